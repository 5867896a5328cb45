"""Rollout speed: fastgrpo's EmbeddedGenerator vs plain `model.generate` on the same model and prompts.

Default (GPU): random-init Qwen2.5-1.5B shape in bf16, 8 prompts x 8 generations of 256 prompt tokens,
256 new tokens, sampling at temperature 1. The EOS id lies outside the vocabulary so every row runs the
full 256 tokens in both paths (equal work). Goal: >= 3x tokens/s over model.generate.

    python bench/bench_generation.py                  # GPU, default shapes
    python bench/bench_generation.py --tiny           # CPU smoke run on a tiny Qwen2 (eager and compiled)
    python bench/bench_generation.py --model DIR --device cpu --prompts 2 --generations 8 \
        --prompt-len 64 --new-tokens 32 --dtype float32 --compile both   # a local model, e.g. SmolLM2

Prints a markdown table; with $OUT set, also writes $OUT/bench_generation.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastgrpo.integrations.generation import EmbeddedGenerator  # noqa: E402

QWEN25_15B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
TINY = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Qwen2 on CPU, small shapes (smoke test)")
    p.add_argument("--model", help="local HF model directory instead of the random-init Qwen2.5-1.5B shape")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 8)")
    p.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="completion tokens (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (median reported)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off", "both"],
                   help="EmbeddedGenerator decode-step compile; auto = its default for the device")  # fmt: skip
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        device="cpu" if tiny else ("cuda" if torch.cuda.is_available() else "cpu"),
        dtype="float32" if tiny else "bfloat16",
        prompts=2 if tiny else 8,
        generations=2 if tiny else 8,
        prompt_len=16 if tiny else 256,
        new_tokens=16 if tiny else 256,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if tiny and args.compile == "auto":
        args.compile = "both"
    return args


def build_model(args):
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        torch.manual_seed(0)
        config = Qwen2Config(**(TINY if args.tiny else QWEN25_15B))
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(args.device).eval()


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device):
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return float("nan")


def time_runs(fn, device, repeats):
    """(first call seconds, median of `repeats` later calls, result of the last call)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), result


def main(argv=None):
    args = parse_args(argv)
    model = build_model(args)
    vocab = model.config.vocab_size
    never_eos = vocab  # outside the vocabulary: every row generates exactly new_tokens tokens
    pad = 0
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    rows = args.prompts * args.generations
    sampling = dict(temperature=1.0, top_p=1.0, top_k=0)

    def hf_generate():
        ids = torch.tensor(prompts, device=args.device).repeat_interleave(args.generations, dim=0)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=args.new_tokens,
                eos_token_id=never_eos, pad_token_id=pad, **sampling,
            )  # fmt: skip
        return out[:, ids.size(1) :].tolist()

    compile_choices = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.compile]
    paths = [("model.generate", hf_generate)]
    for choice in compile_choices:
        generator = EmbeddedGenerator(model, pad, [never_eos], args.new_tokens, compile=choice)
        compiled = choice if choice is not None else torch.device(args.device).type == "cuda"
        name = f"EmbeddedGenerator ({'compiled' if compiled else 'eager'})"
        paths.append((name, lambda gen=generator: gen.generate(prompts, num_generations=args.generations, **sampling)))

    results = []
    for name, fn in paths:
        reset_peak(args.device)
        first, median, out = time_runs(fn, args.device, args.repeats)
        tokens = sum(len(row) for row in out)
        assert len(out) == rows and tokens == rows * args.new_tokens, (name, len(out), tokens)
        results.append(dict(path=name, first_call_s=first, median_s=median, tokens=tokens,
                            tokens_per_s=tokens / median, peak_gib=peak_gib(args.device)))  # fmt: skip
    baseline = results[0]["tokens_per_s"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / baseline

    shape = "tiny Qwen2" if args.tiny else (args.model or "Qwen2.5-1.5B shape (random init)")
    print(f"\n{shape}, {args.dtype}, {args.device}, {args.prompts}x{args.generations} rows, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}\n")  # fmt: skip
    print("| path | first call s | median s | tokens/s | speedup | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['first_call_s']:.2f} | {r['median_s']:.3f} | {r['tokens_per_s']:.0f} "
              f"| {r['speedup']:.2f}x | {r['peak_gib']:.2f} |")  # fmt: skip
    if os.environ.get("OUT"):
        meta = dict(vars(args), torch=torch.__version__, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        path = Path(os.environ["OUT"]) / "bench_generation.json"
        path.write_text(json.dumps(dict(config=meta, results=results), indent=2))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
