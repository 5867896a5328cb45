"""The `fastgrpo report` command: compiles a tiny model of a named architecture with the backend, runs a
training step and prints what was accelerated (table or JSON), graph breaks included."""
import json

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
