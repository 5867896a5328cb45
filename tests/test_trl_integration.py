"""fastgrpo's TRL GRPOTrainer against stock TRL, on a tiny random-init Qwen2 (CPU; two `gpu` tests on CUDA).

One pytest process: importing TRL's GRPO trainer costs ~15 s (it imports vLLM), so everything here shares it.
On CPU the decoder is compiled with the fastgrpo backend handing off to aot_eager (inductor's cold compile is
~25 s); the GPU tests use the backend's defaults.
"""
import gc
import json
import math
import re
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback
from trl.trainer.grpo_config import GRPOConfig as StockGRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer as StockGRPOTrainer

import fastgrpo.integrations.trl as F
from fastgrpo.integrations.precision import resolve_precision
from fastgrpo.integrations.trl import sizing
from tests.tiny_models import tiny_tokenizer

VOCAB = 1024
COMPILE_OPTIONS = {"inner": "aot_eager"}
PROMPTS = ["hello world", "count to ten"]
GROUP = 4  # num_generations
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def low_id_fraction(completion_ids, **kwargs):
    """A reward that varies within every group: the fraction of completion tokens in the lower half of the vocabulary."""
    return [sum(t < VOCAB // 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(PROMPTS + ["the quick brown fox jumps", "a b c d e f g"], VOCAB)


def tiny_model(tokenizer, seed=0, initializer_range=0.02):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def common_args(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=len(PROMPTS) * GROUP, num_generations=GROUP,
        max_completion_length=6, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
    )
    args.update(overrides)
    return args


def set_params(model, seed, scale, only_lora):
    """Deterministic parameter values, the same for two models of the same structure."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if only_lora and "lora_" not in name:
                continue
            noise = (torch.randn(param.shape, generator=generator) * scale).to(param.device)
            param.copy_(noise if only_lora else param + noise)


# Fixed completions of varying lengths; some end with EOS, some are cut at max_completion_length.
def fixed_completions(eos):
    base = [[5, 700, 12], [900, 901, eos], [40, 41, 42, 43, 44, 45], [600, eos], [3, 4, 5, 6, 7, 8], [800, 20, 30, eos],
            [1000], [50, 600, 51, 601, eos]]
    return base


def make_inputs(trainer, eos):
    """Run TRL's `_generate_and_score_completions` with generation replaced by fixed completion ids."""
    completions = fixed_completions(eos)
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: ([list(c) for c in completions], None)
    rows = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
    trainer.model.train()
    return trainer._generate_and_score_completions(rows)


def loss_and_grads(trainer, inputs, named):
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in named(trainer.model) if p.requires_grad}


def lora_params(model):
    return sorted((n, p) for n, p in model.named_parameters() if "lora_" in n)


def compiled_graphs(run) -> int:
    torch._dynamo.utils.counters.clear()
    run()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def tiny_moe(tokenizer, seed=0):
    """A tiny Qwen3-MoE: 4 experts, 2 a token, and a load-balancing coefficient large enough to move the loss."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=128, tie_word_embeddings=True, router_aux_loss_coef=0.5,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3MoeForCausalLM(config)


def build_pair(tokenizer, tmp, compile_options, model=tiny_model, **device_args):
    """A stock TRL trainer and a fastgrpo trainer over the same tiny LoRA model; loss_type and beta are set per check."""
    # num_iterations=2 makes TRL compute the old policy's log-probs (steps are not aligned with generation).
    shared = dict(num_iterations=2, beta=0.04, gradient_checkpointing=True, **device_args)
    stock = StockGRPOTrainer(
        model=model(tokenizer), reward_funcs=low_id_fraction, args=StockGRPOConfig(**common_args(tmp, bf16=False, **shared)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer, peft_config=LoraConfig(**LORA),
    )
    ours = F.GRPOTrainer(
        model=model(tokenizer), reward_funcs=low_id_fraction,
        # Uneven mini-batches (3+3+2 rows) and token chunks: the results must not depend on the split.
        args=F.GRPOConfig(**common_args(
            tmp, fastgrpo_compile_options=compile_options, fastgrpo_mini_batch=3, fastgrpo_logprob_chunk=5,
            bf16=False, **shared,
        )),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer, peft_config=LoraConfig(**LORA),
    )
    for trainer in (stock, ours):
        # Trainer turns checkpointing on in train(); do it here so the compiled decoder sees it.
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return stock, ours


def apply_settings(trainer, settings: dict) -> None:
    """TRL's loss options on a built trainer: its attribute where `_compute_loss` reads one, else its args."""
    for key, value in settings.items():
        setattr(trainer if hasattr(trainer, key) and key != "delta" else trainer.args, key, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy


def check_matches_stock(pair, tokenizer, loss_type, beta, rtol, settings=None):
    """Old-policy and reference log-probs, entropy, loss and every LoRA gradient equal stock TRL's."""
    results = []
    defaults = dict(importance_sampling_level="token", top_entropy_quantile=1.0, entropy_coef=0.0, delta=None,
                    off_policy_mask_threshold=None, epsilon_low=0.2, epsilon_high=0.2)
    for trainer in pair:
        trainer.loss_type, trainer.beta = loss_type, beta
        apply_settings(trainer, {**defaults, **(settings or {})})
        set_params(trainer.model, seed=1, scale=0.3, only_lora=True)  # the policy that sampled: adapters on
        inputs = make_inputs(trainer, tokenizer.eos_token_id)
        set_params(trainer.model, seed=2, scale=0.3, only_lora=True)  # the policy being updated: ratios far from 1
        loss, grads = loss_and_grads(trainer, inputs, lora_params)
        results.append((inputs, loss, grads, dict(trainer._metrics["train"])))
        trainer._metrics["train"].clear()
    (stock_inputs, stock_loss, stock_grads, stock_metrics), (inputs, loss, grads, metrics) = results

    mask = inputs["completion_mask"].bool()
    close = dict(rtol=rtol, atol=rtol * 1e-2)
    torch.testing.assert_close(inputs["old_per_token_logps"][mask], stock_inputs["old_per_token_logps"][mask], **close)
    if beta:
        ref, stock_ref = inputs["ref_per_token_logps"], stock_inputs["ref_per_token_logps"]
        torch.testing.assert_close(ref[mask], stock_ref[mask], **close)
        # The reference is the base model (adapters disabled), not the policy.
        assert (ref - inputs["old_per_token_logps"])[mask].abs().max() > 1e-2
    # The case must exercise clipping, or the clipped branch of the loss would go unchecked.
    clipped = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}.get(loss_type, "clip_ratio/region_mean")
    assert clipped is None or stock_metrics[clipped][0] > 0
    torch.testing.assert_close(metrics["entropy"], stock_metrics["entropy"], **close)
    # The loss is a mean of per-token terms of size ~1 (advantage x ratio) that can cancel to ~1e-4 (the off-policy
    # mask drops most of them): its error is judged against the terms' size, not the mean's.
    torch.testing.assert_close(loss, stock_loss, rtol=rtol, atol=rtol)
    assert grads.keys() == stock_grads.keys() and len(grads) >= 2 * 4 * 2  # 2 layers, q/k/v/o at least, A and B
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        # Absolute slack relative to the gradient's scale: packed rows (the default) sum attention in another order
        # than TRL's padded batch, which moves near-zero elements by ~1e-7 (CPU, fp32).
        torch.testing.assert_close(grad, stock_grads[name], rtol=10 * rtol, atol=rtol * stock_grads[name].abs().max(),
                                   msg=name)


@pytest.fixture(scope="module")
def peft_pair(tokenizer, tmp_path_factory):
    """`build_pair` on CPU, plus how many graphs Dynamo compiled for fastgrpo's decoder in a first rollout without a
    reference (the policy's no-grad pass), then with one (adapters disabled), then in three more rollouts."""
    stock, ours = build_pair(tokenizer, tmp_path_factory.mktemp("peft_pair"), COMPILE_OPTIONS, use_cpu=True)

    def rollout(beta):
        ours.beta = beta
        return lambda: make_inputs(ours, tokenizer.eos_token_id)

    graphs = {
        "policy": compiled_graphs(rollout(0.0)),
        "adapters_disabled": compiled_graphs(rollout(0.04)),
        "again": compiled_graphs(lambda: [rollout(beta)() for beta in (0.0, 0.04, 0.04)]),
    }
    return (stock, ours), graphs


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_loss_and_lora_grads_match_stock_trl(peft_pair, tokenizer, loss_type, beta):
    check_matches_stock(peft_pair[0], tokenizer, loss_type, beta, rtol=1e-5)


@pytest.mark.parametrize("loss_type, settings", [
    ("cispo", {}),
    ("sapo", {}),
    ("vespo", {}),
    # Sequence-level ratios are means over a row: a narrow clip range makes them clip too.
    ("luspo", {"importance_sampling_level": "sequence", "epsilon_low": 0.02, "epsilon_high": 0.02}),
    ("grpo", {"importance_sampling_level": "sequence", "epsilon_low": 0.02, "epsilon_high": 0.02}),  # GSPO
    ("dapo", {"delta": 1.2, "epsilon_high": 0.28}),  # two-sided clipping, DAPO's clip-higher
    ("grpo", {"top_entropy_quantile": 0.5}),  # the loss on the high-entropy half of the tokens only
    ("dapo", {"entropy_coef": 0.05}),  # the entropy bonus: its gradient flows through the op's entropy
    ("grpo", {"off_policy_mask_threshold": 0.05}),
], ids=["cispo", "sapo", "vespo", "luspo-sequence", "gspo", "dapo-delta-clip-higher", "top-entropy",
        "entropy-bonus", "off-policy-mask"])
def test_other_loss_types_and_options_match_stock_trl(peft_pair, tokenizer, loss_type, settings):
    check_matches_stock(peft_pair[0], tokenizer, loss_type, 0.04, rtol=1e-5, settings=settings)


@pytest.mark.parametrize("experts_lora", [False, True], ids=["attention-lora", "experts-lora"])
def test_moe_load_balancing_loss_matches_stock_trl(tokenizer, tmp_path, monkeypatch, experts_lora):
    """An MoE model with TRL's default router loss (the config's coefficient, here 0.5): the loss with its aux_loss
    term and every LoRA gradient equal stock TRL's. LoRA on the fused experts (PEFT's ParamWrapper) runs the decoder
    uncompiled, with a warning naming why."""
    if not experts_lora:
        monkeypatch.setitem(LORA, "target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair = build_pair(tokenizer, tmp_path, COMPILE_OPTIONS, model=tiny_moe, use_cpu=True)
        assert all(trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5 for trainer in pair)
        check_matches_stock(pair, tokenizer, "grpo", 0.04, rtol=1e-5)
    uncompiled = [w for w in caught if "runs uncompiled" in str(w.message)]
    assert bool(uncompiled) == experts_lora
    stock, ours = pair
    assert ours._fastgrpo_heads[0].backbone._compiled is not None


@pytest.mark.gpu
def test_gpu_fp32_matches_stock_trl(tokenizer, tmp_path):
    # fastgrpo's default backend options (inductor) and its Triton op against TRL's CUDA fused head, in fp32.
    pair = build_pair(tokenizer, tmp_path, None, use_cpu=False)
    for loss_type, beta in [("dapo", 0.04), ("grpo", 0.0), ("bnpo", 0.04)]:
        check_matches_stock(pair, tokenizer, loss_type, beta, rtol=1e-4)


def test_adapters_disabled_reference_recompiles_at_most_once(peft_pair):
    # One graph for the policy; switching the LoRA adapters off for the reference compiles exactly one more (their
    # `_disable_adapters` flag is guarded); after that, rollouts of any kind reuse them. This also checks that
    # TRL's checkpointing toggles no longer add embedding hooks (each new hook would recompile the decoder).
    assert peft_pair[1] == {"policy": 1, "adapters_disabled": 1, "again": 0}


def test_full_finetune_reference_copy_matches_stock_trl(tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    shared = dict(num_iterations=2, beta=0.04, loss_type="dapo", gradient_checkpointing=False)
    # The decoder runs uncompiled here (fastgrpo_compile=False): compiling is covered by the LoRA tests, and this
    # one is about the head on the separately loaded reference model.
    stock = StockGRPOTrainer(
        model=str(model_dir), reward_funcs=low_id_fraction, args=StockGRPOConfig(**common_args(tmp_path, bf16=False, **shared)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )
    ours = F.GRPOTrainer(
        model=str(model_dir), reward_funcs=low_id_fraction,
        args=F.GRPOConfig(**common_args(tmp_path, fastgrpo_compile=False, **shared)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )
    results = []
    for trainer in (stock, ours):
        assert trainer.ref_model is not None
        set_params(trainer.model, seed=3, scale=0.05, only_lora=False)
        inputs = make_inputs(trainer, tokenizer.eos_token_id)
        results.append((inputs, *loss_and_grads(trainer, inputs, lambda m: sorted(m.named_parameters()))))
    (stock_inputs, stock_loss, stock_grads), (inputs, loss, grads) = results
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(inputs["ref_per_token_logps"][mask], stock_inputs["ref_per_token_logps"][mask])
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def train_on_learnable_reward(tokenizer, tmp_path, seed=0, **config):
    """Train a LoRA on a reward the tiny model can learn; return the trainer and its mean reward per step.

    The reward is the fraction of completion tokens equal to a target token per prompt (the one the model already
    likes most after that prompt). Large initial weights (initializer_range=0.3) make the random model's
    distributions peaked enough that the targets are sampled from the first step.

    The settings are chosen to learn smoothly rather than fast, so the outcome does not hang on rounding: with
    AdamW at learning_rate 0.1 and 4 completions per prompt the run was chaotic (bf16 vs fp32, or another compiled
    graph layout, flipped Adam's sign-like first updates, and some runs collapsed onto another token, reward 0).
    A smaller constant learning rate, 16 completions per prompt (fewer groups whose rewards are all equal, which carry
    no signal) and 16 steps rose for every seed tried, in fp32 and bf16 autocast (seeds 0-11 with aot_eager and the
    test's mini-batch and chunk, 0-5 with the default inductor and sizes).
    """
    model = tiny_model(tokenizer, seed=seed, initializer_range=0.3)
    with torch.no_grad():
        prompts = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
        targets = dict(zip(PROMPTS, model(**prompts).logits[:, -1].argmax(-1).tolist()))

    def target_fraction(prompts, completion_ids, **kwargs):
        return [sum(t == targets[p] for t in ids) / max(len(ids), 1) for p, ids in zip(prompts, completion_ids)]

    steps, group = 16, 16
    args = F.GRPOConfig(**common_args(
        tmp_path, max_steps=steps, learning_rate=3e-2, lr_scheduler_type="constant", num_generations=group,
        per_device_train_batch_size=len(PROMPTS) * group, max_completion_length=8, seed=seed, **config,
    ))
    trainer = F.GRPOTrainer(
        model=model, reward_funcs=target_fraction, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * steps}),
        processing_class=tokenizer, peft_config=LoraConfig(**LORA),
    )
    torch._dynamo.utils.counters.clear()
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == steps and all(math.isfinite(log["loss"]) for log in logs)
    if args.fastgrpo_mini_batch == "auto":  # the rows of a forward, logged every step: one size for the whole run
        sizes = {log["fastgrpo/mini_batch_update"] for log in logs}
        assert len(sizes) == 1, sizes
        if args.use_cpu:
            assert sizes == {sizing.equal_parts(args.per_device_train_batch_size, sizing.CPU_MINI_BATCH)}
    assert trainer._embedded_generator is not None  # completions came from fastgrpo's generator
    assert trainer._embedded_generator.fallback is None
    assert not torch._dynamo.utils.counters["graph_break"]  # the decoder compiled as one graph
    # The generator's log-probs agree with the loss forward's: in fp32 every importance ratio is within [0.9, 1.1].
    # Under bf16 autocast the sampler decodes the fp32 weights in fp32 and the trainer scores them with bf16 matmuls:
    # on this deliberately peaked model that rounding moved 0-5.1 % of a step's tokens outside (CPU), and on the H200
    # up to 4.7 % a step until the policy collapsed onto its targets; after that (entropy < 0.01, KL to the reference
    # 676-1012 in those steps) two steps of 16 had 37.5 % outside, the rest 0. So the bound under autocast is on the
    # first four steps (<= 10 %) and the median step (<= 2 %); a sampler reading other weights or positions moves
    # most tokens of every step.
    agreement = [log["sampling/ratio_outside_0.9_1.1"] for log in logs]
    if trainer.args.bf16 or trainer.args.fp16:
        assert max(agreement[:4]) <= 0.1 and sorted(agreement)[len(agreement) // 2] <= 0.02, agreement
    else:
        assert max(agreement) == 0.0, agreement
    return trainer, [log["reward"] for log in logs]


def assert_reward_rose(rewards):
    # The rewards start below 0.15; across the seeds and precisions tried, the last three steps averaged at least
    # 0.32 more than the first three (most runs ended near 1.0). A run that does not learn, or collapses onto
    # another token, stays near (or drops below) its start and fails.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


def test_reward_rises_on_a_learnable_reward(tokenizer, tmp_path):
    _, rewards = train_on_learnable_reward(
        tokenizer, tmp_path, fastgrpo_compile_options=COMPILE_OPTIONS, fastgrpo_mini_batch=3, fastgrpo_logprob_chunk=5,
    )
    assert_reward_rose(rewards)


def test_a_hybrid_linear_attention_decoder_trains_with_engine_rollouts(tokenizer, tmp_path):
    """Qwen3.5's layout (gated DeltaNet layers beside attention layers), tiny: GRPO steps run end to end; the engine
    samples the rollouts (their log-probs reach the agreement metric: no model.generate fallback); the loss forwards
    run padded, the reason said. (The backend hands off to eager here: torch 2.13's aot_eager backward fails on the
    gated DeltaNet for any compile, fastgrpo's or not; inductor, the default, trains it.)"""
    import transformers

    from bench.coverage import tiny_causal_lm

    transformers.logging.set_verbosity_error()
    model = tiny_causal_lm("qwen3_5_text")
    model.resize_token_embeddings(VOCAB)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    args = F.GRPOConfig(**common_args(tmp_path, max_steps=2, bf16=False, fastgrpo_compile_options={"inner": "eager"}))
    trainer = F.GRPOTrainer(model=model, reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
                            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv"]))
    with pytest.warns(UserWarning, match="runs padded, not packed.*linear_attention"):
        trainer.train()
    assert trainer._embedded_generator.fallback is None
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["loss"]) for entry in logged)
    assert all("sampling/ratio_outside_0.9_1.1" in entry for entry in logged)


def test_bf16_autocast_training_on_cpu(tokenizer, tmp_path):
    # The GPU's precision on the CPU: fp32 weights, bf16 autocast, the rollouts decoded by the engine in fp32.
    trainer, rewards = train_on_learnable_reward(tokenizer, tmp_path, bf16=True,
                                                 fastgrpo_compile_options=COMPILE_OPTIONS)
    assert trainer.args.bf16 and trainer.model.dtype == torch.float32
    assert_reward_rose(rewards)


@pytest.mark.gpu
def test_gpu_training_with_automatic_precision_and_sizes(tokenizer, tmp_path):
    # Everything but the learning problem left to fastgrpo's defaults: bf16 autocast on this GPU, "auto" mini-batch
    # and log-prob chunk (from the device's free memory and the allocator's cache), the backend's default inner compiler (inductor), packed rows.
    trainer, rewards = train_on_learnable_reward(tokenizer, tmp_path, use_cpu=False)
    assert trainer.args.bf16 and not trainer.args.fp16
    assert_reward_rose(rewards)


@pytest.mark.parametrize("graph_break", [False, True])
def test_first_step_says_what_was_fused_and_warns_about_the_rest(tokenizer, tmp_path, capsys, graph_break):
    import re
    import warnings

    import fastgrpo

    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()  # Dynamo does not guard on hooks: a graph cached by another test would skip the break
    torch._dynamo.utils.counters.clear()
    model = tiny_model(tokenizer)
    if graph_break:  # code the decoder runs that Dynamo cannot trace: the layer around it runs uncompiled
        model.model.layers[1].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    args = F.GRPOConfig(**common_args(tmp_path, max_steps=2, fastgrpo_compile_options=COMPILE_OPTIONS))
    trainer = F.GRPOTrainer(model=model, reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), peft_config=LoraConfig(**LORA))
    frozen_at_step_begin = []
    trainer.add_callback(type("FreezeProbe", (TrainerCallback,), {
        "on_step_begin": lambda self, *args, **kwargs: frozen_at_step_begin.append(gc.get_freeze_count())}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    # The heap is frozen after the first step (fastgrpo_freeze_gc) and unfrozen when training ends.
    assert frozen_at_step_begin[0] == 0 and frozen_at_step_begin[1] > 0, frozen_at_step_begin
    assert gc.get_freeze_count() == 0
    out = capsys.readouterr().out.splitlines()
    # Once each, after the first step: what compiling cost (the decoder layer's graphs), and what was fused.
    compiling = [line for line in out if line.startswith("fastgrpo: ") and " s compiling: " in line]
    assert len(compiling) == 1 and "(forward (modeling_qwen2.py:" in compiling[0], compiling
    printed = [line for line in out if line.startswith("fastgrpo: ") and line not in compiling]
    assert len(printed) == 1, printed
    problems = [str(w.message) for w in caught if str(w.message).startswith("fastgrpo: not accelerated")]
    if graph_break:
        assert len(problems) == 1 and "graph break" in problems[0], problems
        return
    assert not problems, problems
    graphs = int(re.search(r"(\d+) graph\(s\) compiled", printed[0]).group(1))
    fused = dict((name, int(n)) for name, n in re.findall(r"(\w+) (\d+)", printed[0].split("sites fused: ")[1]))
    # Every compiled decoder-layer graph (policy; adapters-disabled reference): 2 norms, rope, MLP.
    assert graphs == 2 and fused == {"rope": graphs, "rms_norm": 2 * graphs, "gated_mlp": graphs}, printed
    assert "2 graph(s) from 2 frame compile(s)" in compiling[0]


def test_defaults_and_precision_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTGRPO_FORCE_FLOAT32", raising=False)
    monkeypatch.delenv("FASTGRPO_MIXED_PRECISION", raising=False)
    config = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, top_k=-1, report_to="none")
    assert config.beta == 0.001 and config.top_k == 0
    assert (config.bf16, config.fp16) == (False, False)  # auto: fp32 on CPU
    assert config.fastgrpo_mini_batch == "auto" and config.fastgrpo_logprob_chunk == "auto"
    assert F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, top_k=None, fastgrpo_mini_batch="4").fastgrpo_mini_batch == 4

    assert F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True).bf16  # config overrides auto
    monkeypatch.setenv("FASTGRPO_MIXED_PRECISION", "bf16")
    config = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (config.bf16, config.fp16) == (True, False)
    with pytest.warns(UserWarning, match="overrides fp32"):
        assert F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).bf16  # environment beats config
    monkeypatch.setenv("FASTGRPO_FORCE_FLOAT32", "1")  # beats FASTGRPO_MIXED_PRECISION and the config
    with pytest.warns(UserWarning, match="overrides bf16"):
        config = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True)
    assert (config.bf16, config.fp16) == (False, False)
    monkeypatch.delenv("FASTGRPO_FORCE_FLOAT32")
    monkeypatch.setenv("FASTGRPO_MIXED_PRECISION", "int8")
    with pytest.raises(ValueError, match="FASTGRPO_MIXED_PRECISION"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    monkeypatch.setenv("FASTGRPO_MIXED_PRECISION", "fp16")
    assert resolve_precision(None, False, use_cpu=True) == "fp16"
    monkeypatch.delenv("FASTGRPO_MIXED_PRECISION")
    assert resolve_precision(None, True, use_cpu=True) == "fp16"
    assert resolve_precision(False, False, use_cpu=False) == "fp32"

    with pytest.raises(ValueError, match="fastgrpo_mini_batch"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fastgrpo_mini_batch=0)
    with pytest.raises(ValueError, match="fastgrpo_generation_merge_lora='yes'; use one of 'float', 'all', 'none'"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fastgrpo_generation_merge_lora="yes")


def test_checkpointed_layers_mlp_form(tmp_path):
    """The trainer hands its device, checkpointing, offloading and packing (its config's defaults resolved) to
    `compiler.options.training_options`, whose table tests/test_options.py checks."""
    from tests.tiny_models import trainer_rule

    act_mul = {"absorb_mlp_projections": False}
    assert trainer_rule("_compile_options", tmp_path, "cuda", fastgrpo_packing=False) == {}
    assert trainer_rule("_compile_options", tmp_path, "cuda", fastgrpo_packing=False,
                        fastgrpo_offload_checkpointing=False) == {"save_mlp_projections": True}
    assert trainer_rule("_compile_options", tmp_path, "cuda") == {}  # packing: "auto", on for CUDA
    assert trainer_rule("_compile_options", tmp_path, "cuda", fastgrpo_offload_checkpointing=False) == act_mul
    assert trainer_rule("_compile_options", tmp_path, "cpu") == act_mul
    mine = {"save_mlp_projections": False, "inner": "aot_eager"}
    assert trainer_rule("_compile_options", tmp_path, "cuda", fastgrpo_compile_options=mine) == mine
    assert trainer_rule("_compile_options", tmp_path, "cpu", fastgrpo_compile_options={"inner": "eager"}) == {
        **act_mul, "inner": "eager"}
    assert trainer_rule("_compile_options", tmp_path, "cuda", gradient_checkpointing=False) is None


@pytest.mark.parametrize("field, value, takes", [("temperature", -1.0, "> 0"), ("temperature", 0.0, "> 0"),
                                                 ("beta", -0.04, ">= 0")])
def test_temperature_or_beta_out_of_range_is_refused(tmp_path, field, value, takes):
    with pytest.raises(ValueError, match=f"{field}={value}; use a number {takes}"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("top_p", 0.0, "top_p=0.0; use a number in (0, 1]"), ("top_k", -5, "top_k=-5; use an integer >= 0"),
    ("min_p", 2.0, "min_p=2.0; use a number in [0, 1]"), ("repetition_penalty", 0.0, "repetition_penalty=0.0; use a"),
    ("num_iterations", 0, "num_iterations=0; use a positive integer"),
    ("fastgrpo_shared_prompt", "no", "fastgrpo_shared_prompt='no'; use True or False"),  # a truthy string
    ("fastgrpo_packing", 2, "fastgrpo_packing=2; use True, False or 'auto'"),
    ("fastgrpo_vllm_max_lora_rank", 0, "fastgrpo_vllm_max_lora_rank=0; use a positive integer"),
    ("fastgrpo_vllm_kwargs", 5, "fastgrpo_vllm_kwargs=5; use a mapping"),
    ("fastgrpo_vllm_kwargs", "{bad", "is not a JSON object"),
])
def test_out_of_range_settings_are_refused_where_they_enter(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


def test_cli_strings_of_settings_become_their_values(tmp_path):
    config = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fastgrpo_shared_prompt="true", fastgrpo_compile="False",
                          fastgrpo_vllm_kwargs='{"enforce_eager": true}', top_k=-1)
    assert config.fastgrpo_shared_prompt is True and config.fastgrpo_compile is False and config.top_k == 0
    assert config.fastgrpo_vllm_kwargs == {"enforce_eager": True}


def test_use_liger_kernel_is_turned_off_with_a_warning(tmp_path):
    # A TRL + Liger config keeps working: Liger's module swaps would hide the sites the backend fuses.
    with pytest.warns(UserWarning, match="use_liger_kernel=True is turned off.*RMSNorm, RoPE"):
        config = F.GRPOConfig(**common_args(tmp_path, use_liger_kernel=True))
    assert config.use_liger_kernel is False


def test_auto_find_batch_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="auto_find_batch_size=False"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, auto_find_batch_size=True)


def test_too_few_prompts_for_one_step_is_refused_with_the_fix(tokenizer, tmp_path):
    # 2 prompts, and a step draws 8 / 2 = 4 distinct ones: TRL's sampler would yield nothing and train 0 steps.
    args = F.GRPOConfig(**common_args(tmp_path, bf16=False, per_device_train_batch_size=8, num_generations=2))
    with pytest.raises(ValueError, match=r"train_dataset has 2 prompt\(s\) and one step draws 4 distinct prompts"):
        F.GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA))


def test_an_out_of_memory_step_notes_the_settings_to_change(tokenizer, tmp_path, monkeypatch):
    trainer = F.GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=low_id_fraction,
                            args=F.GRPOConfig(**common_args(tmp_path, bf16=False)), processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA))

    def out_of_memory(self, model, inputs, num_items_in_batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(StockGRPOTrainer, "training_step", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as raised:
        trainer.training_step(trainer.model, {}, None)
    note = "".join(raised.value.__notes__)
    assert "per_device_train_batch_size=8" in note and "max_completion_length=6" in note
    assert "fastgrpo_mini_batch='auto'" in note and "QLoRA" in note


def test_resuming_a_checkpoint_of_another_lora_is_refused_naming_it(tokenizer, tmp_path):
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": LORA["lora_alpha"], "target_modules": LORA["target_modules"]}))
    trainer = F.GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=low_id_fraction, processing_class=tokenizer,
                            args=F.GRPOConfig(**common_args(tmp_path, bf16=False, fastgrpo_compile=False)),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA))
    with pytest.raises(ValueError, match=r"checkpoint-3 was written with LoRA rank 2 \(this run: 4\); resume with"):
        trainer._load_from_checkpoint(str(checkpoint))


def test_stock_config_is_refused_with_the_fix(tokenizer, tmp_path):
    with pytest.raises(TypeError, match="patch_trl"):
        F.GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=low_id_fraction,
                      args=StockGRPOConfig(**common_args(tmp_path, bf16=False)), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


def test_patch_trl_swaps_the_public_names():
    import trl

    try:
        F.patch_trl()
        F.patch_trl()
        from trl import GRPOConfig, GRPOTrainer
        from trl.trainer import GRPOTrainer as TrainerFromSubpackage

        assert GRPOTrainer is F.GRPOTrainer and GRPOConfig is F.GRPOConfig and TrainerFromSubpackage is F.GRPOTrainer
        assert issubclass(GRPOTrainer, StockGRPOTrainer) and issubclass(GRPOConfig, StockGRPOConfig)
    finally:
        F.unpatch_trl()
    assert trl.GRPOTrainer is StockGRPOTrainer and trl.GRPOConfig is StockGRPOConfig


def test_the_log_prob_head_keeps_the_models_signature_for_generate(tokenizer):
    """transformers' generate passes `logits_to_keep` and `position_ids` only to a forward whose signature names them:
    with the head installed, a prefill still computes the last position's logits alone (not [rows, prompt, vocab])."""
    import inspect

    model = tiny_model(tokenizer).eval()
    head = F.LogprobHead(temperature=1.0, cast_lm_head_to_fp32=False, logprob_chunk=8,
                         backbone=F.CompiledBackbone(False, None))
    head.install(model)
    assert {"logits_to_keep", "position_ids"} <= set(inspect.signature(model.forward).parameters)
    shapes = []
    model.lm_head.register_forward_hook(lambda module, inputs, out: shapes.append(tuple(out.shape)))
    ids = torch.randint(3, VOCAB, (2, 7))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id)
    assert shapes == [(2, 1, VOCAB)] * 3
