"""Pattern passes over Dynamo's FX graph, one file each, applied in this order.

Each pass module exposes `NAME` and `apply(gm, record, **options)`; it rewrites matched
sites into calls of `fastgrpo::` custom ops and records matches and near misses.
"""
from fastgrpo.passes import gated_mlp, rms_norm, rope, selective_logprob
from fastgrpo.passes._record import PatternRecord

PASSES = {
    selective_logprob.NAME: selective_logprob,
    rms_norm.NAME: rms_norm,
    rope.NAME: rope,
    gated_mlp.NAME: gated_mlp,
}

__all__ = ["PASSES", "PatternRecord"]
