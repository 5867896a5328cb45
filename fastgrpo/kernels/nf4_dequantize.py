"""A bitsandbytes 4-bit weight dequantized with its LoRA delta merged, in one bandwidth-bound pass, for decode steps.

`nf4_dequantize(packed, absmax, code, *, shape=(N, K), blocksize=64, nested_absmax=, nested_code=, offset=,
nested_blocksize=256, lora_a=None, lora_b=None, scaling=1.0, dtype=torch.bfloat16) -> W [N, K]`:

    W[n, k] = round_dtype(code[c(n, k)] * scale(n, k) + scaling * (lora_b @ lora_a)[n, k])

the 4-bit layout and block scales as `fastgrpo.kernels.nf4_lora_linear` reads them (its `quant_state_args` gives the
quantization arguments; `pairs` and `code_values` are not used here). The LoRA product takes A and B rounded to the
dtype on CUDA (as autocast runs PEFT's fp32 adapters), fp32 in the interpreter; one rounding of the sum. Without LoRA,
W is bit-exact with `bitsandbytes.functional.dequantize_4bit`.

A decode step of few rows then runs one GEMM over W: each weight element is dequantized by a thread that owns it, with
no operand layout to build, where `nf4_lora_linear` dequantizes in the tensor-core operand's layout (~20x its memory
floor at 8 rows). Triton path: one program a [BN, BK] tile (BK divides the blocksize: one block scale a row), the two
nibbles' codes set side by side and stored as [BN, BK]. Out of the kernel's domain (K not a multiple of the blocksize,
r > MAX_RANK, a CPU tensor outside the interpreter) the op runs the torch reference, the same maths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import cdiv, launch_like_cuda, next_power_of_2
from fastgrpo.kernels.nf4_lora_linear import _block_scale, _dequantize, _step_loads, checked_quantization, \
    kernel_obstacle

_BLOCK_N = 64
_NUM_WARPS = 4


@triton.jit
def _nf4_dequantize_kernel(
    w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, a_ptr, b_ptr, out_ptr,
    N, K, RANK, scaling, sar, sak, sbn, sbr,
    BN: tl.constexpr, BK: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
    R_PAD: tl.constexpr, NESTED: tl.constexpr, LORA: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BK
    rn = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, BK // 2)
    n_ok = rn < N
    rows = rn.to(tl.int64)
    packed, stat, nested = _step_loads(w_ptr + rows[:, None] * (K // 2), absmax_ptr, absmax2_ptr,
                                       rows * (K // BLOCKSIZE), j, n_ok, k0, K, BLOCKSIZE, NESTED_BLOCKSIZE, NESTED,
                                       True)
    if NESTED:
        offset = tl.load(offset_ptr).to(tl.float32)
    else:
        offset = 0.0  # (not read: `_block_scale` takes it when NESTED)
    scale = _block_scale(stat, nested, code2_ptr, offset, NESTED)
    w_even = tl.load(code_ptr + (packed >> 4).to(tl.int32)) * scale[:, None]
    w_odd = tl.load(code_ptr + (packed & 0xF).to(tl.int32)) * scale[:, None]
    if LORA:
        rr = tl.arange(0, R_PAD)
        r_ok = rr < RANK
        b = tl.load(b_ptr + rn[:, None] * sbn + rr[None, :] * sbr, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        a_cols = a_ptr + rr[:, None] * sar + (k0 + 2 * j)[None, :] * sak
        a_even = tl.load(a_cols, mask=r_ok[:, None], other=0.0)
        a_odd = tl.load(a_cols + sak, mask=r_ok[:, None], other=0.0)
        if NATIVE:
            b = b.to(out_ptr.dtype.element_ty)
            a_even = a_even.to(out_ptr.dtype.element_ty)
            a_odd = a_odd.to(out_ptr.dtype.element_ty)
        else:
            b = b.to(tl.float32)
            a_even = a_even.to(tl.float32)
            a_odd = a_odd.to(tl.float32)
        w_even += scaling * tl.dot(b, a_even, input_precision=PRECISION)
        w_odd += scaling * tl.dot(b, a_odd, input_precision=PRECISION)
    w = tl.reshape(tl.join(w_even, w_odd), (BN, BK))  # columns 2j, 2j + 1 side by side
    kk = tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * K + (k0 + kk)[None, :], w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


def _triton_nf4_dequantize(packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                           n, k, lora_a, lora_b, scaling, dtype):
    out = torch.empty(n, k, device=packed.device, dtype=dtype)
    cuda = launch_like_cuda(packed)
    native = cuda and dtype != torch.float32
    bk = min(blocksize, 128)
    nested = nested_absmax is not None
    lora = lora_a is not None
    rank = lora_a.shape[0] if lora else 0
    grid = (cdiv(n, _BLOCK_N), k // bk)
    _nf4_dequantize_kernel[grid](
        packed, absmax, code, nested_absmax if nested else absmax, nested_code if nested else code,
        offset if nested else code, lora_a if lora else code, lora_b if lora else code, out,
        n, k, rank, float(scaling), lora_a.stride(0) if lora else 0, lora_a.stride(1) if lora else 0,
        lora_b.stride(0) if lora else 0, lora_b.stride(1) if lora else 0,
        BN=_BLOCK_N, BK=bk, BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize,
        R_PAD=max(16, next_power_of_2(rank)), NESTED=nested, LORA=lora, NATIVE=native,
        PRECISION=None if native else "ieee", num_warps=_NUM_WARPS if cuda else 1,
    )  # fmt: skip
    return out


def reference_nf4_dequantize(packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                             n, k, lora_a, lora_b, scaling, dtype):
    """The op's maths in plain torch (fp32, one rounding to dtype at the end)."""
    w = _dequantize(packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, (n, k))
    if lora_a is not None:
        w = w + scaling * (lora_b.float() @ lora_a.float())
    return w.to(dtype)


@torch.library.custom_op("fastgrpo::nf4_dequantize", mutates_args=())
def _nf4_dequantize_op(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                       nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                       offset: torch.Tensor | None, blocksize: int, nested_blocksize: int, n: int, k: int,
                       lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scaling: float,
                       dtype: torch.dtype) -> torch.Tensor:
    args = (packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, n, k, lora_a,
            lora_b, scaling, dtype)
    if kernel_obstacle(packed, blocksize, k, 0 if lora_a is None else lora_a.shape[0]) is None:
        return _triton_nf4_dequantize(*args)
    return reference_nf4_dequantize(*args)


@_nf4_dequantize_op.register_fake
def _(packed, absmax, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, n, k, lora_a, lora_b,
      scaling, dtype):
    return packed.new_empty(n, k, dtype=dtype)


def nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, *, shape: tuple[int, int],
                   blocksize: int = 64, nested_absmax: torch.Tensor | None = None,
                   nested_code: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                   nested_blocksize: int = 256, lora_a: torch.Tensor | None = None,
                   lora_b: torch.Tensor | None = None, scaling: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                   pairs: torch.Tensor | None = None, code_values=None) -> torch.Tensor:
    """See the module docstring (`pairs` and `code_values`, from `quant_state_args`, are taken and not used). For
    sampling only: no autograd."""
    del pairs, code_values
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fastgrpo::nf4_dequantize writes float32, float16 or bfloat16, not {dtype}")
    n, k = (int(s) for s in shape)
    flat, absmax, code, nested_absmax, nested_code, offset = checked_quantization(
        packed, absmax, code, n, k, blocksize, nested_absmax, nested_code, offset, nested_blocksize, lora_a, lora_b)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (lora_a, lora_b)):
        raise RuntimeError("fastgrpo nf4_dequantize has no backward (it samples): call it under torch.no_grad()")
    return _nf4_dequantize_op(flat, absmax, code, nested_absmax, nested_code, offset, int(blocksize),
                              int(nested_blocksize), n, k, lora_a, lora_b, float(scaling), dtype)
