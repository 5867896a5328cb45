"""LoRA decoded from the live weights (fastgrpo/integrations/generation/adapters.py): nothing weight-sized copied or
left stale, an optimizer-style update seen by the next call, the frozen bases merged in place for a call and given
back to the exact bits (also after a failing call; an undo that misses is refused loudly), tied or trained bases
merged into a copy, the active adapter and its scale followed, layers that cannot merge decoded unmerged with one
warning, and a bad merge mode refused at construction."""
import warnings

import peft
import pytest
import torch

from fastgrpo.integrations.generation import EmbeddedGenerator, GenerationFallbackWarning
from tests.test_generation import (
    EOS, PAD, PROMPT_LENGTHS, VOCAB, fallback_notes_of_two_calls, hf_greedy, prompts, tiny_lm, with_lora,
)


@pytest.mark.parametrize("merge", ["float", "none"])
def test_generates_from_the_live_weights(merge):
    """No trained weight is moved or copied stale, and the generator holds nothing weight-sized on the device but its
    KV cache and, merged (the default), each attention's joined q/k/v copy: the other frozen base weights take the
    adapters in place for the call and get their exact values back afterwards."""
    model = with_lora(tiny_lm("llama"))
    model.train()
    params = dict(model.named_parameters())
    before = {name: (p.data_ptr(), p.requires_grad) for name, p in params.items()}
    values = {name: p.detach().clone() for name, p in params.items()}
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10, merge_lora=merge)
    first = generator.generate(prompts(), temperature=0)

    assert {name: (p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()} == before
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), f"{name} not restored bit-exact"
    assert model.training, "training mode must be restored"
    assert not any(type(m) is torch.nn.Linear and "lora" not in name and not name.endswith("base_layer")
                   for name, m in model.named_modules() if "layers" in name), "LoRA layers must be restored"
    # The generator holds the model and its KV cache (on the attention modules), and the joined q/k/v copies.
    own = [v for v in vars(generator).values() if isinstance(v, torch.Tensor)]
    assert own == []
    lora_layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert len(generator.engine._merged._entries) == (len(lora_layers) if merge == "float" else 0)
    merged = generator.engine._merged
    assert merged.joined_groups == (2 if merge == "float" else 0)
    hidden, kv_width = 64, 32
    assert [tuple(c.shape) for c in merged.copies] == [(hidden + 2 * kv_width, hidden)] * merged.joined_groups
    caches = [m._fastgrpo_kv for m in model.modules() if "_fastgrpo_kv" in m.__dict__]
    kv_bytes = sum(t.numel() * t.element_size() for kv in caches for t in kv)
    heads, head_dim, layers, slots = 1, 32, 2, max(PROMPT_LENGTHS) + 10
    assert len(caches) == layers
    assert kv_bytes == 2 * layers * len(PROMPT_LENGTHS) * heads * slots * head_dim * 4

    # An in-place optimizer-style update is seen by the next call: there is no stale copy.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    second = generator.generate(prompts(), temperature=0)
    model.eval()
    assert second != first
    assert second == hf_greedy(model, prompts(), 10, eos=VOCAB + 1)


def test_merged_weights_follow_the_active_adapter_and_its_scale():
    """Switching adapters (new merged copies) or their weights between calls: each call decodes the active one."""
    model = with_lora(tiny_lm("qwen2"))
    torch.manual_seed(5)
    model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "down_proj"],
                                               init_lora_weights=False))
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12)
    outputs = []
    for adapter in ["default", "other", "default"]:
        model.set_adapter(adapter)
        got = generator.generate(prompts(), temperature=0)
        assert got == hf_greedy(model, prompts(), 12, eos=VOCAB + 1), adapter
        outputs.append(got)
        expected_layers = 14 if adapter == "default" else 4  # all-linear on 2 layers; q_proj and down_proj on 2
        assert len(generator.engine._merged._entries) == expected_layers
    assert outputs[0] == outputs[2] != outputs[1]


def test_shared_or_trained_bases_merge_into_a_copy_and_written_bases_are_taken_again():
    """A base weight tied to another module (lm_head and the embedding) or one being trained is never written: it is
    merged into a device copy. A frozen base written between calls (a loaded checkpoint) is taken again, not
    restored to its old values."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "up_proj", "lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(tiny_lm("llama"), config)
    trained = model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight
    trained.requires_grad_(True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10)
    assert generator.generate(prompts(), temperature=0) == hf_greedy(model, prompts(), 10, eos=VOCAB + 1)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    merged = generator.engine._merged
    assert len(merged.copies) == 2  # lm_head (tied) and the trained up_proj; the other three in place
    assert len(merged._entries) == 5

    q_proj = model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight
    with torch.no_grad():
        q_proj.mul_(-1.0)
    written = q_proj.detach().clone()
    assert generator.generate(prompts(), temperature=0) == hf_greedy(model, prompts(), 10, eos=VOCAB + 1)
    assert torch.equal(q_proj, written)


def test_a_failing_call_leaves_the_base_weights_exact(monkeypatch):
    model = with_lora(tiny_lm("qwen2"))
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=10)
    generator.generate(prompts(), temperature=0)

    def fail(*args, **kwargs):
        raise RuntimeError("stop")

    monkeypatch.setattr(generator.engine, "_run", fail)
    with pytest.warns(GenerationFallbackWarning):
        generator.generate(prompts(), temperature=0)  # the engine fails mid-call; model.generate finishes it
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), name


def test_layers_that_cannot_merge_decode_unmerged_with_one_warning():
    """DoRA's merge is not a weight sum: those layers run PEFT's forward (compute-dtype factors), named once."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_dora=True,
                             init_lora_weights=False)
    model = peft.get_peft_model(tiny_lm("llama"), config)
    for name, p in model.named_parameters():  # DoRA starts at the identity; move it off
        if "lora_magnitude" in name:
            p.data.mul_(1.5)
    expected = hf_greedy(model, prompts(), 12, eos=VOCAB + 1)
    generator = EmbeddedGenerator(model, PAD, [VOCAB + 1], max_new_tokens=12)
    notes = fallback_notes_of_two_calls(generator, expected)
    assert len(notes) == 1 and "4 with a LoRA variant (DoRA" in notes[0], notes
    assert generator.engine._merged._entries == []


def test_a_bad_merge_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match="merge_lora must be one of"):
        EmbeddedGenerator(tiny_lm("llama"), PAD, [EOS], max_new_tokens=4, merge_lora="yes")


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_merge_is_undone_to_the_exact_bits(dtype, device, kernel, monkeypatch):
    """W <- round(W + delta), then the undo round(merged - delta) and the kept elements where it misses: every bit
    of W back, including elements whose sum rounded across a power of two (the undo alone gets those wrong), signed
    zeros, and a NaN; through `fastgrpo.kernels.lora_merge` and through torch's passes (MERGE_KERNEL off)."""
    from fastgrpo.integrations.generation import adapters
    from fastgrpo.integrations.generation.adapters import MergedAdapters

    monkeypatch.setattr(adapters, "MERGE_KERNEL", kernel)

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=False)
    model = peft.get_peft_model(torch.nn.Sequential(layer), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"],
                                                                            init_lora_weights=False))
    base = model.base_model.model[0].base_layer
    with torch.no_grad():
        base.weight.mul_(0.05)
        base.weight.view(-1)[:256] = 2.0 ** torch.randint(-3, 3, (256,)).float() * (1 - 2.0 ** -7)  # below a power
        base.weight.view(-1)[256] = -0.0
        base.weight.view(-1)[257] = float("nan")
    model.to(device)
    base.to(dtype)
    before = base.weight.detach().clone()
    merged = MergedAdapters("float")
    with merged.swapped(model):
        entry = merged._entries[0]
        assert entry.in_place and model.base_model.model[0] is base  # the base itself decodes
        assert (entry.stats is not None) == kernel
        assert not torch.equal(base.weight.view(-1)[258:], before.view(-1)[258:])  # it holds the merged values
        missed = entry.fixes[0].numel()
    bits = {2: torch.int16, 4: torch.int32}[before.element_size()]
    assert torch.equal(base.weight.view(bits), before.view(bits))
    assert missed > 0 if dtype != torch.float32 else True  # the kept elements were needed


@pytest.mark.parametrize("kernel", [True, False])
def test_an_undo_that_misses_is_refused_loudly(monkeypatch, kernel):
    """If the delta came out differently at the undo (a nondeterministic GEMM), the bit-sum check says so, naming
    the fix, instead of leaving the base weight changed in silence: through the merge kernel's factors and through
    PEFT's delta (MERGE_KERNEL off)."""
    from fastgrpo.integrations.generation import adapters
    from fastgrpo.integrations.generation.adapters import MergedAdapters, MergeNotUndone

    monkeypatch.setattr(adapters, "MERGE_KERNEL", kernel)
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(32, 32)),
                                peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    merged = MergedAdapters("float")
    name = "_factors" if kernel else "_delta"
    real = getattr(MergedAdapters, name)
    calls = []  # layers whose delta was taken: a layer's second delta (its undo) drifts

    def drifting(layer):
        calls.append(id(layer))
        got = real(layer)
        if calls.count(id(layer)) == 1:
            return got
        return (got[0], got[1] * (1 + 2.0 ** -10)) if kernel else got * (1 + 2.0 ** -10)

    monkeypatch.setattr(MergedAdapters, name, staticmethod(drifting))
    with pytest.raises(MergeNotUndone, match="merge_lora='none'"):
        with merged.swapped(model):
            pass
    calls.clear()  # through the generator: raised to the caller, not taken for a model the engine cannot run
    generator = EmbeddedGenerator(with_lora(tiny_lm("llama")), PAD, [VOCAB + 1], max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerationFallbackWarning)
        with pytest.raises(MergeNotUndone):
            generator.generate(prompts(), temperature=0)


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (6, 8)), (torch.float16, (3, 3)), (torch.float32, (5, 2)),
                                         (torch.bfloat16, (3, 5))])
def test_the_bit_sum_sees_any_one_changed_element(dtype, shape):
    """Whole 8-byte words (one read) or widened elements (sizes that are not whole words): either way a weight that
    differs from the original in one element's bits, even its lowest, has another bit sum."""
    from fastgrpo.integrations.generation.adapters import _BITS, _bit_sum

    torch.manual_seed(0)
    weight = torch.randn(shape).to(dtype)
    before = _bit_sum(weight)
    bits = weight.view(_BITS[weight.element_size()])
    for i in range(weight.numel()):
        changed = bits.clone()
        changed.view(-1)[i] ^= 1
        assert _bit_sum(changed.view(dtype)) != before
    assert _bit_sum(weight.clone()) == before
