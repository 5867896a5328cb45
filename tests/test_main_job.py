"""The `fastgrpo train` main job, end to end on a tiny random-init model (CPU)."""
import json
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from fastgrpo.integrations import main_job
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


def run(model_dir, out_dir, *extra, task_size=16):
    config = out_dir.parent / f"{out_dir.name}-config.json"
    config.write_text(json.dumps({"task_size": task_size, "lora_r": 4, "lora_dropout": 0.0}))
    # --cpu-threads as it is: the job must not change the thread count of the test process.
    argv = ["--model", str(model_dir), "--output-dir", str(out_dir), "--config", str(config),
            "--cpu-threads", str(torch.get_num_threads()), *FAST, *extra]  # fmt: skip
    assert main_job.main(argv) == 0


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


def test_resume_continues_and_matches_an_uninterrupted_run(model_dir, tmp_path):
    """2 steps, then --resume to 3, gives bit-identical adapter weights to 3 steps in one go.

    Exact because a resumed Trainer restores the adapter, AdamW state, scheduler and the global RNG
    states (python, numpy, torch) saved with the checkpoint, and the prompt order comes from a
    seeded sampler; the schedule is constant, so stopping at step 2 changes no learning rate.
    """
    full, split = tmp_path / "full", tmp_path / "split"
    run(model_dir, full, "--task", "chain_sum", "--max-steps", "3", "--no-compile")
    run(model_dir, split, "--task", "chain_sum", "--max-steps", "2", "--no-compile")
    first_half = adapter_weights(split)
    run(model_dir, split, "--task", "chain_sum", "--max-steps", "3", "--no-compile", "--resume")

    state = json.loads((split / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    steps = [json.loads(line)["step"] for line in (split / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], "the resumed run must start at step 3, not redo steps 1-2"
    expected, resumed = adapter_weights(full), adapter_weights(split)
    assert expected.keys() == resumed.keys()
    assert any(not torch.equal(first_half[k], resumed[k]) for k in resumed), "step 3 did not train"
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


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
