"""One token per row sampled from softmax(logits / T), with its log-prob, in two launches and one read of the logits.

`race_sample(logits, seed, temperature)`:
- logits [rows, vocab] (any float dtype, unit column stride), seed: an integer device tensor of one element,
  temperature > 0;
- returns tokens [rows] int64 and logprobs [rows] fp32: logits[token] / T - logsumexp(logits / T), what the
  rollout engine's `sample` returns (fp32 maths on the logits over the temperature).

The draw is the exponential race `sample` uses (argmax of x + Gumbel noise, which is a draw from softmax(x)): the
noise comes from Triton's Philox generator keyed by `seed` and each element's (row, column), so a captured CUDA graph
draws new tokens at every replay when the seed tensor is refilled in place by torch's generator inside the graph
(`torch.randint` under capture advances the generator's offset), and a seed fixed by `torch.manual_seed` repeats a
run. The draws are not the same numbers as `torch.Tensor.exponential_`'s: the same distribution.

Triton path: grid (row, split); each program walks its share of the vocabulary in blocks, keeping an online
log-sum-exp and the best raced score with its column; a second kernel combines the splits of a row and reads the
chosen logit again. The split count comes from the batch and the SM count, so a few rows still fill the GPU.
The torch path (CPU without the interpreter, and the tests' reference for the log-probs) draws with torch's
generator seeded from `seed`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import cdiv, launch_like_cuda, multiprocessor_count, next_power_of_2, use_triton

# Programs per SM the splits aim at; a split walks at least one block.
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 128


@triton.jit
def _race_partial_kernel(
    logits_ptr, seed_ptr, part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr,
    stride_row, vocab, temperature,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seed_ptr)
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_idx = 0
    for b in range(BLOCKS_PER_SPLIT):
        cols = (split * BLOCKS_PER_SPLIT + b) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=-float("inf"))
        x = x.to(tl.float32) / temperature
        block_m = tl.max(x, axis=0)
        new_m = tl.maximum(m, block_m)
        # Blocks past the vocabulary leave the maximum at -inf; shifting by 0 then keeps every exp() a number.
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
        u = tl.rand(seed, row * vocab + cols)  # [0, 1): u = 0 gives -inf noise, never chosen
        score = tl.where(inside, x - tl.log(-tl.log(u)), -float("inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0) + (split * BLOCKS_PER_SPLIT + b) * BLOCK
        take = block_best > best
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_best, best)
    out = row * SPLITS + split
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, s)
    tl.store(part_best_ptr + out, best)
    tl.store(part_idx_ptr + out, best_idx)


@triton.jit
def _race_combine_kernel(
    logits_ptr, part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr, tokens_ptr, logprobs_ptr,
    stride_row, temperature,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    valid = offs < SPLITS
    m = tl.load(part_m_ptr + row * SPLITS + offs, mask=valid, other=-float("inf"))
    s = tl.load(part_s_ptr + row * SPLITS + offs, mask=valid, other=0.0)
    best = tl.load(part_best_ptr + row * SPLITS + offs, mask=valid, other=-float("inf"))
    idx = tl.load(part_idx_ptr + row * SPLITS + offs, mask=valid, other=0)
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - top), axis=0)  # a split with nothing in range: s = 0, m = -inf
    lse = top + tl.log(total)
    winner = tl.argmax(best, axis=0)
    token = tl.sum(tl.where(offs == winner, idx, 0), axis=0)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, x - lse)


def _splits(rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Splits per row: enough programs for _PROGRAMS_PER_SM a SM, at most one per block of the vocabulary."""
    want = cdiv(_PROGRAMS_PER_SM * multiprocessor_count(device), rows)
    return max(1, min(want, cdiv(vocab, block), _MAX_SPLITS))


def _triton_race(logits: torch.Tensor, seed: torch.Tensor, temperature: float, splits: int | None = None,
                 block: int | None = None):
    rows, vocab = logits.shape
    cuda = launch_like_cuda(logits)
    if block is None:
        block = 2048 if cuda else min(256, next_power_of_2(vocab))
    if splits is None:
        splits = _splits(rows, vocab, block, logits.device)
    blocks_per_split = cdiv(cdiv(vocab, block), splits)
    part_m = torch.empty(rows, splits, device=logits.device, dtype=torch.float32)
    part_s, part_best = torch.empty_like(part_m), torch.empty_like(part_m)
    part_idx = torch.empty(rows, splits, device=logits.device, dtype=torch.int32)
    _race_partial_kernel[(rows, splits)](
        logits, seed, part_m, part_s, part_best, part_idx, logits.stride(0), vocab, float(temperature),
        SPLITS=splits, BLOCK=block, BLOCKS_PER_SPLIT=blocks_per_split, num_warps=8 if cuda else 1,
    )  # fmt: skip
    tokens = torch.empty(rows, device=logits.device, dtype=torch.int64)
    logprobs = torch.empty(rows, device=logits.device, dtype=torch.float32)
    _race_combine_kernel[(rows,)](
        logits, part_m, part_s, part_best, part_idx, tokens, logprobs, logits.stride(0), float(temperature),
        SPLITS=splits, SPLITS_PAD=max(2, next_power_of_2(splits)), num_warps=1,
    )  # fmt: skip
    return tokens, logprobs


def reference_race_sample(logits: torch.Tensor, seed: torch.Tensor, temperature: float):
    """The op in torch: the same race with noise from torch's generator seeded by `seed` (other numbers than the
    Triton path's, the same distribution); the log-prob as `sample` computes it."""
    scaled = logits.float() / temperature
    generator = torch.Generator(device=logits.device).manual_seed(int(seed.reshape(-1)[0]))
    noise = torch.empty_like(scaled).exponential_(1, generator=generator).log_()
    tokens = (scaled - noise).argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)


@torch.library.custom_op("fastgrpo::race_sample", mutates_args=())
def _race_sample_op(logits: torch.Tensor, seed: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(logits):
        return _triton_race(logits, seed, temperature)
    return reference_race_sample(logits, seed, temperature)


@_race_sample_op.register_fake
def _(logits, seed, temperature):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)


def race_sample(logits: torch.Tensor, seed: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. No autograd: it samples."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"race_sample takes [rows, vocab] logits with unit column stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if not temperature > 0:
        raise ValueError(f"race_sample needs temperature > 0 (greedy is an argmax), got {temperature}")
    if seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64) or seed.device != logits.device:
        raise ValueError("race_sample's seed is one int32/int64 element on the logits' device")
    return _race_sample_op(logits.detach(), seed, float(temperature))
