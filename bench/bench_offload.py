"""Offloaded activation checkpointing on the GRPO policy step (GPU).

The step of bench/grpo_step.py's fastgrpo system (Qwen2.5-1.5B shape by default, bf16, LoRA r=16, G=8
completions of a 256-token prompt, decoder layers compiled one region each with backend="fastgrpo",
log-probs through fastgrpo::selective_logprob), on ONE model compiled once, under:
  checkpoint   HF non-reentrant gradient checkpointing (what grpo_step.py measures)
  offload      fastgrpo.compiler.offload: layer inputs in pinned host buffers, side-stream copies
  hf-offload   (opt-in) transformers' own gradient_checkpointing_enable(offload=True), where supported
Goals (issue 7): offload <= 1.03x checkpoint's step time; at 16384 completions peak <= 16 GiB.
Also reported: the largest gradient difference against the checkpoint run on the same batch, beside
checkpoint-vs-checkpoint on the same batch (the kernels' own run-to-run noise); a copy racing the
compute stream would show as a difference far above that noise. Unsloth's step beside it is the latest `unsloth`
row of bench/results/grpo_step.jsonl for the shape and length on this hardware (bench/peers/unsloth_step.py).

    python bench/bench_offload.py                                  # H200: completions 4096,16384
    python bench/bench_offload.py --modes checkpoint,offload,hf-offload
    python bench/bench_offload.py --tiny --completions 32,64 --inner eager   # CPU: checks the harness
Rows are appended to bench/results/bench_offload.jsonl (not with --tiny).
"""
import inspect
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
import grpo_step  # noqa: E402
from grpo_step import GROUP, PROMPT, build_policy, make_step, timed_steps, with_mixed_precision  # noqa: E402

import fastgrpo  # noqa: E402
from fastgrpo.compiler.offload import enable_offloaded_checkpointing  # noqa: E402

SLOWDOWN_GOAL, MEMORY_GOAL_GIB, MEMORY_GOAL_AT = 1.03, 16.0, 16384


def make_batch(model, completion: int):
    """grpo_step.py's batch (seeded: the same in every mode): ids, completion mask, advantages."""
    device = next(model.parameters()).device
    return grpo_step.make_batch(model.config.vocab_size, PROMPT, completion, False, device)[:3]


def unsloth_rows(shape: str) -> dict[int, dict]:
    """The latest Unsloth row of bench/results/grpo_step.jsonl per completion length (this shape and hardware,
    grpo_step.py's default prompt, equal lengths)."""
    path, here = harness.results_path("grpo_step"), harness.hardware()
    rows = harness.read_rows(path) if path.exists() else []
    return {r["completion"]: r for r in rows
            if r.get("system") == "unsloth" and not r.get("error") and r.get("shape") == shape
            and r.get("hardware") == here and r.get("prompt") == PROMPT and not r.get("spread")}


def step_grads(model, completion: int) -> torch.Tensor:
    """The trainable parameters' gradients after one step on the fixed batch, on the host (so that
    keeping them does not count in the device peak of the next measurement)."""
    batch = make_batch(model, completion)
    with_mixed_precision(make_step("fastgrpo", model, completion), batch[0].device)(*batch)
    grads = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters() if p.requires_grad and p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def measure(model, mode: str, completion: int, warmup: int, repeat: int, handle=None) -> dict:
    cuda = next(model.parameters()).device.type == "cuda"
    result = {"mode": mode, "completion": completion, "ms_median": None, "ms_all": [], "peak_gib": None,
              "tokens_per_s": None, "error": None}
    try:
        batch = make_batch(model, completion)
        step = with_mixed_precision(make_step("fastgrpo", model, completion), batch[0].device)
        timed_steps(step, batch, model, warmup)
        harness.release_cache()
        harness.reset_peak()
        times = timed_steps(step, batch, model, repeat)
        median = statistics.median(times)
        result.update(ms_median=round(median, 1), ms_all=[round(t, 1) for t in times],
                      tokens_per_s=round(GROUP * (PROMPT + completion) / median * 1e3), peak_gib=harness.peak_gib())
        if cuda:  # a lagging copy stream shows here, not in peak_gib (harness.peak_reserved_gib)
            result["peak_reserved_gib"] = harness.peak_reserved_gib()
        if handle is not None:
            result["host_gib"] = round(handle.stats.host_bytes / 2**30, 2)
            result["stats"] = vars(handle.stats).copy()
    except torch.OutOfMemoryError:
        result["error"] = "OOM"
    except Exception as err:  # one failing mode must not hide the others' numbers
        result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.empty_cache()
    return result


def run(modes: list[str], completions: list[int], warmup: int, repeat: int, tiny: bool, inner: str,
        system: str = "fastgrpo", shape: str = harness.DEFAULT_SHAPE) -> list[dict]:
    # Built without compiling, then compiled here with `system`'s backend options, so the inner compiler can be
    # chosen (eager for --tiny on CPU).
    model = build_policy("eager", PROMPT + max(completions) + 8, tiny, shape)
    options = dict(grpo_step.FASTGRPO_OPTIONS[system] or {}, inner=inner)
    fastgrpo.compile_repeated_blocks(model.get_base_model(), options=options, dynamic=grpo_step.DYNAMIC)
    reference = {}  # completion -> gradients under plain checkpointing
    results = []
    for mode in modes:
        handle = None
        if mode == "offload":
            handle = enable_offloaded_checkpointing(model)
        elif mode == "hf-offload":
            if "offload" not in inspect.signature(model.get_base_model().gradient_checkpointing_enable).parameters:
                results += [{"mode": mode, "completion": c, "error": "transformers has no offload option"}
                            for c in completions]
                continue
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
        elif mode != "checkpoint":
            raise ValueError(f"unknown mode {mode!r}")
        for completion in completions:
            result = measure(model, mode, completion, warmup, repeat, handle)
            if not result["error"]:
                grads = step_grads(model, completion)
                result["grad_max_abs"] = grads.abs().max().item()
                if mode == "checkpoint":
                    # A second identical step: how far the kernels alone move the gradients.
                    result["grad_noise"] = (step_grads(model, completion) - grads).abs().max().item()
                    reference[completion] = grads
                elif completion in reference:
                    result["grad_max_diff"] = (grads - reference[completion]).abs().max().item()
            harness.emit(result)
            results.append(result)
        if handle is not None:
            handle.disable()
        if mode == "hf-offload":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return results


def table(results: list[dict], unsloth: dict[int, dict]) -> str:
    by = {(r["mode"], r["completion"]): r for r in results}
    modes = [m for m in ("checkpoint", "offload", "hf-offload") if any(k[0] == m for k in by)]
    lines = [harness.md_header("completion", *modes, "offload time / checkpoint", "offload peak saved", "host GiB",
                               "grad diff (noise)", "Unsloth", "offload tok/s vs Unsloth", "offload mem / Unsloth")]
    for completion in sorted({k[1] for k in by}):
        cells = []
        for m in modes:
            r = by.get((m, completion))
            if r is None:
                cells.append("-")
            elif r["error"]:
                cells.append(r["error"][:40])
            else:
                peak = f"{r['peak_gib']} GiB ({r['peak_reserved_gib']} reserved)" if r["peak_gib"] is not None else "- GiB"
                cells.append(f"{r['ms_median']:.0f} ms, {peak}")
        ck, off = by.get(("checkpoint", completion)), by.get(("offload", completion))
        ok = lambda r: r is not None and not r["error"]  # noqa: E731
        if ok(ck) and ok(off):
            slowdown = off["ms_median"] / ck["ms_median"]
            cells.append(f"{slowdown:.3f}x ({'met' if slowdown <= SLOWDOWN_GOAL else 'not met'})")
            cells.append(f"{ck['peak_gib'] - off['peak_gib']:.2f} GiB" if off["peak_gib"] is not None else "-")
        else:
            cells += ["-", "-"]
        cells.append(str(off.get("host_gib", "-")) if ok(off) else "-")
        if ok(off) and "grad_max_diff" in off:
            cells.append(f"{off['grad_max_diff']:.2e} ({ck.get('grad_noise', float('nan')):.2e})")
        else:
            cells.append("-")
        anchor = unsloth.get(completion)
        cells.append(f"{anchor['step_ms']:.0f} ms, {anchor['peak_gib']} GiB ({anchor['commit']})" if anchor else "-")
        if anchor and ok(off):
            cells.append(f"{anchor['step_ms'] / off['ms_median']:.2f}x")
            cells.append(f"{off['peak_gib'] / anchor['peak_gib']:.2f}x" if off["peak_gib"] is not None else "-")
        else:
            cells += ["-", "-"]
        lines.append(harness.md_row(completion, *cells))
    off = by.get(("offload", MEMORY_GOAL_AT))
    if off is not None and not off["error"] and off["peak_gib"] is not None:
        verdict = "met" if off["peak_gib"] <= MEMORY_GOAL_GIB else "not met"
        lines.append(f"\nGoal: peak <= {MEMORY_GOAL_GIB} GiB at {MEMORY_GOAL_AT} completions: {verdict} "
                     f"({off['peak_gib']} GiB)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    parser.add_argument("--modes", default="checkpoint,offload")
    parser.add_argument("--completions", default="4096,16384")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--inner", default="inductor", help="the fastgrpo backend's inner compiler")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script runs (CPU is fine)")
    parser.add_argument("--system", default="fastgrpo", choices=["fastgrpo", "fastgrpo_save"],
                        help="backend options as in grpo_step.py: the gated MLP keeping gate/up, or the MLP op")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if "offload" in modes and "checkpoint" in modes:
        modes = ["checkpoint"] + [m for m in modes if m != "checkpoint"]  # the gradient reference first
    results = run(modes, [int(c) for c in args.completions.split(",")], args.warmup, args.repeat, args.tiny,
                  args.inner, args.system, args.shape)
    if not args.tiny:
        rows = [dict(shape=args.shape, system=args.system, **r) for r in results]
        print(f"rows appended to {harness.record('bench_offload', rows)}")
    print(table(results, unsloth_rows(args.shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
