"""fastgrpo::nf4_lora_linear: the plain-torch dequantization bit-exact with bitsandbytes' (layouts, blocksizes, double
quantization, storage dtypes); the Triton kernel (interpreter) against a float64 reference of the same maths over
rows, shapes, blocksizes, double quantization, bias, LoRA ranks and dtypes, and K splits; the op's schema and fake
implementation; a PEFT LoRA over a bitsandbytes Linear4bit through `nf4_lora_linear_from_module`; real shapes on a
GPU against bitsandbytes' dequantize + F.linear + the LoRA term, eagerly and replayed in a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.integrations.generation.four_bit import lora_factors, nf4_lora_linear_from_module
from fastgrpo.kernels._dispatch import cdiv, triton_on_cpu
from fastgrpo.kernels import nf4_lora_linear as nf4_module
from fastgrpo.kernels.nf4_lora_linear import (
    _nf4_lora_linear_op,
    group_table,
    _triton_nf4_lora_linear,
    kernel_obstacle,
    launch_config,
    lut_asm,
    nf4_lora_linear,
    quant_state_args,
    reference_dequantize_nf4,
    reference_nf4_lora_linear,
)

bnb = pytest.importorskip("bitsandbytes")
BF = bnb.functional

pytestmark = pytest.mark.usefixtures("one_thread")

# Of the output's largest magnitude: the interpreter runs every dot in fp32 and rounds once at the store (by
# truncation for bf16: up to one ulp, 2^-7 relative).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


def quantized(n, k, dtype=torch.bfloat16, blocksize=64, nested=True, quant_type="nf4", seed=0, storage=torch.uint8):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    return BF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type,
                            quant_storage=storage)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256])
def test_reference_dequantize_is_bit_exact_with_bitsandbytes(dtype, quant_type, nested, blocksize):
    for n, k, seed in ((96, 256, 0), (300, 512, 1), (7, 256, 2)):  # 300 x 512 / 64: 2400 blocks, 10 nested ones
        packed, state = quantized(n, k, dtype, blocksize, nested, quant_type, seed)
        want = BF.dequantize_4bit(packed, state, quant_type=quant_type)
        assert torch.equal(reference_dequantize_nf4(packed, state), want)
        assert torch.equal(reference_dequantize_nf4(packed, state, torch.float32).to(dtype), want)


def test_reference_dequantize_reads_other_storage_dtypes_and_odd_sizes():
    packed, state = quantized(64, 128, storage=torch.bfloat16)  # FSDP-style quant_storage: the same bytes
    assert packed.dtype == torch.bfloat16
    assert torch.equal(reference_dequantize_nf4(packed, state), BF.dequantize_4bit(packed, state, quant_type="nf4"))
    packed, state = quantized(33, 50, blocksize=32)  # blocks across rows, a K that is no multiple of the blocksize
    assert torch.equal(reference_dequantize_nf4(packed, state), BF.dequantize_4bit(packed, state, quant_type="nf4"))


def test_blocks_longer_than_a_row_follow_the_flat_layout():
    """bitsandbytes quantizes the flattened weight, so a block longer than a row spans rows. Its CPU dequantization
    kernel (0.50) indexes such blocks per row and disagrees with its own quantizer there; the reference follows the
    flat layout of the quantizer and of its torch ("default") backend's dequantization."""
    default_ops = pytest.importorskip("bitsandbytes.backends.default.ops")
    dequantize = getattr(default_ops._dequantize_4bit_compute, "__wrapped__", None)
    if dequantize is None:
        pytest.skip("bitsandbytes' default 4-bit dequantization is not reachable uncompiled")
    for nested in (False, True):
        packed, state = quantized(6, 64, blocksize=256, nested=nested)
        absmax = BF.dequantize_blockwise(state.absmax, state.state2) + state.offset if nested else state.absmax
        want = dequantize(packed.reshape(-1), absmax, state.code, 256, state.shape, state.dtype)
        assert torch.equal(reference_dequantize_nf4(packed, state), want)


def _case(seed, m, n, k, blocksize, nested, bias, rank, dtype, lora_dtype, strided):
    g = torch.Generator().manual_seed(seed)
    packed, state = quantized(n, k, dtype if dtype != torch.float32 else torch.bfloat16, blocksize, nested, seed=seed)
    x = torch.randn(m, 2 * k if strided else k, generator=g).to(dtype)
    x = x[:, ::2] if strided else x
    inputs = dict(x=x, packed=packed, **quant_state_args(state), scaling=float(torch.rand(1, generator=g)) * 2 + 0.25,
                  bias=torch.randn(n, generator=g).to(dtype) if bias else None)
    if rank:
        # The LoRA term as large as the base product, so that a wrong one shows above the tolerance.
        inputs["lora_a"] = (torch.randn(rank, k, generator=g) * k ** -0.5).to(lora_dtype)
        inputs["lora_b"] = (torch.randn(n, rank, generator=g) * 0.3).to(lora_dtype)
    return inputs


def _op_args(inputs):
    """The op's positional arguments after `nf4_lora_linear`'s normalization."""
    k = inputs["x"].shape[-1]
    n = inputs["shape"][0]
    return (inputs["x"], [inputs["packed"].reshape(-1).view(torch.uint8)], inputs["absmax"], inputs["code"],
            inputs.get("nested_absmax"), inputs.get("nested_code"),
            None if inputs.get("offset") is None else inputs["offset"].reshape(()), inputs["blocksize"],
            inputs.get("nested_blocksize", 256), n, inputs.get("lora_a"), inputs.get("lora_b"), inputs["scaling"],
            inputs["bias"], inputs.get("code_values"), None), (n, k)


def expected(inputs):
    """The float64 reference: the weight rounded to x's dtype as the kernel takes it, the rest in float64."""
    args, shape = _op_args(inputs)
    x, (packed,), absmax, code, nabs, ncode, offset, bs, nbs, n, a, b, scaling, bias, _, _ = args
    return reference_nf4_lora_linear(x, packed, absmax, code, nabs, ncode, offset, bs, nbs, shape, a, b, scaling, bias,
                                     compute_dtype=torch.float64)


def check(out, inputs):
    want = expected(inputs)
    assert out.dtype == inputs["x"].dtype and out.shape == want.shape
    scale = max(1.0, want.abs().max().item())
    err = (out.double() - want).abs().max().item()
    assert err <= TOLERANCE[inputs["x"].dtype] * scale, (err, scale)


cases = st.tuples(
    st.integers(0, 2**16), st.integers(1, 40), st.integers(1, 160), st.integers(1, 4), st.sampled_from([32, 64, 128]),
    st.booleans(), st.booleans(), st.sampled_from([0, 1, 8, 16]),
    st.sampled_from([torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.integers(1, 4),
    st.booleans(), st.sampled_from([0, 2, 3]),
)


@settings(max_examples=100)
@given(cases)
def test_triton_kernel_matches_the_float64_reference(params):
    seed, m, n, blocks, blocksize, nested, bias, rank, dtype, lora_dtype, strided, splits, lut, ahead = params
    k = blocks * blocksize
    inputs = _case(seed, m, n, k, blocksize, nested, bias, rank, dtype, lora_dtype, strided)
    args, _ = _op_args(inputs)
    config = launch_config(m, n, k, blocksize, torch.device("cpu"))
    per_split = cdiv(cdiv(k, splits), config["BK"]) * config["BK"]
    config.update(k_per_split=per_split, splits=cdiv(k, per_split), LUT=lut, AHEAD=ahead)
    with triton_on_cpu():
        out = _triton_nf4_lora_linear(*args, config=config)
    check(out, inputs)


def _grouped(parts):
    """One grouped call's keyword arguments (and x) from each weight's `_case` inputs (one x, one scaling)."""
    first = parts[0]
    packed = [p["packed"].reshape(-1).view(torch.uint8) for p in parts]
    rows = [p["shape"][0] for p in parts]
    k = first["shape"][1]
    inputs = dict(packed=packed, shape=(sum(rows), k), absmax=torch.cat([p["absmax"] for p in parts]),
                  code=first["code"], blocksize=first["blocksize"], scaling=first["scaling"],
                  code_values=first["code_values"], group_table=group_table(packed, rows, k),
                  bias=None if first["bias"] is None else torch.cat([p["bias"] for p in parts]))
    if "nested_absmax" in first:
        inputs.update(nested_absmax=torch.cat([p["nested_absmax"] for p in parts]), nested_code=first["nested_code"],
                      nested_blocksize=first["nested_blocksize"],
                      offset=torch.stack([p["offset"].reshape(()) for p in parts]))
    if "lora_a" in first:
        inputs.update(lora_a=torch.cat([p["lora_a"] for p in parts]), lora_b=torch.cat([p["lora_b"] for p in parts]))
    return first["x"], inputs


def _group_cases(seed, m, rows, k, blocksize, nested, bias, rank, dtype, lora_dtype):
    parts = [_case(seed + g, m, n, k, blocksize, nested, bias, rank, dtype, lora_dtype, False)
             for g, n in enumerate(rows)]
    for p in parts[1:]:
        p.update(x=parts[0]["x"], scaling=parts[0]["scaling"])
    return parts


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 20), st.lists(st.sampled_from([64, 128, 192]), min_size=1, max_size=2),
       st.integers(1, 100), st.sampled_from([(64, 2), (64, 4), (32, 8), (128, 2)]), st.booleans(), st.booleans(),
       st.sampled_from([0, 8]), st.sampled_from([torch.bfloat16, torch.float32]), st.integers(1, 3), st.booleans(),
       st.sampled_from([0, 2]))
def test_grouped_weights_match_their_own_launches(seed, m, rows, last, k_blocks, nested, bias, rank, dtype, splits, lut,
                                                   ahead):
    """Weights stacked along N in one launch (a tile's group found in the table, its bytes where they lie, its
    nested offset and its adapter's A rows) give each weight's own launch's bits, and the float64 reference."""
    blocksize, blocks = k_blocks
    k = blocksize * blocks
    rows = [4 * r if nested else r for r in rows] + [last]  # (nested: each but the last whole nested blocks)
    parts = _group_cases(seed, m, rows, k, blocksize, nested, bias, rank, dtype, torch.float32)
    x, inputs = _grouped(parts)
    config = launch_config(m, sum(rows), k, blocksize, torch.device("cpu"))
    per_split = cdiv(cdiv(k, splits), config["BK"]) * config["BK"]
    config.update(k_per_split=per_split, splits=cdiv(k, per_split), LUT=lut, AHEAD=ahead)
    with triton_on_cpu():
        grouped = _triton_nf4_lora_linear(*_op_args_of(x, inputs), config=config)
        own = [_triton_nf4_lora_linear(*_op_args(p)[0], config=config) for p in parts]
    assert torch.equal(grouped, torch.cat(own, dim=1))
    lo = 0
    for p, n in zip(parts, rows):
        check(grouped[:, lo:lo + n], p)
        lo += n


def _op_args_of(x, inputs):
    """The op's positional arguments of a `nf4_lora_linear` call's keyword arguments (grouped or not)."""
    flats, absmax, code, nabs, ncode, offset = nf4_module._checked_quantization(
        inputs["packed"], inputs["absmax"], inputs["code"], *inputs["shape"], inputs["blocksize"],
        inputs.get("nested_absmax"), inputs.get("nested_code"), inputs.get("offset"),
        inputs.get("nested_blocksize", 256), inputs.get("lora_a"), inputs.get("lora_b"), inputs.get("group_table"))
    return (x, flats, absmax, code, nabs, ncode, offset, inputs["blocksize"], inputs.get("nested_blocksize", 256),
            inputs["shape"][0], inputs.get("lora_a"), inputs.get("lora_b"), inputs["scaling"], inputs["bias"],
            inputs.get("code_values"), inputs.get("group_table"))


def test_grouped_call_through_the_wrapper_and_its_reference():
    """The public call of three grouped weights (q, k, v-like: 128, 64, 64 rows), the interpreter's kernel and the
    torch path (a group at a time), against each weight's reference; its refusals name the fix."""
    parts = _group_cases(11, 5, [128, 64, 64], 256, 64, True, True, 8, torch.bfloat16, torch.float32)
    x, inputs = _grouped(parts)
    kwargs = {key: value for key, value in inputs.items() if key != "packed"}
    torch_path = nf4_lora_linear(x, inputs["packed"], **kwargs)
    with triton_on_cpu():
        triton_path = nf4_lora_linear(x, inputs["packed"], **kwargs)
    for out in (torch_path, triton_path):
        lo = 0
        for p in parts:
            n = p["shape"][0]
            check(out[:, lo:lo + n], p)
            lo += n
    with pytest.raises(ValueError, match="group_table"):
        nf4_lora_linear(x, inputs["packed"], **dict(kwargs, group_table=None))
    with pytest.raises(ValueError, match="offset of 1 values"):
        nf4_lora_linear(x, inputs["packed"], **dict(kwargs, offset=inputs["offset"][:1]))
    with pytest.raises(ValueError, match="stacked"):
        nf4_lora_linear(x, inputs["packed"], **dict(kwargs, lora_a=inputs["lora_a"][:8]))
    odd = _group_cases(12, 2, [96, 64], 256, 64, False, False, 0, torch.bfloat16, torch.float32)
    x, inputs = _grouped(odd)
    with pytest.raises(ValueError, match="multiple of 64"):
        nf4_lora_linear(x, inputs.pop("packed"), **inputs)


def test_triton_kernel_rank_64_many_rows_and_m_tiles():
    """r = MAX_RANK, 70 rows (two M tiles of 64), three K splits, fp32 adapters with bf16 x."""
    inputs = _case(5, 70, 96, 384, 64, True, True, 64, torch.bfloat16, torch.float32, False)
    args, _ = _op_args(inputs)
    config = dict(launch_config(70, 96, 384, 64, torch.device("cpu")), splits=3, k_per_split=128)
    assert config["BM"] == 64
    with triton_on_cpu():
        out = _triton_nf4_lora_linear(*args, config=config)
    check(out, inputs)


def _run_ptx(asm: str, operand: int) -> tuple[int, int]:
    """A reading of `lut_asm`'s PTX by the ISA's rules (mov, shr, shl, and, or, lop3; prmt in its default mode,
    selector bit 3 replicating the picked byte's sign), on one 32-bit input $2: the outputs ($0, $1)."""
    regs = {"$2": operand}

    def value(token):
        return regs[token] if token in regs else int(token, 0)

    for instruction in asm.strip("{} ").split(";"):
        words = instruction.replace(",", " ").split()
        if not words or words[0] == ".reg":
            continue
        op, dst, args = words[0], words[1], [value(t) for t in words[2:]]
        if op == "mov.b32":
            out = args[0]
        elif op == "shr.b32":
            out = args[0] >> args[1]
        elif op == "shl.b32":
            out = args[0] << args[1]
        elif op == "and.b32":
            out = args[0] & args[1]
        elif op == "or.b32":
            out = args[0] | args[1]
        elif op == "lop3.b32":
            a, b, c, table = args
            out = sum(((table >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif op == "prmt.b32":
            pool, out = args[0] | args[1] << 32, 0
            for i in range(4):
                sel = args[2] >> (4 * i) & 0xF
                byte = pool >> (8 * (sel & 7)) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        else:
            raise AssertionError(f"unread instruction {op}")
        regs[dst] = out & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_register_table_lookup_gives_each_nibbles_code(dtype, quant_type):
    """`lut_asm`'s two lookups, read instruction by instruction: every byte value in every one of the 4 positions
    gives the code of its high (even column) or low (odd column) nibble, rounded to the dtype, in element order."""
    _, state = quantized(8, 64, quant_type=quant_type)
    codes = state.code.float().to(dtype).view(torch.int16).tolist()
    high, low = lut_asm(tuple(state.code.tolist()), dtype)
    g = torch.Generator().manual_seed(0)
    words = [b * 0x01010101 for b in range(256)] + torch.randint(0, 2**32, (512,), generator=g).tolist()
    for word in words:
        for asm, nibble in ((high, lambda byte: byte >> 4), (low, lambda byte: byte & 0xF)):
            out0, out1 = _run_ptx(asm, word)
            got = [out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16]
            want = [codes[nibble(word >> (8 * i) & 0xFF)] & 0xFFFF for i in range(4)]
            assert got == want, (hex(word), got, want)


@pytest.fixture
def split_order(monkeypatch):
    """Sets the order in which the interpreter runs the programs of the K axis (grid axis 1): `order(s, splits)`
    names the split run s-th. The interpreter runs programs one after another, so the last to arrive at a tile's
    counter is the split run last."""
    from triton.runtime.interpreter import interpreter_builder

    real = interpreter_builder.set_grid_idx
    state = {"order": None}

    def set_grid_idx(x, y, z):
        order = state["order"]
        real(x, order(y, interpreter_builder.grid_dim[1]) if order else y, z)

    monkeypatch.setattr(interpreter_builder, "set_grid_idx", set_grid_idx)
    return state


@pytest.mark.parametrize("lut", [False, True])
def test_split_k_sum_does_not_depend_on_arrival_order(split_order, lut):
    """The tile's last program sums every split's partial in split order: the same bits whichever program arrives
    last (on a GPU: run to run, and eager against a CUDA-graph replay), and repeated calls are bit-equal; with the
    weight's columns joined or in the register table's even/odd products."""
    inputs = _case(7, 5, 40, 512, 64, True, True, 8, torch.float32, torch.float32, False)
    args, _ = _op_args(inputs)
    config = dict(launch_config(5, 40, 512, 64, torch.device("cpu")), splits=4, k_per_split=128, LUT=lut)
    outs = []
    with triton_on_cpu():
        for order in (None, lambda s, n: n - 1 - s, lambda s, n: (s + 1) % n, None):
            split_order["order"] = order
            outs.append(_triton_nf4_lora_linear(*args, config=config))
        split_order["order"] = None
        unsplit = _triton_nf4_lora_linear(*args, config=dict(config, splits=1, k_per_split=512))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    check(outs[0], inputs)
    check(unsplit, inputs)
    torch.testing.assert_close(outs[0], unsplit, atol=2e-5 * outs[0].abs().max().item(), rtol=0)


def test_public_wrapper_on_both_paths_and_leading_dims():
    inputs = _case(3, 6, 80, 256, 64, True, True, 8, torch.bfloat16, torch.float32, False)
    x = inputs.pop("x")
    x3 = x.reshape(2, 3, 256)
    kwargs = {key: value for key, value in inputs.items() if key != "packed"}
    torch_path = nf4_lora_linear(x3, inputs["packed"], **kwargs)
    with triton_on_cpu():
        triton_path = nf4_lora_linear(x3, inputs["packed"], **kwargs)
    assert torch_path.shape == triton_path.shape == (2, 3, 80)
    for out in (torch_path, triton_path):
        check(out.reshape(6, 80), dict(inputs, x=x))


def test_out_of_domain_calls_take_the_reference():
    """K not a multiple of the blocksize, or r above MAX_RANK: the reference, inside the interpreter too;
    `kernel_obstacle` names why (a CPU tensor outside the interpreter too)."""
    for n, k, blocksize, rank, why in ((20, 96, 64, 4, "in_features not a multiple"), (16, 128, 64, 80, "rank above")):
        inputs = _case(1, 3, n, k, blocksize, False, False, rank, torch.float32, torch.float32, False)
        kwargs = {key: value for key, value in inputs.items() if key not in ("x", "packed")}
        with triton_on_cpu():
            assert why in kernel_obstacle(inputs["x"], blocksize, k, rank)
            out = nf4_lora_linear(inputs["x"], inputs["packed"], **kwargs)
        check(out, inputs)
    x = torch.zeros(1, 64)
    assert kernel_obstacle(x, 64, 64, 4) == "on cpu, the kernel runs on CUDA"
    with triton_on_cpu():
        assert kernel_obstacle(x, 64, 64, 64) is None


def test_no_rows():
    inputs = _case(0, 1, 16, 64, 64, False, False, 4, torch.bfloat16, torch.float32, False)
    x = inputs.pop("x")[:0]
    with triton_on_cpu():
        assert nf4_lora_linear(x, inputs.pop("packed"), **inputs).shape == (0, 16)


def test_opcheck_schema_and_fake():
    inputs = _case(2, 4, 24, 128, 64, True, True, 4, torch.bfloat16, torch.float32, False)
    args, _ = _op_args(inputs)
    torch.library.opcheck(_nf4_lora_linear_op, args)
    plain = _case(2, 4, 24, 128, 64, False, False, 0, torch.float16, torch.float32, False)
    torch.library.opcheck(_nf4_lora_linear_op, _op_args(plain)[0])


def test_compiled_call_matches_eager():
    inputs = _case(4, 5, 40, 128, 64, True, True, 8, torch.bfloat16, torch.bfloat16, False)
    x = inputs.pop("x")
    packed = inputs.pop("packed")

    def fn(x):
        return nf4_lora_linear(x * 2, packed, **inputs) + 1

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
        torch.testing.assert_close(compiled, fn(x), atol=0, rtol=0)


def test_refusals():
    inputs = _case(0, 2, 16, 64, 64, True, False, 4, torch.bfloat16, torch.float32, False)
    x, packed = inputs.pop("x"), inputs.pop("packed")
    lora_a = inputs["lora_a"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no_grad"):
        nf4_lora_linear(x, packed, **dict(inputs, lora_a=lora_a))
    with torch.no_grad():
        nf4_lora_linear(x, packed, **dict(inputs, lora_a=lora_a))  # trainable adapters are fine without grad
    with pytest.raises(ValueError, match="does not fit"):
        nf4_lora_linear(x[:, :32], packed, **inputs)
    with pytest.raises(ValueError, match="packed bytes"):
        nf4_lora_linear(x, packed[:-1], **inputs)
    with pytest.raises(ValueError, match="both lora_a and lora_b"):
        nf4_lora_linear(x, packed, **dict(inputs, lora_b=None))
    with pytest.raises(ValueError, match="double quantization"):
        nf4_lora_linear(x, packed, **dict(inputs, offset=None))
    with pytest.raises(ValueError, match="lora_a"):
        nf4_lora_linear(x, packed, **dict(inputs, lora_b=inputs["lora_b"][:, :3]))


def _lora_model(nested, bias, dtype=torch.bfloat16, n=96, k=128):
    peft = pytest.importorskip("peft")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, compress_statistics=nested,
                                          quant_type="nf4")
            self.proj.weight.data.mul_(8)  # (its init is ~U(+-1/sqrt(k)): weights about as large as the LoRA term)
            self.proj.support_avx512bf16_for_cpu = False  # keep bitsandbytes' layout on AVX512-BF16 CPUs
            self.proj = self.proj.to("cpu")  # quantizes

        def forward(self, x):
            return self.proj(x)

    model = peft.get_peft_model(Block(), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                                         target_modules=["proj"]))
    return model, model.base_model.model.proj


@pytest.mark.parametrize("nested,bias", [(True, True), (False, False)])
def test_module_convenience_matches_peft_over_bitsandbytes(nested, bias):
    model, layer = _lora_model(nested, bias)
    assert isinstance(layer.get_base_layer(), bnb.nn.Linear4bit)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        model.train()  # (bitsandbytes' own forward as GRPO's training forwards run it)
        want = layer(x)
        ours = nf4_lora_linear_from_module(x, layer)
        with triton_on_cpu():
            kernel = nf4_lora_linear_from_module(x, layer)
    scale = want.abs().max().item()
    for out in (ours, kernel):
        assert out.dtype == x.dtype
        # PEFT rounds the base product and the LoRA term to bf16 before their sum; ours rounds once.
        assert (out.float() - want.float()).abs().max().item() <= 3e-2 * max(1.0, scale)
    # The LoRA term is there: without it the result is bitsandbytes' base layer.
    with torch.no_grad(), model.disable_adapter():
        base = nf4_lora_linear_from_module(x, layer)
        torch.testing.assert_close(base.float(), layer.get_base_layer()(x).float(), atol=3e-2 * scale, rtol=0)
    assert (base.float() - want.float()).abs().max().item() > 0.1 * scale


def test_module_convenience_joins_several_active_adapters():
    peft = pytest.importorskip("peft")
    model, layer = _lora_model(True, True)
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, target_modules=["proj"]))
    layer.set_adapter(["default", "second"])
    a, b, scaling = lora_factors(layer)
    assert a.shape == (12, 128) and b.shape == (96, 12) and scaling == 1.0
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        model.train()
        want = layer(x)
        with triton_on_cpu():
            out = nf4_lora_linear_from_module(x, layer)
    scale = want.abs().max().item()
    assert (out.float() - want.float()).abs().max().item() <= 3e-2 * max(1.0, scale)


def test_module_convenience_refuses_a_weight_repacked_for_the_cpu_kernel():
    _, layer = _lora_model(True, False)
    layer.get_base_layer().weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="support_avx512bf16_for_cpu"), torch.no_grad():
        nf4_lora_linear_from_module(torch.randn(2, 128, dtype=torch.bfloat16), layer)


def test_module_convenience_refuses_adapters_that_are_not_plain_lora():
    peft = pytest.importorskip("peft")
    model, layer = _lora_model(True, False)
    model.add_adapter("biased", peft.LoraConfig(r=4, lora_bias=True, target_modules=["proj"]))
    layer.set_adapter(["default", "biased"])
    with pytest.raises(ValueError, match="LoRA with a bias: only plain LoRA"), torch.no_grad():
        nf4_lora_linear_from_module(torch.randn(2, 128, dtype=torch.bfloat16), layer)


def test_launch_rule_at_the_qwen_shapes():
    """~4 programs per SM on 132 SMs for the Qwen2.5-1.5B projections (static shapes only)."""
    from fastgrpo.kernels import _dispatch

    with _dispatch.triton_on_cpu(), _dispatch.cuda_launch_configs():
        device = torch.device("cpu")
        got = {(n, k): launch_config(64, n, k, 64, device)["splits"]
               for n, k in ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960))}
    assert got == {(1536, 1536): 8, (256, 1536): 12, (8960, 1536): 2, (1536, 8960): 11}


def test_bench_tiny_smoke_run(capsys):
    from bench import bench_nf4_linear

    rows = bench_nf4_linear.main(["--tiny", "--rows", "8"])
    assert [r["projection"] for r in rows] == ["q", "k/v", "o", "gate/up", "down"]
    assert all(r["max_rel_err"] < 3e-2 for r in rows)
    assert "| projection |" in capsys.readouterr().out


# GPU: the Qwen2.5-1.5B projection shapes, QLoRA's defaults (NF4, blocksize 64, double quantization), fp32 adapters.


def _gpu_case(m, n, k, bias, rank=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    packed, state = BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(rank, k, device="cuda", generator=g) * k ** -0.5
    b = torch.randn(n, rank, device="cuda", generator=g) * 0.1
    bias_t = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    return x, packed, state, a, b, bias_t


def _bnb_lora(x, packed, state, a, b, scaling, bias):
    w = BF.dequantize_4bit(packed, state, quant_type="nf4").to(x.dtype)
    out = F.linear(x.float(), w.float()) + scaling * F.linear(F.linear(x.float(), a.float()), b.float())
    return out + bias.float() if bias is not None else out


@pytest.mark.gpu
@pytest.mark.parametrize("lut,ahead", [(False, 2), (False, 3), (True, 0), (True, 2), (True, 3)])
@pytest.mark.parametrize("m", [8, 64])
@pytest.mark.parametrize("n,k", [(1536, 1536), (8960, 1536), (1536, 8960), (256, 1536)])
def test_gpu_kernel_at_real_shapes_and_in_a_cuda_graph(m, n, k, lut, ahead, monkeypatch):
    """Either form, its bytes loaded in the step or carried ahead, at either row band's launch, against
    bitsandbytes + PEFT, eager and replayed."""
    monkeypatch.setattr(nf4_module, "_FEW_ROWS_LUT", lut)
    monkeypatch.setattr(nf4_module, "_LUT", lut)
    monkeypatch.setattr(nf4_module, "_LUT_AHEAD" if lut else "_JOINED_AHEAD", ahead)
    x, packed, state, a, b, bias = _gpu_case(m, n, k, bias=n == 256)
    kwargs = dict(**quant_state_args(state), lora_a=a, lora_b=b, scaling=2.0, bias=bias)
    with torch.no_grad():
        out = nf4_lora_linear(x, packed, **kwargs)
        want = _bnb_lora(x, packed, state, a, b, 2.0, bias)
        scale = want.abs().max().item()
        # bf16 dots (the weight rounded as bitsandbytes rounds it; A, B and x @ A^T rounded to bf16), fp32 sums.
        assert (out.float() - want).abs().max().item() <= 1.6e-2 * max(1.0, scale)
        plain = nf4_lora_linear(x, packed, **quant_state_args(state))
        torch.testing.assert_close(plain.float(), F.linear(x.float(), BF.dequantize_4bit(
            packed, state, quant_type="nf4").float()), atol=1.6e-2 * scale, rtol=0)

        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = nf4_lora_linear(static_x, packed, **kwargs)
        for seed in (1, 2, 3):
            static_x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16,
                                       generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            torch.testing.assert_close(captured, nf4_lora_linear(static_x, packed, **kwargs), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64])
@pytest.mark.parametrize("rows", [(1536, 256, 256), (8960, 8960)])
def test_gpu_grouped_weights_at_real_shapes_and_in_a_cuda_graph(m, rows):
    """The 1.5B shape's q/k/v and gate/up, each weight scaled differently (other nested offsets), in one launch: the
    bits of each weight's own launch at the grouped call's tiles and splits, near bitsandbytes + PEFT, and replayed
    in a CUDA graph."""
    k = 1536
    cases = [_gpu_case(m, n, k, bias=len(rows) == 3, seed=g) for g, n in enumerate(rows)]
    x = cases[0][0]
    packed = [c[1].reshape(-1) for c in cases]
    states = [c[2] for c in cases]
    for g, state in enumerate(states):  # other scales a weight
        state.offset = state.offset * (g + 1)
        state.state2.absmax = state.state2.absmax * (g + 1)
    args = [quant_state_args(state) for state in states]
    kwargs = dict(shape=(sum(rows), k), absmax=torch.cat([a["absmax"] for a in args]), code=args[0]["code"],
                  nested_absmax=torch.cat([a["nested_absmax"] for a in args]), nested_code=args[0]["nested_code"],
                  offset=torch.stack([a["offset"].reshape(()) for a in args]), code_values=args[0]["code_values"],
                  lora_a=torch.cat([c[3] for c in cases]), lora_b=torch.cat([c[4] for c in cases]), scaling=2.0,
                  bias=torch.cat([c[5] for c in cases]) if cases[0][5] is not None else None,
                  group_table=group_table(packed, list(rows), k))
    with torch.no_grad():
        out = nf4_lora_linear(x, packed, **kwargs)
        config = launch_config(m, sum(rows), k, 64, x.device)
        lo = 0
        for (_, p, state, a, b, bias), n in zip(cases, rows):
            want = _bnb_lora(x, p, state, a, b, 2.0, bias)
            assert (out[:, lo:lo + n].float() - want).abs().max().item() <= 1.6e-2 * max(1.0, want.abs().max().item())
            own = _triton_nf4_lora_linear(x, p.reshape(-1), *_op_args_of(x, dict(
                packed=p, **quant_state_args(state), lora_a=a, lora_b=b, scaling=2.0, bias=bias))[2:15],
                config=config)
            torch.testing.assert_close(out[:, lo:lo + n], own, atol=0, rtol=0)
            lo += n
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = nf4_lora_linear(static_x, packed, **kwargs)
        for seed in (1, 2):
            static_x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16,
                                       generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            torch.testing.assert_close(captured, nf4_lora_linear(static_x, packed, **kwargs), atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_module_convenience_matches_peft():
    peft = pytest.importorskip("peft")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear4bit(1536, 256, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4")

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model = peft.get_peft_model(Block().to("cuda"), peft.LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                                                    target_modules=["proj"]))
    layer = model.base_model.model.proj
    x = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        out = nf4_lora_linear_from_module(x, layer)
    scale = want.abs().max().item()
    assert (out.float() - want.float()).abs().max().item() <= 3e-2 * max(1.0, scale)
