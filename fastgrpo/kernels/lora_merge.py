"""A LoRA delta added to a weight, or taken from it, in one pass: the rollout engine's adapter merge.

The delta of a LoRA layer's active adapters is `b @ a`, with `a` [r, K] their A's stacked along r and `b` [N, r]
their B's side by side, each scaled by its adapter's scaling (`lora_factors` of
fastgrpo.integrations.generation.four_bit, then `lora_merge_factors`), both fp32. The kernel computes a [BN, BK] tile
of it in registers (r fused multiply-adds an element, in a fixed order) beside the weight's tile, so each pass reads
(and writes) the weight once and the delta is never in memory. Every call computes the same delta bits from the same
factors, which is what makes an in-place merge undoable exactly:

- `lora_merge_plan(weight, a, b, stats)`: counts the elements where round(round(W + d) - d) != W (a sum that rounds
  across a power of two) into stats[0], adds the bits of that undo, as int64, into stats[1] and W's own bits into
  stats[4]; writes nothing else.
- `lora_merge_(weight, a, b, stats, fix_index, fix_value)`: W <- round(W + d) in place; each element the undo will
  miss has its flat index and original value appended to fix_index / fix_value (sized by the plan's count; the
  count appended goes to stats[2]).
- `lora_unmerge_(weight, a, b, stats)`: W <- round(W - d) in place, its bits summed into stats[3].
- `lora_merge_restored(weight, stats, fix_index, fix_value)`: writes the kept values back, which gives W its exact
  bits, and returns (a 0-d bool tensor, no host sync) whether they are: W's bit sum, from stats[3] and the elements
  replaced, against the plan's stats[4], and the delta and the misses the same at every pass (`STATS` slots a
  weight).
- `lora_merge_into(out, weight, a, b)`: out <- round(W + d) (a merged copy; W untouched).

round() is to the weight's dtype (bf16, fp16 or fp32), the sum in fp32. Bits are compared and summed as integers, so
signed zeros and NaN payloads are kept too. Sums are wrapping int64 sums (order-free: a call's result is
deterministic). CUDA tensors (and CPU tensors in Triton's interpreter) run the kernel; other CPU tensors the torch
reference below, the same contract (its delta is one fp32 matmul, so its bits may differ from the kernel's; each
path only ever undoes its own merge). Eager only: no autograd, not for traced graphs (the merge runs outside them).

Cost (one H100): Llama-3.1-8B's rollout (64 x 512, groups of 8) took 4.26 s with this kernel and 4.30 s with torch's
passes (an fp32 delta in memory, separate add, undo, compare and bit-sum passes and a host sync a weight), in one call:
`python bench/bench_generation.py --shape llama-3.1-8b --cases 64x512 --generations 8 --merge-kernel 1|0`. A pass of
an 8B weight runs at 15-27 % of the copy rate, 5-9x torch's same passes (`bench/bench_lora_merge.py`). One host sync
a call, for the plan's counts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import cdiv, launch_like_cuda, use_triton

STATS = 5  # int64 slots a weight: planned misses, the plan's undo bit sum, misses recorded, the undo's bit sum, W's
_PLAN, _MERGE, _COPY, _UNMERGE = 0, 1, 2, 3
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_TRITON_BITS = {torch.bfloat16: tl.int16, torch.float16: tl.int16, torch.float32: tl.int32}
# A program's work on CUDA: TILES tiles of [BLOCK_N, BLOCK_K] down one column block, its sums kept in registers and
# added to stats once. 16 elements a thread keep the in-place merge at 117 registers (sm_90 build of triton 3.6, read
# with cuobjdump --dump-resource-usage); 8192 a tile took 255 and spilled (the 8B rollout's merges: 210 ms). On one H100
# an 8B gate's plan + merge + undo takes 0.81 ms, the best of the sweep's configurations 0.72 (not worth a rule), the
# DRAM floor ~0.2: `python bench/bench_lora_merge.py --sweep`. Small tiles in the interpreter, so that small test shapes
# span several tiles, programs and their edges.
CUDA_LAUNCH = {"BLOCK_N": 8, "BLOCK_K": 256, "TILES": 4, "num_warps": 4}
_INTERPRETER_LAUNCH = {"BLOCK_N": 4, "BLOCK_K": 16, "TILES": 2, "num_warps": 1}


@triton.jit(do_not_specialize=["fix_cap"])  # a count that changes every call: one compile for all
def _lora_merge_kernel(w_ptr, out_ptr, a_ptr, b_ptr, stats_ptr, fix_index_ptr, fix_value_ptr, fix_cap,
                       N, K, R, stride_w, stride_out, MODE: tl.constexpr, INT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    cols = (pid % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    first_row = (pid // tiles_k) * (TILES * BLOCK_N)
    sum_main = tl.zeros((), dtype=tl.int64)  # plan: the undo's bits; unmerge: the result's bits
    sum_w = tl.zeros((), dtype=tl.int64)  # plan: W's bits
    missed_all = tl.zeros((), dtype=tl.int64)  # plan: the misses
    for t in range(TILES):
        rows = first_row + t * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        inside = row_ok[:, None] & col_ok[None, :]
        delta = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r in range(R):  # one explicit FMA a rank, in rank order: every pass computes the same bits
            b = tl.load(b_ptr + rows * R + r, mask=row_ok, other=0.0)
            a = tl.load(a_ptr + r * K + cols, mask=col_ok, other=0.0)
            delta = tl.fma(b[:, None], a[None, :], delta)
        rows64 = rows.to(tl.int64)[:, None]
        w = tl.load(w_ptr + rows64 * stride_w + cols[None, :], mask=inside, other=0.0)
        if MODE == 3:  # unmerge, in place
            undone = (w.to(tl.float32) - delta).to(w.dtype)
            tl.store(w_ptr + rows64 * stride_w + cols[None, :], undone, mask=inside)
            sum_main += tl.sum(tl.where(inside, undone.to(INT, bitcast=True).to(tl.int64), 0))
        else:
            merged = (w.to(tl.float32) + delta).to(w.dtype)
            if MODE == 2:  # a merged copy
                tl.store(out_ptr + rows64 * stride_out + cols[None, :], merged, mask=inside)
            else:
                undone = (merged.to(tl.float32) - delta).to(w.dtype)
                miss = (undone.to(INT, bitcast=True) != w.to(INT, bitcast=True)) & inside
                missed = tl.sum(miss.to(tl.int32))
                if MODE == 0:  # plan
                    sum_main += tl.sum(tl.where(inside, undone.to(INT, bitcast=True).to(tl.int64), 0))
                    sum_w += tl.sum(tl.where(inside, w.to(INT, bitcast=True).to(tl.int64), 0))
                    missed_all += missed
                else:  # merge in place, keeping what the undo will miss
                    tl.store(w_ptr + rows64 * stride_w + cols[None, :], merged, mask=inside)
                    if missed > 0:
                        start = tl.atomic_add(stats_ptr + 2, missed.to(tl.int64))
                        flat = tl.reshape(miss, (BLOCK_N * BLOCK_K,))
                        slot = start + (tl.cumsum(flat.to(tl.int32), axis=0) - 1)
                        index = tl.reshape(rows64 * K + cols[None, :], (BLOCK_N * BLOCK_K,))
                        keep = flat & (slot < fix_cap)
                        tl.store(fix_index_ptr + slot, index, mask=keep)
                        tl.store(fix_value_ptr + slot, tl.reshape(w, (BLOCK_N * BLOCK_K,)), mask=keep)
    if MODE == 3:
        tl.atomic_add(stats_ptr + 3, sum_main)
    if MODE == 0:
        tl.atomic_add(stats_ptr + 1, sum_main)
        tl.atomic_add(stats_ptr + 4, sum_w)
        if missed_all > 0:
            tl.atomic_add(stats_ptr, missed_all)


def lora_merge_factors(a: torch.Tensor, b: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b * scaling) in fp32 and contiguous, so that b @ a is the delta: one adapter, or several as
    `fastgrpo.integrations.generation.four_bit.lora_factors` joins them."""
    return a.detach().to(torch.float32).contiguous(), (b.detach().to(torch.float32) * scaling).contiguous()


def _check(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, in_place: bool) -> None:
    if weight.dim() != 2 or weight.dtype not in _BITS:
        raise ValueError(f"lora merge: weight must be a 2-D bf16, fp16 or fp32 tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.dim() != 2 or b.dim() != 2:
        raise ValueError("lora merge: a and b must be 2-D fp32 tensors (lora_merge_factors makes them)")
    if a.shape[1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
        raise ValueError(f"lora merge: a {tuple(a.shape)} and b {tuple(b.shape)} do not factor a weight of "
                         f"{tuple(weight.shape)} (a is [r, K], b is [N, r])")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora merge: a and b must be contiguous")
    if len({weight.device, a.device, b.device}) != 1:
        raise ValueError("lora merge: weight, a and b must be on one device")
    if weight.stride(1) != 1 or (in_place and not weight.is_contiguous()):
        raise ValueError("lora merge: the weight's rows must be contiguous (and the whole weight, in place)")


def _launch(mode: int, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats=None, out=None,
            fix_index=None, fix_value=None) -> None:
    n, k = weight.shape
    launch = CUDA_LAUNCH if launch_like_cuda(weight) else _INTERPRETER_LAUNCH
    rows_a_program = launch["BLOCK_N"] * launch["TILES"]
    out = weight if out is None else out  # unused pointers point at the weight
    stats = weight if stats is None else stats
    fix_cap = 0 if fix_index is None else fix_index.numel()
    fix_index, fix_value = (fix_index, fix_value) if fix_cap else (stats, weight)
    _lora_merge_kernel[(cdiv(n, rows_a_program) * cdiv(k, launch["BLOCK_K"]),)](
        weight, out, a, b, stats, fix_index, fix_value, fix_cap, n, k, a.shape[0], weight.stride(0), out.stride(0),
        MODE=mode, INT=_TRITON_BITS[weight.dtype], **launch)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype])


def _reference(mode: int, weight, a, b, stats=None, out=None, fix_index=None, fix_value=None) -> None:
    delta = b @ a
    if mode == _UNMERGE:
        undone = (weight.float() - delta).to(weight.dtype)
        weight.copy_(undone)
        stats[3] += _bits(undone).sum(dtype=torch.int64)
        return
    merged = (weight.float() + delta).to(weight.dtype)
    if mode == _COPY:
        out.copy_(merged)
        return
    undone = (merged.float() - delta).to(weight.dtype)
    miss = _bits(undone).ne(_bits(weight)).view(-1)
    if mode == _PLAN:
        stats[0] += miss.sum()
        stats[1] += _bits(undone).sum(dtype=torch.int64)
        stats[4] += _bits(weight).sum(dtype=torch.int64)
        return
    index = torch.nonzero(miss)[:, 0]
    start = int(stats[2])
    kept = index[:max(0, fix_index.numel() - start)]
    fix_index[start:start + kept.numel()] = kept
    fix_value[start:start + kept.numel()] = weight.view(-1)[kept]
    stats[2] += index.numel()
    weight.copy_(merged)


def _run(mode: int, weight, a, b, **tensors) -> None:
    (_launch if use_triton(weight) else _reference)(mode, weight, a, b, **tensors)


def _check_stats(stats: torch.Tensor, weight: torch.Tensor) -> None:
    if stats.dtype != torch.int64 or stats.numel() != STATS or not stats.is_contiguous() or \
            stats.device != weight.device:
        raise ValueError(f"lora merge: stats must be {STATS} contiguous int64 on the weight's device (zeros at first)")


def _in_place(mode: int, weight, a, b, stats, **tensors) -> None:
    _check(weight, a, b, in_place=True)
    _check_stats(stats, weight)
    _run(mode, weight, a, b, stats=stats, **tensors)


@torch.no_grad()
def lora_merge_plan(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats: torch.Tensor) -> None:
    """stats[0] += elements the undo of an in-place merge will miss; stats[1] += that undo's bit sum."""
    _in_place(_PLAN, weight, a, b, stats)


@torch.no_grad()
def lora_merge_(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats: torch.Tensor,
                fix_index: torch.Tensor, fix_value: torch.Tensor) -> None:
    """weight <- round(weight + b @ a) in place; the elements its undo will miss are kept in fix_index (int64 flat
    indices) and fix_value (their original values, the weight's dtype), as many as they hold; stats[2] += missed."""
    if fix_index.dtype != torch.int64 or fix_value.dtype != weight.dtype or fix_index.numel() != fix_value.numel():
        raise ValueError("lora merge: fix_index must be int64 and fix_value of the weight's dtype, of one length")
    _in_place(_MERGE, weight, a, b, stats, fix_index=fix_index, fix_value=fix_value)


@torch.no_grad()
def lora_unmerge_(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats: torch.Tensor) -> None:
    """weight <- round(weight - b @ a) in place; stats[3] += the result's bit sum (before the kept values go back)."""
    _in_place(_UNMERGE, weight, a, b, stats)


@torch.no_grad()
def lora_merge_into(out: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out <- round(weight + b @ a), out of the weight's shape and dtype with contiguous rows."""
    _check(weight, a, b, in_place=False)
    if out.shape != weight.shape or out.dtype != weight.dtype or out.stride(1) != 1 or out.device != weight.device:
        raise ValueError(f"lora merge: out must have the weight's shape {tuple(weight.shape)}, dtype {weight.dtype} "
                         "and device, with contiguous rows")
    _run(_COPY, weight, a, b, out=out)


@torch.no_grad()
def lora_merge_restored(weight: torch.Tensor, stats: torch.Tensor, fix_index: torch.Tensor,
                        fix_value: torch.Tensor) -> torch.Tensor:
    """After `lora_unmerge_`: the kept values written back; a 0-d bool tensor, True where the weight's bits sum to
    the original's (stats[3], less the elements replaced, plus what replaced them, against the plan's stats[4]) and
    every pass computed the same delta and the same misses."""
    _check_stats(stats, weight)
    flat = weight.view(-1)
    replaced = flat[fix_index]
    flat[fix_index] = fix_value
    restored = stats[3] - _bits(replaced).sum(dtype=torch.int64) + _bits(fix_value).sum(dtype=torch.int64)
    return (restored == stats[4]) & (stats[3] == stats[1]) & (stats[2] == stats[0])
