"""Mixture-of-experts layers in the rollout engine's captured decode step.

transformers dispatches an experts module's forward on `config._experts_implementation`. Its default, "grouped_mm",
is CUDA-graph safe in bf16, but with experts in any other dtype it takes a fallback op that reads the experts' token
offsets on the host (`offs.tolist()`), which a CUDA graph cannot capture (seen on an H200 with fp32 experts, compiled
layers or not). For such modules the engine's captured steps decode with "batched_mm" (each token's selected experts
gathered and multiplied: the same products, no host read) for the call.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

CAPTURABLE = "batched_mm"


def uncapturable_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules whose implementation would read the host inside a captured step."""
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) != "grouped_mm" or not hasattr(module, "has_gate"):
            continue
        weight = next(module.parameters(recurse=False), None)
        if weight is not None and weight.dtype != torch.bfloat16:
            found.append(module)
    return found


@contextlib.contextmanager
def capturable_experts(model: nn.Module, active: bool):
    """For the block, `uncapturable_experts` decode with "batched_mm" (their configs restored afterwards)."""
    configs = {id(m.config): m.config for m in uncapturable_experts(model)} if active else {}
    saved = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            _set(config, CAPTURABLE)
        yield
    finally:
        for key, config in configs.items():
            _set(config, saved[key])


def _set(config, implementation: str) -> None:
    """This config's implementation only (the public setter also rewrites its sub-configs')."""
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = implementation
    else:
        config._experts_implementation = implementation


def is_expert_lora(module: nn.Module) -> bool:
    """A PEFT LoRA on a module's parameter (`ParamWrapper`: what `target_modules` naming an MoE layer's fused experts,
    or `target_parameters`, gives): the parameter is W + B @ A while the wrapper's forward runs."""
    return isinstance(getattr(module, "parameter_name", None), str) and isinstance(
        getattr(module, "base_layer", None), nn.Module) and hasattr(module, "get_delta_weight")


def expert_lora_chain(layer: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """(the wrappers from `layer` inward, the module they wrap): PEFT nests one wrapper per targeted parameter."""
    chain = []
    while is_expert_lora(layer):
        chain.append(layer)
        layer = layer.base_layer
    return chain, layer


def expert_lora_obstacle(layer: nn.Module, shared: set[int] | None = None) -> str | None:
    """Why the chain from `layer` cannot merge into its module's parameters in place for a call (None: it can)."""
    chain, module = expert_lora_chain(layer)
    for wrapper in chain:
        param = getattr(module, wrapper.parameter_name, None)
        if not isinstance(param, torch.Tensor) or not param.is_floating_point():
            return f"LoRA on {type(module).__name__}.{wrapper.parameter_name}, not a floating-point parameter"
        if param.requires_grad or (shared is not None and param.data_ptr() in shared) or not param.is_contiguous():
            return f"LoRA on {type(module).__name__}.{wrapper.parameter_name}, a trained, shared or strided parameter"
    return None
