"""LoRA linears over a bitsandbytes 4-bit base (QLoRA) while the rollout engine decodes: `fastgrpo::nf4_lora_linear`
on the live packed weight and the live adapters, no dequantized copy.

`FourBitLoRALinear` stands in for one PEFT LoRA linear (`MergedAdapters` swaps it in for the call), a
`FourBitGroup` for sibling ones reading one input (an attention's q, k and v; an MLP's gate and up: one launch a group,
`group_obstacle` says why not); `four_bit_obstacle` says why a layer cannot (left to PEFT's forward, with the reason),
`adapter_obstacle` why a layer's adapters are not plain LoRA. `lora_factors` reads a PEFT layer's active adapters as
one (A, B, scaling); `nf4_lora_linear_from_module` runs a PEFT LoRA layer over a `Linear4bit` through the kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from fastgrpo.integrations.generation.joined import joined_slices
from fastgrpo.kernels.nf4_lora_linear import GROUP_ROWS, MAX_RANK, group_table, kernel_obstacle, nf4_lora_linear, \
    quant_state_args

# Sibling projections read by one input, in the order HF modules call them: a group of 4-bit layers decodes as one
# grouped launch (`FourBitGroup`).
GROUP_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def active_adapters(layer: nn.Module) -> list[str]:
    """The names of a PEFT LoRA layer's active adapters that it holds."""
    return [name for name in layer.active_adapters if name in layer.lora_A]


def adapter_obstacle(layer: nn.Module) -> str | None:
    """Why a PEFT LoRA layer's active adapters are not plain LoRA, a weight sum (None: they are)."""
    for name in active_adapters(layer):
        if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name):
            return "a LoRA variant (DoRA, ...) whose merge is not a weight sum"
        if layer.lora_B[name].bias is not None:
            return "LoRA with a bias"
    return None


def lora_factors(layer) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """(A, B, scaling) of a PEFT LoRA layer's active adapters as one adapter: (None, None, 1.0) when adapters are
    disabled, merged or none is active; one adapter as it is; several joined, A's stacked along r and each B scaled
    by its adapter's scaling (scaling 1.0). Dropout is not applied (sampling runs adapters as in eval mode).
    Variants (DoRA, ...), LoRA biases and mixed-adapter batches are refused."""
    if layer.disable_adapters or layer.merged:
        return None, None, 1.0
    why = adapter_obstacle(layer)
    if why is not None:
        raise ValueError(f"{why}: only plain LoRA adapters run in nf4_lora_linear")
    factors = [(layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))
               for name in active_adapters(layer)]
    if not factors:
        return None, None, 1.0
    if len(factors) == 1:
        return factors[0]
    dtype = torch.promote_types(factors[0][0].dtype, factors[0][1].dtype)
    a = torch.cat([f[0].to(dtype) for f in factors])
    b = torch.cat([f[1].to(dtype) * f[2] for f in factors], dim=1)
    return a, b, 1.0


def nf4_lora_linear_from_module(x: torch.Tensor, layer) -> torch.Tensor:
    """What PEFT's LoRA `layer` over a bitsandbytes `Linear4bit` computes for x (its active adapters, their scaling,
    the base's bias), through `nf4_lora_linear`, in the base's compute dtype (x's dtype if unset) and returned in
    x's dtype, as bitsandbytes does. A bare `Linear4bit` runs without LoRA."""
    import bitsandbytes as bnb

    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    if not isinstance(base, bnb.nn.Linear4bit):
        raise TypeError(f"{type(base).__name__} is not a bitsandbytes Linear4bit")
    a, b, scaling = lora_factors(layer) if base is not layer else (None, None, 1.0)
    dtype = getattr(base, "compute_dtype", None) or x.dtype
    weight = base.weight
    out = nf4_lora_linear(x.to(dtype), weight.data, **quant_state_args(weight.quant_state), lora_a=a, lora_b=b,
                          scaling=scaling, bias=base.bias)
    return out.to(x.dtype)


def four_bit_obstacle(layer: nn.Module) -> str | None:
    """Why this LoRA layer over a bitsandbytes-quantized base cannot decode through `fastgrpo::nf4_lora_linear`
    (None: it can): an 8-bit base, a weight in bitsandbytes' CPU layout, a call outside the kernel's domain."""
    weight = layer.base_layer.weight
    copy = "merge_lora='all' merges it into a bf16 copy"
    if type(weight).__name__ != "Params4bit":
        return f"8-bit quantized base ({copy})"
    state = weight.quant_state
    if getattr(state, "quant_type", None) not in ("nf4", "fp4"):
        return "4-bit base without an nf4 or fp4 quantization state"
    if getattr(state, "packing_format_for_cpu", False):
        return "4-bit weight repacked for bitsandbytes' CPU kernel (set support_avx512bf16_for_cpu = False on each " \
               "Linear4bit)"
    rank = sum(layer.lora_A[name].weight.shape[0] for name in active_adapters(layer))
    why = kernel_obstacle(weight, int(state.blocksize), layer.in_features, rank)
    return None if why is None else f"4-bit base not taken by the 4-bit kernel ({why}; {copy})"


# Inputs of more rows than this (a prefill) skip the 4-bit kernel for PEFT's forward (bitsandbytes dequantizes the
# weight once, then one GEMM): the kernel reads the packed weight again for every 64 rows. By bytes moved the two
# meet near 576 rows; not timed.
FOUR_BIT_KERNEL_MAX_ROWS = 256


class FourBitLoRALinear(nn.Module):
    """What decodes in place of a PEFT LoRA linear over a bitsandbytes 4-bit (nf4 or fp4) base while
    `MergedAdapters.swapped()` runs: `fastgrpo::nf4_lora_linear` on the live packed weight, its quantization state,
    the base's bias and the live LoRA factors (fp32 factors cast in the kernel), in the base's compute dtype, the
    result in x's dtype (PEFT's maths with one rounding). One active adapter is read as it is; several are joined
    (`lora_factors`) into factors held here, refreshed at every call (`refresh`). Inputs of more than
    FOUR_BIT_KERNEL_MAX_ROWS rows run the LoRA layer's own forward. Sampling only: no autograd."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        base = layer.base_layer
        self.__dict__["layer"] = layer  # not a submodule: the LoRA layer is out of the model while this stands in
        self.in_features = layer.in_features
        self.compute_dtype = getattr(base, "compute_dtype", None)
        self.packed = base.weight.detach()
        self.quant = quant_state_args(base.weight.quant_state)
        self.bias = None if base.bias is None else base.bias.detach()
        self.joined = len(active_adapters(layer)) > 1
        a, b, self.scaling = lora_factors(layer)
        self.lora_a, self.lora_b = a.detach(), b.detach()

    @torch.no_grad()
    def refresh(self) -> None:
        """Joined factors take the adapters' current values (one adapter is read live: nothing to do)."""
        if self.joined:
            a, b, _ = lora_factors(self.layer)
            self.lora_a.copy_(a)
            self.lora_b.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > FOUR_BIT_KERNEL_MAX_ROWS * self.in_features:
            return self.layer(x)
        out = nf4_lora_linear(x.to(self.compute_dtype or x.dtype), self.packed, **self.quant, lora_a=self.lora_a,
                              lora_b=self.lora_b, scaling=self.scaling, bias=self.bias)
        return out.to(x.dtype)


def four_bit_key(layer: nn.Module) -> tuple:
    """What a `FourBitLoRALinear` holds of a layer: when any of it is another tensor, or a scaling changed, it is
    built again (and graphs that captured the old one are stale)."""
    base = layer.base_layer
    names = active_adapters(layer)
    tensors = [base.weight, base.bias] + [f[n].weight for n in names for f in (layer.lora_A, layer.lora_B)]
    return (id(base.weight.quant_state), tuple(None if t is None else t.data_ptr() for t in tensors),
            tuple(float(layer.scaling[n]) for n in names))


def group_obstacle(members: list[FourBitLoRALinear]) -> str | None:
    """Why sibling `FourBitLoRALinear`s reading one input cannot decode as one grouped launch (None: they can)."""
    first = members[0]
    quant = [m.quant for m in members]
    rows = [q["shape"][0] for q in quant]
    ranks = {0 if m.lora_a is None else m.lora_a.shape[0] for m in members}
    if len({(m.in_features, m.compute_dtype, m.packed.device) for m in members}) != 1:
        return "the layers differ in input width, compute dtype or device"
    if len({(q["blocksize"], q["code_values"], "nested_absmax" in q) for q in quant}) != 1:
        return "the layers differ in quantization (blocksize, code, double quantization)"
    if "nested_absmax" in quant[0] and any(
            q["nested_blocksize"] != quant[0]["nested_blocksize"] or not torch.equal(q["nested_code"],
                                                                                     quant[0]["nested_code"])
            for q in quant):
        return "the layers' double quantizations differ"
    if any(r % GROUP_ROWS for r in rows[:-1]):
        return f"a layer's output width is not a multiple of {GROUP_ROWS}"
    if "nested_absmax" in quant[0] and any(r * first.in_features // quant[0]["blocksize"]
                                           % quant[0]["nested_blocksize"] for r in rows[:-1]):
        return "a layer's blocks are not whole nested blocks"
    if len(ranks) != 1 or max(ranks) > MAX_RANK or len({m.bias is None for m in members}) != 1:
        return "the layers' LoRA ranks differ (or exceed the kernel's), or some have a bias and some not"
    if any(m.packed.data_ptr() % 16 for m in members):
        return "a packed weight does not start 16-byte aligned"
    return None


class FourBitGroup(nn.Module):
    """Sibling `FourBitLoRALinear`s that read one input (`group_obstacle` None), as one grouped
    `fastgrpo::nf4_lora_linear` launch: each weight's packed bytes where they lie (`group_table`), their block
    statistics and biases concatenated once (frozen bases), the adapters' A and B factors copied in at every call
    (`refresh`; B scaled by its adapter's scaling where the members' scalings differ). Its `slices()` stand in for
    the members (joined.py's hand-over). Inputs of more than FOUR_BIT_KERNEL_MAX_ROWS rows run each member alone."""

    def __init__(self, members: list[FourBitLoRALinear]):
        super().__init__()
        self.members = members  # (a plain list: each is its layer's, not this module's)
        quant = [m.quant for m in members]
        rows = [q["shape"][0] for q in quant]
        self.bounds = [0]
        for r in rows:
            self.bounds.append(self.bounds[-1] + r)
        first = members[0]
        self.in_features, self.compute_dtype = first.in_features, first.compute_dtype
        self.packed = [m.packed.reshape(-1) for m in members]
        self.quant = dict(shape=(self.bounds[-1], first.in_features), absmax=torch.cat([q["absmax"] for q in quant]),
                          code=quant[0]["code"], blocksize=quant[0]["blocksize"], code_values=quant[0]["code_values"],
                          group_table=group_table(self.packed, rows, first.in_features))
        if "nested_absmax" in quant[0]:
            self.quant.update(nested_absmax=torch.cat([q["nested_absmax"] for q in quant]),
                              nested_code=quant[0]["nested_code"], nested_blocksize=quant[0]["nested_blocksize"],
                              offset=torch.stack([q["offset"].reshape(()) for q in quant]))
        self.bias = None if first.bias is None else torch.cat([m.bias for m in members])
        self.lora_a = self.lora_b = None
        self.scaling = 1.0
        if first.lora_a is not None:
            dtype = torch.promote_types(first.lora_a.dtype, first.lora_b.dtype)
            self.lora_a = torch.cat([m.lora_a.to(dtype) for m in members])
            self.lora_b = torch.cat([m.lora_b.to(dtype) for m in members])
            scalings = {m.scaling for m in members}
            # one scaling passed to the kernel where the members share it (their own launches' maths); else folded
            # into each member's B
            self.scaling = scalings.pop() if len(scalings) == 1 else None
            self.refresh()
        self.held_input: torch.Tensor | None = None
        self.held_product: torch.Tensor | None = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The adapters' current factors into the group's copies."""
        if self.lora_a is None:
            return
        r = self.lora_a.shape[0] // len(self.members)
        for i, m in enumerate(self.members):
            m.refresh()
            self.lora_a[i * r:(i + 1) * r].copy_(m.lora_a)
            b = m.lora_b if self.scaling is not None else m.lora_b * m.scaling
            self.lora_b[self.bounds[i]:self.bounds[i + 1]].copy_(b)

    def product(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.numel() > FOUR_BIT_KERNEL_MAX_ROWS * self.in_features:
            return None
        out = nf4_lora_linear(x.to(self.compute_dtype or x.dtype), self.packed, **self.quant, lora_a=self.lora_a,
                              lora_b=self.lora_b, scaling=1.0 if self.scaling is None else self.scaling,
                              bias=self.bias)
        return out.to(x.dtype)

    def alone(self, x: torch.Tensor, index: int) -> torch.Tensor:
        return self.members[index](x)

    def slices(self) -> list:
        return joined_slices(self)
