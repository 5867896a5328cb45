"""EmbeddedGenerator and its rollout engine: the same greedy tokens as model.generate (with and without LoRA, sliding
windows, softcaps, sinks, chunked attention), sampling as model.generate samples, EOS handling, finished rows dropping
out, each distinct prompt prefilled once, the KV cache reused and rows that do not fit decoded in waves, the
trainer's logprobs, the compiled decode layer compiled once, and on CUDA the captured decode steps. The tiny models
and references defined here are shared by the other tests/test_generation_*.py files."""
import warnings

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning, sample_next_token
from fastgrpo.integrations.generation.kv import has_layer_cache

VOCAB, PAD, EOS = 256, 0, 2
PROMPT_LENGTHS = (5, 11, 3, 8)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_lm(arch, seed=0, **overrides):
    """A random-init LM whose logits are peaked (large init), so greedy tokens vary and ties are unlikely
    (`overrides`: config fields)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch](**{
        **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
               initializer_range=0.5, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS),
        **overrides,
    })  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def with_lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt_ids, max_new_tokens, eos=EOS, **generate_kwargs):
    """model.generate on the left-padded batch, completions cut after the first EOS like TRL does."""
    from bench.coverage import hf_greedy as greedy

    return greedy(model, prompt_ids, max_new_tokens, pad=PAD, eos=eos, **generate_kwargs)


def fallback_notes_of_two_calls(generator, expected) -> list[str]:
    """Two greedy calls of `generator` on prompts(), each giving `expected`; the GenerationFallbackWarnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert generator.generate(prompts(), temperature=0) == expected
        assert generator.generate(prompts(), temperature=0) == expected
    return [str(w.message) for w in caught if issubclass(w.category, GenerationFallbackWarning)]


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

    generator = EmbeddedGenerator(model, PAD, [eos, VOCAB + 1], max_new_tokens=20)
    generator.generate(batch, temperature=0)  # the first call also checks itself against one plain forward
    calls = []
    hook = model.model.register_forward_hook(lambda *args: calls.append(1))
    got = generator.generate(batch, temperature=0)
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


@pytest.mark.parametrize("shared_slots", [True, False])
def test_the_prefill_runs_each_distinct_prompt_once(monkeypatch, shared_slots):
    """GRPO's groups repeat a prompt: one prefill row per distinct prompt, whose keys and values the rows of its
    completions read where the prefill wrote them (or, SHARED_PROMPT_SLOTS off, from copies); they sample
    independently."""
    from fastgrpo.integrations.generation import engine

    monkeypatch.setattr(engine, "SHARED_PROMPT_SLOTS", shared_slots)
    model = tiny_lm("qwen2")
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    batch = prompts()[:3]
    generator.generate(batch, temperature=0, num_generations=4)  # the first call also checks itself
    widths = []
    hook = model.model.register_forward_hook(lambda module, args, kwargs, out: widths.append(
        kwargs["input_ids"].shape), with_kwargs=True)
    greedy = generator.generate(batch, temperature=0, num_generations=4)
    torch.manual_seed(0)
    sampled = generator.generate(batch, temperature=1.0, num_generations=4)
    hook.remove()
    assert widths[0] == (3, max(PROMPT_LENGTHS[:3]))  # three prompt rows, not twelve
    assert greedy == [row for row in hf_greedy(model, batch, 8, eos=VOCAB + 1) for _ in range(4)]
    assert len({tuple(row) for row in sampled[:4]}) > 1  # the copies of one prompt sample apart
    caches = [m._fastgrpo_kv[0] for m in model.modules() if "_fastgrpo_kv" in m.__dict__]
    layout = generator.engine._buffers.state.layout
    assert caches and layout.is_compact == shared_slots
    if shared_slots:  # the decoding rows take no memory for prompt slots: 3 prompt rows, 12 rows of completions
        per_slot = caches[0].shape[1] * caches[0].shape[3] * caches[0].element_size()
        assert layout.prompts == 3 and layout.buffer_slots < 12 * layout.slots
        assert all(cache.untyped_storage().nbytes() == layout.buffer_slots * per_slot for cache in caches)
    else:  # each row a copy of its prompt
        assert all(bool(cache[3:, :, : widths[0][1]].any()) for cache in caches)


def test_the_compact_cache_layout_takes_no_prompt_slots_for_decoding_rows():
    """kv.CacheLayout: 64 rows of 8 prompts, 256 prompt and 512 completion slots: 72 x 512 + 768 slots (-23 %); one
    prompt a row (nothing shared) stays plain; a call fits while its rows, prompts and lengths do."""
    from fastgrpo.integrations.generation.kv import CacheLayout

    compact = CacheLayout.best(64, 768, 256, 8)
    assert compact.is_compact and compact.buffer_slots == 72 * 512 + 768 < 0.8 * 64 * 768
    assert [compact.prompt_row(j) for j in (0, 7)] == [65, 72] and compact.view_rows == 73
    assert not CacheLayout.best(64, 768, 256, 64).is_compact
    long_prompts = CacheLayout.best(16, 1536, 1024, 2)  # prompt rows two completions apart
    assert long_prompts.prompt_step == 2 and long_prompts.buffer_slots == (16 + 2 + 2) * 512 + 1536
    assert compact.holds(64, 768, 256, 8) and compact.holds(32, 640, 128, 4)
    assert not compact.holds(64, 768, 256, 9) and not compact.holds(64, 832, 320, 8)
    assert not compact.holds(64, 832, 256, 8)  # completions longer than a row's room


@pytest.mark.parametrize("mode, min_bytes, grouped_layers, compiled", [
    (True, None, True, False), ("auto", 0, True, False), ("auto", 0, True, True), ("auto", None, False, True),
    (False, 0, False, False)])
def test_groups_sharing_a_prompt_decode_through_the_kernel_as_model_generate(monkeypatch, mode, min_bytes,
                                                                            grouped_layers, compiled):
    """The Triton decode attention (Triton's interpreter) over rows sharing prompts attends each group's one prompt
    copy once (its prompt kernel) where GROUPED_PROMPT_ATTENTION says (True: every layer; "auto": the layers whose
    token KV reaches GROUPED_PROMPT_MIN_BYTES, none of the tiny model's at the default; decided inside the compiled
    layer where it is compiled), also after finished rows drop out and the groups are listed again: greedy tokens as
    model.generate's."""
    from fastgrpo.integrations.generation import engine
    from fastgrpo.kernels import decode_attention
    from fastgrpo.kernels._dispatch import triton_on_cpu

    monkeypatch.setattr(engine, "GROUPED_PROMPT_ATTENTION", mode)
    if min_bytes is not None:
        monkeypatch.setattr(decode_attention, "GROUPED_PROMPT_MIN_BYTES", min_bytes)
    grouped = []
    kernel = decode_attention._triton_decode
    monkeypatch.setattr(decode_attention, "_triton_decode", lambda *a, **kw: grouped.append(
        a[14] is not None) or kernel(*a, **kw))
    model = tiny_lm("qwen2")
    batch = [prompts()[0]] * 12 + prompts()[1:]  # 12 rows end early, 3 run on
    eos = hf_greedy(model, batch, 10, eos=VOCAB + 1)[0][3]
    expected = hf_greedy(model, batch, 10, eos=eos)
    generator = EmbeddedGenerator(model, PAD, [eos], max_new_tokens=10, min_batch=1, check_finished_every=2,
                                  compile=compiled, compile_backend="eager")
    with triton_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == expected
    assert grouped and set(grouped) == {grouped_layers}
    assert sorted(generator.engine._buffers.batches) == [4, 15]


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
    attention = model.model.layers[0].self_attn
    cache = attention._fastgrpo_kv[0]
    shorter = [p[:2] for p in prompts()]
    assert generator.generate(shorter, temperature=0) == hf_greedy(model, shorter, 8, eos=VOCAB + 1)
    assert attention._fastgrpo_kv[0] is cache
    longer = [p * 3 for p in prompts()]
    assert generator.generate(longer, temperature=0) == hf_greedy(model, longer, 8, eos=VOCAB + 1)
    assert attention._fastgrpo_kv[0] is not cache
    assert attention._fastgrpo_kv[0].shape[2] == 3 * max(PROMPT_LENGTHS) + 8


class _TensorsRead(torch.utils._python_dispatch.TorchDispatchMode):
    """The storages of the tensors ops read that no op of the block made (what a captured step reads from outside)."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:  # a constant the step made (`x[i] = False`): not a read
            args = ()
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in self.made:
                self.read.setdefault(value.untyped_storage().data_ptr(), (value.untyped_storage(), func, value.shape))
        for value in torch.utils._pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.made.add(value.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("arch,sampling", [
    ("llama", dict(temperature=0)),
    ("llama", dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition_penalty=1.3)),  # the filters' buffers
    ("qwen3_next", dict(temperature=0)),  # linear-attention states, experts
])
def test_a_decode_step_reads_the_same_tensors_in_every_call(arch, sampling, monkeypatch):
    """A captured decode step replays in later calls reading the addresses it was captured with: every tensor the step
    reads that it did not make must be the same one in each call (a tensor made per call, such as the EOS ids once
    were, leaves the replay reading freed memory: on an H100 a padded row read another tensor's values as EOS ids and
    stopped in Qwen3-Next's second call). Eager steps on CPU, the first call's tensors kept alive so none is reused."""
    from fastgrpo.integrations.generation import engine as engine_module

    reads = []
    original = engine_module.RolloutEngine._step

    def step(self, *args):
        if self.steps == len(reads) * 3 + 2:  # the second decode step of each call (3 steps a call)
            with _TensorsRead() as mode:
                original(self, *args)
            reads.append(mode.read)
            return
        original(self, *args)

    monkeypatch.setattr(engine_module.RolloutEngine, "_step", step)
    if arch == "llama":
        model, batch = tiny_lm("llama"), prompts()
    else:
        from bench.coverage import tiny_causal_lm

        model = tiny_causal_lm(arch).eval()
        vocab = model.config.get_text_config().vocab_size
        batch = [[3 + t % (vocab - 3) for t in p] for p in prompts()] * 2  # repeats: prefill rows spread
    generator = EmbeddedGenerator(model, PAD, [10**6], max_new_tokens=4, compile=False)
    for _ in range(3):  # the first call's steps also feed the engine's check (its eager probe): compare the others
        generator.generate(batch, **sampling)
    assert len(reads) == 3
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    second, third = (set(read) - parameters for read in reads[1:])
    assert second and third == second, [reads[2][k][1:] for k in third - second]


def test_many_engines_in_one_process_each_compile_their_own_decode_layer():
    """Dynamo's recompile limit (8) counts graphs per code object: ten generators in one process (a trainer's and an
    evaluation's, a test's reference and the engine under test) each decode through their compiled layer, none falls
    back (on an H100 the bf16 Qwen3-Next CUDA-graph test's fourth engine hit the limit when they shared one)."""
    torch._dynamo.reset()
    model = tiny_lm("llama")
    expected = hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        for _ in range(10):
            generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4, compile=True,
                                          compile_backend="eager")
            assert generator.generate(prompts(), temperature=0) == expected
            assert generator.fallback is None and generator.engine.backend.compiles == 1


def test_release_memory_frees_the_cache_between_calls_and_compiles_nothing_again():
    torch._dynamo.reset()
    model = with_lora(tiny_lm("qwen2"))
    expected = hf_greedy(model, prompts(), 8, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8, compile=True, compile_backend="eager",
                                  release_memory=True)
    for _ in range(3):
        assert generator.generate(prompts(), temperature=0) == expected
        assert not any(has_layer_cache(m) for m in model.modules())
        assert generator.engine._buffers is None and generator.engine._merged.copies == []
    assert generator.fallback is None and generator.engine.backend.compiles == 1
    assert generator.lora_decoding["merged"] == 14
    kept = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    assert kept.generate(prompts(), temperature=0) == expected
    assert any(has_layer_cache(m) for m in model.modules()) and len(kept.engine._merged.copies) == 2  # joined q/k/v


def test_rows_that_do_not_fit_decode_in_waves_after_one_warning(monkeypatch):
    """An out-of-memory error in the engine: the generator frees the engine and decodes in waves of half the rows,
    halving again while they do not fit; the tokens and log-probs are those of one call over all rows."""
    from fastgrpo.integrations.generation.engine import RolloutEngine

    model = tiny_lm("llama")
    batch = prompts() + prompts(seed=1)
    expected_ids, expected_logprobs = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=6).generate(
        batch, temperature=0.7, top_k=1, return_logprobs=True)
    fits = RolloutEngine.generate
    calls = []

    def at_most_three_rows(self, decoder, prompts_, sampling):
        calls.append(len(prompts_))
        if len(prompts_) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fits(self, decoder, prompts_, sampling)

    monkeypatch.setattr(RolloutEngine, "generate", at_most_three_rows)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=6)
    with pytest.warns(GenerationFallbackWarning, match="rollouts of 8 rows do not fit.*waves of at most 4 rows"
                      ".*max_completion_length") as caught:
        ids, logprobs = generator.generate(batch, temperature=0.7, top_k=1, return_logprobs=True)
    assert len(caught) == 1 and generator.wave_rows == 2 and calls == [8, 4, 2, 2, 2, 2]
    assert ids == expected_ids
    for got, want in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(want, abs=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == hf_greedy(model, batch, 6, eos=VOCAB + 1)


def test_one_row_that_does_not_fit_raises_naming_the_fixes(monkeypatch):
    from fastgrpo.integrations.generation.engine import RolloutEngine

    def never_fits(self, decoder, prompts_, sampling):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(RolloutEngine, "generate", never_fits)
    generator = EmbeddedGenerator(tiny_lm("llama"), PAD, [VOCAB + 1], max_new_tokens=6)
    with pytest.raises(torch.OutOfMemoryError) as raised, pytest.warns(GenerationFallbackWarning):
        generator.generate(prompts()[:2], temperature=0)
    assert "one row of 6 new tokens does not fit" in "".join(raised.value.__notes__)


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_bad_rollout_input_raises_naming_the_fix(arch):
    """GPT-2's and OPT's learned position tables (OPT's with its offset of 2) end at the configured length: a rollout
    that would pass it raises before any forward (on CUDA the lookup would fail as a device-side assert); rows that
    fit decode as model.generate. RoPE models have no such limit (None). A pad id of None and empty prompts are
    refused, each with its fix."""
    from transformers import GPT2Config, OPTConfig

    from fastgrpo.integrations.generation.generator import learned_position_limit

    torch.manual_seed(0)
    config = (GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, pad_token_id=PAD)
              if arch == "gpt2" else
              OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32,
                        max_position_embeddings=16, vocab_size=VOCAB, pad_token_id=PAD))
    model = AutoModelForCausalLM.from_config(config).eval()
    assert learned_position_limit(model) == 16 and learned_position_limit(tiny_lm("llama")) is None
    batch = [[5, 6, 7, 8]] * 2
    with pytest.raises(ValueError, match="pad_token_id is None: pass the tokenizer's pad token"):
        EmbeddedGenerator(model, None, [VOCAB + 1], max_new_tokens=17)
    with pytest.raises(ValueError, match=r"prompts \[1\] have no tokens \(of 2\); .* drop empty prompts"):
        EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4).generate([[5], []], temperature=0)
    with pytest.raises(ValueError, match="needs 21 positions; .* embeds 16 .* max_completion_length"):
        EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=17).generate(batch, temperature=0)
    assert (EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12).generate(batch, temperature=0)
            == hf_greedy(model, batch, 12, eos=VOCAB + 1))


def test_an_fp32_lm_head_tied_to_the_embeddings_decodes_with_its_cast_hook():
    """TRL's cast_lm_head_to_fp32 on tied embeddings: the shared weight becomes fp32 and a forward hook casts the
    embeddings back to the model's dtype. The engine keeps that hook (and takes off the require-grads one)."""
    model = tiny_lm("llama").to(torch.bfloat16)
    lm_head = model.lm_head.float()  # tied: the embedding's weight is now fp32 too
    lm_head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), lm_head.weight)
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    model.enable_input_require_grads()
    hooks = list(model.model.embed_tokens._forward_hooks.values())
    expected = hf_greedy(model, prompts(), 8, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8, compile=True, compile_backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        got = generator.generate(prompts(), temperature=0)
    assert [row[:4] for row in got] == [row[:4] for row in expected]  # bf16: later tokens may round apart
    assert list(model.model.embed_tokens._forward_hooks.values()) == hooks


def test_a_callers_autocast_is_turned_off():
    """Under autocast RoPE upcasts keys but not values; generation runs in the weights' dtype instead."""
    model = tiny_lm("llama")
    expected = hf_greedy(model, prompts(), 8, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert generator.generate(prompts(), temperature=0) == expected
    assert model.model.layers[0].self_attn._fastgrpo_kv[0].dtype == torch.float32


def test_compiled_decode_layer_traces_as_one_graph_shared_by_every_layer(monkeypatch):
    """The decode step's decoder layer (HF layer with LoRA, rollout attention) compiles with fullgraph=True once for
    all layers, also with the embedding hook that training under gradient checkpointing installs, and never again
    for later tokens or calls. The eager backend keeps the test fast: it checks Dynamo's tracing and the results,
    not inductor's code generation."""
    torch._dynamo.reset()
    monkeypatch.setattr("fastgrpo.integrations.generation.engine.COMPILED_SAMPLING_ROWS", 1)  # sampling compiled too
    model = with_lora(tiny_lm("qwen2"))
    # What TRL/PEFT add for gradient checkpointing: a hook calling requires_grad_ (untraceable) on the embeddings.
    model.enable_input_require_grads()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10, compile=True, compile_backend="eager")
    batch = prompts()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == hf_greedy(model, batch, 10, eos=VOCAB + 1)
        assert generator.engine.backend.compiles == 1
        assert generator.generate(batch, temperature=0.8, top_k=1) == hf_greedy(model, batch, 10, eos=VOCAB + 1)
    assert generator.engine.backend.compiles == 1
    assert generator.engine.sampling_backend.compiles == 2  # one graph per sampling setting (greedy, top-k)


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


def _strict():
    """A context in which a fallback warning fails the test."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error", GenerationFallbackWarning)
    return context


def assert_engine_greedy(model, batch, max_new_tokens=14, **generator_kwargs):
    """The generator's greedy tokens are model.generate's in two calls (on CUDA the second replays the captured
    steps), with no fallback warning."""
    expected = hf_greedy(model, batch, max_new_tokens, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=max_new_tokens, **generator_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(batch, temperature=0) == expected
        assert generator.generate(batch, temperature=0) == expected


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "gpt_oss", "qwen3", "doge", "phimoe", "phi3"])
def test_sliding_windows_softcaps_and_sinks_decode_compiled(arch):
    """Windows shorter than the prompt + completion, Gemma-2's softcap, gpt-oss's sinks, alternating layer kinds, a
    window that only the model's mask carries (Doge, PhiMoE: the attention call names none): the compiled step equals
    model.generate, one graph per layer kind, none after the first decode step."""
    from fastgrpo.compiler.tiny import tiny_model

    torch._dynamo.reset()
    overrides = dict(vocab_size=VOCAB, initializer_range=0.5, sliding_window=4)
    if arch in ("gemma3", "gpt_oss", "qwen3"):
        overrides["layer_types"] = ["sliding_attention", "full_attention"]
    if arch == "qwen3":
        overrides["use_sliding_window"] = True
    model = tiny_model(arch, **overrides).eval()
    batch = prompts()
    expected = hf_greedy(model, batch, 14, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=14, compile=True, compile_backend="eager",
                                  pad_to_multiple_of=8)  # every row left-padded, as on CUDA
    context = _strict()
    try:
        assert generator.generate(batch, temperature=0) == expected
        compiles = generator.engine.backend.compiles
        assert compiles == len(set(getattr(model.config, "layer_types", None) or ["one"]))
        assert generator.generate(batch, temperature=0) == expected
        assert generator.engine.backend.compiles == compiles
    finally:
        context.__exit__(None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "doge", "phimoe", "phi3"])
def test_sliding_windows_decode_on_cuda(arch):
    """On CUDA (inductor, CUDA graphs, the decode attention kernel with its window): windows shorter than the rows,
    also where only the model's mask carries the window (Doge, PhiMoE), give model.generate's greedy tokens."""
    from fastgrpo.compiler.tiny import tiny_model

    torch._dynamo.reset()
    model = tiny_model(arch, vocab_size=VOCAB, initializer_range=0.5, sliding_window=4).eval().cuda()
    assert_engine_greedy(model, [p for p in prompts() for _ in range(2)])


@pytest.mark.parametrize("chunk, engine", [(32, True), (8, False), (14, False)])
def test_chunked_attention_decodes_only_within_one_chunk(chunk, engine):
    """Llama-4's chunked attention is in its mask alone, which the engine does not build: rows that stay within one
    chunk decode on the engine (the chunks change nothing there), longer ones go to model.generate with the reason."""
    from fastgrpo.compiler.tiny import tiny_model

    model = tiny_model("llama4_text", vocab_size=VOCAB, initializer_range=0.5, attention_chunk_size=chunk).eval()
    expected = hf_greedy(model, prompts(), 6, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=6, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert generator.generate(prompts(), temperature=0) == expected
    notes = [str(w.message) for w in caught if issubclass(w.category, GenerationFallbackWarning)]
    assert (generator.fallback != "generate") == engine
    assert notes == ([] if engine else notes[:1]) and (engine or "attention_chunk_size" in notes[0])


def test_repetition_penalty_matches_model_generate():
    model = tiny_lm("llama")
    batch = prompts()
    expected = hf_greedy(model, batch, 12, eos=VOCAB + 1, repetition_penalty=1.7)
    assert expected != hf_greedy(model, batch, 12, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12)
    assert generator.generate(batch, temperature=0, repetition_penalty=1.7) == expected


def test_finished_rows_drop_out_to_smaller_batches():
    """Rows that end early leave the batch: the step continues on the running rows (a smaller batch, one compile
    more for its shape), with the same tokens as model.generate."""
    torch._dynamo.reset()
    model = tiny_lm("qwen2")
    batch = [prompts()[0]] * 12 + prompts()[1:] + [prompts(1)[0]]
    free_run = hf_greedy(model, batch, 24, eos=VOCAB + 1)
    eos = free_run[0][2]  # the first prompt's rows stop early at this token
    expected = hf_greedy(model, batch, 24, eos=eos)
    lengths = sorted(map(len, expected))
    assert lengths[0] < 8 and lengths[-1] == 24, lengths
    generator = EmbeddedGenerator(model, PAD, [eos], max_new_tokens=24, compile=True, compile_backend="eager",
                                  min_batch=1)
    context = _strict()
    try:
        assert generator.generate(batch, temperature=0) == expected
    finally:
        context.__exit__(None, None, None)
    sizes = sorted(generator.engine._buffers.batches)
    assert sizes[0] < len(batch) and sizes[-1] == len(batch), sizes
    assert generator.engine.backend.compiles == 2  # the full batch's shape, then one dynamic graph for the rest


def test_logprobs_are_the_trainers():
    """The log-prob returned with each sampled token is log-softmax(logits / T) of the model's plain forward."""
    model = with_lora(tiny_lm("llama"))
    batch = prompts()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=6)
    ids, logprobs = generator.generate(batch, temperature=0.7, return_logprobs=True)
    for prompt, completion, got in zip(batch, ids, logprobs):
        sequence = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float() / 0.7
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)


def test_fused_sampling_logprobs_are_the_trainers_and_draws_vary(monkeypatch):
    """With sampling.FUSED, plain sampling runs as fastgrpo::race_sample (here through Triton's interpreter): the
    log-probs are still log-softmax(logits / T) of the model's forward, and the rows of one prompt draw differently."""
    from fastgrpo.integrations.generation import sampling
    from fastgrpo.kernels import race_sample
    from fastgrpo.kernels._dispatch import triton_on_cpu

    monkeypatch.setattr(sampling, "FUSED", True)
    calls = []
    monkeypatch.setattr(sampling, "race_sample", lambda *a: calls.append(a) or race_sample.race_sample(*a))
    model = with_lora(tiny_lm("llama"))
    batch = [prompts()[0]] * 4
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=5)
    with triton_on_cpu():
        ids, logprobs = generator.generate(batch, temperature=0.7, return_logprobs=True)
    assert calls and len({tuple(row) for row in ids}) > 1
    for prompt, completion, got in zip(batch, ids, logprobs):
        sequence = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float() / 0.7
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)


def test_sampled_tokens_follow_the_models_distribution():
    """Many rows of one prompt, one sampled token each: frequencies match softmax(logits / T) after top-k, within
    sampling noise (a fixed seed; 4000 draws over a 16-token vocabulary)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, initializer_range=0.1, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = [3, 7, 5]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.8
    kept = logits.topk(6).indices
    probs = torch.full_like(logits, float("-inf")).scatter(0, kept, logits[kept]).softmax(-1)
    generator = EmbeddedGenerator(model, 0, [99], max_new_tokens=1)
    draws = torch.tensor([c[0] for c in generator.generate([prompt] * 4000, temperature=0.8, top_k=6)])
    frequencies = torch.bincount(draws, minlength=16).float() / len(draws)
    assert set(draws.unique().tolist()) <= set(kept.tolist())
    assert (frequencies - probs).abs().max() < 0.03


@pytest.mark.gpu
@pytest.mark.parametrize("arch, grouped", [("qwen2", False), ("gemma3", False), ("qwen2", True), ("gemma3", True)])
def test_cuda_graph_decode_matches_model_generate(arch, grouped, monkeypatch):
    """On CUDA: inductor-compiled layers, the step captured per batch size, the decode attention kernel (grouped: a
    group's prompt attended once for its rows); the tokens of model.generate, also after finished rows drop out to
    smaller batches."""
    from fastgrpo.compiler.tiny import tiny_model

    torch._dynamo.reset()
    monkeypatch.setattr("fastgrpo.integrations.generation.engine.GROUPED_PROMPT_ATTENTION", grouped)
    monkeypatch.setattr("fastgrpo.integrations.generation.engine.COMPILED_SAMPLING_ROWS", 1)  # sampling compiled too
    if arch == "gemma3":
        model = tiny_model("gemma3", vocab_size=VOCAB, initializer_range=0.5, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"]).eval()
    else:
        model = tiny_lm(arch)
    model = with_lora(model).cuda()
    batch = [p for p in prompts() for _ in range(4)]
    expected = hf_greedy(model, batch, 40, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=40)  # CUDA: compiled, CUDA graphs
    context = _strict()
    try:
        assert generator.generate(batch, temperature=0) == expected
        assert generator.generate(batch, temperature=0) == expected  # graph replay
        assert generator.generate(batch, temperature=1.0, top_k=1) == expected
        allocated_before = torch.cuda.memory_allocated()
        released = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=40, release_memory=True)
        assert released.generate(batch, temperature=0) == expected
        compiles = released.engine.backend.compiles
        assert released.generate(batch, temperature=0) == expected  # graphs captured again over a new cache
        assert released.engine.backend.compiles == compiles and torch.cuda.memory_allocated() < allocated_before + 2**23
        stopping_batch = [prompts()[0]] * 12 + prompts()[1:]  # 12 rows end early, 3 run on
        eos = hf_greedy(model, stopping_batch, 40, eos=VOCAB + 1)[0][3]
        early = hf_greedy(model, stopping_batch, 40, eos=eos)
        assert sorted(map(len, early))[-1] > 12
        stopping = EmbeddedGenerator(model, PAD, [eos], max_new_tokens=40, min_batch=1, check_finished_every=4)
        assert stopping.generate(stopping_batch, temperature=0) == early
        assert len(stopping.engine._buffers.batches) > 1
    finally:
        context.__exit__(None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("fused, top_k", [(False, 6), (True, None)])
def test_compiled_sampling_draws_from_the_distribution_also_when_replayed(monkeypatch, fused, top_k):
    """The decode step's compiled sampling on CUDA, captured as the decode step runs it: frequencies of 8192 rows of
    one distribution match softmax(logits / T) after top-k, and each replay draws anew. Unfused: inductor's RNG;
    fused (sampling.FUSED, plain sampling through fastgrpo::race_sample): the seed is drawn inside the graph."""
    from fastgrpo.integrations.generation import sampling

    monkeypatch.setattr(sampling, "FUSED", fused)
    torch._dynamo.reset()
    torch.manual_seed(0)
    logits = torch.randn(16, device="cuda").expand(8192, 16).contiguous()
    setting = sampling.Sampling(temperature=0.8, top_k=top_k)
    compiled = torch.compile(sampling.sample, backend="inductor", fullgraph=True)
    kept = logits[0].topk(top_k or 16).indices
    scaled = logits[0] / 0.8
    probs = torch.full_like(scaled, float("-inf")).scatter(0, kept, scaled[kept]).softmax(-1)
    compiled(logits, setting, None)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = compiled(logits, setting, None)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(tokens.clone())
        frequencies = torch.bincount(tokens, minlength=16).float() / tokens.numel()
        assert set(tokens.unique().tolist()) <= set(kept.tolist())
        assert (frequencies - probs).abs().max() < 0.02
        torch.testing.assert_close(logprobs, (logits / 0.8).log_softmax(-1).gather(-1, tokens[:, None])[:, 0])
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
