"""Op bodies replayed as CUDA graphs: a host-bound step stops paying their Python and their launches.

At short GRPO completions a training step is bound by the host (H200, Qwen2.5-1.5B, 8 x 1280 tokens: the host
took 357 ms a step, the GPU was busy 183 ms of it), and the gated-MLP op is the largest share of that host time:
~20 cuBLAS calls and Triton launches a chunk of rows, 1.5-3 ms a call (a torch.profiler trace of one step:
`python bench/grpo_step.py --systems fastgrpo --completions 1024 --profile-at 1024`). `replayed` runs such a body
as a captured CUDA graph instead:

- `weights`: tensors that stay where they are between calls (a layer's projection weights). The graph reads them in
  place, and their addresses are part of the graph's key: each layer has its own graphs. A weight updated in place
  (the optimizer's step) is read as it is at the replay.
- `rows`: the call's per-row tensors ([rows, ...]: activations, incoming gradients), copied into staging buffers
  whose first dimension is the row count rounded up to a bucket (`bucket_rows`: a multiple of 1/16 of the next
  power of two); the padding rows are zeros. A row-wise body (every output row a function of its input row; weight
  gradients sums of per-row products) then gives the same rows, and zero rows add nothing to the sums. So a few
  graphs serve a run whose row counts vary (packed batches).
- `others`: every other tensor (casts made for this call, LoRA factors): copied into staging buffers of their own
  shape.
- outputs: the body returns a tuple or list of tensors; inside the graph each is copied into a staging buffer, and
  after the replay `row_outputs` (those indexed by row) are cloned out as [:rows], the rest whole.
Staging buffers are shared by every graph with the same position, trailing shape and dtype (one layer's call at a
time; a row buffer has the rows of the largest bucket seen, each graph reading its first rows), and every graph's
temporaries live in one private memory pool, reused from capture to capture: the graphs hold the temporaries of one
call, not one per layer (`graph_pool_bytes` reports them; a benchmark's peak adds them). At most MAX_GRAPHS graphs
are kept.

A key is captured at its second call (a row count seen once is not worth a capture: the first call runs the body
as it is), after one warm-up run on the capture stream, as torch's CUDA-graph rules ask. Calls run the body as it
is off CUDA, inside another capture, in inference mode, and when `ENABLED` is off (FASTGRPO_OP_GRAPHS=0). A capture
that fails is undone (`capturing`), warned once with its error, and the op's calls run as they are from then on
(`failed`).
"""
from __future__ import annotations

import collections
import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from fastgrpo.kernels._dispatch import next_power_of_2

ENABLED = os.environ.get("FASTGRPO_OP_GRAPHS", "1") != "0"
# Buckets: row counts rounded up to a multiple of this fraction of their next power of two (at most 1/16 more rows;
# 8 x 1280 GRPO rows are a bucket of their own), and at least MIN_BUCKET_STEP rows.
BUCKETS_PER_OCTAVE = 16
MIN_BUCKET_STEP = 128


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to its bucket: a multiple of max(next_power_of_2(rows) / 16, 128)."""
    step = max(MIN_BUCKET_STEP, next_power_of_2(rows) // BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None until captured (the key's first call ran eagerly)
    inputs: list[torch.Tensor]  # staging buffers the graph reads: the row tensors, then the others
    outputs: list[torch.Tensor]  # staging buffers the graph writes its outputs into


# Graphs kept at most, the least recently used dropped first (a run whose row counts drift keeps only recent buckets).
MAX_GRAPHS = 1024
_graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
_staging: dict[tuple, torch.Tensor] = {}
_pools: dict[torch.device, tuple] = {}  # device -> (memory pool handle, capture stream)
stats = {"captured": 0, "replayed": 0, "eager": 0}
failed: dict[str, str] = {}  # op name -> why its capture failed (its calls run as they are)


def _describe(t: torch.Tensor | None) -> tuple:
    return (None,) if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)


def _staging_buffer(kind: str, position: int, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The shared staging buffer of (kind, position, shape, dtype), made once."""
    key = (kind, position, shape, dtype, device)
    buffer = _staging.get(key)
    if buffer is None:
        buffer = _staging[key] = torch.zeros(shape, dtype=dtype, device=device)
    return buffer


def _row_staging(kind: str, position: int, padded: int, trailing: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The first `padded` rows of the shared row buffer of (kind, position, trailing shape, dtype): one buffer serves
    every bucket. Where it must grow (by at least a quarter), the graphs that read or write the old buffer are
    dropped and captured again at their key's next call (no eager call first: the key was seen); the others stay."""
    key = (kind, position, "rows", trailing, dtype, device)
    buffer = _staging.get(key)
    if buffer is None or buffer.shape[0] < padded:
        if buffer is not None:
            _drop_graphs_using(buffer)
            padded_to = max(padded, buffer.shape[0] + buffer.shape[0] // 4)
        else:
            padded_to = padded
        buffer = _staging[key] = torch.zeros((padded_to, *trailing), dtype=dtype, device=device)
    return buffer[:padded]


def _drop_graphs_using(buffer: torch.Tensor) -> None:
    """Forgets the captured graph of every key whose staging inputs or outputs are views of `buffer`."""
    storage = buffer.untyped_storage().data_ptr()
    for entry in _graphs.values():
        if any(t is not None and t.untyped_storage().data_ptr() == storage for t in (*entry.inputs, *entry.outputs)):
            entry.graph, entry.inputs, entry.outputs = None, [], []


def _stage(staged: list[torch.Tensor], rows: list[torch.Tensor], others: list[torch.Tensor | None], n: int) -> None:
    """Copies the call's tensors into the graph's staging buffers; zeros the row buffers' padding."""
    for buffer, t in zip(staged, rows):
        buffer[:n].copy_(t)
        if buffer.shape[0] > n:
            buffer[n:].zero_()
    pairs = [(buffer, t) for buffer, t in zip(staged[len(rows):], others) if t is not None]
    if pairs:  # one launch for all of them
        torch._foreach_copy_([buffer for buffer, _ in pairs], [t for _, t in pairs])


_suspended = 0  # > 0 inside `suspended()`


@contextlib.contextmanager
def suspended():
    """Calls run their bodies as they are inside this block: the caller replays a graph around them (a decoder
    layer's call, fastgrpo.compiler.layer_graphs), so op graphs and their staging would be spent on calls that stop
    coming."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def applies(device: torch.device) -> bool:
    """Whether calls on `device` may be replayed: CUDA, enabled, not `suspended()`, not inside another capture, not in
    inference mode (staging buffers made there could not be written by later calls outside it)."""
    return (ENABLED and not _suspended and device.type == "cuda" and not torch.is_inference_mode_enabled()
            and not torch.cuda.is_current_stream_capturing())


def replayed(name: str, call: Callable[[tuple, tuple], tuple], weights: tuple, rows: tuple, others: tuple,
             consts: tuple, row_outputs: tuple[int, ...],
             lead: tuple[int, ...] | None = None) -> list[torch.Tensor] | None:
    """`call(rows, others)` - the op's body with `weights` and `consts` (hashable) bound in it - replayed as a CUDA
    graph: see the module docstring. `rows` have one row count (first dimension, > 0); the body must not have
    Python side effects that each call needs (they would run at the capture only). Returns the body's outputs, each
    a tensor of its own (no view: a custom op's output that is a view cannot be modified in place); `lead` replaces
    the row dimension of the row outputs (e.g. the leading dimensions of a 3-D input). Returns None at a key's first
    call: the op then runs as it does without graphs."""
    n = rows[0].shape[0]
    padded = bucket_rows(n)
    key = (name, tuple(w.data_ptr() if w is not None else None for w in weights),
           tuple(_describe(w) for w in weights), padded, tuple((tuple(t.shape[1:]), t.dtype) for t in rows),
           tuple(_describe(t) for t in others), consts)
    entry = _graphs.get(key)
    if entry is None:
        _graphs[key] = _Graph(None, [], [])
        if len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
        stats["eager"] += 1
        return None
    _graphs.move_to_end(key)
    device = rows[0].device
    if entry.graph is None:
        if name in failed:
            stats["eager"] += 1
            return None
        staged = [_row_staging("in", i, padded, tuple(t.shape[1:]), t.dtype, device) for i, t in enumerate(rows)]
        staged += [None if t is None else _staging_buffer("in", len(rows) + i, tuple(t.shape), t.dtype, device)
                   for i, t in enumerate(others)]
        _stage(staged, rows, others, n)
        entry.inputs = staged
        try:
            _capture(entry, staged[:len(rows)], staged[len(rows):], call, row_outputs, padded, device)
        except Exception as error:  # the capture was undone (`capturing`); the op's calls run as they are from now on
            failed[name] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            del _graphs[key]
            warnings.warn(f"fastgrpo: {name}'s calls are not replayed as CUDA graphs: its capture failed: "
                          f"{failed[name]}", stacklevel=3)
            stats["eager"] += 1
            return None
        stats["captured"] += 1
    else:
        _stage(entry.inputs, rows, others, n)
    entry.graph.replay()
    stats["replayed"] += 1
    sources = [out[:n] if i in row_outputs else out for i, out in enumerate(entry.outputs)]
    results = [torch.empty((*lead, *t.shape[1:]) if lead is not None and i in row_outputs else t.shape, dtype=t.dtype,
                           device=t.device) for i, t in enumerate(sources)]
    torch._foreach_copy_([r.view(t.shape) for r, t in zip(results, sources)], sources)  # one launch for all of them
    return results


def capture_pool(device: torch.device) -> tuple:
    """(the private memory pool, the capture stream) of `device`'s graphs, made once; shared with the layer graphs
    (fastgrpo.compiler.layer_graphs): every graph's temporaries are dead when it ends, so captures reuse them."""
    if device not in _pools:
        with torch.cuda.device(device):
            _pools[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
    return _pools[device]


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream | None = None):
    """`torch.cuda.graph(graph, pool=pool, stream=stream)`, undone when the capture fails. torch's capture_end raises
    on a failed capture before it ends the allocators' recording into `pool`, the random generators' capture and the
    stream context; left so, every later capture into the pool ("beginAllocateToPool: already recording") and every
    random draw on the device ("Offset increment outside graph capture") fails for the rest of the process. Undone:
    the stream, the generators (a capture that ends runs their epilogue), and `pool` retired: the host allocator's
    recording cannot be ended from Python, so the graphs of this module capture into a new pool from then on
    (`capture_pool`). The error raised is the body's own (what broke the capture), not capture_end's. `stream` None:
    torch's default capture stream."""
    before = torch.cuda.current_stream()
    context = torch.cuda.graph(graph, pool=pool, stream=stream)
    try:
        context.__enter__()
        try:
            yield
        except BaseException as error:
            with contextlib.suppress(Exception):  # capture_end's own error hides the body's
                context.__exit__(type(error), error, error.__traceback__)
            raise
        context.__exit__(None, None, None)
    except BaseException:
        _undo_capture(before, pool, context.capture_stream)
        raise


def _undo_capture(before: torch.cuda.Stream, pool, stream: torch.cuda.Stream) -> None:
    torch.cuda.set_stream(before)
    device = stream.device
    if pool is not None:
        with contextlib.suppress(RuntimeError):  # raises where the capture's end got that far
            torch._C._cuda_endAllocateToPool(device.index, pool)
        for key, (handle, capture_stream) in list(_pools.items()):
            if handle == pool:
                _pools[key] = (torch.cuda.graph_pool_handle(), capture_stream)
    scratch = torch.zeros(1, device=device)
    stream.wait_stream(before)
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):  # a pool of its own, released with the graph
        scratch.add_(1)


def _capture(entry: _Graph, rows, others, call, row_outputs, padded, device) -> None:
    pool, stream = capture_pool(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces and Triton's launchers exist before the capture
        warm = list(call(tuple(rows), tuple(others)))
    torch.cuda.current_stream(device).wait_stream(stream)
    entry.outputs = output_staging(warm, row_outputs, padded, device)
    del warm
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, pool, stream):
        outputs = call(tuple(rows), tuple(others))
        for buffer, t in zip(entry.outputs, outputs):
            buffer.copy_(t)
        del outputs
    entry.graph = graph


def output_staging(outputs: list[torch.Tensor], row_outputs, padded: int, device) -> list[torch.Tensor]:
    """The staging buffers a graph writes `outputs` (a warm-up run's) into."""
    return [_row_staging("out", i, padded, tuple(t.shape[1:]), t.dtype, device) if i in row_outputs
            else _staging_buffer("out", i, tuple(t.shape), t.dtype, device) for i, t in enumerate(outputs)]


def graph_pool_bytes() -> int:
    """Device bytes held by the graphs' private memory pool (reserved for their temporaries)."""
    if not _pools:
        return 0
    pools = {tuple(pool) for pool, _ in _pools.values()}
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", ())) in pools)


def log_fields() -> dict:
    """The counts a training log carries (`op_graphs/captured`, `/replayed`, `/eager`: calls since the process
    began) once any call went through here; a run whose row counts keep changing shows captures growing with
    replays."""
    if not any(stats.values()):
        return {}
    return {f"op_graphs/{key}": value for key, value in stats.items()}


def staging_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _staging.values())


def reset() -> None:
    """Drops every graph and staging buffer (tests; a model whose weights moved)."""
    _graphs.clear()
    _staging.clear()
    _pools.clear()
    failed.clear()
    for key in stats:
        stats[key] = 0
