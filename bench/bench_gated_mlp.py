"""Benchmark fastgrpo::gated_mlp and fastgrpo::act_mul against eager, inductor and Liger (bf16, GPU).

    python bench/bench_gated_mlp.py            # H200: Qwen2.5-1.5B and Llama-3.1-8B MLPs, 32k tokens
    python bench/bench_gated_mlp.py --tokens 131072 --shapes qwen2.5-1.5b   # long context
    python bench/bench_gated_mlp.py --block --shapes qwen2.5-1.5b --tokens 34816 --profile
                                               # the whole MLP block (down projection included), as the
                                               # trainer runs it at 4096 completions, + the op's kernels
    python bench/bench_gated_mlp.py --block --checkpointed   # the block under gradient checkpointing, as
                                               # the GRPO trainer runs it (TRL's default)
    python bench/bench_gated_mlp.py --sweep-act-mul   # the act_mul kernels' launch configurations
    python bench/bench_gated_mlp.py --dry-run  # CPU: tiny shapes, checks the harness and the maths

gated_mlp: h = silu(x Wg^T [+ LoRA]) * (x Wu^T [+ LoRA]) up to the down projection; with --block the
  down projection (with LoRA) too, and the op also with saved gate/up (provider fastgrpo_saved: what the
  trainer runs under gradient checkpointing).
  plain: trainable bf16 weights (full fine-tuning); lora: frozen bf16 base, fp32 PEFT adapters
  r=16 on gate and up (and down), scale 2 (bf16 adapters with --block, as autocast runs them). Eager
  is the HF + PEFT arithmetic written out; inductor compiles that; liger is the same matmuls with
  LigerSiLUMulFunction for act*mul (what its SwiGLU MLP does).
  TFLOP/s counts model FLOPs (forward, dx, dW when trained; not fastgrpo's recompute).
  "saved MiB": memory held between forward and backward beyond the inputs. "host ms": the host's time to
  issue one fwd+bwd (median of 5, GPU idle at the start; the op issues a dozen or more launches per row chunk).
  fastgrpo walks the tokens in chunks (rows_per_chunk() rows, printed in the header), so its peak
  beyond its output and dx stays under ~2.25 x 256 MiB at any token count (LoRA; full fine-tuning adds
  fp32 weight-gradient accumulators); fastgrpo_saved holds gate and up ([tokens, 2I]) besides.
--checkpointed (with --block): y = x + mlp(x) under torch's non-reentrant checkpoint, forward + the recompute
  in backward + backward, every provider. fastgrpo (the op keeping only x) runs as the trainer runs it under
  offloaded checkpointing: the re-run is marked (`checkpoint_recompute()`, what fastgrpo's offloaded
  checkpoint does) and the op, told that its output only feeds the residual add, skips it there; its
  backward recomputes the projections once. fastgrpo_saved (the op keeping gate/up) re-runs its projections
  in the recompute to save them, as under HF's checkpoint. The others re-run their whole MLP.
act_mul: h = silu(g) * u on [tokens, I] bf16; GB/s over the bytes read and written once.
The table's rows are appended to bench/results/bench_gated_mlp.jsonl.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.kernels import _row_chunks  # noqa: E402
from fastgrpo.kernels import act_mul as act_mul_module  # noqa: E402
from fastgrpo.compiler.offload import marking_recomputes  # noqa: E402
from fastgrpo.kernels.act_mul import act_mul  # noqa: E402
from fastgrpo.kernels.gated_mlp import gated_mlp  # noqa: E402

SHAPES = {name: harness.mlp_shape(name) for name in ("qwen2.5-1.5b", "llama-3.1-8b")}  # name: (hidden, intermediate)
TOKENS = 32768
RANK = 16
LORA_SCALE = 2.0


def _lora_linear(x, w, a, b):
    """PEFT's LoRA linear: (base(x) + B(A(x in the adapters' dtype)) * scale) in x's dtype; plain without A."""
    y = F.linear(x, w)
    return y if a is None else (y + F.linear(F.linear(x.to(a.dtype), a), b) * LORA_SCALE).to(x.dtype)


def _mlp(act_mul_fn):
    """HF LlamaMLP with PEFT's LoRA arithmetic, act*mul by `act_mul_fn`; the down projection when wd is given."""
    def mlp(x, wg, wu, ga, gb, ua, ub, wd=None, da=None, db=None):
        h = act_mul_fn(_lora_linear(x, wg, ga, gb), _lora_linear(x, wu, ua, ub))
        return h if wd is None else _lora_linear(h, wd, da, db)
    return mlp


eager_mlp = _mlp(lambda g, u: F.silu(g) * u)


def fastgrpo_mlp(save_projections=False):
    def mlp(x, wg, wu, ga, gb, ua, ub, wd=None, da=None, db=None):
        return gated_mlp(x, wg, wu, ga, gb, ua, ub, LORA_SCALE, "silu", wd, da, db, LORA_SCALE, save_projections)
    return mlp


def fastgrpo_skipping_mlp():
    """The op keeping only x, told its output only feeds the residual add (what the FX pass proves in a
    decoder layer): inside a marked checkpoint recompute it computes nothing."""
    def mlp(x, wg, wu, ga, gb, ua, ub, wd=None, da=None, db=None):
        return torch.ops.fastgrpo.gated_mlp(x, wg, wu, ga, gb, ua, ub, LORA_SCALE, "silu", wd, da, db, LORA_SCALE,
                                            False, True)[0]
    return mlp


def checkpointed_block(mlp, mark_recompute=False):
    """y = x + mlp(x) under torch's non-reentrant checkpoint; with mark_recompute the re-run in backward runs
    inside checkpoint_recompute(), as fastgrpo's offloaded checkpoint runs it."""
    def residual_block(*inputs):
        return inputs[0] + mlp(*inputs)

    def block(*args):
        run = marking_recomputes(residual_block) if mark_recompute else residual_block
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    return block


def liger_mlp_fn():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return _mlp(LigerSiLUMulFunction.apply)


def make_mlp_inputs(hidden, inter, tokens, lora, device, block=False):
    """(x, wg, wu, ga, gb, ua, ub[, wd, da, db]): separate gate/up modules as in Llama; --block adds the
    down projection, and its adapters are bf16 as autocast runs them (fp32 PEFT adapters otherwise)."""
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w_gate_up = torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5
    wg, wu = w_gate_up[:inter].clone(), w_gate_up[inter:].clone()
    down = [torch.randn(hidden, inter, device=device, dtype=torch.bfloat16) * inter**-0.5] if block else []
    if not lora:
        return (x, wg.requires_grad_(), wu.requires_grad_(), None, None, None, None,
                *[w.requires_grad_() for w in down], *([None, None] if block else []))
    lora_dtype = torch.bfloat16 if block else torch.float32
    shapes = [(RANK, hidden, hidden**-0.5), (inter, RANK, 0.01), (RANK, hidden, hidden**-0.5), (inter, RANK, 0.01)]
    if block:
        shapes += [(RANK, inter, inter**-0.5), (hidden, RANK, 0.01)]
    factors = [(torch.randn(rows, cols, device=device) * std).to(lora_dtype).requires_grad_() for rows, cols, std in shapes]
    return (x, wg, wu, *factors[:4], *down, *factors[4:])


def mlp_flops(hidden, inter, tokens, lora, block=False):
    projections = 3 if block else 2
    base = 2 * tokens * hidden * projections * inter
    adapters = projections * 2 * tokens * RANK * (hidden + inter)
    fwd = base + (adapters if lora else 0)
    bwd = base + (0 if lora else base) + (2 * adapters if lora else 0)
    return fwd, bwd


def bench_mlp(fn, inputs, mode, device):
    x = inputs[0].detach().requires_grad_()
    args = (x, *inputs[1:])
    wrt = [t for t in args if t is not None and t.requires_grad]
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(*args)
        ms = harness.kernel_ms(step, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=60)
        return ms, None, None, None
    with torch.no_grad():
        dh = torch.randn_like(fn(*args))

    def step():
        return torch.autograd.grad(fn(*args), wrt, dh)

    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn(*args)
    saved = torch.cuda.memory_allocated(device) - base - out.numel() * out.element_size()
    torch.autograd.grad(out, wrt, dh)
    del out
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    # A Llama-8B block step takes ~45 ms: 400 ms of repetitions give ~9 samples (60 ms gave one).
    ms = harness.kernel_ms(step, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=400)
    # The host's share: time to issue one step with the GPU idle at its start (nothing inside waits for it).
    host = []
    harness.wall_ms(step, 5, host_ms=host)
    return ms, peak, saved, sorted(host)[len(host) // 2]


def bench_act_mul(fn, g, u, mode):
    g = g.detach().requires_grad_(mode == "full")
    u = u.detach().requires_grad_(mode == "full")
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(g, u)
    else:
        dh = torch.randn_like(g)

        def step():
            return torch.autograd.grad(fn(g, u), (g, u), dh)
    return harness.kernel_ms(step, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)


def sweep_act_mul(device, tokens, shapes):
    """GPU time of the act_mul kernels for each (BLOCK_M, BLOCK_N, num_warps) at the benchmark shapes, on g and
    u laid out as the op holds them (the two halves of one [rows, 2I] buffer); used to set _act_mul_blocks."""
    import itertools

    configs = [(block_m, block_n, num_warps)
               for block_m, block_n, num_warps in itertools.product((1, 4, 16, 64), (128, 256, 512, 1024), (2, 4, 8))
               if 4 <= block_m * block_n // (32 * num_warps) <= 64]
    for name, (_, inter) in shapes.items():
        gu = torch.randn(tokens, 2 * inter, device=device, dtype=torch.bfloat16)
        g, u = gu[:, :inter], gu[:, inter:]
        h = torch.empty(tokens, inter, device=device, dtype=torch.bfloat16)
        dgu = torch.empty_like(gu)
        kernels = {
            "fwd": (lambda: act_mul_module._act_mul_fwd_triton(g, u, h, "silu"), 3),
            "bwd": (lambda: act_mul_module._act_mul_bwd_triton(h, g, u, dgu[:, :inter], dgu[:, inter:], "silu"), 5),
        }
        for kind, (fn, accesses) in kernels.items():
            n_bytes = accesses * g.numel() * g.element_size()
            now, timings = harness.time_launch_configs(
                fn, configs, lambda c: [(act_mul_module, "_act_mul_blocks", lambda _, c=c: c)], rep=30)
            best = ", ".join(f"{m}x{n} w{w}: {ms * 1e3:.0f}us ({n_bytes / (ms * 1e-3) / 1e9:.0f} GB/s)"
                             for ms, (m, n, w) in timings[:5])
            print(f"act_mul {name} {kind}: now {now * 1e3:.0f}us ({n_bytes / (now * 1e-3) / 1e9:.0f} GB/s); "
                  f"best: {best}", flush=True)


def dry_run():
    for block in (False, True):
        for lora in (False, True):
            inputs = make_mlp_inputs(64, 96, 40, lora, "cpu", block)
            inputs = [t.float() if t is not None else None for t in inputs]
            for rows_per_chunk in (None, 16):  # one chunk, then three
                _row_chunks.ROWS_PER_CHUNK = rows_per_chunk
                for save in (False, True) if block else (False,):
                    err = (fastgrpo_mlp(save)(*inputs) - eager_mlp(*inputs)).abs().max().item()
                    print(f"dry-run gated_mlp block={block} lora={lora} rows_per_chunk={rows_per_chunk} save={save}: "
                          f"max |fastgrpo - eager| = {err:.2e}")
                    assert err < 1e-4
            _row_chunks.ROWS_PER_CHUNK = None
    inputs = [t.float() if t is not None else None for t in make_mlp_inputs(64, 96, 40, True, "cpu", True)]
    x = inputs[0].detach().requires_grad_()
    wrt = [x] + [t for t in inputs[1:] if t is not None and t.requires_grad]
    expected = torch.autograd.grad((x + eager_mlp(x, *inputs[1:])).square().sum(), wrt)
    actual = torch.autograd.grad(checkpointed_block(fastgrpo_skipping_mlp(), True)(x, *inputs[1:]).square().sum(), wrt)
    err = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    print(f"dry-run checkpointed block, op skipping its output in the recompute: max |grad - eager's| = {err:.2e}")
    assert err < 1e-3
    g, u = torch.randn(2, 40, 96, 2).unbind(-1)
    err = (act_mul(g, u) - F.silu(g) * u).abs().max().item()
    print(f"dry-run act_mul: max |fastgrpo - eager| = {err:.2e}")
    assert err < 1e-5


def profile(fn, inputs):
    """torch.profiler's CUDA kernels of one fwd+bwd of `fn` (after a warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inputs = (inputs[0].detach().requires_grad_(), *inputs[1:])
    wrt = [t for t in inputs if t is not None and t.requires_grad]
    with torch.no_grad():
        dh = torch.randn_like(fn(*inputs))
    torch.autograd.grad(fn(*inputs), wrt, dh)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(fn(*inputs), wrt, dh)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=90))


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of the harness")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="rows of x (default %(default)s)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--block", action="store_true", help="the MLP block with its down projection")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top CUDA kernels of the "
                                                              "fastgrpo op (LoRA, last shape)")
    parser.add_argument("--profile-only", action="store_true",
                        help="no timing table: the top CUDA kernels of the fastgrpo op and of inductor")
    parser.add_argument("--checkpointed", action="store_true",
                        help="with --block: y = x + mlp(x) under gradient checkpointing (forward + backward only)")
    parser.add_argument("--sweep-act-mul", action="store_true", help="time the act_mul kernels' launch configurations")
    parser.add_argument("--profile-variant", choices=("lora", "plain"), default="lora",
                        help="what --profile-only profiles: LoRA r=16 on a frozen base, or full fine-tuning")
    args = parser.parse_args(argv)
    if args.checkpointed and not args.block:
        parser.error("--checkpointed times the block (y = x + mlp(x)): add --block")
    if args.dry_run or not torch.cuda.is_available():
        dry_run()
        return
    tokens = args.tokens
    unknown = [name for name in args.shapes.split(",") if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: give some of {', '.join(SHAPES)}")
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    device = torch.device("cuda")
    if args.sweep_act_mul:
        return sweep_act_mul(device, tokens, shapes)
    torch._dynamo.config.cache_size_limit = 64
    providers = {"fastgrpo": fastgrpo_mlp(), "eager": eager_mlp, "inductor": torch.compile(eager_mlp, dynamic=False)}
    if args.block:
        providers["fastgrpo_saved"] = fastgrpo_mlp(save_projections=True)
    liger = liger_mlp_fn()
    if liger is not None:
        providers["liger"] = liger
    if args.checkpointed:
        providers = {name: checkpointed_block(fn) for name, fn in providers.items()}
        providers["fastgrpo"] = checkpointed_block(fastgrpo_skipping_mlp(), mark_recompute=True)
    if args.profile_only:
        for name, (hidden, inter) in shapes.items():
            lora = args.profile_variant == "lora"
            inputs = make_mlp_inputs(hidden, inter, tokens, lora, device, args.block)
            for provider in ("fastgrpo_saved" if args.block else "fastgrpo", "inductor"):
                print(f"== {name} {args.profile_variant}, {provider}")
                profile(providers[provider], inputs)
        return
    rows = []
    for name, (hidden, inter) in shapes.items():
        for lora in (False, True):
            inputs = make_mlp_inputs(hidden, inter, tokens, lora, device, args.block)
            ref = eager_mlp(*[t.double() if t is not None else None for t in inputs]).float()
            err = (fastgrpo_mlp()(*inputs).float() - ref).abs().max().item()
            flops_fwd, flops_bwd = mlp_flops(hidden, inter, tokens, lora, args.block)
            for mode in ("full",) if args.checkpointed else ("fwd", "full"):
                for provider, fn in providers.items():
                    (ms, lo, hi), peak, saved, host_ms = bench_mlp(fn, inputs, mode, device)
                    flops = flops_fwd + (flops_bwd if mode == "full" else 0)
                    op = ("checkpointed block" if args.checkpointed else "gated_mlp block") if args.block else "gated_mlp"
                    rows.append(dict(op=op, shape=name, variant="lora" if lora else "plain", mode=mode,
                                     provider=provider, ms=ms, p20=lo, p80=hi, tflops=flops / ms / 1e9,
                                     peak_mib=None if peak is None else peak / 2**20,
                                     saved_mib=None if saved is None else saved / 2**20, host_ms=host_ms,
                                     max_abs_err_fwd=err))
            if args.profile and lora:
                profile(providers["fastgrpo_saved" if args.block else "fastgrpo"], inputs)
            del inputs
        g = torch.randn(tokens, inter, device=device, dtype=torch.bfloat16)
        u = torch.randn(tokens, inter, device=device, dtype=torch.bfloat16)
        act_providers = {
            "fastgrpo": lambda a, b: act_mul(a, b, "silu"),
            "eager": lambda a, b: F.silu(a) * b,
            "inductor": torch.compile(lambda a, b: F.silu(a) * b, dynamic=False),
        }
        if liger is not None:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            act_providers["liger"] = LigerSiLUMulFunction.apply
        for mode in ("fwd", "full"):
            n_bytes = g.numel() * g.element_size() * (3 if mode == "fwd" else 3 + 5)
            for provider, fn in act_providers.items():
                ms, lo, hi = bench_act_mul(fn, g, u, mode)
                rows.append(dict(op="act_mul", shape=name, variant="silu", mode=mode, provider=provider,
                                 ms=ms, p20=lo, p80=hi, gbps=n_bytes / ms / 1e6))
    for r in rows:
        fast = next(o for o in rows if o["provider"] == "fastgrpo" and all(
            o[key] == r[key] for key in ("op", "shape", "variant", "mode")))
        r["speedup_vs"] = r["ms"] / fast["ms"]  # >1: fastgrpo is faster than this provider
    chunks = ", ".join(f"{name} {_row_chunks.rows_per_chunk(inter, torch.bfloat16)}"
                       for name, (_, inter) in shapes.items())
    print(f"\nGated MLP, bf16, {tokens} tokens, {harness.hardware()}; fastgrpo rows per chunk: {chunks}")
    cells = []
    for r in rows:
        rate = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else f"{r['gbps']:.0f} GB/s"
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        saved = "" if r.get("saved_mib") is None else f"{r['saved_mib']:.0f}"
        host = "" if r.get("host_ms") is None else f"{r['host_ms']:.2f}"
        cells.append((r["op"], r["shape"], r["variant"], r["mode"], r["provider"],
                      f"{r['ms']:.3f} ({r['p20']:.3f}-{r['p80']:.3f})", host, rate, peak, saved,
                      f"{r['speedup_vs']:.2f}"))
    print(harness.markdown_table(("op", "shape", "variant", "mode", "provider", "ms (p20-p80)", "host ms",
                                  "TFLOP/s or GB/s", "peak MiB", "saved MiB", "provider ms / fastgrpo ms"), cells))
    print(f"rows appended to {harness.record('bench_gated_mlp', [dict(tokens=tokens, rank=RANK, **r) for r in rows])}")


if __name__ == "__main__":
    main()
