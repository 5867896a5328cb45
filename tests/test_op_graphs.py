"""Op bodies replayed as CUDA graphs (fastgrpo/kernels/_graphs.py): the gated-MLP op's forward and backward give
what the op gives without graphs - the same bits where the row count is its own bucket - across captures, replays,
layers (weights) that take turns, weights updated in place and row counts padded to their bucket."""
import contextlib

import pytest
import torch

from fastgrpo.kernels import _graphs
from fastgrpo.kernels import gated_mlp as gated_mlp_module
from fastgrpo.kernels.gated_mlp import _replays, gated_mlp


def test_bucket_rows():
    assert _graphs.bucket_rows(10240) == 10240  # 8 x 1280 GRPO rows: a bucket of their own
    assert _graphs.bucket_rows(10241) == 11264  # a 16th of the next power of two (16384)
    assert _graphs.bucket_rows(16385) == 18432
    assert _graphs.bucket_rows(1) == 128 and _graphs.bucket_rows(128) == 128 and _graphs.bucket_rows(129) == 256
    for rows in range(1, 40000, 97):
        padded = _graphs.bucket_rows(rows)
        assert rows <= padded <= rows + max(127, rows // 8)


def test_log_fields(monkeypatch):
    monkeypatch.setattr(_graphs, "stats", {"captured": 0, "replayed": 0, "eager": 0})
    assert _graphs.log_fields() == {}  # nothing went through the graphs (every CPU run)
    monkeypatch.setattr(_graphs, "stats", {"captured": 2, "replayed": 40, "eager": 2})
    assert _graphs.log_fields() == {"op_graphs/captured": 2, "op_graphs/replayed": 40, "op_graphs/eager": 2}


def test_cpu_calls_run_as_they_are():
    x, w = torch.zeros(4, 8), torch.zeros(16, 8)
    assert not _replays(x, w) and not _graphs.applies(x.device)


def test_the_output_of_a_3d_input_is_no_view():
    """The op reshapes x to rows; its output must still be a tensor of its own (a model may add into it in place)."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    w_gate, w_up, w_down = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    y = gated_mlp(x, w_gate, w_up, w_down=w_down)
    assert y.shape == (2, 3, 8) and y._base is None
    y.add_(1.0).sum().backward()


def rerun_capture(entry, rows, others, call, row_outputs, padded, device):
    """A stand-in for `_graphs._capture` off the GPU: its graph re-runs the body into the staging outputs."""
    entry.outputs = _graphs.output_staging(list(call(tuple(rows), tuple(others))), row_outputs, padded, device)

    class Rerun:
        def replay(self):
            for buffer, t in zip(entry.outputs, call(tuple(rows), tuple(others))):
                buffer.copy_(t)

    entry.graph = Rerun()


def test_staging_buckets_and_outputs_on_cpu(monkeypatch):
    """Everything of a replayed call but the capture: staging, padding to the bucket, the outputs' shapes and values
    (a stand-in graph re-runs the body into the staging outputs; capturing needs a GPU)."""

    _graphs.reset()
    monkeypatch.setattr(_graphs, "_capture", rerun_capture)
    monkeypatch.setattr(_graphs, "applies", lambda device: _graphs.ENABLED)
    weights, lora = layer(11, hidden=32, inter=64, rank=4, device="cpu")
    for rows in (600, 620, 600):  # 1200, 1240, 1200 rows: one bucket (1280) of padded rows
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(2, rows, 32, generator=gen).to(torch.bfloat16)
        dy = torch.randn(2, rows, 32, generator=gen).to(torch.bfloat16)
        with graphs(False):
            want = forward_backward(weights, lora, x, dy)
        with graphs(True):
            got = forward_backward(weights, lora, x, dy)
        assert_same(got, want, exact=False)
    assert _graphs.stats == {"captured": 2, "replayed": 4, "eager": 2}
    assert {buffer.shape[0] for key, buffer in _graphs._staging.items() if "rows" in key} == {1280}
    _graphs.reset()


def test_a_grown_row_buffer_recaptures_only_the_graphs_that_read_it(monkeypatch):
    """A larger bucket grows one row buffer: the graphs over the old buffer are captured again at their next call
    (no eager call first), a graph over another buffer keeps replaying."""
    _graphs.reset()
    monkeypatch.setattr(_graphs, "_capture", rerun_capture)

    def double(rows, others):
        return (rows[0] * 2,)

    def call(name, n, width):
        x = torch.arange(n * width, dtype=torch.float32).view(n, width)
        out = _graphs.replayed(name, double, (), (x,), (), (), row_outputs=(0,))
        assert out is None or torch.equal(out[0], x * 2)
        return out

    for _ in range(2):  # eager, captured
        call("narrow", 200, 4), call("wide", 200, 8)
    assert _graphs.stats == {"captured": 2, "replayed": 2, "eager": 2}
    for _ in range(2):  # a larger bucket of the narrow rows: eager, captured over a grown buffer
        call("narrow", 1000, 4)
    assert _graphs.stats == {"captured": 3, "replayed": 3, "eager": 3}
    assert call("wide", 200, 8) is not None and _graphs.stats["captured"] == 3  # its buffer did not grow
    assert call("narrow", 200, 4) is not None  # recaptured at once over the grown buffer
    assert _graphs.stats == {"captured": 4, "replayed": 5, "eager": 3}
    _graphs.reset()


@contextlib.contextmanager
def graphs(enabled: bool):
    before = _graphs.ENABLED
    _graphs.ENABLED = enabled
    try:
        yield
    finally:
        _graphs.ENABLED = before


def layer(seed, hidden=256, inter=512, rank=16, lora_dtype=torch.float32, device="cuda"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std, dtype=torch.bfloat16, grad=False):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device).requires_grad_(grad)

    w_gate_up = rand(2 * inter, hidden, std=hidden**-0.5)
    weights = dict(w_gate=w_gate_up[:inter], w_up=w_gate_up[inter:], w_down=rand(hidden, inter, std=inter**-0.5))
    lora = dict(gate_lora_a=rand(rank, hidden, std=hidden**-0.5, dtype=lora_dtype, grad=True),
                gate_lora_b=rand(inter, rank, std=0.5, dtype=lora_dtype, grad=True),
                up_lora_a=rand(rank, hidden, std=hidden**-0.5, dtype=lora_dtype, grad=True),
                up_lora_b=rand(inter, rank, std=0.5, dtype=lora_dtype, grad=True),
                down_lora_a=rand(rank, inter, std=inter**-0.5, dtype=lora_dtype, grad=True),
                down_lora_b=rand(hidden, rank, std=0.5, dtype=lora_dtype, grad=True))
    return weights, lora


def forward_backward(weights, lora, x, dy):
    """The op's output and the gradients of x and every LoRA factor."""
    x = x.detach().requires_grad_()
    y = gated_mlp(x, weights["w_gate"], weights["w_up"], lora["gate_lora_a"], lora["gate_lora_b"], lora["up_lora_a"],
                  lora["up_lora_b"], 2.0, "silu", weights["w_down"], lora["down_lora_a"], lora["down_lora_b"], 0.5)
    assert y._base is None  # an op output that is a view could not be modified in place
    leaves = [x, *lora.values()]
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def inputs(rows, hidden=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
    dy = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
    return x, dy


def assert_same(got, want, exact):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact:
            assert torch.equal(g, w)
        else:
            scale = w.float().abs().max().clamp(min=1e-3)
            assert (g.float() - w.float()).abs().max() <= 2e-2 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("rows, lora_dtype", [(1280, torch.float32), (1280, torch.bfloat16), (1000, torch.float32)])
def test_replayed_mlp_matches_the_op(rows, lora_dtype):
    _graphs.reset()
    weights, lora = layer(0, lora_dtype=lora_dtype)
    x, dy = inputs(rows)
    with graphs(False):
        want = forward_backward(weights, lora, x, dy)
    with graphs(True):
        runs = [forward_backward(weights, lora, x, dy) for _ in range(3)]  # eager, captured, replayed
    assert _graphs.stats["captured"] == 2 and _graphs.stats["replayed"] == 4  # forward and backward graphs
    for got in runs:
        assert_same(got, want, exact=rows == _graphs.bucket_rows(rows))


@pytest.mark.gpu
def test_layers_take_turns_and_weights_change_in_place():
    _graphs.reset()
    layers = [layer(seed) for seed in (1, 2)]
    x, dy = inputs(1280, seed=3)
    for round_ in range(3):
        for weights, lora in layers:
            with graphs(False):
                want = forward_backward(weights, lora, x, dy)
            with graphs(True):
                got = forward_backward(weights, lora, x, dy)
            assert_same(got, want, exact=True)
            with torch.no_grad():  # an optimizer's step: same tensors, new values
                weights["w_down"].mul_(0.9)
                lora["down_lora_b"].add_(0.01)
    assert _graphs.stats["captured"] == 4  # each layer's forward and backward


@pytest.mark.gpu
def test_row_counts_share_a_bucket():
    _graphs.reset()
    weights, lora = layer(4)
    for rows in (1160, 1200, 1160, 1250, 1280):  # one bucket (1280)
        x, dy = inputs(rows, seed=rows)
        with graphs(False):
            want = forward_backward(weights, lora, x, dy)
        with graphs(True):
            got = forward_backward(weights, lora, x, dy)
        assert_same(got, want, exact=False)
    assert _graphs.stats["captured"] == 2 and _graphs.stats["eager"] == 2


@pytest.mark.gpu
def test_a_larger_bucket_grows_the_staging_and_recaptures():
    _graphs.reset()
    weights, lora = layer(5)
    for rows in (1280, 1280, 2560, 2560, 2560, 1280, 1280, 1280):
        x, dy = inputs(rows, seed=rows)
        with graphs(False):
            want = forward_backward(weights, lora, x, dy)
        replayed = _graphs.stats["replayed"]
        with graphs(True):
            got = forward_backward(weights, lora, x, dy)
        # The same bits where a replayed call is chunked as an eager one (2560 rows: two chunks against one)
        assert_same(got, want, exact=rows <= gated_mlp_module.GRAPH_CHUNK_ROWS)
    # The 1280-row graphs, dropped when 2560 rows grew the row buffers, are captured again over the larger buffers
    assert _graphs.stats["replayed"] == replayed + 2
    assert all(buffer.shape[0] >= 2560 for key, buffer in _graphs._staging.items() if "rows" in key)


@pytest.mark.gpu
def test_least_recently_used_graphs_are_dropped(monkeypatch):
    _graphs.reset()
    monkeypatch.setattr(_graphs, "MAX_GRAPHS", 2)
    layers = [layer(seed) for seed in (6, 7)]
    x, dy = inputs(1280, seed=8)
    for _ in range(2):
        for weights, lora in layers:  # four keys (two layers, forward and backward) through two places
            with graphs(True):
                forward_backward(weights, lora, x, dy)
    assert len(_graphs._graphs) <= 2 and _graphs.stats["captured"] == 0


@pytest.mark.gpu
def test_inference_mode_calls_run_as_they_are():
    _graphs.reset()
    weights, lora = layer(9)
    x, _ = inputs(1280, seed=10)
    with graphs(True):
        with torch.inference_mode():
            for _ in range(2):
                gated_mlp(x, weights["w_gate"], weights["w_up"], *list(lora.values())[:4], 2.0, "silu",
                          weights["w_down"], *list(lora.values())[4:], 0.5)
        assert _graphs.stats == {"captured": 0, "replayed": 0, "eager": 0} and not _graphs._staging
        forward_backward(weights, lora, x, torch.ones_like(x))  # a later call outside it runs as usual


@pytest.mark.gpu
def test_a_failed_capture_is_undone_whole():
    """A body that breaks its capture (a host sync after a random draw and an allocation in the pool) raises its own
    error; the stream and the random generator are as before, the graphs' pool is a new one: draws, captures and
    their replays work."""
    _graphs.reset()
    pool, stream = _graphs.capture_pool(torch.device("cuda", torch.cuda.current_device()))
    before = torch.cuda.current_stream()
    stream.wait_stream(before)
    with pytest.raises(RuntimeError) as caught:
        with _graphs.capturing(torch.cuda.CUDAGraph(), pool, stream):
            noise = torch.rand(64, device="cuda") * 2
            noise.sum().item()  # not allowed while capturing
    assert "capturing" in str(caught.value) and "previous error" not in str(caught.value)
    assert torch.cuda.current_stream() == before and not torch.cuda.is_current_stream_capturing()
    torch.manual_seed(0)
    first = torch.rand(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.rand(8, device="cuda"), first)
    retired = pool
    pool, stream = _graphs.capture_pool(torch.device("cuda", torch.cuda.current_device()))
    assert pool != retired  # the host allocator still records into the old one
    x = torch.arange(8.0, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with _graphs.capturing(graph, pool, stream):
        y = x * 3 + torch.rand(8, device="cuda") * 0
    x.add_(1)
    graph.replay()
    torch.testing.assert_close(y, (torch.arange(8.0, device="cuda") + 1) * 3)


@pytest.mark.gpu
def test_an_op_whose_capture_fails_runs_as_it_is_and_says_why(monkeypatch):
    """The gated-MLP op's body broken for captures only: one warning naming the error, the op's values unchanged,
    no later capture of it, and random draws on the device still work."""
    _graphs.reset()
    weights, lora = layer(9)
    x, dy = inputs(1280, seed=9)
    with graphs(False):
        want = forward_backward(weights, lora, x, dy)
    capture = _graphs._capture

    def breaking(entry, rows, others, call, *args):
        def body(rows, others):
            if torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()
            return call(rows, others)
        return capture(entry, rows, others, body, *args)

    monkeypatch.setattr(_graphs, "_capture", breaking)
    with graphs(True), pytest.warns(UserWarning, match="capture failed.*capturing"):
        runs = [forward_backward(weights, lora, x, dy) for _ in range(3)]
    for got in runs:
        assert_same(got, want, exact=True)
    assert _graphs.stats["captured"] == 0 and _graphs.failed
    torch.rand(4, device="cuda")
