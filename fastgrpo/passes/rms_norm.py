"""RMSNorm, however a model writes it, becomes `fastgrpo::rms_norm`; with the residual add
that feeds it, `fastgrpo::add_rms_norm`.

Anchor: a mean of squares over the last dim, plus a scalar epsilon, through rsqrt (or
`pow(-0.5)`, or `1/sqrt`, or a division by sqrt) - that is RMSNorm in every spelling seen
(HF Llama, Gemma's `1 + w`, OLMo2's cast-after-multiply, Qwen3's per-head q/k norms,
`x * x` / `torch.square`, no-weight norms, `F.rms_norm`). From the anchor the pass walks
forward through casts and the weight multiply, and reads the rounding points off the
dtypes Dynamo recorded, so the op reproduces the eager numerics (a narrowing cast is never
stripped).
"""
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fastgrpo.kernels.rms_norm import MAX_HIDDEN_SIZE
from fastgrpo.passes._fx import (
    erase_unused,
    SUPPORTED_DTYPES, arg, binary_operands, dtype, is_empty, is_kind, is_scalar, is_tensor, is_widening_or_same,
    normalized_dim, only_user, other_operand, propagate_meta, shape, site_name, strip_widening_casts,
)
from fastgrpo.passes._record import PatternRecord

NAME = "rms_norm"


class Miss(Exception):
    """The structure is RMSNorm but a check failed: left alone and reported with this reason."""


@dataclass
class _Norm:
    source: fx.Node          # the un-normalised input (before widening casts)
    eps: Any
    weight: fx.Node | None
    offset: float
    weight_in_fp32: bool
    out: fx.Node             # last node of the pattern; its users get the op's output
    nodes: list[fx.Node]     # every node the op replaces


def _square_of(node: Any) -> Any:
    """x for x**2, x*x or square(x); else None."""
    if is_kind(node, "pow") and is_scalar(arg(node, 1, "exponent"), 2.0):
        return arg(node, 0, "input")
    if is_kind(node, "square"):
        return arg(node, 0, "input")
    if is_kind(node, "mul"):
        a, b = binary_operands(node)
        if a is b:
            return a
    return None


def _is_centred(x: Any) -> bool:
    """`t - t.mean(-1, keepdim=True)`: the variance of a LayerNorm (Cohere's), not an RMSNorm."""
    x = strip_widening_casts(x)
    if not is_kind(x, "sub"):
        return False
    t, m = binary_operands(x)
    return is_kind(m, "mean") and strip_widening_casts(arg(m, 0, "input")) is strip_widening_casts(t)


def _rstd_users(denominator: fx.Node) -> list[tuple[fx.Node, str]]:
    """Nodes that turn `variance + eps` into a scale for x: (node, how it applies)."""
    found = []
    for user in denominator.users:
        if is_kind(user, "rsqrt") or (is_kind(user, "pow") and is_scalar(arg(user, 1, "exponent"), -0.5)):
            found.append((user, "mul"))
        elif is_kind(user, "sqrt"):
            found.append((user, "div"))
    return found


def _normalized(x_fp: fx.Node, scale: fx.Node, how: str) -> list[fx.Node]:
    """The nodes computing x * rstd (or x / sqrt(...), or x * (1/sqrt(...))), the last one
    being the normalised value."""
    if how == "div":
        for user in scale.users:
            if is_kind(user, "div") and arg(user, 1, "other") is scale:
                if strip_widening_casts(arg(user, 0, "input")) is strip_widening_casts(x_fp):
                    return [user]
            if is_kind(user, "reciprocal") or (is_kind(user, "div") and is_scalar(arg(user, 0, "input"), 1.0)):
                return [user, *_normalized(x_fp, user, "mul")]
        raise Miss("sqrt of the variance is not used to divide the input")
    for user in scale.users:
        # `x * rsqrt(...).to(x.dtype)` (DeepSeek-V4): the scale may pass through casts first, and through
        # `* 1.0` (torch 2.11's Dynamo traces `1.0 / t` as Tensor.__rdiv__: `t.reciprocal() * 1.0`).
        passed_through, factor = [], scale
        while only_user(user) is not None and (
            is_kind(user, "cast") or (is_kind(user, "mul") and is_scalar(other_operand(user, factor), 1.0))
        ):
            passed_through.append(user)
            factor, user = user, only_user(user)
        if is_kind(user, "mul"):
            other = other_operand(user, factor)
            if strip_widening_casts(other) is strip_widening_casts(x_fp):
                for step in passed_through:
                    if is_kind(step, "cast") and not is_widening_or_same(dtype(step.args[0]), dtype(step)):
                        raise Miss(f"the inverse RMS is rounded to {dtype(step)} before it scales the input: "
                                   f"a rounding the op does not reproduce")
                return [*passed_through, user]
    raise Miss("the inverse RMS is not multiplied into the same input")


def _weight_of(mul: fx.Node, value: fx.Node, hidden: Any) -> tuple[fx.Node, float] | None:
    """(weight, offset) when `mul` multiplies `value` by a [H] weight (or `1 + weight`)."""
    factor = strip_widening_casts(other_operand(mul, value))
    offset = 0.0
    if is_kind(factor, "add"):
        a, b = binary_operands(factor)
        scalar, tensor = (a, b) if is_scalar(a) else (b, a)
        if not is_scalar(scalar) or not is_tensor(tensor):
            return None
        offset, factor = float(scalar), strip_widening_casts(tensor)
    factor_shape = shape(factor)
    if factor_shape is None or len(factor_shape) != 1:
        return None
    if isinstance(hidden, int) and isinstance(factor_shape[0], int) and factor_shape[0] != hidden:
        return None
    return factor, offset


def _match(mean: fx.Node) -> _Norm | None:
    """RMSNorm anchored at `mean`, None if `mean` is not a mean of squares, Miss if it is but fails."""
    if not is_kind(mean, "mean"):
        return None
    x_fp = _square_of(arg(mean, 0, "input"))
    if x_fp is None or not is_tensor(x_fp) or _is_centred(x_fp):
        return None
    denominator = only_user(mean)
    if not is_kind(denominator, "add"):
        return None
    eps = other_operand(denominator, mean)
    if not is_scalar(eps):
        return None
    scales = _rstd_users(denominator)
    if len(scales) != 1:
        return None
    scale, how = scales[0]

    # From here on the structure is RMSNorm: failures are near misses, reported.
    rank = len(shape(x_fp))
    if normalized_dim(arg(mean, 1, "dim"), rank) != rank - 1:
        raise Miss(f"mean over dim {arg(mean, 1, 'dim')}, not the last dim")
    if not arg(mean, 2, "keepdim", False):
        raise Miss("mean without keepdim=True")
    if not isinstance(eps, torch.fx.Node) and float(eps) <= 0:
        raise Miss(f"epsilon {eps} is not positive")
    source = strip_widening_casts(x_fp)
    _check_input(source)
    normalizing = _normalized(x_fp, scale, how)
    normalized = normalizing[-1]
    nodes = [n for n in (x_fp, arg(mean, 0, "input"), mean, denominator, scale) if n is not source]
    nodes += normalizing

    # Walk forward through casts and at most one weight multiply.
    hidden = shape(source)[-1]
    out, weight, offset, value_dtypes = normalized, None, 0.0, []
    while (user := only_user(out)) is not None:
        if is_kind(user, "cast") and dtype(user) is not None:
            value_dtypes.append(dtype(user))
        elif weight is None and is_kind(user, "mul") and (found := _weight_of(user, out, hidden)):
            weight, offset = found
            product_dtype = dtype(user)
            entering = value_dtypes[-1] if value_dtypes else dtype(normalized)
            factor = other_operand(user, out)
            value_dtypes = []
        else:
            break
        nodes.append(user)
        out = user
    if weight is None:
        weight_in_fp32 = True
        _check_no_rounding(value_dtypes, dtype(out))
        return _Norm(source, eps, None, 0.0, weight_in_fp32, out, nodes)

    x_dtype, w_dtype = dtype(source), dtype(weight)
    if w_dtype not in SUPPORTED_DTYPES:
        raise Miss(f"weight dtype {w_dtype} is not float32/float16/bfloat16")
    if entering == torch.float32 and product_dtype == torch.float32:
        weight_in_fp32 = True
    elif entering == x_dtype and product_dtype == torch.promote_types(x_dtype, w_dtype):
        weight_in_fp32 = False
        if strip_widening_casts(factor) is not weight and dtype(factor) != w_dtype:
            raise Miss(f"weight offset computed in {dtype(factor)}, not the weight's {w_dtype}")
    else:
        raise Miss(
            f"normalised value enters the weight multiply as {entering} and the product is {product_dtype}: "
            f"neither the fp32 nor the input-dtype ({x_dtype}) rounding"
        )
    _check_no_rounding(value_dtypes, dtype(out))
    return _Norm(source, eps, weight, offset, weight_in_fp32, out, nodes)


def _check_input(x: fx.Node) -> None:
    """What the op cannot take, found at compile time rather than raised by the kernel at run time."""
    if dtype(x) not in SUPPORTED_DTYPES:
        raise Miss(f"input dtype {dtype(x)} is not float32/float16/bfloat16")
    hidden = shape(x)[-1]
    if isinstance(hidden, int) and hidden > MAX_HIDDEN_SIZE:
        raise Miss(f"hidden size {hidden} exceeds {MAX_HIDDEN_SIZE}, the widest row the kernel holds")
    if is_empty(x):
        raise Miss(f"zero-size input {shape(x)}: nothing to accelerate")


def _check_no_rounding(cast_dtypes: list, final: torch.dtype) -> None:
    """Casts after the last computed value may only end in the output dtype without passing
    through a narrower one (the op rounds once, to the output dtype)."""
    for d in cast_dtypes:
        if not is_widening_or_same(final, d):
            raise Miss(f"output passes through {d} before {final}: a rounding the op does not reproduce")


def _residual_add(source: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) when the norm input is `a + b` of two same-shape float tensors (the decoder's residual)."""
    if not is_kind(source, "add") or "alpha" in source.kwargs or len(source.args) > 2:
        return None
    a, b = binary_operands(source)
    if not (is_tensor(a) and is_tensor(b)):
        return None
    if shape(a) != shape(source) or shape(b) != shape(source):
        return None
    if dtype(a) not in (torch.float32, torch.float16, torch.bfloat16) or dtype(b) not in (
        torch.float32, torch.float16, torch.bfloat16
    ):
        return None
    return a, b


def _replace(graph: fx.Graph, norm: _Norm, fuse_residual: bool) -> str:
    ops = torch.ops.fastgrpo
    tail = (norm.weight, norm.eps, norm.offset, norm.weight_in_fp32, dtype(norm.out))
    residual = _residual_add(norm.source) if fuse_residual else None
    if residual is not None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_use = min((u for u in norm.source.users if u not in norm.nodes), key=order.get, default=None)
        anchor = norm.out if first_use is None or order[norm.out] < order[first_use] else first_use
        inputs = [n for n in (norm.weight, norm.eps) if isinstance(n, fx.Node)]
        if all(order[n] < order[anchor] for n in inputs):
            with graph.inserting_before(anchor):
                fused = graph.call_function(ops.add_rms_norm.default, (*residual, *tail))
                total = graph.call_function(operator.getitem, (fused, 0))
                normed = graph.call_function(operator.getitem, (fused, 1))
            propagate_meta(total, norm.source)
            propagate_meta(normed, norm.out)
            fused.meta["example_value"] = (total.meta.get("example_value"), normed.meta.get("example_value"))
            norm.out.replace_all_uses_with(normed)
            norm.source.replace_all_uses_with(total)
            erase_unused(graph, norm.nodes + [norm.source])
            return "add_rms_norm"
    with graph.inserting_before(norm.out):
        new = graph.call_function(ops.rms_norm.default, (norm.source, *tail))
    propagate_meta(new, norm.out)
    norm.out.replace_all_uses_with(new)
    erase_unused(graph, norm.nodes)
    return "rms_norm"



def _form(norm: _Norm) -> str:
    parts = []
    if norm.weight is None:
        parts.append("no weight")
    else:
        parts.append("weight in fp32" if norm.weight_in_fp32 else "weight in input dtype")
    if norm.offset:
        parts.append(f"offset {norm.offset:g}")
    return ", ".join(parts)


def _match_functional(node: fx.Node) -> _Norm | None:
    """`F.rms_norm(x, (H,), weight, eps)`: torch computes it in fp32 and casts back to x's dtype."""
    x = arg(node, 0, "input")
    normalized_shape = arg(node, 1, "normalized_shape")
    if not isinstance(normalized_shape, (list, tuple)) or len(normalized_shape) != 1:
        raise Miss(f"F.rms_norm over {normalized_shape}: only the last dim is supported")
    _check_input(x)
    weight = arg(node, 2, "weight")
    if weight is not None and dtype(weight) not in SUPPORTED_DTYPES:
        raise Miss(f"weight dtype {dtype(weight)} is not float32/float16/bfloat16")
    eps = arg(node, 3, "eps")
    if eps is None:
        eps = torch.finfo(dtype(x)).eps
    return _Norm(x, eps, weight, 0.0, True, node, [node])


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.graph is not graph:  # erased by an earlier rewrite
            continue
        try:
            norm = _match_functional(node) if is_kind(node, "rms_norm") else _match(node)
        except Miss as miss:
            record.miss(site_name(node), str(miss))
            continue
        if norm is None:
            continue
        site = site_name(norm.out)
        form = _replace(graph, norm, options.fuse_residual_add)
        record.match(site, f"{form} ({_form(norm)})")
    graph.lint()
    gm.recompile()
