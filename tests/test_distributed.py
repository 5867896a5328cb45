"""Several processes through the engines users already launch: DDP under `accelerate launch`, FSDP2 under torchrun.

Real torch.distributed on CPU: the gloo backend, 2 processes started with subprocess. This file is also the
worker those processes run (`python tests/test_distributed.py <mode> ...`), so the test and what it launches
stay side by side.

Launching on CPU: `accelerate launch --cpu --num_processes 2` starts ONE process unless an MPI hostfile is given
(accelerate's CPU launcher is mpirun); `accelerate launch --multi_gpu --num_processes 2` on a machine without
CUDA starts 2 processes through torchrun and accelerate picks MULTI_CPU with gloo. The tests use the latter.
accelerate's FSDP plugin (`--use_fsdp`) is ignored on CPU (the model is wrapped in DDP), so the trainer under
FSDP2 is a `gpu` test (2 GPUs); FSDP2's `fully_shard` itself runs on CPU/gloo and is tested here directly.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
VOCAB = 1024
PROMPTS = ["hello world", "count to ten"]
GROUP = 8  # num_generations: with 2 processes each group is split across the ranks
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
STEPS = 2


def fixed_completion(row: int, eos: int) -> list[int]:
    """The completion of global row `row` of a generation batch: varying lengths, some ending with EOS."""
    table = [[5, 700, 12], [900, 901, eos], [40, 41, 42, 43, 44, 45], [600, eos], [3, 4, 5, 6, 7, 8],
             [800, 20, 30, eos], [1000], [50, 600, 51, 601, eos]]  # fmt: skip
    return list(table[row % len(table)])


def low_id_fraction(completion_ids, **kwargs):
    """A reward that varies within every group."""
    return [sum(t < VOCAB // 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def child_env() -> dict:
    # The NCCL settings are what the multi-GPU device host needs; CPU runs ignore them.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # fmt: skip


def launch(*runs: tuple[list[str], list[str]], timeout: int) -> None:
    """Run each `launcher script_args` at the same time; on a failure show the end of its processes' output."""
    cmds = [[sys.executable, "-m", *launcher, *script_args] for launcher, script_args in runs]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in cmds]  # fmt: skip
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for cmd, proc, output in zip(cmds, procs, outputs):
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")


def accelerate_launch(processes: int, cpu: bool = True, fsdp2: bool = False) -> list[str]:
    # --multi_gpu refuses one process; --cpu with one process is the plain single-process launch. One process on a
    # multi-GPU host gets one GPU (with several visible, Trainer would wrap the model in nn.DataParallel).
    if processes == 1:
        mode = ["--cpu"] if cpu else ["--gpu_ids", "0"]
    elif fsdp2:
        mode = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                "--fsdp_transformer_layer_cls_to_wrap", "Qwen2DecoderLayer"]  # fmt: skip
    else:
        mode = ["--multi_gpu"]
    if processes > 1:
        mode += ["--main_process_port", str(free_port())]
    return ["accelerate.commands.launch", *mode, "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


def torchrun(processes: int) -> list[str]:
    return ["torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(free_port())]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# Worker side: what each launched process runs.


def run_trainer(model_dir: str, out_path: str, device_type: str = "cpu") -> None:
    """fastgrpo's GRPOTrainer for STEPS steps with fixed completions; rank 0 saves per-step LoRA grads, logs, weights.

    The global batch is one group of GROUP rows whatever the number of processes, so 1 and 2 processes must agree.
    Step 1 uses TRL's default "dapo" loss (normalized by the completion tokens gathered over all ranks), step 2
    "grpo" (per-sequence means, averaged per rank, then by DDP); num_iterations=2 makes step 2 reuse step 1's
    completions with old-policy log-probs, so the clipped ratio is exercised too. On CUDA (fp32, the backend's
    default inductor) the same runs under DDP or, launched with accelerate's FSDP2 plugin, FSDP2.
    """
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import fastgrpo
    import fastgrpo.integrations.trl as F

    cpu = device_type == "cpu"
    if cpu:
        torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = F.GRPOConfig(
        output_dir=str(Path(out_path).parent / f"trainer-{world}"), per_device_train_batch_size=GROUP // world,
        num_generations=GROUP, max_completion_length=6, max_steps=STEPS, num_iterations=2, beta=0.04,
        optim="sgd", learning_rate=0.1, max_grad_norm=0.0, use_cpu=cpu, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, seed=0, gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": False},
        fastgrpo_compile_options={"inner": "aot_eager"} if cpu else None, fastgrpo_mini_batch=3, fastgrpo_logprob_chunk=5,
        disable_tqdm=True,
        # Gradient buckets of ~100 bytes: inside DDP's forward Dynamo would cut the compiled graph at every bucket
        # boundary (its DDPOptimizer) and lose the patterns spanning a cut; fastgrpo compiles it whole.
        ddp_bucket_cap_mb=1e-4 if world > 1 else None,
    )  # fmt: skip
    records = {"grads": [], "loss_types": []}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer.loss_type = ["dapo", "grpo"][state.global_step]
            records["loss_types"].append(trainer.loss_type)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # After the backward: under DDP the gradients are already averaged over the ranks.
            records["grads"].append({n: full(p.grad) for n, p in lora_params(trainer.model)})

    trainer = F.GRPOTrainer(
        model=model, reward_funcs=low_id_fraction, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer, peft_config=LoraConfig(**LORA), callbacks=[Probe()],
    )  # fmt: skip
    eos, rank = tokenizer.eos_token_id, trainer.accelerator.process_index

    def generate(prompt_ids, *args, **kwargs):
        # The completion depends on the row's place in the global batch, not on how the batch is split.
        return [fixed_completion(rank * len(prompt_ids) + i, eos) for i in range(len(prompt_ids))], None

    trainer._generate_single_turn = generate
    set_lora(trainer.model, seed=1, scale=0.3)  # nonzero B: every LoRA parameter gets a gradient
    trainer.train()

    assert trainer.accelerator.num_processes == world
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    assert trainer.is_fsdp_enabled == (fsdp_requested and not cpu)  # on CPU accelerate ignores FSDP: DDP instead
    if world > 1 and not trainer.is_fsdp_enabled:
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    # The decoder ran through the fastgrpo backend on this rank (no silent fallback to eager).
    assert any(head.backbone._compiled is not None for head in trainer._fastgrpo_heads) and fastgrpo.fusion_reports()
    weights = {n: full(p) for n, p in lora_params(trainer.model)}  # every rank: gathering FSDP shards is collective
    if rank == 0:
        matched = [{name: rec["matched"] for name, rec in r["patterns"].items()} for r in fastgrpo.fusion_reports()]
        records.update(logs=[log for log in trainer.state.log_history if "loss" in log], weights=weights, world=world,
                       matched=matched)  # fmt: skip
        torch.save(records, out_path)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # close the process group: exiting with it open can abort (gloo)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy; FSDP2's sharded DTensors gathered whole."""
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu().clone()


def lora_params(model):
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return sorted((n, p) for n, p in model.named_parameters() if "lora_" in n)


def set_lora(model, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in lora_params(model):
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def run_fsdp2(out_path: str, device_type: str = "cpu") -> None:
    """FSDP2 on each decoder layer and the root, then the layers compiled with the fastgrpo backend.

    Each rank also runs the unsharded model eagerly on the whole batch; the sharded run gets half the batch per
    rank. Saves, from rank 0, every gradient of both runs (sharded ones gathered with full_tensor) and the
    fusion reports, for a full fine-tune and for LoRA. CPU: gloo and the backend handing off to aot_eager;
    CUDA: NCCL, one GPU per rank, inductor and the Triton kernels.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fastgrpo
    from fastgrpo.compiler.regions import repeated_blocks
    from fastgrpo.compiler.tiny import tiny_model

    if device_type == "cuda":
        device, backend, inner = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl", "inductor"
        torch.cuda.set_device(device)
    else:
        device, backend, inner = torch.device("cpu"), "gloo", "aot_eager"
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device_type, (world,))
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(7)).to(device)
    weights = torch.linspace(0.5, 2.0, ids.numel()).view(ids.shape).to(device)

    def loss_fn(model, rows):
        logits = model(input_ids=ids[rows], use_cache=False).logits
        return (logits.float().square().mean(-1) * weights[rows]).sum() / ids.numel()

    results = {}
    for case, lora in (("full", False), ("lora", True)):
        reference = tiny_model("qwen2", lora=lora).to(device)
        loss_fn(reference, slice(None)).backward()
        expected = {n: p.grad.cpu() for n, p in reference.named_parameters() if p.grad is not None}

        model = tiny_model("qwen2", lora=lora).to(device)
        layers = repeated_blocks(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fastgrpo.clear_fusion_reports()
        torch._dynamo.reset()
        compiled = fastgrpo.compile_repeated_blocks(model, options={"inner": inner})
        per_rank = ids.shape[0] // world
        # The loss sums over all rows of the global batch; FSDP averages gradients, so scale by the world size.
        (loss_fn(model, slice(rank * per_rank, (rank + 1) * per_rank)) * world).backward()
        sharded = {}
        for name, param in model.named_parameters():
            if param.grad is not None:
                assert type(param.grad).__name__ == "DTensor", (name, type(param.grad))
                sharded[name] = param.grad.full_tensor().cpu()
        results[case] = dict(
            expected=expected, sharded=sharded, compiled_layers=compiled, layers=len(layers),
            reports=[{k: dict(v) for k, v in r["patterns"].items()} for r in fastgrpo.fusion_reports()],
        )  # fmt: skip
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Test side.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 and a byte-level BPE tokenizer with a chat template, saved like a hub model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_models import tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = tiny_tokenizer(PROMPTS + ["the quick brown fox jumps", "What is 3 + 4? 7"], VOCAB)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def check_matches_one_process(single: dict, multi: dict, rtol: float) -> None:
    """Per-step logged loss and metrics, per-step LoRA gradients and the final LoRA weights agree."""
    assert (single["world"], multi["world"]) == (1, 2)
    # Every graph compiled under DDP is one the single process compiled too, with the same sites fused (a graph
    # cut into pieces would show as graphs with fewer sites).
    assert {str(m) for m in multi["matched"]} == {str(m) for m in single["matched"]}, (single["matched"], multi["matched"])
    assert single["loss_types"] == multi["loss_types"] == ["dapo", "grpo"]
    assert len(single["logs"]) == len(multi["logs"]) == STEPS
    assert "reward" in single["logs"][0]  # step 2 trains on step 1's completions: no new rewards to log
    for step, (a, b) in enumerate(zip(single["logs"], multi["logs"])):
        assert a.keys() == b.keys()
        for key in ("loss", "reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rtol / 10, abs=rtol / 100), (step, key)
    assert single["logs"][1]["clip_ratio/region_mean"] > 0  # the clipped branch is exercised
    for step in range(STEPS):
        expected, actual = single["grads"][step], multi["grads"][step]
        assert expected.keys() == actual.keys() and len(expected) == 2 * 7 * 2
        for name in expected:
            scale = expected[name].abs().max()
            assert scale > 0, (step, name)
            # Absolute slack relative to the gradient's scale: each process packs the rows it sees, so a prompt is
            # shared by other sets of rows in 1 and 2 processes and sums in another order (1e-6 of the scale after
            # step 1, 2e-5 after step 2 on the CPU); a DDP mistake is off by O(1).
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=rtol * scale, msg=f"step {step} {name}")
    for name, weight in single["weights"].items():
        torch.testing.assert_close(multi["weights"][name], weight, rtol=rtol, atol=rtol / 100, msg=name)


def test_ddp_two_processes_match_one_process(model_dir, tmp_path):
    # The 1-process run goes through the same launcher, so both runs are built the same way.
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    launch(
        (accelerate_launch(1), [__file__, "trainer", str(model_dir), str(one)]),
        (accelerate_launch(2), [__file__, "trainer", str(model_dir), str(two)]),
        timeout=300,
    )
    check_matches_one_process(torch.load(one), torch.load(two), rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_gpus_match_one_gpu(model_dir, tmp_path, engine):
    # fp32 on CUDA with the backend's defaults (inductor, Triton kernels); FSDP2 through accelerate's plugin, which
    # on CPU falls back to DDP without a word (so this part can only run here).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("trl")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    launch(
        (accelerate_launch(1, cpu=False), [__file__, "trainer", str(model_dir), str(one), "cuda"]),
        (accelerate_launch(2, cpu=False, fsdp2=engine == "fsdp2"), [__file__, "trainer", str(model_dir), str(two), "cuda"]),
        timeout=600,
    )  # fmt: skip
    check_matches_one_process(torch.load(one), torch.load(two), rtol=1e-3)


def test_main_job_runs_under_accelerate_with_two_processes(model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "answer": str(a + 1)} for a in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    # 2 steps, each 2 ranks x 4 rows = one group of 8 completions split across the ranks (processes that did not
    # join one job would each see 4 rows, not a multiple of the group, and stop with an error).
    # beta 0: no reference pass (covered by the DDP test above), one compiled graph less per process.
    launch((accelerate_launch(2), [
        "-m", "fastgrpo.integrations.main_job", "--model", str(model_dir), "--dataset", str(data),
        "--output-dir", str(out), "--max-steps", "2", "--num-generations", "8", "--per-device-train-batch-size", "4",
        "--max-completion-length", "4", "--save-steps", "2", "--lora-r", "4", "--beta", "0", "--cpu-threads", "1",
        "--backend-options", "inner=aot_eager",
    ]), timeout=300)  # fmt: skip
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2], "one log line per step, written by the main process only"
    assert all("reward" in line and "loss" in line for line in lines)
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "checkpoint-2" / "trainer_state.json").exists()
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_fsdp2(results: dict) -> None:
    for case, result in results.items():
        assert result["compiled_layers"] == result["layers"] == 2, case
        # Every graph compiled for a sharded layer still has its norms, rotary and gated MLP fused.
        assert result["reports"], case
        for report in result["reports"]:
            matched = {name: rec["matched"] for name, rec in report.items()}
            assert matched["rms_norm"] == 2 and matched["rope"] == 1 and matched["gated_mlp"] == 1, (case, matched)
        expected, sharded = result["expected"], result["sharded"]
        assert expected.keys() == sharded.keys() and expected, case
        if case == "lora":
            assert all("lora_" in name for name in sharded)
        for name in expected:
            torch.testing.assert_close(sharded[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}")


def test_fsdp2_sharded_layers_compile_and_match_unsharded(tmp_path):
    out = tmp_path / "fsdp.pt"
    launch((torchrun(2), [__file__, "fsdp2", str(out)]), timeout=300)
    check_fsdp2(torch.load(out))


@pytest.mark.gpu
def test_fsdp2_on_two_gpus_with_inductor_and_triton(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL does not run two ranks on one device)")
    out = tmp_path / "fsdp.pt"
    launch((torchrun(2), [__file__, "fsdp2", str(out), "cuda"]), timeout=600)
    check_fsdp2(torch.load(out))


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    {"trainer": run_trainer, "fsdp2": run_fsdp2}[mode](*rest)
