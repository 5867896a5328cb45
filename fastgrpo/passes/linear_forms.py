"""Matmuls and einsums that compute a linear, written as `F.linear` before the patterns look for linears.

A model may write a projection as `F.linear(h, W)` (what `nn.Linear` does) or as `h @ W.t()`, `h @ W.T`,
`torch.matmul(h, W.t())`, `h.matmul(W.transpose(0, 1))`, `torch.mm(h, W.t())`, `torch.addmm(b, h, W.t())`,
`torch.einsum("td,vd->tv", h, W)` or `torch.einsum("...d,vd->...v", h, W)`: each is `F.linear(h, W)` (with bias b
for addmm), the same product of the same operands. The lm-head, gated-MLP and joined-projection patterns look for
linears; rewritten here first, every spelling is found where `F.linear` is. A 2-D product between reshapes, as a
batched model writes `mm` (`torch.mm(h.view(-1, d), W.t()).view(*h.shape[:-1], v)`), becomes one linear of the
[..., d] input h, whatever its leading dims. Tensors are left as they are: a linear's weight is the [out, in]
tensor, so only a product against a transposed 2-D tensor (`W.t()`, `.T`, `.mT`, `transpose`, `swapaxes`,
`permute(1, 0)`) or an einsum that indexes it [out, in] is one; `h @ M` with an [in, out] M stays a matmul.
"""
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fastgrpo.passes._fx import arg, erase_unused, is_kind, is_tensor, only_user, propagate_meta, shape, target_name

NAME = "linear_forms"


def _transposed_2d(node) -> fx.Node | None:
    """W for a node that is a 2-D tensor W transposed, else None."""
    if not isinstance(node, fx.Node) or len(shape(node) or ()) != 2:
        return None
    source, dims = arg(node, 0, "input"), None
    if is_kind(node, "t"):
        dims = (0, 1)
    elif node.op == "call_function" and target_name(node) == "getattr" and node.args[1] in ("T", "mT"):
        dims = (0, 1)
    elif is_kind(node, "transpose"):
        dims = (arg(node, 1, "dim0"), arg(node, 2, "dim1"))
    elif is_kind(node, "permute"):
        order = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        dims = (0, 1) if isinstance(order, (list, tuple)) and [d % 2 for d in order if isinstance(d, int)] == [1, 0] else None
    if dims is None or not all(isinstance(d, int) for d in dims) or {d % 2 for d in dims} != {0, 1}:
        return None
    return source if len(shape(source) or ()) == 2 else None


def _einsum_linear(node) -> tuple[fx.Node, fx.Node] | None:
    """(h, W) for `einsum(eq, h, W)` (or W first) whose equation is h's indices ending in d, W's "od" and the
    output h's indices with d replaced by o: `td,vd->tv`, `...d,vd->...v`, `bsd,vd->bsv`."""
    equation, operands = node.args[0], node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or equation.count("->") != 1:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    if len(specs) != 2:
        return None
    for (x_spec, w_spec), (x, w) in (((specs[0], specs[1]), operands), ((specs[1], specs[0]), operands[::-1])):
        body = x_spec.removeprefix("...")
        if (len(w_spec) == 2 and w_spec.isalpha() and w_spec[0] != w_spec[1] and body.isalpha()
                and len(set(body)) == len(body) and body.endswith(w_spec[1]) and w_spec[0] not in body
                and out == x_spec[:-1] + w_spec[0] and len(shape(w) or ()) == 2):
            return x, w
    return None


def _same_sizes(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _unreshaped(rows: fx.Node, product: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(h, restore) when `rows` is h [..., d] viewed as [N, d] and the product's one user views it back as
    [..., out]: the 2-D product is then a linear of h, standing for `restore`."""
    restore = only_user(product)
    if not (is_kind(rows, "view", "flatten") and (is_kind(restore, "view") or target_name(restore) == "unflatten")):
        return None
    h, rows_shape, out_shape = rows.args[0], shape(rows), shape(restore)
    h_shape = shape(h)
    if h_shape is None or out_shape is None or rows_shape is None or len(h_shape) < 2:
        return None
    if _same_sizes(h_shape[:-1], out_shape[:-1]) and _same_sizes(h_shape[-1:], rows_shape[-1:]) \
            and _same_sizes(out_shape[-1:], shape(product)[-1:]):
        return h, restore
    return None


def _linear_site(node: fx.Node):
    """(h, W, bias, the node the linear stands for, the nodes it replaces) for a product that is a linear."""
    bias = None
    if is_kind(node, "matmul", "addmm"):
        first = 1 if is_kind(node, "addmm") else 0
        if first:
            bias = arg(node, 0, "input")
            if arg(node, 3, "beta", 1) != 1 or arg(node, 4, "alpha", 1) != 1 or len(shape(bias) or ()) != 1:
                return None
        h = node.args[first] if len(node.args) > first else None
        right = node.args[first + 1] if len(node.args) > first + 1 else node.kwargs.get("other", node.kwargs.get("mat2"))
        weight = _transposed_2d(right)
        replaced = [right, node]
    elif is_kind(node, "einsum") and (found := _einsum_linear(node)) is not None:
        (h, weight), replaced = found, [node]
    else:
        return None
    if weight is None or not is_tensor(h) or (bias is not None and shape(bias)[0] != shape(weight)[0]):
        return None
    stands_for = node
    if len(shape(h) or ()) == 2 and (unreshaped := _unreshaped(h, node)) is not None:
        replaced = [h, *replaced, unreshaped[1]]
        h, stands_for = unreshaped
    return h, weight, bias, stands_for, replaced


def apply(gm: fx.GraphModule) -> int:
    """Rewrites every product that is a linear as `F.linear`; returns how many."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.graph is not graph or (site := _linear_site(node)) is None:
            continue
        h, weight, bias, stands_for, replaced = site
        with graph.inserting_before(node):  # where the product was: in its grad mode and autocast region
            linear = graph.call_function(F.linear, (h, weight) if bias is None else (h, weight, bias))
        propagate_meta(linear, node)  # the product's module path and stack, for the report
        for key in ("example_value", "val"):
            if key in stands_for.meta:
                linear.meta[key] = stands_for.meta[key]
        stands_for.replace_all_uses_with(linear)
        erase_unused(graph, replaced)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
