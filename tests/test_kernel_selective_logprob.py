"""fastgrpo::selective_logprob: values, entropy and gradients against a float64 reference,
bitwise chunk invariance, the frozen-weight shortcut, the saved-tensor contract, opcheck and
input errors; on the torch (CPU) path and on the Triton path through the interpreter."""
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastgrpo.kernels.selective_logprob as slp
from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.selective_logprob import IGNORE_INDEX, selective_logprob

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative (to max |reference|) tolerance on gradients; log-probs and entropies are computed
# in fp32 whatever the input dtype and are held to fp32 tolerances.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def reference(hidden, weight, targets, temperature=1.0, logit_scale=1.0, softcap=0.0):
    """Float64 autograd reference of the documented semantics."""
    z = (hidden.double() @ weight.double().t()) * logit_scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.clamp(min=0)[..., None])[..., 0] - lse
    logp = torch.where(targets == IGNORE_INDEX, 0.0, logp)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def make_inputs(n, h, v, dtype, seed, noncontig=False, ignore_frac=0.2, weight_grad=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if noncontig:  # a transposed view: stride (1, N)
        hidden = torch.randn(h, n, generator=g).to(dtype).t()
    else:
        hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (2.0 / max(h, 1) ** 0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignore_frac] = IGNORE_INDEX
    hidden = hidden.to(device).requires_grad_()
    weight = weight.to(device).requires_grad_(weight_grad)
    return hidden, weight, targets.to(device)


def run_and_grad(hidden, weight, targets, g_logp, g_ent, with_entropy, **kw):
    out = selective_logprob(hidden, weight, targets, with_entropy=with_entropy, **kw)
    logp, entropy = out if with_entropy else (out, None)
    loss = (logp * g_logp).sum()
    if with_entropy and g_ent is not None:
        loss = loss + (entropy * g_ent).sum()
    grads = torch.autograd.grad(loss, [hidden, weight] if weight.requires_grad else [hidden])
    return logp, entropy, grads[0], grads[1] if weight.requires_grad else None


def assert_grad_close(got, ref, dtype):
    assert got.dtype == dtype
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= GRAD_TOL[dtype] * scale + 1e-12, f"max err {err:.3g} vs max |ref| {scale:.3g}"


def check_against_reference(n, h, v, dtype, seed, temperature, logit_scale, softcap,
                            with_entropy, weight_grad, noncontig):
    hidden, weight, targets = make_inputs(n, h, v, dtype, seed, noncontig, weight_grad=weight_grad)
    gen = torch.Generator().manual_seed(seed + 1)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    kw = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logp, entropy, d_hidden, d_weight = run_and_grad(hidden, weight, targets, g_logp, g_ent, with_entropy, **kw)

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_logp, ref_ent = reference(h64, w64, targets, **kw)
    ref_loss = (ref_logp * g_logp.double()).sum()
    if with_entropy:
        ref_loss = ref_loss + (ref_ent * g_ent.double()).sum()
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, [h64, w64])

    assert logp.dtype == torch.float32 and logp.shape == (n,)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=2e-5, atol=2e-5)
    assert torch.all(logp[targets == IGNORE_INDEX] == 0)
    if with_entropy:
        assert entropy.dtype == torch.float32
        torch.testing.assert_close(entropy.double(), ref_ent, rtol=2e-5, atol=2e-5)
    assert_grad_close(d_hidden, ref_dh, dtype)
    if weight_grad:
        assert_grad_close(d_weight, ref_dw, dtype)


common = dict(
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([1.0, 0.7, 1.9]),
    logit_scale=st.sampled_from([1.0, 0.25, 3.0]),
    softcap=st.sampled_from([0.0, 0.0, 2.0, 30.0]),
    with_entropy=st.booleans(),
    weight_grad=st.booleans(),
    noncontig=st.booleans(),
)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), h=st.integers(1, 48), v=st.integers(1, 1300), **common)
def test_torch_path_matches_reference(n, h, v, **kw):
    # V up to 1300 spans several TORCH_VOCAB (512) tiles of the online log-sum-exp.
    check_against_reference(n, h, v, **kw)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 64), h=st.integers(1, 64), v=st.integers(1, 300), **common)
def test_triton_interpreter_matches_reference(n, h, v, **kw):
    # Several vocab splits, row blocks and backward chunks at the interpreter's tile sizes.
    with triton_on_cpu():
        check_against_reference(n, h, v, **kw)


def forward_backward(hidden, weight, targets, g_logp, g_ent, **kw):
    """With g_ent None the entropy is returned but gets no gradient: with a frozen weight that is
    the backward from the forward's gradient; with g_ent, the recomputing backward."""
    logp, entropy, d_hidden, _ = run_and_grad(hidden, weight, targets, g_logp, g_ent, True, **kw)
    return logp.detach(), entropy.detach(), d_hidden


def chunked(hidden, weight, targets, g_logp, g_ent, bounds, **kw):
    parts = [
        forward_backward(hidden[a:b].detach().requires_grad_(), weight, targets[a:b], g_logp[a:b],
                         None if g_ent is None else g_ent[a:b], **kw)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return [torch.cat(p) for p in zip(*parts)]


@pytest.mark.parametrize("triton_path", [False, True], ids=["torch", "interpreter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["recomputing", "grad_from_forward"])
def test_chunk_invariance_is_bitwise(dtype, triton_path, entropy_grad):
    # Rows land at other offsets inside the fixed-size tiles, in calls of other sizes.
    n, h, v = (50, 40, 300) if triton_path else (60, 40, 1100)
    hidden, weight, targets = make_inputs(n, h, v, dtype, seed=7, weight_grad=False)
    g_logp, g_ent = torch.randn(n), torch.randn(n) if entropy_grad else None
    kw = dict(temperature=0.8, softcap=20.0)
    with triton_on_cpu() if triton_path else contextlib.nullcontext():
        whole = forward_backward(hidden, weight, targets, g_logp, g_ent, **kw)
        cuts = sorted(torch.randperm(n - 1, generator=torch.Generator().manual_seed(3))[:5].add(1).tolist())
        for got, want in zip(chunked(hidden, weight, targets, g_logp, g_ent, [0, *cuts, n], **kw), whole):
            assert torch.equal(got, want)
        one_row_calls = [0, 1, 2, 3, 4, 5, 6, 7, n - 2, n - 1]  # a row alone, rows shifted by one
        parts = chunked(hidden, weight, targets, g_logp, g_ent, one_row_calls[:8], **kw)
        for got, want in zip(parts, whole):
            assert torch.equal(got, want[:7])
        for got, want in zip(chunked(hidden, weight, targets, g_logp, g_ent, [3, n - 1], **kw), whole):
            assert torch.equal(got, want[3:n - 1])


@pytest.mark.parametrize("triton_path", [False, True], ids=["torch", "interpreter"])
def test_frozen_weight_computes_no_weight_grad(monkeypatch, triton_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("d(weight) computed for a frozen weight")

    hidden, weight, targets = make_inputs(20, 24, 150, torch.bfloat16, seed=1, weight_grad=False)
    monkeypatch.setattr(slp, "_weight_grad_update", forbidden)
    with triton_on_cpu() if triton_path else contextlib.nullcontext():
        logp, entropy = selective_logprob(hidden, weight, targets, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
    assert weight.grad is None and hidden.grad is not None
    # ...and the same spy does fire when the weight is trainable
    weight.requires_grad_()
    logp = selective_logprob(hidden, weight, targets)
    with pytest.raises(AssertionError, match="frozen"):
        logp.sum().backward()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_saved_tensors_are_inputs_plus_per_row_stats(with_entropy):
    # Trainable weight: the recomputing backward's contract.
    n, h, v = 24, 16, 700
    hidden, weight, targets = make_inputs(n, h, v, torch.bfloat16, seed=2)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = selective_logprob(hidden, weight, targets, with_entropy=with_entropy)
    inputs = [t for t in saved if t.data_ptr() in (hidden.data_ptr(), weight.data_ptr(), targets.data_ptr())]
    others = [t for t in saved if t.data_ptr() not in (hidden.data_ptr(), weight.data_ptr(), targets.data_ptr())]
    assert len(inputs) == 3  # by reference, not copies
    assert all(t.numel() < n * v for t in saved)
    extra = sum(t.numel() * t.element_size() for t in others)
    assert extra <= (2 if with_entropy else 1) * n * 4  # lse (+ entropy) fp32 per row
    (out[0] if with_entropy else out).sum().backward()


def test_saved_tensors_with_a_frozen_weight_add_the_gradient_only():
    n, h, v = 24, 16, 700
    hidden, weight, targets = make_inputs(n, h, v, torch.bfloat16, seed=2, weight_grad=False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp = selective_logprob(hidden, weight, targets)
    others = [t for t in saved if t.data_ptr() not in (hidden.data_ptr(), weight.data_ptr(), targets.data_ptr())]
    assert sum(t.numel() * t.element_size() for t in others) <= n * 4 + n * h * 2  # lse + d logp / d hidden
    grad_buffer = max(others, key=torch.Tensor.numel)
    logp.sum().backward()
    assert hidden.grad.data_ptr() == grad_buffer.data_ptr()  # d(hidden) took its memory


def test_gradient_of_entropy_alone_and_of_logp_alone():
    n, h, v = 12, 16, 90
    hidden, weight, targets = make_inputs(n, h, v, torch.float32, seed=5)
    logp, entropy = selective_logprob(hidden, weight, targets, with_entropy=True)
    (d_ent,) = torch.autograd.grad(entropy.sum(), [hidden], retain_graph=True)
    (d_lp,) = torch.autograd.grad(logp.sum(), [hidden])
    h64 = hidden.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, weight.detach(), targets)
    ref_d_ent, ref_d_lp = (torch.autograd.grad(y.sum(), h64, retain_graph=True)[0] for y in (ref_ent, ref_lp))
    torch.testing.assert_close(d_ent.double(), ref_d_ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_lp.double(), ref_d_lp, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# The gradient computed in forward (frozen weight): which backward runs, its precision when
# p_target is near 1, its memory, and that a second backward through it is refused.
# ------------------------------------------------------------------------------------------
def spy_recomputing_backward(monkeypatch):
    calls = []
    for name in ("_backward_torch", "_backward_triton"):
        real = getattr(slp, name)
        monkeypatch.setattr(slp, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("triton_path", [False, True], ids=["torch", "interpreter"])
def test_backward_from_the_forward_gradient_recomputes_nothing(monkeypatch, triton_path):
    calls = spy_recomputing_backward(monkeypatch)
    hidden, weight, targets = make_inputs(20, 24, 150, torch.bfloat16, seed=1, weight_grad=False)
    with triton_on_cpu() if triton_path else contextlib.nullcontext():
        logp, entropy = selective_logprob(hidden, weight, targets, with_entropy=True)
        (logp * 2).sum().backward()  # the entropy gets no gradient
        assert calls == []
        logp, entropy = selective_logprob(hidden, weight, targets, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        assert calls == [1]  # a gradient reaching the entropy needs the logits again
        weight.requires_grad_()
        selective_logprob(hidden, weight, targets).sum().backward()
        assert calls == [1, 1]  # and so does d(weight)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 40), h=st.integers(1, 40), v=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), softcap=st.sampled_from([0.0, 2.0, 30.0]), triton_path=st.booleans())
def test_forward_gradient_matches_reference(n, h, v, dtype, seed, softcap, triton_path):
    # The frozen-weight path alone (the hypothesis tests above mix both backwards).
    with triton_on_cpu() if triton_path else contextlib.nullcontext():
        check_against_reference(n, h, v, dtype, seed, temperature=0.7, logit_scale=1.5, softcap=softcap,
                                with_entropy=False, weight_grad=False, noncontig=seed % 2 == 1)


@pytest.mark.parametrize("triton_path", [False, True], ids=["torch", "interpreter"])
def test_forward_gradient_keeps_precision_when_the_target_is_near_certain(triton_path):
    # p_target = 1 - 1e-3 ... 1 - 1e-13: d logp / d hidden is that small a fraction of |W|. A gradient formed as
    # W_t - E_p[W] would cancel to noise; each row is checked relative to its own size.
    n, h, v = 12, 32, 200
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, h, generator=g) * 0.05
    targets = torch.randint(0, v, (n,), generator=g)
    hidden = (weight[targets] * 400.0 + 0.05 * torch.randn(n, h, generator=g)).requires_grad_()
    with triton_on_cpu() if triton_path else contextlib.nullcontext():
        logp = selective_logprob(hidden, weight, targets)
        (d_hidden,) = torch.autograd.grad(logp.sum(), hidden)
    # Even float64 autograd cancels here (1 - p_t with p_t = 1 - 1e-13): sum_{v != t} p_v (W_t - W_v)
    # has no cancellation.
    z = hidden.detach().double() @ weight.double().t()
    p = torch.softmax(z, dim=1).scatter(1, targets[:, None], 0.0)
    ref = p.sum(1, keepdim=True) * weight.double()[targets] - p @ weight.double()
    assert p.sum(1).max() < 2e-3 and p.sum(1).min() < 1e-12  # near-certain targets indeed
    row_err = (d_hidden.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert row_err.max() < 1e-4, row_err


def test_forward_log_probs_are_bitwise_the_same_with_and_without_gradient():
    hidden, weight, targets = make_inputs(40, 24, 700, torch.bfloat16, seed=3, weight_grad=False)
    for path in (contextlib.nullcontext, triton_on_cpu):
        with path():
            with torch.no_grad():
                plain = selective_logprob(hidden, weight, targets)
            assert torch.equal(selective_logprob(hidden, weight, targets).detach(), plain)


def test_second_backward_through_the_forward_gradient_is_refused():
    hidden, weight, targets = make_inputs(6, 8, 30, torch.float32, seed=3, weight_grad=False)
    loss = selective_logprob(hidden, weight, targets).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_wrapper_accepts_leading_dims_and_sequence_slices():
    b, t, h, v = 3, 9, 16, 50
    full = torch.randn(b, t + 1, h, requires_grad=True)
    hidden = full[:, :-1]  # not viewable as [N, H]
    weight = torch.randn(v, h) * 0.3
    targets = torch.randint(0, v, (b, t))
    logp, entropy = selective_logprob(hidden, weight, targets, temperature=0.9, with_entropy=True)
    assert logp.shape == (b, t) and entropy.shape == (b, t)
    ref_lp, ref_ent = reference(hidden.detach(), weight, targets, temperature=0.9)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=1e-5, atol=1e-5)
    logp.sum().backward()
    assert full.grad.shape == full.shape and torch.all(full.grad[:, -1] == 0)
    assert selective_logprob(hidden.detach(), weight, targets).shape == (b, t)


def test_empty_entropy_and_zero_rows():
    hidden, weight, targets = make_inputs(5, 8, 20, torch.float32, seed=0)
    logp, entropy = torch.ops.fastgrpo.selective_logprob(hidden, weight, targets, 1.0, 1.0, 0.0, False)
    assert logp.shape == (5,) and entropy.shape == (0,) and entropy.dtype == torch.float32
    empty = torch.ops.fastgrpo.selective_logprob(hidden[:0], weight, targets[:0], 1.0, 1.0, 0.0, True)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def opcheck_cases():
    for noncontig in (False, True):
        for with_entropy in (False, True):
            hidden, weight, targets = make_inputs(9, 12, 70, torch.float32, seed=4, noncontig=noncontig)
            yield hidden, weight, targets, 0.8, 1.5, 10.0 if with_entropy else 0.0, with_entropy


@pytest.mark.parametrize("case", list(range(4)))
def test_opcheck(case):
    args = list(opcheck_cases())[case]
    for grad_from_forward in (False, True):
        torch.library.opcheck(torch.ops.fastgrpo.selective_logprob_fwd.default, (*args, grad_from_forward))
    torch.library.opcheck(torch.ops.fastgrpo.selective_logprob.default, args)
    hidden, weight, targets, temperature, logit_scale, softcap, with_entropy = args
    with torch.no_grad():
        logp, entropy, lse, grad = torch.ops.fastgrpo.selective_logprob_fwd(*args, True)
    torch.library.opcheck(torch.ops.fastgrpo.selective_logprob_scale_grad_.default, (grad, torch.randn(18)[::2]))
    grad_logp = torch.randn(18)[::2]  # gradients often arrive non-contiguous
    grad_ent = torch.randn(9) if with_entropy else torch.empty(0)
    for weight_grad in (False, True):
        torch.library.opcheck(
            torch.ops.fastgrpo.selective_logprob_bwd.default,
            (grad_logp, grad_ent, hidden.detach(), weight.detach(), targets, lse, entropy,
             temperature, logit_scale, softcap, weight_grad),
        )


def test_opcheck_triton_interpreter():
    hidden, weight, targets = make_inputs(9, 12, 70, torch.bfloat16, seed=4, noncontig=True)
    with triton_on_cpu():
        torch.library.opcheck(
            torch.ops.fastgrpo.selective_logprob_fwd.default, (hidden, weight, targets, 0.8, 1.0, 5.0, True, True),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


def test_clear_errors():
    hidden, weight, targets = make_inputs(4, 8, 10, torch.float32, seed=0)
    with pytest.raises(TypeError, match="int64"):
        selective_logprob(hidden, weight, targets.int())
    with pytest.raises(ValueError, match="hidden size mismatch"):
        selective_logprob(hidden, torch.randn(10, 9), targets)
    with pytest.raises(TypeError, match="weight dtype"):
        selective_logprob(hidden, weight.bfloat16(), targets)
    with pytest.raises(TypeError, match="supports float32, float16 and bfloat16"):
        selective_logprob(hidden.double(), weight.double(), targets)
    with pytest.raises(ValueError, match="targets shape"):
        selective_logprob(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature > 0"):
        selective_logprob(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        selective_logprob(hidden, weight, targets, softcap=-1.0)


@pytest.mark.parametrize("weight_grad", [True, False], ids=["recomputing", "grad_from_forward"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_as_single_nodes(weight_grad, backend):
    hidden, weight, targets = make_inputs(6, 8, 40, torch.float32, seed=9, weight_grad=weight_grad)
    wrt = [hidden, weight] if weight_grad else [hidden]

    def f(hidden, weight, targets):
        logp, entropy = selective_logprob(hidden, weight, targets, temperature=0.7, with_entropy=True)
        return (logp * 2).sum() + (entropy.mean() if weight_grad else 0.0)

    eager = torch.autograd.grad(f(hidden, weight, targets), wrt)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    got = torch.autograd.grad(compiled(hidden, weight, targets), wrt)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------
# CUDA (run on the GPU machine): the real Triton kernels + cuBLAS, several vocab splits,
# several backward row chunks and vocab chunks.
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,with_entropy", [(0.0, False), (30.0, True)])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["trainable", "frozen"])
def test_gpu_matches_reference(dtype, softcap, with_entropy, weight_grad):
    # frozen + no entropy: the gradient computed in forward; the other cases recompute the logits
    n, h, v = 2500, 256, 20011
    hidden, weight, targets = make_inputs(n, h, v, dtype, seed=11, noncontig=True, device="cuda",
                                          weight_grad=weight_grad)
    g_logp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    kw = dict(temperature=0.7, logit_scale=1.5, softcap=softcap)
    logp, entropy, d_hidden, d_weight = run_and_grad(hidden, weight, targets, g_logp, g_ent, with_entropy, **kw)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, **kw)
    loss = (ref_lp * g_logp.double()).sum() + ((ref_ent * g_ent.double()).sum() if with_entropy else 0)
    ref_dh, ref_dw = torch.autograd.grad(loss, [h64, w64])
    torch.testing.assert_close(logp.double(), ref_lp, rtol=2e-5, atol=5e-5)
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_ent, rtol=2e-5, atol=5e-5)
    assert_grad_close(d_hidden, ref_dh, dtype)
    if weight_grad:
        assert_grad_close(d_weight, ref_dw, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["recomputing", "grad_from_forward"])
def test_gpu_chunk_invariance_is_bitwise(dtype, entropy_grad):
    n, h, v = 4500, 128, 20011
    hidden, weight, targets = make_inputs(n, h, v, dtype, seed=12, weight_grad=False, device="cuda")
    g_logp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda") if entropy_grad else None
    kw = dict(temperature=0.8)
    whole = forward_backward(hidden, weight, targets, g_logp, g_ent, **kw)
    for bounds in ([0, 1, 129, 1000, 2049, 4096, 4499, n], [0, 777, n]):
        for got, want in zip(chunked(hidden, weight, targets, g_logp, g_ent, bounds, **kw), whole):
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_frozen_weight_and_memory():
    n, h, v = 8192, 1024, 65536
    hidden, weight, targets = make_inputs(n, h, v, torch.bfloat16, seed=13, weight_grad=False, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp = selective_logprob(hidden, weight, targets)
    logp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - hidden.grad.numel() * 2
    assert weight.grad is None
    assert extra <= 64 * 2**20, f"{extra / 2**20:.1f} MiB beyond inputs and outputs"
