"""Offloaded activation checkpointing: each decoder layer's checkpointed input waits in host memory.

Under plain (non-reentrant) gradient checkpointing the one tensor a decoder layer keeps between
forward and backward is its input hidden states, [batch, tokens, hidden]. At 16k-token GRPO rows on
a 1.5B model that is 28 x 0.4 GB, most of the step's memory. Here every layer call is one autograd node
(`checkpoint_node.LayerCheckpoint`: gradients those of torch's non-reentrant checkpoint, no Python per saved tensor,
LEAN_CHECKPOINT) whose input waits in a host buffer, as Unsloth's offloaded gradient checkpointing does. A layer with
another input that requires grad goes through `torch.utils.checkpoint(use_reentrant=False)` with a saved-tensors
hook that moves the input instead. Either way:

- forward: the device-to-host copy runs on a side stream while the layer computes; the device
  tensor is freed as soon as the copy has read it (`record_stream`);
- backward: when layer i's recompute asks for its input, the copy of layer i-1's input back to the
  device starts on the side stream, so it overlaps layer i's recompute and backward; where the layer has a
  gated-MLP op, only once that op's backward has freed its buffers (PREFETCH_AFTER_BACKWARD_PEAK);
- host buffers are pinned, one per layer, kept across steps and re-allocated only when a larger
  input arrives; the last layer's input stays on the device (its backward comes first). The first pinned buffer
  switches torch's host allocator to touching pages with threads and registering them (`fast_pinning`), unless
  PYTORCH_CUDA_ALLOC_CONF already says how to pin;
- the recompute runs inside `_dispatch.checkpoint_recompute()`: ops whose output the compiler proved
  feeds no saved tensor (the gated-MLP op before the residual add) compute only what they save;
- outputs an op keeps for the recompute (`_dispatch.kept_or_computed`: the output and log-sum-exp of
  fastgrpo::attention and of packed rows' fastgrpo::flash_packed_attention) wait in host memory like the
  layer's input, are prefetched with it, and the recompute gets them back instead of running attention again.

Without CUDA the same code runs with synchronous copies into plain host buffers (CPU tests exercise
it; on a CPU-only machine the "offload" saves nothing).

The checkpoint sits outside each layer's `__call__`, so a layer compiled on its own
(`fastgrpo.compile_repeated_blocks(model, offload_checkpointing=True)` does both in one call, or
`layer.compile(...)`) stays one compiled region and Dynamo never traces the offload logic. Under a
whole-model `torch.compile` every layer call is a graph break and the layers run uncompiled unless
they were compiled themselves: with offloading, compile the repeated blocks rather than the whole
model. Enable offloading before the first compiled step: each layer's class is swapped for a subclass
(parameter names and the state dict do not change), and Dynamo guards on a module's type, so enabling
later costs one recompile per compiled layer graph. While enabled the model cannot be pickled (state_dict() is fine).

    handle = enable_offloaded_checkpointing(model)   # also works on PEFT models
    ...train...
    handle.disable()                                  # the model is as it was

While enabled, each layer's HF checkpointing flag (`layer.gradient_checkpointing`, what
`model.gradient_checkpointing_enable()` / `_disable()` set and `model.is_gradient_checkpointing`
reads) switches *offloaded* checkpointing on and off for that layer: HF's own checkpoint never nests
inside ours, and code that toggles checkpointing around generation (TRL, HF Trainer, PEFT's
`prepare_model_for_kbit_training`) pauses and resumes offloading. Enabling turns it on;
`gradient_checkpointing_kwargs` (reentrant, HF's `offload=`) are ignored. HF's `enable_input_require_grads` is
not needed (it is for torch's reentrant checkpoint, whose node has no parameter inputs); where it
is on (PEFT's `gradient_checkpointing_enable` turns it on), the input embeddings return a leaf that requires grad,
and a leaf's AccumulateGrad node would hold it (layer 0's input: tokens x hidden) on the device until backward,
besides its host copy. While offloading, that output is swapped for an alias that requires grad without being a leaf
(`_GradWithoutLeaf`): the same values and layer graphs, no gradient for a tensor nothing reads, nothing held.
Gradients are exactly those of plain non-reentrant checkpointing: `loss.backward()`, `torch.autograd.grad` and
`retain_graph` all work, and the forward's RNG state and autocast are replayed in the recompute. Other layer inputs
(attention masks, position embeddings) are shared by all layers and small; they stay where they are.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from fastgrpo.compiler.checkpoint_node import LayerCall, NotFlat, other_inputs_need_grad
from fastgrpo.compiler.layer_graphs import LayerGraphs
from fastgrpo.compiler.regions import CACHE_KWARGS, repeated_blocks
from fastgrpo.kernels._dispatch import (KeptOutputs, after_backward_peak, cancel_after_backward_peak,
                                        checkpoint_recompute, keeping_outputs)

# Where a layer's ops signal the peak of its backward (the gated-MLP op, after its chunk buffers are freed), the copy
# back of the layer before's input and kept outputs starts there rather than when the layer's recompute starts: the
# copies, two [tokens, hidden] tensors, then never sit beside the MLP backward's buffers (the step's peak).
PREFETCH_AFTER_BACKWARD_PEAK = True
# Offloaded layers checkpoint through `LayerCheckpoint`, one autograd node a layer call, rather than torch's
# non-reentrant checkpoint, whose saved-tensor hooks run Python for each of the tensors a layer's graph saves (~40),
# in the forward and again in the backward. A short step is bound by that host time (docs/measurements.md, "Where the
# 0.5B step at 1024 waits"). A/B: `python bench/grpo_step.py --ab fastgrpo.compiler.offload.LEAN_CHECKPOINT=False`.
LEAN_CHECKPOINT = True
# HF decoder layers take the layer input first, or by this name.
HIDDEN_KWARG = "hidden_states"
_ABSENT = object()  # a layer had no instance value of HF's checkpointing flag
# Threads that touch a new pinned buffer's pages before cudaHostRegister (a power of two, as torch requires): 40
# buffers of 151 MB took 0.89 s with 16 threads, 1.24 s with 8 and 4.34 s through cudaHostAlloc, torch's default
# (`python bench/bench_host_pinning.py`, an H200 host of 16 cores). The first update of a 1.5B GRPO step allocates
# 81 such buffers.
PINNED_REGISTER_THREADS = 16
_fast_pinning_done = False


def fast_pinning() -> str | None:
    """Once a process: torch's pinned host buffers made by cudaHostRegister after PINNED_REGISTER_THREADS threads
    (at most the CPUs, a power of two) touched their pages, instead of cudaHostAlloc. Process-wide (every later
    pin_memory allocation): the same pinned memory, sooner. Left alone where PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF names a pinned_* setting. Returns the setting applied, or None."""
    global _fast_pinning_done
    if _fast_pinning_done:
        return None
    _fast_pinning_done = True
    if any("pinned_" in os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return None
    threads = 1 << (min(PINNED_REGISTER_THREADS, os.cpu_count() or 1).bit_length() - 1)
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    torch.cuda.memory._set_allocator_settings(setting)
    return setting


@dataclass
class OffloadStats:
    host_allocations: int = 0  # host buffers allocated or grown (pinned on CUDA)
    host_bytes: int = 0  # bytes of host buffers currently owned
    offloaded: int = 0  # layer inputs copied to the host
    kept: int = 0  # layer inputs left on the device (the last layer's, or non-contiguous ones)
    prefetched: int = 0  # copies back to the device started one layer ahead
    prefetched_after_peak: int = 0  # of those, started once the layer ahead's gated-MLP backward had passed
    loaded_on_demand: int = 0  # copies back that nothing had prefetched (the first layer after a retain_graph, ...)
    outputs_offloaded: int = 0  # tensors ops kept for the recompute (attention's output, ...) copied to the host
    outputs_on_device: int = 0  # such tensors left on the device (the last layer's, or not dense)
    outputs_replayed: int = 0  # op calls of a recompute that got their kept outputs back instead of computing
    outputs_missing: int = 0  # op calls of a recompute that found nothing kept and computed


class _HostSlot:
    """One host buffer of a layer; `in_use` while a saved input lives in it."""

    __slots__ = ("buffer", "in_use")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.in_use = False


class _HostCopy:
    """A tensor waiting for the backward: in a host buffer (`host`, from `slot`), or on the device (`kept`).

    Frees its host slot for the next step when it dies (with autograd's graph)."""

    def __init__(self, device: torch.device, kept: torch.Tensor | None, host: torch.Tensor | None,
                 slot: _HostSlot | None, order: tuple[int, ...] | None = None):
        self.device = device
        self.kept = kept
        self.host = host
        self.slot = slot
        self.order = order  # the tensor is host.permute(order) (a dense layout other than contiguous), or None
        self.on_device: torch.Tensor | None = None  # a copy back, started or done
        self.ready: torch.cuda.Event | None = None  # recorded on the copy stream after that copy

    def __del__(self):
        if self.slot is not None:
            self.slot.in_use = False


class _SavedInput(_HostCopy):
    """What the pack hook stores for a layer input; `frame` holds what the layer's ops kept for its recompute."""

    def __init__(self, layer: int, previous: weakref.ref | None, frame: _KeptFrame, **copy):
        super().__init__(**copy)
        self.layer = layer
        self.previous = previous  # the layer before's saved input, whose copy back this one starts
        self.frame = frame


class _KeptFrame(KeptOutputs):
    """What ops kept in one checkpointed call of a layer, for that call's recompute (in call order)."""

    def __init__(self, handle: OffloadHandle, layer: int):
        self.handle = handle
        self.layer = layer
        self.recording = True
        self.entries: list[list[_HostCopy]] = []
        self.position = 0

    def keep(self, tensors):
        handle = self.handle
        slot_index = sum(len(entry) for entry in self.entries)
        self.entries.append([_HostCopy(**handle._hold(tensor, (self.layer, slot_index + i), output=True))
                             for i, tensor in enumerate(tensors)])

    def start_replay(self) -> None:
        self.recording = False
        self.position = 0

    def replay(self):
        if self.position >= len(self.entries):
            self.handle.stats.outputs_missing += 1
            return None
        entry = self.entries[self.position]
        self.position += 1
        self.handle.stats.outputs_replayed += 1
        return tuple(self.handle._take(copy) for copy in entry)

    def prefetch(self) -> None:
        for entry in self.entries:
            for copy in entry:
                if copy.kept is None and copy.on_device is None:
                    self.handle._copy_back(copy)


def _dense_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """Dims outermost first by stride, when `tensor.permute(order)` is contiguous (a dense layout); else None."""
    order = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    return order if tensor.permute(order).is_contiguous() else None


def marking_recomputes(forward, frame: _KeptFrame | None = None):
    """`forward` for torch's non-reentrant checkpoint, with every call after the first inside
    `checkpoint_recompute()`: the first call is the forward; the checkpoint calls again only to recompute the
    saved tensors and throws the outputs away, so ops the compiler proved feed no saved tensor skip their output.
    With `frame`, ops keep outputs in it during the first call and take them back in every later one."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            with keeping_outputs(frame):
                return forward(*args, **kwargs)
        if frame is not None:
            frame.start_replay()
        with checkpoint_recompute(), keeping_outputs(frame):
            return forward(*args, **kwargs)

    return run


class _GradWithoutLeaf(torch.autograd.Function):
    """`x` (which needs no grad) as a tensor that requires grad through `anchor`, a 0-element leaf, rather than by
    being a leaf itself; the gradient it gets is dropped. Only the anchor's AccumulateGrad is in the graph, so `x` is
    freed as soon as the forward lets go of it."""

    @staticmethod
    def forward(ctx, x, anchor):
        # detach(), not a view: a compiled layer whose input is a view of another tensor is a graph of its own.
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, None


class OffloadHandle:
    """Offloaded checkpointing on one model's repeated blocks; `disable()` undoes it."""

    def __init__(self, blocks: nn.ModuleList, keep_last: int):
        self.blocks = list(blocks)
        self.keep_last = keep_last
        self.stats = OffloadStats()
        self._slots: dict[int | tuple[int, int], list[_HostSlot]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._target: tuple[torch.Tensor, _SavedInput] | None = None  # (input, its holder) the pack hook waits for
        self._last: weakref.ref | None = None  # the most recent saved input
        self._enabled = True
        self._hooks: list = []  # on the input embeddings (watch_input_embeddings)
        self.graphs = LayerGraphs(self.blocks)  # checkpointed calls replayed as CUDA graphs

    # ---- public -------------------------------------------------------------------------------------
    def disable(self) -> None:
        """Put every layer back as it was (class, and HF's checkpointing flag as it was before enabling);
        drop the host buffers."""
        if not self._enabled:
            return
        for block in self.blocks:
            state = block.__dict__.pop("_fastgrpo_offload")
            block.__class__ = state.original_class
            if state.hf_flag is not _ABSENT:
                block.__dict__["gradient_checkpointing"] = state.hf_flag
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._slots.clear()
        self.stats.host_bytes = 0
        self._enabled = False

    def host_buffers(self) -> dict[int | tuple[int, int], list[torch.Tensor]]:
        """Host buffers (flat uint8) of each layer's input (key: the layer) and of the i-th tensor its ops kept
        (key: (layer, i)), for inspection."""
        return {layer: [slot.buffer for slot in slots] for layer, slots in self._slots.items()}

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    # ---- the input embeddings' leaf ---------------------------------------------------------------------
    def watch_input_embeddings(self, embeddings: nn.Module) -> None:
        """Replace a leaf that requires grad, returned by `embeddings` while offloading, with `_GradWithoutLeaf`'s alias.

        HF's `enable_input_require_grads` hook makes the output a leaf in place, whenever it was registered: a
        forward pre-hook keeps the replacing hook after it (hooks run in registration order)."""
        alias_hook = embeddings.register_forward_hook(torch._dynamo.disable(self._alias_leaf_output))

        @torch._dynamo.disable
        def keep_alias_hook_last(module, args):
            module._forward_hooks.move_to_end(alias_hook.id)

        self._hooks += [alias_hook, embeddings.register_forward_pre_hook(keep_alias_hook_last)]

    def _alias_leaf_output(self, module, args, output):
        offloading = self.blocks[0].__dict__["_fastgrpo_offload"].active and self.blocks[0].training
        if not (offloading and torch.is_grad_enabled() and isinstance(output, torch.Tensor)
                and output.is_leaf and output.requires_grad):
            return None
        anchor = torch.empty(0, device=output.device, requires_grad=True)  # 0 elements: allocates nothing
        return _GradWithoutLeaf.apply(output.detach(), anchor)

    # ---- the checkpointed call ------------------------------------------------------------------------
    def _checkpointed_call(self, block: nn.Module, layer: int, call, args: tuple, kwargs: dict):
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                warnings.warn(f"offloaded checkpointing: `{name}` set to None (a recompute would update the cache twice)")
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if args and isinstance(args[0], torch.Tensor):
            hidden, rest = args[0], args[1:]

            def forward(hidden_states, *rest_args, **kw):
                return call(block, hidden_states, *rest_args, **kw)
        elif isinstance(kwargs.get(HIDDEN_KWARG), torch.Tensor):
            hidden, rest = kwargs.pop(HIDDEN_KWARG), args

            def forward(hidden_states, *rest_args, **kw):
                return call(block, *rest_args, **{HIDDEN_KWARG: hidden_states}, **kw)
        else:
            raise TypeError(
                f"offloaded checkpointing: {type(block).__name__} was called without a tensor as its first "
                f"argument or as `{HIDDEN_KWARG}=`; cannot tell which input to offload"
            )
        state = block.__dict__["_fastgrpo_offload"]
        if LEAN_CHECKPOINT and state.lean and not other_inputs_need_grad(rest, kwargs):
            frame = _KeptFrame(self, layer)  # held here until the node's saved input holds it
            try:
                return LayerCall(self, layer, frame, forward, rest, kwargs).checkpointed(hidden)
            except NotFlat as reason:  # once a layer: its calls take torch's checkpoint from here on
                state.lean = False
                warnings.warn(f"offloaded checkpointing: {type(block).__name__} (layer {layer}) runs under "
                              f"torch.utils.checkpoint, not fastgrpo's checkpoint node: {reason}", stacklevel=2)
        frame = _KeptFrame(self, layer)
        run = marking_recomputes(forward, frame)
        # Positional tensors given to checkpoint() are saved through the saved-tensors hooks active
        # here (the layer's own saved tensors go through checkpoint's inner hooks); only `hidden` is moved.
        self._target = (hidden, self._saved_input(hidden, layer, frame))
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                return checkpoint(run, hidden, *rest, use_reentrant=False, **kwargs)
        finally:
            self._target = None

    def _pack(self, tensor: torch.Tensor):
        if self._target is None or tensor is not self._target[0]:
            return tensor
        saved, self._target = self._target[1], None  # hold no reference to the device tensor
        return saved

    def _saved_input(self, tensor: torch.Tensor, layer: int, frame: _KeptFrame) -> _SavedInput:
        """`tensor`, layer `layer`'s input, held for its backward (host copy or kept), linked to the layer before's."""
        last = self._last() if self._last is not None else None
        previous = self._last if last is not None and last.layer == layer - 1 else None
        saved = _SavedInput(layer, previous, frame, **self._hold(tensor, layer, output=False))
        self._last = weakref.ref(saved)
        return saved

    def _offloads(self, layer: int) -> bool:
        return layer < len(self.blocks) - self.keep_last

    def _hold(self, tensor: torch.Tensor, slot_key, output: bool) -> dict:
        """A `_HostCopy`'s fields for `tensor`: copied to a host buffer of `slot_key` (on a side stream on CUDA), or
        kept on the device: in the last `keep_last` layers, and where its layout is not dense (not contiguous,
        for a layer input)."""
        layer = slot_key[0] if output else slot_key
        if output:
            order = _dense_order(tensor)
        else:
            order = tuple(range(tensor.dim())) if tensor.is_contiguous() else None
        if not self._offloads(layer) or order is None or tensor.numel() == 0:
            if output:
                self.stats.outputs_on_device += 1
            else:
                self.stats.kept += 1
            return dict(device=tensor.device, kept=tensor, host=None, slot=None)
        if output:
            self.stats.outputs_offloaded += 1
        else:
            self.stats.offloaded += 1
        dense = tensor.permute(order)
        nbytes = dense.numel() * dense.element_size()
        slot = self._acquire(slot_key, nbytes, pin=tensor.device.type == "cuda")
        host = slot.buffer[:nbytes].view(dense.dtype).view(dense.shape)
        if tensor.device.type == "cuda":
            stream = self._stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is made on the compute stream
            with torch.cuda.stream(stream):
                host.copy_(dense, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(dense)
        return dict(device=tensor.device, kept=None, host=host, slot=slot,
                    order=None if order == tuple(range(tensor.dim())) else order)

    def _take(self, copy: _HostCopy) -> torch.Tensor:
        """The device tensor of `copy`, waiting for (or starting) its copy back; the caller holds it from here."""
        if copy.kept is not None:
            return copy.kept
        if copy.on_device is None:
            self.stats.loaded_on_demand += 1
            self._copy_back(copy)
        if copy.ready is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.ready)
            copy.ready = None
        tensor, copy.on_device = copy.on_device, None
        if copy.order is not None:
            tensor = tensor.permute([copy.order.index(d) for d in range(tensor.dim())])
        return tensor

    def _unpack(self, saved):
        if not isinstance(saved, _SavedInput):
            return saved
        cancel_after_backward_peak()  # a deferred prefetch whose signal never came: its input loads on demand
        tensor = self._take(saved)
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None:
            if PREFETCH_AFTER_BACKWARD_PEAK and saved.frame.signals_backward_peak:
                after_backward_peak(lambda: self._prefetch(previous, after_peak=True))
            else:
                self._prefetch(previous)
        return tensor

    def _prefetch(self, saved: _SavedInput, after_peak: bool = False) -> None:
        """Start the copy back of `saved` (a layer's input) and of what its ops kept: its recompute comes next."""
        if saved.kept is None and saved.on_device is None:
            self.stats.prefetched += 1
            self.stats.prefetched_after_peak += after_peak
            self._copy_back(saved)
        saved.frame.prefetch()

    def _copy_back(self, saved: _HostCopy) -> None:
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
    def _acquire(self, key, nbytes: int, pin: bool) -> _HostSlot:
        """A free host buffer of at least `nbytes` among those of `key` (a layer, or (layer, i) for the i-th
        tensor its ops kept)."""
        slots = self._slots.setdefault(key, [])
        free = [slot for slot in slots if not slot.in_use]
        slot = next((s for s in free if s.buffer.numel() >= nbytes), None)
        if slot is None:
            if free:  # grow the largest free buffer rather than keep two
                slot = max(free, key=lambda s: s.buffer.numel())
                self.stats.host_bytes -= slot.buffer.numel()
            else:  # every buffer of this layer holds a live input (two forwards before one backward)
                slot = _HostSlot(torch.empty(0, dtype=torch.uint8))
                slots.append(slot)
            if pin:
                fast_pinning()
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
    call: object  # the layer's call without HF's checkpointing (see _uncheckpointed_call)
    hf_flag: object  # the instance's own HF checkpointing flag before enabling, or _ABSENT (restored by disable)
    active: bool = True  # what `layer.gradient_checkpointing` reads while enabled
    lean: bool = True  # calls go through `LayerCheckpoint` (off once its output was not a tensor or a flat tuple)


@torch._dynamo.disable
def _offloaded_checkpoint(block: nn.Module, state: _BlockState, args: tuple, kwargs: dict):
    return state.handle._checkpointed_call(block, state.layer, state.call, args, kwargs)


def _offloaded_call(self: nn.Module, *args, **kwargs):
    state = self.__dict__["_fastgrpo_offload"]
    if state.active and self.training and torch.is_grad_enabled():
        return _offloaded_checkpoint(self, state, args, kwargs)
    return state.call(self, *args, **kwargs)


def _uncheckpointed_call(cls: type):
    """The layer's `__call__` minus HF's checkpointing: `GradientCheckpointingLayer.__call__` only adds the
    checkpoint (and drops caches for it) around `nn.Module.__call__`, which also reaches a compiled layer's
    `_compiled_call_impl`. Its flag now means "offload", so its own checkpoint must not run."""
    hf_layers = sys.modules.get("transformers.modeling_layers")
    if hf_layers is not None and cls.__call__ is hf_layers.GradientCheckpointingLayer.__call__:
        return nn.Module.__call__
    return cls.__call__


def _get_checkpointing_flag(self) -> bool:
    return self.__dict__["_fastgrpo_offload"].active


def _set_checkpointing_flag(self, value) -> None:
    self.__dict__["_fastgrpo_offload"].active = bool(value)


_OFFLOADED_CLASSES: dict[type, type] = {}


def _offloaded_class(cls: type) -> type:
    """A subclass of the layer's class whose `__call__` checkpoints with offloading and whose
    `gradient_checkpointing` flag (a property, so HF's setters reach it) switches that on and off.

    Swapping the instance's class (rather than wrapping the module) keeps parameter names, the state
    dict and a compiled layer's `_compiled_call_impl`."""
    if cls not in _OFFLOADED_CLASSES:
        _OFFLOADED_CLASSES[cls] = type(f"Offloaded{cls.__name__}", (cls,), {
            "__call__": _offloaded_call,
            "gradient_checkpointing": property(_get_checkpointing_flag, _set_checkpointing_flag),
            "__module__": cls.__module__,
        })
    return _OFFLOADED_CLASSES[cls]


def enable_offloaded_checkpointing(model: nn.Module, keep_last: int = 1) -> OffloadHandle:
    """Checkpoint every repeated block (decoder layer) of `model`, its input held in host memory.

    Works on any model whose layers form an `nn.ModuleList` of one type (found structurally), PEFT
    models included, with the layers compiled or not. The last `keep_last` layers keep their input on
    the device. Layers are checkpointed only in training mode with grad enabled and while their
    `gradient_checkpointing` flag is on (it is on after enabling), like HF's checkpointing.
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
        cls = type(block)
        # HF's flag now lives in the state (the subclass's property shadows the instance value).
        hf_flag = block.__dict__.pop("gradient_checkpointing", _ABSENT)
        block.__dict__["_fastgrpo_offload"] = _BlockState(handle, layer, cls, _uncheckpointed_call(cls), hf_flag)
        block.__class__ = _offloaded_class(cls)
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not an HF model, or one without input embeddings
        embeddings = None
    if isinstance(embeddings, nn.Module):
        handle.watch_input_embeddings(embeddings)
    return handle


def offload_handle(model: nn.Module) -> OffloadHandle | None:
    """The handle of the offloaded checkpointing enabled on `model`, or None."""
    blocks = repeated_blocks(model)
    state = blocks[0].__dict__.get("_fastgrpo_offload") if blocks is not None else None
    return None if state is None else state.handle


def disable_offloaded_checkpointing(model: nn.Module) -> bool:
    """Undo `enable_offloaded_checkpointing` on `model`; False if it was not enabled."""
    handle = offload_handle(model)
    if handle is None:
        return False
    handle.disable()
    return True
