"""The trainer's account of compiling, when the first step ends: what the backend fused and what it did not
(`FusionSummary`), and what compiling cost (`CompileLog`).

CompileLog's line says how many seconds went to compiling since training began, how many graphs from which frames,
and the persistent compile cache's hits and misses; the first log entry after it (the first line of the main
job's train_log.jsonl) carries the same as `compile_s` and `compile/...` counts
(fastgrpo.compiler.compile_stats). The cache's manifest is written then and when training ends
(fastgrpo.compiler.cache).
"""
from __future__ import annotations

import warnings

from transformers import TrainerCallback

from fastgrpo.compiler import compile_stats, fusion_reports, fusion_summary
from fastgrpo.compiler.cache import CompileCache
from fastgrpo.compiler.report import GraphBreakLog


class FusionSummary(TrainerCallback):
    """After the first optimizer step, says once (main process) what the backend has fused in this process, and
    warns with every site it could not accelerate and every graph break, each with its reason: nothing falls back
    silently. (Graphs compiled earlier in the process are reused, not compiled again: they count too.)"""

    def __init__(self):
        self.done = False
        # Dynamo's graph-break log while the first step compiles: unlike its counter it names breaks in loops,
        # after which Dynamo skips the whole frame, and data-dependent guards (GraphBreakLog).
        self.graph_breaks = GraphBreakLog()

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.done:
            self.graph_breaks.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.graph_breaks.stop()

    def on_step_end(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        self.graph_breaks.stop()
        if not state.is_world_process_zero:
            return
        line, problems = fusion_summary(fusion_reports(), self.graph_breaks.result())
        print(line, flush=True)
        if problems:
            warnings.warn("fastgrpo: not accelerated (graphs compiled in this process so far):\n  " + "\n  ".join(problems),
                          stacklevel=2)


class CompileLog(TrainerCallback):
    """When the first step ends: prints what compiling cost since training began (main process), keeps its fields
    for the next log entry (`pop_fields`) and writes the compile cache's manifest (again when training ends)."""

    def __init__(self, cache: CompileCache | None):
        self.cache = cache
        self.start = None
        self.done = False
        self.pending: dict = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = compile_stats.snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        if self.done or self.start is None:
            return
        self.done = True
        stats = compile_stats.since(self.start)
        self.pending = stats.log_fields()
        if state.is_world_process_zero:
            print(stats.line(None if self.cache is None else self.cache.directory), flush=True)
        if self.cache is not None:
            self.cache.record()

    def on_train_end(self, args, state, control, **kwargs):
        if self.cache is not None:
            self.cache.record()

    def pop_fields(self) -> dict:
        """The first step's compile fields, once (for the next log entry)."""
        fields, self.pending = self.pending, {}
        return fields
