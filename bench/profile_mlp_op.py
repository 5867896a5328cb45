"""Where the gated-MLP op's time goes on the GPU: one Qwen2.5-1.5B MLP layer of the GRPO step at 4096
completions (34,816 tokens), bf16 base and bf16 LoRA r=16 factors on gate, up and down (what autocast
runs), fwd+bwd. Times (CUDA events, median of 10) the op saving the projections with the down projection,
the op recomputing them, and the act_mul form as the trainer ran it before (base projections by cuBLAS,
LoRA as PEFT writes it, act_mul, down with LoRA) compiled by inductor; then prints torch.profiler's top
CUDA kernels of the saving op.

    python bench/profile_mlp_op.py [--tokens 34816]
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fastgrpo.kernels.gated_mlp import act_mul, gated_mlp  # noqa: E402

HIDDEN, INTER, RANK, SCALE = 1536, 8960, 16, 2.0


def inputs(tokens):
    def rand(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda") * std).to(torch.bfloat16)

    x = rand(tokens, HIDDEN).requires_grad_()
    wg, wu, wd = rand(INTER, HIDDEN, std=HIDDEN**-0.5), rand(INTER, HIDDEN, std=HIDDEN**-0.5), rand(HIDDEN, INTER, std=INTER**-0.5)
    lora = [rand(RANK, HIDDEN, std=HIDDEN**-0.5), rand(INTER, RANK, std=0.01), rand(RANK, HIDDEN, std=HIDDEN**-0.5),
            rand(INTER, RANK, std=0.01), rand(RANK, INTER, std=INTER**-0.5), rand(HIDDEN, RANK, std=0.01)]
    return x, wg, wu, wd, [t.requires_grad_() for t in lora]


def op(save):
    def run(x, wg, wu, wd, lora):
        ga, gb, ua, ub, da, db = lora
        return gated_mlp(x, wg, wu, ga, gb, ua, ub, SCALE, "silu", wd, da, db, SCALE, save)
    return run


def _lora_linear(x, w, a, b):
    return F.linear(x, w) + F.linear(F.linear(x, a), b) * SCALE


def act_mul_form(x, wg, wu, wd, lora):
    ga, gb, ua, ub, da, db = lora
    return _lora_linear(act_mul(_lora_linear(x, wg, ga, gb), _lora_linear(x, wu, ua, ub), "silu"), wd, da, db)


def time_ms(fn, args, d_out, repeat=10):
    times = []
    for i in range(repeat + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        torch.autograd.grad(out, [args[0], *args[4]], d_out)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=34816)
    args = parser.parse_args()
    x, wg, wu, wd, lora = inputs(args.tokens)
    d_out = torch.randn(args.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    systems = {"op, saved projections + down": op(True), "op, recomputed + down": op(False),
               "act_mul form (inductor)": torch.compile(act_mul_form)}
    for name, fn in systems.items():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(fn, (x, wg, wu, wd, lora), d_out)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"RESULT {name}: {ms:.2f} ms fwd+bwd, peak +{peak:.2f} GiB")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_ms(op(True), (x, wg, wu, wd, lora), d_out, repeat=1)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
