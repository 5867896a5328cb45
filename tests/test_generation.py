"""EmbeddedGenerator: same greedy tokens as model.generate, sampling filters, EOS handling, no weight copy."""
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.integrations.generation import EmbeddedGenerator, sample_next_token

VOCAB, PAD, EOS = 256, 0, 2
PROMPT_LENGTHS = (5, 11, 3, 8)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_lm(arch, seed=0):
    """A random-init LM whose logits are peaked (large init), so greedy tokens vary and ties are unlikely."""
    torch.manual_seed(seed)
    config = CONFIGS[arch](
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=0.5, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def with_lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt_ids, max_new_tokens, eos=EOS):
    """model.generate on the left-padded batch, completions cut after the first EOS like TRL does."""
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), PAD)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=PAD,
    )[:, width:].tolist()  # fmt: skip
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("adapter", [False, True], ids=["base", "lora"])
def test_greedy_matches_model_generate(arch, adapter):
    model = tiny_lm(arch)
    if adapter:
        model = with_lora(model)
    batch = prompts()
    expected = hf_greedy(model, batch, max_new_tokens=24, eos=VOCAB + 1)  # no EOS: compare all 24 tokens
    got = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=24).generate(batch, temperature=0)
    assert got == expected
    assert len({tuple(row) for row in got}) == len(got), "degenerate test model: rows coincide"


def test_adapter_changes_tokens_and_disable_adapter_is_respected():
    model = with_lora(tiny_lm("llama"))
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12)
    with_adapter = generator.generate(prompts(), temperature=0)
    with model.disable_adapter():
        without = generator.generate(prompts(), temperature=0)
        assert without == hf_greedy(model, prompts(), 12, eos=VOCAB + 1)
    assert with_adapter != without


def test_top_k_one_sampling_is_greedy():
    model = tiny_lm("qwen2")
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=16)
    greedy = generator.generate(prompts(), temperature=0)
    assert generator.generate(prompts(), temperature=0.7, top_k=1) == greedy
    assert generator.generate(prompts(), temperature=1.0, min_p=1.0) == greedy  # only the top token survives min_p=1
    sampled = generator.generate(prompts(), temperature=1.0)
    assert sampled != greedy


def test_eos_truncation_and_early_stop():
    model = tiny_lm("llama")
    batch = prompts()
    free_run = hf_greedy(model, batch, 20, eos=VOCAB + 1)
    eos = free_run[0][4]  # row 0 emits this token 5th: make it the EOS
    expected = hf_greedy(model, batch, 20, eos=eos)
    assert expected[0] == free_run[0][:5]

    calls = []
    hook = model.model.register_forward_hook(lambda *args: calls.append(1))
    got = EmbeddedGenerator(model, PAD, [eos, VOCAB + 1], max_new_tokens=20).generate(batch, temperature=0)
    hook.remove()
    assert got == expected
    for row in got:
        assert eos not in row[:-1]
        assert row[-1] == eos or len(row) == 20
    # One prefill, then one decode step per token after the first, stopping once every row has finished.
    assert len(calls) == max(map(len, got))


def test_num_generations_repeats_each_prompt_adjacently():
    model = tiny_lm("qwen2")
    generator = EmbeddedGenerator(model, PAD, EOS, max_new_tokens=6)
    batch = prompts()[:2]
    out = generator.generate(batch, temperature=0, num_generations=3)
    single = generator.generate(batch, temperature=0)
    assert out == [single[0]] * 3 + [single[1]] * 3


def test_generates_from_the_live_weights_without_copying_them():
    model = with_lora(tiny_lm("llama"))
    model.train()
    params = dict(model.named_parameters())
    before = {name: (p.data_ptr(), p.requires_grad) for name, p in params.items()}
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10)
    first = generator.generate(prompts(), temperature=0)

    assert {name: (p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()} == before
    assert model.training, "training mode must be restored"
    # The generator holds the model and its KV cache, nothing weight-sized of its own.
    own = [v for v in vars(generator).values() if isinstance(v, torch.Tensor)]
    assert own == []
    cache = generator._cache
    kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    heads, head_dim, layers = 1, 32, 2
    assert kv_bytes == 2 * layers * len(PROMPT_LENGTHS) * heads * cache.get_max_length() * head_dim * 4

    # An in-place optimizer-style update is seen by the next call: there is no stale copy.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    second = generator.generate(prompts(), temperature=0)
    model.eval()
    assert second != first
    assert second == hf_greedy(model, prompts(), 10, eos=VOCAB + 1)


def test_gradient_checkpointing_and_use_cache_off_are_handled():
    model = tiny_lm("qwen2")
    expected = hf_greedy(model, prompts(), 12, eos=VOCAB + 1)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    got = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12).generate(prompts(), temperature=0)
    assert got == expected
    assert model.training and model.is_gradient_checkpointing
    # Training still works afterwards: no inference tensors leaked into the model.
    ids = torch.tensor([prompts()[1]])
    model(input_ids=ids, labels=ids).loss.backward()


def test_cache_is_reused_and_grown_only_when_needed():
    model = tiny_lm("llama")
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    generator.generate(prompts(), temperature=0)
    cache = generator._cache
    shorter = [p[:2] for p in prompts()]
    assert generator.generate(shorter, temperature=0) == hf_greedy(model, shorter, 8, eos=VOCAB + 1)
    assert generator._cache is cache
    longer = [p * 3 for p in prompts()]
    assert generator.generate(longer, temperature=0) == hf_greedy(model, longer, 8, eos=VOCAB + 1)
    assert generator._cache is not cache and generator._cache.get_max_length() == 3 * max(PROMPT_LENGTHS) + 8


def test_a_callers_autocast_is_turned_off():
    """Under autocast RoPE upcasts keys but not values; generation runs in the weights' dtype instead."""
    model = tiny_lm("llama")
    expected = hf_greedy(model, prompts(), 8, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert generator.generate(prompts(), temperature=0) == expected
    assert generator._cache.layers[0].keys.dtype == torch.float32


def test_compiled_decode_step_traces_as_one_graph():
    """The decode step (HF forward with LoRA + StaticCache + sampling) compiles with fullgraph=True, also with the
    embedding hook that training under gradient checkpointing installs.

    The eager backend keeps the test fast: it checks Dynamo's tracing (no graph break) and the
    results, not inductor's code generation.
    """
    torch._dynamo.reset()
    model = with_lora(tiny_lm("qwen2"))
    # What TRL/PEFT add for gradient checkpointing: a hook calling requires_grad_ (untraceable) on the embeddings.
    model.enable_input_require_grads()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10, compile=True, compile_backend="eager")
    batch = prompts()
    assert generator.generate(batch, temperature=0) == hf_greedy(model, batch, 10, eos=VOCAB + 1)
    assert generator.generate(batch, temperature=0.8, top_k=1) == hf_greedy(model, batch, 10, eos=VOCAB + 1)


def test_sampling_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0]]).repeat(4000, 1)
    assert sample_next_token(logits, temperature=0).unique().tolist() == [0]
    assert set(sample_next_token(logits, top_k=2).unique().tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps the first two
    assert set(sample_next_token(logits, top_p=0.8).unique().tolist()) == {0, 1}
    assert set(sample_next_token(logits, min_p=0.1).unique().tolist()) == {0, 1, 2}  # p >= 0.066
    frequencies = torch.bincount(sample_next_token(logits), minlength=5).float() / len(logits)
    assert torch.allclose(frequencies, probs, atol=0.03)
    low_temperature = sample_next_token(logits, temperature=0.1)
    assert (low_temperature == 0).float().mean() > 0.99


@pytest.mark.gpu
def test_cuda_graph_decode_matches_model_generate():
    model = with_lora(tiny_lm("qwen2")).cuda()
    batch = prompts()
    expected = hf_greedy(model, batch, 24, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=24)  # CUDA: compiled, CUDA graphs
    assert generator.generate(batch, temperature=0) == expected
    assert generator.generate(batch, temperature=0) == expected  # graph replay
    assert generator.generate(batch, temperature=1.0, top_k=1) == expected
