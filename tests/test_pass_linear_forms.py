"""Every spelling of a linear is found where `F.linear` is: `h @ W.t()`, `h @ W.T`, `torch.matmul(h, W.t())`,
`h.matmul(W.transpose(0, 1))`, `torch.mm` between reshapes, `einsum("...d,vd->...v")` and `einsum("td,vd->tv")`, on
the lm-head (selective_logprob), the MLP projections (gated_mlp) and q/k/v (rope, joined_projections) of tiny
models whose every `nn.Linear` is written that way; outputs and gradients equal eager."""
import pytest
import torch
import torch.nn.functional as F

import fastgrpo
from tests.tiny_models import VOCAB, assert_compiled_matches_eager, assert_grads_close, eager_then_compiled_model, tiny_model

SPELLINGS = {
    "matmul_t": lambda h, w: h @ w.t(),
    "matmul_T": lambda h, w: h @ w.T,
    "torch_matmul": lambda h, w: torch.matmul(h, w.t()),
    "method_transpose": lambda h, w: h.matmul(w.transpose(0, 1)),
    "mm_between_reshapes": lambda h, w: torch.mm(h.reshape(-1, h.shape[-1]), w.t()).view(*h.shape[:-1], w.shape[0]),
    "einsum_ellipsis": lambda h, w: torch.einsum("...d,vd->...v", h, w),
    "einsum_td": lambda h, w: torch.einsum("td,vd->tv", h.flatten(0, -2), w).unflatten(0, h.shape[:-1]),
}


def _records(name):
    return [r["patterns"][name] for r in fastgrpo.fusion_reports()]


def _spelled(model, spelling: str):
    """Every nn.Linear of `model` (LoRA's A, B and base layers, the lm-head) computing with `spelling`."""
    spell = SPELLINGS[spelling]

    class Spelled(torch.nn.Linear):
        def forward(self, x):
            y = spell(x, self.weight)
            return y if self.bias is None else y + self.bias

    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Spelled
    return model


@pytest.mark.parametrize("hidden_rank", [2, 3])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_hand_written_lm_head(spelling, hidden_rank):
    spell = SPELLINGS[spelling]

    def logps(h, w, t):
        return torch.log_softmax(spell(h, w).float() / 0.7, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(0)
    lead = (12,) if hidden_rank == 2 else (2, 6)
    hidden = torch.randn(*lead, 32, requires_grad=True)
    weight = (torch.randn(77, 32) / 32**0.5).requires_grad_()
    assert_compiled_matches_eager(logps, hidden, weight, torch.randint(0, 77, lead))
    assert [r["matched"] for r in _records("selective_logprob")] == [1]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_pattern_on_a_lora_model_written_with_matmuls(spelling):
    """lm-head, gated MLP (down projection and LoRA included), RoPE and the q/k/v joins (base weights, and the
    adapters' A's) all matched on a tiny PEFT-LoRA Llama whose every linear is `spelling`."""
    model = _spelled(tiny_model("llama", lora=True), spelling)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.randint(3, VOCAB, (2, 9))

    def completion_logps(input_ids):
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
        return logits.log_softmax(-1).gather(-1, input_ids.roll(-1, 1).unsqueeze(-1)).squeeze(-1)

    expected, expected_grads, actual, actual_grads = eager_then_compiled_model(
        model, completion_logps, {"input_ids": ids}, loss=lambda out: out.sum(), options={"join_projections": True})
    layers = model.config.num_hidden_layers
    (head,), (mlp,), (rope,), (joined,) = (_records(n) for n in ("selective_logprob", "gated_mlp", "rope",
                                                                  "joined_projections"))
    assert (head["matched"], mlp["matched"], rope["matched"], joined["matched"]) == (1, layers, layers, 2 * layers)
    assert all(s["form"].startswith("gated_mlp (LoRA silu") and "with down projection" in s["form"] for s in mlp["sites"])
    assert not any(r["near_misses"] for r in (head, mlp, rope, joined)), fastgrpo.format_reports(fastgrpo.fusion_reports())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


@pytest.mark.parametrize("arch,spelling", [("phi3", "matmul_T"), ("qwen3", "einsum_ellipsis")])
def test_fused_projections_and_qk_norms_written_with_matmuls(arch, spelling):
    """Phi3's fused qkv and gate_up (split with chunk) and Qwen3's q/k norms, every linear spelled otherwise."""
    model = _spelled(tiny_model(arch, lora=True), spelling)
    ids = torch.randint(3, VOCAB, (2, 9))
    expected, expected_grads, actual, actual_grads = eager_then_compiled_model(
        model, lambda input_ids: model(input_ids=input_ids).logits, {"input_ids": ids},
        loss=lambda out: out.float().square().mean(), options={"join_projections": True})
    layers = model.config.num_hidden_layers
    (mlp,), (rope,), (joined,) = (_records(n) for n in ("gated_mlp", "rope", "joined_projections"))
    # Phi3's qkv_proj is one linear already, and its adapter's A is trained where the base is frozen: nothing to join.
    assert (mlp["matched"], rope["matched"], joined["matched"]) == (layers, layers, 0 if arch == "phi3" else 2 * layers)
    assert all("with down projection" in s["form"] for s in mlp["sites"])
    assert arch != "phi3" or all("fused gate_up" in s["form"] for s in mlp["sites"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def test_a_product_against_an_untransposed_tensor_stays_a_matmul_and_says_why():
    """`h @ M` with an [in, out] M is not a linear of M (its transpose would have to be copied): reported."""

    def logps(h, m, t):
        return torch.log_softmax(h @ m, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(0)
    hidden, m = torch.randn(2, 6, 32, requires_grad=True), torch.randn(32, 77, requires_grad=True)
    assert_compiled_matches_eager(logps, hidden, m, torch.randint(0, 77, (2, 6)))
    (record,) = _records("selective_logprob")
    assert record["matched"] == 0
    assert "stopped at matmul; a product is a linear only against a transposed" in record["near_misses"][0]["reason"]


def test_only_products_that_are_linears_are_rewritten():
    """Of a batched product (attention scores), a contraction against an [in, out] tensor, an implicit output, an
    addmm scaling its bias, an addmm with a plain bias and a linear einsum over [out, in], the last two become
    linears."""
    from fastgrpo.passes import linear_forms

    def scores(q, k, m, w):
        batched = torch.einsum("bhqk,bhkd->bhqd", torch.einsum("bhqd,bhkd->bhqk", q, k), k)
        untransposed, implicit = torch.einsum("bhqd,dv->bhqv", q, m), torch.einsum("bhqd,vd", q, w)
        rows, bias = q.flatten(0, -2), w[0]
        scaled = torch.addmm(bias, rows, w.t(), beta=0.5).view_as(q)  # beta != 1: not a linear's bias
        added = torch.addmm(bias, rows, w.t()).view_as(q)  # a linear with a bias
        return batched + untransposed + implicit + scaled + added + torch.einsum("bhqd,vd->bhqv", q, w)

    rewritten = []

    def backend(gm, example_inputs):
        rewritten.append(linear_forms.apply(gm))
        assert sum(node.target is F.linear for node in gm.graph.nodes) == 2
        return gm.forward

    torch.manual_seed(0)
    inputs = [torch.randn(*s) for s in ((1, 2, 5, 8), (1, 2, 5, 8), (8, 8), (8, 8))]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(scores, backend=backend)(*inputs), scores(*inputs))
    assert rewritten == [2]


def test_a_failure_half_way_puts_the_graph_back_and_warns(monkeypatch):
    """Should the rewrite raise after inserting a linear, the graph is the traced one again: the matmul stays, the
    lm-head pattern reports it, a PassFailedWarning says so, and the results equal eager."""
    from fastgrpo.compiler.backend import PassFailedWarning
    from fastgrpo.passes import linear_forms

    def fails(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(linear_forms, "propagate_meta", fails)
    spell = SPELLINGS["matmul_t"]

    def logps(h, w, t):
        return torch.log_softmax(spell(h, w), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 6, 32, requires_grad=True), torch.randn(77, 32, requires_grad=True)
    with pytest.warns(PassFailedWarning, match="reading matmuls as linears raised RuntimeError: injected"):
        assert_compiled_matches_eager(logps, hidden, weight, torch.randint(0, 77, (2, 6)))
    (record,) = _records("selective_logprob")
    assert record["matched"] == 0 and "stopped at matmul" in record["near_misses"][0]["reason"]


def test_spelled_adapters_enter_the_fused_mlp_in_the_autocast_dtype():
    """Under bf16 autocast PEFT's fp32 adapters, spelled as matmuls, get autocast's casts like linears do: the MLP op
    takes every operand in bf16."""
    from tests.test_autocast import AUTOCAST, _capture, _dtype, _lora_mlp

    model = _spelled(_lora_mlp(), "matmul_T")
    backend, seen = _capture({"inner": "eager", "patterns": ["gated_mlp"]})
    fastgrpo.clear_fusion_reports()
    with torch.autocast(**AUTOCAST):
        torch.compile(model, backend=backend)(torch.randn(3, 7, 32, dtype=torch.bfloat16))
    (op,) = [n for n in seen[0].graph.nodes if n.target is torch.ops.fastgrpo.gated_mlp.default]
    tensors = [a for a in op.args if isinstance(a, torch.fx.Node)]
    assert len(tensors) == 10 and {_dtype(a) for a in tensors} == {torch.bfloat16}


@pytest.mark.gpu
@pytest.mark.parametrize("spelling", ["matmul_T", "einsum_ellipsis", "mm_between_reshapes"])
def test_on_cuda_under_bf16_autocast_a_spelled_model_computes_what_the_linear_one_does(spelling):
    """The Triton kernels on CUDA, bf16 autocast: written as F.linear, the spelled model's graph is the linear one's,
    so its log-probs and LoRA gradients are bit for bit those of the same model with nn.Linear's own forward."""
    import copy

    reference = tiny_model("llama", lora=True).cuda()
    for name, param in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    spelled = _spelled(copy.deepcopy(reference), spelling)
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    results = []
    for model in (reference, spelled):
        fastgrpo.clear_fusion_reports()
        torch._dynamo.reset()
        compiled = torch.compile(lambda input_ids, m=model: m(input_ids=input_ids, use_cache=False).logits.float()
                                 .log_softmax(-1).gather(-1, input_ids.roll(-1, 1).unsqueeze(-1)), backend="fastgrpo",
                                 options={"inner": "eager"})
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(ids)
        out.sum().backward()
        matched = {n: sum(r["patterns"][n]["matched"] for r in fastgrpo.fusion_reports())
                   for n in ("selective_logprob", "gated_mlp", "rope", "joined_projections")}
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, matched))
    (out, grads, matched), (spelled_out, spelled_grads, spelled_matched) = results
    assert spelled_matched == matched and matched["gated_mlp"] == reference.config.num_hidden_layers
    assert torch.equal(spelled_out, out)
    assert grads.keys() == spelled_grads.keys() and all(torch.equal(spelled_grads[n], grads[n]) for n in grads)
