"""Rotary position embeddings applied to q and k become `fastgrpo::rope`, whose backward
keeps only cos and sin (no pre-rotation copies of q and k).

Anchor: `rotate_half(x)` - `cat([-x[..., h:], x[..., :h]], -1)` (HF) or the interleaved
`stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)` (GPT-J / GLM) - feeding
`x * cos + rotate_half(x) * sin` in either operand order. Partial rotary (Phi, GLM:
rotate a slice, pass the rest) needs nothing special: the slice is the op's input.
Sites that share one cos/sin pair are paired into one call (q and k of a layer).
"""
import operator
from dataclasses import dataclass

import torch
from torch import fx

from fastgrpo.kernels import rope as _rope_ops  # noqa: F401  (registers the op)
from fastgrpo.passes._fx import (
    arg, binary_operands, dtype, is_kind, normalized_dim, only_user, other_operand, propagate_meta, shape, site_name,
    strip_widening_casts,
)
from fastgrpo.passes._record import PatternRecord

NAME = "rope"


class Miss(Exception):
    pass


@dataclass
class _Rotation:
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    interleaved: bool
    out: fx.Node
    nodes: list[fx.Node]


def _last_dim_slice(node) -> tuple[fx.Node, int | None, int | None, int | None] | None:
    """(x, start, stop, step) when `node` is `x[..., start:stop:step]` on the last dim only."""
    if not is_kind(node, "getitem") or not isinstance(node.args[0], fx.Node) or shape(node.args[0]) is None:
        return None
    x, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice):
        return None
    rank = len(shape(x))
    leading = index[:-1]
    if leading and leading[0] is Ellipsis:
        leading = leading[1:]
    elif len(index) != rank:
        return None
    if any(s != slice(None) for s in leading):
        return None
    last = index[-1]
    return x, last.start, last.stop, last.step


def _rotate_half_input(node) -> tuple[fx.Node, bool] | None:
    """(x, interleaved) when `node` computes rotate_half(x) or its interleaved variant."""
    interleaved = False
    if is_kind(node, "flatten"):
        stacked = node.args[0]
        if not is_kind(stacked, "stack"):
            return None
        parts, dim = arg(stacked, 0, "tensors"), arg(stacked, 1, "dim", 0)
        interleaved = True
    elif is_kind(node, "cat"):
        parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
    else:
        return None
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not is_kind(parts[0], "neg"):
        return None
    second_half, first_half = _last_dim_slice(parts[0].args[0]), _last_dim_slice(parts[1])
    if second_half is None or first_half is None or second_half[0] is not first_half[0]:
        return None
    x = first_half[0]
    rank = len(shape(x))
    if normalized_dim(dim, rank + (1 if interleaved else 0)) != rank - (0 if interleaved else 1):
        return None
    d = shape(x)[-1]
    if interleaved:
        ok = first_half[1:] in ((None, None, 2), (0, None, 2)) and second_half[1:] == (1, None, 2)
    else:
        ok = (first_half[1] in (None, 0) and first_half[2] == d // 2 and first_half[3] in (None, 1)
              and second_half[1] == d // 2 and second_half[2] in (None, d) and second_half[3] in (None, 1))
    return (x, interleaved) if ok else None


def _match(node: fx.Node) -> _Rotation | None:
    found = _rotate_half_input(node)
    if found is None:
        return None
    x, interleaved = found
    s_mul = only_user(node)
    if not is_kind(s_mul, "mul"):
        raise Miss("rotate_half(x) is not multiplied by sin")
    sin = other_operand(s_mul, node)
    total = only_user(s_mul)
    if not is_kind(total, "add"):
        raise Miss("rotate_half(x) * sin is not added to x * cos")
    c_mul = other_operand(total, s_mul)
    if not is_kind(c_mul, "mul") or len(c_mul.users) != 1:
        raise Miss("x * cos not found beside rotate_half(x) * sin")
    a, b = binary_operands(c_mul)
    x_side, cos = (a, b) if strip_widening_casts(a) is strip_widening_casts(x) else (b, a)
    if strip_widening_casts(x_side) is not strip_widening_casts(x):
        raise Miss("cos multiplies another tensor than the rotated one")
    for t, name in ((cos, "cos"), (sin, "sin")):
        if shape(t) is None or shape(t)[-1] != shape(x)[-1] or len(shape(t)) != len(shape(x)):
            raise Miss(f"{name} of shape {shape(t)} does not match the rotated channels {shape(x)}")
    if shape(x)[-1] % 2:
        raise Miss(f"odd rotary width {shape(x)[-1]}")
    stack_node = node.args[0] if interleaved else None
    parts_owner = stack_node if interleaved else node
    parts = arg(parts_owner, 0, "tensors")
    nodes = [parts[0].args[0], parts[1], parts[0], *( [stack_node] if interleaved else []), node, s_mul, c_mul, total]
    return _Rotation(x, cos, sin, interleaved, total, nodes)


def _op_input(rot: _Rotation) -> fx.Node:
    """x itself, or x before a widening cast when the op's dtype rule gives the same output dtype."""
    source = strip_widening_casts(rot.x)
    promoted = torch.promote_types(torch.promote_types(dtype(source), dtype(rot.cos)), dtype(rot.sin))
    return source if promoted == dtype(rot.out) else rot.x


def _emit(graph: fx.Graph, q: _Rotation, k: _Rotation) -> bool:
    """One op call for q and k (or q alone when q is k), placed before the first use of either
    output; False when an input is only defined after that point (then they go singly)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min((u for rot in (q, k) for u in rot.out.users), key=order.__getitem__)
    inputs = [_op_input(q), _op_input(k), q.cos, q.sin]
    if any(order[n] >= order[first_use] for n in inputs):
        return False
    with graph.inserting_before(first_use):
        call = graph.call_function(
            torch.ops.fastgrpo.rope.default, (*inputs, shape(q.x)[-1], q.interleaved)
        )
        outs = [graph.call_function(operator.getitem, (call, i)) for i in (0, 1)]
    for rot, new in zip((q, k), outs):
        propagate_meta(new, rot.out)
        rot.out.replace_all_uses_with(new)
    for rot in {id(q): q, id(k): k}.values():
        for node in reversed(rot.nodes):
            if node.graph is graph and not node.users:
                graph.erase_node(node)
    return True


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    rotations: list[_Rotation] = []
    for node in list(graph.nodes):
        try:
            rotation = _match(node)
        except Miss as miss:
            record.miss(site_name(node), str(miss))
            continue
        if rotation is not None:
            rotations.append(rotation)
    # Pair rotations that share cos and sin (q and k of one attention), in graph order.
    pending: dict[tuple, _Rotation] = {}
    pairs = []
    for rot in rotations:
        key = (rot.cos, rot.sin, rot.interleaved, shape(rot.x)[-1])
        if key in pending:
            pairs.append((pending.pop(key), rot))
        else:
            pending[key] = rot
    pairs += [(rot, rot) for rot in pending.values()]
    for q, k in pairs:
        if q is not k and not _emit(graph, q, k):
            pairs += [(q, q), (k, k)]
            continue
        if q is k:
            _emit(graph, q, q)
        form = "interleaved" if q.interleaved else "half rotation"
        sliced = _last_dim_slice(q.x)
        partial = ""
        if sliced is not None and shape(sliced[0])[-1] != shape(q.x)[-1]:
            partial = f", partial rotary ({shape(q.x)[-1]} of {shape(sliced[0])[-1]} channels)"
        record.match(site_name(q.out), f"{form}{partial}, {'q and k in one call' if q is not k else 'one tensor'}")
    graph.lint()
    gm.recompile()
