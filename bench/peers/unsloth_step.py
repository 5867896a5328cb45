"""Unsloth's GRPO policy-loss training step (the peer to beat) on bench/grpo_step.py's workload.

Same workload as bench/grpo_step.py: a named shape (`--shape`, bench/_harness.py's SHAPES; default Qwen2.5-1.5B)
with random bf16 weights, LoRA r=16 on q,k,v,o,gate,up,down, G=8 completions of a 256-token prompt, TRL's "grpo"
loss (per-sequence mean) with beta=0. Unsloth's own way: FastLanguageModel + get_peft_model(use_gradient_checkpointing=
"unsloth") and the GRPOTrainer Unsloth generates from TRL's (use_vllm=False). Timed:
trainer.training_step(model, batch, None) on one fixed batch shaped like the dict that Unsloth's
_generate_and_score_completions hands to compute_loss; the rollout is skipped (_prepare_inputs
returns the batch as is). Median of --repeat after --warmup steps, CUDA-synchronised wall time;
peak memory of the timed steps (reset after warm-up, like grpo_step.py). One "RESULT {json}" line
per completion length on stdout; the rows are appended to bench/results/grpo_step.jsonl (system "unsloth", not
with --tiny), where `python bench/grpo_step.py --merge` tables them beside the other systems.

Unsloth reads a checkpoint directory, so a random one (weights + a WordLevel tokenizer of the full
vocabulary) is written to a temporary directory first. Needs CUDA (Unsloth's model loader does);
--tiny (2 layers, vocab 512) is a quick check of the plumbing.

--spread times the batches bench/grpo_step.py --spread times: completion lengths from its
`spread_lengths` (uniform in [10 %, 100 %] of each length, same seed), the batch right-padded to
its longest row with pad tokens and completion_mask zero past each row's length, as TRL builds it;
tokens/s counts real tokens (G*P + sum of lengths). --prompt sets the prompt length. All rows of
the group share one prompt, as in grpo_step.py.

    python bench/peers/unsloth_step.py 1024 4096 16384
    python bench/peers/unsloth_step.py 1024 4096 --shape llama-3.1-8b
    python bench/peers/unsloth_step.py 1024,4096 --spread --prompt 1024
"""
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
from _profile import GcPauses, profile_step  # noqa: E402  (bench/_profile.py: the same profile as grpo_step.py's)
from grpo_step import spread_lengths  # noqa: E402  (bench/grpo_step.py: the same spread)

PROMPT, GROUP, LORA_RANK = 256, 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# No network on the device: every load must stay local. Set before Unsloth is imported (in main).
OFFLINE = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
               UNSLOTH_COMPILE_LOCATION="/tmp/unsloth_cache", HF_HOME="/tmp/hf_home")


def special_ids(vocab: int) -> dict:
    """Special tokens at Qwen2.5's places from the top of the vocabulary (pad <|endoftext|> 151643, eos
    <|im_end|> 151645 of 151936), whatever the shape's vocabulary."""
    return {"<|endoftext|>": vocab - 293, "<|im_end|>": vocab - 291, "<unk>": vocab - 290}


def write_checkpoint(path: str, max_len: int, tiny: bool, device: str, shape: str = harness.DEFAULT_SHAPE) -> int:
    """Random-weight checkpoint of `shape` plus a tokenizer whose vocabulary is exactly the embedding size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = harness.shape_config(shape, max(32768, max_len), tiny)
    specials = special_ids(config.vocab_size)
    config.pad_token_id, config.eos_token_id = specials["<|endoftext|>"], specials["<|im_end|>"]
    model = harness.causal_lm(config, device, seed=0)
    model.save_pretrained(path)
    del model
    names = {i: t for t, i in specials.items()}
    vocab = {names.get(i, f"t{i}"): i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", unk_token="<unk>", model_max_length=max_len)
    tokenizer.save_pretrained(path)
    return config.vocab_size


def build_trainer(path: str, max_len: int, max_completion: int, on_gpu: bool):
    from unsloth import FastLanguageModel  # must precede transformers/trl/peft so its patches apply
    import trl
    from datasets import Dataset

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=path, max_seq_length=max_len, dtype=torch.bfloat16, load_in_4bit=False, load_in_8bit=False,
        full_finetuning=False, fast_inference=False, use_exact_model_name=True, local_files_only=True,
    )
    model = FastLanguageModel.get_peft_model(
        model, r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0, bias="none", target_modules=TARGETS,
        use_gradient_checkpointing="unsloth", random_state=3407, max_seq_length=max_len,
    )
    if not trl.GRPOTrainer.__name__.startswith("Unsloth"):  # its import-time rewrite failed: say so, time nothing
        raise RuntimeError(f"trl.GRPOTrainer is {trl.GRPOTrainer.__module__}.{trl.GRPOTrainer.__name__}, not Unsloth's")

    def zero_reward(completions, **kwargs):
        return [0.0] * len(completions)

    args = trl.GRPOConfig(
        output_dir=os.path.join(path, "trainer"), per_device_train_batch_size=GROUP, num_generations=GROUP,
        gradient_accumulation_steps=1, max_completion_length=max_completion, loss_type="grpo", beta=0.0,
        use_vllm=False, bf16=on_gpu, report_to="none", save_strategy="no", logging_steps=1, max_steps=1,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[zero_reward], args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": ["t1 t2 t3"] * (2 * GROUP)}))
    # What train() does before its first step: the constructor leaves the model in inference mode,
    # and the loop sets the accumulation window that training_step reads.
    use_gc = getattr(trainer.model, "_unsloth_gradient_checkpointing", "unsloth")
    trainer.model.for_training(use_gradient_checkpointing=use_gc)
    trainer.current_gradient_accumulation_steps = 1
    trainer._prepare_inputs = lambda batch: batch  # the batch below stands in for a finished rollout
    return trainer


def make_batch(completion: int, vocab: int, pad_id: int, device, prompt: int = PROMPT,
               lengths: list[int] | None = None) -> dict:
    """The dict Unsloth's _generate_and_score_completions returns with beta=0 and one iteration:
    no old/ref log-probs, max_left_pad per row. Real token ids avoid pad_id: Unsloth drops pad tokens.
    With `lengths`, row i has lengths[i] completion tokens, then pad tokens up to the longest row."""
    first_special = min(special_ids(vocab).values())
    if pad_id < first_special:
        raise ValueError(f"pad_token_id {pad_id} is not the checkpoint's <|endoftext|> ({first_special})")
    lengths = lengths or [completion] * GROUP
    width = max(lengths)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, first_special, (GROUP, prompt + width), generator=gen)
    ids[:, :prompt] = ids[0, :prompt]
    completion_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).to(torch.int32)
    ids[:, prompt:] = ids[:, prompt:].masked_fill(completion_mask == 0, pad_id)
    ids, completion_mask = ids.to(device), completion_mask.to(device)
    return {
        "prompt_ids": ids[:, :prompt], "prompt_mask": torch.ones(GROUP, prompt, dtype=torch.int64, device=device),
        "completion_ids": ids[:, prompt:], "completion_mask": completion_mask,
        "advantages": torch.randn(GROUP, generator=gen).to(device), "num_items_in_batch": completion_mask.sum(),
        "max_left_pad": torch.zeros(GROUP, 1, dtype=torch.int64), "sampling_per_token_logps": None,
    }


def run_setting(trainer, completion: int, vocab: int, pad_id: int, warmup: int, repeat: int, extra: dict,
                prompt: int = PROMPT, spread: bool = False, profile: bool = False) -> dict:
    lengths = spread_lengths(completion, GROUP) if spread else [completion] * GROUP
    tokens = GROUP * prompt + sum(lengths)
    result = {"system": "unsloth", "completion": completion, "step_ms": None, "ms_all": [], "peak_gib": None,
              "tokens_per_s": None, "error": None, **extra, "spread": spread, "tokens": tokens, "lengths": lengths}
    model = trainer.model
    on_gpu = torch.cuda.is_available()
    try:
        batch = make_batch(completion, vocab, pad_id, model.get_input_embeddings().weight.device, prompt, lengths)
        losses = [None]

        def step():
            losses[0] = trainer.training_step(model, dict(batch), None)

        def clear():
            model.zero_grad(set_to_none=True)

        harness.warm_up(step, warmup, after_each=clear)  # as grpo_step.py: the reserved peak of a steady step
        harness.reset_peak()
        with GcPauses() as pauses:  # Unsloth as it runs: its collector left alone
            times = harness.wall_ms(step, repeat, after_each=clear)
        loss = losses[0]
        result.update(gc_ms=round(pauses.ms, 1), gc_full=pauses.full)
        if profile:
            profile_step(lambda: trainer.training_step(model, dict(batch), None), (), f"{extra['shape']} unsloth completion={completion}")
            model.zero_grad(set_to_none=True)
        median = statistics.median(times)
        unwrapped = trainer.accelerator.unwrap_model(model)
        result.update(step_ms=round(median, 1), ms_all=[round(t, 1) for t in times],
                      tokens_per_s=round(tokens / median * 1e3), loss=float(loss),
                      # Unsloth silently falls back to a padded [G, P+C] forward when its packed one fails its check
                      seq_packing=bool(getattr(unwrapped, "_unsloth_seq_packing_grad_ok", False)
                                       and getattr(unwrapped, "_unsloth_seq_packing_grad_verified_T", 0)
                                       >= tokens))
        result["peak_gib"] = harness.peak_gib()
        result["peak_reserved_gib"] = harness.peak_reserved_gib()
    except torch.OutOfMemoryError:
        result["error"] = "OOM"
    except Exception as err:  # one failing length must not hide the others' numbers
        traceback.print_exc()
        oom = "out of memory" in str(err).lower()  # an OOM re-raised under another type by Unsloth's fallbacks
        result["error"] = "OOM" if oom else f"{type(err).__name__}: {str(err)[:300]}"
    model.zero_grad(set_to_none=True)
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("completions", nargs="*", default=["1024", "4096", "16384"],
                        help="completion lengths (spaces or commas)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt length")
    parser.add_argument("--shape", default=harness.DEFAULT_SHAPE, choices=sorted(harness.SHAPES),
                        help="the model shape (default %(default)s)")
    parser.add_argument("--spread", action="store_true",
                        help="completion lengths of bench/grpo_step.py --spread (uniform in [10 %%, 100 %%], same seed)")
    parser.add_argument("--profile-at", default="", help="profile one step at these completion lengths (comma list)")
    parser.add_argument("--tiny", action="store_true",
                        help="two small layers of the shape: a quick check of the plumbing (still needs CUDA; rows "
                             "not recorded)")
    args = parser.parse_args(argv)
    completions = [int(c) for arg in args.completions for c in arg.split(",") if c]
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    on_gpu = torch.cuda.is_available()
    max_len = args.prompt + max(completions)
    workdir = tempfile.mkdtemp(prefix="unsloth_step_", dir="/tmp")
    extra = {"shape": args.shape, "prompt": args.prompt, "group": GROUP}

    def emit(row):
        harness.emit(row)
        if not args.tiny:
            harness.record("grpo_step", [row])

    try:
        started = time.perf_counter()
        import unsloth  # noqa: F401  (first, so that it patches transformers/trl/peft before they load)
        import unsloth_zoo

        extra["versions"] = (f"unsloth {unsloth.__version__}, unsloth_zoo {unsloth_zoo.__version__}, "
                             f"torch {torch.__version__}")
        vocab = write_checkpoint(workdir, max_len, args.tiny, "cuda" if on_gpu else "cpu", args.shape)
        gc.collect()  # the checkpoint's model must not stay resident and count in every peak below
        if on_gpu:
            torch.cuda.empty_cache()
        trainer = build_trainer(workdir, max_len, max(completions), on_gpu)
        extra["trainer_class"] = type(trainer).__name__
        if on_gpu:  # weights + LoRA + optimizer-free trainer state: the floor under every peak_gib
            extra["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        print(f"unsloth_step: setup {time.perf_counter() - started:.0f} s, {extra}", file=sys.stderr, flush=True)
    except Exception as err:
        traceback.print_exc()
        for completion in completions:
            emit({"system": "unsloth", "completion": completion, "step_ms": None, "ms_all": [], "peak_gib": None,
                  "tokens_per_s": None, "spread": args.spread,
                  "error": f"setup failed: {type(err).__name__}: {str(err)[:300]}", **extra})
        shutil.rmtree(workdir, ignore_errors=True)
        return 1
    for completion in completions:
        started = time.perf_counter()
        pad_id = trainer.processing_class.pad_token_id
        emit(run_setting(trainer, completion, vocab, pad_id, args.warmup, args.repeat, extra, args.prompt,
                         args.spread, str(completion) in args.profile_at.split(",")))
        print(f"unsloth_step: completion {completion} took {time.perf_counter() - started:.0f} s", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
