"""act_mul: h = act(gate) * up for a gated MLP (SwiGLU / GeGLU), saving gate and up for backward.

    torch.ops.fastgrpo.act_mul(gate, up, activation) -> h

activation "silu" or "gelu_tanh" (Gemma's gelu_pytorch_tanh); fp32 maths, rounded once to the inputs'
dtype. Backward recomputes the activation from the saved gate and up (as Liger does). It is what the gated
MLP pass emits where it cannot take over the projections (fastgrpo::gated_mlp, kernels/gated_mlp.py, keeps
only x); the elementwise kernels here also serve that op, chunk by chunk (`act_mul_into`,
`act_mul_backward_into`).

Triton on CUDA (the memory-bound part of the MLP; matmuls stay with cuBLAS), torch on the CPU.
"""
import torch
import triton
import triton.language as tl

from fastgrpo.kernels import _dispatch

ACTIVATIONS = ("silu", "gelu_tanh")
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
def _act_mul_fwd_kernel(
    g_ptr, u_ptr, h_ptr, n_rows, n_cols, g_s0, u_s0, h_s0,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < n_rows)[:, None] & (offs_n < n_cols)[None, :]
    g = tl.load(g_ptr + offs_m[:, None] * g_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_m[:, None] * u_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(h_ptr + offs_m[:, None] * h_s0 + offs_n[None, :], (a * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_bwd_kernel(
    dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, n_rows, n_cols, dh_s0, g_s0, u_s0, dg_s0, du_s0, h_s0,
    ACT: tl.constexpr, WRITE_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dg/du may overwrite g/u and h may overwrite dh: each element is read before it is written, by the same
    # thread (loads and stores share one layout). WRITE_H: also store h = act(g) * u, which the down
    # projection's gradients read (a second pass would read g and u again).
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < n_rows)[:, None] & (offs_n < n_cols)[None, :]
    dh = tl.load(dh_ptr + offs_m[:, None] * dh_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs_m[:, None] * g_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_m[:, None] * u_s0 + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(dg_ptr + offs_m[:, None] * dg_s0 + offs_n[None, :], (dh * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs_m[:, None] * du_s0 + offs_n[None, :], (dh * a).to(du_ptr.dtype.element_ty), mask=mask)
    if WRITE_H:
        tl.store(h_ptr + offs_m[:, None] * h_s0 + offs_n[None, :], (a * u).to(h_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host side: 2-D [rows, I] tensors with unit column stride (row strides free: g and u may be the two
# halves of one [rows, 2I] buffer).


def _act_mul_blocks(g: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the act_mul kernels. On CUDA 4 x 1024 tiles of 2-byte g/u (fp32: half as
    wide, the same bytes a tile) and 8 warps, the fastest for both kernels at Qwen2.5-1.5B's and Llama-8B's
    widths, 32k rows: `python bench/bench_gated_mlp.py --sweep-act-mul` (H200: 4200 / 4130 GB/s forward /
    backward, 4070 / 4060 with 64 x 128 tiles)."""
    if _dispatch.launch_like_cuda(g):
        return 4, (1024 if g.element_size() <= 2 else 512), 8
    return min(max(_dispatch.next_power_of_2(g.shape[0]), 16), 64), 128, 4


def _act_mul_grid(g, block_m, block_n):
    return _dispatch.cdiv(g.shape[0], block_m), _dispatch.cdiv(g.shape[1], block_n)


def _act_mul_fwd_triton(g, u, h, act):
    """Writes act(g) * u into h ([N, I], unit column stride; may be a row slice of a larger h)."""
    if g.shape[0] == 0:
        return
    block_m, block_n, num_warps = _act_mul_blocks(g)
    _act_mul_fwd_kernel[_act_mul_grid(g, block_m, block_n)](
        g, u, h, g.shape[0], g.shape[1], g.stride(0), u.stride(0), h.stride(0),
        ACT=ACTIVATIONS.index(act), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def _act_mul_bwd_triton(dh, g, u, dg, du, act, h=None):
    """Writes dg, du (may alias g, u) and, unless None, h = act(g) * u (may alias dh)."""
    if g.shape[0] == 0:
        return
    block_m, block_n, num_warps = _act_mul_blocks(g)
    _act_mul_bwd_kernel[_act_mul_grid(g, block_m, block_n)](
        dh, g, u, dg, du, dg if h is None else h, g.shape[0], g.shape[1],
        dh.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0), 0 if h is None else h.stride(0),
        ACT=ACTIVATIONS.index(act), WRITE_H=h is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def _act_fp32(g, act):
    if act == "silu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    t = torch.tanh(_SQRT_2_OVER_PI * (g + _GELU_COEF * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_COEF * g * g)


def _act_mul_fwd_torch(g, u, h, act):
    h.copy_(_act_fp32(g.float(), act)[0] * u.float())


def _act_mul_bwd_torch(dh, g, u, dg, du, act, h=None):
    a, da = _act_fp32(g.float(), act)
    dh = dh.float()  # fp32 inputs stay the same tensor: what may be overwritten is read first
    u = u.float()
    dg_value, du_value = dh * u * da, dh * a  # formed before du, dg or h may overwrite u, g or dh
    if h is not None:
        h.copy_(a * u)
    du.copy_(du_value)
    dg.copy_(dg_value)


def act_mul_into(g, u, h, act):
    """h = act(g) * u for [rows, I] tensors with unit column stride (h may be a row slice of a larger buffer)."""
    fn = _act_mul_fwd_triton if _dispatch.use_triton(g) else _act_mul_fwd_torch
    fn(g, u, h, act)


def act_mul_backward_into(dh, g, u, dg, du, act, h=None):
    """dg = dh * u * act'(g) and du = dh * act(g), and unless h is None also h = act(g) * u (for the down
    projection's gradients). dg, du may alias g, u and h may alias dh: every element is read before it is
    written."""
    fn = _act_mul_bwd_triton if _dispatch.use_triton(g) else _act_mul_bwd_torch
    fn(dh, g, u, dg, du, act, h)


def rows_unit_stride(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] as a 2-D [rows, width] tensor with unit column stride (a view when possible)."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 or t.shape[0] == 0 else t.contiguous()


def check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"fastgrpo::{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


# ----------------------------------------------------------------------------------------------
# The op


@torch.library.custom_op("fastgrpo::act_mul", mutates_args=())
def _act_mul_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _check_act_mul(gate, up, activation)
    width = gate.shape[-1]
    h = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    act_mul_into(rows_unit_stride(gate, width), rows_unit_stride(up, width), h.view(-1, width), activation)
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
    act_mul_backward_into(rows_unit_stride(dh, width), rows_unit_stride(gate, width), rows_unit_stride(up, width),
                          d_gate.view(-1, width), d_up.view(-1, width), activation)
    return d_gate, d_up


@_act_mul_backward_op.register_fake
def _(dh, gate, up, activation):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _check_act_mul(gate, up, activation):
    check_activation("act_mul", activation)
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

