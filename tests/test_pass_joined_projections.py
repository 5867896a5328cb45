"""Joined projections: linears of one input in one GEMM, on the architecture matrix, and where they must not be."""
import pytest
import torch

import fastgrpo
from tests.tiny_models import ARCHS, VOCAB, assert_grads_close, eager_then_compiled_model, tiny_model


def _joined_records():
    return [r["patterns"]["joined_projections"] for r in fastgrpo.fusion_reports()]


JOIN = {"join_projections": True}  # on CPU graphs too (by default the pass joins on CUDA graphs only)


def _logits_loss(model, ids, options=None):
    return eager_then_compiled_model(model, lambda input_ids: model(input_ids=input_ids).logits, {"input_ids": ids},
                                     loss=lambda out: out.float().square().mean(), options=JOIN | (options or {}))


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_q_k_v_and_their_adapters_joined_on_every_layer(arch, lora):
    """q, k and v read the same normalized input: one group per layer, and under LoRA a second one for their A's
    (the frozen base weights and the trained A's stay apart). Phi3's fused qkv_proj is one linear already, and its
    adapter's A is trained where the base is frozen: nothing to join. Outputs and gradients equal eager."""
    model = tiny_model(arch, lora=lora)
    if lora:
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    ids = torch.randint(3, VOCAB, (2, 10))
    expected, expected_grads, actual, actual_grads = _logits_loss(model, ids)
    (record,) = _joined_records()
    layers = model.config.num_hidden_layers
    assert record["matched"] == (0 if arch == "phi3" else layers * (2 if lora else 1))
    assert not record["near_misses"]
    forms = {site["form"] for site in record["sites"]}
    if arch != "phi3":
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        assert f"3 linears in one GEMM, widths {q}+{kv}+{kv}" in forms
        assert not lora or "3 linears in one GEMM, widths 4+4+4" in forms
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def _matmuls(fn) -> int:
    """aten matmul calls that running `fn` makes (the profiler sees inside compiled code)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm"))


def test_cpu_graphs_are_left_alone_by_default():
    """The joined GEMM sums in another order, which on the CPU buys nothing and moves fp32 results off stock
    TRL's in the last bits: by default only CUDA graphs are joined. (On the CPU even where FASTGRPO_TEST_DEVICE
    moves the other tests to the GPU.)"""
    with torch.device("cpu"):
        model = tiny_model("llama", lora=True)
        eager_then_compiled_model(model, lambda input_ids: model(input_ids=input_ids).logits,
                                  {"input_ids": torch.randint(3, VOCAB, (2, 10))})
    (record,) = _joined_records()
    assert record["matched"] == 0 and not record["near_misses"]


def test_joined_layers_run_fewer_matmuls_forward_and_backward():
    """A LoRA'd Llama layer stack: 4 fewer matmuls per layer forward (q, k, v and their A's: 6 become 2) and
    backward fewer still (x's gradient of each group from one product, the A's gradients from one)."""
    from fastgrpo.passes import PASSES

    model = tiny_model("llama", lora=True)
    ids = torch.randint(3, VOCAB, (2, 10))
    counts = []
    for patterns in (list(PASSES), [p for p in PASSES if p != "joined_projections"]):
        torch._dynamo.reset()
        compiled = torch.compile(lambda i: model(input_ids=i).logits, backend="fastgrpo",
                                 options={"inner": "aot_eager", "patterns": patterns, **JOIN})
        compiled(ids)  # compile outside the count
        outputs = []
        forward = _matmuls(lambda: outputs.append(compiled(ids)))
        backward = _matmuls(lambda: outputs[0].float().square().mean().backward())
        counts.append((forward, backward))
    (joined_fwd, joined_bwd), (apart_fwd, apart_bwd) = counts
    layers = model.config.num_hidden_layers
    assert apart_fwd - joined_fwd == 4 * layers
    assert apart_bwd - joined_bwd >= 4 * layers


def _compiled_record(model, x, inner="aot_eager"):
    """`model(x)` through the backend, joining on CPU, with fresh reports: (output, the joined_projections record)."""
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    out = torch.compile(model, backend="fastgrpo", options={"inner": inner, **JOIN})(x)
    (record,) = _joined_records()
    return out, record


def _assert_not_joined(record, site, reason):
    assert record["matched"] == 0
    assert [m["site"] for m in record["near_misses"]] == [site]
    assert reason in record["near_misses"][0]["reason"]


class _MergesLastDim(torch.nn.Module):
    """Two projections of x, one of them viewed with its last dim merged into the one before."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.a(x).view(x.shape[0], -1).sum(-1) + self.b(x).sum(-1).sum(-1)


class _MixedBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 6), torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x).sum(-1) * self.b(x).sum(-1) - self.c(x).mean(-1)


class _IndexerLike(torch.nn.Module):
    """b's output only picks indices (argmax), as DeepSeek-V4's indexer's top-k does; c's runs under no_grad."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 6, bias=False) for _ in range(3))

    def forward(self, x):
        picked = self.a(x).gather(-1, self.b(x).argmax(-1, keepdim=True))
        with torch.no_grad():
            scale = self.c(x).sigmoid()
        return picked * scale.mean(-1, keepdim=True)


def test_trained_weights_without_a_gradient_path_keep_their_linears():
    """Joined, b and c would get zero gradients where eager gives them none (an optimizer would still move them):
    c, under no_grad, is in another stretch of the graph; b reaches the output only through indices, reported."""
    model, x = _IndexerLike(), torch.randn(3, 5, 8)
    model(x).sum().backward()
    assert model.b.weight.grad is None and model.c.weight.grad is None
    model.zero_grad()
    out, record = _compiled_record(model, x)
    out.sum().backward()
    _assert_not_joined(record, "{a, b}", "reach no output with a gradient")
    assert model.a.weight.grad is not None and model.b.weight.grad is None and model.c.weight.grad is None


def test_under_no_grad_trained_weights_join_too():
    """A graph traced under no_grad (log-probs of the old policy, generation): no weight gets a gradient either way,
    so the A's join although nothing downstream is differentiated."""
    model = tiny_model("qwen3", lora=True)
    ids = torch.randint(3, VOCAB, (2, 10))
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        actual = torch.compile(lambda i: model(input_ids=i).logits, backend="fastgrpo",
                               options={"inner": "eager", **JOIN})(ids)
    (record,) = _joined_records()
    assert record["matched"] == 2 * model.config.num_hidden_layers and not record["near_misses"]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_view_merging_the_last_dim_keeps_the_linears_and_says_why():
    model, x = _MergesLastDim(), torch.randn(3, 5, 8, requires_grad=True)
    out, record = _compiled_record(model, x, inner="eager")
    _assert_not_joined(record, "{a, b}", "merging the last dim")
    torch.testing.assert_close(out, model(x))


def test_biases_join_only_with_biases():
    """a and c have biases, b has none: a and c are joined (their biases concatenated), b keeps its own GEMM."""
    model, x = _MixedBias(), torch.randn(3, 5, 8, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    actual, record = _compiled_record(model, x)
    actual.sum().backward()
    assert [(s["site"], s["form"]) for s in record["sites"]] == [("{a, c}", "2 linears in one GEMM, widths 6+4")]
    torch.testing.assert_close(actual, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name])


def test_checkpointed_layers_with_dynamic_shapes_compile_and_match_eager():
    """Layers compiled one region each with symbolic sizes, under HF's non-reentrant gradient checkpointing (as the
    trainer runs them): the pass builds its nodes' example values from symbolic fakes, and nothing it computes while
    the first call compiles may count as a tensor the checkpoint's forward saved. Two lengths, equal to eager."""
    model = tiny_model("llama", lora=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = [torch.randint(3, VOCAB, (2, length)) for length in (10, 14)]

    def loss_grads(ids):
        model(input_ids=ids).logits.float().square().mean().backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return out

    eager = [loss_grads(ids) for ids in batches]
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    fastgrpo.compile_repeated_blocks(model.get_base_model(), options={"inner": "aot_eager", **JOIN}, dynamic=True)
    for ids, expected in zip(batches, eager):
        assert_grads_close(expected, loss_grads(ids), rel=1e-4)
    records = _joined_records()
    assert records and all(r["matched"] == 2 for r in records)  # q, k, v and their A's, in every layer graph


@pytest.mark.parametrize("failing_target", [torch.cat, torch.nn.functional.linear, torch.narrow])
def test_a_group_whose_nodes_cannot_be_built_is_left_as_it_was_and_reported(monkeypatch, failing_target):
    """Building the joined nodes' example values can fail (torch 2.11 on the GPU asked a symbolic size for a
    concrete numel inside `linear`): whichever new node fails, the group keeps its linears, the graph is as it
    was (no half-built node left reading the others), the report says why."""
    from fastgrpo.passes import joined_projections

    call_with_example = joined_projections.call_with_example

    def failing_call(graph, target, args):
        if target is not failing_target:
            return call_with_example(graph, target, args)

        def raising(*_):
            raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides")
        return call_with_example(graph, raising, args)

    monkeypatch.setattr(joined_projections, "call_with_example", failing_call)
    model, x = _MixedBias(), torch.randn(3, 5, 8, requires_grad=True)
    out, record = _compiled_record(model, x)
    _assert_not_joined(record, "{a, c}", "could not be built (RuntimeError: Cannot call numel()")
    torch.testing.assert_close(out, model(x))
