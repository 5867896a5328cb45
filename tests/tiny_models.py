"""The architecture matrix the pass tests cover, on tiny random-init models (no downloads)."""
from fastgrpo.compiler.tiny import tiny_model

VOCAB = 128
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2"]


def count_modules(model, name_part: str) -> int:
    return sum(1 for m in model.modules() if name_part in type(m).__name__)


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


__all__ = ["tiny_model", "VOCAB", "ARCHS", "count_modules", "grads"]
