"""One GRPO policy-loss step (forward + backward) of a named dense model shape.

`--shape` (bench/_harness.py's SHAPES: qwen2.5-0.5b, qwen2.5-1.5b (default), qwen2.5-7b, llama-3.1-8b, gemma-2-2b;
qwen3-4b and phi-3-mini, never tuned on), random bf16 weights, LoRA r=16 on q,k,v,o,gate,up,down, non-reentrant
gradient checkpointing, G=8 completions of a 256-token prompt, TRL's per-sequence-mean GRPO loss with beta=0, every
system under bf16 autocast as TRL's `bf16=True` runs it (PEFT keeps the adapters in fp32; autocast runs their matmuls
in bf16). Log-probs are those of the model's own logits (soft-capped where the shape's config says so). Systems
(each in this process, one after another):
  eager     TRL's way: full logits, per-row bf16 log_softmax + gather
  inductor  the same, decoder layers compiled by inductor (one region per layer)
  liger     Liger's rope/rms_norm/swiglu (geglu) + LigerFusedLinearGRPOLoss on hidden states
  fastgrpo  decoder layers compiled with backend="fastgrpo" + fastgrpo::selective_logprob; on CUDA
            the checkpointed layer inputs are offloaded to host memory (the integration's default
            there). The gated-MLP op, down projection included, keeps only x and recomputes the
            projections in its backward, and the offloaded checkpoint's recompute of a layer skips the
            MLP altogether (its output feeds only the residual add); attention runs on cuDNN's kernel
            as fastgrpo::attention, whose output and log-sum-exp wait in host memory beside the layer
            input so that the recompute skips attention too (the attention pattern): what the TRL
            integration does with offloaded checkpointing
  fastgrpo_save  the same with the op keeping the gate and up projections (save_mlp_projections=True;
            the recompute then runs the gate/up matmul to save them): the integration's form under
            checkpointing without offloading, padded
  fastgrpo_actmul  the same with the MLP left to inductor but for fastgrpo::act_mul
            (absorb_mlp_projections=False: autograd keeps gate, up and the product): the form on CPU
  fastgrpo_nojoin  the same without the joined-projections pattern (q, k, v and their LoRA A's in six GEMMs)
  fastgrpo_nocombo  the same without inductor's combo kernels (independent small kernels of a graph, such as the
            LoRA factors' casts, launched as one: on by default)
  fastgrpo_packed  fastgrpo on the G rows packed into one sequence without padding
            (fastgrpo.integrations.packing: positions restart per row, each row a causal segment of
            flash's variable-length attention on CUDA, log-probs only at completion positions); the plan
            and mask are built inside the timed step. What the TRL integration does with
            fastgrpo_shared_prompt=False
  fastgrpo_shared  the same with the group's prompt packed once: prompt + c1 + ... + cG, each completion a
            variable-length segment whose keys are its prompt's followed by its own (gathered). What the TRL
            integration does by default
  fastgrpo_packed_save  fastgrpo_packed with the gated-MLP op keeping gate/up (as fastgrpo_save)
  fastgrpo_packed_actmul  fastgrpo_packed with the act_mul form (as fastgrpo_actmul): the integration's packed
            form under checkpointing without offloading
  fastgrpo_packed_nojoin  fastgrpo_packed without the joined-projections pattern
--spread: completion lengths drawn uniformly between 10 % and 100 % of the given maximum
(`spread_lengths`, fixed seed: the same batch for every system and for
bench/peers/unsloth_step.py --spread); padded systems get the batch right-padded to its
longest row, as TRL pads it, and tokens/s counts real tokens only (G*P + sum of lengths).
--prompt sets the prompt length (comma list: each is a separate table row).
Rows are appended to bench/results/grpo_step.jsonl (not with --tiny). Unsloth runs separately
(bench/peers/unsloth_step.py, its own site-packages) and appends its rows to the same file; --merge prints one
table with ratios from that file (or the files given), a later row replacing an earlier one of the same case.

    python bench/grpo_step.py --systems eager,inductor,liger,fastgrpo --completions 1024,4096,16384
    python bench/grpo_step.py --shape llama-3.1-8b --systems fastgrpo,inductor --completions 1024,4096
    python bench/grpo_step.py --systems fastgrpo,fastgrpo_packed,fastgrpo_shared --spread --prompt 256,1024
    python bench/grpo_step.py --merge
    python bench/grpo_step.py --tiny --shape gemma-2-2b --systems eager,fastgrpo --completions 16   # CPU smoke run
"""
import gc
import inspect
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from _profile import GcPauses, profile_device, profile_step  # noqa: E402

PROMPT, GROUP, LORA_RANK = 256, 8, 16
DYNAMIC = True  # one compile serves every completion length
# fastgrpo variants: backend options of each.
# Checkpointing is on in every system here (offloaded on CUDA), so fastgrpo's gated-MLP op recomputes the
# projections in its backward while the checkpoint's recompute skips the MLP, padded or packed (what the TRL
# integration does then); the other variants measure the forms compiler.options.training_options picks elsewhere.
_SAVED_PROJECTIONS = {"save_mlp_projections": True}
_ACT_MUL = {"absorb_mlp_projections": False}
FASTGRPO_OPTIONS = {
    "fastgrpo": None,
    "fastgrpo_save": _SAVED_PROJECTIONS,
    "fastgrpo_actmul": _ACT_MUL,
    "fastgrpo_nojoin": None,
    "fastgrpo_nocombo": {"combo_kernels": False},
    "fastgrpo_packed": None,
    "fastgrpo_shared": None,
    "fastgrpo_packed_save": _SAVED_PROJECTIONS,
    "fastgrpo_packed_actmul": _ACT_MUL,
    "fastgrpo_packed_nojoin": None,
}
# Variants that run every pattern but these (resolved against fastgrpo.passes.PASSES when the system is built, so a
# pattern added later is not silently left out).
PATTERNS_LEFT_OUT = {"fastgrpo_nojoin": ("joined_projections",), "fastgrpo_packed_nojoin": ("joined_projections",)}
# Packed variants: whether the group's prompt is shared.
PACKED = {"fastgrpo_packed": False, "fastgrpo_shared": True, "fastgrpo_packed_save": False,
          "fastgrpo_packed_actmul": False, "fastgrpo_packed_nojoin": False}
SYSTEMS = ("eager", "inductor", "liger", *FASTGRPO_OPTIONS)


def spread_lengths(completion: int, group: int = GROUP, seed: int = 0) -> list[int]:
    """Completion lengths of one group, uniform in [10 %, 100 %] of `completion` (fixed seed per length).

    bench/peers/unsloth_step.py --spread imports this, so Unsloth times exactly the same batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + completion)
    return torch.randint(max(1, completion // 10), completion + 1, (group,), generator=generator).tolist()


def qwen25_15b_config(max_len: int):
    """The Qwen2.5-1.5B shape's config (bench/grpo_qlora_step.py builds its model from it)."""
    return harness.shape_config("qwen2.5-1.5b", max_len)


def softcap(config) -> float:
    """The final-logit softcap of `config` (0: none)."""
    return float(getattr(config, "final_logit_softcapping", None) or 0.0)


def apply_liger(model_type: str) -> None:
    """Liger's kernels for `model_type` (rope, RMSNorm, the gated MLP's activation; not its losses), as its
    apply_liger_kernel_to_<model> names them."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"Liger has no kernels for model_type {model_type!r}")
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    wanted = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False)
    apply(**{k: v for k, v in wanted.items() if k in inspect.signature(apply).parameters})


def build_policy(system: str, max_len: int, tiny: bool, shape: str = harness.DEFAULT_SHAPE):
    import peft

    config = harness.shape_config(shape, max_len, tiny)
    if system == "liger":
        apply_liger(config.model_type)
    device = harness.device()
    model = harness.causal_lm(config, device)
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
                                         offload_checkpointing=device.type == "cuda")
    elif system not in ("eager", "liger"):
        raise ValueError(f"unknown system {system!r}: give one of {', '.join(SYSTEMS)}")
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
    cap = softcap(base.config)

    if system in PACKED:
        from fastgrpo.integrations.packing import Packer
        from fastgrpo.kernels.selective_logprob import selective_logprob

        packer = Packer(share_prompt=PACKED[system])

        def step(ids, mask, adv):
            # TRL's rows: [prompt | completion], the completion's padding masked out of attention and labels.
            attention_mask = torch.cat([torch.ones_like(ids[:, :prompt]), mask.to(ids.dtype)], 1)
            labels = ids.masked_fill(attention_mask == 0, -100)
            labels[:, :prompt] = -100
            call = packer.prepare(base, {"input_ids": ids, "attention_mask": attention_mask}, labels, prompt)
            if call is None:
                raise RuntimeError(f"{system}: the batch was not packed ({sorted(packer.said)})")
            hidden = base.get_decoder()(**call.kwargs).last_hidden_state[0, call.plan.source]
            logps = call.plan.scatter(selective_logprob(hidden, head, call.plan.targets, softcap=cap))[:, prompt - 1:]
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            grpo_loss(logps, mask, adv).backward()
    elif system in ("eager", "inductor"):
        def step(ids, mask, adv):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=completion + 1).logits[:, :-1]
            logps = selective_log_softmax_bf16(logits, ids[:, -completion:])
            del logits  # TRL's log-prob function returns before backward
            grpo_loss(logps, mask, adv).backward()
    elif system == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        if cap and "softcap" not in inspect.signature(LigerFusedLinearGRPOLoss).parameters:
            raise NotImplementedError("LigerFusedLinearGRPOLoss has no final-logit softcap: it would compute other "
                                      "log-probs than this model's")
        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo",
                                           **({"softcap": cap} if cap else {}))

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            out = loss_fn(hidden, head, ids[:, -completion:], mask, adv)
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            (out[0] if isinstance(out, tuple) else out).backward()
    elif system in FASTGRPO_OPTIONS:
        from fastgrpo.kernels.selective_logprob import selective_logprob

        def step(ids, mask, adv):
            hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -completion - 1:-1]
            loss = grpo_loss(selective_logprob(hidden, head, ids[:, -completion:], softcap=cap), mask, adv)
            del hidden  # as a trainer's compute_loss returns the loss before backward: only autograd holds it then
            loss.backward()
    else:
        raise ValueError(f"unknown system {system!r}: give one of {', '.join(SYSTEMS)}")
    return step


def with_mixed_precision(step, device: torch.device):
    """The step under bf16 autocast, as TRL's trainer runs it with `bf16=True` (accelerate's mixed precision)."""
    def mixed_precision_step(*args):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            step(*args)

    return mixed_precision_step


def timed_steps(step, args, model, count: int, before_each=None, host_times: list | None = None) -> list[float]:
    """`step(*args)` `count` times, the gradients cleared after each: each step's wall time in ms (harness.wall_ms)."""
    return harness.wall_ms(lambda: step(*args), count, before_each=before_each,
                           after_each=lambda: model.zero_grad(set_to_none=True), host_ms=host_times)


def warm_steps(step, args, model, count: int) -> None:
    """`count` untimed steps as timed_steps runs them, the cache released before the last (harness.warm_up)."""
    harness.warm_up(lambda: step(*args), count, after_each=lambda: model.zero_grad(set_to_none=True))


def ab_blocks(step, args, model, repeat: int, setting: str) -> str:
    """A/B in one process: `repeat` steps with `setting` ("module.attr=literal") applied, then `repeat` as it
    was, twice over (one settling step before each block). The host and GPU stay the same, so the difference
    is the change's, without the spread between lent machines (the same step took 749-783 ms on four of them)."""
    module, attr, changed, target = harness.parse_setting(setting, "--ab")
    original = getattr(module, attr)
    lines = []
    for label, current in (("changed", changed), ("as is", original)) * 2:
        with harness.patched((module, attr, current)):
            warm_steps(step, args, model, 1)
            harness.reset_peak()
            times = timed_steps(step, args, model, repeat)
            peak, reserved = harness.peak_gib(), harness.peak_reserved_gib()
        lines.append(f"AB {target} = {current!r} ({label}): median {statistics.median(times):.1f} ms, "
                     f"{[round(t, 1) for t in times]}"
                     + ("" if peak is None else f", peak {peak:.2f} GiB ({reserved:.2f} reserved)"))
    return "\n".join(lines)


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
        gc_freeze: bool = True, ab: list[str] = (), device_profile_only: bool = False,
        shape: str = harness.DEFAULT_SHAPE, label: str | None = None, record: bool = False) -> list[dict]:
    """Each completion length's row: printed, and with `record` appended to bench/results/grpo_step.jsonl as soon as
    it is timed (a run cut short keeps its finished rows). `label` names the system in the rows (default `system`)."""
    results = []
    case = {"shape": shape, "system": label or system, "prompt": prompt, "spread": spread}

    def finish(result):
        harness.emit(result)
        if record:
            harness.record("grpo_step", [result])
        results.append(result)

    try:
        model = build_policy(system, prompt + max(completions) + 8, tiny, shape)
    except Exception as err:  # e.g. a peer that is not installed
        for completion in completions:
            finish({**case, "completion": completion, "step_ms": None, "peak_gib": None, "tokens_per_s": None,
                    "error": f"{type(err).__name__}: {str(err)[:200]}"})
        return results
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    for completion in completions:
        result = {**case, "completion": completion, "step_ms": None, "ms_all": [], "peak_gib": None,
                  "tokens_per_s": None, "error": None}
        try:
            ids, mask, adv, tokens, lengths = make_batch(vocab, prompt, completion, spread, device)
            result.update(tokens=tokens, lengths=lengths)
            step = with_mixed_precision(make_step(system, model, mask.shape[1], prompt), device)
            # What earlier lengths and the compiles left cached is not this step's reserve.
            warm_steps(step, (ids, mask, adv), model, warmup)
            harness.reset_peak()
            if device.type == "cuda":  # what the step starts from: weights, caches, anything an earlier system left
                result["in_use_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            frozen = gc_freeze and system in FASTGRPO_OPTIONS
            if frozen:  # as fastgrpo's trainer does after its first step (the peers' collectors are left alone)
                gc.collect()
                gc.freeze()
            try:
                with GcPauses() as pauses:
                    host_times = []
                    times = timed_steps(step, (ids, mask, adv), model, repeat, host_times=host_times)
                peak = harness.peak_gib()  # before any A/B block (whose graphs or buffers would count)
                result["peak_reserved_gib"] = harness.peak_reserved_gib()
                graphs = sys.modules.get("fastgrpo.kernels._graphs")
                if graphs is not None and graphs.stats["captured"]:  # op bodies replayed as CUDA graphs
                    result["op_graphs"] = {**graphs.stats, "pool_mib": round(graphs.graph_pool_bytes() / 2**20),
                                           "staging_mib": round(graphs.staging_bytes() / 2**20)}
                offload = sys.modules.get("fastgrpo.compiler.offload")
                handle = offload.offload_handle(model) if offload is not None and system in FASTGRPO_OPTIONS else None
                if handle is not None and handle.graphs.stats["captured"]:  # layer calls replayed as CUDA graphs
                    result["layer_graphs"] = handle.graphs.summary()
                for setting in ab:
                    setting, _, lengths = setting.partition("@")
                    if not lengths or completion in {int(c) for c in lengths.split(",")}:
                        print(ab_blocks(step, (ids, mask, adv), model, repeat, setting), flush=True)
            finally:
                if frozen:  # a later system in this process, a peer maybe, starts with its collector as it was
                    gc.unfreeze()
            result.update(gc_ms=round(pauses.ms, 1), gc_full=pauses.full, gc_frozen=frozen)
            median = statistics.median(times)
            result.update(step_ms=round(median, 1), ms_all=[round(t, 1) for t in times],
                          host_ms_median=round(statistics.median(host_times), 1),
                          tokens_per_s=round(tokens / median * 1e3), peak_gib=peak)
            if completion in profile_at:
                label = f"{shape} {system} completion={completion}"
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
        finish(result)
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
    """The batch a result timed: (shape, prompt, completion, spread)."""
    return r["shape"], r["prompt"], r["completion"], bool(r["spread"])


def table(results: list[dict]) -> str:
    by = {(r["system"], case_key(r)): r for r in results}
    order = ["eager", "inductor", "liger", "unsloth", *FASTGRPO_OPTIONS]
    systems = [s for s in order if any(k[0] == s for k in by)]
    best = [s for s in ("fastgrpo_shared", "fastgrpo_packed", "fastgrpo") if s in systems]
    lines = [harness.md_header(
        "shape / prompt / completion", *systems, "fastgrpo tok/s vs unsloth", "fastgrpo mem vs unsloth",
        "vs inductor tok/s", "vs liger mem", "packed / shared tok/s vs padded fastgrpo", "best fastgrpo vs unsloth")]
    for case in sorted({k[1] for k in by}):
        cells = []
        for s in systems:
            r = by.get((s, case))
            if r is None:
                cells.append("-")
            elif r["error"]:
                cells.append(r["error"][:40])
            else:
                cells.append(f"{r['step_ms']:.0f} ms, {r['peak_gib']} GiB, {r['tokens_per_s']} tok/s")

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
        shape, prompt, length, spread = case
        lines.append(harness.md_row(f"{shape} / {prompt} / {length}{' spread' if spread else ''}", *cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES),
                        help="the model shape (default %(default)s)")
    parser.add_argument("--systems", default="eager,inductor,liger,fastgrpo",
                        help="comma list of: " + ", ".join(SYSTEMS))
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
    parser.add_argument("--graph-chunk-rows", type=int,
                        help="rows a chunk of the gated-MLP op's CUDA-graph replayed calls has at most (default "
                             "2048: fastgrpo.kernels.gated_mlp.GRAPH_CHUNK_ROWS; the graphs' pool holds one chunk's "
                             "temporaries); the systems' names get a _graphchunk<rows> suffix")
    parser.add_argument("--ab", metavar="MODULE.ATTR=VALUE", action="append", default=[],
                        help="after each timed row, A/B a setting in the same process (ab_blocks; repeat the flag for "
                             "several, each against the tree as it is; a suffix @1024,4096 limits it to those "
                             "completion lengths), e.g. fastgrpo.kernels._lora_gemm.JOIN_MIN_ROWS_PER_HIDDEN=1000000000")
    parser.add_argument("--tiny", action="store_true",
                        help="two small layers of the shape: checks the script runs (CPU is fine; rows not recorded)")
    parser.add_argument("--merge", nargs="*", metavar="JSONL",
                        help="print the table of these JSON-lines files (default bench/results/grpo_step.jsonl) "
                             "instead of running")
    args = parser.parse_args(argv)
    if args.merge is not None:
        print(table(harness.read_rows(*(args.merge or [harness.results_path("grpo_step")]))))
        return 0
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}: give some of {', '.join(SYSTEMS)}")
    completions = [int(c) for c in args.completions.split(",")]
    if args.mlp_chunk_mib:
        from fastgrpo.kernels import _row_chunks
        _row_chunks.CHUNK_BYTES = args.mlp_chunk_mib * 2**20
    if args.graph_chunk_rows:
        from fastgrpo.kernels import gated_mlp
        gated_mlp.GRAPH_CHUNK_ROWS = args.graph_chunk_rows
    profile_at = tuple(int(c) for c in args.profile_at.split(",") if c)
    suffix = f"_chunk{args.mlp_chunk_mib}" if args.mlp_chunk_mib else ""
    suffix += f"_graphchunk{args.graph_chunk_rows}" if args.graph_chunk_rows else ""
    results = []
    for prompt in [int(p) for p in args.prompt.split(",")]:
        for system in systems:
            results += run(system, completions, args.warmup, args.repeat, args.tiny, profile_at, prompt,
                           args.spread, not args.no_gc_freeze, args.ab, args.device_profile_only, args.shape,
                           label=system + suffix, record=not args.tiny)
    if not args.tiny:
        print(f"rows appended to {harness.results_path('grpo_step')}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
