"""Which decoder layers slide, and how far: read from a model's config as transformers' mask builders read it.

Most models hand their attention function the window as `sliding_window=`; some (PhiMoE, Doge) build it into the mask
alone. Whatever attends without that mask (packed segments, the rollout engine's cache) takes the window from here
where the call names none.
"""
from __future__ import annotations

# A layer whose sliding window neither its call nor the config tells (`layer_window`).
UNKNOWN_WINDOW = -1


def layer_kinds(config) -> list[str]:
    """Attention kind of every decoder layer, read from the text config."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
        kinds = ["sliding_attention" if sliding else "full_attention"] * text.num_hidden_layers
    return list(kinds)


def model_window(config) -> int | None:
    """The window of the model's sliding-window layers (None: no layer slides)."""
    window = getattr(config.get_text_config(), "sliding_window", None)
    return window if window is not None and "sliding_attention" in layer_kinds(config) else None


def layer_window(module, kwargs) -> int | None:
    """The sliding window an attention module's call applies: the call's `sliding_window` argument where the model
    passes one; otherwise the one the model's mask gives this layer (None: no window). The layer index is read only
    where the model has layers of both kinds (a compiled layer function shared by every layer then guards on it);
    UNKNOWN_WINDOW where it has and the module names none."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    config = getattr(module, "config", None)
    window = model_window(config) if hasattr(config, "get_text_config") else None
    if window is None:
        return None
    kinds = layer_kinds(config)
    if "full_attention" not in kinds:
        return window
    index = getattr(module, "layer_idx", None)
    if index is None or not 0 <= index < len(kinds):
        return UNKNOWN_WINDOW
    return window if kinds[index] == "sliding_attention" else None
