"""A QLoRA linear for decode steps: the 4-bit (NF4) base weight read packed, the LoRA product added in the same launch.

`nf4_lora_linear(x, packed, absmax, code, shape=(N, K), blocksize=64, nested_absmax=, nested_code=, offset=,
nested_blocksize=256, lora_a=None, lora_b=None, scaling=1.0, bias=None, code_values=None)`:

    out[M, N] = x[M, K] @ W[N, K]^T + scaling * (x @ lora_a^T)[M, r] @ lora_b^T[r, N] (+ bias[N])

in x's dtype (bf16, fp16 or fp32), fp32 accumulation; x [..., K] -> [..., N]. One adapter: lora_a [r, K],
lora_b [N, r] (PEFT's lora_A / lora_B weights, any float dtype: cast in the kernel), or none (lora_a None).
Several active adapters are one adapter with their A's stacked along r and each B scaled by its adapter's scaling
(`fastgrpo.integrations.generation.four_bit.lora_factors` reads them so from a PEFT layer).

W is bitsandbytes' 4-bit layout (bitsandbytes 0.50 `functional.quantize_4bit` / `dequantize_4bit`):
- `packed`: the [N, K] weight flattened row-major, two elements a byte, element 2i in the high nibble and 2i+1 in
  the low one ((N*K+1)//2 bytes, held as [(N*K+1)//2, 1] uint8 or viewed as another `quant_storage` dtype).
- element e = n*K + k has code index c (its nibble) and block e // blocksize; W[n, k] = code[c] * absmax[block],
  `code` the 16 fp32 levels of `QuantState.code` (NF4's table; FP4's is a 16-entry table too), the product in fp32,
  then rounded to x's dtype (as bitsandbytes dequantizes before its matmul).
- double quantization (`compress_statistics=True`, QLoRA's default): `absmax` holds uint8 codes and the block
  scale is nested_code[absmax[b]] * nested_absmax[b // nested_blocksize] + offset (fp32; nested_code is the
  256-entry dynamic map `state2.code`, nested_blocksize `state2.blocksize` = 256, offset a 0-d fp32 tensor).

Triton path: grid (N tiles, K splits, M tiles). A program walks its K range in steps of BK <= blocksize columns, so a
step of a weight row has one block scale (dequantized in the kernel, nested or not). Two forms, chosen by the row
count (`tile_settings`):
- register table (`_FEW_ROWS_LUT`, up to 16 rows; `code_values`, the 16 codes on the host, are needed): the step's
  [BK/2, BN] bytes are loaded straight into the dot operand's layout and each nibble's code is looked up in registers
  from a table held in the instructions (`lut_asm`); the even columns' codes and the odd ones' multiply x's even and
  odd columns in two `tl.dot`s (M padded to 16: tensor cores at every M), and each row's block scale multiplies the
  fp32 product: the weight is rounded to x's dtype before its scale instead of after (bitsandbytes rounds code *
  scale), the same maths.
- joined (more rows, or no `code_values`): each nibble's code gathered from the 16 fp32 codes, scaled, cast to x's
  dtype as bitsandbytes casts it, the even and odd columns set side by side (`tl.join`) to multiply x's [BM, BK] tile
  in one `tl.dot` (at 64 rows the wgmma reads the weight from shared memory, so the register table saves nothing).
A step's packed bytes are loaded AHEAD (2 or 3) steps ahead and carried in registers, x and A tiles one step ahead,
so that the lookups and the dots never wait on memory; the LUT form may instead load its bytes in the step (AHEAD 0,
its default: Triton's pipeline copies them ahead) and look them up in the dot operand's layout, where with AHEAD they
are looked up as loaded, then transposed. Its share of x @ A^T (A's columns of its K range) rides along on the same x
tiles; after the loop it adds scaling * (x @ A^T)_part @ B^T for its columns. As that product is linear in the K parts,
splitting K splits the LoRA term with it: no program reads A in full unless K is not split. When K is split, every
program stores its fp32 partial and counts itself in a per-tile counter; the last program of a tile sums all the tile's
partials (its own read back) in split order, adds the bias, writes the output and resets the counter (the counters need
no clearing between calls, and a captured call replays as is). The sum's order does not depend on which program arrives
last: a call's result is deterministic, eager or captured.
Grouped: weights that read one x (an attention's q, k and v; an MLP's gate and up) in one launch, stacked along N as
one [N, K] weight whose column tiles each lie in one of them (`group_table`): a tile finds its weight's bytes where
they lie (no copy), its rows of the concatenated statistics, its nested offset and its adapter's rows of the stacked
A; each tile computes what the weight's own launch computes, the same bits at the same tiles and splits.
Out of the kernel's domain (K not a multiple of blocksize, r > MAX_RANK, a CPU tensor outside the interpreter) the
op runs the reference: `reference_dequantize_nf4` + F.linear + the LoRA term in fp32, the same maths.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import cdiv, launch_like_cuda, multiprocessor_count, next_power_of_2, use_triton

MAX_RANK = 64  # LoRA ranks the kernel takes (the [BM, r] product of x and A lives in registers)
# Columns a tile and programs an SM of CUDA calls. From 17 rows, `python bench/bench_nf4_linear.py --rows 64 --sweep`
# (one H100, Qwen2.5-1.5B's projections, 32 settings): 32 columns and 4 programs are the fastest or within 3 % of it
# at every projection but gate/up (34.3 us against 32.0), 133 us a layer against 152 for 64 columns and 2 an SM.
# Up to 16 rows (a group of 8 decoding), 64 and 2: the QLoRA whole step's rollout (8 rows) took 3.44-3.49 s with them
# against 3.61-3.64 s with 32 and 4 (one H100, `QLORA_AB=... bash bench/device_session.sh qlora_ab`).
_PROGRAMS_PER_SM = 4
_BLOCK_N = 32
_FEW_ROWS = 16
_FEW_ROWS_PROGRAMS_PER_SM = 2
_FEW_ROWS_BLOCK_N = 64
# The register-table form up to 16 rows: at 8 rows it took 7.5 / 5.9 / 18.3 / 16.8 us at q / k,v / gate,up / down
# against the joined form's 10.4 / 7.1 / 42.0 / 28.4, and the QLoRA whole step's rollout 2.42 s against 3.46 (one
# H100, `NF4_ARGS="--rows 8 64 --sweep forms" bash bench/device_session.sh nf4_forms qlora_ab`); at 64 rows (32 columns,
# 4 programs an SM) the joined form is faster at every projection (gate/up 33.2 us against 47.0).
_FEW_ROWS_LUT = True
_LUT = False
# Steps ahead a step's packed bytes are loaded and carried in registers: 2 or 3, or 0 (the register-table form only:
# loaded in the step, left to Triton's pipeline). The 8-row gate/up launch built for sm_90 (bench/kernel_resources.py's
# build of it): AHEAD 0 / 2 / 3 take 128 / 127 / 157 registers and 380 / 430 / 433 instructions a K step; their GPU
# times are `NF4_ARGS="--rows 8 --sweep lut --ahead 0 2 3" bash bench/device_session.sh nf4_forms`'s to measure.
_LUT_AHEAD = 0
_JOINED_AHEAD = 2
_NUM_WARPS = 4
_NUM_STAGES = 3
_MAX_SPLITS = 32
_COUNTERS = 16384  # tiles a split call may use
_REDUCE_ELEMENTS = 8192  # partial values the split-K sum loads at a time (see _reduce_rows)
_counters: dict[torch.device, torch.Tensor] = {}
GROUP_ROWS = 64  # every grouped weight but the last has a multiple of this many rows: a column tile lies in one


@triton.jit
def _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k, k_hi, BLOCKSIZE: tl.constexpr,
                NESTED_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BYTES: tl.constexpr):
    """What a step reads from HBM: its [BN, BK/2] packed bytes (BYTES; else a placeholder), each row's block
    statistic (the fp32 absmax, or the uint8 code of a double-quantized one and its nested absmax). A step at or
    past k_hi loads nothing."""
    ok = n_ok & (tl.zeros_like(first_block) + k < k_hi)  # (a tensor compare: the interpreter's scalar one is no mask)
    if BYTES:
        packed = tl.load(w_rows + (k // 2 + j)[None, :], mask=ok[:, None], other=0)
    else:
        packed = tl.zeros((1, 1), dtype=tl.uint8)
    block = first_block + k // BLOCKSIZE
    stat = tl.load(absmax_ptr + block, mask=ok, other=0)
    if NESTED:
        nested = tl.load(absmax2_ptr + block // NESTED_BLOCKSIZE, mask=ok, other=0.0)
    else:
        nested = stat
    return packed, stat, nested


@triton.jit
def _block_scale(stat, nested, code2_ptr, offset, NESTED: tl.constexpr):
    """The fp32 scale of each row's block from `_step_loads`' statistics (a double-quantized one dequantized as
    bitsandbytes does; `offset` is only read when NESTED)."""
    if NESTED:
        return tl.load(code2_ptr + stat.to(tl.int32)) * nested + offset
    return stat.to(tl.float32)


@triton.jit
def _nf4_lora_linear_kernel(
    x_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, a_ptr, b_ptr, bias_ptr,
    out_ptr, part_ptr, count_ptr, table_ptr,
    M, N, K, K_PER_SPLIT, RANK, GROUPS, scaling,
    sxm, sxk, sar, sak, sbn, sbr, som,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
    R_PAD: tl.constexpr, SPLITS: tl.constexpr, NESTED: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr,
    NATIVE: tl.constexpr, REDUCE_ROWS: tl.constexpr, PRECISION: tl.constexpr, LUT: tl.constexpr,
    LUT_HIGH: tl.constexpr, LUT_LOW: tl.constexpr, AHEAD: tl.constexpr, GROUPED: tl.constexpr,
):  # fmt: skip
    # BK divides BLOCKSIZE, BLOCKSIZE divides K and K_PER_SPLIT is a multiple of BK: no step needs a K mask, and a
    # step of a weight row lies in one quantization block.
    # A step's block statistics are loaded two steps ahead (three at AHEAD 3), its packed bytes AHEAD steps ahead
    # (AHEAD 0: in the step), its x and A tiles one step ahead, carried in registers, so that the table lookups
    # (gathers whose addresses are those bytes) and the dots never wait on HBM or L2 (the joined form's bytes left
    # to Triton's software pipeline instead, the sweep's calls took 1.5-6x as long).
    # NATIVE: the dots take half-precision inputs (the weight rounded to x's dtype, A and B cast to it; CUDA); else
    # every value is fp32 and the dots run in full fp32 (PRECISION "ieee": fp32 x, and the interpreter, whose half
    # arithmetic is wrong).
    # GROUPED: GROUPS weights stacked along N, each tile in one (`group_table`: table[g] is where group g's bytes
    # lie, as an offset from w_ptr less its first row times K/2; table[GROUPS + n] is row n's group); group g's
    # adapter is A's rows g*RANK... and its nested offset offset[g]. Ungrouped: group 0, the bytes at w_ptr.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, BK // 2)
    kk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if GROUPED:
        group = tl.load(table_ptr + GROUPS + pid_n * BN)
        w_ptr += tl.multiple_of(tl.load(table_ptr + group), 16)
    else:
        group = 0
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * (K // 2)
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * (K // 2)  # (LUT: the step's bytes as a [BK/2, BN] tile)
    # x rows past M and A rows past the rank read the last real one (unmasked loads: their products land in output
    # rows the store masks, or meet B's zeroed columns), and a step past k_hi re-reads the split's last step
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * sxm
    first_block = rn.to(tl.int64) * (K // BLOCKSIZE)
    if NESTED:
        offset = tl.load(offset_ptr + group).to(tl.float32)
    else:
        offset = 0.0  # (not read: `_block_scale` takes it when NESTED)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if LORA:
        rr = tl.arange(0, R_PAD)
        r_ok = rr < RANK
        a_rows = a_ptr + (group * RANK + tl.minimum(rr, RANK - 1))[:, None] * sar
        xa = tl.zeros((BM, R_PAD), dtype=tl.float32)
    p1, s1, t1 = _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k_lo, k_hi, BLOCKSIZE,
                             NESTED_BLOCKSIZE, NESTED, AHEAD > 0)
    p2, s2, t2 = _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k_lo + BK, k_hi, BLOCKSIZE,
                             NESTED_BLOCKSIZE, NESTED, AHEAD > 0)
    if AHEAD > 2:
        p3, s3, t3 = _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k_lo + 2 * BK, k_hi,
                                 BLOCKSIZE, NESTED_BLOCKSIZE, NESTED, True)
    x1 = tl.load(x_rows + (k_lo + kk)[None, :] * sxk)
    if LORA:
        a1 = tl.load(a_rows + (k_lo + kk)[None, :] * sak)
    for k in range(k_lo, k_hi, BK):
        packed, stat, nested = p1, s1, t1
        x = x1
        k_next = tl.minimum(k + BK, k_hi - BK)
        x1 = tl.load(x_rows + (k_next + kk)[None, :] * sxk)
        if LORA:
            a = a1
            a1 = tl.load(a_rows + (k_next + kk)[None, :] * sak)
        p1, s1, t1 = p2, s2, t2
        if AHEAD > 2:
            p2, s2, t2 = p3, s3, t3
            p3, s3, t3 = _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k + 3 * BK, k_hi,
                                     BLOCKSIZE, NESTED_BLOCKSIZE, NESTED, True)
        else:
            p2, s2, t2 = _step_loads(w_rows, absmax_ptr, absmax2_ptr, first_block, j, n_ok, k + 2 * BK, k_hi,
                                     BLOCKSIZE, NESTED_BLOCKSIZE, NESTED, AHEAD > 0)
        scale = _block_scale(stat, nested, code2_ptr, offset, NESTED)
        if LUT and AHEAD == 0:
            # The step's bytes loaded in the loop as [BK/2, BN] (Triton's pipeline copies them ahead: a load carried
            # across iterations would not be moved into the dot operand's layout), looked up as they lie there; with
            # AHEAD, the [BN, BK/2] bytes loaded AHEAD steps ago, transposed after the lookups.
            packed = tl.load(w_cols + (k // 2 + j)[:, None], mask=n_ok[None, :], other=0)
        if LUT and NATIVE:
            # The code of each byte's high or low nibble in x's dtype, from a table held in the instructions
            # (`lut_asm`): pure unary elementwise ops, so at AHEAD 0 Triton loads the bytes straight into the dot
            # operand's layout and looks them up there.
            w_even = tl.inline_asm_elementwise(LUT_HIGH, "=r,=r,r", [packed], dtype=x_ptr.dtype.element_ty,
                                               is_pure=True, pack=4)
            w_odd = tl.inline_asm_elementwise(LUT_LOW, "=r,=r,r", [packed], dtype=x_ptr.dtype.element_ty,
                                              is_pure=True, pack=4)
        else:
            w_even = tl.load(code_ptr + (packed >> 4).to(tl.int32))
            w_odd = tl.load(code_ptr + (packed & 0xF).to(tl.int32))
        if not LUT:
            # the weight scaled in fp32, then rounded to x's dtype (below), as bitsandbytes does
            w_even = w_even * scale[:, None]
            w_odd = w_odd * scale[:, None]
        elif AHEAD > 0:
            w_even = tl.trans(w_even)
            w_odd = tl.trans(w_odd)
        if NATIVE:
            if LORA:
                a = a.to(x_ptr.dtype.element_ty)
        else:
            x = x.to(tl.float32)
            if LORA:
                a = a.to(tl.float32)
        if LUT:
            x_even, x_odd = tl.split(tl.reshape(x, (BM, BK // 2, 2)))
            # x @ A^T's dots first: Triton (3.6) gives the loop's dots one MMA layout, and with these last it was
            # theirs ([BM, r]: at 16 rows each of the 4 warps did the whole tile, 24 MMAs a step against 8)
            if LORA:
                a_even, a_odd = tl.split(tl.reshape(a, (R_PAD, BK // 2, 2)))
                xa = tl.dot(x_even, tl.trans(a_even), xa, input_precision=PRECISION)
                xa = tl.dot(x_odd, tl.trans(a_odd), xa, input_precision=PRECISION)
            # codes times x, then the rows' block scales (one a row in a step)
            part = tl.dot(x_even, w_even, input_precision=PRECISION)
            part = tl.dot(x_odd, w_odd, part, input_precision=PRECISION)
            acc += part * scale[None, :]
        else:
            w = tl.reshape(tl.join(w_even, w_odd), (BN, BK))  # columns 2j, 2j + 1 side by side
            if NATIVE:  # (joined in fp32: joined in bf16, triton 3.6 fails to build the 64-row tile for sm_90)
                w = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if LORA:
                xa = tl.dot(x, tl.trans(a), xa, input_precision=PRECISION)
    if LORA:
        b = tl.load(b_ptr + rn[:, None] * sbn + rr[None, :] * sbr, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        xa = xa * scaling
        if NATIVE:
            b = b.to(x_ptr.dtype.element_ty)
            xa = xa.to(x_ptr.dtype.element_ty)
        else:
            b = b.to(tl.float32)
        acc = tl.dot(xa, tl.trans(b), acc, input_precision=PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    out_offsets = rm.to(tl.int64)[:, None] * som + rn[None, :]
    part_offsets = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if SPLITS == 1:
        if BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        plane = (tl.zeros((), dtype=tl.int64) + M) * N  # one split's [M, N] partials (64-bit offsets)
        tl.store(part_ptr + part_offsets + pid_k * plane, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count says so
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            # The tile's last program sums every split's partial, its own read back too, in the fixed order
            # 0..SPLITS-1: the result does not depend on which program arrived last, so it is the same bits run to
            # run, eager or replayed in a CUDA graph. REDUCE_ROWS rows at a time, each chunk's SPLITS loads unrolled
            # (issued back to back) and bounded to ~64 registers a thread; the chunk loop is not unrolled, so the
            # loads of later chunks are not hoisted beside them (spills).
            if BIAS:
                bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            for r0 in tl.range(0, BM, REDUCE_ROWS, loop_unroll_factor=1):
                rows = pid_m * BM + r0 + tl.arange(0, REDUCE_ROWS)
                chunk_mask = (rows < M)[:, None] & n_ok[None, :]
                chunk = part_ptr + rows.to(tl.int64)[:, None] * N + rn[None, :]
                total = tl.load(chunk, mask=chunk_mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLITS):
                    total += tl.load(chunk + s * plane, mask=chunk_mask, other=0.0, cache_modifier=".cg")
                if BIAS:
                    total += bias[None, :]
                out = out_ptr + rows.to(tl.int64)[:, None] * som + rn[None, :]
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=chunk_mask)
            tl.atomic_xchg(count_ptr + tile, 0)


def tile_settings(m: int) -> tuple[int, int, bool]:
    """(output columns a tile, programs an SM, register-table form) of a call of m rows."""
    if m <= _FEW_ROWS:
        return _FEW_ROWS_BLOCK_N, _FEW_ROWS_PROGRAMS_PER_SM, _FEW_ROWS_LUT
    return _BLOCK_N, _PROGRAMS_PER_SM, _LUT


def launch_config(m: int, n: int, k: int, blocksize: int, device: torch.device) -> dict:
    """Tiles and K splits of one call, from static shapes only. Every row in one tile up to 64 rows (the weight
    is read once), output columns a tile and programs an SM by the row count (`tile_settings`), steps of
    min(blocksize, 128) columns of K.
    Rule: splits = min(ceil(programs an SM * SMs / tiles), K / (2 * BK), 32), so that each split walks at least
    two steps (1.5B shapes at 64 rows on 132 SMs: 1536x1536 -> 8 splits, 256x1536 -> 12, 8960x1536 -> 2,
    1536x8960 -> 11)."""
    bm = min(64, max(16, next_power_of_2(m)))
    bn, per_sm, lut = tile_settings(m)
    bk = min(blocksize, 128)
    tiles = cdiv(m, bm) * cdiv(n, bn)
    want = cdiv(per_sm * multiprocessor_count(device), tiles)
    splits = max(1, min(want, k // (2 * bk), _MAX_SPLITS))
    if tiles > _COUNTERS:
        splits = 1
    k_per_split = cdiv(cdiv(k, splits), bk) * bk
    return dict(BM=bm, BN=bn, BK=bk, splits=cdiv(k, k_per_split), k_per_split=k_per_split, LUT=lut,
                AHEAD=_LUT_AHEAD if lut else _JOINED_AHEAD)


_LUT_BODY = (
    "and.b32 t, t, 0x0F0F0F0F; shr.b32 s, t, 4; or.b32 s, s, t; prmt.b32 s, s, 0, 0x0020; "  # nibble i of s: code i
    "and.b32 s, s, 0x7777; prmt.b32 m, m, 0, 0xBA98; "  # m: byte i 0xFF where code i >= 8 (its bit 3 at bit 7)
    "prmt.b32 a, {l0}, {l1}, s; prmt.b32 b, {l2}, {l3}, s; lop3.b32 a, a, b, m, 0xD8; "  # low bytes: m ? b : a
    "prmt.b32 b, {h0}, {h1}, s; prmt.b32 c, {h2}, {h3}, s; lop3.b32 b, b, c, m, 0xD8; "  # high bytes
    "prmt.b32 $0, a, b, 0x5140; prmt.b32 $1, a, b, 0x7362; }}"  # codes 0, 1 and 2, 3 as two 16-bit pairs
)


@functools.lru_cache(maxsize=None)
def lut_asm(values: tuple[float, ...], dtype: torch.dtype) -> tuple[str, str]:
    """PTX of the register-table lookups (the LUT form) for the 16 code `values` rounded to `dtype` (bf16 or fp16):
    (high, low) look up the high (even column) or low (odd column) nibble of each of 4 packed bytes in $2, giving four
    16-bit codes in $0, $1.
    A byte of 8 entries is picked by `prmt` (selectors: the nibbles' low 3 bits); entries 8-15 come from a second
    `prmt`, chosen by the nibble's bit 3."""
    bits = [int(b) & 0xFFFF for b in torch.tensor(values, dtype=torch.float32).to(dtype).view(torch.int16).tolist()]

    def word(entries):
        return hex(sum(e << (8 * i) for i, e in enumerate(entries)))

    tables = {f"l{t}": word([b & 0xFF for b in bits[4 * t:4 * t + 4]]) for t in range(4)}
    tables.update({f"h{t}": word([b >> 8 for b in bits[4 * t:4 * t + 4]]) for t in range(4)})
    body = _LUT_BODY.format(**tables)
    head = "{ .reg .b32 t, s, m, a, b, c; "
    high = head + "shr.b32 t, $2, 4; mov.b32 m, $2; " + body  # bit 3 of the high nibble is the byte's bit 7
    low = head + "mov.b32 t, $2; shl.b32 m, $2, 4; " + body
    return high, low


def _reduce_rows(bm: int, bn: int, splits: int) -> int:
    """Rows of a tile the split-K sum takes at a time: its SPLITS fp32 [rows, BN] loads hold at most _REDUCE_ELEMENTS
    values (64 registers a thread at 4 warps), a power of 2 dividing BM."""
    rows = max(1, _REDUCE_ELEMENTS // (bn * splits))
    return min(bm, 1 << (rows.bit_length() - 1))


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """Per-tile arrival counters, zero between calls (each tile's last program resets its own). One buffer per
    device for the process: calls on one stream run one after another. Made at the first split call on the device,
    which must not be inside a CUDA graph capture (the buffer would live in the graph's pool)."""
    buffer = _counters.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fastgrpo nf4_lora_linear: call it once outside CUDA graph capture first (warm-up)")
        buffer = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return buffer


def group_table(packed: list[torch.Tensor], widths: list[int], k: int) -> torch.Tensor:
    """The int64 table of a grouped call (weights stacked along N; see the kernel): where each group's bytes lie from
    packed[0]'s, less its first row times K/2, then each output row's group. Hold it for the weights' life (a CUDA
    graph that captured a call reads it at every replay); the bytes must not move."""
    if any(p.data_ptr() % 16 for p in packed):
        raise ValueError("grouped nf4_lora_linear: every group's packed bytes must start 16-byte aligned")
    starts, groups, row = [], [], 0
    for g, (p, width) in enumerate(zip(packed, widths)):
        starts.append(p.data_ptr() - packed[0].data_ptr() - row * (k // 2))
        groups += [g] * width
        row += width
    return torch.tensor(starts + groups, dtype=torch.int64, device=packed[0].device)


def _triton_nf4_lora_linear(x2, packed, absmax, code, nested_absmax, nested_code, offset, blocksize,
                            nested_blocksize, n, lora_a, lora_b, scaling, bias, code_values=None, table=None,
                            config=None):
    """x2 [M, K] (any strides) through the kernel; `config` overrides `launch_config` (tests). The config's LUT form
    runs where `code_values` (the codes on the host) are given or off CUDA (the interpreter gathers from `code`);
    else the joined one. `packed`: the weight's flat bytes, or a list of each group's with their `group_table` (see
    `nf4_lora_linear`)."""
    m, k = x2.shape
    packed = list(packed) if isinstance(packed, (list, tuple)) else [packed]
    groups = len(packed)
    grouped = groups > 1
    packed = packed[0]
    config = config or launch_config(m, n, k, blocksize, x2.device)
    splits = config["splits"]
    out = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    part = torch.empty(splits, m, n, device=x2.device, dtype=torch.float32) if splits > 1 else out
    grid = (cdiv(n, config["BN"]), splits, cdiv(m, config["BM"]))
    if splits > 1 and grid[0] * grid[2] > _COUNTERS:
        raise ValueError(f"{grid[0] * grid[2]} tiles need more than the {_COUNTERS} counters; split K less")
    counters = _counter_buffer(x2.device) if splits > 1 else out
    cuda = launch_like_cuda(x2)
    native = cuda and x2.dtype != torch.float32
    nested = nested_absmax is not None
    lora = lora_a is not None
    rank = lora_b.shape[1] if lora else 0  # (a group's, when grouped)
    use_lut = config["LUT"] and (not native or code_values is not None)
    lut_high, lut_low = lut_asm(tuple(code_values), x2.dtype) if use_lut and native else ("", "")
    _nf4_lora_linear_kernel[grid](
        x2, packed, absmax, code, nested_absmax if nested else absmax,
        nested_code if nested else code, offset if nested else code, lora_a if lora else x2,
        lora_b if lora else x2, bias if bias is not None else out,
        out, part, counters, table if grouped else out,
        m, n, k, config["k_per_split"], rank, groups, float(scaling),
        x2.stride(0), x2.stride(1), lora_a.stride(0) if lora else 0, lora_a.stride(1) if lora else 0,
        lora_b.stride(0) if lora else 0, lora_b.stride(1) if lora else 0, out.stride(0),
        BM=config["BM"], BN=config["BN"], BK=config["BK"], BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize,
        R_PAD=max(16, next_power_of_2(rank)), SPLITS=splits, NESTED=nested, LORA=lora, BIAS=bias is not None,
        NATIVE=native, PRECISION=None if native else "ieee", LUT=use_lut, LUT_HIGH=lut_high, LUT_LOW=lut_low,
        AHEAD=config["AHEAD"] if use_lut else max(2, config["AHEAD"]),  # (the joined form's bytes come ahead)
        REDUCE_ROWS=_reduce_rows(config["BM"], config["BN"], splits), GROUPED=grouped,
        num_warps=_NUM_WARPS if cuda else 1,
        num_stages=_NUM_STAGES if cuda else 1,
    )  # fmt: skip
    return out


def _block_scales(absmax, nested_absmax, nested_code, offset, nested_blocksize):
    """The fp32 scale of every quantization block, the nested ones dequantized as bitsandbytes does."""
    if nested_absmax is None:
        return absmax.reshape(-1).float()
    q = absmax.reshape(-1).long()
    nested = nested_absmax.reshape(-1).float().repeat_interleave(nested_blocksize)[: q.numel()]
    return nested_code.float()[q] * nested + offset.float()


def _dequantize(packed, absmax, code, nested_absmax=None, nested_code=None, offset=None, blocksize=64,
                nested_blocksize=256, shape=None, dtype=torch.float32):
    n, k = shape
    flat = packed.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    index = torch.stack([flat >> 4, flat & 0xF], dim=-1).reshape(-1)[: n * k].long()
    scales = _block_scales(absmax, nested_absmax, nested_code, offset, nested_blocksize)
    values = code.float()[index] * scales.repeat_interleave(blocksize)[: n * k]
    return values.reshape(n, k).to(dtype)


def reference_dequantize_nf4(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight of bitsandbytes' packed 4-bit tensor and its `QuantState` in plain torch (see the module
    docstring), in `dtype` (default: the state's dtype): bit-exact with `bitsandbytes.functional.dequantize_4bit`."""
    return _dequantize(packed, **_state_args(quant_state), dtype=dtype or quant_state.dtype)


def reference_nf4_lora_linear(x, packed, absmax, code, nested_absmax, nested_code, offset, blocksize,
                              nested_blocksize, shape, lora_a, lora_b, scaling, bias,
                              compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The op's maths in plain torch: the weight dequantized and rounded to x's dtype, then the products, the LoRA
    term and the bias in `compute_dtype`; returns [..., N] in `compute_dtype` (not rounded to x's dtype)."""
    w = _dequantize(packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, shape,
                    x.dtype)
    xc = x.to(compute_dtype)
    out = F.linear(xc, w.to(compute_dtype))
    if lora_a is not None:
        out = out + scaling * F.linear(F.linear(xc, lora_a.to(compute_dtype)), lora_b.to(compute_dtype))
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out


def kernel_obstacle(t: torch.Tensor, blocksize: int, k: int, rank: int) -> str | None:
    """Why a call on tensors on t's device, with this blocksize, K and LoRA rank (0: none), would run the torch
    reference instead of the kernel (None: the kernel runs)."""
    if not use_triton(t):
        return f"on {t.device.type}, the kernel runs on CUDA"
    if k % blocksize:
        return "in_features not a multiple of the blocksize"
    if rank > MAX_RANK:
        return f"LoRA rank above {MAX_RANK}"
    return None


def _group_parts(packed, absmax, nested_absmax, offset, blocksize, nested_blocksize, k, lora_a, lora_b, bias):
    """Each group's (packed, absmax, nested_absmax, offset, lora_a, lora_b, bias, rows) of a grouped call."""
    row = block = 0
    rank = 0 if lora_b is None else lora_b.shape[1]
    for g, p in enumerate(packed):
        rows = p.numel() * 2 // k
        blocks = rows * k // blocksize
        nested = None
        if nested_absmax is not None:
            nested = nested_absmax[block // nested_blocksize:cdiv(block + blocks, nested_blocksize)]
        yield (p, absmax[block:block + blocks], nested, None if offset is None else offset[g],
               None if lora_a is None else lora_a[g * rank:(g + 1) * rank],
               None if lora_b is None else lora_b[row:row + rows], None if bias is None else bias[row:row + rows], rows)
        row, block = row + rows, block + blocks


def _reference(x2, packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, n, lora_a,
               lora_b, scaling, bias):
    """The op's torch path, in x's dtype: `reference_nf4_lora_linear`, a group at a time for a grouped call."""
    k = x2.shape[1]
    if len(packed) == 1:
        return reference_nf4_lora_linear(x2, packed[0], absmax, code, nested_absmax, nested_code, offset, blocksize,
                                         nested_blocksize, (n, k), lora_a, lora_b, scaling, bias).to(x2.dtype)
    return torch.cat([
        reference_nf4_lora_linear(x2, p, a, code, nested, nested_code, off, blocksize, nested_blocksize, (rows, k),
                                  la, lb, scaling, b).to(x2.dtype)
        for p, a, nested, off, la, lb, b, rows in _group_parts(packed, absmax, nested_absmax, offset, blocksize,
                                                                nested_blocksize, k, lora_a, lora_b, bias)], dim=1)


@torch.library.custom_op("fastgrpo::nf4_lora_linear", mutates_args=())
def _nf4_lora_linear_op(x: torch.Tensor, packed: list[torch.Tensor], absmax: torch.Tensor, code: torch.Tensor,
                        nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                        offset: torch.Tensor | None, blocksize: int, nested_blocksize: int, out_features: int,
                        lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scaling: float,
                        bias: torch.Tensor | None, code_values: list[float] | None,
                        group_table: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rank = 0 if lora_b is None else lora_b.shape[1]
    if x2.shape[0] == 0:
        out = x2.new_empty(0, out_features)
    elif kernel_obstacle(x2, blocksize, k, rank) is None:
        out = _triton_nf4_lora_linear(x2, packed, absmax, code, nested_absmax, nested_code, offset, blocksize,
                                      nested_blocksize, out_features, lora_a, lora_b, scaling, bias, code_values,
                                      table=group_table)
    else:
        out = _reference(x2, packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                         out_features, lora_a, lora_b, scaling, bias)
    return out.reshape(*x.shape[:-1], out_features)


@_nf4_lora_linear_op.register_fake
def _(x, packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, out_features,
      lora_a, lora_b, scaling, bias, code_values, group_table):
    return x.new_empty(*x.shape[:-1], out_features)


def quant_state_args(quant_state) -> dict:
    """The keyword arguments of `nf4_lora_linear` held in a bitsandbytes `QuantState`: absmax, code, code_values
    (code read to the host: a sync; made here, so hold the result instead of calling this per call), shape,
    blocksize and, when double-quantized, nested_absmax, nested_code, nested_blocksize, offset."""
    return dict(_state_args(quant_state), code_values=tuple(float(v) for v in quant_state.code.reshape(-1).tolist()))


def _state_args(quant_state) -> dict:
    """`quant_state_args` without code_values (what the dequantization reads: no host sync)."""
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError("this 4-bit weight was repacked for bitsandbytes' CPU inference kernel (an eval no-grad "
                         "forward on an AVX512-BF16 CPU); set the Linear4bit's support_avx512bf16_for_cpu = False "
                         "before its first forward to keep bitsandbytes' layout")
    if quant_state.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type {quant_state.quant_type!r}: a 4-bit state (nf4 or fp4) is needed")
    args = dict(absmax=quant_state.absmax, code=quant_state.code, shape=tuple(quant_state.shape),
                blocksize=int(quant_state.blocksize))
    if quant_state.nested:
        args.update(nested_absmax=quant_state.state2.absmax, nested_code=quant_state.state2.code,
                    nested_blocksize=int(quant_state.state2.blocksize), offset=quant_state.offset)
    return args


def _flat_bytes(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)  # another quant_storage dtype: the same bytes


def _checked_quantization(packed, absmax, code, n, k, blocksize, nested_absmax, nested_code, offset,
                          nested_blocksize, lora_a, lora_b, group_table):
    """The 4-bit weight's tensors and the LoRA factors checked against an (n, k) weight (a clear error naming the
    fix otherwise), then as the ops take them: (each group's packed bytes flat as uint8, absmax, code as fp32,
    nested_absmax as fp32, nested_code as fp32, offset 0-d, or one a group), the nested ones None when not
    double-quantized."""
    flats = [_flat_bytes(p) for p in (packed if isinstance(packed, (list, tuple)) else [packed])]
    groups = len(flats)
    if groups > 1:
        rows = [2 * f.numel() // k for f in flats]
        fix = "(group_table(packed, widths, K) builds the table; widths: each group's rows)"
        if k % blocksize or sum(rows) != n or any(2 * f.numel() != r * k for f, r in zip(flats, rows)):
            raise ValueError(f"grouped weights of {[f.numel() for f in flats]} packed bytes for a ({n}, {k}) weight: "
                             f"K a multiple of the blocksize and whole rows of K a group, {n} in all")
        if any(r % GROUP_ROWS for r in rows[:-1]):
            raise ValueError(f"grouped weights of {rows} rows: each but the last a multiple of {GROUP_ROWS}")
        if group_table is None or group_table.numel() != groups + n:
            raise ValueError(f"a grouped call needs its group_table of {groups + n} entries {fix}")
        if nested_absmax is not None and any(r * k // blocksize % nested_blocksize for r in rows[:-1]):
            raise ValueError(f"grouped double-quantized weights: each but the last needs a multiple of "
                             f"{nested_blocksize} blocks")
    elif flats[0].numel() != (n * k + 1) // 2:
        raise ValueError(f"{flats[0].numel()} packed bytes for a ({n}, {k}) weight: expected {(n * k + 1) // 2} "
                         f"(quant_state_args(weight.quant_state) gives the weight's shape and statistics)")
    if blocksize <= 0 or blocksize & (blocksize - 1) or blocksize < 32:
        raise ValueError(f"blocksize {blocksize}: a power of 2 of at least 32 (bitsandbytes' 4-bit blocksizes)")
    if absmax.numel() != cdiv(n * k, blocksize) or code.numel() != 16:
        raise ValueError(f"absmax of {absmax.numel()} blocks and a code of {code.numel()} levels: expected "
                         f"{cdiv(n * k, blocksize)} and 16")
    nested = (nested_absmax, nested_code, offset)
    if any(t is not None for t in nested):
        if any(t is None for t in nested) or absmax.dtype != torch.uint8:
            raise ValueError("double quantization needs uint8 absmax codes, nested_absmax, nested_code and offset")
        want = cdiv(absmax.numel(), nested_blocksize)  # (grouped: each weight but the last whole nested blocks)
        if nested_absmax.numel() != want or nested_code.numel() != 256:
            raise ValueError(f"nested_absmax of {nested_absmax.numel()} blocks and nested_code of "
                             f"{nested_code.numel()} levels: expected {want}, 256")
        if offset.numel() != groups:
            raise ValueError(f"offset of {offset.numel()} values: expected one a group ({groups})")
        offset = offset.reshape(groups) if groups > 1 else offset.reshape(())
    elif absmax.dtype == torch.uint8:
        raise ValueError("uint8 absmax is double-quantized: pass nested_absmax, nested_code and offset")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("pass both lora_a and lora_b, or neither")
    if lora_a is not None:
        r = lora_b.shape[-1]
        if lora_a.shape != (groups * r, k) or lora_b.shape != (n, r):
            raise ValueError(f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)}: expected "
                             f"({groups * r}, {k}) and ({n}, {r})" + (" (each group's A, of equal ranks, stacked)"
                                                                      if groups > 1 else ""))
    return (flats, absmax.reshape(-1), code.reshape(-1).float(),
            None if nested_absmax is None else nested_absmax.reshape(-1).float(),
            None if nested_code is None else nested_code.reshape(-1).float(), offset)


def nf4_lora_linear(x: torch.Tensor, packed: torch.Tensor | list[torch.Tensor], absmax: torch.Tensor,
                    code: torch.Tensor, *, shape: tuple[int, int], blocksize: int = 64,
                    nested_absmax: torch.Tensor | None = None, nested_code: torch.Tensor | None = None,
                    offset: torch.Tensor | None = None, nested_blocksize: int = 256,
                    lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None, scaling: float = 1.0,
                    bias: torch.Tensor | None = None, code_values: tuple[float, ...] | None = None,
                    group_table: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring; `quant_state_args(weight.quant_state)` gives the quantization arguments.
    `code_values`: code's 16 values on the host (values that disagree with code give wrong weights), or None (then
    the joined form runs at every row count). For sampling only: no autograd, so a call with grad-requiring inputs
    is refused (run it under torch.no_grad()).
    Grouped (several weights reading x in one launch): `packed` a list of each weight's bytes, `shape` (their rows in
    all, K), absmax, nested_absmax, bias and lora_b the weights' concatenated in order, offset one a weight, lora_a
    their adapters' A (of one rank) stacked, code and nested_code shared, and `group_table(packed, rows, K)`."""
    tensors = (x, lora_a, lora_b, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("fastgrpo nf4_lora_linear has no backward (it samples): call it under torch.no_grad()")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fastgrpo::nf4_lora_linear takes float32, float16 or bfloat16 x, got {x.dtype}")
    n, k = (int(s) for s in shape)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of shape ({n}, {k})")
    flats, absmax, code, nested_absmax, nested_code, offset = _checked_quantization(
        packed, absmax, code, n, k, blocksize, nested_absmax, nested_code, offset, nested_blocksize, lora_a, lora_b,
        group_table)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}: expected ({n},)")
    if code_values is not None and len(code_values) != 16:
        raise ValueError(f"{len(code_values)} code_values: expected code's 16 values")
    return _nf4_lora_linear_op(x, flats, absmax, code, nested_absmax, nested_code, offset,
                               int(blocksize), int(nested_blocksize), n, lora_a, lora_b, float(scaling), bias,
                               None if code_values is None else [float(v) for v in code_values],
                               group_table if len(flats) > 1 else None)
