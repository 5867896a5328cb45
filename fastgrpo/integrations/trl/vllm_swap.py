"""Colocated vLLM on the training weights: TRL's `VLLMGeneration` swapped for fastgrpo's shared engine while TRL's
constructor runs."""
from __future__ import annotations

import contextlib
import warnings

from accelerate.utils import is_peft_model
from trl.trainer import grpo_trainer as trl_grpo_trainer

from fastgrpo.integrations.trl.config import GRPOConfig


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
