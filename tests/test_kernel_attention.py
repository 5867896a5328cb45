"""fastgrpo.kernels.attention against a float64 reference (SDPA's CPU flash kernel here, cuDNN's on CUDA), and its
kept outputs: inside a recording frame the op keeps (output, log-sum-exp); in the frame's re-run it returns them
without running the kernel, and computes where nothing was kept."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels import attention as attention_kernel
from fastgrpo.kernels._dispatch import KeptOutputs, keeping_outputs
from fastgrpo.kernels.attention import attention

# Relative to the largest reference magnitude.
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def reference(query, key, value, visible, scale, grad):
    """float64 attention with `visible` [B or 1, 1, S, S_k] (True: may attend); output and d(query, key, value).
    Rows with no visible key are left out of the comparison by the caller."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys, values = (t.repeat_interleave(group, 1) for t in (k, v))
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~visible.cpu(), float("-inf"))
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ values
    out.backward(grad.cpu().double())
    return [out.detach(), q.grad, k.grad, v.grad]


def make_case(batch, heads, kv_heads, length, dim, dtype, device, transposed, mask_kind, seed=0):
    """q, k, v ([B, h, S, D]; with `transposed` views of [B, S, h, D], as HF's projections make them), the output's
    gradient, the mask the op gets and the visibility it means."""
    gen = torch.Generator().manual_seed(seed)

    def make(h):
        if transposed:
            return torch.randn(batch, length, h, dim, generator=gen).to(dtype).transpose(1, 2).to(device)
        return torch.randn(batch, h, length, dim, generator=gen).to(dtype).to(device)

    q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    visible = causal.expand(batch, 1, length, length).clone()
    for row in range(batch):  # left padding of the row's first `row` positions, as a padded GRPO batch has
        visible[row, :, :, :row] = False
        visible[row, :, :row, :] = torch.eye(length, dtype=torch.bool)[:row]  # padding queries see themselves
    mask = {"causal": None, "bool": visible,
            "additive": torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).to(dtype)}[mask_kind]
    if mask_kind == "causal":
        visible = causal.expand(batch, 1, length, length)
    mask = None if mask is None else mask.to(device)
    return q, k, v, make(heads).detach(), mask, visible


def check(batch, heads, kv_heads, length, dim, dtype, scale, mask_kind, transposed, device="cpu"):
    q, k, v, grad, mask, visible = make_case(batch, heads, kv_heads, length, dim, dtype, device, transposed, mask_kind)
    out = attention(q, k, v, attn_mask=mask, is_causal=mask_kind == "causal", scale=scale,
                    enable_gqa=heads != kv_heads)
    out.backward(grad)
    expected = reference(q, k, v, visible, scale, grad)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected):
        assert got.dtype == dtype and got.shape == want.shape, name
        error = (got.detach().cpu().double() - want).abs().max().item()
        assert error <= TOL[dtype] * max(want.abs().max().item(), 1.0), f"{name}: max abs error {error:.3e}"


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    length=st.integers(1, 24),
    dim=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    scale=st.sampled_from([None, 0.3]),
    mask_kind=st.sampled_from(["causal", "bool", "additive"]),
    transposed=st.booleans(),
)
def test_cpu_matches_float64_reference(batch, kv_heads, group, length, dim, dtype, scale, mask_kind, transposed):
    check(batch, kv_heads * group, kv_heads, length, dim, dtype, scale, mask_kind, transposed)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (4, 4, 64), (8, 2, 80)])
def test_cuda_matches_float64_reference(heads, kv_heads, dim, mask_kind):
    for dtype in (torch.bfloat16, torch.float16):
        check(3, heads, kv_heads, 200, dim, dtype, None, mask_kind, transposed=True, device="cuda")


@pytest.mark.gpu
def test_cuda_equals_sdpa_on_cudnn():
    """The op is the kernel SDPA runs: output, dk and dv equal SDPA's on cuDNN exactly; dq within a bf16 rounding,
    as cuDNN's backward does not give the same dq twice (H200, torch 2.11, 2026-12-01: SDPA against itself, 2-3
    of its 921,600 elements differed by one bf16 step in each of 3 runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, grad, mask, _ = make_case(2, 12, 2, 300, 128, torch.bfloat16, "cuda", True, "bool")
    results = []
    for fn in (attention, F.scaled_dot_product_attention):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = fn(q, k, v, attn_mask=mask, enable_gqa=True)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    (out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv) = results
    for got, want in ((out, want_out), (dk, want_dk), (dv, want_dv)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(dq, want_dq, rtol=2**-7, atol=2**-7 * want_dq.abs().max().item())


class ListFrame(KeptOutputs):
    """A frame that keeps in a list (what fastgrpo.compiler.offload does in host memory)."""

    def __init__(self):
        self.kept, self.position = [], 0

    def keep(self, tensors):
        self.kept.append(tensors)

    def replay(self):
        if self.position >= len(self.kept):
            return None
        self.position += 1
        return self.kept[self.position - 1]


def test_kept_outputs_are_replayed_instead_of_computed(monkeypatch):
    q, k, v, grad, mask, _ = make_case(2, 4, 2, 9, 8, torch.float32, "cpu", True, "bool")
    calls = []
    kernel = attention_kernel._kernel_forward
    monkeypatch.setattr(attention_kernel, "_kernel_forward", lambda *a: calls.append(1) or kernel(*a))
    frame = ListFrame()
    with keeping_outputs(frame):
        first = attention(q, k, v, attn_mask=mask, enable_gqa=True)
        first_grads = torch.autograd.grad(first, (q, k, v), grad)
    assert len(calls) == 1 and len(frame.kept) == 1 and frame.kept[0][0] is not None
    frame.recording = False
    with keeping_outputs(frame):
        replayed = attention(q, k, v, attn_mask=mask, enable_gqa=True)  # what the checkpoint's re-run does
        replayed_grads = torch.autograd.grad(replayed, (q, k, v), grad)
        assert len(calls) == 1  # the kernel did not run again
        computed = attention(q, k, v, attn_mask=mask, enable_gqa=True)  # nothing more was kept: it computes
    assert len(calls) == 2
    for got, want in zip([replayed, *replayed_grads, computed], [first, *first_grads, first]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refuses_dropout_and_mismatched_heads():
    q, k, v, *_ = make_case(1, 4, 2, 5, 8, torch.float32, "cpu", False, "causal")
    with pytest.raises(ValueError, match="dropout"):
        attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attention(q, k, v)


def test_compiles_in_one_graph_with_gradients():
    q, k, v, grad, mask, _ = make_case(2, 4, 2, 7, 8, torch.float32, "cpu", True, "bool")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), grad),
                               torch.autograd.grad(expected, (q, k, v), grad))
