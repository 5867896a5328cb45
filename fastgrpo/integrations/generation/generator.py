"""`EmbeddedGenerator`: GRPO rollouts from the training weights themselves, without vLLM.

It runs the policy's own forward (a PEFT model with its adapters active works as is): no copy of the weights, no
weight sync. The work is done by `RolloutEngine` (engine.py). What it cannot run falls back, never silently:

- a compile that fails or keeps recompiling: one warning naming the model class and the reason, then the same
  engine with the decoder layers uncompiled for the rest of the run;
- a model the engine cannot decode (its attention does not go through transformers' AttentionInterface, a cache
  of another kind, ...): one warning, then `model.generate` for the rest of the run;
- rows that do not fit the accelerator's memory (its KV cache, its graphs): one warning, then the engine decodes in
  waves of half as many rows, halved again until a wave fits, for the rest of the run. A single row that does not
  fit raises the out-of-memory error, with a note naming the fixes.

Rows longer than a model's learned position table (GPT-2, OPT, ...) raise a ValueError naming the fix before any
forward: past it the table's lookup fails, on CUDA as a device-side assert that ends the process's CUDA context.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from fastgrpo.integrations.generation.adapters import MergeNotUndone, check_merge_mode
from fastgrpo.integrations.generation.engine import RolloutEngine
from fastgrpo.integrations.generation.kv import release_caches
from fastgrpo.integrations.generation.sampling import Sampling
from fastgrpo.integrations.unwrap import causal_lm_of


class GenerationFallbackWarning(UserWarning):
    """The rollout engine could not run (compiled, at all, or all rows at once) for this model; the warning says why
    and what runs."""


# What a rollout that does not fit can change (the trainer's fields in parentheses).
_MEMORY_FIXES = ("fewer rows per call (TRL: generation_batch_size, or per_device_train_batch_size x "
                 "steps_per_generation), fewer new tokens (max_completion_length), or a 4-bit base (QLoRA)")


def unwrap_for_generation(model: nn.Module) -> nn.Module:
    """The module whose forward runs the decoder with any LoRA layers active: `causal_lm_of` (wrappers peeled, a PEFT
    model's base model, whose layers hold the adapters), also peeled of a compile wrapper of its own."""
    peft_config = getattr(getattr(model, "_orig_mod", model), "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning:
        raise NotImplementedError("EmbeddedGenerator supports LoRA-style adapters, not prompt learning")
    base = causal_lm_of(model)
    return getattr(base, "_orig_mod", base)


def truncate_after_eos(completion: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Rows as lists, each cut right after its first EOS (EOS kept); rows without EOS keep everything."""
    is_eos = torch.isin(completion, torch.tensor(eos_token_ids, device=completion.device))
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completion.size(1))
    return [row[:n].tolist() for row, n in zip(completion.cpu(), lengths.tolist())]


def learned_position_limit(model: nn.Module) -> int | None:
    """The positions a model with a learned absolute position table can embed (GPT-2's `n_positions`, OPT's
    `max_position_embeddings`), or None where positions are computed (RoPE, ALiBi) and longer rows only degrade. A
    table is an nn.Embedding of the configured size (OPT's offset of 2 included) with no row per vocabulary token."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        return None
    vocab = getattr(config, "vocab_size", None)
    for module in model.modules():
        if (isinstance(module, nn.Embedding) and module.num_embeddings != vocab
                and module.num_embeddings in (limit, limit + 2)):
            return limit
    return None


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


class EmbeddedGenerator:
    """Batched sampling from a causal LM's own weights.

    Args:
        model: a transformers causal LM, a PEFT model around one, or a torch.compile wrapper of either.
        pad_token_id: fed after a row has finished and used for left padding.
        eos_token_ids: a row finishes at the first of these; it is kept in the returned completion.
        max_new_tokens: completion budget per row.
        compile: compile the decode step's decoder layer; default: on CUDA yes, on CPU no (a short CPU run spends
            more on the compile than it saves).
        compile_backend: torch.compile backend for the decoder layer (inductor; "eager" only traces, for tests).
        compile_options: that backend's options (e.g. `{"patterns": ["joined_projections"]}` for "fastgrpo").
        cuda_graphs: replay the decode step as CUDA graphs; default: on CUDA.
        pad_to_multiple_of: round the padded prompt and the cache length up, so that caches and graphs are reused
            across batches; default 64 on CUDA, 1 on CPU.
        check_finished_every: decode steps between host reads of how many rows still run; default 16 on CUDA, 1 on
            CPU (where a read costs nothing).
        min_batch: the fewest rows a step runs once finished rows drop out (smaller batches save little).
        merge_lora: how LoRA layers decode: "float" (the default: floating-point bases with the adapters merged in
            place and undone exactly; bitsandbytes 4-bit bases (QLoRA) through fastgrpo's 4-bit kernel, which reads
            the packed weight and adds the LoRA product in one launch, no dequantized copy; on CUDA), "all" (every
            base merged, quantized ones into a bf16 copy held while the generator lives), "none" (the adapters' own
            forward). `lora_decoding` says which layers decoded how. See `MergedAdapters`.
        compile_sampling: compile the decode step's sampling as well; default: when the layers compile.
        release_memory: after each call free what the engine holds between calls (the KV cache, the CUDA graphs
            and their pool, the joined q/k/v copies), as vLLM's sleep mode frees its cache while the trainer
            updates. The next call allocates them again and captures its graphs again (nothing recompiles).
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        eos_token_ids: int | Sequence[int],
        max_new_tokens: int,
        *,
        compile: bool | None = None,
        compile_backend: str = "inductor",
        compile_options: dict | None = None,
        cuda_graphs: bool | None = None,
        pad_to_multiple_of: int | None = None,
        check_finished_every: int | None = None,
        min_batch: int = 8,
        merge_lora: str = "float",
        compile_sampling: bool | None = None,
        release_memory: bool = False,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: pass the tokenizer's pad token id (TRL pads with the EOS token "
                             "where a tokenizer has none: tokenizer.pad_token = tokenizer.eos_token)")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(e) for e in eos_token_ids]
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        self.max_new_tokens = int(max_new_tokens)
        self._compile = compile
        self._compile_backend = compile_backend
        self._compile_options = compile_options
        self._cuda_graphs = cuda_graphs
        self._pad_to_multiple_of = pad_to_multiple_of
        self._check_finished_every = check_finished_every
        self._min_batch = min_batch
        self._merge_lora = check_merge_mode(merge_lora)  # a bad mode fails here, not at the first generate
        self._unmerged_reported = False
        self._compile_sampling = compile_sampling
        self._release_memory = bool(release_memory)
        self.engine: RolloutEngine | None = None
        self.fallback: str | None = None  # None: the engine runs; "eager": uncompiled layers; "generate"
        self.wave_rows: int | None = None  # rows per engine call after an out-of-memory; None: all rows at once

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def lora_decoding(self) -> dict | None:
        """How the last engine call decoded the LoRA layers with active adapters: {"merge_lora": the mode,
        "merged": layers from merged weights, "nf4_kernel": layers through the 4-bit kernel, "nf4_groups": groups of
        them in one launch each, "nf4_ungrouped": {reason: 4-bit sibling layers launched one by one},
        "adapters_forward": {reason: layers left to PEFT's own forward}} (with "none" nothing is counted: every layer
        runs PEFT's forward); None before the engine's first call or once it fell back to model.generate."""
        if self.engine is None:
            return None
        merged = self.engine._merged
        return {"merge_lora": merged.mode, "merged": merged.merged_layers, "nf4_kernel": merged.nf4_layers,
                "nf4_groups": merged.nf4_groups, "nf4_ungrouped": dict(merged.ungrouped),
                "adapters_forward": dict(merged.not_merged)}

    def _new_engine(self, compiled: bool) -> RolloutEngine:
        on_cuda = self.device.type == "cuda"
        cuda_graphs = on_cuda if self._cuda_graphs is None else self._cuda_graphs
        return RolloutEngine(
            self.pad_token_id, self.eos_token_ids, self.max_new_tokens,
            compile_layers=compiled, backend=self._compile_backend, backend_options=self._compile_options,
            cuda_graphs=cuda_graphs and on_cuda,
            pad_to_multiple_of=self._pad_to_multiple_of or (64 if on_cuda else 1),
            check_every=self._check_finished_every or (16 if on_cuda else 1), min_batch=self._min_batch,
            merge_lora=self._merge_lora, compile_sampling=compiled and self._compile_sampling is not False,
        )

    def _fall_back(self, to: str, decoder: nn.Module, error: Exception) -> None:
        what = {"eager": "decoding with uncompiled decoder layers", "generate": "generating with model.generate"}[to]
        warnings.warn(
            f"fastgrpo: the rollout engine cannot {'compile' if to == 'eager' else 'run'} {type(decoder).__name__} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); {what} for the rest of "
            "the run.",
            GenerationFallbackWarning,
            stacklevel=3,
        )
        self.fallback = to
        if self.engine is not None:
            self.engine.release()
        release_caches(decoder)
        self.engine = self._new_engine(compiled=False) if to == "eager" else None

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        num_generations: int = 1,
        return_logprobs: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """Completion ids for each prompt (each prompt repeated `num_generations` times, copies adjacent); with
        `return_logprobs`, also each completion token's log-prob as the trainer computes it (log-softmax of the
        logits over the temperature, before the sampling filters), or None where model.generate sampled.

        A completion stops after its first EOS (kept, as TRL keeps it) or after `max_new_tokens`. The model is put
        in eval mode for the call and its training mode restored afterwards; autograd is off (no_grad rather than
        inference_mode: buffers a forward creates lazily, e.g. rotary caches, must stay usable by the training
        backward). Generation runs in the weights' dtype with autocast off, LoRA factors in the base's dtype.
        """
        if not prompt_ids:
            return []
        empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
        if empty:
            raise ValueError(f"prompts {empty[:8]} have no tokens (of {len(prompt_ids)}); a completion continues a "
                             "prompt: drop empty prompts from the data set (or use a tokenizer that adds a BOS token)")
        sampling = Sampling(temperature, top_k or None, top_p, min_p, repetition_penalty)
        prompts = [list(p) for p in prompt_ids for _ in range(num_generations)]
        decoder = unwrap_for_generation(self.model)
        limit = learned_position_limit(decoder)
        longest = max(map(len, prompt_ids))
        if limit is not None and longest + self.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens with {self.max_new_tokens} new tokens needs {longest + self.max_new_tokens} "
                f"positions; {type(decoder).__name__} embeds {limit} (a learned position table: past it, its lookup "
                f"fails, on CUDA as a device-side assert). Shorten the data set's prompts or max_completion_length so "
                f"that together they fit {limit} tokens.")
        if self.fallback != "generate":
            if self.engine is None:
                self.engine = self._new_engine(compiled=self._compile if self._compile is not None
                                               else self.device.type == "cuda")
            try:
                waves = self._engine_waves(decoder, prompts, sampling)
                self._report_unmerged(decoder)
            except torch.OutOfMemoryError as error:
                self._shrink_waves(len(prompts), error)
                return self.generate(prompt_ids, temperature, top_p, top_k, min_p, repetition_penalty,
                                     num_generations, return_logprobs)
            except MergeNotUndone:  # not a model the engine cannot run: the caller's to see
                raise
            except Exception as error:  # noqa: BLE001 - every failure is named in the warning
                compiled = self.engine.backend is not None
                self._fall_back("eager" if compiled and _is_compile_failure(error) else "generate", decoder, error)
                return self.generate(prompt_ids, temperature, top_p, top_k, min_p, repetition_penalty,
                                     num_generations, return_logprobs)
        else:
            waves = [self._hf_generate(decoder, prompts, sampling)]
        ids, logprobs = [], []
        for completion, wave_logprobs in waves:
            rows = truncate_after_eos(completion, self.eos_token_ids)
            ids += rows
            if return_logprobs and wave_logprobs is not None:
                wave_logprobs = wave_logprobs.cpu()
                logprobs += [wave_logprobs[row, : len(tokens)].tolist() for row, tokens in enumerate(rows)]
        if not return_logprobs:
            return ids
        return ids, (logprobs if waves[0][1] is not None else None)

    def _engine_waves(self, decoder: nn.Module, prompts: list[list[int]], sampling: Sampling
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The engine's (completions, log-probs) for `prompts`, in consecutive waves of at most `wave_rows` rows."""
        wave = self.wave_rows or len(prompts)
        waves = []
        for first in range(0, len(prompts), wave):
            completion, logprobs = self.engine.generate(decoder, prompts[first:first + wave], sampling)
            if len(prompts) > wave:  # the next wave writes the same buffers
                completion, logprobs = completion.clone(), logprobs.clone()
            waves.append((completion, logprobs))
        if self._release_memory:
            self.engine.release()  # the results are views of buffers that live as long as they do
        return waves

    def _shrink_waves(self, rows: int, error: torch.OutOfMemoryError) -> None:
        """After `error` in a call of `rows` rows: free what the engine holds and decode in waves of half the rows
        from now on (one warning); a wave of one row that does not fit re-raises, noting the fixes."""
        wave = min(rows, self.wave_rows or rows)
        self.engine.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if wave <= 1:
            error.add_note(f"fastgrpo: one row of {self.max_new_tokens} new tokens does not fit in memory; "
                           f"use {_MEMORY_FIXES}.")
            raise error
        first = self.wave_rows is None
        self.wave_rows = wave // 2
        if first:
            warnings.warn(
                f"fastgrpo: rollouts of {wave} rows do not fit in the accelerator's memory; the rollout engine decodes "
                f"in waves of at most {self.wave_rows} rows from now on, halved again while they do not fit (each wave "
                f"reads the weights once a token: slower). To decode all rows at once: {_MEMORY_FIXES}.",
                GenerationFallbackWarning,
                stacklevel=4,
            )

    def _report_unmerged(self, decoder: nn.Module) -> None:
        """One warning naming the LoRA layers that decode through the adapters' own forward, and why."""
        not_merged = self.engine._merged.not_merged
        if not not_merged or self._unmerged_reported:
            return
        self._unmerged_reported = True
        reasons = "; ".join(f"{count} with {reason}" for reason, count in not_merged.items())
        warnings.warn(
            f"fastgrpo: the rollout engine decodes some LoRA layers of {type(decoder).__name__} with the adapters' own "
            f"forward (two extra GEMMs each) instead of merged weights or fastgrpo's 4-bit kernel: {reasons}.",
            GenerationFallbackWarning,
            stacklevel=3,
        )

    def _hf_generate(self, decoder: nn.Module, prompts: list[list[int]], sampling: Sampling
                     ) -> tuple[torch.Tensor, None]:
        """`model.generate` on the left-padded batch: (completions, None). It keeps no log-probs (its per-step logits
        would be [rows, tokens, vocab]): the trainer then logs no sampler agreement."""
        ids, mask = left_padded(prompts, self.pad_token_id, self.device)
        was_training = decoder.training
        decoder.eval()
        try:
            out = decoder.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
                top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty, eos_token_id=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
            )
        finally:
            decoder.train(was_training)
        return out[:, ids.shape[1]:], None


def _is_compile_failure(error: Exception) -> bool:
    from fastgrpo.integrations.generation.engine import RecompileStorm

    dynamo_errors = (torch._dynamo.exc.TorchDynamoException,)
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (RecompileStorm, *dynamo_errors)):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
