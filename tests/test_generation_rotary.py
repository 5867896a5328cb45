"""Rotary tables in the decode step (fastgrpo/integrations/generation/rotary.py): the same bits as each rotary module
computes, PhiMoE (frequencies built on the CPU in every call) decoding on the engine, and the length-dependent RoPE
types (longrope, dynamic) on the engine within their pretraining length and on model.generate, with the reason,
past it."""
import warnings

import pytest
import torch

from fastgrpo.compiler.tiny import tiny_model
from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from fastgrpo.integrations.generation.rotary import RotaryTables, rotary_modules
from tests.test_generation import PAD, VOCAB, assert_engine_greedy, hf_greedy, prompts

HEAD_DIM = 32


def longrope(original: int) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 2)]}


def dynamic(factor: float) -> dict:
    return {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor}


@pytest.mark.parametrize("arch, extra", [("llama", ()), ("gemma3", ("sliding_attention",)),
                                         ("gemma3", ("full_attention",)), ("phimoe", ()), ("phi3", ())])
def test_a_table_row_is_what_the_module_computes_for_that_position(arch, extra):
    overrides = {"layer_types": ["sliding_attention", "full_attention"]} if arch == "gemma3" else {}
    if arch == "phi3":
        overrides["rope_parameters"] = longrope(64)
    model = tiny_model(arch, vocab_size=VOCAB, max_position_embeddings=128, **overrides).eval()
    module = rotary_modules(model)[0]
    x = torch.randn(3, 1, 64, dtype=torch.bfloat16)
    positions = torch.tensor([[0], [17], [39]])
    want = module(x, positions, *extra)
    tables = RotaryTables(40)
    with tables.installed(model, torch.nn.ModuleList()):
        got = module(x, positions, *extra)
        assert tables.tables  # answered from a table
    assert "forward" not in module.__dict__  # the module's own forward is back
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("arch, rope", [("phimoe", None), ("phi3", longrope(64)), ("llama", dynamic(2.0))])
def test_rotary_modules_with_host_work_decode_on_the_engine(arch, rope):
    """Within the pretraining length (64 positions here) the engine's greedy tokens are model.generate's."""
    overrides = {"rope_parameters": rope} if rope else {}
    model = tiny_model(arch, vocab_size=VOCAB, initializer_range=0.5, max_position_embeddings=64, **overrides).eval()
    assert_engine_greedy(model, prompts(), compile=True, compile_backend="eager", pad_to_multiple_of=8)


@pytest.mark.parametrize("rope", [longrope(16), dynamic(2.0)])
def test_length_dependent_rope_past_its_pretraining_length_goes_to_generate_with_the_reason(rope):
    max_positions = 16 if rope["rope_type"] == "dynamic" else 64  # dynamic: its pretraining length
    extra = {"original_max_position_embeddings": 16} if rope["rope_type"] == "longrope" else {}  # Phi-3's own field
    model = tiny_model("phi3" if rope["rope_type"] == "longrope" else "llama", vocab_size=VOCAB,
                       initializer_range=0.5, max_position_embeddings=max_positions, rope_parameters=rope,
                       **extra).eval()
    expected = hf_greedy(model, prompts(), 10, eos=VOCAB + 1)  # rows of up to 21 positions: past 16
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert generator.generate(prompts(), temperature=0) == expected
    notes = [str(w.message) for w in caught if issubclass(w.category, GenerationFallbackWarning)]
    assert len(notes) == 1 and rope["rope_type"] in notes[0] and "16 positions" in notes[0], notes


@pytest.mark.gpu
@pytest.mark.parametrize("arch, rope", [("phimoe", None), ("phi3", longrope(64)), ("llama", dynamic(2.0))])
def test_rotary_tables_in_captured_decode_steps(arch, rope):
    """On CUDA (inductor, each decode step a CUDA graph): model.generate's greedy tokens, also on a replay."""
    torch._dynamo.reset()
    overrides = {"rope_parameters": rope} if rope else {}
    model = tiny_model(arch, vocab_size=VOCAB, initializer_range=0.5, max_position_embeddings=64,
                       **overrides).eval().cuda()
    assert_engine_greedy(model, [p for p in prompts() for _ in range(2)])
