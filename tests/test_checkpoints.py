"""Checkpoints written whole or not at all (a real transformers Trainer's save, killed mid-write in a subprocess),
the checks that pick the newest checkpoint that loads, and the Ctrl-C callback. The main job's resume from a
truncated real checkpoint and its Ctrl-C runs are in test_main_job.py."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainerControl, TrainingArguments

from fastgrpo.integrations import checkpoints
from fastgrpo.integrations.checkpoints import UnloadableCheckpointWarning

ROOT = Path(__file__).resolve().parents[1]


class AtomicTrainer(Trainer):
    def _save_checkpoint(self, model, trial):
        checkpoints.save_checkpoint_atomically(self, super()._save_checkpoint, model, trial)


def _trainer(output_dir, **args):
    torch.manual_seed(0)
    trainer = AtomicTrainer(model=torch.nn.Linear(4, 4), args=TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to="none", **args))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    return trainer


def _save(trainer, step):
    trainer.state.global_step = step
    trainer._save_checkpoint(trainer.model, None)


def test_saves_rename_a_whole_directory_and_rotate_as_transformers_does(tmp_path):
    trainer = _trainer(tmp_path, save_total_limit=2)
    for step in (1, 2, 3):
        _save(trainer, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # no staging left
    files = {p.name for p in (tmp_path / "checkpoint-3").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    assert checkpoints.newest_loadable_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")


def test_a_checkpoint_of_the_same_step_is_replaced_and_the_best_one_points_at_the_final_directory(tmp_path):
    trainer = _trainer(tmp_path)
    _save(trainer, 1)
    (tmp_path / "checkpoint-1" / "stale-file").write_text("from an earlier run")
    trainer.state.best_global_step, trainer.args.save_strategy = 1, "steps"  # as after an evaluation at step 1
    _save(trainer, 1)
    assert not (tmp_path / "checkpoint-1" / "stale-file").exists()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    saved = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(tmp_path / "checkpoint-1")


def test_a_save_killed_while_writing_leaves_no_checkpoint_of_its_step(tmp_path):
    """A subprocess saves checkpoint-1, then is SIGKILLed in the middle of writing checkpoint-2's files: there is no
    checkpoint-2, resuming picks checkpoint-1, and the next save clears the staging directory."""
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from tests.test_checkpoints import _save, _trainer

        trainer = _trainer({str(tmp_path / "out")!r})
        _save(trainer, 1)
        write_rng = trainer._save_rng_state

        def slow(output_dir):
            write_rng(output_dir)
            Path({str(marker)!r}).write_text(output_dir)
            time.sleep(600)

        trainer._save_rng_state = slow
        _save(trainer, 2)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the subprocess never reached the write of checkpoint-2"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = tmp_path / "out"
    assert Path(marker.read_text()).parent.name == ".partial-checkpoint-2"  # it was writing into the staging dir
    assert sorted(p.name for p in out.iterdir()) == [".partial-checkpoint-2", "checkpoint-1"]
    assert checkpoints.newest_loadable_checkpoint(out) == str(out / "checkpoint-1")
    _save(_trainer(out), 2)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def _checkpoint(root: Path, step: int) -> Path:
    """A checkpoint directory with the kinds of files transformers writes."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.randn(64, 8)}, path / "adapter_model.safetensors")
    torch.save({"state": {0: torch.randn(256)}}, path / "optimizer.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage,reason", [
    (lambda c: _truncate(c / "adapter_model.safetensors"), "adapter_model.safetensors: SafetensorError"),
    (lambda c: _truncate(c / "adapter_model.safetensors", 0.001), "adapter_model.safetensors: SafetensorError"),
    (lambda c: _truncate(c / "optimizer.pt"), "optimizer.pt: BadZipFile"),
    (lambda c: _truncate(c / "trainer_state.json"), "trainer_state.json: JSONDecodeError"),
    (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    (lambda c: (c / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00002-of-00002.safetensors"}})),
     "model-00002-of-00002.safetensors (listed in model.safetensors.index.json) is missing"),
], ids=["safetensors_cut", "safetensors_header_cut", "torch_zip_cut", "json_cut", "no_state", "missing_shard"])
def test_resume_skips_a_damaged_checkpoint_naming_the_file_and_why(tmp_path, damage, reason):
    _checkpoint(tmp_path, 1)
    damage(_checkpoint(tmp_path, 2))
    assert checkpoints.checkpoint_problem(tmp_path / "checkpoint-1") is None
    with pytest.warns(UnloadableCheckpointWarning, match="skipping checkpoint-2") as caught:
        assert checkpoints.newest_loadable_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert reason in str(caught[0].message)


def test_no_loadable_checkpoint_and_no_directory():
    assert checkpoints.newest_loadable_checkpoint("/nonexistent/run") is None


def test_steps_past_the_resumed_checkpoint_are_dropped_from_the_log(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rew')
    checkpoints.drop_log_lines_after(log, 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


class _Args:
    world_size, device = 1, torch.device("cpu")


def test_first_ctrl_c_saves_and_stops_at_the_step_end_second_stops_at_once(capsys):
    """The callback's handler in place inside `with`, the previous one back after; signals raised in this process."""
    before = signal.getsignal(signal.SIGINT)
    interrupt, control = checkpoints.GracefulInterrupt(), TrainerControl()
    with interrupt:
        interrupt.on_step_end(_Args(), None, control)
        assert not (control.should_save or control.should_training_stop)
        signal.raise_signal(signal.SIGINT)  # the first: nothing stops now
        assert "Ctrl-C again stops at once" in capsys.readouterr().err
        interrupt.on_step_end(_Args(), None, control)
        assert control.should_save and control.should_training_stop and interrupt.stopped
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_lora_mismatch_names_each_setting_that_differs(tmp_path):
    from fastgrpo.integrations.checkpoints import lora_mismatch

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}))
    assert lora_mismatch(tmp_path, 8, 16.0, ["q_proj", "v_proj"]) is None
    assert lora_mismatch(tmp_path, 8, 16, "all-linear") is None  # PEFT expands it: not compared
    assert lora_mismatch(tmp_path, 16, 32, ["q_proj"]) == (
        "LoRA rank 8 (this run: 16); LoRA alpha 16 (this run: 32); LoRA target modules ['q_proj', 'v_proj'] (this "
        "run: ['q_proj'])")
    assert lora_mismatch(tmp_path / "missing", 16, 32, ["q_proj"]) is None  # no adapter config: nothing to compare
