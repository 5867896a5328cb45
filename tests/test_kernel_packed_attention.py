"""fastgrpo.kernels.packed_attention against a float64 reference: causal attention over a dense block-diagonal mask
(the torch path on CPU, flash's variable-length kernel on CUDA), and over shared prompts: each completion's key
segment the prompt's keys followed by its own, gathered, against the mask of the packed sequence."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels.packed_attention import FLASH_TAKES_WINDOW, flash_refusal, packed_attention

# Relative to the largest reference magnitude; attention confined to the wrong rows is off by O(1).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def block_diagonal(lengths, window=None):
    """[T, T] a key of the same segment at or before the query (and fewer than `window` positions back)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = segment.numel()
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(total, total, dtype=torch.bool).triu(1 - window)
    return allowed


def reference(query, key, value, lengths, scale, grad, window=None, allowed=None):
    """float64 attention of the whole packed sequence under `allowed` (default: `block_diagonal`); output and
    d(query, key, value)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (query, key, value))
    if allowed is None:
        allowed = block_diagonal(lengths, window)
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys, values = (t.repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    scores = (q.transpose(0, 1) @ keys.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    out.backward(grad.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def make_case(lengths, heads, kv_heads, dim, dtype, device, transposed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def make(h):
        if transposed:  # [T, h, D] as a view of [h, T, D]: a token's heads are not adjacent
            return torch.randn(h, total, dim, generator=gen).to(dtype).transpose(0, 1).to(device)
        return torch.randn(total, h, dim, generator=gen).to(dtype).to(device)

    q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + lengths).cumsum(0).to(device, torch.int32)
    return q, k, v, make(heads).detach(), cu


def check(lengths, heads, kv_heads, dim, dtype, scale, device="cpu", transposed=False, window=None):
    q, k, v, grad, cu = make_case(lengths, heads, kv_heads, dim, dtype, device, transposed)
    out = packed_attention(q, k, v, cu, max(lengths), scale, window)
    out.backward(grad)
    assert_close_to_reference([out, q.grad, k.grad, v.grad],
                              reference(q.cpu(), k.cpu(), v.cpu(), lengths, scale, grad.cpu(), window), dtype)


def assert_close_to_reference(got, expected, dtype):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert a.dtype == dtype and a.shape == b.shape, name
        error = (a.detach().cpu().double() - b).abs().max().item()
        assert error <= TOL[dtype] * max(b.abs().max().item(), 1.0), f"{name}: max abs error {error:.3e}"


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([8, 12, 16]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([None, 0.3]),
    transposed=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 30)),
)
def test_torch_path_matches_float64_reference(lengths, kv_heads, group, dim, dtype, scale, transposed, window):
    check(lengths, kv_heads * group, kv_heads, dim, dtype, scale, transposed=transposed, window=window)


def shared_prompt_case(groups, window):
    """Packed [prompt, c1, ..., cG] per group of (prompt length, completion lengths): the query and key lengths of
    the segments (the prompt, then each non-empty completion), the gather of their keys (a completion's: its
    prompt's, then its own) and the packed sequence's mask (a key of the group at or before the query, in the
    query's segment or the prompt, fewer than `window` positions back)."""
    query_lengths, key_lengths, gather, group_of, segment_of, position_of, is_prompt = [], [], [], [], [], [], []
    for g, (prompt, completions) in enumerate(groups):
        prompt_keys = list(range(len(group_of), len(group_of) + prompt))
        for i, n in enumerate([prompt, *completions]):
            own = list(range(len(group_of), len(group_of) + n))
            group_of += [g] * n
            segment_of += [i] * n
            position_of += list(range(prompt, prompt + n)) if i else list(range(n))
            is_prompt += [i == 0] * n
            if n:
                keys = own if i == 0 else prompt_keys + own
                query_lengths.append(n)
                key_lengths.append(len(keys))
                gather += keys
    q, kv = torch.arange(len(group_of))[:, None], torch.arange(len(group_of))[None, :]
    group_id, segment, position = (torch.tensor(x) for x in (group_of, segment_of, position_of))
    allowed = (group_id[q] == group_id[kv]) & (kv <= q) & ((segment[q] == segment[kv]) | torch.tensor(is_prompt)[kv])
    if window is not None:
        allowed &= position[q] - position[kv] < window
    return query_lengths, key_lengths, torch.tensor(gather), allowed


@settings(max_examples=30, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(0, 10), min_size=1, max_size=4)),
                    min_size=1, max_size=3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    window=st.one_of(st.none(), st.integers(1, 16)),
)
def test_shared_prompt_segments_match_the_packed_mask(groups, kv_heads, group, dtype, window):
    check_shared(groups, kv_heads * group, kv_heads, 8, dtype, window)


def check_shared(groups, heads, kv_heads, dim, dtype, window, device="cpu"):
    query_lengths, key_lengths, gather, allowed = shared_prompt_case(groups, window)
    q, k, v, grad, _ = make_case([allowed.shape[0]], heads, kv_heads, dim, dtype, device, transposed=True)
    cu_q, cu_k = (torch.tensor([0] + lengths).cumsum(0).to(device, torch.int32) for lengths in (query_lengths, key_lengths))
    gather = gather.to(device)
    out = packed_attention(q, k.index_select(0, gather), v.index_select(0, gather), cu_q, max(query_lengths), None,
                           window, cu_k, max(key_lengths))
    out.backward(grad)
    assert_close_to_reference([out, q.grad, k.grad, v.grad],
                              reference(q.cpu(), k.cpu(), v.cpu(), None, None, grad.cpu(), allowed=allowed), dtype)


def test_compiles_in_one_graph_with_gradients():
    # The torch path is a custom op with a fake: Dynamo and AOTAutograd trace it without a graph break, forward and
    # backward (the packed decoder layers compile with it inside).
    lengths = [5, 1, 9]
    q, k, v, grad, cu = make_case(lengths, 4, 2, 8, torch.float32, "cpu", transposed=True)
    eager = packed_attention(q, k, v, cu, 9)
    eager.backward(grad)
    expected = [eager.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(packed_attention, backend="aot_eager", fullgraph=True)(q, k, v, cu, 9)
    compiled.backward(grad)
    for a, b in zip([compiled.detach()] + [t.grad for t in (q, k, v)], expected):
        torch.testing.assert_close(a, b)


def test_runs_in_the_autocast_dtype_like_sdpa():
    # HF's RoPE turns bf16 projections into fp32 q and k (fp32 cos/sin): under autocast attention runs in its dtype.
    lengths = [3, 8]
    q, k, v, grad, cu = make_case(lengths, 4, 2, 8, torch.float32, "cpu", transposed=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = packed_attention(q, k, v, cu, 8)
    assert out.dtype == torch.bfloat16
    out.backward(grad.bfloat16())
    expected = reference(q, k, v, lengths, None, grad)
    for a, b in zip([out, q.grad, k.grad, v.grad], expected):
        assert (a.detach().double() - b).abs().max() <= TOL[torch.bfloat16] * max(b.abs().max().item(), 1.0)
    assert q.grad.dtype == torch.float32


def test_bad_layout_or_window_is_refused_with_what_is_expected():
    q = torch.randn(1, 4, 6, 8)  # the [B, heads, T, D] of an attention call, not [T, heads, D]
    with pytest.raises(ValueError, match=r"takes q \[T, heads, D\]"):
        packed_attention(q, q, q, torch.tensor([0, 6], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="at least the query itself"):
        packed_attention(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32), 4, window=0)


def test_flash_refusals_name_the_reason():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flash_refusal(cuda, torch.bfloat16, 128, 12, 2) is None
    assert "CUDA only" in flash_refusal(cpu, torch.bfloat16, 128, 12, 2)
    assert "float16 or bfloat16" in flash_refusal(cuda, torch.float32, 128, 12, 2)
    assert "multiples of 8 up to 256" in flash_refusal(cuda, torch.bfloat16, 260, 12, 2)
    assert "not a multiple" in flash_refusal(cuda, torch.bfloat16, 64, 12, 5)
    assert (flash_refusal(cuda, torch.bfloat16, 128, 12, 2, window=512) is None) == FLASH_TAKES_WINDOW


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (4, 4, 64), (8, 1, 96)])
def test_cuda_flash_matches_float64_reference(dtype, heads, kv_heads, dim):
    for lengths, transposed in (([1, 130, 7, 300, 64], True), ([257], False)):
        check(lengths, heads, kv_heads, dim, dtype, None, device="cuda", transposed=transposed)
    for window in (1, 64):  # sliding windows (a Gemma3 layer's): one key, and a window shorter than two of the rows
        check([1, 130, 7, 300, 64], heads, kv_heads, dim, dtype, None, device="cuda", window=window)
    # Shared prompts: completions whose keys start with their prompt's (flash aligns the two at their ends).
    for window in (None, 1, 100):
        check_shared([(200, [1, 0, 150, 300]), (5, [70])], heads, kv_heads, dim, dtype, window, device="cuda")


@pytest.mark.gpu
def test_cuda_flash_op_keeps_its_outputs_for_the_re_run(monkeypatch):
    """On CUDA the op is flash's kernel with flash's backward: output, dk and dv equal torch's own autograd through
    `aten._flash_attention_forward` exactly, dq within a bf16 step (flash accumulates dq with atomics). Inside a
    checkpointed call it keeps (output, log-sum-exp), and the re-run takes them back without running the kernel."""
    from fastgrpo.kernels import packed_attention as packed_module
    from fastgrpo.kernels._dispatch import keeping_outputs
    from tests.test_kernel_attention import ListFrame

    lengths = [1, 130, 7, 300, 64]
    q, k, v, grad, cu = make_case(lengths, 12, 2, 128, torch.bfloat16, "cuda", True)
    want = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max(lengths), max(lengths), 0.0, True, False)[0]
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    calls = []
    kernel = packed_module._flash_forward
    monkeypatch.setattr(packed_module, "_flash_forward", lambda *a: calls.append(1) or kernel(*a))
    frame = ListFrame()
    with keeping_outputs(frame):
        first = packed_attention(q, k, v, cu, max(lengths))
        first_grads = torch.autograd.grad(first, (q, k, v), grad)
    frame.recording = False
    with keeping_outputs(frame):
        replayed = packed_attention(q, k, v, cu, max(lengths))
        replayed_grads = torch.autograd.grad(replayed, (q, k, v), grad)
    assert len(calls) == 1 and len(frame.kept) == 1
    for got in ((first, *first_grads), (replayed, *replayed_grads)):
        for i in (0, 2, 3):
            torch.testing.assert_close(got[i], (want, *want_grads)[i], rtol=0, atol=0)
        dq, want_dq = got[1], want_grads[0]
        torch.testing.assert_close(dq, want_dq, rtol=2**-7, atol=2**-7 * want_dq.abs().max().item())


def test_flash_op_traces_forward_and_backward_with_symbolic_sizes():
    """The flash op's fake and its backward trace on any machine (the kernels run on CUDA only): forward the op
    itself (opaque to the compiler, so that it can keep its outputs), backward flash's own backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, _, cu = make_case([5, 15], 4, 2, 32, torch.bfloat16, "cpu", False)

    def step(q, k, v, cu):
        out, lse = torch.ops.fastgrpo.flash_packed_attention(q, k, v, cu, cu, 15, 15, None, None, True)
        return out, lse, torch.autograd.grad(out.float().sum(), (q, k, v))

    gm = make_fx(step, tracing_mode="symbolic")(q, k, v, cu)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"fastgrpo.flash_packed_attention.default", "aten._flash_attention_backward.default"} <= targets
    (op,) = [n for n in gm.graph.nodes if str(n.target) == "fastgrpo.flash_packed_attention.default"]
    out, lse = op.meta["val"]
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
