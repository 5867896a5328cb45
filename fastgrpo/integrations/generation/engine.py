"""The rollout engine: batched sampling from a transformers causal LM over a KV cache it owns.

One call: a prefill of the left-padded prompts (eager), then one decode step per token. The decode step is the
model's own forward (any architecture: `kv.py` says how its attention reaches the cache) with

- LoRA adapters merged into their base weights for the call (`adapters.py`): one GEMM a projection; over a 4-bit
  (QLoRA) base, one launch of the 4-bit kernel reading the packed weight and the adapters;
- each decoder layer compiled once and shared by every layer of its kind (a layer's cache tensors are its inputs,
  never its index), for the step's pointwise work;
- the sampling compiled too for large batches (its passes over the logits fused);
- on CUDA the whole step (embedding, layers, head, sampling, EOS bookkeeping) captured as one CUDA graph per batch
  size and replayed per token: the host only replays and, every few steps, reads how many rows are still running;
- finished rows dropping out: once at most half of a batch's rows run, the step continues on the next smaller batch
  size (powers of two, each its own graph) holding the running rows. Rows keep their cache rows and slots, so
  nothing is copied: the batch is a list of cache rows.

Every value that changes per token (the slot count, the rows) lives in device tensors that the step updates in
place, so a captured step replays unchanged and a compiled layer never recompiles per token.
"""
from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from fastgrpo.compiler.backend import cpu_vector_probe_off
from fastgrpo.integrations.generation.adapters import CompactAdapters, MergedAdapters
from fastgrpo.integrations.generation.experts import capturable_experts
from fastgrpo.integrations.generation.kv import (
    ATTN_IMPLEMENTATION,
    CacheLayout,
    NotRolloutAttention,
    RolloutCache,
    RolloutState,
    has_layer_cache,
    release_caches,
    rollout_context,
)
from fastgrpo.integrations.generation.recurrent import has_states, own_states, recurrent_mixers
from fastgrpo.integrations.generation.rotary import RotaryTables, check_length
from fastgrpo.integrations.generation.sampling import Sampling, sample
from fastgrpo.kernels._graphs import capturing
from fastgrpo.kernels.decode_attention import PROMPT_GROUP_ROWS, grouped_prompt_pays


# Rows that share a prompt read its keys and values from the cache row the prefill wrote (`kv.py`), in a cache whose
# decoding rows take no memory for prompt slots where that is smaller (`kv.CacheLayout`); False copies them into every
# row first (the A/B of `python bench/bench_generation.py --generations 8 --shared-prompt-slots 0`).
SHARED_PROMPT_SLOTS = True
# With SHARED_PROMPT_SLOTS: the compact cache layout where it is smaller; False keeps every row's prompt slots (the A/B
# of `python bench/bench_generation.py --generations 8 --compact-cache 0`).
COMPACT_CACHE = True
# With SHARED_PROMPT_SLOTS: the decode attention attends a group's prompt once a step for all its rows
# (decode_attention's prompt_groups): "auto" in the layers where decode_attention.grouped_prompt_pays (a token's KV
# of 8 KiB and more: Phi-3-mini's generation 4.64 -> 3.81 s a step), True in every layer, False in none.
GROUPED_PROMPT_ATTENTION = "auto"


class RecompileStorm(RuntimeError):
    """The compiled decode layer kept compiling: some value that changes per token reaches its guards."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _layer_forward(layer: nn.Module, *args, **kwargs):
    return layer.forward(*args, **kwargs)


def own_code(fn):
    """`fn` with a code object of its own. Dynamo keeps compiled graphs, and counts them against its recompile limit
    (8), per code object: engines compiling one shared function would share one cache and one limit, and a process with
    several engines (a trainer's and another, or a test's reference and the engine under test) would exceed it."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return copy


def embed_and_forward(decoder: nn.Module, input_ids: torch.Tensor, **kwargs):
    """The decoder's forward on `input_ids`, called eagerly even when `decoder.compile()` gave it a compiled
    (training) call path. The ids themselves go in, as `generate` passes them: a multimodal wrapper finds its
    placeholder tokens and a model with per-layer token inputs its rows from them."""
    kwargs["input_ids"] = input_ids
    if getattr(decoder, "_compiled_call_impl", None) is not None:
        return decoder._call_impl(**kwargs)
    return decoder(**kwargs)


# Names of the forward hooks `enable_input_require_grads` puts on the input embeddings (transformers; PEFT and TRL).
_REQUIRE_GRADS_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


@contextlib.contextmanager
def _require_grads_hooks_off(decoder: nn.Module):
    """The input embeddings' `enable_input_require_grads` hooks taken off for the block and put back in their place.
    They are for training under gradient checkpointing (`requires_grad_` on the embeddings' output), which no-grad
    sampling does not need and a traced decode step cannot hold; the embeddings' other hooks run (TRL's cast of a
    tied fp32 lm-head's embeddings back to the model's dtype)."""
    embeddings = decoder.get_input_embeddings()
    hooks = getattr(embeddings, "_forward_hooks", None)
    saved = dict(hooks) if hooks else {}
    try:
        for key, hook in saved.items():
            if getattr(hook, "__name__", None) in _REQUIRE_GRADS_HOOKS:
                del hooks[key]
        yield
    finally:
        if saved:
            hooks.clear()
            hooks.update(saved)



class _CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and stops a storm of recompiles."""

    def __init__(self, backend: str, limit: int, options: dict | None = None):
        inner = torch._dynamo.lookup_backend(backend)
        self.inner = functools.partial(inner, options=options) if options else inner
        self.limit = limit
        self.compiles = 0
        self.step = 0  # the engine's decode step being run
        self.compile_steps: list[int] = []  # the decode step of each compile

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        self.compile_steps.append(self.step)
        if self.compiles > self.limit:
            raise RecompileStorm(
                f"the decode layer compiled {self.compiles} graphs (limit {self.limit}): a value that changes per "
                "token or per call reaches its guards"
            )
        # The inductor config a fastgrpo-compiled graph gets on CUDA (no host vector-ISA probes), for any backend.
        from torch._inductor import config as inductor_config

        with inductor_config.patch(cpu_vector_probe_off(example_inputs)):
            return self.inner(gm, example_inputs)


def _model_code_frame(error: BaseException) -> str | None:
    """"file:line" of the innermost frame of `error` when that frame is a model's code (not torch's, not
    fastgrpo's): a model that reads the attention mask or the cache itself fails there on the engine's inputs."""
    import traceback
    from pathlib import Path

    import fastgrpo

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    path = Path(frames[-1].filename).resolve()
    packages = (Path(fastgrpo.__file__).resolve().parent, Path(torch.__file__).resolve().parent)
    if any(path.is_relative_to(package) for package in packages):
        return None
    return f"{path.name}:{frames[-1].lineno}"


class EngineMismatch(RuntimeError):
    """The engine's logits differ from the model's own forward on the same tokens (the model computes something the
    engine does not reproduce: positions from the token ids, attention modules called twice per layer, ...)."""


# Largest KL(model's forward || engine) over the checked positions: fp32 agrees to rounding; half precision differs
# by the order of its sums (attention kernels, LoRA in bf16) but far below what a wrong position or cache gives (>1).
_MISMATCH_KL = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
# Batches from this many rows sample with the compiled sampling; below it sampling runs eagerly (no compile). At 128
# rows compiled sampling was 6.5 % faster a call, at 64 no faster (`python bench/bench_generation.py --cases
# 64x256,128x512 --compile-sampling 0` against the default).
COMPILED_SAMPLING_ROWS = 128
# Logit rows the check compares: the prefill's and the first decode steps' (eager on the first call).
_PROBE_STEPS = 4


@dataclass
class _Batch:
    """A decode step for `size` rows: which cache rows they are, and its captured graph (keyed by sampling)."""

    rows: torch.Tensor
    groups: torch.Tensor | None = None  # [size, PROMPT_GROUP_ROWS]: the rows by shared prompt (GROUPED_PROMPT_ATTENTION)
    graph: tuple | None = None
    warmed: set = field(default_factory=set)  # the samplings this size has run eagerly (compiled, warmed up)


@dataclass
class _Buffers:
    """Per-cache-row state the step reads and writes in place (allocated for `rows` cache rows)."""

    rows: int
    state: RolloutState  # start [rows], length (0-d): slots written, prompt_rows [rows], prompt_len (0-d)
    last: torch.Tensor  # [rows] the token each row feeds next
    finished: torch.Tensor  # [rows] bool
    completion: torch.Tensor  # [rows, max_new_tokens]
    logprobs: torch.Tensor  # [rows, max_new_tokens] fp32: log-prob of each sampled token (temperature applied)
    eos: torch.Tensor  # the EOS token ids (kept, like every tensor a captured step reads: a later call replays it)
    rotary: RotaryTables | None = None  # the rotary modules' per-position tables the decode steps read
    seen: torch.Tensor | None = None  # [rows, vocab] bool, for the repetition penalty
    batches: dict = field(default_factory=dict)  # size -> _Batch
    weights: tuple = ()  # the adapter copies' versions the captured graphs read


class RolloutEngine:
    """Prefill and decode for one model; reuses its cache, buffers, compiled layers and graphs across calls.

    Args:
        compile_layers: compile the decoder layer for the decode step (with `backend`).
        cuda_graphs: capture each batch size's decode step as a CUDA graph (CUDA only).
        pad_to_multiple_of: round the padded prompt length and the cache length up to it, so that caches and graphs
            are reused across calls.
        check_every: decode steps between the host's reads of how many rows still run.
        min_batch: the smallest batch a compacted step runs (smaller compactions save little).
        compile_limit: graphs the compiled layer may compile before the engine gives up (`RecompileStorm`).
        backend_options: the backend's `options` (e.g. the fastgrpo backend's patterns).
        verify: on the first call, check the engine's logits against the model's own forward (`EngineMismatch`).
        merge_lora: how LoRA layers decode (`MergedAdapters`: "float", "all", "none").
        compile_sampling: compile the decode step's sampling too, for batches of COMPILED_SAMPLING_ROWS rows and
            more (inductor, or eager when `backend` is "eager"): its passes over the [rows, vocab] logits fuse;
            default: when the layers compile.
    """

    def __init__(self, pad_token_id: int, eos_token_ids: list[int], max_new_tokens: int, *, compile_layers: bool,
                 backend: str, cuda_graphs: bool, pad_to_multiple_of: int, check_every: int, min_batch: int = 8,
                 compile_limit: int = 8, verify: bool = True, backend_options: dict | None = None,
                 merge_lora: str = "float", compile_sampling: bool | None = None):
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.cuda_graphs = cuda_graphs
        self.pad_to_multiple_of = pad_to_multiple_of
        self.check_every = check_every
        self.min_batch = min_batch
        self.backend = _CountingBackend(backend, compile_limit, backend_options) if compile_layers else None
        self._compiled_layer = (
            torch.compile(own_code(_layer_forward), backend=self.backend, fullgraph=True) if compile_layers else None
        )
        compile_sampling = compile_layers if compile_sampling is None else compile_sampling
        self.sampling_backend = (
            _CountingBackend("eager" if backend == "eager" else "inductor", compile_limit) if compile_sampling else None
        )
        self._sample = (torch.compile(own_code(sample), backend=self.sampling_backend, fullgraph=True)
                        if compile_sampling else sample)
        self._verify = verify
        self._probe: list[torch.Tensor] | None = None  # logits kept for the check: prefill's, first step's
        self._buffers: _Buffers | None = None
        self._decoder: nn.Module | None = None
        self._pool = None
        self._adapters = CompactAdapters()
        self._merged = MergedAdapters(merge_lora)
        self._cache = RolloutCache()
        self._states: list = []  # the linear-attention / state-space mixers' LayerStates of this call (recurrent.py)
        self.steps = 0  # decode steps run, for tests and logs

    # ---- setup -------------------------------------------------------------------------------------------------

    def release(self) -> None:
        """Free the KV cache, the buffers and the captured graphs."""
        if self._decoder is not None:
            release_caches(self._decoder)
        self._buffers = None
        self._pool = None
        self._merged.release()

    def _ensure_buffers(self, decoder: nn.Module, rows: int, slots: int, prompt_len: int, prompts: int, vocab: int,
                        device, penalty: bool) -> _Buffers:
        """The buffers for a call of `rows` rows, `slots` slots and `prompts` distinct prompts of `prompt_len` padded
        tokens: the last call's where its cache layout holds this one, else new ones (and new caches and graphs)."""
        b = self._buffers
        compact = SHARED_PROMPT_SLOTS and COMPACT_CACHE
        if (b is None or not b.state.layout.holds(rows, slots, prompt_len, prompts) or b.last.device != device
                or self._decoder is not decoder or (b.state.layout.is_compact and not compact)):
            self.release()  # the layers' caches are allocated again at this call's prefill
            self._decoder = decoder
            long = dict(dtype=torch.long, device=device)
            layout = (CacheLayout.best(rows, slots, prompt_len, prompts) if compact
                      else CacheLayout.plain(rows, slots))
            state = RolloutState(rows=torch.arange(rows, device=device), start=torch.zeros(rows, **long),
                                 length=torch.zeros((), **long), prompt_rows=torch.arange(rows, device=device),
                                 prompt_len=torch.zeros((), **long), layout=layout)
            b = _Buffers(
                rows=rows, state=state,
                last=torch.zeros(rows, **long), finished=torch.ones(rows, dtype=torch.bool, device=device),
                completion=torch.zeros(rows, self.max_new_tokens, **long),
                logprobs=torch.zeros(rows, self.max_new_tokens, device=device),
                eos=torch.tensor(self.eos_token_ids, device=device), rotary=RotaryTables(slots),
            )  # fmt: skip
            self._buffers = b
        if penalty and (b.seen is None or b.seen.shape[1] != vocab):
            b.seen = torch.zeros(b.rows, vocab, dtype=torch.bool, device=device)
            b.batches.clear()  # graphs captured without the penalty's buffer
        return b

    def _batch(self, b: _Buffers, size: int, grouped: bool) -> _Batch:
        """The decode step of `size` rows; `grouped`: it lists its rows by shared prompt (`_prompt_groups_used`)."""
        batch = b.batches.get(size)
        if batch is None:
            device = b.last.device
            groups = torch.full((size, PROMPT_GROUP_ROWS), -1, dtype=torch.long, device=device) if grouped else None
            batch = b.batches[size] = _Batch(rows=torch.arange(size, device=device), groups=groups)
        return batch

    @contextlib.contextmanager
    def _decoding(self, decoder: nn.Module, state: RolloutState):
        """The model set up for rollout attention with compact adapters, in eval mode, autocast off; all restored
        afterwards."""
        configs = {id(m.config): m.config for m in decoder.modules()
                   if hasattr(getattr(m, "config", None), "_attn_implementation")}
        saved = {key: config._attn_implementation for key, config in configs.items()}
        was_training = decoder.training
        decoder.eval()
        try:
            for config in configs.values():
                config._attn_implementation = ATTN_IMPLEMENTATION
            with self._merged.swapped(decoder), self._adapters.swapped(decoder), _require_grads_hooks_off(decoder), \
                    own_states(recurrent_mixers(decoder)) as self._states, \
                    capturable_experts(decoder, self.cuda_graphs), \
                    torch.autocast(decoder.device.type, enabled=False), rollout_context(state):
                weights = (self._merged.version, self._adapters.version)
                if self._buffers is not None and self._buffers.weights != weights:
                    self._buffers.batches.clear()  # graphs captured reading weight copies that are gone
                    self._buffers.weights = weights
                yield
        finally:
            for key, config in configs.items():
                config._attn_implementation = saved[key]
            decoder.train(was_training)

    @contextlib.contextmanager
    def _compiled_layers(self, decoder: nn.Module):
        """Every decoder layer called through the one compiled layer function (restored afterwards). The layers are
        the module list whose members hold the attention modules the prefill gave a cache."""
        if self._compiled_layer is None:
            yield
            return
        layers = _decoder_layers(decoder)
        saved = [layer.__dict__.get("_compiled_call_impl") for layer in layers]
        try:
            for layer in layers:
                layer._compiled_call_impl = functools.partial(self._compiled_layer, layer)
            yield
        finally:
            for layer, call in zip(layers, saved):
                layer._compiled_call_impl = call

    # ---- one call ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, decoder: nn.Module, prompts: list[list[int]], sampling: Sampling
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(completions [rows, generated], pad after a row's first EOS; their tokens' log-probs under the sampling
        temperature, before top-k/top-p/min-p), one row per prompt."""
        device = next(decoder.parameters()).device
        batch = len(prompts)
        chunk = getattr(decoder.config.get_text_config(), "attention_chunk_size", None)
        reach = max(len(p) for p in prompts) + self.max_new_tokens  # positions a row may reach
        if chunk and reach > chunk:
            raise NotRolloutAttention(
                f"{type(decoder).__name__} attends in chunks of {chunk} tokens (attention_chunk_size), which only its "
                f"mask applies and the engine's cache does not; these rows reach {reach} tokens")
        check_length(decoder, reach)
        multiple = self.pad_to_multiple_of
        prompt_len = round_up(max(len(p) for p in prompts), multiple)
        slots = round_up(prompt_len + self.max_new_tokens, multiple)
        vocab = decoder.get_output_embeddings().weight.shape[0]
        penalty = sampling.repetition_penalty != 1.0
        # GRPO repeats each prompt once per completion: the prefill runs each distinct prompt once, into the cache
        # layout's prompt rows; the rows of its completions read its slots there (or get a copy: SHARED_PROMPT_SLOTS).
        distinct = {}
        sources = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        b = self._ensure_buffers(decoder, batch, slots, prompt_len, len(distinct), vocab, device, penalty)
        state = b.state
        layout = state.layout

        input_ids = torch.full((batch, prompt_len), self.pad_token_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, prompt_len - len(p):] = torch.tensor(p)
        start = torch.tensor([prompt_len - len(p) for p in prompts])
        input_ids, start = input_ids.to(device), start.to(device)
        state.start.zero_()[:batch] = start
        state.length.fill_(prompt_len)
        state.prompt_len.fill_(prompt_len)
        b.finished.fill_(True)
        b.completion.fill_(self.pad_token_id)
        b.logprobs.zero_()
        if penalty:  # as transformers' RepetitionPenaltyLogitsProcessor: every token of the padded prompt row
            b.seen.zero_()[:batch].scatter_(1, input_ids, True)
        self._probe = [] if self._verify else None
        if self._probe is not None:  # up to two of the longest prompts, and the most padded one
            longest, shortest = torch.nonzero(start == start.min())[:2, 0], torch.argmax(start)[None]
            self._probe_rows = longest if start.max() == start.min() else torch.cat([longest, shortest])
            self._probe_starts = start[self._probe_rows].tolist()

        source = torch.tensor(sources, device=device)
        firsts = torch.tensor([prompts.index(list(p)) for p in distinct], device=device)
        with self._decoding(decoder, state):
            logits = self._prefill(decoder, input_ids[firsts], start[firsts], b, len(distinct))[source]
            state.prompt_rows.fill_(layout.prompt_row(0))  # rows past this call's: any row the cache has
            if SHARED_PROMPT_SLOTS or len(distinct) == batch:
                state.prompt_rows[:batch] = layout.prompt_row(source)
            else:  # a plain layout: each row a copy
                _spread_prompt_rows(decoder, source, prompt_len)
                state.prompt_rows.copy_(torch.arange(b.rows, device=device))
            if len(distinct) < batch:
                for states in self._states:
                    states.spread(source)
            for states in self._states:
                states.use_rows(batch)
            grouped = _prompt_groups_used(decoder)
            state.prompt_groups_everywhere = GROUPED_PROMPT_ATTENTION is True
            if self._probe is not None:
                self._probe[0] = self._probe[0][source[self._probe_rows]]
            first, first_logprobs = sample(logits, sampling, b.seen[:batch] if penalty else None)
            b.last[:batch] = first
            b.finished[:batch] = torch.isin(first, b.eos)
            b.completion[:batch, 0] = first
            b.logprobs[:batch, 0] = first_logprobs
            if penalty:
                b.seen[torch.arange(batch, device=device), first] = True
            generated = 1
            size = batch
            current = self._batch(b, size, grouped)
            current.rows.copy_(torch.arange(size, device=device))
            if current.groups is not None:
                _fill_prompt_groups(current, sources)
            with self._compiled_layers(decoder), b.rotary.installed(decoder, _decoder_layers(decoder)):
                while generated < self.max_new_tokens:
                    if generated % self.check_every == 0:
                        running = int((~b.finished[:batch]).sum())
                        if running == 0:
                            break
                        smaller = max(self.min_batch, 1 << max(0, math.ceil(math.log2(running))))
                        probing = self._probe is not None and len(self._probe) < _PROBE_STEPS
                        if smaller < size and running <= size // 2 and not probing:
                            size = smaller
                            # Running rows first; finished rows fill the rest (their writes land after their EOS).
                            order = torch.argsort(b.finished[:batch].to(torch.int8), stable=True)
                            if self._states:  # their rows are batch positions: each running row's moves with it
                                position = torch.zeros(batch, dtype=torch.long, device=device)
                                position[current.rows] = torch.arange(len(current.rows), device=device)
                                for states in self._states:
                                    states.reorder(position[order[:size]])
                            current = self._batch(b, size, grouped)
                            current.rows.copy_(order[:size])
                            if current.groups is not None:
                                _fill_prompt_groups(current, [sources[row] for row in order[:size].tolist()])
                    self._run(decoder, current, b, sampling)
                    generated += 1
        if self._probe:
            self._check(decoder, input_ids, b, generated)
        return b.completion[:batch, :generated], b.logprobs[:batch, :generated]

    def _prefill(self, decoder, input_ids, start, b: _Buffers, batch: int) -> torch.Tensor:
        """The prompts' forward: keys and values into cache rows [0, batch), the last position's logits. While it
        runs, `state.start` holds these rows' starts (it is set for the completion rows afterwards)."""
        state = b.state
        prompt_len = input_ids.shape[1]
        row_starts = state.start.clone()
        state.start[:batch] = start
        positions = (torch.arange(prompt_len, device=input_ids.device)[None] - start[:, None]).clamp(min=0)
        state.rows = torch.arange(batch, device=input_ids.device)
        state.prefill, state.prefill_calls = True, 0
        state.prefill_modules.clear()
        self._cache.seen_tokens, self._cache.prefill_updates, self._cache.prefilling = 0, 0, True
        extra = {}
        if self._states:  # the mixers zero the padded positions' inputs with the 2D mask (recurrent.py)
            slots = torch.arange(prompt_len, device=input_ids.device)
            extra["attention_mask"] = (slots[None] >= start[:, None]).long()
            for states in self._states:
                states.begin_prefill(state.cache_rows)
        try:
            logits = embed_and_forward(
                decoder, input_ids, position_ids=positions, past_key_values=self._cache, use_cache=True,
                logits_to_keep=1, **extra,
            ).logits[:, -1]
        except (TypeError, AttributeError, IndexError, KeyError) as error:
            if (where := _model_code_frame(error)) is None:
                raise
            raise NotRolloutAttention(
                f"{type(decoder).__name__}: its own code ({where}) failed on the engine's inputs, which give no "
                "attention mask (the rollout attention masks each row itself) and a cache of the engine's kind: "
                f"{type(error).__name__}: {error}"
            ) from error
        finally:
            state.prefill = self._cache.prefilling = False
            for states in self._states:
                states.end_prefill()
        stateful = any(states.written for states in self._states)
        if (state.prefill_calls == 0 and not stateful) or state.prefill_calls != self._cache.prefill_updates:
            raise NotRolloutAttention(
                f"{type(decoder).__name__}: {self._cache.prefill_updates} cache updates but {state.prefill_calls} "
                "calls of the rollout attention in the prefill (some attention does not go through transformers' "
                "AttentionInterface)"
            )
        self._cache.seen_tokens = prompt_len
        state.start.copy_(row_starts)
        if self._probe is not None:
            self._probe.append(logits.float())  # all prefill rows; generate() keeps the probe rows
            self._probe_dtype = logits.dtype if logits.dtype in _MISMATCH_KL else torch.float16
        return logits

    def _step(self, decoder, batch: _Batch, b: _Buffers, sampling: Sampling) -> None:
        """One decode step for `batch.rows`: feed each row's last token, sample the next, book-keep EOS."""
        rows = batch.rows
        state = b.state
        state.rows, state.prompt_groups = rows, batch.groups
        state.length.add_(1)
        positions = (state.length - 1 - state.start[rows])[:, None]
        logits = embed_and_forward(
            decoder, b.last[rows][:, None], position_ids=positions, past_key_values=self._cache, use_cache=True,
        ).logits[:, -1]
        if self._probe is not None and len(self._probe) < _PROBE_STEPS:
            self._probe.append(logits[self._probe_rows].float().clone())
        seen = b.seen[rows] if b.seen is not None and sampling.repetition_penalty != 1.0 else None
        done = b.finished[rows]
        sample_step = self._sample if rows.shape[0] >= COMPILED_SAMPLING_ROWS else sample
        tokens, logprobs = sample_step(logits, sampling, seen)
        tokens = tokens.masked_fill(done, self.pad_token_id)
        column = (state.length - state.prompt_len).expand(rows.shape[0])
        b.last[rows] = tokens
        b.completion[rows, column] = tokens
        b.logprobs[rows, column] = logprobs.masked_fill(done, 0.0)
        b.finished[rows] = done | torch.isin(tokens, b.eos)
        if seen is not None:
            b.seen[rows, tokens] = True

    def _run(self, decoder, batch: _Batch, b: _Buffers, sampling: Sampling) -> None:
        self.steps += 1
        if self.backend is not None:
            self.backend.step = self.steps
        self._cache.seen_tokens += 1
        if not self.cuda_graphs:
            self._step(decoder, batch, b, sampling)
            return
        if batch.graph is not None and batch.graph[0] == sampling:
            batch.graph[1].replay()
            return
        if sampling not in batch.warmed or self._probe is not None and len(self._probe) < _PROBE_STEPS:
            # The first step of a batch size and sampling runs eagerly: it compiles and warms up what the capture
            # records (nothing may compile while a stream captures), and feeds the check.
            batch.warmed.add(sampling)
            self._step(decoder, batch, b, sampling)
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        captured = torch.cuda.CUDAGraph()
        try:
            with capturing(captured, self._pool):  # a failed capture leaves the device as it was
                self._step(decoder, batch, b, sampling)
        except BaseException:
            self._pool = None  # retired (`capturing`)
            raise
        batch.graph = (sampling, captured)
        captured.replay()  # capturing records the step without running it

    def _check(self, decoder, input_ids: torch.Tensor, b: _Buffers, generated: int) -> None:
        """Compare the engine's logits (prefill and the first decode steps) on up to two of the longest prompts and
        the most padded one with the model's plain forward over the same tokens, padding stripped: the forward the
        trainer scores with; once per engine. `EngineMismatch` when they disagree (a model whose positions or states
        the engine does not reproduce, with or without left padding)."""
        probe, self._probe, self._verify = self._probe, None, False
        rows = self._probe_rows
        steps = min(len(probe), generated)
        was_training = decoder.training
        decoder.eval()
        layers = _decoder_layers(decoder)
        saved = [layer.__dict__.get("_compiled_call_impl") for layer in layers]
        reference = [None] * len(rows)
        try:
            for layer in layers:  # eagerly: a compiled training layer would compile a graph for this one forward
                layer._compiled_call_impl = None
            for start in set(self._probe_starts):  # one forward for the rows of each padding
                group = [i for i, s in enumerate(self._probe_starts) if s == start]
                ids = torch.cat([input_ids[rows[group], start:], b.completion[rows[group], : steps - 1]], dim=1)
                with torch.autocast(ids.device.type, enabled=False):
                    logits = decoder(input_ids=ids, use_cache=False).logits[:, -steps:]
                for i, row_logits in zip(group, logits):
                    reference[i] = row_logits
        finally:
            for layer, call in zip(layers, saved):
                layer._compiled_call_impl = call
            decoder.train(was_training)
        reference = torch.stack(reference).float().transpose(0, 1)  # [steps, rows, vocab]
        engine = torch.stack(probe[:steps])
        kl = torch.nn.functional.kl_div(engine.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1).max().item()
        tolerance = _MISMATCH_KL[self._probe_dtype]
        if not kl <= tolerance:
            raise EngineMismatch(
                f"{type(decoder).__name__}: the engine's next-token distribution differs from the model's own forward "
                f"(KL {kl:.3g} > {tolerance:g})"
            )


def _prompt_groups_used(decoder: nn.Module) -> bool:
    """Whether some layer's decode attention takes the rows listed by shared prompt (GROUPED_PROMPT_ATTENTION: True,
    or "auto" with a layer cache that decode_attention.grouped_prompt_pays for); else no step lists them."""
    if not (SHARED_PROMPT_SLOTS and GROUPED_PROMPT_ATTENTION):
        return False
    return GROUPED_PROMPT_ATTENTION is True or any(
        grouped_prompt_pays(module._fastgrpo_kv[0]) for module in decoder.modules() if has_layer_cache(module))


def _fill_prompt_groups(batch: _Batch, prompts: list[int]) -> None:
    """`batch.groups` in place: batch row i decodes a completion of distinct prompt prompts[i]; an entry lists up to
    PROMPT_GROUP_ROWS rows of one prompt, -1 after them, and rows after the last entry."""
    by_prompt = {}
    for position, prompt in enumerate(prompts):
        by_prompt.setdefault(prompt, []).append(position)
    table = torch.full(batch.groups.shape, -1, dtype=torch.long)
    entry = 0
    for members in by_prompt.values():
        for first in range(0, len(members), PROMPT_GROUP_ROWS):
            chunk = members[first:first + PROMPT_GROUP_ROWS]
            table[entry, : len(chunk)] = torch.tensor(chunk)
            entry += 1
    batch.groups.copy_(table)


def _spread_prompt_rows(decoder: nn.Module, source: torch.Tensor, prompt_len: int) -> None:
    """Row i of every layer's cache takes the prompt slots of row source[i] (the prefill filled rows [0, distinct))."""
    for module in decoder.modules():
        if has_layer_cache(module):
            for cache in module._fastgrpo_kv:
                cache[: len(source), :, :prompt_len] = cache[source, :, :prompt_len]


def _decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    """The module list whose members hold the attention modules given a cache or the mixers given states (not, say, a
    vision tower's)."""
    best, held = None, 0
    for module in decoder.modules():
        if isinstance(module, nn.ModuleList):  # hybrids' lists mix layer classes: each compiles its own graph
            count = sum(any(has_layer_cache(m) or has_states(m) for m in child.modules()) for child in module)
            if count > held:
                best, held = module, count
    if best is None:
        raise NotRolloutAttention(f"{type(decoder).__name__} has no list of decoder layers holding attention")
    return best
