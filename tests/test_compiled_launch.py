"""In a training graph inductor compiles, the RMSNorm and RoPE ops (torch.library.triton_op) become launches of
their Triton kernels that inductor makes itself: none of the ops' Python runs per call, and no input is copied for
them. The results are those of the ops called eagerly, bit for bit, forward and backward (dW included), and one
graph serves every sequence length. The block is bench/bench_op_host.py's. On CPU: the ops' bodies, traced with the
GPU's launch configuration and a symbolic sequence length, keep it a symbol (a launch configuration that depended
on it would pin every compiled graph to one length)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from bench.bench_op_host import HEAD_DIM, HEADS_K, HIDDEN, block

KERNELS = ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_dw_reduce_kernel", "_rope_kernel")
OP_MODULES = ("fastgrpo/kernels/rms_norm.py", "fastgrpo/kernels/rope.py", "fastgrpo/kernels/_dispatch.py")


def _inputs(seq, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    angles = torch.rand(2, 1, seq, HEAD_DIM // 2, device="cuda", generator=gen) * 6.3
    inputs = (randn(2, seq, HIDDEN), randn(2, seq, HIDDEN), randn(HIDDEN), randn(2, seq, HIDDEN),
              randn(2, seq, HEADS_K * HEAD_DIM), angles.cos().bfloat16(), angles.sin().bfloat16())
    for t in inputs[:5]:
        t.requires_grad_()
    return inputs


def _forward_backward(fn, inputs):
    outs = fn(*inputs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.empty_like(o).normal_(generator=gen) for o in outs]
    return outs, torch.autograd.grad(outs, inputs[:5], grads)


def _mark_dynamic(inputs):
    """The sequence dim of every input that has one ([B, S, ...], and cos/sin [B, 1, S, D / 2])."""
    for t in inputs:
        if t.dim() > 1:
            torch._dynamo.mark_dynamic(t, 2 if t.dim() == 4 else 1)


def _frames_in_ops(fn, *args):
    """Calls of Python functions of the ops' modules while fn runs."""
    entered = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(OP_MODULES):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return entered


@pytest.mark.gpu
def test_inductor_launches_the_kernels_itself_with_the_eager_results():
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor")
    for seq in (37, 64):
        inputs = _inputs(seq, seed=seq)
        expected = _forward_backward(block, inputs)
        _mark_dynamic(inputs)
        if seq == 37:
            got, codes = run_and_get_code(_forward_backward, compiled, inputs)
            code = "\n".join(codes)
            for kernel in KERNELS:
                assert kernel in code, f"{kernel} not launched by the compiled graph"
            lines = code.splitlines()
            unwanted = [f"{i}: {line}" for i, line in enumerate(lines) if "torch.ops.fastgrpo" in line or "clone" in line]
            assert not unwanted, "\n".join(unwanted[:20])
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = _forward_backward(compiled, inputs)
        for a, b in zip([*got[0], *got[1]], [*expected[0], *expected[1]]):
            assert torch.equal(a, b)
    # Once compiled, a call runs none of the ops' Python (the wrappers rms_norm / rope are traced away too).
    assert _frames_in_ops(_forward_backward, compiled, inputs) == []


# Run without Triton's interpreter (which the CPU tests set), so that wrap_triton records the launches as it does on a
# GPU rather than running the kernels on the tracer's tensors.
_TRACE_WITH_SYMBOLIC_LENGTH = """
import sympy, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from fastgrpo.kernels import _dispatch

_dispatch.launches_triton = lambda t: True  # the bodies' GPU path, on the tracer's CPU tensors
env = ShapeEnv()
mode = FakeTensorMode(shape_env=env)

def traced(shape, seq_dim=None):
    dims = [DimDynamic.DYNAMIC if i == seq_dim else DimDynamic.STATIC for i in range(len(shape))]
    return mode.from_tensor(torch.empty(shape, dtype=torch.bfloat16),
                            symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

x, residual, q_rows, k_rows = (traced((2, 37, w), 1) for w in (1536, 1536, 1536, 256))
cos, sin, w = traced((2, 1, 37, 64), 2), traced((2, 1, 37, 64), 2), traced((1536,))
ops = torch.ops.fastgrpo
with _dispatch.cuda_launch_configs(), mode:
    s, normed = ops.add_rms_norm(x, residual, w, 1e-6, 0.0, False, torch.bfloat16)
    y = ops.rms_norm(normed, w, 1e-6, 0.0, False, torch.bfloat16)
    dx, dw = ops.rms_norm_backward(y, s, s, w, 1e-6, 0.0, False, True, True)
    q = q_rows.view(2, q_rows.shape[1], 12, 128).transpose(1, 2)
    k = k_rows.view(2, k_rows.shape[1], 2, 128).transpose(1, 2)
    q_out, k_out = ops.rope(q, k, cos, sin, 128, False)
    dq, dk = ops.rope_backward(q_out, k_out, cos, sin, 128, False, torch.bfloat16, torch.bfloat16)
inputs = ((x, 1), (residual, 1), (q_rows, 1), (k_rows, 1), (cos, 2), (sin, 2))
lengths = {t.shape[d].node.expr for t, d in inputs}
lengths |= {env.replacements.get(n, n) for n in lengths}
assert all(isinstance(n, sympy.Symbol) for n in lengths), ("a sequence length was specialised", lengths, env.guards)
# Guards may only say that two lengths are the same one; any other (a bound, a parity) splits the graphs by length.
bounds = [g.expr for g in env.guards if g.expr.free_symbols & lengths
          and not (isinstance(g.expr, sympy.Eq) and all(isinstance(a, sympy.Symbol) for a in g.expr.args))]
assert not bounds, ("guards on a sequence length", bounds)
assert all(isinstance(t.shape[d], torch.SymInt) for t, d in ((dx, 1), (q_out, 2), (dq, 2))), (dx.shape, dq.shape)
print("symbolic", lengths)
"""


def test_traced_bodies_keep_the_sequence_length_symbolic():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_TRACE_WITH_SYMBOLIC_LENGTH)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "symbolic" in result.stdout, result.stdout + result.stderr[-3000:]
