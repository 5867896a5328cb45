"""One GRPO policy-loss step (forward + backward) on the anchor workload of DESIGN.md §4.

Qwen2.5-1.5B shape, random bf16 weights, LoRA r=16 on q,k,v,o,gate,up,down, non-reentrant
gradient checkpointing, G=8 completions of a 256-token prompt, TRL's per-sequence-mean GRPO
loss with beta=0, every system under bf16 autocast as TRL's `bf16=True` runs it (PEFT keeps the adapters in
fp32; autocast runs their matmuls in bf16). Systems (each in this process, one after another):
  eager     TRL's way: full logits, per-row bf16 log_softmax + gather
  inductor  the same, decoder layers compiled by inductor (one region per layer)
  liger     Liger rope/rms_norm/swiglu + LigerFusedLinearGRPOLoss on hidden states
  fastgrpo  decoder layers compiled with backend="fastgrpo" + fastgrpo::selective_logprob; on CUDA
            the checkpointed layer inputs are offloaded to host memory (the integration's default
            there). The gated-MLP op, down projection included, keeps only x and recomputes the
            projections in its backward, and the offloaded checkpoint's recompute of a layer skips the
            MLP altogether (its output feeds only the residual add); attention runs on cuDNN's kernel
            as fastgrpo::attention, whose output and log-sum-exp wait in host memory beside the layer
            input so that the recompute skips attention too (the attention pattern): what the TRL
            integration does with offloaded checkpointing
  fastgrpo_recompute_attention  the same with the recompute running attention again (SDPA on cuDNN,
            keep_attention_output=False): the `fastgrpo` row before 2026-12-01's twelfth session
  fastgrpo_flash  the same with SDPA's flash kernel (the attention pattern left out, flash forced while the
            layers compile: torch 2.11's own choice on the H200 is cuDNN already)
  fastgrpo_save  the same with the op keeping the gate and up projections (save_mlp_projections=True;
            the recompute then runs the gate/up matmul to save them): the integration's form under
            checkpointing without offloading, and the `fastgrpo` row of this file before 2026-11-30's
            third session
  fastgrpo_actmul  the same with the MLP left to inductor but for fastgrpo::act_mul
            (absorb_mlp_projections=False: autograd keeps gate, up and the product)
  fastgrpo_nomlp  the same without the gated-MLP pattern (inductor keeps the MLP)
  fastgrpo_nojoin  the same without the joined-projections pattern (q, k, v and their LoRA A's in six GEMMs)
  fastgrpo_packed  fastgrpo on the G rows packed into one sequence without padding
            (fastgrpo.integrations.packing: positions restart per row, each row a causal segment of
            flash's variable-length attention on CUDA, log-probs only at completion positions); the plan
            and mask are built inside the timed step. What the TRL integration does with
            fastgrpo_shared_prompt=False
  fastgrpo_packed_flex  the same with flex_attention and the packed BlockMask (fastgrpo_packed before
            2026-11-30's ninth session)
  fastgrpo_shared  the same with the group's prompt packed once: prompt + c1 + ... + cG, each completion a
            variable-length segment whose keys are its prompt's followed by its own (gathered). What the TRL
            integration does by default (since 2026-11-30's tenth session)
  fastgrpo_shared_flex  the same with flex_attention and the shared-prompt BlockMask (fastgrpo_shared before
            2026-11-30's tenth session)
  fastgrpo_shared_recompute_attention  fastgrpo_shared with the recompute running attention again
            (keep_attention_output=False): fastgrpo_shared before 2026-12-01's thirteenth session, whose packed
            rows keep their attention output (fastgrpo::flash_packed_attention)
  fastgrpo_packed_save  fastgrpo_packed with the gated-MLP op keeping gate/up (as fastgrpo_save): more
            memory than the act_mul form when packed (7.96 vs 5.97 GiB, H200, prompt 1024, spread 4096)
  fastgrpo_packed_actmul  fastgrpo_packed with the act_mul form (as fastgrpo_actmul): the integration's
            packed form before 2026-11-30's fourth session (503 ms / 5.25 GiB against 480 ms / 4.27 GiB for
            fastgrpo_packed, prompt 256, spread 4096)
  fastgrpo_packed_nojoin  fastgrpo_packed without the joined-projections pattern
--spread: completion lengths drawn uniformly between 10 % and 100 % of the given maximum
(`spread_lengths`, fixed seed: the same batch for every system and for
bench/peers/unsloth_step.py --spread); padded systems get the batch right-padded to its
longest row, as TRL pads it, and tokens/s counts real tokens only (G*P + sum of lengths).
--prompt sets the prompt length (comma list: each is a separate table row).
Unsloth runs separately (bench/peers/unsloth_step.py, its own site-packages); pass its
JSON lines with --merge to print one table with ratios.

    python bench/grpo_step.py --systems eager,inductor,liger,fastgrpo --completions 1024,4096,16384
    python bench/grpo_step.py --systems fastgrpo,fastgrpo_packed,fastgrpo_shared --spread --prompt 256,1024
    python bench/grpo_step.py --merge $OUT/grpo_step.jsonl $OUT/unsloth_step.jsonl
"""
import argparse
import collections
import gc
import json
import math
import os
import re
import statistics
import sys
import time

import torch

PROMPT, GROUP, LORA_RANK = 256, 8, 16
DYNAMIC = True  # one compile serves every completion length
# fastgrpo variants: backend options of each.
# Checkpointing is on in every system here (offloaded on CUDA), so fastgrpo's gated-MLP op recomputes the
# projections in its backward while the checkpoint's recompute skips the MLP, padded or packed (what the TRL
# integration does then); the other variants measure the alternatives.
_SAVED_PROJECTIONS = {"save_mlp_projections": True}
_ACT_MUL = {"absorb_mlp_projections": False}
FASTGRPO_OPTIONS = {
    "fastgrpo": None,
    "fastgrpo_flash": None,
    "fastgrpo_recompute_attention": {"keep_attention_output": False},
    "fastgrpo_save": _SAVED_PROJECTIONS,
    "fastgrpo_actmul": _ACT_MUL,
    "fastgrpo_nomlp": None,
    "fastgrpo_nojoin": None,
    "fastgrpo_packed": None,
    "fastgrpo_shared": None,
    "fastgrpo_packed_save": _SAVED_PROJECTIONS,
    "fastgrpo_packed_actmul": _ACT_MUL,
    "fastgrpo_packed_nojoin": None,
    "fastgrpo_packed_flex": None,
    "fastgrpo_shared_flex": None,
    "fastgrpo_shared_recompute_attention": {"keep_attention_output": False},
}
# Variants that run every pattern but these (resolved against fastgrpo.passes.PASSES when the system is built, so a
# pattern added later is not silently left out).
PATTERNS_LEFT_OUT = {"fastgrpo_flash": ("attention",), "fastgrpo_nomlp": ("gated_mlp",),
                     "fastgrpo_nojoin": ("joined_projections",), "fastgrpo_packed_nojoin": ("joined_projections",)}
# Packed variants: whether the group's prompt is shared.
PACKED = {"fastgrpo_packed": False, "fastgrpo_shared": True, "fastgrpo_packed_save": False,
          "fastgrpo_packed_actmul": False, "fastgrpo_packed_nojoin": False, "fastgrpo_packed_flex": False,
          "fastgrpo_shared_flex": True, "fastgrpo_shared_recompute_attention": True}
# Packed variants whose attention is forced (default "auto": rows as variable-length segments where layers allow).
PACKED_ATTENTION = {"fastgrpo_packed_flex": "flex_attention", "fastgrpo_shared_flex": "flex_attention"}


def spread_lengths(completion: int, group: int = GROUP, seed: int = 0) -> list[int]:
    """Completion lengths of one group, uniform in [10 %, 100 %] of `completion` (fixed seed per length).

    bench/peers/unsloth_step.py --spread imports this, so Unsloth times exactly the same batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + completion)
    return torch.randint(max(1, completion // 10), completion + 1, (group,), generator=generator).tolist()


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
    elif system in FASTGRPO_OPTIONS:
        import fastgrpo
        from fastgrpo.passes import PASSES

        options = FASTGRPO_OPTIONS[system]
        if system in PATTERNS_LEFT_OUT:
            options = {**(options or {}), "patterns": [p for p in PASSES if p not in PATTERNS_LEFT_OUT[system]]}
        # As the TRL integration does by default: on CUDA the checkpointed layer inputs go to host memory.
        fastgrpo.compile_repeated_blocks(base, options=options, dynamic=DYNAMIC,
                                         offload_checkpointing=device == "cuda")
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


def make_step(system: str, model, completion: int, prompt: int = PROMPT):
    base = model.get_base_model()
    head = base.get_output_embeddings().weight

    if system in PACKED:
        from fastgrpo.integrations.packing import Packer
        from fastgrpo.kernels.selective_logprob import selective_logprob

        packer = Packer(share_prompt=PACKED[system], attention=PACKED_ATTENTION.get(system, "auto"))

        def step(ids, mask, adv):
            # TRL's rows: [prompt | completion], the completion's padding masked out of attention and labels.
            attention_mask = torch.cat([torch.ones_like(ids[:, :prompt]), mask.to(ids.dtype)], 1)
            labels = ids.masked_fill(attention_mask == 0, -100)
            labels[:, :prompt] = -100
            call = packer.prepare(base, {"input_ids": ids, "attention_mask": attention_mask}, labels, prompt)
            if call is None:
                raise RuntimeError(f"{system}: the batch was not packed ({sorted(packer.said)})")
            hidden = base.get_decoder()(**call.kwargs).last_hidden_state[0, call.plan.source]
            logps = call.plan.scatter(selective_logprob(hidden, head, call.plan.targets))[:, prompt - 1:]
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            grpo_loss(logps, mask, adv).backward()
    elif system in ("eager", "inductor"):
        def step(ids, mask, adv):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=completion + 1).logits[:, :-1]
            logps = selective_log_softmax_bf16(logits, ids[:, -completion:])
            del logits  # TRL's log-prob function returns before backward (until 2026-12-01 this step held them)
            grpo_loss(logps, mask, adv).backward()
    elif system == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            out = loss_fn(hidden, head, ids[:, -completion:], mask, adv)
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            (out[0] if isinstance(out, tuple) else out).backward()
    elif system in FASTGRPO_OPTIONS:
        from fastgrpo.kernels.selective_logprob import selective_logprob

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            loss = grpo_loss(selective_logprob(hidden, head, ids[:, -completion:]), mask, adv)
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            loss.backward()
    else:
        raise ValueError(f"unknown system {system!r}")
    return step


def with_flash_attention(step):
    """The step with SDPA's flash kernel forced; the choice is made when the layers compile (the first step)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash_step(*args):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            step(*args)

    return flash_step


def with_mixed_precision(step, device: torch.device):
    """The step under bf16 autocast, as TRL's trainer runs it with `bf16=True` (accelerate's mixed precision)."""
    def mixed_precision_step(*args):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            step(*args)

    return mixed_precision_step


class GcPauses:
    """Python's garbage-collector pauses while installed (gc.callbacks): total ms and full (generation-2)
    collections. A full collection walks every live Python object - after compiling a model, hundreds of
    thousands - and stalls the host, so the GPU idles: a step that takes it is hundreds of ms slower."""

    def __init__(self):
        self.ms, self.full, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms += (time.perf_counter() - self._start) * 1e3
            self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def timed_steps(step, args, model, count: int, before_each=None, host_times: list | None = None) -> list[float]:
    """`step(*args)` `count` times, the gradients cleared after each; returns each step's wall time in ms
    (CUDA-synchronised). `before_each` runs untimed before each step (e.g. a barrier across ranks).
    `host_times`, if given, gets each step's host time in ms: until `step` returned, before the synchronize.
    Close to the wall time, the step is bound by the host (or waits on the GPU inside: see sync_points)."""
    cuda = next(model.parameters()).device.type == "cuda"
    times = []
    for _ in range(count):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        step(*args)
        if host_times is not None:
            host_times.append((time.perf_counter() - start) * 1e3)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    return times


def host_lead(step, args, model) -> str:
    """How far the host runs ahead of the GPU through one step: at each decoder layer's call (forward, then
    the checkpoint's recompute in backward) the host time and the GPU time of a CUDA event recorded there,
    from the step's start. A lead near zero means the GPU had caught up and waited on the host's launches
    there (host-bound); a growing lead means the GPU was the bottleneck. Needs offloaded checkpointing (its
    layer call, outside the compiled regions, is where the marks are recorded)."""
    from fastgrpo.compiler.regions import repeated_blocks

    marks = []

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, time.perf_counter(), event))

    states = [block.__dict__.get("_fastgrpo_offload") for block in repeated_blocks(model.get_base_model())]
    if any(state is None for state in states):
        return "host lead: needs offloaded checkpointing"
    originals = [state.call for state in states]
    seen = collections.Counter()

    def marked(layer, call):
        def run(block, *a, **k):
            seen[layer] += 1
            mark(f"layer {layer}" + (" recompute" if seen[layer] > 1 else ""))
            return call(block, *a, **k)
        return run

    for layer, state in enumerate(states):
        state.call = marked(layer, state.call)
    try:
        torch.cuda.synchronize()
        mark("start")
        step(*args)
        mark("step returned")
        torch.cuda.synchronize()
    finally:
        for state, call in zip(states, originals):
            state.call = call
    _, host0, event0 = marks[0]
    lines = ["| mark | host ms | GPU ms | lead ms |", "|---|---|---|---|"]
    for name, host, event in marks:
        host_ms, gpu_ms = (host - host0) * 1e3, event0.elapsed_time(event)
        lines.append(f"| {name} | {host_ms:.1f} | {gpu_ms:.1f} | {gpu_ms - host_ms:.1f} |")
    return "Host lead over the GPU through one step:\n" + "\n".join(lines)


def ab_blocks(step, args, model, repeat: int, setting: str) -> str:
    """A/B in one process: `repeat` steps with `setting` ("module.attr=literal") applied, then `repeat` as it
    was, twice over (one settling step before each block). The host and GPU stay the same, so the difference
    is the change's, without the spread between lent machines (the same step took 749-783 ms on four of them)."""
    import ast
    import importlib

    target, value = setting.split("=", 1)
    module_name, attr = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    original, changed = getattr(module, attr), ast.literal_eval(value)
    lines = []
    try:
        for label, current in (("changed", changed), ("as is", original)) * 2:
            setattr(module, attr, current)
            timed_steps(step, args, model, 1)
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = timed_steps(step, args, model, repeat)
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""
            lines.append(f"AB {target} = {current!r} ({label}): median {statistics.median(times):.1f} ms, "
                         f"{[round(t, 1) for t in times]}{peak}")
    finally:
        setattr(module, attr, original)
    return "\n".join(lines)


def sync_points(step, args, rows: int = 12) -> str:
    """Where one step makes the host wait on the GPU (torch.cuda's sync debug mode: .item(), copies to
    pageable host memory, nonzero, ...), by Python location: each one empties the GPU's queue."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    places = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught
                                 if "synchroniz" in str(w.message))
    lines = [f"{count} x {place}" for place, count in places.most_common(rows)]
    return f"synchronizing calls in one step: {sum(places.values())}" + "".join("\n  " + line for line in lines)


# Kernel-name patterns of the categories profile_step sums device time into (first match wins).
KERNEL_CATEGORIES = [
    ("memcpy/memset (copy engines: overlaps compute)", r"memcpy|memset"),
    ("attention", r"flash|fmha|cudnn|attn|sdpa"),
    ("matmul (cuBLAS/CUTLASS)", r"nvjet|gemm|cutlass|xmma|splitk|cublas|sm90_"),
    ("norm/rope/act-mul/log-prob Triton kernels (fastgrpo's; Unsloth's norm and rope)",
     r"_rms_norm|_rope|_act_mul|_stats_kernel|_grad_logits|_dw_reduce"),
    ("inductor Triton kernels", r"^triton_"),
    ("aten elementwise/reduce/copy", r"elementwise|reduce|vectorized|cat_|copy|index|fill|scatter|gather"),
    ("other", r""),
]


def is_copy(kernel_name: str) -> bool:
    """A copy-engine transfer (host <-> device copy, memset), which runs beside the compute kernels."""
    return re.search(KERNEL_CATEGORIES[0][1], kernel_name.lower()) is not None


def on_device(event) -> bool:
    """A kernel or copy on the GPU's timeline. Left out: the ranges that annotate it (`## Call CompiledFxGraph
    ... ##` spans a whole compiled graph, the gaps inside it too, which would count as busy)."""
    return (event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and not event.name.startswith("## "))


def kernel_summary(prof) -> str:
    """Device time of one profiled step by kernel category, and the GPU's busy time (union of its compute
    kernels' intervals, copies left out) against the step's wall time: how host-bound the step is."""
    totals, intervals = {}, []
    for event in prof.events():
        if not on_device(event):
            continue
        name = event.name.lower()
        category = next(c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, name))
        count, time_us = totals.get(category, (0, 0.0))
        totals[category] = (count + 1, time_us + event.time_range.elapsed_us())
        if not is_copy(name):
            intervals.append((event.time_range.start, event.time_range.end))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    wall = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    lines = ["| kernels | count | ms |", "|---|---|---|"]
    lines += [f"| {c} | {n} | {t / 1e3:.1f} |" for c, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    lines.append(f"GPU busy {busy / 1e3:.1f} ms of {wall / 1e3:.1f} ms from first to last kernel")
    return "\n".join(lines)


def idle_gaps(prof, rows: int = 15, min_ms: float = 0.2, with_host: bool = True) -> str:
    """Where the GPU waits inside the step (no compute kernel running): every gap between kernels, the gaps
    of at least `min_ms` grouped by the kernel that ends them (count, ms, forward or backward), and the longest
    ones with the kernels either side and the innermost host events covering most of the gap (what the host
    was doing while the GPU waited: a synchronisation, an allocation, an op's Python before its launch).
    `with_host` False: a profile of the device's activity alone, with no host events to say the phase."""
    kernels, host = [], []
    for event in prof.events():
        interval = (event.time_range.start, event.time_range.end, event.name)
        if on_device(event):
            if not is_copy(event.name):
                kernels.append(interval)
        elif event.device_type != torch.autograd.DeviceType.CUDA:
            host.append(interval)
    kernels.sort()
    gaps, end, last, all_gaps = [], float("-inf"), "", 0.0
    for start, stop, name in kernels:
        if last and start > end:
            all_gaps += start - end
            if start - end >= min_ms * 1e3:
                gaps.append((start - end, end, start, last, name))
        if stop > end:
            end, last = stop, name

    def covering(start, stop):
        return [n for _, n in sorted((e - s, n) for s, e, n in host if min(e, stop) - max(s, start) >= 0.5 * (stop - start))]

    during = {(start, stop): covering(start, stop) for _, start, stop, _, _ in gaps}
    groups = {}
    for length, start, stop, _, after in gaps:
        phase = ("-" if not with_host  # a profile of the device alone
                 else "backward" if any(n.startswith("autograd::engine") for n in during[start, stop]) else "forward")
        count, total = groups.get((after[:60], phase), (0, 0.0))
        groups[(after[:60], phase)] = (count + 1, total + length)
    lines = [f"GPU idle between kernels: {all_gaps / 1e3:.1f} ms in all; {len(gaps)} gaps >= {min_ms} ms, "
             f"{sum(g[0] for g in gaps) / 1e3:.1f} ms, by the kernel after them:",
             "| kernel after | phase | gaps | ms |", "|---|---|---|---|"]
    lines += [f"| {name} | {phase} | {count} | {total / 1e3:.1f} |"
              for (name, phase), (count, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]]
    lines += ["The longest:", "| ms | kernel before | kernel after | host during the gap (innermost first) |",
              "|---|---|---|---|"]
    for length, start, stop, before, after in sorted(gaps, reverse=True)[:rows]:
        host_events = "; ".join(dict.fromkeys(during[start, stop][:4]))
        lines.append(f"| {length / 1e3:.2f} | {before[:50]} | {after[:50]} | {host_events[:160]} |")
    return "\n".join(lines)


def gap_causes(prof, rows: int = 12, min_ms: float = 0.05) -> str:
    """Why the GPU waited before a kernel: each gap of at least `min_ms` split at the moment the host launched the
    kernel after it (the launch call that shares the kernel's CUPTI correlation id, or failing that, its linked
    one). Up to that moment the host was
    late (its Python, dispatch or launch work had not reached the kernel yet); after it, the kernel was queued
    and waited on the device: on a stream's wait for an event (a copy back, another stream's work), or the
    launch's own latency."""
    launches, kernels = {}, []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            if not event.is_user_annotation() and not is_copy(event.name()):
                ids = (event.correlation_id(), event.linked_correlation_id())
                kernels.append((event.start_ns(), event.end_ns(), event.name(), ids))
        elif event.name().startswith(("cudaLaunch", "cuLaunch")):
            launches[event.correlation_id()] = event.start_ns()
    kernels.sort()
    host_ns = device_ns = unlinked_ns = 0
    groups, end = {}, None
    for start, stop, name, ids in kernels:
        if end is not None and start - end >= min_ms * 1e6:
            gap, launched = start - end, next((launches[i] for i in ids if i in launches), None)
            late = None if launched is None else min(max(launched - end, 0), gap)
            if late is None:
                unlinked_ns += gap
            else:
                host_ns, device_ns = host_ns + late, device_ns + gap - late
            count, total, host_part = groups.get(name[:60], (0, 0, 0))
            groups[name[:60]] = (count + 1, total + gap, host_part + (late or 0))
        if end is None or stop > end:
            end = stop
    lines = [f"gaps >= {min_ms} ms: {(host_ns + device_ns + unlinked_ns) / 1e6:.1f} ms; the host late for "
             f"{host_ns / 1e6:.1f} ms of it, the kernel queued and waiting for {device_ns / 1e6:.1f} ms"
             + (f", launch not found for {unlinked_ns / 1e6:.1f} ms" if unlinked_ns else ""),
             "| kernel after | gaps | ms | host late ms |", "|---|---|---|---|"]
    lines += [f"| {name} | {count} | {total / 1e6:.1f} | {host_part / 1e6:.1f} |"
              for name, (count, total, host_part) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]]
    return "\n".join(lines)


# aten matmul ops and the positions of their two operands among the recorded input shapes.
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::bmm": (0, 1),
                   "aten::baddbmm": (1, 2)}
MATMUL_PEAK_TFLOPS = 790  # bf16 dense matmul measured on the H200 (DESIGN.md §4)
THIN = 64  # a product with a dimension this small or smaller (LoRA's rank side) is bound by memory, not FLOPs


def matmul_shapes(prof, rows: int = 20) -> str:
    """Matmul device time by op and operand shapes, with the TFLOP/s each reached: which products run below the
    GPU's matmul rate (LoRA's thin ones, split-K reductions) and what share of the matmul time they take."""
    groups, cuda = [], torch.cuda.is_available()
    for average in prof.key_averages(group_by_input_shape=True):
        operands = MATMUL_OPERANDS.get(average.key)
        shapes = average.input_shapes if operands else None
        if not shapes or max(operands) >= len(shapes):
            continue
        a, b = shapes[operands[0]], shapes[operands[1]]
        if len(a) < 2 or len(b) < 2:
            continue
        flop = 2 * math.prod(a[:-2]) * a[-2] * a[-1] * b[-1] * average.count
        us = (getattr(average, "self_device_time_total", None) or getattr(average, "self_cuda_time_total", 0)
              if cuda else average.self_cpu_time_total)
        thin = min(a[-2], a[-1], b[-1]) <= THIN
        groups.append((us / 1e3, flop, average.count, average.key, f"{list(a)} x {list(b)}", thin))
    if not groups:
        return "no matmuls recorded"
    total_ms, total_flop = sum(g[0] for g in groups), sum(g[1] for g in groups)
    thin_ms, thin_flop = sum(g[0] for g in groups if g[5]), sum(g[1] for g in groups if g[5])
    lines = [f"matmuls: {total_flop / 1e12:.1f} TFLOP in {total_ms:.1f} ms ({total_flop / 1e9 / max(total_ms, 1e-9):.0f} "
             f"TFLOP/s; {total_flop / 1e9 / MATMUL_PEAK_TFLOPS:.1f} ms at {MATMUL_PEAK_TFLOPS}); thin products (a dim <= "
             f"{THIN}): {thin_flop / 1e12:.2f} TFLOP in {thin_ms:.1f} ms",
             "| op | operands | calls | ms | TFLOP/s |", "|---|---|---|---|---|"]
    for ms, flop, count, op, operands, _ in sorted(groups, reverse=True)[:rows]:
        lines.append(f"| {op} | {operands} | {count} | {ms:.1f} | {flop / 1e9 / max(ms, 1e-9):.0f} |")
    return "\n".join(lines)


def profile_step(step, args, label: str, rows: int = 40, model=None) -> None:
    """Print the kernels that take the step's time (one step under torch.profiler), by category and by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"PROFILE {label}\n" + (kernel_summary(prof) + "\n" + idle_gaps(prof) + "\n" if torch.cuda.is_available() else "")
          + matmul_shapes(prof) + "\n"
          + prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90), flush=True)
    if torch.cuda.is_available():
        profile_device(step, args, label)
        print(sync_points(step, args), flush=True)
        if model is not None:
            print(host_lead(step, args, model), flush=True)
    print(f"HOST PROFILE {label} (cProfile of one more step: where the host's time goes)\n" + host_profile(step, args),
          flush=True)


def profile_device(step, args, label: str) -> None:
    """One step with only the device's activity recorded: the profile of `profile_step` records every host call
    and its shapes, which slows the host enough for the GPU to wait on it; here the host runs at its own speed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(*args)
        torch.cuda.synchronize()
    print(f"DEVICE PROFILE {label} (the device's activity alone)\n" + kernel_summary(prof) + "\n"
          + idle_gaps(prof, min_ms=0.05, with_host=False) + "\n" + gap_causes(prof), flush=True)


def host_profile(step, args, rows: int = 45) -> str:
    """cProfile of one step, by own time and by cumulative time: the Python and launch work the host does
    (a step whose GPU is idle part of the time is bound by this), and any wait on the GPU (synchronize)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def make_batch(vocab: int, prompt: int, completion: int, spread: bool, device):
    """One group: G rows behind the same prompt; with `spread`, right-padded to the longest of spread_lengths.
    Returns ids [G, prompt + width], completion mask [G, width], advantages [G], real tokens."""
    lengths = spread_lengths(completion) if spread else [completion] * GROUP
    width = max(lengths)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (GROUP, prompt + width), device=device)
    ids[:, :prompt] = ids[0, :prompt]
    mask = (torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]).float()
    adv = torch.randn(GROUP, device=device)
    return ids, mask, adv, GROUP * prompt + sum(lengths), lengths


def run(system: str, completions: list[int], warmup: int, repeat: int, tiny: bool,
        profile_at: tuple[int, ...] = (), prompt: int = PROMPT, spread: bool = False,
        gc_freeze: bool = True, ab: list[str] = (), device_profile_only: bool = False) -> list[dict]:
    results = []
    try:
        model = build_policy(system, prompt + max(completions) + 8, tiny)
    except Exception as err:  # e.g. a peer that is not installed
        for completion in completions:
            result = {"system": system, "prompt": prompt, "completion": completion, "spread": spread,
                      "error": f"{type(err).__name__}: {str(err)[:200]}"}
            print("RESULT " + json.dumps(result), flush=True)
            results.append(result)
        return results
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    for completion in completions:
        result = {"system": system, "prompt": prompt, "completion": completion, "spread": spread, "ms_median": None,
                  "ms_all": [], "peak_gib": None, "tokens_per_s": None, "error": None}
        try:
            ids, mask, adv, tokens, lengths = make_batch(vocab, prompt, completion, spread, device)
            result.update(tokens=tokens, lengths=lengths)
            step = with_mixed_precision(make_step(system, model, mask.shape[1], prompt), device)
            if system == "fastgrpo_flash" and device.type == "cuda":
                step = with_flash_attention(step)
            timed_steps(step, (ids, mask, adv), model, warmup)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            frozen = gc_freeze and system in FASTGRPO_OPTIONS
            if frozen:  # as fastgrpo's trainer does after its first step (the peers' collectors are left alone)
                gc.collect()
                gc.freeze()
            try:
                with GcPauses() as pauses:
                    host_times = []
                    times = timed_steps(step, (ids, mask, adv), model, repeat, host_times=host_times)
                for setting in ab:
                    setting, _, lengths = setting.partition("@")
                    if not lengths or completion in {int(c) for c in lengths.split(",")}:
                        print(ab_blocks(step, (ids, mask, adv), model, repeat, setting), flush=True)
            finally:
                if frozen:  # a later system in this process, a peer maybe, starts with its collector as it was
                    gc.unfreeze()
            result.update(gc_ms=round(pauses.ms, 1), gc_full=pauses.full, gc_frozen=frozen)
            median = statistics.median(times)
            result.update(ms_median=round(median, 1), ms_all=[round(t, 1) for t in times],
                          host_ms_median=round(statistics.median(host_times), 1),
                          tokens_per_s=round(tokens / median * 1e3))
            if device.type == "cuda":
                result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if completion in profile_at:
                label = f"{system} completion={completion}"
                try:  # a diagnostic that fails must not take the row's numbers with it
                    if device_profile_only and device.type == "cuda":
                        profile_device(step, (ids, mask, adv), label)
                    else:
                        profile_step(step, (ids, mask, adv), label, model=model)
                except Exception as err:
                    print(f"PROFILE {label} failed: {type(err).__name__}: {err}", flush=True)
        except torch.OutOfMemoryError:
            result["error"] = "OOM"
        except Exception as err:  # a failing system must not hide the others' numbers
            result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print("RESULT " + json.dumps(result), flush=True)
        results.append(result)
    if system in FASTGRPO_OPTIONS:
        import fastgrpo

        matched = {}
        for report in fastgrpo.fusion_reports():
            for name, rec in report["patterns"].items():
                matched[name] = matched.get(name, 0) + rec["matched"]
        print(f"{system}: {len(fastgrpo.fusion_reports())} graphs compiled, sites matched: {matched}")
        fastgrpo.clear_fusion_reports()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def case_key(r: dict) -> tuple:
    """The batch a result timed: (prompt, completion, spread); older records have no prompt/spread."""
    return r.get("prompt", PROMPT), r["completion"], bool(r.get("spread", False))


def table(results: list[dict]) -> str:
    by = {(r["system"], case_key(r)): r for r in results}
    order = ["eager", "inductor", "liger", "unsloth", *FASTGRPO_OPTIONS]
    systems = [s for s in order if any(k[0] == s for k in by)]
    best = [s for s in ("fastgrpo_shared", "fastgrpo_packed", "fastgrpo") if s in systems]
    lines = ["| prompt / completion | " + " | ".join(systems) + " | fastgrpo tok/s vs unsloth | fastgrpo mem vs unsloth"
             " | vs inductor tok/s | vs liger mem | packed / shared tok/s vs padded fastgrpo | best fastgrpo vs unsloth |",
             "|---" * (len(systems) + 7) + "|"]
    for case in sorted({k[1] for k in by}):
        cells = []
        for s in systems:
            r = by.get((s, case))
            if r is None:
                cells.append("-")
            elif r["error"]:
                cells.append(r["error"][:40])
            else:
                cells.append(f"{r['ms_median']:.0f} ms, {r['peak_gib']} GiB, {r['tokens_per_s']} tok/s")

        def ratio(a, b, key, invert=False):
            ra, rb = by.get((a, case)), by.get((b, case))
            if not ra or not rb or ra["error"] or rb["error"] or not ra[key] or not rb[key]:
                return "-"
            return f"{(rb[key] / ra[key] if invert else ra[key] / rb[key]):.2f}x"

        cells += [ratio("fastgrpo", "unsloth", "tokens_per_s"), ratio("fastgrpo", "unsloth", "peak_gib"),
                  ratio("fastgrpo", "inductor", "tokens_per_s"), ratio("fastgrpo", "liger", "peak_gib"),
                  f'{ratio("fastgrpo_packed", "fastgrpo", "tokens_per_s")} / {ratio("fastgrpo_shared", "fastgrpo", "tokens_per_s")}']
        fastest = max((by[(s, case)] for s in best if (s, case) in by and not by[(s, case)]["error"]),
                      key=lambda r: r["tokens_per_s"] or 0, default=None)
        cells.append("-" if fastest is None else f'{fastest["system"]}: ' + ratio(fastest["system"], "unsloth", "tokens_per_s"))
        prompt, length, spread = case
        lines.append(f"| {prompt} / {length}{' spread' if spread else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="eager,inductor,liger,fastgrpo")
    parser.add_argument("--completions", default="1024,4096,16384")
    parser.add_argument("--prompt", default=str(PROMPT), help="prompt length(s), comma-separated")
    parser.add_argument("--spread", action="store_true",
                        help="completion lengths uniform in [10 %%, 100 %%] of each --completions value (fixed seed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile-at", default="",
                        help="profile one step of each system at these completion lengths (comma list)")
    parser.add_argument("--device-profile-only", action="store_true",
                        help="with --profile-at on CUDA: only the profile of the device's activity (kernel time, "
                             "idle gaps and whether the host or the device made each one wait), not the host's")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave Python's collector as it is (by default the fastgrpo systems call gc.freeze() after "
                             "warm-up, as the trainer does after its first step)")
    parser.add_argument("--mlp-chunk-mib", type=int,
                        help="bytes of the gated-MLP op's per-chunk projection buffer (default 256 MiB); the systems' "
                             "names get a _chunk<MiB> suffix")
    parser.add_argument("--ab", metavar="MODULE.ATTR=VALUE", action="append", default=[],
                        help="after each timed row, A/B a setting in the same process (ab_blocks; repeat the flag for "
                             "several, each against the tree as it is; a suffix @1024,4096 limits it to those "
                             "completion lengths), e.g. fastgrpo.kernels._lora_gemm.JOIN_MIN_ROWS_PER_HIDDEN=1000000000")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script runs (CPU is fine)")
    parser.add_argument("--merge", nargs="*", help="JSON-lines files to merge into one table instead of running")
    args = parser.parse_args()
    if args.merge is not None:
        results = [json.loads(line.removeprefix("RESULT ")) for path in args.merge for line in open(path) if line.strip()]
        print(table(results))
        return 0
    completions = [int(c) for c in args.completions.split(",")]
    if args.mlp_chunk_mib:
        from fastgrpo.kernels import _row_chunks
        _row_chunks.CHUNK_BYTES = args.mlp_chunk_mib * 2**20
    profile_at = tuple(int(c) for c in args.profile_at.split(",") if c)
    results = []
    for prompt in [int(p) for p in args.prompt.split(",")]:
        for system in args.systems.split(","):
            rows = run(system, completions, args.warmup, args.repeat, args.tiny, profile_at, prompt,
                       args.spread, not args.no_gc_freeze, args.ab, args.device_profile_only)
            for row in rows if args.mlp_chunk_mib else ():
                row["system"] += f"_chunk{args.mlp_chunk_mib}"
            results += rows
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grpo_step.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
