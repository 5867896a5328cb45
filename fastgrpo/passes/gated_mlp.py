"""The gated MLP - `down(act(gate(x)) * up(x))`, SwiGLU or GeGLU - becomes `fastgrpo::gated_mlp`,
which keeps only x for backward and recomputes the two [tokens x intermediate]
projections, the activation and their product: memory that inductor's partitioner would save, since
it does not recompute matmuls. With the backend option `save_mlp_projections` (what
`compiler.options.training_options` picks for layers under HF's checkpointing with padded batches: their
forward is re-run anyway) it keeps the two projections instead and recomputes only the activation and the
product.

The down projection is absorbed too when it is a bias-free linear or PEFT LoRA linear that
alone reads the product: then neither the product h (which the down adapter's autograd would
save) nor its gradient exists in full, only chunk by chunk inside the op. When the op's output
only flows, through casts, dropout and the residual add, into the graph's one returned tensor (a decoder layer
without a post-MLP norm), no saved tensor depends on it, and the op is told so (`skip_output_on_recompute`):
an offloaded checkpoint's recompute of the layer then skips the activation and the down projection,
and without save_mlp_projections the whole MLP.

Anchor: `act(g) * u` (either order) with act = SiLU (also written `g * sigmoid(g)`) or
tanh-GELU; other activations (exact GELU, ReLU, squared ReLU, swish with a slope) are
reported as near misses. The projections g and u are absorbed when each is a bias-free
linear of the same x - plain, a PEFT LoRA linear (`base(x) + B(A(x.to(A.dtype))) * scale`,
cast back), or a half of a fused `gate_up` projection taken with `chunk(2, -1)` (Phi3).
Anything else (bnb 4-bit, biases, LoRA dropout, DoRA, unknown producers such as MoE expert
matmuls) falls back to `fastgrpo::act_mul`, which saves g and u and recomputes only the
activation; the report says which form each site got and why.
"""
import math
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from fastgrpo.kernels import act_mul as _act_mul_op, gated_mlp as _gated_mlp_op  # noqa: F401  (register the ops)
from fastgrpo.passes._fx import (
    erase_unused,
    SUPPORTED_DTYPES, arg, binary_operands, dtype, is_empty, is_kind, is_scalar, other_operand, propagate_meta, shape,
    site_name, strip_widening_casts, value,
)
from fastgrpo.passes._record import PatternRecord

NAME = "gated_mlp"


class Unabsorbable(Exception):
    """The projections cannot be folded into the op (the site falls back to act_mul)."""


@dataclass
class _Projection:
    x: fx.Node
    weight: fx.Node | tuple[fx.Node, int]     # a weight, or (fused weight, half index)
    lora_a: fx.Node | None = None
    lora_b: fx.Node | tuple[fx.Node, int] | None = None
    scale: float | fx.Node | None = None
    nodes: tuple[fx.Node, ...] = ()


def _activation(node) -> tuple[str, fx.Node, list[fx.Node]] | None:
    """(name, input, the nodes computing it in graph order) for an activation: SiLU and GELU, SiLU
    written out as `x * sigmoid(x)`, and - to be reported, not fused - swish with a slope
    (`x * sigmoid(a * x)`, GPT-OSS), ReLU and squared ReLU (BitNet)."""
    if is_kind(node, "silu"):
        return "silu", arg(node, 0, "input"), [node]
    if is_kind(node, "gelu"):
        approximate = arg(node, 1, "approximate", "none")
        return (f"gelu_{approximate}" if approximate != "none" else "gelu"), arg(node, 0, "input"), [node]
    if is_kind(node, "relu"):
        return "relu", arg(node, 0, "input"), [node]
    if (is_kind(node, "square") or (is_kind(node, "pow") and is_scalar(arg(node, 1, "exponent"), 2.0))) and is_kind(
        relu := arg(node, 0, "input"), "relu"
    ):
        return "squared relu", arg(relu, 0, "input"), [relu, node]
    if is_kind(node, "mul"):
        for x, sigmoid in (binary_operands(node), binary_operands(node)[::-1]):
            if not is_kind(sigmoid, "sigmoid"):
                continue
            inner = arg(sigmoid, 0, "input")
            if inner is x:
                return "silu", x, [sigmoid, node]
            if is_kind(inner, "mul") and x in binary_operands(inner):
                slope = other_operand(inner, x)
                if is_scalar(slope) and not isinstance(slope, fx.Node):
                    return f"swish with slope {float(slope):g}", x, [inner, sigmoid, node]
    return None


def _plain_linear(node) -> tuple[fx.Node, fx.Node] | None:
    if is_kind(node, "linear") and arg(node, 2, "bias") is None:
        return arg(node, 0, "input"), arg(node, 1, "weight")
    return None


def _lora_branch(node) -> tuple[fx.Node, fx.Node, fx.Node, float, list[fx.Node]] | None:
    """(x, A, B, scale, nodes) for `B(A(x')) * scale` where x' is x, maybe cast (PEFT's adapter path)."""
    if not is_kind(node, "mul"):
        return None
    a, b = binary_operands(node)
    branch, scale = (a, b) if is_scalar(b) else (b, a)
    # The scale is a Python float, or - when Dynamo traces floats as inputs (dynamic=True) - a node
    # holding a symbolic float (PEFT's `scaling[adapter]` read off the module).
    if not is_scalar(scale) or (down := _plain_linear(branch)) is None:
        return None
    lora_out, lora_b = down
    if (up := _plain_linear(lora_out)) is None:
        return None
    x_in, lora_a = up
    if is_kind(x_in, "dropout"):
        if arg(x_in, 1, "p", 0.5) != 0.0 or not isinstance(arg(x_in, 1, "p", 0.5), (int, float)):
            raise Unabsorbable("LoRA dropout > 0 (set lora_dropout=0 to fuse this MLP)")
        x_in = arg(x_in, 0, "input")
    scale = scale if isinstance(scale, fx.Node) else float(scale)
    return strip_widening_casts(x_in), lora_a, lora_b, scale, [node, branch, lora_out]


def _projection(node: fx.Node) -> _Projection:
    """What produced one input of `act(g) * u`, if the op can recompute it from x."""
    nodes = []
    if is_kind(node, "cast"):  # PEFT casts the base + adapter sum back to the input dtype
        nodes.append(node)
        node = node.args[0]
    if is_kind(node, "getitem") and is_kind(node.args[0], "chunk"):
        chunk = node.args[0]
        if arg(chunk, 1, "chunks") != 2 or arg(chunk, 2, "dim", 0) not in (-1, len(shape(chunk.args[0])) - 1):
            raise Unabsorbable("fused gate_up split other than chunk(2, -1)")
        fused = _projection(chunk.args[0])
        half = node.args[1]
        return _Projection(
            fused.x, (fused.weight, half), fused.lora_a,
            None if fused.lora_b is None else (fused.lora_b, half), fused.scale, (*nodes, node, *fused.nodes),
        )
    if (plain := _plain_linear(node)) is not None:
        return _Projection(*plain, nodes=(*nodes, node))
    if is_kind(node, "add"):
        a, b = binary_operands(node)
        for base, branch in ((a, b), (b, a)):
            plain, lora = _plain_linear(base), _lora_branch(branch)
            if plain is not None and lora is not None:
                x, lora_a, lora_b, scale, lora_nodes = lora
                if x is not strip_widening_casts(plain[0]):  # a same-dtype cast (Gemma's type_as) may sit between
                    raise Unabsorbable("the LoRA adapter reads another input than its base linear")
                return _Projection(plain[0], plain[1], lora_a, lora_b, scale, (*nodes, node, base, *lora_nodes))
    if is_kind(node, "linear"):
        raise Unabsorbable("projection has a bias")
    raise Unabsorbable(f"projection produced by {_describe(node)}, not a linear")


@dataclass
class _Down:
    weight: fx.Node
    lora_a: fx.Node | None
    lora_b: fx.Node | None
    scale: float | fx.Node | None
    nodes: tuple[fx.Node, ...]   # replaced, in graph order
    output: fx.Node              # what the op's result stands for


def _down_projection(product: fx.Node) -> _Down:
    """The down projection when it alone reads the product: a bias-free linear, or PEFT's
    `(base(h) + B(A(h')) * scale).to(h.dtype)` with h' h itself or a widening cast of it."""
    users = list(product.users)
    linears = [u for u in users if (p := _plain_linear(u)) is not None and p[0] is product]
    if len(users) == 1 and linears:
        weight = _plain_linear(linears[0])[1]
        if dtype(weight) != dtype(product):
            raise Unabsorbable(f"down projection weight {dtype(weight)} does not match the MLP's {dtype(product)}")
        return _Down(weight, None, None, None, (linears[0],), linears[0])
    for base in linears:  # the LoRA adapter's A may read the product directly too
        add = next(iter(base.users)) if len(base.users) == 1 else None
        lora = _lora_branch(other_operand(add, base)) if is_kind(add, "add") else None
        if lora is not None and lora[0] is product:
            break
    else:
        raise Unabsorbable("the product is read by something other than one bias-free linear or a PEFT LoRA linear")
    weight = _plain_linear(base)[1]
    _, lora_a, lora_b, scale, lora_nodes = lora
    path = []  # casts (and p=0 dropout) between the product and the adapter's A
    node = arg(lora_nodes[-1], 0, "input")
    while node is not product:
        path.append(node)
        node = node.args[0]
    output = add
    if dtype(add) != dtype(product):
        output = next(iter(add.users)) if len(add.users) == 1 else None
        if not (is_kind(output, "cast") and dtype(output) == dtype(product)):
            raise Unabsorbable(f"the down projection's output is used as {dtype(add)}")
    nodes = (base, *path[::-1], *lora_nodes[::-1], add, *([output] if output is not add else []))
    inside = set(nodes)
    if any(user not in inside for n in (product, *nodes) if n is not output for user in n.users):
        raise Unabsorbable("a value inside the down projection is used outside it")
    if any(dtype(w) != dtype(lora_a) for w in (lora_a, lora_b)) or dtype(weight) != dtype(product):
        raise Unabsorbable("down projection weights do not match the MLP's dtype")
    return _Down(weight, lora_a, lora_b, scale, nodes, output)


def _describe(node) -> str:
    """A stable, readable name for what a node computes (no object addresses in the report)."""
    if not isinstance(node, fx.Node):
        return repr(node)
    target = node.target
    if isinstance(target, str):
        return f"'{target}'"
    if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _weight_half(graph: fx.Graph, weight, rows: int) -> fx.Node:
    """A plain weight, or one half (rows of it) of a fused [2I, ...] weight, as a graph node."""
    if isinstance(weight, tuple):
        fused, half = weight
        return graph.call_function(operator.getitem, (fused, slice(half * rows, (half + 1) * rows)))
    return weight


def _scaled_lora_b(graph: fx.Graph, lora_b, scale):
    """B * scale, for a plain B or the fused B of a (fused, half) pair: (x A^T) B^T s = x A^T (s B)^T."""
    if isinstance(lora_b, tuple):
        return graph.call_function(operator.mul, (lora_b[0], scale)), lora_b[1]
    return graph.call_function(operator.mul, (lora_b, scale))


def _only_summed_into_the_output(node: fx.Node, summed: bool = False) -> bool:
    """Whether node's value only flows, through dtype casts, dropout and at least one addition (a residual add),
    into the graph's single returned tensor: then no tensor saved for backward depends on it. Casts and additions
    save no operand's value (PEFT casts its LoRA result back); dropout (Phi3's residual dropout) saves a mask
    drawn from the RNG whatever the values, and the checkpoint replays the RNG. A graph cut short by a graph break
    returns what the code after the break reads, which may save it: the op's own output returned, or a graph with
    more than one returned tensor, does not count."""
    for user in node.users:
        if user.op == "output":
            if not summed or sum(isinstance(v, fx.Node) for v in pytree.tree_leaves(user.args)) != 1:
                return False
        elif is_kind(user, "add", "sub"):
            if not _only_summed_into_the_output(user, summed=True):
                return False
        elif not is_kind(user, "cast", "dropout") or not _only_summed_into_the_output(user, summed):
            return False
    return True


def _emit_fused(graph: fx.Graph, product: fx.Node, activation: str, gate: _Projection, up: _Projection,
                down: _Down | None, save_projections: bool) -> bool:
    """Puts the op in place of the MLP; returns whether it may skip its output on a checkpoint's recompute."""
    inter = shape(product)[-1]
    scales = {p.scale for p in (gate, up) if p.scale is not None}
    # The op takes one Python-float scale. A symbolic scale, or two different ones, is folded into each
    # B factor instead (a [I, r] multiply; exact for PEFT's usual power-of-two alpha / r).
    fold = len(scales) > 1 or any(isinstance(s, fx.Node) for s in scales)
    output = product if down is None else down.output
    skip_output_on_recompute = _only_summed_into_the_output(output)
    with graph.inserting_before(output):
        args = [gate.x, _weight_half(graph, gate.weight, inter), _weight_half(graph, up.weight, inter)]
        for p in (gate, up):
            lora_b = p.lora_b
            if fold and lora_b is not None:
                lora_b = _scaled_lora_b(graph, lora_b, p.scale)
            args += [p.lora_a, None if lora_b is None else _weight_half(graph, lora_b, inter)]
        args += [1.0 if fold or not scales else scales.pop(), activation]
        if down is None:
            args += [None, None, None, 1.0]
        else:
            down_b, down_scale = down.lora_b, 1.0 if down.scale is None else down.scale
            if isinstance(down_scale, fx.Node):
                down_b, down_scale = _scaled_lora_b(graph, down_b, down_scale), 1.0
            args += [down.weight, down.lora_a, down_b, down_scale]
        new = graph.call_function(torch.ops.fastgrpo.gated_mlp.default,
                                  (*args, save_projections, skip_output_on_recompute))
        result = graph.call_function(operator.getitem, (new, 0))
    propagate_meta(new, product)
    propagate_meta(result, output)
    example = value(output)
    if example is not None:
        rows = math.prod(shape(gate.x)[:-1])
        with example.fake_mode:
            saved = example.new_empty((rows, 2 * inter) if save_projections else (0,))
        new.meta["example_value"] = (example, saved)
    output.replace_all_uses_with(result)
    return skip_output_on_recompute


def _emit_fallback(graph: fx.Graph, product: fx.Node, activation: str, g: fx.Node, u: fx.Node) -> None:
    with graph.inserting_before(product):
        new = graph.call_function(torch.ops.fastgrpo.act_mul.default, (g, u, activation))
    propagate_meta(new, product)
    product.replace_all_uses_with(new)



def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    for product in list(graph.nodes):
        if product.graph is not graph or not is_kind(product, "mul"):
            continue
        a, b = binary_operands(product)
        act_node, other = (a, b) if _activation(a) else (b, a)
        found = _activation(act_node)
        if found is None or len(act_node.users) != 1 or not isinstance(other, fx.Node):
            continue
        activation, g, act_nodes = found
        if strip_widening_casts(other) is strip_widening_casts(g):
            continue  # x * act(x) is an activation written out, not a gate
        u = other
        site = site_name(product)
        if activation not in ("silu", "gelu_tanh"):
            record.miss(site, f"activation {activation} is not SiLU or tanh-GELU")
            continue
        if shape(g) != shape(u) or dtype(g) != dtype(u) or dtype(g) not in SUPPORTED_DTYPES:
            record.miss(site, f"gate {shape(g)} {dtype(g)} and up {shape(u)} {dtype(u)} differ or are not "
                              f"float32/float16/bfloat16")
            continue
        if is_empty(g):
            record.miss(site, f"zero-size gate and up {shape(g)}: nothing to accelerate")
            continue
        try:
            if not options.absorb_mlp_projections:
                raise Unabsorbable("absorb_mlp_projections=False (keeps gate and up: under gradient checkpointing "
                                   "the recompute would be paid twice)")
            gate, up = _projection(g), _projection(u)
            if gate.x is not up.x:
                raise Unabsorbable("gate and up read different inputs")
            if dtype(gate.x) != dtype(product):
                raise Unabsorbable(f"input dtype {dtype(gate.x)} differs from the MLP's {dtype(product)}")
            for p in (gate, up):
                weights = [w[0] if isinstance(w, tuple) else w for w in (p.weight, p.lora_a, p.lora_b) if w is not None]
                if dtype(weights[0]) != dtype(gate.x) or len({dtype(w) for w in weights[1:]}) > 1:
                    raise Unabsorbable(f"projection weights {[str(dtype(w)) for w in weights]} do not match the "
                                       f"input dtype {dtype(gate.x)} (LoRA factors must share one dtype)")
            if any(user not in act_nodes for user in g.users) or len(u.users) != 1:
                raise Unabsorbable("gate or up projection is used outside the MLP")
            try:
                down, with_down = _down_projection(product), "with down projection"
            except Unabsorbable as why:
                down, with_down = None, f"down projection not absorbed: {why}"
            skips = _emit_fused(graph, product, activation, gate, up, down, options.save_mlp_projections)
            erase_unused(graph, [*gate.nodes[::-1], *up.nodes[::-1], *act_nodes, product,
                                 *(down.nodes if down is not None else ())])
            lora = "LoRA " if gate.lora_a is not None or up.lora_a is not None else ""
            fused = "fused gate_up, " if isinstance(gate.weight, tuple) else ""
            keeps = "saves projections" if options.save_mlp_projections else "recomputes projections"
            recompute = "output skipped in checkpoint recompute" if skips else "output computed in checkpoint recompute"
            record.match(site, f"gated_mlp ({fused}{lora}{activation}, {keeps}; {with_down}; {recompute})")
        except Unabsorbable as why:
            _emit_fallback(graph, product, activation, g, u)
            erase_unused(graph, [*act_nodes, product])
            record.match(site, f"act_mul fallback ({activation}; saves gate and up): {why}")
    graph.lint()
    gm.recompile()
