"""Decode-step QLoRA linears: fastgrpo::nf4_lora_linear against bitsandbytes + PEFT and against the bytes floor.

For a named shape's projections (q, k/v, o, gate/up, down) at decode row counts, GPU time of one call replayed in a
CUDA graph, for
- fastgrpo: `nf4_lora_linear`, one launch: the packed NF4 weight read as it is, the LoRA product added in the kernel;
- bnb+peft: PEFT's LoRA layer over a bitsandbytes `Linear4bit`, as QLoRA rollouts run it (bitsandbytes' own 4-bit
  forward, then lora_B(lora_A(x)) in the adapters' dtype, scaled and added);
- floor: the bytes the call must move, at the measured copy rate (bench/_harness.py COPY_TBPS): the packed weight,
  its uint8 block codes and nested scales, x, A and B read once and the output written once.
QLoRA's defaults: NF4, blocksize 64, double quantization, bf16 compute; fp32 adapters of rank 16 (PEFT's), scaling 2.

Each timed call runs a whole rotation of distinct layers (`--copies` at least, more where needed for the
rotation's packed weights to fill twice the L2 cache), and the time is divided by the rotation's length: one layer
reused would be served from the 50-60 MB L2, not HBM.

    python bench/bench_nf4_linear.py                   # GPU: qwen2.5-1.5b, rows 8 16 64
    python bench/bench_nf4_linear.py --rows 8 --rank 64
    python bench/bench_nf4_linear.py --sweep           # GPU: the kernel's launch settings at each projection and
                                                       # row count (columns a tile, warps, programs per SM) in
                                                       # both forms (register table, joined)
    python bench/bench_nf4_linear.py --sweep lut       # GPU: the launch settings in one form (lut or joined)
    python bench/bench_nf4_linear.py --rows 8 --sweep lut --warps 4 --per-sm 2 4 --projections gate/up
    python bench/bench_nf4_linear.py --rows 8 --sweep lut --warps 4 --block-n 64 --ahead 0 2 3
    python bench/bench_nf4_linear.py --sweep forms     # GPU: the launch as it is in each form
    python bench/bench_nf4_linear.py --tiny            # CPU smoke: tiny projections, the torch paths, no rows kept
Every swept setting's output is checked against bitsandbytes + PEFT before it is timed. Rows are appended to
bench/results/bench_nf4_linear.jsonl (not with --tiny).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import _harness as harness  # noqa: E402
from fastgrpo.kernels import nf4_lora_linear as nf4_module  # noqa: E402
from fastgrpo.kernels.nf4_lora_linear import launch_config, nf4_lora_linear, quant_state_args  # noqa: E402

BLOCKSIZE = 64
SCALING = 2.0
DEFAULT_L2_BYTES = 50 * 2**20


def projections(shape: str, tiny: bool = False) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the shape's linears."""
    heads, kv_heads, head_dim = harness.attention_shape(shape)
    hidden, inter = harness.mlp_shape(shape)
    if tiny:
        hidden, inter, heads, kv_heads, head_dim = (harness.TINY["hidden_size"], harness.TINY["intermediate_size"],
                                                    2, 1, harness.TINY["hidden_size"] // 2)
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q": (q, hidden), "k/v": (kv, hidden), "o": (hidden, q), "gate/up": (inter, hidden),
            "down": (hidden, inter)}


def lora_layer(n: int, k: int, rank: int, device: str):
    """PEFT's LoRA layer (rank `rank`, fp32 adapters, scaling SCALING) over a bf16-compute NF4 `Linear4bit`."""
    import bitsandbytes as bnb
    import peft

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                                          quant_type="nf4")
            self.proj.support_avx512bf16_for_cpu = False  # CPU smoke: keep bitsandbytes' layout

        def forward(self, x):
            return self.proj(x)

    config = peft.LoraConfig(r=rank, lora_alpha=int(SCALING * rank), lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["proj"])
    model = peft.get_peft_model(Block().to(device), config)  # .to quantizes
    model.eval()
    return model.base_model.model.proj


def _layer_args(layer):
    """(packed weight, quantization and LoRA arguments, bias) of `layer`, taken once (what an integration keeps)."""
    base = layer.get_base_layer()
    kwargs = quant_state_args(base.weight.quant_state)
    kwargs.update(lora_a=layer.lora_A["default"].weight, lora_b=layer.lora_B["default"].weight,
                  scaling=float(layer.scaling["default"]))
    return base.weight.data, kwargs, base.bias


def _ours_call(layer):
    packed, kwargs, bias = _layer_args(layer)
    return lambda x: nf4_lora_linear(x, packed, **kwargs, bias=bias)


def floor_bytes(m: int, n: int, k: int, rank: int) -> int:
    blocks = n * k // BLOCKSIZE
    return n * k // 2 + blocks + 4 * -(-blocks // 256) + 2 * m * k + 4 * rank * (n + k) + 2 * m * n


def rotation(per_copy: int, args) -> int:
    """Distinct copies a timed call rotates through: at least --copies, and enough for their weights to fill twice
    the L2 cache (two with --tiny)."""
    return 2 if args.tiny else min(512, max(args.copies, -(-2 * l2_bytes() // per_copy)))


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", DEFAULT_L2_BYTES) or DEFAULT_L2_BYTES
    return DEFAULT_L2_BYTES


# (columns a tile, warps) pairs (4 and 8 warps: those whose sm_90 code spilled nothing; BN 128 at 4 warps spilled; 2
# warps added unchecked) x pipeline stages x programs per SM (--warps, --block-n, --stages and --per-sm choose among
# them), in either form: the register table's even/odd products (lut) or the weight's columns joined.
FORMS = {"lut": True, "joined": False}
TILES = ((32, 2), (64, 2), (32, 4), (64, 4), (64, 8), (128, 8))


def launches(args) -> list[dict]:
    return [dict(block_n=bn, warps=w, stages=s, per_sm=ps, ahead=a) for bn, w in TILES
            if w in args.warps and (not args.block_n or bn in args.block_n) for s in args.stages for ps in args.per_sm
            for a in args.ahead]


def sweep_settings(config: dict):
    """Both row bands' tile settings take the config's (`tile_settings` picks one by the row count)."""
    return [(nf4_module, "_BLOCK_N", config["block_n"]), (nf4_module, "_FEW_ROWS_BLOCK_N", config["block_n"]),
            (nf4_module, "_PROGRAMS_PER_SM", config["per_sm"]),
            (nf4_module, "_FEW_ROWS_PROGRAMS_PER_SM", config["per_sm"]), (nf4_module, "_NUM_WARPS", config["warps"]),
            (nf4_module, "_NUM_STAGES", config["stages"]), (nf4_module, "_FEW_ROWS_LUT", config["lut"]),
            (nf4_module, "_LUT", config["lut"]), (nf4_module, "_LUT_AHEAD", config["ahead"]),
            (nf4_module, "_JOINED_AHEAD", config["ahead"])]


def _name(config: dict) -> str:
    return (f"{config['block_n']}/{config['warps']}/{config['stages']}/{config['per_sm']}"
            + (" lut" if config["lut"] else " joined") + (f" ahead {config['ahead']}" if config["ahead"] else ""))


def sweep(ours, check, name: str, n: int, k: int, m: int, copies: int, args) -> dict:
    """GPU time per call of each swept setting (the rotation `ours`), fastest first, each setting's output checked
    first (`check()`); one row for the results. `args.sweep`: all (`launches` in both forms), a form's name (`launches`
    in it), or forms (the launch as it is, in each form)."""
    block_n, per_sm, _ = nf4_module.tile_settings(m)
    if args.sweep == "forms":
        configs = [dict(block_n=block_n, warps=nf4_module._NUM_WARPS, stages=nf4_module._NUM_STAGES, per_sm=per_sm,
                        lut=lut, ahead=nf4_module._LUT_AHEAD if lut else nf4_module._JOINED_AHEAD)
                   for lut in FORMS.values()]
    else:
        forms = FORMS.values() if args.sweep == "all" else [FORMS[args.sweep]]
        configs = [dict(launch, lut=lut) for lut in forms for launch in launches(args)]
    for config in configs:
        with harness.patched(*sweep_settings(config)):
            check(f"{name} rows {m} at {_name(config)}")
    now, timings = harness.time_launch_configs(ours, configs, sweep_settings, rep=20)
    best_ms, best = timings[0]
    print(f"{name} {n}x{k} rows {m}: now {now * 1e3 / copies:.1f} us, best {best_ms * 1e3 / copies:.1f} us at {best}; "
          + ", ".join(f"{_name(c)}: {t * 1e3 / copies:.1f}" for t, c in timings))
    return dict(shape=args.shape, projection=name, rows=m, n=n, k=k, rank=args.rank, copies=copies, sweep=True,
                now_us=now * 1e3 / copies, best_us=best_ms * 1e3 / copies, best=best,
                timings_us={_name(c): t * 1e3 / copies for t, c in timings})


def main(argv=None):
    p = harness.argument_parser(__doc__)
    p.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--copies", type=int, default=8, help="distinct layers a timed call rotates through, at least")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny projections, two copies, no rows kept")
    p.add_argument("--sweep", nargs="?", const="all", choices=["all", "forms", *FORMS],
                   help="time the kernel's launch settings (GPU): in both forms (all), in one (lut, joined), or the "
                   "launch as it is in each form (forms)")
    p.add_argument("--projections", nargs="+", help="only these projections (default: all the shape's)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="--sweep: the warps of the swept tiles")
    p.add_argument("--block-n", type=int, nargs="+", help="--sweep: only tiles of these widths")
    p.add_argument("--stages", type=int, nargs="+", default=[3], help="--sweep: pipeline stages")
    p.add_argument("--per-sm", type=int, nargs="+", default=[2, 4, 8], help="--sweep: programs an SM")
    p.add_argument("--ahead", type=int, nargs="+", default=[0], choices=[0, 2, 3],
                   help="--sweep: steps ahead the packed bytes are carried (0: loaded in the step; the joined form "
                   "takes at least 2)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        sys.exit("needs a CUDA device (or --tiny for a CPU smoke run)")
    device = "cuda" if cuda else "cpu"
    if args.tiny:
        torch.set_num_threads(1)  # tiny CPU matmuls: more threads only contend
    torch.manual_seed(0)
    bandwidth = harness.COPY_TBPS * 1e12
    rows_out = []
    for name, (n, k) in projections(args.shape, args.tiny).items():
        if args.projections and name not in args.projections:
            continue
        per_copy = floor_bytes(0, n, k, args.rank)
        copies = rotation(per_copy, args)
        layers = [lora_layer(n, k, args.rank, device) for _ in range(copies)]
        ours_calls = [_ours_call(layer) for layer in layers]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                want = layers[0](x).float()

                def check(what):
                    got = ours_calls[0](x).float()
                    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
                    assert err < 3e-2, f"{what}: fastgrpo and bitsandbytes + PEFT differ by {err:.3g} (relative)"
                    return err

                err = check(f"{name} rows {m}")

                def ours():
                    for call in ours_calls:
                        call(x)

                def bnb_peft():
                    for layer in layers:
                        layer(x)

                if args.sweep and cuda:
                    row = sweep(ours, check, name, n, k, m, copies, args)
                    harness.emit(row)
                    rows_out.append(row)
                    continue
                ours_us = harness.graph_ms(ours) * 1e3 / copies
                bnb_us = harness.graph_ms(bnb_peft) * 1e3 / copies
            floor_us = floor_bytes(m, n, k, args.rank) / bandwidth * 1e6
            config = launch_config(m, n, k, BLOCKSIZE, x.device)
            row = dict(shape=args.shape, projection=name, rows=m, n=n, k=k, rank=args.rank, copies=copies,
                       fastgrpo_us=ours_us, bnb_peft_us=bnb_us, floor_us=floor_us,
                       share_of_floor=floor_us / ours_us, speedup=bnb_us / ours_us, splits=config["splits"],
                       max_rel_err=err)
            harness.emit(row)
            rows_out.append(row)
    print(f"\n{args.shape}{' (tiny, CPU: times mean nothing)' if args.tiny else ''}, bf16 x, NF4 blocksize "
          f"{BLOCKSIZE} double-quantized, fp32 LoRA r={args.rank}; CUDA-graph replay per call; floor: bytes at "
          f"{harness.COPY_TBPS} TB/s\n")
    print(harness.md_header("projection", "N x K", "rows", "splits", "copies", "fastgrpo us", "bnb+peft us",
                            "floor us", "share of floor", "bnb+peft / fastgrpo"))
    for r in (r for r in rows_out if not r.get("sweep")):
        print(harness.md_row(r["projection"], f"{r['n']}x{r['k']}", r["rows"], r["splits"], r["copies"],
                             f"{r['fastgrpo_us']:.1f}", f"{r['bnb_peft_us']:.1f}", f"{r['floor_us']:.2f}",
                             f"{100 * r['share_of_floor']:.0f} %", f"{r['speedup']:.2f}x"))
    if not args.tiny:
        harness.record("bench_nf4_linear", rows_out, argv)
    return rows_out


if __name__ == "__main__":
    main()
