"""bench/_profile.py's reading of a profile (printed by bench/grpo_step.py --profile-at): which device events are
kernels, and why the GPU waited (the GPU profile itself is a benchmark; these feed it events shaped like the
profiler's)."""
from types import SimpleNamespace

import torch

from bench._profile import gap_causes, kernel_summary

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
MS = 1_000_000  # ns


class _KinetoEvent:
    """The accessors of torch's _KinetoEvent that gap_causes reads."""

    def __init__(self, name, device, start, end, correlation=0, linked=0, annotation=False):
        self._fields = (name, device, start, end, correlation, linked, annotation)

    def name(self): return self._fields[0]
    def device_type(self): return self._fields[1]
    def start_ns(self): return self._fields[2]
    def end_ns(self): return self._fields[3]
    def correlation_id(self): return self._fields[4]
    def linked_correlation_id(self): return self._fields[5]
    def is_user_annotation(self): return self._fields[6]


def _profile(events):
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))


def test_each_gap_is_split_at_the_launch_of_the_kernel_after_it():
    events = [
        _KinetoEvent("## Call CompiledFxGraph abc ##", CUDA, 0, 10 * MS, annotation=True),  # spans everything
        _KinetoEvent("gemm_a", CUDA, 0, 1 * MS, correlation=1),
        _KinetoEvent("cudaLaunchKernel", CPU, 0, MS // 100, correlation=1),
        # launched long before: queued, it waited 2 ms on the device (a stream waiting for a copy back)
        _KinetoEvent("cuLaunchKernelEx", CPU, MS // 2, MS // 2 + 10, correlation=2),
        _KinetoEvent("Memcpy HtoD (Pinned -> Device)", CUDA, 1 * MS, 3 * MS),  # copies run beside: no kernel
        _KinetoEvent("rope_kernel", CUDA, 3 * MS, 3 * MS + MS // 2, correlation=2),
        # launched 0.5 ms into a 0.7 ms gap: the host was late for 0.5 ms of it
        _KinetoEvent("cudaLaunchKernel", CPU, 4 * MS, 4 * MS + 10, correlation=3),
        _KinetoEvent("cat_kernel", CUDA, 4 * MS + MS // 5, 5 * MS, correlation=9, linked=3),  # by the link
        _KinetoEvent("tiny_kernel", CUDA, 5 * MS + 10_000, 6 * MS, correlation=4),  # a 10 us gap: under the threshold
    ]
    text = gap_causes(_profile(events), min_ms=0.05)
    first, _, _, *rows = text.splitlines()
    assert first == "gaps >= 0.05 ms: 2.7 ms; the host late for 0.5 ms of it, the kernel queued and waiting for 2.2 ms"
    assert rows == ["| rope_kernel | 1 | 2.0 | 0.0 |", "| cat_kernel | 1 | 0.7 | 0.5 |"]


def test_a_gap_whose_launch_was_not_recorded_is_counted_apart():
    events = [_KinetoEvent("a", CUDA, 0, MS, correlation=1), _KinetoEvent("b", CUDA, 2 * MS, 3 * MS, correlation=7)]
    assert gap_causes(_profile(events)).splitlines()[0].endswith("launch not found for 1.0 ms")


def test_annotation_ranges_are_not_kernels():
    def event(name, start_us, end_us, annotation=False):
        return SimpleNamespace(name=name, device_type=CUDA, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start_us, end=end_us,
                                                          elapsed_us=lambda: end_us - start_us))

    prof = SimpleNamespace(events=lambda: [
        event("## Call CompiledFxGraph abc ##", 0, 10_000, annotation=True),
        event("nvjet_sm90_gemm", 0, 1_000), event("triton_poi_fused_add_0", 4_000, 5_000)])
    text = kernel_summary(prof)
    assert "GPU busy 2.0 ms of 5.0 ms" in text and "other" not in text
