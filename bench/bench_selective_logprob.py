"""Benchmark fastgrpo::selective_logprob (lm-head + log-softmax + gather), forward + backward.

Compared, on N rows (default 8 x 4096 = 32768) at the Qwen2.5-1.5B (1536, 151936) and
Llama-3.1-8B (4096, 128256) lm-head shapes, bf16, frozen weight (d(hidden) only) and trainable:
  fastgrpo   this op (frozen weight: d logp / d hidden computed in forward, no logits recomputed)
  fastgrpo_recompute  this op with its recomputing backward forced (what a trainable weight or an
             entropy gradient gets)
  eager      full logits -> float -> log_softmax -> gather (what HF + a naive loss do)
  compiled   torch.compile (inductor) of eager
  trl        full bf16 logits + TRL's selective_log_softmax (imported if trl is installed,
             else a copy of its formula: per-sequence log_softmax loop for bf16)
  liger      liger_kernel.chunked_loss.fused_linear_ppo._ChunkedSelectiveLogProbFunction (0.8.5)
  chunked    torch: 1024-row chunks, fp32 logits, log_softmax, gather, each chunk checkpointed
Time: median of triton.testing.do_bench. Memory: peak during one fwd+bwd minus what was
allocated before it and minus the outputs (logp, d(hidden), d(weight)). The floor is the
matmuls the op must do (2*N*H*V FLOPs each: forward logits, backward recompute, d(hidden),
and d(weight) when trainable) at bench/_harness.py's MATMUL_TFLOPS (cuBLAS bf16 on 8192^3 on the H200; on these
lm-head shapes cuBLAS itself reaches less: `--sweep` prints it). eager/trl/compiled keep the logits
and do not recompute them, so they need one matmul fewer than the floor counts; so does this
op with a frozen weight (logits, then probabilities times W, both in forward).
Liger is compared when liger-kernel is importable (carry its wheel to the GPU machine).

    python bench/bench_selective_logprob.py            # GPU: the table
    python bench/bench_selective_logprob.py --sweep [--table]  # GPU: tile sizes of this op [and the table]
    python bench/bench_selective_logprob.py --dry-run  # CPU: every implementation at a tiny shape
Rows are appended to bench/results/bench_selective_logprob.jsonl (the sweep's to bench_selective_logprob_sweep.jsonl).
"""
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
import fastgrpo.kernels.selective_logprob as slp  # noqa: E402

PEAK_TFLOPS = harness.MATMUL_TFLOPS
SHAPES = [harness.head_shape(name) for name in ("qwen2.5-1.5b", "llama-3.1-8b")]  # (hidden, vocabulary)

try:
    from trl.trainer.utils import selective_log_softmax as trl_selective_log_softmax
except ImportError:  # copy of trl 1.16 trl/trainer/utils.py selective_log_softmax

    def trl_selective_log_softmax(logits, index):
        if logits.dtype in [torch.float32, torch.float64]:
            selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
            lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
            return selected - lse
        per_token_logps = []
        for row_logits, row_labels in zip(logits, index):
            row_logps = F.log_softmax(row_logits, dim=-1)
            per_token_logps.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
        return torch.stack(per_token_logps)

try:
    from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction
except ImportError:
    _ChunkedSelectiveLogProbFunction = None


def fastgrpo_impl(hidden, weight, targets, seqs):
    return slp.selective_logprob(hidden, weight, targets)


def fastgrpo_recompute_impl(hidden, weight, targets, seqs):
    with harness.patched((slp, "_grad_from_forward", lambda hidden, weight: False)):
        return slp.selective_logprob(hidden, weight, targets)


def eager_impl(hidden, weight, targets, seqs):
    logits = (hidden @ weight.t()).float()
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def trl_impl(hidden, weight, targets, seqs):
    logits = hidden @ weight.t()
    return trl_selective_log_softmax(logits.view(seqs, -1, logits.shape[-1]), targets.view(seqs, -1)).reshape(-1)


def liger_impl(hidden, weight, targets, seqs):
    return _ChunkedSelectiveLogProbFunction.apply(hidden, weight, targets, None, 1.0, 4096)


def _chunk_logp(h, weight, t):
    return (h @ weight.t()).float().log_softmax(-1).gather(-1, t[:, None])[:, 0]


def chunked_impl(hidden, weight, targets, seqs, rows=1024):
    return torch.cat([
        torch.utils.checkpoint.checkpoint(
            _chunk_logp, hidden[i:i + rows], weight, targets[i:i + rows], use_reentrant=False
        )
        for i in range(0, hidden.shape[0], rows)
    ])


def implementations(device):
    impls = {"fastgrpo": fastgrpo_impl, "fastgrpo_recompute": fastgrpo_recompute_impl, "eager": eager_impl,
             "trl": trl_impl, "chunked": chunked_impl}
    if device == "cuda":
        impls["compiled"] = torch.compile(eager_impl, dynamic=False)
    if _ChunkedSelectiveLogProbFunction is not None:
        impls["liger"] = liger_impl
    return impls


def make_inputs(n, h, v, dtype, device, weight_grad):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) * h ** -0.5).to(dtype).requires_grad_(weight_grad)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    return hidden, weight, targets


def step(impl, hidden, weight, targets, seqs, grad):
    logp = impl(hidden, weight, targets, seqs)
    wrt = [hidden, weight] if weight.requires_grad else [hidden]
    return logp, torch.autograd.grad(logp, wrt, grad)


def extra_peak_bytes(impl, hidden, weight, targets, seqs, grad):
    (logp, grads), peak = harness.peak_above(lambda: step(impl, hidden, weight, targets, seqs, grad))
    return peak - logp.numel() * logp.element_size() - sum(g.numel() * g.element_size() for g in grads)


def forward_extra_bytes(hidden, weight, targets):
    logp, peak = harness.peak_above(lambda: slp.selective_logprob(hidden, weight, targets))
    return peak - logp.numel() * logp.element_size()


def bench_ms(fn):
    # 0.5 s of repetitions: several samples of a 100 ms step (120 ms gave one, which a slow first run decided)
    return harness.kernel_ms(fn, warmup=100, rep=500, quantiles=[0.5, 0.2, 0.8])


def run_table(n, seqs, dtype, device, names):
    rows = []
    impls = implementations(device)
    for h, v in SHAPES:
        for weight_grad in (False, True):
            hidden, weight, targets = make_inputs(n, h, v, dtype, device, weight_grad)
            grad = torch.randn(n, device=device)
            floor_ms = (4 if weight_grad else 3) * 2 * n * h * v / (PEAK_TFLOPS * 1e12) * 1e3
            for name, impl in impls.items():
                if names and name not in names:
                    continue
                if (name == "compiled" or name == "fastgrpo_recompute") and weight_grad:
                    continue  # one compile per shape keeps the run short; a trainable weight always recomputes
                try:
                    step(impl, hidden, weight, targets, seqs, grad)  # warm-up / compile
                    extra = extra_peak_bytes(impl, hidden, weight, targets, seqs, grad)
                    fwd = bench_ms(lambda: impl(hidden.detach(), weight.detach(), targets, seqs))
                    med, lo, hi = bench_ms(lambda: step(impl, hidden, weight, targets, seqs, grad))
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    rows.append(dict(H=h, V=v, weight_grad=weight_grad, impl=name, oom=True))
                    print(f"H={h} V={v} dW={weight_grad} {name}: OOM", flush=True)
                    continue
                row = dict(H=h, V=v, weight_grad=weight_grad, impl=name, fwd_ms=fwd[0], ms=med, ms_p20=lo,
                           ms_p80=hi, extra_mib=extra / 2**20, floor_ms=floor_ms,
                           tflops=(floor_ms / med) * PEAK_TFLOPS, x_floor=med / floor_ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del hidden, weight, targets
            torch.cuda.empty_cache()
    return rows


def print_table(rows):
    ours = {(r["H"], r["weight_grad"]): r["ms"] for r in rows if r["impl"] == "fastgrpo" and "ms" in r}
    cells = []
    for r in rows:
        if r.get("oom"):
            cells.append((r["H"], r["V"], r["weight_grad"], r["impl"], "OOM", "", "", "", "", ""))
            continue
        ratio = r["ms"] / ours[(r["H"], r["weight_grad"])] if (r["H"], r["weight_grad"]) in ours else float("nan")
        cells.append((r["H"], r["V"], r["weight_grad"], r["impl"], f"{r['fwd_ms']:.2f}", f"{r['ms']:.2f}",
                      f"{r['x_floor']:.3f}", f"{r['tflops']:.0f}", f"{r['extra_mib']:.1f}", f"{ratio:.2f}x"))
    print("\n" + harness.markdown_table(("H", "V", "dW", "impl", "fwd ms", "fwd+bwd ms", "x floor", "TFLOP/s",
                                         "extra MiB", "vs fastgrpo"), cells))


def sweep(n, dtype):
    """Time this op's forward and fwd+bwd under several tile configs (frozen weight): the forward
    configurations without and with the gradient computed in forward (no-grad forward alone, and
    forward + the backward that scales the gradient), the recomputing backward's configurations."""
    # (rows, vocab, block_rows, num_warps). The printed extra memory says which fit in 64 MiB.
    # Forward: the [R, H] GEMM of the gradient computed in forward fills whole waves of 128 x 128 tiles on 132
    # SMs at R = 1408 (x 1536 / 128 = 132 tiles) or 2816; 32 MiB of logits at most but for the reference one.
    fwd_configs = [
        slp.TileConfig(1024, 8192, 1, 8),
        slp.TileConfig(2048, 4096, 1, 8),
        slp.TileConfig(4096, 2048, 1, 8),
        slp.TileConfig(1408, 4096, 1, 8),
        slp.TileConfig(2816, 2048, 1, 8),
        slp.TileConfig(512, 16384, 1, 16),
        slp.TileConfig(2048, 8192, 1, 8),  # 64 MiB of logits alone: for reference
    ]
    bwd_configs = [
        slp.TileConfig(1024, 8192, 1, 8),
        slp.TileConfig(512, 16384, 1, 16),
        slp.TileConfig(1024, 4096, 1, 8),
        slp.TileConfig(2048, 4096, 1, 8),
    ]
    results = []
    for h, v in SHAPES:
        hidden, weight, targets = make_inputs(n, h, v, dtype, "cuda", False)
        grad = torch.randn(n, device="cuda")
        mm_flops = 2 * n * h * v
        out = torch.empty(n, v, device="cuda", dtype=dtype)
        mm_ms = bench_ms(lambda: torch.mm(hidden.detach(), weight.t(), out=out))[0]
        del out
        print(f"H={h} V={v}: cuBLAS logits mm {mm_ms:.2f} ms = {mm_flops / mm_ms / 1e9:.0f} TFLOP/s", flush=True)
        results.append(dict(H=h, kind="cublas", mm_ms=mm_ms))
        for cfg in fwd_configs:
            with harness.patched((slp, "CUDA_FORWARD", cfg), (slp, "CUDA_FORWARD_NARROW", cfg)):
                try:
                    ms = bench_ms(lambda: slp.selective_logprob(hidden.detach(), weight, targets))[0]
                    with_grad = bench_ms(lambda: step(fastgrpo_impl, hidden, weight, targets, 8, grad))[0]
                except Exception as e:  # a config the compiler or the GPU cannot run
                    print(f"  fwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                extra = forward_extra_bytes(hidden.detach(), weight, targets) / 2**20
                extra_grad = extra_peak_bytes(fastgrpo_impl, hidden, weight, targets, 8, grad) / 2**20
            results.append(dict(H=h, kind="fwd", cfg=dataclasses.astuple(cfg), ms=ms, extra_mib=extra,
                                tflops=mm_flops / ms / 1e9))
            results.append(dict(H=h, kind="fwd_grad", cfg=dataclasses.astuple(cfg), ms=with_grad,
                                extra_mib=extra_grad, tflops=2 * mm_flops / with_grad / 1e9))
            print(f"  fwd {dataclasses.astuple(cfg)}: {ms:.2f} ms = {mm_flops / ms / 1e9:.0f} TFLOP/s, "
                  f"extra {extra:.1f} MiB; with the gradient, fwd+bwd {with_grad:.2f} ms = "
                  f"{2 * mm_flops / with_grad / 1e9:.0f} TFLOP/s, {with_grad / (3 * mm_flops / PEAK_TFLOPS / 1e9):.3f}"
                  f" x floor, extra {extra_grad:.1f} MiB", flush=True)
        fwd_ms = bench_ms(lambda: slp.selective_logprob(hidden.detach(), weight, targets))[0]
        for cfg in bwd_configs:
            with harness.patched((slp, "CUDA_BACKWARD", cfg), (slp, "CUDA_BACKWARD_NARROW", cfg)):
                try:
                    ms = bench_ms(lambda: step(fastgrpo_recompute_impl, hidden, weight, targets, 8, grad))[0]
                    extra = extra_peak_bytes(fastgrpo_recompute_impl, hidden, weight, targets, 8, grad) / 2**20
                except Exception as e:
                    print(f"  bwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
            bwd = ms - fwd_ms
            results.append(dict(H=h, kind="bwd", cfg=dataclasses.astuple(cfg), ms=bwd, extra_mib=extra,
                                tflops=2 * mm_flops / bwd / 1e9))
            print(f"  bwd {dataclasses.astuple(cfg)}: {bwd:.2f} ms = {2 * mm_flops / bwd / 1e9:.0f} TFLOP/s, "
                  f"extra {extra:.1f} MiB", flush=True)
        del hidden, weight, targets
        torch.cuda.empty_cache()
    return results


def dry_run():
    """CPU, tiny shape: every implementation runs and agrees with this op."""
    n, h, v, seqs = 64, 32, 500, 4
    for weight_grad in (False, True):
        hidden, weight, targets = make_inputs(n, h, v, torch.float32, "cpu", weight_grad)
        grad = torch.randn(n)
        ref_logp, ref_grads = step(fastgrpo_impl, hidden, weight, targets, seqs, grad)
        for name, impl in implementations("cpu").items():
            logp, grads = step(impl, hidden, weight, targets, seqs, grad)
            torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            print(f"dry-run dW={weight_grad} {name}: ok")


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=8 * 4096)
    parser.add_argument("--seqs", type=int, default=8, help="TRL loops over this many sequences")
    parser.add_argument("--impls", nargs="*", default=None)
    parser.add_argument("--sweep", action="store_true", help="time tile sizes of this op")
    parser.add_argument("--table", action="store_true", help="with --sweep: the table too (module's configs)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (use --dry-run on CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    liger = _ChunkedSelectiveLogProbFunction is not None
    print(harness.hardware(), "torch", torch.__version__, "liger", liger)
    if args.sweep:
        rows = [dict(rows=args.rows, **r) for r in sweep(args.rows, torch.bfloat16)]
        print(f"rows appended to {harness.record('bench_selective_logprob_sweep', rows)}")
    if not args.sweep or args.table:
        table = run_table(args.rows, args.seqs, torch.bfloat16, "cuda", args.impls)
        print_table(table)
        rows = [dict(rows=args.rows, seqs=args.seqs, **r) for r in table]
        print(f"rows appended to {harness.record('bench_selective_logprob', rows)}")


if __name__ == "__main__":
    main()
