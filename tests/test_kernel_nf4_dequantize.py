"""fastgrpo::nf4_dequantize: the Triton kernel (interpreter) equal to bitsandbytes' dequantization without LoRA and
against a float64 reference with a merged LoRA delta, over shapes, blocksizes, double quantization, ranks and
dtypes; the torch path; bad input; real shapes on a GPU, eagerly and replayed in a CUDA graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.nf4_dequantize import nf4_dequantize
from fastgrpo.kernels.nf4_lora_linear import _dequantize, quant_state_args

bnb = pytest.importorskip("bitsandbytes")
BF = bnb.functional

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(seed, n, k, blocksize, nested, rank, dtype, quant_type="nf4"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype if dtype != torch.float32 else torch.bfloat16)
    packed, state = BF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)
    lora = {}
    if rank:
        # the delta about as large as the weight, so that a wrong one shows
        lora = dict(lora_a=torch.randn(rank, k, generator=g) * 0.1, lora_b=torch.randn(n, rank, generator=g) * 0.1,
                    scaling=float(torch.rand(1, generator=g)) + 0.5)
    return packed, state, lora


def _want(packed, state, lora, dtype):
    args = quant_state_args(state)
    del args["pairs"], args["code_values"]
    w = _dequantize(packed, **args).double()
    if lora:
        w = w + lora["scaling"] * (lora["lora_b"].double() @ lora["lora_a"].double())
    return w


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 100), st.integers(1, 4), st.sampled_from([32, 64, 128, 256]),
       st.booleans(), st.sampled_from([0, 1, 8, 16]),
       st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), st.sampled_from(["nf4", "fp4"]))
def test_kernel_matches_bitsandbytes_and_the_float64_reference(seed, n, blocks, blocksize, nested, rank, dtype,
                                                               quant_type):
    k = blocks * blocksize
    packed, state, lora = _case(seed, n, k, blocksize, nested, rank, dtype, quant_type)
    with triton_on_cpu():
        got = nf4_dequantize(packed, **quant_state_args(state), **lora, dtype=dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    if not rank:  # one rounding of code * scale, as bitsandbytes rounds (test_kernel_nf4_linear.py checks the bits)
        want = _want(packed, state, lora, dtype).float().to(dtype)
        if dtype == torch.bfloat16:  # the interpreter rounds to bf16 by truncation: within one ulp (on a GPU: equal)
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
        else:
            assert torch.equal(got, want)
    else:
        want = _want(packed, state, lora, dtype)
        ulp = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert (got.double() - want).abs().max().item() <= ulp * max(1.0, want.abs().max().item())


def test_torch_path_is_the_same_maths():
    packed, state, lora = _case(1, 40, 256, 64, True, 8, torch.bfloat16)
    cpu = nf4_dequantize(packed, **quant_state_args(state), **lora)
    with triton_on_cpu():
        kernel = nf4_dequantize(packed, **quant_state_args(state), **lora)
    want = _want(packed, state, lora, torch.bfloat16)
    for got in (cpu, kernel):
        assert (got.double() - want).abs().max().item() <= 8e-3 * want.abs().max().item()


def test_bad_input_names_the_fix():
    packed, state, lora = _case(2, 16, 128, 64, False, 4, torch.bfloat16)
    args = quant_state_args(state)
    with pytest.raises(ValueError, match="quant_state_args"):
        nf4_dequantize(packed, **dict(args, shape=(16, 256)))
    with pytest.raises(ValueError, match="both lora_a and lora_b"):
        nf4_dequantize(packed, **args, lora_a=lora["lora_a"])
    with pytest.raises(TypeError, match="bfloat16"):
        nf4_dequantize(packed, **args, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="no_grad"):
        nf4_dequantize(packed, **args, lora_a=lora["lora_a"].requires_grad_(), lora_b=lora["lora_b"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(1536, 1536), (8960, 1536), (1536, 8960), (256, 1536)])
def test_gpu_real_shapes_and_cuda_graph(n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    packed, state = BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    a = torch.randn(16, k, device="cuda", generator=g) * 0.1
    b = torch.randn(n, 16, device="cuda", generator=g) * 0.1
    base = BF.dequantize_4bit(packed, state, quant_type="nf4")
    with torch.no_grad():
        plain = nf4_dequantize(packed, **quant_state_args(state))
        assert torch.equal(plain, base)
        merged = nf4_dequantize(packed, **quant_state_args(state), lora_a=a, lora_b=b, scaling=2.0)
        want = base.float() + 2.0 * (b.bfloat16().float() @ a.bfloat16().float())
        assert (merged.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = nf4_dequantize(packed, **quant_state_args(state), lora_a=a, lora_b=b, scaling=2.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, merged)
