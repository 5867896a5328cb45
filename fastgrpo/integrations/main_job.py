"""`fastgrpo train`: GRPO with LoRA end to end, sized by default to finish on a 2-core CPU in minutes.

Default run: the shipped SmolLM2-135M-Instruct (converted once, then cached), LoRA on all linear
layers, reasoning-gym's chain_sum with one-digit terms, partial-credit rewards (see tasks.py).

    fastgrpo train                                       # the defaults
    fastgrpo train --model ./my-model --dataset prompts.jsonl --max-steps 100 --output-dir runs/a
    fastgrpo train --config grpo.yaml --resume           # continue from the newest checkpoint in --output-dir

Precedence: built-in defaults < `--config` file (GRPOConfig fields and the job keys below) < flags.
Writes into --output-dir: checkpoint-N/ (every --save-steps), adapter/ (final LoRA adapter and
tokenizer), train_log.jsonl (one line per logged step), reward_curve.png.

Faults: a checkpoint directory appears only once complete; --resume takes the newest checkpoint that loads (a
damaged one is skipped with a warning naming the file). Ctrl-C saves a checkpoint at the end of the step under
way, prints the command that resumes and exits with status 130; a second Ctrl-C stops at once. An --output-dir
that holds an earlier run is refused without --resume (a new run would rotate its checkpoints away). Running out of
accelerator memory is a short message naming the settings to change and how to resume, exit status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shlex
import sys
import time
from pathlib import Path

import torch

from fastgrpo.compiler.options import checked_options
from fastgrpo.errors import MissingPathError, UserError
from fastgrpo.integrations import checkpoints


def trainer_classes():
    """(GRPOConfig, GRPOTrainer): fastgrpo's TRL subclasses. Imported on use: TRL takes ~15 s to import."""
    from fastgrpo.integrations.trl import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer


# Keys a --config file may hold besides GRPOConfig fields.
JOB_KEYS = ("model", "dataset", "task", "task_size", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")

# Defaults sized for the 2-core CPU machine: 30 steps of 2 prompts x 4 completions of <= 16 tokens took
# 7.5 min wall there (shared machine, 1 thread), the mean reward rising from 0.80 (first 10 steps) to 1.26
# (last 10; maximum 2), mostly as the model learns to reply with just a number.
JOB_DEFAULTS = dict(
    model=None,  # the shipped SmolLM2-135M-Instruct
    dataset=None,
    task="chain_sum",
    task_size=512,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    lora_target_modules="all-linear",
)
TRAIN_DEFAULTS = dict(
    output_dir="fastgrpo-output",
    max_steps=30,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    num_generations=4,  # 2 prompts per step: a less noisy mean reward than 1 prompt x 8
    max_completion_length=16,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    temperature=1.0,
    logging_steps=1,
    save_strategy="steps",
    save_steps=10,
    save_total_limit=2,
    gradient_checkpointing=False,  # a 135M model's activations are small; checkpointing only costs time
    report_to="none",
    seed=0,
    disable_tqdm=True,  # the job draws its own progress bar with the step metrics
)

# flag -> config key
FLAG_KEYS = {
    "model": "model",
    "dataset": "dataset",
    "task": "task",
    "max_steps": "max_steps",
    "num_generations": "num_generations",
    "max_completion_length": "max_completion_length",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "learning_rate": "learning_rate",
    "beta": "beta",
    "temperature": "temperature",
    "save_steps": "save_steps",
    "output_dir": "output_dir",
    "seed": "seed",
    "lora_r": "lora_r",
    "compile_cache": "fastgrpo_compile_cache",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastgrpo train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="local HF model directory (default: the shipped SmolLM2-135M-Instruct)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="local dataset with a 'prompt' column: save_to_disk dir or .json/.jsonl/.csv/.parquet")
    source.add_argument("--task", help="reasoning-gym task name (default chain_sum with one-digit terms)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--num-generations", type=int, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--per-device-train-batch-size", type=int, help="rows per step (a multiple of --num-generations)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--beta", type=float, help="KL coefficient (0 turns the reference pass and the KL log off)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--save-steps", type=int, help="checkpoint every N steps")
    p.add_argument("--lora-r", type=int)
    p.add_argument("--output-dir")
    p.add_argument("--seed", type=int)
    p.add_argument("--config", help="YAML or JSON file of GRPOConfig fields and job keys " + ", ".join(JOB_KEYS))
    p.add_argument(
        "--backend-options",
        help="options of the fastgrpo torch.compile backend, JSON (e.g. '{\"inner\": \"aot_eager\"}') or key=value,...",
    )
    p.add_argument(
        "--compile-cache",
        help="directory of the persistent compile caches (default $FASTGRPO_COMPILE_CACHE, else ~/.cache/fastgrpo/compile), "
        "or 'off'",
    )
    p.add_argument("--no-compile", action="store_true", help="run the policy eagerly instead of through the fastgrpo backend")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir that loads")
    p.add_argument(
        "--cpu-threads",
        type=int,
        help="torch threads on CPU (default: every core, or 1 when the load average shows the cores are busy)",
    )
    return p


def choose_cpu_threads(requested: int | None) -> int:
    """Threads for a CPU run. On cores other processes keep busy, one thread is far faster than several.

    Every op splits its work across the threads and waits for the slowest; when the OS has
    descheduled one of them, the others spin at the barrier. Measured on the 2-core machine with
    other jobs running (load ~4): 2 threads took ~100 s per step of the default job, 1 thread ~10-25 s.
    """
    if requested is not None and requested < 1:
        raise UserError(f"--cpu-threads {requested}; it takes a positive number of threads")
    if requested is None:
        cores = os.cpu_count() or 1
        busy_cores = int(os.getloadavg()[0])
        requested = max(1, min(torch.get_num_threads(), cores - busy_cores))
    torch.set_num_threads(requested)
    return requested


def _read_config_file(path: str) -> dict:
    if not Path(path).is_file():
        raise MissingPathError(f"--config {path!r} does not exist")
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise UserError(f"{path}: YAML syntax error{where}: {getattr(error, 'problem', None) or error}; "
                            "fix the file") from error
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: JSON syntax error: {error}; fix the file (a .yaml or .yml name reads it as "
                            "YAML)") from error
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def _parse_backend_options(text: str) -> dict:
    text = text.strip()
    if text.startswith("{"):
        return checked_options(text, "--backend-options")
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--backend-options: expected a JSON object or key=value,..., got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    return options


def resolve_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """(job settings, GRPOConfig kwargs) after defaults < config file < flags."""
    config_fields = dataclasses.fields(trainer_classes()[0])
    grpo_fields = {f.name for f in config_fields}
    merged = {**JOB_DEFAULTS, **TRAIN_DEFAULTS}
    if args.config:
        from_file = _read_config_file(args.config)
        unknown = sorted(set(from_file) - grpo_fields - set(JOB_KEYS))
        if unknown:
            raise UserError(f"{args.config}: unknown keys {unknown} (not GRPOConfig fields nor job keys {list(JOB_KEYS)})")
        floats = {f.name for f in config_fields if "float" in str(f.type) and "str" not in str(f.type)}
        from_file = _floats_read(from_file, floats | {"lora_alpha", "lora_dropout"})
        if from_file.get("dataset") is not None:
            merged["task"] = None
        merged.update(from_file)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            merged[key] = value
    if args.dataset is not None:
        merged["task"] = None
    elif args.task is not None:
        merged["dataset"] = None
    if args.backend_options:
        merged["fastgrpo_compile_options"] = _parse_backend_options(args.backend_options)
    source = "--backend-options" if args.backend_options else f"{args.config}: fastgrpo_compile_options"
    merged["fastgrpo_compile_options"] = checked_options(merged.get("fastgrpo_compile_options"), source)
    if merged.get("fastgrpo_compile_options") is None and not torch.cuda.is_available():
        # On CPU the rewritten decoder-layer graph runs as it is (inner "eager": fastgrpo's ops, no AOTAutograd),
        # the gated MLP as act_mul: inductor's cold compile of a layer takes minutes on the 2-core machine and
        # saves nothing there. `fastgrpo train --max-steps 5` on it (other jobs running): compiling 2.1 s with
        # eager, 7.6 s with aot_eager, first step 9.9 s against 15.7 s; with act_mul the five steps took 36.8 s
        # against 41.0 s (the same rewards).
        merged["fastgrpo_compile_options"] = {"inner": "eager", "absorb_mlp_projections": False}
    if args.no_compile:
        merged["fastgrpo_compile"] = False
    if not torch.cuda.is_available():
        # Launched as several processes (accelerate launch / torchrun), accelerate joins them into one gloo job
        # only when told the run is on CPU; otherwise each process trains alone on a copy of the data.
        merged.setdefault("use_cpu", True)
    job = {key: merged.pop(key) for key in JOB_KEYS}
    if job["dataset"] is None and job["task"] is None:
        raise UserError("give --task or --dataset")
    _check_values(job, merged)
    _check_inputs(job)
    return job, merged


def _floats_read(settings: dict, float_keys: set[str]) -> dict:
    """Numbers that YAML read as text, as numbers: YAML 1.1 reads `1e-4` (no dot) as a string, which GRPOConfig keeps
    and the optimizer refuses only after the model has loaded."""
    read = dict(settings)
    for key, value in settings.items():
        if key in float_keys and isinstance(value, str):
            try:
                read[key] = float(value)
            except ValueError:
                pass  # left as it is: the value checks or GRPOConfig name it
    return read


def _number(value, *, integer: bool = False) -> bool:
    kinds = (int,) if integer else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


# (setting, flag, test, what it takes): values that the libraries refuse only after the model has loaded (PEFT at
# the first LoRA layer, torch at the optimizer) or read as something else (transformers reads max_steps 0 as "train
# for num_train_epochs").
_VALUE_CHECKS = (
    ("task_size", None, lambda v: _number(v, integer=True) and v >= 1, "a positive number of prompts"),
    ("lora_r", "--lora-r", lambda v: _number(v, integer=True) and v >= 1, "a positive integer"),
    ("lora_alpha", None, lambda v: _number(v) and v > 0, "a positive number"),
    ("lora_dropout", None, lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("learning_rate", "--learning-rate", lambda v: _number(v) and v >= 0, "a number >= 0"),
    ("max_steps", "--max-steps", lambda v: _number(v, integer=True) and (v >= 1 or v == -1),
     "a positive number of steps (or -1 in a --config file: train for num_train_epochs)"),
    ("max_completion_length", "--max-completion-length", lambda v: _number(v, integer=True) and v >= 1,
     "a positive number of tokens"),
    ("per_device_train_batch_size", "--per-device-train-batch-size", lambda v: _number(v, integer=True) and v >= 1,
     "a positive integer"),
    ("temperature", "--temperature", lambda v: _number(v) and v > 0,
     "a number > 0 (GRPO samples; the log-probs divide by it; lower values are closer to greedy)"),
    ("beta", "--beta", lambda v: _number(v) and v >= 0, "a number >= 0 (the KL penalty's weight; 0: none)"),
    ("save_steps", "--save-steps", lambda v: _number(v) and v > 0,
     "a positive number of steps (or a fraction of the run below 1)"),
    ("seed", "--seed", lambda v: _number(v, integer=True) and 0 <= v < 2**32, "an integer in [0, 2**32)"),
)


def _check_values(job: dict, train: dict) -> None:
    """Each checked setting within its range: a UserError naming the flag (or config key) before anything loads."""
    for key, flag, valid, takes in _VALUE_CHECKS:
        settings = job if key in job else train
        if key in settings and not valid(settings[key]):
            name = f"{flag} / {key}" if flag else key
            raise UserError(f"{name} = {settings[key]!r}; it takes {takes}")


def _check_inputs(job: dict) -> None:
    """The model, dataset and task named exist: a UserError before anything loads otherwise."""
    from fastgrpo.integrations.models import SMOLLM2_ALIASES, resolve_model_path
    from fastgrpo.integrations.tasks import check_task

    if job["model"] is not None and str(job["model"]) not in SMOLLM2_ALIASES:
        resolve_model_path(job["model"])
    if job["dataset"] is not None and not Path(job["dataset"]).expanduser().exists():
        raise MissingPathError(f"--dataset {job['dataset']!r} does not exist")
    if job["task"] is not None:
        check_task(job["task"])


def _resume_command(argv: list[str]) -> str:
    """The command line that continues this run from its newest checkpoint."""
    return shlex.join(["fastgrpo", "train", *argv, *([] if "--resume" in argv else ["--resume"])])


def peak_memory_gib() -> float:
    """Peak accelerator memory, or the process's peak resident memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _job_callback():
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class JobProgress(TrainerCallback):
        """A progress bar with the latest step metrics, and one JSON line per logged step in train_log.jsonl."""

        def __init__(self, log_path: Path):
            self.log_path = log_path
            self.bar = None
            self.last_time = self.last_tokens = None

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:  # several processes: one bar and one log, from the main one
                return
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="GRPO", unit="step", dynamic_ncols=True)
            self.last_time = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs or not state.is_world_process_zero:
                return
            now = time.perf_counter()
            tokens = logs.get("num_tokens")
            record = {"step": state.global_step, **logs, "peak_memory_gib": peak_memory_gib()}
            if tokens is not None and self.last_tokens is not None and now > self.last_time:
                record["tokens_per_s"] = (tokens - self.last_tokens) / (now - self.last_time)
            self.last_time, self.last_tokens = now, tokens
            with self.log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            shown = {
                "reward": record.get("reward"),
                "kl": record.get("kl"),
                "tok/s": record.get("tokens_per_s"),
                "peak GiB": record["peak_memory_gib"],
            }
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if v is not None}, refresh=False)
            self.bar.write(
                f"step {state.global_step:>4}  " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items() if v is not None)
            )

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return JobProgress


def plot_reward_curve(log_history: list[dict], path: Path) -> None:
    """Mean reward per step, each reward function's mean beside it, and a moving average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({e["step"]: e for e in log_history if "reward" in e and "step" in e}.values(), key=lambda e: e["step"])
    steps = [e["step"] for e in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [e["reward"] for e in rows], marker=".", label="reward (sum)")
    if rows:
        window = max(1, len(rows) // 5)
        rewards = [e["reward"] for e in rows]
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, linewidth=2, label=f"moving average ({window})")
    for key in sorted({k for e in rows for k in e if k.startswith("rewards/") and k.endswith("/mean")}):
        ax.plot(steps, [e.get(key, math.nan) for e in rows], linestyle="--", label=key.split("/")[1])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    job, train_kwargs = resolve_settings(args)
    wall_start = time.perf_counter()

    from peft import LoraConfig
    from transformers import PrinterCallback, set_seed

    from fastgrpo.integrations.models import load_model_and_tokenizer
    from fastgrpo.integrations.tasks import load_prompt_dataset, make_task_dataset, reward_functions

    GRPOConfig, GRPOTrainer = trainer_classes()
    try:
        config = GRPOConfig(**train_kwargs)  # checked before anything loads
    except UserError:
        raise
    except ValueError as error:  # TRL's and transformers' checks of the values
        raise UserError(f"config: {error}") from error
    output_dir = Path(train_kwargs["output_dir"])
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--output-dir {str(output_dir)!r} cannot be created ({error.strerror}); "
                        "give a directory you can write to") from error
    if not args.resume and (previous := checkpoints.previous_run(output_dir)):
        raise UserError(f"--output-dir {str(output_dir)!r} holds an earlier run ({previous}); a new run there would "
                        "delete its checkpoints and mix the logs. Pass --resume to continue it, or give another "
                        "--output-dir (or remove that one)")
    # The dataset before the model: its errors (empty, no prompt column) come before the load.
    if job["dataset"] is not None:
        dataset = load_prompt_dataset(job["dataset"])
    else:
        dataset = make_task_dataset(job["task"], size=job["task_size"], seed=train_kwargs["seed"])
    from fastgrpo.integrations.trl.trainer import check_prompts_for_a_step

    check_prompts_for_a_step(dataset, config)  # also in the trainer; here before the model loads
    resume_from = checkpoints.newest_loadable_checkpoint(output_dir) if args.resume else None
    if args.resume and resume_from is None:
        print(f"--resume: no checkpoint in {output_dir} that loads, starting from scratch", file=sys.stderr)
    if resume_from and (mismatch := checkpoints.lora_mismatch(resume_from, job["lora_r"], job["lora_alpha"],
                                                               job["lora_target_modules"])):
        raise UserError(f"--resume: {Path(resume_from).name} was written with {mismatch}; resume with its LoRA "
                        "settings (--lora-r, lora_alpha, lora_target_modules), or give a new --output-dir")
    if args.resume:  # the steps past the checkpoint are run and logged again
        step = json.loads((Path(resume_from) / "trainer_state.json").read_text())["global_step"] if resume_from else 0
        checkpoints.drop_log_lines_after(output_dir / "train_log.jsonl", step)

    if not torch.cuda.is_available():
        threads = choose_cpu_threads(args.cpu_threads)
        print(f"CPU run with {threads} torch thread(s) (--cpu-threads to change)", file=sys.stderr)

    # bf16 weights on a GPU (as TRL's dtype="auto" loads hub checkpoints): generation, which runs in the
    # weights' dtype, and the frozen base both get the fast path; LoRA weights stay fp32 (PEFT upcasts them).
    on_bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    model_start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(job["model"], dtype=torch.bfloat16 if on_bf16_gpu else torch.float32)
    print(f"model loaded in {time.perf_counter() - model_start:.1f} s: {model.config.name_or_path}", file=sys.stderr)
    lora = LoraConfig(
        r=job["lora_r"],
        lora_alpha=job["lora_alpha"],
        lora_dropout=job["lora_dropout"],
        target_modules=job["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
    set_seed(config.seed)  # before the trainer builds the LoRA layers, so their init follows --seed
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(dataset),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[_job_callback()(output_dir / "train_log.jsonl"), interrupt := checkpoints.GracefulInterrupt()],
    )
    trainer.remove_callback(PrinterCallback)  # the job's own bar and step lines replace its raw dicts
    with interrupt:
        try:
            trainer.train(resume_from_checkpoint=resume_from)
        except torch.OutOfMemoryError as error:
            if any(output_dir.glob("checkpoint-*")):
                error.add_note(f"With the setting changed, --resume continues from the newest checkpoint in "
                               f"{output_dir}: {_resume_command(argv)} ...")
            raise
    if interrupt.stopped:
        if trainer.is_world_process_zero():
            saved = output_dir / f"checkpoint-{trainer.state.global_step}"
            print(f"stopped by Ctrl-C after step {trainer.state.global_step}, saved in {saved}; resume with:\n  "
                  f"{_resume_command(argv)}", file=sys.stderr)
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
        return 130

    adapter_dir = output_dir / "adapter"
    trainer.save_model(str(adapter_dir))  # every process: under FSDP/DeepSpeed saving gathers the shards
    if trainer.is_world_process_zero():  # a multi-process launch writes the rest once
        tokenizer.save_pretrained(adapter_dir)
        plot_reward_curve(trainer.state.log_history, output_dir / "reward_curve.png")
        rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
        summary = {
            "steps": trainer.state.global_step,
            "wall_s": round(time.perf_counter() - wall_start, 1),
            "first_reward": rewards[0] if rewards else None,
            "last_reward": rewards[-1] if rewards else None,
            "adapter": str(adapter_dir),
            "reward_curve": str(output_dir / "reward_curve.png"),
        }
        print(json.dumps(summary), file=sys.stderr)
    # Several processes leave together with the process group closed: one exiting with it open aborts (gloo).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
