"""The trainer's live LoRA adapter inside vLLM: registered once from memory, refreshed by copying, never stale.

The live PEFT adapter is registered with vLLM's LoRA manager as a `LoRAModel` built from in-memory tensors,
pinned in its slot. `LiveAdapter.refresh()` copies the live A and B (B pre-scaled by PEFT's `scaling`, as vLLM
stores it) into vLLM's registered adapter and into its active slot, then resets the prefix cache (cached KV was
computed with the old adapter): a copy of the adapter, no RPC, disk, merge or reload of the base.

`AdapterVersion` counts changes to the live adapter; `LiveAdapter.check()` raises `StaleAdapterError` unless vLLM
holds the trainer's current version, in an active slot, unmerged. Generation never falls back to the base model.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fastgrpo.integrations.vllm.checks import lora_layers, peft_helper

ADAPTER_NAME = "fastgrpo-live-adapter"
ADAPTER_ID = 1
# vLLM requires a path on every LoRARequest; the adapter is registered from memory before any request
# names it, so vLLM never reads this path.
IN_MEMORY_ADAPTER_PATH = "/fastgrpo/in-memory-adapter"


class StaleAdapterError(RuntimeError):
    """vLLM does not hold the trainer's current adapter (older version, evicted, or merged into the base)."""


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


class LiveAdapter:
    """The active LoRA adapter of the PEFT `model`, served by the vLLM engine `llm` (whose in-process
    `model_runner` holds the LoRA manager). Registers it on construction."""

    def __init__(self, model: nn.Module, causal_lm: nn.Module, lora_config, llm, model_runner):
        from vllm.lora.request import LoRARequest

        self.model = model
        self.lora_config = lora_config
        self.llm = llm
        self.model_runner = model_runner
        self.name = name = model.active_adapter
        self.layers = lora_layers(causal_lm, name)
        self.version = AdapterVersion(
            [t for layer in self.layers.values() for t in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
        )
        self.loaded_version: int | None = None
        self.loaded_addresses: tuple[int, ...] = ()
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_ADAPTER_PATH)
        self.register()

    @property
    def manager(self):
        """vLLM's LoRA adapter manager."""
        return self.model_runner.lora_manager._adapter_manager

    def register(self) -> None:
        """Register the live adapter with vLLM's LoRA manager from memory, pin it, and copy it in."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = self.manager
        adapter = self.name
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        # Checkpoint-style names (what PEFT's save_pretrained writes), vLLM's parser maps them to its modules.
        tensors, live_by_vllm_name = {}, {}
        self.check_servable()
        for name, layer in self.layers.items():
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
            peft_helper(self.lora_config),
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
        self.loaded_version = None
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> bool:
        """Copy the live adapter into vLLM if it changed since the last refresh. Returns whether it copied.

        The live A and B (B times PEFT's scaling, as vLLM stores it) go into vLLM's registered copy of the
        adapter (what it restores after an eviction) and into its active slot; then the prefix cache is reset.
        """
        manager = self.manager
        registered = ADAPTER_ID in manager.list_adapters() and ADAPTER_ID in manager.lora_index_to_id
        version, addresses = self.version.value, self.version.addresses()
        if not force and registered and version == self.loaded_version and addresses == self.loaded_addresses:
            return False
        if not registered:
            self.register()
            return True
        self.check_servable()
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
        self.loaded_version, self.loaded_addresses = version, addresses
        return True

    def check_servable(self) -> None:
        """Raise StaleAdapterError if the model's active adapter is another one, or this one is merged."""
        if self.model.active_adapter != self.name:
            raise StaleAdapterError(
                f"the model's active adapter is {self.model.active_adapter!r}, but this engine serves "
                f"{self.name!r}; start an engine for the other adapter"
            )
        merged = [name for name, layer in self.layers.items() if layer.merged]
        if merged:
            raise StaleAdapterError(
                f"the adapter is merged into the shared base weights ({merged[0]}, ...): vLLM would apply it twice. "
                "Unmerge it (model.unmerge_adapter()) before generating."
            )

    def check(self) -> None:
        """Raise StaleAdapterError unless vLLM holds the trainer's current adapter in an active slot."""
        self.check_servable()
        manager = self.manager
        if ADAPTER_ID not in manager.list_adapters() or ADAPTER_ID not in manager.lora_index_to_id:
            raise StaleAdapterError(
                "vLLM no longer holds the training adapter (it was removed or evicted); call refresh_adapter()"
            )
        version = self.version.value
        if version != self.loaded_version or self.version.addresses() != self.loaded_addresses:
            raise StaleAdapterError(
                f"vLLM holds adapter version {self.loaded_version} but the trainer's is {version}: the adapter "
                "changed (an optimizer step?) after the last refresh_adapter(). Refresh before generating."
            )

    def close(self) -> None:
        """Stop counting optimizer steps."""
        self.version.close()
