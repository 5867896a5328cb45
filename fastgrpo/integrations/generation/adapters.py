"""LoRA adapters in the compute dtype while the rollout engine decodes.

PEFT keeps adapter weights in fp32 beside a bf16 base and casts the input up to them, so with autocast off (the
engine's setting) every LoRA product of a decode step is an fp32 GEMM. Training runs the same products under bf16
autocast. While the engine decodes, each fp32 adapter weight whose base layer computes in a narrower dtype is swapped
for a copy in that dtype, refreshed from the trained weight at every call (one batched copy): the products then run
as autocast runs them, and a captured decode step keeps reading the same copies across calls.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def _base_compute_dtype(layer: nn.Module) -> torch.dtype | None:
    base = getattr(layer, "base_layer", None)
    if base is None:
        return None
    dtype = getattr(base, "compute_dtype", None)  # bitsandbytes 4-bit layers compute in this dtype
    if dtype is None:
        weight = getattr(base, "weight", None)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


class CompactAdapters:
    """Compute-dtype copies of a model's fp32 LoRA factors, swapped in for the duration of `swapped()`."""

    def __init__(self):
        self._entries: list[tuple[nn.Module, nn.Parameter, nn.Parameter]] = []  # (linear, trained, copy)
        self._key: tuple = ()

    def _build(self, model: nn.Module) -> None:
        entries = []
        for layer in model.modules():
            dtype = _base_compute_dtype(layer)
            if dtype is None:
                continue
            for factors in (getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)):
                if not isinstance(factors, nn.ModuleDict):
                    continue
                for linear in factors.values():
                    weight = getattr(linear, "weight", None)
                    if isinstance(weight, nn.Parameter) and weight.dtype == torch.float32:
                        copy = nn.Parameter(torch.empty_like(weight, dtype=dtype), requires_grad=False)
                        entries.append((linear, weight, copy))
        key = tuple(id(weight) for _, weight, _ in entries)
        if key != self._key:
            self._entries, self._key = entries, key

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        self._build(model)
        if not self._entries:
            yield 0
            return
        with torch.no_grad():
            torch._foreach_copy_([copy for _, _, copy in self._entries], [weight for _, weight, _ in self._entries])
        for linear, _, copy in self._entries:
            linear._parameters["weight"] = copy
        try:
            yield len(self._entries)
        finally:
            for linear, weight, _ in self._entries:
                linear._parameters["weight"] = weight
