"""Host time of one call of the RMSNorm and RoPE ops (GPU, tiny tensors, so the host sets the pace), beside an aten op
and a bare Triton launch. A GRPO step at short completions makes ~250 such calls and is bound by its host.

    python bench/bench_op_host.py            # eager calls, then a compiled training block (fwd+bwd) calling all three
    python bench/bench_op_host.py --dry-run  # CPU: the harness on the torch path, times meaningless
Rows are appended to bench/results/bench_op_host.jsonl (CUDA runs).
"""
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.kernels.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from fastgrpo.kernels.rope import rope  # noqa: E402

HEADS_Q, HEADS_K, HEAD_DIM = 12, 2, 128
HIDDEN = HEADS_Q * HEAD_DIM


@triton.jit
def _copy_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def block(x, residual, w, q_rows, k_rows, cos, sin):
    """A decoder layer's uses of the ops (tests/test_compiled_launch.py compiles it too): the residual add + norm,
    RoPE on HF's transposed q/k views (half-width cos/sin, as the rope pass passes them), and a plain norm with a
    weight whose gradient is wanted. q and k leave as rows again, as attention's output does: their gradients then
    arrive laid out like the rotated q/k, whose memory is [B, S, H, D] like the inputs' (a compiled graph's
    incoming gradients are contiguous)."""
    s, normed = add_rms_norm(x, residual, w)
    batch, seq = q_rows.shape[:2]
    q = q_rows.view(batch, seq, HEADS_Q, HEAD_DIM).transpose(1, 2)
    k = k_rows.view(batch, seq, HEADS_K, HEAD_DIM).transpose(1, 2)
    q_out, k_out = rope(q, k, cos, sin, HEAD_DIM)
    q_out, k_out = (t.transpose(1, 2).reshape(rows.shape) for t, rows in ((q_out, q_rows), (k_out, k_rows)))
    return s, rms_norm(normed, w), q_out, k_out


def host_us(fn, calls):
    """Host microseconds a call, the queue never waited on (the kernels are tiny)."""
    for _ in range(20):
        fn()
    harness.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    harness.synchronize()
    return us


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="CPU, torch path: checks the harness only")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    calls = 20 if device == "cpu" else args.calls

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    seq = 8
    x, residual, w = randn(1, seq, HIDDEN), randn(1, seq, HIDDEN), randn(HIDDEN)
    q_rows, k_rows = randn(1, seq, HIDDEN), randn(1, seq, HEADS_K * HEAD_DIM)
    cos, sin = randn(1, 1, seq, HEAD_DIM // 2), randn(1, 1, seq, HEAD_DIM // 2)
    q = q_rows.view(1, seq, HEADS_Q, HEAD_DIM).transpose(1, 2)
    k = k_rows.view(1, seq, HEADS_K, HEAD_DIM).transpose(1, 2)
    buf = torch.zeros(64, device=device)
    cases = {"aten add": lambda: x + residual,
             "rms_norm": lambda: rms_norm(x, w),
             "add_rms_norm": lambda: add_rms_norm(x, residual, w),
             "rope": lambda: rope(q, k, cos, sin, HEAD_DIM)}
    if device == "cuda":
        cases["bare Triton launch"] = lambda: _copy_kernel[(1,)](buf, 64, BLOCK=64)
    print(f"host us a call, {device}, {calls} calls")
    rows = []

    def report(name, us, n_calls):
        print(harness.md_row(name, f"{us:.1f}"), flush=True)
        rows.append(dict(case=name, host_us=us, calls=n_calls, device=device))

    with torch.no_grad():
        for name, fn in cases.items():
            report(name, host_us(fn, calls), calls)

    inputs = (x, residual, w, q_rows, k_rows, cos, sin)
    for t in inputs[:5]:
        t.requires_grad_()

    def forward_backward(fn):
        outs = fn(*inputs)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    compiled = torch.compile(block, backend="inductor" if device == "cuda" else "aot_eager")
    training_calls = max(1, calls // 5)
    report("block fwd+bwd, eager ops", host_us(lambda: forward_backward(block), training_calls), training_calls)
    report("block fwd+bwd, compiled", host_us(lambda: forward_backward(compiled), training_calls), training_calls)
    if device == "cuda":
        print(f"rows appended to {harness.record('bench_op_host', rows)}")


if __name__ == "__main__":
    main()
