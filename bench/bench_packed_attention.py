"""Attention over packed rows (one sequence of several causal segments), forward + backward, bf16, on the
GRPO step's spread batch: what the packed trainer runs (flex_attention with the packed BlockMask) against
torch's variable-length kernels that take the segments as cumulative lengths (flash, cuDNN). Qwen2.5-1.5B
heads (12 query / 2 key-value, D 128); segments of the spread batch (prompt 256 + completions 10-100 % of
4096, seed 0, as bench/grpo_step.py --spread). q, k, v are transposed views of [1, T, heads, D], as the
model's projections make them. Each kernel's output and gradients are compared, on the first two segments,
with float32 math attention of each segment alone (max abs error relative to the reference's largest value).
Rows are appended to bench/results/bench_packed_attention.jsonl.

    python bench/bench_packed_attention.py            # CUDA
    python bench/bench_packed_attention.py --prompt 8 --completion 32   # CPU smoke run (CUDA kernels refused)
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from grpo_step import spread_lengths  # noqa: E402


def flex_runner(lengths, heads, kv_heads, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    total = segment.numel()

    def document_causal(batch, head, q, kv):
        return (segment[q] == segment[kv]) & (kv <= q)

    mask = create_block_mask(document_causal, 1, None, total, total, device=device)
    compiled = torch.compile(flex_attention)

    def run(q, k, v):  # [1, H, T, D]
        return compiled(q, k, v, block_mask=mask, enable_gqa=heads != kv_heads)

    return run


def cumulative(lengths, device):
    return torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def flash_varlen_runner(lengths, heads, kv_heads, device):
    cu, longest = cumulative(lengths, device), max(lengths)

    def run(q, k, v):  # [1, H, T, D] views -> [T, H, D]
        out = torch.ops.aten._flash_attention_forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                      cu, cu, longest, longest, 0.0, True, False)[0]
        return out.transpose(0, 1).unsqueeze(0)

    return run


def cudnn_varlen_runner(lengths, heads, kv_heads, device):
    cu, longest = cumulative(lengths, device), max(lengths)
    repeat = heads // kv_heads

    def run(q, k, v):
        if repeat > 1 and cudnn_varlen_runner.expand:
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = torch.ops.aten._cudnn_attention_forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                      None, cu, cu, longest, longest, True, 0.0, True, False)[0]
        return out.transpose(0, 1).unsqueeze(0)

    return run


cudnn_varlen_runner.expand = False


def padded_cudnn_runner(lengths, heads, kv_heads, device):
    """The padded batch the trainer runs when it does not pack: [B, H, longest, D], cuDNN via SDPA."""
    longest = max(lengths)

    def run(q, k, v):
        pieces = []
        for tensor in (q, k, v):
            rows = tensor[0].split(lengths, dim=1)
            pieces.append(torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[1])) for r in rows]))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*pieces, is_causal=True, enable_gqa=heads != kv_heads)
        return torch.cat([o[:, :n] for o, n in zip(out, lengths)], dim=1).unsqueeze(0)

    return run


RUNNERS = {"flex (packed BlockMask)": flex_runner, "flash varlen": flash_varlen_runner,
           "cudnn varlen": cudnn_varlen_runner, "cudnn padded (copies included)": padded_cudnn_runner}


def forward_backward(run, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = run(q, k, v)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in (q, k, v)]


def reference(q, k, v, grad, lengths, heads, kv_heads, segments=2):
    """float32 math attention of the first `segments` segments, each alone: out, dq, dk, dv rows."""
    results, start = [], 0
    for n in lengths[:segments]:
        pieces = [t[:, :, start:start + n].detach().float().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(*pieces, is_causal=True, enable_gqa=heads != kv_heads)
        out.backward(grad[:, :, start:start + n].float())
        results.append([out.detach()] + [p.grad for p in pieces])
        start += n
    return [torch.cat(parts, dim=2) for parts in zip(*results)], start


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b"],
                        choices=sorted(harness.SHAPES), metavar="SHAPE")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=4096)
    args = parser.parse_args(argv)
    device = harness.device()
    print(f"{harness.hardware()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    lengths = [args.prompt + n for n in spread_lengths(args.completion)]
    print(f"segments {lengths}, {sum(lengths)} tokens")
    print(harness.md_header("shape", "kernel", "fwd ms", "fwd+bwd ms", "vs flex (fwd+bwd)",
                            "max error (out, dq, dk, dv)"))
    rows = []

    def refused(shape, name, text):
        print(harness.md_row(shape, name, text), flush=True)
        rows.append(dict(shape=shape, prompt=args.prompt, completion=args.completion, kernel=name, error=text))

    for shape in args.shapes:
        heads, kv_heads, dim = harness.attention_shape(shape)
        torch.manual_seed(0)
        total = sum(lengths)

        def make(h):
            return torch.randn(1, total, h, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)

        q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad = make(heads)
        ref, upto = reference(q, k, v, grad, lengths, heads, kv_heads)
        flex_ms = None
        for name, build in RUNNERS.items():
            try:
                run = build(lengths, heads, kv_heads, q.device)
                got = forward_backward(run, q, k, v, grad)
            except Exception as error:  # a kernel this torch or GPU refuses: say so, time the others
                if name == "cudnn varlen" and not cudnn_varlen_runner.expand and heads != kv_heads:
                    refused(shape, name, f"refused with grouped heads: {str(error).splitlines()[0][:90]}")
                    cudnn_varlen_runner.expand = True
                    name, run = name + " (k, v repeated)", build(lengths, heads, kv_heads, q.device)
                    try:
                        got = forward_backward(run, q, k, v, grad)
                    except Exception as again:
                        refused(shape, name, f"refused: {str(again).splitlines()[0][:90]}")
                        continue
                else:
                    refused(shape, name, f"refused: {type(error).__name__}: {str(error).splitlines()[0][:90]}")
                    continue
            errors = [((a[:, :, :upto].float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]
            fwd = harness.kernel_ms(lambda: run(q, k, v), warmup=25, rep=200)
            both = harness.kernel_ms(lambda: forward_backward(run, q, k, v, grad), warmup=25, rep=200)
            flex_ms = flex_ms or both
            print(harness.md_row(shape, name, f"{fwd:.3f}", f"{both:.3f}", f"{flex_ms / both:.2f}x",
                                 ", ".join(f"{e:.1e}" for e in errors)), flush=True)
            rows.append(dict(shape=shape, prompt=args.prompt, completion=args.completion, kernel=name, fwd_ms=fwd,
                             fwd_bwd_ms=both, max_rel_errors=errors))
    if device.type == "cuda":
        print(f"rows appended to {harness.record('bench_packed_attention', rows)}")


if __name__ == "__main__":
    main()
