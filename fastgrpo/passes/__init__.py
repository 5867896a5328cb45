"""Pattern passes over Dynamo's FX graph, one file each, applied in this order.

RoPE goes before RMSNorm: where a norm follows the rotation (NanoChat, HunYuan apply q/k norms
after RoPE), the rotation's final add would otherwise be taken for a residual add and fused
into the norm, and the rotation lost. The gated MLP goes before RMSNorm for the same reason: where
the MLP's output feeds a post-norm (Gemma2, Gemma3, OLMo2), the add of a LoRA-wrapped down
projection (`base(h) + lora(h)`) would be fused into the norm as a residual add, and the down
projection could no longer be absorbed into the MLP op. Attention (which SDPA kernel runs) is
independent of the others. Joined projections go last: they take the linears no other pattern absorbed
(the MLP's gate and up are already in its op; q, k, v and their LoRA A's remain).

The contract of every pass in PASSES (the backend calls it once per graph, compiler/backend.py `_apply_pass`):

    NAME: str                                   # the pattern's name in options and fusion reports
    apply(gm: fx.GraphModule, record: PatternRecord, options) -> None

`options` is the backend's parsed `fastgrpo.compiler.options.Options` (a pass reads only the fields it owns).
`apply` rewrites matched sites of `gm.graph` in place - into calls of `fastgrpo::` custom ops; attention and
joined projections into other torch calls - and recompiles `gm` when it changed anything; it calls
`record.match(site, form)` for each rewritten site and `record.miss(site, reason)` for each site it recognised
but left alone. A pass that raises has that graph restored and the error reported by the backend.
`autocast.py` is not one of these patterns: the backend runs it first under ambient autocast, with its own
signature.
"""
from fastgrpo.passes import attention, gated_mlp, joined_projections, rms_norm, rope, selective_logprob
from fastgrpo.passes._record import PatternRecord

PASSES = {
    selective_logprob.NAME: selective_logprob,
    rope.NAME: rope,
    gated_mlp.NAME: gated_mlp,
    rms_norm.NAME: rms_norm,
    attention.NAME: attention,
    joined_projections.NAME: joined_projections,
}

# Python functions (not torch ops) that passes make graph calls: the backend marks them cacheable for AOTAutograd.
CALL_TARGETS = attention.CALL_TARGETS

__all__ = ["CALL_TARGETS", "PASSES", "PatternRecord"]
