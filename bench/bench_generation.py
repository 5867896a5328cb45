"""Rollout speed: fastgrpo's EmbeddedGenerator against the bytes a decode step must read, and against model.generate.

Default (GPU): a random-init Qwen2.5-1.5B shape in bf16 with a PEFT LoRA r=16 adapter active on every projection
(fp32 factors, as TRL keeps them), sampling at temperature 1, 256-token prompts, these cases (rows x new tokens):
64x256, 128x512, 256x1024, and `spread`: 128 rows of up to 1024 tokens whose lengths spread over the range (the EOS
logit is raised so that rows end at random, geometric lengths with a mean near half the maximum). Without the
spread, the EOS id lies outside the vocabulary and every row runs the full length.

`--generations G` gives each prompt to G adjacent rows, as GRPO's groups do (default 1: every row its own prompt).

The limit of a case: every decode step reads the weights once, each running row's written completion KV once and each
running group's prompt KV once, at the device's copy rate (measured at the start: ~4.3 TB/s on an H200, ~3.0 on an
H100), plus the prefill's matmuls (one row per distinct prompt) at 790 TFLOP/s. tokens/s over the tokens/s that limit
allows is the share reported. Goals: >= 25k tokens/s at 64x256 and >= 35k (>= 40 % of the limit) at 128x512 with LoRA.

    python bench/bench_generation.py                            # GPU, the four cases
    python bench/bench_generation.py --cases 128x512 --hf       # also time model.generate on the first case
    python bench/bench_generation.py --shape gemma-3-1b         # sliding-window layers
    python bench/bench_generation.py --generations 8 --shared-prompt-slots 0   # GRPO groups, prompt copied per row
    python bench/bench_generation.py --tiny                     # CPU smoke run
Rows are appended to bench/results/bench_generation.jsonl (GPU runs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import _harness as harness  # noqa: E402
from bench.grpo_train_step import build_model  # noqa: E402
from fastgrpo.integrations.generation import EmbeddedGenerator  # noqa: E402
from fastgrpo.integrations.generation import adapters  # noqa: E402
from fastgrpo.integrations.generation import engine as engine_module  # noqa: E402
from fastgrpo.integrations.generation import sampling as sampling_module  # noqa: E402
from fastgrpo.integrations.generation.adapters import MERGE_MODES  # noqa: E402

MATMUL = harness.MATMUL_TFLOPS * 1e12
SPREAD_EOS_BIAS = 5.0  # added to the EOS logit in the spread case (lengths ~ geometric, mean ~ half of 1024)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES))
    p.add_argument("--cases", default="64x256,128x512,256x1024,spread", help="ROWSxNEW_TOKENS,... and/or spread")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank (0: no adapter)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per case (median reported)")
    p.add_argument("--hf", action="store_true", help="also time model.generate on the first case")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, short rows")
    p.add_argument("--profile", action="store_true",
                   help="after the first case, profile one call: GPU time by kernel, kernels per decode step")
    p.add_argument("--backend", default="inductor", help="the decode layer's compile backend (inductor, fastgrpo)")
    p.add_argument("--backend-options", type=json.loads, default=None,
                   help='its options as JSON, e.g. \'{"patterns": ["joined_projections"]}\' for fastgrpo')
    p.add_argument("--merge-lora", default="float", choices=MERGE_MODES,
                   help="LoRA layers decoded from merged weights (EmbeddedGenerator's merge_lora)")
    p.add_argument("--compile-sampling", type=int, default=1, help="0: the decode step's sampling runs eagerly")
    p.add_argument("--fused-sampling", type=int, default=None,
                   help="1/0: plain sampling through fastgrpo::race_sample or the eager race (sampling.FUSED; "
                   "default: as $FASTGRPO_FUSED_SAMPLING says)")
    p.add_argument("--join-qkv", type=int, default=1,
                   help="0: merged q, k and v decode as three GEMMs (adapters.JOIN_QKV off)")
    p.add_argument("--generations", type=int, default=1, help="rows a prompt is given to (GRPO's group size)")
    p.add_argument("--shared-prompt-slots", type=int, default=1,
                   help="0: a group's rows each get a copy of its prompt's KV (engine.SHARED_PROMPT_SLOTS off)")
    p.add_argument("--grouped-prompt", type=harness.grouped_mode, default="auto",
                   help="a group's prompt attended once a step for all its rows (engine.GROUPED_PROMPT_ATTENTION): 1 in "
                   "every layer, 0 in none, auto (default) where a token's KV is large")
    p.add_argument("--merge-kernel", type=int, default=1,
                   help="0: the LoRA merge runs PEFT's delta and torch's passes (adapters.MERGE_KERNEL off)")
    p.add_argument("--compact-cache", type=int, default=1,
                   help="0: every row keeps its prompt slots in the KV cache (engine.COMPACT_CACHE off)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="a module setting for this process, recorded in the rows (repeatable), e.g. "
                   "fastgrpo.kernels.decode_attention.NARROW_OFFSETS_MAX_DIM=0")
    args = p.parse_args(argv)
    if args.tiny:
        args.cases, args.prompt_len, args.repeats = "4x8,spread", 8, 1
    return args


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(model) -> tuple[int, int]:
    """(KV bytes a row reads per cached token, state bytes a row reads and writes per decode step), from the caches
    the engine holds after a call: only attention layers keep KV; linear-attention and state-space layers keep a
    fixed-size state instead (both 0 when the engine fell back)."""
    from fastgrpo.integrations.generation.recurrent import STATES_ATTRIBUTE

    kv = state = 0
    for module in model.modules():
        for cache in module.__dict__.get("_fastgrpo_kv") or ():
            rows, heads, slots, dim = cache.shape
            kv += heads * dim * cache.element_size()
        states = module.__dict__.get(STATES_ATTRIBUTE)
        if states is not None:
            state += states.bytes_per_row
    return kv, state


def cache_storage_gib(model) -> float:
    """GiB of the KV cache buffers the engine holds (each layer's keys and values; a compact layout's views overlap,
    their buffers do not)."""
    storages = {}
    for module in model.modules():
        for cache in module.__dict__.get("_fastgrpo_kv") or ():
            storages[cache.untyped_storage().data_ptr()] = cache.untyped_storage().nbytes()
    return sum(storages.values()) / 2**30


def expert_banks(model) -> list[tuple[int, int, int, int]]:
    """(bytes, parameters, experts, experts a token) of each mixture-of-experts bank: a module with `num_experts` whose
    own weights are [experts, ...] tensors, its config naming `num_experts_per_tok`."""
    banks = []
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        per_token = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        own = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] == experts]
        if isinstance(experts, int) and isinstance(per_token, int) and own:
            banks.append((sum(p.numel() * p.element_size() for p in own), sum(p.numel() for p in own), experts,
                          per_token))
    return banks


def limit_seconds(model, rows_lengths: list[int], prompt_len: int, kv_per_token: int, state_per_row: int,
                  generations: int = 1) -> float:
    """Weights read once per decode step, each running row's completion KV once, each running group's (the
    `generations` adjacent rows of one prompt) prompt KV once, each running row's states read and written once; the
    prefill's active parameters at the matmul rate, once per distinct prompt. An expert bank counts the experts that
    `running` rows are expected to pick (uniform routing: a share 1 - (1 - k/E)^running of its bytes) and, in the
    prefill, k/E of its parameters."""
    banks = expert_banks(model)
    dense = model_bytes(model) - sum(bank[0] for bank in banks)
    active = sum(p.numel() for p in model.parameters()) - sum(n - n * k / e for _, n, e, k in banks)
    steps = max(rows_lengths)
    seconds = 2 * active * -(-len(rows_lengths) // generations) * prompt_len / MATMUL
    bandwidth = harness.copy_tbps() * 1e12
    for t in range(1, steps):
        running = sum(1 for n in rows_lengths if n > t)
        groups = len({i // generations for i, n in enumerate(rows_lengths) if n > t})
        weights = dense + sum(size * (1 - (1 - k / e) ** running) for size, _, e, k in banks)
        kv = (groups * prompt_len + running * t) * kv_per_token
        seconds += (weights + kv + running * 2 * state_per_row) / bandwidth
    return seconds


def main(argv=None):
    args = parse_args(argv)
    adapters.JOIN_QKV = bool(args.join_qkv)
    engine_module.SHARED_PROMPT_SLOTS = bool(args.shared_prompt_slots)
    engine_module.GROUPED_PROMPT_ATTENTION = args.grouped_prompt
    engine_module.COMPACT_CACHE = bool(args.compact_cache)
    adapters.MERGE_KERNEL = bool(args.merge_kernel)
    settings = harness.apply_settings(args.set)
    if args.fused_sampling is not None:
        sampling_module.FUSED = bool(args.fused_sampling)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(args.shape, dtype, device, tiny=args.tiny).eval()
    vocab = model.config.get_text_config().vocab_size
    if args.lora:
        import peft

        config = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=PROJECTIONS,
                                 init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    decoder = model.get_base_model() if args.lora else model
    eos, pad = 1, 0
    g = torch.Generator().manual_seed(1)
    rows_out = []
    hf_done = False
    for case in args.cases.split(","):
        spread = case == "spread"
        rows, new = (128, 1024) if spread and not args.tiny else (4, 16) if spread else map(int, case.split("x"))
        distinct = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
                    for _ in range(-(-rows // args.generations))]
        prompts = [distinct[i // args.generations] for i in range(rows)]
        head = decoder.get_output_embeddings()
        hook = None
        if spread:  # raise the EOS logit so rows end at random
            def raise_eos(module, inputs, out):
                out[..., eos] += SPREAD_EOS_BIAS

            hook = head.register_forward_hook(raise_eos)
        generator = EmbeddedGenerator(model, pad, [eos if spread else vocab], new, compile_backend=args.backend,
                                      compile_options=args.backend_options, merge_lora=args.merge_lora,
                                      compile_sampling=bool(args.compile_sampling))
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        torch.manual_seed(0)
        sync()
        start = time.perf_counter()
        generator.generate(prompts)
        sync()
        first = time.perf_counter() - start
        times, lengths = [], []
        for _ in range(args.repeats):
            torch.manual_seed(0)
            sync()
            start = time.perf_counter()
            out = generator.generate(prompts)
            sync()
            times.append(time.perf_counter() - start)
            lengths = [len(row) for row in out]
        if args.profile and not rows_out:
            harness.kernel_profile(lambda: generator.generate(prompts), new - 1)
        if hook is not None:
            hook.remove()
        seconds = statistics.median(times)
        tokens = sum(lengths)
        limit = limit_seconds(decoder, lengths, args.prompt_len, *cache_bytes(decoder), args.generations)
        row = dict(path="EmbeddedGenerator", backend=args.backend, backend_options=args.backend_options, shape=args.shape, rows=rows, new_tokens=new, spread=spread,
                   mean_length=tokens / rows, lora=bool(args.lora), merge_lora=args.merge_lora if args.lora else None,
                   compile_sampling=bool(args.compile_sampling), fused_sampling=sampling_module.FUSED,
                   join_qkv=bool(args.join_qkv), prompt_len=args.prompt_len, generations=args.generations,
                   shared_prompt_slots=bool(args.shared_prompt_slots), grouped_prompt=args.grouped_prompt,
                   compact_cache=engine_module.COMPACT_CACHE, merge_kernel=adapters.MERGE_KERNEL, settings=settings,
                   cache_gib=cache_storage_gib(decoder),
                   seconds=seconds, copy_tbps=harness.copy_tbps(),
                   first_call_s=first, tokens_per_s=tokens / seconds, limit_tokens_per_s=tokens / limit,
                   share_of_limit=limit / seconds, fallback=generator.fallback,
                   batches=sorted(generator.engine._buffers.batches) if generator.engine else None,
                   lora_decoding=generator.lora_decoding)
        rows_out.append(row)
        harness.emit(row)
        generator.engine and generator.engine.release()
        if args.hf and not hf_done:
            hf_done = True
            ids = torch.tensor(prompts, device=device)
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_k=0, max_new_tokens=new, eos_token_id=vocab, pad_token_id=pad)
            sync()
            hf = time.perf_counter() - start
            row = dict(row, path="model.generate", seconds=hf, first_call_s=None, tokens_per_s=rows * new / hf,
                       share_of_limit=limit / hf, fallback=None, batches=None)
            rows_out.append(row)
            harness.emit(row)
    print(f"\n{args.shape}, {dtype}, {device}, LoRA r={args.lora} (merge_lora={args.merge_lora}), prompt "
          f"{args.prompt_len}, {args.generations} rows a prompt (shared slots: {bool(args.shared_prompt_slots)})\n")
    print("| path | rows x new | mean length | first call s | s | tokens/s | limit tokens/s | share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        first = "-" if r["first_call_s"] is None else f"{r['first_call_s']:.1f}"
        name = f"{r['rows']}x{r['new_tokens']}" + (" spread" if r["spread"] else "")
        print(f"| {r['path']} | {name} | {r['mean_length']:.0f} | {first} | {r['seconds']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['limit_tokens_per_s']:.0f} | {100 * r['share_of_limit']:.0f} % |")
    if device == "cuda":
        harness.record("bench_generation", rows_out, argv)


if __name__ == "__main__":
    main()
