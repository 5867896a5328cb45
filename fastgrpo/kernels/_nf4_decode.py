"""The 4-bit code lookups of `_nf4_lora_linear_kernel` (fastgrpo/kernels/nf4_lora_linear.py), one per LOOKUP value.

Contract of every lookup: a packed byte b yields (code[b >> 4], code[b & 15]) as fp32, bit for bit the table's
values (no arithmetic on them), so the kernel's weight stays fp32(code[c]) * fp32(scale) rounded to x's dtype.
- 0 GATHER: two global-memory gathers a byte into the 64-byte table (L1-resident).
- 1 SELECT: the 16 levels loaded once a program as scalars; a byte's nibble picks its level by a tree of 15
  selects on its 4 bits (registers only: no memory access per element, ~20 ALU instructions per element).
- 2 REGISTER: the 16 levels loaded once a program as a [16] tensor; `tl.gather` from it (Triton lowers it to
  shuffles or a shared-memory read).
- 3 PAIR: one 64-bit global gather a byte into a 256-entry table of (code[b >> 4], code[b & 15]) pairs
  (`pair_table`, 2 KB, L1-resident), split into the two fp32 halves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GATHER, SELECT, REGISTER, PAIR = 0, 1, 2, 3

_pair_tables: dict[tuple, tuple[torch.Tensor, int, torch.Tensor]] = {}


def pair_table(code: torch.Tensor) -> torch.Tensor:
    """The [256] int64 view of the 256 x 2 fp32 table (code[b >> 4], code[b & 15]) of the 16-entry fp32 `code`,
    made once per code tensor and kept for the process (one a bitsandbytes QuantState: a few KB a model). The
    cache holds `code` itself, so its address names it while cached; a write into it (its version) rebuilds the
    table. The first call on a code tensor must be outside CUDA graph capture (a captured build would not run
    before replay)."""
    key = (code.device, code.data_ptr())
    hit = _pair_tables.get(key)
    if hit is not None and hit[1] == code._version:
        return hit[2]
    if code.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fastgrpo nf4_lora_linear: call it once outside CUDA graph capture first (warm-up)")
    byte = torch.arange(256, device=code.device)
    table = torch.stack((code[byte >> 4], code[byte & 15]), dim=-1).float().contiguous().view(torch.int64)
    _pair_tables[key] = (code, code._version, table.reshape(256))
    return _pair_tables[key][2]


@triton.jit
def levels(code_ptr, LOOKUP: tl.constexpr):
    """What a program holds of the table for its lookups: the pointer (GATHER, PAIR), 16 scalars (SELECT) or a
    [16] tensor (REGISTER)."""
    if LOOKUP == 1:
        return (tl.load(code_ptr + 0), tl.load(code_ptr + 1), tl.load(code_ptr + 2), tl.load(code_ptr + 3),
                tl.load(code_ptr + 4), tl.load(code_ptr + 5), tl.load(code_ptr + 6), tl.load(code_ptr + 7),
                tl.load(code_ptr + 8), tl.load(code_ptr + 9), tl.load(code_ptr + 10), tl.load(code_ptr + 11),
                tl.load(code_ptr + 12), tl.load(code_ptr + 13), tl.load(code_ptr + 14), tl.load(code_ptr + 15))
    elif LOOKUP == 2:
        return tl.load(code_ptr + tl.arange(0, 16))
    else:
        return code_ptr


@triton.jit
def _select16(byte, t, SHIFT: tl.constexpr):
    """t[(byte >> SHIFT) & 15] of the 16-tuple t, by the nibble's bits (lowest first)."""
    b = (byte & (1 << SHIFT)) != 0
    v0 = tl.where(b, t[1], t[0])
    v1 = tl.where(b, t[3], t[2])
    v2 = tl.where(b, t[5], t[4])
    v3 = tl.where(b, t[7], t[6])
    v4 = tl.where(b, t[9], t[8])
    v5 = tl.where(b, t[11], t[10])
    v6 = tl.where(b, t[13], t[12])
    v7 = tl.where(b, t[15], t[14])
    b = (byte & (2 << SHIFT)) != 0
    u0 = tl.where(b, v1, v0)
    u1 = tl.where(b, v3, v2)
    u2 = tl.where(b, v5, v4)
    u3 = tl.where(b, v7, v6)
    b = (byte & (4 << SHIFT)) != 0
    w0 = tl.where(b, u1, u0)
    w1 = tl.where(b, u3, u2)
    return tl.where((byte & (8 << SHIFT)) != 0, w1, w0)


@triton.jit
def _level(nibble, table, LOOKUP: tl.constexpr):
    """code[nibble] as fp32 (int32 nibbles of any shape; GATHER, SELECT or REGISTER)."""
    if LOOKUP == 1:
        return _select16(nibble, table, 0)
    elif LOOKUP == 2:
        flat = tl.reshape(nibble, (nibble.numel,))
        return tl.reshape(tl.gather(table, flat, 0), nibble.shape)
    else:
        return tl.load(table + nibble)


@triton.jit
def _levels_of_bytes(byte, table, LOOKUP: tl.constexpr):
    """(code[byte >> 4], code[byte & 15]) as fp32 for int32 bytes of any shape."""
    if LOOKUP == 3:
        pair = tl.load(table + byte)  # little-endian: the even level in the low 32 bits
        return pair.to(tl.int32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif LOOKUP == 1:
        return _select16(byte, table, 4), _select16(byte, table, 0)
    else:
        return _level(byte >> 4, table, LOOKUP), _level(byte & 0xF, table, LOOKUP)


@triton.jit
def decode(packed, table, LOOKUP: tl.constexpr, WORDS: tl.constexpr):
    """The fp32 levels of the weight's even and odd columns, each [rows, BK/2], from a step's packed tile: [rows,
    BK/2] uint8 bytes (element 2i in byte i's high nibble, 2i+1 in its low one), or with WORDS [rows, BK/8] int32
    words (little-endian: byte i of word q is byte 4q + i, bits 8i..8i+7). `table` is what `levels` returned (PAIR:
    the `pair_table` pointer)."""
    if WORDS:
        rows: tl.constexpr = packed.shape[0]
        half: tl.constexpr = packed.shape[1] * 4
        byte = (packed[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
        even, odd = _levels_of_bytes(byte, table, LOOKUP)
        return tl.reshape(even, (rows, half)), tl.reshape(odd, (rows, half))
    else:
        return _levels_of_bytes(packed.to(tl.int32), table, LOOKUP)
