"""What the benchmarks under bench/ share: model shapes by name, the device's timers, markdown tables, and the rows
each benchmark appends to bench/results/<bench>.jsonl.

A script puts bench/ on sys.path and imports this module (`import _harness`); the import puts the repository root on
sys.path too, so `fastgrpo` is this checkout's. Nothing here imports transformers or fastgrpo at import time (Unsloth
must be imported before transformers in its peer script).

Rows: one JSON object a line: `date`, `commit` (git short hash, "+dirty" when tracked files differ from it),
`hardware` (the GPU's name, or the CPU's model), `command` (the argv), then the benchmark's own fields.
FASTGRPO_BENCH_RESULTS names another directory for them; FASTGRPO_BENCH_COMMIT gives the commit of a tree without
a git directory (a copy of the checkout on another machine).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Named dense shapes, random-init from transformers configs (nothing is downloaded). The numbers are the
# config.json values of the released checkpoints on their public model cards (Qwen/Qwen2.5-0.5B, -1.5B, -7B,
# meta-llama/Llama-3.1-8B, google/gemma-2-2b); tests/test_bench_harness.py checks each against the model's published
# parameter count. max_position_embeddings is raised to a run's length where that is longer.
SHAPES = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # Shapes nothing was tuned on (checked, not tuned: issue 42). Qwen3-4B: q/k RMSNorm, 36 layers, tied head.
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=40960,
    ),
    # Phi-3-mini-4k: q/k/v and gate/up each one fused projection, head dim 96, no GQA, 32k vocabulary, sliding window
    # 2047 on every layer.
    "phi-3-mini": dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047,
        pad_token_id=32000, bos_token_id=1, eos_token_id=32000,
    ),
    # Soft-capped attention logits and final logits, sliding-window attention on every other layer. transformers'
    # SDPA path leaves the attention softcap out, so every system runs the eager attention that applies it (what
    # transformers asks of Gemma-2 training).
    "gemma-3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1e6, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=1e4, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        attn_implementation="eager",
    ),
    # A hybrid decoder: gated DeltaNet (linear attention) layers with a full-attention layer every fourth. transformers'
    # Qwen3_5TextConfig defaults as they are (hidden 4096, 32 layers, head dim 256, 248,320-token vocabulary: the
    # dimensions third-party descriptions give for Qwen3.5-9B; not checked against a released checkpoint).
    "qwen3.5-text-defaults": dict(model_type="qwen3_5_text"),
    # A mixture-of-experts decoder: 128 experts, 8 a token, in every layer (Qwen3-30B-A3B's config.json values; the
    # parameter count is its model card's, tests/test_bench_harness.py). The rollout engine decodes its bf16 experts
    # through transformers' grouped_mm inside the captured step.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}
DEFAULT_SHAPE = "qwen2.5-1.5b"
# --tiny: two small layers of the same architecture (a smoke run; CPU is fine). The second set applies only to
# shapes whose config names those fields.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=512)
TINY_WHERE_SET = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=64)


def _shape(name: str) -> dict:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: give one of {', '.join(SHAPES)}")
    return SHAPES[name]


def shape_config(name: str, max_len: int | None = None, tiny: bool = False):
    """The transformers config of shape `name` (use_cache off, bf16), long enough for `max_len` positions."""
    from transformers import AutoConfig

    values = dict(_shape(name))
    model_type = values.pop("model_type")
    if tiny:
        values.update(TINY)
        values.update({key: value for key, value in TINY_WHERE_SET.items() if key in values})
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # special tokens inside the tiny vocabulary
            if values.get(key) is not None and values[key] >= TINY["vocab_size"]:
                values[key] = TINY["vocab_size"] - 1
        if "layer_types" in values:  # one layer of each kind
            values["layer_types"] = (list(dict.fromkeys(values["layer_types"])) * 2)[: TINY["num_hidden_layers"]]
    if max_len is not None:
        values["max_position_embeddings"] = max(max_len, values.get("max_position_embeddings", 0))
    return AutoConfig.for_model(model_type, **values, use_cache=False, dtype="bfloat16")


def attention_shape(name: str) -> tuple[int, int, int]:
    """(query heads, key-value heads, head dim) of shape `name`."""
    c = shape_config(name)
    heads = c.num_attention_heads
    return heads, c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // heads


def mlp_shape(name: str) -> tuple[int, int]:
    """(hidden, intermediate) of shape `name`."""
    c = shape_config(name)
    return c.hidden_size, c.intermediate_size


def head_shape(name: str) -> tuple[int, int]:
    """(hidden, vocabulary) of shape `name`'s lm-head."""
    c = shape_config(name)
    return c.hidden_size, c.vocab_size


def causal_lm(config, device, dtype: torch.dtype = torch.bfloat16, seed: int | None = None):
    """A random-init causal LM of `config`, made on `device` (seeded when `seed` is given)."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# Timing. On CUDA: CUDA-synchronised wall time, triton's do_bench (and its CUDA-graph form, GPU time alone). On the
# CPU the same calls time plain calls, so --help and tiny smoke runs work without a GPU (their times mean nothing).


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, count: int, before_each=None, after_each=None, host_ms: list | None = None) -> list[float]:
    """`fn()` `count` times; each call's wall time in ms up to the device's finishing it. `before_each` and
    `after_each` run untimed around each call. `host_ms`, if given, gets each call's host time: until `fn` returned,
    before the synchronize (close to the wall time, the call is bound by the host)."""
    times = []
    for _ in range(count):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        fn()
        if host_ms is not None:
            host_ms.append((time.perf_counter() - start) * 1e3)
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if after_each is not None:
            after_each()
    return times


def _summary(times: list[float], quantiles, return_mode: str):
    if quantiles is not None:
        ordered = sorted(times)
        picked = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in quantiles]
        return picked[0] if len(picked) == 1 else picked
    return {"mean": statistics.mean, "median": statistics.median, "min": min, "max": max}[return_mode](times)


def _cpu_ms(fn, warmup: float, rep: float) -> list[float]:
    """Calls of `fn` for `warmup` ms (at least one), then for `rep` ms (at least one): each timed call's ms."""
    deadline = time.perf_counter() + warmup / 1e3
    fn()
    while time.perf_counter() < deadline:
        fn()
    times, deadline = [], time.perf_counter() + rep / 1e3
    while not times or time.perf_counter() < deadline:
        times.append(wall_ms(fn, 1)[0])
    return times


def kernel_ms(fn, warmup: float = 25, rep: float = 100, quantiles=None, return_mode: str = "mean"):
    """triton.testing.do_bench of `fn` (warm-up and repetitions in ms, its quantiles or its `return_mode`)."""
    if not torch.cuda.is_available():
        return _summary(_cpu_ms(fn, warmup, rep), quantiles, return_mode)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)


def graph_ms(fn, rep: float = 20, return_mode: str = "median") -> float:
    """GPU time of `fn` replayed as a CUDA graph (triton.testing.do_bench_cudagraph); on the CPU, plain calls."""
    if not torch.cuda.is_available():
        return _summary(_cpu_ms(fn, 0, rep), None, return_mode)
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode=return_mode)


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def release_cache() -> None:
    """Give back the cached blocks no tensor uses (compiles and earlier lengths leave them), so that
    `peak_reserved_gib()` after a step and reset_peak() counts what a step in steady state holds (warm_up)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def warm_up(fn, count: int, **wall_ms_kwargs) -> None:
    """`count` warm-up calls of `fn` (wall_ms's keyword arguments), the cache released before the last
    (release_cache), so that a reserved peak measured after them holds what a call in steady state holds."""
    wall_ms(fn, max(count - 1, 0), **wall_ms_kwargs)
    release_cache()
    wall_ms(fn, min(count, 1), **wall_ms_kwargs)


def peak_above(fn):
    """(fn(), the device's peak allocated bytes during the call beyond those allocated before it; 0 on the CPU)."""
    if not torch.cuda.is_available():
        return fn(), 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def graph_pool_bytes() -> int:
    """The memory pool that fastgrpo's graphs keep for their temporaries (fastgrpo/kernels/_graphs.py: reserved, so
    not counted as allocated while they replay); 0 where fastgrpo's graphs were never imported."""
    graphs = sys.modules.get("fastgrpo.kernels._graphs")
    return graphs.graph_pool_bytes() if graphs is not None else 0


def peak_gib() -> float | None:
    """The device's peak allocated GiB since reset_peak(), plus `graph_pool_bytes()`; two decimals; None on the CPU."""
    if not torch.cuda.is_available():
        return None
    return round((torch.cuda.max_memory_allocated() + graph_pool_bytes()) / 2**30, 2)


def peak_reserved_gib() -> float | None:
    """The device's peak reserved GiB since reset_peak() (see release_cache()); two decimals; None on the CPU.
    Beyond `peak_gib()` it counts blocks freed while another stream still used them (an offloaded input whose copy to
    the host had not finished: the allocator stops counting them as allocated at the free, and reuses them once that
    stream passes) and the caching allocator's free blocks (fragmentation)."""
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)


@contextlib.contextmanager
def patched(*settings):
    """Each (object, attribute, value) of `settings` set while the block runs, then put back."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in settings]
    try:
        for obj, name, value in settings:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def parse_setting(setting: str, flag: str = "--set"):
    """(module, attribute, value, "module.attribute") of a "module.attribute=literal" setting (the A/B flags' form),
    refused with a message naming `flag` where it does not parse or name an existing attribute."""
    import ast
    import importlib

    target, sep, literal = setting.partition("=")
    module_name, _, attribute = target.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"{flag} {setting!r}: write MODULE.ATTRIBUTE=VALUE, e.g. "
                         "fastgrpo.kernels.nf4_lora_linear._BLOCK_N=64")
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise SystemExit(f"{flag} {setting!r}: {module_name} has no attribute {attribute!r}")
    return module, attribute, ast.literal_eval(literal), target


def apply_settings(settings: list[str]) -> dict:
    """Each "module.attribute=literal" of `settings` set for the rest of the process (an A/B of a setting across the
    processes of one call); returns {"module.attribute": value} for the rows."""
    applied = {}
    for setting in settings:
        module, attribute, value, target = parse_setting(setting)
        setattr(module, attribute, value)
        applied[target] = value
    return applied


def time_launch_configs(fn, configs, settings, rep: float = 30, now_rep: float | None = None, report=None):
    """A launch-configuration sweep: the GPU time (median of CUDA-graph replays) of `fn` under each of `configs`,
    `settings(config)` giving the (module, attribute, value) triples that select it. Returns `fn`'s time as the
    modules have it and [(ms, config)] fastest first. `report(config, ms)` runs after each (progress lines)."""
    timings = []
    for config in configs:
        with patched(*settings(config)):
            ms = graph_ms(fn, rep)
        timings.append((ms, config))
        if report is not None:
            report(config, ms)
    return graph_ms(fn, now_rep or rep), sorted(timings, key=lambda t: t[0])


# The H200's rates the kernel benches state their numbers against: bf16 dense matmul (cuBLAS, 8192^3) and
# device-to-device copy, `python bench/_harness.py` (which measures them on the device it runs on).
MATMUL_TFLOPS = 790.0
COPY_TBPS = 4.3


def device_rates() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3, device-to-device copy TB/s of 1 GiB: read + write) of this CUDA device."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    matmul = kernel_ms(lambda: torch.mm(a, b, out=out), warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (matmul * 1e-3) / 1e12, copy_tbps()


@functools.cache
def copy_tbps() -> float:
    """This CUDA device's copy rate (read + write, TB/s of a 1 GiB copy), measured once a process: the floors of the
    memory-bound benches (an H100 copies at ~3 TB/s, an H200 at ~4.3); COPY_TBPS where no CUDA device is."""
    if not torch.cuda.is_available():
        return COPY_TBPS
    source = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    copy = kernel_ms(lambda: target.copy_(source), warmup=100, rep=500, return_mode="median")
    del source, target
    torch.cuda.empty_cache()
    return 2 * 2**30 / (copy * 1e-3) / 1e12


# Markdown tables.


def md_header(*columns) -> str:
    return "| " + " | ".join(map(str, columns)) + " |\n" + "|---" * len(columns) + "|"


def md_row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(columns, rows) -> str:
    return "\n".join([md_header(*columns), *(md_row(*cells) for cells in rows)])


# Rows.


def commit() -> str:
    """The checkout's git short hash, "+dirty" when tracked files differ from it (FASTGRPO_BENCH_COMMIT if set)."""
    if os.environ.get("FASTGRPO_BENCH_COMMIT"):
        return os.environ["FASTGRPO_BENCH_COMMIT"]

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def hardware() -> str:
    """The GPU's name, or the CPU's model."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def command(argv: list[str] | None = None) -> str:
    """The command line that ran: python, the script's path from the repository root, its arguments."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    name = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else argv[0]
    return shlex.join(["python", name, *argv[1:]])


def stamp(argv: list[str] | None = None) -> dict:
    return dict(date=time.strftime("%Y-%m-%d"), commit=commit(), hardware=hardware(), command=command(argv))


def results_path(bench: str) -> Path:
    return Path(os.environ.get("FASTGRPO_BENCH_RESULTS") or REPO / "bench" / "results") / f"{bench}.jsonl"


def record(bench: str, rows: list[dict], argv: list[str] | None = None) -> Path:
    """Appends `rows` to bench/results/<bench>.jsonl, each after the stamp's fields (a row's own `date`, ... win)."""
    path = results_path(bench)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = stamp(argv)
    with path.open("a") as out:
        out.writelines(json.dumps({**head, **row}, default=str) + "\n" for row in rows)
    return path


def read_rows(*paths) -> list[dict]:
    """The rows of JSON-lines files (a line may start with "RESULT ", as the scripts print them)."""
    return [json.loads(line.removeprefix("RESULT ")) for path in paths for line in Path(path).read_text().splitlines()
            if line.strip()]


def emit(row: dict) -> None:
    """One row on stdout as "RESULT {json}" (a run cut short still leaves the rows it finished)."""
    print("RESULT " + json.dumps(row, default=str), flush=True)


def grouped_mode(text: str) -> bool | str:
    """--grouped-prompt's value: 1 / 0 as True / False, or "auto" (engine.GROUPED_PROMPT_ATTENTION)."""
    if text not in ("0", "1", "auto"):
        raise argparse.ArgumentTypeError(f"{text!r}: use 1, 0 or auto")
    return text if text == "auto" else text == "1"


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help prints the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device: measures its matmul and copy rates")
    tflops, tbps = device_rates()
    print(f"{hardware()}: bf16 matmul 8192^3 {tflops:.0f} TFLOP/s, device copy {tbps:.2f} TB/s "
          f"(stated: {MATMUL_TFLOPS:.0f}, {COPY_TBPS})")


def kernel_profile(call, decode_steps: int) -> None:
    """GPU time of one `call()` by kernel name (top 30), and the kernels a decode step launches (`decode_steps` of
    them in the call), as PROFILE lines."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1e3
    by_name = {}
    for e in kernels:
        count, time_us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, time_us + e.device_time)
    steps = max(1, decode_steps)
    print(f"PROFILE kernels {len(kernels)} ({len(kernels) / steps:.0f} a decode step), GPU time {total:.1f} ms "
          f"({total / steps:.3f} ms a step)")
    for name, (count, time_us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"PROFILE {time_us / 1e3:9.2f} ms {100 * time_us / 1e3 / max(total, 1e-9):5.1f} % {count:7d}x  "
              f"{name[:110]}")
