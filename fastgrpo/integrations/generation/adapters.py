"""LoRA adapters while the rollout engine decodes: merged into their base weights, or else in the compute dtype.

`MergedAdapters` (below) folds each plain LoRA linear into one weight for the duration of a call (in place and
restored bit-exact, or in a copy). What it leaves (DoRA, bias LoRA, non-Linear bases, quantized bases unless asked)
runs PEFT's own forward with `CompactAdapters`:

PEFT keeps adapter weights in fp32 beside a bf16 base and casts the input up to them, so with autocast off (the
engine's setting) every LoRA product of a decode step is an fp32 GEMM. Training runs the same products under bf16
autocast. While the engine decodes, each fp32 adapter weight whose base layer computes in a narrower dtype is swapped
for a copy in that dtype, refreshed from the trained weight at every call (one batched copy): the products then run
as autocast runs them, and a captured decode step keeps reading the same copies across calls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from fastgrpo.integrations.generation.joined import JoinedProjections, joinable_groups


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
        self.version = 0  # bumped when the copies are new tensors (graphs that read the old ones are stale)

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
            self.version += 1

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


# ---- merged adapters ---------------------------------------------------------------------------------------------

MERGE_MODES = ("float", "all", "none")
# Merged q, k and v decode as one GEMM over a joined copy (`joined.py`). `python bench/bench_generation.py
# --join-qkv 0` times the rollouts without it.
JOIN_QKV = True


def check_merge_mode(mode: str) -> str:
    if mode not in MERGE_MODES:
        raise ValueError(f"merge_lora must be one of {MERGE_MODES}, got {mode!r}")
    return mode


def _is_quantized(weight) -> bool:
    """A bitsandbytes 4-bit or 8-bit parameter."""
    return type(weight).__name__ in ("Params4bit", "Int8Params")


def _adapter_device(layer: nn.Module) -> torch.device:
    return layer.lora_A[next(iter(layer.lora_A))].weight.device


def _merge_obstacle(layer: nn.Module, quantized: bool) -> str | None:
    """Why this LoRA layer's adapters cannot be folded into a copy of its base weight (None: they can)."""
    base = layer.base_layer
    weight = getattr(base, "weight", None)
    if _is_quantized(weight):
        if not quantized:
            return "quantized base (merge_lora='all' merges it into a bf16 copy)"
    elif type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not nn.Linear"
    elif not weight.is_floating_point():
        return f"base weight of dtype {weight.dtype}"
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name):
            return "a LoRA variant (DoRA, ...) whose merge is not a weight sum"
        if layer.lora_B[name].bias is not None:
            return "LoRA with a bias"
    return None


def _is_lora_linear(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "get_delta_weight")
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict))


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits, by its size in bytes


class MergeNotUndone(RuntimeError):
    """An in-place LoRA merge did not give the base weight its exact bits back."""


@dataclass
class _Merge:
    parent: nn.Module
    name: str
    layer: nn.Module  # the LoRA layer, put back afterwards
    linear: nn.Linear  # what decodes in its place: the base layer itself (in place) or a linear over a copy
    in_place: bool = False  # the base weight itself holds the merged values during the call
    fixes: tuple | None = None  # in place, while merged: (flat indices, original values) the undo would miss
    checksum: torch.Tensor | None = None  # in place, while merged: the sum of the original weight's bits


class MergedAdapters:
    """LoRA linears replaced, while the engine decodes, by plain linears whose weight is base + the active adapters'
    deltas (PEFT's `get_delta_weight`), rounded once to the base's compute dtype. A decode step then runs one GEMM a
    projection, as a sampler given merged weights does (TRL's vLLM path merges the adapters too); the trainer adds
    the two in its own order, so sampler and trainer log-probs differ by rounding (logged as the sampler agreement).

    Where the merged weight lives:
    - in place, for a frozen floating-point base weight no other module shares: W <- round(W + delta) for the call,
      then W <- round(merged - delta), the same delta computed again (the same deterministic ops on the same
      inputs). That undo is W itself except where W + delta rounded across a power of two; those elements (found
      at merge time, when W is known, by comparing bits) and their values are kept and written back. So the base
      gets its exact bits back with no copy of it anywhere, for a few passes over the weights a call;
    - in a persistent device copy, refreshed per call, for a trained or shared base and, with mode "all", a
      bitsandbytes-quantized base (dequantized into the copy: bf16 memory for those weights while the engine lives);
    - in a joined copy for an attention's q, k and v that all merge (`joined.py`, while `JOIN_QKV`): one GEMM for
      the three.

    Args:
        mode: "float" merges layers with a floating-point base; "all" also quantized bases; "none" merges nothing.
    """

    def __init__(self, mode: str = "float"):
        self.mode = check_merge_mode(mode)
        self._entries: list[_Merge] = []
        self._key: tuple = ()
        self.not_merged: dict[str, int] = {}  # reason -> LoRA layers left to the adapters' own forward
        self.version = 0  # bumped when the decoding weights are new tensors (graphs that read the old ones are stale)

    @property
    def copies(self) -> list[torch.Tensor]:
        """The device copies held (weights merged out of place; a joined group's weight once)."""
        copies = {}
        for e in self._entries:
            if e.linear is not e.layer.base_layer:
                weight = e.linear.joined.weight if hasattr(e.linear, "joined") else e.linear.weight
                copies[id(weight)] = weight
        return list(copies.values())

    @property
    def joined_groups(self) -> int:
        """Groups of projections decoding as one GEMM (`joined.py`)."""
        return len({id(e.linear.joined) for e in self._entries if hasattr(e.linear, "joined")})

    def release(self) -> None:
        self._entries, self._key = [], ()
        self.version += 1

    def _targets(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        targets, not_merged = [], {}
        for parent in model.modules():
            for name, child in parent._modules.items():
                if child is None or not _is_lora_linear(child) or child.disable_adapters or child.merged:
                    continue
                if not any(a in child.lora_A for a in child.active_adapters):
                    continue
                reason = _merge_obstacle(child, quantized=self.mode == "all")
                if reason is None:
                    targets.append((parent, name, child))
                else:
                    not_merged[reason] = not_merged.get(reason, 0) + 1
        self.not_merged = not_merged
        return targets

    @staticmethod
    def _copy_dtype(layer: nn.Module) -> torch.dtype:
        """The dtype a merged copy of this layer's weight takes: the base's (a quantized base's compute dtype)."""
        base = layer.base_layer
        weight = base.weight
        return (getattr(base, "compute_dtype", None) or torch.bfloat16) if _is_quantized(weight) else weight.dtype

    @classmethod
    def _copy_linear(cls, layer: nn.Module) -> nn.Linear:
        base = layer.base_layer
        dtype = cls._copy_dtype(layer)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype,
                                                 device=_adapter_device(layer)), requires_grad=False)
        linear.bias = base.bias
        return linear

    def _entry(self, parent: nn.Module, name: str, layer: nn.Module, shared: set[int]) -> _Merge:
        base = layer.base_layer
        weight = base.weight
        in_place = (type(base) is nn.Linear and type(weight) is nn.Parameter and not weight.requires_grad
                    and weight.data_ptr() not in shared and weight.element_size() in _BITS and weight.is_contiguous())
        if not in_place:
            return _Merge(parent, name, layer, self._copy_linear(layer))
        return _Merge(parent, name, layer, base, in_place=True)

    @staticmethod
    def _delta(layer: nn.Module) -> torch.Tensor:
        """The active adapters' summed delta in fp32, computed the same way at merge and undo (autocast off)."""
        total = None
        with torch.autocast(_adapter_device(layer).type, enabled=False):
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    delta = layer.get_delta_weight(name).to(torch.float32)
                    total = delta if total is None else total + delta
        return total

    @torch.no_grad()
    def _merge(self) -> None:
        from peft.utils.integrations import dequantize_module_weight

        for e in self._entries:
            delta = self._delta(e.layer)
            if not e.in_place:
                base = dequantize_module_weight(e.layer.base_layer).to(torch.float32)
                target = e.linear.merge_weight if hasattr(e.linear, "joined") else e.linear.weight
                target.copy_(base + delta)
                if getattr(e.linear, "merge_bias", None) is not None:
                    e.linear.merge_bias.copy_(e.layer.base_layer.bias)
                continue
            weight = e.linear.weight
            merged = (weight.to(torch.float32) + delta).to(weight.dtype)
            undone = (merged.to(torch.float32) - delta).to(weight.dtype)
            bits = _BITS[weight.element_size()]
            missed = torch.nonzero(undone.view(bits).ne(weight.view(bits)).view(-1))[:, 0]
            e.fixes = (missed, weight.view(-1)[missed].clone())
            e.checksum = weight.view(bits).sum(dtype=torch.int64)
            weight.copy_(merged)

    @torch.no_grad()
    def _restore(self) -> None:
        """Undo the in-place merges; then check every undone weight's bit sum against the original's (one host sync):
        a delta that came out differently the second time would otherwise leave the base silently changed."""
        undone = []
        for e in self._entries:
            if e.fixes is None:
                continue
            weight = e.linear.weight
            weight.copy_((weight.to(torch.float32) - self._delta(e.layer)).to(weight.dtype))
            missed, values = e.fixes
            weight.view(-1)[missed] = values
            e.fixes = None
            undone.append((e, weight.view(_BITS[weight.element_size()]).sum(dtype=torch.int64)))
        if not undone:
            return
        same = torch.stack([e.checksum == now for e, now in undone]).cpu()
        for (e, _), ok in zip(undone, same.tolist()):
            e.checksum = None
            if not ok:
                raise MergeNotUndone(
                    f"fastgrpo: the rollout's LoRA merge into {type(e.layer).__name__} '{e.name}' did not undo to the "
                    "exact base weight (its delta computed twice differed). Decode with the adapters unmerged: "
                    "EmbeddedGenerator(merge_lora='none') / fastgrpo_generation_merge_lora='none'."
                )

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        if self.mode == "none":
            self.not_merged = {}
            yield 0
            return
        targets = self._targets(model)
        key = tuple((id(parent), name, id(layer), id(layer.base_layer.weight), tuple(layer.active_adapters))
                    for parent, name, layer in targets)
        if key != self._key:
            counts: dict[int, int] = {}
            tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            for _, tensor in tensors:
                counts[tensor.data_ptr()] = counts.get(tensor.data_ptr(), 0) + 1
            shared = {ptr for ptr, n in counts.items() if n > 1}
            self._entries = []  # the old copies go before the new are allocated
            joined = {}
            for group in joinable_groups(targets, self._copy_dtype) if JOIN_QKV else []:
                layers = [layer for _, _, layer in group]
                projections = JoinedProjections([layer.out_features for layer in layers], layers[0].in_features,
                                                self._copy_dtype(layers[0]), _adapter_device(layers[0]),
                                                bias=layers[0].base_layer.bias is not None)
                for (parent, name, layer), piece in zip(group, projections.slices()):
                    joined[id(layer)] = _Merge(parent, name, layer, piece)
            self._entries = [joined.get(id(layer)) or self._entry(parent, name, layer, shared)
                             for parent, name, layer in targets]
            self._key = key
            self.version += 1
        try:
            self._merge()
            for e in self._entries:
                e.parent._modules[e.name] = e.linear
            yield len(self._entries)
        finally:
            for e in self._entries:
                e.parent._modules[e.name] = e.layer
            self._restore()
