"""Autocast made explicit on the matmuls of a graph traced under `torch.autocast`.

Under autocast (what TRL's and accelerate's bf16/fp16 mixed precision turn on) Dynamo's graph
shows a PEFT adapter as `linear(x.to(float32), A)` with a float32 `A`, although the matmul that
runs is bf16: autocast casts the inputs of linear and the matmul family when the op executes, and
the graph does not say so. Our passes replace such matmuls with custom ops, which autocast does
not see into; fed the graph's dtypes they would compute the adapter in fp32, slower than eager and
with other numerics. So before the patterns run, every matmul-family node gets its autocast input
casts written into the graph (`A.to(bf16)`, and `x.to(float32).to(bf16)` collapsed back to x,
which is exact): the patterns then see the dtypes that really run. Nothing else changes meaning;
autocast still applies, as a no-op, to those nodes and as before to every other op.

Nodes inside an autocast region the code opens itself (`torch.autocast(..., enabled=False)`
around a rotary embedding, say) are left alone: what applies there is not the ambient state.
"""
import torch
from torch import fx

from fastgrpo.passes._fx import arg, dtype, is_kind, value

NAME = "autocast"

# The ops autocast runs in the lower precision that our patterns absorb (torch's autocast lists
# for CUDA and CPU both hold them).
_MATMUL_KINDS = ("linear", "matmul", "addmm", "baddbmm")
# Tensor arguments of each kind that autocast casts (index, keyword).
_TENSOR_ARGS = {
    "linear": ((0, "input"), (1, "weight"), (2, "bias")),
    "matmul": ((0, "input"), (1, "other")),
    "addmm": ((0, "input"), (1, "mat1"), (2, "mat2")),
    "baddbmm": ((0, "input"), (1, "batch1"), (2, "batch2")),
}
# Autocast leaves float64 alone and casts only floating tensors of its device.
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
_AUTOCAST_ENTER = (torch.amp.autocast_mode._enter_autocast,)
_AUTOCAST_EXIT = (torch.amp.autocast_mode._exit_autocast,)


def ambient_autocast(example_inputs) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast active while Dynamo compiles these inputs, or None."""
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    for device in sorted(devices):
        if device in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def _cast(graph: fx.Graph, node: fx.Node, to: torch.dtype) -> fx.Node:
    """`node` as `to`: the source of an exact round trip (x.to(float32) of a bf16 x), else a new cast."""
    if is_kind(node, "cast") and dtype(node.args[0]) == to and dtype(node) in (torch.float32, torch.float64):
        return node.args[0]
    with graph.inserting_after(node):
        cast = graph.call_method("to", (node, to))
    example = value(node)
    with example.fake_mode if hasattr(example, "fake_mode") else torch.no_grad():
        cast.meta["example_value"] = example.to(to)
    return cast


def apply(gm: fx.GraphModule, device: str, to: torch.dtype) -> int:
    """Write the input casts of every matmul-family node on `device` into the graph; returns how many nodes."""
    graph, rewritten, nested = gm.graph, 0, 0
    collapsed = []  # `x.to(float32)` nodes a matmul read, now bypassed for x itself
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _AUTOCAST_ENTER:
            nested += 1
        elif node.op == "call_function" and node.target in _AUTOCAST_EXIT:
            nested -= 1
        if nested or not any(is_kind(node, k) for k in _MATMUL_KINDS):
            continue
        kind = next(k for k in _MATMUL_KINDS if is_kind(node, k))
        changed = False
        for index, name in _TENSOR_ARGS[kind]:
            operand = arg(node, index, name)
            example = value(operand)
            if not isinstance(example, torch.Tensor) or example.device.type != device:
                continue
            if example.dtype == to or example.dtype not in _CASTABLE:
                continue
            cast = _cast(graph, operand, to)
            if is_kind(operand, "cast") and cast is operand.args[0]:
                collapsed.append(operand)
            if index < len(node.args):
                node.update_arg(index, cast)
            else:
                node.update_kwarg(name, cast)
            changed = True
        rewritten += changed
    # A collapsed cast nobody reads any more is erased: left in place it would still read its input (PEFT's
    # `h.to(float32)` of the MLP product), and a pattern that replaces that input could not erase it.
    for cast in dict.fromkeys(collapsed):
        if not cast.users:
            graph.erase_node(cast)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
