"""The rollout's LoRA merge (`fastgrpo.kernels.lora_merge`) against the same contract in torch, per pass, on a shape's
weights: r=16 fp32 factors over bf16 weights.

    python bench/bench_lora_merge.py                          # Llama-3.1-8B's and Qwen2.5-1.5B's projections
    python bench/bench_lora_merge.py --sweep                  # and the kernel's launch configurations,
                                                              # timed on the first shape's gate and down
    python bench/bench_lora_merge.py --dry-run                # tiny weights on the CPU: the harness runs

Passes and the bytes each must move (W's size S): plan reads W (S); merge in place reads and writes it (2S), and so
does the undo (2S); the merged copy reads W and writes the copy (2S). A rollout runs plan + merge + undo on each
in-place weight (5S) and the copy on each joined q/k/v. GB/s and the share of the device's copy rate
(`_harness.copy_tbps`) count those bytes. Times are medians of triton.testing.do_bench (launches included); torch's
merge syncs the host once a weight for `nonzero`, as the engine's torch path did. Rows go to
bench/results/bench_lora_merge.jsonl (the sweep's to bench_lora_merge_sweep.jsonl).
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.kernels import lora_merge as lm  # noqa: E402

RANK = 16
PASSES = {"plan": 1, "merge+undo": 4, "copy": 2}  # bytes moved, in weight sizes


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """[out, in] of a decoder layer's merged weights: gate (and up), down, o in place; q/k/v joined, a copy."""
    hidden, inter = harness.mlp_shape(shape)
    hq, hkv, d = harness.attention_shape(shape)
    return {"gate": (inter, hidden), "down": (hidden, inter), "o": (hidden, hq * d),
            "qkv": ((hq + 2 * hkv) * d, hidden)}


def case(n: int, k: int, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).to(device)
    a = (torch.randn(RANK, k, generator=g) / k ** 0.5).to(device)
    b = (torch.randn(n, RANK, generator=g) * 0.01).to(device)
    return weight, a, b


def pass_fns(weight, a, b, torch_path: bool):
    """{pass: fn} on `weight` (the in-place passes leave it as they found it, up to the undo's misses)."""
    stats = torch.zeros(lm.STATS, dtype=torch.int64, device=weight.device)
    lm.lora_merge_plan(weight, a, b, stats)
    fix = max(int(stats[0]), 1)
    fix_index = torch.zeros(fix, dtype=torch.int64, device=weight.device)
    fix_value = torch.zeros(fix, dtype=weight.dtype, device=weight.device)
    out = torch.empty_like(weight)
    run = (lambda mode, **kw: lm._reference(mode, weight, a, b, **kw)) if torch_path else \
        (lambda mode, **kw: lm._launch(mode, weight, a, b, **kw))

    def merge_undo():
        stats.zero_()
        run(lm._MERGE, stats=stats, fix_index=fix_index, fix_value=fix_value)
        run(lm._UNMERGE, stats=stats)
    return {"plan": lambda: run(lm._PLAN, stats=stats), "merge+undo": merge_undo,
            "copy": lambda: run(lm._COPY, out=out)}


def measure(shapes, device, rep: float) -> list[dict]:
    rows = []
    rate = harness.copy_tbps()
    for shape in shapes:
        for name, (n, k) in projections(shape).items():
            weight, a, b = case(n, k, device)
            for path in ("kernel", "torch"):
                for pass_name, fn in pass_fns(weight, a, b, path == "torch").items():
                    if (pass_name == "copy") != (name == "qkv"):
                        continue
                    ms = harness.kernel_ms(fn, warmup=rep / 4, rep=rep, return_mode="median")
                    moved = PASSES[pass_name] * weight.numel() * weight.element_size()
                    row = dict(shape=shape, weight=name, n=n, k=k, rank=RANK, path=path, ms=ms,
                               gbps=moved / ms / 1e6, share_of_copy=moved / ms / 1e9 / rate, **{"pass": pass_name})
                    rows.append(row)
                    harness.emit(row)
            del weight, a, b
    return rows


SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, TILES=t, num_warps=w) for t in (1, 4, 16)
         for bn, bk, w in ((2, 256, 4), (4, 128, 4), (4, 256, 4), (4, 512, 4), (8, 128, 4), (8, 256, 4), (8, 512, 8),
                           (16, 256, 8))]


def sweep(shapes, device) -> list[dict]:
    rows = []
    for shape in shapes:
        for name in ("gate", "down"):
            weight, a, b = case(*projections(shape)[name], device)
            fns = pass_fns(weight, a, b, torch_path=False)

            def rollout():
                fns["plan"]()
                fns["merge+undo"]()
            now, timings = harness.time_launch_configs(rollout, SWEEP, lambda c: [(lm, "CUDA_LAUNCH", c)], rep=20)
            for ms, config in timings:
                row = dict(shape=shape, weight=name, n=weight.shape[0], k=weight.shape[1], passes="plan+merge+undo",
                           ms=ms, default_ms=now, default=lm.CUDA_LAUNCH, **config)
                rows.append(row)
                harness.emit(row)
            del weight, a, b, fns
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen2.5-1.5b"])
    p.add_argument("--sweep", action="store_true", help="also time the kernel's launch configurations")
    p.add_argument("--dry-run", action="store_true", help="tiny weights on the CPU (the interpreter's kernel)")
    args = p.parse_args()
    if args.dry_run:
        global projections
        projections = lambda shape: {"gate": (24, 40), "qkv": (40, 24)}  # noqa: E731
    device = "cpu" if args.dry_run else harness.device()
    rows = measure(args.shapes, device, rep=5 if args.dry_run else 100)
    if not args.dry_run:
        harness.record("bench_lora_merge", rows)
    print(harness.markdown_table(
        ("shape", "weight", "[out, in]", "pass", "kernel ms", "torch ms", "kernel GB/s", "kernel share of copy rate"),
        [(r["shape"], r["weight"], f'{r["n"]} x {r["k"]}', r["pass"], f'{r["ms"]:.4f}',
          next(f'{t["ms"]:.4f}' for t in rows if t["path"] == "torch" and t["weight"] == r["weight"]
               and t["shape"] == r["shape"] and t["pass"] == r["pass"]), f'{r["gbps"]:.0f}',
          f'{r["share_of_copy"]:.0%}') for r in rows if r["path"] == "kernel"]))
    if args.sweep and not args.dry_run:
        rows = sweep(args.shapes[:1], device)
        harness.record("bench_lora_merge_sweep", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
