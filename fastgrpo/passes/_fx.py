"""One vocabulary for the many spellings of an op in a Dynamo FX graph.

Dynamo hands the backend torch-level graphs in which the same operation shows up as a
`call_method` ("mul"), an `operator` function (`operator.mul`), a `torch` function
(`torch.mul`), a `torch.Tensor` method object or an aten overload. The passes match on
`kind(node)` instead, and read arguments with `arg(...)`, so a pattern is written once.
Patterns never key on module names: the point is to work on models nobody wrote a patch for.
"""
import contextlib
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from fastgrpo.kernels._dispatch import SUPPORTED_DTYPES  # noqa: F401  (the passes rewrite only what the kernels take)

aten = torch.ops.aten

# kind -> every spelling Dynamo (or a pre-lowered graph) may use for it.
_SPELLINGS: dict[str, tuple[Any, ...]] = {
    "add": (operator.add, operator.iadd, torch.add, torch.Tensor.add, aten.add.Tensor),
    "sub": (operator.sub, torch.sub, torch.Tensor.sub, aten.sub.Tensor),
    "mul": (operator.mul, operator.imul, torch.mul, torch.Tensor.mul, aten.mul.Tensor),
    "div": (operator.truediv, torch.div, torch.true_divide, torch.Tensor.div, aten.div.Tensor),
    "neg": (operator.neg, torch.neg, torch.Tensor.neg, aten.neg.default),
    "pow": (operator.pow, torch.pow, torch.Tensor.pow, aten.pow.Tensor_Scalar),
    "square": (torch.square, torch.Tensor.square),
    "rsqrt": (torch.rsqrt, torch.Tensor.rsqrt, aten.rsqrt.default),
    "sqrt": (torch.sqrt, torch.Tensor.sqrt, aten.sqrt.default),
    "reciprocal": (torch.reciprocal, torch.Tensor.reciprocal, aten.reciprocal.default),
    "mean": (torch.mean, torch.Tensor.mean, aten.mean.dim),
    "tanh": (torch.tanh, torch.Tensor.tanh, F.tanh, aten.tanh.default),
    "linear": (torch._C._nn.linear, F.linear, aten.linear.default),
    "matmul": (operator.matmul, torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
               aten.matmul.default, aten.mm.default, aten.bmm.default),
    "addmm": (torch.addmm, torch.Tensor.addmm, aten.addmm.default),
    "baddbmm": (torch.baddbmm, torch.Tensor.baddbmm, aten.baddbmm.default),
    "einsum": (torch.einsum, aten.einsum.default),
    "t": (torch.t, torch.Tensor.t, aten.t.default),
    "transpose": (torch.transpose, torch.swapaxes, torch.swapdims, torch.Tensor.transpose, torch.Tensor.swapaxes,
                  torch.Tensor.swapdims, aten.transpose.int),
    "permute": (torch.permute, torch.Tensor.permute, aten.permute.default),
    "silu": (F.silu, aten.silu.default),
    "relu": (F.relu, torch.relu, torch.Tensor.relu, aten.relu.default),
    "sigmoid": (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, aten.sigmoid.default),
    "gelu": (F.gelu, torch._C._nn.gelu, aten.gelu.default),
    "log_softmax": (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, aten._log_softmax.default),
    "logsumexp": (torch.logsumexp, torch.Tensor.logsumexp, aten.logsumexp.default),
    "gather": (torch.gather, torch.Tensor.gather, aten.gather.default),
    "cross_entropy": (F.cross_entropy,),
    "sdpa": (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
             aten.scaled_dot_product_attention.default),
    "rms_norm": (F.rms_norm, torch.rms_norm, aten.rms_norm.default),
    "cos": (torch.cos, torch.Tensor.cos, aten.cos.default),
    "sin": (torch.sin, torch.Tensor.sin, aten.sin.default),
    "expand": (torch.Tensor.expand, aten.expand.default),
    "contiguous": (torch.Tensor.contiguous,),
    "cat": (torch.cat, torch.concat, aten.cat.default),
    "getitem": (operator.getitem,),
    "unsqueeze": (torch.unsqueeze, torch.Tensor.unsqueeze, aten.unsqueeze.default),
    "squeeze": (torch.squeeze, torch.Tensor.squeeze, aten.squeeze.dim),
    "view": (torch.Tensor.view, torch.reshape, torch.Tensor.reshape, aten.view.default, aten.reshape.default),
    "chunk": (torch.chunk, torch.Tensor.chunk),
    "stack": (torch.stack, aten.stack.default),
    "view_as_complex": (torch.view_as_complex, aten.view_as_complex.default),
    "view_as_real": (torch.view_as_real, aten.view_as_real.default),
    "flatten": (torch.flatten, torch.Tensor.flatten),
    "dropout": (F.dropout, torch.dropout),
    "cast": (torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.half, torch.Tensor.bfloat16),
}
# `call_method` names -> kind (casts all map to "cast": the dtype is read off the node's value).
_METHODS = {name: name for name in _SPELLINGS} | {
    "reshape": "view", "to": "cast", "float": "cast", "type_as": "cast", "half": "cast", "bfloat16": "cast", "type": "cast",
    "mm": "matmul", "bmm": "matmul", "__matmul__": "matmul", "swapaxes": "transpose", "swapdims": "transpose",
    "__mul__": "mul", "__add__": "add", "__radd__": "add", "__rmul__": "mul", "__truediv__": "div",
}
_FUNCTIONS = {fn: kind for kind, fns in _SPELLINGS.items() for fn in fns}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def kind(node: Any) -> str | None:
    """The canonical op name of `node`, or None for placeholders, outputs, constants and unknown ops."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


def is_kind(node: Any, *kinds: str) -> bool:
    return kind(node) in kinds


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `index` (method spelling: self is index 0) or keyword `name` of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def value(node: Any) -> Any:
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...), or None."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def dtype(node: Any) -> torch.dtype | None:
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape(node: Any) -> tuple | None:
    v = value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_empty(node: Any) -> bool:
    """A tensor with a dimension known at compile time to be 0 (Dynamo specialises sizes 0 and 1)."""
    return any(isinstance(d, int) and d == 0 for d in (shape(node) or ()))


def is_tensor(node: Any) -> bool:
    return isinstance(value(node), torch.Tensor)


def is_scalar(x: Any, expected: float | None = None) -> bool:
    """A Python number (or a symbolic float read from the graph), optionally equal to `expected`."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return expected is None or float(x) == expected
    if isinstance(x, fx.Node) and not is_tensor(x) and expected is None:
        return isinstance(value(x), (torch.SymFloat, torch.SymInt, float, int))
    return False


def is_widening_or_same(src: torch.dtype | None, dst: torch.dtype | None) -> bool:
    if src is None or dst is None or src not in _FLOAT_DTYPES or dst not in _FLOAT_DTYPES:
        return False
    return src == dst or torch.promote_types(src, dst) == dst


def strip_widening_casts(node: Any) -> Any:
    """Walk back through casts that lose nothing (same dtype or wider). A narrowing cast
    (PEFT's `.to(bf16)` after an fp32 LoRA path) changes values and is kept."""
    while is_kind(node, "cast") and is_widening_or_same(dtype(node.args[0]), dtype(node)):
        node = node.args[0]
    return node


def binary_operands(node: fx.Node) -> tuple[Any, Any]:
    return arg(node, 0, "input"), arg(node, 1, "other")


def other_operand(node: fx.Node, known: Any) -> Any:
    """For a commutative binary node with `known` as one operand, the other operand."""
    a, b = binary_operands(node)
    if a is known:
        return b
    if b is known:
        return a
    raise ValueError(f"{known} is not an operand of {node}")


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def normalized_dim(dim: Any, rank: int) -> Any:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, int) and dim < 0:
        dim += rank
    return dim


def site_name(node: fx.Node) -> str:
    """Where a node comes from, for the report: the innermost module path Dynamo recorded
    (informational only, never used for matching), else the node name."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        for prefix in ("L['self'].", "L['self']"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path or node.name
    return node.name


def all_graph_modules(gm: fx.GraphModule):
    """`gm` and every GraphModule nested under it (higher-order-op bodies such as the
    `wrap_body_N` regions Dynamo creates under activation checkpointing)."""
    yield gm
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            yield from all_graph_modules(child)


def target_name(node: fx.Node) -> str:
    """The name of what a node calls: a method's name, or a function's `__name__`."""
    return getattr(node.target, "__name__", str(node.target))


def call_with_example(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A call to `target` inserted at the graph's insertion point, with its example value computed on the fake
    inputs (later checks read it). The fakes are detached first: on fakes that require grad autograd would record
    the call, and a checkpoint whose forward is being traced (the first call compiles) would count what that
    saves as the forward's own saved tensors, its recompute then finding fewer. requires_grad is set back by hand.
    It runs as Dynamo's own fake propagation does, in the fakes' mode with the Python dispatcher on: a composite op
    such as `linear` otherwise decomposes in C++ and asks a symbolic size for a concrete numel (torch 2.11 raises
    "Cannot call numel() on tensor with symbolic sizes" for a 3-D input of dynamic length)."""
    examples = fx.node.map_arg(args, value)
    leaves = torch.utils._pytree.tree_leaves(examples)
    tracked = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
    fake_mode = next((t.fake_mode for t in leaves if isinstance(t, FakeTensor)), None)
    with fake_mode or contextlib.nullcontext(), enable_python_dispatcher():
        example = target(*torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, examples))
    node = graph.call_function(target, args)  # only once the example exists: a failure leaves the graph as it was
    node.meta["example_value"] = example.requires_grad_() if tracked else example
    return node


def error_summary(error: Exception, limit: int = 300) -> str:
    """`Type: first line of the message` (cut at `limit` characters), for a near miss's reason."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:limit] if lines else ''}"


def erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase the replaced pattern nodes, last first, skipping any still read elsewhere (or listed twice)."""
    for node in reversed(list(dict.fromkeys(nodes))):
        if node.graph is graph and not node.users:
            graph.erase_node(node)


def propagate_meta(new: fx.Node, like: fx.Node) -> None:
    for key in ("example_value", "val", "nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]


_RANDOM_OPS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson")


def value_key(x: Any, depth: int = 8) -> Any:
    """A hashable key equal for two nodes that compute the same value: the same pure op on
    the same inputs, recursively (`cos.unsqueeze(1)` written once per rotated tensor, as Gemma4,
    GPT-J and CodeGen do). Placeholders, random or in-place ops, and anything deeper than
    `depth` are keyed by identity."""
    if isinstance(x, fx.Node):
        name = target_name(x)
        pure = (
            x.op in ("call_function", "call_method") and depth > 0 and not x.is_impure()
            and not name.endswith("_") and not any(r in name for r in _RANDOM_OPS)
        )
        if not pure:
            return x
        key = (x.op, x.target, value_key(tuple(x.args), depth - 1),
               tuple(sorted((k, value_key(v, depth - 1)) for k, v in x.kwargs.items())))
        try:
            hash(key)
        except TypeError:
            return x
        return key
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(value_key(a, depth) for a in x))
    if isinstance(x, slice):
        return ("slice", value_key(x.start, depth), value_key(x.stop, depth), value_key(x.step, depth))
    return x
