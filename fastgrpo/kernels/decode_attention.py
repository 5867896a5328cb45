"""Decode attention over the rollout engine's KV cache: one new query per row, grouped-query heads read once.

`decode_attention(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale=, window=, softcap=, sinks=,
prompt_rows=, prompt_len=)`:
- q [b, Hq, D]: this step's query of each batch row; k_new, v_new [b, Hkv, D]: its key and value.
- k_cache, v_cache [R, Hkv, L, D]: the cache; batch row i lives in cache row rows[i] (a compacted batch is a subset).
  Any strides with a unit last one; rows may overlap in memory where no slot the op reads or writes is shared (the
  rollout engine's compact layout: a decoding row's prompt slots alias another row's completion slots).
- start [R]: a cache row's first valid slot (left padding); length (0-d device tensor): slots written once this
  step's key is in, the same for every row (the query sits at slot length - 1).
- The op writes k_new / v_new at slot length - 1 of each batch row's cache row, then attends over the row's slots
  [start, length) - the last `window` of them for a sliding-window layer - with `softcap` (c * tanh(s / c), after
  the scale) and `sinks` (one logit per query head that joins the softmax's denominator and carries no value).
- prompt_rows [R'] (R' <= R: the rows that decode), prompt_len (0-d device tensor), both or neither: slots
  [0, prompt_len) of cache row r are read from cache row prompt_rows[r] (rows that share a prompt keep one copy of its
  keys and values). The new slot must lie at or after prompt_len.
- prompt_groups [N, PROMPT_GROUP_ROWS] (with prompt_rows): batch rows listed by the prompt they share, -1 after the
  last of an entry; every batch row in exactly one entry, an entry's rows of one prompt row and one start. The
  prompt slots are then attended once per entry for all its rows' queries: each prompt key and value is read once
  for the entry, not once per row.
- Returns [b, Hq, D] in q's dtype; fp32 accumulation.

`length` never becomes a Python int: the op is replayed in CUDA graphs with `length` advanced in place.

Triton path ("flash decoding"): grid (batch row, KV head, split); each program loads the G = Hq / Hkv query heads
of its KV head (padded to the 16 rows `tl.dot` takes), so each key and value is read once for its whole group; it
walks its share of the valid slots in blocks with an online softmax and writes a partial (max, sum, output); a second
kernel combines the splits and the sinks. The new slot's key and value are read from k_new / v_new (so no program
depends on another's store); split 0 stores them in the cache. The split count comes from static facts only (batch,
KV heads, cache length, SMs), never from `length`.
With prompt_groups ("cascade" decoding) a prompt kernel runs first: grid (entry chunk, KV head, split), each program
holding the queries of up to PROMPT_GROUP_ROWS rows x G heads as the rows of its dots (at most 64), walking the
shared prompt slots; the row kernel then walks each row's own slots from prompt_len on, and the combine merges both
kernels' partials.
The torch path (CPU, and the tests' reference) does the same maths on gathered rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import cdiv, launch_like_cuda, multiprocessor_count, next_power_of_2, use_triton

# Programs per SM the splits aim at (one wave of short programs hides the reduction's launch).
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64
PROMPT_GROUP_ROWS = 8  # width of a prompt_groups entry (GRPO's common group size; larger groups take two entries)
_PROMPT_DOT_ROWS = 64  # rows x heads a prompt program holds at most (its queries, accumulator and scores)
# Keys + values of one token of one layer from which prompt_groups pays for its extra kernel: rows reading a shared
# prompt each (prompt_rows alone) mostly hit L2 when a token's KV is small, and miss it when it is large.
# `python bench/bench_decode_attention.py` (H100): Phi-3-mini (12 KiB) 0.44-0.95x the time of prompt_rows alone;
# Qwen2.5-1.5B and Gemma-3-1B (1 KiB) 0.93-3.6x. Whole steps (`bash bench/device_session.sh train_step`,
# `--grouped-prompt 1|0`): Phi-3-mini generation 3.81 against 4.64 s, Llama-3.1-8B (4 KiB) 4.72 against 4.59 s.
GROUPED_PROMPT_MIN_BYTES = 8192
# Slot offsets in the kernels: 32-bit for caches spanning fewer than WIDE_OFFSETS_FROM elements at head dims up to
# NARROW_OFFSETS_MAX_DIM, else 64-bit (`WIDE`). sm_90 builds (triton 3.6, `python bench/kernel_resources.py`) of the
# rows' kernel at 4 warps: head dims 96-128 (64 slots a block) 168-204 registers and no spill with 32-bit offsets,
# 255 and 16-264 bytes of spill with 64-bit ones; head dim 256 (32 slots a block) 255 and 88 bytes of spill with 32-bit,
# 254 and none with 64-bit. Rollouts, `python bench/bench_generation.py --generations 8 [--set
# fastgrpo.kernels.decode_attention.NARROW_OFFSETS_MAX_DIM=0]` (one H100, LoRA): Qwen2.5-1.5B 64x256 22.4-22.7k tok/s
# against 20.3-21.0k with 64-bit, Llama-3.1-8B 64x512 7.83k against 7.66k, Phi-3-mini and 1.5B 128x512 within 1.5 %.
WIDE_OFFSETS_FROM = 2**31
NARROW_OFFSETS_MAX_DIM = 128


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_block(q, k, v, n_ok, m, l, acc, scale, softcap, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr):
    """One block of keys and values (k, v [BLOCK_N, D_PAD], in q's dtype; `n_ok` marks the visible slots, at least
    one) into the online softmax (m, l, acc) of q's rows; returns the updated (m, l, acc)."""
    if NATIVE:
        scores = tl.dot(q, tl.trans(k)) * scale
    else:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the block holds a visible slot
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    if NATIVE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _slot_offsets(n, d, stride, WIDE: tl.constexpr):
    """[BLOCK_N, D_PAD] element offsets of slots n, dims d from a head's start: 64-bit where WIDE, else 32-bit."""
    slots = n[:, None]
    if WIDE:
        slots = slots.to(tl.int64)
    return slots * stride + d[None, :]


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_ptr, v_ptr, rows_ptr, start_ptr, length_ptr, prompt_rows_ptr, prompt_len_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr,
    sq0, sq1, skn0, skn1, svn0, svn1,
    sk0, sk1, sk2, sv0, sv1, sv2,
    scale, softcap,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr, SHARED: tl.constexpr,
    OWN_ONLY: tl.constexpr, PART_SPLITS: tl.constexpr, PART_BASE: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    # OWN_ONLY: the prompt kernel took slots [0, prompt_len); this one walks the rest. Partials go to splits
    # [PART_BASE, PART_BASE + SPLITS) of PART_SPLITS.
    # WIDE: a block's slot offsets in 64 bits (a cache of 2^31 elements or more needs them; see NARROW_OFFSETS_MAX_DIM
    # for the registers either takes); else 32-bit offsets from the head's (or, SHARED, the cache's) start.
    # NATIVE: the dots take the half-precision inputs as they are (CUDA); else every value is fp32 and the dots run
    # in full fp32 (fp32 models, and the interpreter, whose half-precision arithmetic is wrong).
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(rows_ptr + i).to(tl.int64)
    length = tl.load(length_ptr).to(tl.int32)
    last = length - 1
    lo = tl.load(start_ptr + row).to(tl.int32)
    if WINDOW > 0:
        lo = tl.maximum(lo, length - WINDOW)
    if OWN_ONLY:
        lo = tl.maximum(lo, tl.load(prompt_len_ptr).to(tl.int32))
    per_split = tl.cdiv(tl.cdiv(length - lo, SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + s * per_split
    s_hi = tl.minimum(s_lo + per_split, length)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    heads = h * G + g
    q = tl.load(q_ptr + i * sq0 + heads[:, None] * sq1 + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_new = tl.load(k_new_ptr + i * skn0 + h * skn1 + d, mask=d_ok, other=0.0).to(k_ptr.dtype.element_ty)
    v_new = tl.load(v_new_ptr + i * svn0 + h * svn1 + d, mask=d_ok, other=0.0).to(v_ptr.dtype.element_ty)
    if s == 0:
        tl.store(k_ptr + row * sk0 + h * sk1 + last.to(tl.int64) * sk2 + d, k_new, mask=d_ok)
        tl.store(v_ptr + row * sv0 + h * sv1 + last.to(tl.int64) * sv2 + d, v_new, mask=d_ok)
    if NATIVE:
        q = q.to(k_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)
        k_new = k_new.to(tl.float32)
        v_new = v_new.to(tl.float32)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if SHARED:
        prompt_row = tl.load(prompt_rows_ptr + row).to(tl.int64)
        prompt_len = tl.load(prompt_len_ptr).to(tl.int32)
    for block in range(s_lo, s_hi, BLOCK_N):
        n = block + tl.arange(0, BLOCK_N)
        n_ok = n < s_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        if SHARED:  # each slot's cache row: the prompt's for prompt slots, the row's own after them
            source = tl.where(n < prompt_len, prompt_row, row)[:, None]
            if not WIDE:
                source = source.to(tl.int32)
            k_at = k_ptr + h * sk1 + (source * sk0 + _slot_offsets(n, d, sk2, WIDE))
            v_at = v_ptr + h * sv1 + (source * sv0 + _slot_offsets(n, d, sv2, WIDE))
        else:
            k_at = k_ptr + row * sk0 + h * sk1 + _slot_offsets(n, d, sk2, WIDE)
            v_at = v_ptr + row * sv0 + h * sv1 + _slot_offsets(n, d, sv2, WIDE)
        k = tl.load(k_at, mask=kv_mask, other=0.0)
        v = tl.load(v_at, mask=kv_mask, other=0.0)
        if not NATIVE:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        is_new = (n == last)[:, None]
        k = tl.where(is_new, k_new[None, :], k)
        v = tl.where(is_new, v_new[None, :], v)
        m, l, acc = _attend_block(q, k, v, n_ok, m, l, acc, scale, softcap, SOFTCAP, NATIVE)

    out = (i * (G * tl.num_programs(1)) + heads) * PART_SPLITS + PART_BASE + s
    tl.store(part_m_ptr + out, m, mask=g_ok)
    tl.store(part_l_ptr + out, l, mask=g_ok)
    tl.store(part_o_ptr + out[:, None] * D_PAD + d[None, :], acc, mask=(g_ok & (m > float("-inf")))[:, None])


@triton.jit
def _decode_prompt_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, start_ptr, length_ptr, prompt_rows_ptr, prompt_len_ptr, groups_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr,
    sq0, sq1, sk0, sk1, sk2, sv0, sv1, sv2, scale, softcap,
    G: tl.constexpr, MEMBERS: tl.constexpr, WIDTH: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PART_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    # Program (chunk e of a prompt_groups entry, KV head h, split s): MEMBERS rows of the entry x G heads as the rows
    # of the dots, over the entry's prompt slots [start, prompt_len) (the last WINDOW of the row's slots).
    e = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    entry_at = groups_ptr + (e // (WIDTH // MEMBERS)) * WIDTH + (e % (WIDTH // MEMBERS)) * MEMBERS
    j = tl.arange(0, M_PAD)
    member_ok = j < MEMBERS * G
    position = tl.load(entry_at + j // G, mask=member_ok, other=-1).to(tl.int64)
    valid = member_ok & (position >= 0)
    first = tl.load(entry_at).to(tl.int64)
    row = tl.load(rows_ptr + tl.maximum(first, 0)).to(tl.int64)
    prompt_row = tl.load(prompt_rows_ptr + row).to(tl.int64)
    length = tl.load(length_ptr).to(tl.int32)
    lo = tl.load(start_ptr + row).to(tl.int32)
    if WINDOW > 0:
        lo = tl.maximum(lo, length - WINDOW)
    hi = tl.minimum(tl.load(prompt_len_ptr).to(tl.int32), length)
    hi = tl.where(first >= 0, hi, lo)  # an empty entry walks nothing
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + s * per_split
    s_hi = tl.minimum(s_lo + per_split, hi)

    d = tl.arange(0, D_PAD)
    d_ok = d < D
    heads = h * G + j % G
    q = tl.load(q_ptr + tl.maximum(position, 0)[:, None] * sq0 + heads[:, None] * sq1 + d[None, :],
                mask=valid[:, None] & d_ok[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty) if NATIVE else q.to(tl.float32)
    m = tl.full([M_PAD], float("-inf"), tl.float32)
    l = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    k_base = k_ptr + prompt_row * sk0 + h * sk1
    v_base = v_ptr + prompt_row * sv0 + h * sv1
    for block in range(s_lo, s_hi, BLOCK_N):
        n = block + tl.arange(0, BLOCK_N)
        n_ok = n < s_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + _slot_offsets(n, d, sk2, WIDE), mask=kv_mask, other=0.0)
        v = tl.load(v_base + _slot_offsets(n, d, sv2, WIDE), mask=kv_mask, other=0.0)
        if not NATIVE:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m, l, acc = _attend_block(q, k, v, n_ok, m, l, acc, scale, softcap, SOFTCAP, NATIVE)

    out = (position * (G * tl.num_programs(1)) + heads) * PART_SPLITS + s
    tl.store(part_m_ptr + out, m, mask=valid)
    tl.store(part_l_ptr + out, l, mask=valid)
    tl.store(part_o_ptr + out[:, None] * D_PAD + d[None, :], acc, mask=(valid & (m > float("-inf")))[:, None])


@triton.jit
def _decode_combine_kernel(
    part_o_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, so0, so1, HQ,
    D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < SPLITS
    base = (i * HQ + head) * SPLITS
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    # A split that walked no slot stored m = -inf and no output: its weight is 0 and its output is not read.
    o = tl.load(part_o_ptr + (base + s)[:, None] * D_PAD + d[None, :], mask=(m > float("-inf"))[:, None], other=0.0)
    top = tl.max(m, axis=0)
    weight = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    total = tl.sum(weight * l, axis=0)
    if SINKS:
        total += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - top)
    result = tl.sum(weight[:, None] * o, axis=0) / total
    tl.store(out_ptr + i * so0 + head * so1 + d, result, mask=d < D)


def _offset_span(t: torch.Tensor) -> int:
    """One past the largest element offset of `t` (its storage span in elements, whatever its strides)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _splits(batch: int, kv_heads: int, slots: int, block_n: int, device: torch.device) -> int:
    programs = batch * kv_heads
    want = cdiv(_PROGRAMS_PER_SM * multiprocessor_count(device), programs)
    return max(1, min(want, cdiv(slots, block_n), _MAX_SPLITS))


def grouped_prompt_pays(k_cache: torch.Tensor) -> bool:
    """Whether attending a shared prompt once a group (prompt_groups) is expected to be faster than each row reading
    it (prompt_rows alone) on a cache [R, Hkv, L, D]: a token's keys and values of the layer reach
    GROUPED_PROMPT_MIN_BYTES."""
    return 2 * k_cache.shape[1] * k_cache.shape[3] * k_cache.element_size() >= GROUPED_PROMPT_MIN_BYTES


def _prompt_members(group: int) -> int:
    """Rows of a prompt_groups entry one prompt program holds: the largest power of two that divides the entry and
    keeps rows x heads within _PROMPT_DOT_ROWS."""
    members = PROMPT_GROUP_ROWS
    while members > 1 and members * group > _PROMPT_DOT_ROWS:
        members //= 2
    return members


def _triton_decode(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale, window, softcap, sinks,
                   prompt_rows=None, prompt_len=None, prompt_groups=None, splits=None, prompt_splits=None,
                   block_n=None, num_warps=None, num_stages=None):
    # splits, prompt_splits, block_n, num_warps, num_stages: launch overrides (bench_decode_attention.py --sweep).
    b, hq, d = q.shape
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    d_pad = max(16, next_power_of_2(d))
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    if splits is None:
        splits = _splits(b, hkv, slots, block_n, q.device)
    cuda = launch_like_cuda(q)
    num_warps = num_warps or (4 if cuda else 1)
    num_stages = num_stages or (2 if cuda else 1)
    native = cuda and k_cache.dtype != torch.float32
    wide = d_pad > NARROW_OFFSETS_MAX_DIM or max(_offset_span(k_cache), _offset_span(v_cache)) >= WIDE_OFFSETS_FROM
    members = _prompt_members(group)
    chunks = prompt_groups.shape[0] * (PROMPT_GROUP_ROWS // members) if prompt_groups is not None else 0
    if prompt_groups is not None and prompt_splits is None:  # as many programs as the rows' kernel, by static facts
        prompt_splits = _splits(max(1, b // members), hkv, slots, block_n, q.device)
    base = prompt_splits if prompt_groups is not None else 0
    total = base + splits
    part_o = torch.empty(b, hq, total, d_pad, device=q.device, dtype=torch.float32)
    part_m = torch.empty(b, hq, total, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    if prompt_groups is not None:
        m_pad = max(16, next_power_of_2(members * group))
        _decode_prompt_kernel[(chunks, hkv, prompt_splits)](
            q, k_cache, v_cache, rows, start, length, prompt_rows, prompt_len, prompt_groups, part_o, part_m, part_l,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), float(scale), float(softcap or 0.0),
            G=group, MEMBERS=members, WIDTH=PROMPT_GROUP_ROWS, M_PAD=m_pad, D=d, D_PAD=d_pad, BLOCK_N=block_n,
            SPLITS=prompt_splits, PART_SPLITS=total, WINDOW=int(window or 0), SOFTCAP=bool(softcap), NATIVE=native,
            WIDE=wide, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    _decode_partial_kernel[(b, hkv, splits)](
        q, k_new, v_new, k_cache, v_cache, rows, start, length,
        rows if prompt_rows is None else prompt_rows, length if prompt_len is None else prompt_len,
        part_o, part_m, part_l,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(scale), float(softcap or 0.0),
        G=group, G_PAD=max(16, next_power_of_2(group)), D=d, D_PAD=d_pad, BLOCK_N=block_n, SPLITS=splits,
        WINDOW=int(window or 0), SOFTCAP=bool(softcap), NATIVE=native,
        SHARED=prompt_rows is not None and prompt_groups is None, OWN_ONLY=prompt_groups is not None,
        PART_SPLITS=total, PART_BASE=base, WIDE=wide, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    _decode_combine_kernel[(b, hq)](
        part_o, part_m, part_l, sinks if sinks is not None else part_m, out, out.stride(0), out.stride(1), hq,
        D=d, D_PAD=d_pad, SPLITS=total, SPLITS_PAD=max(2, next_power_of_2(total)), SINKS=sinks is not None,
        num_warps=1,
    )  # fmt: skip
    return out


def reference_decode_attention(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale, window=None,
                               softcap=None, sinks=None, prompt_rows=None, prompt_len=None):
    """The op in plain torch (fp32 maths): writes the new slot, then attends over the gathered rows."""
    b, hq, d = q.shape
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    last = (length - 1).reshape(1).expand(b)
    k_cache[rows, :, last] = k_new.to(k_cache.dtype)
    v_cache[rows, :, last] = v_new.to(v_cache.dtype)
    keys, values = k_cache[rows].float(), v_cache[rows].float()
    if prompt_rows is not None:
        from_prompt = (torch.arange(slots, device=q.device) < prompt_len)[None, None, :, None]
        source = prompt_rows[rows]
        keys = torch.where(from_prompt, k_cache[source].float(), keys)
        values = torch.where(from_prompt, v_cache[source].float(), values)
    group = hq // hkv
    scores = torch.einsum("bhgd,bhld->bhgl", q.float().reshape(b, hkv, group, d), keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    slot = torch.arange(slots, device=q.device)
    visible = (slot[None] >= start[rows][:, None]) & (slot[None] <= last[:, None])
    if window:
        visible &= last[:, None] - slot[None] < window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, group, 1).expand(b, -1, -1, -1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhgl,bhld->bhgd", probs, values).reshape(b, hq, d).to(q.dtype)


@torch.library.custom_op("fastgrpo::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                         scale: float, window: int, softcap: float, sinks: torch.Tensor | None,
                         prompt_rows: torch.Tensor | None, prompt_len: torch.Tensor | None,
                         prompt_groups: torch.Tensor | None) -> torch.Tensor:
    if use_triton(q):
        return _triton_decode(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale, window, softcap, sinks,
                              prompt_rows, prompt_len, prompt_groups)
    return reference_decode_attention(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale, window, softcap,
                                      sinks, prompt_rows, prompt_len)


@_decode_attention_op.register_fake
def _(q, k_new, v_new, k_cache, v_cache, rows, start, length, scale, window, softcap, sinks, prompt_rows, prompt_len,
      prompt_groups):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention(q, k_new, v_new, k_cache, v_cache, rows, start, length, *, scale, window=None, softcap=None,
                     sinks=None, prompt_rows=None, prompt_len=None, prompt_groups=None) -> torch.Tensor:
    """See the module docstring. `window` None or 0: no window; `softcap` None or 0: none. For sampling only: no
    autograd (it mutates the cache), so a call with grad-requiring inputs is refused."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_new, v_new, sinks)):
        raise RuntimeError("fastgrpo decode_attention has no backward (it samples): call it under torch.no_grad()")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[1]} key/value heads")
    if q.shape[-1] != k_cache.shape[-1] or k_new.shape != (q.shape[0], k_cache.shape[1], q.shape[-1]):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_new {tuple(k_new.shape)}, cache "
                         f"{tuple(k_cache.shape)}")
    if (prompt_rows is None) != (prompt_len is None):
        raise ValueError("give prompt_rows and prompt_len together (the prompt slots and the rows holding them)")
    if prompt_rows is not None and (prompt_rows.dim() != 1 or prompt_rows.shape[0] > k_cache.shape[0]
                                    or prompt_len.dim() != 0):
        raise ValueError(f"prompt_rows must be [R'] with R' <= {k_cache.shape[0]} (one per decoding cache row) and "
                         f"prompt_len 0-d; got {tuple(prompt_rows.shape)} and {tuple(prompt_len.shape)}")
    if prompt_groups is not None and (prompt_rows is None or prompt_groups.dim() != 2
                                      or prompt_groups.shape[1] != PROMPT_GROUP_ROWS):
        raise ValueError(f"prompt_groups must be [entries, {PROMPT_GROUP_ROWS}] batch rows, with prompt_rows; got "
                         f"{tuple(prompt_groups.shape)}")
    return _decode_attention_op(q, k_new, v_new, k_cache, v_cache, rows, start, length, float(scale),
                                int(window or 0), float(softcap or 0.0), sinks, prompt_rows, prompt_len, prompt_groups)
