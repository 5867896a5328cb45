"""Architecture coverage of the fastgrpo backend: every causal LM of the installed transformers.

For every model_type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES this builds a tiny
random-init model (fp32, two layers - or one per layer kind for hybrid models, experts and
low-rank dimensions shrunk), compiles a GRPO-style completion log-prob function with
`backend="fastgrpo"` (inner="eager" by default: the passes are what is measured), runs forward
and backward and records, against the same model run eagerly:
  - matched sites per pattern against what the model contains, counted from the eager run
    (RMSNorm-like modules by class name, attention layers, gated MLPs and expert banks found
    by their weight shapes, one lm-head);
  - near misses with their reasons, graph breaks, and whether outputs and gradients equal eager.
A model whose graph breaks at data-dependent ops (MoE routing by .item() or nonzero()) is measured
again with Dynamo's capture flags, as the fusion report tells users to; its row says so.
Encoder-decoder models, models that cannot be built tiny and models with none of RMSNorm,
RoPE or a gated MLP are listed with the reason.

    python bench/coverage.py                       # full sweep -> docs/SUPPORT.md, docs/support.json
    python bench/coverage.py --archs llama,mixtral # a subset, printed (add --md/--json to write files)
    python bench/coverage.py --archs jetmoe --update  # re-measure these rows of docs/support.json, rewrite both

Nothing is cached: every run rebuilds and recompiles every model.
"""
import gc
import json
import logging
import multiprocessing
import re
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402
import fastgrpo  # noqa: E402
from fastgrpo.compiler.report import CAPTURE_FLAGS, GraphBreakLog, is_data_dependent_break  # noqa: E402
from fastgrpo.compiler.tiny import _SMALL, ALIASES  # noqa: E402

PATTERNS = ("rms_norm", "rope", "gated_mlp", "selective_logprob")
MAX_PARAMS = 20_000_000
# Same tolerances as the pass tests (tests/tiny_models.assert_grads_close): fp32 log-probs within
# 1e-5 (absolute plus relative), every gradient within 1e-4 of its largest eager magnitude.
OUT_TOL, GRAD_REL_TOL = 1e-5, 1e-4

# Config attributes that size experts, low-rank attention and linear-attention heads, and the
# small value each gets (never larger than the default). Only attributes a config has are set.
_SHRINK = {
    # mixture of experts: few small experts, each token routed to two of them
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "zero_expert_num": 2,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2, "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1,
    "moe_intermediate_size": 48, "shared_expert_intermediate_size": 48, "expert_ffn_hidden_size": 48,
    "moe_shared_expert_intermediate_size": 48, "dense_intermediate_size": 96, "shared_intermediate_size": 48,
    "ffn_hidden_size": 96, "router_hidden_size": 32,
    # multi-head latent attention (DeepSeek and descendants)
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
    # sparse-attention indexers, linear attention, state-space and sliding-window branches
    "index_n_heads": 2, "index_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_heads": 2, "linear_head_dim": 16,
    "swa_num_attention_heads": 2, "swa_num_key_value_heads": 1, "swa_head_dim": 32,
    "chunk_size": 16, "mamba_chunk_size": 16,  # Mamba-2's scan pads every sequence to a whole chunk
    # per-layer inputs; layers that reuse an earlier layer's keys and values (none of two layers can)
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0,
}
_LAYER_KIND_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type")
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_MAX_LAYERS = 4


def _distinct_kinds(default_config) -> dict[str, list]:
    """For hybrid models: each per-layer kind list of the full-size default config reduced to one
    layer of each kind, in first-seen order, so the tiny model keeps every kind of layer."""
    kinds = {}
    for name in _LAYER_KIND_LISTS:
        values = getattr(default_config, name, None)
        if isinstance(values, (list, tuple)) and values and not _read_only(type(default_config), name):
            kinds[name] = list(dict.fromkeys(values))
    return kinds


def _read_only(config_class, name: str) -> bool:
    """Attributes some configs derive (a property without a setter) and refuse as arguments."""
    name = getattr(config_class, "attribute_map", {}).get(name, name)
    attribute = getattr(config_class, name, None)
    return isinstance(attribute, property) and attribute.fset is None


def _derived_sizes(config) -> dict:
    """Integer sizes a config derives through a property with a setter, which `to_dict` leaves out although
    they take a value like any other (LongCat-Flash's num_hidden_layers, twice its num_layers)."""
    config_class, values = type(config), {}
    for name in dir(config_class):
        attribute = getattr(config_class, name, None)
        if isinstance(attribute, property) and attribute.fset is not None:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                values[name] = value
    return values


def _shrunk(values: dict, small: dict, config_class) -> dict:
    """`small`'s sizes for the keys of `values` (never larger than the default; a size left
    unset by the default, such as a top-k of None, gets the small value), with dropout and
    router noise off. Keys may be the aliases of a config's `attribute_map` (GPT-2's n_embd ...)."""
    aliases = getattr(config_class, "attribute_map", {})
    out = {}
    for key, target in small.items():
        real = aliases.get(key, key)
        if real not in values or _read_only(config_class, key):
            continue
        default = values[real]
        if default is None or (isinstance(default, int) and not isinstance(default, bool)):
            out[real] = target if default is None else min(target, default)
    for key, default in values.items():  # eager and compiled must draw no random masks or noise
        random = "dropout" in key or key.endswith("_pdrop") or "jitter" in key
        if random and isinstance(default, float) and default > 0 and not _read_only(config_class, key):
            out[key] = 0.0
    return out


def tiny_overrides(arch: str, attempt: int = 0, layers_per_kind: int | None = None) -> dict:
    """Config arguments that make `arch` small enough to run here. Attempt 1 is a fallback for
    models whose attention needs more (or more key/value) heads: four heads of 16, no grouping.
    Decoder layers: one of each layer kind in turn (at least two, at most _MAX_LAYERS), or with `layers_per_kind`
    that many of each kind (also in a multimodal wrapper's text config), each kind's layers consecutive (as deep
    models stack them; Dynamo's reason for a recompile then compares a layer with the one before it, of its kind)."""
    config_class = type(transformers.AutoConfig.for_model(ALIASES.get(arch, arch)))
    full = transformers.AutoConfig.for_model(config_class.model_type)
    small = dict(_SMALL)
    if attempt:
        small |= dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    defaults = full.to_dict() | _derived_sizes(full)
    overrides = _shrunk(defaults, small | _SHRINK, config_class)
    if "kv_lora_rank" in defaults:  # multi-head latent attention expands k and v to every head
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    if "qk_rope_head_dim" in overrides and "qk_nope_head_dim" in overrides:
        if "qk_head_dim" in defaults and not _read_only(config_class, "qk_head_dim"):
            overrides["qk_head_dim"] = overrides["qk_rope_head_dim"] + overrides["qk_nope_head_dim"]
        if defaults.get("head_dim") == defaults.get("qk_rope_head_dim") and "head_dim" in overrides:
            overrides["head_dim"] = overrides["qk_rope_head_dim"]  # MLA: head_dim is the rotary width
    if isinstance(defaults.get("rotary_dim"), int):  # an explicit rotary width: rotate half of each head
        overrides["rotary_dim"] = small["hidden_size"] // small["num_attention_heads"] // 2
    overrides |= _layers(full, overrides, layers_per_kind)
    text = full.get_text_config()
    for key, sub in defaults.items():  # sub-configs (text, vision, ...): the same small sizes
        if isinstance(sub, dict) and "model_type" in sub:
            sub_config = getattr(full, key)
            overrides[key] = _shrunk(sub | _derived_sizes(sub_config), small | _SHRINK, type(sub_config))
            if layers_per_kind is not None and sub_config is text:  # a multimodal wrapper's decoder
                overrides[key] |= _layers(sub_config, overrides[key], layers_per_kind)
    return overrides


def _layers(config, shrunk: dict, layers_per_kind: int | None) -> dict:
    """`config`'s layer count (where `shrunk` sets one) and per-layer kind lists: one layer of each kind in turn (at
    least two, at most _MAX_LAYERS), or `layers_per_kind` of each kind, each kind's layers consecutive."""
    kinds = _distinct_kinds(config)
    out = {}
    if layers_per_kind is None:
        layers = min(_MAX_LAYERS, max([_SMALL["num_hidden_layers"], *map(len, kinds.values())]))
        for name, values in kinds.items():
            out[name] = (values * layers)[:layers]
    else:
        layers = layers_per_kind * max([1, *map(len, kinds.values())])
        for name, values in kinds.items():
            out[name] = [values[i * len(values) // layers] for i in range(layers)]
    count = getattr(type(config), "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")  # GPT-2's n_layer
    if count in shrunk:
        out[count] = layers
    return out


def tiny_causal_lm(arch: str, dtype: torch.dtype = torch.float32, lora: bool = False, attempt: int = 0, seed: int = 0,
                   layers_per_kind: int | None = None):
    """A tiny random-init, dropout-free causal LM of `arch` in training mode (optionally with LoRA); decoder layers as
    `tiny_overrides` builds them."""
    torch.manual_seed(seed)
    overrides = tiny_overrides(arch, attempt, layers_per_kind)
    config = transformers.AutoConfig.for_model(ALIASES.get(arch, arch), **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    for module in model.modules():  # dropout modules built with a hard-coded rate
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if lora:
        import peft

        # The attention and MLP projections, as fastgrpo.compiler.tiny targets them; not "all-linear",
        # which also wraps MoE routers and expert banks (parametrized, and Dynamo breaks on them).
        present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        targets = [t for t in _LORA_TARGETS if t in present]
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                      target_modules=targets)
        model = peft.get_peft_model(model, lora_config)
    model.train()
    return model


# --- what the model contains, counted on the eager run -------------------------------------

def _linears(module: nn.Module) -> list[nn.Linear]:
    """The module's own linear layers (a PEFT LoRA layer counts as the linear it wraps)."""
    children = (getattr(child, "base_layer", child) for child in module.children())
    return [child for child in children if isinstance(child, nn.Linear)]


_ATTENTION_SUFFIXES = ("Attention", "MLA")  # MLA: multi-head latent attention (LongCat-Flash's LongcatFlashMLA)


def _is_attention(module: nn.Module) -> bool:
    """Innermost module whose class is named *Attention or *MLA (the layer's attention, not its wrapper)."""
    name = type(module).__name__
    if not name.endswith(_ATTENTION_SUFFIXES):
        return False
    return not any(type(m).__name__.endswith(_ATTENTION_SUFFIXES) for m in module.modules() if m is not module)


def _is_gated_mlp(module: nn.Module) -> bool:
    """Two same-shape projections of one input and a down projection of their width, or one fused
    [gate; up] projection (registered before the down projection) twice as wide as its input."""
    linears = _linears(module)
    if len(linears) == 3:
        for a, b, down in ((linears[0], linears[1], linears[2]), (linears[0], linears[2], linears[1]),
                           (linears[1], linears[2], linears[0])):
            if (a.in_features, a.out_features) == (b.in_features, b.out_features) == (down.out_features, down.in_features):
                return True
    if len(linears) == 2:
        fused, down = linears
        return fused.out_features == 2 * down.in_features and fused.in_features == down.out_features
    return False


def _is_gated_experts(module: nn.Module) -> bool:
    """A bank of experts stored as 3-D weights [E, ., .] with a gate: separate gate, up and down
    weights, or a fused [gate; up] weight with a dim twice one of the down weight's (either layout).
    E may differ between the weights: LongCat-Flash's identity ("zero") experts have a [gate; up] row
    but no down projection."""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if len(weights) < 2 or min(w.shape[0] for w in weights) < 2:  # one weight per expert, several experts
        return False
    if len(weights) == 3:
        return True
    if len(weights) == 2:
        a, b = (w.shape[1:] for w in weights)
        return any(x == 2 * y for x in a for y in b) or any(y == 2 * x for x in a for y in b)
    return False


def _is_rms_norm(module: nn.Module) -> bool:
    """RMSNorm-like modules by class name: RMSNorm (with or without weight, gated or not) and
    L2Norm (an RMSNorm without weight)."""
    def named(m):
        return "RMSNorm" in type(m).__name__ or "L2Norm" in type(m).__name__

    # innermost only: a wrapper (AXK2's RMSNorm-then-sigmoid-gate) is counted through the norm it holds
    return named(module) and not any(named(m) for m in module.modules() if m is not module)


def _has_rope(model: nn.Module) -> bool:
    """A rotary-embedding module was built (class name with "Rotary"), or the config asks for an
    explicit rotary width (GPT-J and CodeGen rotate inside attention)."""
    if any("Rotary" in type(m).__name__ for m in model.modules()):
        return True
    config = model.config.get_text_config()
    return isinstance(getattr(config, "rotary_dim", None), int) and config.rotary_dim > 0


class _ReadsTensors(torch.overrides.TorchFunctionMode):
    """Records whether any torch op inside it takes one of `tensors` as an input."""

    def __init__(self, tensors):
        super().__init__()
        self.ids = {id(t) for t in tensors}
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        inputs, _ = torch.utils._pytree.tree_flatten((args, kwargs or {}))
        self.read = self.read or any(id(x) in self.ids for x in inputs)
        return func(*args, **(kwargs or {}))


def _uses_position_embeddings(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether an attention module computes with the (cos, sin) it is given: called again on the same inputs,
    does any op read them? False for NoPE and linear-attention layers that take position embeddings and
    ignore them. (Perturbing cos/sin and comparing outputs is no test: a tiny random-init attention can be
    near-uniform, so rotation-insensitive, while it rotates.) Modules given none (rotation computed inside,
    GPT-J) count as RoPE."""
    cos_sin = kwargs.get("position_embeddings")
    pair = isinstance(cos_sin, (tuple, list)) and len(cos_sin) == 2
    if not (pair and all(isinstance(t, torch.Tensor) for t in cos_sin)):
        return True
    with torch.no_grad(), _ReadsTensors(cos_sin) as mode:
        module(*args, **kwargs)
    return mode.read


def count_calls(model: nn.Module, run) -> dict[str, int]:
    """How often RMSNorm-like modules, attention layers and gated MLPs / expert banks run in `run()`
    (Dynamo unrolls every call into its own site), how many attention modules ran at all, and how many of
    those rotate by their position embeddings (a RoPE site is counted per such attention module, however
    often a recurrent model calls it; NoPE and linear-attention layers are not RoPE sites)."""
    categories = {
        "rms_norm": _is_rms_norm,
        "attention": _is_attention,
        "gated_mlp": lambda m: (_is_gated_mlp(m) and not _is_attention(m)) or _is_gated_experts(m),
    }
    counts = dict.fromkeys(categories, 0)
    first_calls = {}  # attention module -> (args, kwargs) of its first call
    handles = []

    def hook(module, args, kwargs, category):
        counts[category] += 1
        if category == "attention" and module not in first_calls:
            first_calls[module] = (args, kwargs)

    for module in model.modules():
        for category, test in categories.items():
            if test(module):
                handles.append(module.register_forward_hook(
                    lambda m, args, kwargs, out, category=category: hook(m, args, kwargs, category), with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    rotating = sum(_uses_position_embeddings(m, *call) for m, call in first_calls.items())
    return counts | {"attention_modules": len(first_calls), "rotating_attention_modules": rotating}


# --- one architecture ----------------------------------------------------------------------

class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _step(fn, ids, advantages):
    logps = fn(ids)
    (logps * advantages).mean().backward()
    return logps.detach()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_grad_error(expected: dict, actual: dict) -> float:
    """Largest error of any gradient relative to its largest eager value, with a floor of 1e-4 of
    the largest gradient of the model: a gradient that is numerically zero next to the others
    (DeepSeek-V4's hash router: 4e-9 beside 5) is compared on the model's scale."""
    if expected.keys() != actual.keys():
        return float("inf")
    floor = 1e-4 * max((g.float().abs().max().item() for g in expected.values()), default=0.0)
    worst = 0.0
    for name, want in expected.items():
        scale = max(want.float().abs().max().item(), floor, 1e-12)
        worst = max(worst, (actual[name].float() - want.float()).abs().max().item() / scale)
    return worst


def _summarise(reports: list[dict]) -> dict:
    """Per pattern: matched sites, their forms, near misses. RoPE is counted per attention module
    (one site may rotate q and k together, or each alone when k is only computed after q is used)."""
    out = {}
    for name in PATTERNS:
        records = [r["patterns"][name] for r in reports if name in r["patterns"]]
        sites = [site for rec in records for site in rec["sites"]]
        forms: dict[str, int] = {}
        for site in sites:
            forms[site["form"]] = forms.get(site["form"], 0) + 1
        matched = len({s["site"] for s in sites}) if name == "rope" else len(sites)
        out[name] = {"matched": matched, "sites": len(sites), "forms": forms,
                     "near_misses": [m for rec in records for m in rec["near_misses"]]}
    return out


def _tiny_params(arch: str, attempt: int) -> int:
    config = transformers.AutoConfig.for_model(ALIASES.get(arch, arch), **tiny_overrides(arch, attempt))
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


def completion_logps_fn(model):
    """The GRPO log-prob computation: per-token log-probs of the next input token."""
    def completion_logps(input_ids):
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
        return logits.log_softmax(-1).gather(-1, input_ids.roll(-1, 1).unsqueeze(-1)).squeeze(-1)

    return completion_logps


def _eager_reference(arch: str, attempt: int, lora: bool, seq_len: int) -> dict:
    """Build the tiny model and run the eager step, counting the modules that ran."""
    params = _tiny_params(arch, attempt)
    if params > MAX_PARAMS:
        raise _TooLarge(f"{params / 1e6:.0f}M parameters after shrinking (a sub-model keeps its full size)")
    model = tiny_causal_lm(arch, torch.float32, lora=lora, attempt=attempt)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 128), (2, seq_len), generator=generator)
    advantages = torch.randn(2, seq_len, generator=generator)
    fn = completion_logps_fn(model)
    out = {}
    calls = count_calls(model, lambda: out.setdefault("logps", _step(fn, ids, advantages)))
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return dict(model=model, fn=fn, ids=ids, advantages=advantages, logps=out["logps"], grads=grads,
                calls=calls, params=params)


class _TooLarge(Exception):
    pass


def _compiled_run(completion_logps, model, ids, advantages, inner: str, expected: dict) -> dict:
    """Compile `completion_logps` with the fastgrpo backend, run one step and compare with the eager `expected`
    (logps, grads): graphs, graph breaks, what each pattern matched, the errors."""
    from torch._dynamo.utils import counters

    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(completion_logps, backend="fastgrpo", options={"inner": inner})
    with GraphBreakLog() as log:
        actual = _step(compiled, ids, advantages)
    actual_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    reports = fastgrpo.fusion_reports()
    graph_breaks = log.result()
    if not graph_breaks and len(reports) != 1:
        graph_breaks = {f"{len(reports)} graphs compiled for one call, though Dynamo named no graph break": 1}
    want = expected["logps"]
    out_err = (actual - want).abs().max().item() if actual.shape == want.shape else float("inf")
    scale = want.abs().max().item()
    grad_error = _max_grad_error(expected["grads"], actual_grads)
    return {"graphs": len(reports), "graph_breaks": graph_breaks, "patterns": _summarise(reports),
            "output_error": out_err, "grad_error": grad_error,
            "equal": out_err <= OUT_TOL + OUT_TOL * scale and grad_error <= GRAD_REL_TOL}


def measure(arch: str, inner: str = "eager", seq_len: int = 8, lora: bool = False, timeout: int = 600) -> dict:
    """Build, compile and compare one architecture; never raises (errors are recorded). A model whose graph breaks
    at data-dependent ops is measured again with Dynamo's capture flags: the result is that run's, and
    result["capture_flags"] says so and keeps the first run's status, graphs and breaks."""
    result = {"arch": arch, "status": None}
    start = time.perf_counter()
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    stage = "build"
    try:
        try:
            default_config = transformers.AutoConfig.for_model(ALIASES.get(arch, arch))
        except Exception as err:  # noqa: BLE001
            result.update(status="skipped", reason=f"cannot be built tiny: {_one_line(err)}")
            return result
        if getattr(default_config, "is_encoder_decoder", False):
            result.update(status="skipped", reason="encoder-decoder model")
            return result
        failures = []
        for attempt in (0, 1):  # the second with four ungrouped heads (models that need more heads)
            try:
                ref = _eager_reference(arch, attempt, lora, seq_len)
                break
            except _TooLarge as err:
                result.update(status="skipped", reason=f"cannot be built tiny: {err}")
                return result
            except Exception as err:  # noqa: BLE001
                failures.append(_one_line(err))
        else:
            result.update(status="skipped", reason=f"cannot be built tiny: {failures[0]}"
                          + (f" (with 4 heads: {failures[1]})" if failures[1] != failures[0] else ""))
            return result
        result["overrides"] = tiny_overrides(arch, attempt)
        if failures:
            result["note"] = f"built with 4 ungrouped heads (2 heads, 1 KV head failed: {failures[0]})"
        model, calls = ref["model"], ref["calls"]
        result["model_class"] = type(model).__name__
        result["params"] = ref["params"]
        result["modules"] = calls
        result["expected"] = {
            "rms_norm": calls["rms_norm"],
            "rope": calls["rotating_attention_modules"] if _has_rope(model) else 0,
            "gated_mlp": calls["gated_mlp"],
            "selective_logprob": 1,
        }
        run = (ref["fn"], model, ref["ids"], ref["advantages"], inner, ref)

        stage = "compiled run"
        result |= _compiled_run(*run)
        result["status"] = _status(result)
        if any(is_data_dependent_break(reason) for reason in result["graph_breaks"]):
            # What users get who follow the fusion report's advice for such breaks (report.CAPTURE_FIX).
            stage = "compiled run with Dynamo's capture flags"
            without = {key: result[key] for key in ("status", "graphs", "graph_breaks")}
            try:
                with torch._dynamo.config.patch(CAPTURE_FLAGS):
                    flagged = _compiled_run(*run)
            except Exception as err:  # noqa: BLE001 - the run without the flags stands
                result["capture_flags"] = {"flags": sorted(CAPTURE_FLAGS), "error": _one_line(err)}
            else:
                result |= flagged
                result["status"] = _status(result)
                result["capture_flags"] = {"flags": sorted(CAPTURE_FLAGS), "without": without}
        stage = "rollouts"
        try:
            deep = rollout_model(arch, attempt)
        except Exception as err:  # noqa: BLE001 - the compiled run's row stands
            result |= {"rollout": "not run", "rollout_reason": f"cannot be built with {rollout_layers_per_kind()} "
                                                               f"layers of each kind: {_one_line(err)}"}
        else:
            result |= measure_rollouts(deep)
    except _Timeout:
        result |= {"status": "error", "reason": f"{stage}: timed out after {timeout} s"}
    except Exception as err:  # noqa: BLE001 - the sweep records every failure and goes on
        result |= {"status": "error", "reason": f"{stage}: {_one_line(err)}",
                   "traceback": traceback.format_exc(limit=-4)[-2000:]}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        result["seconds"] = round(time.perf_counter() - start, 1)
        torch._dynamo.reset()
        gc.collect()
    return result


ROLLOUT_STATUSES = {
    "engine": "the rollout engine's compiled decode step gives model.generate's greedy tokens (where transformers' "
              "generate fails on the tiny model: those of the model's forward without cache), compiling in its first "
              "decode step only and not again in a second call",
    "uncompiled layers": "the decode layer did not compile: the engine decodes with uncompiled layers, same tokens "
                         "(one warning with the reason)",
    "model.generate": "the engine cannot run the model: model.generate samples, without per-token log-probs "
                      "(one warning with the reason)",
    "recompiles": "the engine gives model.generate's tokens, but its decode layer compiled after the first decode "
                  "step, again in the second call, or past Dynamo's recompile limit (a value per layer in its guards: "
                  "one graph per layer; the engine then decodes with uncompiled layers); the reason names the guard",
    "differs": "the generator's tokens differ from model.generate's",
    "error": "the generator raised",
    "not run": "transformers' generate fails on the tiny model, where the engine would fall back to it or where "
               "the model's forward without cache fails too; or the model cannot be built with that many layers of "
               "each kind",
}


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, pad: int, eos: int, **generate_kwargs
              ) -> list[list[int]]:
    """model.generate's greedy completions of the left-padded batch, each cut after its first EOS (as TRL keeps it)."""
    from fastgrpo.integrations.generation.generator import left_padded

    ids, mask = left_padded(prompts, pad, next(model.parameters()).device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=eos, pad_token_id=pad, **generate_kwargs)[:, ids.shape[1]:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


@torch.no_grad()
def forward_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy completions from the model's forward over the whole sequence at every token, one prompt at a time (no
    cache, no padding): the reference where transformers' generate cannot run a tiny model."""
    device = next(model.parameters()).device
    completions = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
        completions.append(ids[len(prompt):])
    return completions


def rollout_layers_per_kind() -> int:
    """Layers of each kind in the rollouts model: one past Dynamo's recompile limit. The engine compiles one decode
    layer function for every layer; a value per layer in its guards (a mixer's `layer_idx`) compiles a graph per
    layer, which a full-depth model's many layers of one kind take past the limit and the tiny model's few do not."""
    return torch._dynamo.config.recompile_limit + 1


def rollout_model(arch: str, attempt: int = 0) -> nn.Module:
    """The model the rollouts column measures: `arch` tiny with `rollout_layers_per_kind()` layers of each kind."""
    return tiny_causal_lm(arch, attempt=attempt, layers_per_kind=rollout_layers_per_kind())


# A recompile reason as Dynamo gives it: "0/7: <guard>  # <code>  # <file:line> in <function> (HINT: ...)".
_RECOMPILE_REASON = re.compile(r"^\d+/\d+: (?P<guard>.*?)(\s+#\s*(?P<code>.*?)\s+#\s*(?P<where>\S+ in \S+))?(\s+\(|$)")
# The compile errors the engine falls back from when its decode layer keeps compiling.
_RECOMPILE_LIMIT_ERRORS = ("FailOnRecompileLimitHit", "RecompileStorm")


class _DecodeLayerCompiles(logging.Handler):
    """While entered: the graphs the engine's decode layer (`_layer_forward`) compiles and, for each recompile (also
    one refused at the limit), the guard that failed for every graph it had. Read from torch's structured trace
    ("compilation_metrics" and "recompile_reasons" records), which torch writes only while its logger has a handler."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.graphs = 0
        self.recompiles: list[list[str]] = []

    def emit(self, record):
        metadata = getattr(record, "metadata", None) or {}
        if metadata.get("compilation_metrics", {}).get("co_name") == "_layer_forward":
            self.graphs += 1
        if metadata.get("artifact", {}).get("name") == "recompile_reasons":
            payload = record.payload or ""  # one reason as text, several as a JSON list
            self.recompiles.append(json.loads(payload) if payload.startswith("[") else [payload])

    def __enter__(self):
        logging.getLogger("torch.__trace").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch.__trace").removeHandler(self)

    def guard(self) -> str | None:
        """The guard behind the recompiles, as "guard (code, file:line in function)": the latest recompile's first
        failed guard that compares a value with an integer (a layer index, a token count), else the last recompile's
        first failed guard (a graph of another layer kind, say)."""
        for reasons in reversed(self.recompiles):
            for reason in reasons:
                match = _RECOMPILE_REASON.match(reason.strip().splitlines()[0] if reason.strip() else "")
                if match and re.search(r" == -?\d+$", match["guard"]):
                    return f"{match['guard']} ({match['code']}, {match['where']})" if match["where"] else match["guard"]
        first = self.recompiles[-1][0].strip().splitlines() if self.recompiles and self.recompiles[-1] else []
        return first[0][:200] if first else None


def measure_rollouts(model: nn.Module, new_tokens: int = 8) -> dict:
    """The embedded generator on a tiny model (its weights scaled up in place: peaked logits, so greedy tokens vary
    and ties are unlikely), decode layer compiled with Dynamo's guard-only backend, against model.generate's greedy
    tokens; two calls. {"rollout": a ROLLOUT_STATUSES key, "rollout_reason": the fallback warning or error, for
    "recompiles" the graphs and the guard behind them, and for "engine" the decode steps it compiled in and the
    compiles of the second call}. A value per layer in the decode layer's guards shows as "recompiles" only where the
    model has more layers of a kind than Dynamo's recompile limit (`rollout_model`)."""
    from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning

    torch._dynamo.reset()  # graphs of earlier engines stay cached and count towards the recompile limit
    model.eval()
    text = model.config.get_text_config()
    layers, vocab = getattr(text, "num_hidden_layers", None), text.vocab_size
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3)]
    eos = vocab + 5  # never sampled: every row runs the full length
    try:
        expected, reference = hf_greedy(model, prompts, new_tokens, pad=0, eos=eos), "model.generate"
    except Exception as generate_error:  # noqa: BLE001 - transformers' own cache fails on some tiny hybrids
        try:
            expected, reference = forward_greedy(model, prompts, new_tokens), "the forward without cache"
        except Exception as err:  # noqa: BLE001
            return {"rollout": "not run", "rollout_reason": f"{_one_line(generate_error)}; {_one_line(err)}"}
    generator = EmbeddedGenerator(model, 0, [eos], max_new_tokens=new_tokens, compile=True, compile_backend="eager")
    try:
        with warnings.catch_warnings(record=True) as caught, _DecodeLayerCompiles() as compiled:
            warnings.simplefilter("always")
            first = generator.generate(prompts, temperature=0)
            backend = generator.engine.backend if generator.engine is not None else None
            compiles = backend.compiles if backend is not None else 0
            second = generator.generate(prompts, temperature=0)
    except Exception as err:  # noqa: BLE001
        if generator.fallback == "generate":  # the engine cannot run it and transformers' generate fails on it too
            return {"rollout": "not run", "rollout_reason": f"model.generate, the fallback: {_one_line(err)}"}
        return {"rollout": "error", "rollout_reason": _one_line(err)}
    notes = [str(w.message) for w in caught if issubclass(w.category, GenerationFallbackWarning)]
    guard = compiled.guard()
    last_guard = f"; recompiled on {guard}" if guard else ""
    result = {"rollout_warnings": notes, "rollout_reference": reference, "rollout_layers": layers}
    if first != expected or second != expected:
        return result | {"rollout": "differs", "rollout_reason": _differs_reason(model, prompts, new_tokens, reference,
                                                                                expected, first, second)}
    if generator.fallback is not None:
        note = notes[0] if notes else ""
        limit = [error for error in _RECOMPILE_LIMIT_ERRORS if f"({error}:" in note]
        if generator.fallback == "eager" and limit:
            return result | {"rollout": "recompiles", "rollout_reason":
                             f"{compiled.graphs} graphs of the decode layer for {layers} decoder layers, then "
                             f"{limit[0]} (the recompile limit): decodes with uncompiled layers{last_guard}"}
        status = "uncompiled layers" if generator.fallback == "eager" else "model.generate"
        return result | {"rollout": status, "rollout_reason": note or None}
    steps, again = sorted(set(backend.compile_steps)), backend.compiles - compiles
    status = "engine" if set(steps) <= {1} and again == 0 else "recompiles"
    reason = None if status == "engine" else \
        f"compiled in decode steps {steps}, {again} compile(s) in the second call{last_guard}"
    return result | {"rollout": status, "rollout_reason": reason, "rollout_compile_steps": steps,
                     "rollout_recompiles": again}


def _differs_reason(model, prompts, new_tokens: int, reference: str, expected, first, second) -> str:
    """How the generator's tokens differ: between its two calls, or in both from `reference`'s (`expected`); and,
    against model.generate, whether they are those of the forward without cache (one prompt at a time, no padding:
    then model.generate's left-padded batch is what differs)."""
    if first != second:
        wrong = " and the ".join(name for name, tokens in (("first", first), ("second", second)) if tokens != expected)
        return f"the two calls give different tokens; the {wrong} call's differ from {reference}'s"
    if reference != "model.generate":
        return f"both calls differ from {reference}'s tokens"
    try:
        plain = forward_greedy(model, prompts, new_tokens)
    except Exception as err:  # noqa: BLE001
        return f"both calls differ from model.generate's tokens; the forward without cache fails: {_one_line(err)}"
    if plain == first:
        return ("both calls differ from model.generate's tokens but equal greedy decoding with the forward without "
                "cache, one prompt at a time (model.generate's left-padded batch differs)")
    return "both calls differ from model.generate's tokens and from greedy decoding with the forward without cache"


def _one_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


STATUSES = {
    "full": "every site the model has is matched (more is fine: an `act(g) * u` outside an MLP module, a norm "
            "written inline), no near miss, no graph break, equal to eager",
    "explained": "equal to eager, no graph break, and every site is matched or reported as a near miss with its reason",
    "incomplete": "equal to eager, but some sites are neither matched nor reported (a spelling the passes do not "
                  "know), or graph breaks",
    "mismatch": "compiled and eager results differ",
    "out of scope": "no RMSNorm, RoPE or gated MLP",
}


def _reported(rec: dict, pattern: str) -> int:
    """Sites a pattern matched or reported: RoPE per attention module (q and k may be reported apart)."""
    misses = {m["site"] for m in rec["near_misses"]} if pattern == "rope" else rec["near_misses"]
    return rec["matched"] + len(misses)


def _status(result: dict) -> str:
    expected, patterns = result["expected"], result["patterns"]
    if not (expected["rms_norm"] or expected["rope"] or expected["gated_mlp"]) and not any(
        patterns[p]["matched"] or patterns[p]["near_misses"] for p in ("rms_norm", "rope", "gated_mlp")
    ):
        return "out of scope"
    if not result["equal"]:
        return "mismatch"
    if result["graph_breaks"]:
        return "incomplete"
    if all(patterns[p]["matched"] >= expected[p] and not patterns[p]["near_misses"] for p in PATTERNS):
        return "full"
    return "explained" if all(_reported(patterns[p], p) >= expected[p] for p in PATTERNS) else "incomplete"


# --- the sweep and its report --------------------------------------------------------------

def causal_lm_archs() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _worker(args):
    arch, inner, seq_len, lora, timeout = args
    _quiet()
    return measure(arch, inner, seq_len, lora, timeout)


def _quiet():
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)


def _cell(result: dict, pattern: str) -> str:
    rec = result["patterns"][pattern]
    text = f"{rec['matched']}/{result['expected'][pattern]}"
    if rec["near_misses"]:
        text += f" ({len(rec['near_misses'])} near miss{'es' if len(rec['near_misses']) > 1 else ''})"
    fallbacks = sum(n for form, n in rec["forms"].items() if form.startswith("act_mul"))
    if fallbacks:
        text += f" ({fallbacks} act_mul)"
    return text


def _status_cell(result: dict) -> str:
    flags = result.get("capture_flags", {})
    return f"{result['status']} with Dynamo's capture flags" if "without" in flags else result["status"]


def _brief(reason: str) -> str:
    """A graph break in one line: each break it chains (a break in a loop makes Dynamo skip the frame) by its
    kind and, where Dynamo gives one, its debug context (the op)."""
    parts = []
    for part in reason.split("*** While handling this graph break, another graph break occurred: ***"):
        lines = [line.strip() for line in part.strip().splitlines() if line.strip()]
        context = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")]
        parts.append(lines[0] + (f" ({context[0]})" if context else "") if lines else "")
    return " -> ".join(parts)


def _capture_flags_note(result: dict) -> str | None:
    """For a model measured again with Dynamo's capture flags: that it was, and how it did without them."""
    flags = result.get("capture_flags")
    if not flags:
        return None
    names = ", ".join(f"{flag}=True" for flag in flags["flags"])
    if "error" in flags:
        return f"graph breaks at data-dependent ops; with Dynamo's capture flags ({names}) the run failed: " + flags["error"]
    without = flags["without"]
    breaks = "; ".join(_brief(reason) + (f" (x{n})" if n > 1 else "") for reason, n in without["graph_breaks"].items())
    return (f"{result['status']} with Dynamo's capture flags ({names}); without them {without['status']}, "
            f"{without['graphs']} graphs, {sum(without['graph_breaks'].values())} graph breaks: {breaks}")


def _notes(result: dict) -> str:
    notes = [note] if (note := _capture_flags_note(result)) else []
    for pattern in PATTERNS:
        rec = result["patterns"][pattern]
        reasons = {}
        for miss in rec["near_misses"]:
            reasons[miss["reason"]] = reasons.get(miss["reason"], 0) + 1
        notes += [f"{pattern}: {reason}" + (f" (x{n})" if n > 1 else "") for reason, n in reasons.items()]
        fallbacks = {form.split(": ", 1)[-1] for form in rec["forms"] if form.startswith("act_mul")}
        notes += [f"{pattern} act_mul fallback: {why}" for why in sorted(fallbacks)]
        unreported = result["expected"][pattern] - _reported(rec, pattern)
        if unreported > 0:
            notes.append(f"{pattern}: {unreported} site(s) neither matched nor reported")
    for reason, n in result["graph_breaks"].items():
        notes.append(f"graph break: {reason}" + (f" (x{n})" if n > 1 else ""))
    if not result["equal"]:
        notes.append(f"output error {result['output_error']:.1e}, gradient error {result['grad_error']:.1e}")
    return "; ".join(notes).replace("|", "\\|").replace("\n", " ")


def _rollout_section(results: list[dict]) -> list[str]:
    """Markdown lines: how the embedded generator ran each measured model (status counts, then every model it did
    not run compiled, with the reason)."""
    rows = [r for r in results if "rollout" in r]
    if not rows:
        return []
    lines = [
        "## Rollouts",
        "",
        f"Every model built above ({len(rows)}, out-of-scope ones included), built again with "
        f"{rollout_layers_per_kind()} consecutive layers of each layer kind (one past Dynamo's recompile limit: the "
        "engine compiles one decode layer function for every layer, and a value per layer in its guards, such as a "
        "mixer's `layer_idx`, compiles a graph per layer, which a full-size model's many layers take past the limit), "
        "also samples 8 greedy tokens for 3 left-padded prompts with fastgrpo's embedded generator (its decode layer "
        "compiled with Dynamo's guard-only backend, `compile_backend=\"eager\"`), twice, against `model.generate` "
        "(where transformers' generate fails on the tiny model: against greedy decoding with the model's forward "
        "without cache).",
        "",
        "| rollouts | count | meaning |",
        "|---|---|---|",
        *[f"| {status} | {sum(r['rollout'] == status for r in rows)} | {meaning} |"
          for status, meaning in ROLLOUT_STATUSES.items()],
        "",
    ]
    others = sorted((r for r in rows if r["rollout"] != "engine"), key=lambda r: (r["rollout"], r["arch"]))
    if others:
        lines += ["| arch | rollouts | reason |", "|---|---|---|"]
        lines += [f"| {r['arch']} | {r['rollout']} | "
                  f"{(r.get('rollout_reason') or '').replace('|', '/').replace(chr(10), ' ')} |" for r in others]
        lines.append("")
    return lines


def write_markdown(results: list[dict], path: Path, meta: dict) -> None:
    """docs/SUPPORT.md from the rows and the JSON's meta (date, versions, inner, lora, seq_len, rows updated since)."""
    inner, lora, seq_len = meta["inner"], meta["lora"], meta["seq_len"]
    by_status: dict[str, list[dict]] = {}
    for r in results:
        by_status.setdefault(r["status"], []).append(r)
    measured = [r for r in results if r["status"] in ("full", "explained", "incomplete", "mismatch")]
    updates = "".join(f" Rows measured again on {u['date']} (transformers {u['transformers']}, torch {u['torch']}): "
                      f"{', '.join(u['archs'])}." for u in meta.get("updated", []))
    lines = [
        "# Architecture support",
        "",
        f"Generated by `bench/coverage.py` on {meta['date']} with transformers {meta['transformers']}, "
        f"torch {meta['torch']}: every model_type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)}), "
        f"built tiny and random-init (fp32, two layers or one per layer kind, experts shrunk), "
        f"{'with LoRA, ' if lora else ''}compiled with `backend=\"fastgrpo\"` (inner=`{inner}`) around a "
        f"completion log-prob function (batch 2, {seq_len} tokens), forward + backward, compared with eager."
        f"{updates}",
        "",
        "Cells are matched sites / sites the model has (counted on the eager run: RMSNorm-like modules by "
        "class name; for RoPE, attention modules with a matched rotation / attention modules that compute with "
        "the cos and sin they are given, when the model uses rotary embeddings (NoPE "
        "and linear-attention layers are no RoPE sites); for the gated "
        "MLP column gated MLPs and gated expert banks found by their weight shapes (more matches mean an "
        "`act(g) * u` elsewhere: a gated norm, a Mamba gate); one lm-head). `act_mul` = the site matched but its "
        "projections "
        "could not be absorbed into the fused MLP op (it then saves gate and up). "
        "Equal = log-probs within 1e-5 and every gradient within 1e-4 of its largest eager value (floored at 1e-4 "
        "of the model's largest gradient). Site counts come from the compiled graphs: where a graph break splits "
        "the decoder layers, one compiled layer serves several and the counts are per compiled graph.",
        "",
        "Graph breaks are those Dynamo's graph-break log names, including a break in a loop or one it cannot resume "
        "from, after which it skips the whole frame. A model whose graph breaks at a data-dependent op "
        "(`Tensor.item()`, `nonzero()`: MoE routing) is measured again under "
        "`torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)`, as the "
        "fusion report tells users to: its row is that run's, its status says \"with Dynamo's capture flags\" and "
        "its notes give the run without them.",
        "",
        "| status | count | meaning |",
        "|---|---|---|",
        *[f"| {status} | {len(by_status.get(status, []))} | {meaning} |" for status, meaning in STATUSES.items()],
        f"| skipped | {len(by_status.get('skipped', []))} | encoder-decoder, or cannot be built tiny (reason below) |",
        f"| error | {len(by_status.get('error', []))} | the compiled run failed (reason below) |",
        "",
        *_rollout_section(results),
        "## Measured architectures",
        "",
        "| arch | status | RMSNorm | RoPE | gated MLP | lm-head | graph breaks | equal | rollouts | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(measured, key=lambda r: (list(STATUSES).index(r["status"]), r["arch"])):
        lines.append(
            f"| {r['arch']} | {_status_cell(r)} | {_cell(r, 'rms_norm')} | {_cell(r, 'rope')} | {_cell(r, 'gated_mlp')} | "
            f"{_cell(r, 'selective_logprob')} | {sum(r['graph_breaks'].values())} | {'yes' if r['equal'] else 'NO'} | "
            f"{r.get('rollout', '-')} | {_notes(r)} |"
        )
    lines += ["", "## Out of scope (no RMSNorm, RoPE or gated MLP)", ""]
    lines.append(", ".join(r["arch"] for r in by_status.get("out of scope", [])) or "-")
    lines += ["", "## Not measured", "", "| arch | status | reason |", "|---|---|---|"]
    for r in sorted(by_status.get("skipped", []) + by_status.get("error", []), key=lambda r: r["arch"]):
        lines.append(f"| {r['arch']} | {r['status']} | {r['reason'].replace('|', '/')} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--archs", help="comma-separated model_types (default: every causal LM in transformers)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1: run in this process)")
    parser.add_argument("--inner", default="eager", choices=["eager", "aot_eager", "inductor"])
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--lora", action="store_true", help="wrap every model in PEFT LoRA first")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per architecture")
    parser.add_argument("--md", type=Path, help="markdown output (default for a full sweep: docs/SUPPORT.md)")
    parser.add_argument("--json", type=Path, help="JSON output (default for a full sweep: docs/support.json)")
    parser.add_argument("--update", action="store_true",
                        help="measure --archs again and replace their rows in the --json file, then rewrite it and "
                             "the --md file from every row (defaults docs/support.json, docs/SUPPORT.md)")
    args = parser.parse_args(argv)
    _quiet()
    archs = args.archs.split(",") if args.archs else causal_lm_archs()
    if not args.archs or args.update:
        args.md = args.md or harness.REPO / "docs" / "SUPPORT.md"
        args.json = args.json or harness.REPO / "docs" / "support.json"
    previous = None
    if args.update:
        if not args.archs:
            parser.error("--update needs --archs")
        previous = json.loads(args.json.read_text())
        for key, value in (("inner", args.inner), ("lora", args.lora), ("seq_len", args.seq_len)):
            if previous[key] != value:
                parser.error(f"--update: {args.json} was measured with {key}={previous[key]!r}, not {value!r}")
    tasks = [(arch, args.inner, args.seq_len, args.lora, args.timeout) for arch in archs]
    results = []
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for r in pool.imap(_worker, tasks):
                results.append(r)
                _print(r)
    else:
        for task in tasks:
            results.append(_worker(task))
            _print(results[-1])
    stamp = harness.stamp()
    today = stamp["date"]
    meta = {**stamp, "transformers": transformers.__version__,
            "torch": torch.__version__, "inner": args.inner, "lora": args.lora, "seq_len": args.seq_len}
    rows = results
    if previous is not None:  # the sweep's rows, these archs' replaced (or added) in place
        meta = {key: value for key, value in previous.items() if key != "results"}
        meta["updated"] = meta.get("updated", []) + [
            {"date": today, "archs": archs, "transformers": transformers.__version__, "torch": torch.__version__}]
        fresh = {r["arch"]: r for r in results}
        rows = [fresh.pop(r["arch"], r) for r in previous["results"]] + list(fresh.values())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "results": rows}, indent=1, default=str) + "\n")
    if args.md:
        write_markdown(rows, args.md, meta)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("summary:", ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 0


def _print(r: dict) -> None:
    if r["status"] in ("full", "explained", "incomplete", "mismatch"):
        cells = " ".join(f"{p}={_cell(r, p)}" for p in PATTERNS)
        print(f"{r['arch']:26s} {_status_cell(r):8s} {cells} breaks={sum(r['graph_breaks'].values())} "
              f"equal={r['equal']} rollouts={r.get('rollout')} {r['seconds']}s  {_notes(r)}", flush=True)
    else:
        print(f"{r['arch']:26s} {r['status']:8s} {r.get('reason', '')} rollouts={r.get('rollout')} {r['seconds']}s",
              flush=True)
    if r.get("rollout_reason"):
        print(f"{'':26s} rollouts: {r['rollout_reason']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
