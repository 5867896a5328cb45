"""SDPA's kernels on the GRPO step's attention: flash (SDPA's first choice) against cuDNN's fused attention
(what fastgrpo's attention pattern prefers on sm90+) and the memory-efficient kernel, forward and forward +
backward, bf16, causal. Qwen2.5-1.5B heads (12 query / 2 key-value, D 128) and Llama-8B heads (32 / 8), batch 8,
sequence 1280 and 4352 (prompt 256 + completions 1024 / 4096); grouped-query attention as HF passes it
(`enable_gqa=True`) and with key/value repeated (HF's path when a mask is passed). Each kernel's output and
gradients are compared, on the first two rows of the batch, with float32 math attention (max abs error,
relative to the reference's largest value). Rows are appended to bench/results/bench_attention.jsonl.

    python bench/bench_attention.py            # CUDA
    python bench/bench_attention.py --batch 1 --seq 64 --shapes qwen2.5-1.5b   # CPU smoke run (kernels refused)
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")  # bench/_harness.py's names: (query heads, key-value heads, head dim)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, gqa):
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                          is_causal=True)


def forward_backward(q, k, v, grad, gqa):
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v, gqa)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in (q, k, v)]


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[1280, 4352])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        choices=sorted(harness.SHAPES), metavar="SHAPE")
    args = parser.parse_args(argv)
    device = harness.device()
    print(f"{harness.hardware()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(harness.md_header("shape", "seq", "gqa", "kernel", "fwd ms", "fwd+bwd ms", "vs flash (fwd+bwd)",
                            "max error (out, dq, dk, dv)"))
    rows = []
    for shape in args.shapes:
        heads, kv_heads, dim = harness.attention_shape(shape)
        for seq in args.seq:
            torch.manual_seed(0)
            make = lambda h: torch.randn(args.batch, h, seq, dim, device=device, dtype=torch.bfloat16)  # noqa: E731
            q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
            grad = make(heads)
            with sdpa_kernel([SDPBackend.MATH]):  # the first two rows: math attention keeps [rows, H, S, S]
                ref = forward_backward(*(t[:2].detach().float().requires_grad_() for t in (q, k, v)), grad[:2].float(),
                                       True)
            for gqa in (True, False):
                flash_ms = None
                for name, backend in BACKENDS.items():
                    with sdpa_kernel([backend]):
                        try:
                            got = forward_backward(q, k, v, grad, gqa)
                        except RuntimeError as error:
                            refused = str(error).splitlines()[0][:80]
                            print(harness.md_row(shape, seq, gqa, name, f"refused: {refused}"), flush=True)
                            rows.append(dict(shape=shape, batch=args.batch, seq=seq, gqa=gqa, kernel=name,
                                             error=refused))
                            continue
                        errors = [((a[:2].float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]
                        fwd = harness.kernel_ms(lambda: attention(q, k, v, gqa), warmup=50, rep=300)
                        both = harness.kernel_ms(lambda: forward_backward(q, k, v, grad, gqa), warmup=50, rep=300)
                    flash_ms = flash_ms or both
                    print(harness.md_row(shape, seq, gqa, name, f"{fwd:.3f}", f"{both:.3f}", f"{flash_ms / both:.2f}x",
                                         ", ".join(f"{e:.1e}" for e in errors)), flush=True)
                    rows.append(dict(shape=shape, batch=args.batch, seq=seq, gqa=gqa, kernel=name, fwd_ms=fwd,
                                     fwd_bwd_ms=both, max_rel_errors=errors))
    if device.type == "cuda":
        print(f"rows appended to {harness.record('bench_attention', rows)}")


if __name__ == "__main__":
    main()
