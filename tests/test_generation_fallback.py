"""Models the rollout engine cannot run as it is: a recompile storm finishes on uncompiled layers, a model whose
attention bypasses transformers' AttentionInterface or adds the mask itself goes to model.generate, each with one
warning naming the model and the reason and the same tokens. Every causal LM of the installed transformers (the
coverage sweep's list and rollout check) decodes on the engine or falls back so, never with a silent difference, and
the sweep's rollout check sees a decode graph per layer."""
import re
import warnings

import pytest
import torch

from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from fastgrpo.integrations.generation.kv import RolloutCache
from tests.test_generation import PAD, VOCAB, hf_greedy, prompts, tiny_lm


def test_a_recompile_storm_falls_back_to_uncompiled_layers_once(monkeypatch):
    """A value that changes per token reaching the compiled layer's guards (here the cache's token count, an int
    Dynamo specialises on) recompiles every step: the engine stops at its limit, warns once naming the model, and
    finishes uncompiled."""
    torch._dynamo.reset()
    model = tiny_lm("llama")
    batch = prompts()
    expected = hf_greedy(model, batch, 16, eos=VOCAB + 1)

    original = RolloutCache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states, value_states = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        return key_states * (1 + 0 * self.seen_tokens), value_states

    monkeypatch.setattr(RolloutCache, "update", update)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=16, compile=True, compile_backend="eager")
    storm = "LlamaForCausalLM.*(RecompileStorm|FailOnRecompileLimitHit)"
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
            pytest.warns(GenerationFallbackWarning, match=storm) as w:
        assert generator.generate(batch, temperature=0) == expected
    assert len(w) == 1 and generator.fallback == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == expected


def test_a_model_the_engine_cannot_run_falls_back_to_generate_once():
    """GPT-J's attention does not go through transformers' AttentionInterface: one warning naming the model and the
    reason, then model.generate (same tokens), and no further warning."""
    from fastgrpo.compiler.tiny import tiny_model

    model = tiny_model("gptj", vocab_size=VOCAB, initializer_range=0.5, rotary_dim=8).eval()
    batch = prompts()
    expected = hf_greedy(model, batch, 8, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    with pytest.warns(GenerationFallbackWarning, match="GPTJForCausalLM.*AttentionInterface") as w:
        assert generator.generate(batch, temperature=0) == expected
    assert len(w) == 1 and generator.fallback == "generate"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == expected


def test_a_model_that_reads_the_mask_itself_falls_back_naming_its_code():
    """Falcon's eager attention adds the attention mask itself, outside transformers' AttentionInterface; the
    engine gives no mask. The warning names the model, the model's line that failed and why, not a bare TypeError."""
    from bench.coverage import tiny_causal_lm

    model = tiny_causal_lm("falcon").eval()
    vocab = model.config.vocab_size
    generator = EmbeddedGenerator(model, PAD, [vocab + 1], max_new_tokens=4)
    with pytest.warns(GenerationFallbackWarning, match=r"FalconForCausalLM: its own code \(modeling_falcon.py:\d+\) "
                      r"failed on the engine's inputs, which give no attention mask.*TypeError") as w:
        generator.generate([[5, 6, 7], [8, 9]], temperature=0)
    assert len(w) == 1 and generator.fallback == "generate"


def _family_cases():
    from bench.coverage import causal_lm_archs

    return causal_lm_archs()


@pytest.mark.parametrize("arch", _family_cases())
def test_every_decoder_family_decodes_or_falls_back_with_one_warning(arch):
    """Every causal LM of the installed transformers (the coverage sweep's list and its rollout check), tiny and
    random-init: the engine's compiled step (guard-only backend) gives model.generate's greedy tokens and compiles
    only in the first decode step, never in a second call; or the generator warns once, names the model and the
    reason, and returns model.generate's tokens. Never a silent difference. The reference is model.generate's greedy
    tokens, or where transformers' generate fails on the tiny model, greedy decoding with its forward without cache."""
    from bench.coverage import measure_rollouts, tiny_causal_lm

    torch._dynamo.reset()
    try:
        model = tiny_causal_lm(arch)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"cannot be built tiny: {type(error).__name__}: {error}")
    result = measure_rollouts(model)
    if result["rollout"] == "not run":
        pytest.skip(f"no reference runs the tiny model: {result['rollout_reason']}")
    assert result["rollout"] in ("engine", "uncompiled layers", "model.generate"), result
    if result["rollout"] == "engine":
        assert not result["rollout_warnings"]
    else:
        assert len(result["rollout_warnings"]) == 1, result["rollout_warnings"]
        assert type(model).__name__ in result["rollout_warnings"][0]
        # The reason is the engine's, not a bare Python error from inside the model's code.
        assert not re.search(r"\((TypeError|AttributeError|IndexError|KeyError):", result["rollout_warnings"][0])


def test_the_sweeps_rollout_check_sees_a_decode_graph_per_layer(monkeypatch):
    """The coverage sweep's rollouts model has more layers of each kind than Dynamo's recompile limit: a decoder layer
    whose guards read its layer index (one decode graph per layer) hits the limit there, as in a full-size model, and
    is classified "recompiles" with that guard named, not "engine". Without that value, the same model is "engine"."""
    import torch._dynamo
    from transformers.models.llama import modeling_llama

    from bench.coverage import measure_rollouts, rollout_model

    result = measure_rollouts(rollout_model("llama"))
    assert result["rollout"] == "engine", result
    assert result["rollout_layers"] == torch._dynamo.config.recompile_limit + 1

    forward = modeling_llama.LlamaAttention.forward

    def forward_reading_layer_idx(self, hidden_states, *args, **kwargs):
        out, weights = forward(self, hidden_states, *args, **kwargs)
        return out + 0.0 * self.layer_idx, weights

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward_reading_layer_idx)
    result = measure_rollouts(rollout_model("llama"))
    assert result["rollout"] == "recompiles", result
    assert "FailOnRecompileLimitHit" in result["rollout_reason"]
    assert "['self_attn'].layer_idx == " in result["rollout_reason"], result["rollout_reason"]


def test_an_error_in_fastgrpos_or_torchs_code_is_not_blamed_on_the_model():
    """Only a failure inside the model's own code (here: this file) is named as the model's, by file and line; one
    raised in fastgrpo's or torch's code is the engine's own, and the prefill raises it as it is."""
    from fastgrpo.integrations.generation import engine

    def raised(fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001
            return error
        raise AssertionError("no error")

    model_error = raised(lambda: None + 1)
    line = model_error.__traceback__.tb_next.tb_lineno
    assert engine._model_code_frame(model_error) == f"test_generation_fallback.py:{line}"
    assert engine._model_code_frame(raised(lambda: engine.round_up(None, 8))) is None
    assert engine._model_code_frame(raised(lambda: torch.nn.functional.softmax(None, 0))) is None
