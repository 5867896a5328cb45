"""LoRA adapters while the rollout engine decodes: merged into their base weights, read by the 4-bit kernel with a
QLoRA base, or else in the compute dtype.

`MergedAdapters` (below) folds each plain LoRA linear, and each LoRA on an MoE layer's fused experts (experts.py),
into one weight for the duration of a call (in place and restored bit-exact, or in a copy); in its default mode it
decodes each plain LoRA linear over a bitsandbytes 4-bit base through `fastgrpo::nf4_lora_linear` instead (the
packed weight and the adapters read where they live). What it leaves (DoRA, bias LoRA, other non-Linear bases, 4-bit
bases the kernel does not take, 8-bit bases) runs PEFT's own forward with `CompactAdapters`:

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

from fastgrpo.integrations.generation.experts import expert_lora_chain, expert_lora_obstacle, is_expert_lora
from fastgrpo.integrations.generation.four_bit import GROUP_NAMES, FourBitGroup, FourBitLoRALinear, \
    active_adapters, adapter_obstacle, four_bit_key, four_bit_obstacle, group_obstacle, lora_factors
from fastgrpo.integrations.generation.joined import JoinedProjections, JoinedSlice, joinable_groups, sibling_groups
from fastgrpo.kernels.lora_merge import STATS, lora_merge_, lora_merge_factors, lora_merge_into, lora_merge_plan, \
    lora_merge_restored, lora_unmerge_


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
# 4-bit q/k/v and gate/up decode as one grouped launch each (`four_bit.FourBitGroup`) when True. Off until a GPU has
# run it (its GPU tests and the QLoRA whole step's A/B:
# `QLORA_AB="fastgrpo.integrations.generation.adapters.GROUP_FOUR_BIT=1;" bash bench/device_session.sh qlora_ab`):
# an earlier grouped form passed the CPU tests and was refused by the engine's first-call check on the 1.5B shape.
GROUP_FOUR_BIT = False
# Merges of plain LoRA over bf16/fp16/fp32 bases run `fastgrpo.kernels.lora_merge` (one pass a weight, the delta never
# in memory); False runs PEFT's delta and torch's passes for them too (the A/B of `python bench/bench_generation.py
# --shape llama-3.1-8b --cases 64x512 --generations 8 --merge-kernel 0`).
MERGE_KERNEL = True


def check_merge_mode(mode: str) -> str:
    if mode not in MERGE_MODES:
        raise ValueError(f"merge_lora must be one of {MERGE_MODES}, got {mode!r}")
    return mode


def _is_quantized(weight) -> bool:
    """A bitsandbytes 4-bit or 8-bit parameter."""
    return type(weight).__name__ in ("Params4bit", "Int8Params")


def _adapter_device(layer: nn.Module) -> torch.device:
    return layer.lora_A[next(iter(layer.lora_A))].weight.device


def _obstacle(layer: nn.Module, mode: str) -> tuple[str | None, bool]:
    """(why this LoRA layer decodes through PEFT's forward, None where it does not; whether it decodes through the
    4-bit kernel rather than a merged weight). Mode "float" takes 4-bit bases to the kernel; "all" merges every
    quantized base into a copy."""
    if is_expert_lora(layer):  # a LoRA on an MoE layer's fused experts: merged into them in place, or not at all
        return adapter_obstacle(layer) or expert_lora_obstacle(layer), False
    base = layer.base_layer
    weight = getattr(base, "weight", None)
    if _is_quantized(weight):
        why = adapter_obstacle(layer)
        if why is None and mode != "all":
            return four_bit_obstacle(layer), True
        return why, False
    if type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not nn.Linear", False
    if not weight.is_floating_point():
        return f"base weight of dtype {weight.dtype}", False
    return adapter_obstacle(layer), False


def _merged_tensors(layer: nn.Module) -> tuple:
    """Ids of the tensors a LoRA layer's merge writes or reads as its base: another tensor means new entries."""
    if is_expert_lora(layer):
        chain, module = expert_lora_chain(layer)
        return tuple(id(getattr(module, wrapper.parameter_name)) for wrapper in chain)
    return (id(layer.base_layer.weight),)


def _is_lora_linear(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "get_delta_weight")
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict))


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits, by its size in bytes


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """A checksum of t's bits: the wrapping sum of its bytes read as 8-byte words where they are whole words (one read
    of t), else of its elements widened to int64 (a widened copy first: ~9x the bytes)."""
    size = t.element_size()
    if t.is_contiguous() and (t.numel() * size) % 8 == 0 and (t.storage_offset() * size) % 8 == 0:
        return t.reshape(-1).view(torch.int64).sum()
    return t.view(_BITS[size]).sum(dtype=torch.int64)


class MergeNotUndone(RuntimeError):
    """An in-place LoRA merge did not give the base weight its exact bits back."""


def _in_four_bit_group(linear: nn.Module) -> bool:
    return isinstance(linear, JoinedSlice) and isinstance(linear.joined, FourBitGroup)


@dataclass
class _Merge:
    parent: nn.Module
    name: str
    layer: nn.Module  # the LoRA layer, put back afterwards
    linear: nn.Module  # what decodes in its place: the base (in place), a linear over a copy, a FourBitLoRALinear
    in_place: bool = False  # the base weight itself holds the merged values during the call
    param: torch.Tensor | None = None  # in place: the tensor merged (a linear's weight, or an experts parameter)
    fixes: tuple | None = None  # in place, while merged: (flat indices, original values) the undo would miss
    checksum: torch.Tensor | None = None  # in place, while merged: the sum of the original weight's bits
    stats: torch.Tensor | None = None  # in place through the merge kernel, while merged: its STATS counters


class MergedAdapters:
    """LoRA linears replaced, while the engine decodes, by plain linears whose weight is base + the active adapters'
    deltas (PEFT's `get_delta_weight`), rounded once to the base's compute dtype. A decode step then runs one GEMM a
    projection, as a sampler given merged weights does (TRL's vLLM path merges the adapters too); the trainer adds
    the two in its own order, so sampler and trainer log-probs differ by rounding (logged as the sampler agreement).
    A LoRA linear over a bitsandbytes 4-bit base (QLoRA) is replaced, in mode "float", by a `FourBitLoRALinear`
    instead: one `fastgrpo::nf4_lora_linear` launch reads the packed 4-bit weight and adds the LoRA product, with no
    dequantized copy (where the kernel runs: CUDA tensors, or Triton's interpreter).

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

    Every LoRA layer with active adapters is counted once after `swapped()` enters: `merged_layers` (merged
    weights), `nf4_layers` (the 4-bit kernel), `not_merged` (reason -> layers left to PEFT's own forward).

    Args:
        mode: "float" merges layers with a floating-point base and decodes those with a 4-bit base through the 4-bit
            kernel; "all" merges quantized bases too (into bf16 copies); "none" swaps nothing (PEFT's forward).
    """

    def __init__(self, mode: str = "float"):
        self.mode = check_merge_mode(mode)
        self._entries: list[_Merge] = []
        self._key: tuple = ()
        self.not_merged: dict[str, int] = {}  # reason -> LoRA layers left to the adapters' own forward
        self.merged_layers = 0  # LoRA layers decoding from merged weights
        self.nf4_layers = 0  # LoRA layers decoding through fastgrpo::nf4_lora_linear (4-bit bases, mode "float")
        self.nf4_groups = 0  # groups of them decoding as one launch (`FourBitGroup`)
        self.ungrouped: dict[str, int] = {}  # reason -> 4-bit layers of a sibling group decoding one launch each
        self.version = 0  # bumped when the decoding weights are new tensors (graphs that read the old ones are stale)

    @property
    def copies(self) -> list[torch.Tensor]:
        """The device copies held (weights merged out of place; a joined group's weight once)."""
        copies = {}
        for e in self._entries:
            if isinstance(e.linear, FourBitLoRALinear) or e.in_place or _in_four_bit_group(e.linear):
                continue
            weight = e.linear.joined.weight if isinstance(e.linear, JoinedSlice) else e.linear.weight
            copies[id(weight)] = weight
        return list(copies.values())

    @property
    def joined_groups(self) -> int:
        """Groups of projections decoding as one GEMM (`joined.py`)."""
        return len({id(e.linear.joined) for e in self._entries
                    if isinstance(e.linear, JoinedSlice) and not _in_four_bit_group(e.linear)})

    def release(self) -> None:
        self._entries, self._key = [], ()
        self.version += 1

    def _targets(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, bool]]:
        """(parent, name, LoRA layer, whether it decodes through the 4-bit kernel) of the layers swapped; counts."""
        targets, not_merged = [], {}
        for parent in model.modules():
            if is_expert_lora(parent):  # an inner wrapper of a chain: its outermost stands for it
                continue
            for name, child in parent._modules.items():
                if child is None or not _is_lora_linear(child) or child.disable_adapters or child.merged:
                    continue
                if not active_adapters(child):
                    continue
                reason, four_bit = _obstacle(child, self.mode)
                if reason is None:
                    targets.append((parent, name, child, four_bit))
                else:
                    not_merged[reason] = not_merged.get(reason, 0) + 1
        self.not_merged = not_merged
        self.nf4_layers = sum(t[3] for t in targets)
        self.merged_layers = sum(len(expert_lora_chain(t[2])[0]) or 1 for t in targets if not t[3])
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

    def _entries_of(self, parent: nn.Module, name: str, layer: nn.Module, four_bit: bool,
                    shared: set[int]) -> list[_Merge]:
        if four_bit:
            return [_Merge(parent, name, layer, FourBitLoRALinear(layer))]
        if is_expert_lora(layer):  # each wrapper's parameter merged in place; the outermost swapped for the module
            chain, module = expert_lora_chain(layer)
            return [_Merge(parent if i == 0 else None, name, wrapper, module, in_place=True,
                           param=getattr(module, wrapper.parameter_name)) for i, wrapper in enumerate(chain)]
        base = layer.base_layer
        weight = base.weight
        in_place = (type(base) is nn.Linear and type(weight) is nn.Parameter and not weight.requires_grad
                    and weight.data_ptr() not in shared and weight.element_size() in _BITS and weight.is_contiguous())
        if not in_place:
            return [_Merge(parent, name, layer, self._copy_linear(layer))]
        return [_Merge(parent, name, layer, base, in_place=True, param=weight)]

    @staticmethod
    def _delta(layer: nn.Module) -> torch.Tensor:
        """The active adapters' summed delta in fp32 (PEFT's `get_delta_weight`), computed the same way at merge and
        undo (autocast off): the merge of the layers `_factors` does not take."""
        total = None
        with torch.autocast(_adapter_device(layer).type, enabled=False):
            for name in active_adapters(layer):
                delta = layer.get_delta_weight(name).to(torch.float32)
                total = delta if total is None else total + delta
        return total

    @staticmethod
    def _factors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp32 factors (a, b) with b @ a the active adapters' summed delta, for `fastgrpo.kernels.lora_merge`
        (one pass over the weight, no delta in memory); None for a layer it does not take (and with MERGE_KERNEL
        off): the LoRA of an MoE layer's experts, a quantized base, a base dtype other than bf16/fp16/fp32, a
        transposed (fan-in-fan-out) weight."""
        if not MERGE_KERNEL or is_expert_lora(layer) or getattr(layer, "fan_in_fan_out", False):
            return None
        weight = layer.base_layer.weight
        if _is_quantized(weight) or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return None
        return lora_merge_factors(*lora_factors(layer))

    @torch.no_grad()
    def _merge(self) -> None:
        from peft.utils.integrations import dequantize_module_weight

        planned = []  # in-place kernel merges: (entry, factors), once their misses are counted
        for e in self._entries:
            if isinstance(e.linear, FourBitLoRALinear):
                e.linear.refresh()
                continue
            if _in_four_bit_group(e.linear):
                if e.linear.index == 0:
                    e.linear.joined.refresh()
                continue
            factors = self._factors(e.layer)
            if not e.in_place:
                target, bias = (e.linear.joined.rows(e.linear.index) if isinstance(e.linear, JoinedSlice)
                                else (e.linear.weight, None))
                if factors is not None:
                    lora_merge_into(target, e.layer.base_layer.weight, *factors)
                else:
                    target.copy_(dequantize_module_weight(e.layer.base_layer).to(torch.float32) + self._delta(e.layer))
                if bias is not None:  # a joined projection's rows of the bias
                    bias.copy_(e.layer.base_layer.bias)
                continue  # (a copy linear shares the base's bias)
            if factors is not None:
                e.stats = torch.zeros(STATS, dtype=torch.int64, device=e.param.device)
                lora_merge_plan(e.param, *factors, e.stats)
                planned.append((e, factors))
                continue
            # fp32 maths rounded once into the weight's dtype, one pass each; the elements the undo misses found
            # by comparing bits, and kept.
            weight = e.param
            delta = self._delta(e.layer)
            merged = torch.add(weight, delta, out=torch.empty_like(weight))
            undone = torch.sub(merged, delta, out=torch.empty_like(weight))
            bits = _BITS[weight.element_size()]
            missed = torch.nonzero(undone.view(bits).ne(weight.view(bits)).view(-1))[:, 0]
            del undone
            e.fixes = (missed, weight.view(-1)[missed].clone())
            e.checksum = _bit_sum(weight)
            weight.copy_(merged)
        if not planned:
            return
        counts = torch.stack([e.stats[0] for e, _ in planned]).tolist()  # one host sync for every weight
        for (e, factors), count in zip(planned, counts):
            weight = e.param
            fixes = (torch.empty(count, dtype=torch.int64, device=weight.device),
                     torch.empty(count, dtype=weight.dtype, device=weight.device))
            lora_merge_(weight, *factors, e.stats, *fixes)
            e.fixes = fixes  # merged: the undo takes it back

    @torch.no_grad()
    def _restore(self) -> None:
        """Undo the in-place merges; then check every undone weight's bit sum against the original's (one host sync):
        a delta that came out differently the second time would otherwise leave the base silently changed."""
        undone = []
        for e in self._entries:
            if e.fixes is None:
                continue
            weight = e.param
            missed, values = e.fixes
            factors = self._factors(e.layer) if e.stats is not None else None
            if factors is not None:
                lora_unmerge_(weight, *factors, e.stats)
                same = lora_merge_restored(weight, e.stats, missed, values)
            else:
                weight.sub_(self._delta(e.layer))  # in fp32, rounded once: the merge's add undone but for rounding
                weight.view(-1)[missed] = values
                same = e.checksum == _bit_sum(weight)
            e.fixes = None
            undone.append((e, same))
        if not undone:
            return
        same = torch.stack([ok for _, ok in undone]).cpu()
        for (e, _), ok in zip(undone, same.tolist()):
            e.checksum = e.stats = None
            if not ok:
                raise MergeNotUndone(
                    f"fastgrpo: the rollout's LoRA merge into {type(e.layer).__name__} '{e.name}' did not undo to the "
                    "exact base weight (its delta computed twice differed). Decode with the adapters unmerged: "
                    "EmbeddedGenerator(merge_lora='none') / fastgrpo_generation_merge_lora='none'."
                )

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        if self.mode == "none":
            self.not_merged, self.merged_layers, self.nf4_layers, self.nf4_groups, self.ungrouped = {}, 0, 0, 0, {}
            yield 0
            return
        targets = self._targets(model)
        key = tuple((id(parent), name, id(layer), _merged_tensors(layer), tuple(layer.active_adapters),
                     four_bit_key(layer) if four_bit else None)
                    for parent, name, layer, four_bit in targets)
        if key != self._key:
            counts: dict[int, int] = {}
            tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            for _, tensor in tensors:
                counts[tensor.data_ptr()] = counts.get(tensor.data_ptr(), 0) + 1
            shared = {ptr for ptr, n in counts.items() if n > 1}
            self._entries = []  # the old copies go before the new are allocated
            built = {}  # id(layer) -> its entry, where a group built it (else _entries_of builds it)
            merged = [(parent, name, layer) for parent, name, layer, four_bit in targets
                      if not four_bit and not is_expert_lora(layer)]
            for group in joinable_groups(merged, self._copy_dtype) if JOIN_QKV else []:
                layers = [layer for _, _, layer in group]
                projections = JoinedProjections([layer.out_features for layer in layers], layers[0].in_features,
                                                self._copy_dtype(layers[0]), _adapter_device(layers[0]),
                                                bias=layers[0].base_layer.bias is not None)
                for (parent, name, layer), piece in zip(group, projections.slices()):
                    built[id(layer)] = _Merge(parent, name, layer, piece)
            self.nf4_groups, self.ungrouped = 0, {}
            four_bit = [(parent, name, layer) for parent, name, layer, four_bit in targets if four_bit]
            for group in sibling_groups(four_bit, GROUP_NAMES) if GROUP_FOUR_BIT else []:
                members = [FourBitLoRALinear(layer) for _, _, layer in group]
                why = group_obstacle(members)
                if why is not None:  # each member launched alone (built once: not again by _entries_of)
                    self.ungrouped[why] = self.ungrouped.get(why, 0) + len(members)
                    pieces = members
                else:
                    self.nf4_groups += 1
                    pieces = FourBitGroup(members).slices()
                for (parent, name, layer), piece in zip(group, pieces):
                    built[id(layer)] = _Merge(parent, name, layer, piece)
            self._entries = [e for target in targets
                             for e in ([built[id(target[2])]] if id(target[2]) in built
                                       else self._entries_of(*target, shared))]
            self._key = key
            self.version += 1
        try:
            self._merge()
            for e in self._entries:
                if e.parent is not None:
                    e.parent._modules[e.name] = e.linear
            yield len(self._entries)
        finally:
            for e in self._entries:
                if e.parent is not None:
                    e.parent._modules[e.name] = e.layer
            self._restore()
