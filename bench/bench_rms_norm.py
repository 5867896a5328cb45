"""RMSNorm and residual-add + RMSNorm, forward + backward, bf16: fastgrpo vs eager HF-style
code, torch.compile (inductor) of that code, and Liger-Kernel (when importable).

    python bench/bench_rms_norm.py                 # rows 32768, H in {576, 1536, 4096, 8192}
    python bench/bench_rms_norm.py --dry-run       # tiny shapes on CPU: checks the providers agree
    python bench/bench_rms_norm.py --frozen-weight # the same without dW, as in a LoRA step
    python bench/bench_rms_norm.py --sweep         # time the kernels' launch configurations
    python bench/bench_rms_norm.py --hidden 576 1536 4096 --sweep bwd+dw add_bwd+dw --stages 0 2 3 4
                                                   # the backward with dW, register prefetch vs pipelined

Bytes counted (the minimum traffic of the op, weight excluded):
    rms:      fwd reads x, writes y;            bwd reads x, dy, writes dx         -> 5 * N * H * 2
    add+rms:  fwd reads x, res, writes s, y;    bwd reads s, dy, ds, writes d(s)   -> 8 * N * H * 2
d(res) is the same tensor as d(x) (d(s) itself), in every provider, so it is written once.
The weight requires grad (dW is computed), or with --frozen-weight not (as in a LoRA step).
Times are medians of triton.testing.do_bench (with the Python launch overhead) and of
do_bench_cudagraph (GPU time only).
The row "same bytes" is no RMSNorm: two compiled pointwise kernels (one for the forward, one for the
backward) that read and write exactly the bytes counted above, the ceiling the op's kernels can reach at
that size on this device, launch and drain included. % peak: share of the H200's device-to-device copy rate
(bench/_harness.py's COPY_TBPS). The table's rows are appended to bench/results/bench_rms_norm.jsonl.
"""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.kernels import rms_norm as fastgrpo_rms  # noqa: E402

EPS = 1e-6
DTYPE = torch.bfloat16
DEVICE_COPY_TBPS = harness.COPY_TBPS


def eager_rms_norm(x, weight):  # LlamaRMSNorm.forward
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return weight * h.to(input_dtype)


def eager_add_rms_norm(x, residual, weight):  # decoder layer: residual add, then the next norm
    s = x + residual
    return s, eager_rms_norm(s, weight)


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None, None
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        LigerFusedAddRMSNormFunction = None
    return LigerRMSNormFunction, LigerFusedAddRMSNormFunction


def providers(mode, with_inductor, with_liger):
    """name -> fn(*inputs) returning the outputs as a tuple ((y,) or (s, y))."""
    if mode == "rms":
        out = {
            "eager": lambda x, w: (eager_rms_norm(x, w),),
            "fastgrpo": lambda x, w: (fastgrpo_rms.rms_norm(x, w, EPS),),
        }
        if with_inductor:
            compiled = torch.compile(eager_rms_norm, dynamic=False)
            out["inductor"] = lambda x, w: (compiled(x, w),)
        liger_rms, _ = _liger() if with_liger else (None, None)
        if liger_rms is not None:
            # Liger's defaults: llama casting, dX written into dY's storage.
            out["liger"] = lambda x, w: (liger_rms.apply(x, w, EPS, 0.0, "llama", True),)
    else:
        out = {
            "eager": eager_add_rms_norm,
            "fastgrpo": lambda x, r, w: fastgrpo_rms.add_rms_norm(x, r, w, EPS),
        }
        if with_inductor:
            out["inductor"] = torch.compile(eager_add_rms_norm, dynamic=False)
        _, liger_add = _liger() if with_liger else (None, None)
        if liger_add is not None:
            out["liger"] = lambda x, r, w: tuple(reversed(liger_add.apply(x, r, w, EPS, 0.0, "llama", False)))
    return out


def make_inputs(mode, rows, H, device, seed=0, weight_grad=True):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE).requires_grad_(requires_grad)

    x = randn(rows, H, requires_grad=True)
    w = (randn(H) * 0.1 + 1).requires_grad_(weight_grad)
    if mode == "rms":
        return (x, w), (randn(rows, H),)
    return (x, randn(rows, H, requires_grad=True), w), (randn(rows, H), randn(rows, H))


def fwd_bwd(fn, inputs, grads):
    wanted = [t for t in inputs if t.requires_grad]  # the weight drops out when frozen

    def step():
        outs = fn(*inputs)
        return torch.autograd.grad(outs, wanted, grads)

    return step


def bytes_moved(mode, rows, H):
    per_elem = 5 if mode == "rms" else 8
    return per_elem * rows * H * torch.finfo(DTYPE).bits // 8


def same_bytes_step(mode, rows, H):
    """Pointwise kernels with the op's traffic: rms fwd x -> y, bwd (x, dy) -> dx; add+rms fwd (x, res) ->
    (s, y), bwd (s, dy, ds) -> d."""
    def randn():
        return torch.randn(rows, H, device="cuda", dtype=DTYPE)

    if mode == "rms":
        fwd = torch.compile(lambda x: x * 2, dynamic=False)
        bwd = torch.compile(lambda x, dy: x + dy, dynamic=False)
        x, dy = randn(), randn()
        return lambda: (fwd(x), bwd(x, dy))
    fwd = torch.compile(lambda x, r: (x + r, (x + r) * 2), dynamic=False)
    bwd = torch.compile(lambda s, dy, ds: ds + dy * s, dynamic=False)
    x, r, dy, ds = randn(), randn(), randn(), randn()
    return lambda: (fwd(x, r), bwd(x, dy, ds))


def check_agreement(mode, fns, rows, H, device, weight_grad=True):
    """Every provider's outputs and grads close to eager's (bf16 tolerances)."""
    inputs, grads = make_inputs(mode, rows, H, device, weight_grad=weight_grad)
    ref = None
    for name, fn in fns.items():
        grads_copy = tuple(g.clone() for g in grads)  # Liger writes dX into dY
        outs = fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        got = tuple(o.float() for o in outs) + tuple(g.float() for g in torch.autograd.grad(outs, wanted, grads_copy))
        if ref is None:
            ref = got
            continue
        for i, (a, b) in enumerate(zip(got, ref)):
            err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            if err > 2e-2:
                raise AssertionError(f"{mode} H={H}: {name} output {i} differs from eager by {err:.3g} (relative)")


def timings(step, mode, rows, H):
    """Medians of `step` with launch overhead (do_bench, with p20/p80) and as CUDA-graph replays, and the GB/s
    of the op's counted bytes at each."""
    ms, ms20, ms80 = harness.kernel_ms(step, quantiles=[0.5, 0.2, 0.8], rep=200)
    ms_graph = harness.graph_ms(step, rep=100)
    return dict(ms=ms, ms_p20=ms20, ms_p80=ms80, ms_cudagraph=ms_graph,
                gbps=bytes_moved(mode, rows, H) / (ms * 1e-3) / 1e9,
                gbps_cudagraph=bytes_moved(mode, rows, H) / (ms_graph * 1e-3) / 1e9)


def bench(mode, rows, H, with_inductor, with_liger, weight_grad=True):
    fns = providers(mode, with_inductor, with_liger)
    check_agreement(mode, fns, 256, H, "cuda", weight_grad)
    results = {}
    for name, fn in fns.items():
        inputs, grads = make_inputs(mode, rows, H, "cuda", weight_grad=weight_grad)
        step = fwd_bwd(fn, inputs, grads)
        step()
        _, peak = harness.peak_above(step)
        results[name] = dict(timings(step, mode, rows, H), peak_extra_mib=peak / 2**20)
    step = same_bytes_step(mode, rows, H)
    step()
    results["same bytes"] = dict(timings(step, mode, rows, H), peak_extra_mib=0.0)
    return results


SWEEP_KINDS = ("fwd", "bwd", "bwd+dw", "add_fwd", "add_bwd", "add_bwd+dw")
# Bytes each kind moves per element (bf16): reads and writes of the rows, weight excluded.
SWEEP_BYTES_PER_ELEM = {"fwd": 4, "bwd": 6, "bwd+dw": 6, "add_fwd": 8, "add_bwd": 8, "add_bwd+dw": 8}
# One H100/H200 SM.
SM_REGISTERS, SM_WARPS, SM_SHARED_BYTES, SM_SHARED_BYTES_PER_BLOCK = 65536, 64, 228 * 1024, 227 * 1024


def sweep_configs(kind, H, stages=(0,)):
    """Launch configurations to time for `kind` at width H: (rows per program, num_warps,
    programs per SM, pipeline stages); programs per SM None = one program per row block.

    With dW: `stages` x rows {1, 2, 4, 8} x warps {2, 4, 8} (also 1 up to 1024 wide blocks; {8, 16, 32} from
    8192 wide rows)
    x programs per SM {2, 4, 8, 16}, less those whose threads hold fewer than 4 or more than 32
    elements of a block, that would spill (registers, by a rough count) or not compile (shared
    memory of the pipelined loads: stages - 1 blocks of each bf16 input); and 4 or 8 programs
    per SM and up only where that many fit on one SM (warps, registers, shared memory). Fewer resident
    programs than that only run in waves, while the pipelined loads keep one program's memory
    traffic in flight from shared memory, so 2 per SM stays in even where they do not fit."""
    block_h = 1 << (H - 1).bit_length()
    if kind.endswith("+dw"):
        inputs = 3 if kind.startswith("add") else 2
        # One warp a row up to 1024 wide: the row's sums stay inside the warp (no shared-memory round trip).
        warps = (1, 2, 4, 8) if block_h <= 1024 else (2, 4, 8) if block_h <= 4096 else (8, 16, 32)
        configs = []
        for n_stages, block_row, num_warps, per_sm in itertools.product(stages, (1, 2, 4, 8), warps, (2, 4, 8, 16)):
            per_thread = block_row * block_h // (32 * num_warps)
            registers = (inputs + 3) * per_thread + 24  # fp32 inputs, weight, accumulator, temporaries, addresses
            shared = max(n_stages - 1, 0) * inputs * block_row * block_h * 2
            if not (4 <= per_thread <= 32 and registers <= 255 and shared <= SM_SHARED_BYTES_PER_BLOCK):
                continue
            fits = (per_sm * num_warps <= SM_WARPS and registers * 32 * num_warps * per_sm <= SM_REGISTERS
                    and shared * per_sm <= SM_SHARED_BYTES)
            if per_sm == 2 or fits:
                configs.append((block_row, num_warps, per_sm, n_stages))
        return configs
    blocks = [(br, nw) for br in (1, 2, 4, 8, 16, 32) for nw in (1, 2, 4, 8, 16, 32)
              if 4 <= br * block_h // (nw * 32) <= 32]
    # (programs per SM None: one row block a program, straight through, as inductor's own kernels run)
    per_sm_options = (None,) if kind.endswith("fwd") else (None, 4, 8)
    configs = [(br, nw, per_sm, 0) for (br, nw), per_sm in itertools.product(blocks, per_sm_options)]
    if not kind.endswith("fwd") and block_h <= 2048:
        # and, without dW too, one row a program with pipelined loads (`stages` > 0), as with dW
        configs += [(1, nw, per_sm, n_stages) for n_stages in stages if n_stages > 0
                    for nw in (1, 2) for per_sm in (4, 8, 12, 16) if 4 <= block_h // (nw * 32) <= 32]
    return configs


def sweep(rows, hidden_sizes, kinds, stages):
    """Time each launch configuration of the Triton kernels (forward, backward with and
    without dW; plain and with the residual add) at the benchmark shapes, GPU time only (CUDA
    graphs); used to set _fwd_config / _bwd_config. `stages`: the backward's pipeline stages
    tried with dW (0 = the register prefetch). One line per configuration, then the best per
    (kind, H) against the current default ("now")."""
    import time

    peak_gbps = DEVICE_COPY_TBPS * 1e3
    started = time.perf_counter()
    best_lines = []
    for H in hidden_sizes:
        (x, res, w), (dy, dsum) = make_inputs("add+rms", rows, H, "cuda")
        x, res, w = x.detach(), res.detach(), w.detach()
        for kind in kinds:
            if kind == "fwd":
                def fn():
                    return torch.ops.fastgrpo.rms_norm(x, w, EPS, 0.0, False, DTYPE)
            elif kind == "add_fwd":
                def fn():
                    return torch.ops.fastgrpo.add_rms_norm(x, res, w, EPS, 0.0, False, DTYPE)
            else:
                def fn(need_dw=kind.endswith("+dw"), grad_sum=dsum if kind.startswith("add") else None):
                    return torch.ops.fastgrpo.rms_norm_backward(dy, grad_sum, x, w, EPS, 0.0, False, True, need_dw)

            def gbps(ms):
                return SWEEP_BYTES_PER_ELEM[kind] * rows * H / (ms * 1e-3) / 1e9

            def settings(config):
                block_row, num_warps, per_sm, n_stages = config
                return [(fastgrpo_rms, "_fwd_config", lambda *_: (block_row, num_warps)),
                        (fastgrpo_rms, "_bwd_config", lambda *_: (block_row, num_warps, per_sm, n_stages))]

            def report(config, ms):
                block_row, num_warps, per_sm, n_stages = config
                print(f"H={H} {kind:10s} stages {n_stages} br{block_row} w{num_warps} sm*{per_sm}: "
                      f"{ms * 1e3:.1f}us ({gbps(ms):.0f} GB/s, {100 * gbps(ms) / peak_gbps:.0f}%)", flush=True)

            now, timings = harness.time_launch_configs(fn, sweep_configs(kind, H, stages), settings, rep=20,
                                                       now_rep=30, report=report)
            ms, (block_row, num_warps, per_sm, n_stages) = timings[0]
            best_lines.append(f"BEST H={H} {kind:10s} stages {n_stages} br{block_row} w{num_warps} sm*{per_sm}: "
                              f"{ms * 1e3:.1f}us ({gbps(ms):.0f} GB/s, {100 * gbps(ms) / peak_gbps:.0f}%); "
                              f"now {now * 1e3:.1f}us ({100 * gbps(now) / peak_gbps:.0f}%), x{now / ms:.2f}")
    print(f"\n{harness.hardware()}, rows {rows}, bf16, % of {DEVICE_COPY_TBPS} TB/s; "
          f"sweep took {time.perf_counter() - started:.0f} s")
    print("\n".join(best_lines))


def sweep_reduce(rows, hidden_sizes):
    """GPU time of the backward with dW (plain and with the residual's gradient) for each dW reduction
    configuration (partials per load, columns per program, warps) and number of backward programs per SM
    (fewer programs, fewer partials to reduce); used to set _dw_reduce_config."""
    configs = [(per_sm, block_p, block_c, num_warps) for per_sm, block_p, block_c, num_warps in itertools.product(
        (4, 6, 8), (512, 1024, 2048), (4, 8, 16, 32), (4, 8, 16)) if 4 <= block_p * block_c // (32 * num_warps) <= 64]
    best_lines = []
    for H in hidden_sizes:
        (x, _, w), (dy, dsum) = make_inputs("add+rms", rows, H, "cuda")
        x, w = x.detach(), w.detach()
        for grad_sum in (None, dsum):
            def fn():
                return torch.ops.fastgrpo.rms_norm_backward(dy, grad_sum, x, w, EPS, 0.0, False, True, True)

            kind = "add_bwd+dw" if grad_sum is not None else "bwd+dw"
            default = fastgrpo_rms._bwd_config(H, True, True, grad_sum is not None)

            def settings(config):
                per_sm, block_p, block_c, num_warps = config
                return [(fastgrpo_rms, "_bwd_config", lambda *_: (*default[:2], per_sm, default[3])),
                        (fastgrpo_rms, "_dw_reduce_config", lambda programs: (block_p, block_c, num_warps))]

            def report(config, ms):
                per_sm, block_p, block_c, num_warps = config
                print(f"H={H} {kind} sm*{per_sm} reduce p{block_p} c{block_c} w{num_warps}: {ms * 1e3:.1f}us",
                      flush=True)

            now, timings = harness.time_launch_configs(fn, configs, settings, rep=20, now_rep=30, report=report)
            ms, (per_sm, block_p, block_c, num_warps) = timings[0]
            best_lines.append(f"BEST H={H} {kind} sm*{per_sm} reduce p{block_p} c{block_c} w{num_warps}: "
                              f"{ms * 1e3:.1f}us; now {now * 1e3:.1f}us")
    print("\n".join(best_lines))


def dry_run():
    """CPU, tiny shapes: the providers that run on CPU agree and the byte counts are right."""
    for mode, weight_grad in itertools.product(("rms", "add+rms"), (True, False)):
        check_agreement(mode, providers(mode, with_inductor=False, with_liger=False), 64, 96, "cpu", weight_grad)
    assert bytes_moved("rms", 32768, 4096) == 5 * 32768 * 4096 * 2
    # The sweep's grid holds the current defaults (its "now"); count what a stages sweep would time.
    n_configs = 0
    for H in (576, 1536, 4096, 8192):
        for kind in SWEEP_KINDS:
            configs = sweep_configs(kind, H, (0, 2, 3, 4))
            if not kind.endswith("fwd"):
                default = fastgrpo_rms._bwd_config(H, True, kind.endswith("+dw"), kind.startswith("add"))
                assert default in configs, (kind, H, default)
            n_configs += len(configs) if kind.endswith("+dw") and H <= 4096 else 0
    print(f"dry run ok: eager and fastgrpo agree on CPU for rms and add+rms; --hidden 576 1536 4096 "
          f"--sweep bwd+dw add_bwd+dw --stages 0 2 3 4 times {n_configs} configurations")


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 1536, 4096, 8192])
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--sweep", nargs="*", metavar="KIND", choices=SWEEP_KINDS,
                        help="time launch configurations of: " + " ".join(SWEEP_KINDS) + " (default all)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0], metavar="S",
                        help="with --sweep: the backward's pipeline stages tried with dW (0 = register prefetch, "
                             "the default; e.g. --stages 0 2 3 4)")
    parser.add_argument("--frozen-weight", action="store_true",
                        help="the weight requires no gradient, as in a LoRA step (no dW; Liger's backward still "
                             "computes it)")
    parser.add_argument("--sweep-reduce", action="store_true",
                        help="time the dW reduction's configurations and the backward's programs per SM")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (use --dry-run on CPU)")
    if args.sweep_reduce:
        return sweep_reduce(args.rows, args.hidden)
    if args.sweep is not None:
        return sweep(args.rows, args.hidden, args.sweep or SWEEP_KINDS, args.stages)

    all_results = []
    for mode in ("rms", "add+rms"):
        for H in args.hidden:
            res = bench(mode, args.rows, H, not args.no_inductor, with_liger=True, weight_grad=not args.frozen_weight)
            for name, r in res.items():
                all_results.append(dict(mode=mode, rows=args.rows, hidden=H, provider=name, **r))
            print(f"{mode} H={H}: " + ", ".join(f"{n} {r['ms'] * 1e3:.0f}us" for n, r in res.items()), flush=True)

    peak_gbps = DEVICE_COPY_TBPS * 1e3
    print(f"\n{harness.hardware()}, bf16, rows={args.rows}, fwd+bwd "
          f"{'without dW (frozen weight)' if args.frozen_weight else 'with dW'}; "
          f"% = share of {DEVICE_COPY_TBPS} TB/s; x = speed-up of fastgrpo over the provider\n")
    cells = []
    for r in all_results:
        ours = next(o for o in all_results if o["mode"] == r["mode"] and o["hidden"] == r["hidden"]
                    and o["provider"] == "fastgrpo")
        r["fastgrpo_speedup"] = r["ms"] / ours["ms"]
        r["fastgrpo_speedup_cudagraph"] = r["ms_cudagraph"] / ours["ms_cudagraph"]
        cells.append((r["mode"], r["hidden"], r["provider"], f"{r['ms']:.4f}", f"{r['gbps']:.0f}",
                      f"{100 * r['gbps'] / peak_gbps:.0f}", f"{r['ms_cudagraph']:.4f}", f"{r['gbps_cudagraph']:.0f}",
                      f"{100 * r['gbps_cudagraph'] / peak_gbps:.0f}", f"{r['peak_extra_mib']:.0f}",
                      f"{r['fastgrpo_speedup']:.2f}", f"{r['fastgrpo_speedup_cudagraph']:.2f}"))
    print(harness.markdown_table(("mode", "H", "provider", "ms", "GB/s", "% peak", "ms (CUDA graph)", "GB/s (graph)",
                                  "% peak (graph)", "extra peak MiB", "fastgrpo x", "fastgrpo x (graph)"), cells))
    rows = [dict(frozen_weight=args.frozen_weight, torch=torch.__version__, **r) for r in all_results]
    print(f"rows appended to {harness.record('bench_rms_norm', rows)}")


if __name__ == "__main__":
    main()
