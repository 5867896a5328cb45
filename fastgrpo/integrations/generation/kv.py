"""The rollout engine's KV cache and the attention function transformers calls with it.

Any transformers decoder whose attention goes through `AttentionInterface` (`attention_interface(self, q, k, v, mask,
scaling=..., sliding_window=..., softcap=..., s_aux=..., **kwargs)`) decodes on this cache with no per-model code:

- `RolloutCache` is the `past_key_values` the model is called with. Its `update` hands the new keys and values
  through unchanged: the attention function writes them. So no layer index, Python int or cache length ever
  reaches a compiled graph; the model's mask builders see an attention implementation with no mask function and
  build nothing (`masking_utils._preprocess_mask_arguments` exits early).
- Each attention module owns its layer's cache tensors, attached to it as `_fastgrpo_kv` during the prefill:
  [rows, kv_heads, slots, head_dim] keys and values. Being module attributes, they are inputs of a compiled
  decoder layer, so one compiled layer serves every layer of its kind.
- `RolloutState`, the engine's one forward context (`rollout_context`; read by the attention function whatever
  keywords a model forwards to it), holds the per-call tensors: which cache row each batch row decodes into, the
  first valid slot of each cache row (left padding) and the number of written slots, a device tensor advanced inside
  the captured decode step. A compiled layer reads it as an input; its `rows` tensor differs per batch size.

Slots: a row's prompt fills slots [start, prompt_len) (left-padded), its completion token t slot prompt_len + t.
Rows that share a prompt (GRPO's group) read its slots from the one cache row the prefill wrote them to
(`prompt_rows`); with `prompt_groups` (engine.GROUPED_PROMPT_ATTENTION; by default in the layers whose tokens' KV is
large: `decode_attention.grouped_prompt_pays`) the decode attention attends to them once a step for all the group's
rows.
The token at slot s has position s - start (real tokens only, as `model.generate` counts them).

Memory (`CacheLayout`): a cache tensor is a strided view [rows, kv_heads, slots, head_dim] of one buffer with a plane
per KV head, in which a row's slots of the head are contiguous (as in a contiguous cache: the decode kernel reads a
row's head as one run). Rows that only decode never touch their prompt slots, so in the compact layout consecutive
rows lie `completion` slots apart in each plane: row r's prompt slots overlap row r-1's completion slots, and the
prefill writes each distinct prompt into a row of its own past all of them. A group of 8 completions of 512 tokens
after a 256-token prompt then takes 37.6k slots instead of 49.2k (-23 %).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from fastgrpo.integrations.generation.recurrent import STATES_ATTRIBUTE
from fastgrpo.integrations.windows import UNKNOWN_WINDOW, layer_window
from fastgrpo.kernels.decode_attention import decode_attention, grouped_prompt_pays

ATTN_IMPLEMENTATION = "fastgrpo_rollout"
_KV_ATTRIBUTE = "_fastgrpo_kv"


@dataclass
class RolloutState:
    """What the attention function needs besides q, k, v (one object per engine; see the module docstring)."""

    rows: torch.Tensor  # [batch] int64: the cache row each batch row reads and writes
    start: torch.Tensor  # [cache rows] int64: first valid slot of each cache row
    length: torch.Tensor  # 0-d int64: slots written so far, this step's token included
    prompt_rows: torch.Tensor  # [cache rows] int64: the cache row holding each row's prompt slots
    prompt_len: torch.Tensor  # 0-d int64: the padded prompt length (prompt slots are [0, prompt_len))
    layout: CacheLayout  # how the layer caches are allocated at the prefill (cache_rows decoding rows, slots)
    prompt_groups: torch.Tensor | None = None  # [entries, 8]: batch rows by shared prompt (decode_attention)
    prompt_groups_everywhere: bool = False  # pass prompt_groups to every layer, not only where grouped_prompt_pays
    prefill: bool = False  # the prompt pass: allocate the layer caches, write slots [0, q) of the prompt rows
    prefill_calls: int = 0  # attention calls in the prefill (each layer's must reach this function)
    prefill_modules: set = field(default_factory=set)  # ids of the attention modules the prefill called

    @property
    def cache_rows(self) -> int:
        return self.layout.rows


class RolloutCache(Cache):
    """`past_key_values` for the rollout engine: keys and values pass through (the attention function stores them)."""

    def __init__(self):
        super().__init__(layers=[])
        self.seen_tokens = 0  # host-side count, for models that ask; never enters a compiled decode step
        self.prefilling = False
        self.prefill_updates = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.prefilling:
            self.prefill_updates += 1
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_query_offset(self, *args, **kwargs):
        raise NotRolloutAttention(
            "the model derives positions from the cache's offsets, which the rollout engine's cache (one per row, "
            "left-padded) does not keep"
        )

    get_mask_sizes = get_query_offset

    @property
    def is_compileable(self) -> bool:
        return True


_CONTEXT: list[RolloutState | None] = [None]


@contextlib.contextmanager
def rollout_context(state: RolloutState):
    """Make `state` what the rollout attention reads while the engine runs the model."""
    previous, _CONTEXT[0] = _CONTEXT[0], state
    try:
        yield state
    finally:
        _CONTEXT[0] = previous


class NotRolloutAttention(RuntimeError):
    """The model did not call the rollout attention as the engine needs it (the generator falls back)."""


@dataclass(frozen=True)
class CacheLayout:
    """Where slot s of cache row r lies: element (h * buffer_slots + r * completion + s) * head_dim + d of one buffer
    for KV head h (its plane).

    Rows [0, rows) decode; distinct prompt j is written to row `prompt_row(j)`, and decoding rows read prompt slots
    only from there (`prompt_rows`). `plain`: rows `slots` apart, prompt j in row j (rows hold prompt copies when
    `SHARED_PROMPT_SLOTS` is off). `compact`: rows `completion` = slots - prompt_capacity apart, so a decoding row's
    completion slots [prompt_len, prompt_len + completion) (prompt_len <= prompt_capacity) lie within
    [r * completion, (r + 1) * completion + prompt_capacity), disjoint from every other row's; its prompt slots alias
    row r - 1's and are never read or written. Prompt rows lie past all decoding rows, `prompt_step` rows apart (at
    least prompt_capacity slots), so no slot of theirs aliases a used one."""

    rows: int
    slots: int
    completion: int  # slots between consecutive rows
    prompt_first: int = 0
    prompt_step: int = 1
    prompts: int = 0  # prompt rows past the decoding rows (compact only)

    @classmethod
    def plain(cls, rows: int, slots: int) -> CacheLayout:
        return cls(rows, slots, slots)

    @classmethod
    def compact(cls, rows: int, slots: int, prompt_capacity: int, prompts: int) -> CacheLayout:
        completion = slots - prompt_capacity
        step = -(-prompt_capacity // completion)
        return cls(rows, slots, completion, rows + step, step, prompts)

    @classmethod
    def best(cls, rows: int, slots: int, prompt_capacity: int, prompts: int) -> CacheLayout:
        """The compact layout where it takes fewer slots than the plain one, else the plain one."""
        plain = cls.plain(rows, slots)
        if prompts < 1 or prompt_capacity >= slots:
            return plain
        compact = cls.compact(rows, slots, prompt_capacity, prompts)
        return compact if compact.buffer_slots < plain.buffer_slots else plain

    @property
    def is_compact(self) -> bool:
        return self.completion != self.slots

    @property
    def prompt_capacity(self) -> int:
        return self.slots - self.completion

    @property
    def view_rows(self) -> int:
        return self.prompt_first + (self.prompts - 1) * self.prompt_step + 1 if self.is_compact else self.rows

    @property
    def buffer_slots(self) -> int:
        return (self.view_rows - 1) * self.completion + self.slots

    def holds(self, rows: int, slots: int, prompt_len: int, prompts: int) -> bool:
        """Whether a call of `rows` rows, `slots` slots and `prompts` distinct prompts of `prompt_len` padded tokens
        fits this layout."""
        if self.is_compact:
            return (rows <= self.rows and prompts <= self.prompts and prompt_len <= self.prompt_capacity
                    and slots - prompt_len <= self.completion)
        return rows <= self.rows and slots <= self.slots

    def prompt_row(self, prompt: torch.Tensor | int):
        return self.prompt_first + prompt * self.prompt_step

    def prompt_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache's prompt rows: row j holds distinct prompt j (what the prefill writes)."""
        return cache[self.prompt_first::self.prompt_step]

    def shape(self, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (self.view_rows, kv_heads, self.slots, head_dim)

    def strides(self, head_dim: int) -> tuple[int, int, int, int]:
        return (self.completion * head_dim, self.buffer_slots * head_dim, head_dim, 1)

    def allocate(self, kv_heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed `shape` view of one buffer with `strides`, of `like`'s dtype and device."""
        buffer = like.new_zeros(kv_heads * self.buffer_slots * head_dim)
        return buffer.as_strided(self.shape(kv_heads, head_dim), self.strides(head_dim))


def _layer_cache(module, key: torch.Tensor, state: RolloutState) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's cache tensors, (re)allocated at the prefill when missing or of another layout, shape or dtype."""
    kv = module.__dict__.get(_KV_ATTRIBUTE)
    layout, heads, dim = state.layout, key.shape[1], key.shape[3]
    if (kv is None or kv[0].shape != layout.shape(heads, dim) or kv[0].stride() != layout.strides(dim)
            or kv[0].dtype != key.dtype or kv[0].device != key.device):
        module.__dict__[_KV_ATTRIBUTE] = None  # free the old tensors first
        kv = (layout.allocate(heads, dim, key), layout.allocate(heads, dim, key))
        module.__dict__[_KV_ATTRIBUTE] = kv
    return kv


def has_layer_cache(module: torch.nn.Module) -> bool:
    return module.__dict__.get(_KV_ATTRIBUTE) is not None


def release_caches(model: torch.nn.Module) -> None:
    """Free the engine's per-module caches: attention modules' KV tensors, linear-attention mixers' states."""
    for module in model.modules():
        module.__dict__.pop(_KV_ATTRIBUTE, None)
        module.__dict__.pop(STATES_ATTRIBUTE, None)


def _window(sliding_window) -> int | None:
    return int(sliding_window) if sliding_window else None


_NOT_GIVEN = object()  # a call that names no sliding window (None names "no window")


def rollout_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=_NOT_GIVEN,
                      softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query [b, Hq, q, D], key/value [b, Hkv, q, D] (this call's tokens);
    returns ([b, q, Hq, D], None). A call that names no `sliding_window` gets the one the model's mask would apply
    (`windows.layer_window`: the engine builds no mask)."""
    if sliding_window is _NOT_GIVEN:
        sliding_window = layer_window(module, {})
        if sliding_window == UNKNOWN_WINDOW:
            raise NotRolloutAttention(
                f"{type(module).__name__} names neither its sliding window nor its layer index, in a model of sliding "
                "and full layers: its window is only in the mask, which the rollout engine does not build")
    state = _CONTEXT[0]
    if state is None:
        raise NotRolloutAttention(
            f"{type(module).__name__} called the rollout attention outside the rollout engine (attn_implementation "
            f"{ATTN_IMPLEMENTATION!r} is set only while the engine decodes)"
        )
    if key.shape[-1] != value.shape[-1]:
        raise NotRolloutAttention(f"{type(module).__name__}: keys and values of different head dims")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = _window(sliding_window)
    softcap = float(softcap) if softcap else None
    if not state.prefill:
        k_cache, v_cache = module.__dict__[_KV_ATTRIBUTE]
        groups = state.prompt_groups
        if groups is not None and not (state.prompt_groups_everywhere or grouped_prompt_pays(k_cache)):
            groups = None
        out = decode_attention(
            query[:, :, 0], key[:, :, 0], value[:, :, 0], k_cache, v_cache, state.rows, state.start, state.length,
            scale=scale, window=window, softcap=softcap, sinks=s_aux, prompt_rows=state.prompt_rows,
            prompt_len=state.prompt_len, prompt_groups=groups,
        )
        return out[:, None], None
    state.prefill_calls += 1
    if id(module) in state.prefill_modules:
        raise NotRolloutAttention(
            f"{type(module).__name__} is called more than once per forward: one cache a module cannot hold its calls"
        )
    state.prefill_modules.add(id(module))
    k_cache, v_cache = (state.layout.prompt_view(cache) for cache in _layer_cache(module, key, state))
    return prefill_attention(query, key, value, k_cache, v_cache, state.start, scale, window, softcap, s_aux), None


def prefill_attention(query, key, value, k_cache, v_cache, start, scale, window, softcap, sinks):
    """Write a whole left-padded prompt batch into rows [0, b), slots [0, q) of the caches given (the layout's prompt
    rows), and attend causally within it.

    Query slot i sees key slot j when start <= j <= i (and i - j < window); a padding query sees itself only, so no
    row of the softmax is empty. Returns [b, q, Hq, D]."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    k_cache[:b, :, :q_len] = key.to(k_cache.dtype)
    v_cache[:b, :, :q_len] = value.to(v_cache.dtype)
    slots = torch.arange(q_len, device=query.device)
    causal = slots[None, :, None] >= slots[None, None, :]
    visible = causal & (slots[None, None, :] >= start[:b, None, None])
    if window:
        visible &= slots[None, :, None] - slots[None, None, :] < window
    visible |= torch.eye(q_len, dtype=torch.bool, device=query.device)[None]
    visible = visible[:, None]  # [b, 1, q, k]
    group = hq // hkv
    key, value = key.to(query.dtype), value.to(query.dtype)
    if softcap is None and sinks is None:
        key = key.repeat_interleave(group, dim=1) if group > 1 else key
        value = value.repeat_interleave(group, dim=1) if group > 1 else value
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale)
        return out.transpose(1, 2).contiguous()
    # Softcapped or sink attention: plain maths in fp32, one row at a time (a prefill is once per call).
    outs = []
    for row in range(b):
        qf = query[row].float().reshape(hkv, group, q_len, d)
        scores = torch.einsum("hgqd,hkd->hgqk", qf, key[row].float()) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[row, 0][None, None], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(hkv, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hgqk,hkd->hgqd", probs, value[row].float()).reshape(hq, q_len, d))
    return torch.stack(outs).to(query.dtype).transpose(1, 2).contiguous()


AttentionInterface.register(ATTN_IMPLEMENTATION, rollout_attention)
