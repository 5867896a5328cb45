"""Which implementation a fastgrpo op runs, and the input checks every op shares.

CUDA tensors go to the Triton kernels; CPU tensors go to the torch implementation
with the same save/recompute contract. Tests run the Triton kernels on CPU tensors
through Triton's interpreter inside `triton_on_cpu()`.
"""
import contextlib
import functools
import os
import threading
from typing import Callable

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_triton_on_cpu = False
_cuda_launch_configs = False
# What `multiprocessor_count` answers for a CPU tensor inside `cuda_launch_configs()`: an H100/H200's SMs.
RECORDING_SMS = 132


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _triton_on_cpu


def traced() -> bool:
    """Whether the body of a `torch.library.triton_op` runs for a tracer (fake tensors, AOTAutograd's functional
    ones) rather than on real tensors. torch runs the body eagerly with `wrap_triton` off; under a trace with it
    on, each launch is recorded as a node that inductor then launches itself, so that none of our Python (checks,
    launch configurations, Triton's JIT launcher) runs per call in a compiled training graph. (AOTAutograd
    decomposes a triton_op there; a no-grad graph keeps calling the op, whose body then runs eagerly: torch 2.11.)"""
    return torch._library.triton.is_wrap_triton_enabled()


def launches_triton(t: torch.Tensor) -> bool:
    """`use_triton` for a triton_op's body: Triton's interpreter cannot run on a tracer's CPU tensors, so a traced
    CPU call takes the torch path (same contract and outputs)."""
    return t.is_cuda or (_triton_on_cpu and not traced())


def launcher(kernel):
    """A Triton kernel as a triton_op's body launches it (`launcher(kernel)[grid](...)`): through `wrap_triton`, so
    that a trace records the launch; called eagerly, the kernel itself."""
    return torch.library.wrap_triton(kernel)


def launch_like_cuda(t: torch.Tensor) -> bool:
    """Whether a kernel launch on `t` takes the configuration made for GPUs (block sizes, warps, grid
    sizing, TF32 dot precision) rather than the interpreter's: on CUDA tensors, and on CPU tensors inside
    `cuda_launch_configs()`."""
    return t.is_cuda or _cuda_launch_configs


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; RECORDING_SMS inside `cuda_launch_configs()`; 1 for the interpreter."""
    if device.type == "cuda":
        return _cuda_properties(device).multi_processor_count
    return RECORDING_SMS if _cuda_launch_configs else 1


def _cuda_properties(device: torch.device):
    return _cuda_properties_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_properties_of(index: int):
    # Asked on every launch of several ops: read the device's properties once.
    return torch.cuda.get_device_properties(index)


# FASTGRPO_PROGRAMMATIC_LAUNCH=0 launches every kernel after the one before it has finished, the usual way
# (for tools that do not follow programmatic dependent launches, and to time the difference).
_PROGRAMMATIC_LAUNCH = os.environ.get("FASTGRPO_PROGRAMMATIC_LAUNCH", "1") != "0"


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether a kernel on `t` may launch as a programmatic dependent of the kernel before it (sm_90+):
    its launch and the start of its programs overlap that kernel's end, and it waits (`gdc_wait`) for that
    kernel's writes before reading them. CUDA only: the interpreter has no grid dependency control."""
    return _PROGRAMMATIC_LAUNCH and t.is_cuda and _cuda_properties(t.device).major >= 9


def dependent_launch_args(t: torch.Tensor) -> dict:
    """Launch arguments of a kernel written for programmatic dependent launch (its `DEPENDENT_LAUNCH`
    constexpr guards the `gdc_wait` before its first access to memory): launched as a dependent of the
    kernel before it where `programmatic_launch(t)`, in the usual way elsewhere. Traced launches (`traced`) take
    the usual way: inductor's analysis of which arguments a kernel writes cannot read `gdc_wait` (inline assembly),
    and would take every pointer as written, copying the inputs."""
    dependent = programmatic_launch(t) and not traced()
    return {"DEPENDENT_LAUNCH": dependent, "launch_pdl": dependent}


@contextlib.contextmanager
def cuda_launch_configs():
    """Inside `triton_on_cpu()`: launch with the configurations a GPU would get, so that a test can record
    and compile exactly those (tests/test_triton_compiles_for_cuda.py). Results computed this way are not
    checked (the interpreter does not model TF32)."""
    global _cuda_launch_configs
    previous, _cuda_launch_configs = _cuda_launch_configs, True
    try:
        yield
    finally:
        _cuda_launch_configs = previous


@contextlib.contextmanager
def triton_on_cpu():
    """Route CPU tensors to the Triton kernels, run by Triton's interpreter (for tests)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    global _triton_on_cpu
    previous, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = previous


# Thread-local: a checkpoint's re-run runs on autograd's thread.
_recompute = threading.local()


@contextlib.contextmanager
def _on_this_thread(name: str, value):
    previous = getattr(_recompute, name, None)
    setattr(_recompute, name, value)
    try:
        yield
    finally:
        setattr(_recompute, name, previous)


def checkpoint_recompute():
    """Marks a gradient checkpoint's re-run of a forward whose outputs are thrown away (torch's non-reentrant
    checkpoint re-runs a layer only for the tensors it saves). An op whose output the compiler proved feeds
    nothing that is saved (`skip_output_on_recompute`) may then compute only what it saves."""
    return _on_this_thread("active", True)


def in_checkpoint_recompute() -> bool:
    return bool(getattr(_recompute, "active", False))


class KeptOutputs:
    """Outputs an op keeps from a checkpointed forward for the checkpoint's re-run of it, in call order.

    The checkpoint (fastgrpo.compiler.offload) owns one per checkpointed call and decides where the kept tensors
    wait (host memory, or the device); an op goes through `kept_or_computed`. While `recording` (the forward) an
    op computes and calls `keep`; in the re-run (`recording` False) it asks `replay` for what it kept instead of
    computing it again, and computes only if nothing was kept (None). `signals_backward_peak`: an op of the call
    will call `backward_peak_passed()` from its backward (`signal_backward_peak`)."""

    recording = True
    signals_backward_peak = False

    def keep(self, tensors: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError

    def replay(self) -> tuple[torch.Tensor, ...] | None:
        raise NotImplementedError


def keeping_outputs(frame: KeptOutputs | None):
    """Makes `frame` the one `kept_or_computed` uses on this thread."""
    return _on_this_thread("frame", frame)


def kept_or_computed(compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """An op's outputs inside a checkpointed call: in the checkpoint's re-run what its forward kept, if anything;
    else `compute()`, kept while the forward records."""
    frame = getattr(_recompute, "frame", None)
    if frame is not None and not frame.recording:
        kept = frame.replay()
        if kept is not None:
            return kept
    outputs = compute()
    if frame is not None and frame.recording:
        frame.keep(outputs)
    return outputs


def signal_backward_peak() -> None:
    """Called by an op's forward whose backward frees the largest temporaries of a decoder layer's backward (the
    gated-MLP op's chunk buffers) and then calls `backward_peak_passed()`: marks the checkpointed call recording."""
    frame = getattr(_recompute, "frame", None)
    if frame is not None and frame.recording:
        frame.signals_backward_peak = True


# Work waiting for the backward's peak to pass (global: ops run their backward on autograd's thread).
_after_backward_peak: list[Callable[[], None]] = []


def after_backward_peak(callback: Callable[[], None]) -> None:
    """Run `callback` at the next `backward_peak_passed()` (the checkpoint defers the copy back of the layer before's
    input there, so that it does not sit beside the gated-MLP backward's buffers)."""
    _after_backward_peak.append(callback)


def cancel_after_backward_peak() -> None:
    """Drop what waits for a signal that did not come (the checkpoint's next layer arrived first)."""
    _after_backward_peak.clear()


def backward_peak_passed() -> None:
    while _after_backward_peak:
        _after_backward_peak.pop(0)()


def take_after_backward_peak() -> list[Callable[[], None]]:
    """What waits for the signal, removed (a CUDA-graph capture, whose ops signal only while it captures, holds it
    aside and gives it back with `restore_after_backward_peak`)."""
    pending = list(_after_backward_peak)
    _after_backward_peak.clear()
    return pending


def restore_after_backward_peak(pending: list[Callable[[], None]]) -> None:
    _after_backward_peak[:0] = pending


# Host-side block arithmetic in plain Python: triton.next_power_of_2 and triton.cdiv go through Triton's
# JIT wrapper (~3 us a call), and a launch computes several (RoPE's host path on a 2-core CPU: 45 us a call,
# 58 with Triton's helpers). At short completions the GRPO step is bound by the host.
def next_power_of_2(n: int) -> int:
    """Smallest power of 2 >= n (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_dtype(op: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fastgrpo::{op} supports float32, float16 and bfloat16 inputs, got {t.dtype}; "
            f"cast the input (e.g. .to(torch.bfloat16)) or leave this site to inductor"
        )
