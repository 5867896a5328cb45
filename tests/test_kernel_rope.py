"""fastgrpo::rope against float64 references and HF's own RoPE code (torch path and Triton path)."""
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.rope import rope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the largest reference magnitude; a wrong sign or channel pairing is off by O(1).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def path_ctx(path):
    """"torch": CPU torch implementation; "triton": Triton kernels through the interpreter on CPU
    tensors; "cuda": CUDA tensors (Triton kernels compiled for the GPU)."""
    return triton_on_cpu() if path == "triton" else contextlib.nullcontext()


def ref_rope(x, cos, sin, rotary_dim, interleaved):
    """float64 reference written from the layouts' definitions."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.empty_like(rot)
        out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 0::2]
        out[..., 1::2] = x2 * cos[..., 1::2] + x1 * sin[..., 1::2]
    else:
        half = rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1)


def assert_close(actual, expected, dtype, what):
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1.0)
    assert err <= TOL[dtype] * scale, f"{what}: max abs err {err:.3e} > {TOL[dtype]} * {scale:.3e}"


def make_case(batch, seq, n_kv, group, head_dim, rotary_dim, offset, cos_batch, dtype, cos_dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_q = n_kv * group
    # HF layout: projections [B, S, H, D] transposed to [B, H, S, D] (non-contiguous views).
    q = torch.randn(batch, seq, n_q, head_dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, n_kv, head_dim, generator=gen).to(dtype).transpose(1, 2)
    # cos/sin rows taken from a larger table at a position offset, as with a KV prefix.
    table = torch.randn(cos_batch, offset + seq + 3, rotary_dim, 2, generator=gen).to(cos_dtype)
    cos = table[:, offset:offset + seq, :, 0].unsqueeze(1)
    sin = table[:, offset:offset + seq, :, 1].unsqueeze(1)
    return [t.to(device) for t in (q, k, cos, sin)]


def check_case(q, k, cos, sin, rotary_dim, interleaved, path, seed=1):
    dtype = q.dtype
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    with path_ctx(path):
        q_out, k_out = rope(q, k, cos, sin, rotary_dim, interleaved)
    out_dtype = torch.promote_types(dtype, cos.dtype)
    assert q_out.dtype == out_dtype and k_out.dtype == out_dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    cos64, sin64 = cos.double(), sin.double()
    if not interleaved and 2 * cos.shape[-1] == rotary_dim:  # the first half given, standing for both
        cos64, sin64 = torch.cat((cos64, cos64), -1), torch.cat((sin64, sin64), -1)
    ref_q = ref_rope(q64, cos64, sin64, rotary_dim, interleaved)
    ref_k = ref_rope(k64, cos64, sin64, rotary_dim, interleaved)
    assert_close(q_out, ref_q, out_dtype, "q_out")
    assert_close(k_out, ref_k, out_dtype, "k_out")
    # Gradients arrive non-contiguous (here: transposes of [B, S, H, D] buffers).
    gen = torch.Generator().manual_seed(seed)

    def transposed_grad(x):
        shape = (*x.shape[:-3], x.shape[-2], x.shape[-3], x.shape[-1])
        return torch.randn(shape, generator=gen).to(out_dtype).to(x.device).transpose(-3, -2)

    dq, dk = transposed_grad(q), transposed_grad(k)
    with path_ctx(path):
        grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
    ref_gq, ref_gk = torch.autograd.grad((ref_q, ref_k), (q64, k64), (dq.double(), dk.double()))
    assert grad_q.dtype == dtype and grad_k.dtype == dtype
    assert_close(grad_q, ref_gq, dtype, "dq")
    assert_close(grad_k, ref_gk, dtype, "dk")


case = st.fixed_dictionaries(dict(
    batch=st.integers(1, 2),
    seq=st.integers(1, 9),
    n_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    head_dim=st.integers(2, 19),
    rotary_frac=st.floats(0.0, 1.0),
    offset=st.integers(0, 5),
    cos_batch_is_one=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    cos_in_fp32=st.booleans(),
    interleaved=st.booleans(),
    cos_half_width=st.booleans(),
))


def run_case(c, path, device="cpu"):
    even_dims = c["head_dim"] // 2 * 2
    rotary_dim = max(2, int(c["rotary_frac"] * even_dims) // 2 * 2)
    cos_dtype = torch.float32 if c["cos_in_fp32"] else c["dtype"]
    # Half-rotation cos/sin may come as their first half only (the halves repeating).
    cos_dim = rotary_dim // 2 if c["cos_half_width"] and not c["interleaved"] else rotary_dim
    q, k, cos, sin = make_case(c["batch"], c["seq"], c["n_kv"], c["group"], c["head_dim"], cos_dim, c["offset"],
                               1 if c["cos_batch_is_one"] else c["batch"], c["dtype"], cos_dtype, device)
    check_case(q, k, cos, sin, rotary_dim, c["interleaved"], path)


@settings(max_examples=40, deadline=None)
@given(c=case)
def test_rope_torch_path(c):
    run_case(c, "torch")


@settings(max_examples=30, deadline=None)
@given(c=case)
def test_rope_triton_path(c):
    run_case(c, "triton")


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_rope_cos_per_head_and_rank3(path):
    """cos/sin that vary over heads, and 3-d q/k without a batch dim."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 3, 8, generator=gen).transpose(1, 2)
    k = torch.randn(2, 5, 3, 8, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(2, 2, 3, 5, 8, generator=gen).unbind(0)
    check_case(q, k, cos, sin, 8, False, path)
    check_case(q[0], k[0], cos[0, ..., :6], sin[0, ..., :6], 6, True, path)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_rope_matches_hf_in_bf16(path):
    """Literal transformers code (Llama's apply_rotary_pos_emb, Phi3's partial rotary, GPT-J's
    interleaved rotation) in bf16, against the op in bf16."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    gen = torch.Generator().manual_seed(4)
    bf16 = torch.bfloat16
    q = torch.randn(2, 7, 4, 16, generator=gen).to(bf16).transpose(1, 2)
    k = torch.randn(2, 7, 2, 16, generator=gen).to(bf16).transpose(1, 2)
    pos = torch.arange(7, dtype=torch.float32)
    for rotary_dim, hf in ((16, llama_rope), (10, phi3_rope)):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        emb = torch.outer(pos, inv_freq).repeat(1, 2)[None].expand(2, -1, -1)
        cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)
        hf_q, hf_k = hf(q, k, cos, sin)
        with path_ctx(path):
            q_out, k_out = rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1), rotary_dim)
        assert_close(q_out, hf_q, bf16, f"q vs HF rotary_dim={rotary_dim}")
        assert_close(k_out, hf_k, bf16, f"k vs HF rotary_dim={rotary_dim}")
    # GPT-J: [B, S, H, D] with sin/cos [B, S, rd/2] repeated pairwise, rotation on the first 8 channels.
    x = q.transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.outer(pos, inv_freq)[None].expand(2, -1, -1)
    sin, cos = angles.sin().to(bf16), angles.cos().to(bf16)
    hf_x = torch.cat((gptj_rope(x[..., :8], sin, cos), x[..., 8:]), dim=-1)
    cos_full = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    sin_full = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    with path_ctx(path):
        x_out, _ = rope(x, x, cos_full, sin_full, 8, interleaved=True)
    assert_close(x_out, hf_x, bf16, "GPT-J interleaved")


def test_rope_output_layout_follows_input():
    """Outputs keep q/k's memory order (HF's [B, S, H, D] seen as [B, H, S, D]); fake agrees."""
    q, k, cos, sin = make_case(2, 5, 2, 2, 8, 8, 0, 1, torch.float32, torch.float32)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fc, fs = (mode.from_tensor(t) for t in (q, k, cos, sin))
        f_out = torch.ops.fastgrpo.rope(fq, fk, fc, fs, 8, False)
    assert f_out[0].stride() == q_out.stride() and f_out[1].stride() == k_out.stride()


def test_rope_errors():
    q, k, cos, sin = make_case(1, 4, 1, 2, 9, 8, 0, 1, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope(q, k, cos[..., :7], sin[..., :7], 7)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope(q, k, cos, sin, 10)
    with pytest.raises(ValueError, match="does not broadcast"):
        rope(q, k, cos, sin, 6)
    with pytest.raises(ValueError, match="does not broadcast"):
        rope(q, k, cos.expand(1, 3, 4, 8), sin, 8)
    with pytest.raises(TypeError, match="supports float32"):
        rope(q.double(), k, cos, sin)
    with pytest.raises(ValueError, match="no gradient for cos/sin"):
        rope(q, k, cos.clone().requires_grad_(), sin)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_rope_saves_only_cos_sin(path):
    q, k, cos, sin = make_case(2, 6, 2, 3, 16, 16, 2, 1, torch.bfloat16, torch.bfloat16)
    q.requires_grad_()
    k.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), path_ctx(path):
        q_out, k_out = rope(q, k, cos, sin)
    assert len(saved) == 2
    assert {(t.data_ptr(), t.shape) for t in saved} == {(cos.data_ptr(), cos.shape), (sin.data_ptr(), sin.shape)}
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes == 2 * cos.numel() * cos.element_size() < q.numel() * q.element_size()


def test_rope_opcheck():
    q, k, cos, sin = make_case(2, 5, 2, 2, 10, 6, 1, 2, torch.float32, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    torch.library.opcheck(torch.ops.fastgrpo.rope, (q, k, cos, sin, 6, False))
    torch.library.opcheck(torch.ops.fastgrpo.rope, (q, k, cos, sin, 6, True))
    torch.library.opcheck(torch.ops.fastgrpo.rope, (q, k, cos[..., :3], sin[..., :3], 6, False))
    dq = torch.randn(2, 5, 4, 10).transpose(1, 2)
    dk = torch.randn(2, 10, 2, 5).permute(0, 2, 3, 1)
    torch.library.opcheck(torch.ops.fastgrpo.rope_backward,
                          (dq, dk, cos, sin, 6, False, torch.bfloat16, torch.float32))


def test_rope_under_torch_compile():
    """The op as one node under AOTAutograd: forward and backward match eager."""
    q, k, cos, sin = make_case(2, 5, 2, 2, 8, 8, 0, 1, torch.float32, torch.float32)
    q.requires_grad_()

    def f(q, k, cos, sin):
        q_out, k_out = rope(q, k, cos, sin)
        return (q_out * 2).sum() + k_out.sum()

    eager = torch.autograd.grad(f(q, k, cos, sin), q)[0]
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, cos, sin), q)[0]
    torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None)
@given(c=case)
def test_rope_cuda(c):
    run_case(c, "cuda", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,n_kv,interleaved,cos_dim", [(12, 2, False, 128), (12, 2, False, 64), (32, 8, False, 128),
                                                          (32, 8, True, 128), (64, 8, False, 128), (64, 8, False, 64)])
def test_rope_cuda_model_shapes(n_q, n_kv, interleaved, cos_dim):
    # 64 q heads (Llama-70B) take the kernel's loop over head blocks; the others load q and k in one block each.
    # cos_dim 64: cos/sin given as their first half.
    tensors = make_case(2, 333, n_kv, n_q // n_kv, 128, cos_dim, 7, 2, torch.bfloat16, torch.bfloat16, device="cuda")
    check_case(*tensors, 128, interleaved, "cuda")
