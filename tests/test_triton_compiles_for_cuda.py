"""Every Triton kernel launch the ops make on a GPU compiles for Hopper (sm_90) and fits its shared memory,
checked on a machine without a GPU.

CPU CI runs the kernels through Triton's interpreter, which accepts Python the CUDA compiler
refuses: a plain-float global read inside a kernel passed every CPU test and failed every GeLU
kernel on the H200; and the interpreter has no shared memory: the fp32 act_mul backward's tiles
needed 304 KB and failed there too. So each op runs here once, forward and backward, on the Triton
path with the launch configurations a GPU would get (`_dispatch.cuda_launch_configs()`: block sizes,
warps, grid sizing, TF32 dots) while its kernel launches are recorded (kernel, argument types,
constexprs, num_warps) and not run: which launches the ops make depends on shapes, not values, and the
interpreter would take minutes over GPU-sized blocks (204 s on CI's 2 cores, for the same 58 launches).
A fresh process without the interpreter then compiles each recorded
launch for sm_90 through Triton's front end, its GPU-IR passes and its shared-memory allocation, as
the GPU's first call would (stopping before LLVM and ptxas, for time), and checks the allocation
against an H100/H200's 227 KB per block.
"""
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

import fastgrpo.kernels
from fastgrpo.kernels import _dispatch
from fastgrpo.kernels import rms_norm as rms_norm_module
from fastgrpo.kernels.act_mul import act_mul
from fastgrpo.kernels.decode_attention import decode_attention
from fastgrpo.kernels.gated_mlp import gated_mlp
from fastgrpo.kernels.lora_merge import STATS, lora_merge_, lora_merge_into, lora_merge_plan, lora_unmerge_
from fastgrpo.kernels.nf4_lora_linear import nf4_lora_linear
from fastgrpo.kernels.race_sample import race_sample
from fastgrpo.kernels.rms_norm import add_rms_norm, rms_norm
from fastgrpo.kernels.rope import rope
from fastgrpo.kernels.selective_logprob import selective_logprob

_TENSOR_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.bool: "*i1", torch.uint8: "*u8"}

_COMPILER = r"""
import json, sys
from tests.test_triton_compiles_for_cuda import launch_source
from triton._C.libtriton import ir, nvidia, passes
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

SHARED_MEMORY_PER_BLOCK = 232448  # sm_90: 227 KB of dynamic shared memory per block
target = GPUTarget("cuda", 90, 32)
failures, largest = [], 0
for launch in json.load(sys.stdin):
    source, _ = launch_source(launch)
    try:
        # triton.compile's pipeline up to Triton GPU IR: the front end and the layout passes (where such
        # errors arise), without LLVM and ptxas, which would take minutes for all launches on 2 cores.
        backend = make_backend(target)
        options = backend.parse_options(launch["options"])
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                                backend.get_module_map(), context)
        stages = {}
        backend.add_stages(stages, options, source.language)
        metadata = {"target": target, **options.__dict__}
        module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
        # The start of make_llir, up to shared-memory allocation (PTX 8.6: CUDA 12.6, any recent ptxas).
        manager = ir.pass_manager(module.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(manager)
        try:
            passes.ttgpuir.add_allocate_warp_groups(manager, False)  # triton 3.9: (manager, consan)
        except TypeError:
            passes.ttgpuir.add_allocate_warp_groups(manager)  # triton 3.6
        passes.convert.add_scf_to_cf(manager)
        passes.gluon.add_inliner(manager)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(manager, 90, 86)
        manager.run(module, "allocate_shared_memory")
        shared = module.get_int_attr("ttg.shared")
        if shared > SHARED_MEMORY_PER_BLOCK:
            failures.append(f"{launch['name']} {launch['args']} {launch['options']}: {shared} bytes of shared "
                            f"memory, over the {SHARED_MEMORY_PER_BLOCK} an H100/H200 block has")
        largest = max(largest, shared)
    except Exception as error:
        failures.append(f"{launch['name']} {launch['args']}: {type(error).__name__}: {str(error)[:600]}")
print(json.dumps({"failures": failures, "largest_shared": largest}))
"""


def launch_source(launch: dict):
    """(triton.compiler.ASTSource, constexprs) of a launch `_record_launches` recorded, made with the Triton of the
    process that builds it (this module's compile step, and bench/kernel_resources.py's)."""
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    signature, constexprs, attrs = {}, {}, {}
    for name, (kind, value) in launch["args"].items():
        if kind in ("type", "type16"):
            signature[name] = value
            if kind == "type16":
                attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
        else:
            signature[name], constexprs[name] = "constexpr", tl.dtype(value) if kind == "tl_dtype" else value
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), constexprs


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    return "fp32"


def _describe(value, constexpr: bool, specialize: bool = True) -> tuple[str, object]:
    """What the compiled kernel depends on: a constexpr's value (a Triton dtype by name), a tensor's pointer
    type, a runtime scalar's type; specialized as Triton's launcher specializes (unless `specialize` is off, its
    `do_not_specialize`): an int equal to 1 is the constant 1, and an int or a tensor's address divisible by 16 is
    marked so ("type16"), which lets loads vectorize (without it the builds read a kernel the GPU never runs)."""
    if isinstance(value, tl.dtype):
        return "tl_dtype", value.name
    if constexpr or value is None:
        return "constexpr", value
    if isinstance(value, torch.Tensor):
        return "type16" if value.data_ptr() % 16 == 0 else "type", _TENSOR_TYPES[value.dtype]
    if specialize and isinstance(value, int) and not isinstance(value, bool):
        if value == 1:
            return "constexpr", 1
        if value % 16 == 0:
            return "type16", _scalar_type(value)
    return "type", _scalar_type(value)


def _record_launches(run_ops) -> list[dict]:
    """Run `run_ops()` on the Triton path and return each distinct kernel launch it made; the kernels do not run
    (their outputs are left as allocated)."""
    launches, original = {}, interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        params = inspect.signature(self.fn).parameters
        constexpr = {n for n, p in params.items() if p.annotation in (tl.constexpr, "tl.constexpr")}
        unspecialized = set(self.kwargs.get("do_not_specialize") or ())
        record = {
            "module": self.fn.__module__,
            "name": self.fn.__name__,
            "args": {name: _describe(value, name in constexpr, name not in unspecialized)
                     for name, value in named.items()},
            "options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs},
        }
        launches[json.dumps(record, sort_keys=True)] = record

    interpreter.InterpretedFunction.run = recording_run
    products = torch.mm, torch.addmm, torch.Tensor.addmm_
    torch.mm, torch.addmm, torch.Tensor.addmm_ = _shaped_mm, _shaped_addmm, _shaped_addmm_
    try:
        with _dispatch.triton_on_cpu(), _dispatch.cuda_launch_configs():
            run_ops()
    finally:
        interpreter.InterpretedFunction.run = original
        torch.mm, torch.addmm, torch.Tensor.addmm_ = products
    return list(launches.values())


# While launches are recorded, the ops' torch matrix products (the MLP's and the lm-head's, beside the kernels) only
# give an output of their shape and dtype, as the kernels do: launches depend on shapes, and bf16 products of
# 16 x 5120 x 17408 took 145 s of CPU for UNSEEN_DIMS.
def _shaped_mm(a, b, out_dtype=None, out=None):
    return out if out is not None else a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)


def _shaped_addmm(acc, a, b, *, beta=1, alpha=1, out_dtype=None, out=None):
    return out if out is not None else a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype or acc.dtype)


def _shaped_addmm_(self, a, b, *, beta=1, alpha=1):
    return self


def _run_every_op():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(6, 40, dtype=dtype, requires_grad=True)
        residual = torch.randn(6, 40, dtype=dtype, requires_grad=True)
        weight = torch.randn(40, dtype=dtype, requires_grad=True)
        rms_norm(x, weight).float().sum().backward()
        rms_norm(x, weight, offset=1.0, weight_in_fp32=True).float().sum().backward()
        rms_norm(x, None).float().sum().backward()
        s, normed = add_rms_norm(x, residual, weight)
        (s.float().sum() + normed.float().sum()).backward()

        q = torch.randn(2, 3, 5, 16, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 1, 5, 16, dtype=dtype, requires_grad=True)
        cos, sin = torch.randn(2, 1, 5, 16, dtype=dtype), torch.randn(2, 1, 5, 16, dtype=dtype)
        for interleaved in (False, True):
            rq, rk = rope(q, k, cos, sin, interleaved=interleaved)
            (rq.float().sum() + rk.float().sum()).backward()
        rq, rk = rope(q, k, cos[..., :8], sin[..., :8], rotary_dim=8)
        (rq.float().sum() + rk.float().sum()).backward()

        h = torch.randn(7, 24, dtype=dtype, requires_grad=True)
        w_gate = torch.randn(20, 24, dtype=dtype, requires_grad=True)
        w_up = torch.randn(20, 24, dtype=dtype, requires_grad=True)
        lora = [torch.randn(4, 24, requires_grad=True), torch.randn(20, 4, requires_grad=True)]
        for activation in ("silu", "gelu_tanh"):
            gated_mlp(h, w_gate, w_up, activation=activation).float().sum().backward()
            gated_mlp(h, w_gate, w_up, *lora, *lora, lora_scale=2.0, activation=activation).float().sum().backward()
            # with the down projection: the activation's backward also writes h for its gradients
            w_down = torch.randn(24, 20, dtype=dtype, requires_grad=True)
            down_lora = [torch.randn(4, 20, requires_grad=True), torch.randn(24, 4, requires_grad=True)]
            gated_mlp(h, w_gate, w_up, activation=activation, w_down=w_down, down_lora_a=down_lora[0],
                      down_lora_b=down_lora[1], down_lora_scale=0.5).float().sum().backward()
            gate, up = torch.randn(7, 20, dtype=dtype, requires_grad=True), torch.randn(7, 20, dtype=dtype, requires_grad=True)
            act_mul(gate, up, activation).float().sum().backward()

        hidden = torch.randn(5, 24, dtype=dtype, requires_grad=True)
        head = torch.randn(50, 24, dtype=dtype, requires_grad=True)
        targets = torch.tensor([1, 7, -100, 49, 0])
        logp, entropy = selective_logprob(hidden, head, targets, temperature=0.7, softcap=30.0, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        for softcap in (0.0, 30.0):  # the frozen head: the gradient computed in forward
            selective_logprob(hidden, head.detach(), targets, logit_scale=0.5, softcap=softcap).sum().backward()

    # Decode attention: several splits (few rows) and one split (rows enough to fill the GPU), in each dtype, at head
    # dims 64, 80 (padded), 128 and 256, with and without window, softcap and sinks, and prompt slots read from
    # another row (GRPO's groups sharing one copy of their prompt); 32- and 64-bit slot offsets.
    shared = dict(prompt_rows=torch.zeros(201, dtype=torch.int64), prompt_len=torch.tensor(64))
    grouped = dict(shared, prompt_groups=torch.full((200, 8), -1, dtype=torch.int64))
    for dtype, batch, kv_heads, group, head_dim, slots, options in (
            (torch.bfloat16, 2, 1, 8, 128, 256, dict(window=64, softcap=50.0, sinks=torch.zeros(8))),
            (torch.bfloat16, 200, 2, 6, 128, 256, {}),
            (torch.bfloat16, 200, 2, 6, 128, 256, shared),
            (torch.bfloat16, 200, 2, 6, 128, 256, grouped),
            (torch.bfloat16, 200, 32, 1, 96, 256, dict(window=100, **grouped)),
            (torch.bfloat16, 200, 1, 4, 256, 64, dict(window=32, softcap=30.0, **grouped)),
            (torch.float32, 200, 2, 16, 64, 128, dict(sinks=torch.zeros(32), **grouped)),
            (torch.bfloat16, 200, 1, 4, 256, 64, dict(window=32, softcap=30.0)),
            (torch.float16, 4, 2, 2, 64, 512, dict(sinks=torch.zeros(4))),
            (torch.float32, 2, 2, 2, 80, 128, dict(softcap=20.0))):
        q = torch.randn(batch, kv_heads * group, head_dim, dtype=dtype)
        k_new, v_new = (torch.randn(batch, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        k_cache, v_cache = (torch.zeros(batch + 1, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))
        start = torch.zeros(batch + 1, dtype=torch.int64)
        decode_module = importlib.import_module("fastgrpo.kernels.decode_attention")
        for narrow in (0, 256):  # with 64-bit slot offsets, then 32-bit ones
            with mock.patch.object(decode_module, "NARROW_OFFSETS_MAX_DIM", narrow):
                decode_attention(q, k_new, v_new, k_cache, v_cache, torch.arange(batch), start,
                                 torch.tensor(slots // 2), scale=head_dim ** -0.5, **options)

    # The NF4 + LoRA decode linear: split K (q at 8 rows) and unsplit (gate/up at 64 rows), nested and plain block
    # scales, ranks 16 and 64 with fp32 and bf16 adapters, blocksizes 64 and 128, bias, fp16 and fp32 x; the weight's
    # columns joined (codes gathered from the 16 fp32 ones) or in even/odd products of register-table codes.
    nf4_module = importlib.import_module("fastgrpo.kernels.nf4_lora_linear")
    for m, n, k, dtype, blocksize, nested, rank, lora_dtype, bias in (
            (8, 1536, 1536, torch.bfloat16, 64, True, 16, torch.float32, True),
            (64, 8960, 1536, torch.bfloat16, 64, True, 64, torch.bfloat16, False),
            (64, 1536, 8960, torch.float16, 128, False, 0, None, False),
            (3, 256, 256, torch.float32, 64, False, 8, torch.float32, True)):
        blocks = n * k // blocksize
        quant = dict(absmax=torch.zeros(blocks, dtype=torch.uint8 if nested else torch.float32), code=torch.zeros(16),
                     code_values=tuple(range(16)), shape=(n, k), blocksize=blocksize)
        if nested:
            quant.update(nested_absmax=torch.zeros(-(-blocks // 256)), nested_code=torch.zeros(256),
                         offset=torch.tensor(0.0))
        lora = dict(lora_a=torch.zeros(rank, k, dtype=lora_dtype), lora_b=torch.zeros(n, rank, dtype=lora_dtype),
                    scaling=2.0) if rank else {}
        for lut in (False, True):
            with mock.patch.object(nf4_module, "_FEW_ROWS_LUT", lut), mock.patch.object(nf4_module, "_LUT", lut):
                nf4_lora_linear(torch.zeros(m, k, dtype=dtype), torch.zeros(n * k // 2, 1, dtype=torch.uint8),
                                **quant, **lora, bias=torch.zeros(n, dtype=dtype) if bias else None)
    # Grouped: q/k/v at 8 rows (register table, split K), gate/up at 64 (joined), double-quantized, rank 16.
    for m, rows, lut in ((8, (1536, 256, 256), True), (64, (8960, 8960), False)):
        n, k = sum(rows), 1536
        packed = [torch.zeros(r * k // 2, dtype=torch.uint8) for r in rows]
        with mock.patch.object(nf4_module, "_FEW_ROWS_LUT", lut), mock.patch.object(nf4_module, "_LUT", lut):
            nf4_lora_linear(torch.zeros(m, k, dtype=torch.bfloat16), packed,
                            absmax=torch.zeros(n * k // 64, dtype=torch.uint8), code=torch.zeros(16),
                            code_values=tuple(range(16)), shape=(n, k), nested_absmax=torch.zeros(n * k // 64 // 256),
                            nested_code=torch.zeros(256), offset=torch.zeros(len(rows)),
                            lora_a=torch.zeros(16 * len(rows), k), lora_b=torch.zeros(n, 16), scaling=2.0,
                            group_table=nf4_module.group_table(packed, list(rows), k))

    # The rollout engine's LoRA merge, each of its four passes (plan, in-place merge, copy, undo), in each weight
    # dtype (the kernel's bit-compare integer type follows it), rank 16.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        weight, a, b = torch.zeros(300, 600, dtype=dtype), torch.zeros(16, 600), torch.zeros(300, 16)
        stats = torch.zeros(STATS, dtype=torch.int64)
        lora_merge_plan(weight, a, b, stats)
        lora_merge_(weight, a, b, stats, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=dtype))
        lora_merge_into(torch.empty_like(weight), weight, a, b)
        lora_unmerge_(weight, a, b, stats)

    # The rollout engine's plain sampling: bf16 logits of a real vocabulary in many splits, fp32 in one, an int32 seed.
    for rows, vocab, dtype, seed_dtype in ((64, 151_936, torch.bfloat16, torch.int64), (1024, 4096, torch.float32,
                                                                                         torch.int32)):
        race_sample(torch.zeros(rows, vocab, dtype=dtype), torch.zeros(1, dtype=seed_dtype), 0.7)

    # RMSNorm's backward in each form a launch configuration selects, whichever the defaults pick at these widths:
    # the row loop of persistent programs with the next rows prefetched into registers (stages 0) or
    # software-pipelined (stages > 0), and, without dW, one row block a program (no programs per SM).
    default_config = rms_norm_module._bwd_config
    x, residual, weight = (torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
                           for shape in ((3, 576), (3, 576), (576,)))
    try:
        for stages in (0, 2, 4):
            rms_norm_module._bwd_config = lambda *args, stages=stages: default_config(*args)[:3] + (stages,)
            rms_norm(x, weight).float().sum().backward()
            s, normed = add_rms_norm(x, residual, weight)
            (s.float().sum() + normed.float().sum()).backward()
        rms_norm_module._bwd_config = lambda *args: (2, 2, None, 0)
        rms_norm(x, weight.detach()).float().sum().backward()
        s, normed = add_rms_norm(x, residual, weight.detach())
        (s.float().sum() + normed.float().sum()).backward()
    finally:
        rms_norm_module._bwd_config = default_config


# Dimensions of models the kernels were not tuned on: (hidden, intermediate, query heads, key-value heads, head dim,
# vocabulary, rotary dims), as their public configs give them (the Qwen3.5 rows: transformers' Qwen3_5TextConfig
# defaults and a 27B-sized variant). Head dims 64-256 (96 is not a power of two), vocabularies of 32k-262k.
UNSEEN_DIMS = {
    "phi-3-mini": (3072, 8192, 32, 32, 96, 32064, 96),
    "smollm2-1.7b": (2048, 8192, 32, 32, 64, 49152, 64),
    "mistral-7b": (4096, 14336, 32, 8, 128, 32768, 128),
    "gemma-3-4b": (2560, 10240, 8, 4, 256, 262208, 256),
    "qwen3.5-text-defaults": (4096, 12288, 16, 4, 256, 248320, 64),
    "qwen3.5-27b-sized": (5120, 17408, 24, 4, 256, 248320, 64),
}


def _run_ops_at_model_dims():
    """The ops at the dimensions of UNSEEN_DIMS, in bf16 as training and decoding run them: launch configurations
    are chosen by rules of these sizes. Rows are many where only Triton computes (the norms, RoPE, act_mul, decode
    attention, sampling) and few where torch's matmuls run beside the kernels (the MLP, the lm-head)."""
    bf16 = dict(dtype=torch.bfloat16)
    for hidden, inter, heads, kv_heads, head_dim, vocab, rotary in UNSEEN_DIMS.values():
        x, residual = (torch.zeros(4096, hidden, **bf16, requires_grad=True) for _ in range(2))
        weight = torch.zeros(hidden, **bf16, requires_grad=True)
        rms_norm(x, weight).float().sum().backward()
        s, normed = add_rms_norm(x, residual, weight)
        (s.float().sum() + normed.float().sum()).backward()

        q = torch.zeros(2, heads, 1024, head_dim, **bf16, requires_grad=True)
        k = torch.zeros(2, kv_heads, 1024, head_dim, **bf16, requires_grad=True)
        cos, sin = (torch.zeros(2, 1, 1024, rotary, **bf16) for _ in range(2))
        rq, rk = rope(q, k, cos, sin, rotary_dim=rotary if rotary < head_dim else None)
        (rq.float().sum() + rk.float().sum()).backward()

        h = torch.zeros(16, hidden, **bf16, requires_grad=True)
        w_gate, w_up = (torch.zeros(inter, hidden, **bf16) for _ in range(2))
        w_down = torch.zeros(hidden, inter, **bf16)
        lora = [torch.zeros(16, hidden, requires_grad=True), torch.zeros(inter, 16, requires_grad=True)]
        down_lora = [torch.zeros(16, inter, requires_grad=True), torch.zeros(hidden, 16, requires_grad=True)]
        gated_mlp(h, w_gate, w_up, *lora, *lora, lora_scale=2.0, w_down=w_down, down_lora_a=down_lora[0],
                  down_lora_b=down_lora[1], down_lora_scale=2.0).float().sum().backward()
        gate, up = (torch.zeros(4096, inter, **bf16, requires_grad=True) for _ in range(2))
        act_mul(gate, up, "silu").float().sum().backward()


        for rows in (8, 64):
            q = torch.zeros(rows, heads, head_dim, **bf16)
            k_new, v_new = (torch.zeros(rows, kv_heads, head_dim, **bf16) for _ in range(2))
            k_cache, v_cache = (torch.zeros(rows + 1, kv_heads, 1024, head_dim, **bf16) for _ in range(2))
            decode_attention(q, k_new, v_new, k_cache, v_cache, torch.arange(rows), torch.zeros(rows + 1,
                             dtype=torch.int64), torch.tensor(700), scale=head_dim ** -0.5)
            race_sample(torch.zeros(rows, vocab, **bf16), torch.zeros(1, dtype=torch.int64), 1.0)
            for n, k_in in ((heads * head_dim, hidden), (inter, hidden), (hidden, inter)):
                blocks = n * k_in // 64
                nf4_lora_linear(torch.zeros(rows, k_in, **bf16), torch.zeros(n * k_in // 2, 1, dtype=torch.uint8),
                                absmax=torch.zeros(blocks, dtype=torch.uint8), code=torch.zeros(16),
                                code_values=tuple(range(16)), shape=(n, k_in),
                                blocksize=64, nested_absmax=torch.zeros(-(-blocks // 256)),
                                nested_code=torch.zeros(256), offset=torch.tensor(0.0),
                                lora_a=torch.zeros(16, k_in), lora_b=torch.zeros(n, 16), scaling=2.0)

    # The lm-head op's tiles are chosen by the hidden size's band (<= 2048: 2048 rows x 4096 columns, else 1024 x 8192),
    # its launches by a tile's place (first, middle, last): three tiles of each band give them all, without the CPU
    # running a real vocabulary's padded GEMMs.
    for hidden, tile in ((2048, 4096), (2560, 8192)):
        hidden_rows = torch.zeros(4, hidden, **bf16, requires_grad=True)
        head = torch.zeros(2 * tile + 300, hidden, **bf16)
        logp, entropy = selective_logprob(hidden_rows, head, torch.tensor([1, 7, -100, 3]), with_entropy=True)
        (logp.sum() + entropy.sum()).backward()


# The GPU machines' Triton (3.6), installed by .ci/setup beside the lock's: each launch is built with both.
DEVICE_TRITON = Path(__file__).resolve().parents[1] / ".venv" / "triton-device"
TRITONS = [pytest.param(None, id="lock"), pytest.param(DEVICE_TRITON, id="device")]


def _compile_for_sm90(launches: list[dict], triton_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir is not None:
        if not (triton_dir / "triton").is_dir():
            pytest.skip(f"no Triton at {triton_dir}: run .ci/setup")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(triton_dir), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(launches), capture_output=True,
                          text=True, env=env, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["failures"], "\n".join(result["failures"])
    return result


@pytest.mark.parametrize("triton_dir", TRITONS)
def test_kernels_compile_for_sm90_at_dimensions_they_were_not_tuned_on(triton_dir):
    launches = _record_launches(_run_ops_at_model_dims)
    result = _compile_for_sm90(launches, triton_dir)
    print(f"{len(launches)} launches at {len(UNSEEN_DIMS)} models' dimensions compiled for sm_90, "
          f"largest shared memory {result['largest_shared']} bytes")


@pytest.mark.parametrize("triton_dir", TRITONS)
def test_every_kernel_compiles_for_sm90(triton_dir):
    launches = _record_launches(_run_every_op)
    names = {r["name"] for r in launches}
    # Every kernel the package defines was launched (helpers that kernels call are compiled with them).
    modules = [importlib.import_module(f"fastgrpo.kernels.{info.name}")
               for info in pkgutil.iter_modules(fastgrpo.kernels.__path__)]
    defined = {name for module in modules for name, value in vars(module).items()
               if isinstance(value, interpreter.InterpretedFunction) and name.endswith("_kernel")}
    assert names == defined, (sorted(defined - names), sorted(names - defined))
    result = _compile_for_sm90(launches, triton_dir)
    print(f"{len(launches)} launches of {len(names)} kernels compiled for sm_90, "
          f"largest shared memory {result['largest_shared']} bytes")


def test_launches_are_recorded_specialized_as_the_launcher_specializes():
    """An int argument of 1 is recorded as the constant 1, a 16-divisible int or address as such ("type16"), other
    values by type, and an argument in the kernel's `do_not_specialize` by type only (lora_merge's fix_cap)."""
    assert _describe(1, False) == ("constexpr", 1)
    assert _describe(48, False) == ("type16", "i32")
    assert _describe(40, False) == ("type", "i32")
    assert _describe(True, False) == ("type", "i1")
    assert _describe(1, False, specialize=False) == ("type", "i32")
    assert _describe(torch.zeros(4)[1:], False) == ("type", "*fp32")  # an address 4 bytes past an aligned one
    merges = [r for r in _record_launches(_run_every_op) if r["name"] == "_lora_merge_kernel"]
    assert merges and all(r["args"]["fix_cap"][0] == "type" for r in merges)
