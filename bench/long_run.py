"""Memory over a long run: 200 GRPO policy steps of bench/grpo_step.py's fastgrpo system (GPU).

Qwen2.5-1.5B shape, LoRA r=16, G=8, prompt 256, completion lengths drawn anew every step (what GRPO
batches do), one optimizer (AdamW on the LoRA parameters) stepping each time, bf16 autocast as in grpo_step.py. Records the memory
held between steps (torch.cuda.memory_allocated after the optimizer step) and each window's peak,
so a leak (a cache growing per shape, saved tensors kept alive, recompiles piling up graphs) shows
as a rising line. Issue 8's criterion: flat from step 50 to the end.

    python bench/long_run.py                      # H200: 200 steps, completions 256..1024
    python bench/long_run.py --tiny --steps 20    # CPU: checks the harness
The run's row (its windows, the growth between the first and the last) is appended to bench/results/long_run.jsonl
(not with --tiny).
"""
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from grpo_step import GROUP, PROMPT, build_policy, make_step, with_mixed_precision  # noqa: E402


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--min-completion", type=int, default=256)
    parser.add_argument("--max-completion", type=int, default=1024)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script runs (CPU is fine)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    model = build_policy("fastgrpo", PROMPT + args.max_completion + 8, args.tiny, args.shape)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    lengths = random.Random(0)
    rows, window_peak, start = [], 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        completion = lengths.randint(args.min_completion, args.max_completion)
        ids = torch.randint(0, model.config.vocab_size, (GROUP, PROMPT + completion), device=device)
        mask = torch.ones(GROUP, completion, device=device)
        grpo_step = with_mixed_precision(make_step("fastgrpo", model, completion), device)
        grpo_step(ids, mask, torch.randn(GROUP, device=device))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            window_peak = max(window_peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        if step % args.window == 0 or step == args.steps:
            row = {"step": step, "seconds": round(time.perf_counter() - start, 1),
                   "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1) if cuda else None,
                   "window_peak_gib": round(window_peak / 2**30, 2) if cuda else None,
                   "recompiles": dict(torch._dynamo.utils.counters["stats"])}
            print("ROW " + json.dumps(row), flush=True)
            rows.append(row)
            window_peak = 0
    result = {"shape": args.shape, "steps": args.steps, "completions": [args.min_completion, args.max_completion],
              "rows": rows}
    if cuda and len(rows) >= 2:
        first, last = rows[0], rows[-1]
        result["allocated_growth_mib"] = round(last["allocated_mib"] - first["allocated_mib"], 1)
        print(f"held between steps: {first['allocated_mib']} MiB at step {first['step']} -> "
              f"{last['allocated_mib']} MiB at step {last['step']}")
    if not args.tiny:
        print(f"row appended to {harness.record('long_run', [result])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
