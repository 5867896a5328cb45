"""The lm-head log-prob pass: hand-written GRPO log-prob code and real model heads."""
import pytest
import torch
import torch.nn.functional as F

import fastgrpo
from tests.tiny_models import (
    VOCAB, assert_compiled_matches_eager, assert_grads_close, eager_then_compiled_model, tiny_model,
)

H, V = 32, 77


def _records():
    return [r["patterns"]["selective_logprob"] for r in fastgrpo.fusion_reports()]


def _compare(fn, *inputs, expect_matched=1):
    """fn compiled vs eager: outputs and the grads of every input that requires grad."""
    assert_compiled_matches_eager(fn, *inputs)
    assert sum(r["matched"] for r in _records()) == expect_matched, fastgrpo.format_reports(fastgrpo.fusion_reports())


def _inputs(weight_grad=True):
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, H, requires_grad=True)
    weight = (torch.randn(V, H) / H**0.5).requires_grad_(weight_grad)
    targets = torch.randint(0, V, (2, 6))
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_softmax_gather(temperature):
    def logps(h, w, t):
        logits = F.linear(h, w).float() / temperature
        return logits.log_softmax(-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    _compare(logps, *_inputs())


def test_softcap_and_logit_scale():
    def logps(h, w, t):
        logits = F.linear(h, w) * 0.5
        logits = torch.tanh(logits / 3.0) * 3.0
        return torch.log_softmax(logits / 0.9, dim=-1).gather(2, t[..., None]).squeeze(-1)

    _compare(logps, *_inputs(weight_grad=False))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy(reduction):
    def loss(h, w, t):
        logits = F.linear(h, w)
        t = t.clone()
        t[0, :2] = -100
        return F.cross_entropy(logits.view(-1, V), t.view(-1), reduction=reduction)

    _compare(loss, *_inputs())


def test_gather_minus_logsumexp():
    def logps(h, w, t):
        logits = F.linear(h, w).float()
        picked = torch.gather(logits, -1, t.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    _compare(logps, *_inputs())


def test_logits_returned_to_the_caller_is_a_reported_near_miss():
    def both(h, w, t):
        logits = F.linear(h, w)
        return logits, logits.log_softmax(-1).gather(-1, t.unsqueeze(-1))

    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    logits, lp = torch.compile(both, backend="fastgrpo", options={"inner": "eager"})(*_inputs())
    record = _records()[0]
    assert record["matched"] == 0
    assert "used elsewhere" in record["near_misses"][0]["reason"]
    torch.testing.assert_close(lp, both(*_inputs())[1])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_model_head_in_a_grpo_logprob_function(arch):
    model = tiny_model(arch, lora=True)
    ids = torch.randint(3, VOCAB, (2, 9))

    def completion_logps(input_ids):
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
        return logits.log_softmax(-1).gather(-1, input_ids.roll(-1, 1).unsqueeze(-1)).squeeze(-1)

    expected, expected_grads, actual, actual_grads = eager_then_compiled_model(
        model, completion_logps, {"input_ids": ids}, loss=lambda out: out.sum())
    assert sum(r["matched"] for r in _records()) == 1
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)
