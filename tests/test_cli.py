"""The `fastgrpo report` command: compiles a tiny model of a named architecture with the backend, runs a
training step and prints what was accelerated (table or JSON), graph breaks included."""
import json

import pytest
import torch

from fastgrpo.cli import main
from fastgrpo.compiler.tiny import tiny_model
from tests.tiny_models import count_modules


def test_report_json_counts_every_site_of_a_tiny_llama(capsys):
    assert main(["report", "--arch", "llama", "--inner", "eager", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["reports"]) == 1 and out["graph_breaks"] == []
    patterns = out["reports"][0]["patterns"]
    model = tiny_model("llama")
    assert patterns["rms_norm"]["matched"] == count_modules(model, "RMSNorm")
    assert patterns["rope"]["matched"] == model.config.num_hidden_layers
    assert patterns["gated_mlp"]["matched"] == model.config.num_hidden_layers
    # The step is a mean of the logits: no log-softmax, so nothing for the lm-head pattern, and no near miss.
    assert patterns["selective_logprob"]["matched"] == 0
    assert all(not p["near_misses"] for p in patterns.values()), patterns


def test_report_table_names_the_graph_breaks(capsys):
    assert main(["report", "--arch", "llama", "--inner", "eager"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm" in out and out.rstrip().endswith("graphs compiled: 1; graph breaks: 0")


def test_unknown_command_prints_the_usage(capsys):
    assert main(["reprot"]) == 2
    assert "usage: fastgrpo {report" in capsys.readouterr().out


def test_report_on_a_local_model_directory_with_lora(tmp_path, capsys):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    assert main(["report", "--model", str(tmp_path), "--lora", "--inner", "eager", "--json"]) == 0
    patterns = json.loads(capsys.readouterr().out)["reports"][0]["patterns"]
    layers = model.config.num_hidden_layers
    assert (patterns["rms_norm"]["matched"], patterns["rope"]["matched"], patterns["gated_mlp"]["matched"]) == (
        count_modules(model, "RMSNorm"), layers, layers)


# ---- bad input: one line naming the fix, exit status 2, before anything loads


@pytest.fixture(scope="module")
def model_config_dir(tmp_path_factory):
    """A directory with a model's config.json and the names of a weights file and a tokenizer file (the input
    checks look no further; nothing may load it)."""
    path = tmp_path_factory.mktemp("config-only")
    tiny_model("llama").config.save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if the main job gets as far as loading a model."""
    from fastgrpo.integrations import models

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(models, "load_model_and_tokenizer", load)


def _bad_input_cases(tmp_path, model_dir):
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"max_stepz": 3}))
    broken = tmp_path / "broken.yaml"
    broken.write_text("max_steps: 3\nlearning_rate: [1e-4\nbeta: 0.0\n")
    options = tmp_path / "options.yaml"
    options.write_text("fastgrpo_compile_options:\n  inner: eager\n  patern: [rope]\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "a"}\nnot json\n')
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"prompt": 5}\n{"prompt": 6}\n')
    resumed = tmp_path / "resumed"  # a run whose checkpoint holds a rank-8 adapter
    (resumed / "checkpoint-1").mkdir(parents=True)
    (resumed / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    (resumed / "checkpoint-1" / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}))
    earlier = tmp_path / "earlier"  # a finished run's directory
    (earlier / "checkpoint-30").mkdir(parents=True)
    (earlier / "train_log.jsonl").write_text('{"step": 30}\n')
    plain_dir = tmp_path / "plain_dir"  # a directory, not a save_to_disk one
    plain_dir.mkdir()
    one_prompt = tmp_path / "one_prompt.jsonl"
    one_prompt.write_text('{"prompt": "What is 2 + 2?"}\n')
    no_prompts = tmp_path / "no_prompts.yaml"
    no_prompts.write_text("task_size: 0\n")
    blocked = tmp_path / "a_file"  # a directory cannot be made under a file
    blocked.write_text("")
    dropout = tmp_path / "dropout.yaml"
    dropout.write_text("lora_dropout: 1.0\n")
    model = ["--model", str(model_dir)]
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((model_dir / "config.json").read_text())
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((model_dir / name).read_bytes())
    return {
        "model without weights": (["train", "--model", str(config_only)],
                                  "has a config.json but no weights (model.safetensors, "),
        "model without tokenizer": (["train", "--model", str(no_tokenizer)],
                                    "has no tokenizer (tokenizer.json, tokenizer.model, "),
        "missing model": (["train", "--model", "/nonexistent/model"], "--model '/nonexistent/model' is neither"),
        "missing config": (["train", *model, "--config", str(tmp_path / "nope.yaml")], "nope.yaml' does not exist"),
        "unknown config key": (["train", *model, "--config", str(unknown)], "unknown keys ['max_stepz']"),
        "yaml syntax": (["train", *model, "--config", str(broken)], "broken.yaml: YAML syntax error at line 3"),
        "backend option typo": (["train", *model, "--backend-options", '{"patern": 1}'],
                                "--backend-options: unknown fastgrpo backend option(s) ['patern']"),
        "backend option type": (["train", *model, "--backend-options", "fuse_residual_add=yes"],
                                "fuse_residual_add='yes'; it takes true or false"),
        "option typo in config": (["train", *model, "--config", str(options)],
                                  "fastgrpo_compile_options: unknown fastgrpo backend option(s) ['patern']"),
        "task typo": (["train", *model, "--task", "chain_summ"], "did you mean chain_sum or"),
        "missing dataset": (["train", *model, "--dataset", str(tmp_path / "rows.jsonl")], "rows.jsonl' does not exist"),
        "bad GRPO value": (["train", *model, "--num-generations", "3", "--per-device-train-batch-size", "4",
                            "--cpu-threads", str(torch.get_num_threads())], "config: "),
        "zero LoRA rank": (["train", *model, "--lora-r", "0"], "--lora-r / lora_r = 0; it takes a positive integer"),
        "negative learning rate": (["train", *model, "--learning-rate", "-1"], "--learning-rate / learning_rate = -1.0"),
        "zero steps": (["train", *model, "--max-steps", "0"], "--max-steps / max_steps = 0; it takes a positive"),
        "negative temperature": (["train", *model, "--temperature", "-1"], "--temperature / temperature = -1.0"),
        "greedy temperature": (["train", *model, "--temperature", "0"], "temperature = 0.0; it takes a number > 0"),
        "negative beta": (["train", *model, "--beta", "-0.1"], "--beta / beta = -0.1; it takes a number >= 0"),
        "no completion tokens": (["train", *model, "--max-completion-length", "0"], "max_completion_length = 0"),
        "empty batch": (["train", *model, "--per-device-train-batch-size", "0"], "per_device_train_batch_size = 0"),
        "checkpoints never": (["train", *model, "--save-steps", "0"], "--save-steps / save_steps = 0"),
        "negative seed": (["train", *model, "--seed", "-5"], "--seed / seed = -5; it takes an integer"),
        "no threads": (["train", *model, "--cpu-threads", "0"], "--cpu-threads 0; it takes a positive number"),
        "empty dataset": (["train", *model, "--dataset", str(empty)], "empty.jsonl is empty; it needs rows"),
        "malformed dataset": (["train", *model, "--dataset", str(malformed)], "malformed.jsonl could not be read as "
                              "jsonl: JSON parse error"),
        "numbers as prompts": (["train", *model, "--dataset", str(numbers)], "'prompt' column holds values of type "
                               "int64; it needs text, or chat messages"),
        "resume with another LoRA": (["train", *model, "--output-dir", str(resumed), "--resume", "--lora-r", "16"],
                                     "--resume: checkpoint-1 was written with LoRA rank 8 (this run: 16); resume with its"),
        "earlier run without --resume": (["train", *model, "--output-dir", str(earlier)],
                                         "holds an earlier run (checkpoint-30, train_log.jsonl); a new run there would "
                                         "delete its checkpoints"),
        "dataset directory not saved": (["train", *model, "--dataset", str(plain_dir)],
                                        "plain_dir is a directory but not a datasets save_to_disk one"),
        "fewer prompts than a step": (["train", *model, "--dataset", str(one_prompt)],
                                      "train_dataset has 1 prompt(s) and one step draws 2 distinct prompts"),
        "no task prompts": (["train", *model, "--config", str(no_prompts)], "task_size = 0; it takes a positive"),
        "output dir not writable": (["train", *model, "--output-dir", str(blocked / "run")],
                                    "cannot be created"),
        "dropout of 1 in config": (["train", *model, "--config", str(dropout)], "lora_dropout = 1.0; it takes a number"),
        "report missing model": (["report", "--model", "/nonexistent/model"], "--model '/nonexistent/model' is neither"),
        "report unknown arch": (["report", "--arch", "lama"], "unknown architecture 'lama'"),
    }


def test_bad_input_is_one_line_naming_the_fix_with_exit_status_2(tmp_path, model_config_dir, nothing_loads, capsys):
    for case, (argv, expected) in _bad_input_cases(tmp_path, model_config_dir).items():
        assert main(argv) == 2, case
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"fastgrpo {argv[0]}: error: "), (case, err)
        assert expected in lines[0], (case, lines[0])
        assert "Traceback" not in err


def test_debug_shows_the_traceback_of_bad_input(nothing_loads):
    from fastgrpo.errors import UserError

    with pytest.raises(UserError, match="is neither"):
        main(["train", "--debug", "--model", "/nonexistent/model"])


def test_unexpected_errors_keep_their_traceback_and_ctrl_c_exits_130(monkeypatch, capsys):
    from fastgrpo import cli

    def fails(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "report", fails)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["report"])

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "report", interrupted)
    assert main(["report"]) == 130
    assert capsys.readouterr().err.strip() == "fastgrpo report: stopped (Ctrl-C)"


def test_out_of_memory_is_a_message_with_its_notes_not_a_traceback(monkeypatch, capsys):
    from fastgrpo import cli

    def out_of_memory(argv):
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB\nmore details")
        error.add_note("fastgrpo: the step did not fit in memory (...). Change one of: ...")
        raise error

    monkeypatch.setattr(cli, "report", out_of_memory)
    assert main(["report"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["fastgrpo report: error: out of memory (CUDA out of memory. Tried to allocate 4.00 GiB)",
                   "  fastgrpo: the step did not fit in memory (...). Change one of: ..."]
    with pytest.raises(torch.OutOfMemoryError):
        main(["report", "--debug"])


def test_the_command_checks_versions_once_at_start(monkeypatch):
    from fastgrpo import cli

    calls = []
    monkeypatch.setattr(cli, "warn_untested_versions", lambda: calls.append(1))
    assert main(["reprot"]) == 2 and calls == [1]


def test_grpo_config_checks_backend_options_where_they_enter():
    from fastgrpo.errors import UserError
    from fastgrpo.integrations.trl import GRPOConfig

    with pytest.raises(UserError, match=r"fastgrpo_compile_options: unknown .* \['patern'\].*did you mean patterns"):
        GRPOConfig(output_dir="unused", use_cpu=True, fastgrpo_compile_options={"patern": ["rope"]})
    with pytest.raises(UserError, match="fastgrpo_compile_options: .* is not a JSON object"):
        GRPOConfig(output_dir="unused", use_cpu=True, fastgrpo_compile_options="{inner: eager}")
    config = GRPOConfig(output_dir="unused", use_cpu=True, fastgrpo_compile_options='{"inner": "eager"}')
    assert config.fastgrpo_compile_options == {"inner": "eager"}


def test_a_damaged_model_file_is_one_line_naming_the_fix(tmp_path):
    """A weights file cut short (a full disk, an interrupted copy) fails the load with one line, not a traceback."""
    from fastgrpo.errors import UserError
    from fastgrpo.integrations.models import load_model_and_tokenizer
    from tests.tiny_models import tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer(["a b c", "d e f"], vocab=64).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match=r"could not be loaded \(SafetensorError: .*save or copy the model again"):
        load_model_and_tokenizer(tmp_path)
