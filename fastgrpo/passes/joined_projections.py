"""Linear projections of one input joined into one matmul: q, k and v, and their LoRA A's.

An attention block multiplies its normalized input x by three projection weights (q, k, v) and,
under PEFT LoRA, by three rank-r A factors as well: six GEMMs that each read x ([tokens, hidden],
107 MB at 34,816 tokens of Qwen2.5-1.5B). Inductor keeps them apart. The three A products are
bound by that read (x @ A is ~32 us at rank 16 on an H200), and backward forms x's gradient as one
product per projection, each written out in full and summed afterwards. Joined, one GEMM reads x
once for each group, backward gets x's gradient of the group from one GEMM over the concatenated
output gradient and the weights' gradients from one GEMM as well, and the outputs are column
slices of the joined one (views: `.view(batch, tokens, heads, head_dim)` splits only the last dim).

A group is the linears that read the same value (casts written by the autocast pass included)
between the same side effects (grad mode, autocast), with weights of one dtype and width that all
require gradients or all do not, and with a bias on every one or none: a frozen base weight beside a
trainable A would make autograd form the joined weight's whole gradient to keep r rows of it. Trained
weights join only where each output reaches the graph's outputs with a gradient. Weights are
concatenated in the graph on every call (a few MB, the cost of a copy), so trained weights stay what
they are and PEFT sees no change. Outputs whose users view them in a way a column slice cannot take
(a `.view` that merges the last dim, an in-place op) keep their linear, reported.

The maths is the same: each output column is the same dot product, in the same dtype; only the GEMM's
summation order may differ. By default (option `join_projections=None`) only CUDA graphs are joined, where
the saved reads pay (H200, Qwen2.5-1.5B GRPO step at 4096 tokens: 732 against 743 ms, `python
bench/grpo_step.py --systems fastgrpo,fastgrpo_nojoin --completions 4096`); on the CPU nothing is gained and
fp32 results would move off stock TRL's in the last bits.
"""
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fastgrpo.passes._fx import (
    arg, call_with_example, error_summary, is_kind, site_name, target_name, value, value_key,
)
from fastgrpo.passes._record import PatternRecord

NAME = "joined_projections"


def _linear_parts(node: fx.Node) -> tuple | None:
    """(input, weight, bias) of a 2-D-weight linear node with tensor operands, or None."""
    x, weight, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or not isinstance(value(x), torch.Tensor):
        return None
    w = value(weight)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or (bias is not None and not isinstance(bias, fx.Node)):
        return None
    return x, weight, bias


def _group_key(region, x, weight, bias):
    w = value(weight)
    b = value(bias) if bias is not None else None
    return (region, value_key(x), w.dtype, w.device, w.shape[1], w.requires_grad,
            None if b is None else (b.dtype, b.requires_grad))


def _takes_column_slice(node: fx.Node) -> bool:
    """Whether every user of the linear `node` takes a column slice of a wider output as well: a `.view` must
    keep the leading dims (it may split the last one); reshape, pointwise ops and matmuls take any strides.
    In-place ops are left alone (they would write into the joined output, which other outputs view)."""
    out = value(node)
    for user in node.users:
        name = target_name(user)
        if name.endswith("_") and not name.endswith("__"):
            return False
        if not (user.op == "call_method" and user.target == "view" or user.target is torch.Tensor.view):
            continue
        viewed = value(user)
        if not isinstance(viewed, torch.Tensor) or not _same_sizes(viewed.shape[: out.dim() - 1], out.shape[:-1]):
            return False
    return True


def _feeds_gradient(node: fx.Node, grad_enabled: dict) -> bool:
    """Whether `node`'s value reaches a graph output along a path autograd differentiates: not through integer or
    boolean values (top-k indices, comparisons), `detach`, or a stretch under `torch.no_grad()`. A trained weight
    whose output reaches none (DeepSeek-V4's indexer feeds only top-k indices) has no gradient in eager, where
    joined it would get zeros from the joined weight's: an optimizer would then move it (weight decay, momentum)."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                return True
            example = value(user)
            if (user in seen or not grad_enabled.get(user, True) or target_name(user) == "detach"
                    or isinstance(example, torch.Tensor) and not example.dtype.is_floating_point):
                continue
            seen.add(user)
            stack.append(user)
    return False


def _grad_enabled(graph: fx.Graph) -> dict:
    """Each node's grad mode, from the graph's own `torch._C._set_grad_enabled` calls (the mode the graph was
    traced in at first)."""
    enabled, modes = torch.is_grad_enabled(), {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        modes[node] = enabled
    return modes


def _same_sizes(a, b) -> bool:
    """Sizes equal for every value of the symbols in them (asking no guard of Dynamo)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _regions(graph: fx.Graph) -> dict:
    """Each node's stretch of the graph between side effects (a grad-mode switch, an autocast region's entry or
    exit, ...): numbered in graph order, a side effect starting the next one."""
    region, regions = 0, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.is_impure():
            region += 1
        regions[node] = region
    return regions


def _movable_before(node: fx.Node, point: fx.Node, order: dict, regions: dict) -> bool:
    """Whether `node` (a weight or bias operand) is defined before `point`, or can be moved there: a pure
    call (the autocast pass's `A.to(bf16)`) whose own operands are all defined before `point`, in point's
    stretch between side effects (so it stays in the same grad mode and autocast region)."""
    if order[node] < order[point]:
        return True
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    return regions[node] == regions[point] and all(order[a] < order[point] for a in node.all_input_nodes)


def _group_site(paths: list[str]) -> str:
    """`layers.0.self_attn.{q_proj, k_proj, v_proj}.base_layer` for the members' module paths."""
    split = [p.split(".") for p in paths]
    head = 0
    while all(len(s) > head + 1 and s[head] == split[0][head] for s in split):
        head += 1
    tail = 0
    while all(len(s) > head + tail + 1 and s[-1 - tail] == split[0][-1 - tail] for s in split):
        tail += 1
    middles = [".".join(s[head:len(s) - tail]) for s in split]
    return ".".join([*split[0][:head], "{" + ", ".join(middles) + "}", *split[0][len(split[0]) - tail:]])


def _join(graph: fx.Graph, members: list[fx.Node], parts: list[tuple], order: dict) -> str | None:
    """Rewrites the group; returns None, or why it could not (the graph is then as it was, but for weight casts
    moved up to the first member, which changes nothing)."""
    first = min(members, key=order.__getitem__)
    for _, weight, bias in parts:
        for operand in (weight, bias):
            if operand is not None and order[operand] > order[first]:
                first.prepend(operand)
    x = arg(first, 0, "input")
    widths = [value(weight).shape[0] for _, weight, _ in parts]
    created = []
    try:
        with graph.inserting_before(first):
            created.append(call_with_example(graph, torch.cat, ([w for _, w, _ in parts], 0)))
            bias = None
            if parts[0][2] is not None:
                bias = call_with_example(graph, torch.cat, ([b for _, _, b in parts], 0))
                created.append(bias)
            joined = call_with_example(graph, torch.nn.functional.linear, (x, created[0], bias))
            created.append(joined)
            starts = [sum(widths[:i]) for i in range(len(widths))]
            pieces = []
            for start, width in zip(starts, widths):
                pieces.append(call_with_example(graph, torch.narrow, (joined, -1, start, width)))
                created.append(pieces[-1])
    except Exception as error:  # the example values of the new nodes (a symbolic size it cannot take, ...)
        for node in reversed(created):
            graph.erase_node(node)
        return f"the joined nodes could not be built ({error_summary(error)})"
    for member, piece in zip(members, pieces):
        piece.meta["nn_module_stack"] = member.meta.get("nn_module_stack")
        member.replace_all_uses_with(piece)
        graph.erase_node(member)
    return None


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    if options.join_projections is False:
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    regions, grad_enabled = _regions(graph), _grad_enabled(graph)
    groups: dict = {}
    # Linears join only within one stretch between side effects: a grad-mode switch (`torch.no_grad()` around an
    # indexer, as DeepSeek-V4 has) or an autocast region changes what a linear computes or records for backward.
    for node in graph.nodes:
        if is_kind(node, "linear"):
            parts = _linear_parts(node)
            # By default CUDA weights only (module docstring).
            if parts is not None and (options.join_projections or value(parts[1]).device.type == "cuda"):
                groups.setdefault(_group_key(regions[node], *parts), []).append((node, parts))
    changed = False
    for group in groups.values():
        members = [node for node, _ in group]
        if len(members) < 2:
            continue
        site = _group_site([site_name(m) for m in members])
        kept = [m for m in members if not _takes_column_slice(m)]
        if kept:
            record.miss(site, f"{', '.join(m.name for m in kept)} used in a way a column slice cannot take (a .view "
                              "merging the last dim, an in-place op): not joined")
            continue
        operands = [t for _, parts in group for t in parts[1:] if t is not None]
        # (under no_grad nothing gets a gradient, joined or not)
        if grad_enabled[members[0]] and any(value(t).requires_grad for t in operands):
            unused = [m for m in members if not _feeds_gradient(m, grad_enabled)]
            if unused:
                record.miss(site, f"{', '.join(m.name for m in unused)} reach no output with a gradient: their "
                                  "trained weights get none in eager, joined they would get zeros: not joined")
                continue
        first = min(members, key=order.__getitem__)
        if not all(_movable_before(t, first, order, regions) for t in operands):
            record.miss(site, "a weight or bias is computed after the first projection from other values: not joined")
            continue
        failure = _join(graph, members, [parts for _, parts in group], order)
        if failure is not None:
            record.miss(site, f"{failure}: not joined")
            continue
        record.match(site, f"{len(members)} linears in one GEMM, widths "
                           f"{'+'.join(str(value(p[1]).shape[0]) for _, p in group)}")
        order, grad_enabled = {node: i for i, node in enumerate(graph.nodes)}, _grad_enabled(graph)
        changed = True
    if changed:
        gm.recompile()
