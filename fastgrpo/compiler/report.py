"""The fusion report: per compiled graph and pattern, what matched where and what did not, and why."""
import logging
import re
from dataclasses import dataclass, field

from fastgrpo.passes import PatternRecord


@dataclass
class FusionReport:
    graph: int
    kernels: str
    inner: str
    patterns: dict[str, PatternRecord] = field(default_factory=dict)
    # The ambient torch.autocast the graph was traced under, made explicit on its matmuls (None: off).
    autocast: str | None = None

    def record(self, pattern: str) -> PatternRecord:
        return self.patterns.setdefault(pattern, PatternRecord(pattern))

    def as_dict(self) -> dict:
        return {
            "graph": self.graph,
            "kernels": self.kernels,
            "inner": self.inner,
            "autocast": self.autocast,
            "patterns": {name: rec.as_dict() for name, rec in self.patterns.items()},
        }


_REPORTS: list[FusionReport] = []


def new_report(kernels: str, inner: str) -> FusionReport:
    """A report for a graph being compiled; it joins `fusion_reports()` only through `publish`."""
    return FusionReport(graph=-1, kernels=kernels, inner=inner)


def publish(report: FusionReport) -> None:
    report.graph = len(_REPORTS)
    _REPORTS.append(report)


def fusion_reports() -> list[dict]:
    """The reports of every graph the fastgrpo backend compiled in this process, as plain dicts:
    {"graph", "kernels", "inner", "patterns": {name: {"matched", "sites", "near_misses"}}}."""
    return [r.as_dict() for r in _REPORTS]


def clear_fusion_reports() -> None:
    _REPORTS.clear()


def format_reports(reports: list[dict]) -> str:
    """A readable table: one row per graph and pattern, then every near miss with its reason."""
    lines = [f"{'graph':>5}  {'pattern':<18} {'matched':>7} {'missed':>6}  forms"]
    misses = []
    for report in reports:
        for name, rec in report["patterns"].items():
            forms: dict[str, int] = {}
            for site in rec["sites"]:
                forms[site["form"]] = forms.get(site["form"], 0) + 1
            form_text = "; ".join(f"{n}x {f}" for f, n in forms.items()) or "-"
            lines.append(
                f"{report['graph']:>5}  {name:<18} {rec['matched']:>7} {len(rec['near_misses']):>6}  {form_text}"
            )
            misses += [(report["graph"], name, m) for m in rec["near_misses"]]
    kernels = sorted({r["kernels"] for r in reports})
    lines.append(f"kernels: {', '.join(kernels) or '-'}")
    lines += sorted({f"autocast: {r['autocast']}" for r in reports if r.get("autocast")})
    if misses:
        lines.append("not accelerated:")
        lines += [f"  graph {g} {name} at {m['site']}: {m['reason']}" for g, name, m in misses]
    return "\n".join(lines)


# Dynamo breaks the graph at an op whose output value or shape depends on tensor data (Tensor.item() and
# aten._local_scalar_dense, nonzero, torch.where with one argument: MoE routing loops) unless these two flags are
# set; the hint of every such break names one of them. They cannot be scoped to the backend (torch.compile hides a
# non-inductor backend's config context behind its wrapper), and setting them on import would change how
# unrelated code traces: the user sets them.
CAPTURE_FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
CAPTURE_FIX = (
    "to trace data-dependent ops into the graph instead, set Dynamo's capture flags while it traces: run the "
    "compiled calls inside `with torch._dynamo.config.patch(capture_scalar_outputs=True, "
    "capture_dynamic_output_shape_ops=True):` (every call that may compile: a recompile for a new shape outside "
    "it breaks again), or set both in torch._dynamo.config before training"
)


def is_data_dependent_break(reason: str) -> bool:
    """Whether a graph break is one that Dynamo's capture flags remove (its hint names one of them)."""
    return any(flag in reason for flag in CAPTURE_FLAGS)


class GraphBreakLog(logging.Handler):
    """Dynamo's graph-break log (what TORCH_LOGS="graph_breaks" prints), collected while open (`with`, or
    start() / stop()) into `breaks` (reason -> count), and printed nowhere unless the user asked for that log.
    It names every break, where counters["graph_break"] misses two kinds: a break inside a loop or one Dynamo
    cannot resume from, after which it skips the whole frame (the frame runs eagerly and its callees are compiled
    one by one: LongCat-Flash's dozen graphs), and a break raised as a UserError, such as a guard on a data-dependent
    value (a Python loop over the rows of a nonzero(), which even Dynamo's capture flags cannot trace)."""

    _BOILERPLATE = ("For more information", "For extended logs", "If you suspect", "For more debugging help",
                    "For C++ stack trace")

    def __init__(self):
        super().__init__()
        self.breaks: dict[str, int] = {}
        self.loggers: list[logging.Logger] = []
        self.saved: list[tuple[int, bool]] = []

    def start(self) -> "GraphBreakLog":
        if self.loggers:  # already collecting
            return self
        self.loggers = [log for log in logging.Logger.manager.loggerDict.values()
                        if getattr(log, "artifact_name", None) == "graph_breaks"]
        self.saved = [(log.level, log.propagate) for log in self.loggers]
        for log in self.loggers:
            if not log.isEnabledFor(logging.DEBUG):  # the user did not ask for it: enable it for us alone
                log.setLevel(logging.DEBUG)
                log.propagate = False
            log.addHandler(self)
        return self

    def stop(self) -> None:
        for log, (level, propagate) in zip(self.loggers, self.saved):
            log.removeHandler(self)
            log.setLevel(level)
            log.propagate = propagate
        self.loggers, self.saved = [], []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def result(self) -> dict[str, int]:
        """The breaks logged, or Dynamo's counter of breaks if the log named none (should its format change)."""
        from torch._dynamo.utils import counters

        return dict(self.breaks) or dict(counters["graph_break"])

    def emit(self, record):
        message = record.getMessage()
        found = re.search(r"in user code at (.+?:\d+)\nGraph Break Reason: (.*)", message, re.S)
        skipped = re.search(r"skip tracing the frame (.+?) and fall back", message)
        if found:
            where, reason = found[1], found[2]
        elif skipped and record.exc_info:  # a frame skipped for a break logged nowhere else: the exception says why
            where, reason = skipped[1], str(record.exc_info[1])
        else:  # the verbose copy of a break that Dynamo logs again as one
            return
        stack = r"\n(?:User code traceback|Stack variable source attribution|User Stack \(most recent call last\)):"
        reason = re.split(stack, reason)[0].strip()
        # Drop what Dynamo says about the bytecode it stopped at ("Encountered graph break when attempting to
        # trace CALL: ...:") and, for a UserError, its debugging boilerplate; keep the reason itself.
        first, _, rest = reason.partition("\n")
        if first.endswith(":") and rest.strip():
            reason = rest.strip()
        lines = [line for line in reason.splitlines() if not line.startswith(self._BOILERPLATE)]
        reason = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        if "Explanation:" not in reason:  # not one of Dynamo's catalogued breaks: say where it happened
            reason += f" (at {where})"
        reason = re.sub(r"[^\s(\"']*/site-packages/", "", reason)  # the same text on every machine
        self.breaks[reason] = self.breaks.get(reason, 0) + 1


def fusion_summary(reports: list[dict], graph_breaks: dict[str, int]) -> tuple[str, list[str]]:
    """What `reports` fused, in one line, and what was not accelerated, each reason once with its count: the
    near misses of the patterns and Dynamo's graph breaks (`graph_breaks`: reason -> count), whose code between
    graphs runs eagerly, outside every pattern; when some break is at a data-dependent op, the last entry says
    how to trace it (Dynamo's capture flags)."""
    matched: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    problems: dict[str, int] = {}
    for report in reports:
        for name, rec in report["patterns"].items():
            matched[name] = matched.get(name, 0) + rec["matched"]
            for site in rec["sites"]:
                if "fallback" in site["form"]:
                    text = f"{name} as {site['form']}"
                    fallbacks[text] = fallbacks.get(text, 0) + 1
            for miss in rec["near_misses"]:
                text = f"{name} not accelerated: {miss['reason']}"
                problems[text] = problems.get(text, 0) + 1
    for reason, count in graph_breaks.items():
        text = f"graph break (the code around it runs uncompiled): {reason}"
        problems[text] = problems.get(text, 0) + count
    fused = ", ".join(f"{name} {n}" for name, n in matched.items() if n) or "nothing"
    line = f"fastgrpo: {len(reports)} graph(s) compiled; sites fused: {fused}"
    if fallbacks:
        line += " (" + "; ".join(f"{n}x {text}" for text, n in fallbacks.items()) + ")"
    lines = [f"{n}x {text}" for text, n in problems.items()]
    if any(is_data_dependent_break(reason) for reason in graph_breaks):
        lines.append(f"fix for the graph break(s) at data-dependent ops: {CAPTURE_FIX}")
    return line, lines
