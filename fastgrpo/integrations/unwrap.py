"""The causal LM inside the wrappers that training puts around a model."""
from __future__ import annotations

from accelerate.utils import extract_model_from_parallel, is_peft_model
from torch import nn


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM in `model`: distributed (DDP, DeepSpeed, FSDP) and torch.compile wrappers
    removed, and for a PEFT model its base model, whose modules still hold the adapters."""
    model = extract_model_from_parallel(model, keep_torch_compile=False)
    return model.get_base_model() if is_peft_model(model) else model
