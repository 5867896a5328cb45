"""Pinned host buffers: how long allocating offloaded checkpointing's buffers takes, by the host allocator's setting.

Offloaded checkpointing (`fastgrpo.compiler.offload`) allocates its pinned host buffers at the first update: one per
layer input and per tensor an op keeps (81 buffers of ~150 MB at the Qwen2.5-1.5B whole step, 8x8x768 tokens). Each
setting runs in its own process (the host allocator's settings are process-wide), allocating `--count` buffers of
`--mb` MB and copying one device tensor into each:
- default: torch's host caching allocator (cudaHostAlloc of the size rounded up to a power of two);
- register: `pinned_use_cuda_host_register:True,pinned_num_register_threads:N` (malloc, pages touched by N threads,
  then cudaHostRegister), set through `torch.cuda.memory._set_allocator_settings` after CUDA is up, as a library
  would set it.

    python bench/bench_host_pinning.py                 # GPU: 40 x 151 MB, default and register with 8 / 16 threads
    python bench/bench_host_pinning.py --count 81 --mb 151
Rows are appended to bench/results/bench_host_pinning.jsonl.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402


def _child(setting: str, count: int, mb: int) -> dict:
    import torch

    torch.cuda.init()
    source = torch.ones(mb * 2**20, dtype=torch.uint8, device="cuda")
    if setting:
        torch.cuda.memory._set_allocator_settings(setting)
    start = time.perf_counter()
    buffers = []
    for _ in range(count):
        buffer = torch.empty(mb * 2**20, dtype=torch.uint8, pin_memory=True)
        buffer.copy_(source, non_blocking=True)
        buffers.append(buffer)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ok = all(bool(b[:: 2**20].eq(1).all()) for b in buffers) and all(b.is_pinned() for b in buffers)
    return dict(seconds=seconds, gb_per_s=count * mb / 1024 / seconds, correct=ok)


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--mb", type=int, default=151)
    parser.add_argument("--threads", default="8,16", help="register settings' thread counts")
    parser.add_argument("--child", help="internal: the one setting this process runs")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args.child, args.count, args.mb)))
        return 0
    settings = {"default": ""}
    for n in args.threads.split(","):
        settings[f"register, {n} threads"] = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{n}"
    rows = []
    for name, setting in settings.items():
        out = subprocess.run([sys.executable, __file__, "--child", setting, "--count", str(args.count), "--mb",
                              str(args.mb)], capture_output=True, text=True, check=True).stdout
        row = dict(setting=name, count=args.count, mb=args.mb, **json.loads(out.strip().splitlines()[-1]))
        harness.emit(row)
        rows.append(row)
    harness.record("bench_host_pinning", rows, argv)
    print(harness.markdown_table(["setting", "buffers", "s", "GB/s", "correct"],
                                 [[r["setting"], f"{r['count']} x {r['mb']} MB", f"{r['seconds']:.2f}",
                                   f"{r['gb_per_s']:.1f}", r["correct"]] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
