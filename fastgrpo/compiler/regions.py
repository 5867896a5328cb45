"""Compile a model's repeated blocks (its decoder layers) one region each, like Unsloth does.

Compiling a whole 28-layer model traces and compiles 28 copies of the same layer; the
layers share one code object, so compiling each one with the same backend compiles the
layer once and reuses it for all of them (and after one dynamic-shape recompile, for
every sequence length). The blocks are found structurally - the largest `nn.ModuleList`
whose children all have one type - never by model-specific names.
"""
from torch import nn

from fastgrpo.compiler.backend import fastgrpo_backend


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            if len({type(child) for child in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


def compile_repeated_blocks(model: nn.Module, options: dict | None = None, dynamic: bool | None = None) -> int:
    """`torch.compile(block, backend="fastgrpo")` on every decoder layer, in place; returns how many.
    Raises if the model has no repeated blocks (compile the whole model instead)."""
    blocks = repeated_blocks(model)
    if blocks is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; "
            f"use torch.compile(model, backend='fastgrpo') on the whole model instead"
        )
    for block in blocks:
        # The function itself, not the name: works without the package's entry point installed.
        block.compile(backend=fastgrpo_backend, options=options, dynamic=dynamic)
    return len(blocks)
