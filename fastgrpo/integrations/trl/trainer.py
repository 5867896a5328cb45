"""fastgrpo's `GRPOTrainer`: TRL's trainer with the log-prob head, compiled layers, offloaded checkpointing, packed
rows, memory-sized mini-batches and the embedded generator."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from trl.extras.profiling import profiling_context
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import get_config_model_id

from fastgrpo.compiler import compile_repeated_blocks, layer_graphs
from fastgrpo.compiler.cache import enable_compile_cache
from fastgrpo.compiler.offload import enable_offloaded_checkpointing, offload_handle
from fastgrpo.compiler.options import training_options
from fastgrpo.compiler.regions import repeated_blocks
from fastgrpo.errors import UserError
from fastgrpo.integrations.checkpoints import lora_mismatch, save_checkpoint_atomically
from fastgrpo.integrations.compile_log import CompileLog, FusionSummary
from fastgrpo.integrations.generation import EmbeddedGenerator
from fastgrpo.integrations.packing import PACK_MIN_SAVED, Packer
from fastgrpo.integrations.unwrap import causal_lm_of
from fastgrpo.kernels import _graphs
from fastgrpo.versions import warn_untested_versions
from fastgrpo.integrations.trl.config import GRPOConfig
from fastgrpo.integrations.trl.hooks import (
    FreezeLongLivedObjects,
    keep_bnb_4bit_on_its_autograd_path,
    keep_one_input_require_grads_hook,
)
from fastgrpo.integrations.trl.logprob_head import CompiledBackbone, LogprobHead
from fastgrpo.integrations.trl.sizing import auto_mini_batch, out_of_memory_note
from fastgrpo.integrations.trl.vllm_swap import shared_vllm_generation


def check_prompts_for_a_step(dataset, args: GRPOConfig) -> None:
    """A `UserError` naming the fix where a map-style `dataset` holds fewer prompts than one generation batch draws:
    TRL's sampler yields only whole batches of distinct prompts, so such a run would train 0 steps and end as if it
    had succeeded."""
    if dataset is None or not hasattr(dataset, "__len__") or args.generation_batch_size is None:
        return
    needed = args.generation_batch_size // args.num_generations
    if len(dataset) < needed:
        raise UserError(
            f"train_dataset has {len(dataset)} prompt(s) and one step draws {needed} distinct prompts "
            f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}): TRL's "
            "sampler would yield no batch and train 0 steps. Add prompts (repeat them), or lower "
            "per_device_train_batch_size or steps_per_generation."
        )


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
        self._compile_log = CompileLog(enable_compile_cache(args.fastgrpo_compile_cache))  # before any compile
        with shared_vllm_generation(args):
            super().__init__(model, reward_funcs, args, *more_args, **kwargs)
        check_prompts_for_a_step(self.train_dataset, args)
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
            head.install(causal_lm_of(target))
            self._fastgrpo_heads.append(head)
        self._fastgrpo_offload = self._offload_checkpointing() if self._offload_on() else None
        for head in self._fastgrpo_heads:
            if head.packer is not None:  # packed calls whose layers replay take a length bucket's shapes
                head.packer.replays = self._layer_calls_replay
        self.add_callback(self._compile_log)
        if args.fastgrpo_compile:
            self.add_callback(FusionSummary())
        if args.fastgrpo_freeze_gc:
            self.add_callback(FreezeLongLivedObjects())
        reentrant = bool((args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False))
        # With the layers compiled one region each (CompiledBackbone, offloading) the hook is kept for another reason:
        # a first layer whose input needs no grad would compile a second layer graph (offloading also swaps the
        # leaf the hook makes for an alias that autograd does not hold through the backward).
        regions = args.fastgrpo_compile and repeated_blocks(causal_lm_of(self.model)) is not None
        needed = reentrant or self._offload_on() or regions
        keep_one_input_require_grads_hook(causal_lm_of(self.model), needed=needed)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """A checkpoint whose adapter has another rank, alpha or targets than this run's is refused naming them (PEFT
        would fail with a size mismatch per tensor, or resume with another scaling)."""
        target = model if model is not None else self.model
        configs = getattr(target, "peft_config", None) or {}
        config = configs.get(getattr(target, "active_adapter", None)) if isinstance(configs, dict) else None
        if config is not None and hasattr(config, "r"):
            mismatch = lora_mismatch(resume_from_checkpoint, config.r, config.lora_alpha, config.target_modules)
            if mismatch:
                raise UserError(f"resume_from_checkpoint: {Path(resume_from_checkpoint).name} was written with "
                                f"{mismatch}; resume with its LoraConfig, or train from scratch")
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_checkpoint(self, model, trial):
        """checkpoint-N appears only when complete (fastgrpo.integrations.checkpoints)."""
        save_checkpoint_atomically(self, super()._save_checkpoint, model, trial)

    def _offload_checkpointing(self):
        """Checkpoint the policy's decoder layers with their inputs in host memory.

        Offloading wraps each layer's call outside any compiled region, so a whole-decoder graph would
        break at every layer: the layers are compiled one region each instead. Each layer's HF
        checkpointing flag now switches the offloading, so `Trainer.train()`'s
        `gradient_checkpointing_enable()` and TRL's disable/enable around generation and no-grad passes
        pause and resume it rather than stacking HF's checkpoint on top. Returns the offload handle."""
        policy = causal_lm_of(self.model)
        if not self.args.fastgrpo_compile:
            return enable_offloaded_checkpointing(policy)
        compile_repeated_blocks(policy, options=self._compile_options(), dynamic=True, offload_checkpointing=True)
        return offload_handle(policy)

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
                merge_lora=self.args.fastgrpo_generation_merge_lora,
                release_memory=self.args.fastgrpo_generation_release_memory,
            )
        # TRL's sampler already repeats each prompt num_generations times in prompt_ids. The sampler's log-probs go
        # back to TRL as vLLM's do (`sampling_per_token_logps`), for the agreement metric and off-policy masking.
        with profiling_context(self, "fastgrpo.EmbeddedGenerator.generate"):
            completion_ids, logprobs = self._embedded_generator.generate(
                prompt_ids, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None,
                min_p=self.min_p, repetition_penalty=self.repetition_penalty, return_logprobs=True,
            )
        return completion_ids, logprobs

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as error:
            error.add_note(out_of_memory_note(self.args))
            raise

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.use_vllm:
            self._log_sampler_agreement(output.get("old_per_token_logps"), output)
        return output

    def _compute_loss(self, model, inputs):
        # The embedded generator's log-probs are compared with the loss forward's own (no extra forward).
        self._fastgrpo_sampled = None if self.use_vllm else inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._fastgrpo_sampled = None

    def _log_sampler_agreement(self, trainer_logps, output) -> None:
        """Log the share of completion tokens whose importance ratio exp(trainer - sampler log-prob) is outside
        [0.9, 1.1]. With vLLM the trainer's side is the old-policy log-probs, which TRL computes unless
        vllm_importance_sampling_correction=False (and steps are aligned); with the embedded generator it is the
        loss forward's."""
        sampled = output.get("sampling_per_token_logps")
        if trainer_logps is None or sampled is None:
            return
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        log_ratio = (trainer_logps.detach() - sampled)[mask]
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
            and self.args.generation_kwargs is None
            and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        )

    def log(self, logs: dict, start_time: float | None = None) -> None:
        logs.update(self._compile_log.pop_fields())  # the first entry after the first step: compile_s, cache use
        logs.update(_graphs.log_fields())  # op bodies replayed as CUDA graphs (fastgrpo/kernels/_graphs.py)
        handle = self._fastgrpo_offload
        if handle is not None and handle.graphs.stats["eager"]:  # layer calls as CUDA graphs (compiler/layer_graphs.py)
            logs.update(handle.graphs.log_fields())
        super().log(logs, start_time)

    def _bucket_padding(self, input_ids: torch.Tensor, model_inputs: dict, rows: int | None) -> int:
        """Columns to append to a training forward's rows so that its length is a bucket's
        (`layer_graphs.bucket_length`): where the policy's layer calls, `rows` rows each (None: all), are replayed
        as CUDA graphs, whose keys include the length; not with other model inputs (images, token types). Appended
        columns are masked; causal attention keeps them out of every real position."""
        if any(v is not None for k, v in model_inputs.items() if k != "compute_aux_loss"):
            return 0
        length = layer_graphs.bucket_length(input_ids.size(1))
        if not self._layer_calls_replay(min(rows or input_ids.size(0), input_ids.size(0)) * length, input_ids.device):
            return 0  # a call this large runs as it is (or nothing replays): no padding
        return length - input_ids.size(1)

    def _layer_calls_replay(self, tokens: int, device: torch.device) -> bool:
        """Whether the policy's layer calls on `tokens` tokens replay as CUDA graphs (`layer_graphs`): offloaded
        checkpointing on, gradients on, on CUDA, and a call small enough (`LayerGraphs.worth_it`)."""
        on_device = device.type == "cuda" or layer_graphs.EMULATE_ON_CPU
        return (layer_graphs.ENABLED and on_device and torch.is_grad_enabled() and self._fastgrpo_offload is not None
                and self._fastgrpo_offload.graphs.worth_it(tokens))

    def _offload_on(self) -> bool:
        choice = self.args.fastgrpo_offload_checkpointing
        auto = choice == "auto" and self.accelerator.device.type == "cuda" and self.args.gradient_checkpointing
        return choice is True or auto

    def _compile_options(self) -> dict | None:
        """The backend options: the user's, plus the gated-MLP form `training_options` picks for this run."""
        return training_options(self.args.fastgrpo_compile_options, device_type=self.accelerator.device.type,
                                checkpointing=self.args.gradient_checkpointing, offload=self._offload_on(),
                                packing=self._packing_on())

    def _pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return pad if pad is not None else 0

    def _packing_on(self) -> bool:
        return self.args.fastgrpo_packing in (True, "auto")

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        rows = self.args.fastgrpo_mini_batch
        if kwargs.get("compute_aux_loss"):
            # The MoE load-balancing loss is not a sum over rows (its expert shares multiply): TRL's batches, so that
            # it is TRL's number.
            rows = batch_size
        elif rows == "auto":
            rows = auto_mini_batch(
                self.accelerator.unwrap_model(model).config,
                rows=batch_size or input_ids.size(0),
                seq_len=input_ids.size(1),
                device=input_ids.device,
                grad=torch.is_grad_enabled(),
                checkpointing=self.args.gradient_checkpointing,
                offload=self._fastgrpo_offload is not None,
            )
            # Logged: a mini-batch that changes between steps changes every compiled call's shape.
            mode = "train" if self.model.training else "eval"
            name = "fastgrpo/mini_batch_" + ("update" if torch.is_grad_enabled() else "scoring")
            self._metrics[mode][name].append(float(rows))
        # The entropy is extra work in the op and its backward: only compute it when TRL asks for it.
        for head in self._fastgrpo_heads:
            head.with_entropy = compute_entropy
            head.prompt_columns = input_ids.size(1) - logits_to_keep
        pad = self._bucket_padding(input_ids, kwargs, rows if isinstance(rows, int) else None)
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=self._pad_id())
            attention_mask = torch.nn.functional.pad(attention_mask, (0, pad), value=0)
        result = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep + pad, batch_size=rows, compute_entropy=compute_entropy,
            **kwargs
        )
        if pad:  # the appended columns' log-probs and entropies go
            result = tuple(t[:, :logits_to_keep] if isinstance(t, torch.Tensor) and t.dim() >= 2
                           and t.size(1) == logits_to_keep + pad else t for t in result)
        sampled = getattr(self, "_fastgrpo_sampled", None)
        if sampled is not None and torch.is_grad_enabled():
            self._log_sampler_agreement(result[0], sampled)
        return result
