"""Options of the fastgrpo backend: `torch.compile(m, backend="fastgrpo", options={...})`."""
import difflib
import json
import typing
from dataclasses import dataclass, field, fields

from fastgrpo.errors import UserError
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
    # Fold the gated MLP's gate/up projections into fastgrpo::gated_mlp, which keeps only x and recomputes them
    # in backward. False keeps gate and up (fastgrpo::act_mul): under gradient checkpointing the layer's forward
    # is re-run anyway and the recompute is paid twice (H200, Qwen2.5-1.5B GRPO step at 4096: 1170 ms / 7.7 GiB
    # absorbed vs 896 ms / 9.5 GiB kept), so under checkpointing the TRL integration sets False for packed
    # batches and on CPU (GRPOTrainer._compile_options).
    absorb_mlp_projections: bool = True
    # With the projections absorbed, keep the gate and up projections (LoRA included, [tokens, 2I]) for backward
    # instead of recomputing them: for checkpointed layers, whose forward is re-run anyway (the TRL integration
    # sets it under checkpointing for padded batches on CUDA). Saves the same as act_mul but nothing else of [tokens x intermediate]:
    # the product, its gradient and dgate/dup exist only chunk by chunk inside the op.
    save_mlp_projections: bool = False
    # Join linears of one input (q, k, v; their LoRA A's) into one GEMM each (passes/joined_projections.py). None:
    # for CUDA weights only, where the saved reads of x pay (H200, Qwen2.5-1.5B GRPO step at 4096: 732 against 743
    # ms); on the CPU the joined GEMM only sums in another order (fp32 results then differ from stock TRL's in the
    # last bits). True or False: everywhere or nowhere.
    join_projections: bool | None = None
    # Attention sites as fastgrpo::attention, whose output and log-sum-exp a checkpoint's re-run of the layer takes
    # back instead of computing attention again (kept in host memory under offloaded checkpointing). None: on CUDA,
    # where the site runs on cuDNN; True: also on the CPU (SDPA's CPU flash kernel); False: SDPA everywhere.
    keep_attention_output: bool | None = None
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
            hint = ""
            if "offload_checkpointing" in unknown:
                # The backend sees one graph at a time; offloading wraps the model's layers.
                hint = ("; offload_checkpointing acts on the model's layers, not on a graph: use "
                        "fastgrpo.compile_repeated_blocks(model, offload_checkpointing=True)")
            close = [m for name in unknown for m in difflib.get_close_matches(name, valid, n=1)]
            hint += f"; did you mean {' or '.join(close)}?" if close else ""
            raise UserError(
                f"unknown fastgrpo backend option(s) {unknown}; valid options are {sorted(valid)}{hint}"
            )
        _check_types(cls, options)
        if "patterns" in options:
            patterns = options["patterns"]
            if isinstance(patterns, str):
                patterns = (patterns,)
            bad = sorted(set(patterns) - set(PASSES))
            if bad:
                raise UserError(f"unknown fastgrpo pattern(s) {bad}; known patterns are {list(PASSES)}")
            options["patterns"] = tuple(p for p in PASSES if p in patterns)
        if options.get("inner", "inductor") not in INNER_COMPILERS:
            raise UserError(
                f"fastgrpo option inner={options['inner']!r}; choose one of {list(INNER_COMPILERS)}"
            )
        return cls(**options)


_TYPE_NAMES = {bool: "true or false", type(None): "null (None)", str: "a string", dict: "a mapping"}


def _check_types(cls, options: dict) -> None:
    """Each option's value of the type its field declares (bool options take booleans only, not 1 or "yes")."""
    for f in fields(cls):
        if f.name not in options:
            continue
        value = options[f.name]
        if f.name == "patterns":
            allowed = isinstance(value, str) or isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value)
            expected = "a pattern name or a list of them"
        else:
            types = typing.get_args(f.type) or (f.type,)
            allowed = isinstance(value, types)
            expected = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
        if not allowed:
            raise UserError(f"fastgrpo option {f.name}={value!r}; it takes {expected}")


def checked_options(options: dict | str | None, source: str) -> dict | None:
    """`options` (a mapping, or a JSON object as text), checked with `Options.parse` where they enter (a config,
    a command line) rather than when the first graph compiles; a `UserError` naming `source` otherwise."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as error:
            raise UserError(f"{source}: {options!r} is not a JSON object ({error})") from None
    if options is not None and not isinstance(options, dict):
        raise UserError(f"{source}: expected a mapping of backend options, got {options!r}")
    try:
        Options.parse(options)
    except UserError as error:
        raise UserError(f"{source}: {error}") from None
    return options
