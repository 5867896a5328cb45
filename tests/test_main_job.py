"""The `fastgrpo train` main job, end to end on a tiny random-init model (CPU)."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from fastgrpo.integrations import checkpoints, main_job
from fastgrpo.integrations.tasks import closeness_reward, format_reward, make_task_dataset
from tests.tiny_models import tiny_tokenizer

VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Small everything: 2 steps of 1 prompt x 4 completions of <= 6 tokens.
FAST = ["--max-steps", "2", "--num-generations", "4", "--per-device-train-batch-size", "4",
        "--max-completion-length", "6", "--save-steps", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (head_dim 32) and a byte-level BPE tokenizer with a chat template, saved like a hub model."""
    path = tmp_path_factory.mktemp("tiny-llama")
    texts = [e["prompt"][-1]["content"] + " " + e["answer"] for e in make_task_dataset("chain_sum", size=64, seed=1)]
    tokenizer = tiny_tokenizer(texts + [main_job.__doc__], VOCAB, bpe_vocab=VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def job_argv(model_dir, out_dir, *extra, task_size=16, threads=None):
    config = out_dir.parent / f"{out_dir.name}-config.json"
    config.write_text(json.dumps({"task_size": task_size, "lora_r": 4, "lora_dropout": 0.0}))
    # --cpu-threads as it is: the job must not change the thread count of the test process.
    return ["--model", str(model_dir), "--output-dir", str(out_dir), "--config", str(config),
            "--cpu-threads", str(threads or torch.get_num_threads()), *FAST, *extra]  # fmt: skip


def run(model_dir, out_dir, *extra, task_size=16):
    assert main_job.main(job_argv(model_dir, out_dir, *extra, task_size=task_size)) == 0


def logged_steps(out_dir):
    return [json.loads(line)["step"] for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


def adapter_weights(out_dir):
    return load_file(out_dir / "adapter" / "adapter_model.safetensors")


def test_job_trains_and_writes_adapter_plot_and_logs(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    start = time.perf_counter()
    run(model_dir, out, "--task", "chain_sum", "--backend-options", "inner=aot_eager")
    # After the first step: what compiling cost, one decoder-layer graph for training and one for the reference.
    assert "s compiling: 2 graph(s) from 2 frame compile(s)" in capsys.readouterr().out
    print(f"2-step job: {time.perf_counter() - start:.1f} s")
    weights = adapter_weights(out)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    assert any("lora_B" in name and w.abs().sum() > 0 for name, w in weights.items()), "LoRA B never trained"
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "adapter" / "tokenizer_config.json").exists()
    png = (out / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        for key in ("reward", "kl", "peak_memory_gib", "rewards/closeness_reward/mean", "rewards/format_reward/mean"):
            assert key in line, key
    assert lines[1]["tokens_per_s"] > 0
    # The first line says what compiling cost before the first step ended, and how the compile cache was used.
    assert lines[0]["compile_s"] > 0 and lines[0]["compile/graphs"] == 2
    assert {"compile/aot_cache_hits", "compile/aot_cache_misses", "compile/fx_graph_cache_hits",
            "compile/fx_graph_cache_misses"} <= lines[0].keys()
    assert not any(key.startswith("compile") for key in lines[1])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


@pytest.fixture(scope="module")
def three_steps(model_dir, tmp_path_factory):
    """The adapter after 3 uninterrupted steps."""
    full = tmp_path_factory.mktemp("full") / "run"
    run(model_dir, full, "--task", "chain_sum", "--max-steps", "3", "--no-compile")
    return adapter_weights(full)


def assert_equal_weights(expected, resumed):
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


def test_out_of_memory_names_the_settings_and_the_resume_command(model_dir, tmp_path, monkeypatch, capsys):
    from trl.trainer.grpo_trainer import GRPOTrainer as StockGRPOTrainer

    from fastgrpo.cli import main

    real, calls = StockGRPOTrainer.training_step, []

    def second_step_does_not_fit(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StockGRPOTrainer, "training_step", second_step_does_not_fit)
    out = tmp_path / "run"
    assert main(["train", *job_argv(model_dir, out, "--no-compile")]) == 1
    err = capsys.readouterr().err
    assert "fastgrpo train: error: out of memory (CUDA out of memory. Tried to allocate 9.00 GiB)" in err
    assert "max_completion_length=6" in err and "fastgrpo_mini_batch" in err
    assert f"--resume continues from the newest checkpoint in {out}" in err and "Traceback" not in err
    assert (out / "checkpoint-1").is_dir()


def test_resume_continues_and_matches_an_uninterrupted_run(model_dir, three_steps, tmp_path):
    """2 steps, then --resume to 3, gives bit-identical adapter weights to 3 steps in one go.

    Exact because a resumed Trainer restores the adapter, AdamW state, scheduler and the global RNG
    states (python, numpy, torch) saved with the checkpoint, and the prompt order comes from a
    seeded sampler; the schedule is constant, so stopping at step 2 changes no learning rate.
    """
    split = tmp_path / "split"
    run(model_dir, split, "--task", "chain_sum", "--max-steps", "2", "--no-compile")
    first_half = adapter_weights(split)
    run(model_dir, split, "--task", "chain_sum", "--max-steps", "3", "--no-compile", "--resume")

    state = json.loads((split / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert logged_steps(split) == [1, 2, 3], "the resumed run must start at step 3, not redo steps 1-2"
    resumed = adapter_weights(split)
    assert any(not torch.equal(first_half[k], resumed[k]) for k in resumed), "step 3 did not train"
    assert_equal_weights(three_steps, resumed)


def test_resume_skips_a_truncated_checkpoint_and_still_matches_an_uninterrupted_run(model_dir, three_steps, tmp_path):
    """The newest checkpoint's adapter cut in half (a full disk, a kill while saving): --resume warns with the file
    and the reason, resumes from the checkpoint before it, replaces the damaged one and ends where 3 steps in one go
    end; the log holds each step once."""
    split = tmp_path / "split"
    run(model_dir, split, "--task", "chain_sum", "--max-steps", "2", "--no-compile")
    adapter = split / "checkpoint-2" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])
    with pytest.warns(checkpoints.UnloadableCheckpointWarning,
                      match=r"skipping checkpoint-2.*adapter_model.safetensors: SafetensorError"):
        run(model_dir, split, "--task", "chain_sum", "--max-steps", "3", "--no-compile", "--resume")
    assert logged_steps(split) == [1, 2, 3]
    assert checkpoints.checkpoint_problem(split / "checkpoint-2") is None
    assert_equal_weights(three_steps, adapter_weights(split))


# `fastgrpo train` whose every step first sleeps 2 s: two Ctrl-C sent a few ms apart land inside one step.
SLOW_STEPS = """
import sys, time
from fastgrpo.integrations.trl import GRPOTrainer
step = GRPOTrainer.training_step
GRPOTrainer.training_step = lambda self, *args, **kwargs: (time.sleep(2), step(self, *args, **kwargs))[1]
from fastgrpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _launch(model_dir, out_dir, stderr, slow=False):
    """The job as a user starts it (`python -m fastgrpo train`), steps until stopped, no checkpoint of its own."""
    argv = job_argv(model_dir, out_dir, "--task", "chain_sum", "--no-compile", "--max-steps", "1000", "--save-steps",
                    "1000", threads=1)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, *(["-c", SLOW_STEPS] if slow else ["-m", "fastgrpo"]), "train", *argv]
    return argv, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def _after_first_step(proc, out_dir, err_path):
    deadline = time.monotonic() + 300
    while not (out_dir / "train_log.jsonl").exists() or not (out_dir / "train_log.jsonl").read_text():
        assert proc.poll() is None, err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.2)


def test_ctrl_c_saves_at_the_step_end_prints_the_resume_command_and_that_command_resumes(model_dir, tmp_path):
    out, err_path = tmp_path / "run", tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        argv, proc = _launch(model_dir, out, err)
        try:
            _after_first_step(proc, out, err_path)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130, err_path.read_text()[-3000:]
        finally:
            proc.kill()
    stderr = err_path.read_text()
    assert "Ctrl-C: finishing this step, then saving a checkpoint" in stderr and "Traceback" not in stderr
    stopped = logged_steps(out)[-1]
    assert checkpoints.newest_loadable_checkpoint(out) == str(out / f"checkpoint-{stopped}")
    command = shlex.split(stderr.split("resume with:\n", 1)[1].splitlines()[0])
    assert command == ["fastgrpo", "train", *argv, "--resume"]
    resumed = command[2:] + ["--max-steps", str(stopped + 1), "--cpu-threads", str(torch.get_num_threads())]
    assert main_job.main(resumed) == 0
    assert logged_steps(out) == list(range(1, stopped + 2))


def test_a_second_ctrl_c_stops_at_once(model_dir, tmp_path):
    out, err_path = tmp_path / "run", tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        _, proc = _launch(model_dir, out, err, slow=True)
        try:
            _after_first_step(proc, out, err_path)
            proc.send_signal(signal.SIGINT)
            while "Ctrl-C again stops at once" not in err_path.read_text():
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 130, err_path.read_text()[-3000:]
        finally:
            proc.kill()
    stderr = err_path.read_text()
    assert "fastgrpo train: stopped (Ctrl-C)" in stderr and "Traceback" not in stderr and "resume with" not in stderr
    assert all(checkpoints.checkpoint_problem(c) is None for c in checkpoints.checkpoints_newest_first(out))


def test_dataset_file_and_config_precedence(model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "answer": str(a + 1)} for a in range(8)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("max_steps: 5\nlearning_rate: 0.001\nbeta: 0.0\ntemperature: 0.7\n")
    args = main_job.build_parser().parse_args(["--config", str(grpo), "--dataset", str(data), "--max-steps", "1"])
    job, train = main_job.resolve_settings(args)
    assert (job["dataset"], job["task"]) == (str(data), None)
    assert train["max_steps"] == 1 and train["learning_rate"] == 0.001 and train["temperature"] == 0.7

    out = tmp_path / "run"
    run(model_dir, out, "--dataset", str(data), "--config", str(grpo), "--max-steps", "1", "--no-compile")
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and "kl" not in lines[0]  # beta 0 from the file: no reference pass


def test_yaml_numbers_without_a_dot_are_read_as_numbers(tmp_path):
    # YAML 1.1 reads 1e-4 as text; GRPOConfig would keep it and the optimizer refuse it after the model loaded.
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("learning_rate: 1e-4\nlora_alpha: 3e1\nmax_grad_norm: 5e-1\n")
    job, train = main_job.resolve_settings(main_job.build_parser().parse_args(["--config", str(grpo)]))
    assert (train["learning_rate"], job["lora_alpha"], train["max_grad_norm"]) == (1e-4, 30.0, 0.5)


def test_unknown_config_key_is_rejected(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_stepz": 3}))
    with pytest.raises(ValueError, match="max_stepz"):
        main_job.resolve_settings(main_job.build_parser().parse_args(["--config", str(bad)]))


def test_backend_options_forms():
    assert main_job._parse_backend_options('{"inner": "eager"}') == {"inner": "eager"}
    assert main_job._parse_backend_options("inner=aot_eager,print_report=true") == {
        "inner": "aot_eager",
        "print_report": True,
    }


def test_cpu_threads_follow_the_request_and_the_load(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert main_job.choose_cpu_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(main_job.os, "cpu_count", lambda: 2)
        monkeypatch.setattr(main_job.os, "getloadavg", lambda: (4.0, 4.0, 4.0))
        assert main_job.choose_cpu_threads(None) == 1  # busy machine: one thread
        torch.set_num_threads(2)
        monkeypatch.setattr(main_job.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
        assert main_job.choose_cpu_threads(None) == 2  # idle machine: every core
    finally:
        torch.set_num_threads(before)


def test_rewards_give_partial_credit():
    completions = [[{"role": "assistant", "content": c}] for c in ["7", "It is 7.", "about 8", "no idea"]]
    assert format_reward(completions) == [1.0, 0.5, 0.5, 0.0]
    assert closeness_reward(completions, answer=["7"] * 4) == [1.0, 1.0, 0.5, 0.0]


def test_shipped_smollm2_loads_from_cache():
    """The default model: converted from the shipped GGUF once (~20 s), later loads from the cache quickly."""
    pytest.importorskip("gguf")
    from fastgrpo.integrations.models import load_model_and_tokenizer, smollm2_path

    smollm2_path()  # convert now if this machine never did, so the timing below is the cached load
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer()
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"cached SmolLM2 load took {elapsed:.1f} s"
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None


@pytest.mark.slow
def test_resident_memory_stays_flat_over_200_steps(model_dir, tmp_path, monkeypatch):
    """Nothing may pile up per step (autograd hooks, compiled graphs, KV caches, logs): after a warm-up
    of 50 steps the process's resident memory grows by less than 64 MiB over the next 150."""
    import gc

    import psutil

    resident = []
    job_progress = main_job._job_callback()

    class WithMemoryProbe(job_progress):
        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)
            gc.collect()
            resident.append(psutil.Process().memory_info().rss)

    monkeypatch.setattr(main_job, "_job_callback", lambda: WithMemoryProbe)
    run(model_dir, tmp_path / "run", "--max-steps", "200", "--save-steps", "1000",
        "--backend-options", "inner=aot_eager")  # fmt: skip
    assert len(resident) == 200
    growth = resident[-1] - resident[49]
    print(f"resident memory: step 50 {resident[49] / 2**20:.0f} MiB, step 200 {resident[-1] / 2**20:.0f} MiB")
    assert growth < 64 * 2**20, f"grew {growth / 2**20:.1f} MiB over 150 steps"
