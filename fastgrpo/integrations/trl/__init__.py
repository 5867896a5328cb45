"""fastgrpo's drop-in `GRPOTrainer` and `GRPOConfig` for TRL.

Turn it on in an existing TRL script with one line, before TRL's classes are imported:

    import fastgrpo.integrations.trl as F; F.patch_trl()
    from trl import GRPOConfig, GRPOTrainer      # now fastgrpo's subclasses

or import the classes from here. They subclass TRL's: TRL's generation, rewards, advantages and loss maths (loss
types grpo, dapo, dr_grpo, bnpo, ...; importance sampling; clipping; KL) run unchanged. What changes:

- Per-token log-probs (policy, old policy, reference) come from the decoder's hidden states through
  `fastgrpo::selective_logprob`, only at completion positions: no [tokens x vocab] logits tensor is ever made
  (`logprob_head.py`, replacing the fused LM head TRL installs).
- The decoder (for PEFT models the base model's, so adapters can still be switched off) runs through
  `torch.compile(..., backend="fastgrpo")`, each decoder layer one region.
- Rows go through the model in mini-batches sized from free memory, the log-prob op on bounded token chunks
  (`sizing.py`).
- Without vLLM, completions are sampled by `fastgrpo.integrations.generation.EmbeddedGenerator` from the training
  weights; its log-probs go back to TRL, and the share of completion tokens whose trainer/sampler importance ratio
  lies outside [0.9, 1.1] is logged every step as `sampling/ratio_outside_0.9_1.1` (as with vLLM).
- With `use_vllm=True, vllm_mode="colocate"` and a LoRA model, vLLM runs in this process on the training model's own
  base weights (`vllm_swap.py`, `fastgrpo.integrations.vllm`).
- Defaults: automatic mixed precision (`fastgrpo.integrations.precision`), `top_k` -1/None read as 0 (no top-k),
  `auto_find_batch_size=True` refused (`config.py`).

One concern a module: `config.py`, `sizing.py`, `logprob_head.py`, `vllm_swap.py`, `hooks.py`, `trainer.py`,
`patch.py`.
"""
from fastgrpo.integrations.trl.config import GRPOConfig
from fastgrpo.integrations.trl.hooks import (
    FreezeLongLivedObjects,
    keep_bnb_4bit_on_its_autograd_path,
    keep_one_input_require_grads_hook,
)
from fastgrpo.integrations.trl.logprob_head import CompiledBackbone, LogprobHead
from fastgrpo.integrations.trl.patch import patch_trl, unpatch_trl
from fastgrpo.integrations.trl.sizing import (
    AUTO_MEMORY_FRACTION,
    CPU_LOGPROB_CHUNK,
    CPU_MINI_BATCH,
    MIN_LOGPROB_CHUNK,
    auto_logprob_chunk,
    auto_mini_batch,
)
from fastgrpo.integrations.trl.trainer import GRPOTrainer
from fastgrpo.integrations.trl.vllm_swap import shared_vllm_generation

__all__ = [
    "AUTO_MEMORY_FRACTION", "CPU_LOGPROB_CHUNK", "CPU_MINI_BATCH", "MIN_LOGPROB_CHUNK", "CompiledBackbone",
    "FreezeLongLivedObjects", "GRPOConfig", "GRPOTrainer", "LogprobHead", "auto_logprob_chunk", "auto_mini_batch",
    "keep_bnb_4bit_on_its_autograd_path", "keep_one_input_require_grads_hook", "patch_trl", "shared_vllm_generation",
    "unpatch_trl",
]
