"""fastgrpo::race_sample: its log-probs against a float64 log-softmax over random shapes, dtypes, strides, splits and
temperatures; its draws against the softmax's probabilities; seeds; compiled and captured calls."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.race_sample import _triton_race, race_sample, reference_race_sample

TOLERANCE = 1e-4  # fp32 maths on the (rounded) logits in every dtype


def expected_logprobs(logits, tokens, temperature):
    scaled = logits.double() / temperature
    return (scaled.gather(-1, tokens[:, None].long())[:, 0] - scaled.logsumexp(-1)).float()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), vocab=st.integers(1, 700),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), strided=st.booleans(),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 2.0]), splits=st.integers(1, 5))
def test_logprobs_match_the_log_softmax_of_the_chosen_tokens(seed, rows, vocab, dtype, strided, temperature, splits):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, vocab * 2 if strided else vocab, generator=g) * 4).to(dtype)
    logits = full[:, :vocab]  # a row stride larger than the vocabulary
    with triton_on_cpu():  # blocks of 64 columns: several a split
        tokens, logprobs = _triton_race(logits, torch.tensor([seed]), temperature, splits=splits, block=64)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert ((tokens >= 0) & (tokens < vocab)).all()
    torch.testing.assert_close(logprobs, expected_logprobs(logits, tokens, temperature), rtol=0, atol=TOLERANCE)


def frequencies(logits, temperature, seeds, **options):
    counts = torch.zeros(logits.shape[1])
    for seed in seeds:
        with triton_on_cpu():
            tokens, _ = _triton_race(logits, torch.tensor([seed]), temperature, **options)
        counts += torch.bincount(tokens, minlength=logits.shape[1]).float()
    return counts / counts.sum()


@pytest.mark.parametrize("temperature, rows, options", [(1.0, 256, {}), (0.6, 128, dict(splits=3, block=4))])
def test_draws_follow_the_softmax(temperature, rows, options):
    # rows x 3 seeds draws over 10 tokens (in 3 splits of blocks of 4 tokens in the second case): each frequency within
    # 4.5 standard deviations of its probability.
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0, 0.2, 0.9])
    logits = base.expand(rows, -1).contiguous()
    probs = (base / temperature).softmax(-1)
    seen = frequencies(logits, temperature, seeds=range(3), **options)
    draws = 3 * rows
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert ((seen - probs).abs() <= 4.5 * sigma + 1e-3).all(), (seen, probs)


def test_a_seed_repeats_its_draws_and_another_seed_draws_others():
    logits = torch.zeros(64, 50)
    with triton_on_cpu():
        first = race_sample(logits, torch.tensor([7]), 1.0)[0]
        again = race_sample(logits, torch.tensor([7]), 1.0)[0]
        other = race_sample(logits, torch.tensor([8]), 1.0)[0]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_a_dominant_token_is_always_drawn_and_masked_ones_never():
    logits = torch.full((32, 300), -float("inf"))
    logits[:, 5], logits[:, 250] = 0.0, -40.0  # 250 has probability e^-40
    with triton_on_cpu():
        tokens, logprobs = _triton_race(logits, torch.tensor([3]), 1.0, splits=4)
    assert (tokens == 5).all()
    torch.testing.assert_close(logprobs, torch.zeros(32), atol=1e-6, rtol=0)


def test_the_torch_path_draws_from_the_same_distribution():
    base = torch.tensor([1.0, 0.0, -1.0, 2.0])
    logits = base.expand(4096, -1).contiguous()
    tokens, logprobs = reference_race_sample(logits, torch.tensor([11]), 1.0)
    seen = torch.bincount(tokens, minlength=4).float() / 4096
    probs = base.softmax(-1)
    assert ((seen - probs).abs() <= 4.5 * (probs * (1 - probs) / 4096).sqrt()).all()
    torch.testing.assert_close(logprobs, expected_logprobs(logits, tokens, 1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad, message", [
    (dict(logits=torch.zeros(2, 3, 4)), r"\[rows, vocab\]"), (dict(temperature=0.0), "temperature > 0"),
    (dict(seed=torch.tensor([1.5])), "int32/int64"),
])
def test_bad_calls_are_refused(bad, message):
    call = dict(logits=torch.zeros(2, 8), seed=torch.tensor([1]), temperature=1.0) | bad
    with pytest.raises(ValueError, match=message):
        race_sample(**call)


def test_compiles_without_a_graph_break():
    logits = torch.randn(6, 40)
    seed = torch.tensor([5])

    def sample(x, s):
        return race_sample(x * 1.0, s, 0.8)

    torch._dynamo.reset()
    compiled = torch.compile(sample, backend="aot_eager", fullgraph=True)
    tokens, logprobs = compiled(logits, seed)
    torch.testing.assert_close(logprobs, expected_logprobs(logits, tokens, 0.8), atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_gpu_captured_replays_draw_new_tokens_from_a_seed_refilled_in_the_graph():
    logits = torch.zeros(256, 151_936, device="cuda", dtype=torch.bfloat16)
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")

    def step():
        seed.copy_(torch.randint(0, 2**31 - 1, (1,), device="cuda"))
        return race_sample(logits, seed, 1.0)

    step()  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = step()
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(tokens.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(151_936)), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_draws_follow_the_softmax_on_a_real_vocabulary(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(151_936, generator=g) * 3
    logits = base.to("cuda", dtype).expand(4096, -1).contiguous()
    probs = (logits[0].double() / 0.9).softmax(-1).cpu()
    tokens, logprobs = race_sample(logits, torch.tensor([1], device="cuda"), 0.9)
    torch.testing.assert_close(logprobs, expected_logprobs(logits, tokens, 0.9), atol=TOLERANCE, rtol=0)
    top = probs.topk(5).indices
    seen = torch.bincount(tokens.cpu(), minlength=151_936).double() / 4096
    sigma = (probs[top] * (1 - probs[top]) / 4096).sqrt()
    assert ((seen[top] - probs[top]).abs() <= 4.5 * sigma + 1e-3).all()
