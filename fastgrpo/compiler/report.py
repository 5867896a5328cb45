"""The fusion report: per compiled graph and pattern, what matched where and what did not, and why."""
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


def fusion_summary(reports: list[dict], graph_breaks: dict[str, int]) -> tuple[str, list[str]]:
    """What `reports` fused, in one line, and what was not accelerated, each reason once with its count: the
    near misses of the patterns and Dynamo's graph breaks (`graph_breaks`: reason -> count), whose code between
    graphs runs eagerly, outside every pattern."""
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
    return line, [f"{n}x {text}" for text, n in problems.items()]
