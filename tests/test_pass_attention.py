"""The attention pass: SDPA calls rerouted to prefer cuDNN's kernel on CUDA (sm90+), reported per site."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastgrpo
from fastgrpo.passes import attention
from tests.tiny_models import VOCAB, assert_grads_close, eager_then_compiled_model, tiny_model

ARCHS = ["llama", "qwen2", "gemma2"]


def _record():
    records = [r["patterns"]["attention"] for r in fastgrpo.fusion_reports()]
    return {"matched": sum(r["matched"] for r in records),
            "sites": [s for r in records for s in r["sites"]],
            "near_misses": [m for r in records for m in r["near_misses"]]}


def _compile_and_compare(model, ids, options=None):
    return eager_then_compiled_model(model, lambda input_ids: model(input_ids=input_ids).logits, {"input_ids": ids},
                                     loss=lambda out: out.float().square().mean(), options=options)


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_graphs_are_left_to_sdpa(arch):
    """On the CPU SDPA's own kernel is what runs: no site rerouted, none reported."""
    model = tiny_model(arch)
    if next(model.parameters()).is_cuda:
        pytest.skip("a CPU test")
    _compile_and_compare(model, torch.randint(3, VOCAB, (2, 10)))
    record = _record()
    assert record["matched"] == 0 and not record["near_misses"]


KEPT_FORM = "cudnn, output kept for a checkpoint's re-run"
RECOMPUTED_FORM = "cudnn, output recomputed (keep_attention_output=False)"


@pytest.mark.parametrize("keep,form", [(None, KEPT_FORM), (False, RECOMPUTED_FORM)])
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rerouted_sites_equal_eager(arch, inner, keep, form, monkeypatch):
    """Where cuDNN takes the inputs every layer's SDPA call is rerouted (by default to fastgrpo::attention, which
    can keep its output for a checkpoint's re-run), and the model computes what eager does (here on whatever
    device the tests run: on the CPU the op runs SDPA's CPU flash kernel)."""
    monkeypatch.setattr(attention, "_on_cuda", lambda query: isinstance(query, torch.Tensor))
    monkeypatch.setattr(attention, "_why_not_cudnn", lambda inputs: None)
    model = tiny_model(arch)
    expected, expected_grads, actual, actual_grads = _compile_and_compare(
        model, torch.randint(3, VOCAB, (2, 10)), {"inner": inner, "keep_attention_output": keep})
    record = _record()
    assert record["matched"] == model.config.num_hidden_layers and not record["near_misses"]
    assert all(site["form"] == form for site in record["sites"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_sites_take_the_op_when_asked(arch):
    """keep_attention_output=True puts fastgrpo::attention (SDPA's CPU flash kernel) on the CPU's sites too."""
    model = tiny_model(arch)
    if next(model.parameters()).is_cuda:
        pytest.skip("a CPU test")
    expected, expected_grads, actual, actual_grads = _compile_and_compare(
        model, torch.randint(3, VOCAB, (2, 10)), {"keep_attention_output": True})
    record = _record()
    assert record["matched"] == model.config.num_hidden_layers and not record["near_misses"]
    assert all(site["form"] == "CPU flash, output kept for a checkpoint's re-run" for site in record["sites"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def test_attention_dropout_is_reported(monkeypatch):
    """A site with dropout keeps nothing (a re-run would need the same dropout mask): on the CPU it is left to
    SDPA and reported; on cuDNN it is rerouted with its output recomputed, and the form says why."""
    model = tiny_model("llama", attention_dropout=0.1).train()
    ids = torch.randint(3, VOCAB, (2, 10))
    fastgrpo.clear_fusion_reports()
    torch.compile(model, backend="fastgrpo", options={"inner": "eager", "keep_attention_output": True})(input_ids=ids)
    record = _record()
    layers = model.config.num_hidden_layers
    if next(model.parameters()).is_cuda:
        assert all(site["form"] == "cudnn, output recomputed (dropout_p=0.1 (a re-run would have to replay the "
                   "dropout mask))" for site in record["sites"]) and record["matched"] == layers
    else:
        assert record["matched"] == 0 and len(record["near_misses"]) == layers
        assert all("dropout_p=0.1" in miss["reason"] for miss in record["near_misses"])


def test_not_rerouted_when_the_user_disabled_cudnn(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    reason = attention._why_not_cudnn({"query": None})
    assert "enable_cudnn_sdp(False)" in reason


def test_sdpa_is_asked_which_kernel_it_would_pick(monkeypatch):
    """The pass asks SDPA, with cuDNN first, which kernel these inputs get; here (CPU tensors posing as an sm90
    GPU's) SDPA's answer is not cuDNN, and the reason names its choice."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    reason = attention._why_not_cudnn(
        {"query": q, "key": k, "value": k, "attn_mask": None, "dropout_p": 0.0, "is_causal": True, "scale": None,
         "enable_gqa": True})
    assert "SDPA chose" in reason, reason


def test_pattern_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(attention, "_on_cuda", lambda query: isinstance(query, torch.Tensor))
    monkeypatch.setattr(attention, "_why_not_cudnn", lambda inputs: None)
    model = tiny_model("llama")
    _compile_and_compare(model, torch.randint(3, VOCAB, (2, 10)),
                         {"patterns": ["rms_norm", "rope", "gated_mlp", "selective_logprob"]})
    assert all("attention" not in r["patterns"] for r in fastgrpo.fusion_reports())


class _AtenLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cuda_bf16_runs_cudnn_forward_and_backward(arch):
    """On an sm90+ GPU in bf16 each layer's attention runs cuDNN's kernels, forward and backward, and the model's
    outputs and gradients match eager (flash) within bf16 attention's tolerance."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is preferred on sm90+ only")
    torch.manual_seed(0)
    model = tiny_model(arch).to("cuda", torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 64), device="cuda")
    expected, expected_grads, _, _ = _compile_and_compare(model, ids, {"inner": "aot_eager"})
    record = _record()
    assert record["matched"] == model.config.num_hidden_layers and not record["near_misses"], record
    model.zero_grad()
    log = _AtenLog()
    compiled = torch.compile(lambda input_ids: model(input_ids=input_ids).logits, backend="fastgrpo",
                             options={"inner": "aot_eager"})
    compiled(ids)  # compiles outside the log: AOTAutograd's tracing would show every op too
    model.zero_grad()
    with log:
        actual = compiled(ids)
        actual.float().square().mean().backward()
    assert "aten._scaled_dot_product_cudnn_attention" in log.ops, sorted(log.ops)
    assert "aten._scaled_dot_product_cudnn_attention_backward" in log.ops, sorted(log.ops)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert_grads_close(expected_grads, {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                       rel=3e-2)


@pytest.mark.gpu
def test_cuda_float32_is_reported_with_sdpa_choice():
    """cuDNN's attention has no float32 kernel: the sites stay SDPA's and the report says which kernel runs."""
    model = tiny_model("qwen2").to("cuda")
    _compile_and_compare(model, torch.randint(3, VOCAB, (2, 16), device="cuda"), {"inner": "aot_eager"})
    record = _record()
    assert record["matched"] == 0
    assert len(record["near_misses"]) == model.config.num_hidden_layers
    reason = record["near_misses"][0]["reason"]
    assert ("SDPA chose" in reason) or ("sm90" in reason), reason


def test_symbolic_dropout_is_taken_at_zero_and_guarded():
    """Compiled one layer at a time with dynamic shapes, Dynamo makes HF's float `attention_dropout` a graph input:
    the site is taken while it is 0 in the trace, and the op's check guards the graph on it, so a layer whose
    dropout is then switched on recompiles (and that graph's site is reported, its dropout applied)."""
    model = tiny_model("qwen2", num_hidden_layers=2)
    if next(model.parameters()).is_cuda:
        pytest.skip("a CPU test")
    fastgrpo.clear_fusion_reports()
    fastgrpo.compile_repeated_blocks(model, options={"inner": "eager", "keep_attention_output": True}, dynamic=True)
    ids = torch.randint(3, VOCAB, (2, 10))
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert _record()["matched"] == 1  # one graph serves both layers
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    fastgrpo.clear_fusion_reports()
    outputs = [model(input_ids=ids, use_cache=False).logits for _ in range(2)]
    record = _record()
    assert record["matched"] == 0 and "dropout_p=0.5" in record["near_misses"][0]["reason"]
    assert not torch.equal(*outputs)  # dropout is on


def test_sdpa_priority_order_is_left_as_it_was():
    """Putting cuDNN first for one call leaves the user's priority order as it was (torch 2.11's own
    `sdpa_kernel(set_priority=True)` left cuDNN first for the rest of the process; 2.13's restores it)."""
    before = torch._C._get_sdp_priority_order()
    q = torch.randn(1, 2, 4, 8)
    attention.sdpa_preferring_cudnn(q, q, q, is_causal=True)
    assert torch._C._get_sdp_priority_order() == before


@pytest.mark.parametrize("keep", [None, False])
def test_packed_rows_flash_attention_is_reported_and_follows_keep_attention_output(keep):
    """Packed rows' flash attention (fastgrpo::flash_packed_attention, which the packing integration writes on CUDA)
    is reported; it keeps its output for the checkpoint's re-run unless keep_attention_output=False clears its
    `keep` argument. (Traced symbolically: the op's kernel runs on CUDA only.)"""
    from fastgrpo.compiler.options import Options
    from fastgrpo.passes._record import PatternRecord

    def packed(q, k, v, cu):
        return torch.ops.fastgrpo.flash_packed_attention.default(q, k, v, cu, cu, 8, 8, None, None, True)[0]

    gm = torch.fx.symbolic_trace(packed)
    record = PatternRecord("attention")
    attention.apply(gm, record, Options.parse({"keep_attention_output": keep}))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.fastgrpo.flash_packed_attention.default]
    assert node.args[-1] is (keep is not False)
    form = "output kept for a checkpoint's re-run" if keep is None else "output recomputed (keep_attention_output=False)"
    assert record.sites == [{"site": record.sites[0]["site"], "form": f"flash variable-length (packed rows), {form}"}]
    assert f"None, None, {keep is not False})" in gm.code  # the module was recompiled with it
