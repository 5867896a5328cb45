"""The whole GRPO step a user waits for: real `trainer.train()` steps of fastgrpo's GRPOTrainer against stock TRL's.

One system per process (`--system`), the same model, data and config for each: a random-init model of a named shape
in bf16 (`--shape`: Qwen2.5-1.5B, or Gemma-3-1B with its sliding-window layers), PEFT LoRA r=16 on every projection,
8 prompts x G=8 completions, 256-token prompts, completions up to 512 tokens (`--completion`; a random-init model
never samples EOS, so every row runs to the limit), a reward that costs nothing, gradient checkpointing, bf16. Each
step: generation, scoring (rewards, advantages, the no-grad log-prob passes TRL runs), and the update (loss forward
and backward, optimizer). Timed with CUDA synchronisation around TRL's own methods: generation is
`_generate_single_turn`, scoring is the rest of `_generate_and_score_completions`, update the rest of the step.
The first `--warmup` steps (compiles) are reported apart; the table gives the median of the timed steps.

    python bench/grpo_train_step.py --system fastgrpo            # then --system trl; rows appended to
    python bench/grpo_train_step.py --system trl                 #   bench/results/grpo_train_step.jsonl
    python bench/grpo_train_step.py --table                      # the rows of this tree's commit, as a table
    python bench/grpo_train_step.py --system fastgrpo --tiny     # CPU smoke run: a 2-layer model, short rows
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "grpo_train_step.jsonl"

SHAPES = {
    # Public config.json values of the released models (random init here).
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, rope_theta=1e6,
        query_pre_attn_scalar=256, tie_word_embeddings=True, rms_norm_eps=1e-6,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
    ),
    "tiny": dict(
        model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    ),
}
SPECIAL = ["<pad>", "<eos>"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["fastgrpo", "trl"], help="the trainer to time (one per process)")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shape, short rows, fp32)")
    p.add_argument("--table", action="store_true", help="print the rows of this commit from the results file")
    p.add_argument("--embedded-generation", type=int, default=1, help="fastgrpo: 0 samples with model.generate")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.prompts, args.generations, args.prompt_len, args.completion = "tiny", 2, 4, 8, 8
    return args


def commit() -> str:
    """The tree's commit (FASTGRPO_BENCH_COMMIT where the tree travelled without its history)."""
    if os.environ.get("FASTGRPO_BENCH_COMMIT"):
        return os.environ["FASTGRPO_BENCH_COMMIT"]

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def word_tokenizer(vocab: int):
    """A whitespace word-level tokenizer over `vocab` ids: "w7 w12" -> [7, 12] (ids 0/1 are pad/eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {name: i for i, name in enumerate(SPECIAL)}
    words.update({f"w{i}": i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")


def build_model(shape: str, dtype: torch.dtype, device: str):
    import transformers

    values = dict(SHAPES[shape])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values, pad_token_id=0, eos_token_id=1,
                                               bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


class StepClock:
    """Wall time of generation, scoring and whole steps, each bracketed by a device synchronisation."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.generation, self.scoring, self.steps, self.peaks = [], [], [], []

    def wrap(self, trainer):
        clock = self
        generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions

        def timed_generate(*args, **kwargs):
            clock.sync()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            clock.sync()
            clock._generation += time.perf_counter() - start
            return out

        def timed_score(*args, **kwargs):
            clock.sync()
            start = time.perf_counter()
            out = score(*args, **kwargs)
            clock.sync()
            clock._scored += time.perf_counter() - start
            return out

        trainer._generate_single_turn = timed_generate
        trainer._generate_and_score_completions = timed_score

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.sync()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                clock._generation = clock._scored = 0.0
                clock._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.sync()
                clock.steps.append(time.perf_counter() - clock._start)
                clock.generation.append(clock._generation)
                clock.scoring.append(clock._scored - clock._generation)
                clock.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0)

        return Clock()


def run(args) -> dict:
    import peft
    from datasets import Dataset

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(args.shape, dtype, device)
    vocab = model.config.get_text_config().vocab_size
    tokenizer = word_tokenizer(vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{i}" for i in torch.randint(len(SPECIAL), vocab, (args.prompt_len,), generator=g).tolist())
               for _ in range(args.prompts)]
    steps = args.warmup + args.steps
    dataset = Dataset.from_dict({"prompt": prompts * steps})

    def free_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    common = dict(
        output_dir=f"/tmp/grpo_train_step_{args.system}", per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.completion, max_steps=steps,
        learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no", gradient_checkpointing=True,
        bf16=device == "cuda", use_cpu=device == "cpu", seed=0, temperature=1.0, disable_tqdm=True,
    )
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if args.system == "fastgrpo":
        from fastgrpo.integrations.trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, fastgrpo_embedded_generation=bool(args.embedded_generation))
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common)
    trainer = GRPOTrainer(model=model, reward_funcs=free_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    clock = StepClock(device)
    clock.wrap(trainer)
    trainer.add_callback(clock.callback())
    trainer.train()
    timed = slice(args.warmup, None)

    def median(values):
        return statistics.median(values[timed]) if values[timed] else float("nan")

    generator = getattr(trainer, "_embedded_generator", None)
    return dict(
        system=args.system if args.embedded_generation else f"{args.system}_generate", shape=args.shape,
        prompts=args.prompts, generations=args.generations, prompt_len=args.prompt_len, completion=args.completion,
        step_s=median(clock.steps), generation_s=median(clock.generation), scoring_s=median(clock.scoring),
        update_s=median(clock.steps) - median(clock.generation) - median(clock.scoring),
        peak_gib=max(clock.peaks[timed], default=float("nan")), first_step_s=clock.steps[0],
        first_generation_s=clock.generation[0], fallback=getattr(generator, "fallback", None),
    )


def table(rows: list[dict]) -> str:
    lines = ["| shape | system | step s | generation s | scoring s | update s | peak GiB | first step s | vs trl |",
             "|---|---|---|---|---|---|---|---|---|"]
    trl = {r["shape"]: r["step_s"] for r in rows if r["system"] == "trl"}
    for r in rows:
        ratio = f"{trl[r['shape']] / r['step_s']:.2f}x" if r["shape"] in trl else "-"
        lines.append(f"| {r['shape']} | {r['system']} | {r['step_s']:.2f} | {r['generation_s']:.2f} | "
                     f"{r['scoring_s']:.2f} | {r['update_s']:.2f} | {r['peak_gib']:.2f} | {r['first_step_s']:.1f} | "
                     f"{ratio} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        here = commit()
        rows = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
        print(table([r for r in rows if r["commit"] == here and r["hardware"] == hardware()]))
        return
    if args.system is None:
        raise SystemExit("give --system fastgrpo or --system trl (one per process), or --table")
    row = run(args)
    row = dict(date=time.strftime("%Y-%m-%d"), commit=commit(), hardware=hardware(),
               command=" ".join(["python", "bench/grpo_train_step.py", *(argv or sys.argv[1:])]), **row)
    print("RESULT " + json.dumps(row))
    print(table([row]))
    if not args.tiny:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
