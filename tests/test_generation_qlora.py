"""QLoRA decoding: LoRA over bitsandbytes 4-bit (NF4) bases through fastgrpo::nf4_lora_linear (Triton's interpreter
on CPU). The kernel reads the live packed weights and adapters (no copy), traces into the compiled decode layer, takes
several active adapters and disabled ones; the layers it does not take are left to PEFT with the reason in one
warning, merge modes "all" and "none" do without it, its modules are put back after an exception, and on CUDA it runs
inside captured decode steps."""
import warnings

import peft
import pytest
import torch

from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from tests.test_generation import (
    PAD, VOCAB, _strict, fallback_notes_of_two_calls, hf_greedy, prompts, tiny_lm, with_lora,
)


def qlora_lm(arch="qwen2", dtype=torch.float32, device="cpu", lora=True, nested=True, **overrides):
    """`tiny_lm` (`overrides`: config fields) with every decoder linear a bitsandbytes NF4 `Linear4bit`
    (double-quantized unless not `nested`, computing in `dtype`) quantized from the same init, then (`lora`) LoRA on
    all of them. On CPU in bitsandbytes' own layout (no repacking for its CPU kernel, which the 4-bit kernel does not
    read). Each interpreted kernel launch takes tens of ms: tests keep the decodes short."""
    bnb = pytest.importorskip("bitsandbytes")
    model = tiny_lm(arch, **overrides).to(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not model.lm_head:
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=dtype, quant_type="nf4")
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                      compress_statistics=nested)
                if child.bias is not None:
                    quantized.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                quantized.support_avx512bf16_for_cpu = False
                setattr(parent, name, quantized.to(device))  # quantizes
    model.to(device)
    return with_lora(model) if lora else model


@torch.no_grad()
def scale_lora_b(model, factor, match="lora_B"):
    """Every LoRA B factor whose parameter name contains `match` multiplied in place (an optimizer-style update)."""
    for name, p in model.named_parameters():
        if match in name:
            p.mul_(factor)


def _kernel_modules(model):
    from fastgrpo.integrations.generation.four_bit import FourBitLoRALinear

    return [m for m in model.modules() if isinstance(m, FourBitLoRALinear)]


QLORA_LAYERS = 14  # 7 projections x 2 layers


def test_qlora_layers_decode_through_the_4bit_kernel_from_the_live_weights():
    """Mode "float": every LoRA linear over a 4-bit base decodes through the kernel (the greedy tokens of the
    unswapped model), reading the live packed weight and adapters: no copy, and an optimizer-style update of the
    adapters is seen by the next call. The LoRA layers are back after each call. (LoRA on four projections a layer,
    q and k with a bias; the compiled test below has it on all seven.)"""
    from fastgrpo.kernels._dispatch import triton_on_cpu

    torch.manual_seed(1)
    model = peft.get_peft_model(qlora_lm(lora=False), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"], init_lora_weights=False))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4)
    with triton_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        first = generator.generate(prompts(), temperature=0)
        assert first == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
        assert generator.lora_decoding == {"merge_lora": "float", "merged": 0, "nf4_kernel": 8, "nf4_groups": 0,
                                           "nf4_ungrouped": {}, "adapters_forward": {}}
        merged = generator.engine._merged
        assert merged.copies == [] and generator.engine._adapters._entries == []
        scale_lora_b(model, -3.0)
        second = generator.generate(prompts(), temperature=0)
    assert second != first and second == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
    assert {name: m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)} == layers
    assert _kernel_modules(model) == []
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params


def test_qlora_kernel_layers_trace_into_the_compiled_decode_layer(monkeypatch):
    """The swapped modules trace with fullgraph=True into one graph shared by every decoder layer; with grouping on,
    sibling layers that cannot group are launched alone, the reasons counted."""
    from fastgrpo.integrations.generation import adapters
    from fastgrpo.kernels._dispatch import triton_on_cpu

    monkeypatch.setattr(adapters, "GROUP_FOUR_BIT", True)
    torch._dynamo.reset()
    model = qlora_lm()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=5, compile=True, compile_backend="eager")
    with triton_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(prompts(), temperature=0) == hf_greedy(model, prompts(), 5, eos=VOCAB + 1)
    assert generator.engine.backend.compiles == 1
    assert generator.lora_decoding["nf4_kernel"] == QLORA_LAYERS
    # k and v of 32 rows, gate's 128 blocks not whole nested blocks of 256: each launched alone, the reasons counted
    assert generator.lora_decoding["nf4_groups"] == 0
    assert generator.lora_decoding["nf4_ungrouped"] == {"a layer's output width is not a multiple of 64": 6,
                                                        "a layer's blocks are not whole nested blocks": 4}


def test_qlora_sibling_layers_decode_as_one_grouped_launch(monkeypatch):
    """q/k/v and gate/up (widths 64, 64, 64 and 128, 128; single quantization) each decode as one grouped launch,
    traced into the compiled decode layer: the greedy tokens of the unswapped model and of one launch a layer; an
    update of the adapters is seen by the next call (the group's factors refreshed)."""
    from fastgrpo.integrations.generation import adapters
    from fastgrpo.kernels._dispatch import triton_on_cpu

    monkeypatch.setattr(adapters, "GROUP_FOUR_BIT", True)
    torch._dynamo.reset()
    model = qlora_lm(nested=False, num_key_value_heads=2)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4, compile=True, compile_backend="eager")
    with triton_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        grouped = generator.generate(prompts(), temperature=0)
        assert grouped == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
        assert generator.lora_decoding["nf4_groups"] == 4 and generator.lora_decoding["nf4_kernel"] == QLORA_LAYERS
        assert generator.engine.backend.compiles == 1
        scale_lora_b(model, -3.0)
        updated = generator.generate(prompts(), temperature=0)
        assert updated != grouped and updated == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
        monkeypatch.setattr(adapters, "GROUP_FOUR_BIT", False)
        alone = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4)
        assert alone.generate(prompts(), temperature=0) == updated
        assert alone.lora_decoding["nf4_groups"] == 0


def test_qlora_several_active_adapters_and_disabled_adapters():
    """Several active adapters decode joined (their factors refreshed every call); adapters disabled: the base.
    (LoRA on three projections a layer: the bare 4-bit ones run bitsandbytes, fast on CPU.)"""
    from fastgrpo.kernels._dispatch import triton_on_cpu

    torch.manual_seed(1)
    model = peft.get_peft_model(qlora_lm(lora=False), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "o_proj"],
                                               init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=4)
    with triton_on_cpu():
        assert generator.generate(prompts(), temperature=0) == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
        assert sum(e.linear.joined for e in generator.engine._merged._entries) == 2  # q_proj
        assert generator.lora_decoding["nf4_kernel"] == 6
        scale_lora_b(model, -20.0, "lora_B.other")
        changed = generator.generate(prompts(), temperature=0)
        assert changed == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
        with model.disable_adapter():
            base = generator.generate(prompts(), temperature=0)
            assert base == hf_greedy(model, prompts(), 4, eos=VOCAB + 1)
            assert generator.lora_decoding["nf4_kernel"] == 0 and generator.lora_decoding["adapters_forward"] == {}
    assert base != changed


def test_qlora_layers_the_kernel_does_not_take_are_left_to_peft_with_the_reason():
    """DoRA and a LoRA bias stay with PEFT's forward, as does every 4-bit base on CPU outside Triton's interpreter;
    the reasons are counted and named in one warning; the tokens are PEFT's."""
    from fastgrpo.integrations.generation.adapters import MergedAdapters
    from fastgrpo.kernels._dispatch import triton_on_cpu

    base = qlora_lm(lora=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      use_dora=True, init_lora_weights=False))
    model.add_adapter("bias", peft.LoraConfig(r=4, target_modules=["o_proj"], lora_bias=True,
                                              init_lora_weights=False))
    model.base_model.set_adapter(["default", "bias"])
    merged = MergedAdapters("float")
    with triton_on_cpu(), merged.swapped(model):
        assert merged.nf4_layers == 0
        assert merged.not_merged == {"a LoRA variant (DoRA, ...) whose merge is not a weight sum": 4,
                                     "LoRA with a bias": 2}
    plain = with_lora(qlora_lm(lora=False))
    with merged.swapped(plain):  # no interpreter: a CPU tensor is not the kernel's
        assert merged.nf4_layers == 0 and _kernel_modules(plain) == []
        [(reason, count)] = merged.not_merged.items()
        assert count == QLORA_LAYERS and reason.startswith("4-bit base not taken by the 4-bit kernel (on cpu")
    expected = hf_greedy(plain, prompts(), 4, eos=VOCAB + 1)
    generator = EmbeddedGenerator(plain, PAD, [VOCAB + 1], max_new_tokens=4)
    notes = fallback_notes_of_two_calls(generator, expected)
    assert len(notes) == 1 and f"{QLORA_LAYERS} with 4-bit base not taken by the 4-bit kernel" in notes[0], notes


@pytest.mark.parametrize("mode", ["all", "none"])
def test_qlora_modes_all_and_none_do_not_use_the_kernel(mode):
    """"all" merges the 4-bit bases into copies in the compute dtype, "none" swaps nothing: no kernel either way."""
    from fastgrpo.kernels._dispatch import triton_on_cpu

    model = qlora_lm()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=5, merge_lora=mode)
    with triton_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        assert generator.generate(prompts(), temperature=0) == hf_greedy(model, prompts(), 5, eos=VOCAB + 1)
    merged = generator.engine._merged
    assert merged.nf4_layers == 0 and merged.not_merged == {}
    assert merged.merged_layers == (QLORA_LAYERS if mode == "all" else 0)
    # one copy a merged layer, q/k/v sharing one (joined)
    assert merged.joined_groups == (2 if mode == "all" else 0)
    assert len(merged.copies) == merged.merged_layers - 2 * merged.joined_groups


def test_qlora_kernel_modules_are_put_back_after_an_exception():
    from fastgrpo.integrations.generation.adapters import MergedAdapters
    from fastgrpo.kernels._dispatch import triton_on_cpu

    model = qlora_lm()
    before = dict(model.named_modules())
    merged = MergedAdapters("float")
    with pytest.raises(RuntimeError, match="stop"), triton_on_cpu(), merged.swapped(model):
        assert len(_kernel_modules(model)) == QLORA_LAYERS
        raise RuntimeError("stop")
    assert dict(model.named_modules()) == before and _kernel_modules(model) == []


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_qlora_decode_through_the_4bit_kernel(dtype, grouped, monkeypatch):
    """On CUDA: the 4-bit kernel inside inductor-compiled layers and captured decode steps, one launch a layer or
    (grouped: single quantization, two kv heads) one a sibling group. fp32: the greedy tokens of PEFT's forward; bf16:
    within the engine's own check against PEFT's forward (no fallback warning). Calls that replay every step give the
    same bits (the kernel's split-K sum has a fixed order)."""
    from fastgrpo.integrations.generation import adapters

    monkeypatch.setattr(adapters, "GROUP_FOUR_BIT", grouped)
    torch._dynamo.reset()
    model = qlora_lm(dtype=dtype, device="cuda", nested=not grouped, num_key_value_heads=2 if grouped else 1)
    batch = [p for p in prompts() for _ in range(4)]
    expected = hf_greedy(model, batch, 24, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=24)
    context = _strict()
    try:
        first = generator.generate(batch, temperature=0, return_logprobs=True)  # eager steps, then captured
        assert generator.lora_decoding["nf4_kernel"] == QLORA_LAYERS
        assert generator.lora_decoding["nf4_groups"] == (4 if grouped else 0)
        if dtype == torch.float32:
            assert first[0] == expected
        replayed = generator.generate(batch, temperature=0, return_logprobs=True)
        assert replayed[0] == first[0]
        assert generator.generate(batch, temperature=0, return_logprobs=True) == replayed
    finally:
        context.__exit__(None, None, None)


def test_four_bit_group_folds_differing_scalings_into_b():
    """A group whose members' LoRA scalings differ passes scaling 1 with each B scaled (refreshed per call); its
    product is each member's own, column by column."""
    from fastgrpo.integrations.generation.four_bit import FourBitGroup, FourBitLoRALinear, group_obstacle
    from fastgrpo.kernels._dispatch import triton_on_cpu

    model = qlora_lm(nested=False, num_key_value_heads=2)
    mlp = model.base_model.model.model.layers[0].mlp
    mlp.up_proj.scaling["default"] = 0.5
    members = [FourBitLoRALinear(mlp.gate_proj), FourBitLoRALinear(mlp.up_proj)]
    assert group_obstacle(members) is None
    group = FourBitGroup(members)
    assert group.scaling is None
    x = torch.randn(3, 64)
    with torch.no_grad(), triton_on_cpu():
        out = group.product(x)
        want = torch.cat([m(x) for m in members], dim=1)
        torch.testing.assert_close(out, want, atol=1e-4 * want.abs().max().item(), rtol=0)
        mlp.up_proj.lora_B["default"].weight.mul_(2.0)
        group.refresh()
        torch.testing.assert_close(group.product(x)[:, 128:], members[1](x), atol=1e-4 * want.abs().max().item(),
                                   rtol=0)
