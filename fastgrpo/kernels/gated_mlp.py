"""Gated MLP (SwiGLU / GeGLU), with or without its down projection, saving only x for backward
(or x and the gate and up projections).

    torch.ops.fastgrpo.gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                 lora_scale, activation, w_down, down_lora_a, down_lora_b,
                                 down_lora_scale, save_projections, skip_output_on_recompute)
        -> (out, saved_projections)
    torch.ops.fastgrpo.act_mul(gate, up, activation) -> h

gated_mlp matches HF + PEFT (vanilla LoRA, no dropout):
    g = x @ w_gate.T                                      (x.dtype)
    g = (g + (x.to(A.dtype) @ A.T @ B.T) * lora_scale).to(x.dtype)     if the gate has LoRA
    u likewise with w_up and the up factors
    h = act(g) * u                                        (fp32 maths, rounded once to x.dtype)
    out = h, or with w_down: h @ w_down.T [+ (h.to(A.dtype) @ A.T @ B.T) * down_lora_scale], to x.dtype
x [..., H]; w_gate, w_up [I, H] (row slices of a fused [2I, H] gate_up weight are recognised
and multiplied as one matrix); w_down [H_out, I]; LoRA A [r, in], B [out, r] in PEFT's layout,
often fp32 beside a bf16 base; activation "silu" or "gelu_tanh" (Gemma's gelu_pytorch_tanh).
LoRA dropout is not supported (dropout on x would have to be saved or replayed): the FX pass
leaves such sites unfused.

Backward saves only x (weights and LoRA factors are kept by reference and cost no memory),
recomputes g and u (LoRA terms added in place by cuBLAS), and gets dg, du from one Triton kernel.
With save_projections the forward keeps g and u ([N, 2I], LoRA included, the op's second output,
empty otherwise) and backward reads them instead of recomputing them: the form for
gradient-checkpointed layers, whose forward runs twice already.
With w_down, h is recomputed per chunk in backward (for the down weight and LoRA gradients), so
neither h nor dh is ever full size. Weight gradients are produced only for inputs that require them.

skip_output_on_recompute (set by the FX pass only where the output flows, through casts, dropout and the
residual add alone, into the graph's one returned tensor, so no saved tensor depends on it): inside
`_dispatch.checkpoint_recompute()` - a gradient checkpoint re-running the layer for its saved tensors,
its outputs thrown away - the op computes only what it saves (the projections with save_projections,
nothing otherwise) and returns zeros. The recompute then costs the gate/up matmul or nothing, instead
of the whole MLP.

Forward and backward walk the rows of x in chunks (rows_per_chunk(): a chunk's g/u buffer is
about 256 MiB), so apart from the output, the saved projections and the incoming gradient no
[tokens x intermediate] temporary exists at any time: the working set stays fixed as the
context grows. Each chunk writes its rows of out or dx; weight and LoRA gradients are summed
over chunks in fp32 accumulators, in chunk order (deterministic, and independent of the chunk
size up to fp32 summation order), and rounded once at the end.

act_mul is the fallback when the matmuls cannot be taken over: h = act(gate) * up, saving gate
and up and recomputing the activation in backward (as Liger does).

Matmuls, the LoRA terms and every LoRA gradient: cuBLAS (torch.mm / addmm_, fp32 accumulators).
Triton: act(g) * u and its backward (dg, du from dh, g, u), the memory-bound part. (LoRA terms
computed inside those kernels made them 4-10x slower than their memory traffic on the H200.)
"""
import math

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
# Host side. "lora" below is None or a pair (xa [N, r] = x.to(A.dtype) @ A^T, B [I, r]).


def _act_mul_blocks(g: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the act_mul kernels. On CUDA, 4 x 1024 tiles of 2-byte g/u and 8
    warps: the best of a sweep on the H200 for both kernels at Qwen2.5-1.5B's and Llama-8B's widths
    (bench_gated_mlp.py --sweep-act-mul, 32k rows: 4200 / 4130 GB/s forward / backward, against 4070 / 4060
    with the 64 x 128 tiles before); fp32 tiles half as wide, the same bytes a tile."""
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
        ACT=_ACTIVATIONS.index(act), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def _act_mul_bwd_triton(dh, g, u, dg, du, act, h=None):
    """Writes dg, du (may alias g, u) and, unless None, h = act(g) * u (may alias dh)."""
    if g.shape[0] == 0:
        return
    block_m, block_n, num_warps = _act_mul_blocks(g)
    _act_mul_bwd_kernel[_act_mul_grid(g, block_m, block_n)](
        dh, g, u, dg, du, dg if h is None else h, g.shape[0], g.shape[1],
        dh.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0), 0 if h is None else h.stride(0),
        ACT=_ACTIVATIONS.index(act), WRITE_H=h is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
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


def _act_mul_fwd(g, u, h, act):
    fn = _act_mul_fwd_triton if _dispatch.use_triton(g) else _act_mul_fwd_torch
    fn(g, u, h, act)


def _act_mul_bwd(dh, g, u, dg, du, act, h=None):
    fn = _act_mul_bwd_triton if _dispatch.use_triton(g) else _act_mul_bwd_torch
    fn(dh, g, u, dg, du, act, h)


def _add_product_(out, a, b, alpha=1.0):
    """out += (a @ b) * alpha in place. When a shares out's dtype (adapters under autocast) cuBLAS's
    epilogue does the add: the product is summed in fp32 and rounded once, and no [rows, width]
    temporary is written and read back (at 32k tokens and I = 8960 that pass cost 0.1 ms a chunk)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b, alpha=alpha)
    else:
        out.add_(torch.mm(a, b), alpha=alpha)


def _add_lora_(base, lora, scale):
    """base += (xa @ B^T) * scale in place: PEFT's `(base + lora_B(xa) * scale).to(base.dtype)`."""
    xa, b = lora
    _add_product_(base, xa, b.t(), scale)


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
    _act_mul_fwd(_rows_unit_stride(gate, width), _rows_unit_stride(up, width), h.view(-1, width), activation)
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
                 d_gate.view(-1, width), d_up.view(-1, width), activation)
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


def _gate_up(x_rows, w_gate, w_up, gu_rows=None):
    """Base projections in x's dtype, written into the [rows, 2I] buffer gu_rows (a new one if None; LoRA
    terms are added in place after): (g, u, gu_rows), g and u views of it. One cuBLAS call for a fused
    gate_up weight."""
    inter = w_gate.shape[0]
    if gu_rows is None:
        gu_rows = torch.empty(x_rows.shape[0], 2 * inter, dtype=x_rows.dtype, device=x_rows.device)
    g, u = gu_rows[:, :inter], gu_rows[:, inter:]
    fused = _fused_rows(w_gate, w_up)
    if fused is not None:
        torch.mm(x_rows, fused.t(), out=gu_rows)
    else:
        torch.mm(x_rows, w_gate.t(), out=g)
        torch.mm(x_rows, w_up.t(), out=u)
    return g, u, gu_rows


# Joined weights are built per call, a copy of the projections' weights ([2I, H] read and written), to spare
# a read and a write of [rows, I] per adapter: they can pay from rows ~ H up, not for a decode step's handful
# of rows. Joined from this many rows per hidden unit, and on the GPU path only, where those passes are
# memory-bound cuBLAS epilogues; the CPU torch path keeps the separate products it has always run.
_JOIN_MIN_ROWS_PER_HIDDEN = 2


def _joins(weight, lora_a, rows, hidden):
    """Whether a LoRA'd projection's product joins its base weight's GEMM (see _JOIN_MIN_ROWS_PER_HIDDEN)."""
    return (lora_a is not None and lora_a.dtype == weight.dtype and _dispatch.use_triton(weight)
            and rows >= _JOIN_MIN_ROWS_PER_HIDDEN * hidden)


def _joined_weight(w_gate, w_up, factors, rows):
    """[[W_g, B_g, 0], [W_u, 0, B_u]] ([2I, H + r_g + r_u]; [[W_g, B_g], [W_u, B_u]] for one A that both
    share; a projection without adapter has no B column block), or None. With it one GEMM of x joined with
    its scaled LoRA inputs, [x | s xa], gives both projections with their LoRA terms: adding a rank-r
    product into g and u afterwards reads and writes the whole [rows, 2I] buffer once more, ~0.6 ms a
    pass at 34,816 tokens of Qwen2.5-1.5B's MLP. Only for adapters in the base's dtype (as autocast runs
    them), since one GEMM has one operand dtype (fp32 adapters on a bf16 base keep their own products),
    and only on the GPU path for `rows` of x from _JOIN_MIN_ROWS_PER_HIDDEN per hidden unit. The backward
    multiplies [dg | du] by it for dx and dL/d(xa) at once (_joined_input_grads)."""
    ga, gb, ua, ub = factors
    inter, hidden = w_gate.shape
    if not _joins(w_gate, ga if ga is not None else ua, rows, hidden):
        return None
    rank_g = ga.shape[0] if ga is not None else 0
    rank_u = ua.shape[0] if ua is not None and ua is not ga else 0
    joined = w_gate.new_zeros(2 * inter, hidden + rank_g + rank_u)
    joined[:inter, :hidden] = w_gate
    joined[inter:, :hidden] = w_up
    if ga is not None:
        joined[:inter, hidden:hidden + rank_g] = gb
    if ua is not None:  # after B_g's columns, or in them when both share one A
        start = hidden if ua is ga else hidden + rank_g
        joined[inter:, start:start + ua.shape[0]] = ub
    return joined


def _joined_gate_up(x_rows, xa, scale, joined, gu_rows=None):
    """g and u with their LoRA terms from one GEMM: [x | scale * xa] @ joined^T into the [rows, 2I] buffer."""
    hidden = x_rows.shape[1]
    x_joined = torch.empty(x_rows.shape[0], joined.shape[1], dtype=x_rows.dtype, device=x_rows.device)
    x_joined[:, :hidden] = x_rows
    torch.mul(xa, scale, out=x_joined[:, hidden:])
    if gu_rows is None:
        gu_rows = torch.empty(x_rows.shape[0], joined.shape[0], dtype=x_rows.dtype, device=x_rows.device)
    torch.mm(x_joined, joined.t(), out=gu_rows)
    inter = joined.shape[0] // 2
    return gu_rows[:, :inter], gu_rows[:, inter:], gu_rows


def _lora_a(factors):
    """The A that x is multiplied with, or None without LoRA: the one A (LoRA on one projection,
    or one A shared by gate and up as for a fused gate_up_proj), else [A_g; A_u] stacked so that
    both xa come from one skinny matmul."""
    ga, _, ua, _ = factors
    if ga is None or ua is None or ga is ua:
        return ga if ga is not None else ua
    return torch.cat((ga, ua))


def _lora_inputs(x_rows, factors, a):
    """(x_cast, xa, lora_g, lora_u) for some rows of x: x in the adapters' dtype, x @ a^T (both adapters'
    columns) and the (xa, B) pairs."""
    ga, gb, ua, ub = factors
    if a is None:
        return None, None, None, None
    x_cast = x_rows.to(a.dtype)
    xa = torch.mm(x_cast, a.t())
    if ga is not None and ua is not None and ga is not ua:
        rank_g = ga.shape[0]
        return x_cast, xa, (xa[:, :rank_g], gb), (xa[:, rank_g:], ub)
    return x_cast, xa, (xa, gb) if ga is not None else None, (xa, ub) if ua is not None else None


# Both passes walk x in chunks of rows, so no [tokens x intermediate] temporary is larger than a
# chunk (full size are only the op's output and incoming gradient - h and dh when the op stops
# before the down projection - and the saved projections). A chunk's largest temporary is its
# [rows, 2I] projection buffer in x's dtype (g and u; dg and du overwrite it in backward, or take
# a buffer of their own when g and u are saved ones; with the down projection h is written over g in
# forward, and in backward dh, [rows, I], comes beside it and h is written over dh); _CHUNK_BYTES caps that
# buffer, which keeps the working set fixed as contexts grow (bf16: at most 7424 rows at I = 8960, 4608 at
# I = 14336; _row_chunks splits the rows evenly into as few chunks as that allows), and _CHUNK_INPUT_MULTIPLE keeps it
# in proportion to x at short contexts. The other per-chunk temporaries are
# [rows, H] (x cast to the adapters' dtype; x joined with its LoRA inputs, [rows, H + r]) or [rows, r],
# smaller still, beside a weight-sized one per call (the joined weights of _joined_weight) - except with fp32 adapters
# on a bf16/fp16 base outside autocast, where one projection's LoRA term (forward) or gradient
# (backward) is an fp32 [rows, I] temporary beside the buffer. At least
# _MIN_CHUNK_ROWS rows (whole multiples of 128, the matmul tiles) keep each cuBLAS call large
# enough to run at full speed. The CPU torch path chunks the same way; its fp32 activation
# temporaries make its chunks a few times larger in bytes.
_CHUNK_BYTES = 256 * 2**20
# ... and at most this many times the bytes of x: at short contexts (1024-token GRPO rows: x 30 MiB) a 256 MiB
# buffer, with dh beside it, would be the largest part of the step's working memory beyond the weights.
_CHUNK_INPUT_MULTIPLE = 4
_MIN_CHUNK_ROWS = 1024
# Set by tests to force many small chunks; None sizes chunks from _CHUNK_BYTES.
ROWS_PER_CHUNK: int | None = None


def rows_per_chunk(inter: int, dtype: torch.dtype, input_bytes: int | None = None) -> int:
    """Rows of x that gated_mlp's forward and backward handle at most per step for intermediate size `inter`
    (and an x of `input_bytes`, if given)."""
    if ROWS_PER_CHUNK is not None:
        return ROWS_PER_CHUNK
    budget = _CHUNK_BYTES if input_bytes is None else min(_CHUNK_BYTES, _CHUNK_INPUT_MULTIPLE * input_bytes)
    per_row = 2 * inter * dtype.itemsize
    return max(_MIN_CHUNK_ROWS, budget // per_row // 128 * 128)


def _row_chunks(n_rows, inter, dtype, hidden):
    """(start, end) of each chunk: as few chunks as rows_per_chunk() allows, of equal size up to the last
    (whole multiples of 128 rows): 34816 rows are five chunks of 7040, not four of 7424 and one of 5120, whose
    working set would be the larger ones'."""
    step = most = rows_per_chunk(inter, dtype, n_rows * hidden * dtype.itemsize)
    if ROWS_PER_CHUNK is None and n_rows > most:
        chunks = -(-n_rows // most)
        per_chunk = -(-n_rows // chunks)
        step = min(most, -(-per_chunk // 128) * 128)
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _mm_fp32(a, b):
    """a @ b in fp32; bf16/fp16 operands are multiplied without rounding the product to their dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _accumulate(acc, name, a, b):
    """acc[name] += a @ b in fp32, if acc holds `name` (a gradient that is needed). The first chunk's
    product becomes the accumulator (no zero fill: two launches fewer per gradient); later chunks' are
    added by the GEMM itself, without first rounding them to the operands' dtype, so a gradient summed
    over chunks differs from a one-chunk result only by fp32 summation order."""
    if name not in acc:
        return
    if acc[name] is None:
        acc[name] = _mm_fp32(a, b)
    elif a.dtype == torch.float32 or not a.is_cuda:
        acc[name].addmm_(a.float(), b.float())
    else:  # one GEMM: its epilogue adds the fp32 product into the accumulator
        torch.addmm(acc[name], a, b, out_dtype=torch.float32, out=acc[name])


def _summed(acc, name, like):
    """The fp32 sum of acc[name] over all chunks (zeros when there were no rows)."""
    total = acc[name]
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if total is None else total


def _check_gated_mlp(x, w_gate, w_up, ga, gb, ua, ub, activation, w_down=None, da=None, db=None):
    _check_activation("gated_mlp", activation)
    for t in (x, w_gate, w_up, ga, gb, ua, ub, w_down, da, db):
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
    for name, a, b, width, out in (("gate", ga, gb, hidden, inter), ("up", ua, ub, hidden, inter),
                                   ("down", da, db, inter, w_down.shape[0] if w_down is not None else None)):
        if (a is None) != (b is None):
            raise ValueError(f"fastgrpo::gated_mlp: {name} LoRA needs both A and B")
        if a is None:
            continue
        if out is None:
            raise ValueError("fastgrpo::gated_mlp: down LoRA factors need w_down")
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape != (out, a.shape[0]) or a.dtype != b.dtype:
            raise ValueError(
                f"fastgrpo::gated_mlp: {name} LoRA factors A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype} "
                f"must be A [r, {width}] and B [{out}, r] of one dtype"
            )
    if w_down is not None and (w_down.dim() != 2 or w_down.shape[1] != inter or w_down.dtype != x.dtype):
        raise ValueError(f"fastgrpo::gated_mlp: w_down {tuple(w_down.shape)} {w_down.dtype} must be [H_out, {inter}] "
                         f"in x's dtype {x.dtype}")


def _out_width(w_gate, w_down):
    return w_down.shape[0] if w_down is not None else w_gate.shape[0]


def _saved_projections(x, w_gate, save_projections):
    """The [N, 2I] buffer of the gate and up projections kept for backward, or an empty stand-in."""
    shape = (math.prod(x.shape[:-1]), 2 * w_gate.shape[0]) if save_projections else (0,)
    return torch.empty(shape, dtype=x.dtype, device=x.device)


def _down_forward(h_rows, w_down, down, out_rows, joined_down=None):
    """out_rows = h @ w_down^T [+ PEFT LoRA (h in the adapters' dtype) @ A^T @ B^T * scale], rounded once
    to out's dtype as PEFT's `(base + lora * scale).to(dtype)` does. With the joined [W_down; A_down]
    (_joined_down_weight), h @ W^T and the LoRA input h @ A^T come from one GEMM: h ([rows, I], the chunk's
    largest operand) is read once, not a second time by a skinny product."""
    if joined_down is not None:
        _, db, scale = down
        width = out_rows.shape[1]
        base_and_xa = torch.mm(h_rows, joined_down.t())
        out_rows.copy_(base_and_xa[:, :width])  # out is the op's contiguous output, the GEMM's is wider
        _add_lora_(out_rows, (base_and_xa[:, width:], db), scale)
        return
    torch.mm(h_rows, w_down.t(), out=out_rows)
    if down is not None:
        da, db, scale = down
        _add_lora_(out_rows, (torch.mm(h_rows.to(da.dtype), da.t()), db), scale)


def _add_loras_(g, u, lora_g, lora_u, scale):
    """The adapters' terms added into the gate and up projections in place."""
    if lora_g is not None:
        _add_lora_(g, lora_g, scale)
    if lora_u is not None:
        _add_lora_(u, lora_u, scale)


def _projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, gu_rows=None):
    """(g, u, gu_rows, lora inputs as _lora_inputs gives them) of some rows, LoRA included, written into
    gu_rows (a new buffer if None); from one GEMM when there is a joined weight."""
    lora = _lora_inputs(x_rows, factors, a)
    _, xa, lora_g, lora_u = lora
    if joined is not None:
        g, u, gu_rows = _joined_gate_up(x_rows, xa, lora_scale, joined, gu_rows)
    else:
        g, u, gu_rows = _gate_up(x_rows, w_gate, w_up, gu_rows)
        _add_loras_(g, u, lora_g, lora_u, lora_scale)
    return g, u, gu_rows, lora


def _forward_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, activation, w_down, down, joined_down,
                  out_rows, gu_rows):
    # One chunk, in a function of its own so that its buffers are freed before the next
    # chunk's are allocated.
    g, u, _, _ = _projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, gu_rows)
    if w_down is None:
        h_rows = out_rows
    elif gu_rows is None:  # h over g (read before written, element by element): the chunk needs no third [rows, I]
        h_rows = g
    else:  # g and u are the saved projections
        h_rows = torch.empty(g.shape, dtype=x_rows.dtype, device=x_rows.device)
    _act_mul_fwd(g, u, h_rows, activation)
    if w_down is not None:
        _down_forward(h_rows, w_down, down, out_rows, joined_down)


def _down_factors(w_down, down_lora_a, down_lora_b, down_lora_scale):
    return None if w_down is None or down_lora_a is None else (down_lora_a, down_lora_b, down_lora_scale)


@torch.library.custom_op("fastgrpo::gated_mlp", mutates_args=())
def _gated_mlp_op(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    gate_lora_a: torch.Tensor | None, gate_lora_b: torch.Tensor | None,
    up_lora_a: torch.Tensor | None, up_lora_b: torch.Tensor | None,
    lora_scale: float, activation: str,
    w_down: torch.Tensor | None = None, down_lora_a: torch.Tensor | None = None,
    down_lora_b: torch.Tensor | None = None, down_lora_scale: float = 1.0, save_projections: bool = False,
    skip_output_on_recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, saved projections): out is h, or down(h) when w_down is given; the second output holds
    the gate/up projections (LoRA included) for backward when save_projections, else it is empty.
    With skip_output_on_recompute, inside a checkpoint's recompute out is zeros (module docstring)."""
    factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    _check_gated_mlp(x, w_gate, w_up, *factors, activation, w_down, down_lora_a, down_lora_b)
    inter = w_gate.shape[0]
    x2d = x.reshape(-1, x.shape[-1])
    width = _out_width(w_gate, w_down)
    skip_output = skip_output_on_recompute and _dispatch.in_checkpoint_recompute()
    _dispatch.signal_backward_peak()  # the backward calls backward_peak_passed() when its chunk buffers are gone
    out = (torch.zeros if skip_output else torch.empty)(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    out2d = out.view(-1, width)
    gu = _saved_projections(x, w_gate, save_projections)
    if skip_output and not save_projections:
        return out, gu  # the recompute re-saves x: nothing to compute
    a = _lora_a(factors)
    joined = _joined_weight(w_gate, w_up, factors, x2d.shape[0])
    down = _down_factors(w_down, down_lora_a, down_lora_b, down_lora_scale)
    joined_down = None if skip_output else _joined_down_weight(w_down, down, x2d.shape[0])
    for start, end in _row_chunks(x2d.shape[0], inter, x.dtype, x2d.shape[1]):
        if skip_output:
            _projections_rows(x2d[start:end], w_gate, w_up, factors, a, lora_scale, joined, gu[start:end])
        else:
            _forward_rows(x2d[start:end], w_gate, w_up, factors, a, lora_scale, joined, activation, w_down, down,
                          joined_down, out2d[start:end], gu[start:end] if save_projections else None)
    return out, gu


@_gated_mlp_op.register_fake
def _(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation,
      w_down=None, down_lora_a=None, down_lora_b=None, down_lora_scale=1.0, save_projections=False,
      skip_output_on_recompute=False):
    _check_gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, activation,
                     w_down, down_lora_a, down_lora_b)
    out = torch.empty(*x.shape[:-1], _out_width(w_gate, w_down), dtype=x.dtype, device=x.device)
    return out, _saved_projections(x, w_gate, save_projections)


# Inputs of gated_mlp that can have gradients, in the order gated_mlp_backward returns them.
_GRAD_INPUTS = ("x", "w_gate", "w_up", "gate_a", "gate_b", "up_a", "up_b", "w_down", "down_a", "down_b")


@torch.library.custom_op("fastgrpo::gated_mlp_backward", mutates_args=())
def _gated_mlp_backward_op(
    d_out: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    gate_lora_a: torch.Tensor | None, gate_lora_b: torch.Tensor | None,
    up_lora_a: torch.Tensor | None, up_lora_b: torch.Tensor | None,
    lora_scale: float, activation: str, needs: list[bool],
    w_down: torch.Tensor | None = None, down_lora_a: torch.Tensor | None = None,
    down_lora_b: torch.Tensor | None = None, down_lora_scale: float = 1.0, saved_projections: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Gradients of the inputs named in _GRAD_INPUTS, those `needs` selects, in that order. Per chunk
    of rows: take g and u from saved_projections or recompute them, go back through the down
    projection (recomputing h) when there is one, form dg and du, write the chunk's rows of dx, add
    its share of the weight and LoRA gradients to fp32 accumulators."""
    need = dict(zip(_GRAD_INPUTS, needs, strict=True))
    ga, gb, ua, ub = factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    hidden, inter = x.shape[-1], w_gate.shape[0]
    x2d = x.reshape(-1, hidden)
    d_out2d = d_out.reshape(-1, _out_width(w_gate, w_down))
    fused = _fused_rows(w_gate, w_up)
    a = _lora_a(factors)
    down = _down_factors(w_down, down_lora_a, down_lora_b, down_lora_scale)
    saved = saved_projections if saved_projections is not None and saved_projections.numel() else None
    # The joined weight serves the recompute of g and u and, for dx, the GEMM of [dg | du] (_joined_input_grads).
    joined = _joined_weight(w_gate, w_up, factors, x2d.shape[0]) if saved is None or need["x"] else None
    # Gradients of gate's and up's A come from one accumulator for `a` (split at the end), so
    # both LoRA x-side gradients are formed whenever either A or x needs them.
    need_da = need["gate_a"] or need["up_a"]
    need_dxa_g = ga is not None and (need["x"] or need_da)
    need_dxa_u = ua is not None and (need["x"] or need_da)
    # dL/d(xa) from a product of its own (paired when it can be), unless the joined GEMM for dx gives it.
    lora_back = None if need["x"] and joined is not None else _paired_lora_b(factors, x.dtype if saved is None
                                                                             else saved.dtype)

    # fp32 gradient sums over the chunks, one per needed gradient (None until the first chunk's).
    needed = dict(w_gate=need["w_gate"], w_up=need["w_up"], a=need_da, gate_b=need["gate_b"], up_b=need["up_b"],
                  w_down=need["w_down"], down_a=need["down_a"], down_b=need["down_b"])
    acc = {name: None for name, wanted in needed.items() if wanted}
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need["x"] else None
    dx2d = dx.view(-1, hidden) if need["x"] else None
    for start, end in _row_chunks(x2d.shape[0], inter, x.dtype, x2d.shape[1]):
        _backward_rows(d_out2d[start:end], x2d[start:end], None if saved is None else saved[start:end],
                       w_gate, w_up, fused, factors, a, lora_scale, joined, activation, w_down, down, x2d.shape[0],
                       need_dxa_g, need_dxa_u, lora_back, dx2d[start:end] if need["x"] else None, acc)
    _dispatch.backward_peak_passed()
    grads = []
    if need["x"]:
        grads.append(dx)
    if need["w_gate"]:
        grads.append(_summed(acc, "w_gate", w_gate).to(w_gate.dtype))
    if need["w_up"]:
        grads.append(_summed(acc, "w_up", w_up).to(w_up.dtype))
    d_a_both = _summed(acc, "a", a) if need_da else None
    # Returned gradients may not alias each other (copy=True: the accumulator may have A's dtype).
    # One A shared by gate and up gets its whole gradient in the gate slot (autograd adds the two
    # slots), so the two halves are not rounded separately before they are summed.
    if need["gate_a"]:
        d_a = d_a_both if ga is ua or ua is None else d_a_both[: ga.shape[0]]
        grads.append(d_a.to(ga.dtype, copy=True))
    if need["gate_b"]:
        grads.append((_summed(acc, "gate_b", gb) * lora_scale).to(gb.dtype))
    if need["up_a"]:
        d_a = torch.zeros_like(ua) if ga is ua else d_a_both if ga is None else d_a_both[ga.shape[0]:]
        grads.append(d_a.to(ua.dtype, copy=True))
    if need["up_b"]:
        grads.append((_summed(acc, "up_b", ub) * lora_scale).to(ub.dtype))
    for name, like in (("w_down", w_down), ("down_a", down_lora_a), ("down_b", down_lora_b)):
        if need[name]:
            grads.append(_summed(acc, name, like).to(like.dtype))
    return grads


def _joined_down_weight(w_down, down, rows):
    """[W_down; A_down] ([H_out + r, I]) for adapters in the base's dtype and enough rows, else None (same
    conditions as _joined_weight). Forward: h times it gives the base output and the LoRA input at once
    (_down_forward). Backward (built for each chunk, and gone before the chunk's recomputed g/u exist): dh of a
    chunk comes from one GEMM of [dy | dxa] with it, instead of adding dxa @ A into dh afterwards (a read and a
    write of the chunk's [rows, I] dh)."""
    if down is None or not _joins(w_down, down[0], rows, w_down.shape[0]):
        return None
    return torch.cat((w_down, down[0]))


def _down_backward(d_out_rows, w_down, down, joined_down):
    """dh for one chunk, back through the down projection (and its LoRA, as PEFT's autograd forms
    it), and the LoRA's (d_lora, dxa) for its gradients, or None."""
    if down is None:
        return torch.mm(d_out_rows, w_down), None
    da, db, scale = down
    d_lora = d_out_rows.to(db.dtype)  # gradient at the output of lora_B, before * scale
    if scale != 1.0:
        d_lora = d_lora * scale
    if joined_down is None:
        dh = torch.mm(d_out_rows, w_down)
        dxa = torch.mm(d_lora, db)
        _add_product_(dh, dxa, da)
        return dh, (d_lora, dxa)
    dxa = torch.mm(d_lora, db)
    return torch.mm(torch.cat((d_out_rows, dxa), dim=1), joined_down), (d_lora, dxa)


def _down_grads(d_out_rows, h, down, down_lora, acc):
    """Adds the chunk's share of the down weight's and its LoRA's gradients, which read h = act(g) * u."""
    _accumulate(acc, "w_down", d_out_rows.t(), h)
    if down_lora is not None:
        da = down[0]
        d_lora, dxa = down_lora
        h_cast = h.to(da.dtype)
        if "down_b" in acc:
            _accumulate(acc, "down_b", d_lora.t(), torch.mm(h_cast, da.t()))
        _accumulate(acc, "down_a", dxa.t(), h_cast)


def _backward_rows(d_out_rows, x_rows, saved_rows, w_gate, w_up, fused, factors, a, lora_scale, joined, activation,
                   w_down, down, n_rows, need_dxa_g, need_dxa_u, lora_back, dx_rows, acc):
    """One chunk of the backward (of the op's n_rows): writes dx_rows (unless None) and adds the chunk's share of each
    needed weight and LoRA gradient to its fp32 accumulator in `acc`. A
    function of its own so that the chunk's buffers are freed before the next chunk's exist."""
    ga, _, ua, _ = factors
    inter = w_gate.shape[0]
    h = down_lora = None
    if w_down is not None:
        # dh first, through a joined down weight of this chunk's own: it and [dy | dxa] are gone before the
        # recomputed g and u exist (the backward's peak: g/u, dh and the joined gate/up weight).
        dh_rows, down_lora = _down_backward(d_out_rows, w_down, down, _joined_down_weight(w_down, down, n_rows))
        if {"w_down", "down_a", "down_b"} & set(acc):
            h = dh_rows  # written over dh (a buffer of this chunk's, read first): no fourth [rows, I]
    else:
        dh_rows = _rows_unit_stride(d_out_rows, inter)
    if saved_rows is None:
        # dg, du overwrite the recomputed g, u: a chunk holds one [rows, 2I] buffer, not two.
        g, u, dgu, (x_cast, _, lora_g, lora_u) = _projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale,
                                                                   joined)
        dg, du = g, u
    else:
        g, u = saved_rows[:, :inter], saved_rows[:, inter:]
        dgu = torch.empty(saved_rows.shape, dtype=saved_rows.dtype, device=saved_rows.device)
        dg, du = dgu[:, :inter], dgu[:, inter:]
        x_cast, _, lora_g, lora_u = _lora_inputs(x_rows, factors, a)
    _act_mul_bwd(dh_rows, g, u, dg, du, activation, h)  # also forms h, for the down projection's gradients
    del dh_rows
    if h is not None:
        _down_grads(d_out_rows, h, down, down_lora, acc)
        del h
    if dx_rows is not None and joined is not None:
        dxa = _joined_input_grads(dgu, joined, x_rows.shape[1], lora_g, lora_u, lora_scale, a, dx_rows, acc)
    else:
        dxa = _lora_input_grads(dgu, inter, lora_g, lora_u, lora_back, lora_scale, need_dxa_g, need_dxa_u,
                                ga is not None and ga is ua, acc)
        # dL/d(x_cast @ a^T), rounded to the adapters' dtype as PEFT's autograd holds it.
        dxa = dxa.to(a.dtype) if dxa is not None else None
        if dx_rows is not None:
            if fused is not None:
                torch.mm(dgu, fused, out=dx_rows)
            else:
                torch.mm(dg, w_gate, out=dx_rows)
                dx_rows.addmm_(du, w_up)
            if a is not None:  # LoRA path, in the adapters' dtype (PEFT casts x up, so back down here)
                _add_product_(dx_rows, dxa, a)
    _accumulate(acc, "w_gate", dg.t(), x_rows)
    _accumulate(acc, "w_up", du.t(), x_rows)
    if "a" in acc:
        _accumulate(acc, "a", dxa.t(), x_cast)


def _lora_input_grads(dgu, inter, lora_g, lora_u, lora_back, scale, need_dxa_g, need_dxa_u, shared_a, acc):
    """Adds the B gradients of gate's and up's adapters and returns dL/d(xa) in fp32 (None if not needed), from
    the chunk's [dg | du]: one paired GEMM when _paired_lora_b gives its matrix, else per projection."""
    if lora_back is not None:
        return _paired_lora_backward(dgu, inter, lora_g, lora_u, lora_back, scale, need_dxa_g, acc)
    dxa_g = _lora_backward(dgu[:, :inter], lora_g, scale, need_dxa_g, acc, "gate_b")
    dxa_u = _lora_backward(dgu[:, inter:], lora_u, scale, need_dxa_u, acc, "up_b")
    if shared_a:
        return dxa_g + dxa_u
    if dxa_g is not None and dxa_u is not None:
        return torch.cat((dxa_g, dxa_u), dim=1)
    return dxa_g if dxa_g is not None else dxa_u


def _joined_input_grads(dgu, joined, hidden, lora_g, lora_u, scale, a, dx_rows, acc):
    """The backward through x for a chunk whose projections join LoRA (_joined_weight's J = [[W_g, B_g, 0],
    [W_u, 0, B_u]]): one GEMM [dg | du] @ J gives dg W_g + du W_u beside dL/d(xa) / scale laid out like xa,
    where two base GEMMs (the second adding into the first's output) and the paired LoRA product each read
    [dg | du] or dx again. Adds the B gradients, writes dx_rows = dg W_g + du W_u + dL/d(xa) A and returns
    dL/d(xa), in x's dtype as PEFT's autograd holds it under autocast."""
    _add_b_grads(dgu, joined.shape[0] // 2, lora_g, lora_u, acc)
    both = torch.mm(dgu, joined)
    dxa = both[:, hidden:] if scale == 1.0 else both[:, hidden:] * scale
    torch.addmm(both[:, :hidden], dxa, a, out=dx_rows)
    return dxa


def _add_b_grads(dgu, inter, lora_g, lora_u, acc):
    """Adds the chunk's share of gate's and up's B gradients, [dg | du]'s halves^T xa (scaled once at the end)."""
    if lora_g is not None:
        _accumulate(acc, "gate_b", dgu[:, :inter].t(), lora_g[0])
    if lora_u is not None:
        _accumulate(acc, "up_b", dgu[:, inter:].t(), lora_u[0])


def _paired_lora_b(factors, grad_dtype):
    """M with [dg | du] @ M = dL/d(xa) / scale for gate's and up's adapters together, laid out like xa:
    blockdiag(B_g, B_u) [2I, r_g + r_u] for two A's, [B_g; B_u] [2I, r] for one A that both share (its
    two terms summed by the GEMM). None unless both projections have adapters in the dtype of the
    projections' gradient (`grad_dtype`): otherwise [dg | du] would be cast whole, a [rows, 2I] temporary
    in the adapters' dtype (fp32 adapters on a bf16 base outside autocast), where casting one projection
    at a time keeps it at [rows, I]."""
    ga, gb, ua, ub = factors
    if ga is None or ua is None or not gb.dtype == ub.dtype == grad_dtype:
        return None
    return torch.cat((gb, ub)) if ga is ua else torch.block_diag(gb, ub)


def _paired_lora_backward(dgu, inter, lora_g, lora_u, lora_back, scale, need_dxa, acc):
    """_lora_backward for gate and up at once, from the chunk's [rows, 2I] buffer [dg | du]: the two B
    gradients as before, and dL/d(xa) for both adapters from one GEMM against _paired_lora_b's matrix
    (one launch where two products, two scalings and a concatenation took five)."""
    _add_b_grads(dgu, inter, lora_g, lora_u, acc)
    if not need_dxa:
        return None
    dxa = _mm_fp32(dgu, lora_back)
    return dxa if scale == 1.0 else dxa.mul_(scale)


def _lora_backward(d_proj, lora, scale, need_dxa, acc, b_name):
    """For one projection's adapter, given the gradient of the projection (LoRA included): adds
    d_proj^T xa to B's fp32 accumulator acc[b_name] (scaled once at the end) and returns dL/d(xa) in
    fp32 (None if not needed). d_proj is taken in the adapters' dtype, as PEFT's autograd holds it."""
    if lora is None:
        return None
    xa, b = lora
    d_proj = d_proj if d_proj.dtype == b.dtype else d_proj.to(b.dtype)
    _accumulate(acc, b_name, d_proj.t(), xa)
    if not need_dxa:
        return None
    dxa = _mm_fp32(d_proj, b)
    return dxa if scale == 1.0 else dxa.mul_(scale)


@_gated_mlp_backward_op.register_fake
def _(d_out, x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation, needs,
      w_down=None, down_lora_a=None, down_lora_b=None, down_lora_scale=1.0, saved_projections=None):
    inputs = (x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, w_down, down_lora_a, down_lora_b)
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t, need in zip(inputs, needs) if need]


def _gated_mlp_setup_context(ctx, inputs, output):
    (x, w_gate, w_up, ga, gb, ua, ub, lora_scale, activation,
     w_down, down_a, down_b, down_scale, save_projections, _skip_output_on_recompute) = inputs
    ctx.save_for_backward(x, w_gate, w_up, ga, gb, ua, ub, w_down, down_a, down_b,
                          output[1] if save_projections else None)
    ctx.lora_scale, ctx.activation, ctx.down_scale = lora_scale, activation, down_scale
    ctx.mark_non_differentiable(output[1])
    # Autograd would otherwise hand backward a zero-filled [N, 2I] gradient for the saved projections
    # (0.55 ms and 1.9 GB at 32k tokens of Llama-8B), which it ignores.
    ctx.set_materialize_grads(False)


def _gated_mlp_backward(ctx, d_out, _d_saved_projections):
    if d_out is None:  # the output was not used
        return (None,) * 15
    x, w_gate, w_up, ga, gb, ua, ub, w_down, down_a, down_b, saved = ctx.saved_tensors
    grad_inputs = (x, w_gate, w_up, ga, gb, ua, ub, w_down, down_a, down_b)
    # ctx.needs_input_grad follows gated_mlp's arguments: the 7 tensors, lora_scale, activation, then w_down, A, B
    # (trailing arguments left at their defaults are not listed).
    flags = (*ctx.needs_input_grad, *[False] * 15)
    flags = (*flags[:7], *flags[9:12])
    needs = [bool(n) and t is not None for n, t in zip(flags, grad_inputs)]
    grads = iter(_gated_mlp_backward_op(d_out, x, w_gate, w_up, ga, gb, ua, ub, ctx.lora_scale, ctx.activation, needs,
                                        w_down, down_a, down_b, ctx.down_scale, saved))
    grad_of = [next(grads) if n else None for n in needs]
    return (*grad_of[:7], None, None, *grad_of[7:], None, None, None)


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
    w_down: torch.Tensor | None = None,
    down_lora_a: torch.Tensor | None = None,
    down_lora_b: torch.Tensor | None = None,
    down_lora_scale: float = 1.0,
    save_projections: bool = False,
) -> torch.Tensor:
    """act(x @ w_gate.T [+ LoRA]) * (x @ w_up.T [+ LoRA]) -> [..., I], as HF + PEFT compute it,
    and with w_down [H_out, I] (and its LoRA) the down projection of that -> [..., H_out].

    x [..., H]; w_gate, w_up [I, H] in x's dtype (row slices of a fused gate_up weight are fine);
    LoRA factors in PEFT's layout, A [r, in] and B [out, r] (any float dtype, e.g. fp32 adapters on
    a bf16 base), scaled by lora_scale (PEFT's alpha / r; down_lora_scale for the down adapter);
    no LoRA dropout. activation: "silu" or "gelu_tanh". Backward keeps x and recomputes the
    projections, or with save_projections keeps the two projections instead (for layers that
    gradient checkpointing already re-runs).
    """
    out, _ = torch.ops.fastgrpo.gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                          float(lora_scale), activation, w_down, down_lora_a, down_lora_b,
                                          float(down_lora_scale), save_projections)
    return out
