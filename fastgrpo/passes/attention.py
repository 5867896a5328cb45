"""Attention on cuDNN's fused kernel where it is eligible (CUDA, sm90 and newer).

`F.scaled_dot_product_attention` picks its kernel when AOTAutograd traces the graph, by a priority
order that has changed across torch releases: torch 2.11 on an H200 already puts cuDNN first for the
inputs below (the pass then changes nothing there and only confirms the choice in the report); where a
release puts flash first, the pass moves cuDNN ahead of it. At the Qwen2.5-1.5B attention of the GRPO step
(12 query / 2 key-value heads, head dim 128, causal, 8 x 4352 tokens, bf16, grouped query attention as HF
passes it, `enable_gqa=True`) cuDNN's kernel takes 3.38 ms forward + backward against flash's 5.97 ms
(forward 0.84 against 1.45 ms): `python bench/bench_attention.py` (H200). This pass reroutes
each SDPA call through `sdpa_preferring_cudnn`, which puts cuDNN first in the priority order while
the call is traced, so the graph holds cuDNN's forward and backward. The maths is SDPA's; where
cuDNN refuses the inputs, SDPA's next choice applies, and the pass, which asks SDPA ahead of time
with the same inputs, reports the site as not accelerated with SDPA's choice instead.

Where the site goes to cuDNN, the call becomes `fastgrpo::attention` (fastgrpo/kernels/attention.py): the
same kernel, whose output and log-sum-exp a checkpoint's re-run of the layer takes back instead of running
attention again (option `keep_attention_output`; None, the default, on CUDA only; True also on the CPU, with
SDPA's CPU flash kernel). Outside a checkpoint it is SDPA's computation.

Nothing else is recorded for graphs on the CPU: SDPA's own CPU kernel is what runs there.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastgrpo.kernels import attention as attention_kernel
from fastgrpo.kernels import packed_attention as _packed_attention_ops  # noqa: F401  (registers the flash op)
from fastgrpo.passes._fx import arg, error_summary, is_kind, site_name, value
from fastgrpo.passes._record import PatternRecord

NAME = "attention"

# SDPA's other backends in its own order, each kept only if the user has it enabled.
_FALLBACKS = (
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
)
_MIN_CAPABILITY = (9, 0)  # cuDNN first where it was measured faster (sm90); elsewhere SDPA's own order stands


def _preferred_order() -> list[SDPBackend]:
    return [SDPBackend.CUDNN_ATTENTION] + [backend for backend, enabled in _FALLBACKS if enabled()]


@contextlib.contextmanager
def _cudnn_first():
    """cuDNN's kernel first in SDPA's priority order, and the user's order back afterwards: torch 2.11's
    `sdpa_kernel(..., set_priority=True)` does not put it back on leaving ([1, 2, 0, 3, 4] becomes
    [3, 1, 2, 0, 4]), which would leave cuDNN first in the user's process for good."""
    previous = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel(_preferred_order(), set_priority=True):
            yield
    finally:
        torch._C._set_sdp_priority_order(previous)


def sdpa_preferring_cudnn(*args, **kwargs):
    """`F.scaled_dot_product_attention` with cuDNN's kernel first in SDPA's priority order."""
    with _cudnn_first():
        return F.scaled_dot_product_attention(*args, **kwargs)


# The Python functions this pass makes a graph call (not torch ops): the backend marks them cacheable for
# AOTAutograd, which otherwise refuses every graph that calls one (compiler/cache.py `cacheable_pass_functions`).
CALL_TARGETS = (attention_kernel.attention, sdpa_preferring_cudnn)


def _sdpa_inputs(node: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    return {name: arg(node, i, name, default) for i, (name, default) in enumerate(zip(names, defaults))}


def _example(x):
    return value(x) if isinstance(x, fx.Node) else x


# SDPA's kernel choice is asked with small real tensors laid out like the site's: asked with the graph's fake
# tensors, its meta implementation answers as if they were not on the GPU (always the math kernel).
_PROBE_LENGTH = 64
_SEQ_DIMS = {"query": (-2,), "key": (-2,), "value": (-2,), "attn_mask": (-2, -1)}


def _size(size, fallback: int) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)  # a symbolic size's value in this trace
    return hint if isinstance(hint, int) else fallback


def _probe(example, seq_dims: tuple[int, ...]):
    """A small real tensor like `example` (dtype, device, layout, requires_grad): batch 1, the sequence dims
    `_PROBE_LENGTH` long (or 1 where they broadcast), broadcast dims (stride 0) expanded again."""
    if not isinstance(example, torch.Tensor):
        return example
    rank = example.dim()
    sizes = [_size(size, 1) for size in example.shape]
    if rank == 4:
        sizes[0] = 1
    for dim in seq_dims:
        if sizes[dim] != 1:
            sizes[dim] = _PROBE_LENGTH
    strides = [_size(stride, 1) for stride in example.stride()]
    order = sorted(range(rank), key=lambda d: -strides[d])  # outermost first
    stored = [1 if strides[d] == 0 else sizes[d] for d in order]
    tensor = torch.zeros(stored, dtype=example.dtype, device=example.device)
    tensor = tensor.permute([order.index(d) for d in range(rank)]).expand(sizes)
    return tensor.requires_grad_(example.requires_grad) if example.dtype.is_floating_point else tensor


def _on_cuda(query) -> bool:
    return isinstance(query, torch.Tensor) and query.device.type == "cuda"


def _why_not_cudnn(inputs: dict) -> str | None:
    """None when SDPA, with cuDNN first, would run these inputs on cuDNN; else the reason."""
    query = _example(inputs["query"])
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp(False)): SDPA's own choice runs"
    capability = torch.cuda.get_device_capability(query.device)
    if capability < _MIN_CAPABILITY:
        return (f"cuDNN attention is preferred on sm90 and newer only (this GPU: sm{capability[0]}{capability[1]}): "
                "SDPA's own choice runs")
    if isinstance(query.shape[-2], int) and query.shape[-2] == 1:
        return "one query position (a decode step): SDPA's own choice runs"
    probe = {name: _example(x) for name, x in inputs.items()}
    probe.update({name: _probe(probe[name], seq_dims) for name, seq_dims in _SEQ_DIMS.items()})
    try:
        with _cudnn_first():
            choice = torch._fused_sdp_choice(**probe)
    except (RuntimeError, TypeError) as error:  # no kernel at all (SDPA says so itself when the graph runs), or
        # a torch whose private chooser reads other arguments: leave the site to SDPA either way
        return f"SDPA's kernel choice could not be asked ({error_summary(error)})"
    if choice != SDPBackend.CUDNN_ATTENTION.value:
        return f"cuDNN attention does not take these inputs (dtype, head dim, mask or layout): SDPA chose {SDPBackend(choice).name}"
    return None


def _hinted(x):
    """A number as this trace sees it: a graph value's example (a symbolic float's value in this trace: Dynamo
    makes a layer's float attributes, such as HF's attention dropout, inputs of a dynamic-shape graph)."""
    example = _example(x)
    if isinstance(example, (torch.SymFloat, torch.SymInt)):
        return getattr(example.node, "hint", None)
    return example


def _why_not_kept(inputs: dict) -> str | None:
    """None when fastgrpo::attention takes the site (and keeps its output for a checkpoint's re-run); else why not.
    (A symbolic dropout_p that is 0 in this trace is taken: the op's `if dropout_p` guards the graph on it.)"""
    dropout_p = _hinted(inputs["dropout_p"])
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (a re-run would have to replay the dropout mask)"
    mask = _example(inputs["attn_mask"])
    if isinstance(mask, torch.Tensor) and (mask.requires_grad or mask.dim() != 4):
        return "the mask is trained" if mask.requires_grad else f"a {mask.dim()}-D mask (the op takes 4-D masks)"
    query, key = _example(inputs["query"]), _example(inputs["key"])
    if query.dim() != 4 or key.dim() != 4:
        return "not [batch, heads, seq, head_dim] inputs"
    return None


_PACKED_FLASH = (torch.ops.fastgrpo.flash_packed_attention, torch.ops.fastgrpo.flash_packed_attention.default)
_PACKED_FLASH_KEEP = 9  # the op's `keep` argument


def _packed_flash_site(node: fx.Node, keep: bool | None, record: PatternRecord) -> bool:
    """Packed rows' flash attention (fastgrpo.integrations.packing) keeps its output unless keep_attention_output is
    False; whether rewritten."""
    if keep is False:
        if len(node.args) > _PACKED_FLASH_KEEP:
            node.update_arg(_PACKED_FLASH_KEEP, False)
        else:
            node.update_kwarg("keep", False)
        record.match(site_name(node), "flash variable-length (packed rows), output recomputed "
                                      "(keep_attention_output=False)")
        return True
    record.match(site_name(node), "flash variable-length (packed rows), output kept for a checkpoint's re-run")
    return False


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    keep = options.keep_attention_output
    rewritten = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _PACKED_FLASH:
            rewritten |= _packed_flash_site(node, keep, record)
            continue
        if not is_kind(node, "sdpa"):
            continue
        inputs = _sdpa_inputs(node)
        on_cuda = _on_cuda(_example(inputs["query"]))
        if not on_cuda and keep is not True:
            continue
        if on_cuda:
            reason = _why_not_cudnn(inputs)
            if reason is not None:
                record.miss(site_name(node), reason)
                continue
        kernel = "cudnn" if on_cuda else "CPU flash"
        why_not_kept = "keep_attention_output=False" if keep is False else _why_not_kept(inputs)
        if why_not_kept is None:
            node.target = attention_kernel.attention
            record.match(site_name(node), f"{kernel}, output kept for a checkpoint's re-run")
        elif on_cuda:
            node.target = sdpa_preferring_cudnn
            record.match(site_name(node), f"cudnn, output recomputed ({why_not_kept})")
        else:
            record.miss(site_name(node), f"output not kept: {why_not_kept}")
            continue
        rewritten = True
    if rewritten:
        gm.recompile()
