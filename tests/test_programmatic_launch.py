"""Kernels launched as programmatic dependents (sm_90+: `_dispatch.programmatic_launch`) give bit for bit the
results of the usual launches, each kernel reading what the kernel before it wrote.

The chain below makes every launch read its predecessor's output: the RMSNorm backward takes the forward's
output as its incoming gradient, the dW reduction the backward's partials, RoPE rotates the backward's dx,
and a second forward normalises RoPE's output with the reduced dW as its weight. A kernel that started
reading before its predecessor finished would see stale or uninitialised memory. Run eagerly and replayed
from a CUDA graph (where launches follow each other most closely) on fresh inputs.
"""
import pytest
import torch

from fastgrpo.kernels import _dispatch
from fastgrpo.kernels.rope import rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="programmatic dependent launch needs a CUDA device of compute capability 9.0+"),
]

ROWS, HIDDEN, HEAD_DIM = 4096, 576, 64
EPS = 1e-6


def _chain(x, residual, w, cos, sin):
    ops = torch.ops.fastgrpo
    y = ops.rms_norm(x, w, EPS, 0.0, False, torch.bfloat16)
    dx, dw = ops.rms_norm_backward(y, None, x, w, EPS, 0.0, False, True, True)
    heads = dx.view(1, ROWS, HIDDEN // HEAD_DIM, HEAD_DIM)
    q, k = rope(heads.transpose(1, 2), heads[:, :, :3].transpose(1, 2), cos, sin)
    s, normed = ops.add_rms_norm(q.transpose(1, 2).reshape(ROWS, HIDDEN), residual, dw, EPS, 0.0, False,
                                 torch.bfloat16)
    return y, dx, dw, q, k, s, normed


def _inputs(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.rand(HIDDEN, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    angles = torch.rand(1, 1, ROWS, HEAD_DIM // 2, device="cuda", generator=gen) * 6.3
    cos, sin = (torch.cat((f, f), -1).to(torch.bfloat16) for f in (angles.cos(), angles.sin()))
    return x, residual, w, cos, sin


def _serial(monkeypatch, inputs):
    with monkeypatch.context() as patch:
        patch.setattr(_dispatch, "_PROGRAMMATIC_LAUNCH", False)
        return _chain(*inputs)


def _assert_equal(got, expected):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"output {i} of the chain differs from the serial launches'"


def test_dependent_launches_match_serial_ones(monkeypatch):
    monkeypatch.setattr(_dispatch, "_PROGRAMMATIC_LAUNCH", True)
    assert _dispatch.programmatic_launch(torch.empty(0, device="cuda"))
    inputs = _inputs(0)
    _assert_equal(_chain(*inputs), _serial(monkeypatch, inputs))


def test_dependent_launches_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(_dispatch, "_PROGRAMMATIC_LAUNCH", True)
    static = _inputs(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(*static)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _chain(*static)
    for seed in (1, 2):
        fresh = _inputs(seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        _assert_equal(outputs, _serial(monkeypatch, fresh))
