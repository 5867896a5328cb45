"""Offloaded activation checkpointing: each decoder layer's checkpointed input waits in host memory.

Under plain (non-reentrant) gradient checkpointing the one tensor a decoder layer keeps between
forward and backward is its input hidden states, [batch, tokens, hidden]. At 16k-token GRPO rows on
a 1.5B model that is 28 x 0.4 GB, most of the step's memory. Here every layer still runs under
`torch.utils.checkpoint(use_reentrant=False)`, and a saved-tensors hook moves that one input to a
host buffer (Unsloth's offloaded checkpointing, PEERS.md §1.5):

- forward: the device-to-host copy runs on a side stream while the layer computes; the device
  tensor is freed as soon as the copy has read it (`record_stream`);
- backward: when layer i's recompute asks for its input, the copy of layer i-1's input back to the
  device starts on the side stream, so it overlaps layer i's recompute and backward;
- host buffers are pinned, one per layer, kept across steps and re-allocated only when a larger
  input arrives; the last layer's input stays on the device (its backward comes first).

Without CUDA the same code runs with synchronous copies into plain host buffers (CPU tests exercise
it; on a CPU-only machine the "offload" saves nothing).

The checkpoint sits outside each layer's `__call__`, so a layer compiled on its own
(`fastgrpo.compile_repeated_blocks(model)`, or `layer.compile(...)`) stays one compiled region and
Dynamo never traces the offload logic. Under a whole-model `torch.compile` every layer call is a
graph break and the layers run uncompiled unless they were compiled themselves: with offloading,
compile the repeated blocks rather than the whole model. Enable offloading before the first
compiled step: each layer's class is swapped for a subclass (parameter names and the state dict do
not change), and Dynamo guards on a module's type, so enabling later costs one recompile per
compiled layer graph. While enabled the model cannot be pickled (state_dict() is fine).

    handle = enable_offloaded_checkpointing(model)   # also works on PEFT models
    ...train...
    handle.disable()                                  # the model is as it was

Use it instead of HF's `gradient_checkpointing_enable()`, not on top of it: enabling switches the
layers' own checkpointing flag off (disable() switches it back). PEFT's `enable_input_require_grads`
is not needed (that is for reentrant checkpointing). Gradients are exactly those of plain
non-reentrant checkpointing: `loss.backward()`, `torch.autograd.grad` and `retain_graph` all work, and
RNG state and autocast are replayed by torch's checkpoint as usual. Other layer inputs (attention
masks, position embeddings) are shared by all layers and small; they stay where they are.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from fastgrpo.compiler.regions import repeated_blocks

# HF decoder layers take the layer input first, or by this name.
HIDDEN_KWARG = "hidden_states"
# Caches a checkpointed layer must not update twice (HF's GradientCheckpointingLayer drops them too).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


@dataclass
class OffloadStats:
    host_allocations: int = 0  # host buffers allocated or grown (pinned on CUDA)
    host_bytes: int = 0  # bytes of host buffers currently owned
    offloaded: int = 0  # layer inputs copied to the host
    kept: int = 0  # layer inputs left on the device (the last layer's, or non-contiguous ones)
    prefetched: int = 0  # copies back to the device started one layer ahead
    loaded_on_demand: int = 0  # copies back that nothing had prefetched (the first layer after a retain_graph, ...)


class _HostSlot:
    """One host buffer of a layer; `in_use` while a saved input lives in it."""

    __slots__ = ("buffer", "in_use")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.in_use = False


class _SavedInput:
    """What the pack hook stores for a layer input: a host copy (or the device tensor itself, when kept).

    Lives exactly as long as autograd's saved copy of the checkpoint's inputs, so its host slot is
    freed for the next step when the graph is freed."""

    def __init__(self, layer: int, device: torch.device, kept: torch.Tensor | None, host: torch.Tensor | None,
                 slot: _HostSlot | None, previous: weakref.ref | None):
        self.layer = layer
        self.device = device
        self.kept = kept
        self.host = host
        self.slot = slot
        self.previous = previous  # the layer before's saved input, whose copy back this one starts
        self.on_device: torch.Tensor | None = None  # a copy back, started or done
        self.ready: torch.cuda.Event | None = None  # recorded on the copy stream after that copy

    def __del__(self):
        if self.slot is not None:
            self.slot.in_use = False


class OffloadHandle:
    """Offloaded checkpointing on one model's repeated blocks; `disable()` undoes it."""

    def __init__(self, blocks: nn.ModuleList, keep_last: int):
        self.blocks = list(blocks)
        self.keep_last = keep_last
        self.stats = OffloadStats()
        self._slots: dict[int, list[_HostSlot]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._target: tuple[torch.Tensor, int] | None = None  # (input, layer) the pack hook waits for
        self._last: weakref.ref | None = None  # the most recent saved input
        self._enabled = True

    # ---- public -------------------------------------------------------------------------------------
    def disable(self) -> None:
        """Put every layer back as it was (class and HF checkpointing flag); drop the host buffers."""
        if not self._enabled:
            return
        for block in self.blocks:
            state = block.__dict__.pop("_fastgrpo_offload")
            block.__class__ = state.original_class
            if state.hf_checkpointing:
                block.gradient_checkpointing = True
        self._slots.clear()
        self.stats.host_bytes = 0
        self._enabled = False

    def host_buffers(self) -> dict[int, list[torch.Tensor]]:
        """Each layer's host buffers (flat uint8), for inspection."""
        return {layer: [slot.buffer for slot in slots] for layer, slots in self._slots.items()}

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    # ---- the checkpointed call ------------------------------------------------------------------------
    def _checkpointed_call(self, block: nn.Module, layer: int, call, args: tuple, kwargs: dict):
        if getattr(block, "gradient_checkpointing", False) is True:
            raise RuntimeError(
                "HF gradient checkpointing was switched on again over offloaded checkpointing (each layer would "
                "be checkpointed twice); call model.gradient_checkpointing_disable() or handle.disable()"
            )
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                warnings.warn(f"offloaded checkpointing: `{name}` set to None (a recompute would update the cache twice)")
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if args and isinstance(args[0], torch.Tensor):
            hidden, rest = args[0], args[1:]

            def run(hidden_states, *rest_args, **kw):
                return call(block, hidden_states, *rest_args, **kw)
        elif isinstance(kwargs.get(HIDDEN_KWARG), torch.Tensor):
            hidden, rest = kwargs.pop(HIDDEN_KWARG), args

            def run(hidden_states, *rest_args, **kw):
                return call(block, *rest_args, **{HIDDEN_KWARG: hidden_states}, **kw)
        else:
            raise TypeError(
                f"offloaded checkpointing: {type(block).__name__} was called without a tensor as its first "
                f"argument or as `{HIDDEN_KWARG}=`; cannot tell which input to offload"
            )
        # Positional tensors given to checkpoint() are saved through the saved-tensors hooks active
        # here (the layer's own saved tensors go through checkpoint's inner hooks); only `hidden` is moved.
        self._target = (hidden, layer)
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                return checkpoint(run, hidden, *rest, use_reentrant=False, **kwargs)
        finally:
            self._target = None

    def _pack(self, tensor: torch.Tensor):
        if self._target is None or tensor is not self._target[0]:
            return tensor
        layer = self._target[1]
        self._target = None  # hold no reference to the device tensor
        last = self._last() if self._last is not None else None
        previous = self._last if last is not None and last.layer == layer - 1 else None
        if layer >= len(self.blocks) - self.keep_last or not tensor.is_contiguous() or tensor.numel() == 0:
            self.stats.kept += 1
            saved = _SavedInput(layer, tensor.device, kept=tensor, host=None, slot=None, previous=previous)
        else:
            self.stats.offloaded += 1
            nbytes = tensor.numel() * tensor.element_size()
            slot = self._acquire(layer, nbytes, pin=tensor.device.type == "cuda")
            host = slot.buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
            if tensor.device.type == "cuda":
                stream = self._stream(tensor.device)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the input is made on the compute stream
                with torch.cuda.stream(stream):
                    host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # its memory is not reused before the copy has read it
            else:
                host.copy_(tensor)
            saved = _SavedInput(layer, tensor.device, kept=None, host=host, slot=slot, previous=previous)
        self._last = weakref.ref(saved)
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _SavedInput):
            return saved
        if saved.kept is not None:
            tensor = saved.kept
        else:
            if saved.on_device is None:
                self.stats.loaded_on_demand += 1
                self._copy_back(saved)
            if saved.ready is not None:
                torch.cuda.current_stream(saved.device).wait_event(saved.ready)
                saved.ready = None
            tensor, saved.on_device = saved.on_device, None  # the recompute holds it from here
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None and previous.kept is None and previous.on_device is None:
            self.stats.prefetched += 1
            self._copy_back(previous)
        return tensor

    def _copy_back(self, saved: _SavedInput) -> None:
        host = saved.host
        # Allocated on the compute stream, which will read it after waiting for `ready`.
        on_device = torch.empty(host.shape, dtype=host.dtype, device=saved.device)
        if saved.device.type == "cuda":
            stream = self._stream(saved.device)
            # The block may have just been freed by compute-stream work still in flight.
            stream.wait_stream(torch.cuda.current_stream(saved.device))
            with torch.cuda.stream(stream):
                on_device.copy_(host, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
            on_device.record_stream(stream)  # safe to free even if the backward never reads it
        else:
            on_device.copy_(host)
        saved.on_device = on_device

    # ---- buffers and streams -----------------------------------------------------------------------------
    def _acquire(self, layer: int, nbytes: int, pin: bool) -> _HostSlot:
        slots = self._slots.setdefault(layer, [])
        free = [slot for slot in slots if not slot.in_use]
        slot = next((s for s in free if s.buffer.numel() >= nbytes), None)
        if slot is None:
            if free:  # grow the largest free buffer rather than keep two
                slot = max(free, key=lambda s: s.buffer.numel())
                self.stats.host_bytes -= slot.buffer.numel()
            else:  # every buffer of this layer holds a live input (two forwards before one backward)
                slot = _HostSlot(torch.empty(0, dtype=torch.uint8))
                slots.append(slot)
            slot.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.stats.host_allocations += 1
            self.stats.host_bytes += nbytes
        slot.in_use = True
        return slot

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


@dataclass
class _BlockState:
    handle: OffloadHandle
    layer: int
    original_class: type
    hf_checkpointing: bool  # HF's per-layer flag was on before enabling (restored by disable)


@torch._dynamo.disable
def _offloaded_checkpoint(block: nn.Module, state: _BlockState, args: tuple, kwargs: dict):
    return state.handle._checkpointed_call(block, state.layer, state.original_class.__call__, args, kwargs)


def _offloaded_call(self: nn.Module, *args, **kwargs):
    state = self.__dict__["_fastgrpo_offload"]
    if self.training and torch.is_grad_enabled():
        return _offloaded_checkpoint(self, state, args, kwargs)
    return state.original_class.__call__(self, *args, **kwargs)


_OFFLOADED_CLASSES: dict[type, type] = {}


def _offloaded_class(cls: type) -> type:
    """A subclass of the layer's class whose `__call__` checkpoints with offloading.

    Swapping the instance's class (rather than wrapping the module) keeps parameter names, the state
    dict and a compiled layer's `_compiled_call_impl`, which the original `__call__` still reaches."""
    if cls not in _OFFLOADED_CLASSES:
        _OFFLOADED_CLASSES[cls] = type(f"Offloaded{cls.__name__}", (cls,), {"__call__": _offloaded_call,
                                                                             "__module__": cls.__module__})
    return _OFFLOADED_CLASSES[cls]


def enable_offloaded_checkpointing(model: nn.Module, keep_last: int = 1) -> OffloadHandle:
    """Checkpoint every repeated block (decoder layer) of `model`, its input held in host memory.

    Works on any model whose layers form an `nn.ModuleList` of one type (found structurally), PEFT
    models included, with the layers compiled or not. The last `keep_last` layers keep their input on
    the device. Layers are checkpointed only in training mode with grad enabled, like HF's flag.
    Returns a handle: `handle.disable()` restores the model; `handle.stats` counts copies and buffers."""
    blocks = repeated_blocks(model)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to checkpoint")
    if any("_fastgrpo_offload" in block.__dict__ for block in blocks):
        raise RuntimeError("offloaded checkpointing is already enabled on this model")
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    handle = OffloadHandle(blocks, keep_last)
    for layer, block in enumerate(blocks):
        state = _BlockState(handle, layer, type(block), getattr(block, "gradient_checkpointing", False) is True)
        if state.hf_checkpointing:
            block.gradient_checkpointing = False  # ours replaces it
        block.__dict__["_fastgrpo_offload"] = state
        block.__class__ = _offloaded_class(type(block))
    return handle


def disable_offloaded_checkpointing(model: nn.Module) -> bool:
    """Undo `enable_offloaded_checkpointing` on `model`; False if it was not enabled."""
    blocks = repeated_blocks(model)
    state = blocks[0].__dict__.get("_fastgrpo_offload") if blocks is not None else None
    if state is None:
        return False
    state.handle.disable()
    return True
