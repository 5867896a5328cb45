"""fastgrpo::decode_attention against SDPA over the whole static cache (what transformers' StaticCache decode runs,
the grouped heads expanded) and against the bytes floor (each row's written KV read once at 4.3 TB/s). CUDA graphs.

    python bench/bench_decode_attention.py        # GPU; rows appended to bench/results/bench_decode_attention.jsonl
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import _harness as harness  # noqa: E402
from fastgrpo.kernels.decode_attention import decode_attention  # noqa: E402

BANDWIDTH = harness.COPY_TBPS * 1e12
SHAPES = {"qwen2.5-1.5b": None, "gemma-3-1b": 512}  # shape -> its sliding layers' window


graph_ms = harness.graph_ms


def main():
    rows_out = []
    dev = "cuda"
    for shape, window in SHAPES.items():
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
                floor = 1e3 * b * hkv * seen * d * 2 * 2 / BANDWIDTH
                row = dict(shape=shape, rows=b, slots=slots, written=int(length), window=window, ms=ours,
                           sdpa_full_cache_ms=full, floor_ms=floor, floor_share=floor / ours)
                rows_out.append(row)
                harness.emit(row)
    print("\n| shape | rows | slots | fastgrpo ms | SDPA full cache ms | floor ms | share of floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['rows']} | {r['slots']} | {r['ms']:.4f} | {r['sdpa_full_cache_ms']:.4f} | "
              f"{r['floor_ms']:.4f} | {100 * r['floor_share']:.0f} % |")
    harness.record("bench_decode_attention", rows_out)


if __name__ == "__main__":
    main()
