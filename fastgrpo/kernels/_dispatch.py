"""Which implementation a fastgrpo op runs, and the input checks every op shares.

CUDA tensors go to the Triton kernels; CPU tensors go to the torch implementation
with the same save/recompute contract. Tests run the Triton kernels on CPU tensors
through Triton's interpreter inside `triton_on_cpu()`.
"""
import contextlib
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_triton_on_cpu = False


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _triton_on_cpu


@contextlib.contextmanager
def triton_on_cpu():
    """Route CPU tensors to the Triton kernels, run by Triton's interpreter (for tests)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    global _triton_on_cpu
    previous, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = previous


def check_dtype(op: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fastgrpo::{op} supports float32, float16 and bfloat16 inputs, got {t.dtype}; "
            f"cast the input (e.g. .to(torch.bfloat16)) or leave this site to inductor"
        )
