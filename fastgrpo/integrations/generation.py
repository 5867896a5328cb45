"""Generate GRPO rollouts from the training weights themselves, without vLLM.

`EmbeddedGenerator` runs the policy's own forward (a PEFT model with its adapters active works as is):
no copy of the weights, no weight sync. What makes it faster than `model.generate`:
- a transformers `StaticCache` allocated once and reused across calls (grown only when a longer
  prompt + completion needs it), so every decode step has the same shapes;
- on CUDA, one decode step (forward of one token per row + sampling + EOS bookkeeping) compiled with
  `mode="reduce-overhead"`, i.e. replayed as a CUDA graph; the prefill runs eagerly (its shape varies);
- a plain loop with no logits-processor machinery, and a single host sync every few steps to stop
  once all rows have finished.
On CPU the decode step runs eagerly by default: the compile time (tens of seconds for a 30-layer model)
is more than a short CPU training run saves (measured in bench/bench_generation.py --tiny).

Left padding: prompts are left-padded, the attention mask covers the whole cache (prompt mask, then
ones for the completion slots; the causal mask hides the slots not yet written), and position ids
count only real tokens, as `model.generate` computes them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import StaticCache

_FILTERED = float("-inf")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _unwrap_for_generation(model: nn.Module) -> nn.Module:
    """The module whose forward runs the decoder with any LoRA layers active.

    torch.compile wrappers are peeled off (their compiled graph is the training forward), and a PEFT
    model gives its base model: LoRA lives in the injected layers, the PeftModel wrapper only forwards.
    """
    model = getattr(model, "_orig_mod", model)
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is None or not hasattr(model, "get_base_model"):
        return model
    if peft_config.is_prompt_learning:
        raise NotImplementedError("EmbeddedGenerator supports LoRA-style adapters, not prompt learning")
    base = model.get_base_model()
    return getattr(base, "_orig_mod", base)


def _forward(decoder: nn.Module, input_ids: torch.Tensor, **kwargs):
    """Call the decoder eagerly even when `decoder.compile()` gave it a compiled (training) call path.

    The tokens are embedded here with the embedding's own forward, skipping its hooks: those are for
    training (PEFT's and TRL's `enable_input_require_grads` under gradient checkpointing calls
    `requires_grad_`, which a fullgraph decode step cannot trace and no-grad sampling does not need)."""
    kwargs["inputs_embeds"] = decoder.get_input_embeddings().forward(input_ids)
    if getattr(decoder, "_compiled_call_impl", None) is not None:
        return decoder._call_impl(**kwargs)
    return decoder(**kwargs)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float | None = None,
) -> torch.Tensor:
    """Sample one token per row of `logits` [rows, vocab]; greedy (argmax) when temperature == 0.

    Filters apply in `model.generate`'s order (temperature, top-k, top-p, min-p) with its definitions,
    each keeping at least one token. Sampling uses the exponential-race trick (argmax of p / Exp(1)),
    which equals multinomial sampling, draws from torch's global RNG and needs no host sync.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    vocab = logits.size(-1)
    if top_k is not None and 0 < top_k < vocab:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, _FILTERED)
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_indices, remove_sorted)
        logits = logits.masked_fill(remove, _FILTERED)
    if min_p is not None and min_p > 0:
        probs = logits.softmax(dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, _FILTERED)
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return (probs / race).argmax(dim=-1)


class EmbeddedGenerator:
    """Batched sampling from a causal LM's own weights with a static KV cache.

    Args:
        model: a transformers causal LM, a PEFT model around one, or a torch.compile wrapper of either.
        pad_token_id: fed after a row has finished and used for left padding.
        eos_token_ids: a row finishes at the first of these; it is kept in the returned completion.
        max_new_tokens: completion budget per row.
        compile: compile the decode step; default: on CUDA yes (CUDA graphs), on CPU no.
        compile_mode: torch.compile mode for the decode step ("reduce-overhead" = CUDA graphs).
        compile_backend: torch.compile backend for the decode step (inductor; "eager" only traces).
        pad_to_multiple_of: round the padded prompt length up, so caches get reused across batches;
            default 64 on CUDA, 1 on CPU.
        check_finished_every: decode steps between host syncs that test whether all rows finished;
            default 16 on CUDA, 1 on CPU (where a sync costs nothing).
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        eos_token_ids: int | Sequence[int],
        max_new_tokens: int,
        *,
        compile: bool | None = None,
        compile_mode: str | None = "reduce-overhead",
        compile_backend: str = "inductor",
        pad_to_multiple_of: int | None = None,
        check_finished_every: int | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(e) for e in eos_token_ids]
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        self.max_new_tokens = int(max_new_tokens)
        self._compile = compile
        self._compile_mode = compile_mode
        self._compile_backend = compile_backend
        self._pad_to_multiple_of = pad_to_multiple_of
        self._check_finished_every = check_finished_every
        self._cache: StaticCache | None = None
        self._cache_batch = 0
        self._compiled_step = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _static_cache(self, decoder: nn.Module, batch: int, length: int) -> StaticCache:
        """The reusable cache, or a new one when the batch changes or it is too short.

        Keeping one cache (same tensors, same shapes) is what lets the compiled step and its CUDA
        graph be reused across calls; a longer cache serves shorter prompts as well.
        """
        if self._cache is not None and self._cache_batch == batch and self._cache.get_max_length() >= length:
            self._cache.reset()
            return self._cache
        self._cache = None  # free the old cache before allocating the new one
        self._cache = StaticCache(config=decoder.config, max_cache_len=length)
        self._cache_batch = batch
        return self._cache

    def _step(
        self,
        decoder: nn.Module,
        cache: StaticCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        finished: torch.Tensor,
        eos: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float,
        min_p: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per row, sample the next; rows already finished get pad instead."""
        logits = _forward(
            decoder,
            input_ids=tokens[:, None],
            position_ids=positions[:, None],
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_tokens = sample_next_token(logits, temperature, top_k, top_p, min_p)
        next_tokens = next_tokens.masked_fill(finished, self.pad_token_id)
        return next_tokens, finished | torch.isin(next_tokens, eos)

    def _step_fn(self):
        use_compile = self._compile if self._compile is not None else self._on_cuda()
        if not use_compile:
            return self._step
        if self._compiled_step is None:
            mode = self._compile_mode if self._compile_backend == "inductor" else None
            self._compiled_step = torch.compile(
                self._step, backend=self._compile_backend, mode=mode, fullgraph=True, dynamic=False
            )
        return self._compiled_step

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        num_generations: int = 1,
    ) -> list[list[int]]:
        """Completion ids for each prompt (each prompt repeated `num_generations` times, copies adjacent).

        A completion stops after its first EOS (kept, as TRL keeps it) or after `max_new_tokens`.
        The model is put in eval mode for the call and its training mode restored afterwards; autograd
        is off (no_grad rather than inference_mode: buffers a forward creates lazily, e.g. rotary
        caches, must stay usable by the training backward).
        """
        if not prompt_ids:
            return []
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        prompts = [list(p) for p in prompt_ids for _ in range(num_generations)]
        decoder = _unwrap_for_generation(self.model)
        device = self.device
        on_cuda = device.type == "cuda"
        multiple = self._pad_to_multiple_of or (64 if on_cuda else 1)
        check_every = self._check_finished_every or (16 if on_cuda else 1)

        batch = len(prompts)
        prompt_len = _round_up(max(len(p) for p in prompts), multiple)
        input_ids = torch.full((batch, prompt_len), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((batch, prompt_len), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, prompt_len - len(p) :] = torch.tensor(p)
            prompt_mask[row, prompt_len - len(p) :] = 1
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        # As model.generate: count real tokens only; pads get position 0 (they are masked anyway).
        prompt_positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)

        cache = self._static_cache(decoder, batch, prompt_len + self.max_new_tokens)
        cache_len = cache.get_max_length()
        attention_mask = torch.ones((batch, cache_len), dtype=torch.long, device=device)
        attention_mask[:, :prompt_len] = prompt_mask
        eos = torch.tensor(self.eos_token_ids, device=device)
        completion = torch.full((batch, self.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        step = self._step_fn()

        was_training = decoder.training
        decoder.eval()
        # Autocast off: under it keys (upcast by RoPE) and values can differ in dtype, which one
        # static cache cannot hold. Generation runs in the weights' dtype.
        try:
            with torch.autocast(device.type, enabled=False):
                logits = _forward(
                    decoder,
                    input_ids=input_ids,
                    position_ids=prompt_positions,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]
                tokens = sample_next_token(logits, temperature, top_k, top_p, min_p)
                finished = torch.isin(tokens, eos)
                completion[:, 0] = tokens
                positions = prompt_positions[:, -1] + 1
                generated = 1
                while generated < self.max_new_tokens:
                    if generated % check_every == 0 and bool(finished.all()):
                        break
                    if on_cuda:
                        torch.compiler.cudagraph_mark_step_begin()
                    tokens, finished = step(
                        decoder, cache, tokens, positions, attention_mask, finished, eos,
                        temperature, top_k, top_p, min_p,
                    )  # fmt: skip
                    # The step's outputs live in CUDA-graph memory that the next replay overwrites.
                    tokens, finished = tokens.clone(), finished.clone()
                    completion[:, generated] = tokens
                    positions = positions + 1
                    generated += 1
        finally:
            decoder.train(was_training)
        return _truncate_after_eos(completion[:, :generated].cpu(), self.eos_token_ids)


def _truncate_after_eos(completion: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Rows as lists, each cut right after its first EOS (EOS kept); rows without EOS keep everything."""
    is_eos = torch.isin(completion, torch.tensor(eos_token_ids))
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completion.size(1))
    return [row[:n].tolist() for row, n in zip(completion, lengths.tolist())]
