"""What is alive at a GRPO step's memory peak, and who allocated it (CUDA).

Runs one step of each named `bench/grpo_step.py` system after a warm-up step, with the CUDA caching
allocator's history recorded (`torch.cuda.memory._record_memory_history`, Python stacks), replays the
trace to the moment the allocated bytes peak, and prints the blocks alive then, grouped by the Python frames
that allocated them, largest first. Its readings are in docs/measurements.md ("What is alive at the 1024 peak", and
"Phi-3-mini's packed peak at 4096").

    python bench/memory_peak.py --systems fastgrpo_packed,fastgrpo_packed_save --spread --prompt 1024
Each system's row (its peaks and the largest allocation sites) is appended to bench/results/memory_peak.jsonl.
"""
import bisect
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
import grpo_step  # noqa: E402  (the systems, batches and steps of the step benchmark)

# Frames that say nothing about who asked for the memory.
_PLUMBING = ("torch/_ops.py", "torch/utils/_contextlib.py", "torch/_library/", "torch/nn/modules/module.py",
             "torch/_tensor.py", "torch/autograd/graph.py", "torch/utils/_python_dispatch.py")


def _frame_key(frames: list[dict], depth: int) -> str:
    """The first `depth` Python frames of an allocation that are not dispatch plumbing, innermost first."""
    kept = [f for f in frames if f["filename"].endswith(".py") and not any(p in f["filename"] for p in _PLUMBING)]
    names = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in kept[:depth]]
    return " < ".join(names) or "(no frame)"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replays one device's allocator trace: (peak allocated bytes, the allocations alive at that moment).

    A block counts from its `alloc` to its `free_completed`: a block freed while another stream still uses it
    (`record_stream`) counts until the allocator finds that stream past it. `torch.cuda.max_memory_allocated` stops
    counting it at the free, so this peak can exceed that one (1.5B step at 1024: +0.79 against +0.39 GiB). Blocks
    allocated before recording started are not in the trace: the peak is relative to the memory in use when recording
    began."""
    live, current, peak, peak_index = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > peak:
            peak, peak_index = current, index
    alive = {}
    for index, event in enumerate(trace[: peak_index + 1]):
        if event["action"] == "alloc":
            alive[event["addr"]] = dict(event, index=index)
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    return peak, list(alive.values())


def timeline(trace: list[dict], alive: list[dict], min_mib: float = 1.0, context: int = 4) -> str:
    """The blocks of at least `min_mib` alive at the peak, in the order they were allocated, each with the sizes of the
    `context` allocations of at least that size before it: without Python stacks, what was made around a block
    tells which tensor it is (a [rows, 2I] chunk buffer follows the layer's [tokens, H] recompute, ...)."""
    big = [(i, e["size"]) for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] >= min_mib * 2**20]
    order = [i for i, _ in big]
    lines = ["| trace index | MiB | allocations before it (MiB) |", "|---|---|---|"]
    for block in sorted((b for b in alive if b["size"] >= min_mib * 2**20), key=lambda b: b["index"]):
        at = bisect.bisect_left(order, block["index"])
        before = ", ".join(f"{size / 2**20:.1f}" for _, size in big[max(0, at - context):at])
        lines.append(f"| {block['index']} | {block['size'] / 2**20:.1f} | {before} |")
    return "\n".join(lines)


def by_site(events: list[dict], depth: int) -> list[tuple[str, int, int]]:
    """(site, bytes, blocks) of the allocations, grouped by their frames, largest first."""
    groups = defaultdict(lambda: [0, 0])
    for event in events:
        frames = event.get("frames")
        group = groups[_frame_key(frames, depth) if frames else f"(no stack) {event['size'] / 2**20:.1f} MiB blocks"]
        group[0] += event["size"]
        group[1] += 1
    return sorted(((site, size, n) for site, (size, n) in groups.items()), key=lambda row: -row[1])


def recorded_step(step, args, model, stacks: str) -> dict:
    """One step with the allocator's history recorded: `stacks` "python" (the allocating Python frames), "backward"
    (the same, recording from the call of `Tensor.backward` on: under checkpointing what is alive at the peak is
    mostly the recompute's) or "none" (sizes only)."""
    backward = torch.Tensor.backward

    def recording_backward(tensor, *a, **k):
        torch.cuda.memory._record_memory_history(context="all", stacks="python")
        return backward(tensor, *a, **k)

    if stacks == "python":
        torch.cuda.memory._record_memory_history(context="all", stacks="python")
    elif stacks == "backward":
        torch.Tensor.backward = recording_backward
    else:
        torch.cuda.memory._record_memory_history(context=None)
    try:
        grpo_step.timed_steps(step, args, model, 1)
        return torch.cuda.memory._snapshot()
    finally:
        torch.Tensor.backward = backward
        torch.cuda.memory._record_memory_history(enabled=None)


def measure(system: str, completion: int, prompt: int, spread: bool, rows: int, depth: int,
            shape: str = harness.DEFAULT_SHAPE, warmup: int = 1) -> dict:
    model = grpo_step.build_policy(system, prompt + completion + 8, tiny=False, shape=shape)
    device = next(model.parameters()).device
    ids, mask, adv, tokens, lengths = grpo_step.make_batch(model.config.vocab_size, prompt, completion, spread, device)
    step = grpo_step.with_mixed_precision(grpo_step.make_step(system, model, mask.shape[1], prompt), device)
    grpo_step.timed_steps(step, (ids, mask, adv), model, warmup)  # compile and warm up (the graphs capture)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # Recording Python stacks can make the compiled layer's autograd function return NULL (torch 2.11, CUDA): then
    # record from the backward on, then sizes alone (which still name the [rows, width] tensors).
    for stacks in ("python", "backward", "none"):
        try:
            snapshot = recorded_step(step, (ids, mask, adv), model, stacks)
            break
        except SystemError as err:
            print(f"MEMORY {system}: recording with stacks={stacks} failed ({err})", flush=True)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
    trace = snapshot["device_traces"][device.index or 0]
    peak, alive = live_at_peak(trace)
    pool = harness.graph_pool_bytes()
    sites = by_site(alive, depth)[:rows]
    allocated_above = torch.cuda.max_memory_allocated() - base
    row = dict(shape=shape, system=system, prompt=prompt, completion=completion, spread=spread, tokens=tokens,
               before_gib=round(base / 2**30, 2), peak_gib=harness.peak_gib(),
               allocated_above_gib=round(allocated_above / 2**30, 2), trace_peak_gib=round(peak / 2**30, 2),
               graph_pool_gib=round(pool / 2**30, 3), warmup=warmup,
               blocks_alive=len(alive), sites=[dict(site=site, gib=round(size / 2**30, 3), blocks=n)
                                               for site, size, n in sites])
    print(f"MEMORY {shape} {system} prompt {prompt} completion {completion}{' spread' if spread else ''} ({tokens} "
          f"tokens): in use before the step {row['before_gib']:.2f} GiB, peak {row['peak_gib']:.2f} GiB "
          f"(allocated: +{row['allocated_above_gib']:.2f} GiB; trace: +{row['trace_peak_gib']:.2f} GiB at its peak, "
          f"{len(alive)} blocks alive then, freed blocks a side stream still read included; the graphs' pool "
          f"{row['graph_pool_gib']:.3f} GiB, reserved beside it)")
    print(harness.markdown_table(("allocated by (innermost first)", "GiB", "blocks"),
                                 [(site, f"{size / 2**30:.3f}", n) for site, size, n in sites]))
    print(f"Blocks of 1 MiB or more alive at the peak, in allocation order (of {len(trace)} trace events):")
    print(timeline(trace, alive))
    del model, step
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    parser.add_argument("--systems", default="fastgrpo_packed,fastgrpo_packed_save")
    parser.add_argument("--completion", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=grpo_step.PROMPT)
    parser.add_argument("--spread", action="store_true", help="completion lengths of grpo_step.py --spread")
    parser.add_argument("--rows", type=int, default=20, help="sites to print per system")
    parser.add_argument("--depth", type=int, default=3, help="Python frames per site")
    parser.add_argument("--warmup", type=int, default=1,
                        help="steps before the recorded one (3: the layer graphs capture at a call's second step and "
                        "check at its third)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_peak.py needs CUDA (the allocator history is CUDA's)", file=sys.stderr)
        return 1
    for system in args.systems.split(","):
        row = measure(system, args.completion, args.prompt, args.spread, args.rows, args.depth, args.shape,
                      args.warmup)
        harness.record("memory_peak", [row])
    print(f"rows appended to {harness.results_path('memory_peak')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
