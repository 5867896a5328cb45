"""RoPE and gated-MLP passes on the architecture matrix, plus the forms and fallbacks they must handle."""
import pytest
import torch
import torch.nn.functional as F

import fastgrpo
from tests.tiny_models import (
    ARCHS, VOCAB, assert_grads_close, eager_then_compiled, eager_then_compiled_model, grads, tiny_model,
)


def _records(name):
    return [r["patterns"][name] for r in fastgrpo.fusion_reports()]


def _compile_and_compare(model, ids, options=None, dynamic=None):
    """The model's logits eager and through the backend, each followed by `logits.float().square().mean()`'s
    backward: (expected, actual, expected grads, actual grads)."""
    expected, expected_grads, actual, actual_grads = eager_then_compiled_model(
        model, lambda input_ids: model(input_ids=input_ids).logits, {"input_ids": ids},
        loss=lambda out: out.float().square().mean(), options=options, dynamic=dynamic)
    return expected, actual, expected_grads, actual_grads


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rope_and_mlp_matched_on_every_layer(arch, lora):
    model = tiny_model(arch, lora=lora)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, VOCAB, (2, 10))
    expected, actual, expected_grads, actual_grads = _compile_and_compare(model, ids)
    rope, mlp = _records("rope"), _records("gated_mlp")
    assert sum(r["matched"] for r in rope) == layers
    assert sum(r["matched"] for r in mlp) == layers
    # Every MLP absorbed its projections, the down projection (and its LoRA) included, on these architectures
    # (Gemma2/3 and OLMo2 feed the MLP's output to a post-norm, whose pass must not take the adapter's add).
    assert all(s["form"].startswith("gated_mlp") and "with down projection" in s["form"] for r in mlp for s in r["sites"])
    # The whole model is one graph: its rotary embedding's cat((freqs, freqs), -1) is in view.
    assert all("cos/sin read at half width" in s["form"] for r in rope for s in r["sites"])
    assert not any(r["near_misses"] for r in rope + mlp)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def _hf_rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def _reshaped(f):
    return torch.cat((f, f), -1).reshape(1, 1, -1, 16)[:, 0].to(torch.float64).float()


_COS_SIN = {  # how cos/sin are built from angles [1, S, 8] -> whether their halves provably repeat
    "hf": (lambda f: (torch.cat((f, f), -1).cos() * 1.5, torch.cat((f, f), -1).sin() * 1.5), True),
    "reshaped": (lambda f: (_reshaped(f).cos(), _reshaped(f).sin()), True),
    "different halves": (lambda f: (torch.cat((f, 2 * f), -1).cos(), torch.cat((f, 2 * f), -1).sin()), False),
    "tensor factor": (lambda f: (torch.cat((f, f), -1).cos() * torch.linspace(1, 2, 16, device=f.device),
                                 torch.cat((f, f), -1).sin()), False),
    # rows of 16 made of two consecutive positions of the cat: the last dim changes in the reshape
    "cat on positions": (lambda f: (torch.cat((f, f), 1).reshape(1, -1, 16).cos(),
                                    torch.cat((f, f), 1).reshape(1, -1, 16).sin()), False),
}


@pytest.mark.parametrize("built", list(_COS_SIN))
def test_cos_sin_go_at_half_width_only_when_their_halves_provably_repeat(built):
    make, repeats = _COS_SIN[built]

    def attention_inputs(q, k, angles):
        cos, sin = make(angles)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _hf_rotate_half(q) * sin, k * cos + _hf_rotate_half(k) * sin

    q = torch.randn(1, 4, 6, 16, requires_grad=True)
    k = torch.randn(1, 2, 6, 16, requires_grad=True)
    angles = torch.randn(1, 6, 8)
    expected = attention_inputs(q, k, angles)
    sum(t.square().sum() for t in expected).backward()
    expected_grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    actual = torch.compile(attention_inputs, backend="fastgrpo", options={"inner": "eager"})(q, k, angles)
    sum(t.square().sum() for t in actual).backward()
    (site,) = _records("rope")[0]["sites"]
    assert ("cos/sin read at half width" in site["form"]) == repeats, site["form"]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, expected_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, expected_grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_lora_scales_traced_as_inputs_or_different_are_folded_into_b(arch):
    """Under dynamic=True Dynamo passes PEFT's float `scaling` in as a symbolic input; and gate and up
    may have different scales (alpha_pattern). Both fold the scale into B instead of refusing the MLP."""
    import peft

    torch.manual_seed(0)
    base = tiny_model(arch)
    targets = ["gate_up_proj", "down_proj"] if arch == "phi3" else ["gate_proj", "up_proj", "down_proj"]
    different = {} if arch == "phi3" else {"alpha_pattern": {"up_proj": 12}}  # Phi3: one fused gate_up adapter
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **different))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.randint(3, VOCAB, (2, 10))
    expected, actual, expected_grads, actual_grads = _compile_and_compare(model, ids, {"inner": "aot_eager"}, dynamic=True)
    mlp = _records("gated_mlp")
    # Dynamo may trace the model twice under dynamic=True (a restart, not a break): each graph holds every layer.
    assert [r["matched"] for r in mlp] == [model.config.num_hidden_layers] * len(mlp)
    assert all(s["form"].startswith("gated_mlp (") and "LoRA" in s["form"] for r in mlp for s in r["sites"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def _relative_error(grads_by_name: dict, reference: dict) -> float:
    """Relative error of all the gradients together (per-tensor errors of a tiny bf16 model are noise)."""
    err = sum((g.float() - reference[n]).square().sum() for n, g in grads_by_name.items())
    return (err / sum(r.square().sum() for r in reference.values())).sqrt().item()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_bf16_base_with_fp32_adapters_is_as_accurate_as_eager(arch):
    """bf16 rounds differently in the fused ops (once, from fp32) than in eager (at every step):
    measure both against the same model in fp32 and require ours to be no less accurate."""
    model = tiny_model(arch, lora=True)
    ids = torch.randint(3, VOCAB, (2, 10))
    model(input_ids=ids).logits.float().square().mean().backward()
    reference = {n: g.float() for n, g in grads(model).items()}
    model.zero_grad()
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    expected, actual, expected_grads, actual_grads = _compile_and_compare(model, ids)
    assert sum(r["matched"] for r in _records("gated_mlp")) == model.config.num_hidden_layers
    torch.testing.assert_close(actual.float(), expected.float(), rtol=3e-2, atol=3e-2)
    eager_err, our_err = _relative_error(expected_grads, reference), _relative_error(actual_grads, reference)
    print(f"{arch} bf16 gradient error vs fp32: fastgrpo {our_err:.4f}, eager {eager_err:.4f}")
    assert our_err <= 1.5 * eager_err


def test_partial_rotary_is_reported_as_such():
    model = tiny_model("phi3", partial_rotary_factor=0.5)
    ids = torch.randint(3, VOCAB, (2, 10))
    expected, actual, expected_grads, actual_grads = _compile_and_compare(model, ids)
    forms = [s["form"] for r in _records("rope") for s in r["sites"]]
    assert forms and all("partial rotary (16 of 32 channels)" in f for f in forms)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def test_interleaved_rope():
    def attn_inputs(q, k, cos, sin):
        return q * cos + _rotate_every_two(q) * sin, k * cos + _rotate_every_two(k) * sin

    q = torch.randn(2, 4, 6, 32, requires_grad=True)
    k = torch.randn(2, 2, 6, 32, requires_grad=True)
    angles = torch.randn(1, 1, 6, 16)
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    expected = attn_inputs(q, k, cos, sin)
    sum(t.square().sum() for t in expected).backward()
    expected_grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    actual = torch.compile(attn_inputs, backend="fastgrpo", options={"inner": "eager"})(q, k, cos, sin)
    sum(t.square().sum() for t in actual).backward()
    assert _records("rope")[0]["matched"] == 1
    assert "interleaved" in _records("rope")[0]["sites"][0]["form"]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, expected_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, expected_grads[1], rtol=1e-5, atol=1e-5)


class _BiasedMLP(torch.nn.Module):
    """A gated MLP whose projections have biases: the op cannot absorb them."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(32, 48), torch.nn.Linear(32, 48)
        self.down = torch.nn.Linear(48, 32, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_unabsorbable_projections_fall_back_to_act_mul_and_say_why():
    expected, expected_grad, actual, actual_grad = eager_then_compiled(_BiasedMLP(), torch.randn(3, 7, 32, requires_grad=True))
    (site,) = _records("gated_mlp")[0]["sites"]
    assert site["form"].startswith("act_mul fallback") and "bias" in site["form"]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-5, atol=1e-5)


class _DownReadTwice(torch.nn.Module):
    """Bias-free gate and up, but the product is read by a biased down projection and by a second branch:
    the op takes gate/up and stops before the down projection, and the report says why."""

    def __init__(self, down_bias: bool):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(32, 48, bias=False)
        self.down = torch.nn.Linear(48, 32, bias=down_bias)
        self.down_bias = down_bias

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(h) if self.down_bias else self.down(h) + h[..., :32]


@pytest.mark.parametrize("down_bias", [True, False], ids=["biased_down", "product_read_twice"])
def test_down_projection_left_out_when_it_cannot_be_absorbed(down_bias):
    expected, expected_grad, actual, actual_grad = eager_then_compiled(
        _DownReadTwice(down_bias), torch.randn(3, 7, 32, requires_grad=True))
    (site,) = _records("gated_mlp")[0]["sites"]
    assert site["form"].startswith("gated_mlp (") and "down projection not absorbed" in site["form"]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_exact_gelu_is_a_reported_near_miss():
    def mlp(x, wg, wu):
        return F.gelu(F.linear(x, wg)) * F.linear(x, wu)

    x, wg, wu = torch.randn(4, 16), torch.randn(24, 16), torch.randn(24, 16)
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    out = torch.compile(mlp, backend="fastgrpo", options={"inner": "eager"})(x, wg, wu)
    record = _records("gated_mlp")[0]
    assert record["matched"] == 0 and "gelu is not SiLU" in record["near_misses"][0]["reason"]
    torch.testing.assert_close(out, mlp(x, wg, wu))


def _saved(fn) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_decoder_layers_keep_no_mlp_intermediate_and_save_less_than_inductor():
    # A real MLP ratio (intermediate = 4 x hidden): the MLP intermediates dominate as in real models.
    model = tiny_model("llama", lora=True, num_hidden_layers=1, intermediate_size=256)
    ids = torch.randint(3, VOCAB, (2, 128))
    tokens, hidden, inter = 2 * 128, model.config.hidden_size, model.config.intermediate_size
    saved = {}
    for name, options in (("inductor", {"inner": "inductor", "patterns": []}), ("fastgrpo", {"inner": "inductor"})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fastgrpo", options=options)
        saved[name] = _saved(lambda: compiled(input_ids=ids).logits)
    nbytes = {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in saved.items()}
    intermediate, row = tokens * inter * 4, tokens * hidden * 4
    print(f"saved for backward: fastgrpo {nbytes['fastgrpo']} vs inductor {nbytes['inductor']} bytes "
          f"(ratio {nbytes['fastgrpo'] / nbytes['inductor']:.2f})")
    # Inductor keeps the gate and up projections and the product the down projection's LoRA needs; with the
    # down projection inside the op we keep none of them.
    def intermediates(ts):
        return sum(not isinstance(t, torch.nn.Parameter) and t.dim() >= 2 and t.shape[-1] == inter
                   and t.numel() == tokens * inter for t in ts)

    assert intermediates(saved["inductor"]) >= 3 and intermediates(saved["fastgrpo"]) == 0
    # Net of the one [tokens x hidden] norm output an opaque norm op makes inductor save instead of recompute.
    assert nbytes["inductor"] - nbytes["fastgrpo"] >= 2 * intermediate - row


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_saved_projections_keep_gate_and_up_only(arch):
    """save_mlp_projections (what the trainer sets under checkpointing): outputs and gradients equal eager, and
    of the MLP's [tokens x intermediate] values a layer keeps the two projections (one [tokens, 2I] buffer)
    and nothing else, where act_mul keeps gate, up and the product - and the full-size gradients then exist too."""
    model = tiny_model(arch, lora=True, num_hidden_layers=1, intermediate_size=96)
    ids = torch.randint(3, VOCAB, (2, 16))
    expected, actual, expected_grads, actual_grads = _compile_and_compare(
        model, ids, {"inner": "aot_eager", "save_mlp_projections": True})
    (site,) = _records("gated_mlp")[0]["sites"]
    assert site["form"].startswith("gated_mlp (") and "saves projections; with down projection" in site["form"]
    # One graph for the whole model: the residual stream goes on into the final norm, which saves it, so a
    # checkpoint's recompute must compute the MLP's output (per-layer regions skip it: tests/test_offload.py).
    assert site["form"].endswith("output computed in checkpoint recompute)")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(expected_grads, actual_grads, rel=1e-4)

    tokens, inter = ids.numel(), model.config.intermediate_size
    shapes = {}
    for name, options in (("saved", {"save_mlp_projections": True}), ("act_mul", {"absorb_mlp_projections": False})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fastgrpo", options={"inner": "aot_eager", **options})
        shapes[name] = [tuple(t.shape) for t in _saved(lambda: compiled(input_ids=ids).logits)
                        if t.dim() and t.shape[-1] in (inter, 2 * inter) and t.numel() == tokens * t.shape[-1]]
    assert shapes["saved"] == [(tokens, 2 * inter)]
    assert len(shapes["act_mul"]) >= 3


class _MLPBlock(torch.nn.Module):
    """x + down(silu(gate(x)) * up(x)), then `tail` of (x, mlp_out): what follows a layer's MLP."""

    def __init__(self, tail):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)
        self.tail = tail

    def forward(self, x):
        return self.tail(x, self.down(F.silu(self.gate(x)) * self.up(x)))


def _break_then_norm(x, y):
    torch._dynamo.graph_break()
    return x + F.rms_norm(y, (16,))


@pytest.mark.parametrize("tail,skips", [
    (lambda x, y: x + y.float().to(x.dtype), True),  # the residual add (through casts): nothing saves y
    (lambda x, y: x + F.dropout(y, 0.1, True), True),  # dropout saves a mask drawn whatever y is (Phi3)
    (lambda x, y: x + F.rms_norm(y, (16,)), False),  # a post-MLP norm saves y
    (lambda x, y: (x + y, y), False),  # y itself returned: whoever reads it may save it
    (_break_then_norm, False),  # y crosses a graph break into a graph that saves it
], ids=["residual", "dropout", "post_norm", "returned", "graph_break"])
def test_output_skipped_in_checkpoint_recompute_only_when_nothing_saves_it(tail, skips):
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    block = _MLPBlock(tail)
    torch.compile(block, backend="fastgrpo", options={"inner": "eager"})(torch.randn(2, 5, 16))
    forms = [site["form"] for r in _records("gated_mlp") for site in r["sites"]]
    assert forms and all(f.endswith(f"output {'skipped' if skips else 'computed'} in checkpoint recompute)")
                         for f in forms), forms
