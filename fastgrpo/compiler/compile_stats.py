"""What compiling has cost since a point in the process: seconds, frames and graphs, and compile cache use.

    start = compile_stats.snapshot()
    ...                                   # run (and so compile) something
    stats = compile_stats.since(start)
    print(stats.line()); stats.log_fields()  # {"compile_s": ..., "compile/graphs": ..., ...}

Seconds are Dynamo's own timings (`torch._dynamo.utils.compile_times`): every frame compile (tracing, the
backend's passes, AOTAutograd and the inner compiler, cache lookups included) plus backward graphs compiled
lazily at their first backward. Graph and frame counts are Dynamo's counters; cache hits and misses are
AOTAutograd's (one lookup per graph) and inductor's FX graph cache's (one per forward, backward or inference
graph). Graphs compiled by `aot_eager` or `eager` use no cache: their hits and misses stay 0.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from torch._dynamo.utils import compile_times, counters, get_compilation_metrics

# Dynamo's timing keys of a whole frame compile and of a backward compiled later, at its first backward.
_TIMED = ("_compile.compile_inner", "backward._backward_impl")
_COUNTED = {
    "frames": ("frames", "ok"),
    "graphs": ("stats", "unique_graphs"),
    "aot_cache_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_cache_misses": ("aot_autograd", "autograd_cache_miss"),
    "aot_cache_bypasses": ("aot_autograd", "autograd_cache_bypass"),
    "fx_graph_cache_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_cache_misses": ("inductor", "fxgraph_cache_miss"),
    "fx_graph_cache_bypasses": ("inductor", "fxgraph_cache_bypass"),
}


@dataclass(frozen=True)
class Snapshot:
    seconds: float
    counts: dict
    metrics: tuple  # Dynamo's per-frame compilation records so far (held, so that their ids stay theirs)


def _seconds() -> float:
    names, values = compile_times(repr="csv", aggregate=True)
    return sum(float(value) for name, value in zip(names, values) if name in _TIMED)


def snapshot() -> Snapshot:
    return Snapshot(
        seconds=_seconds(),
        counts={name: counters[group][key] for name, (group, key) in _COUNTED.items()},
        metrics=tuple(get_compilation_metrics()),
    )


@dataclass
class CompileStats:
    seconds: float
    counts: dict
    # "forward (modeling_llama.py:284)" -> how many frame compiles of it finished
    frames: dict = field(default_factory=dict)

    def line(self, cache_dir: str | Path | None = None) -> str:
        c = self.counts
        what = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in self.frames.items()) or "nothing"
        text = (f"fastgrpo: {self.seconds:.1f} s compiling: {c['graphs']} graph(s) from {c['frames']} frame "
                f"compile(s) ({what})")
        if any(c[k] for k in _COUNTED if "cache" in k):
            text += (f"; compile cache: AOTAutograd {c['aot_cache_hits']} hit(s) / {c['aot_cache_misses']} miss(es), "
                     f"FX graphs {c['fx_graph_cache_hits']} / {c['fx_graph_cache_misses']}")
            bypasses = c["aot_cache_bypasses"] + c["fx_graph_cache_bypasses"]
            if bypasses:
                text += f", {bypasses} bypassed"
        elif c["graphs"]:
            text += "; no compile cache used (the inner compiler is not inductor)"
        if cache_dir is not None:
            text += f" [{cache_dir}]"
        return text

    def log_fields(self) -> dict:
        return {"compile_s": round(self.seconds, 2), **{f"compile/{name}": n for name, n in self.counts.items()}}


def since(start: Snapshot) -> CompileStats:
    now = snapshot()
    seen = {id(m) for m in start.metrics}
    frames = collections.Counter(
        f"{m.co_name} ({Path(m.co_filename or '?').name}:{m.co_firstlineno})"
        for m in get_compilation_metrics()
        if id(m) not in seen and m.has_guarded_code and m.co_name
    )
    return CompileStats(
        seconds=now.seconds - start.seconds,
        counts={name: now.counts[name] - start.counts[name] for name in _COUNTED},
        frames=dict(frames),
    )
