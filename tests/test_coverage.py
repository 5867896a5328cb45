"""Breadth of the backend: a broad sample of architectures with no graph break and every site
matched, dynamic sequence lengths without recompiles, and the inputs the ops cannot take
(float64, very wide norms, empty tensors) left to the fallback path and reported, not failed.

The architecture sample reuses bench/coverage.py (the full sweep over every causal LM of the
installed transformers, which writes docs/SUPPORT.md)."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fastgrpo
from bench.coverage import measure
from fastgrpo.compiler.report import GraphBreakLog, fusion_summary, is_data_dependent_break
from fastgrpo.kernels.rms_norm import MAX_HIDDEN_SIZE
from tests.tiny_models import (
    VOCAB, assert_compiled_matches_eager, assert_grads_close, count_modules, eager_then_compiled_model, grads, tiny_model,
)

PATTERNS = ("rms_norm", "rope", "gated_mlp", "selective_logprob")


def _records(name):
    return [r["patterns"][name] for r in fastgrpo.fusion_reports()]


# One of each family of writing: q/k norms, sandwich norms and soft-capping, fused gate_up and
# partial rotary, cast-after-multiply, MoE experts (plain, with a shared expert, with group
# routing and multi-head latent attention with even/odd RoPE), complex-number RoPE and L2 norms,
# linear attention with gated norms, LayerNorm with interleaved RoPE, sign-flipped RoPE followed
# by q/k norms, casts inside the norm and the rotation (DeepSeek-V4), sliding layers with RoPE beside global
# layers without it (Cohere2: a NoPE layer is no RoPE site).
SAMPLE = ["qwen3", "gemma2", "phi3", "olmo2", "mixtral", "qwen2_moe", "deepseek_v3", "llama4", "qwen3_next", "cohere",
          "nanochat", "deepseek_v4", "cohere2"]


def _assert_one_graph_every_site_matched(result):
    """A coverage result with status "full": one graph, no break, every site matched, no near miss, equal to eager."""
    assert result["graph_breaks"] == {}, result["graph_breaks"]
    assert result["graphs"] == 1
    for name in PATTERNS:
        rec, want = result["patterns"][name], result["expected"][name]
        assert rec["matched"] >= want, f"{name}: {rec['matched']} of {want} sites matched; {rec}"
        assert not rec["near_misses"], f"{name}: {rec['near_misses']}"
    assert result["equal"], f"output error {result['output_error']:.2e}, gradient error {result['grad_error']:.2e}"
    assert result["status"] == "full"


@pytest.mark.parametrize("arch", SAMPLE)
def test_no_graph_break_and_every_site_matched(arch):
    result = measure(arch, inner="eager", seq_len=8)
    assert result["status"] not in ("skipped", "error"), result.get("reason")
    _assert_one_graph_every_site_matched(result)


def test_data_dependent_moe_routing_is_one_graph_with_dynamos_capture_flags():
    """JetMoE routes tokens by .item() on routing tensors: without Dynamo's capture flags the graph breaks there
    and the fusion summary names the flags; under them (what the sweep measures next) it is one graph, every site
    matched, equal to eager."""
    result = measure("jetmoe", inner="eager", seq_len=8)
    without = result["capture_flags"]["without"]
    assert without["status"] == "incomplete" and without["graphs"] > 1, without
    assert any(is_data_dependent_break(reason) for reason in without["graph_breaks"]), without["graph_breaks"]
    _, problems = fusion_summary([], without["graph_breaks"])
    fix = "torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)"
    assert fix in problems[-1], problems

    _assert_one_graph_every_site_matched(result)


def test_python_loop_over_routed_experts_falls_back_to_eager_correctly_and_says_why():
    """LongCat-Flash loops in Python over the experts that got tokens (`for idx in expert_hit`): a loop of
    data-dependent length, which Dynamo cannot trace even with its capture flags. The explained fallback: the
    break is named with its source line, the layers around it are still compiled and matched graph by graph
    (RMSNorm, RoPE), and the result equals eager."""
    result = measure("longcat_flash", inner="eager", seq_len=8)
    assert "without" in result["capture_flags"], result.get("capture_flags")
    assert result["status"] == "incomplete" and result["graphs"] > 1
    reasons = " ".join(result["graph_breaks"])
    assert "data-dependent expression" in reasons and "for expert_idx_tensor in expert_hit" in reasons, reasons
    for name in ("rms_norm", "rope"):
        assert result["patterns"][name]["matched"] == result["expected"][name] > 0, result["patterns"][name]
    assert result["equal"], f"output error {result['output_error']:.2e}, gradient error {result['grad_error']:.2e}"


def _doubles_and_logs(x):
    for _ in range(2):
        x = x * 2
        logging.getLogger("fastgrpo.tests").debug("%s", x.sum().item())  # a graph break inside a loop
    return x + 1


def test_graph_break_in_a_loop_is_named_although_dynamo_counts_none():
    """A break inside a loop makes Dynamo skip the whole frame, which its graph-break counter does not record;
    the log that the trainer's first-step summary and `fastgrpo report` read names it."""
    torch._dynamo.reset()
    counters.clear()
    with GraphBreakLog() as log:
        out = torch.compile(_doubles_and_logs, backend="fastgrpo", options={"inner": "eager"})(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 5.0))
    assert not counters["graph_break"]
    reasons = " ".join(log.result())
    assert "graph break in loop" in reasons and "frame skipped: _doubles_and_logs" in reasons, reasons
    _, problems = fusion_summary([], log.result())
    assert problems and "graph break" in problems[0]
    assert all(handler is not log for name in logging.Logger.manager.loggerDict
               for handler in getattr(logging.getLogger(name), "handlers", []))  # stopped: detached everywhere


def test_only_data_dependent_graph_breaks_get_the_capture_flags_fix():
    data_dependent = ("Dynamic shape operator\n  Explanation: Operator `aten.nonzero.default`'s output shape depends on "
                      "input Tensor data.\n  Hint: Enable tracing of dynamic shape operators with "
                      "`torch._dynamo.config.capture_dynamic_output_shape_ops = True`")
    other = "Missing tp_iternext\n  Explanation: Dynamo does not support next() on dict_keyiterator."
    _, problems = fusion_summary([], {other: 1})
    assert problems == [f"1x graph break (the code around it runs uncompiled): {other}"]
    _, problems = fusion_summary([], {other: 1, data_dependent: 3})
    assert problems[1].startswith("3x graph break") and "capture_dynamic_output_shape_ops=True" in problems[-1]
    assert len(problems) == 3


def test_unsupported_activation_is_explained_and_rope_halves_matched():
    """GPT-OSS: RoPE written on the two halves is matched; its clamped swish with slope 1.702 is
    not an activation the gated-MLP op has, and each expert bank says so."""
    result = measure("gpt_oss", inner="eager", seq_len=8)
    assert result["status"] == "explained", result
    rope = result["patterns"]["rope"]
    assert rope["matched"] == result["expected"]["rope"] and "halves rotated as written" in str(rope["forms"])
    mlp = result["patterns"]["gated_mlp"]
    assert len(mlp["near_misses"]) == result["expected"]["gated_mlp"]
    assert all("swish with slope 1.702" in m["reason"] for m in mlp["near_misses"])


def test_varying_prompt_and_completion_lengths_compile_at_most_twice():
    """A GRPO step over 20 batches of different prompt + completion lengths: the first shape
    compiles, the second recompiles with a dynamic sequence length, the rest reuse it."""
    model = tiny_model("qwen3", lora=True)

    def policy_loss(input_ids, completion_mask, advantages):
        logits = model(input_ids=input_ids, use_cache=False).logits
        logits = logits[:, :-1, :].float()  # as TRL does: position t predicts token t + 1
        logps = logits.log_softmax(-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        mask = completion_mask[:, 1:]
        return (logps * advantages[:, None] * mask).sum() / mask.sum()

    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(policy_loss, backend="fastgrpo", options={"inner": "eager"})
    generator = torch.Generator().manual_seed(0)
    for step in range(20):
        prompt, completion = (int(n) for n in torch.randint(3, 16, (2,), generator=generator))
        ids = torch.randint(3, VOCAB, (2, prompt + completion), generator=generator)
        mask = (torch.arange(prompt + completion) >= prompt).float().expand(2, -1)
        advantages = torch.randn(2, generator=generator)
        compiled(ids, mask, advantages).backward()
    reports = fastgrpo.fusion_reports()
    assert len(reports) <= 2, f"{len(reports)} compiles"
    assert counters["stats"]["unique_graphs"] <= 2
    assert not counters["graph_break"]
    layers = model.config.num_hidden_layers
    for report in reports:  # the dynamic-shape graph still has every site
        matched = {name: rec["matched"] for name, rec in report["patterns"].items()}
        assert matched == {"selective_logprob": 1, "rms_norm": count_modules(model, "RMSNorm"),
                           "rope": layers, "gated_mlp": layers, "attention": 0,  # CPU: SDPA's own kernel
                           "joined_projections": 0}, matched  # CPU: joined on CUDA only
    # The last step, compiled and eager, gives the same loss and gradients.
    model.zero_grad()
    loss = compiled(ids, mask, advantages)
    loss.backward()
    actual_grads = grads(model)
    model.zero_grad()
    expected = policy_loss(ids, mask, advantages)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads(model), actual_grads, rel=1e-4)


def test_float64_model_runs_eagerly_and_every_site_says_why():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 9))

    def logps(input_ids):
        logits = model(input_ids=input_ids, use_cache=False).logits
        return logits.log_softmax(-1).gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)

    expected, expected_grads, actual, actual_grads = eager_then_compiled_model(
        model, logps, {"input_ids": ids}, loss=lambda out: out.sum())
    layers = model.config.num_hidden_layers
    for name, sites in (("rms_norm", count_modules(model, "RMSNorm")), ("rope", layers), ("gated_mlp", layers),
                        ("selective_logprob", 1)):
        (rec,) = _records(name)
        assert rec["matched"] == 0, rec
        # one near miss per site (RoPE: per attention module; q and k are each reported)
        assert len({m["site"] for m in rec["near_misses"]}) == sites, rec
        assert all("float64" in m["reason"] for m in rec["near_misses"]), rec
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert_grads_close(expected_grads, actual_grads, rel=1e-10)


def test_norm_wider_than_the_kernel_is_a_near_miss_at_compile_time():
    hidden = MAX_HIDDEN_SIZE + 1
    weight = torch.randn(hidden, requires_grad=True)

    def norm(x):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    assert_compiled_matches_eager(norm, torch.randn(2, hidden, requires_grad=True))
    (rec,) = _records("rms_norm")
    assert rec["matched"] == 0
    assert f"hidden size {hidden} exceeds {MAX_HIDDEN_SIZE}" in rec["near_misses"][0]["reason"]


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _block(x, norm_w, w_qk, cos, sin, w_gate, w_up):
    """An RMSNorm, RoPE on q and k and a SwiGLU, every input a strided view of a larger tensor."""
    xf = x.float()
    h = norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    qk = F.linear(h, w_qk).view(*h.shape[:-1], 2, 2, 8).transpose(1, 3)  # [B, heads, 2, S, D]
    q, k = qk[:, :, 0], qk[:, :, 1]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    mlp = F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)
    return q.sum() + k.sum() + mlp.sum()


def _block_inputs(batch):
    torch.manual_seed(0)
    x = torch.randn(batch, 16, 5, requires_grad=True).transpose(1, 2)  # [B, 5, 16], last-dim stride 5
    x.retain_grad()
    angles = torch.randn(1, 1, 5, 4)
    cos, sin = angles.cos().repeat(1, 1, 1, 2), angles.sin().repeat(1, 1, 1, 2)
    return (x, torch.randn(16, requires_grad=True), torch.randn(32, 16, requires_grad=True), cos, sin,
            torch.randn(24, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True))


def test_non_contiguous_inputs_are_matched_and_exact():
    inputs = _block_inputs(batch=3)
    assert not inputs[0].is_contiguous()
    assert_compiled_matches_eager(_block, *inputs)
    for name in ("rms_norm", "rope", "gated_mlp"):
        (rec,) = _records(name)
        assert rec["matched"] == 1 and not rec["near_misses"], (name, rec)


def test_zero_size_inputs_fall_back_and_are_reported():
    inputs = _block_inputs(batch=0)
    assert_compiled_matches_eager(_block, *inputs)
    for name in ("rms_norm", "rope", "gated_mlp"):
        (rec,) = _records(name)
        assert rec["matched"] == 0, (name, rec)
        assert rec["near_misses"] and all("zero-size" in m["reason"] for m in rec["near_misses"]), (name, rec)
