"""Prompt datasets and reward functions for the main job.

Built-in tasks come from reasoning-gym (generated offline, seeded). The defaults are sized for a
135M model: one-digit sums it gets partly right, so the reward can rise within a short run. Rewards
give partial credit, because an all-or-nothing reward is almost always 0 for such a model and GRPO
then has no signal (all advantages in a group are zero):
- `format_reward`: 1 for a reply that is just a number, 0.5 for a reply that contains one;
- `closeness_reward`: 1 / (1 + |last number in the reply - answer|), so 1 when exact.
Reward functions follow TRL's signature: `(completions, **dataset_columns) -> list[float]`.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from datasets import Dataset, Value, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from fastgrpo.errors import MissingPathError, UserError

# reasoning-gym dataset name -> generator settings that keep the task within a 135M model's reach.
TASKS: dict[str, dict] = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}
DEFAULT_TASK = "chain_sum"
SYSTEM_PROMPT = "Reply with the final answer only, as a number."

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def make_task_dataset(task: str = DEFAULT_TASK, size: int = 512, seed: int = 0, **task_options) -> Dataset:
    """A reasoning-gym task as a conversational prompt dataset with an `answer` column.

    `task_options` override the generator settings in `TASKS` (any reasoning-gym config field);
    tasks not in `TASKS` run with reasoning-gym's own defaults.
    """
    import reasoning_gym

    check_task(task)
    options = {**TASKS.get(task, {}), **task_options}
    entries = reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": entry["question"]},
            ],
            "answer": str(entry["answer"]),
        }
        for entry in entries
    ]
    return Dataset.from_list(rows)


def check_task(task: str) -> None:
    """A `UserError` naming the closest reasoning-gym tasks unless `task` is one."""
    import difflib

    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise UserError(f"--task needs the pip package reasoning-gym ({error}): pip install reasoning-gym, or give "
                        "--dataset") from error

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UserError(f"--task {task!r} is not a reasoning-gym task; {hint}python -c 'import reasoning_gym.factory "
                        "as f; print(sorted(f.DATASETS))' lists them (or give --dataset)")


def load_prompt_dataset(path: str | os.PathLike) -> Dataset:
    """A local dataset with a "prompt" column: a `save_to_disk` directory, or a .json/.jsonl/.csv/.parquet file."""
    path = Path(path).expanduser()
    if path.is_dir():
        try:
            dataset = load_from_disk(str(path))
        except FileNotFoundError as error:  # a directory without save_to_disk's files
            raise UserError(f"{path} is a directory but not a datasets save_to_disk one; give that, or a .json, "
                            ".jsonl, .csv or .parquet file") from error
        if hasattr(dataset, "keys"):  # a DatasetDict: train on its "train" split
            if "train" not in dataset:
                raise UserError(f"{path} holds splits {list(dataset)}; it needs a 'train' split")
            dataset = dataset["train"]
    elif path.is_file():
        kind = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise UserError(f"{path}: use a .json, .jsonl, .csv or .parquet file, or a save_to_disk directory")
        if path.stat().st_size == 0:  # datasets' readers raise StopIteration on it
            raise UserError(f"{path} is empty; it needs rows with a 'prompt' column")
        try:
            with _quiet_datasets():
                dataset = load_dataset(kind, data_files=str(path), split="train")
        except (DatasetGenerationError, ValueError) as error:  # the reader's own error is the cause (ArrowInvalid, ...)
            cause = error.__cause__ or error
            reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise UserError(f"{path} could not be read as {path.suffix[1:]}: {reason}") from error
    else:
        raise MissingPathError(f"--dataset {str(path)!r} does not exist")
    if "prompt" not in dataset.column_names:
        raise UserError(f"{path} has columns {dataset.column_names}; a 'prompt' column is required")
    if len(dataset) == 0:
        raise UserError(f"{path} has no rows; it needs rows with a 'prompt' column")
    problem = _prompt_feature_problem(dataset.features["prompt"])
    if problem:
        raise UserError(f"{path}: its 'prompt' column holds {problem}; it needs text, or chat messages (lists of "
                        "{'role': ..., 'content': ...})")
    return dataset


@contextlib.contextmanager
def _quiet_datasets():
    """`datasets` without its progress bars and its logged reader errors (the error is raised as one line)."""
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), datasets_logging.is_progress_bar_enabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets_logging.enable_progress_bar()


def _prompt_feature_problem(feature) -> str | None:
    """What is wrong with a 'prompt' column of this `datasets` feature type, or None: strings and lists of chat
    messages are what TRL's GRPOTrainer takes."""
    if isinstance(feature, Value):
        return None if feature.dtype in ("string", "large_string") else f"values of type {feature.dtype}"
    inner = getattr(feature, "feature", None)
    if isinstance(inner, dict) and {"role", "content"} <= set(inner):
        return None
    return f"values of type {feature}"


def completion_text(completion) -> str:
    """TRL passes a string for plain prompts and a list of messages for conversational ones."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def last_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the reply is only a number, 0.5 when it contains one, else 0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion).strip().rstrip(".")
        if _NUMBER.fullmatch(text.replace(",", "")):
            rewards.append(1.0)
        elif _NUMBER.search(text):
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards


def closeness_reward(completions, answer, **kwargs) -> list[float]:
    """1 / (1 + |last number in the reply - answer|): 1 when exact, 0.5 when off by one, 0 without a number."""
    rewards = []
    for completion, target in zip(completions, answer):
        guess, truth = last_number(completion_text(completion)), last_number(str(target))
        if guess is None or truth is None:
            rewards.append(0.0)
        else:
            rewards.append(1.0 / (1.0 + abs(guess - truth)))
    return rewards


def reward_functions(dataset: Dataset) -> list:
    """The rewards a dataset supports: the format reward always, closeness when it has an `answer` column."""
    if "answer" in dataset.column_names:
        return [format_reward, closeness_reward]
    return [format_reward]
