"""Where a training step's time goes: Python's collector pauses, the host's lead over the GPU, the step's
synchronising calls, and torch.profiler readings (device time by kernel category, the GPU's idle gaps and their
causes, matmul rates by operand shape, the host's cProfile). bench/grpo_step.py and bench/peers/unsloth_step.py print
them with --profile-at."""
import collections
import gc
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import MATMUL_TFLOPS  # noqa: E402


class GcPauses:
    """Python's garbage-collector pauses while installed (gc.callbacks): total ms and full (generation-2)
    collections. A full collection walks every live Python object - after compiling a model, hundreds of
    thousands - and stalls the host, so the GPU idles: a step that takes it is hundreds of ms slower."""

    def __init__(self):
        self.ms, self.full, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms += (time.perf_counter() - self._start) * 1e3
            self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def host_lead(step, args, model) -> str:
    """How far the host runs ahead of the GPU through one step: at each decoder layer's call (forward, then
    the checkpoint's recompute in backward) the host time and the GPU time of a CUDA event recorded there,
    from the step's start. A lead near zero means the GPU had caught up and waited on the host's launches
    there (host-bound); a growing lead means the GPU was the bottleneck. Needs offloaded checkpointing (its
    layer call, outside the compiled regions, is where the marks are recorded)."""
    from fastgrpo.compiler.regions import repeated_blocks

    marks = []

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, time.perf_counter(), event))

    states = [block.__dict__.get("_fastgrpo_offload") for block in repeated_blocks(model.get_base_model())]
    if any(state is None for state in states):
        return "host lead: needs offloaded checkpointing"
    originals = [state.call for state in states]
    seen = collections.Counter()

    def marked(layer, call):
        def run(block, *a, **k):
            seen[layer] += 1
            mark(f"layer {layer}" + (" recompute" if seen[layer] > 1 else ""))
            return call(block, *a, **k)
        return run

    for layer, state in enumerate(states):
        state.call = marked(layer, state.call)
    try:
        torch.cuda.synchronize()
        mark("start")
        step(*args)
        mark("step returned")
        torch.cuda.synchronize()
    finally:
        for state, call in zip(states, originals):
            state.call = call
    _, host0, event0 = marks[0]
    lines = ["| mark | host ms | GPU ms | lead ms |", "|---|---|---|---|"]
    for name, host, event in marks:
        host_ms, gpu_ms = (host - host0) * 1e3, event0.elapsed_time(event)
        lines.append(f"| {name} | {host_ms:.1f} | {gpu_ms:.1f} | {gpu_ms - host_ms:.1f} |")
    return "Host lead over the GPU through one step:\n" + "\n".join(lines)


def sync_points(step, args, rows: int = 12) -> str:
    """Where one step makes the host wait on the GPU (torch.cuda's sync debug mode: .item(), copies to
    pageable host memory, nonzero, ...), by Python location: each one empties the GPU's queue."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    places = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught
                                 if "synchroniz" in str(w.message))
    lines = [f"{count} x {place}" for place, count in places.most_common(rows)]
    return f"synchronizing calls in one step: {sum(places.values())}" + "".join("\n  " + line for line in lines)


# Kernel-name patterns of the categories profile_step sums device time into (first match wins).
KERNEL_CATEGORIES = [
    ("memcpy/memset (copy engines: overlaps compute)", r"memcpy|memset"),
    ("attention", r"flash|fmha|cudnn|attn|sdpa"),
    ("matmul (cuBLAS/CUTLASS)", r"nvjet|gemm|cutlass|xmma|splitk|cublas|sm90_"),
    ("norm/rope/act-mul/log-prob Triton kernels (fastgrpo's; Unsloth's norm and rope)",
     r"_rms_norm|_rope|_act_mul|_stats_kernel|_grad_logits|_dw_reduce"),
    ("inductor Triton kernels", r"^triton_"),
    ("aten elementwise/reduce/copy", r"elementwise|reduce|vectorized|cat_|copy|index|fill|scatter|gather"),
    ("other", r""),
]


def is_copy(kernel_name: str) -> bool:
    """A copy-engine transfer (host <-> device copy, memset), which runs beside the compute kernels."""
    return re.search(KERNEL_CATEGORIES[0][1], kernel_name.lower()) is not None


def on_device(event) -> bool:
    """A kernel or copy on the GPU's timeline. Left out: the ranges that annotate it (`## Call CompiledFxGraph
    ... ##` spans a whole compiled graph, the gaps inside it too, which would count as busy)."""
    return (event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and not event.name.startswith("## "))


def kernel_summary(prof) -> str:
    """Device time of one profiled step by kernel category, and the GPU's busy time (union of its compute
    kernels' intervals, copies left out) against the step's wall time: how host-bound the step is."""
    totals, intervals = {}, []
    for event in prof.events():
        if not on_device(event):
            continue
        name = event.name.lower()
        category = next(c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, name))
        count, time_us = totals.get(category, (0, 0.0))
        totals[category] = (count + 1, time_us + event.time_range.elapsed_us())
        if not is_copy(name):
            intervals.append((event.time_range.start, event.time_range.end))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    wall = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    lines = ["| kernels | count | ms |", "|---|---|---|"]
    lines += [f"| {c} | {n} | {t / 1e3:.1f} |" for c, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    lines.append(f"GPU busy {busy / 1e3:.1f} ms of {wall / 1e3:.1f} ms from first to last kernel")
    return "\n".join(lines)


def idle_gaps(prof, rows: int = 15, min_ms: float = 0.2, with_host: bool = True) -> str:
    """Where the GPU waits inside the step (no compute kernel running): every gap between kernels, the gaps
    of at least `min_ms` grouped by the kernel that ends them (count, ms, forward or backward), and the longest
    ones with the kernels either side and the innermost host events covering most of the gap (what the host
    was doing while the GPU waited: a synchronisation, an allocation, an op's Python before its launch).
    `with_host` False: a profile of the device's activity alone, with no host events to say the phase."""
    kernels, host = [], []
    for event in prof.events():
        interval = (event.time_range.start, event.time_range.end, event.name)
        if on_device(event):
            if not is_copy(event.name):
                kernels.append(interval)
        elif event.device_type != torch.autograd.DeviceType.CUDA:
            host.append(interval)
    kernels.sort()
    gaps, end, last, all_gaps = [], float("-inf"), "", 0.0
    for start, stop, name in kernels:
        if last and start > end:
            all_gaps += start - end
            if start - end >= min_ms * 1e3:
                gaps.append((start - end, end, start, last, name))
        if stop > end:
            end, last = stop, name

    def covering(start, stop):
        return [n for _, n in sorted((e - s, n) for s, e, n in host if min(e, stop) - max(s, start) >= 0.5 * (stop - start))]

    during = {(start, stop): covering(start, stop) for _, start, stop, _, _ in gaps}
    groups = {}
    for length, start, stop, _, after in gaps:
        phase = ("-" if not with_host  # a profile of the device alone
                 else "backward" if any(n.startswith("autograd::engine") for n in during[start, stop]) else "forward")
        count, total = groups.get((after[:60], phase), (0, 0.0))
        groups[(after[:60], phase)] = (count + 1, total + length)
    lines = [f"GPU idle between kernels: {all_gaps / 1e3:.1f} ms in all; {len(gaps)} gaps >= {min_ms} ms, "
             f"{sum(g[0] for g in gaps) / 1e3:.1f} ms, by the kernel after them:",
             "| kernel after | phase | gaps | ms |", "|---|---|---|---|"]
    lines += [f"| {name} | {phase} | {count} | {total / 1e3:.1f} |"
              for (name, phase), (count, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]]
    lines += ["The longest:", "| ms | kernel before | kernel after | host during the gap (innermost first) |",
              "|---|---|---|---|"]
    for length, start, stop, before, after in sorted(gaps, reverse=True)[:rows]:
        host_events = "; ".join(dict.fromkeys(during[start, stop][:4]))
        lines.append(f"| {length / 1e3:.2f} | {before[:50]} | {after[:50]} | {host_events[:160]} |")
    return "\n".join(lines)


def gap_causes(prof, rows: int = 12, min_ms: float = 0.05) -> str:
    """Why the GPU waited before a kernel: each gap of at least `min_ms` split at the moment the host launched the
    kernel after it (the launch call that shares the kernel's CUPTI correlation id, or failing that, its linked
    one). Up to that moment the host was
    late (its Python, dispatch or launch work had not reached the kernel yet); after it, the kernel was queued
    and waited on the device: on a stream's wait for an event (a copy back, another stream's work), or the
    launch's own latency."""
    launches, kernels = {}, []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            if not event.is_user_annotation() and not is_copy(event.name()):
                ids = (event.correlation_id(), event.linked_correlation_id())
                kernels.append((event.start_ns(), event.end_ns(), event.name(), ids))
        elif event.name().startswith(("cudaLaunch", "cuLaunch")):
            launches[event.correlation_id()] = event.start_ns()
    kernels.sort()
    host_ns = device_ns = unlinked_ns = 0
    groups, end = {}, None
    for start, stop, name, ids in kernels:
        if end is not None and start - end >= min_ms * 1e6:
            gap, launched = start - end, next((launches[i] for i in ids if i in launches), None)
            late = None if launched is None else min(max(launched - end, 0), gap)
            if late is None:
                unlinked_ns += gap
            else:
                host_ns, device_ns = host_ns + late, device_ns + gap - late
            count, total, host_part = groups.get(name[:60], (0, 0, 0))
            groups[name[:60]] = (count + 1, total + gap, host_part + (late or 0))
        if end is None or stop > end:
            end = stop
    lines = [f"gaps >= {min_ms} ms: {(host_ns + device_ns + unlinked_ns) / 1e6:.1f} ms; the host late for "
             f"{host_ns / 1e6:.1f} ms of it, the kernel queued and waiting for {device_ns / 1e6:.1f} ms"
             + (f", launch not found for {unlinked_ns / 1e6:.1f} ms" if unlinked_ns else ""),
             "| kernel after | gaps | ms | host late ms |", "|---|---|---|---|"]
    lines += [f"| {name} | {count} | {total / 1e6:.1f} | {host_part / 1e6:.1f} |"
              for name, (count, total, host_part) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]]
    return "\n".join(lines)


# aten matmul ops and the positions of their two operands among the recorded input shapes.
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::bmm": (0, 1),
                   "aten::baddbmm": (1, 2)}
THIN = 64  # a product with a dimension this small or smaller (LoRA's rank side) is bound by memory, not FLOPs


def matmul_shapes(prof, rows: int = 20) -> str:
    """Matmul device time by op and operand shapes, with the TFLOP/s each reached: which products run below the
    GPU's matmul rate (LoRA's thin ones, split-K reductions) and what share of the matmul time they take."""
    groups, cuda = [], torch.cuda.is_available()
    for average in prof.key_averages(group_by_input_shape=True):
        operands = MATMUL_OPERANDS.get(average.key)
        shapes = average.input_shapes if operands else None
        if not shapes or max(operands) >= len(shapes):
            continue
        a, b = shapes[operands[0]], shapes[operands[1]]
        if len(a) < 2 or len(b) < 2:
            continue
        flop = 2 * math.prod(a[:-2]) * a[-2] * a[-1] * b[-1] * average.count
        us = (getattr(average, "self_device_time_total", None) or getattr(average, "self_cuda_time_total", 0)
              if cuda else average.self_cpu_time_total)
        thin = min(a[-2], a[-1], b[-1]) <= THIN
        groups.append((us / 1e3, flop, average.count, average.key, f"{list(a)} x {list(b)}", thin))
    if not groups:
        return "no matmuls recorded"
    total_ms, total_flop = sum(g[0] for g in groups), sum(g[1] for g in groups)
    thin_ms, thin_flop = sum(g[0] for g in groups if g[5]), sum(g[1] for g in groups if g[5])
    lines = [f"matmuls: {total_flop / 1e12:.1f} TFLOP in {total_ms:.1f} ms ({total_flop / 1e9 / max(total_ms, 1e-9):.0f} "
             f"TFLOP/s; {total_flop / 1e9 / MATMUL_TFLOPS:.1f} ms at {MATMUL_TFLOPS}); thin products (a dim <= "
             f"{THIN}): {thin_flop / 1e12:.2f} TFLOP in {thin_ms:.1f} ms",
             "| op | operands | calls | ms | TFLOP/s |", "|---|---|---|---|---|"]
    for ms, flop, count, op, operands, _ in sorted(groups, reverse=True)[:rows]:
        lines.append(f"| {op} | {operands} | {count} | {ms:.1f} | {flop / 1e9 / max(ms, 1e-9):.0f} |")
    return "\n".join(lines)


def profile_step(step, args, label: str, rows: int = 40, model=None) -> None:
    """Print the kernels that take the step's time (one step under torch.profiler), by category and by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"PROFILE {label}\n" + (kernel_summary(prof) + "\n" + idle_gaps(prof) + "\n" if torch.cuda.is_available() else "")
          + matmul_shapes(prof) + "\n"
          + prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90), flush=True)
    if torch.cuda.is_available():
        profile_device(step, args, label)
        print(sync_points(step, args), flush=True)
        if model is not None:
            print(host_lead(step, args, model), flush=True)
    print(f"HOST PROFILE {label} (cProfile of one more step: where the host's time goes)\n" + host_profile(step, args),
          flush=True)


def profile_device(step, args, label: str) -> None:
    """One step with only the device's activity recorded: the profile of `profile_step` records every host call
    and its shapes, which slows the host enough for the GPU to wait on it; here the host runs at its own speed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(*args)
        torch.cuda.synchronize()
    print(f"DEVICE PROFILE {label} (the device's activity alone)\n" + kernel_summary(prof) + "\n"
          + idle_gaps(prof, min_ms=0.05, with_host=False) + "\n" + gap_causes(prof), flush=True)


def host_profile(step, args, rows: int = 45) -> str:
    """cProfile of one step, by own time and by cumulative time: the Python and launch work the host does
    (a step whose GPU is idle part of the time is bound by this), and any wait on the GPU (synchronize)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()

