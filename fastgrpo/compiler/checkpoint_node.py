"""A checkpointed decoder-layer call as one autograd node (`LayerCheckpoint`), for offloaded checkpointing.

torch's non-reentrant checkpoint runs Python hooks for each tensor a layer's graph saves (~40), in the forward and
again in the backward; a short GRPO step is bound by that host time. Here a layer call is one node whose inputs are
the hidden states and the leaves the layer's graph reached (its parameters): the forward runs the layer with grad
enabled (the same compiled graph as the recompute), finds those leaves and drops the graph; the backward gets the
input back from the offload handle (`fastgrpo.compiler.offload`, which owns where it waits), runs the layer again under
the forward's RNG and autocast state and returns `torch.autograd.grad` of that graph. So gradients are those of
torch's checkpoint, and `torch.autograd.grad` from outside and `retain_graph` work. On CUDA the two bodies replay as
CUDA graphs once a call's key repeats (`fastgrpo.compiler.layer_graphs`, via the handle's `graphs`).

A layer whose output is not a tensor or a flat tuple raises `NotFlat` (the offload handle then keeps torch's
checkpoint for it).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states

from fastgrpo.kernels import _graphs
from fastgrpo.kernels._dispatch import checkpoint_recompute, keeping_outputs


def other_inputs_need_grad(args: tuple, kwargs: dict) -> bool:
    """Whether a layer input besides the hidden states (one level into tuples and lists) requires grad."""
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return True
    return False


def _autocast_state(device_type: str) -> dict:
    return dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type), cache_enabled=torch.is_autocast_cache_enabled())


def _graph_leaves(outputs, exclude: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that require grad whose gradient accumulates at the leaves of the graph behind `outputs` (the
    layer's parameters it used), `exclude` left out; in the order first found."""
    leaves, seen = {}, set()
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            if variable is not exclude:
                leaves.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def release_values(output: torch.Tensor, layer_input: torch.Tensor) -> bool:
    """Free the memory of a recomputed layer output whose values nothing reads: `torch.autograd.grad` needs its graph
    and shape only, and torch's checkpoint drops the recompute's outputs too (a [tokens, hidden] tensor less at the
    backward's peak). Only where the output owns its whole storage, is not the layer input's, and its node (a compiled
    region's, whose saved tensors Python can see) did not save it. Returns whether it freed."""
    node = output.grad_fn
    saved = getattr(node, "saved_tensors", None) if type(node).__name__ == "CompiledFunctionBackward" else None
    storage = output.untyped_storage()
    address = storage.data_ptr()
    if (saved is None or output._base is not None or storage.nbytes() != output.numel() * output.element_size()
            or address == layer_input.untyped_storage().data_ptr()
            or any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == address for t in saved)):
        return False
    storage.resize_(0)
    return True


class NotFlat(Exception):
    """A layer's output that `LayerCheckpoint` cannot return as its outputs (the node's outputs are flat tensors)."""


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def flat_outputs(out) -> tuple:
    """A layer's output as the node's flat outputs: a tensor as a tuple of one, a tuple of tensors, None and plain
    values as it is; anything else raises `NotFlat`."""
    outputs = (out,) if isinstance(out, torch.Tensor) else out
    if not isinstance(outputs, tuple) or not all(v is None or isinstance(v, (torch.Tensor, int, float, bool, str))
                                                 for v in outputs):
        raise NotFlat(f"it returned {_describe(out)}, not a tensor or a tuple of tensors")
    return outputs


def differentiate(out, x: torch.Tensor, leaves: list, grads: tuple, needs: tuple, release: bool = False) -> list:
    """The gradients of a recomputed layer's output `out` against `grads` for its input `x` and each of `leaves`, as
    `LayerCheckpoint.backward` returns them (None where `needs`, the node's needs_input_grad, is off); with `release`,
    the output's values are freed first where nothing reads them (`release_values`)."""
    pairs = [(o, g) for o, g in zip(flat_outputs(out), grads)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if release:
        for o, _ in pairs:
            release_values(o, x)
    inputs = ([x] if needs[1] else []) + [leaf for leaf, need in zip(leaves, needs[2:]) if need]
    found = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                 if pairs and inputs else [None] * len(inputs))
    return [next(found) if needs[1] else None, *(next(found) if need else None for need in needs[2:])]


class LayerCall:
    """One checkpointed call of a layer through `LayerCheckpoint`: the layer's call and other inputs, the forward's
    RNG and autocast state, the leaves its graph reached. Its input and the frame of kept outputs are held by the
    node's saved tensor (a `_SavedInput`), so autograd frees them after the backward, as it frees saved tensors."""

    __slots__ = ("handle", "layer", "frame", "forward", "args", "kwargs", "rng", "autocast", "leaves", "outputs",
                 "entry", "graph_tensors", "graph_pass")

    def __init__(self, handle, layer, frame, forward, args, kwargs):
        self.handle, self.layer, self.forward = handle, layer, forward
        self.frame = weakref.ref(frame)
        self.args, self.kwargs = args, kwargs
        self.rng = self.autocast = self.leaves = self.outputs = None
        self.entry = self.graph_tensors = self.graph_pass = None  # the call's CUDA graphs (layer_graphs)

    def run(self, hidden: torch.Tensor, requires_grad: bool, frame: _KeptFrame):
        """The layer on `hidden` (detached, requiring grad as asked) with grad enabled: the same compiled graph in the
        forward as in the recompute, so both compute the same values. Returns (that input, the output)."""
        x = hidden.detach().requires_grad_(requires_grad)
        with torch.enable_grad(), keeping_outputs(frame):
            return x, self.forward(x, *self.args, **self.kwargs)

    def checkpointed(self, hidden: torch.Tensor):
        """The forward: state stashed, the input to the handle (its copy to the host starts before the layer runs),
        the layer run, its graph's leaves found and the graph dropped; the outputs come back from `LayerCheckpoint`,
        whose inputs are `hidden` and those leaves."""
        device_type = hidden.device.type
        self.autocast = [_autocast_state(device_type)] + ([_autocast_state("cpu")] if device_type != "cpu" else [])
        self.rng = (torch.get_rng_state(), *get_device_states(hidden))  # as torch's checkpoint stashes them
        frame = self.frame()
        handle = self.handle
        saved = handle._saved_input(hidden, self.layer, frame)
        entry = self.entry = handle.graphs.entry(self, hidden)
        replayed = handle.graphs.replay_forward(entry, self, hidden) if entry is not None else None
        if replayed is not None:  # a replayed forward keeps no outputs for the recompute (its frame stays empty)
            self.leaves, self.outputs = list(entry.leaves), replayed
        else:
            # A call whose layer graphs are on their way runs its ops as they are (_graphs.suspended).
            with _graphs.suspended() if entry is not None else contextlib.nullcontext():
                x, out = self.run(hidden, hidden.requires_grad, frame)
                outputs = flat_outputs(out)
                self.leaves = _graph_leaves(outputs, x)
                self.outputs = out.detach() if isinstance(out, torch.Tensor) else tuple(
                    v.detach() if isinstance(v, torch.Tensor) else v for v in outputs)
                del x, out, outputs  # the forward's graph and what it saved go here
                if entry is not None:
                    handle.graphs.after_forward(entry, self, hidden, self.outputs, self.leaves,
                                                [torch.get_rng_state(), *get_device_states(hidden)[1]])
        handle._target = (hidden, saved)
        del saved
        try:
            with saved_tensors_hooks(handle._pack, handle._unpack):  # hooks that hold no tensor
                return LayerCheckpoint.apply(self, hidden, *self.leaves)
        finally:
            handle._target = None
            self.outputs = None  # the node's outputs hold the node, which holds this call: no cycle through them


class LayerCheckpoint(torch.autograd.Function):
    """A checkpointed layer call as one autograd node, whose inputs are the hidden states and the leaves that require
    grad which the layer's graph reached (its parameters). The forward ran in `LayerCall.checkpointed` (the values
    are the node's outputs). Backward: the input comes back from the handle, the layer runs again inside
    `checkpoint_recompute()` under the forward's RNG and autocast state, and `torch.autograd.grad` of that graph gives
    the gradients the node returns (so `torch.autograd.grad` from outside and `retain_graph` work as with torch's
    checkpoint)."""

    @staticmethod
    def forward(ctx, call: LayerCall, hidden: torch.Tensor, *leaves: torch.Tensor):
        ctx.call = call
        ctx.save_for_backward(hidden)  # the hooks of `checkpointed` store the `_SavedInput` made for it
        return call.outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        call = ctx.call
        needs = ctx.needs_input_grad
        (hidden,) = ctx.saved_tensors  # the handle's unpack: the copy back, and the prefetch of the layer before's
        graphs = call.handle.graphs
        if call.entry is not None:
            replayed = graphs.backward(call.entry, call, hidden, grads, needs)
            if replayed is not None:
                found = iter(replayed)
                return (None, next(found), *found)
        with _graphs.suspended() if call.entry is not None else contextlib.nullcontext():
            found = LayerCheckpoint.recompute_and_differentiate(call, hidden, grads, needs)
            if call.entry is not None:
                graphs.after_backward(call.entry, call, hidden, grads, needs, found)
        return (None, *found)

    @staticmethod
    def recompute_and_differentiate(call: LayerCall, hidden: torch.Tensor, grads: tuple, needs: tuple) -> list:
        """The layer run again on `hidden` under the forward's RNG and autocast state; the gradients of its outputs
        against `grads` for the hidden states and each leaf (None where not needed)."""
        frame = call.frame()
        frame.start_replay()
        cpu_state, devices, device_states = call.rng
        device_type = hidden.device.type if devices else "cuda"  # no device states: only the CPU's is forked
        with torch.random.fork_rng(devices=devices, device_type=device_type), contextlib.ExitStack() as stack:
            torch.set_rng_state(cpu_state)
            set_device_states(devices, device_states, device_type=device_type)
            for state in call.autocast:
                stack.enter_context(torch.autocast(**state))
            with checkpoint_recompute():
                x, out = call.run(hidden, needs[1], frame)
        # The recomputed graph's backward runs outside the forward's autocast and RNG state, as torch's checkpoint
        # runs it: under the backward's own.
        return differentiate(out, x, call.leaves, grads, needs, release=True)
