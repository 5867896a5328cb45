"""The whole GRPO step a user waits for: real `trainer.train()` steps of fastgrpo's GRPOTrainer against stock TRL's.

One system per process (`--system`), the same model, data and config for each: a random-init model of a named shape
in bf16 (`--shape`, bench/_harness.py's names: Qwen2.5-1.5B by default, Gemma-3-1B with its sliding-window layers), PEFT LoRA r=16 on every projection,
8 prompts x G=8 completions, 256-token prompts, completions up to 512 tokens (`--completion`; a random-init model
never samples EOS, so every row runs to the limit), a reward that costs nothing, gradient checkpointing, bf16. Each
step: generation, scoring (rewards, advantages, the no-grad log-prob passes TRL runs: with beta > 0 the reference
model's, fastgrpo's default beta=0.001 against TRL's 0.0; `--beta` sets one for both), and the update (loss forward
and backward, optimizer). Timed with CUDA synchronisation around TRL's own methods: generation is
`_generate_single_turn`, scoring is the rest of `_generate_and_score_completions`, update the rest of the step.
The first `--warmup` steps (compiles) are reported apart; the table gives the median of the timed steps.

    python bench/grpo_train_step.py --system fastgrpo            # then --system trl; rows appended to
    python bench/grpo_train_step.py --system trl                 #   bench/results/grpo_train_step.jsonl
    python bench/grpo_train_step.py --system fastgrpo --shape gemma-3-1b   # sliding-window layers
    python bench/grpo_train_step.py --table                      # the rows of this tree's commit, as a table
    python bench/grpo_train_step.py --system fastgrpo --tiny     # CPU smoke run: a 2-layer model, short rows
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import _harness as harness  # noqa: E402

SPECIAL = ["<pad>", "<eos>"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["fastgrpo", "trl"], help="the trainer to time (one per process)")
    p.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows a forward and backward takes (per_device_train_batch_size; gradient accumulation over the "
                   "step's prompts x generations rows, one rollout a step); default: all rows at once")
    p.add_argument("--beta", type=float, default=None,
                   help="the KL weight, for both systems; default: each trainer's own (fastgrpo 0.001, which adds a "
                   "no-grad reference pass to scoring; TRL 0.0)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shape, short rows, fp32)")
    p.add_argument("--table", action="store_true", help="print the rows of this commit from the results file")
    p.add_argument("--embedded-generation", type=int, default=1, help="fastgrpo: 0 samples with model.generate")
    p.add_argument("--merge-lora", default="float", choices=["float", "all", "none"],
                   help="fastgrpo: fastgrpo_generation_merge_lora (LoRA layers the generator decodes merged)")
    p.add_argument("--release-memory", type=int, default=0,
                   help="fastgrpo: fastgrpo_generation_release_memory (free the generator's cache after each rollout)")
    p.add_argument("--join-qkv", type=int, default=1,
                   help="fastgrpo: 0 decodes merged q, k and v as three GEMMs (generation.adapters.JOIN_QKV off)")
    p.add_argument("--shared-prompt-slots", type=int, default=1,
                   help="fastgrpo: 0 copies a group's prompt KV into each of its rows (engine.SHARED_PROMPT_SLOTS off)")
    p.add_argument("--grouped-prompt", type=harness.grouped_mode, default="auto",
                   help="fastgrpo: a group's prompt attended once a step for all its rows "
                   "(engine.GROUPED_PROMPT_ATTENTION): 1 in every layer, 0 in none, auto (default) where a token's KV "
                   "is large")
    p.add_argument("--profile-first", metavar="PATH", help="write a cProfile of the first step (pstats) to PATH and "
                   "print its 25 costliest functions by own time and Dynamo's compile-phase times")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.generations, args.prompt_len, args.completion = 2, 4, 8, 8
    return args


def word_tokenizer(vocab: int):
    """A whitespace word-level tokenizer over `vocab` ids: "w7 w12" -> [7, 12] (ids 0/1 are pad/eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {name: i for i, name in enumerate(SPECIAL)}
    words.update({f"w{i}": i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")


def build_model(shape: str, dtype: torch.dtype, device: str, tiny: bool = False):
    """A random-init model of a named shape (bench/_harness.py), pad 0 and EOS 1 as the word tokenizer has them."""
    config = harness.shape_config(shape, tiny=tiny)
    config.use_cache, config.pad_token_id, config.eos_token_id, config.bos_token_id = True, 0, 1, None
    return harness.causal_lm(config, device, dtype, seed=0)


class StepClock:
    """Wall time of generation, scoring and whole steps, each bracketed by a device synchronisation."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.generation, self.scoring, self.steps, self.peaks = [], [], [], []
        self.generation_peaks = []  # the step's peak up to the end of its rollouts

    def wrap(self, trainer):
        """Time TRL's generation and its generate-and-score method (which contains it) in every step."""
        clock = self

        def timed(method, total: str):
            def call(*args, **kwargs):
                clock.sync()
                start = time.perf_counter()
                out = method(*args, **kwargs)
                clock.sync()
                setattr(clock, total, getattr(clock, total) + time.perf_counter() - start)
                if total == "_generation" and torch.cuda.is_available():
                    clock._generation_peak = torch.cuda.max_memory_allocated() / 2**30
                return out

            return call

        trainer._generate_single_turn = timed(trainer._generate_single_turn, "_generation")
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "_scored")

    def callback(self, profile_path: str | None = None):
        import cProfile
        import pstats

        from transformers import TrainerCallback

        clock = self
        profiler = cProfile.Profile() if profile_path else None

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.sync()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                clock._generation = clock._scored = clock._generation_peak = 0.0
                if profiler is not None and not clock.steps:
                    profiler.enable()
                clock._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.sync()
                clock.steps.append(time.perf_counter() - clock._start)
                clock.generation.append(clock._generation)
                clock.scoring.append(clock._scored - clock._generation)
                clock.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0)
                clock.generation_peaks.append(clock._generation_peak)
                if profiler is not None and len(clock.steps) == 1:
                    profiler.disable()
                    profiler.dump_stats(profile_path)
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

        return Clock()


def run(args) -> dict:
    import peft
    from datasets import Dataset

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(args.shape, dtype, device, tiny=args.tiny)
    vocab = model.config.get_text_config().vocab_size
    tokenizer = word_tokenizer(vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{i}" for i in torch.randint(len(SPECIAL), vocab, (args.prompt_len,), generator=g).tolist())
               for _ in range(args.prompts)]
    steps = args.warmup + args.steps
    dataset = Dataset.from_dict({"prompt": prompts * steps})

    def free_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    rows = args.prompts * args.generations
    micro = args.micro_batch or rows
    if rows % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the step's {rows} rows (prompts x generations)")
    common = dict(
        output_dir=f"/tmp/grpo_train_step_{args.system}", per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        num_generations=args.generations, max_completion_length=args.completion, max_steps=steps,
        learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no", gradient_checkpointing=True,
        bf16=device == "cuda", use_cpu=device == "cpu", seed=0, temperature=1.0, disable_tqdm=True,
    )
    if args.beta is not None:
        common["beta"] = args.beta
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if args.system == "fastgrpo":
        from fastgrpo.integrations.generation import adapters, engine
        from fastgrpo.integrations.trl import GRPOConfig, GRPOTrainer

        adapters.JOIN_QKV = bool(args.join_qkv)
        engine.SHARED_PROMPT_SLOTS = bool(args.shared_prompt_slots)
        engine.GROUPED_PROMPT_ATTENTION = args.grouped_prompt
        config = GRPOConfig(**common, fastgrpo_embedded_generation=bool(args.embedded_generation),
                            fastgrpo_generation_merge_lora=args.merge_lora,
                            fastgrpo_generation_release_memory=bool(args.release_memory))
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common)
    trainer = GRPOTrainer(model=model, reward_funcs=free_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    clock = StepClock(device)
    clock.wrap(trainer)
    trainer.add_callback(clock.callback(args.profile_first))
    trainer.train()
    if args.profile_first:
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str", aggregate=True))
    compiled = next((entry for entry in trainer.state.log_history if "compile_s" in entry), {})
    timed = slice(args.warmup, None)

    def median(values):
        return statistics.median(values[timed]) if values[timed] else float("nan")

    generator = getattr(trainer, "_embedded_generator", None)
    return dict(
        system=args.system if args.embedded_generation else f"{args.system}_generate", shape=args.shape,
        beta=trainer.args.beta,
        merge_lora=args.merge_lora if args.system == "fastgrpo" else None,
        join_qkv=bool(args.join_qkv) if args.system == "fastgrpo" else None,
        shared_prompt_slots=bool(args.shared_prompt_slots) if args.system == "fastgrpo" else None,
        grouped_prompt=args.grouped_prompt if args.system == "fastgrpo" else None,
        release_memory=bool(args.release_memory) if args.system == "fastgrpo" else None,
        prompts=args.prompts, generations=args.generations, prompt_len=args.prompt_len, completion=args.completion,
        micro_batch=micro, layer_graphs=layer_graph_stats(trainer),
        # fastgrpo's rows per forward ("auto"), each step: update, scoring
        mini_batches=[[entry.get("fastgrpo/mini_batch_update"), entry.get("fastgrpo/mini_batch_scoring")]
                      for entry in trainer.state.log_history if "loss" in entry] if args.system == "fastgrpo" else None,
        step_s=median(clock.steps), generation_s=median(clock.generation), scoring_s=median(clock.scoring),
        update_s=median(clock.steps) - median(clock.generation) - median(clock.scoring),
        peak_gib=max(clock.peaks[timed], default=float("nan")), first_step_s=clock.steps[0],
        generation_peak_gib=max(clock.generation_peaks[timed], default=float("nan")),
        each_step_s=[round(t, 3) for t in clock.steps], each_generation_s=[round(t, 3) for t in clock.generation],
        each_scoring_s=[round(t, 3) for t in clock.scoring],
        first_generation_s=clock.generation[0], first_scoring_s=clock.scoring[0],
        first_update_s=clock.steps[0] - clock.generation[0] - clock.scoring[0],
        compile=({k: v for k, v in compiled.items() if k.startswith("compile")} or None),
        fallback=getattr(generator, "fallback", None),
    )


def layer_graph_stats(trainer) -> dict | None:
    """fastgrpo: the policy's layer calls replayed as CUDA graphs (fastgrpo/compiler/layer_graphs.py)."""
    handle = getattr(trainer, "_fastgrpo_offload", None)
    return None if handle is None else handle.graphs.summary()


def table(rows: list[dict]) -> str:
    def cell(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| shape | system | beta | step s | generation s | scoring s | update s | peak GiB | first step s | vs trl |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    trl = {r["shape"]: r["step_s"] for r in rows if r["system"] == "trl"}
    for r in rows:
        ratio = f"{trl[r['shape']] / r['step_s']:.2f}x" if r["shape"] in trl else "-"
        beta = "-" if r.get("beta") is None else f"{r['beta']:g}"  # rows before the field: each trainer's default
        lines.append(f"| {r['shape']} | {r['system']} | {beta} | {cell(r['step_s'])} | {cell(r['generation_s'])} | "
                     f"{cell(r['scoring_s'])} | {cell(r['update_s'])} | {cell(r['peak_gib'])} | "
                     f"{cell(r['first_step_s'], 1)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        here, rows = harness.commit(), harness.read_rows(harness.results_path("grpo_train_step"))
        print(table([r for r in rows if r["commit"] == here and r["hardware"] == harness.hardware()]))
        return
    if args.system is None:
        raise SystemExit("give --system fastgrpo or --system trl (one per process), or --table")
    row = run(args)
    harness.emit(row)
    print(table([row]))
    if not args.tiny:
        harness.record("grpo_train_step", [row], argv)


if __name__ == "__main__":
    main()
