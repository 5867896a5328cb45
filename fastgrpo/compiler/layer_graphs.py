"""Checkpointed decoder-layer calls replayed as CUDA graphs: a short training step stops waiting for the host.

At short GRPO completions the policy update is bound by the host: between one layer's last kernel and the next
one's first, Dynamo's guards, AOTAutograd's runtime wrappers and the custom ops' Python run (docs/measurements.md,
"Where the 0.5B step at 1024 waits": the GPU busy 90 ms of a 260 ms step). Under offloaded checkpointing
(`fastgrpo.compiler.offload`) a layer call is one autograd node with two plain bodies, the forward and the backward
(recompute, then `torch.autograd.grad`), so each is captured whole as a CUDA graph and replayed:

- a call's key: the layer, every tensor input's shape, strides, dtype and grad flag, the other inputs' values, the
  autocast state (a call with an input that is none of these, such as a flex_attention `BlockMask`, runs as it is
  and is counted as `unkeyed`; the layer's other calls still replay); a backward's key adds which inputs need
  gradients and the incoming gradients' layouts. A layer keeps MAX_KEYS_PER_LAYER keys (the least recently used
  dropped), so a run whose lengths vary keeps a few graphs a layer; the GRPO trainer pads lengths to buckets for that
  (`fastgrpo.integrations.trl`; packed rows: `fastgrpo.integrations.packing.pad_plan`).
- a key's first call runs as it is (compiles, autotunes) and shows whether the layer can be replayed: no random
  numbers drawn (dropout: the recompute must draw the same), its gradients only for the layer's parameters, outputs a
  tensor or a flat tuple. Its second call captures (after a warm-up run on the capture stream, as torch asks); its
  third runs as it is and beside the replay, and the two must agree (a value the host read at the capture, baked
  into the graph, shows there); from then on it replays. A layer that fails a rule runs as it is, with the reason
  in `LayerGraphs.off` and one warning.
- inputs are copied into staging buffers of their own layout, shared by all layers (one layer's call at a time);
  an input that is the same tensor, unchanged, as the last one copied there (position embeddings, masks: one per
  forward) is not copied again. Outputs and gradients are copied out of staging buffers after the replay.
- what the graphs read in place: the layer's parameters and buffers. Each replay checks their addresses and grad
  flags; a change (a moved model, a frozen parameter) drops the layer's graphs. Module state that Dynamo guards and
  these keys do not see (an adapter switched off while gradients are on) needs `reset()`.
- temporaries live in the op graphs' private pool (`fastgrpo.kernels._graphs`), reused by every capture: the graphs
  hold one call's temporaries, counted by benchmarks with that pool.
- replayed forwards keep no attention outputs for the recompute (the backward graph runs attention again); the
  copy back of the layer before's input starts when the backward starts.

`ENABLED` (FASTGRPO_LAYER_GRAPHS=0 turns it off) switches it; calls run as they are off CUDA, in inference mode and
inside another capture. A capture that fails stops all captures of the model (`broken`). A/B:
`python bench/grpo_step.py --ab fastgrpo.compiler.layer_graphs.ENABLED=False` (`bash bench/device_session.sh layer_graphs`).
"""
from __future__ import annotations

import collections
import contextlib
import os
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from fastgrpo.compiler.checkpoint_node import differentiate, flat_outputs
from fastgrpo.kernels import _dispatch, _graphs

ENABLED = os.environ.get("FASTGRPO_LAYER_GRAPHS", "1") != "0"
# Keys a layer keeps (each its forward graph and its backward graphs).
MAX_KEYS_PER_LAYER = 4
# A call whose forward does more work than this (2 x the layer's parameter elements x tokens, FLOPs) runs as it is: the
# GPU, not the host, bounds it, and its graphs' pool would only add to the step's peak (which lies outside the layers).
# Measured on an H100 (`bash bench/device_session.sh layer_graphs`, `--ab ...ENABLED=False`): Qwen2.5-0.5B shape at
# 10k tokens (0.3e12) 2.3x faster, Qwen2.5-1.5B at 10k (0.96e12) 1.17x; 0.5B at 35k tokens (1.04e12) ~5 % and
# +1.4 GiB of peak.
MAX_WORK_PER_CALL = 1e12
# A layer whose keys change faster than they are replayed stops capturing: after CHURN_CAPTURES forward captures with
# fewer than REPLAYS_PER_CAPTURE replays each. A key's capture and comparison cost about two more runs of its body
# and the capture's host time, which its replays must win back (lengths that vary beyond MAX_KEYS_PER_LAYER buckets).
CHURN_CAPTURES = 2 * MAX_KEYS_PER_LAYER
REPLAYS_PER_CAPTURE = 2
# A replay agrees with the call run as it is when each output differs by at most this share of its largest value.
AGREEMENT = 1e-2
_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device)
# Tests on machines without CUDA: calls on CPU tensors take every step (keys, rules, staging, capture, comparison,
# replay) with a stand-in graph that runs its body again at each replay.
EMULATE_ON_CPU = False


# Sequence lengths a trainer pads its training forwards to (`bucket_length`), so that a few keys serve a run whose
# lengths vary: a multiple of 1/16 of the length's power of two (at most 1/16 more tokens), and of at least 64.
LENGTH_BUCKETS_PER_OCTAVE = 16
MIN_LENGTH_STEP = 64


def bucket_step(n: int) -> int:
    """The spacing of the buckets around `n`: max(largest power of 2 <= n / 16, 64); a bucket adds less than it."""
    return max(MIN_LENGTH_STEP, (1 << max(n.bit_length() - 1, 0)) // LENGTH_BUCKETS_PER_OCTAVE)


def bucket_length(n: int) -> int:
    """`n` rounded up to its bucket: a multiple of `bucket_step(n)`."""
    step = bucket_step(n)
    return -(-n // step) * step


def _elements(p: torch.Tensor) -> int:
    """The weight elements `p` stands for: a 4-bit bitsandbytes parameter packs two in a byte (its quant_state has
    the weight's shape)."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return p.numel() if shape is None else torch.Size(shape).numel()


class _NotReplayable(Exception):
    """Why a layer's calls cannot be replayed."""


def _tensor_key(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _flatten(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], tuple]:
    """The tensors among a layer call's inputs besides the hidden states (one level into tuples and lists), and the
    call's key part for them."""
    tensors = []

    def leaf(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _tensor_key(v)
        if isinstance(v, _SCALARS):
            return (type(v), v)
        raise _NotReplayable(f"a layer input of type {type(v).__name__}")

    def value(v):
        return (type(v), tuple(map(leaf, v))) if isinstance(v, (tuple, list)) else leaf(v)

    key = (tuple(map(value, args)), tuple((name, value(v)) for name, v in kwargs.items()))
    return tensors, key


def _substitute(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
    """`args` and `kwargs` with their tensors (in `_flatten`'s order) replaced by `tensors`."""
    it = iter(tensors)

    def leaf(v):
        return next(it) if isinstance(v, torch.Tensor) else v

    def value(v):
        return type(v)(map(leaf, v)) if isinstance(v, (tuple, list)) else leaf(v)

    return tuple(map(value, args)), {name: value(v) for name, v in kwargs.items()}


def _non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two of `t`'s elements share a storage element (gaps allowed, as in a slice)."""
    reach = 0  # the furthest offset the dims so far, smallest strides first, step to
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _unchanged(state: list) -> bool:
    """Whether each (tensor, address, requires_grad) of `state` still has that address and grad flag."""
    return all(t.data_ptr() == address and t.requires_grad == grad for t, address, grad in state)


def _agree(eager: list, replayed: list) -> str | None:
    """None where every replayed tensor is within AGREEMENT of the eager one; else what differs."""
    for i, (a, b) in enumerate(zip(eager, replayed)):
        if (a is None) != (b is None):
            return f"output {i} is None in one run only"
        if a is None or not isinstance(a, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} has another shape or dtype"
        a32, b32 = a.detach().float(), b.detach().float()
        error, scale = (a32 - b32).abs().max().item(), a32.abs().max().item()
        if not error <= AGREEMENT * scale + 1e-30:  # also catches NaN
            return f"output {i} differs by {error:.3g} (largest value {scale:.3g})"
    return None


def _brief(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"


class _Staging:
    """Buffers the graphs read and write, shared by all layers: one per (role, position, layout, dtype). Held by the
    graphs that read or write them, not here: a length whose keys every layer has dropped frees its buffers."""

    def __init__(self):
        self.buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.sources: dict[int, tuple] = {}  # id(buffer) -> (weak reference to the tensor last copied in, version)

    def like(self, role: str, position: int, t: torch.Tensor) -> torch.Tensor:
        """A buffer with `t`'s shape, strides and dtype; broadcast dims (stride 0) share one element as in `t`."""
        key = (role, position, tuple(t.shape), t.stride(), t.dtype, t.device)
        buffer = self.buffers.get(key)
        if buffer is None:
            compact_shape = [1 if stride == 0 else size for size, stride in zip(t.shape, t.stride())]
            if not _non_overlapping(t.as_strided(compact_shape, t.stride(), t.storage_offset())):
                raise _NotReplayable(f"a layer input of shape {tuple(t.shape)} whose strides {t.stride()} overlap")
            if t._is_view():  # a view where the input is one (expanded, sliced): Dynamo guards on that
                span = 1 + sum((size - 1) * stride for size, stride in zip(compact_shape, t.stride()))
                buffer = torch.empty(span, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())
            else:
                buffer = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self.buffers[key] = buffer
            weakref.finalize(buffer, self.sources.pop, id(buffer), None)  # a later buffer may get its id
        return buffer

    def stage(self, buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Copies `tensors` into `buffers` (one launch), skipping a tensor already there unchanged."""
        pairs = []
        for buffer, t in zip(buffers, tensors):
            last = self.sources.get(id(buffer))
            if last is not None and last[0]() is t and last[1] == t._version:
                continue
            self.sources[id(buffer)] = (weakref.ref(t), t._version)  # holds no tensor alive
            pairs.append((_compact(buffer), _compact(t)))
        if pairs:  # without autograd: a copy from a tensor that requires grad would put the buffers into its graph
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in pairs], [t for _, t in pairs])

    def forget_sources(self) -> None:
        self.sources.clear()

    def bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in list(self.buffers.values()))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t` without its broadcast dims (stride 0): the elements it holds once each."""
    if 0 not in t.stride():
        return t
    return t.as_strided([1 if stride == 0 else size for size, stride in zip(t.shape, t.stride())], t.stride(),
                        t.storage_offset())


class _Rerun:
    """EMULATE_ON_CPU's stand-in for a CUDA graph: `replay()` runs the captured body on the staging buffers again and
    writes its outputs where the graph would."""

    def __init__(self, body, outputs: list):
        self.body, self.outputs = body, outputs

    def replay(self) -> None:
        with torch.no_grad():
            for buffer, t in zip(self.outputs, self.body()):
                if buffer is not None:
                    buffer.copy_(t)


@dataclass
class _Pass:
    """One captured body: the forward, or a backward with given gradient layouts and needs."""

    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    inputs: list = field(default_factory=list)  # staging buffers read: hidden, the other inputs, (incoming grads)
    outputs: list = field(default_factory=list)  # staging buffers written (None where the body returns None)
    verified: bool = False


@dataclass
class _Entry:
    """A layer's graphs for one key."""

    layer: int
    leaves: list[torch.Tensor] | None = None  # the parameters the layer's graph reached (found at the first call)
    out_shape: tuple | None = None  # None: the output is a tensor; else the flat tuple's non-tensor values
    forward: _Pass = field(default_factory=_Pass)
    backwards: dict = field(default_factory=dict)


class LayerGraphs:
    """The CUDA graphs of one model's checkpointed layer calls (owned by its offload handle)."""

    def __init__(self, blocks: list):
        self.blocks = blocks
        self.entries: dict[int, collections.OrderedDict] = {}
        self.params: dict[int, list] = {}  # layer -> [(tensor, address, requires_grad)] its graphs read
        self.elements: dict[int, int] = {}  # layer -> its parameters' elements (`worth_it`)
        self.churn: dict[int, list[int]] = {}  # layer -> [forward captures, forward replays] (CHURN_CAPTURES)
        self.staging = _Staging()
        self.off: dict[int, str] = {}  # layer -> why its calls are not replayed
        self.broken: str | None = None  # why no call is replayed any more (a capture failed: the device's state)
        self.accumulators: dict[int, list] = {}  # layer -> its leaves' AccumulateGrad nodes, made on the capture stream
        self.stats = {"captured": 0, "replayed_forward": 0, "replayed_backward": 0, "eager": 0, "dropped": 0,
                      "gpu_bound": 0, "unkeyed": 0}
        self._warned: set[str] = set()

    # ---- keys ----------------------------------------------------------------------------------------------
    def entry(self, call, hidden: torch.Tensor) -> _Entry | None:
        """The entry of `call` (a `checkpoint_node.LayerCall`) on `hidden`, or None where it runs as it is."""
        layer = call.layer
        if not (ENABLED and (hidden.is_cuda or EMULATE_ON_CPU) and layer not in self.off and self.broken is None
                and not torch.is_inference_mode_enabled()
                and not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())):
            return None
        if hidden.is_cuda and layer not in self.accumulators:
            self._own_accumulators(layer, [p for p in self.blocks[layer].parameters() if p.requires_grad])
        if not self.worth_it(hidden.numel() // hidden.size(-1), layer):  # before any other work on the call
            self.stats["gpu_bound"] += 1
            return None
        try:
            tensors, others = _flatten(call.args, call.kwargs)
        except _NotReplayable as reason:  # this call's inputs, not the layer: its other calls may still replay
            self.stats["unkeyed"] += 1
            self._warn_once(str(reason), f"decoder layers' calls with {reason} run as they are, not as CUDA graphs")
            return None
        if not self._params_unchanged(layer):
            self.drop(layer)
            self._params_unchanged(layer)  # records them again
        key = (_tensor_key(hidden), others, tuple(tuple(sorted(state.items())) for state in call.autocast))
        entries = self.entries.setdefault(layer, collections.OrderedDict())
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = _Entry(layer)
            if len(entries) > MAX_KEYS_PER_LAYER:
                entries.popitem(last=False)
                self.stats["dropped"] += 1
        else:
            entries.move_to_end(key)
        call.graph_tensors = tensors
        return entry

    def worth_it(self, tokens: int, layer: int = 0) -> bool:
        """Whether a call of `layer` on `tokens` tokens is small enough to gain from a replay (`MAX_WORK_PER_CALL`)."""
        elements = self.elements.get(layer)
        if elements is None:
            elements = self.elements[layer] = sum(map(_elements, self.blocks[layer].parameters()))
        return 2 * elements * tokens <= MAX_WORK_PER_CALL

    def _params_unchanged(self, layer: int) -> bool:
        state = self.params.get(layer)
        if state is None:
            block = self.blocks[layer]
            self.params[layer] = [(t, t.data_ptr(), t.requires_grad)
                                  for t in (*block.parameters(), *block.buffers())]
            return True
        return _unchanged(state)

    def drop(self, layer: int | None = None) -> None:
        """Forget the graphs of `layer` (all layers: None); they are captured again as their keys come back."""
        layers = list(self.entries) if layer is None else [layer]
        for i in layers:
            self.stats["dropped"] += len(self.entries.pop(i, ()))
            self.params.pop(i, None)
            self.accumulators.pop(i, None)
        self.staging.forget_sources()

    def reset(self) -> None:
        """Drop every graph and forget every layer's reason (module state the keys do not see has changed)."""
        self.drop()
        self.off.clear()
        self.accumulators.clear()
        self.churn.clear()

    def _turn_off(self, layer: int, reason: str) -> None:
        self.off[layer] = reason
        self.entries.pop(layer, None)
        self.accumulators.pop(layer, None)
        self._warn_once(reason, f"decoder layer {layer}'s checkpointed calls are not replayed as CUDA graphs: {reason}")

    def _warn_once(self, reason: str, message: str) -> None:
        """Warn `message` the first time `reason` comes up (for any layer)."""
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"fastgrpo: {message}", stacklevel=5)

    # ---- the forward -----------------------------------------------------------------------------------------
    def replay_forward(self, entry: _Entry, call, hidden: torch.Tensor):
        """The call's outputs from its graph, or None where this call runs as it is (then `after_forward`)."""
        done = entry.forward
        if done.graph is None or not done.verified:
            return None
        self.staging.stage(done.inputs, [hidden, *call.graph_tensors])
        done.graph.replay()
        self.stats["replayed_forward"] += 1
        self.churn.setdefault(call.layer, [0, 0])[1] += 1
        return self._outputs(entry, self._copied_out(done.outputs))

    def after_forward(self, entry: _Entry, call, hidden: torch.Tensor, out, leaves: list, rng_after: list) -> None:
        """Bookkeeping after a call that ran as it is: the first checks the rules, the second captures, the third
        compares a replay with it. `rng_after`: the CPU's and each device's generator state after the call."""
        done = entry.forward
        done.calls += 1
        self.stats["eager"] += 1
        layer = call.layer
        try:
            outputs = flat_outputs(out)
            if done.calls == 1:
                self._check_rules(entry, call, out, outputs, leaves, rng_after)
            elif done.graph is None:
                self._capture_forward(entry, call, hidden)
            elif not done.verified:
                self.staging.stage(done.inputs, [hidden, *call.graph_tensors])
                done.graph.replay()
                if (disagreement := _agree(outputs, done.outputs)) is not None:
                    raise _NotReplayable(f"a replay of its forward disagrees with the call ({disagreement})")
                done.verified = True
        except _NotReplayable as reason:
            self._turn_off(layer, str(reason))
        except RuntimeError as error:  # a capture that failed (a host read, an op not allowed in a capture)
            self._turn_off(layer, f"its capture failed: {_brief(error)}")

    def _check_rules(self, entry: _Entry, call, out, outputs: list, leaves: list, rng_after: list) -> None:
        before = [call.rng[0], *call.rng[2]]  # the CPU's generator state, then each device's
        if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, rng_after)):
            raise _NotReplayable("it draws random numbers (dropout), which a recompute must draw again")
        params = {id(t) for t, _, _ in self.params[call.layer]}
        if any(id(leaf) not in params for leaf in leaves):
            raise _NotReplayable("its gradient reaches a tensor that requires grad and is not one of its parameters")
        entry.leaves = list(leaves)
        if call.layer not in self.accumulators and leaves and leaves[0].is_cuda:
            self._own_accumulators(call.layer, leaves)
        entry.out_shape = None if isinstance(out, torch.Tensor) else tuple(
            None if isinstance(v, torch.Tensor) else ("value", v) for v in outputs)

    def _own_accumulators(self, layer: int, leaves: list[torch.Tensor]) -> None:
        """The backward graph differentiates for the leaves on the capture stream; the autograd engine runs a leaf's
        AccumulateGrad node on the stream that node was made on, and a capture that waits on the legacy stream fails
        ("operation would make the legacy stream depend on a capturing blocking stream"). So a layer's leaves get their
        nodes made on the capture stream at the layer's first call of any size, and kept alive here: a node is made
        once while alive, and a call too large to replay, run earlier in the same step, would otherwise have made it on
        the default stream (outside a capture the engine syncs the streams as usual)."""
        if not leaves:
            return
        # The engine warns once of the mismatch when an eager backward reaches such a node: expected here.
        warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
        _, stream = _graphs.capture_pool(leaves[0].device)
        with torch.cuda.stream(stream), torch.enable_grad():
            self.accumulators[layer] = [leaf.view_as(leaf).grad_fn.next_functions[0][0] for leaf in leaves]

    def _capture_forward(self, entry: _Entry, call, hidden: torch.Tensor) -> None:
        captures, replays = self.churn.setdefault(call.layer, [0, 0])
        if captures >= CHURN_CAPTURES and replays < REPLAYS_PER_CAPTURE * captures:
            raise _NotReplayable(f"its inputs' lengths change faster than its graphs are replayed ({captures} keys "
                                 f"captured, {replays} replays; MAX_KEYS_PER_LAYER={MAX_KEYS_PER_LAYER})")
        self.churn[call.layer][0] += 1
        done = entry.forward
        inputs = self._staged_inputs([hidden, *call.graph_tensors])
        self.staging.stage(inputs, [hidden, *call.graph_tensors])
        args, kwargs = _substitute(call.args, call.kwargs, inputs[1:])
        requires_grad = hidden.requires_grad

        def body():
            x = inputs[0].detach().requires_grad_(requires_grad)
            with torch.enable_grad(), _dispatch.keeping_outputs(None):
                out = call.forward(x, *args, **kwargs)
            return [v.detach() if isinstance(v, torch.Tensor) else None for v in flat_outputs(out)]

        done.graph, done.outputs = self._capture(body, "forward")
        done.inputs = inputs

    # ---- the backward ----------------------------------------------------------------------------------------
    def backward(self, entry: _Entry, call, hidden: torch.Tensor, grads: tuple, needs: tuple):
        """The backward's gradients (hidden's, then each leaf's, None where not needed) from its graph; None where
        this call runs as it is. After such a call, `after_backward` with its gradients."""
        state = self.params.get(call.layer)
        if call.layer in self.off or state is None or not _unchanged(state):  # (parameters moved since the forward)
            return None
        key = (needs, tuple(None if g is None else _tensor_key(g) for g in grads))
        done = entry.backwards.get(key)
        if done is None:
            done = entry.backwards[key] = _Pass()
        call.graph_pass = done
        if done.graph is None or not done.verified:
            return None
        self.staging.stage(done.inputs, [hidden, *call.graph_tensors, *(g for g in grads if g is not None)])
        done.graph.replay()
        self.stats["replayed_backward"] += 1
        return self._copied_out(done.outputs)

    def after_backward(self, entry: _Entry, call, hidden: torch.Tensor, grads: tuple, needs: tuple,
                       found: list) -> None:
        done = call.graph_pass
        if done is None or call.layer in self.off:
            return
        done.calls += 1
        try:
            if done.calls == 1 or entry.leaves is None:
                return
            tensors = [hidden, *call.graph_tensors, *(g for g in grads if g is not None)]
            if done.graph is None:
                self._capture_backward(done, entry, call, tensors, grads, needs)
            elif not done.verified:
                self.staging.stage(done.inputs, tensors)
                done.graph.replay()
                if (disagreement := _agree(found, done.outputs)) is not None:
                    raise _NotReplayable(f"a replay of its backward disagrees with the call ({disagreement})")
                done.verified = True
        except _NotReplayable as reason:
            self._turn_off(call.layer, str(reason))
        except RuntimeError as error:
            self._turn_off(call.layer, f"its capture failed: {_brief(error)}")

    def _capture_backward(self, done: _Pass, entry: _Entry, call, tensors: list, grads: tuple, needs: tuple):
        inputs = self._staged_inputs(tensors)
        self.staging.stage(inputs, tensors)
        hidden_in = inputs[0]
        others = inputs[1:1 + len(call.graph_tensors)]
        grads_in = iter(inputs[1 + len(call.graph_tensors):])
        grads_staged = [None if g is None else next(grads_in) for g in grads]
        args, kwargs = _substitute(call.args, call.kwargs, others)
        leaves = entry.leaves

        def body():
            with contextlib.ExitStack() as stack:
                for state in call.autocast:
                    stack.enter_context(torch.autocast(**state))
                with _dispatch.checkpoint_recompute(), torch.enable_grad(), _dispatch.keeping_outputs(None):
                    x = hidden_in.detach().requires_grad_(needs[1])
                    out = call.forward(x, *args, **kwargs)
            return differentiate(out, x, leaves, grads_staged, needs)

        done.graph, done.outputs = self._capture(body, "backward")
        done.inputs = inputs

    # ---- capture and copies ----------------------------------------------------------------------------------
    def _staged_inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.staging.like("in", i, t) for i, t in enumerate(tensors)]

    def _capture(self, body, role: str) -> tuple[torch.cuda.CUDAGraph, list]:
        if self.broken is not None:  # keys made before the failure capture no more either
            raise _NotReplayable(self.broken)
        if not torch.cuda.is_available():  # EMULATE_ON_CPU: a "graph" that runs its body again at each replay
            try:
                body()  # as the warm-up before a capture
                warm = body()
            except Exception as error:
                self.broken = f"a capture failed ({_brief(error)})"
                raise
            outputs = [None if t is None else self.staging.like(f"{role}-out", i, t) for i, t in enumerate(warm)]
            self.stats["captured"] += 1
            return _Rerun(body, outputs), outputs
        device = torch.cuda.current_device()
        pool, stream = _graphs.capture_pool(torch.device("cuda", device))
        pending = _dispatch.take_after_backward_peak()  # work that waits for a signal must not run in the capture
        # Autocast caches its casts of leaves (fp32 LoRA factors) until the outermost autocast region ends: a cast the
        # capture found cached would be read from that tensor's address at every replay, after the region freed it,
        # and a cast the capture made would stay cached in the graph's pool. So the cache is emptied before the
        # warm-up, before the capture and after it. (Turning it off instead would change Dynamo's global-state guard.)
        torch.clear_autocast_cache()
        try:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces and Triton's launchers exist before it
                warm = body()
            torch.cuda.current_stream().wait_stream(stream)
            outputs = [None if t is None else self.staging.like(f"{role}-out", i, t) for i, t in enumerate(warm)]
            del warm
            torch.clear_autocast_cache()
            graph = torch.cuda.CUDAGraph()
            try:
                with _graphs.capturing(graph, pool, stream):  # undone whole where it fails
                    produced = body()
                    for buffer, t in zip(outputs, produced):
                        if buffer is not None:
                            buffer.copy_(t)
                    del produced
                torch.clear_autocast_cache()
            except Exception as error:  # no later capture is tried
                self.broken = f"a capture failed ({_brief(error)})"
                raise
        finally:
            _dispatch.restore_after_backward_peak(pending)
        self.staging.forget_sources()  # the warm-up and the capture ran on the staged inputs; keep them honest
        self.stats["captured"] += 1
        return graph, outputs

    @staticmethod
    def _copied_out(buffers: list) -> list:
        """Fresh tensors with the staging outputs' values (one launch for all)."""
        results = [None if b is None else torch.empty_like(b) for b in buffers]
        pairs = [(r, b) for r, b in zip(results, buffers) if b is not None]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([_compact(r) for r, _ in pairs], [_compact(b) for _, b in pairs])
        return results

    @staticmethod
    def _outputs(entry: _Entry, tensors: list):
        if entry.out_shape is None:
            return tensors[0]
        return tuple(t if slot is None else slot[1] for t, slot in zip(tensors, entry.out_shape))

    def summary(self) -> dict:
        """The counters, the staging buffers' MiB and the reasons layers are off (benchmark rows)."""
        return {**self.stats, "staging_mib": round(self.staging.bytes() / 2**20), "off": sorted(set(self.off.values()))}

    def log_fields(self) -> dict:
        summary = self.summary()
        del summary["off"]
        fields = {f"layer_graphs/{key}": value for key, value in summary.items()}
        fields["layer_graphs/layers_off"] = len(self.off)
        return fields
