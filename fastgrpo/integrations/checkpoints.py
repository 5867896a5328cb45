"""Checkpoints that exist whole or not at all, resuming from the newest one that loads, and Ctrl-C.

- `save_checkpoint_atomically`: transformers' `Trainer._save_checkpoint` writes `<run dir>/checkpoint-N` file by
  file, so a job killed while saving (or a full disk) leaves a newest checkpoint that cannot be loaded. Here the
  same method writes into `<run dir>/.partial-checkpoint-N/checkpoint-N`; once every process has written its
  part, the files and directories are fsynced and the directory is renamed to `<run dir>/checkpoint-N` (an
  existing checkpoint-N moved aside first and deleted after). A kill at any moment leaves either the complete
  checkpoint or none, plus a `.partial-` directory that the next save removes. The rotation of old checkpoints
  (`save_total_limit`) and hub pushes then run on the renamed directory.
- `newest_loadable_checkpoint`: the newest `checkpoint-N` whose files load (JSON parses, safetensors headers and
  sizes agree, torch zip archives are whole, sharded weights all present); each one skipped is warned about with
  the file and the reason.
- `GracefulInterrupt`: a callback for `train()`: the first Ctrl-C (SIGINT) lets the step under way finish, saves a
  checkpoint and stops training; a second one raises `KeyboardInterrupt` at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import warnings
import zipfile
from pathlib import Path

from transformers import TrainerCallback

PREFIX = "checkpoint"
PARTIAL = ".partial-"  # staging directories: `.partial-checkpoint-N`
_CHECKPOINT = re.compile(rf"{PREFIX}-(\d+)")


class UnloadableCheckpointWarning(UserWarning):
    """A checkpoint was skipped when resuming because one of its files does not load."""


# ---------------------------------------------------------------- atomic saves

_MISSING = object()


@contextlib.contextmanager
def _instance_override(obj, name: str, replacement):
    """`obj.name` replaced by `replacement` (an instance attribute) for the duration of the block."""
    before = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


def _fsync(path: Path) -> None:
    if path.is_dir() and os.name == "nt":  # directories cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Files first, then their directories, deepest first: everything under root is on disk before a rename."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder, name))
        _fsync(Path(folder))


def _remove_partials(run_dir: Path) -> None:
    for stale in run_dir.glob(f"{PARTIAL}{PREFIX}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _rotate(trainer, run_dir: Path) -> None:
    """transformers' rotation of old checkpoints (`save_total_limit`), as `_save_checkpoint` calls it."""
    from transformers import trainer as hf_trainer

    if hasattr(hf_trainer, "rotate_checkpoints"):
        hf_trainer.rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                                      best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    else:  # transformers releases before the module-level function
        trainer._rotate_checkpoints(use_mtime=True, output_dir=str(run_dir))


def save_checkpoint_atomically(trainer, save, model, trial) -> None:
    """Run `save(model, trial)` (a Trainer's `_save_checkpoint`) so that `checkpoint-N` appears only when whole.

    Every process calls this, as every process calls `_save_checkpoint`; the process that writes the shared files
    (`args.should_save`: the main process, or each node's with `save_on_each_node`) prepares, renames and rotates."""
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"{PREFIX}-{trainer.state.global_step}"
    staging_root, final = run_dir / f"{PARTIAL}{name}", run_dir / name
    writer = trainer.args.should_save
    if writer:
        _remove_partials(run_dir)  # left by a save that was killed
        staging_root.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    pushes = []
    with _instance_override(trainer, "_get_output_dir", lambda trial=None: str(staging_root)), \
            _instance_override(trainer, "_push_from_checkpoint", pushes.append):
        save(model, trial)
    # The best checkpoint, when it is this one, was found under the staging directory (and saved so in its state).
    best = trainer.state.best_model_checkpoint
    best_is_staged = best is not None and Path(best).parent == staging_root
    if best_is_staged:
        trainer.state.best_model_checkpoint = str(run_dir / Path(best).name)
    trainer.accelerator.wait_for_everyone()
    if writer:
        staged = staging_root / name
        if best_is_staged and (staged / "trainer_state.json").exists():
            trainer.state.save_to_json(str(staged / "trainer_state.json"))
        _fsync_tree(staged)
        replaced = run_dir / f"{PARTIAL}{name}.replaced"
        if final.exists():  # a checkpoint of this step from an earlier run (resumed from an older one)
            final.rename(replaced)
        staged.rename(final)
        _fsync(run_dir)
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(staging_root, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    for _ in pushes:
        trainer._push_from_checkpoint(str(final))
    if writer:
        _rotate(trainer, run_dir)


# ---------------------------------------------------------------- resume


def _file_problem(path: Path) -> str | None:
    """Why `path` would not load, for the formats a checkpoint holds; None when it looks whole."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):  # checks the header and that the data fits the file
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            with path.open("rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
            if zipped:  # torch.save's archive: a cut-off file has no central directory or members past its end
                size = path.stat().st_size
                with zipfile.ZipFile(path) as archive:
                    for member in archive.infolist():
                        if member.header_offset + member.compress_size > size:
                            return f"member {member.filename} runs past the end of the file"
    except Exception as error:  # what loading it would raise
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    return None


def checkpoint_problem(checkpoint: str | os.PathLike) -> str | None:
    """Why a checkpoint directory would not load (naming the file), or None."""
    root = Path(checkpoint)
    if not (root / "trainer_state.json").is_file():
        return f"{root / 'trainer_state.json'} is missing"
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if (problem := _file_problem(path)) is not None:
            return f"{path}: {problem}"
    for index in root.glob("*.index.json"):  # sharded weights: every shard it names must be there
        for shard in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())):
            if not (root / shard).is_file():
                return f"{root / shard} (listed in {index.name}) is missing"
    return None


def checkpoints_newest_first(output_dir: str | os.PathLike) -> list[Path]:
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.fullmatch(p.name))]
    return [path for _, path in sorted(found, reverse=True)]


def newest_loadable_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` in `output_dir` that loads; each newer one that does not is skipped with an
    `UnloadableCheckpointWarning` naming the file and the reason. None when there is none."""
    for path in checkpoints_newest_first(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        warnings.warn(f"skipping {path.name}, which cannot be loaded: {problem}", UnloadableCheckpointWarning,
                      stacklevel=2)
    return None


def previous_run(output_dir: str | os.PathLike) -> str | None:
    """What an earlier run left in `output_dir` (its checkpoints, step log, adapter), or None when it holds none: a
    new run there would rotate those checkpoints away, append to the log and replace the adapter."""
    root = Path(output_dir)
    found = [path.name for path in checkpoints_newest_first(root)]
    log = root / "train_log.jsonl"
    if log.is_file() and log.stat().st_size:
        found.append(log.name)
    if (root / "adapter").is_dir():
        found.append("adapter/")
    return ", ".join(found) or None


def lora_mismatch(checkpoint: str | os.PathLike, r: int, alpha: float, target_modules) -> str | None:
    """How the LoRA a checkpoint was written with (its adapter_config.json) differs from this run's; None when it
    matches, or the checkpoint holds no adapter config, or `target_modules` is a name PEFT expands ("all-linear"). A
    rank or targets that differ would fail the load with a size mismatch per tensor; an alpha that differs would
    resume with another scaling."""
    path = Path(checkpoint) / "adapter_config.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    differences = []
    if saved.get("r") != r:
        differences.append(f"LoRA rank {saved.get('r')} (this run: {r})")
    if saved.get("lora_alpha") is not None and float(saved["lora_alpha"]) != float(alpha):
        differences.append(f"LoRA alpha {saved['lora_alpha']} (this run: {alpha})")
    if not isinstance(target_modules, str) and set(saved.get("target_modules") or ()) != set(target_modules):
        differences.append(f"LoRA target modules {sorted(saved.get('target_modules') or ())} (this run: "
                           f"{sorted(target_modules)})")
    return "; ".join(differences) or None


def drop_log_lines_after(log_path: str | os.PathLike, step: int) -> None:
    """Remove the lines of a JSON-lines step log whose "step" is past `step` (logged after the checkpoint a run
    resumes from, and logged again by the resumed run), and a last line cut short by a kill."""
    path = Path(log_path)
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) != len(lines):
        path.write_text("".join(kept))


# ---------------------------------------------------------------- Ctrl-C


class GracefulInterrupt(TrainerCallback):
    """First Ctrl-C: the step under way finishes, a checkpoint of it is saved and `train()` returns (`stopped` is
    then True). Second Ctrl-C: `KeyboardInterrupt` at once. The SIGINT handler is in place inside `with` (around
    `train()`), in the main thread only; with several processes, one process's Ctrl-C stops them all at the same
    step."""

    def __init__(self, notice: str = "Ctrl-C: finishing this step, then saving a checkpoint and stopping "
                                      "(Ctrl-C again stops at once)"):
        self.notice = notice
        self.requested = self.stopped = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(self.notice, file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False

    def _anyone_requested(self, args) -> bool:
        import torch

        if args.world_size <= 1 or not torch.distributed.is_initialized():
            return self.requested
        flag = torch.tensor([float(self.requested)], device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        if self._anyone_requested(args):
            control.should_save = control.should_training_stop = True
            self.stopped = True
        return control
