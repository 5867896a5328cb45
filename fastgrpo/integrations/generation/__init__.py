"""GRPO rollouts from the training weights: the embedded generator and its decode engine.

- `generator.py`: `EmbeddedGenerator`, the trainer-facing class, and its fallbacks;
- `engine.py`: `RolloutEngine`, prefill + decode loop, compiled layers, CUDA graphs, finished rows dropping out;
- `kv.py`: the KV cache the engine owns and the attention function transformers calls with it;
- `adapters.py`: LoRA factors in the compute dtype while decoding;
- `sampling.py`: next-token sampling as `model.generate` samples.
"""
from fastgrpo.integrations.generation.generator import EmbeddedGenerator, GenerationFallbackWarning
from fastgrpo.integrations.generation.sampling import Sampling, sample_next_token

__all__ = ["EmbeddedGenerator", "GenerationFallbackWarning", "Sampling", "sample_next_token"]
