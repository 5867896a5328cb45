"""Linear-attention and state-space layers in the rollout engine: their conv and recurrent states.

transformers' mixers of such layers (Mamba, Mamba-2, gated DeltaNet, short convolutions and their kin: Qwen3.5,
Qwen3-Next, Falcon-H1, Nemotron-H, Zamba2, Jamba, Bamba, Kimi-Linear, Zaya, ...) take the cache (as `cache_params` or
`past_key_values`) and use one API on it:
`has_previous_state(layer_idx)`, `update_conv_state(x, layer_idx, ...)` and `update_recurrent_state(s, layer_idx)` in
the prefill; in a decode step `layers[layer_idx].conv_states[0]` (updated in place by the causal-conv step),
`.recurrent_states[0]` and `update_recurrent_state`. While the engine decodes, each such mixer is handed its own
`LayerStates` instead of the shared cache (the mixer classes' forward is wrapped for the call), so that, as with the
attention layers' KV tensors, a layer's states are inputs of the compiled decoder layer and never its index.

States hold one row per batch position, not per cache row as the KV cache does: a decode step reads the first `rows`
of them. The engine reorders them when finished rows drop out (`reorder`) and when a prompt's prefill row is spread to
its completions (`spread`): a few copies a call. Left padding: the prefill is given the prompts' 2D mask, with which
the mixers zero the padded positions' inputs, so a row's states stay zero until its first token, as in
`model.generate`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

STATES_ATTRIBUTE = "_fastgrpo_states"
CACHE_ARGUMENTS = ("cache_params", "past_key_values")  # what transformers' mixers call the cache they update
_STATE_CALLS = (".update_conv_state(", ".update_recurrent_state(")
_CACHE_ARGUMENT: dict[type, tuple[str, int] | None] = {}
_WRAPPERS: dict[type, object] = {}  # mixer class -> its forward wrapper: one object per class, so guards hold


def _cache_argument(cls: type) -> tuple[str, int] | None:
    """(name, position after self) of the cache argument of a mixer class: one whose forward updates conv or recurrent
    states on a cache it takes (not the blocks and models that pass the cache on); None for any other class."""
    if cls not in _CACHE_ARGUMENT:
        found = None
        try:
            forward = inspect.unwrap(cls.forward)
            source = inspect.getsource(forward)
            names = list(inspect.signature(forward).parameters)
        except (TypeError, OSError, ValueError):
            source, names = "", []
        if any(call in source for call in _STATE_CALLS):
            found = next(((name, names.index(name) - 1) for name in CACHE_ARGUMENTS if name in names), None)
        _CACHE_ARGUMENT[cls] = found
    return _CACHE_ARGUMENT[cls]


def recurrent_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward updates conv or recurrent states on the cache it takes (the mixers)."""
    return [m for m in model.modules() if _cache_argument(type(m)) is not None]


def has_states(module: nn.Module) -> bool:
    return module.__dict__.get(STATES_ATTRIBUTE) is not None


class LayerStates:
    """One mixer's conv and recurrent states, with the part of transformers' Cache API the mixers call.

    `conv_states` / `recurrent_states` map a state index to the [rows, ...] view of its buffer that the current batch
    reads; the buffers ([capacity, ...]) are allocated in the prefill and keep their address across steps and calls
    (captured decode steps read them). Outside the prefill the updates only write in place."""

    record_past = False  # read by the mixers: no rollback of conv states is kept

    def __init__(self):
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        self.conv_kernel_size: dict[int, int] = {}
        self.previous: dict[int, bool] = {}
        self.capacity = 0
        self.prefilling = False
        self.written = False  # whether this call's prefill wrote a state (the mixer ran with the cache)

    # -- the Cache API of the mixers ---------------------------------------------------------------------------------

    @property
    def layers(self) -> LayerStates:
        return self  # cache_params.layers[layer_idx] is this object: its index is never read

    def __getitem__(self, layer_idx) -> LayerStates:
        return self

    def has_previous_state(self, layer_idx=None, state_idx: int = 0) -> bool:
        return self.previous.get(state_idx, False)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx=None, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """transformers' `LinearAttentionLayer.update_conv_state`: keep the last `conv_kernel_size` columns of the
        [rows, channels, tokens] input (continuing from the kept ones when there are), return what the causal conv
        reads (the input left-padded to the kernel size, or the kept columns and the input)."""
        if self.previous.get(state_idx, False):
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        else:
            kernel = conv_kernel_size or conv_states.shape[-1]
            self.conv_kernel_size[state_idx] = kernel
            full = F.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
            self.previous[state_idx] = True
        kept = full[..., -self.conv_kernel_size[state_idx]:]
        self._write("conv", self.conv_states, state_idx, kept)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx=None, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        return self._write("recurrent", self.recurrent_states, state_idx, recurrent_states)

    # -- what the engine calls --------------------------------------------------------------------------------------

    def begin_prefill(self, capacity: int) -> None:
        """A new call: states start empty; the prefill writes the first rows of buffers of `capacity` rows."""
        self.previous.clear()
        self.capacity, self.prefilling, self.written = capacity, True, False

    def end_prefill(self) -> None:
        self.prefilling = False

    @property
    def bytes_per_row(self) -> int:
        """What a decode step reads (and writes) of these states for one row."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values()) // max(self.capacity, 1)

    def spread(self, source: torch.Tensor) -> None:
        """Row i takes the states of prefill row source[i] (GRPO's completions of one prompt)."""
        for buffer in self._buffers.values():
            buffer[: len(source)] = buffer[source]

    def reorder(self, positions: torch.Tensor) -> None:
        """Row i takes the states of row positions[i] (the rows still running, first); the batch is then that long."""
        for buffer in self._buffers.values():
            buffer[: len(positions)] = buffer[positions]
        self.use_rows(len(positions))

    def use_rows(self, rows: int) -> None:
        """The decode steps from now on run `rows` rows: the views they read."""
        for (kind, index), buffer in self._buffers.items():
            (self.conv_states if kind == "conv" else self.recurrent_states)[index] = buffer[:rows]

    def _write(self, kind: str, views: dict, index: int, value: torch.Tensor) -> torch.Tensor:
        if not self.prefilling:  # a decode step: in place, into the view its graph reads
            views[index].copy_(value)
            return views[index]
        key = (kind, index)
        buffer = self._buffers.get(key)
        shape = (self.capacity, *value.shape[1:])
        if buffer is None or buffer.shape != shape or buffer.dtype != value.dtype or buffer.device != value.device:
            buffer = self._buffers[key] = value.new_zeros(shape)
        buffer[: value.shape[0]].copy_(value)
        views[index] = buffer[: value.shape[0]]
        self.written = True
        return views[index]


def _own_states_forward(original, name: str, position: int):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        states = self.__dict__.get(STATES_ATTRIBUTE)
        if states is not None:
            if kwargs.get(name) is not None:
                kwargs[name] = states
            elif len(args) > position and args[position] is not None:
                args = (*args[:position], states, *args[position + 1:])
        return original(self, *args, **kwargs)

    return forward


@contextlib.contextmanager
def own_states(mixers: list[nn.Module]):
    """Each mixer given its `LayerStates` (kept across calls) and handed it as its cache argument for the block."""
    classes = {type(m) for m in mixers}
    saved = {cls: cls.__dict__.get("forward") for cls in classes}
    # The mixers read their `layer_idx` only to index the cache, which their LayerStates ignore; Dynamo guards it all
    # the same (`cache_params.layers[self.layer_idx]`), so distinct indices would compile one decode graph per layer
    # and hit the recompile limit at 9 linear layers. For the block every mixer says 0: one graph per layer kind.
    indices = {m: m.__dict__["layer_idx"] for m in mixers if isinstance(m.__dict__.get("layer_idx"), int)}
    try:
        for module in mixers:
            if not has_states(module):
                module.__dict__[STATES_ATTRIBUTE] = LayerStates()
        for module in indices:
            module.__dict__["layer_idx"] = 0
        for cls in classes:
            wrapper = _WRAPPERS.get(cls)
            if wrapper is None:
                wrapper = _WRAPPERS[cls] = _own_states_forward(cls.forward, *_cache_argument(cls))
            cls.forward = wrapper
        yield [m.__dict__[STATES_ATTRIBUTE] for m in mixers]
    finally:
        for module, index in indices.items():
            module.__dict__["layer_idx"] = index
        for cls, forward in saved.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
