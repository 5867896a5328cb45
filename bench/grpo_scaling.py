"""GRPO step throughput from 1 to N GPUs: the fastgrpo step of bench/grpo_step.py under DDP (LoRA parameters).

Each rank builds the Qwen2.5-1.5B-shaped LoRA policy of grpo_step.py (decoder layers compiled with the fastgrpo
backend) and runs the GRPO policy-loss step on its own batch of G=8 completions of a 256-token prompt. One
process: grpo_step's own step, no DDP. Several: the decoder wrapped in DistributedDataParallel, so the LoRA
gradients are all-reduced during the backward. Prints tokens/s over all ranks (the slowest rank's median step
sets the pace), each rank's peak memory, and the scaling efficiency tokens/s(N) / (N * tokens/s(1)), with the
1-process numbers taken from the latest 1-process rows of --baseline (default bench/results/grpo_scaling.jsonl) on
this hardware or, with --local-baseline, measured in the same launch by running the step without DDP on every rank
first. Each DDP record also times one all-reduce of as many bytes as the trainable gradients (what DDP moves per
step, overlapped with the backward where the buckets allow).

    torchrun --nproc_per_node 1 bench/grpo_scaling.py --completions 1024,4096
    torchrun --nproc_per_node 2 bench/grpo_scaling.py --completions 1024,4096      # against the 1-process rows
    torchrun --nproc_per_node 2 bench/grpo_scaling.py --tiny --inner aot_eager       # CPU, gloo: the script runs

Each run appends its records to bench/results/grpo_scaling.jsonl (rank 0; not with --tiny).
"""
import os

# Required on the GPU host (see ../shared KINDS.md): no NVLink SHARP / multicast in NCCL and symmetric memory.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
import grpo_step  # noqa: E402  (the workload: build_policy, make_step, grpo_loss, PROMPT, GROUP)


def ddp_step(ddp_decoder, head: torch.Tensor, completion: int):
    """grpo_step.make_step("fastgrpo") with the decoder called through its DDP wrapper (which syncs gradients)."""
    from fastgrpo.kernels.selective_logprob import selective_logprob

    def step(ids, mask, adv):
        hidden = ddp_decoder(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1 : -1]
        grpo_step.grpo_loss(selective_logprob(hidden, head, ids[:, -completion:]), mask, adv).backward()

    return step


def time_step(step, model, completion: int, vocab: int, device, warmup: int, repeat: int, rank: int) -> dict:
    """Median step time on this rank (after warm-up) and its peak memory; bf16 autocast like grpo_step.py."""
    step = grpo_step.with_mixed_precision(step, device)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch
    ids = torch.randint(0, vocab, (grpo_step.GROUP, grpo_step.PROMPT + completion), generator=generator).to(device)
    mask = torch.ones(grpo_step.GROUP, completion, device=device)
    adv = torch.randn(grpo_step.GROUP, generator=generator).to(device)
    grpo_step.timed_steps(step, (ids, mask, adv), model, warmup)
    harness.reset_peak()
    # Every rank starts each step together, so a rank's time includes waiting in the all-reduce.
    times = grpo_step.timed_steps(step, (ids, mask, adv), model, repeat, before_each=dist.barrier)
    return {"ms": statistics.median(times), "peak_gib": harness.peak_gib()}


def allreduce_ms(params, device, repeat: int = 10) -> float:
    """Median time of one all-reduce of a buffer as large as the trainable gradients: the bytes DDP moves a step."""
    buffer = torch.zeros(sum(p.numel() for p in params), device=device)
    times = []
    for _ in range(repeat + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        harness.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def summarize(per_rank: list[dict], world: int, completion: int, ddp: bool) -> dict:
    ms = max(r["ms"] for r in per_rank)
    tokens = world * grpo_step.GROUP * (grpo_step.PROMPT + completion)
    peaks = [r["peak_gib"] for r in per_rank]
    return {
        "gpus": world, "completion": completion, "ddp": ddp, "step_ms": round(ms, 1),
        "rank_ms": [round(r["ms"], 1) for r in per_rank], "tokens_per_s": round(tokens / ms * 1e3),
        "peak_gib": [None if p is None else round(p, 2) for p in peaks],
    }  # fmt: skip


def efficiency(record: dict, baseline: dict | None) -> float | None:
    if baseline is None:
        return None
    return record["tokens_per_s"] / (record["gpus"] * baseline["tokens_per_s"])


def load_baselines(path, shape: str, tiny: bool) -> dict[int, dict]:
    """The latest 1-process rows of a JSON-lines results file on this hardware, by completion length."""
    if not os.path.exists(path):
        return {}
    here = harness.hardware()
    return {r["completion"]: r for r in harness.read_rows(path)
            if r["gpus"] == 1 and not r["ddp"] and r.get("hardware") == here and r.get("shape") == shape
            and r.get("tiny") == tiny and not r.get("concurrent_ranks")}


def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        peaks = ", ".join("-" if p is None else f"{p}" for p in r["peak_gib"])
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f} (vs {r['baseline']})"
        rows.append((r["gpus"], r["completion"], "yes" if r["ddp"] else "no", f"{r['step_ms']:.0f}", r["tokens_per_s"],
                     peaks, eff, r.get("allreduce_ms", "-")))
    return harness.markdown_table(("GPUs", "completion", "DDP", "step ms (slowest rank)", "tokens/s (all ranks)",
                                   "peak GiB per rank", "scaling efficiency", "all-reduce of the LoRA gradients, ms"),
                                  rows)


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    parser.add_argument("--completions", default="1024,4096")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="grpo_step's 2-layer model: checks the script (CPU + gloo is fine)")
    parser.add_argument("--baseline", default=str(harness.results_path("grpo_scaling")), metavar="JSONL",
                        help="results whose latest 1-process rows (this hardware and shape) the DDP rows are compared "
                             "against (default %(default)s)")
    parser.add_argument("--local-baseline", action="store_true",
                        help="also time the step without DDP on every rank first, as the 1-process baseline")
    parser.add_argument("--inner", choices=["inductor", "aot_eager", "eager"],
                        help="the fastgrpo backend's inner compiler (default: grpo_step's, i.e. inductor)")
    args = parser.parse_args(argv)
    completions = [int(c) for c in args.completions.split(",")]

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)  # build_policy allocates on the current device
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    model = grpo_step.build_policy("fastgrpo", grpo_step.PROMPT + max(completions) + 8, args.tiny, args.shape)
    base = model.get_base_model()
    if args.inner is not None:
        import fastgrpo

        fastgrpo.compile_repeated_blocks(base, options={"inner": args.inner}, dynamic=grpo_step.DYNAMIC)
    vocab, head = model.config.vocab_size, base.get_output_embeddings().weight
    ddp = None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # Only the LoRA parameters train, so only they are all-reduced; the rotary buffers are the same on every
        # rank and need no broadcast each step. Wrapping broadcasts rank 0's weights once.
        ddp = DistributedDataParallel(base.get_decoder(), device_ids=[local_rank] if cuda else None,
                                      broadcast_buffers=False, gradient_as_bucket_view=True)  # fmt: skip

    trainable = [p for p in model.parameters() if p.requires_grad]
    baselines = {} if args.local_baseline else load_baselines(args.baseline, args.shape, args.tiny)
    records = []
    for completion in completions:
        plain = grpo_step.make_step("fastgrpo", model, completion)
        if world == 1 or args.local_baseline:
            result = summarize(gather(time_step(plain, model, completion, vocab, device, args.warmup, args.repeat, rank)),
                               world, completion, ddp=False)  # fmt: skip
            if world > 1:
                # Every rank ran alone (no all-reduce): the per-GPU baseline, timed in this launch.
                result.update(gpus=1, tokens_per_s=round(result["tokens_per_s"] / world), concurrent_ranks=world)
            baselines.setdefault(completion, result)
            records.append(result)
        if ddp is not None:
            step = ddp_step(ddp, head, completion)
            result = summarize(gather(time_step(step, model, completion, vocab, device, args.warmup, args.repeat, rank)),
                               world, completion, ddp=True)  # fmt: skip
            result["allreduce_ms"] = round(max(gather(allreduce_ms(trainable, device))), 2)
            records.append(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for record in records:
        baseline = baselines.get(record["completion"])
        if record["gpus"] > 1 and baseline is not None:
            record["efficiency"] = round(efficiency(record, baseline), 3)
            record["baseline"] = "same launch" if baseline.get("concurrent_ranks") else baseline.get("commit", "--baseline")

    if rank == 0:
        import fastgrpo

        matched = {}
        for report in fastgrpo.fusion_reports():
            for name, rec in report["patterns"].items():
                matched[name] = matched.get(name, 0) + rec["matched"]
        print(f"fastgrpo (rank 0): {len(fastgrpo.fusion_reports())} graphs compiled, sites matched: {matched}")
        for record in records:
            record.update(shape=args.shape, tiny=args.tiny)
            harness.emit(record)
        if not args.tiny:
            print(f"rows appended to {harness.record('grpo_scaling', records)}")
        print(table(records))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
