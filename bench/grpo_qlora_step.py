"""The seed headline (issue 7): one full GRPO training step of a 4-bit QLoRA policy, peak GPU memory.

Qwen2.5-1.5B shape (bench/grpo_step.py's config) with random bf16 weights, its 7 projections per layer
quantized to 4-bit NF4 by bitsandbytes (as `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16)` loads them; embeddings, norms and the tied
lm-head stay bf16), PEFT LoRA r=16 on all 7 projections (adapters cast to bf16, as TRL does for QLoRA).
One step:
  generation  fastgrpo's EmbeddedGenerator samples G=8 completions of 768 tokens from one 256-token
              prompt (static KV cache; on CUDA the decode step is one CUDA graph); no EOS can end a row
              early, so every completion is full length;
  rewards     a toy reward per completion, advantages normalised within the group (TRL's formula);
  update      forward + backward of the GRPO loss (bench/grpo_step.py's fastgrpo system: decoder layers
              compiled one region each with backend="fastgrpo", log-probs from hidden states through
              fastgrpo::selective_logprob, non-reentrant checkpointing), then AdamW on the adapters.
  --offload   checkpointing with each layer's input in pinned host memory
              (compile_repeated_blocks(..., offload_checkpointing=True)).
Reported: torch.cuda.max_memory_allocated during generation and during the update (the model, the
generator's KV cache and the optimizer state are resident in both), their maximum (the step's peak), and
step times (the first step includes compilation; the rest are timed). Goal: peak <= 4 GB (Unsloth
advertises 5 GB for this model and recipe).

    python bench/grpo_qlora_step.py                  # H200, plain checkpointing
    python bench/grpo_qlora_step.py --offload        # offloaded checkpointing
    python bench/grpo_qlora_step.py --tiny           # CPU: a 2-layer model, short sequences
Writes $OUT/grpo_qlora_step.json (--offload: grpo_qlora_step_offload.json) when OUT is set.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _harness as harness  # noqa: E402
from grpo_step import GROUP, LORA_RANK, PROMPT, grpo_loss, qwen25_15b_config  # noqa: E402

import fastgrpo  # noqa: E402
from fastgrpo.compiler import compile_stats  # noqa: E402
from fastgrpo.compiler.cache import enable_compile_cache  # noqa: E402
from fastgrpo.compiler.offload import offload_handle  # noqa: E402
from fastgrpo.integrations.generation import EmbeddedGenerator  # noqa: E402
from fastgrpo.integrations.generation.adapters import MERGE_MODES  # noqa: E402
from fastgrpo.kernels.selective_logprob import selective_logprob  # noqa: E402

COMPLETION = 768
# Untimed steps: the first compiles, the second captures the ops' CUDA graphs (fastgrpo/kernels/_graphs.py captures at
# a key's second call), and the third's update still took 0.67-0.79 s against 0.21 s from the fourth on (one H100,
# `QLORA_ARGS="--steps 6" bash bench/device_session.sh qlora_ab`, bench/results/grpo_qlora_step.jsonl).
WARMUP_STEPS = 3
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GOAL_GB = 4.0  # issue 7's goal for the whole step (Unsloth: 5 GB)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=512)


def quantize_projections(model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> int:
    """Replace each projection's nn.Linear by a bitsandbytes Linear4bit holding its weight in NF4, quantized on
    `device` (what from_pretrained does with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    without writing a checkpoint to disk). Returns how many were replaced."""
    import bitsandbytes as bnb

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in PROJECTIONS or type(child) is not nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=compute_dtype, quant_type="nf4", device="meta")
            quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=False, module=quantized)
            if child.bias is not None:
                quantized.bias = nn.Parameter(child.bias.data, requires_grad=False)
            if device.type == "cpu":
                # bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks the weight for its inference kernel at the
                # first eval-mode no-grad forward (generation), for good; training forwards then take that
                # kernel's path, which has no autograd and fails ("a view of a leaf Variable ... in-place").
                quantized.support_avx512bf16_for_cpu = False
            setattr(parent, name, quantized.to(device))  # Params4bit quantizes when moved to a device
            replaced += 1
    model.is_loaded_in_4bit = True  # what PEFT reads to wrap Linear4bit in its bnb LoRA layer
    return replaced


def build_policy(tiny: bool, offload: bool, inner: str, device: torch.device):
    import peft
    from transformers import AutoModelForCausalLM

    config = qwen25_15b_config(PROMPT + COMPLETION + 64)
    if tiny:
        config.update(TINY)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    replaced = quantize_projections(model, torch.bfloat16, device)
    assert replaced == len(PROJECTIONS) * config.num_hidden_layers, replaced
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0, target_modules=list(PROJECTIONS)))
    for name, param in model.named_parameters():
        if param.requires_grad:  # TRL casts QLoRA adapters to bf16 (QLoRA paper, §3)
            param.data = param.data.to(torch.bfloat16)
    model.train()
    base = model.get_base_model()
    options = {"inner": inner}
    if offload:
        fastgrpo.compile_repeated_blocks(base, options=options, dynamic=True, offload_checkpointing=True)
        # As HF's checkpointing does (and the trainer with offloading): the first layer's input requires grad too,
        # so all layers share one compiled graph instead of the first compiling its own.
        model.enable_input_require_grads()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fastgrpo.compile_repeated_blocks(base, options=options, dynamic=True)
    return model


def toy_rewards(completions: list[list[int]]) -> torch.Tensor:
    """Share of even token ids: varies within the group, so the advantages are not all zero."""
    return torch.tensor([sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions])


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's advantages with one group: (r - mean) / (std + 1e-4)."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


class Step:
    def __init__(self, model, completion: int, prompt_len: int, generation_compile: bool | None,
                 merge_lora: str = "float"):
        self.model = model
        self.base = model.get_base_model()
        self.completion = completion
        vocab = model.config.vocab_size
        self.device = next(model.parameters()).device
        self.prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        # An id outside the vocabulary as EOS: never sampled, every row generates exactly `completion` tokens.
        self.pad = 0
        self.generator = EmbeddedGenerator(model, pad_token_id=self.pad, eos_token_ids=[vocab],
                                           max_new_tokens=completion, compile=generation_compile,
                                           merge_lora=merge_lora)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def generate(self) -> list[list[int]]:
        return self.generator.generate([self.prompt], temperature=1.0, num_generations=GROUP)

    def update(self, completions: list[list[int]]) -> float:
        advantages = group_advantages(toy_rewards(completions)).to(self.device)
        ids = torch.full((GROUP, self.completion), self.pad, dtype=torch.long)
        mask = torch.zeros(GROUP, self.completion)
        for row, completion in enumerate(completions):
            ids[row, : len(completion)] = torch.tensor(completion)
            mask[row, : len(completion)] = 1
        prompt = torch.tensor(self.prompt).expand(GROUP, -1)
        ids, mask = torch.cat([prompt, ids], dim=1).to(self.device), mask.to(self.device)
        head = self.base.get_output_embeddings().weight
        hidden = self.base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        hidden = hidden[:, -self.completion - 1 : -1]
        loss = grpo_loss(selective_logprob(hidden, head, ids[:, -self.completion :]), mask, advantages)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_and_reset(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inner = args.inner or ("inductor" if device.type == "cuda" else "eager")
    completion, prompt_len = (24, 16) if args.tiny else (COMPLETION, PROMPT)
    generation_compile = {"auto": None, "on": True, "off": False}[args.generation_compile]
    cache = enable_compile_cache(args.compile_cache)  # a second run loads what the first compiled
    start = time.perf_counter()
    model = build_policy(args.tiny, args.offload, inner, device)
    step = Step(model, completion, prompt_len, generation_compile, args.merge_lora)
    sync(device)
    build_s = time.perf_counter() - start
    model_bytes = torch.cuda.memory_allocated() if device.type == "cuda" else None
    fastgrpo.clear_fusion_reports()
    torch._dynamo.utils.counters.clear()
    compiling = compile_stats.snapshot()
    steps = []
    for index in range(args.steps):
        peak_and_reset(device)
        t0 = time.perf_counter()
        completions = step.generate()
        sync(device)
        t1 = time.perf_counter()
        generation_peak = peak_and_reset(device)
        loss = step.update(completions)
        sync(device)
        t2 = time.perf_counter()
        update_peak = peak_and_reset(device)
        lengths = [len(c) for c in completions]
        assert lengths == [completion] * GROUP, lengths
        steps.append({"step": index, "generation_s": round(t1 - t0, 3), "update_s": round(t2 - t1, 3),
                      "step_s": round(t2 - t0, 3), "loss": loss,
                      "generation_peak_bytes": generation_peak, "update_peak_bytes": update_peak})
        print("STEP " + json.dumps(steps[-1]), flush=True)
        if index == 0:  # what the first step spent compiling, and the compile cache's hits
            first_compile = compile_stats.since(compiling)
            print(first_compile.line(cache and cache.directory), flush=True)
    timed = steps[WARMUP_STEPS:] or steps[-1:]
    if args.profile:  # after the timed steps: one rollout's GPU time by kernel
        harness.kernel_profile(step.generate, completion - 1)
    reports = fastgrpo.fusion_reports()
    matched = {}
    for report in reports:
        for name, rec in report["patterns"].items():
            matched[name] = matched.get(name, 0) + rec["matched"]
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "tiny": args.tiny, "offload": args.offload, "inner": inner,
        "generation_compile": args.generation_compile, "merge_lora": args.merge_lora, "group": GROUP, "prompt": prompt_len, "completion": completion,
        "lora_rank": LORA_RANK, "build_s": round(build_s, 1), "model_bytes": model_bytes,
        "first_step_s": steps[0]["step_s"], "first_step_compile": first_compile.log_fields(),
        "generation_s": statistics.median(s["generation_s"] for s in timed),
        "update_s": statistics.median(s["update_s"] for s in timed),
        "step_s": statistics.median(s["step_s"] for s in timed),
        "steps": steps, "layer_graphs": len(reports), "sites_matched": matched,
        "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
        "lora_decoding": step.generator.lora_decoding,
    }
    if device.type == "cuda":
        generation_peak = max(s["generation_peak_bytes"] for s in timed)
        update_peak = max(s["update_peak_bytes"] for s in timed)
        result.update(generation_peak_gib=round(generation_peak / 2**30, 3), update_peak_gib=round(update_peak / 2**30, 3),
                      step_peak_gb=round(max(generation_peak, update_peak) / 1e9, 3),
                      step_peak_gib=round(max(generation_peak, update_peak) / 2**30, 3),
                      model_gib=round(model_bytes / 2**30, 3))
    handle = offload_handle(model)
    if handle is not None:
        result["offload_stats"] = vars(handle.stats).copy()
        result["host_gib"] = round(handle.stats.host_bytes / 2**30, 3)
    return result


def table(r: dict) -> str:
    gib = lambda key: f"{r[key]:.2f} GiB" if r.get(key) is not None else "-"  # noqa: E731
    goal = "-"
    if r.get("step_peak_gb") is not None:
        goal = f"{r['step_peak_gb']:.2f} GB ({'met' if r['step_peak_gb'] <= GOAL_GB else 'not met'}, goal <= {GOAL_GB} GB)"
    return "\n".join([
        "| checkpointing | model | generation peak | update peak | step peak | generation | update | step | first step |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {'offloaded' if r['offload'] else 'plain'} | {gib('model_gib')} | {gib('generation_peak_gib')} | "
        f"{gib('update_peak_gib')} | {goal} | {r['generation_s']:.2f} s | {r['update_s']:.2f} s | {r['step_s']:.2f} s | "
        f"{r['first_step_s']:.1f} s |",
        f"\nG={r['group']} x ({r['prompt']} prompt + {r['completion']} completion), LoRA r={r['lora_rank']}, 4-bit NF4 base, "
        f"inner={r['inner']}; layer graphs compiled: {r['layer_graphs']}, sites matched: {r['sites_matched']}, "
        f"graph breaks: {sum(r['graph_breaks'].values()) if r['graph_breaks'] else 0}"
        + (f", host buffers {r['host_gib']} GiB" if "host_gib" in r else "")
        + f"; LoRA layers decoded: {r.get('lora_decoding')}",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offload", action="store_true", help="offloaded checkpointing instead of plain")
    parser.add_argument("--steps", type=int, default=6,
                        help=f"steps to run; the first {WARMUP_STEPS} (compiling, capturing) are not timed")
    parser.add_argument("--inner", help="the fastgrpo backend's inner compiler (default: inductor on CUDA, eager on CPU)")
    parser.add_argument("--generation-compile", default="auto", choices=["auto", "on", "off"],
                        help="compile the decode step (auto: EmbeddedGenerator's default, CUDA graphs on CUDA)")
    parser.add_argument("--compile-cache", help="persistent compile cache directory, or 'off' (default: fastgrpo's, "
                        "$FASTGRPO_COMPILE_CACHE or ~/.cache/fastgrpo/compile); run twice for the warm first step")
    parser.add_argument("--merge-lora", default="float", choices=MERGE_MODES,
                        help="LoRA layers the generator decodes merged ('all' dequantizes the 4-bit bases into a "
                        "bf16 copy)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (CPU is fine)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile one rollout: GPU time by kernel, kernels a decode step")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                        help="a module setting for this process, recorded in the row (repeatable), e.g. "
                        "fastgrpo.kernels.nf4_lora_linear._BLOCK_N=64: an A/B across two processes of one call")
    args = parser.parse_args()
    settings = harness.apply_settings(args.set)
    result = run(args)
    if settings:
        result["settings"] = settings
    if os.environ.get("OUT"):
        name = "grpo_qlora_step_offload.json" if args.offload else "grpo_qlora_step.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)
    print("RESULT " + json.dumps(result))
    if not args.tiny:
        harness.record("grpo_qlora_step", [result])
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
