"""fastgrpo::decode_attention against a float64 reference: ragged starts, compacted rows, GQA ratios, head dims,
sliding windows, softcaps, sinks, prompt slots read from another row, dtypes and strides; the cache write; compiled
and captured calls."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels import decode_attention as decode_module
from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.decode_attention import (
    PROMPT_GROUP_ROWS,
    _triton_decode,
    decode_attention,
    reference_decode_attention,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def case(seed, b, hkv, group, d, slots, cache_rows, dtype, window, softcap, sinks, strided_q, device="cpu",
         shared=False):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    hq = hkv * group
    q = randn(b, 2 * hq, d)[:, ::2] if strided_q else randn(b, hq, d)
    inputs = dict(
        q=q, k_new=randn(b, hkv, d), v_new=randn(b, hkv, d), k_cache=randn(cache_rows, hkv, slots, d),
        v_cache=randn(cache_rows, hkv, slots, d), rows=torch.randperm(cache_rows, generator=g)[:b].to(device),
        start=torch.randint(0, slots // 2, (cache_rows,), generator=g).to(device),
        length=torch.tensor(slots - int(torch.randint(0, slots // 4, (1,), generator=g)), device=device),
    )
    if shared:  # prompt slots [0, prompt_len) read from other rows; the new slot lies after them
        inputs["prompt_rows"] = torch.randint(0, cache_rows, (cache_rows,), generator=g).to(device)
        inputs["prompt_len"] = torch.randint(0, int(inputs["length"]), (), generator=g).to(device)
    if shared == "groups":  # rows of one prompt row share its start; entries list them, in random order
        inputs["start"] = inputs["start"][inputs["prompt_rows"]]
        inputs["prompt_groups"] = prompt_groups(inputs["prompt_rows"][inputs["rows"]].tolist(), g).to(device)
    options = dict(scale=d ** -0.5, window=window, softcap=softcap,
                   sinks=torch.randn(hq, generator=g).to(device) if sinks else None)
    return inputs, options


def prompt_groups(keys: list[int], g: torch.Generator) -> torch.Tensor:
    """Batch rows grouped by their prompt row (`keys`), PROMPT_GROUP_ROWS at most an entry, entries shuffled, and
    empty entries added (-1)."""
    by_key = {}
    for position, key in enumerate(keys):
        by_key.setdefault(key, []).append(position)
    entries = [members[i:i + PROMPT_GROUP_ROWS] for members in by_key.values()
               for i in range(0, len(members), PROMPT_GROUP_ROWS)]
    entries += [[]] * int(torch.randint(0, 3, (1,), generator=g))
    table = torch.full((len(entries), PROMPT_GROUP_ROWS), -1, dtype=torch.long)
    for e, i in enumerate(torch.randperm(len(entries), generator=g).tolist()):
        table[e, : len(entries[i])] = torch.tensor(entries[i], dtype=torch.long)
    return table


def expected(inputs, options):
    """The float64 reference on copies (it writes the cache too)."""
    double = {k: (v.double() if v.is_floating_point() else v).cpu().clone() for k, v in inputs.items()
              if k != "prompt_groups"}  # how the kernel reads, not the maths
    sinks = options["sinks"] if options["sinks"] is None else options["sinks"].cpu()
    out = reference_decode_attention(**double, scale=options["scale"], window=options["window"],
                                     softcap=options["softcap"], sinks=None if sinks is None else sinks.double())
    return out, double["k_cache"], double["v_cache"]


def nan_scratch():
    """The kernels' scratch (torch.empty) filled with NaN: an empty split's partials must be neither stored nor read."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return mock.patch.object(torch, "empty", filled)


def run(inputs, options, call):
    """`call(**inputs, **options)` on the inputs (it writes their caches); checked against the reference run on the
    inputs as they were before."""
    before = {k: v.clone() for k, v in inputs.items()}
    out = call(**inputs, **options)
    want, k_after, v_after = expected(before, options)
    dtype = inputs["q"].dtype
    scale = want.abs().max().item()
    assert (out.cpu().double() - want.cpu()).abs().max().item() <= TOLERANCE[dtype] * max(1.0, scale)
    # The new key/value sits at slot length - 1 of exactly the given rows; nothing else changed.
    for cache, after in ((inputs["k_cache"], k_after), (inputs["v_cache"], v_after)):
        assert torch.equal(cache.cpu(), after.to(cache.dtype).cpu())
    assert not torch.equal(inputs["k_cache"], before["k_cache"])


shapes = st.tuples(
    st.integers(0, 2**16), st.integers(1, 4), st.integers(1, 3), st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([16, 32, 64, 80, 128]), st.integers(8, 72), st.integers(0, 3),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([None, 3, 16]),
    st.sampled_from([None, 5.0, 30.0]), st.booleans(), st.booleans(), st.integers(1, 4),
    st.sampled_from([None, "rows", "groups"]), st.booleans(),
)


@settings(max_examples=25)
@given(shapes)
def test_triton_kernel_matches_the_float64_reference(params):
    """With the slot offsets 32-bit (`narrow`, at every head dim here) or 64-bit."""
    seed, b, hkv, group, d, slots, extra_rows, dtype, window, softcap, sinks, strided, splits, shared, narrow = params
    inputs, options = case(seed, b, hkv, group, d, slots, b + extra_rows, dtype, window, softcap, sinks, strided,
                           shared=shared)
    narrow_offsets = mock.patch.object(decode_module, "NARROW_OFFSETS_MAX_DIM", 256 if narrow else 0)
    with triton_on_cpu(), nan_scratch(), narrow_offsets:
        run(inputs, options, lambda **kw: _triton_decode(**kw, splits=min(splits, -(-slots // 64) + 1),
                                                         prompt_splits=splits if shared == "groups" else None))


@settings(max_examples=25)
@given(shapes)
def test_torch_path_matches_the_float64_reference(params):
    seed, b, hkv, group, d, slots, extra_rows, dtype, window, softcap, sinks, strided, _, shared, _ = params
    inputs, options = case(seed, b, hkv, group, d, slots, b + extra_rows, dtype, window, softcap, sinks, strided,
                           shared=shared)
    run(inputs, options, decode_attention)


def test_head_dim_256_with_window_and_softcap_and_many_splits():
    inputs, options = case(3, 2, 1, 4, 256, 70, 3, torch.float32, 16, 20.0, False, False)
    with triton_on_cpu(), nan_scratch():  # more splits than blocks: empty splits weigh nothing
        run(inputs, options, lambda **kw: _triton_decode(**kw, splits=5))


def test_a_row_whose_window_holds_only_the_new_slot():
    inputs, options = case(4, 2, 1, 2, 32, 20, 2, torch.float32, 1, None, True, False)
    with triton_on_cpu():
        run(inputs, options, lambda **kw: _triton_decode(**kw, splits=2))


def test_compiled_call_writes_the_real_cache_and_never_recompiles_for_a_new_length():
    """Inside a compiled graph (inductor, fullgraph) the cache is written in place, with no copy of it, and the
    length, a device tensor advanced between calls, causes no recompile."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kv = (torch.zeros(4, 1, 32, 16), torch.zeros(4, 1, 32, 16))

        def forward(self, q, k, v, rows, start, length):
            return decode_attention(q * 2, k, v, self.kv[0], self.kv[1], rows, start, length, scale=0.25) + 1

    torch._dynamo.reset()
    counters.clear()
    layer = Layer()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    q, k, v = torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    rows, start, length = torch.tensor([3, 1]), torch.zeros(4, dtype=torch.long), torch.tensor(5)
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(compiled, q, k, v, rows, start, length)
        for n in (6, 7):
            out = compiled(q, k, v, rows, start, length.fill_(n))
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(layer.kv[0][3, :, 4], k[0]) and torch.equal(layer.kv[1][1, :, 6], v[1])
    assert "copy_" not in code and "clone" not in code  # the op wrote the module's cache tensors themselves
    eager_kv = (torch.zeros(4, 1, 32, 16), torch.zeros(4, 1, 32, 16))
    for n in (5, 6, 7):
        want = decode_attention(q * 2, k, v, *eager_kv, rows, start, torch.tensor(n), scale=0.25) + 1
    torch.testing.assert_close(out, want)


def test_rows_sharing_a_prompt_read_its_slots_from_the_row_holding_them():
    """Rows 1-3 share row 0's prompt (slots [0, 12)): their own prompt slots are never read, so garbage there changes
    nothing, while their written slots after the prompt are their own."""
    inputs, options = case(5, 4, 2, 2, 32, 40, 4, torch.float32, None, None, False, False)
    inputs["start"].zero_()
    inputs["length"].fill_(30)
    inputs["rows"] = torch.arange(4)
    copied = {k: v.clone() for k, v in inputs.items()}
    for cache in (copied["k_cache"], copied["v_cache"]):  # the private layout: each row a copy of the prompt
        cache[1:, :, :12] = cache[0, :, :12]
    for cache in (inputs["k_cache"], inputs["v_cache"]):
        cache[1:, :, :12] = 1e4  # would dominate the softmax if read
    shared = dict(prompt_rows=torch.zeros(4, dtype=torch.long), prompt_len=torch.tensor(12))
    want = decode_attention(**copied, **options)
    torch.testing.assert_close(decode_attention(**inputs, **shared, **options), want)
    groups = torch.tensor([[2, 0, 3, 1] + [-1] * (PROMPT_GROUP_ROWS - 4), [-1] * PROMPT_GROUP_ROWS])
    with triton_on_cpu():
        torch.testing.assert_close(_triton_decode(**inputs, **shared, **options, splits=3), want)
        torch.testing.assert_close(_triton_decode(**inputs, **shared, **options, prompt_groups=groups), want)


def test_many_heads_a_group_split_an_entry_into_chunks():
    """16 query heads a KV head: 4 rows of an entry per prompt program (64 dot rows), two programs an entry."""
    inputs, options = case(6, 8, 1, 16, 16, 40, 8, torch.float32, None, 20.0, True, False, shared="groups")
    with triton_on_cpu():
        run(inputs, options, lambda **kw: _triton_decode(**kw, splits=2, prompt_splits=2))


def test_prompt_rows_and_prompt_len_come_together():
    inputs, options = case(0, 2, 1, 1, 16, 8, 2, torch.float32, None, None, False, False)
    with pytest.raises(ValueError, match="together"):
        decode_attention(**inputs, prompt_rows=torch.zeros(2, dtype=torch.long), **options)
    with pytest.raises(ValueError, match="one per decoding cache row"):
        decode_attention(**inputs, prompt_rows=torch.zeros(3, dtype=torch.long), prompt_len=torch.tensor(2), **options)
    with pytest.raises(ValueError, match="prompt_groups must be"):
        decode_attention(**inputs, prompt_rows=torch.zeros(2, dtype=torch.long), prompt_len=torch.tensor(2),
                         prompt_groups=torch.zeros(2, 3, dtype=torch.long), **options)


def test_grouped_prompt_pays_where_a_tokens_keys_and_values_are_large():
    """prompt_groups pays from GROUPED_PROMPT_MIN_BYTES of keys + values a token and layer (Phi-3-mini's 32 x 96 heads
    in bf16: 12 KiB), not at grouped-query caches (Llama-3.1-8B's 8 x 128: 4 KiB; Qwen2.5-1.5B's 2 x 128: 1 KiB)."""
    from fastgrpo.kernels.decode_attention import grouped_prompt_pays

    def cache(heads, dim, dtype=torch.bfloat16):
        return torch.empty(1, heads, 4, dim, dtype=dtype, device="meta")

    assert grouped_prompt_pays(cache(32, 96)) and grouped_prompt_pays(cache(32, 128))
    assert not grouped_prompt_pays(cache(8, 128)) and not grouped_prompt_pays(cache(2, 128))
    assert grouped_prompt_pays(cache(8, 128, torch.float32))  # the bytes count, not the heads


def compact_case(seed, rows, prompts, prompt_capacity, completion, hkv, group, d, dtype, window, grouped,
                 device="cpu"):
    """A compact-layout cache (kv.CacheLayout: decoding rows `completion` slots apart, prompts in rows of their own)
    filled at random, and the same keys and values laid out plainly (each row a copy of its prompt)."""
    from fastgrpo.integrations.generation.kv import CacheLayout

    g = torch.Generator().manual_seed(seed)
    slots = prompt_capacity + completion
    layout = CacheLayout.compact(rows, slots, prompt_capacity, prompts)
    prompt_len = int(torch.randint(1, prompt_capacity + 1, (1,), generator=g))
    length = prompt_len + int(torch.randint(1, completion + 1, (1,), generator=g))  # the new slot: length - 1
    source = torch.randint(0, prompts, (rows,), generator=g)
    prompt_start = torch.randint(0, prompt_len, (prompts,), generator=g)
    b = int(torch.randint(1, rows + 1, (1,), generator=g))
    hq = hkv * group
    compact, plain = [], []
    for _ in range(2):  # keys, values
        own = torch.randn(rows, hkv, slots, d, generator=g).to(device=device, dtype=dtype)
        shared = torch.randn(prompts, hkv, slots, d, generator=g).to(device=device, dtype=dtype)
        cache = layout.allocate(hkv, d, own)
        layout.prompt_view(cache)[:prompts, :, :prompt_len] = shared[:, :, :prompt_len]
        for r in range(rows):  # a row's own slots: [prompt_len, prompt_len + completion)
            cache[r, :, prompt_len:prompt_len + completion] = own[r, :, prompt_len:prompt_len + completion]
        copy = torch.zeros(rows, hkv, slots, d, dtype=dtype, device=device)
        copy[:, :, :prompt_len] = shared[source.to(device), :, :prompt_len]
        copy[:, :, prompt_len:] = own[:, :, prompt_len:]
        compact.append(cache)
        plain.append(copy)
    common = dict(q=torch.randn(b, hq, d, generator=g).to(dtype), k_new=torch.randn(b, hkv, d, generator=g).to(dtype),
                  v_new=torch.randn(b, hkv, d, generator=g).to(dtype), rows=torch.randperm(rows, generator=g)[:b],
                  start=prompt_start[source], length=torch.tensor(length))
    common = {k: v.to(device) for k, v in common.items()}
    inputs = dict(common, k_cache=compact[0], v_cache=compact[1], prompt_rows=layout.prompt_row(source).to(device),
                  prompt_len=torch.tensor(prompt_len, device=device))
    if grouped:
        inputs["prompt_groups"] = prompt_groups(source[common["rows"].cpu()].tolist(), g).to(device)
    reference = dict({k: v.clone() for k, v in common.items()}, k_cache=plain[0], v_cache=plain[1])
    options = dict(scale=d ** -0.5, window=window, softcap=None, sinks=None)
    return layout, inputs, reference, options


def check_compact(layout, inputs, reference, options, call):
    """`call` on the compact cache gives the plain cache's output and writes each row's new slot into its own row,
    leaving every prompt row and every other used slot as it was."""
    prompt_len, length = int(inputs["prompt_len"]), int(inputs["length"])
    prompts_before = [layout.prompt_view(c)[:layout.prompts, :, :prompt_len].clone()
                      for c in (inputs["k_cache"], inputs["v_cache"])]
    out = call(**inputs, **options)
    want = decode_attention(**reference, **options)
    dtype = inputs["q"].dtype
    assert (out.double() - want.double()).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    for cache, plain, before in zip((inputs["k_cache"], inputs["v_cache"]), (reference["k_cache"],
                                                                           reference["v_cache"]), prompts_before):
        assert torch.equal(layout.prompt_view(cache)[:layout.prompts, :, :prompt_len], before)
        for r in range(layout.rows):  # the row's written slots, the new one included where it decoded
            assert torch.equal(cache[r, :, prompt_len:length], plain[r, :, prompt_len:length])


compact_shapes = st.tuples(
    st.integers(0, 2**16), st.integers(1, 9), st.integers(1, 4), st.integers(1, 40), st.integers(1, 40),
    st.integers(1, 3), st.sampled_from([1, 2, 4]), st.sampled_from([16, 32, 80]),
    st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([None, 5]), st.booleans(), st.booleans(),
)


@settings(max_examples=30, deadline=None)
@given(compact_shapes)
def test_a_compact_cache_reads_and_writes_as_a_plain_one(params):
    """The rollout engine's compact layout (rows overlapping in memory; kv.CacheLayout) through the torch path and
    the Triton kernels (interpreter): the output of a plain cache holding the same keys and values, the new slot in
    the row's own memory, nothing used overwritten."""
    seed, rows, prompts, capacity, completion, hkv, group, d, dtype, window, grouped, triton_path = params
    layout, inputs, reference, options = compact_case(seed, rows, prompts, capacity, completion, hkv, group, d, dtype,
                                                      window, grouped)
    if triton_path:
        with triton_on_cpu():
            check_compact(layout, inputs, reference, options, lambda **kw: _triton_decode(**kw, splits=2))
    else:
        inputs.pop("prompt_groups", None)
        check_compact(layout, inputs, reference, options, decode_attention)


def test_compiled_call_on_a_compact_cache_writes_it_in_place():
    """Inside an inductor graph, a cache whose rows overlap in memory is written in place (no copy of it) and the
    output is the eager one's."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    layout, inputs, reference, options = compact_case(7, 6, 2, 12, 20, 2, 2, 16, torch.float32, None, False)

    class Layer(torch.nn.Module):
        def __init__(self, kv):
            super().__init__()
            self.kv = kv

        def forward(self, q, k, v, rows, start, length, prompt_rows, prompt_len):
            return decode_attention(q * 2, k, v, self.kv[0], self.kv[1], rows, start, length, scale=0.25,
                                    prompt_rows=prompt_rows, prompt_len=prompt_len) + 1

    def buffer(cache):  # the whole buffer under a compact cache view
        return cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size(),), (1,), 0)

    torch._dynamo.reset()
    counters.clear()
    eager_kv = tuple(layout.allocate(c.shape[1], c.shape[3], c) for c in (inputs["k_cache"], inputs["v_cache"]))
    for mine, theirs in zip(eager_kv, (inputs["k_cache"], inputs["v_cache"])):
        buffer(mine).copy_(buffer(theirs))
    layer = Layer((inputs["k_cache"], inputs["v_cache"]))
    args = [inputs[k] for k in ("q", "k_new", "v_new", "rows", "start", "length", "prompt_rows", "prompt_len")]
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(layer, backend="inductor", fullgraph=True), *args)
        want = Layer(eager_kv)(*args)
    assert counters["stats"]["unique_graphs"] == 1
    assert "copy_" not in code and "clone" not in code  # the op wrote the module's cache tensors themselves
    torch.testing.assert_close(out, want)
    for mine, theirs in zip(layer.kv, eager_kv):
        assert torch.equal(buffer(mine), buffer(theirs))


def test_no_backward():
    inputs, options = case(0, 1, 1, 1, 16, 8, 1, torch.float32, None, None, False, False)
    inputs["q"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="no_grad"):
        decode_attention(**inputs, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("shared", [None, "rows", "groups"])
@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "gemma3-1b", "phi-3-mini"])
def test_gpu_kernel_at_real_shapes(shape, shared, narrow, monkeypatch):
    monkeypatch.setattr(decode_module, "NARROW_OFFSETS_MAX_DIM", 256 if narrow else 0)
    b, hkv, group, d, window, softcap = {"qwen2.5-1.5b": (128, 2, 6, 128, None, None),
                                         "gemma3-1b": (64, 1, 4, 256, 512, 50.0),
                                         "phi-3-mini": (64, 32, 1, 96, 2047, None)}[shape]
    inputs, options = case(0, b, hkv, group, d, 1024, b + 8, torch.bfloat16, window, softcap, False, False, "cuda",
                           shared=shared)
    run(inputs, options, decode_attention)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_gpu_kernel_on_a_compact_cache(grouped):
    """The engine's compact layout at Phi-3-mini's heads: 64 rows of 8 prompts, 256 + 512 slots."""
    layout, inputs, reference, options = compact_case(2, 64, 8, 256, 512, 32, 1, 96, torch.bfloat16, 2047, grouped,
                                                      device="cuda")
    check_compact(layout, inputs, reference, options, decode_attention)


@pytest.mark.gpu
def test_gpu_captured_call_replays_with_an_advanced_length():
    inputs, options = case(1, 32, 2, 6, 128, 512, 40, torch.bfloat16, None, None, False, False, "cuda")
    inputs["length"].fill_(300)
    replay = {k: v.clone() for k, v in inputs.items()}
    decode_attention(**replay, **options)  # warm-up (compiles the kernels)
    replay = {k: v.clone() for k, v in inputs.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(**replay, **options)
    eager = {k: v.clone() for k, v in inputs.items()}
    for n in (300, 301, 302):
        replay["length"].fill_(n)
        graph.replay()
        eager["length"].fill_(n)
        want = decode_attention(**eager, **options)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(replay["k_cache"], eager["k_cache"], atol=0, rtol=0)
