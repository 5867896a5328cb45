"""bench/_harness.py: the rows every benchmark appends, the named model shapes, the CPU timers and the sweep; and the
step benchmark's table, which names each row's shape and reads the peers' rows from the same file."""
import json
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from bench import _harness as harness
from bench import grpo_step

# The released checkpoints' config.json values and parameter counts, as their model cards give them.
PUBLISHED = {
    # name: (model_type, layers, query heads, key-value heads, head dim, hidden, parameters)
    "qwen2.5-0.5b": ("qwen2", 24, 14, 2, 64, 896, 494_032_768),
    "qwen2.5-1.5b": ("qwen2", 28, 12, 2, 128, 1536, 1_543_714_304),
    "qwen2.5-7b": ("qwen2", 28, 28, 4, 128, 3584, 7_615_616_512),
    "llama-3.1-8b": ("llama", 32, 32, 8, 128, 4096, 8_030_261_248),
    "gemma-2-2b": ("gemma2", 26, 8, 4, 256, 2304, 2_614_341_888),
    "qwen3-4b": ("qwen3", 36, 32, 8, 128, 2560, 4_022_468_096),
    "phi-3-mini": ("phi3", 32, 32, 32, 96, 3072, 3_821_079_552),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 32, 4, 128, 2048, 30_532_122_624),
}


def test_every_required_shape_is_named():
    assert set(PUBLISHED) <= set(harness.SHAPES)
    assert harness.DEFAULT_SHAPE == "qwen2.5-1.5b"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_shape_builds_the_released_model(name):
    model_type, layers, heads, kv_heads, head_dim, hidden, parameters = PUBLISHED[name]
    config = harness.shape_config(name, max_len=4352)
    assert config.model_type == model_type
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (layers, heads, kv_heads)
    assert (config.hidden_size, getattr(config, "head_dim", None) or hidden // heads) == (hidden, head_dim)
    assert harness.attention_shape(name) == (heads, kv_heads, head_dim)
    assert config.max_position_embeddings >= 4352 and config.use_cache is False
    model = harness.causal_lm(config, "meta")  # no memory: only the parameter count is read
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_gemma_2_keeps_its_softcaps_and_sliding_window():
    config = harness.shape_config("gemma-2-2b")
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.sliding_window == 4096 and "sliding_attention" in config.layer_types
    # transformers' SDPA path drops the attention softcap: the shape runs the attention that applies it.
    assert config._attn_implementation == "eager"
    assert grpo_step.softcap(config) == 30.0 and grpo_step.softcap(harness.shape_config("qwen2.5-1.5b")) == 0.0
    tiny = harness.shape_config("gemma-2-2b", tiny=True)
    assert tiny.sliding_window < 4096 and tiny.head_dim == harness.TINY_WHERE_SET["head_dim"]


@pytest.mark.parametrize("name", sorted(harness.SHAPES))
def test_each_tiny_shape_runs_a_forward(name):
    config = harness.shape_config(name, max_len=64, tiny=True)
    assert config.num_hidden_layers == 2 and config.vocab_size == 512
    model = harness.causal_lm(config, "cpu", dtype=torch.float32, seed=0)
    logits = model(input_ids=torch.randint(0, 512, (2, 24))).logits
    assert logits.shape == (2, 24, 512) and torch.isfinite(logits).all()


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen2.5-1.5b"):
        harness.shape_config("qwen-9000")


def test_record_appends_stamped_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGRPO_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("FASTGRPO_BENCH_COMMIT", "abc1234+dirty")
    argv = [str(harness.REPO / "bench" / "grpo_step.py"), "--shape", "gemma-2-2b", "--prompt", "a b"]
    path = harness.record("grpo_step", [{"system": "fastgrpo", "step_ms": 1.5}], argv)
    harness.record("grpo_step", [{"system": "unsloth", "step_ms": 2.5}, {"system": "eager", "step_ms": None}], argv)
    assert path == tmp_path / "grpo_step.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["system"] for r in rows] == ["fastgrpo", "unsloth", "eager"]
    for row in rows:
        assert list(row)[:4] == ["date", "commit", "hardware", "command"]
        assert row["date"] == time.strftime("%Y-%m-%d") and row["commit"] == "abc1234+dirty"
        assert row["hardware"] == harness.hardware() and row["hardware"]
        assert row["command"] == "python bench/grpo_step.py --shape gemma-2-2b --prompt 'a b'"
    assert harness.read_rows(path) == rows


def test_read_rows_takes_printed_result_lines(tmp_path):
    printed = tmp_path / "out.txt"
    printed.write_text('RESULT {"a": 1}\n\n{"a": 2}\n')
    assert harness.read_rows(printed) == [{"a": 1}, {"a": 2}]


def test_commit_is_the_short_hash_and_says_dirty(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(harness, "REPO", tmp_path)
    monkeypatch.delenv("FASTGRPO_BENCH_COMMIT", raising=False)
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.txt").write_text("not part of the tree")
    assert harness.commit() == head
    (tmp_path / "a.txt").write_text("2")
    assert harness.commit() == head + "+dirty"
    monkeypatch.setattr(harness, "REPO", tmp_path / "nowhere")
    assert harness.commit() == "unknown"


def test_markdown_table():
    assert harness.markdown_table(("a", "b"), [(1, "x"), (2, "y")]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |"


def test_cpu_timers():
    host = []
    times = harness.wall_ms(lambda: time.sleep(0.002), 3, host_ms=host)
    assert len(times) == len(host) == 3 and all(t >= 2 for t in times)
    low, high = harness.kernel_ms(lambda: time.sleep(0.001), warmup=1, rep=10, quantiles=[0.2, 0.8])
    assert 1 <= low <= high
    assert harness.graph_ms(lambda: time.sleep(0.001), rep=5) >= 1


def test_peaks_since_reset_none_on_the_cpu():
    harness.release_cache()
    harness.reset_peak()
    if not torch.cuda.is_available():
        assert harness.peak_gib() is None and harness.peak_reserved_gib() is None
        return
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    assert harness.peak_reserved_gib() >= 64 / 1024 and harness.peak_gib() >= 64 / 1024


@pytest.mark.parametrize("count", [0, 1, 3])
def test_warm_up_calls_as_many_times_as_asked_each_followed_by_its_after_each(count):
    calls, after = [], []
    harness.warm_up(lambda: calls.append(1), count, after_each=lambda: after.append(len(calls)))
    assert len(calls) == count and after == list(range(1, count + 1))


def test_a_launch_configuration_sweep_times_each_and_puts_the_setting_back():
    module = SimpleNamespace(delay=0.006)
    seen = []
    now, timings = harness.time_launch_configs(lambda: time.sleep(module.delay), [0.012, 0.0, 0.024],
                                               lambda c: [(module, "delay", c)], rep=40,
                                               report=lambda c, ms: seen.append(c))
    assert module.delay == 0.006 and seen == [0.012, 0.0, 0.024]
    assert [c for _, c in timings] == [0.0, 0.012, 0.024]
    assert timings[0][0] < now < timings[1][0]


def test_settings_for_a_process_are_set_and_named_and_bad_ones_refused(monkeypatch):
    from fastgrpo.kernels import nf4_lora_linear as nf4

    monkeypatch.setattr(nf4, "_BLOCK_N", nf4._BLOCK_N)  # put back after the test
    monkeypatch.setattr(nf4, "_LUT", nf4._LUT)
    applied = harness.apply_settings(["fastgrpo.kernels.nf4_lora_linear._BLOCK_N=64",
                                      "fastgrpo.kernels.nf4_lora_linear._LUT=True"])
    assert applied == {"fastgrpo.kernels.nf4_lora_linear._BLOCK_N": 64,
                       "fastgrpo.kernels.nf4_lora_linear._LUT": True}
    assert nf4._BLOCK_N == 64 and nf4._LUT is True
    for bad, words in (("_BLOCK_N=64", "MODULE.ATTRIBUTE=VALUE"), ("fastgrpo.kernels.nf4_lora_linear._BLOCK_N", "e.g."),
                       ("fastgrpo.kernels.nf4_lora_linear._NO_SUCH=1", "no attribute")):
        with pytest.raises(SystemExit, match=words):
            harness.apply_settings([bad])


def test_the_lora_merge_bench_runs_on_the_cpu(capsys):
    import sys

    from bench import bench_lora_merge

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["bench_lora_merge.py", "--dry-run", "--shapes", "qwen2.5-1.5b"])
        mp.setenv("TRITON_INTERPRET", "1")
        assert bench_lora_merge.main() == 0
    out = capsys.readouterr().out
    assert "| qwen2.5-1.5b | gate | 24 x 40 | merge+undo |" in out and "| qwen2.5-1.5b | qkv | 40 x 24 | copy |" in out


def _row(system, step_ms, peak, shape="qwen2.5-0.5b", completion=1024, error=None):
    return dict(shape=shape, system=system, prompt=256, completion=completion, spread=False, step_ms=step_ms,
                peak_gib=peak, tokens_per_s=None if step_ms is None else round(10240 / step_ms * 1e3), error=error)


def test_the_step_table_names_each_shape_and_compares_the_systems():
    rows = [_row("fastgrpo", 200.0, 3.0), _row("unsloth", 300.0, 4.0), _row("inductor", 100.0, 12.0),
            _row("fastgrpo", 700.0, 4.5, shape="gemma-2-2b", completion=4096),
            _row("unsloth", None, None, shape="gemma-2-2b", completion=4096, error="OOM")]
    lines = grpo_step.table(rows).splitlines()
    assert lines[0].startswith("| shape / prompt / completion | inductor | unsloth | fastgrpo |")
    gemma, qwen = lines[2:]  # sorted by shape
    assert gemma.startswith("| gemma-2-2b / 256 / 4096 | - | OOM | 700 ms, 4.5 GiB")
    assert qwen.startswith("| qwen2.5-0.5b / 256 / 1024 | 100 ms, 12.0 GiB, 102400 tok/s | 300 ms")
    assert "| 1.50x | 0.75x | 0.50x |" in qwen  # tokens/s and memory against Unsloth, tokens/s against inductor


def test_merge_prints_the_table_of_the_results_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGRPO_BENCH_RESULTS", str(tmp_path))
    harness.record("grpo_step", [_row("fastgrpo", 200.0, 3.0), _row("unsloth", 300.0, 4.0)])
    harness.record("grpo_step", [_row("fastgrpo", 250.0, 3.0)])  # a later row of the same case replaces the first
    assert grpo_step.main(["--merge"]) == 0
    assert ("| qwen2.5-0.5b / 256 / 1024 | 300 ms, 4.0 GiB, 34133 tok/s | 250 ms, 3.0 GiB, 40960 tok/s | 1.20x |"
            in capsys.readouterr().out)


def test_the_step_refuses_unknown_systems_and_shapes():
    with pytest.raises(SystemExit):
        grpo_step.main(["--systems", "fastgrpo_flash", "--tiny"])
    with pytest.raises(SystemExit):
        grpo_step.main(["--shape", "llama-8b", "--tiny"])


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gemma-2-2b", "phi-3-mini"])
def test_the_unsloth_peer_writes_the_shapes_checkpoint(tmp_path, name):
    """Unsloth itself needs CUDA; the checkpoint it loads and the batch it is given are built here."""
    import transformers

    from bench.peers import unsloth_step

    vocab = unsloth_step.write_checkpoint(str(tmp_path), 96, tiny=True, device="cpu", shape=name)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert config.model_type == PUBLISHED[name][0] and config.num_hidden_layers == 2 and vocab == config.vocab_size
    assert len(tokenizer) == vocab and (tokenizer.pad_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id, config.eos_token_id)
    batch = unsloth_step.make_batch(8, vocab, tokenizer.pad_token_id, "cpu", prompt=4, lengths=[8, 3] * 4)
    assert batch["completion_ids"].shape == (unsloth_step.GROUP, 8)
    assert (batch["completion_ids"][1, 3:] == tokenizer.pad_token_id).all()


@pytest.mark.gpu
def test_cuda_timers_and_peak_memory():
    block, peak = harness.peak_above(lambda: torch.empty(2**28, device="cuda", dtype=torch.uint8))
    assert peak >= block.numel()
    x = torch.randn(4096, 4096, device="cuda")
    low, mid, high = harness.kernel_ms(lambda: x @ x, quantiles=[0.2, 0.5, 0.8])
    assert 0 < low <= mid <= high
    module = SimpleNamespace(n=2048)
    now, timings = harness.time_launch_configs(lambda: x[:module.n] @ x, [4096, 256], lambda n: [(module, "n", n)])
    assert module.n == 2048 and [n for _, n in timings] == [256, 4096] and timings[0][0] < now < timings[1][0]
    tflops, tbps = harness.device_rates()
    assert tflops > 50 and tbps > 0.5


CUDA_STEP_SYSTEMS = ("eager", "inductor", "fastgrpo", "fastgrpo_save", "fastgrpo_actmul", "fastgrpo_packed",
                     "fastgrpo_shared")


@pytest.mark.gpu
@pytest.mark.parametrize("system", CUDA_STEP_SYSTEMS)
@pytest.mark.parametrize("shape", ["gemma-2-2b", "llama-3.1-8b", "phi-3-mini"])
def test_the_step_runs_each_system_on_cuda(shape, system, capsys):
    """The --tiny step of every fastgrpo form and the baselines on CUDA (offloaded checkpointing, packed rows), one
    system a test: each compiles its own graphs, so apart they spread over pytest-xdist's workers."""
    assert grpo_step.main(["--tiny", "--shape", shape, "--systems", system, "--completions", "64",
                           "--prompt", "32", "--warmup", "1", "--repeat", "1"]) == 0
    rows = [json.loads(line.removeprefix("RESULT ")) for line in capsys.readouterr().out.splitlines()
            if line.startswith("RESULT ")]
    assert [r["system"] for r in rows] == [system]
    for row in rows:
        assert row["shape"] == shape
        if row["error"] is None:
            assert row["peak_gib"] > 0 and row["step_ms"] > 0, row
        else:  # Gemma-2's soft-capped attention has no variable-length kernel: its packed rows may say so
            assert shape == "gemma-2-2b" and row["system"] in grpo_step.PACKED, row


def test_the_rollout_limit_reads_the_experts_the_rows_pick():
    """bench_generation's limit: a decode step reads the dense weights and, of each expert bank, the share of its
    experts that the running rows are expected to pick (k/E for one row, nearly all for many)."""
    from bench import bench_generation as bg

    moe = harness.causal_lm(harness.shape_config("qwen3-30b-a3b"), "meta")
    banks = bg.expert_banks(moe)
    assert len(banks) == 48 and {bank[2:] for bank in banks} == {(128, 8)}
    assert not bg.expert_banks(harness.causal_lm(harness.shape_config("qwen2.5-1.5b"), "meta"))
    experts = sum(bank[0] for bank in banks)
    dense = bg.model_bytes(moe) - experts

    def step_bytes(rows):  # one decode step, no prefill, no cache
        return bg.limit_seconds(moe, [2] * rows, 0, 0, 0) * harness.copy_tbps() * 1e12

    assert step_bytes(1) == pytest.approx(dense + experts * 8 / 128)
    assert step_bytes(1024) == pytest.approx(dense + experts)


def test_kernel_resources_builds_a_recorded_launch_for_sm90_and_reads_its_registers(tmp_path):
    """bench/kernel_resources.py's build step on one recorded launch (the rollout merge's in-place pass): a row with
    its registers and spill bytes, read from the sm_90 build's cubin."""
    from bench import kernel_resources

    launch = {"module": "fastgrpo.kernels.lora_merge", "name": "_lora_merge_kernel", "options": {"num_warps": 4},
              "args": {"w_ptr": ["type", "*bf16"], "out_ptr": ["type", "*bf16"], "a_ptr": ["type", "*fp32"],
                       "b_ptr": ["type", "*fp32"], "stats_ptr": ["type", "*i64"], "fix_index_ptr": ["type", "*i64"],
                       "fix_value_ptr": ["type", "*bf16"], "fix_cap": ["type", "i64"], "N": ["type", "i32"],
                       "K": ["type", "i32"], "R": ["type", "i32"], "stride_w": ["type", "i32"],
                       "stride_out": ["type", "i32"], "MODE": ["constexpr", 1], "INT": ["tl_dtype", "int16"],
                       "BLOCK_N": ["constexpr", 8], "BLOCK_K": ["constexpr", 256], "TILES": ["constexpr", 4]}}
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([launch, launch]))
    rows = kernel_resources.build(str(path), None, [])
    assert len(rows) == 1 and "error" not in rows[0], rows  # one build for two equal launches
    assert 0 < rows[0]["registers"] <= 255 and rows[0]["spill_bytes"] == 0
    assert kernel_resources.build(str(path), None, ["_other_kernel"]) == []
