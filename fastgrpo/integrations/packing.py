"""Padding-free GRPO forwards: the rows of a batch packed into one sequence, optionally sharing each prompt.

TRL hands the model rows laid out as [left-padded prompt | right-padded completion]. A padded
forward spends compute on the padding and, within a group of G completions, recomputes the same
prompt G times. Here the rows become one sequence of length T = sum of real tokens:

- `plan_packing` lists the packed tokens with per-token metadata: a position id that restarts at 0
  in every row (RoPE sees what it saw at generation), a group id (the rows that see each other's
  tokens: one row, or with `share_prompt` the rows behind one prompt), a segment id and an
  is-prompt flag. With sharing, a group's prompt is packed once and followed by its completions,
  whose positions continue from the prompt length: prompt + c1 + ... + cG.
- `PackPlan.mask_mod` is the attention rule, one function for every mechanism: a query sees a key
  of its own group at or before it, in its own segment or in the group's prompt (and, for
  sliding-window layers, fewer than `window` positions back).
- The same rule as causal segments for variable-length attention (fastgrpo.kernels.packed_attention: flash's
  kernel on CUDA, 1.51x flex_attention on the H200): without sharing each row is a segment; with sharing a
  group's prompt is one, and each completion another whose keys are the prompt's followed by its own (a gathered
  copy of the keys and values, `PackPlan.kv_index`). The packed call hands the bounds to every attention layer,
  and each layer that can runs them instead of the mask.
- `attention_masks` turns that rule into what the model's attention takes: a flex_attention
  `BlockMask` (CUDA: built from per-128-token-block id ranges, O((T/128)^2), no [T, T] tensor), or a dense
  [1, 1, T, T] mask for SDPA / eager attention (CPU, where flex_attention has no backward; only
  small T belong there).
- The scored positions (labels != -100) are read off the packed hidden states at `plan.source`
  and written back with `plan.rows, plan.cols` into TRL's padded [B, S - 1] layout.
- Which attention each layer runs for a packed call is fastgrpo.integrations.packed_dispatch's. Where every layer
  takes the segments (`segments_everywhere`), the packed call builds no mask at all, and where its
  layer calls replay as CUDA graphs (fastgrpo.compiler.layer_graphs, whose keys hold every input's shape and the ints
  it is given) `pad_plan` gives it the shapes of a length bucket, so that a few graphs serve batches whose lengths
  vary.

Pure torch and transformers; the caller (fastgrpo.integrations.trl) decides when to use it.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from fastgrpo.compiler.layer_graphs import bucket_length, bucket_step
from fastgrpo.kernels._dispatch import next_power_of_2
from fastgrpo.integrations.packed_dispatch import (PACKED_ATTENTION_PREFIX, segments_everywhere,
                                                   use_mask_dispatched_attention, varlen_refusal)
from fastgrpo.integrations.windows import layer_kinds, model_window
from fastgrpo.kernels.packed_attention import FLASH_TAKES_WINDOW

# Layer kinds whose attention a mask can confine to a segment. Anything else (linear attention,
# state-space or convolution mixers) carries state along the sequence and would leak across rows.
ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention"}
FLEX_BLOCK_SIZE = 128
# The share of a padded batch's tokens that packing must drop to pay on CUDA. `python bench/grpo_step.py --systems
# fastgrpo,fastgrpo_packed --completions 4096` (H200, Qwen2.5-1.5B shape, 8 completions behind a 256-token prompt):
# all 4096 long (nothing to drop), padded (cuDNN attention) 774-794 ms against packed (flex_attention) 900 ms; spread
# over 10-100 % of 4096 (`--spread`, 47 % dropped), packed 480 ms against padded 723 ms; with flash's variable-length
# kernel instead of flex_attention the spread batch packed took 416 against 517 ms. cuDNN's attention on a padded
# batch is 1.75x flash's at these shapes, so a batch with little padding stays padded.
PACK_MIN_SAVED = 0.15
# A padded batch's sliding-window layers attend through a dense mask, each query against every key of its row, where
# packed segments take only the window's band (flash's window). So a batch whose rows are at least this many windows
# long packs whatever padding it drops. `python bench/grpo_step.py --systems fastgrpo,fastgrpo_packed --shape
# phi-3-mini --completions 4096` (H100; rows of 4352 tokens, window 2047, all 32 layers sliding): packed 1692 ms
# against padded 2225 ms, with nothing to drop.
WINDOW_PACK_ROWS = 2
# Above this many packed tokens the dense-mask mechanism (CPU) refuses: a [T, T] mask would be too big.
DENSE_MASK_MAX_TOKENS = 8192


@dataclass
class PackPlan:
    """One packed sequence and how it maps back to the padded batch it came from."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per group (completions continue after a shared prompt)
    group: torch.Tensor  # [T_pad] int; T_pad = T rounded up to FLEX_BLOCK_SIZE, padding gets group -1
    segment: torch.Tensor  # [T_pad] int
    is_prompt: torch.Tensor  # [T_pad] bool: a shared prompt token (visible to the whole group)
    positions: torch.Tensor  # [T_pad] position ids again, padded, for the sliding-window rule
    source: torch.Tensor  # [N] packed index whose hidden state scores each labelled token
    targets: torch.Tensor  # [N] the labelled token ids
    rows: torch.Tensor  # [N] row of each scored token in the padded batch
    cols: torch.Tensor  # [N] its column in the shifted [B, S - 1] layout (label column - 1)
    batch_shape: tuple[int, int]  # (B, S - 1)
    shared_rows: int  # rows whose prompt was packed once for several rows (0 without sharing)
    # The rule as causal segments for variable-length attention, int32 [segments + 1] from 0: the queries' bounds in
    # the packed sequence, and the keys' in the copy of it that `kv_index` gathers (a completion after a shared
    # prompt: the prompt's keys, then its own; without sharing each row's keys are its queries, kv_index None).
    cu_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    kv_index: torch.Tensor | None
    longest: int  # the longest query segment
    longest_k: int  # the longest key segment

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def mask_mod(self, window: int | None = None):
        """The attention rule as a flex_attention mask_mod (also evaluated densely for SDPA/eager)."""
        group, segment, is_prompt, positions = self.group, self.segment, self.is_prompt, self.positions

        def packed_mask(batch, head, q, kv):
            visible = (group[q] == group[kv]) & (kv <= q) & ((segment[q] == segment[kv]) | is_prompt[kv])
            return visible & (group[q] >= 0)

        if window is None:
            return packed_mask

        def packed_sliding_mask(batch, head, q, kv):
            return packed_mask(batch, head, q, kv) & (positions[q] - positions[kv] < window)

        return packed_sliding_mask

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-scored-token values [N] into the padded [B, S - 1] layout, zero elsewhere."""
        out = values.new_zeros(self.batch_shape)
        return out.index_put((self.rows, self.cols), values)

    def scored_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.batch_shape, dtype=torch.bool, device=self.rows.device)
        return mask.index_put((self.rows, self.cols), torch.ones_like(self.rows, dtype=torch.bool))


def plan_packing(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    prompt_columns: int | None = None,
    share_prompt: bool = False,
) -> tuple[PackPlan | None, str | None, str | None]:
    """Pack rows of [left-padded prompt | right-padded completion]; returns (plan, failure, no_sharing).

    `labels` as TRL passes them to the model (shifted inside: the token at column c is scored from
    the hidden state at column c - 1; -100 = not scored). With `share_prompt`, rows whose prompts
    (columns < `prompt_columns`, padding included) are identical are packed as one prompt followed by their
    completions, wherever they sit in the batch (TRL shuffles the rows of a generation batch before the loss's
    forward). `failure` says why the batch cannot be packed at all (plan None); `no_sharing` why
    sharing was asked for but not done. When the only reason is that no prompt repeats, each row still gets
    its prompt and its completion as two segments, the layout of a shared batch (the same attention call, so
    the same compiled graph); otherwise the plan is plain packing.
    """
    rows, columns = input_ids.shape
    device = input_ids.device
    real = attention_mask.bool()
    scored = labels != -100
    counts = real.sum(1)
    first = torch.where(counts > 0, real.int().argmax(1), columns)
    last = torch.where(counts > 0, columns - 1 - real.flip(1).int().argmax(1), -1)
    col = torch.arange(columns, device=device)
    if not bool(((last - first + 1).clamp(min=0) == counts).all()):
        return None, "a row's attention mask has holes (real tokens are not contiguous)", None
    if bool((scored & ~real).any()):
        return None, "a label sits on a padding position", None
    if bool((scored & (col == first[:, None])).any()):
        return None, "a row's first real token is labelled (no earlier position to score it from)", None

    no_sharing = None
    prompt_of = list(range(rows))  # rows with equal numbers here share a prompt
    sharing = False  # prompts packed as segments of their own, each followed by its rows' completions
    shared_rows = 0  # rows whose prompt another row has too
    if share_prompt:
        no_sharing = _sharing_problem(rows, first, last, scored, col, prompt_columns)
        if no_sharing is None:
            sharing = True
            prompts = input_ids[:, :prompt_columns].masked_fill(~real[:, :prompt_columns], -1)
            _, inverse, counts = torch.unique(prompts, dim=0, return_inverse=True, return_counts=True)
            prompt_of = inverse.tolist()
            shared_rows = int(counts[counts > 1].sum())
            if shared_rows == 0:
                no_sharing = "no two rows have the same prompt"

    # The layout is built on the host from a few numbers per row (small ops, no kernel launches), then moved.
    host = torch.device("cpu")
    first_l, last_l = first.tolist(), last.tolist()
    # Rows with one prompt are packed one after another, the prompts in the order of their first row.
    first_row_of = {}
    for row, prompt in enumerate(prompt_of):
        first_row_of.setdefault(prompt, row)
    order = sorted(range(rows), key=lambda row: (first_row_of[prompt_of[row]], row))
    flat_index, positions, groups, segments, prompt_flags = [], [], [], [], []
    packed_of = torch.full((rows, columns), -1, dtype=torch.long)
    cursor, group_id, segment_id = 0, -1, -1
    query_lengths, key_spans = [], []  # per attention segment: its length, and the (start, length) spans of its keys
    prompt_span = None  # (packed start, length) of the current group's shared prompt
    previous = None
    for row in order:
        start, stop = first_l[row], last_l[row] + 1
        if stop <= start:
            continue
        if sharing:
            if prompt_of[row] != previous:
                previous = prompt_of[row]
                group_id += 1
                segment_id += 1
                prompt_span = (cursor, prompt_columns - start)
                _append(flat_index, positions, groups, segments, prompt_flags, row * columns + start,
                        prompt_columns - start, 0, group_id, segment_id, True, host)
                query_lengths.append(prompt_span[1])
                key_spans.append([prompt_span])
                cursor += prompt_columns - start
            packed_start, prompt_len = prompt_span
            packed_of[row, start:prompt_columns] = torch.arange(packed_start, packed_start + prompt_len)
            segment_id += 1
            length = stop - prompt_columns
            _append(flat_index, positions, groups, segments, prompt_flags, row * columns + prompt_columns,
                    length, prompt_len, group_id, segment_id, False, host)
            packed_of[row, prompt_columns:stop] = torch.arange(cursor, cursor + length)
            if length:
                query_lengths.append(length)
                key_spans.append([prompt_span, (cursor, length)])
        else:
            group_id += 1
            segment_id += 1
            length = stop - start
            _append(flat_index, positions, groups, segments, prompt_flags, row * columns + start,
                    length, 0, group_id, segment_id, False, host)
            packed_of[row, start:stop] = torch.arange(cursor, cursor + length)
            query_lengths.append(length)
            key_spans.append([(cursor, length)])
        cursor += length
    if cursor == 0:
        return None, "every row is empty", None

    total = cursor
    padded = -(-total // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE
    flat = torch.cat(flat_index).to(device)
    position = torch.cat(positions).to(device)
    packed_of = packed_of.to(device)

    def pad(values, fill):
        return torch.cat([values, values.new_full((padded - total,), fill)]).to(device)

    scored_rows, scored_cols = scored.nonzero(as_tuple=True)
    key_lengths = [sum(length for _, length in spans) for spans in key_spans]
    cu_seqlens = torch.tensor([0] + query_lengths).cumsum(0).to(device, torch.int32)
    plan = PackPlan(
        input_ids=input_ids.reshape(-1)[flat][None],
        position_ids=position[None],
        group=pad(torch.cat(groups), -1),
        segment=pad(torch.cat(segments), -1),
        is_prompt=pad(torch.cat(prompt_flags), False),
        positions=pad(position, 0),
        source=packed_of[scored_rows, scored_cols - 1],
        targets=input_ids[scored_rows, scored_cols],
        rows=scored_rows,
        cols=scored_cols - 1,
        batch_shape=(rows, columns - 1),
        shared_rows=shared_rows,
        cu_seqlens=cu_seqlens,
        cu_seqlens_k=torch.tensor([0] + key_lengths).cumsum(0).to(device, torch.int32) if sharing else cu_seqlens,
        kv_index=torch.cat([torch.arange(first, first + length) for spans in key_spans for first, length in spans]
                           ).to(device) if sharing else None,
        longest=max(query_lengths),
        longest_k=max(key_lengths),
    )
    return plan, None, no_sharing


def _append(flat_index, positions, groups, segments, prompt_flags, flat_start, length, first_position, group,
            segment, is_prompt, device):
    flat_index.append(torch.arange(flat_start, flat_start + length, device=device))
    positions.append(torch.arange(first_position, first_position + length, device=device))
    groups.append(torch.full((length,), group, dtype=torch.int32, device=device))
    segments.append(torch.full((length,), segment, dtype=torch.int32, device=device))
    prompt_flags.append(torch.full((length,), is_prompt, dtype=torch.bool, device=device))


def graph_segments(rows: int) -> int:
    """Attention segments a padded plan of `rows` rows has (`pad_plan`): a prompt and a completion a row at most,
    and the appended tokens."""
    return 2 * rows + 1


def pad_plan(plan: PackPlan, length: int, segments: int, key_length: int | None = None, least: int = 1,
             least_k: int = 1) -> PackPlan:
    """`plan` with the shapes of a bucket, for a call whose layers replay as CUDA graphs: `length` tokens (at least
    plan.length), `segments` attention segments (more than plan's), the keys' gather (shared prompts) `key_length`
    long (at least its own length plus the appended tokens), and the longest query and key segments rounded up to a
    power of 2 of at least `least` / `least_k` (the kernels take them as bounds on the segments' lengths, which fix
    their grids; given the most a bucket appends, the appended segment does not move them).

    The appended tokens (id 0, positions from 0, no group: the mask rule hides them) are one segment of their own,
    whose keys are themselves and, past them, copies of the last one; the segments after it are empty. Nothing scored
    reads them: attention stays within a segment and every other op of a decoder acts per token, so log-probs are the
    plan's, and the appended tokens, whose outputs get no gradient, add none."""
    total, count = plan.length, plan.cu_seqlens.numel() - 1
    if length < total or segments <= count:
        raise ValueError(f"pad_plan: {length} tokens and {segments} segments cannot hold a plan of {total} tokens "
                         f"and {count} segments plus one of padding")
    device, extra = plan.input_ids.device, length - total
    keys = int(plan.cu_seqlens_k[-1]) if plan.kv_index is not None else total
    key_length = keys + extra if key_length is None or plan.kv_index is None else key_length
    if key_length < keys + extra:
        raise ValueError(f"pad_plan: a key gather of {key_length} cannot hold {keys} keys and {extra} appended")

    def bounds(cu: torch.Tensor, end: int) -> torch.Tensor:
        return torch.cat([cu, cu.new_full((segments - count,), end)])

    padded = -(-length // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE
    old = plan.group.numel()

    def grown(values, fill):
        return torch.cat([values[:total], values.new_full((padded - total,), fill)]) if padded != old else values

    appended = torch.arange(extra, device=device)
    kv_index = None
    if plan.kv_index is not None:
        filler = plan.kv_index.new_full((key_length - keys - extra,), length - 1 if extra else 0)
        kv_index = torch.cat([plan.kv_index, appended + total, filler])
    cu_seqlens = bounds(plan.cu_seqlens, length)
    positions = torch.cat([plan.positions[:total], appended, plan.positions.new_zeros(padded - length)])
    return dataclasses.replace(
        plan,
        input_ids=torch.cat([plan.input_ids, plan.input_ids.new_zeros((1, extra))], 1),
        position_ids=torch.cat([plan.position_ids, appended[None].to(plan.position_ids.dtype)], 1),
        group=grown(plan.group, -1), segment=grown(plan.segment, -1), is_prompt=grown(plan.is_prompt, False),
        positions=positions,
        cu_seqlens=cu_seqlens,
        cu_seqlens_k=bounds(plan.cu_seqlens_k, key_length) if kv_index is not None else cu_seqlens,
        kv_index=kv_index,
        longest=next_power_of_2(max(plan.longest, extra, least)),
        longest_k=next_power_of_2(max(plan.longest_k, key_length - keys, least_k)),
    )


def _sharing_problem(rows, first, last, scored, col, prompt_columns) -> str | None:
    if prompt_columns is None:
        return "the prompt/completion boundary is unknown"
    if rows < 2:
        return "a single row"
    if bool((first >= prompt_columns).any()):
        return "a row has an empty prompt"
    if bool((last < prompt_columns - 1).any()):
        return "a row's real tokens end inside the prompt columns"
    if bool((scored & (col < prompt_columns)).any()):
        return "prompt tokens are labelled"
    return None


_MAPPING_SUPPORT: dict[type, bool] = {}


def takes_mask_mapping(decoder: torch.nn.Module) -> bool:
    """Whether the decoder's forward accepts {layer kind: mask} as attention_mask (transformers' idiom for
    models mixing full and sliding-window layers)."""
    cls = type(decoder)
    if cls not in _MAPPING_SUPPORT:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _MAPPING_SUPPORT[cls] = "causal_mask_mapping := attention_mask" in source
    return _MAPPING_SUPPORT[cls]


def unsupported_reason(config, decoder: torch.nn.Module, plan: PackPlan | None = None) -> str | None:
    """Why this model cannot run packed (None: it can). With a plan, also checks the sliding windows."""
    text = config.get_text_config()
    if getattr(text, "is_encoder_decoder", False):
        return "encoder-decoder models are not packed"
    kinds = layer_kinds(config)
    others = sorted(set(kinds) - ATTENTION_LAYER_KINDS)
    if others:
        return f"layers of kind {others} carry state along the sequence (only attention layers can be packed)"
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention is not packed"
    if plan is not None and "sliding_attention" in kinds and "full_attention" in kinds:
        if _window_matters(text, plan) and not takes_mask_mapping(decoder):
            return (f"{type(decoder).__name__} mixes sliding-window and full attention layers but takes a single "
                    "attention mask, so the packed sliding-window mask cannot be given to its sliding layers")
    return None


def window_cuts_rows(config, row_length: int) -> bool:
    """Whether the model has sliding-window layers whose window rows of `row_length` tokens span WINDOW_PACK_ROWS
    times or more."""
    window = model_window(config)
    return window is not None and row_length >= WINDOW_PACK_ROWS * window


def _window_matters(text_config, plan: PackPlan) -> bool:
    window = getattr(text_config, "sliding_window", None)
    return window is not None and int(plan.positions.max()) + 1 > window


def attention_masks(plan: PackPlan, config, implementation: str, dtype: torch.dtype = torch.float32):
    """What the decoder takes as `attention_mask` for the packed sequence.

    `implementation`: "flex_attention" -> BlockMask; "sdpa" -> boolean [1, 1, T, T]; "eager" -> additive
    float [1, 1, T, T] in `dtype`. Models whose sliding window matters get a {layer kind: mask} dict when
    they mix layer kinds (see `unsupported_reason`), or the sliding mask when all layers slide.
    """
    text = config.get_text_config()
    kinds = set(layer_kinds(config))
    window = text.sliding_window if "sliding_attention" in kinds and _window_matters(text, plan) else None

    def build(sliding: int | None):
        if implementation == "flex_attention":
            return block_mask(plan, sliding)
        mask_dtype = None if implementation == "sdpa" else dtype
        return dense_mask(plan.mask_mod(sliding), plan.length, plan.group.device, mask_dtype)

    if window is None:
        return build(None)
    if kinds == {"sliding_attention"}:
        return build(window)
    return {"full_attention": build(None), "sliding_attention": build(window)}


def dense_mask(mask_mod, length: int, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[1, 1, T, T] mask from `mask_mod`: boolean (True = attend) or, with `dtype`, additive (0 / dtype min)."""
    index = torch.arange(length, device=device)
    allowed = mask_mod(None, None, index[:, None], index[None, :])[None, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def block_mask(plan: PackPlan, window: int | None = None):
    """The flex_attention BlockMask of `plan.mask_mod(window)`, from per-block summaries: O((T/128)^2), no [T, T].

    For every pair of 128-token blocks, ranges of group, segment and position ids decide whether no pair
    can be visible (skipped), every pair is (a "full" block: mask_mod not applied) or some may be
    (a partial block: mask_mod decides per pair). The bounds only ever err towards "partial", which
    costs time, never correctness.
    """
    from torch.nn.attention.flex_attention import BlockMask

    size = FLEX_BLOCK_SIZE
    blocks = plan.group.numel() // size
    valid = (plan.group >= 0).view(blocks, size)
    big = torch.iinfo(torch.int32).max

    def low(values):
        return torch.where(valid, values.view(blocks, size).int(), big).amin(1)

    def high(values):
        return torch.where(valid, values.view(blocks, size).int(), -1).amax(1)

    group_lo, group_hi = low(plan.group), high(plan.group)
    segment_lo, segment_hi = low(plan.segment), high(plan.segment)
    position_lo, position_hi = low(plan.positions), high(plan.positions)
    prompt = plan.is_prompt.view(blocks, size)
    any_prompt, all_prompt = (prompt & valid).any(1), (prompt | ~valid).all(1)
    complete = valid.all(1)
    q, kv = (slice(None), None), (None, slice(None))  # rows: query blocks, columns: key blocks
    index = torch.arange(blocks, device=plan.group.device)

    overlap_groups = (group_lo[q] <= group_hi[kv]) & (group_lo[kv] <= group_hi[q])
    overlap_segments = (segment_lo[q] <= segment_hi[kv]) & (segment_lo[kv] <= segment_hi[q])
    some = (index[kv] <= index[q]) & overlap_groups & (overlap_segments | any_prompt[kv])
    one_group = (group_lo == group_hi)
    one_segment = (segment_lo == segment_hi)
    same_segment = one_segment[q] & one_segment[kv] & (segment_lo[q] == segment_lo[kv])
    every = (
        (index[kv] < index[q]) & complete[q] & complete[kv]
        & one_group[q] & one_group[kv] & (group_lo[q] == group_lo[kv])
        & (same_segment | all_prompt[kv])
    )
    if window is not None:
        some &= position_lo[q] - position_hi[kv] < window
        every &= position_hi[q] - position_lo[kv] < window
    every &= some
    partial = some & ~every

    def to_indices(flags):
        counts = flags.sum(-1, dtype=torch.int32)
        order = torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_indices = to_indices(partial)
    full_num, full_indices = to_indices(every)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=size,
                                    mask_mod=plan.mask_mod(window), seq_lengths=(plan.length, plan.length))


@dataclass
class PackedCall:
    plan: PackPlan
    kwargs: dict  # for the decoder: input_ids, position_ids, attention_mask, use_cache


class Packer:
    """Decides per forward whether a batch runs packed, and builds the call; says once per reason why not.

    `attention`: "auto" (flex_attention on CUDA; on CPU the model's own SDPA/eager attention with a
    dense mask, up to DENSE_MASK_MAX_TOKENS), "flex_attention", or "dense". With "auto", the packed call also
    carries the causal segments (VARLEN_KWARGS), and every layer that allows it runs them as variable-length
    attention instead of through the mask: flash's kernel on CUDA (1.51x flex_attention's forward + backward on
    the H200, fastgrpo.kernels.packed_attention), SDPA a segment at a time on CPU.
    `min_saved`: a batch whose packing would drop less than this fraction of its padded tokens (padding,
    and repeated prompts when sharing) runs padded: packed attention (flex_attention, flash's variable-length
    kernel) is slower per token than the padded batch's cuDNN attention, so packing pays only past some padding
    (PACK_MIN_SAVED). Except where a sliding window cuts the rows (`window_cuts_rows`): the padded batch's
    attention then computes every key of a row through its mask, the packed one the window's band.
    """

    def __init__(self, share_prompt: bool = False, attention: str = "auto", min_saved: float = 0.0):
        if attention not in ("auto", "flex_attention", "dense"):
            raise ValueError(f"attention={attention!r}; use 'auto', 'flex_attention' or 'dense'")
        if not 0.0 <= min_saved < 1.0:
            raise ValueError(f"min_saved={min_saved!r}; use a fraction of the padded batch's tokens in [0, 1)")
        self.share_prompt = share_prompt
        self.attention = attention
        self.min_saved = min_saved
        self.said: set[str] = set()
        self.last_plan: PackPlan | None = None
        # Set by the trainer: whether the layer calls of a packed call of this many tokens (a `bucket_length`) on this
        # device replay as CUDA graphs; such a call, where it is mask-free, is padded to the bucket (`pad_plan`).
        self.replays: Callable[[int, torch.device], bool] | None = None
        self._everywhere: dict[tuple, bool] = {}  # segments_everywhere per (decoder, dtype, device, training)

    def say_once(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            warnings.warn(f"fastgrpo: {message}", stacklevel=3)

    def fall_back(self, reason: str) -> None:
        self.say_once(f"this batch runs padded, not packed: {reason}")

    def prepare(self, model, inputs: dict, labels, prompt_columns: int | None) -> PackedCall | None:
        """The packed call for `model(**inputs, labels=labels)` (a causal LM), or None to run it padded."""
        extra = sorted(k for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "use_cache") and v is not None)
        if extra:
            return self.fall_back(f"inputs {extra} are not packed")
        input_ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
        if input_ids is None or mask is None or labels is None or input_ids.dim() != 2:
            return self.fall_back("packing needs 2-D input_ids, an attention_mask and labels")
        decoder = model.base_model
        if reason := unsupported_reason(model.config, decoder):
            return self.fall_back(reason)
        plan, failure, no_sharing = plan_packing(input_ids, mask, labels.to(input_ids.device), prompt_columns,
                                                 self.share_prompt)
        if failure:
            return self.fall_back(failure)
        if self.share_prompt and no_sharing:
            self.say_once(f"prompts not shared in a batch ({no_sharing}); its rows are packed one by one")
        saved = 1.0 - plan.length / input_ids.numel()
        if saved < self.min_saved and not window_cuts_rows(model.config, input_ids.size(1)):
            self.say_once(f"batches that packing would shorten by less than {self.min_saved:.0%} run padded "
                          f"(this one: {saved:.0%}), where the fused attention is faster")
            return None
        if reason := unsupported_reason(model.config, decoder, plan):
            return self.fall_back(reason)
        implementation = self._implementation(model.config, input_ids.device, plan)
        if implementation.startswith("!"):
            return self.fall_back(implementation[1:])
        dtype = torch.get_autocast_dtype(input_ids.device.type) if torch.is_autocast_enabled(
            input_ids.device.type) else model.get_input_embeddings().weight.dtype
        varlen = self.attention == "auto"
        if varlen and (reason := varlen_refusal(model.config, dtype, input_ids.device, model.training)):
            self.say_once(f"packed rows run {implementation}, not variable-length attention: {reason}")
            varlen = False
        if (varlen and input_ids.is_cuda and not FLASH_TAKES_WINDOW and "sliding_attention" in layer_kinds(model.config)
                and _window_matters(model.config.get_text_config(), plan)):
            self.say_once(f"sliding-window layers run {implementation}, not variable-length attention: this torch's "
                          f"flash kernel ({torch.__version__}) takes no sliding window")
        if implementation == "flex_attention" or varlen:
            use_mask_dispatched_attention(model.config)
        mask_free = varlen and self._segments_everywhere(model.config, decoder, dtype, input_ids.device, model.training)
        length = bucket_length(plan.length)
        if mask_free and self.replays is not None and self.replays(length, input_ids.device):
            # Its layer calls replay as CUDA graphs: the shapes of a bucket.
            keys = int(plan.cu_seqlens_k[-1]) + length - plan.length
            least_k = bucket_step(length) + (bucket_step(keys) if plan.kv_index is not None else 0)
            plan = pad_plan(plan, length, graph_segments(input_ids.size(0)),
                            None if plan.kv_index is None else bucket_length(keys), bucket_step(length), least_k)
        if mask_free:  # a stand-in that transformers passes on as it is (a 4-D mask): no [T, T] and no BlockMask
            masks = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
        else:
            masks = attention_masks(plan, model.config, implementation, dtype)
        for dense in (masks.values() if isinstance(masks, dict) else [masks]):
            if isinstance(dense, torch.Tensor) and not mask_free:  # the packed length changes every batch: dynamic
                torch._dynamo.maybe_mark_dynamic(dense, 2)
                torch._dynamo.maybe_mark_dynamic(dense, 3)
        self.last_plan = plan
        kwargs = dict(input_ids=plan.input_ids, position_ids=plan.position_ids, attention_mask=masks, use_cache=False)
        if varlen:  # the mask (unless mask_free) stays for layers that cannot take segments (_layer_takes_varlen)
            for bounds in (plan.cu_seqlens, plan.cu_seqlens_k, plan.kv_index):
                if bounds is not None:
                    torch._dynamo.maybe_mark_dynamic(bounds, 0)
            # Every key always (None where a plan has no shared prompt): a frame compiled with one key set and
            # called with another made Dynamo's recompile-reason formatting raise KeyError('fastgrpo_kv_index')
            # (H200, tests/test_packing.py::test_bf16_segments_match_padded_attention[phi3-cuda], once in three runs).
            kwargs.update(cu_seq_lens_q=plan.cu_seqlens, cu_seq_lens_k=plan.cu_seqlens_k, max_length_q=plan.longest,
                          max_length_k=plan.longest_k, fastgrpo_kv_index=plan.kv_index, fastgrpo_mask_free=mask_free)
        return PackedCall(plan, kwargs)

    def _segments_everywhere(self, config, decoder, dtype, device, training) -> bool:
        key = (id(decoder), dtype, device, training)
        if key not in self._everywhere:
            self._everywhere[key] = segments_everywhere(config, decoder, dtype, device, training)
        return self._everywhere[key]

    def _implementation(self, config, device, plan: PackPlan) -> str:
        """The attention implementation to use, or "!reason" when none fits."""
        if self.attention == "flex_attention" or (self.attention == "auto" and device.type == "cuda"):
            return "flex_attention"
        own = config.get_text_config()._attn_implementation.removeprefix(PACKED_ATTENTION_PREFIX)
        if own not in ("sdpa", "eager"):
            return f"!the dense-mask packing runs SDPA or eager attention; the model uses {own!r}"
        if plan.length > DENSE_MASK_MAX_TOKENS:
            return (f"!{plan.length} packed tokens is over DENSE_MASK_MAX_TOKENS={DENSE_MASK_MAX_TOKENS} for a dense "
                    f"[T, T] mask on {device.type} (flex_attention, used on CUDA, has no such limit)")
        return own
