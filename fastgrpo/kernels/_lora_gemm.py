"""The gated MLP's projection GEMMs with their LoRA terms (PEFT's vanilla LoRA), forward and backward.

A projection with an adapter is `base(x) + lora_B(lora_A(x)) * scale` as PEFT computes it. Two ways to run it:

- separate products: the base GEMM, then the rank-r product added into its output in place (cuBLAS's
  epilogue where the adapter shares the output's dtype);
- joined: one GEMM against a weight that carries the adapter's B beside the base weight, e.g.
  [x | s xa] @ [[W_g, B_g, 0], [W_u, 0, B_u]]^T for gate and up, h @ [W_down; A_down]^T for the down
  projection and its LoRA input. That spares a read and a write of a [rows, I] buffer per adapter; the joined
  weight is a per-call copy of the projection weights, so it is built only where it pays (`joins`).

The backward mirrors both: B gradients and dL/d(xa) from [dg | du] (one paired GEMM where it can), dx from the
joined weight when there is one. Gradients go into the fp32 accumulators of kernels/_row_chunks.py.
"lora" below is None or a pair (xa [rows, r] = x.to(A.dtype) @ A^T, B [I, r]).
"""
import torch

from fastgrpo.kernels import _dispatch
from fastgrpo.kernels._row_chunks import accumulate, mm_fp32

# A profile of these products: `python bench/bench_gated_mlp.py --block --shapes qwen2.5-1.5b --tokens 34816 --profile`.


def add_product_(out, a, b, alpha=1.0):
    """out += (a @ b) * alpha in place. When a shares out's dtype (adapters under autocast) cuBLAS's
    epilogue does the add: the product is summed in fp32 and rounded once, and no [rows, width]
    temporary is written and read back (H200, 32k tokens, I = 8960: that pass cost 0.1 ms a chunk)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b, alpha=alpha)
    else:
        out.add_(torch.mm(a, b), alpha=alpha)


def add_lora_(base, lora, scale):
    """base += (xa @ B^T) * scale in place: PEFT's `(base + lora_B(xa) * scale).to(base.dtype)`."""
    xa, b = lora
    add_product_(base, xa, b.t(), scale)


def fused_rows(w_gate, w_up):
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
    fused = fused_rows(w_gate, w_up)
    if fused is not None:
        torch.mm(x_rows, fused.t(), out=gu_rows)
    else:
        torch.mm(x_rows, w_gate.t(), out=g)
        torch.mm(x_rows, w_up.t(), out=u)
    return g, u, gu_rows


# Joined weights are built per call, a copy of the projections' weights ([2I, H] read and written), to spare
# a read and a write of [rows, I] per adapter: they can pay from rows ~ H up, not for a decode step's handful
# of rows. Joined from this many rows per hidden unit, and on the GPU path only, where those passes are
# memory-bound cuBLAS epilogues; the CPU torch path keeps the separate products.
JOIN_MIN_ROWS_PER_HIDDEN = 2


def _joins(weight, lora_a, rows, hidden):
    """Whether a LoRA'd projection's product joins its base weight's GEMM (see JOIN_MIN_ROWS_PER_HIDDEN)."""
    return (lora_a is not None and lora_a.dtype == weight.dtype and _dispatch.use_triton(weight)
            and rows >= JOIN_MIN_ROWS_PER_HIDDEN * hidden)


@torch.no_grad()  # a copy the op's own backward reads: never differentiated
def joined_weight(w_gate, w_up, factors, rows):
    """[[W_g, B_g, 0], [W_u, 0, B_u]] ([2I, H + r_g + r_u]; [[W_g, B_g], [W_u, B_u]] for one A that both
    share; a projection without adapter has no B column block), or None. With it one GEMM of x joined with
    its scaled LoRA inputs, [x | s xa], gives both projections with their LoRA terms: adding a rank-r
    product into g and u afterwards reads and writes the whole [rows, 2I] buffer once more (H200, 34,816
    tokens of Qwen2.5-1.5B's MLP: ~0.6 ms a pass). Only for adapters in the base's dtype (as autocast runs
    them), since one GEMM has one operand dtype (fp32 adapters on a bf16 base keep their own products),
    and only on the GPU path for `rows` of x from JOIN_MIN_ROWS_PER_HIDDEN per hidden unit. The backward
    multiplies [dg | du] by it for dx and dL/d(xa) at once (joined_input_grads)."""
    ga, gb, ua, ub = factors
    inter, hidden = w_gate.shape
    if not _joins(w_gate, ga if ga is not None else ua, rows, hidden):
        return None
    rank_g = ga.shape[0] if ga is not None else 0
    rank_u = ua.shape[0] if ua is not None and ua is not ga else 0
    # Each half written once by a concatenation into its rows (contiguous), zeros only in the [I, r] blocks: a
    # zero fill of the whole [2I, H + r] buffer and copies into its column slices cost three passes over it.
    joined = torch.empty(2 * inter, hidden + rank_g + rank_u, dtype=w_gate.dtype, device=w_gate.device)
    if ua is ga:  # [[W_g, B_g], [W_u, B_u]]: one A, whose columns both B's fill
        torch.cat((w_gate, gb), dim=1, out=joined[:inter])
        torch.cat((w_up, ub), dim=1, out=joined[inter:])
        return joined
    gate_blocks = (w_gate, *((gb,) if ga is not None else ()), *((w_gate.new_zeros(inter, rank_u),) if rank_u else ()))
    up_blocks = (w_up, *((w_up.new_zeros(inter, rank_g),) if rank_g else ()), *((ub,) if ua is not None else ()))
    torch.cat(gate_blocks, dim=1, out=joined[:inter])
    torch.cat(up_blocks, dim=1, out=joined[inter:])
    return joined


def _joined_gate_up(x_rows, xa, scale, joined, gu_rows=None):
    """g and u with their LoRA terms from one GEMM: [x | scale * xa] @ joined^T into the [rows, 2I] buffer."""
    # One concatenation (a copy into a column slice of the buffer strides every row: a slower, unvectorised kernel).
    x_joined = torch.cat((x_rows, xa if scale == 1.0 else xa * scale), dim=1)
    if gu_rows is None:
        gu_rows = torch.empty(x_rows.shape[0], joined.shape[0], dtype=x_rows.dtype, device=x_rows.device)
    torch.mm(x_joined, joined.t(), out=gu_rows)
    inter = joined.shape[0] // 2
    return gu_rows[:, :inter], gu_rows[:, inter:], gu_rows


def stacked_lora_a(factors):
    """The A that x is multiplied with, or None without LoRA: the one A (LoRA on one projection,
    or one A shared by gate and up as for a fused gate_up_proj), else [A_g; A_u] stacked so that
    both xa come from one skinny matmul."""
    ga, _, ua, _ = factors
    if ga is None or ua is None or ga is ua:
        return ga if ga is not None else ua
    return torch.cat((ga, ua))


def lora_inputs(x_rows, factors, a):
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


def _add_loras_(g, u, lora_g, lora_u, scale):
    """The adapters' terms added into the gate and up projections in place."""
    if lora_g is not None:
        add_lora_(g, lora_g, scale)
    if lora_u is not None:
        add_lora_(u, lora_u, scale)


def projections_rows(x_rows, w_gate, w_up, factors, a, lora_scale, joined, gu_rows=None):
    """(g, u, gu_rows, lora inputs as lora_inputs gives them) of some rows, LoRA included, written into
    gu_rows (a new buffer if None); from one GEMM when there is a joined weight."""
    lora = lora_inputs(x_rows, factors, a)
    _, xa, lora_g, lora_u = lora
    if joined is not None:
        g, u, gu_rows = _joined_gate_up(x_rows, xa, lora_scale, joined, gu_rows)
    else:
        g, u, gu_rows = _gate_up(x_rows, w_gate, w_up, gu_rows)
        _add_loras_(g, u, lora_g, lora_u, lora_scale)
    return g, u, gu_rows, lora


def down_forward(h_rows, w_down, down, out_rows, joined_down=None):
    """out_rows = h @ w_down^T [+ PEFT LoRA (h in the adapters' dtype) @ A^T @ B^T * scale], rounded once
    to out's dtype as PEFT's `(base + lora * scale).to(dtype)` does. With the joined [W_down; A_down]
    (joined_down_weight), h @ W^T and the LoRA input h @ A^T come from one GEMM: h ([rows, I], the chunk's
    largest operand) is read once, not a second time by a skinny product."""
    if joined_down is not None:
        _, db, scale = down
        width = out_rows.shape[1]
        base_and_xa = torch.mm(h_rows, joined_down.t())
        out_rows.copy_(base_and_xa[:, :width])  # out is the op's contiguous output, the GEMM's is wider
        add_lora_(out_rows, (base_and_xa[:, width:], db), scale)
        return
    torch.mm(h_rows, w_down.t(), out=out_rows)
    if down is not None:
        da, db, scale = down
        add_lora_(out_rows, (torch.mm(h_rows.to(da.dtype), da.t()), db), scale)


def joined_down_weight(w_down, down, rows):
    """[W_down; A_down] ([H_out + r, I]) for adapters in the base's dtype and enough rows, else None (same
    conditions as joined_weight). Forward: h times it gives the base output and the LoRA input at once
    (down_forward). Backward (built once a call, for all its chunks): dh of a chunk comes from one GEMM of
    [dy | dxa] with it, instead of adding dxa @ A into dh afterwards (a read and a write of the chunk's [rows, I]
    dh)."""
    if down is None or not _joins(w_down, down[0], rows, w_down.shape[0]):
        return None
    return torch.cat((w_down, down[0]))


def down_backward(d_out_rows, w_down, down, joined_down):
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
        add_product_(dh, dxa, da)
        return dh, (d_lora, dxa)
    dxa = torch.mm(d_lora, db)
    return torch.mm(torch.cat((d_out_rows, dxa), dim=1), joined_down), (d_lora, dxa)


def down_grads(d_out_rows, h, down, down_lora, acc):
    """Adds the chunk's share of the down weight's and its LoRA's gradients, which read h = act(g) * u."""
    accumulate(acc, "w_down", d_out_rows.t(), h)
    if down_lora is not None:
        da = down[0]
        d_lora, dxa = down_lora
        h_cast = h.to(da.dtype)
        if "down_b" in acc:
            accumulate(acc, "down_b", d_lora.t(), torch.mm(h_cast, da.t()))
        accumulate(acc, "down_a", dxa.t(), h_cast)


def lora_input_grads(dgu, inter, lora_g, lora_u, lora_back, scale, need_dxa_g, need_dxa_u, shared_a, acc):
    """Adds the B gradients of gate's and up's adapters and returns dL/d(xa) in fp32 (None if not needed), from
    the chunk's [dg | du]: one paired GEMM when paired_lora_b gives its matrix, else per projection."""
    if lora_back is not None:
        return _paired_lora_backward(dgu, inter, lora_g, lora_u, lora_back, scale, need_dxa_g, acc)
    dxa_g = _lora_backward(dgu[:, :inter], lora_g, scale, need_dxa_g, acc, "gate_b")
    dxa_u = _lora_backward(dgu[:, inter:], lora_u, scale, need_dxa_u, acc, "up_b")
    if shared_a:
        return dxa_g + dxa_u
    if dxa_g is not None and dxa_u is not None:
        return torch.cat((dxa_g, dxa_u), dim=1)
    return dxa_g if dxa_g is not None else dxa_u


def joined_input_grads(dgu, joined, hidden, lora_g, lora_u, scale, a, dx_rows, acc):
    """The backward through x for a chunk whose projections join LoRA (joined_weight's J = [[W_g, B_g, 0],
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
        accumulate(acc, "gate_b", dgu[:, :inter].t(), lora_g[0])
    if lora_u is not None:
        accumulate(acc, "up_b", dgu[:, inter:].t(), lora_u[0])


def paired_lora_b(factors, grad_dtype):
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
    gradients as before, and dL/d(xa) for both adapters from one GEMM against paired_lora_b's matrix
    (one launch where two products, two scalings and a concatenation took five)."""
    _add_b_grads(dgu, inter, lora_g, lora_u, acc)
    if not need_dxa:
        return None
    dxa = mm_fp32(dgu, lora_back)
    return dxa if scale == 1.0 else dxa.mul_(scale)


def _lora_backward(d_proj, lora, scale, need_dxa, acc, b_name):
    """For one projection's adapter, given the gradient of the projection (LoRA included): adds
    d_proj^T xa to B's fp32 accumulator acc[b_name] (scaled once at the end) and returns dL/d(xa) in
    fp32 (None if not needed). d_proj is taken in the adapters' dtype, as PEFT's autograd holds it."""
    if lora is None:
        return None
    xa, b = lora
    d_proj = d_proj if d_proj.dtype == b.dtype else d_proj.to(b.dtype)
    accumulate(acc, b_name, d_proj.t(), xa)
    if not need_dxa:
        return None
    dxa = mm_fp32(d_proj, b)
    return dxa if scale == 1.0 else dxa.mul_(scale)

