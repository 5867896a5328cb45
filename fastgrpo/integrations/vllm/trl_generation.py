"""TRL's colocate-mode generation on the shared engine. Importing this module imports TRL; the rest of
`fastgrpo.integrations.vllm` does not."""
from __future__ import annotations

import os

from trl.generation.vllm_generation import VLLMGeneration

from fastgrpo.integrations.vllm.engine import SharedVLLMEngine


class SharedVLLMGeneration(VLLMGeneration):
    """TRL's colocate-mode `VLLMGeneration` on a `SharedVLLMEngine`.

    TRL's `generate` runs unchanged (sampling parameters, structured outputs, log-prob extraction),
    on the engine's `GuardedLLM`. `sync_weights`, which TRL calls before generating whenever the
    training step changed, is the in-memory adapter refresh instead of TRL's merge, push of every
    parameter through `load_weights`, unmerge. Takes TRL's arguments plus `engine_options` (keyword
    arguments for `SharedVLLMEngine`: max_lora_rank, kv_cache_dtype, vllm.LLM extras).
    """

    def __init__(self, *args, engine_options: dict | None = None, **kwargs):
        self._engine_options = dict(engine_options or {})
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        from transformers import PreTrainedTokenizerBase

        if self.mode != "colocate":
            raise ValueError("SharedVLLMGeneration runs vLLM in the training process: vllm_mode must be 'colocate'")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "the shared vLLM engine holds the whole model on each process: use vllm_tensor_parallel_size=1"
            )
        if self.model_impl not in ("auto", "vllm"):
            raise ValueError(f"the shared vLLM engine needs vLLM's own model implementation, not {self.model_impl!r}")
        if not isinstance(self.processing_class, PreTrainedTokenizerBase):
            raise ValueError("the shared vLLM engine serves text models only (the processing class is not a tokenizer)")
        accelerator = self.accelerator
        options = dict(max_num_batched_tokens=4096, trust_remote_code=self.trust_remote_code)
        if accelerator.num_processes > 1:
            # As TRL's colocate mode: every rank runs its own engine inside the launched process group.
            from trl.trainer.utils import ensure_master_addr_port

            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            options["distributed_executor_backend"] = "external_launcher"
        options.update(self._engine_options)
        self.engine = SharedVLLMEngine(
            accelerator.unwrap_model(self.model),
            self.processing_class,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            seed=accelerator.process_index,
            **options,
        )
        self.llm = self.engine.front
        self.enable_sleep_mode = self.engine.enable_sleep_mode
        self._llm_weights_sleeping = False
        accelerator.wait_for_everyone()

    def sync_weights(self):
        """The adapter refresh (a no-op when the adapter did not change): no merge, no weight push."""
        self.engine.refresh_adapter()
        self._llm_weights_sleeping = False
