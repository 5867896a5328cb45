"""An attention's q, k and v projections decoded as one GEMM over a joined copy of their merged weights.

At decode row counts (8-128 rows) each projection's GEMM costs about its launch (~5 us on the 1.5B shape's q, k and
v): one GEMM over the three weights stacked pays one launch and reads the input once. `MergedAdapters` builds a
`JoinedProjections` for sibling LoRA linears named `JOINED_NAMES` (the names HF's attention modules give them) that
all merge, read the same width and have a bias on each or none; it merges their adapters into the joined copy (one
persistent device copy of those weights: ~176 MB on Qwen2.5-1.5B; their own base weights are not touched) and swaps
in one `JoinedSlice` a projection for the call.

Hand-over (`JoinedSlice`, for any group module with `bounds`, `product(x)` and `alone(x, index)`: this one, or a
4-bit group in four_bit.py): the first slice called (q) computes the joined product and leaves (input, product) on the
shared module; a later slice given the same input tensor returns its columns of that product (a column slice, a
view), the last clears it. A slice called with another input, or before the first, computes its own rows alone: the
result is right in any call order, joined only in the usual one. Inside a compiled layer Dynamo traces the
hand-over as attribute writes read back in the same trace (the final value is None: nothing leaves the graph), and
the joined weight is a registered buffer, so every layer runs the same compiled graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

JOINED_NAMES = ("q_proj", "k_proj", "v_proj")  # in the order HF attention modules call them


class JoinedProjections(nn.Module):
    """The stacked [sum(widths), in_features] weight (and bias) of a group of projections reading one input."""

    def __init__(self, widths: list[int], in_features: int, dtype: torch.dtype, device: torch.device, bias: bool):
        super().__init__()
        rows = sum(widths)
        self.register_buffer("weight", torch.empty(rows, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("bias", torch.empty(rows, dtype=dtype, device=device) if bias else None,
                             persistent=False)
        bounds = [0]
        for width in widths:
            bounds.append(bounds[-1] + width)
        self.bounds = bounds
        self.held_input: torch.Tensor | None = None
        self.held_product: torch.Tensor | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def alone(self, x: torch.Tensor, index: int) -> torch.Tensor:
        lo, hi = self.bounds[index], self.bounds[index + 1]
        return F.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])

    def rows(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A projection's rows of the joined weight and bias, where the merge writes."""
        lo, hi = self.bounds[index], self.bounds[index + 1]
        return self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi]

    def slices(self) -> list[JoinedSlice]:
        return joined_slices(self)


def joined_slices(joined: nn.Module) -> list[JoinedSlice]:
    n = len(joined.bounds) - 1
    return [JoinedSlice(joined, i, last=i == n - 1) for i in range(n)]


class JoinedSlice(nn.Module):
    """One projection of a group module (a `JoinedProjections`, or four_bit.py's `FourBitGroup`): its output columns of
    the group's product (see the module docstring)."""

    def __init__(self, joined: nn.Module, index: int, last: bool):
        super().__init__()
        self.joined = joined
        self.index = index
        self.last = last
        self.lo, self.hi = joined.bounds[index], joined.bounds[index + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.joined
        if self.index == 0:
            product = joined.product(x)
            if product is None:  # (the group declines this input: each projection alone)
                return joined.alone(x, self.index)
            joined.held_input, joined.held_product = x, product
        elif joined.held_input is x:
            product = joined.held_product
        else:  # not called after the first slice with the same input: this projection alone
            return joined.alone(x, self.index)
        if self.last:
            joined.held_input = joined.held_product = None
        return product[..., self.lo:self.hi]

    def extra_repr(self) -> str:
        return f"rows {self.lo}:{self.hi} of {self.joined.bounds[-1]}"


def sibling_groups(targets: list[tuple[nn.Module, str, nn.Module]], names: tuple[tuple[str, ...], ...]) -> list:
    """Groups of (parent, name, layer) among `targets`: under one parent, every name of one of `names`' tuples, in
    its order."""
    by_parent: dict[int, dict[str, tuple]] = {}
    for target in targets:
        by_parent.setdefault(id(target[0]), {})[target[1]] = target
    return [[members[n] for n in group] for members in by_parent.values() for group in names
            if all(n in members for n in group)]


def joinable_groups(targets: list[tuple[nn.Module, str, nn.Module]], dtype_of) -> list[list[tuple]]:
    """Groups of (parent, name, LoRA layer) among `targets` (layers that merge) to join: under one parent, every name
    of `JOINED_NAMES`, with equal in_features, one merged dtype (`dtype_of(layer)`), one device, and a bias on all
    or none of their bases."""
    groups = []
    for group in sibling_groups(targets, (JOINED_NAMES,)):
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
