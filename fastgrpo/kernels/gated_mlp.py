"""Gated MLP (SwiGLU / GeGLU), with or without its down projection, saving only x for backward
(or x and the gate and up projections).

    torch.ops.fastgrpo.gated_mlp(x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                 lora_scale, activation, w_down, down_lora_a, down_lora_b,
                                 down_lora_scale, save_projections, skip_output_on_recompute)
        -> (out, saved_projections)

It matches HF + PEFT (vanilla LoRA, no dropout):
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
recomputes g and u, and gets dg, du from one Triton kernel (kernels/act_mul.py).
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

Forward and backward walk the rows of x in chunks (kernels/_row_chunks.py: a chunk's g/u buffer is about
256 MiB), so apart from the output, the saved projections and the incoming gradient no [tokens x
intermediate] temporary exists at any time. Each chunk writes its rows of out or dx and adds its share of the
weight and LoRA gradients to fp32 accumulators.

Matmuls, the LoRA terms and every LoRA gradient: cuBLAS (kernels/_lora_gemm.py). Triton: act(g) * u and its
backward, the memory-bound part (LoRA terms computed inside those kernels made them 4-10x slower than their
memory traffic on an H200).
"""
import math

import torch

from fastgrpo.kernels import _dispatch, _graphs
from fastgrpo.kernels._lora_gemm import (
    add_product_, down_backward, down_forward, down_grads, fused_rows, joined_down_weight, joined_input_grads,
    joined_weight, lora_input_grads, lora_inputs, paired_lora_b, projections_rows, stacked_lora_a,
)
from fastgrpo.kernels._row_chunks import accumulate, row_chunks, summed
from fastgrpo.kernels.act_mul import act_mul_backward_into, act_mul_into, check_activation, rows_unit_stride


# Calls replay as CUDA graphs up to this much MLP work (rows x hidden x intermediate): 16384 rows of Qwen2.5-1.5B's
# MLP. There a 1.5B GRPO step is host-bound (1024-token completions, 10,240 rows); from ~35k rows (4096) it is bound
# by the GPU, and a graph's staging copies would only add to it.
GRAPH_MAX_WORK = 16384 * 1536 * 8960
# Rows a chunk of a replayed call has at most: a graph's launches cost no host time, and its temporaries stay
# reserved in the graphs' pool, so replayed calls take smaller chunks than the eager ones.
GRAPH_CHUNK_ROWS = 2048


def _check_gated_mlp(x, w_gate, w_up, ga, gb, ua, ub, activation, w_down=None, da=None, db=None):
    check_activation("gated_mlp", activation)
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


def _forward_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, activation, w_down, down, joined_down,
                  out_rows, gu_rows):
    # One chunk, in a function of its own so that its buffers are freed before the next
    # chunk's are allocated.
    g, u, _, _ = projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, gu_rows)
    if w_down is None:
        h_rows = out_rows
    elif gu_rows is None:  # h over g (read before written, element by element): the chunk needs no third [rows, I]
        h_rows = g
    else:  # g and u are the saved projections
        h_rows = torch.empty(g.shape, dtype=x_rows.dtype, device=x_rows.device)
    act_mul_into(g, u, h_rows, activation)
    if w_down is not None:
        down_forward(h_rows, w_down, down, out_rows, joined_down)


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
    skip_output = skip_output_on_recompute and _dispatch.in_checkpoint_recompute()
    _dispatch.signal_backward_peak()  # the backward calls backward_peak_passed() when its chunk buffers are gone
    if skip_output and not save_projections:  # the recompute re-saves x: nothing to compute
        return (torch.zeros(*x.shape[:-1], _out_width(w_gate, w_down), dtype=x.dtype, device=x.device),
                _saved_projections(x, w_gate, False))
    x2d = x.reshape(-1, x.shape[-1])
    if not skip_output and not save_projections and _replays(x2d, w_gate):
        outputs = _graphs.replayed(
            "gated_mlp", lambda rows, lora: _forward(rows[0], w_gate, w_up, *lora[:4], lora_scale, activation, w_down,
                                                     *lora[4:], down_lora_scale, False, False, GRAPH_CHUNK_ROWS),
            (w_gate, w_up, w_down), (x2d,), (*factors, down_lora_a, down_lora_b),
            (lora_scale, activation, down_lora_scale, GRAPH_CHUNK_ROWS), row_outputs=(0,), lead=tuple(x.shape[:-1]))
        if outputs is not None:
            return tuple(outputs)
    return _forward(x2d, w_gate, w_up, *factors, lora_scale, activation, w_down, down_lora_a, down_lora_b,
                    down_lora_scale, save_projections, skip_output, lead=tuple(x.shape[:-1]))


def _replays(x2d, w_gate) -> bool:
    """Whether a call replays as a CUDA graph (kernels/_graphs.py): on CUDA, for row counts whose MLP work (rows x
    hidden x intermediate) is at most GRAPH_MAX_WORK, where the op's host time is as long as its GPU time."""
    rows, (inter, hidden) = x2d.shape[0], w_gate.shape
    return rows > 0 and rows * hidden * inter <= GRAPH_MAX_WORK and _graphs.applies(x2d.device)


def _forward(x2d, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation, w_down,
             down_lora_a, down_lora_b, down_lora_scale, save_projections, skip_output, chunk_rows=None, lead=None):
    """The op on x2d [rows, H] (see _gated_mlp_op): (out [*lead, width] (lead: (rows,) if None), saved projections);
    chunks of at most `chunk_rows` rows if given. out is a tensor of its own, not a view (an op output that is a view
    cannot be modified in place)."""
    factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    inter = w_gate.shape[0]
    width = _out_width(w_gate, w_down)
    lead = (x2d.shape[0],) if lead is None else lead
    out = (torch.zeros if skip_output else torch.empty)(*lead, width, dtype=x2d.dtype, device=x2d.device)
    out2d = out.view(-1, width)
    gu = _saved_projections(x2d, w_gate, save_projections)
    a = stacked_lora_a(factors)
    joined = joined_weight(w_gate, w_up, factors, x2d.shape[0])
    down = _down_factors(w_down, down_lora_a, down_lora_b, down_lora_scale)
    joined_down = None if skip_output else joined_down_weight(w_down, down, x2d.shape[0])
    for start, end in row_chunks(x2d.shape[0], inter, x2d.dtype, x2d.shape[1], chunk_rows):
        if skip_output:
            projections_rows(x2d[start:end], w_gate, w_up, factors, a, lora_scale, joined, gu[start:end])
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
    saved = saved_projections if saved_projections is not None and saved_projections.numel() else None
    x2d = x.reshape(-1, x.shape[-1])
    factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    grads = None
    if saved is None and _replays(x2d, w_gate):
        grads = _graphs.replayed(
            "gated_mlp_backward",
            lambda rows, lora: _backward(rows[0], rows[1], w_gate, w_up, *lora[:4], lora_scale, activation, needs,
                                         w_down, *lora[4:], down_lora_scale, None, GRAPH_CHUNK_ROWS),
            (w_gate, w_up, w_down), (d_out.reshape(x2d.shape[0], -1), x2d), (*factors, down_lora_a, down_lora_b),
            (lora_scale, activation, tuple(needs), down_lora_scale, GRAPH_CHUNK_ROWS),
            row_outputs=(0,) if needs[0] else (), lead=tuple(x.shape[:-1]))
    if grads is None:
        grads = _backward(d_out, x, w_gate, w_up, *factors, lora_scale, activation, needs, w_down, down_lora_a,
                          down_lora_b, down_lora_scale, saved)
    _dispatch.backward_peak_passed()
    return grads


def _backward(d_out, x, w_gate, w_up, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, lora_scale, activation, needs,
              w_down, down_lora_a, down_lora_b, down_lora_scale, saved, chunk_rows=None):
    """The backward op's gradients (see _gated_mlp_backward_op); `saved` the projections or None; chunks of at most
    `chunk_rows` rows if given."""
    need = dict(zip(_GRAD_INPUTS, needs, strict=True))
    ga, gb, ua, ub = factors = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b)
    hidden, inter = x.shape[-1], w_gate.shape[0]
    x2d = x.reshape(-1, hidden)
    d_out2d = d_out.reshape(-1, _out_width(w_gate, w_down))
    fused = fused_rows(w_gate, w_up)
    a = stacked_lora_a(factors)
    down = _down_factors(w_down, down_lora_a, down_lora_b, down_lora_scale)
    # The joined weight serves the recompute of g and u and, for dx, the GEMM of [dg | du] (joined_input_grads).
    joined = joined_weight(w_gate, w_up, factors, x2d.shape[0]) if saved is None or need["x"] else None
    # [W_down; A_down], once for all chunks: a weight-sized temporary beside the joined gate/up weight (half its
    # size), where building it per chunk reads and writes it once a chunk (at a 7B shape's 3,456-row chunks as many
    # bytes as the pass over the chunk's dh that joining it spares).
    joined_down = joined_down_weight(w_down, down, x2d.shape[0])
    # Gradients of gate's and up's A come from one accumulator for `a` (split at the end), so
    # both LoRA x-side gradients are formed whenever either A or x needs them.
    need_da = need["gate_a"] or need["up_a"]
    need_dxa_g = ga is not None and (need["x"] or need_da)
    need_dxa_u = ua is not None and (need["x"] or need_da)
    # dL/d(xa) from a product of its own (paired when it can be), unless the joined GEMM for dx gives it.
    lora_back = None if need["x"] and joined is not None else paired_lora_b(factors, x.dtype if saved is None
                                                                             else saved.dtype)

    # fp32 gradient sums over the chunks, one per needed gradient (None until the first chunk's).
    needed = dict(w_gate=need["w_gate"], w_up=need["w_up"], a=need_da, gate_b=need["gate_b"], up_b=need["up_b"],
                  w_down=need["w_down"], down_a=need["down_a"], down_b=need["down_b"])
    acc = {name: None for name, wanted in needed.items() if wanted}
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need["x"] else None
    dx2d = dx.view(-1, hidden) if need["x"] else None
    for start, end in row_chunks(x2d.shape[0], inter, x.dtype, x2d.shape[1], chunk_rows):
        _backward_rows(d_out2d[start:end], x2d[start:end], None if saved is None else saved[start:end],
                       w_gate, w_up, fused, factors, a, lora_scale, joined, activation, w_down, down, joined_down,
                       need_dxa_g, need_dxa_u, lora_back, dx2d[start:end] if need["x"] else None, acc)
    grads = []
    if need["x"]:
        grads.append(dx)
    if need["w_gate"]:
        grads.append(summed(acc, "w_gate", w_gate).to(w_gate.dtype))
    if need["w_up"]:
        grads.append(summed(acc, "w_up", w_up).to(w_up.dtype))
    d_a_both = summed(acc, "a", a) if need_da else None
    # Returned gradients may not alias each other (copy=True: the accumulator may have A's dtype).
    # One A shared by gate and up gets its whole gradient in the gate slot (autograd adds the two
    # slots), so the two halves are not rounded separately before they are summed.
    if need["gate_a"]:
        d_a = d_a_both if ga is ua or ua is None else d_a_both[: ga.shape[0]]
        grads.append(d_a.to(ga.dtype, copy=True))
    if need["gate_b"]:
        grads.append((summed(acc, "gate_b", gb) * lora_scale).to(gb.dtype))
    if need["up_a"]:
        d_a = torch.zeros_like(ua) if ga is ua else d_a_both if ga is None else d_a_both[ga.shape[0]:]
        grads.append(d_a.to(ua.dtype, copy=True))
    if need["up_b"]:
        grads.append((summed(acc, "up_b", ub) * lora_scale).to(ub.dtype))
    for name, like in (("w_down", w_down), ("down_a", down_lora_a), ("down_b", down_lora_b)):
        if need[name]:
            grads.append(summed(acc, name, like).to(like.dtype))
    return grads



def _backward_rows(d_out_rows, x_rows, saved_rows, w_gate, w_up, fused, factors, a, lora_scale, joined, activation,
                   w_down, down, joined_down, need_dxa_g, need_dxa_u, lora_back, dx_rows, acc):
    """One chunk of the backward: writes dx_rows (unless None) and adds the chunk's share of each
    needed weight and LoRA gradient to its fp32 accumulator in `acc`. A
    function of its own so that the chunk's buffers are freed before the next chunk's exist."""
    ga, _, ua, _ = factors
    inter = w_gate.shape[0]
    h = down_lora = None
    if w_down is not None:
        # dh first ([dy | dxa] is gone before the recomputed g and u exist: the chunk's peak is g/u and dh).
        dh_rows, down_lora = down_backward(d_out_rows, w_down, down, joined_down)
        if {"w_down", "down_a", "down_b"} & set(acc):
            h = dh_rows  # written over dh (a buffer of this chunk's, read first): no fourth [rows, I]
    else:
        dh_rows = rows_unit_stride(d_out_rows, inter)
    if saved_rows is None:
        # dg, du overwrite the recomputed g, u: a chunk holds one [rows, 2I] buffer, not two.
        g, u, dgu, (x_cast, _, lora_g, lora_u) = projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale,
                                                                   joined)
        dg, du = g, u
    else:
        g, u = saved_rows[:, :inter], saved_rows[:, inter:]
        dgu = torch.empty(saved_rows.shape, dtype=saved_rows.dtype, device=saved_rows.device)
        dg, du = dgu[:, :inter], dgu[:, inter:]
        x_cast, _, lora_g, lora_u = lora_inputs(x_rows, factors, a)
    act_mul_backward_into(dh_rows, g, u, dg, du, activation, h)  # also forms h, for the down projection's gradients
    del dh_rows
    if h is not None:
        down_grads(d_out_rows, h, down, down_lora, acc)
        del h
    if dx_rows is not None and joined is not None:
        dxa = joined_input_grads(dgu, joined, x_rows.shape[1], lora_g, lora_u, lora_scale, a, dx_rows, acc)
    else:
        dxa = lora_input_grads(dgu, inter, lora_g, lora_u, lora_back, lora_scale, need_dxa_g, need_dxa_u,
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
                add_product_(dx_rows, dxa, a)
    accumulate(acc, "w_gate", dg.t(), x_rows)
    accumulate(acc, "w_up", du.t(), x_rows)
    if "a" in acc:
        accumulate(acc, "a", dxa.t(), x_cast)



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
