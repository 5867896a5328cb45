"""Mixture-of-experts layers in the rollout engine (experts.py): experts whose implementation would read the host in a
captured step decode batched, and PEFT LoRA on the fused experts (`ParamWrapper`) merges into them in place for the
call, restored to the exact bits."""
import warnings

import peft
import pytest
import torch

from bench.coverage import hf_greedy, tiny_causal_lm
from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from fastgrpo.integrations.generation.adapters import MergedAdapters
from fastgrpo.integrations.generation.experts import expert_lora_chain, is_expert_lora


def peaked(model):
    """Weights scaled up: peaked logits, so greedy tokens vary and ties are unlikely."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model.eval()


def batch_of(vocab, lengths=(5, 9, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def strict_generate(generator, prompts, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        return generator.generate(prompts, temperature=0, **kwargs)


def test_experts_that_would_read_the_host_in_a_captured_step_decode_batched():
    """A non-bf16 experts module (Qwen3-Next's) would take transformers' grouped_mm fallback inside the compiled step,
    which reads its offsets on the host (no CUDA graph can capture that): for the engine's call it decodes with
    "batched_mm" (the same tokens), and its config is restored afterwards; bf16 experts keep grouped_mm."""
    from fastgrpo.integrations.generation.experts import capturable_experts, uncapturable_experts

    model = peaked(tiny_causal_lm("qwen3_next"))
    experts = uncapturable_experts(model)
    assert experts and all(m.config._experts_implementation == "grouped_mm" for m in experts)
    vocab = model.config.vocab_size
    prompts = batch_of(vocab, lengths=(5, 9, 3))
    expected = hf_greedy(model, prompts, 6, pad=0, eos=vocab + 5)
    with capturable_experts(model, active=True):
        assert {m.config._experts_implementation for m in experts} == {"batched_mm"}
        assert hf_greedy(model, prompts, 6, pad=0, eos=vocab + 5) == expected
    assert {m.config._experts_implementation for m in experts} == {"grouped_mm"}
    with capturable_experts(model, active=False):
        assert {m.config._experts_implementation for m in experts} == {"grouped_mm"}
    assert not uncapturable_experts(model.to(torch.bfloat16))


def moe_with_expert_lora():
    """A tiny Qwen3-MoE with LoRA on q, v and the MLP projections: PEFT puts the latter on the fused experts' gate_up
    and down parameters (two nested `ParamWrapper`s a layer)."""
    torch.manual_seed(0)
    model = peaked(tiny_causal_lm("qwen3_moe"))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                 "down_proj"], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on patterns the fused experts do not match
        return peft.get_peft_model(model, config).eval()


def test_lora_on_fused_experts_merges_in_place_and_restores_the_exact_bits():
    model = moe_with_expert_lora()
    wrappers = [m for m in model.modules() if is_expert_lora(m)]
    assert len(wrappers) == 4 and {m.parameter_name for m in wrappers} == {"gate_up_proj", "down_proj"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    vocab = model.config.vocab_size
    prompts = batch_of(vocab)
    expected = hf_greedy(model, prompts, 8, pad=0, eos=vocab + 5)
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=8, compile=True, compile_backend="eager",
                                  min_batch=1)
    assert strict_generate(generator, prompts) == expected
    merged = generator.engine._merged
    assert merged.not_merged == {} and merged.merged_layers == 8  # q and v of 2 layers, and the 4 expert wrappers
    assert strict_generate(generator, prompts) == expected  # again: merged again from the restored experts
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert [m for m in model.modules() if is_expert_lora(m)] == wrappers  # the wrappers are back in the model


def test_a_merge_of_the_experts_that_left_their_delta_out_would_decode_the_base(monkeypatch):
    """The check above can fail: with the experts' delta dropped, the engine's logits are the base model's (its
    first-call check against the model's forward then refuses it)."""
    model = moe_with_expert_lora()
    vocab = model.config.vocab_size
    prompts = batch_of(vocab)
    delta = MergedAdapters._delta
    monkeypatch.setattr(MergedAdapters, "_delta", staticmethod(
        lambda layer: delta(layer) * (0 if is_expert_lora(layer) else 1)))
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=8, compile=False, min_batch=1)
    with pytest.raises(GenerationFallbackWarning, match="EngineMismatch|differ"):
        strict_generate(generator, prompts)


def test_trained_experts_are_left_to_peft_with_the_reason():
    model = moe_with_expert_lora()
    chain, experts = expert_lora_chain(next(m for m in model.modules() if is_expert_lora(m)))
    experts.gate_up_proj.requires_grad_(True)
    vocab = model.config.vocab_size
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=4, compile=False, min_batch=1)
    with pytest.warns(GenerationFallbackWarning, match="trained, shared or strided"):
        generator.generate(batch_of(vocab), temperature=0)
