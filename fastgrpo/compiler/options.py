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
            raise ValueError(
                f"unknown fastgrpo backend option(s) {unknown}; valid options are {sorted(valid)}{hint}"
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
