"""lm-head + log-softmax + pick-the-target becomes `fastgrpo::selective_logprob`, so the
[tokens x vocab] logits are never materialised.

Anchors: `log_softmax(z, -1)` read only through `gather(-1, idx)`; `cross_entropy(z, t)`;
and `gather(z, -1, idx) - logsumexp(z, -1)`. From the anchor the pass walks back from z
to a bias-free `linear(h, W)` through casts, scalar multiplies/divides (logit scale,
temperature), the `cap * tanh(z / cap)` soft-cap, reshapes and token selections such as
TRL's `logits[:, :-1, :]` (moved onto the hidden states, so only the kept rows are
computed). The logits must have no other user: a graph that also returns them to its
caller is reported, not rewritten.

Deliberate numerical change: the op computes logits and log-softmax in fp32 even where
the model ran log_softmax in bf16 (as HF does for bf16 models); its fp32 result is then
cast to the dtype the graph expected.
"""
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from fastgrpo.kernels.selective_logprob import selective_logprob
from fastgrpo.passes._fx import (
    erase_unused,
    SUPPORTED_DTYPES, arg, binary_operands, dtype, is_empty, is_kind, kind, is_scalar, normalized_dim, only_user,
    propagate_meta, shape, site_name, value,
)
from fastgrpo.passes._record import PatternRecord

NAME = "selective_logprob"


class Miss(Exception):
    pass


@dataclass
class _Head:
    hidden: fx.Node
    weight: fx.Node
    logit_scale: float = 1.0
    softcap: float = 0.0
    temperature: float = 1.0
    nodes: list[fx.Node] = field(default_factory=list)  # linear .. z, all replaced
    # Token selections of the logits (`logits[:, :-1, :]`, as TRL writes it) moved onto the
    # hidden states, innermost first, and the rank of the hidden states after them.
    hidden_index: list = field(default_factory=list)
    hidden_rank: int = 0


def _softcap_input(node: fx.Node) -> tuple[fx.Node, float] | None:
    """x and cap for `tanh(x / cap) * cap` (Gemma2's final-logit soft-capping)."""
    if not is_kind(node, "mul"):
        return None
    a, b = binary_operands(node)
    tanh, cap = (a, b) if is_kind(a, "tanh") else (b, a)
    if not is_kind(tanh, "tanh") or not is_scalar(cap) or isinstance(cap, fx.Node):
        return None
    inner = arg(tanh, 0, "input")
    if is_kind(inner, "div") and arg(inner, 1, "other") == cap:
        return arg(inner, 0, "input"), float(cap)
    if is_kind(inner, "mul") and is_scalar(arg(inner, 1, "other"), 1.0 / cap):
        return arg(inner, 0, "input"), float(cap)
    return None


def _token_index(node: fx.Node):
    """The index of `logits[index]` when it selects tokens only (slices, ints, None, Ellipsis)
    and leaves the vocabulary dim whole: the same index then applies to the hidden states."""
    index = node.args[1]
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(not (e is None or e is Ellipsis or isinstance(e, (int, slice))) for e in entries):
        return None
    rank = len(shape(node.args[0]))
    if Ellipsis in entries:
        trailing = [e for e in entries[entries.index(Ellipsis) + 1:] if e is not None]
        whole_last = not trailing or trailing[-1] == slice(None)
    else:
        consuming = [e for e in entries if e is not None]
        whole_last = len(consuming) < rank or (len(consuming) == rank and consuming[-1] == slice(None))
    return index if whole_last else None


def _trace_head(z: fx.Node) -> _Head:
    """Walk back from the log-softmax input to the lm-head linear."""
    nodes, post_scale, pre_scale, cap = [], 1.0, 1.0, 0.0
    indexes, rank_after_index = [], None
    node = z
    while True:
        nodes.append(node)
        if is_kind(node, "linear"):
            if arg(node, 2, "bias") is not None:
                raise Miss("lm-head linear has a bias")
            hidden, weight = arg(node, 0, "input"), arg(node, 1, "weight")
            if len(shape(weight) or ()) != 2:
                raise Miss("lm-head weight is not 2-D")
            if dtype(hidden) not in SUPPORTED_DTYPES or dtype(weight) != dtype(hidden):
                raise Miss(f"hidden {dtype(hidden)} and lm-head weight {dtype(weight)}: the op takes one of "
                           f"float32/float16/bfloat16 for both")
            if is_empty(hidden):
                raise Miss(f"zero-size hidden states {shape(hidden)}: nothing to accelerate")
            scale = pre_scale if cap else pre_scale * post_scale
            return _Head(hidden, weight, logit_scale=scale, softcap=cap,
                         temperature=1.0 / post_scale if cap else 1.0, nodes=nodes[::-1],
                         hidden_index=indexes[::-1], hidden_rank=rank_after_index or len(shape(node)))
        if is_kind(node, "getitem") and (index := _token_index(node)) is not None:
            rank_after_index = rank_after_index or len(shape(node))
            indexes.append(index)
            node = node.args[0]
        elif is_kind(node, "cast", "view"):
            if is_kind(node, "view") and indexes:
                raise Miss("logits selected after a reshape: the selection cannot move onto the hidden states")
            if is_kind(node, "cast") and dtype(node) not in (torch.float32, dtype(node.args[0])):
                raise Miss(f"logits cast to {dtype(node)}")
            node = node.args[0]
        elif (softcapped := _softcap_input(node)) is not None:
            if cap:
                raise Miss("two soft-caps")
            nodes += [n for n in node.all_input_nodes] + list(node.all_input_nodes[0].all_input_nodes)
            node, cap = softcapped
        elif is_kind(node, "div") and is_scalar(arg(node, 1, "other")) and not isinstance(arg(node, 1, "other"), fx.Node):
            factor = 1.0 / float(arg(node, 1, "other"))
            if cap:
                pre_scale *= factor
            else:
                post_scale *= factor
            node = arg(node, 0, "input")
        elif is_kind(node, "mul") and any(is_scalar(o) and not isinstance(o, fx.Node) for o in binary_operands(node)):
            a, b = binary_operands(node)
            factor, node = (float(a), b) if is_scalar(a) else (float(b), a)
            if cap:
                pre_scale *= factor
            else:
                post_scale *= factor
        else:
            stopped = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
            hint = ("; a product is a linear only against a transposed [out, in] weight: h @ W.t(), einsum('...d,vd->...v')"
                    if is_kind(node, "matmul", "einsum", "addmm") else "")
            raise Miss(f"log-softmax input does not come from a linear (stopped at {stopped}{hint})")
        if len(node.users) != 1:
            raise Miss("the full logits are used elsewhere (e.g. returned to the caller)")


def _gather_targets(gather: fx.Node, z_dim: int) -> fx.Node | None:
    if normalized_dim(arg(gather, 1, "dim"), z_dim) != z_dim - 1:
        return None
    return arg(gather, 2, "index")


def _emit(graph: fx.Graph, head: _Head, targets, at: fx.Node, out_like: fx.Node,
          gather_index=True, negate=False, keepdim=False):
    """Insert the op before `at`; return the node that replaces `out_like`. A gather index
    has a trailing dim of 1 that the op's targets do not."""
    with graph.inserting_before(at):
        flat_targets = targets
        if gather_index:
            last = len(shape(targets)) - 1
            if is_kind(targets, "unsqueeze") and normalized_dim(arg(targets, 1, "dim"), last + 1) == last:
                flat_targets = arg(targets, 0, "input")
            else:
                flat_targets = graph.call_method("squeeze", (targets, -1))
        hidden = head.hidden
        for index in head.hidden_index:
            hidden = graph.call_function(operator.getitem, (hidden, index))
            hidden.meta["example_value"] = value(hidden.args[0])[fx.node.map_arg(index, value)]
        target_rank = len(shape(targets)) - (1 if gather_index else 0)
        if target_rank == 1 and head.hidden_rank > 2:  # logits were viewed as [tokens, V]
            hidden = graph.call_method("flatten", (hidden, 0, -2))
        new = graph.call_function(
            selective_logprob, (hidden, head.weight, flat_targets),
            {"temperature": head.temperature, "logit_scale": head.logit_scale, "softcap": head.softcap},
        )
        result = new
        if negate:
            result = graph.call_function(operator.neg, (result,))
        if keepdim:
            result = graph.call_method("unsqueeze", (result, -1))
        if dtype(out_like) not in (None, torch.float32):
            result = graph.call_function(torch.Tensor.to, (result, dtype(out_like)))
    propagate_meta(result, out_like)
    return result


def _match_log_softmax(graph: fx.Graph, node: fx.Node) -> str | None:
    z = arg(node, 0, "input")
    if normalized_dim(arg(node, 1, "dim"), len(shape(z))) != len(shape(z)) - 1:
        return None
    users = list(node.users)
    if len(users) != 1 or not is_kind(users[0], "gather"):
        raise Miss("log-softmax output is read other than through one gather (the full log-probs are used)")
    gather = users[0]
    if len(z.users) != 1:
        raise Miss("the full logits are used elsewhere (e.g. returned to the caller)")
    targets = _gather_targets(gather, len(shape(z)))
    if targets is None:
        raise Miss("gather over another dim than the vocabulary")
    head = _trace_head(z)
    squeeze = only_user(gather)
    if is_kind(squeeze, "squeeze"):
        out, keepdim = squeeze, False
    else:
        out, keepdim = gather, True
    out.replace_all_uses_with(_emit(graph, head, targets, out, out, keepdim=keepdim))
    erase_unused(graph, [*head.nodes, node, gather, out])
    return "log_softmax + gather"


def _match_cross_entropy(graph: fx.Graph, node: fx.Node) -> str | None:
    if arg(node, 2, "weight") is not None or arg(node, 7, "label_smoothing", 0.0):
        raise Miss("cross_entropy with class weights or label smoothing")
    if arg(node, 4, "ignore_index", -100) != -100:
        raise Miss("cross_entropy with an ignore_index other than -100")
    reduction = arg(node, 6, "reduction", "mean")
    logits, targets = arg(node, 0, "input"), arg(node, 1, "target")
    if len(shape(logits)) != 2:
        raise Miss("cross_entropy over logits that are not [tokens, vocab]")
    if len(logits.users) != 1:
        raise Miss("the full logits are used elsewhere (e.g. returned to the caller)")
    head = _trace_head(logits)
    with graph.inserting_before(node):
        if reduction == "none":
            result = _emit(graph, head, targets, node, node, gather_index=False, negate=True)
        elif reduction in ("sum", "mean"):
            per_token = _emit(graph, head, targets, node, node, gather_index=False, negate=True)
            result = graph.call_method("sum", (per_token,))
            if reduction == "mean":
                count = graph.call_method("sum", (graph.call_function(operator.ne, (targets, -100)),))
                result = graph.call_function(operator.truediv, (result, count))
            if dtype(node) not in (None, torch.float32):
                result = graph.call_function(torch.Tensor.to, (result, dtype(node)))
        else:
            raise Miss(f"cross_entropy reduction={reduction!r}")
    propagate_meta(result, node)
    node.replace_all_uses_with(result)
    erase_unused(graph, [*head.nodes, node])
    return f"cross_entropy ({reduction})"


def _match_logsumexp(graph: fx.Graph, node: fx.Node) -> str | None:
    """`gather(z, -1, idx).squeeze(-1) - logsumexp(z, -1)`."""
    z = arg(node, 0, "input")
    rank = len(shape(z))
    if normalized_dim(arg(node, 1, "dim"), rank) != rank - 1 or arg(node, 2, "keepdim", False):
        return None
    sub = only_user(node)
    gathers = [u for u in z.users if is_kind(u, "gather")]
    if not is_kind(sub, "sub") or len(gathers) != 1 or set(z.users) != {node, gathers[0]}:
        return None
    gather = gathers[0]
    squeeze = only_user(gather)
    if not is_kind(squeeze, "squeeze") or binary_operands(sub) != (squeeze, node):
        return None
    targets = _gather_targets(gather, rank)
    if targets is None:
        return None
    head = _trace_head(z)
    sub.replace_all_uses_with(_emit(graph, head, targets, sub, sub))
    erase_unused(graph, [*head.nodes, gather, squeeze, node, sub])
    return "gather - logsumexp"



_ANCHORS = {"log_softmax": _match_log_softmax, "cross_entropy": _match_cross_entropy, "logsumexp": _match_logsumexp}


def apply(gm: fx.GraphModule, record: PatternRecord, options) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.graph is not graph or not is_kind(node, *_ANCHORS):
            continue
        try:
            form = _ANCHORS[kind(node)](graph, node)
        except Miss as miss:
            record.miss(site_name(node), str(miss))
            continue
        if form:
            record.match(site_name(node), f"{form}, fp32 log-softmax")
    graph.lint()
    gm.recompile()
