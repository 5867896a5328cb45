"""How packed rows reach each attention layer: variable-length segments where the layer can take them, the packed
mask otherwise (fastgrpo.integrations.packing builds both).

`use_mask_dispatched_attention` registers, in transformers' attention and mask registries, an implementation that
decides per call: a call carrying the segments' bounds (VARLEN_KWARGS) whose layer allows them runs
`fastgrpo.kernels.packed_attention.packed_attention` (flash's variable-length kernel on CUDA, with the layer's
sliding window where it has one); a call whose mask is a packed BlockMask runs flex_attention; any other runs the
model's own attention. `segments_everywhere` says, from the model alone, whether every layer will take the segments,
so that a packed call can carry no mask at all.
"""
from __future__ import annotations

import inspect

import torch

from fastgrpo.integrations.windows import UNKNOWN_WINDOW, layer_window, model_window
from fastgrpo.kernels.packed_attention import FLASH_TAKES_WINDOW, compute_dtype, flash_refusal, packed_attention


PACKED_ATTENTION_PREFIX = "fastgrpo_packed+"
# What the packed call hands every attention call for variable-length attention: transformers' FlashAttentionKwargs,
# which its decoders pass down, and the gather of the keys' copy (PackPlan.kv_index), which they pass on as well.
# `fastgrpo_mask_free`: the call carries no mask (a [1, 1, 1, 1] stand-in that transformers passes on as it is), so
# every layer must take the segments.
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "fastgrpo_kv_index",
                 "fastgrpo_mask_free")


def varlen_refusal(config, dtype: torch.dtype, device: torch.device, training: bool) -> str | None:
    """Why no attention layer of this model can take packed rows as variable-length segments (None: they can, those
    with a sliding window too where `flash_refusal` allows a window; the others take the mask)."""
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped (the variable-length kernels have no softcap)"
    if training and getattr(text, "attention_dropout", 0.0):
        return "attention dropout is on"
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if device.type == "cuda":
        return flash_refusal(device, dtype, head_dim, heads, getattr(text, "num_key_value_heads", None) or heads)
    return None


def _window_of_call(module, longest, kwargs) -> int | None:
    """The call's sliding window where it cuts into the longest key segment (None: no window, or one that spans
    every segment; UNKNOWN_WINDOW passes through)."""
    window = layer_window(module, kwargs)
    return window if window is not None and (window == UNKNOWN_WINDOW or longest > window) else None


def _layer_takes_varlen(module, query, key, window, kwargs) -> bool:
    """Whether this attention call (with `_window_of_call`'s window) can run as causal variable-length segments;
    otherwise it takes the mask. Mirrors varlen_refusal per layer, plus what only the call shows (its window, sinks)."""
    causal = kwargs.get("is_causal")
    return ((getattr(module, "is_causal", True) if causal is None else causal) and not kwargs.get("dropout")
            and window != UNKNOWN_WINDOW
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and (not query.is_cuda or flash_refusal(query.device, compute_dtype(query), query.shape[-1], query.shape[1],
                                                    key.shape[1], window) is None))


def segments_everywhere(config, decoder: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                        training: bool) -> bool:
    """Whether every attention layer takes packed rows as variable-length segments, as `_layer_takes_varlen` will
    find in each call: `varlen_refusal` has no reason, sliding-window layers have a kernel that takes their window
    (flash's, where this torch's takes one; every CPU path), and no attention module is bidirectional or has
    attention sinks. Then a packed call needs no mask."""
    if varlen_refusal(config, dtype, device, training) is not None:
        return False
    if device.type == "cuda" and not FLASH_TAKES_WINDOW and model_window(config) is not None:
        return False
    return not any(getattr(m, "is_causal", True) is False or isinstance(getattr(m, "sinks", None), torch.Tensor)
                   for m in decoder.modules())


def use_mask_dispatched_attention(config) -> None:
    """Make the model's attention choose per call: variable-length attention over the packed rows when the call
    carries their bounds (VARLEN_KWARGS) and the layer allows it, flex_attention when its mask is a packed
    BlockMask, and the model's own attention (and mask format) otherwise.

    The choice must follow the call, not a setting around it: non-reentrant checkpointing re-runs each
    layer's forward during backward, after any context around the forward has exited, and that recompute
    sees the same BlockMask the forward saw. Registered once per own implementation under
    "fastgrpo_packed+<own>" in transformers' attention and mask registries; idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    text = config.get_text_config()
    own = text._attn_implementation
    if own is None or own.startswith(PACKED_ATTENTION_PREFIX):
        return
    name = PACKED_ATTENTION_PREFIX + own
    if name not in ALL_ATTENTION_FUNCTIONS:
        from torch.nn.attention.flex_attention import BlockMask
        from transformers.integrations.flex_attention import flex_attention_forward

        def dispatch(module, query, key, value, attention_mask, *args, **kwargs):
            varlen = {kwarg: kwargs.pop(kwarg, None) for kwarg in VARLEN_KWARGS}
            bounds = varlen["cu_seq_lens_q"]
            window = None if bounds is None else _window_of_call(module, varlen["max_length_k"], kwargs)
            takes_segments = bounds is not None and _layer_takes_varlen(module, query, key, window, kwargs)
            if varlen["fastgrpo_mask_free"] and not takes_segments:
                raise RuntimeError(
                    f"fastgrpo: a packed call without a mask reached an attention layer ({type(module).__name__}) "
                    "that cannot run its rows as variable-length segments; packed_dispatch.segments_everywhere missed "
                    "what this layer's call shows. Set fastgrpo_packing=False to run such batches padded")
            if takes_segments:
                # [1, heads, T, D] -> [T, heads, D] and back as [1, T, heads, D], the layout attention functions return.
                q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
                if (gather := varlen["fastgrpo_kv_index"]) is not None:
                    k, v = k.index_select(0, gather), v.index_select(0, gather)
                out = packed_attention(q, k, v, bounds, varlen["max_length_q"], kwargs.get("scaling"), window,
                                       varlen["cu_seq_lens_k"], varlen["max_length_k"])
                return out.unsqueeze(0), None
            if isinstance(attention_mask, BlockMask):
                # A packed batch of fewer than 128 tokens would get inductor's flex-decoding kernel (an inference
                # kernel for short queries), which found no valid config for these masks on an H200.
                kwargs["kernel_options"] = {"FORCE_USE_FLEX_ATTENTION": True, **(kwargs.get("kernel_options") or {})}
                attention = flex_attention_forward
            elif own == "eager":  # not in the registry: each modeling file has its own eager_attention_forward
                attention = inspect.getmodule(type(module)).eager_attention_forward
            else:
                attention = ALL_ATTENTION_FUNCTIONS[own]
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        AttentionInterface.register(name, dispatch)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[own])
    config._attn_implementation = name  # sets the text sub-config too
