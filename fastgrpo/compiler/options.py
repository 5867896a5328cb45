"""Options of the fastgrpo backend: `torch.compile(m, backend="fastgrpo", options={...})`."""
from dataclasses import dataclass, field, fields

from fastgrpo.passes import PASSES

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class Options:
    # What compiles the rewritten graph: inductor (default), aot_eager, or eager (no AOTAutograd).
    inner: str = "inductor"
    # Which patterns to apply; by default all of them.
    patterns: tuple[str, ...] = field(default_factory=lambda: tuple(PASSES))
    # Fuse the residual add that feeds an RMSNorm into the norm op.
    fuse_residual_add: bool = True
    # Print the fusion table after each graph is compiled.
    print_report: bool = False
    # Extra inductor config (passed to compile_fx as config_patches).
    inductor_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"unknown fastgrpo backend option(s) {unknown}; valid options are {sorted(valid)}"
            )
        if "patterns" in options:
            patterns = options["patterns"]
            if isinstance(patterns, str):
                patterns = (patterns,)
            bad = sorted(set(patterns) - set(PASSES))
            if bad:
                raise ValueError(f"unknown fastgrpo pattern(s) {bad}; known patterns are {list(PASSES)}")
            options["patterns"] = tuple(p for p in PASSES if p in patterns)
        if options.get("inner", "inductor") not in INNER_COMPILERS:
            raise ValueError(
                f"fastgrpo option inner={options['inner']!r}; choose one of {list(INNER_COMPILERS)}"
            )
        return cls(**options)
