"""Graphs traced under torch.autocast (TRL's bf16 mixed precision): the matmuls' casts are written into
the graph before the patterns run, so the fused ops compute in the dtype eager autocast uses."""
import copy

import peft
import torch
from torch import nn

import fastgrpo
from fastgrpo.compiler import fastgrpo_backend
from fastgrpo.compiler.tiny import tiny_model
from tests.tiny_models import VOCAB, grads

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


class _GatedMLP(nn.Module):
    def __init__(self, hidden=32, inter=48):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _lora_mlp() -> nn.Module:
    """A bf16 gated MLP with PEFT LoRA adapters, which PEFT keeps in fp32 (autocast_adapter_dtype)."""
    torch.manual_seed(0)
    model = peft.get_peft_model(
        nn.Sequential(_GatedMLP()).to(torch.bfloat16),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.1)
    assert {p.dtype for n, p in model.named_parameters() if "lora" in n} == {torch.float32}
    return model


def _capture(options):
    """A backend that runs fastgrpo's and keeps the graph it rewrote."""
    seen = []

    def backend(gm, example_inputs):
        compiled = fastgrpo_backend(gm, example_inputs, options=options)
        seen.append(gm)
        return compiled

    return backend, seen


def _dtype(node):
    return node.meta["example_value"].dtype


def test_adapters_enter_the_fused_mlp_in_the_autocast_dtype():
    model = _lora_mlp()
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16)
    backend, seen = _capture({"inner": "eager", "patterns": ["gated_mlp"]})
    fastgrpo.clear_fusion_reports()
    with torch.autocast(**AUTOCAST):
        torch.compile(model, backend=backend)(x)
    (report,) = fastgrpo.fusion_reports()
    assert report["autocast"].startswith("bfloat16 on cpu")
    assert report["patterns"]["gated_mlp"]["sites"][0]["form"].startswith("gated_mlp (LoRA")
    (op,) = [n for n in seen[0].graph.nodes if n.target is torch.ops.fastgrpo.gated_mlp.default]
    tensors = [a for a in op.args if isinstance(a, torch.fx.Node)]
    assert len(tensors) == 10  # x, gate and up weights and LoRA pairs, the down weight and its LoRA pair
    assert {_dtype(a) for a in tensors} == {torch.bfloat16}
    assert op.args[0].op == "placeholder"  # x itself: the fp32 round trip PEFT writes is collapsed
    # Nothing of the eager MLP is left behind (the collapsed `h.to(float32)` of the down adapter used to keep the
    # product, and with it every projection, alive as dead code that an eager inner compiler would run).
    matmuls = [n for n in seen[0].graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert matmuls == [] and not [n for n in seen[0].graph.nodes if "silu" in str(n.target)]


def test_explicit_casts_change_nothing_bitwise():
    """With no pattern matching, the casts alone: outputs and grads identical to eager autocast."""
    model = _lora_mlp()
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16, requires_grad=True)

    def run(fn):
        model.zero_grad()
        x.grad = None
        with torch.autocast(**AUTOCAST):
            out = fn(x)
        out.float().square().sum().backward()
        return out.detach(), x.grad.clone(), grads(model)

    expected = run(model)
    backend, seen = _capture({"inner": "aot_eager", "patterns": ["rms_norm"]})  # matches nothing here
    actual = run(torch.compile(model, backend=backend))
    assert any(n.op == "call_method" and n.target == "to" and _dtype(n) == torch.bfloat16 for n in seen[0].graph.nodes)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=0)
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name], rtol=0, atol=0, msg=name)


def test_no_autocast_no_casts():
    model = _lora_mlp()
    backend, seen = _capture({"inner": "eager", "patterns": ["gated_mlp"]})
    fastgrpo.clear_fusion_reports()
    torch.compile(model, backend=backend)(torch.randn(2, 5, 32, dtype=torch.bfloat16))
    assert fastgrpo.fusion_reports()[0]["autocast"] is None
    (op,) = [n for n in seen[0].graph.nodes if n.target is torch.ops.fastgrpo.gated_mlp.default]
    assert _dtype(op.args[3]) == torch.float32  # the fp32 adapters, as PEFT computes them without autocast


def test_code_that_leaves_autocast_is_left_alone():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)

        def forward(self, x):
            y = self.a(x)
            with torch.autocast("cpu", enabled=False):
                z = self.b(y.float())
            return y.float() + z

    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(4, 16)
    with torch.autocast(**AUTOCAST):
        expected = model(x)
        backend, seen = _capture({"inner": "aot_eager", "patterns": ["gated_mlp"]})
        actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert expected.dtype == torch.float32


def test_tiny_llama_under_autocast_matches_and_is_no_less_accurate_than_eager():
    """Every pattern still matches; gradients against an fp32 reference are no worse than eager
    autocast's own (bf16 rounding dominates a tiny random model's LoRA grads, so compare errors)."""
    torch.manual_seed(0)
    reference = tiny_model("llama", dtype=torch.float32, lora=True)
    for name, param in reference.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.05)
    model = copy.deepcopy(reference)
    for name, param in model.named_parameters():
        if "lora" not in name:
            param.data = param.data.to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 12))

    def run(m, fn, autocast):
        m.zero_grad()
        with torch.autocast(**AUTOCAST, enabled=autocast):
            out = fn(input_ids=ids).last_hidden_state
        out.float().square().mean().backward()
        return out.detach().float(), grads(m)

    ref_out, ref_grads = run(reference, reference.get_base_model().model, False)
    eager_out, eager_grads = run(model, model.get_base_model().model, True)
    fastgrpo.clear_fusion_reports()
    compiled = torch.compile(model.get_base_model().model, backend="fastgrpo", options={"inner": "aot_eager"})
    out, compiled_grads = run(model, compiled, True)
    (report,) = fastgrpo.fusion_reports()
    layers = reference.config.num_hidden_layers
    assert {name: rec["matched"] for name, rec in report["patterns"].items()} == {
        "selective_logprob": 0, "rope": layers, "rms_norm": 2 * layers + 1, "gated_mlp": layers,
        "attention": 0,  # a CPU graph: SDPA's own CPU kernel runs
        "joined_projections": 0,  # a CPU graph: joined on CUDA only
    }
    assert all("LoRA" in site["form"] for site in report["patterns"]["gated_mlp"]["sites"])

    def error(g):
        return sum((g[n].float() - ref_grads[n]).norm() ** 2 for n in ref_grads) ** 0.5

    assert (out - ref_out).abs().max() <= 1.5 * (eager_out - ref_out).abs().max() + 1e-2
    print(f"grad error vs fp32: eager autocast {error(eager_grads):.4g}, fastgrpo autocast {error(compiled_grads):.4g}")
    assert error(compiled_grads) <= 1.5 * error(eager_grads)
