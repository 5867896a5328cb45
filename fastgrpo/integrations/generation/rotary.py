"""Rotary embeddings as tables in the decode step: positions looked up, no host work while a step is captured.

The engine captures each decode step as a CUDA graph, which allows no host work on device values and no copy from
pageable host memory. Most transformers rotary modules compute cos/sin from device buffers and are capturable as they
are, but some are not: PhiMoE builds its frequencies on the CPU in every call, and the length-dependent RoPE types
("dynamic", "longrope") read max(position_ids) on the host to choose theirs. So while the engine decodes, every rotary
module (a module whose class name ends in `RotaryEmbedding`, transformers' convention) answers from a table of its own
outputs for positions 0..length-1, computed by its own forward, eagerly, before the first decode step:

- exact: a rotary output at a position depends on that position alone (and the module's buffers), so a row of the
  table is what the module computes for that position; the values are the same bits.
- length-dependent types choose their frequencies by the longest position seen. Within the pretraining length (their
  `original_max_position_embeddings` / `original_max_seq_len`) every choice is the original one, which the table
  holds; a call whose rows go past it raises `NotRolloutAttention` (the generator falls back to `model.generate`
  with the reason), since `generate` would switch frequencies part-way through a row.
- a call the table cannot answer (position ids not [rows, positions] integers, outputs that are not per-position
  tensors) runs the module's own forward.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from fastgrpo.integrations.generation.kv import NotRolloutAttention

# RoPE types whose frequencies depend on the longest position of the call (transformers' `dynamic_rope_update`).
LENGTH_DEPENDENT = ("dynamic", "longrope")
_ABSENT = object()  # a module without an instance `forward` of its own


def rotary_modules(decoder: nn.Module) -> list[nn.Module]:
    return [m for m in decoder.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _rope_types(module: nn.Module) -> set[str]:
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, dict):  # one per layer kind (Gemma-3 and others)
        return {str(k) for k in kind.values()}
    parameters = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
    if kind is None and isinstance(parameters, dict):
        kind = parameters.get("rope_type")
    return {str(kind)} if kind is not None else set()


def pretraining_length(module: nn.Module) -> int | None:
    """The longest length at which a length-dependent rotary module keeps its original frequencies, read where
    transformers' `dynamic_rope_update` reads it: longrope's `original_max_position_embeddings` among the RoPE
    parameters, dynamic RoPE's `original_max_seq_len` (the configured max_position_embeddings)."""
    kinds = _rope_types(module)
    found = []
    if "longrope" in kinds:
        parameters = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
        entries = parameters.values() if all(isinstance(v, dict) for v in parameters.values()) else [parameters]
        found += [int(e["original_max_position_embeddings"]) for e in entries
                  if isinstance(e, dict) and e.get("original_max_position_embeddings")]
    if "dynamic" in kinds and getattr(module, "original_max_seq_len", None):
        found.append(int(module.original_max_seq_len))
    return min(found) if found else None


class RotaryTables:
    """Per-position tables of a decoder's rotary modules for positions [0, length), built at their first call (the
    engine's first decode step of a batch size runs eagerly) and kept as long as the captured graphs that read them."""

    def __init__(self, length: int):
        self.length = length
        self.tables: dict[tuple, tuple[torch.Tensor, ...] | None] = {}

    @contextlib.contextmanager
    def installed(self, decoder: nn.Module, layers: nn.Module):
        """Inside the block the decoder's rotary modules answer from the tables, but for those inside `layers` (the
        decoder layers, compiled for the decode step: Dynamo traces their rotary modules, and a table per module
        there would make it compile a graph per layer)."""
        inside = {id(m) for m in layers.modules()}
        modules = [(m, m.__dict__.get("forward", _ABSENT)) for m in rotary_modules(decoder) if id(m) not in inside]
        try:
            for module, _ in modules:
                module.forward = functools.partial(self._call, module, module.forward)
            yield
        finally:
            for module, saved in modules:
                if saved is _ABSENT:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = saved

    def _build(self, module: nn.Module, forward, x: torch.Tensor, extra: tuple) -> tuple[torch.Tensor, ...] | None:
        length = self.length
        if _rope_types(module) & set(LENGTH_DEPENDENT):  # the original frequencies (check_length keeps rows within)
            length = min(length, pretraining_length(module) or length)
        out = forward(x[:1], torch.arange(length, device=x.device)[None], *extra)
        if not (isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) and t.dim() >= 2 and
                                                       tuple(t.shape[:2]) == (1, length) for t in out)):
            return None
        return tuple(t[0] for t in out)

    def _call(self, module: nn.Module, forward, x: torch.Tensor, position_ids: torch.Tensor | None = None, *extra,
              **kwargs):
        usable = (position_ids is not None and position_ids.dim() == 2 and not position_ids.is_floating_point()
                  and not kwargs and all(isinstance(e, (str, int, type(None))) for e in extra))
        if not usable:
            return forward(x, position_ids, *extra, **kwargs)
        key = (id(module), x.dtype, x.device, extra)
        if key not in self.tables:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise NotRolloutAttention(f"{type(module).__name__}: its rotary table first asked for while a decode "
                                          "step is captured")
            self.tables[key] = self._build(module, forward, x, extra)
        table = self.tables[key]
        if table is None:
            return forward(x, position_ids, *extra)
        return tuple(t[position_ids] for t in table)


def check_length(decoder: nn.Module, length: int) -> None:
    """NotRolloutAttention where a length-dependent rotary module would change its frequencies within rows of
    `length` positions."""
    for module in rotary_modules(decoder):
        kinds = _rope_types(module) & set(LENGTH_DEPENDENT)
        limit = pretraining_length(module) if kinds else None
        if kinds and (limit is None or length > limit):
            raise NotRolloutAttention(
                f"{type(module).__name__} ({'/'.join(sorted(kinds))} RoPE) changes its frequencies with the sequence "
                f"length past {limit} positions, and these rows reach {length}")
