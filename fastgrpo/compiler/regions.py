"""Compile a model's repeated blocks (its decoder layers) one region each, like Unsloth does.

Compiling a whole 28-layer model traces and compiles 28 copies of the same layer; the
layers share one code object, so compiling each one with the same backend compiles the
layer once and reuses it for all of them (and after one dynamic-shape recompile, for
every sequence length). The blocks are found structurally - the largest `nn.ModuleList`
whose children all have one type - never by model-specific names.

A layer called with a KV cache (generation) runs uncompiled: its cache update takes the
layer's index as a graph constant, so every layer would compile its own graph and the
shared code object would hit Dynamo's recompile limit after 8 layers. Training and
log-prob passes carry no cache and stay compiled; a decode step compiled as a whole
(`torch.compile` around the model, CUDA graphs) still traces through the layers. A forward that
computes gradients with a cache (HF's `use_cache` left on outside gradient checkpointing) would
lose the compiled layers silently: that warns once, naming the fix.

Dynamo guards on whether each tensor input requires grad. Under `no_grad` that flag changes nothing a
layer computes, yet it differs between layer 0 (whose input `enable_input_require_grads`' hook marks,
even in a no-grad pass) and the layers after it: so a no-grad call detaches its tensor inputs first, and
one no-grad graph serves every layer (the scoring passes of GRPO's old policy and reference).

Under DistributedDataParallel the compiled calls run outside Dynamo's DDPOptimizer (`unsplit_by_ddp`).

A block's float attributes (RMSNorm's eps, attention's scaling) are the same in every layer, yet a region compiled
with dynamic shapes would trace them as symbolic inputs: AOTAutograd then specializes them at the custom ops that
take a float, and Dynamo restarts the frame's compile (a second trace, and an AOTAutograd cache miss in every
process). The compiled calls trace with Dynamo's `specialize_float` on: floats become constants, guarded by value.
"""
import contextlib
import warnings

import torch
from torch import nn
from torch._dynamo import config as dynamo_config
from torch.nn.parallel import DistributedDataParallel

from fastgrpo.compiler.backend import fastgrpo_backend
from fastgrpo.errors import UserError

# Keyword arguments through which HF decoder layers receive a KV cache.
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            if len({type(child) for child in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


@contextlib.contextmanager
def unsplit_by_ddp():
    """Compile the graphs traced inside this context whole, even inside DDP's forward.

    There Dynamo's DDPOptimizer would cut each graph at DDP's gradient-bucket boundaries (so that all-reduces
    start during the backward) and compile the pieces one by one: a pattern that spans a cut is not matched
    (on 2 H200s: every layer's gated MLP unmatched, and 2-GPU scaling at 1024 completions 0.75). A
    compiled decoder layer needs no cut: its backward ends before the previous layer's starts, so DDP's hooks
    fire layer by layer anyway. A whole compiled decoder all-reduces after its backward instead (LoRA
    gradients: well under a millisecond on NVLink). Only Dynamo reads the active DDP module.
    """
    active = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = None
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = active


def _without_grad_flags(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Tensor inputs that require grad, detached (for no-grad calls: see the module docstring)."""
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values())):
        return args, kwargs
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v  # noqa: E731
    return tuple(map(detach, args)), {key: detach(value) for key, value in kwargs.items()}


def _eager_with_cache(block: nn.Module, compiled):
    """The block's compiled call (unsplit by DDP, floats specialized), except for calls that carry a KV cache;
    no-grad calls with their inputs detached (see the module docstring)."""

    def call(*args, **kwargs):
        if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
            if torch.is_grad_enabled():
                warnings.warn(
                    "fastgrpo: decoder layers called with a KV cache run uncompiled (the cache update would "
                    "compile one graph per layer); this forward computes gradients - pass use_cache=False to "
                    "keep the compiled layers.",
                    stacklevel=2,
                )
            return block._call_impl(*args, **kwargs)
        if not torch.is_grad_enabled():
            args, kwargs = _without_grad_flags(args, kwargs)
        specialize_float, dynamo_config.specialize_float = dynamo_config.specialize_float, True
        try:
            with unsplit_by_ddp():
                return compiled(*args, **kwargs)
        finally:
            dynamo_config.specialize_float = specialize_float

    return call


def _cudagraph_trees_obstacle(options: dict | None) -> str | None:
    """Why inductor's CUDA graphs cannot run with offloaded checkpointing, where they are asked for (the backend's
    `inductor_config`, or inductor's global `triton.cudagraphs`); None where they are not.

    Measured: H200, torch 2.11, Qwen2.5-0.5B and 1.5B GRPO steps (`bench/grpo_step.py` with
    `inductor_config={"triton.cudagraphs": True}`): every step raised "Detected 3 tensor(s) in the cudagraph pool not
    tracked as outputs" after "Unable to hit fast path of CUDAGraphs because of pending, uninvoked backwards"."""
    from torch._inductor import config as inductor_config

    asked = (options or {}).get("inductor_config", {}).get("triton.cudagraphs")
    if asked is None:
        asked = inductor_config.triton.cudagraphs
    if not asked:
        return None
    return ("inductor's CUDA graphs (triton.cudagraphs, torch.compile's mode='reduce-overhead') do not run "
            "offloaded checkpointing's forward / recompute / backward order (on torch 2.11 every step raised "
            "'tensors in the cudagraph pool not tracked as outputs'); fastgrpo replays its own ops as CUDA graphs "
            "already. Drop that setting, or turn the offloading off (offload_checkpointing=False; in the trainer "
            "fastgrpo_offload_checkpointing=False)")


def compile_repeated_blocks(
    model: nn.Module, options: dict | None = None, dynamic: bool | None = None, offload_checkpointing: bool = False
) -> int:
    """`torch.compile(block, backend="fastgrpo")` on every decoder layer, in place; returns how many.

    `offload_checkpointing=True` also checkpoints every layer with its input held in host memory
    (`fastgrpo.compiler.offload.enable_offloaded_checkpointing`; `offload_handle(model)` returns its
    handle), instead of HF's `gradient_checkpointing_enable()`, whose flag then toggles the offloading.
    Works on PEFT models. Raises if the model has no repeated blocks (compile the whole model instead), if
    they are compiled already (with options that may differ), or if offloading is asked for together with inductor's
    CUDA graphs (which do not run it)."""
    blocks = repeated_blocks(model)
    if blocks is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; "
            f"use torch.compile(model, backend='fastgrpo') on the whole model instead"
        )
    if any(getattr(block, "_fastgrpo_compiled", False) for block in blocks):
        raise RuntimeError(f"the repeated blocks of {type(model).__name__} are compiled already")
    if offload_checkpointing and (obstacle := _cudagraph_trees_obstacle(options)):
        raise UserError(f"fastgrpo.compile_repeated_blocks: {obstacle}")
    for block in blocks:
        # The function itself, not the name: works without the package's entry point installed.
        block.compile(backend=fastgrpo_backend, options=options, dynamic=dynamic)
        block._compiled_call_impl = _eager_with_cache(block, block._compiled_call_impl)
        block._fastgrpo_compiled = True
    if offload_checkpointing:
        from fastgrpo.compiler.offload import enable_offloaded_checkpointing  # it imports repeated_blocks from here

        enable_offloaded_checkpointing(model)
    return len(blocks)
