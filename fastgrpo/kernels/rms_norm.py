"""RMSNorm and residual-add + RMSNorm as fastgrpo custom ops.

    torch.ops.fastgrpo.rms_norm(x, weight, eps, offset, weight_in_fp32, out_dtype) -> normed
    torch.ops.fastgrpo.add_rms_norm(x, residual, weight, eps, offset, weight_in_fp32, out_dtype)
        -> (sum, normed)

Rounding points (they make the result equal HF eager code up to the last bit of fp32
reductions):
    s   = x + residual, in promote_types(x, residual), rounded    (add variant; "src" = s, else x)
    n   = src.float() * rsqrt(mean(src.float()^2) + eps)           (fp32)
    weight None:            y = n.to(out_dtype)
    weight_in_fp32 False:   y = (n.to(src.dtype) * w_eff) in promote_types(src, weight), rounded,
                            then .to(out_dtype); w_eff = weight, or (weight + offset) rounded to
                            weight.dtype when offset != 0                  (Llama family)
    weight_in_fp32 True:    y = (n * (weight.float() + offset)).to(out_dtype)  (Gemma, OLMo2)

Saved for backward: the normalised input (x, or the sum s) and the weight. Nothing else:
the backward kernel reads every row in full anyway, so it recomputes rstd from that row
instead of keeping an fp32 [rows] tensor alive between forward and backward.

Backward differentiates the fp32 formula (the intermediate roundings are ignored):
    g  = dy * w_eff            dx = rstd * (g - n * mean(g * n))  (+ d(sum) for the add variant)
    dw = sum over rows of dy * n, as per-program fp32 partials summed afterwards (deterministic).
The add variant returns one gradient for x and residual (the same tensor when their dtypes
match), as d(x + residual) / dx = d(x + residual) / dresidual = 1.

CUDA tensors run the Triton kernels; CPU tensors run the torch implementation below (or the
Triton kernels through the interpreter inside `_dispatch.triton_on_cpu()`). The ops are triton_ops:
in a compiled training graph inductor launches the kernels itself (`_dispatch.traced`), where a custom
op's call costs ~0.1-0.6 ms of host time (`python bench/bench_op_host.py`, on the H200 machines' hosts)
in a step that is host-bound at short completions.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fastgrpo.kernels import _dispatch

# One row must fit one Triton block; wider rows are rejected (the compiler pass leaves them to
# inductor and reports the site).
MAX_HIDDEN_SIZE = 65536

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(rows, n1, n2, stride0, stride1, stride2):
    """Element offset of each row of a [n0, n1, n2, H] strided tensor (rows are int64)."""
    i2 = rows % n2
    rest = rows // n2
    return (rest // n1) * stride0 + (rest % n1) * stride1 + i2 * stride2


@triton.jit
def _cast(x, DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """fp32 x rounded to DTYPE (round to nearest even).

    Triton's interpreter truncates fp32 -> bf16 (casts and stores alike); with
    EMULATE_BF16_RTNE (set on the CPU/interpreter path only) the rounding is done on the bits,
    after which the interpreter's truncating cast is exact."""
    if EMULATE_BF16_RTNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def _fp32_scalars(eps, offset):
    """eps and offset as fp32: launched from a compiled graph (see _dispatch.traced), Python floats arrive as fp64
    scalars, which would carry the row's maths into fp64."""
    return tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, x_s0, x_s1, x_s2,
    res_ptr, res_s0, res_s1, res_s2,
    w_ptr,
    y_ptr,
    sum_ptr,
    n_rows, n1, n2, H,
    eps, offset,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_IN_FP32: tl.constexpr,
    ROUND_W_EFF: tl.constexpr,  # llama mode with offset != 0: (w + offset) rounded to w's dtype
    SRC_DTYPE: tl.constexpr,  # dtype of the normalised input (x, or the rounded sum)
    W_DTYPE: tl.constexpr,
    PROD_DTYPE: tl.constexpr,  # llama mode: dtype the product n.to(src) * w_eff is rounded to
    OUT_DTYPE: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
    EARLY_DEPENDENTS: tl.constexpr,  # see _early_dependents
):
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()  # launched as a programmatic dependent: the kernel before has finished
        if EARLY_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
    eps, offset = _fp32_scalars(eps, offset)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    out_offsets = rows[:, None] * H + cols[None, :]

    x_offsets = _row_offsets(rows, n1, n2, x_s0, x_s1, x_s2)
    # Upcast right after the load: all arithmetic in fp32, rounding only where torch rounds.
    v = tl.load(x_ptr + x_offsets[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_offsets = _row_offsets(rows, n1, n2, res_s0, res_s1, res_s2)
        r = tl.load(res_ptr + res_offsets[:, None] + cols[None, :], mask=mask, other=0.0)
        v = _cast(v + r.to(tl.float32), SRC_DTYPE, EMULATE_BF16_RTNE)
        tl.store(sum_ptr + out_offsets, v, mask=mask)
        v = v.to(tl.float32)

    rstd = tl.math.rsqrt(tl.sum(v * v, axis=1) / H + eps)
    n = v * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if WEIGHT_IN_FP32:
            y = n * (w + offset)[None, :]
        else:
            if ROUND_W_EFF:
                w = _cast(w + offset, W_DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
            n = _cast(n, SRC_DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
            y = _cast(n * w[None, :], PROD_DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
    else:
        y = n
    tl.store(y_ptr + out_offsets, _cast(y, OUT_DTYPE, EMULATE_BF16_RTNE), mask=mask)


@triton.jit
def _load_rows(ptr, rows, n_rows, n1, n2, stride0, stride1, stride2, cols, col_mask):
    offsets = _row_offsets(rows, n1, n2, stride0, stride1, stride2)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return tl.load(ptr + offsets[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_bwd_inputs(src_ptr, dy_ptr, dsum_ptr, rows, n_rows, n1, n2, src_s0, src_s1, src_s2, dy_s0, dy_s1, dy_s2,
                     dsum_s0, dsum_s1, dsum_s2, cols, col_mask, HAS_DSUM: tl.constexpr):
    """A row block's normalised input, incoming gradient and the sum's gradient (without one: the incoming
    gradient again, unused), as stored."""
    v = _load_rows(src_ptr, rows, n_rows, n1, n2, src_s0, src_s1, src_s2, cols, col_mask)
    dy = _load_rows(dy_ptr, rows, n_rows, n1, n2, dy_s0, dy_s1, dy_s2, cols, col_mask)
    dsum = dy
    if HAS_DSUM:
        dsum = _load_rows(dsum_ptr, rows, n_rows, n1, n2, dsum_s0, dsum_s1, dsum_s2, cols, col_mask)
    return v, dy, dsum


@triton.jit
def _bwd_rows(v, dy, dsum, w, eps, H, rows, n_rows, cols, col_mask, dx_ptr,
              HAS_DSUM: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DX: tl.constexpr, DX_DTYPE: tl.constexpr,
              EMULATE_BF16_RTNE: tl.constexpr):
    """Stores dx of one row block (NEED_DX) from the loaded v, dy and dsum, rstd recomputed from v, and returns
    the block's fp32 terms of dW, dy * n (dropped by the compiler where no dW is summed)."""
    v = v.to(tl.float32)
    dy = dy.to(tl.float32)
    sum_vv = tl.sum(v * v, axis=1)
    if NEED_DX:
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        # sum(g * n) = rstd * sum(g * v): the row's two sums do not wait on each other (a row is
        # one warp's work at narrow widths, where each sum is a chain of shuffles).
        sum_gv = tl.sum(g * v, axis=1)
    rstd = tl.math.rsqrt(sum_vv / H + eps)
    n = v * rstd[:, None]
    if NEED_DX:
        mean_gn = rstd * sum_gv / H
        dx = (g - n * mean_gn[:, None]) * rstd[:, None]
        if HAS_DSUM:
            dx += dsum.to(tl.float32)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        tl.store(dx_ptr + rows[:, None] * H + cols[None, :], _cast(dx, DX_DTYPE, EMULATE_BF16_RTNE), mask=mask)
    return dy * n


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, dy_s0, dy_s1, dy_s2,
    dsum_ptr, dsum_s0, dsum_s1, dsum_s2,
    src_ptr, src_s0, src_s1, src_s2,
    w_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows, n1, n2, H,
    eps, offset,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROUND_W_EFF: tl.constexpr,
    W_DTYPE: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    DX_DTYPE: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PIPELINE_STAGES: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    """PERSISTENT: each program walks row blocks pid, pid + P, pid + 2P, ... (P = number of programs) and,
    when dW is needed, writes its fp32 partial sum of dy * n to dw_partial[pid]. Otherwise (no dW) each
    program does one row block, straight through, as inductor's own kernels do: no loop, no prefetch, so
    few registers a thread and many programs on an SM, which keep the loads in flight.
    DEPENDENT_LAUNCH (then NEED_DW is False, or the dW reduction follows as this kernel's programmatic
    dependent): wait for the kernel before, and let the reduction's programs start now (they take their
    place on the SMs and wait there for this kernel's partials).

    Persistent programs keep the next blocks' loads in flight while a block computes, which keeps the few
    programs a dW reduction allows busy on memory. PIPELINE_STAGES = 0: the next block is prefetched into
    registers by hand; > 0: Triton's software pipelining keeps PIPELINE_STAGES - 1 blocks in
    flight, staged through shared memory (cp.async on sm_80+), so they cost no registers."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()
        if NEED_DW:
            tl.extra.cuda.gdc_launch_dependents()
    eps, offset = _fp32_scalars(eps, offset)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H

    w = tl.zeros((BLOCK_H,), dtype=tl.float32)  # unused without a weight
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ROUND_W_EFF:
            w = _cast(w + offset, W_DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
        else:
            w = w + offset
    rows = (pid * BLOCK_ROW + tl.arange(0, BLOCK_ROW)).to(tl.int64)  # int64: offsets pass 2**31

    if not PERSISTENT:
        v, dy, dsum = _load_bwd_inputs(src_ptr, dy_ptr, dsum_ptr, rows, n_rows, n1, n2, src_s0, src_s1, src_s2,
                                       dy_s0, dy_s1, dy_s2, dsum_s0, dsum_s1, dsum_s2, cols, col_mask, HAS_DSUM)
        _bwd_rows(v, dy, dsum, w, eps, H, rows, n_rows, cols, col_mask, dx_ptr,
                  HAS_DSUM, HAS_WEIGHT, NEED_DX, DX_DTYPE, EMULATE_BF16_RTNE)
        return

    step = tl.num_programs(0) * BLOCK_ROW
    if NEED_DW:
        dw_acc = tl.zeros((BLOCK_ROW, BLOCK_H), dtype=tl.float32)
    if PIPELINE_STAGES == 0:
        v_next, dy_next, dsum_next = _load_bwd_inputs(
            src_ptr, dy_ptr, dsum_ptr, rows, n_rows, n1, n2, src_s0, src_s1, src_s2, dy_s0, dy_s1, dy_s2,
            dsum_s0, dsum_s1, dsum_s2, cols, col_mask, HAS_DSUM)
    # num_stages 0 leaves the loop unpipelined (as a plain range); > 1 pipelines loads that feed no dot.
    for _ in tl.range(pid * BLOCK_ROW, n_rows, step, num_stages=PIPELINE_STAGES):
        if PIPELINE_STAGES == 0:
            v, dy, dsum = v_next, dy_next, dsum_next
            v_next, dy_next, dsum_next = _load_bwd_inputs(
                src_ptr, dy_ptr, dsum_ptr, rows + step, n_rows, n1, n2, src_s0, src_s1, src_s2, dy_s0, dy_s1, dy_s2,
                dsum_s0, dsum_s1, dsum_s2, cols, col_mask, HAS_DSUM)
        else:
            v, dy, dsum = _load_bwd_inputs(src_ptr, dy_ptr, dsum_ptr, rows, n_rows, n1, n2, src_s0, src_s1, src_s2,
                                           dy_s0, dy_s1, dy_s2, dsum_s0, dsum_s1, dsum_s2, cols, col_mask, HAS_DSUM)
        dw_terms = _bwd_rows(v, dy, dsum, w, eps, H, rows, n_rows, cols, col_mask, dx_ptr,
                             HAS_DSUM, HAS_WEIGHT, NEED_DX, DX_DTYPE, EMULATE_BF16_RTNE)
        if NEED_DW:
            dw_acc += dw_terms
        rows += step

    if NEED_DW:
        tl.store(dw_partial_ptr + pid * H + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _dw_reduce_kernel(
    partial_ptr, dw_ptr, n_partials, H,
    DW_DTYPE: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
    EARLY_DEPENDENTS: tl.constexpr,  # see _early_dependents
):
    """dw[c] = sum over p of partial[p, c], in a fixed order (deterministic), rounded once.
    DEPENDENT_LAUNCH: wait here until the backward has finished and its partials are visible."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()
        if EARLY_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(partial_ptr + p[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + cols, _cast(tl.sum(acc, axis=0), DW_DTYPE, EMULATE_BF16_RTNE), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------


def _block_h(H: int) -> int:
    return _dispatch.next_power_of_2(H)


# Launch configurations: the fastest of `python bench/bench_rms_norm.py --sweep` (H200, rows 32768,
# H in {576, 1536, 4096, 8192}, bf16). The best ones share a pattern: a fixed number of
# elements per program and per thread, whatever H.


def _fwd_config(H: int, on_cuda: bool) -> tuple[int, int]:
    """(rows per program, num_warps) for the forward kernel: >= 2048 elements a program,
    32 a thread."""
    block_h = _block_h(H)
    if not on_cuda:
        # Interpreter: each program costs Python overhead, so few programs with big blocks.
        return max(1, 16384 // block_h), 1
    block_row = max(1, 2048 // block_h)
    return block_row, min(32, max(2, block_row * block_h // 1024))


def _bwd_config(H: int, on_cuda: bool, need_dw: bool, has_dsum: bool = False) -> tuple[int, int, Optional[int], int]:
    """(rows per program, num_warps, programs per SM, pipeline stages) for the backward kernel. Programs
    per SM None: one row block a program, straight through (never with dW); otherwise persistent programs,
    which loop over row blocks with the next block's loads in flight: by Triton's software pipelining
    (stages > 0: stages - 1 blocks in shared memory) or, stages 0, prefetched into registers.

    Each rule is the fastest of `python bench/bench_rms_norm.py --sweep KIND --stages 0 2 3 4` (KIND bwd,
    bwd+dw, add_bwd, add_bwd+dw; H200, rows 32768, bf16; us, against the runner-up):
    - no dW, 1024-wide blocks (without d(sum)) and 2048-wide: one row a program, straight through, as inductor's
      own backward: few registers a thread, many programs an SM (1 warp at 1024 wide, 2 at 2048, 4 with d(sum)).
      H = 576 28.4 against 29.6 (inductor 28.2), H = 1536 70.6 against 74.9, with d(sum) 93.1 against 95.6.
      H = 576 with d(sum) loses (38.5 against 37.8) and keeps the next rule; so do narrower rows (per-head q/k
      norms), where one short row would be a very small program.
    - up to 1024 wide otherwise: one warp holds the row, so its two sums never leave the warp; 8 programs an
      SM, 4 stages (3 with d(sum), a third input in shared memory). Against register prefetch, H = 576: with dW
      36.8 against 45.5 (with d(sum) 43.4 against 55.3), without dW 29.7 against 35.9 (37.9 against 43.2).
    - 1024 wide with dW, without d(sum): 2 rows a program (one a warp), 6 programs an SM, 3 stages, the best of
      59 configurations around it: H = 576 31.98 against 32.49 (with d(sum) level, 40.81 against 40.94).
    - 2048 wide: 2 warps, 4 programs an SM, 3 stages. H = 1536 with dW 82.2 against 89.3 for register prefetch,
      without dW 74.8 against 77.6 (95.2 against 99.3 with d(sum)).
    - wider: register prefetch (pipelined loads lose at H = 4096 without dW: 202.8 against 194.7, with d(sum)
      282.3 against 252.8). Each program keeps two row blocks of every input in registers (this one and the
      next), so the block shrinks as inputs are added:
        plain:              4096 to 16384 elements a program, 32 a thread;
        with dW:            2048 elements a program (or one row), 16 a thread (32 with d(sum) as a third input),
                            4 programs an SM (2 from 4096 elements), the fp32 accumulator taking registers too;
        d(sum), no dW:      1024 elements a program (or one row), 16 a thread, 8 programs an SM (the plain
                            rule's blocks: H = 4096 548 against 253)."""
    block_h = _block_h(H)
    if not on_cuda:
        return max(1, 16384 // block_h), 1, (2 if need_dw else None), 0
    if not need_dw and (block_h == 2048 or (block_h == 1024 and not has_dsum)):
        return 1, (4 if has_dsum else block_h // 1024), None, 0
    if block_h == 1024 and need_dw and not has_dsum:
        return 2, 2, 6, 3
    if block_h <= 1024:
        return 1, 1, 8, (3 if has_dsum else 4)
    if block_h <= 2048:
        return 1, 2, 4, 3
    if need_dw:
        block_row = max(1, 2048 // block_h)
        elements = block_row * block_h
        num_warps = elements // (1024 if has_dsum else 512)
        return block_row, min(32, max(2, num_warps)), (4 if elements <= 2048 else 2), 0
    if has_dsum:
        block_row = max(1, 1024 // block_h)
        return block_row, min(32, max(2, block_row * block_h // 512)), 8, 0
    block_row = max(1, min(max(4 * block_h, 4096), 16384) // block_h)
    return block_row, min(32, max(4, block_row * block_h // 1024)), (8 if block_h >= 8192 else 4), 0


def _dw_reduce_config(most_programs: int) -> tuple[int, int, int]:
    """(partials per load, columns per program, num_warps) of the dW reduction: one pass over the
    partials per column block (a loop of loads would serialise on latency), so up to 2048 partials a
    load: the H200's 8 programs per SM x 132 SMs are 1056, one more than a 1024 block. Sized for the
    most partials the device's backward writes (fewer are masked): a compiled graph holds their number
    as a symbol of the row count."""
    block_p = min(2048, _dispatch.next_power_of_2(most_programs))
    # `python bench/bench_rms_norm.py --sweep-reduce` (H200, rows 32768, bf16; backward with dW, us): 8 columns a
    # program, so that at H = 576 72 programs read the 1056 partials instead of 36: 33.4 against 34.6 with 16
    # columns (H = 1536 level, 78.7-79.0); one pass over 2048 partials (16 warps) against two over 1024 (8 warps):
    # 33.1 against 33.9, with d(sum) 41.5 against 42.1, within 0.2 of the best of the 79 configurations swept.
    return block_p, 8, max(1, min(16, block_p // 64))


def _early_dependents(H: int) -> bool:
    """Whether the forward and the dW reduction, launched as programmatic dependents, let the kernel after them
    launch as soon as all their programs have started (`gdc_launch_dependents`; otherwise it launches when they
    end): rows up to 1024 wide, where the kernels are short and the boundaries between them a larger share.
    `python bench/bench_rms_norm.py` (CUDA graphs), with this returning True and False in turns (H200, rows 32768,
    bf16, fwd + bwd with dW, us): H = 576 52.75 against 53.03 (7 of 7 rounds), with the residual add 79.78 against
    79.85; level at 1536 and 4096, behind at 8192 with the residual add (1035.7 against 1034.1)."""
    return _block_h(H) <= 1024


def _bwd_programs(device: torch.device, n_row_blocks, programs_per_sm: Optional[int]):
    """(programs of a backward launch, the most it can have on this device). Persistent programs share the row
    blocks evenly: each takes ceil(blocks / most) of them, and the programs are as few as that needs, so that
    no remainder of programs runs a tail of one block more alone (32768 rows over at most 1056 programs: 1024
    programs of 32 rows, not 32 of 32 and 1024 of 31). `python bench/bench_rms_norm.py --frozen-weight` (H200,
    rows 32768, bf16): the register-prefetch backward without dW at H = 4096 194.2 against 197.7 us (512 programs
    against 528); every other persistent form within 0.5 us either way.
    The number depends only on the row count and the device, so the fp32 partial sums (hence dW) are
    bit-reproducible. In a compiled graph the row count is a symbol, and these stay expressions of it."""
    if programs_per_sm is None:
        return n_row_blocks, n_row_blocks
    most = programs_per_sm * _dispatch.multiprocessor_count(device)
    blocks_per_program = _dispatch.cdiv(n_row_blocks, most)
    return _dispatch.cdiv(n_row_blocks, blocks_per_program), most


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of the (up to) three leading dims, padded at the front with zeros."""
    strides = t.stride()[:-1]
    return (0,) * (3 - len(strides)) + tuple(strides)


def _strided_rows(tensors: list[Optional[torch.Tensor]], one_row_dim: bool = True):
    """Bring same-shaped [..., H] tensors (the first one not None) into a layout the kernels index directly: unit stride
    along H, rows addressed through at most three leading dims. Returns the tensors, the leading sizes (n0, n1, n2)
    and each tensor's leading strides.

    With one_row_dim, where every tensor's rows are evenly spaced (contiguous tensors, any 2-D view), the rows are
    one leading dim, given as (n_rows, 1, 1): Triton specialises arguments equal to 1, so a row's offset is its index
    times the row stride. Otherwise (per-head q/k norms on transposed 4-D views) the leading dims keep their own
    strides, and a row's offset takes an int64 division and remainder by each inner leading size. One leading dim
    against (1, 1, n_rows), `python bench/bench_rms_norm.py` and `--frozen-weight` (H200, rows 32768, bf16, us):
    H = 576 forward 19.8 against 20.1, backward with dW 32.8 against 33.2, without dW 28.4 against 29.9; H = 1536
    backward with dW 77.4 against 78.9; H = 4096 with dW 198.8 against 201.2."""
    shape = tensors[0].shape
    H = shape[-1]
    out = [t.contiguous() if t is not None and H > 1 and t.stride(-1) != 1 else t for t in tensors]
    if one_row_dim and all(t is None or t.dim() <= 2 or t.is_contiguous() for t in out):
        out = [t.view(-1, H) if t is not None else None for t in out]
        strides = [(t.stride(0), 0, 0) if t is not None else (0, 0, 0) for t in out]
        return out, (out[0].shape[0], 1, 1), strides
    if len(shape) > 4:
        out = [t.reshape(-1, H) if t is not None else None for t in out]  # a view when the leading dims collapse
    lead = tuple(out[0].shape[:-1])
    lead = (1,) * (3 - len(lead)) + lead
    strides = [_row_strides(t) if t is not None else (0, 0, 0) for t in out]
    return out, lead, strides


def _check_hidden(op: str, H: int) -> None:
    if H > MAX_HIDDEN_SIZE:
        raise ValueError(
            f"fastgrpo::{op}: hidden size {H} exceeds {MAX_HIDDEN_SIZE}, the widest row one "
            f"Triton block holds; leave this norm to inductor"
        )


def _forward_triton(x, residual, weight, eps, offset, weight_in_fp32, out_dtype):
    H = x.shape[-1]
    src_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=src_dtype, device=x.device) if residual is not None else None
    n_rows = y.numel() // H if H else 0
    if n_rows == 0 or H == 0:
        return y, s
    (x_, res_), (_, n1, n2), (x_st, res_st) = _strided_rows([x, residual])
    if weight is not None:
        weight = weight.contiguous()
    prod_dtype = torch.promote_types(src_dtype, weight.dtype) if weight is not None else src_dtype
    block_row, num_warps = _fwd_config(H, _dispatch.launch_like_cuda(x))
    grid = (_dispatch.cdiv(n_rows, block_row),)
    _dispatch.launcher(_rms_norm_fwd_kernel)[grid](
        x_, *x_st,
        res_ if res_ is not None else x_, *res_st,
        weight if weight is not None else x_,
        y,
        s if s is not None else y,
        n_rows, n1, n2, H,
        eps, offset,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        WEIGHT_IN_FP32=weight_in_fp32,
        ROUND_W_EFF=weight is not None and not weight_in_fp32 and offset != 0.0,
        SRC_DTYPE=_TL_DTYPES[src_dtype],
        W_DTYPE=_TL_DTYPES[weight.dtype] if weight is not None else tl.float32,
        PROD_DTYPE=_TL_DTYPES[prod_dtype],
        OUT_DTYPE=_TL_DTYPES[out_dtype],
        EMULATE_BF16_RTNE=not x.is_cuda,
        BLOCK_ROW=block_row,
        BLOCK_H=_block_h(H),
        **_dispatch.dependent_launch_args(x),
        EARLY_DEPENDENTS=_early_dependents(H),
        num_warps=num_warps,
    )
    return y, s


def _backward_triton(grad_normed, grad_sum, src, weight, eps, offset, weight_in_fp32, input_grad, weight_grad):
    H = src.shape[-1]
    weight_grad = weight_grad and weight is not None
    dx = torch.empty(src.shape, dtype=src.dtype, device=src.device) if input_grad else src.new_empty(0)
    n_rows = src.numel() // H if H else 0
    if n_rows == 0 or H == 0:
        return dx, (torch.zeros_like(weight) if weight_grad else src.new_empty(0))
    block_row, num_warps, programs_per_sm, stages = _bwd_config(H, _dispatch.launch_like_cuda(src), weight_grad,
                                                                grad_sum is not None)
    # The register-prefetch programs without dW (rows of 4096 and wider) keep the rows as (1, 1, n_rows), where one
    # leading dim is slower: H = 4096 217.0 against 193.9 us, H = 8192 462.8 against 387.4 (`python
    # bench/bench_rms_norm.py --frozen-weight --hidden 4096 8192`, H200, rows 32768, bf16).
    one_row_dim = weight_grad or programs_per_sm is None or stages > 0
    (dy, dsum, src_), (_, n1, n2), (dy_st, dsum_st, src_st) = _strided_rows([grad_normed, grad_sum, src],
                                                                            one_row_dim)
    if weight is not None:
        weight = weight.contiguous()
    if weight_grad and programs_per_sm is None:
        raise ValueError("fastgrpo::rms_norm: a backward with dW needs persistent programs (a fixed number of "
                         "partial sums); _bwd_config returned no programs per SM")
    programs, most_programs = _bwd_programs(src.device, _dispatch.cdiv(n_rows, block_row), programs_per_sm)
    # The backward lets the reduction start early only when the reduction is launched as its dependent (and the
    # dW reduction's programs then overlap the backward's last rows).
    dependent_launch = _dispatch.dependent_launch_args(src)
    dw_partial = torch.empty((programs, H), dtype=torch.float32, device=src.device) if weight_grad else None
    _dispatch.launcher(_rms_norm_bwd_kernel)[(programs,)](
        dy, *dy_st,
        dsum if dsum is not None else dy, *dsum_st,
        src_, *src_st,
        weight if weight is not None else src_,
        dx if input_grad else src_,
        dw_partial if weight_grad else src_,
        n_rows, n1, n2, H,
        eps, offset,
        HAS_DSUM=grad_sum is not None,
        HAS_WEIGHT=weight is not None,
        ROUND_W_EFF=weight is not None and not weight_in_fp32 and offset != 0.0,
        W_DTYPE=_TL_DTYPES[weight.dtype] if weight is not None else tl.float32,
        NEED_DX=input_grad,
        NEED_DW=weight_grad,
        DX_DTYPE=_TL_DTYPES[src.dtype],
        EMULATE_BF16_RTNE=not src.is_cuda,
        BLOCK_ROW=block_row,
        BLOCK_H=_block_h(H),
        PERSISTENT=programs_per_sm is not None,
        PIPELINE_STAGES=stages,
        **dependent_launch,
        num_warps=num_warps,
    )
    if not weight_grad:
        return dx, src.new_empty(0)
    dw = torch.empty_like(weight)
    block_p, block_c, num_warps = _dw_reduce_config(most_programs)
    _dispatch.launcher(_dw_reduce_kernel)[(_dispatch.cdiv(H, block_c),)](
        dw_partial, dw, programs, H,
        DW_DTYPE=_TL_DTYPES[weight.dtype],
        EMULATE_BF16_RTNE=not src.is_cuda,
        BLOCK_P=block_p,
        BLOCK_C=block_c,
        **dependent_launch,
        EARLY_DEPENDENTS=_early_dependents(H),
        num_warps=num_warps,
    )
    return dx, dw


# --------------------------------------------------------------------------------------------
# Torch implementation (CPU), same contract
# --------------------------------------------------------------------------------------------


def _weight_eff(weight, offset, weight_in_fp32):
    """The multiplier the forward applies: fp32 (w + offset) in gemma mode; in llama mode
    w, or (w + offset) rounded to w's dtype."""
    if weight_in_fp32:
        return weight.float() + offset
    return weight if offset == 0.0 else weight + offset


def _forward_torch(x, residual, weight, eps, offset, weight_in_fp32, out_dtype):
    s = x + residual if residual is not None else None
    src = s if s is not None else x
    xf = src.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        y = n.to(out_dtype)
    elif weight_in_fp32:
        y = (n * _weight_eff(weight, offset, True)).to(out_dtype)
    else:
        y = (_weight_eff(weight, offset, False) * n.to(src.dtype)).to(out_dtype)
    # Contiguous outputs, as the Triton path and the fake implementation allocate them.
    return y.contiguous(), (s.contiguous() if s is not None else None)


def _backward_torch(grad_normed, grad_sum, src, weight, eps, offset, weight_in_fp32, input_grad, weight_grad):
    H = src.shape[-1]
    xf = src.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    dy = grad_normed.float()
    dx = src.new_empty(0)
    if input_grad:
        g = dy * _weight_eff(weight, offset, weight_in_fp32).float() if weight is not None else dy
        dxf = (g - n * (g * n).mean(-1, keepdim=True)) * rstd
        if grad_sum is not None:
            dxf = dxf + grad_sum.float()
        dx = dxf.to(src.dtype).contiguous()
    if weight_grad and weight is not None:
        dw = (dy * n).reshape(-1, H).sum(0).to(weight.dtype)
    else:
        dw = src.new_empty(0)
    return dx, dw


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _check_inputs(op, x, residual, weight):
    _dispatch.check_dtype(op, x)
    if residual is not None:
        _dispatch.check_dtype(op, residual)
        if residual.shape != x.shape:
            raise ValueError(f"fastgrpo::{op}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if x.dim() == 0:
        raise ValueError(f"fastgrpo::{op}: x must have a last (hidden) dimension")
    H = x.shape[-1]
    _check_hidden(op, H)
    if weight is not None:
        _dispatch.check_dtype(op, weight)
        if weight.shape != (H,):
            raise ValueError(f"fastgrpo::{op}: weight shape {tuple(weight.shape)} != ({H},)")


# triton_ops: a compiled graph launches the kernels itself (see _dispatch.traced); eagerly the body runs as written.
@torch.library.triton_op("fastgrpo::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float, weight_in_fp32: bool,
                 out_dtype: torch.dtype) -> torch.Tensor:
    _check_inputs("rms_norm", x, None, weight)
    impl = _forward_triton if _dispatch.launches_triton(x) else _forward_torch
    return impl(x, None, weight, eps, offset, weight_in_fp32, out_dtype)[0]


@torch.library.triton_op("fastgrpo::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                     weight_in_fp32: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, normed)."""
    _check_inputs("add_rms_norm", x, residual, weight)
    impl = _forward_triton if _dispatch.launches_triton(x) else _forward_torch
    y, s = impl(x, residual, weight, eps, offset, weight_in_fp32, out_dtype)
    return s, y


@torch.library.triton_op("fastgrpo::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_normed: torch.Tensor, grad_sum: Optional[torch.Tensor], input: torch.Tensor,
                          weight: Optional[torch.Tensor], eps: float, offset: float, weight_in_fp32: bool,
                          input_grad: bool, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rms_norm / add_rms_norm. `input` is what the forward normalised (x, or the
    sum); grad_input is d(input) in input's dtype (empty when input_grad is False), grad_weight
    is dW in weight's dtype (empty when weight_grad is False or there is no weight)."""
    impl = _backward_triton if _dispatch.launches_triton(input) else _backward_torch
    return impl(grad_normed, grad_sum, input, weight, eps, offset, weight_in_fp32, input_grad, weight_grad)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, offset, weight_in_fp32, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (eps, offset, weight_in_fp32)


def _rms_norm_backward(ctx, grad_normed):
    x, weight = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dw = torch.ops.fastgrpo.rms_norm_backward(
        grad_normed, None, x, weight, *ctx.args, ctx.needs_input_grad[0], weight_grad
    )
    return (dx if ctx.needs_input_grad[0] else None), (dw if weight_grad else None), None, None, None, None


def _add_rms_norm_setup_context(ctx, inputs, output):
    x, residual, weight, eps, offset, weight_in_fp32, _ = inputs
    ctx.save_for_backward(output[0], weight)
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.args = (eps, offset, weight_in_fp32)


def _add_rms_norm_backward(ctx, grad_sum, grad_normed):
    s, weight = ctx.saved_tensors
    need_x, need_res, need_w = ctx.needs_input_grad[:3]
    weight_grad = weight is not None and need_w
    ds, dw = torch.ops.fastgrpo.rms_norm_backward(
        grad_normed, grad_sum, s, weight, *ctx.args, need_x or need_res, weight_grad
    )
    dx = ds.to(ctx.dtypes[0]) if need_x else None
    dres = ds.to(ctx.dtypes[1]) if need_res else None
    return dx, dres, (dw if weight_grad else None), None, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)
_add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


# --------------------------------------------------------------------------------------------
# Public wrappers
# --------------------------------------------------------------------------------------------


def _natural_dtype(src_dtype, weight, weight_in_fp32):
    if weight is None or weight_in_fp32:
        return src_dtype
    return torch.promote_types(src_dtype, weight.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., H], any rank, any strides), with weight [H] or None.

    weight_in_fp32=False rounds like HF Llama (`weight * x_normed.to(x.dtype)`);
    weight_in_fp32=True like Gemma/OLMo2 (`(x_normed * (offset + weight.float())).to(x.dtype)`).
    out_dtype None gives promote_types(x, weight) in the first case and x.dtype in the second.
    """
    if out_dtype is None:
        out_dtype = _natural_dtype(x.dtype, weight, weight_in_fp32)
    return torch.ops.fastgrpo.rms_norm(x, weight, eps, offset, weight_in_fp32, out_dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + residual (in promote_types(x, residual), rounded), the fused
    residual add + norm of a decoder layer; s is the next residual. Same options as rms_norm,
    with s in place of x."""
    if out_dtype is None:
        out_dtype = _natural_dtype(torch.promote_types(x.dtype, residual.dtype), weight, weight_in_fp32)
    return torch.ops.fastgrpo.add_rms_norm(x, residual, weight, eps, offset, weight_in_fp32, out_dtype)
