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
    # in backward. False keeps gate and up for backward (fastgrpo::act_mul). Which form a training step takes:
    # `training_options` below.
    absorb_mlp_projections: bool = True
    # With the projections absorbed, keep the gate and up projections (LoRA included, [tokens, 2I]) for backward
    # instead of recomputing them. Saves the same as act_mul but nothing else of [tokens x intermediate]: the
    # product, its gradient and dgate/dup exist only chunk by chunk inside the op.
    save_mlp_projections: bool = False
    # Join linears of one input (q, k, v; their LoRA A's) into one GEMM each (passes/joined_projections.py). None:
    # for CUDA weights only, where the saved reads of x pay (H200, Qwen2.5-1.5B GRPO step at 4096: 732 against
    # 743 ms, `python bench/grpo_step.py --systems fastgrpo,fastgrpo_nojoin --completions 4096`); on the CPU the
    # joined GEMM only sums in another order (fp32 results then differ from stock TRL's in the last bits). True
    # or False: everywhere or nowhere.
    join_projections: bool | None = None
    # Attention sites as fastgrpo::attention, whose output and log-sum-exp a checkpoint's re-run of the layer takes
    # back instead of computing attention again (kept in host memory under offloaded checkpointing). None: on CUDA,
    # where the site runs on cuDNN; True: also on the CPU (SDPA's CPU flash kernel); False: SDPA everywhere.
    keep_attention_output: bool | None = None
    # Inductor's combo kernels for graphs on CUDA: independent small kernels of a graph (the LoRA factors' casts, the
    # norms' side outputs) launched as one. None: on unless $FASTGRPO_COMBO_KERNELS=0. H200, Qwen2.5-1.5B
    # step at 1024: 220 and 227 ms against 243 and 256 (`python bench/grpo_step.py --systems
    # fastgrpo|fastgrpo_nocombo --completions 1024`, four processes alternating).
    combo_kernels: bool | None = None
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


# The options that choose the gated MLP's form; a user who sets either keeps their choice.
MLP_FORM_OPTIONS = ("absorb_mlp_projections", "save_mlp_projections")


def training_options(options: dict | None, *, device_type: str, checkpointing: bool, offload: bool,
                     packing: bool) -> dict | None:
    """The backend options for a training step's forward: `options` (the user's, which win) plus the gated MLP's
    form for the situation. Under gradient checkpointing each layer's forward runs twice, so the form depends on
    what the checkpoint's recompute does:

    | device | checkpointing | offloaded | packed | form                                 | option added                 |
    |--------|---------------|-----------|--------|--------------------------------------|------------------------------|
    | any    | no            | -         | -      | the op keeps x (`options` unchanged) | -                            |
    | cuda   | yes           | yes       | any    | the op keeps x                       | -                            |
    | cuda   | yes           | no        | no     | the op keeps gate and up             | save_mlp_projections=True    |
    | cuda   | yes           | no        | yes    | act_mul                              | absorb_mlp_projections=False |
    | cpu    | yes           | any       | any    | act_mul                              | absorb_mlp_projections=False |

    Why (H200, Qwen2.5-1.5B GRPO step, `bench/grpo_step.py`):
    - offloaded: the recompute skips the MLP (the op is told its output feeds only the residual add), so the op
      recomputes the projections once, in its backward: as fast as keeping gate/up at 4.75 against 5.88 GiB
      (4096 padded, 792 ms both: `--systems fastgrpo,fastgrpo_save --completions 4096`), and faster and leaner
      than act_mul packed (480 ms, 4.27 GiB against 503 ms, 5.25 GiB: `--systems
      fastgrpo_packed,fastgrpo_packed_actmul --spread --completions 4096`).
    - HF's own checkpointing (layers not offloaded), where the recompute runs the whole MLP: padded, keeping
      gate/up spares the op's second recompute (12.5 against 18.2 GiB for act_mul at 16384, 1-2 % slower);
      packed, act_mul is leaner and faster than keeping gate/up (683 ms, 5.97 GiB against 706 ms, 7.96 GiB at
      prompt 1024, completions spread over 10-100 % of 4096).
    - CPU: memory is not what limits, and act_mul is the faster form (the main job's step: 5.9 s against 9.3 s
      with the op's torch path; `fastgrpo train` against `fastgrpo train --backend-options
      inner=aot_eager,absorb_mlp_projections=true`, 2-core CPU).
    """
    if not checkpointing or set(MLP_FORM_OPTIONS) & set(options or {}):
        return options
    if device_type == "cuda" and offload:
        form = {}
    elif device_type == "cuda" and not packing:
        form = {"save_mlp_projections": True}
    else:
        form = {"absorb_mlp_projections": False}
    return {**form, **(options or {})}


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
