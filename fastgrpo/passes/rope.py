"""Rotary position embeddings applied to q and k become `fastgrpo::rope`, whose backward
keeps only cos and sin (no pre-rotation copies of q and k).

Anchor: `rotate_half(x)` - `cat([-x[..., h:], x[..., :h]], -1)` (HF) or the interleaved
`stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)` (GPT-J / GLM) - feeding
`x * cos + rotate_half(x) * sin` in either operand order. Partial rotary (Phi, GLM:
rotate a slice, pass the rest) needs nothing special: the slice is the op's input.
`cat([x2, -x1])` (NanoChat) is -rotate_half(x): the same op with -sin. Sites that share
one cos/sin pair (the same value, even if computed twice) are paired into one call (q and k).

Two more spellings of the same rotation are rewritten to the op:
- the pairs rotated as written, `cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)` with
  half-width c, s: x1, x2 the halves of x (GPT-OSS) - the half rotation of x with
  `cat([c, c], -1)`, `cat([s, s], -1)` - or its even and odd channels (DeepSeek-V3 MLA and
  descendants) - the same of `cat([x[..., 0::2], x[..., 1::2]], -1)`, a de-interleaving
  copy made in the graph;
- complex multiplication (Llama 4, DeepSeek-V2):
  `view_as_real(view_as_complex(x.reshape(..., -1, 2)) * f).flatten(-2)`: the interleaved
  rotation with cos, sin = real and imaginary parts of f, each repeated twice.
"""
import operator
from dataclasses import dataclass

import torch
from torch import fx

from fastgrpo.kernels import rope as _rope_ops  # noqa: F401  (registers the op)
from fastgrpo.passes._fx import (
    call_with_example, erase_unused,
    SUPPORTED_DTYPES, arg, binary_operands, dtype, is_empty, is_kind, is_scalar, is_widening_or_same, normalized_dim,
    only_user, other_operand, propagate_meta, shape, site_name, strip_widening_casts, value, value_key,
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
    form: str = ""
    cos_half: bool = False  # the op reads cos/sin at half width (their halves repeat)


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


def _rotate_half_input(node) -> tuple[fx.Node, bool, bool] | None:
    """(x, interleaved, flipped) when `node` computes rotate_half(x) or its interleaved variant;
    flipped for `cat([x2, -x1])` (NanoChat), which is -rotate_half(x): a rotation by -sin."""
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
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    if is_kind(parts[0], "neg"):
        flipped, second_half, first_half = False, _last_dim_slice(parts[0].args[0]), _last_dim_slice(parts[1])
    elif is_kind(parts[1], "neg"):
        flipped, second_half, first_half = True, _last_dim_slice(parts[0]), _last_dim_slice(parts[1].args[0])
    else:
        return None
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
    return (x, interleaved, flipped) if ok else None


_EVEN, _ODD, _FIRST, _SECOND = "even", "odd", "first", "second"
_MADE_HERE = "fastgrpo_rope_input"  # meta key of the op inputs this pass builds


def _new_node(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A call to `target` with its example value (the op's checks read it), marked as built here."""
    node = call_with_example(graph, target, args)
    node.meta[_MADE_HERE] = True
    return node


def _through_widening_casts(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The value `node` becomes after casts that lose nothing (`rotate_half(x).float()` in
    DeepSeek-V4), and those casts: rotating then widening equals widening then rotating."""
    casts = []
    while (user := only_user(node)) is not None and is_kind(user, "cast") and is_widening_or_same(dtype(node), dtype(user)):
        casts.append(user)
        node = user
    return node, casts


def _match(node: fx.Node, graph: fx.Graph) -> _Rotation | None:
    found = _rotate_half_input(node)
    if found is None:
        return None
    x, interleaved, flipped = found
    rotated, casts = _through_widening_casts(node)
    s_mul = only_user(rotated)
    if not is_kind(s_mul, "mul"):
        raise Miss("rotate_half(x) is not multiplied by sin")
    sin = other_operand(s_mul, rotated)
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
    negated = parts[1] if flipped else parts[0]
    nodes = [negated.args[0], *parts, *([stack_node] if interleaved else []), node, *casts, s_mul, c_mul, total]
    if flipped:
        with graph.inserting_before(total):
            sin = _new_node(graph, torch.neg, (sin,))
    return _Rotation(x, cos, sin, interleaved, total, nodes, form="rotate_half with flipped signs" if flipped else "")


def _half_of(node) -> tuple[str, fx.Node] | None:
    """("even" | "odd" | "first" | "second", x) for x[..., 0::2], x[..., 1::2], the first or
    second half of x's last dim (a slice or `chunk(x, 2, -1)[i]`)."""
    if is_kind(node, "getitem") and is_kind(node.args[0], "chunk") and isinstance(node.args[1], int):
        chunk = node.args[0]
        x = arg(chunk, 0, "input")
        if arg(chunk, 1, "chunks") == 2 and shape(x) and normalized_dim(arg(chunk, 2, "dim", 0), len(shape(x))) == len(shape(x)) - 1:
            return (_FIRST if node.args[1] == 0 else _SECOND), x
        return None
    sliced = _last_dim_slice(node)
    if sliced is None:
        return None
    x, start, stop, step = sliced
    d = shape(x)[-1]
    if step == 2 and stop is None and start in (None, 0, 1):
        return (_ODD if start == 1 else _EVEN), x
    if step in (None, 1) and start in (None, 0) and stop == d // 2:
        return _FIRST, x
    if step in (None, 1) and start == d // 2 and stop in (None, d):
        return _SECOND, x
    return None


def _half_factor(mul) -> tuple[fx.Node, str, fx.Node, fx.Node] | None:
    """(half, which half, x, factor) when `mul` multiplies one half of x (see `_half_of`) by a factor."""
    if not is_kind(mul, "mul") or len(mul.users) != 1:
        return None
    for a, b in (binary_operands(mul), binary_operands(mul)[::-1]):
        if isinstance(a, fx.Node) and (half := _half_of(strip_widening_casts(a))) is not None:
            return a, half[0], half[1], b
    return None


def _match_pairwise(node: fx.Node, graph: fx.Graph) -> _Rotation | None:
    """`cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)` with half-width c, s, where x1, x2 are the
    two halves of x (GPT-OSS) or its even and odd channels (DeepSeek-V3 MLA)."""
    if not is_kind(node, "cat"):
        return None
    parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not (is_kind(parts[0], "sub") and is_kind(parts[1], "add")):
        return None
    minus, plus = parts
    terms = [_half_factor(m) for m in (*binary_operands(minus), *binary_operands(plus))]
    if any(t is None for t in terms) or any(len(p.users) != 1 for p in parts):
        return None
    (a, a_half, x, cos), (b, b_half, _, sin) = terms[:2]
    if (a_half, b_half) not in ((_EVEN, _ODD), (_FIRST, _SECOND)) or any(t[2] is not x for t in terms):
        return None
    # the second half: x2 * c + x1 * s, in either order
    if {(t[1], value_key(t[3])) for t in terms[2:]} != {(b_half, value_key(cos)), (a_half, value_key(sin))}:
        return None
    rank = len(shape(node))
    if normalized_dim(dim, rank) != rank - 1:
        return None
    d = shape(x)[-1]
    for t, name in ((cos, "cos"), (sin, "sin")):
        if shape(t) is None or len(shape(t)) != len(shape(x)) or shape(t)[-1] != d // 2:
            raise Miss(f"{name} of shape {shape(t)} does not match the pairs of the rotated channels {shape(x)}")
    if d % 2:
        raise Miss(f"odd rotary width {d}")
    with graph.inserting_before(node):
        halves = x if a_half == _FIRST else _new_node(graph, torch.cat, ([a, b], -1))
        cos_full = _new_node(graph, torch.cat, ([cos, cos], -1))
        sin_full = _new_node(graph, torch.cat, ([sin, sin], -1))
    replaced = {minus, plus, node, *(m for p in parts for m in binary_operands(p))}
    for t in terms:  # the halves as written, and the chunk they come from
        replaced |= {t[0], strip_widening_casts(t[0])}
        if is_kind(half := strip_widening_casts(t[0]), "getitem") and is_kind(half.args[0], "chunk"):
            replaced.add(half.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = sorted(replaced, key=order.__getitem__)
    if a_half == _FIRST:
        form = "halves rotated as written"
    else:
        form = "even/odd channels, de-interleaved output"
    return _Rotation(halves, cos_full, sin_full, False, node, nodes, form=form)


def _match_complex(node: fx.Node, graph: fx.Graph) -> _Rotation | None:
    """`view_as_real(view_as_complex(x.reshape(..., -1, 2)) * f).flatten(-2)` with f complex."""
    if not is_kind(node, "view_as_complex"):
        return None
    pairs = arg(node, 0, "input")
    if not is_kind(pairs, "view") or shape(pairs) is None or shape(pairs)[-1] != 2:
        return None
    x = pairs.args[0]
    if shape(x) is None or tuple(shape(pairs)[:-2]) != tuple(shape(x)[:-1]):
        return None
    mul = only_user(node)
    if not is_kind(mul, "mul"):
        raise Miss("complex-number RoPE: view_as_complex(x) is not multiplied by the rotation")
    freqs = other_operand(mul, node)
    real = only_user(mul)
    flat = only_user(real) if is_kind(real, "view_as_real") else None
    rank = len(shape(x)) + 1
    if not is_kind(flat, "flatten") or normalized_dim(arg(flat, 1, "start_dim", 0), rank) != rank - 2 or (
        normalized_dim(arg(flat, 2, "end_dim", -1), rank) != rank - 1
    ):
        raise Miss("complex-number RoPE: the product is not turned back into x's layout with view_as_real(...).flatten(-2)")
    if value(freqs) is None or not value(freqs).is_complex() or shape(freqs)[-1] != shape(x)[-1] // 2:
        raise Miss(f"complex-number RoPE: the rotation {shape(freqs)} {dtype(freqs)} is not complex of half x's width")
    if len(shape(freqs)) != len(shape(x)):
        raise Miss(f"complex-number RoPE: rotation of shape {shape(freqs)} does not match x {shape(x)}")
    with graph.inserting_before(flat):
        parts = _new_node(graph, torch.view_as_real, (freqs,))
        cos = _new_node(graph, operator.getitem, (parts, (Ellipsis, 0)))
        sin = _new_node(graph, operator.getitem, (parts, (Ellipsis, 1)))
        cos_full = _new_node(graph, torch.repeat_interleave, (cos, 2, -1))
        sin_full = _new_node(graph, torch.repeat_interleave, (sin, 2, -1))
    return _Rotation(x, cos_full, sin_full, True, flat, [x, pairs, node, mul, real, flat], form="complex multiply")


def _check_inputs(graph: fx.Graph, rot: _Rotation) -> None:
    """What the op cannot take, found at compile time rather than raised by the kernel at run time.
    On a miss, the inputs a matcher built for the op (de-interleaved x, full-width cos/sin) go again."""
    for t, name in ((_op_input(rot), "input"), (rot.cos, "cos"), (rot.sin, "sin")):
        if dtype(t) not in SUPPORTED_DTYPES:
            reason = f"{name} dtype {dtype(t)} is not float32/float16/bfloat16"
            break
    else:
        if not is_empty(rot.x):
            return
        reason = f"zero-size input {shape(rot.x)}: nothing to accelerate"
    for made in (rot.x, rot.cos, rot.sin):
        _erase_if_dead(graph, made, only_new=True)
    raise Miss(reason)


def _op_input(rot: _Rotation) -> fx.Node:
    """x itself, or x before a widening cast when the op's dtype rule gives the same output dtype."""
    source = strip_widening_casts(rot.x)
    promoted = torch.promote_types(torch.promote_types(dtype(source), dtype(rot.cos)), dtype(rot.sin))
    return source if promoted == dtype(rot.out) else rot.x


# Maps of one element at a time: halves that are equal before stay equal after.
_ELEMENTWISE = ("cos", "sin", "neg", "cast", "contiguous")


def _repeats_halves(node, depth: int = 16) -> bool:
    """Whether the graph proves that the last dim of `node` is two equal halves: HF's
    `cat((freqs, freqs), -1)` carried through element-wise maps, scalar factors and indexing or
    reshapes that keep every last-dim row whole (the whole-model graph; in a decoder layer's own
    graph cos and sin are inputs, and nothing is proved)."""
    if depth == 0 or not isinstance(node, fx.Node) or not shape(node):
        return False
    rank = len(shape(node))
    if is_kind(node, "cat"):
        parts = arg(node, 0, "tensors")
        return (isinstance(parts, (list, tuple)) and len(parts) == 2 and value_key(parts[0]) == value_key(parts[1])
                and normalized_dim(arg(node, 1, "dim", 0), rank) == rank - 1)
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    if len(operands) != 1 or not shape(operands[0]) or shape(operands[0])[-1] != shape(node)[-1]:
        return False
    source = operands[0]
    if is_kind(node, "mul", "div"):
        keeps_rows = all(a is source or is_scalar(a) for a in node.args[:2])
    elif is_kind(node, "unsqueeze"):
        keeps_rows = normalized_dim(arg(node, 1, "dim"), rank) != rank - 1
    elif is_kind(node, "getitem"):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        # an index that reaches the last dim only through `...` followed by nothing, or not at all
        keeps_rows = None not in index and (index[-1] is Ellipsis if Ellipsis in index
                                            else len(index) < len(shape(source)))
    else:
        # reshapes keep last-dim rows whole when the last size stays: row-major order is kept
        keeps_rows = is_kind(node, *_ELEMENTWISE, "view", "expand")
    return keeps_rows and _repeats_halves(source, depth - 1)


def _half_width(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The first half of `node`'s last dim: `a` itself for `cat([a, a], -1)`, else a view."""
    if is_kind(node, "cat"):
        return arg(node, 0, "tensors")[0]
    return _new_node(graph, operator.getitem, (node, (Ellipsis, slice(None, shape(node)[-1] // 2))))


def _emit(graph: fx.Graph, q: _Rotation, k: _Rotation) -> bool:
    """One op call for q and k (or q alone when q is k), placed before the first use of either
    output; False when an input is only defined after that point (then they go singly).
    Half-rotation cos/sin whose halves provably repeat go at half width: the kernel reads half."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min((u for rot in (q, k) for u in rot.out.users), key=order.__getitem__)
    inputs = [_op_input(q), _op_input(k), q.cos, q.sin]
    if any(order[n] >= order[first_use] for n in inputs):
        return False
    with graph.inserting_before(first_use):
        if not q.interleaved and _repeats_halves(q.cos) and _repeats_halves(q.sin):
            inputs[2:] = [_half_width(graph, q.cos), _half_width(graph, q.sin)]
            q.cos_half = True
        call = graph.call_function(
            torch.ops.fastgrpo.rope.default, (*inputs, shape(q.x)[-1], q.interleaved)
        )
        outs = [graph.call_function(operator.getitem, (call, i)) for i in (0, 1)]
    for rot, new in zip((q, k), outs):
        propagate_meta(new, rot.out)
        rot.out.replace_all_uses_with(new)
    for rot in {id(q): q, id(k): k}.values():
        erase_unused(graph, rot.nodes)
    for unused in {k.cos, k.sin} - {q.cos, q.sin}:  # k's own copies of q's cos and sin
        _erase_if_dead(graph, unused)
    for full in (q.cos, q.sin):  # full-width cos/sin this pass built, replaced by their halves
        _erase_if_dead(graph, full, only_new=True)
    return True


def _erase_if_dead(graph: fx.Graph, node, only_new: bool = False) -> None:
    """Erase `node` and then its inputs while nothing reads them (pure computations only;
    with `only_new`, only nodes this pass made)."""
    if not isinstance(node, fx.Node) or node.graph is not graph or node.users or node.op not in (
        "call_function", "call_method"
    ) or node.is_impure() or (only_new and not node.meta.get(_MADE_HERE)):
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for parent in inputs:
        _erase_if_dead(graph, parent, only_new)


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    rotations: list[_Rotation] = []
    for node in list(graph.nodes):
        try:
            rotation = _match(node, graph) or _match_pairwise(node, graph) or _match_complex(node, graph)
            if rotation is not None:
                _check_inputs(graph, rotation)
        except Miss as miss:
            record.miss(site_name(node), str(miss))
            continue
        if rotation is not None:
            rotations.append(rotation)
    # Pair rotations that share cos and sin (q and k of one attention), in graph order.
    pending: dict[tuple, _Rotation] = {}
    pairs = []
    for rot in rotations:
        key = (value_key(rot.cos), value_key(rot.sin), rot.interleaved, shape(rot.x)[-1])
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
        form = q.form or ("interleaved" if q.interleaved else "half rotation")
        sliced = _last_dim_slice(q.x)
        partial = ""
        if sliced is not None and shape(sliced[0])[-1] != shape(q.x)[-1]:
            partial = f", partial rotary ({shape(q.x)[-1]} of {shape(sliced[0])[-1]} channels)"
        half = ", cos/sin read at half width" if q.cos_half else ""
        record.match(site_name(q.out), f"{form}{partial}{half}, {'q and k in one call' if q is not k else 'one tensor'}")
    graph.lint()
    gm.recompile()
