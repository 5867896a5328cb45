"""fastgrpo::rms_norm / fastgrpo::add_rms_norm: values and gradients against a float64
reference, bit-level agreement with the HF formulas, op registration, the saved-tensor
contract and input checks. Each check runs on the CPU torch path, on the Triton kernels
through the interpreter (small shapes), and on CUDA (marked gpu)."""
import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastgrpo.kernels import rms_norm as rms_mod
from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.rms_norm import MAX_HIDDEN_SIZE, add_rms_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Per-dtype tolerance: a few roundings of the output dtype (llama mode rounds twice).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (device, run the Triton kernels?) for each path under test.
PATHS = [
    pytest.param("cpu", False, id="cpu-torch"),
    pytest.param(
        "cpu", True, id="cpu-triton",
        marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"),
    ),
    pytest.param("cuda", True, id="cuda", marks=pytest.mark.gpu),
]


def _path(triton_cpu: bool, device: str):
    return triton_on_cpu() if (triton_cpu and device == "cpu") else contextlib.nullcontext()


def _make(shape, dtype, device, layout, gen, scale=1.0):
    """A tensor of `shape` with the given memory layout (values from gen)."""
    *lead, H = shape
    if layout == "contiguous":
        base = torch.randn(shape, generator=gen, dtype=torch.float32)
    elif layout == "sliced":  # row stride > H
        base = torch.randn(*lead, H + 3, generator=gen, dtype=torch.float32)[..., :H]
    elif layout == "strided_last":  # stride 2 along H
        base = torch.randn(*lead, 2 * H, generator=gen, dtype=torch.float32)[..., ::2]
    elif layout == "permuted":  # leading dims in reverse memory order, e.g. a transposed grad
        base = torch.randn(*reversed(lead), H, generator=gen, dtype=torch.float32)
        base = base.permute(*reversed(range(len(lead))), len(lead))
    else:
        raise ValueError(layout)
    out = torch.empty_strided(base.shape, base.stride(), dtype=dtype, device=device)
    out.copy_(base * scale)
    return out


def _reference(x, residual, weight, eps, offset, weight_in_fp32):
    """float64 s (rounded as torch rounds the add) and y, plus a closure for the gradients.
    The multiplier is the forward's: in llama mode (w + offset) rounded to w's dtype."""
    s = x + residual if residual is not None else x
    sd = s.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_() if weight is not None else None
    n = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)
    if wd is None:
        y = n
    elif weight_in_fp32:
        y = n * (wd + offset)
    else:
        rounded = (weight.detach() + offset).double()
        y = n * (wd + (rounded - wd.detach()))

    def grads(dy, ds):
        """d(src), dw, and the size of the terms d(src) sums (its cancellations can leave a
        result far smaller than the terms: the scale for an absolute tolerance)."""
        inputs = [sd] + ([wd] if wd is not None else [])
        g = torch.autograd.grad(y, inputs, dy.double())
        d_src = g[0] + (ds.double() if ds is not None else 0)
        rstd = torch.rsqrt(sd.detach().pow(2).mean(-1, keepdim=True) + eps)
        terms = (dy.double() * (y.detach() / n.detach()).nan_to_num(0.0) * rstd).abs()
        terms = terms + (ds.double().abs() if ds is not None else 0)
        return d_src, (g[1] if wd is not None else None), terms.max().item()

    return s.detach(), y.detach(), grads


def _coarsest(dtypes):
    return max(dtypes, key=lambda d: TOL[d])


def _assert_close(actual, expected, dtype, what, scale=None):
    tol = TOL[dtype]
    atol = tol * (scale if scale is not None else 1e-2)
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=atol, msg=lambda m: f"{what}: {m}")


@st.composite
def _cases(draw, max_rows, max_h):
    rank = draw(st.integers(2, 4))
    H = draw(st.one_of(st.sampled_from([1, 7, 64, 127]), st.integers(1, max_h)))
    lead = [draw(st.integers(1, 4)) for _ in range(rank - 2)]
    rows_left = max(1, max_rows // math.prod(lead))
    lead = [draw(st.one_of(st.just(1), st.integers(1, rows_left)))] + lead
    dtype = draw(st.sampled_from(DTYPES))
    return dict(
        shape=tuple(lead) + (H,),
        dtype=dtype,
        add=draw(st.booleans()),
        res_dtype=draw(st.sampled_from([dtype, dtype, torch.float32])),
        has_weight=draw(st.sampled_from([True, True, False])),
        w_dtype=draw(st.sampled_from([dtype, dtype, torch.float32])),
        weight_grad=draw(st.booleans()),
        offset=draw(st.sampled_from([0.0, 1.0])),
        weight_in_fp32=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        x_layout=draw(st.sampled_from(["contiguous", "sliced", "strided_last", "permuted"])),
        grad_layout=draw(st.sampled_from(["contiguous", "sliced", "permuted"])),
        grad_sum=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _check_case(c, device, triton_cpu):
    gen = torch.Generator().manual_seed(c["seed"])
    shape, dtype = c["shape"], c["dtype"]
    x = _make(shape, dtype, device, c["x_layout"], gen, scale=2.0).requires_grad_()
    residual = _make(shape, c["res_dtype"], device, "contiguous", gen).requires_grad_() if c["add"] else None
    weight = None
    if c["has_weight"]:
        weight = (torch.randn(shape[-1], generator=gen) * 0.5 + (0.0 if c["offset"] else 1.0))
        weight = weight.to(device=device, dtype=c["w_dtype"]).requires_grad_(c["weight_grad"])
    kwargs = dict(eps=c["eps"], offset=c["offset"], weight_in_fp32=c["weight_in_fp32"])

    with _path(triton_cpu, device):
        if c["add"]:
            s, y = add_rms_norm(x, residual, weight, **kwargs)
        else:
            s, y = None, rms_norm(x, weight, **kwargs)
        src_dtype = s.dtype if s is not None else x.dtype
        expected_dtype = src_dtype if weight is None or c["weight_in_fp32"] else torch.promote_types(src_dtype, weight.dtype)
        assert y.dtype == expected_dtype and y.shape == x.shape

        s_ref, y_ref, ref_grads = _reference(x, residual, weight, c["eps"], c["offset"], c["weight_in_fp32"])
        if s is not None:
            assert torch.equal(s, s_ref), "sum differs from torch's x + residual"
        # llama mode rounds the normalised value to src's dtype, then the product; gemma mode
        # rounds only the output.
        rounded_in = [y.dtype] if c["weight_in_fp32"] or weight is None else [y.dtype, src_dtype]
        _assert_close(y, y_ref, _coarsest(rounded_in), "y")

        dy = _make(shape, y.dtype, device, c["grad_layout"], gen)
        ds = _make(shape, s.dtype, device, "permuted", gen) if (s is not None and c["grad_sum"]) else None
        inputs = [x] + ([residual] if residual is not None else []) + ([weight] if c["weight_grad"] and weight is not None else [])
        outputs, grads_in = [y], [dy]
        if ds is not None:
            outputs, grads_in = [s, y], [ds, dy]
        got = torch.autograd.grad(outputs, inputs, grads_in)

    # Gradients are computed in fp32 and rounded once, to their own dtype.
    d_src_ref, dw_ref, d_src_scale = ref_grads(dy, ds)
    assert got[0].dtype == x.dtype and got[0].shape == x.shape
    _assert_close(got[0], d_src_ref, x.dtype, "dx", d_src_scale)
    if residual is not None:
        assert got[1].dtype == residual.dtype and got[1].shape == x.shape
        _assert_close(got[1], d_src_ref, residual.dtype, "dresidual", d_src_scale)
    if c["weight_grad"] and weight is not None:
        assert got[-1].dtype == weight.dtype
        _assert_close(got[-1], dw_ref, weight.dtype, "dweight", dw_ref.abs().max().item())


_SMALL = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("device,triton_cpu", PATHS)
@_SMALL
@given(c=_cases(max_rows=40, max_h=160))
def test_matches_float64_reference(device, triton_cpu, c):
    _check_case(c, device, triton_cpu)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(c=_cases(max_rows=3000, max_h=9000))
def test_matches_float64_reference_cuda_large(c):
    _check_case(c, "cuda", True)


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_many_rows_and_one_row(device, triton_cpu):
    """Many rows make several row blocks and several dW programs (the persistent loop)."""
    for shape in [(1, 33), (517, 40), (3, 2, 171, 24), (2, 3, 2, 5, 24)]:  # rank 5: leading dims flattened
        c = dict(shape=shape, dtype=torch.bfloat16, add=True, res_dtype=torch.bfloat16, has_weight=True,
                 w_dtype=torch.bfloat16, weight_grad=True, offset=0.0, weight_in_fp32=False, eps=1e-6,
                 x_layout="sliced", grad_layout="permuted", grad_sum=True, seed=1)
        _check_case(c, device, triton_cpu)
        _check_case(dict(c, add=False, dtype=torch.float32, res_dtype=torch.float32, w_dtype=torch.float32),
                    device, triton_cpu)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_backward(monkeypatch, stages):
    """The backward's software-pipelined row loop (PIPELINE_STAGES > 0; the interpreter ignores
    num_stages, so this checks its logic): gradients against the float64 reference, with the
    residual's gradient, non-contiguous inputs and a partial last block, and bit for bit the
    register-prefetch loop's (same partial-sum layout)."""
    # 4 rows a program, 2 persistent programs: many iterations each.
    configs = {0: lambda *_: (4, 1, 2, 0), stages: lambda *_: (4, 1, 2, stages)}
    monkeypatch.setattr(rms_mod, "_bwd_config", configs[stages])
    c = dict(shape=(3, 37, 40), dtype=torch.bfloat16, add=True, res_dtype=torch.bfloat16, has_weight=True,
             w_dtype=torch.bfloat16, weight_grad=True, offset=0.0, weight_in_fp32=False, eps=1e-6,
             x_layout="permuted", grad_layout="sliced", grad_sum=True, seed=stages)
    _check_case(c, "cpu", True)
    _check_case(dict(c, add=False, dtype=torch.float32, res_dtype=torch.float32, w_dtype=torch.float32, offset=1.0,
                     weight_in_fp32=True, x_layout="sliced", grad_layout="permuted"), "cpu", True)

    gen = torch.Generator().manual_seed(stages)
    src = _make((2, 45, 24), torch.bfloat16, "cpu", "permuted", gen)
    dy, dsum = _make((2, 45, 24), torch.bfloat16, "cpu", "sliced", gen), _make((2, 45, 24), torch.bfloat16, "cpu",
                                                                                 "contiguous", gen)
    w = torch.randn(24, generator=gen).to(torch.bfloat16)
    runs = {}
    for s in (0, stages):
        monkeypatch.setattr(rms_mod, "_bwd_config", configs[s])
        with triton_on_cpu():
            runs[s] = torch.ops.fastgrpo.rms_norm_backward(dy, dsum, src, w, 1e-6, 0.0, False, True, True)
    assert torch.equal(runs[0][0], runs[stages][0]) and torch.equal(runs[0][1], runs[stages][1])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_contiguous_rows_as_one_leading_dim_or_three(monkeypatch):
    """Contiguous rows reach the kernels as one leading dim, (n_rows, 1, 1), except in the register-prefetch
    backward without dW, which keeps them as three, (1, B, T): both addressings give the same bits."""
    gen = torch.Generator().manual_seed(0)
    src, dy, dsum = (_make((3, 37, 40), torch.bfloat16, "cpu", "contiguous", gen) for _ in range(3))
    w = torch.randn(40, generator=gen).to(torch.bfloat16)
    strided_rows, leads, grads = rms_mod._strided_rows, [], []

    def recording(tensors, *args):
        out = strided_rows(tensors, *args)
        leads.append(tuple(out[1]))
        return out

    monkeypatch.setattr(rms_mod, "_strided_rows", recording)
    for config in ((4, 1, None, 0), (4, 1, 2, 0)):  # straight through; persistent with register prefetch
        monkeypatch.setattr(rms_mod, "_bwd_config", lambda *_, c=config: c)
        with triton_on_cpu():
            grads.append(torch.ops.fastgrpo.rms_norm_backward(dy, dsum, src, w, 1e-6, 0.0, False, True, False)[0])
    assert leads == [(111, 1, 1), (1, 3, 37)]
    assert torch.equal(grads[0], grads[1])


@settings(max_examples=200, deadline=None)
@given(n_row_blocks=st.integers(1, 200_000), programs_per_sm=st.sampled_from([2, 4, 8]),
       sms=st.sampled_from([1, 78, 114, 132]))
@example(n_row_blocks=32768, programs_per_sm=8, sms=132)  # the benchmark's rows on the H200, always run
def test_persistent_programs_share_row_blocks_evenly(n_row_blocks, programs_per_sm, sms):
    """The persistent backward takes no more programs than the device holds, and no program takes more row blocks than
    the fewest possible: program p takes blocks p, p + P, ..., so the remainder over P programs would otherwise
    be a tail of programs with one block more than the rest."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rms_mod._dispatch, "multiprocessor_count", lambda _device: sms)
        programs, most = rms_mod._bwd_programs(torch.device("cpu"), n_row_blocks, programs_per_sm)
    assert most == programs_per_sm * sms
    assert 1 <= programs <= min(most, n_row_blocks)
    fewest_possible = math.ceil(n_row_blocks / most)
    assert math.ceil(n_row_blocks / programs) == fewest_possible  # the busiest program's blocks
    assert (programs - 1) * fewest_possible < n_row_blocks  # no program is left without a block
    if n_row_blocks == 32768 and most == 1056:
        assert programs == 1024


def test_persistent_programs_of_a_symbolic_row_count():
    """In a compiled graph the row count is a symbol: the programs stay an expression of it (no specialisation)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    rows = env.create_unspecified_symint_and_symbol(32768, ConstantSource("rows"), DimDynamic.DYNAMIC)
    with_symbol = rms_mod._bwd_programs(torch.device("cpu"), rows, 8)[0]
    assert isinstance(with_symbol, torch.SymInt) and not env.guards
    assert with_symbol.node.expr.xreplace({rows.node.expr: 32768}) == rms_mod._bwd_programs(
        torch.device("cpu"), 32768, 8)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("H", [576, 1536])
def test_cuda_pipelined_backward(monkeypatch, H, stages):
    """The pipelined row loop compiled for the GPU (the sweep's candidates), at the benchmark widths."""
    monkeypatch.setattr(rms_mod, "_bwd_config", lambda *_: (4, 4, 4, stages))
    for add in (False, True):
        c = dict(shape=(4, 1031, H), dtype=torch.bfloat16, add=add, res_dtype=torch.bfloat16, has_weight=True,
                 w_dtype=torch.bfloat16, weight_grad=True, offset=0.0, weight_in_fp32=False, eps=1e-6,
                 x_layout="sliced", grad_layout="permuted", grad_sum=add, seed=H + stages)
        _check_case(c, "cuda", True)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [576, 1536, 4096, 8192])
@pytest.mark.parametrize("add,grad_sum,weight_grad", [(False, False, False), (False, False, True),
                                                      (True, True, False), (True, True, True)])
def test_cuda_every_backward_launch_configuration(H, add, grad_sum, weight_grad):
    """The benchmark widths through each launch configuration of the backward (plain, with dW,
    with d(sum) with and without dW), with more row blocks than persistent programs."""
    c = dict(shape=(4, 1031, H), dtype=torch.bfloat16, add=add, res_dtype=torch.bfloat16, has_weight=True,
             w_dtype=torch.bfloat16, weight_grad=weight_grad, offset=0.0, weight_in_fp32=False, eps=1e-6,
             x_layout="contiguous", grad_layout="contiguous", grad_sum=grad_sum, seed=H)
    _check_case(c, "cuda", True)


# ---------------------------------------------------------------------------------------------
# Bit-level agreement with the HF modules' formulas, written out in the same dtype
# ---------------------------------------------------------------------------------------------


def _llama_rms_norm(x, weight, eps):  # LlamaRMSNorm.forward (also Qwen2/3, Mistral, Phi3)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _gemma_rms_norm(x, weight, eps):  # GemmaRMSNorm.forward (Gemma 1/2/3)
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def _olmo2_rms_norm(x, weight, eps):  # Olmo2RMSNorm.forward
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def _ulp_distance(a, b):
    """Distance in units in the last place, elementwise (same dtype, finite values)."""
    assert a.dtype == b.dtype
    int_dtype = {2: torch.int16, 4: torch.int32}[a.element_size()]
    sign_bit = 1 << (8 * a.element_size() - 1)

    def ordered(t):  # sign-magnitude bits -> integers in the order of the float values
        i = t.contiguous().view(int_dtype).long()
        return torch.where(i < 0, -(i & (sign_bit - 1)), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("device,triton_cpu", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_hf_formulas_within_one_ulp(device, triton_cpu, dtype):
    gen = torch.Generator().manual_seed(0)
    # [B, S, heads, D] like Qwen3's q_norm, and a [tokens, hidden] layer norm.
    for shape in [(2, 5, 4, 64), (37, 96)]:
        x = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
        residual = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        w = (torch.randn(shape[-1], generator=gen) * 0.3 + 1).to(device=device, dtype=dtype)
        eps = 1e-6
        with _path(triton_cpu, device):
            cases = [
                (rms_norm(x, w, eps), _llama_rms_norm(x, w, eps)),
                (rms_norm(x, w, eps, offset=1.0, weight_in_fp32=True), _gemma_rms_norm(x, w, eps)),
                (rms_norm(x, w, eps, weight_in_fp32=True), _olmo2_rms_norm(x, w, eps)),
                (rms_norm(x, None, eps), _llama_rms_norm(x, torch.ones((), dtype=dtype, device=device), eps)),
            ]
            s, y = add_rms_norm(x, residual, w, eps)
            cases.append((y, _llama_rms_norm(x + residual, w, eps)))
            cases.append((s, x + residual))
        # A half-precision result may flip by one ulp where the fp32 sum of squares, added up
        # in another order, lands on the other side of a rounding boundary; an fp32 result
        # carries that reduction's few-ulp difference itself.
        max_ulp = 16 if dtype == torch.float32 else 1
        for i, (got, want) in enumerate(cases):
            assert got.dtype == want.dtype, i
            dist = _ulp_distance(got, want)
            assert dist.max().item() <= max_ulp, f"case {i}: {dist.max().item()} ulp apart"
            # Flips are rare; a missing or extra rounding step shows up as many of them.
            if dtype != torch.float32:
                assert (dist > 0).float().mean().item() < 0.01, f"case {i}: too many differ"
            if not triton_cpu:  # the torch path runs the very same torch ops
                assert torch.equal(got, want), f"case {i}"


# ---------------------------------------------------------------------------------------------
# Registration, saved tensors, input checks, determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_opcheck(device, triton_cpu):
    gen = torch.Generator().manual_seed(0)
    x = _make((3, 4, 40), torch.bfloat16, device, "permuted", gen).requires_grad_()
    x_sliced = _make((6, 40), torch.float32, device, "sliced", gen).requires_grad_()
    residual = _make((3, 4, 40), torch.bfloat16, device, "contiguous", gen).requires_grad_()
    w = torch.randn(40, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w32 = torch.randn(40, generator=gen).to(device).requires_grad_()
    dy = _make((3, 4, 40), torch.bfloat16, device, "permuted", gen)
    ops = torch.ops.fastgrpo
    cases = [
        (ops.rms_norm.default, (x, w, 1e-6, 0.0, False, torch.bfloat16)),
        (ops.rms_norm.default, (x_sliced, None, 1e-5, 0.0, False, torch.float32)),
        (ops.rms_norm.default, (x_sliced, w32, 1e-6, 1.0, True, torch.bfloat16)),
        (ops.add_rms_norm.default, (x, residual, w, 1e-6, 1.0, False, torch.bfloat16)),
        (ops.add_rms_norm.default, (x, residual, None, 1e-6, 0.0, True, torch.float32)),
        (ops.rms_norm_backward.default, (dy, None, x.detach(), w.detach(), 1e-6, 0.0, False, True, True)),
        (ops.rms_norm_backward.default, (dy, dy, x.detach(), w.detach(), 1e-6, 1.0, True, True, False)),
        (ops.rms_norm_backward.default, (dy, None, x.detach(), None, 1e-6, 0.0, False, True, False)),
    ]
    with _path(triton_cpu, device):
        for op, args in cases:
            torch.library.opcheck(op, args)


def _saved_tensors(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_saves_only_the_contract(device, triton_cpu):
    """Backward keeps the normalised input (x, or the sum) and the weight; nothing else
    (rstd is recomputed from the saved row, so not even the fp32 [rows] tensor the contract
    allows)."""
    x = torch.randn(8, 16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(8, 16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=device, dtype=torch.bfloat16, requires_grad=True)
    with _path(triton_cpu, device):
        saved, y = _saved_tensors(lambda: rms_norm(x, w))
        assert len(saved) == 2
        assert saved[0] is x and saved[1] is w
        saved, (s, y) = _saved_tensors(lambda: add_rms_norm(x, residual, w))
        assert len(saved) == 2
        assert saved[0].data_ptr() == s.data_ptr() and saved[1] is w
        saved_bytes = sum(t.numel() * t.element_size() for t in saved)
        assert saved_bytes == s.numel() * 2 + 64 * 2
        (s.sum() + y.float().pow(2).sum()).backward()  # the saved tensors suffice for backward
    assert x.grad is not None and residual.grad is not None and w.grad is not None


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_frozen_weight_gets_no_grad(device, triton_cpu):
    x = torch.randn(5, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device)  # frozen, like the base model's norms under LoRA
    with _path(triton_cpu, device):
        rms_norm(x, w).sum().backward()
        dx, dw = torch.ops.fastgrpo.rms_norm_backward(torch.ones_like(x), None, x.detach(), w, 1e-6, 0.0, False, True, False)
    assert x.grad is not None and w.grad is None
    assert dw.numel() == 0 and dx.shape == x.shape


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_only_weight_needs_grad(device, triton_cpu):
    x = torch.randn(6, 40, device=device)
    w = torch.randn(40, device=device, requires_grad=True)
    dy = torch.randn(6, 40, device=device)
    with _path(triton_cpu, device):
        (dw,) = torch.autograd.grad(rms_norm(x, w), (w,), dy)
    n = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(dw.double(), (dy.double() * n).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_weight_grad_is_deterministic(device, triton_cpu):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 40, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(40, generator=gen).to(device=device, dtype=torch.bfloat16)
    dy = torch.randn(300, 40, generator=gen).to(device=device, dtype=torch.bfloat16)
    with _path(triton_cpu, device):
        runs = [torch.ops.fastgrpo.rms_norm_backward(dy, None, x, w, 1e-6, 0.0, False, True, True) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64])
def test_rejects_unsupported_dtypes(dtype):
    x = torch.ones(4, 8, dtype=dtype)
    with pytest.raises(TypeError, match="fastgrpo::rms_norm supports float32, float16 and bfloat16"):
        rms_norm(x)
    with pytest.raises(TypeError, match="fastgrpo::add_rms_norm supports"):
        add_rms_norm(torch.ones(4, 8), x)
    with pytest.raises(TypeError, match="fastgrpo::rms_norm supports"):
        rms_norm(torch.ones(4, 8), torch.ones(8, dtype=dtype))


def test_rejects_bad_shapes_and_too_wide_rows():
    with pytest.raises(ValueError, match="exceeds 65536"):
        rms_norm(torch.empty(2, MAX_HIDDEN_SIZE + 1, device="meta"))
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.ones(4, 8), torch.ones(7))
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(torch.ones(4, 8), torch.ones(1, 8))


@pytest.mark.parametrize("device,triton_cpu", PATHS)
def test_empty_input(device, triton_cpu):
    x = torch.ones(0, 16, device=device, requires_grad=True)
    with _path(triton_cpu, device):
        y = rms_norm(x, torch.ones(16, device=device, requires_grad=True))
        y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)


@pytest.mark.gpu
def test_cuda_widest_row_and_int64_offsets():
    """H = MAX_HIDDEN_SIZE in one block; > 2**31 elements need int64 offsets."""
    x = torch.randn(4, MAX_HIDDEN_SIZE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(MAX_HIDDEN_SIZE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w)
    assert _ulp_distance(y, _llama_rms_norm(x.detach(), w.detach(), 1e-6)).max().item() <= 1
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()

    rows = (2**31) // 4096 + 8
    big = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(big)
    tail = big[-16:]
    assert _ulp_distance(y[-16:], _llama_rms_norm(tail, torch.ones((), dtype=torch.bfloat16, device="cuda"), 1e-6)).max() <= 1


def test_module_exports():
    assert callable(rms_mod.rms_norm) and callable(rms_mod.add_rms_norm)
