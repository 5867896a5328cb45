"""One GRPO policy-loss step (forward + backward) on the anchor workload of DESIGN.md §4.

Qwen2.5-1.5B shape, random bf16 weights, LoRA r=16 on q,k,v,o,gate,up,down, non-reentrant
gradient checkpointing, G=8 completions of a 256-token prompt, TRL's per-sequence-mean GRPO
loss with beta=0. Systems (each in this process, one after another):
  eager     TRL's way: full logits, per-row bf16 log_softmax + gather
  inductor  the same, decoder layers compiled by inductor (one region per layer)
  liger     Liger rope/rms_norm/swiglu + LigerFusedLinearGRPOLoss on hidden states
  fastgrpo  decoder layers compiled with backend="fastgrpo" + fastgrpo::selective_logprob
Unsloth runs separately (bench/peers/unsloth_step.py, its own site-packages); pass its
JSON lines with --merge to print one table with ratios.

    python bench/grpo_step.py --systems eager,inductor,liger,fastgrpo --completions 1024,4096,16384
    python bench/grpo_step.py --merge $OUT/grpo_step.jsonl $OUT/unsloth_step.jsonl
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

PROMPT, GROUP, LORA_RANK = 256, 8, 16
DYNAMIC = True  # one compile serves every completion length


def qwen25_15b_config(max_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=max_len, rope_theta=1e6,
        tie_word_embeddings=True, use_cache=False, torch_dtype="bfloat16",
    )


def build_policy(system: str, max_len: int, tiny: bool):
    import peft
    from transformers import AutoModelForCausalLM

    if system == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    config = qwen25_15b_config(max_len)
    if tiny:
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=512))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    base = model.get_base_model()
    if system == "inductor":
        from fastgrpo.compiler.regions import repeated_blocks

        for block in repeated_blocks(base):
            block.compile(dynamic=DYNAMIC)
    elif system == "fastgrpo":
        import fastgrpo

        fastgrpo.compile_repeated_blocks(base, dynamic=DYNAMIC)
    return model


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """TRL's "grpo" loss with beta=0 and one iteration: per-sequence mean of -ratio * advantage."""
    ratio = torch.exp(logps - logps.detach())
    per_token = -ratio * advantages[:, None]
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def selective_log_softmax_bf16(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's bf16 path: log_softmax row by row, then gather."""
    rows = [torch.log_softmax(lg, dim=-1).gather(-1, ix.unsqueeze(-1)).squeeze(-1) for lg, ix in zip(logits, index)]
    return torch.stack(rows)


def make_step(system: str, model, completion: int):
    base = model.get_base_model()
    head = base.get_output_embeddings().weight

    if system in ("eager", "inductor"):
        def step(ids, mask, adv):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=completion + 1).logits[:, :-1]
            logps = selective_log_softmax_bf16(logits, ids[:, -completion:])
            grpo_loss(logps, mask, adv).backward()
    elif system == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            out = loss_fn(hidden, head, ids[:, -completion:], mask, adv)
            (out[0] if isinstance(out, tuple) else out).backward()
    elif system == "fastgrpo":
        from fastgrpo.kernels.selective_logprob import selective_logprob

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            grpo_loss(selective_logprob(hidden, head, ids[:, -completion:]), mask, adv).backward()
    else:
        raise ValueError(f"unknown system {system!r}")
    return step


def run(system: str, completions: list[int], warmup: int, repeat: int, tiny: bool) -> list[dict]:
    results = []
    try:
        model = build_policy(system, PROMPT + max(completions) + 8, tiny)
    except Exception as err:  # e.g. a peer that is not installed
        for completion in completions:
            result = {"system": system, "completion": completion, "error": f"{type(err).__name__}: {str(err)[:200]}"}
            print("RESULT " + json.dumps(result), flush=True)
            results.append(result)
        return results
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    for completion in completions:
        result = {"system": system, "completion": completion, "ms_median": None, "ms_all": [], "peak_gib": None,
                  "tokens_per_s": None, "error": None}
        try:
            torch.manual_seed(0)
            ids = torch.randint(0, vocab, (GROUP, PROMPT + completion), device=device)
            mask = torch.ones(GROUP, completion, device=device)
            adv = torch.randn(GROUP, device=device)
            step = make_step(system, model, completion)
            for _ in range(warmup):
                step(ids, mask, adv)
                model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                step(ids, mask, adv)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
                model.zero_grad(set_to_none=True)
            median = statistics.median(times)
            result.update(ms_median=round(median, 1), ms_all=[round(t, 1) for t in times],
                          tokens_per_s=round(GROUP * (PROMPT + completion) / median * 1e3))
            if device.type == "cuda":
                result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except torch.OutOfMemoryError:
            result["error"] = "OOM"
        except Exception as err:  # a failing system must not hide the others' numbers
            result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print("RESULT " + json.dumps(result), flush=True)
        results.append(result)
    if system == "fastgrpo":
        import fastgrpo

        matched = {}
        for report in fastgrpo.fusion_reports():
            for name, rec in report["patterns"].items():
                matched[name] = matched.get(name, 0) + rec["matched"]
        print(f"fastgrpo: {len(fastgrpo.fusion_reports())} graphs compiled, sites matched per graph: {matched}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def table(results: list[dict]) -> str:
    by = {(r["system"], r["completion"]): r for r in results}
    systems = [s for s in ("eager", "inductor", "liger", "unsloth", "fastgrpo") if any(k[0] == s for k in by)]
    lines = ["| completion | " + " | ".join(systems) + " | fastgrpo tok/s vs unsloth | fastgrpo mem vs unsloth | vs inductor tok/s | vs liger mem |",
             "|---" * (len(systems) + 5) + "|"]
    for completion in sorted({k[1] for k in by}):
        cells = []
        for s in systems:
            r = by.get((s, completion))
            if r is None:
                cells.append("-")
            elif r["error"]:
                cells.append(r["error"][:40])
            else:
                cells.append(f"{r['ms_median']:.0f} ms, {r['peak_gib']} GiB, {r['tokens_per_s']} tok/s")

        def ratio(a, b, key, invert=False):
            ra, rb = by.get((a, completion)), by.get((b, completion))
            if not ra or not rb or ra["error"] or rb["error"] or not ra[key] or not rb[key]:
                return "-"
            return f"{(rb[key] / ra[key] if invert else ra[key] / rb[key]):.2f}x"

        cells += [ratio("fastgrpo", "unsloth", "tokens_per_s"), ratio("fastgrpo", "unsloth", "peak_gib"),
                  ratio("fastgrpo", "inductor", "tokens_per_s"), ratio("fastgrpo", "liger", "peak_gib")]
        lines.append(f"| {completion} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="eager,inductor,liger,fastgrpo")
    parser.add_argument("--completions", default="1024,4096,16384")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script runs (CPU is fine)")
    parser.add_argument("--merge", nargs="*", help="JSON-lines files to merge into one table instead of running")
    args = parser.parse_args()
    if args.merge is not None:
        results = [json.loads(line.removeprefix("RESULT ")) for path in args.merge for line in open(path) if line.strip()]
        print(table(results))
        return 0
    completions = [int(c) for c in args.completions.split(",")]
    results = []
    for system in args.systems.split(","):
        results += run(system, completions, args.warmup, args.repeat, args.tiny)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grpo_step.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
