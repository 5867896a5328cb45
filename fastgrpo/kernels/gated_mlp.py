"""Gated MLP (SwiGLU / GeGLU) up to the down projection, saving only x for backward.

    torch.ops.fastgrpo.gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                 lora_scale, activation) -> h
    torch.ops.fastgrpo.act_mul(gate, up, activation) -> h

gated_mlp matches HF + PEFT (vanilla LoRA, no dropout):
    g = x @ w_gate.T                                      (x.dtype)
    g = (g + (x.to(A.dtype) @ A.T @ B.T) * lora_scale).to(x.dtype)     if the gate has LoRA
    u likewise with w_up and the up factors
    h = act(g) * u                                        (fp32 maths, rounded once to x.dtype)
x [..., H]; w_gate, w_up [I, H] (row slices of a fused [2I, H] gate_up weight are recognised
and multiplied as one matrix); LoRA A [r, H], B [I, r] in PEFT's layout, often fp32 beside a
bf16 base; activation "silu" or "gelu_tanh" (Gemma's gelu_pytorch_tanh).
LoRA dropout is not supported (dropout on x would have to be saved or replayed): the FX pass
leaves such sites unfused.

Backward saves only x (weights and LoRA factors are kept by reference and cost no memory),
recomputes g and u with cuBLAS, and gets dg, du from one Triton kernel that also recomputes the
LoRA terms and accumulates dL/d(x A^T) on the fly; no [tokens x intermediate] tensor outlives
the forward. Weight gradients are produced only for inputs that require them.

Forward and backward walk the rows of x in chunks (rows_per_chunk(): a chunk's g/u buffer is
about 256 MiB), so apart from h and dh no [tokens x intermediate] temporary exists at any time:
the working set stays fixed as the context grows. Each chunk writes its rows of h or dx; weight
and LoRA gradients are summed over chunks in fp32 accumulators, in chunk order (deterministic,
and independent of the chunk size up to fp32 summation order), and rounded once at the end.

act_mul is the fallback when the matmuls cannot be taken over: h = act(gate) * up, saving gate
and up and recomputing the activation in backward (as Liger does).

Matmuls: cuBLAS (torch.mm). Triton: the act*mul forward, its backward (dg, du and the LoRA
x-side gradient from dh, g, u), and the LoRA B gradient dB = scale * dg^T (x A^T).
"""
import torch
import triton
import triton.language as tl

from fastgrpo.kernels import _dispatch

_ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_COEF = 0.044715
# The same for the Triton kernels: a compiled @triton.jit function may read only constexpr globals
# (the interpreter accepts plain floats, the CUDA compiler refuses them).
_TL_SQRT_2_OVER_PI = tl.constexpr(_SQRT_2_OVER_PI)
_TL_GELU_COEF = tl.constexpr(_GELU_COEF)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """act(g) and act'(g) in fp32; ACT 0 = silu, 1 = tanh-approximated gelu."""
    if ACT == 0:
        sig = tl.sigmoid(g)
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    else:
        z = _TL_SQRT_2_OVER_PI * (g + _TL_GELU_COEF * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * z) - 1.0  # tanh(z)
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _TL_SQRT_2_OVER_PI * (1.0 + 3.0 * _TL_GELU_COEF * g * g)
    return a, da


@triton.jit
def _add_lora(base, xa_ptr, xa_s0, b_ptr, b_s0, b_s1, rank, scale, offs_m, offs_n, m_ok, n_ok,
              BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """PEFT's (base + (xa @ B^T) * scale).to(base dtype), with the adapter-dtype roundings PEFT does."""
    r = tl.arange(0, BLOCK_R)
    xa = tl.load(xa_ptr + offs_m[:, None] * xa_s0 + r[None, :], mask=m_ok[:, None] & (r[None, :] < rank), other=0.0)
    bt = tl.load(b_ptr + r[:, None] * b_s1 + offs_n[None, :] * b_s0, mask=(r[:, None] < rank) & n_ok[None, :], other=0.0)
    lora_dtype = b_ptr.dtype.element_ty
    lora = tl.dot(xa.to(tl.float32), bt.to(tl.float32), input_precision=DOT_PRECISION)
    lora = lora.to(lora_dtype).to(tl.float32)
    lora = (lora * scale).to(lora_dtype).to(tl.float32)
    return base + lora


@triton.jit
def _act_mul_fwd_kernel(
    g_ptr, u_ptr, h_ptr, xag_ptr, bg_ptr, xau_ptr, bu_ptr,
    n_rows, n_cols, rank_g, rank_u, scale,
    g_s0, u_s0, h_s0, xag_s0, bg_s0, bg_s1, xau_s0, bu_s0, bu_s1,
    ACT: tl.constexpr, LORA_G: tl.constexpr, LORA_U: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RG: tl.constexpr, BLOCK_RU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < n_rows
    n_ok = offs_n < n_cols
    mask = m_ok[:, None] & n_ok[None, :]
    g = tl.load(g_ptr + offs_m[:, None] * g_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_m[:, None] * u_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if LORA_G:
        g = _add_lora(g, xag_ptr, xag_s0, bg_ptr, bg_s0, bg_s1, rank_g, scale, offs_m, offs_n, m_ok, n_ok,
                      BLOCK_RG, DOT_PRECISION)
        g = g.to(g_ptr.dtype.element_ty).to(tl.float32)
    if LORA_U:
        u = _add_lora(u, xau_ptr, xau_s0, bu_ptr, bu_s0, bu_s1, rank_u, scale, offs_m, offs_n, m_ok, n_ok,
                      BLOCK_RU, DOT_PRECISION)
        u = u.to(u_ptr.dtype.element_ty).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(h_ptr + offs_m[:, None] * h_s0 + offs_n[None, :], (a * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_bwd_kernel(
    dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, xag_ptr, bg_ptr, xau_ptr, bu_ptr, dxag_ptr, dxau_ptr,
    n_rows, n_cols, cols_per_split, rank_g, rank_u, scale,
    dh_s0, g_s0, u_s0, dg_s0, du_s0, xag_s0, bg_s0, bg_s1, xau_s0, bu_s0, bu_s1,
    ACT: tl.constexpr, LORA_G: tl.constexpr, LORA_U: tl.constexpr,
    DXA_G: tl.constexpr, DXA_U: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RG: tl.constexpr, BLOCK_RU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Rows of one block, columns [split * cols_per_split, ...) walked in BLOCK_N chunks, so the
    # LoRA x-side gradient (dg @ B_g) sums over those columns in registers; the few column
    # splits are added on the host. dg/du may overwrite g/u: each element is read before it
    # is written by the same program.
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = offs_m < n_rows
    col_start = split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, n_cols)
    rg = tl.arange(0, BLOCK_RG)
    ru = tl.arange(0, BLOCK_RU)
    acc_g = tl.zeros((BLOCK_M, BLOCK_RG), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_RU), dtype=tl.float32)
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < col_end
        mask = m_ok[:, None] & n_ok[None, :]
        dh = tl.load(dh_ptr + offs_m[:, None] * dh_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs_m[:, None] * g_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs_m[:, None] * u_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if LORA_G:
            g = _add_lora(g, xag_ptr, xag_s0, bg_ptr, bg_s0, bg_s1, rank_g, scale, offs_m, offs_n, m_ok, n_ok,
                          BLOCK_RG, DOT_PRECISION)
            g = g.to(g_ptr.dtype.element_ty).to(tl.float32)
        if LORA_U:
            u = _add_lora(u, xau_ptr, xau_s0, bu_ptr, bu_s0, bu_s1, rank_u, scale, offs_m, offs_n, m_ok, n_ok,
                          BLOCK_RU, DOT_PRECISION)
            u = u.to(u_ptr.dtype.element_ty).to(tl.float32)
        a, da = _act_and_grad(g, ACT)
        dg = (dh * u * da).to(dg_ptr.dtype.element_ty)
        du = (dh * a).to(du_ptr.dtype.element_ty)
        tl.store(dg_ptr + offs_m[:, None] * dg_s0 + offs_n[None, :], dg, mask=mask)
        tl.store(du_ptr + offs_m[:, None] * du_s0 + offs_n[None, :], du, mask=mask)
        if DXA_G:
            b = tl.load(bg_ptr + offs_n[:, None] * bg_s0 + rg[None, :] * bg_s1,
                        mask=n_ok[:, None] & (rg[None, :] < rank_g), other=0.0)
            acc_g += tl.dot(dg.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
        if DXA_U:
            b = tl.load(bu_ptr + offs_n[:, None] * bu_s0 + ru[None, :] * bu_s1,
                        mask=n_ok[:, None] & (ru[None, :] < rank_u), other=0.0)
            acc_u += tl.dot(du.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    if DXA_G:
        out = dxag_ptr + (split * n_rows + offs_m[:, None]) * rank_g + rg[None, :]
        tl.store(out, acc_g * scale, mask=m_ok[:, None] & (rg[None, :] < rank_g))
    if DXA_U:
        out = dxau_ptr + (split * n_rows + offs_m[:, None]) * rank_u + ru[None, :]
        tl.store(out, acc_u * scale, mask=m_ok[:, None] & (ru[None, :] < rank_u))


@triton.jit
def _lora_b_grad_kernel(
    dg_ptr, xa_ptr, part_ptr, n_rows, n_cols, rows_per_split, rank, scale,
    dg_s0, xa_s0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # part[split, n, :] = scale * sum over this split's rows m of dg[m, n] * xa[m, :]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    n_ok = offs_n < n_cols
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, n_rows)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = offs_m < row_end
        dg = tl.load(dg_ptr + offs_m[:, None] * dg_s0 + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        xa = tl.load(xa_ptr + offs_m[:, None] * xa_s0 + r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(tl.trans(dg.to(tl.float32)), xa.to(tl.float32), input_precision=DOT_PRECISION)
    out = part_ptr + (split * n_cols + offs_n[:, None]) * rank + r[None, :]
    tl.store(out, acc * scale, mask=n_ok[:, None] & r_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Host side. "lora" below is None or a pair (xa [N, r] = x.to(A.dtype) @ A^T, B [I, r]).


def _dot_precision(t: torch.Tensor) -> str:
    # The in-kernel LoRA products stand in for PEFT's fp32 matmuls: 3-pass TF32 (about fp32
    # accuracy) on GPUs, plain fp32 in the interpreter.
    return "tf32x3" if _dispatch.launch_like_cuda(t) else "ieee"


def _block_r(lora) -> int:
    return max(16, triton.next_power_of_2(lora[1].shape[1])) if lora is not None else 16


def _lora_args(lora, like):
    if lora is None:
        return like, like, 0, 0, 0, 0  # never read: the LORA_* flag is off
    xa, b = lora
    return xa, b, b.shape[1], xa.stride(0), b.stride(0), b.stride(1)


def _act_mul_blocks(g: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the act_mul kernels. On CUDA, 64 x 128 tiles of 2-byte g/u; fp32 tiles
    half as wide, or the backward's pipelined loads of dh, g and u (3 stages) need 304 KB of shared memory
    (an H200 has 227 KB per block)."""
    if _dispatch.launch_like_cuda(g):
        return 64, (128 if g.element_size() <= 2 else 64), 8
    return min(max(triton.next_power_of_2(g.shape[0]), 16), 64), 128, 4


def _act_mul_fwd_triton(g, u, h, lora_g, lora_u, scale, act):
    """Writes act(g) * u into h ([N, I], unit column stride; may be a row slice of a larger h)."""
    n_rows, n_cols = g.shape
    if n_rows == 0:
        return
    block_m, block_n, num_warps = _act_mul_blocks(g)
    xag, bg, rank_g, xag_s0, bg_s0, bg_s1 = _lora_args(lora_g, g)
    xau, bu, rank_u, xau_s0, bu_s0, bu_s1 = _lora_args(lora_u, g)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    _act_mul_fwd_kernel[grid](
        g, u, h, xag, bg, xau, bu,
        n_rows, n_cols, rank_g, rank_u, scale,
        g.stride(0), u.stride(0), h.stride(0), xag_s0, bg_s0, bg_s1, xau_s0, bu_s0, bu_s1,
        ACT=_ACTIVATIONS.index(act), LORA_G=lora_g is not None, LORA_U=lora_u is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_RG=_block_r(lora_g), BLOCK_RU=_block_r(lora_u),
        DOT_PRECISION=_dot_precision(g), num_warps=num_warps,
    )


def _act_mul_bwd_triton(dh, g, u, dg, du, lora_g, lora_u, scale, act, need_dxa_g, need_dxa_u):
    """Writes dg, du (may alias g, u); returns dL/d(xa) per LoRA factor (fp32 [N, r]) or None."""
    n_rows, n_cols = g.shape
    if n_rows == 0:
        return (torch.zeros(0, lora_g[1].shape[1], device=g.device) if need_dxa_g else None,
                torch.zeros(0, lora_u[1].shape[1], device=g.device) if need_dxa_u else None)
    block_m, block_n, num_warps = _act_mul_blocks(g)
    n_row_blocks = triton.cdiv(n_rows, block_m)
    n_col_blocks = triton.cdiv(n_cols, block_n)
    if need_dxa_g or need_dxa_u:
        # Column splits only to fill the GPU; each adds one fp32 [N, r] partial.
        target = 4 * _dispatch.multiprocessor_count(g.device) if _dispatch.launch_like_cuda(g) else 1
        n_splits = min(n_col_blocks, triton.cdiv(target, n_row_blocks))
    else:
        n_splits = n_col_blocks
    cols_per_split = triton.cdiv(n_col_blocks, n_splits) * block_n
    n_splits = triton.cdiv(n_cols, cols_per_split)
    xag, bg, rank_g, xag_s0, bg_s0, bg_s1 = _lora_args(lora_g, g)
    xau, bu, rank_u, xau_s0, bu_s0, bu_s1 = _lora_args(lora_u, g)
    dxag = torch.empty(n_splits, n_rows, rank_g, dtype=torch.float32, device=g.device) if need_dxa_g else g
    dxau = torch.empty(n_splits, n_rows, rank_u, dtype=torch.float32, device=g.device) if need_dxa_u else g
    _act_mul_bwd_kernel[(n_row_blocks, n_splits)](
        dh, g, u, dg, du, xag, bg, xau, bu, dxag, dxau,
        n_rows, n_cols, cols_per_split, rank_g, rank_u, scale,
        dh.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0),
        xag_s0, bg_s0, bg_s1, xau_s0, bu_s0, bu_s1,
        ACT=_ACTIVATIONS.index(act), LORA_G=lora_g is not None, LORA_U=lora_u is not None,
        DXA_G=need_dxa_g, DXA_U=need_dxa_u,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_RG=_block_r(lora_g), BLOCK_RU=_block_r(lora_u),
        DOT_PRECISION=_dot_precision(g), num_warps=num_warps,
    )
    return (dxag.sum(0) if need_dxa_g else None, dxau.sum(0) if need_dxa_u else None)


def _lora_b_grad_triton(dg, xa, scale):
    """scale * dg^T @ xa in fp32: [I, r], from bf16/fp16/fp32 dg without an fp32 copy of it."""
    n_rows, n_cols = dg.shape
    rank = xa.shape[1]
    if n_rows == 0:
        return torch.zeros(n_cols, rank, dtype=torch.float32, device=dg.device)
    block_r = max(16, triton.next_power_of_2(rank))
    if _dispatch.launch_like_cuda(dg):
        block_m, block_n, num_warps = 64, 128, 8
        n_col_blocks = triton.cdiv(n_cols, block_n)
        target = 4 * _dispatch.multiprocessor_count(dg.device)
        n_splits = max(1, min(triton.cdiv(n_rows, block_m), triton.cdiv(target, n_col_blocks)))
    else:
        block_m, block_n, num_warps, n_splits = 64, 128, 4, 1
    rows_per_split = triton.cdiv(triton.cdiv(n_rows, n_splits), block_m) * block_m
    n_splits = max(1, triton.cdiv(n_rows, rows_per_split))
    part = torch.zeros(n_splits, n_cols, rank, dtype=torch.float32, device=dg.device)
    _lora_b_grad_kernel[(triton.cdiv(n_cols, block_n), n_splits)](
        dg, xa, part, n_rows, n_cols, rows_per_split, rank, scale, dg.stride(0), xa.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, DOT_PRECISION=_dot_precision(dg), num_warps=num_warps,
    )
    return part.sum(0)


def _act_fp32(g, act):
    if act == "silu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    t = torch.tanh(_SQRT_2_OVER_PI * (g + _GELU_COEF * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_COEF * g * g)


def _add_lora_torch(base, lora, scale):
    xa, b = lora
    return (base + torch.mm(xa, b.t()) * scale).to(base.dtype)


def _act_mul_fwd_torch(g, u, h, lora_g, lora_u, scale, act):
    if lora_g is not None:
        g = _add_lora_torch(g, lora_g, scale)
    if lora_u is not None:
        u = _add_lora_torch(u, lora_u, scale)
    h.copy_(_act_fp32(g.float(), act)[0] * u.float())


def _act_mul_bwd_torch(dh, g, u, dg, du, lora_g, lora_u, scale, act, need_dxa_g, need_dxa_u):
    if lora_g is not None:
        g = _add_lora_torch(g, lora_g, scale)
    if lora_u is not None:
        u = _add_lora_torch(u, lora_u, scale)
    a, da = _act_fp32(g.float(), act)
    dh = dh.float()
    dg.copy_(dh * u.float() * da)
    du.copy_(dh * a)
    dxag = torch.mm(dg.float(), lora_g[1].float()) * scale if need_dxa_g else None
    dxau = torch.mm(du.float(), lora_u[1].float()) * scale if need_dxa_u else None
    return dxag, dxau


def _lora_b_grad_torch(dg, xa, scale):
    return torch.mm(dg.float().t(), xa.float()) * scale


def _act_mul_fwd(g, u, h, lora_g, lora_u, scale, act):
    fn = _act_mul_fwd_triton if _dispatch.use_triton(g) else _act_mul_fwd_torch
    fn(g, u, h, lora_g, lora_u, scale, act)


def _act_mul_bwd(dh, g, u, dg, du, lora_g, lora_u, scale, act, need_dxa_g=False, need_dxa_u=False):
    fn = _act_mul_bwd_triton if _dispatch.use_triton(g) else _act_mul_bwd_torch
    return fn(dh, g, u, dg, du, lora_g, lora_u, scale, act, need_dxa_g, need_dxa_u)


def _lora_b_grad(dg, xa, scale):
    fn = _lora_b_grad_triton if _dispatch.use_triton(dg) else _lora_b_grad_torch
    return fn(dg, xa, scale)


def _rows_unit_stride(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] as a 2-D [rows, width] tensor with unit column stride (a view when possible)."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 or t.shape[0] == 0 else t.contiguous()


def _check_activation(op, activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"fastgrpo::{op}: activation must be one of {_ACTIVATIONS}, got {activation!r}")


# ----------------------------------------------------------------------------------------------
# act_mul


@torch.library.custom_op("fastgrpo::act_mul", mutates_args=())
def _act_mul_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _check_act_mul(gate, up, activation)
    width = gate.shape[-1]
    h = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    _act_mul_fwd(_rows_unit_stride(gate, width), _rows_unit_stride(up, width), h.view(-1, width),
                 None, None, 1.0, activation)
    return h


@_act_mul_op.register_fake
def _(gate, up, activation):
    _check_act_mul(gate, up, activation)
    return torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)


@torch.library.custom_op("fastgrpo::act_mul_backward", mutates_args=())
def _act_mul_backward_op(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    width = gate.shape[-1]
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    _act_mul_bwd(_rows_unit_stride(dh, width), _rows_unit_stride(gate, width), _rows_unit_stride(up, width),
                 d_gate.view(-1, width), d_up.view(-1, width), None, None, 1.0, activation)
    return d_gate, d_up


@_act_mul_backward_op.register_fake
def _(dh, gate, up, activation):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _check_act_mul(gate, up, activation):
    _check_activation("act_mul", activation)
    _dispatch.check_dtype("act_mul", gate)
    _dispatch.check_dtype("act_mul", up)
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"fastgrpo::act_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must match in shape and device")


def _act_mul_setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _act_mul_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    d_gate, d_up = _act_mul_backward_op(dh, gate, up, ctx.activation)
    return d_gate, d_up, None


_act_mul_op.register_autograd(_act_mul_backward, setup_context=_act_mul_setup_context)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """h = act(gate) * up (activation "silu" or "gelu_tanh"), fp32 maths rounded once.

    gate, up: same shape [..., I], any strides. Saves gate and up; backward recomputes act.
    """
    return torch.ops.fastgrpo.act_mul(gate, up, activation)


# ----------------------------------------------------------------------------------------------
# gated_mlp


def _fused_rows(w_gate, w_up):
    """[w_gate; w_up] as one [2I, H] view when w_up's rows directly follow w_gate's in memory."""
    n_rows, width = w_gate.shape
    if (w_gate.stride() == (width, 1) and w_up.stride() == (width, 1) and w_gate.dtype == w_up.dtype
            and w_gate.device == w_up.device
            and w_gate.untyped_storage().data_ptr() == w_up.untyped_storage().data_ptr()
            and w_up.storage_offset() == w_gate.storage_offset() + n_rows * width):
        return w_gate.as_strided((2 * n_rows, width), (width, 1))
    return None


def _gate_up(x_rows, w_gate, w_up):
    """Base projections in x's dtype; one cuBLAS call for a fused gate_up weight."""
    fused = _fused_rows(w_gate, w_up)
    if fused is not None:
        gu = torch.mm(x_rows, fused.t())
        n = w_gate.shape[0]
        return gu[:, :n], gu[:, n:], gu
    return torch.mm(x_rows, w_gate.t()), torch.mm(x_rows, w_up.t()), None


def _lora_a(factors):
    """The A that x is multiplied with, or None without LoRA: the one A (LoRA on one projection,
    or one A shared by gate and up as for a fused gate_up_proj), else [A_g; A_u] stacked so that
    both xa come from one skinny matmul."""
    ga, _, ua, _ = factors
    if ga is None or ua is None or ga is ua:
        return ga if ga is not None else ua
    return torch.cat((ga, ua))


def _lora_inputs(x_rows, factors, a):
    """(x_cast, lora_g, lora_u) for some rows of x: x in the adapters' dtype and the (xa, B) pairs."""
    ga, gb, ua, ub = factors
    if a is None:
        return None, None, None
    x_cast = x_rows.to(a.dtype)
    xa = torch.mm(x_cast, a.t())
    if ga is not None and ua is not None and ga is not ua:
        rank_g = ga.shape[0]
        return x_cast, (xa[:, :rank_g], gb), (xa[:, rank_g:], ub)
    return x_cast, (xa, gb) if ga is not None else None, (xa, ub) if ua is not None else None


# Both passes walk x in chunks of rows, so no [tokens x intermediate] temporary is larger than a
# chunk (only h, the forward's output, and dh, the backward's input, are full size). A chunk's
# largest temporary is its [rows, 2I] projection buffer in x's dtype (g and u; dg and du overwrite
# it in backward); _CHUNK_BYTES caps that buffer, which keeps the working set fixed as contexts
# grow (bf16: 7424 rows at I = 8960, 4608 at I = 14336). The other per-chunk temporaries are
# [rows, H] (x cast to the adapters' dtype) or [rows, r], smaller still. At least
# _MIN_CHUNK_ROWS rows (whole multiples of 128, the matmul tiles) keep each cuBLAS call large
# enough to run at full speed. The CPU torch path chunks the same way; its fp32 activation
# temporaries make its chunks a few times larger in bytes.
_CHUNK_BYTES = 256 * 2**20
_MIN_CHUNK_ROWS = 1024
# Set by tests to force many small chunks; None sizes chunks from _CHUNK_BYTES.
ROWS_PER_CHUNK: int | None = None


def rows_per_chunk(inter: int, dtype: torch.dtype) -> int:
    """Rows of x that gated_mlp's forward and backward handle per step for intermediate size `inter`."""
    if ROWS_PER_CHUNK is not None:
        return ROWS_PER_CHUNK
    per_row = 2 * inter * dtype.itemsize
    return max(_MIN_CHUNK_ROWS, _CHUNK_BYTES // per_row // 128 * 128)


def _row_chunks(n_rows, inter, dtype):
    step = rows_per_chunk(inter, dtype)
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _addmm_fp32(acc, a, b):
    """acc += a @ b into an fp32 accumulator. bf16/fp16 products are summed in fp32 and added
    without first rounding a chunk's partial sum to the operands' dtype, so a gradient summed over
    chunks differs from a one-chunk result only by fp32 summation order."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.addmm_(a.float(), b.float())


def _check_gated_mlp(x, w_gate, w_up, ga, gb, ua, ub, activation):
    _check_activation("gated_mlp", activation)
    for t in (x, w_gate, w_up, ga, gb, ua, ub):
        if t is not None:
            _dispatch.check_dtype("gated_mlp", t)
            if t.device != x.device:
                raise ValueError(f"fastgrpo::gated_mlp: all inputs must be on {x.device}, got one on {t.device}")
    hidden = x.shape[-1]
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.shape[1] != hidden:
        raise ValueError(
            f"fastgrpo::gated_mlp: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be [I, {hidden}]"
        )
    if w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
        raise ValueError(f"fastgrpo::gated_mlp: weights ({w_gate.dtype}, {w_up.dtype}) must have x's dtype {x.dtype}")
    inter = w_gate.shape[0]
    if ga is not None and ua is not None and ga.dtype != ua.dtype:
        raise ValueError(f"fastgrpo::gated_mlp: gate and up LoRA factors must share a dtype, got {ga.dtype}, {ua.dtype}")
    for name, a, b in (("gate", ga, gb), ("up", ua, ub)):
        if (a is None) != (b is None):
            raise ValueError(f"fastgrpo::gated_mlp: {name} LoRA needs both A and B")
        if a is None:
            continue
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != hidden or b.shape != (inter, a.shape[0]) or a.dtype != b.dtype:
            raise ValueError(
                f"fastgrpo::gated_mlp: {name} LoRA factors A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype} "
                f"must be A [r, {hidden}] and B [{inter}, r] of one dtype"
            )


def _forward_rows(x_rows, w_gate, w_up, factors, a, lora_scale, activation, h_rows):
    # One chunk, in a function of its own so that its g/u buffer is freed before the next
    # chunk's is allocated.
    g, u, _ = _gate_up(x_rows, w_gate, w_up)
    _, lora_g, lora_u = _lora_inputs(x_rows, factors, a)
    _act_mul_fwd(g, u, h_rows, lora_g, lora_u, lora_scale, activation)


@torch.library.custom_op("fastgrpo::gated_mlp", mutates_args=())
def _gated_mlp_op(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    gate_lora_a: torch.Tensor | None, gate_lora_b: torch.Tensor | None,
    up_lora_a: torch.Tensor | None, up_lora_b: torch.Tensor | None,
    lora_scale: float, activation: str,
) -> torch.Tensor:
    factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    _check_gated_mlp(x, w_gate, w_up, *factors, activation)
    inter = w_gate.shape[0]
    x2d = x.reshape(-1, x.shape[-1])
    h = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    h2d = h.view(-1, inter)
    a = _lora_a(factors)
    for start, end in _row_chunks(x2d.shape[0], inter, x.dtype):
        _forward_rows(x2d[start:end], w_gate, w_up, factors, a, lora_scale, activation, h2d[start:end])
    return h


@_gated_mlp_op.register_fake
def _(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation):
    _check_gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, activation)
    return torch.empty(*x.shape[:-1], w_gate.shape[0], dtype=x.dtype, device=x.device)


@torch.library.custom_op("fastgrpo::gated_mlp_backward", mutates_args=())
def _gated_mlp_backward_op(
    dh: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    gate_lora_a: torch.Tensor | None, gate_lora_b: torch.Tensor | None,
    up_lora_a: torch.Tensor | None, up_lora_b: torch.Tensor | None,
    lora_scale: float, activation: str, needs: list[bool],
) -> list[torch.Tensor]:
    """Gradients of (x, w_gate, w_up, gate A, gate B, up A, up B), those `needs` selects, in that
    order. Per chunk of rows: recompute g and u, overwrite them with dg and du, write the chunk's
    rows of dx, add its share of the weight and LoRA gradients to fp32 accumulators."""
    need_dx, need_dwg, need_dwu, need_dga, need_dgb, need_dua, need_dub = needs
    ga, gb, ua, ub = factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    hidden, inter = x.shape[-1], w_gate.shape[0]
    x2d = x.reshape(-1, hidden)
    dh2d = dh.reshape(-1, inter)
    fused = _fused_rows(w_gate, w_up)
    a = _lora_a(factors)
    # Gradients of gate's and up's A come from one accumulator for `a` (split at the end), so
    # both LoRA x-side gradients are formed whenever either A or x needs them.
    need_da = need_dga or need_dua
    need_dxa_g = ga is not None and (need_dx or need_da)
    need_dxa_u = ua is not None and (need_dx or need_da)

    def fp32_zeros(like, needed):
        return torch.zeros(like.shape, dtype=torch.float32, device=x.device) if needed else None

    acc = dict(w_gate=fp32_zeros(w_gate, need_dwg), w_up=fp32_zeros(w_up, need_dwu), a=fp32_zeros(a, need_da),
               gate_b=fp32_zeros(gb, need_dgb), up_b=fp32_zeros(ub, need_dub))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    dx2d = dx.view(-1, hidden) if need_dx else None
    for start, end in _row_chunks(x2d.shape[0], inter, x.dtype):
        _backward_rows(dh2d[start:end], x2d[start:end], w_gate, w_up, fused, factors, a, lora_scale, activation,
                       need_dxa_g, need_dxa_u, dx2d[start:end] if need_dx else None, acc)
    grads = []
    if need_dx:
        grads.append(dx)
    if need_dwg:
        grads.append(acc["w_gate"].to(w_gate.dtype))
    if need_dwu:
        grads.append(acc["w_up"].to(w_up.dtype))
    # Returned gradients may not alias each other (copy=True: the accumulator may have A's dtype).
    # One A shared by gate and up gets its whole gradient in the gate slot (autograd adds the two
    # slots), so the two halves are not rounded separately before they are summed.
    if need_dga:
        d_a = acc["a"] if ga is ua or ua is None else acc["a"][: ga.shape[0]]
        grads.append(d_a.to(ga.dtype, copy=True))
    if need_dgb:
        grads.append(acc["gate_b"].to(gb.dtype))
    if need_dua:
        d_a = torch.zeros_like(ua) if ga is ua else acc["a"] if ga is None else acc["a"][ga.shape[0]:]
        grads.append(d_a.to(ua.dtype, copy=True))
    if need_dub:
        grads.append(acc["up_b"].to(ub.dtype))
    return grads


def _backward_rows(dh_rows, x_rows, w_gate, w_up, fused, factors, a, lora_scale, activation, need_dxa_g, need_dxa_u,
                   dx_rows, acc):
    """One chunk of the backward: writes dx_rows (unless None) and adds the chunk's share of each
    weight and LoRA gradient to the fp32 accumulators in `acc` (None where not needed). A
    function of its own so that the chunk's buffers are freed before the next chunk's exist."""
    ga, _, ua, _ = factors
    inter = w_gate.shape[0]
    g, u, gu = _gate_up(x_rows, w_gate, w_up)
    x_cast, lora_g, lora_u = _lora_inputs(x_rows, factors, a)
    # dg, du overwrite the recomputed g, u: a chunk holds one [rows, 2I] buffer, not two.
    dxa_g, dxa_u = _act_mul_bwd(_rows_unit_stride(dh_rows, inter), g, u, g, u, lora_g, lora_u,
                                lora_scale, activation, need_dxa_g, need_dxa_u)
    dg, du, dgu = g, u, gu
    # dL/d(x_cast @ a^T), rounded to the adapters' dtype as PEFT's autograd holds it.
    if ga is not None and ga is ua:
        dxa = dxa_g + dxa_u
    elif dxa_g is not None and dxa_u is not None:
        dxa = torch.cat((dxa_g, dxa_u), dim=1)
    else:
        dxa = dxa_g if dxa_g is not None else dxa_u
    dxa = dxa.to(a.dtype) if dxa is not None else None
    if dx_rows is not None:
        if dgu is not None:
            torch.mm(dgu, fused, out=dx_rows)
        else:
            torch.mm(dg, w_gate, out=dx_rows)
            dx_rows.addmm_(du, w_up)
        if a is not None:  # LoRA path, in the adapters' dtype (PEFT casts x up, so back down here)
            dx_rows.add_(torch.mm(dxa, a))
    if acc["w_gate"] is not None:
        _addmm_fp32(acc["w_gate"], dg.t(), x_rows)
    if acc["w_up"] is not None:
        _addmm_fp32(acc["w_up"], du.t(), x_rows)
    if acc["a"] is not None:
        _addmm_fp32(acc["a"], dxa.t(), x_cast)
    if acc["gate_b"] is not None:
        acc["gate_b"].add_(_lora_b_grad(dg, lora_g[0], lora_scale))
    if acc["up_b"] is not None:
        acc["up_b"].add_(_lora_b_grad(du, lora_u[0], lora_scale))


@_gated_mlp_backward_op.register_fake
def _(dh, x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation, needs):
    inputs = (x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t, need in zip(inputs, needs) if need]


def _gated_mlp_setup_context(ctx, inputs, output):
    x, w_gate, w_up, ga, gb, ua, ub, lora_scale, activation = inputs
    ctx.save_for_backward(x, w_gate, w_up, ga, gb, ua, ub)
    ctx.lora_scale, ctx.activation = lora_scale, activation


def _gated_mlp_backward(ctx, dh):
    inputs = ctx.saved_tensors
    needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:7], inputs)]
    grads = iter(_gated_mlp_backward_op(dh, *inputs, ctx.lora_scale, ctx.activation, needs))
    return (*(next(grads) if need else None for need in needs), None, None)


_gated_mlp_op.register_autograd(_gated_mlp_backward, setup_context=_gated_mlp_setup_context)


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    gate_lora_a: torch.Tensor | None = None,
    gate_lora_b: torch.Tensor | None = None,
    up_lora_a: torch.Tensor | None = None,
    up_lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    activation: str = "silu",
) -> torch.Tensor:
    """act(x @ w_gate.T [+ LoRA]) * (x @ w_up.T [+ LoRA]) -> [..., I], as HF + PEFT compute it.

    x [..., H]; w_gate, w_up [I, H] in x's dtype (row slices of a fused gate_up weight are fine);
    LoRA factors in PEFT's layout, A [r, H] and B [I, r] (any float dtype, e.g. fp32 adapters on
    a bf16 base), scaled by lora_scale (PEFT's alpha / r); no LoRA dropout. activation: "silu"
    or "gelu_tanh". Backward keeps only x and recomputes the projections.
    """
    return torch.ops.fastgrpo.gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                        float(lora_scale), activation)
