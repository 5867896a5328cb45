"""Next-token sampling as `model.generate` samples, with no host sync (it runs inside a captured decode step)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastgrpo.kernels._dispatch import use_triton
from fastgrpo.kernels.race_sample import race_sample

_FILTERED = float("-inf")
# Plain sampling (temperature > 0, no filter, no repetition penalty: TRL's defaults) through fastgrpo::race_sample,
# one read of the logits in two launches, instead of the eager race's ~8 passes over [rows, vocab]: 1.06x the rollouts'
# tokens/s at 64x256 on the 1.5B shape (`bash bench/device_session.sh fused_sampling`, four processes alternating).
# FASTGRPO_FUSED_SAMPLING=0 turns it off.
FUSED = os.environ.get("FASTGRPO_FUSED_SAMPLING", "1") == "1"


@dataclass(frozen=True)
class Sampling:
    """TRL's sampling options. temperature 0 is greedy; top_k None/0, top_p 1, min_p None/0 and
    repetition_penalty 1 are off."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: logits of tokens already in the row (prompt included) are
    divided by `penalty` where positive, multiplied where negative. `seen` [rows, vocab] bool."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float | None = None,
) -> torch.Tensor:
    """Sample one token per row of `logits` [rows, vocab]; greedy (argmax) when temperature == 0.

    Filters apply in `model.generate`'s order (temperature, top-k, top-p, min-p) with its definitions,
    each keeping at least one token. Sampling uses the exponential race (argmax of log p - log E, E ~ Exp(1)),
    which equals multinomial sampling, draws from torch's global RNG and needs no host sync.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    return _race(_filtered(logits.float() / temperature, top_k, top_p, min_p))


def _filtered(scaled: torch.Tensor, top_k: int | None, top_p: float, min_p: float | None) -> torch.Tensor:
    """Temperature-scaled logits with the top-k, top-p and min-p filters' removals at -inf."""
    vocab = scaled.size(-1)
    if top_k is not None and 0 < top_k < vocab:
        kth_largest = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, _FILTERED)
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scaled, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_indices, remove_sorted)
        scaled = scaled.masked_fill(remove, _FILTERED)
    if min_p is not None and min_p > 0:
        probs = scaled.softmax(dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scaled = scaled.masked_fill(remove, _FILTERED)
    return scaled


def _race(scaled: torch.Tensor) -> torch.Tensor:
    """argmax(scaled - log E): a draw from softmax(scaled) without forming the softmax."""
    race = torch.empty_like(scaled).exponential_(1).log_()
    return (scaled - race).argmax(dim=-1)


def _plain(sampling: Sampling, vocab: int) -> bool:
    """Whether `sampling` draws from softmax(logits / T) with nothing filtered or penalized."""
    return (sampling.temperature > 0 and sampling.repetition_penalty == 1.0 and sampling.top_p >= 1.0
            and not (sampling.top_k and sampling.top_k < vocab) and not sampling.min_p)


def sample(logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: the repetition penalty (over `seen`), then the temperature and `sample_next_token`'s
    filters. Also returns each token's log-prob as the trainer computes it: log-softmax of the logits over the
    temperature (1 when greedy), before the penalty and the filters. With FUSED, plain sampling runs as one op whose
    seed is drawn from torch's generator here (so a captured step draws anew at every replay)."""
    if FUSED and _plain(sampling, logits.shape[-1]) and use_triton(logits):
        seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device)
        return race_sample(logits, seed, sampling.temperature)
    temperature = sampling.temperature or 1.0
    scaled = logits.float() / temperature
    chosen_from = scaled
    if sampling.repetition_penalty != 1.0:
        chosen_from = penalize_repetitions(logits.float(), seen, sampling.repetition_penalty) / temperature
    if sampling.temperature == 0:
        tokens = chosen_from.argmax(dim=-1)
    else:
        tokens = _race(_filtered(chosen_from, sampling.top_k, sampling.top_p, sampling.min_p))
    logprobs = scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)
    return tokens, logprobs
