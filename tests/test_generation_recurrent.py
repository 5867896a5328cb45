"""The rollout engine on linear-attention and state-space layers (recurrent.py): hybrid decoders (gated DeltaNet with
full attention: Qwen3-Next, Qwen3.5; Mamba-2 with attention: Falcon-H1, Zamba2) and pure state-space models
(Mamba) decode through the compiled step with model.generate's greedy tokens, also when finished rows drop out,
when a prompt's prefill row is spread to its completions, under LoRA and across calls."""
import warnings

import pytest
import torch
import transformers

from bench.coverage import hf_greedy, tiny_causal_lm
from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from fastgrpo.integrations.generation import recurrent
from fastgrpo.integrations.generation.recurrent import LayerStates, recurrent_mixers

ARCHS = ["qwen3_next", "qwen3_5_text", "falcon_h1", "zamba2", "mamba"]


@pytest.fixture(autouse=True)
def _quiet():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the reference-kernel notes of every mixer
    yield
    transformers.logging.set_verbosity(level)


def peaked(model):
    """Weights scaled up: peaked logits, so greedy tokens vary and ties are unlikely."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model.eval()


def batch_of(vocab, lengths=(5, 9, 3, 7, 4, 6, 2, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def strict_generate(generator, prompts, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        return generator.generate(prompts, temperature=0, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_and_state_space_models_decode_compiled_with_finished_rows_dropping_out(arch):
    torch._dynamo.reset()
    model = peaked(tiny_causal_lm(arch))
    vocab = model.config.get_text_config().vocab_size
    for seed in range(20):  # an EOS token the first prompt samples early and the other prompts never
        first, *others = batch_of(vocab, lengths=(5, 9, 3), seed=seed)
        prompts = [first] * 6 + others  # the six copies stop early, the others run on
        free_run = hf_greedy(model, prompts, 16, pad=0, eos=vocab + 5)
        eos = next((t for t in free_run[0][1:4] if all(t not in row for row in free_run[6:])), None)
        if eos is not None:
            break
    expected = hf_greedy(model, prompts, 16, pad=0, eos=eos)
    assert max(map(len, expected[:6])) < 5 and min(map(len, expected[6:])) == 16, expected
    generator = EmbeddedGenerator(model, 0, [eos], max_new_tokens=16, compile=True, compile_backend="eager",
                                  min_batch=1)
    assert strict_generate(generator, prompts) == expected
    assert len(generator.engine._buffers.batches) > 1  # the batch shrank
    mixers = recurrent_mixers(model)
    assert mixers and all(isinstance(m.__dict__["_fastgrpo_states"], LayerStates) for m in mixers)
    compiles = generator.engine.backend.compiles
    assert strict_generate(generator, prompts) == expected  # again: the states start over, nothing compiles
    assert generator.engine.backend.compiles == compiles
    assert all(type(m).forward is not recurrent._WRAPPERS[type(m)] for m in mixers)  # the classes' forward is back


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba"])
def test_a_prompts_completions_share_its_prefill_and_decode_apart(arch):
    model = peaked(tiny_causal_lm(arch))
    vocab = model.config.get_text_config().vocab_size
    prompts = batch_of(vocab, lengths=(6, 3, 9))
    expected = hf_greedy(model, prompts, 8, pad=0, eos=vocab + 5)
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=8)
    assert strict_generate(generator, prompts, num_generations=3) == [row for row in expected for _ in range(3)]
    torch.manual_seed(0)
    sampled = generator.generate(prompts, temperature=1.0, num_generations=4)
    assert len({tuple(row) for row in sampled[:4]}) > 1  # the copies of one prompt sample apart


def test_lora_on_a_hybrid_decodes_from_the_merged_weights():
    import peft

    model = peaked(tiny_causal_lm("qwen3_next"))
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "in_proj_qkvz", "out_proj"]))
    vocab = model.config.get_text_config().vocab_size
    prompts = batch_of(vocab, lengths=(5, 9, 3))
    expected = hf_greedy(model, prompts, 8, pad=0, eos=vocab + 5)
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=8, compile=True, compile_backend="eager")
    assert strict_generate(generator, prompts) == expected
    assert generator.lora_decoding["merged"] > 0 and not generator.lora_decoding["adapters_forward"]


def test_layer_states_follow_transformers_conv_and_recurrent_updates():
    """LayerStates against transformers' own LinearAttentionLayer: the prefill's conv input (shorter and longer than
    the kernel), what it keeps, and the recurrent state; then an in-place decode-step write."""
    from transformers.cache_utils import LinearAttentionLayer

    for tokens in (2, 7):
        conv = torch.randn(3, 5, tokens)
        recurrent = torch.randn(3, 2, 4, 4)
        ours, theirs = LayerStates(), LinearAttentionLayer()
        ours.begin_prefill(capacity=6)
        torch.testing.assert_close(ours.update_conv_state(conv, 0, conv_kernel_size=4),
                                   theirs.update_conv_state(conv, conv_kernel_size=4))
        ours.update_recurrent_state(recurrent, 0)
        theirs.update_recurrent_state(recurrent)
        ours.end_prefill()
        ours.use_rows(3)
        assert ours.has_previous_state(0) and ours.layers[17] is ours
        torch.testing.assert_close(ours.conv_states[0], theirs.conv_states[0])
        torch.testing.assert_close(ours.recurrent_states[0], theirs.recurrent_states[0])
        view = ours.recurrent_states[0]
        ours.update_recurrent_state(recurrent * 2, 0)
        assert ours.recurrent_states[0] is view and torch.equal(view, recurrent * 2)
        ours.reorder(torch.tensor([2, 0]))
        torch.testing.assert_close(ours.recurrent_states[0], (recurrent * 2)[[2, 0]])


@pytest.mark.gpu
@pytest.mark.parametrize("arch,dtype", [("qwen3_next", torch.float32), ("qwen3_next", torch.bfloat16),
                                        ("falcon_h1", torch.float32)])
def test_cuda_graph_decode_of_hybrids_matches_model_generate(arch, dtype):
    """On CUDA: inductor-compiled layers and the step captured per batch size, the states read and written in place
    by the replays; model.generate's tokens (fp32), also after finished rows drop out and in a second call. Qwen3-Next's
    experts decode through grouped_mm in bf16 and batched_mm in fp32 (experts.py). In bf16 inductor's fused layers
    round differently from eager transformers (greedy tokens part after a few steps on this peaked model: measured on
    an H200), so there the reference is the same compiled layers run without CUDA graphs."""
    torch._dynamo.reset()
    model = peaked(tiny_causal_lm(arch, dtype=dtype)).cuda()
    vocab = model.config.get_text_config().vocab_size
    first, *others = batch_of(vocab, lengths=(5, 9, 3))
    prompts = [first] * 12 + others

    def reference(eos, **kwargs):
        if dtype == torch.float32:
            return hf_greedy(model, prompts, 40, pad=0, eos=eos)
        return strict_generate(EmbeddedGenerator(model, 0, [eos], max_new_tokens=40, cuda_graphs=False, **kwargs),
                               prompts)

    free_run = expected = reference(vocab + 5)
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=40)  # CUDA: compiled, CUDA graphs
    assert strict_generate(generator, prompts) == expected
    assert strict_generate(generator, prompts) == expected  # replays
    eos = next((t for t in free_run[0][1:6] if all(t not in row for row in free_run[12:])), None)
    if eos is not None:
        early = reference(eos, min_batch=1, check_finished_every=4)
        stopping = EmbeddedGenerator(model, 0, [eos], max_new_tokens=40, min_batch=1, check_finished_every=4)
        assert strict_generate(stopping, prompts) == early
        assert len(stopping.engine._buffers.batches) > 1


@pytest.mark.parametrize("arch", ["qwen3_5_text", "mamba"])
def test_a_deep_model_compiles_one_decode_graph_per_layer_kind(arch):
    """Twelve layers (nine or twelve mixers: past Dynamo's recompile limit of 8 if each layer index compiled its own
    graph) decode through the compiled step with one graph per kind of layer."""
    from bench.coverage import tiny_overrides

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, **tiny_overrides(arch))
    config.num_hidden_layers = 12
    if arch == "qwen3_5_text":
        config.layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)]
    model = peaked(transformers.AutoModelForCausalLM.from_config(config))
    kinds = len({tuple(name for name, _ in layer.named_children()) for layer in model.base_model.layers})
    vocab = config.vocab_size
    prompts = batch_of(vocab, lengths=(5, 9, 3))
    expected = hf_greedy(model, prompts, 6, pad=0, eos=vocab + 5)
    generator = EmbeddedGenerator(model, 0, [vocab + 5], max_new_tokens=6, compile=True, compile_backend="eager",
                                  min_batch=1)
    assert strict_generate(generator, prompts) == expected
    assert generator.engine.backend.compiles == kinds
    if arch == "mamba":
        assert [m.layer_idx for m in recurrent_mixers(model)] == list(range(12))  # the indices are back
