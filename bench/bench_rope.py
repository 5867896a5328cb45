"""Benchmark fastgrpo::rope against eager HF RoPE, inductor and Liger (bf16, GPU).

    python bench/bench_rope.py            # H200: Qwen2.5-1.5B and Llama-3.1-8B head shapes, 32k tokens
    python bench/bench_rope.py --dry-run  # CPU: tiny shapes, checks the harness and the maths

q and k are made the way HF makes them: [B, S, H, D] projections transposed to [B, H, S, D]
(non-contiguous); cos/sin [B, 1, S, D] in bf16. Bytes counted once each: q and k read and
written, cos and sin read (their first halves only for Liger, which assumes the halves repeat, and
for `fastgrpo_half`: the op given cos/sin at half width, as the rope pass passes them where the
graph proves the halves repeat). Liger rotates in place and takes cos/sin before the unsqueeze.
The table's rows are appended to bench/results/bench_rope.jsonl.
"""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.kernels.rope import rope  # noqa: E402

# name: (q heads, kv heads, head dim)
SHAPES = {name: harness.attention_shape(name) for name in ("qwen2.5-1.5b", "llama-3.1-8b")}
TOKENS = 32768
BATCH = 8  # 8 completions of 4096 tokens, GRPO-like
COPY_BANDWIDTH = harness.COPY_TBPS * 1e12


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def fastgrpo_half(q, k, cos, sin):
    """The op reading the first halves of cos and sin (the rope pass's form where they repeat)."""
    half = cos.shape[-1] // 2
    return rope(q, k, cos[..., :half], sin[..., :half], cos.shape[-1])


# Providers that read only the first halves of cos and sin.
READS_HALF_COS = ("fastgrpo_half", "liger")


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb after its unsqueeze."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def liger_rope_fn():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None
    # Liger takes cos/sin [B, S, D] and rotates q/k in place (values drift; timing does not).
    return lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos.squeeze(1), sin.squeeze(1))


def make_inputs(n_q, n_kv, head_dim, batch, seq, device, dtype):
    q = torch.randn(batch, seq, n_q, head_dim, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, n_kv, head_dim, device=device, dtype=dtype).transpose(1, 2)
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(dtype)[None, None].expand(batch, 1, seq, head_dim).contiguous()
    sin = emb.sin().to(dtype)[None, None].expand(batch, 1, seq, head_dim).contiguous()
    return q, k, cos, sin


def bench(fn, q, k, cos, sin, mode, device):
    """Median ms (p20, p80) and peak extra bytes for one mode: fwd, bwd or full."""
    q = q.detach().requires_grad_(mode != "fwd")
    k = k.detach().requires_grad_(mode != "fwd")
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(q, k, cos, sin)
    elif mode == "bwd":
        outs = fn(q, k, cos, sin)
        grads = [torch.randn_like(o) for o in outs]

        def step():
            return torch.autograd.grad(outs, (q, k), grads, retain_graph=True)
    else:
        grads = None

        def step():
            nonlocal grads
            outs = fn(q, k, cos, sin)
            if grads is None:
                grads = [torch.randn_like(o) for o in outs]
            return torch.autograd.grad(outs, (q, k), grads)
    step()
    _, peak = harness.peak_above(step)
    ms = harness.kernel_ms(step, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
    # Replayed as a CUDA graph, the forward's time is the GPU's alone: at 32k tokens a RoPE kernel
    # takes ~0.1 ms, less than a custom op's Python dispatch, so eager timings measure the host.
    # (Here bwd and full have eager timings only; `--rounds` replays forward + backward as a graph.)
    gpu_ms = None
    if mode == "fwd":
        try:
            gpu_ms = harness.graph_ms(step, rep=20, return_mode="mean")
        except RuntimeError as e:  # a provider that cannot be captured keeps its eager timing only
            print(f"CUDA-graph timing unavailable: {e}")
    return ms, peak, gpu_ms


def sweep(device):
    """GPU time of the forward and backward kernels for each launch configuration (positions
    per program x warps) at the benchmark shapes; used to set rope._cuda_config."""
    import triton

    from fastgrpo.kernels import rope as rope_module

    for name, (n_q, n_kv, head_dim) in SHAPES.items():
        q, k, cos, sin = make_inputs(n_q, n_kv, head_dim, BATCH, TOKENS // BATCH, device, torch.bfloat16)
        block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_kv)
        for backward, cos_width in itertools.product((False, True), (head_dim, head_dim // 2)):
            op = torch.ops.fastgrpo.rope_backward if backward else torch.ops.fastgrpo.rope
            args = ((q, k, cos[..., :cos_width], sin[..., :cos_width], head_dim, False)
                    + ((q.dtype, k.dtype) if backward else ()))
            moved = (2 * (q.numel() + k.numel()) * q.element_size()
                     + 2 * cos.numel() * cos.element_size() * cos_width // head_dim)
            now, timings = harness.time_launch_configs(
                lambda: op(*args), list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8))),
                lambda c: [(rope_module, "_cuda_config", lambda *_: (block_hq, block_hk, *c))], rep=50)
            best = ", ".join(f"s{bs} w{nw}: {ms * 1e3:.1f}us ({100 * moved / (ms * 1e-3) / COPY_BANDWIDTH:.0f}%)"
                             for ms, (bs, nw) in timings[:5])
            print(f"{name} {'bwd' if backward else 'fwd'} cos width {cos_width}: now {now * 1e3:.1f}us; "
                  f"best: {best}", flush=True)


def graph_rounds(providers, rounds, device):
    """GPU time (CUDA graph) of every provider's forward and of its forward + backward (the issue's measure: a
    training step runs both), `rounds` times in turn, so that the drift of the device's speed within a call (a few
    us at these sizes) falls on every provider alike: medians and spreads per provider, and the ratios of the
    medians. The forward + backward graph holds the forward, then autograd's backward to q and k from fixed
    output gradients (Liger rotates q, k and those gradients in place at every replay: a rotation keeps their
    magnitude, so the timing holds)."""
    import statistics

    for name, (n_q, n_kv, head_dim) in SHAPES.items():
        q, k, cos, sin = make_inputs(n_q, n_kv, head_dim, BATCH, TOKENS // BATCH, device, torch.bfloat16)
        q_grad, k_grad = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out_grads = [torch.randn_like(q), torch.randn_like(k)]
        for mode in ("fwd", "fwd+bwd"):
            times = {provider: [] for provider in providers}
            for _ in range(rounds):
                for provider, fn in providers.items():
                    if mode == "fwd":
                        def step(fn=fn):
                            with torch.no_grad():
                                return fn(q, k, cos, sin)
                    else:
                        def step(fn=fn):
                            outs = fn(q_grad, k_grad, cos, sin)
                            return torch.autograd.grad(outs, (q_grad, k_grad), out_grads)
                    times[provider].append(harness.graph_ms(step, rep=50) * 1e3)
            ours = statistics.median(times["fastgrpo_half"])
            print(f"\n{name}, {mode}, CUDA-graph us, {rounds} rounds (median, min-max), "
                  "ratio = provider / fastgrpo_half")
            for provider, us in times.items():
                cos_bytes = 2 * cos.numel() * cos.element_size() // (2 if provider in READS_HALF_COS else 1)
                n_bytes = (2 * (q.numel() + k.numel()) * q.element_size() + cos_bytes) * (1 if mode == "fwd" else 2)
                median = statistics.median(us)
                print(f"| {name} | {mode} | {provider} | {median:.1f} ({min(us):.1f}-{max(us):.1f}) | "
                      f"{100 * n_bytes / (median * 1e-6) / COPY_BANDWIDTH:.0f} % | {median / ours:.3f} |", flush=True)


def dry_run():
    """CPU check of the harness pieces: inputs, reference and op agree on tiny shapes."""
    for name, (n_q, n_kv, head_dim) in SHAPES.items():
        q, k, cos, sin = make_inputs(n_q // 2, n_kv, 16, 2, 8, "cpu", torch.float32)
        ref = hf_rope(q, k, cos, sin)
        for provider in (rope, fastgrpo_half):
            err = max((a - b).abs().max().item() for a, b in zip(provider(q, k, cos, sin), ref))
            print(f"dry-run {name} {provider.__name__}: max |fastgrpo - hf| = {err:.2e}")
            assert err < 1e-5


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of the harness")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch configurations")
    parser.add_argument("--rounds", type=int, default=0, metavar="N",
                        help="only the CUDA-graph times (forward, forward + backward) of each provider, N rounds "
                             "taking turns; medians")
    args = parser.parse_args(argv)
    if args.dry_run or not torch.cuda.is_available():
        dry_run()
        return
    device = torch.device("cuda")
    if args.sweep:
        return sweep(device)
    torch._dynamo.config.cache_size_limit = 64
    providers = {"fastgrpo": rope, "fastgrpo_half": fastgrpo_half, "eager": hf_rope,
                 "inductor": torch.compile(hf_rope, dynamic=False)}
    liger = liger_rope_fn()
    if liger is not None:
        providers["liger"] = liger
    if args.rounds:
        return graph_rounds(providers, args.rounds, device)
    rows = []
    for name, (n_q, n_kv, head_dim) in SHAPES.items():
        q, k, cos, sin = make_inputs(n_q, n_kv, head_dim, BATCH, TOKENS // BATCH, device, torch.bfloat16)
        ref = hf_rope(q.float(), k.float(), cos.float(), sin.float())
        out = rope(q, k, cos, sin)
        err = max((a.float() - b).abs().max().item() for a, b in zip(out, ref))
        for mode in ("fwd", "bwd", "full"):
            for provider, fn in providers.items():
                (ms, lo, hi), peak, gpu_ms = bench(fn, q, k, cos, sin, mode, device)
                cos_bytes = 2 * cos.numel() * cos.element_size() // (2 if provider in READS_HALF_COS else 1)
                n_bytes = (2 * (q.numel() + k.numel()) * q.element_size() + cos_bytes) * (2 if mode == "full" else 1)
                rows.append(dict(shape=name, mode=mode, provider=provider, ms=ms, p20=lo, p80=hi,
                                 gbps=n_bytes / ms / 1e6, peak_mib=peak / 2**20, max_err_fwd=err, gpu_ms=gpu_ms,
                                 gpu_gbps=None if gpu_ms is None else n_bytes / gpu_ms / 1e6))
    for r in rows:
        same = [o for o in rows if o["shape"] == r["shape"] and o["mode"] == r["mode"]]
        fast = next(o for o in same if o["provider"] == "fastgrpo")
        r["speedup_vs"] = r["ms"] / fast["ms"]  # >1: fastgrpo is faster than this provider
        if r["gpu_ms"] is not None and fast["gpu_ms"] is not None:
            r["gpu_speedup_vs"] = r["gpu_ms"] / fast["gpu_ms"]
            r["gpu_pct_of_copy_bw"] = 100 * r["gpu_gbps"] * 1e9 / COPY_BANDWIDTH
    print(f"\nRoPE, bf16, {TOKENS} tokens (B={BATCH}), q/k transposed views, {harness.hardware()}")
    cells = []
    for r in rows:
        gpu = ((f"{r['gpu_ms'] * 1e3:.1f}", f"{r['gpu_gbps']:.0f}", f"{r['gpu_pct_of_copy_bw']:.0f}",
                f"{r['gpu_speedup_vs']:.2f}") if "gpu_speedup_vs" in r else ("", "", "", ""))
        cells.append((r["shape"], r["mode"], r["provider"], f"{r['ms']:.4f} ({r['p20']:.4f}-{r['p80']:.4f})",
                      f"{r['gbps']:.0f}", f"{r['peak_mib']:.0f}", f"{r['speedup_vs']:.2f}", *gpu))
    print(harness.markdown_table(("shape", "mode", "provider", "eager ms (p20-p80)", "GB/s", "peak MiB",
                                  "ms / fastgrpo ms", "CUDA-graph us", "GB/s", f"% of {harness.COPY_TBPS} TB/s",
                                  "us / fastgrpo us"), cells))
    rows = [dict(tokens=TOKENS, batch=BATCH, **r) for r in rows]
    print(f"rows appended to {harness.record('bench_rope', rows)}")


if __name__ == "__main__":
    main()
