"""fastgrpo::decode_attention against SDPA over the whole static cache (what transformers' StaticCache decode runs,
the grouped heads expanded) and against the bytes floor (each row's written KV read once at the device's copy rate,
measured at the start). CUDA graphs. Also the op with GRPO's groups of 8 rows sharing a prompt of half the slots:
the group's prompt KV held once and read by each row (`prompt_rows`) or attended once a step for the group
(`prompt_groups`), against its floor (each group's prompt KV and each row's own KV read once).

    python bench/bench_decode_attention.py        # GPU; rows appended to bench/results/bench_decode_attention.jsonl
    python bench/bench_decode_attention.py --sweep --shapes llama-3.1-8b   # launch configurations of a rollout

--sweep times the op's launch configurations (splits, keys a block, warps, pipeline stages) on a GRPO rollout's cache:
64 rows in groups of 8 sharing a 256-token prompt, 512 completion slots, at three points of the rollout (64, 256 and
448 tokens written), each row reading its group's prompt (`prompt_rows`) and the group attending it once
(`prompt_groups`); the default configuration is timed in the same run. Rows go to bench_decode_attention_sweep.jsonl.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import _harness as harness  # noqa: E402
from fastgrpo.kernels import decode_attention as decode_module  # noqa: E402
from fastgrpo.kernels.decode_attention import decode_attention  # noqa: E402

SHAPES = {"qwen2.5-1.5b": None, "gemma-3-1b": 512, "phi-3-mini": None, "llama-3.1-8b": None}  # -> sliding window
GROUP = 8  # rows a prompt in the shared-prompt column


graph_ms = harness.graph_ms


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true", help="time launch configurations on a GRPO rollout's cache")
    args = p.parse_args(argv)
    if args.sweep:
        return sweep(args.shapes)
    rows_out = []
    bandwidth = harness.copy_tbps() * 1e12
    dev = "cuda"
    for shape in args.shapes:
        window = SHAPES[shape]
        hq, hkv, d = harness.attention_shape(shape)
        for b in (8, 32, 128, 256):
            for slots in (512, 1024, 2048):
                q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
                kn, vn = (torch.randn(b, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
                kc, vc = (torch.randn(b, hkv, slots, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
                rows = torch.arange(b, device=dev)
                start = torch.zeros(b, dtype=torch.long, device=dev)
                length = torch.tensor(slots * 3 // 4, device=dev)  # three quarters written
                ours = graph_ms(lambda: decode_attention(q, kn, vn, kc, vc, rows, start, length, scale=d ** -0.5,
                                                         window=window))
                mask = torch.arange(slots, device=dev)[None, None, None] < length

                def sdpa():
                    k = kc.repeat_interleave(hq // hkv, dim=1)
                    v = vc.repeat_interleave(hq // hkv, dim=1)
                    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask)

                full = graph_ms(sdpa)
                seen = min(int(length), window or slots)
                floor = 1e3 * b * hkv * seen * d * 2 * 2 / bandwidth
                prompt_len = torch.tensor(slots // 2, device=dev)
                prompt_rows = torch.arange(b, device=dev) // GROUP * GROUP
                groups = torch.full((b, GROUP), -1, dtype=torch.long, device=dev)  # as the engine lists them
                groups[: b // GROUP] = torch.arange(b, device=dev).view(-1, GROUP)
                shared = graph_ms(lambda: decode_attention(q, kn, vn, kc, vc, rows, start, length, scale=d ** -0.5,
                                                           window=window, prompt_rows=prompt_rows,
                                                           prompt_len=prompt_len, prompt_groups=groups))
                shared_rows = graph_ms(lambda: decode_attention(q, kn, vn, kc, vc, rows, start, length,
                                                                scale=d ** -0.5, window=window,
                                                                prompt_rows=prompt_rows, prompt_len=prompt_len))
                lo = int(length) - seen  # the first slot a row sees
                prompt_seen, own_seen = max(0, slots // 2 - lo), seen - max(0, slots // 2 - lo)
                shared_floor = 1e3 * (-(-b // GROUP) * prompt_seen + b * own_seen) * hkv * d * 2 * 2 / bandwidth
                row = dict(shape=shape, rows=b, slots=slots, written=int(length), window=window, ms=ours,
                           sdpa_full_cache_ms=full, floor_ms=floor, floor_share=floor / ours, group=GROUP,
                           prompt_len=slots // 2, prompt_groups=True, shared_prompt_ms=shared,
                           shared_prompt_rows_ms=shared_rows, shared_floor_ms=shared_floor,
                           copy_tbps=bandwidth / 1e12)
                rows_out.append(row)
                harness.emit(row)
    print(f"\nfloor at {bandwidth / 1e12:.2f} TB/s; groups of 8 sharing a prompt of half the slots: each row reading it "
          "(prompt_rows), the group attending it once (prompt_groups)")
    print("| shape | rows | slots | fastgrpo ms | SDPA full cache ms | floor ms | share of floor | shared: prompt_rows ms "
          "| prompt_groups ms | its floor ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['rows']} | {r['slots']} | {r['ms']:.4f} | {r['sdpa_full_cache_ms']:.4f} | "
              f"{r['floor_ms']:.4f} | {100 * r['floor_share']:.0f} % | {r['shared_prompt_rows_ms']:.4f} | "
              f"{r['shared_prompt_ms']:.4f} | "
              f"{r['shared_floor_ms']:.4f} |")
    harness.record("bench_decode_attention", rows_out)


# (splits, keys a block, warps, stages); None: the op's own choice. The first is the default.
SWEEP_CONFIGS = [(None, None, None, None)] + [(sp, bn, 4, 2) for sp in (1, 2, 4) for bn in (32, 64, 128)] + [
    (sp, 64, w, st) for sp in (1, 2) for w, st in ((4, 3), (4, 4), (8, 2), (8, 3))]
SWEEP_ROWS, SWEEP_PROMPT, SWEEP_COMPLETION, SWEEP_WRITTEN = 64, 256, 512, (64, 256, 448)


def sweep(shapes):
    dev = "cuda"
    rows_out = []
    for shape in shapes:
        window = SHAPES[shape]
        hq, hkv, d = harness.attention_shape(shape)
        b, slots = SWEEP_ROWS, SWEEP_PROMPT + SWEEP_COMPLETION
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        kn, vn = (torch.randn(b, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kc, vc = (torch.randn(b, hkv, slots, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        rows = torch.arange(b, device=dev)
        start = torch.zeros(b, dtype=torch.long, device=dev)
        prompt_len = torch.tensor(SWEEP_PROMPT, device=dev)
        prompt_rows = torch.arange(b, device=dev) // GROUP * GROUP
        groups = torch.full((b, GROUP), -1, dtype=torch.long, device=dev)
        groups[: b // GROUP] = torch.arange(b, device=dev).view(-1, GROUP)
        for mode in ("prompt_rows", "prompt_groups"):
            for splits, block_n, warps, stages in SWEEP_CONFIGS:
                times = []
                for written in SWEEP_WRITTEN:
                    length = torch.tensor(SWEEP_PROMPT + written, device=dev)
                    times.append(graph_ms(lambda: decode_module._triton_decode(
                        q, kn, vn, kc, vc, rows, start, length, d ** -0.5, window, None, None, prompt_rows,
                        prompt_len, groups if mode == "prompt_groups" else None, splits=splits, block_n=block_n,
                        num_warps=warps, num_stages=stages), rep=10))
                row = dict(shape=shape, mode=mode, rows=b, prompt=SWEEP_PROMPT, completion=SWEEP_COMPLETION,
                           written=list(SWEEP_WRITTEN), splits=splits, block_n=block_n, num_warps=warps,
                           num_stages=stages, ms=times, mean_ms=sum(times) / len(times))
                rows_out.append(row)
                harness.emit(row)
        harness.record("bench_decode_attention_sweep", [r for r in rows_out if r["shape"] == shape])  # kept if cut
    written = ", ".join(map(str, SWEEP_WRITTEN))
    print(f"| shape | mode | splits | block | warps | stages | mean ms | ms at {written} written |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows_out, key=lambda r: (r["shape"], r["mode"], r["mean_ms"])):
        cfg = ["default" if v is None else v for v in (r["splits"], r["block_n"], r["num_warps"], r["num_stages"])]
        print(f"| {r['shape']} | {r['mode']} | " + " | ".join(map(str, cfg)) + f" | {r['mean_ms']:.4f} | "
              + ", ".join(f"{t:.4f}" for t in r["ms"]) + " |")


if __name__ == "__main__":
    main()
