"""fastgrpo.kernels.lora_merge against a float64 reference, and its exact undo, on the Triton path (the interpreter
on CPU, the GPU where marked) and the torch path."""
import contextlib

import peft
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.integrations.generation.four_bit import lora_factors
from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.lora_merge import STATS, lora_merge_, lora_merge_factors, lora_merge_into, lora_merge_plan, \
    lora_merge_restored, lora_unmerge_

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}  # relative, one rounding
SPACING = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}  # subnormal steps


PATHS = (contextlib.nullcontext, triton_on_cpu)  # the torch path, the kernel in the interpreter


def awkward_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with the undo's hard cases: zeros (any delta misses there), values just below a power of two,
    a signed zero, a NaN and an infinity."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    flat = w.view(-1)
    m = flat.numel()
    flat[torch.randperm(m, generator=g)[: m // 8]] = 0.0
    below = torch.randperm(m, generator=g)[: m // 8]
    flat[below] = 2.0 ** torch.randint(-6, 2, (below.numel(),), generator=g).float() * (1 - 2.0 ** -7)
    flat[0] = -0.0
    if m > 2:
        flat[1] = float("nan")
        flat[2] = float("inf")
    return w.to(dtype)


def merge_and_undo(weight, a, b):
    """Plan, merge in place, undo, put the kept values back: what MergedAdapters does a call."""
    stats = torch.zeros(STATS, dtype=torch.int64, device=weight.device)
    lora_merge_plan(weight, a, b, stats)
    count = int(stats[0])
    fix_index = torch.empty(count, dtype=torch.int64, device=weight.device)
    fix_value = torch.empty(count, dtype=weight.dtype, device=weight.device)
    lora_merge_(weight, a, b, stats, fix_index, fix_value)
    merged = weight.clone()
    lora_unmerge_(weight, a, b, stats)
    assert bool(lora_merge_restored(weight, stats, fix_index, fix_value))
    return merged, stats


def check_merged(merged, original, a, b):
    """Within one rounding (plus the fp32 delta's own error) of round(W + b @ a) computed in float64."""
    exact = original.double() + b.double() @ a.double()
    finite = original.isfinite()
    err = (merged.double() - exact).abs()[finite]
    bound = (exact.abs() * ULP[original.dtype] + (b.double().abs() @ a.double().abs()) * 2.0 ** -18
             + SPACING[original.dtype])[finite]
    assert bool((err <= bound).all()), float((err / bound).max())
    assert torch.equal(merged.isnan(), original.isnan())


shapes = st.tuples(st.integers(1, 70), st.integers(1, 90), st.integers(1, 20),
                   st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), st.integers(0, 2 ** 16),
                   st.sampled_from([0.5, 2.0, 1 / 16]))


def case_factors(case):
    """(n, k, dtype, seed, a, b) of a drawn case."""
    n, k, r, dtype, seed, scaling = case
    torch.manual_seed(seed)
    return n, k, dtype, seed, *lora_merge_factors(torch.randn(r, k), torch.randn(n, r) * 0.1, scaling)


@settings(max_examples=20, deadline=None)
@given(shapes)
def test_an_in_place_merge_is_right_and_undoes_to_the_exact_bits(case):
    n, k, dtype, seed, a, b = case_factors(case)
    for path in PATHS:
        weight = awkward_weight(n, k, dtype, seed)
        original = weight.clone()
        with path():
            merged, stats = merge_and_undo(weight, a, b)
        check_merged(merged, original, a, b)
        assert torch.equal(weight.view(BITS[dtype]), original.view(BITS[dtype]))
        planned, planned_sum, recorded, undone_sum, _ = stats.tolist()
        assert planned == recorded and planned_sum == undone_sum


@settings(max_examples=10, deadline=None)
@given(shapes)
def test_a_merged_copy_matches_the_in_place_merge(case):
    """lora_merge_into writes the in-place merge's values into rows of a larger buffer (a joined q/k/v weight);
    rows outside are untouched and the source weight is not written."""
    n, k, dtype, seed, a, b = case_factors(case)
    for path in PATHS:
        weight = awkward_weight(n, k, dtype, seed)
        original = weight.clone()
        buffer = torch.full((n + 5, k), 7.0, dtype=dtype)
        with path():
            lora_merge_into(buffer[3:3 + n], weight, a, b)
            in_place, _ = merge_and_undo(weight.clone(), a, b)
        assert torch.equal(weight.view(BITS[dtype]), original.view(BITS[dtype]))
        assert torch.equal(buffer[3:3 + n].view(BITS[dtype]), in_place.view(BITS[dtype]))
        assert bool((buffer[:3] == 7).all()) and bool((buffer[3 + n:] == 7).all())


def test_several_adapters_sum_with_their_scalings():
    """A PEFT layer's two active adapters (one fp32, one bf16), joined by `lora_factors`: the merged weight is the
    base plus each adapter's scaling * B @ A (in fp32: PEFT's `get_delta_weight` rounds a bf16 adapter's delta)."""
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(40, 24, bias=False)), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False))
    model.add_adapter("second", peft.LoraConfig(r=8, lora_alpha=2, target_modules=["0"], init_lora_weights=False))
    layer = model.base_model.model[0]
    layer.lora_A["second"].bfloat16()
    layer.lora_B["second"].bfloat16()
    layer.set_adapter(["default", "second"])
    weight = layer.base_layer.weight.detach()
    names = ("default", "second")
    expected = weight + sum(layer.scaling[n] * (layer.lora_B[n].weight.float() @ layer.lora_A[n].weight.float())
                            for n in names)
    a, b = lora_merge_factors(*lora_factors(layer))
    assert a.shape[0] == 12
    for path in PATHS:
        out = torch.empty_like(weight)
        with path():
            lora_merge_into(out, weight, a, b)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_undo_with_another_delta_or_wrong_kept_values_is_seen():
    """The check MergedAdapters makes: a delta that differs at the undo, or a kept value that is not the original,
    leaves the weight's bit sum apart from the original's."""
    torch.manual_seed(1)
    a, b = lora_merge_factors(torch.randn(4, 64), torch.randn(32, 4) * 0.1, 1.0)
    for path in PATHS:
        weight = awkward_weight(32, 64, torch.bfloat16, 3)
        stats = torch.zeros(STATS, dtype=torch.int64)
        with path():
            lora_merge_plan(weight, a, b, stats)
            count = int(stats[0])
            fixes = torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.bfloat16)
            lora_merge_(weight, a, b, stats, *fixes)
            lora_unmerge_(weight, a, b * (1 + 2.0 ** -10), stats)
            assert stats[3] != stats[1] and not lora_merge_restored(weight, stats, *fixes)
        weight = awkward_weight(32, 64, torch.bfloat16, 3)  # the right delta, one kept value changed by its last bit
        with path():
            stats = torch.zeros(STATS, dtype=torch.int64)
            lora_merge_plan(weight, a, b, stats)
            count = int(stats[0])
            fixes = torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.bfloat16)
            lora_merge_(weight, a, b, stats, *fixes)
            lora_unmerge_(weight, a, b, stats)
            fixes[1].view(torch.int16)[0] ^= 1
            assert not lora_merge_restored(weight, stats, *fixes)


def test_too_small_a_fix_buffer_records_what_fits_and_counts_all():
    torch.manual_seed(2)
    a, b = lora_merge_factors(torch.randn(4, 64), torch.randn(32, 4), 1.0)
    for path in PATHS:
        weight = torch.zeros(32, 64, dtype=torch.bfloat16)  # every element misses
        stats = torch.zeros(STATS, dtype=torch.int64)
        fix_index, fix_value = torch.full((5,), -1, dtype=torch.int64), torch.zeros(5, dtype=torch.bfloat16)
        with path():
            lora_merge_(weight, a, b, stats, fix_index, fix_value)
        assert int(stats[2]) == 32 * 64 and bool((fix_index >= 0).all()) and fix_index.unique().numel() == 5


@pytest.mark.parametrize("bad,match", [
    (lambda w, a, b: (w.double(), a, b), "bf16, fp16 or fp32"),
    (lambda w, a, b: (w, a.bfloat16(), b), "fp32"),
    (lambda w, a, b: (w, a[:, :-1], b), "do not factor"),
    (lambda w, a, b: (w.t(), a, b), "do not factor"),
    (lambda w, a, b: (w[:, ::2], a[:, ::2].contiguous(), b), "contiguous"),
])
def test_bad_input_is_refused_naming_the_fix(bad, match):
    torch.manual_seed(0)
    weight = torch.randn(8, 16)
    a, b = lora_merge_factors(torch.randn(2, 16), torch.randn(8, 2), 1.0)
    with pytest.raises(ValueError, match=match):
        lora_merge_plan(*bad(weight, a, b), torch.zeros(STATS, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_at_a_projection_size(dtype):
    """A 4096 x 14336 projection (an 8B model's down projection): right, undone exactly, the copy equal to it."""
    torch.manual_seed(0)
    n, k = 4096, 14336
    a, b = lora_merge_factors(torch.randn(16, k, device="cuda") * 0.02, torch.randn(n, 16, device="cuda") * 0.02, 2.0)
    weight = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    weight.view(-1)[: n * k // 16] = 0.0
    original = weight.clone()
    merged, stats = merge_and_undo(weight, a, b)
    assert torch.equal(weight.view(BITS[dtype]), original.view(BITS[dtype]))
    assert stats[0] == stats[2] and stats[1] == stats[3] and int(stats[0]) > 0
    copy = torch.empty_like(weight)
    lora_merge_into(copy, original, a, b)
    assert torch.equal(copy.view(BITS[dtype]), merged.view(BITS[dtype]))
    rows = slice(0, 256)  # the float64 reference on a slice (the whole product would be 470 MB of float64)
    check_merged(merged[rows].cpu(), original[rows].cpu(), a.cpu(), b[rows].cpu())
