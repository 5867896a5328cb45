"""Projections that read one input (an attention's q, k and v; an MLP's gate and up) decoded as one launch.

At decode row counts (8-128 rows) each projection costs about its launch (~5 us on the 1.5B shape's q, k and v): one
launch over the weights side by side pays one launch and reads the input once. Two kinds:
- `JoinedProjections`: a joined copy of q, k and v's merged weights, one GEMM. `MergedAdapters` builds one for sibling
  LoRA linears named `JOINED_NAMES` (the names HF's attention modules give them) that all merge, read the same width
  and have a bias on each or none; it merges their adapters into the joined copy (one persistent device copy of those
  weights: ~176 MB on Qwen2.5-1.5B; their own base weights are not touched).
- `FourBitStack`: the 4-bit layers (`FourBitLoRALinear`) of q, k and v, or of gate and up (`STACKED_NAMES`), in one
  `fastgrpo::nf4_lora_linear` launch over their live packed weights (`nf4_lora_linear_stacked`): no copy.
Either swaps in one `JoinedSlice` a projection for the call.

Hand-over: the first slice called computes the joined product and leaves (input, product) on the shared module; a
later slice given the same input tensor returns its columns of that product (a column slice, a view), the last clears
it. A slice called with another input, or before the first, computes its own projection alone: the result is right in
any call order, joined only in the usual one. Inside a compiled layer Dynamo traces the hand-over as attribute writes
read back in the same trace (the final value is None: nothing leaves the graph), and the joined weight is a registered
buffer, so every layer runs the same compiled graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgrpo.kernels.nf4_lora_linear import nf4_lora_linear_stacked

JOINED_NAMES = ("q_proj", "k_proj", "v_proj")  # in the order HF attention modules call them
STACKED_NAMES = (JOINED_NAMES, ("gate_proj", "up_proj"))  # (HF's gated MLPs call gate first)


class SharedInput(nn.Module):
    """Projections of widths `widths` over one input, their outputs side by side (`product`); `alone` is one of them
    by itself."""

    def __init__(self, widths: list[int]):
        super().__init__()
        bounds = [0]
        for width in widths:
            bounds.append(bounds[-1] + width)
        self.bounds = bounds
        self.held_input: torch.Tensor | None = None
        self.held_product: torch.Tensor | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def alone(self, x: torch.Tensor, index: int) -> torch.Tensor:
        raise NotImplementedError

    def slices(self) -> list[JoinedSlice]:
        n = len(self.bounds) - 1
        return [JoinedSlice(self, i, last=i == n - 1) for i in range(n)]


class JoinedProjections(SharedInput):
    """The stacked [sum(widths), in_features] weight (and bias) of a group of projections reading one input."""

    def __init__(self, widths: list[int], in_features: int, dtype: torch.dtype, device: torch.device, bias: bool):
        super().__init__(widths)
        rows = sum(widths)
        self.register_buffer("weight", torch.empty(rows, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("bias", torch.empty(rows, dtype=dtype, device=device) if bias else None,
                             persistent=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def alone(self, x: torch.Tensor, index: int) -> torch.Tensor:
        lo, hi = self.bounds[index], self.bounds[index + 1]
        return F.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])


class FourBitStack(SharedInput):
    """`FourBitLoRALinear`s (`members`) reading one input, in one `nf4_lora_linear_stacked` launch where the members
    take the kernel (`takes_kernel`: decode row counts); a prefill runs each member (PEFT's forward) and joins the
    outputs."""

    def __init__(self, members: list[nn.Module]):
        super().__init__([m.out_features for m in members])
        self.members = nn.ModuleList(members)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        first = self.members[0]
        if not first.takes_kernel(x):
            return torch.cat([m(x) for m in self.members], dim=-1)
        out = nf4_lora_linear_stacked(x.to(first.compute_dtype or x.dtype), [m.weight_args() for m in self.members])
        return out.to(x.dtype)

    def alone(self, x: torch.Tensor, index: int) -> torch.Tensor:
        return self.members[index](x)


class JoinedSlice(nn.Module):
    """One projection of a `SharedInput`: its output columns of the joined product (see the module docstring).
    `merge_weight` / `merge_bias` are its rows of a `JoinedProjections`' weight and bias, where the merge writes."""

    def __init__(self, joined: SharedInput, index: int, last: bool):
        super().__init__()
        self.joined = joined
        self.index = index
        self.last = last
        self.lo, self.hi = joined.bounds[index], joined.bounds[index + 1]

    @property
    def merge_weight(self) -> torch.Tensor:
        return self.joined.weight[self.lo:self.hi]

    @property
    def merge_bias(self) -> torch.Tensor | None:
        return None if self.joined.bias is None else self.joined.bias[self.lo:self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.joined
        if self.index == 0:
            product = joined.product(x)
            joined.held_input, joined.held_product = x, product
        elif joined.held_input is x:
            product = joined.held_product
        else:  # not called after the first slice with the same input: this projection alone
            return joined.alone(x, self.index)
        if self.last:
            joined.held_input = joined.held_product = None
        return product[..., self.lo:self.hi]

    def extra_repr(self) -> str:
        return f"columns {self.lo}:{self.hi} of {self.joined.bounds[-1]}"


def _siblings(targets: list[tuple[nn.Module, str, nn.Module]], names: tuple[str, ...]) -> list[list[tuple]]:
    """The (parent, name, layer) groups among `targets` that hold every one of `names` under one parent, in that
    order."""
    by_parent: dict[int, dict[str, tuple]] = {}
    for parent, name, layer in targets:
        if name in names:
            by_parent.setdefault(id(parent), {})[name] = (parent, name, layer)
    return [[members[name] for name in names] for members in by_parent.values() if len(members) == len(names)]


def joinable_groups(targets: list[tuple[nn.Module, str, nn.Module]], dtype_of) -> list[list[tuple]]:
    """Groups of (parent, name, LoRA layer) among `targets` (layers that merge) to join: under one parent, every name
    of `JOINED_NAMES`, with equal in_features, one merged dtype (`dtype_of(layer)`), one device, and a bias on all
    or none of their bases."""
    groups = []
    for group in _siblings(targets, JOINED_NAMES):
        layers = [layer for _, _, layer in group]
        bases = [layer.base_layer for layer in layers]
        if len({layer.in_features for layer in layers}) != 1:
            continue
        if len({dtype_of(layer) for layer in layers}) != 1 or len({b.weight.device for b in bases}) != 1:
            continue
        if len({getattr(b, "bias", None) is None for b in bases}) != 1:
            continue
        groups.append(group)
    return groups


def stackable_groups(targets: list[tuple[nn.Module, str, nn.Module]], module_of) -> list[list[tuple]]:
    """Groups of (parent, name, LoRA layer) among `targets` (layers that decode through the 4-bit kernel) to stack:
    under one parent, every name of a `STACKED_NAMES` entry, whose `FourBitLoRALinear`s (`module_of(layer)`) agree
    on what one launch shares (`stack_key`)."""
    return [group for names in STACKED_NAMES for group in _siblings(targets, names)
            if len({module_of(layer).stack_key() for _, _, layer in group}) == 1]
