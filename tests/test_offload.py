"""Offloaded activation checkpointing (fastgrpo.compiler.offload) and its wiring.

Loss and every gradient must equal plain non-reentrant checkpointing and no checkpointing, eager and
with the layers compiled; layer inputs must live in the host buffers (not on the compute device)
between forward and backward; buffers must be reused across steps; disable() must restore the model;
HF's checkpointing flag must switch the offloading (never nest HF's checkpoint in ours);
`compile_repeated_blocks(..., offload_checkpointing=True)` and the trainer flag
`fastgrpo_offload_checkpointing` must give the same loss and LoRA gradients as without it.
"""
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import fastgrpo
from fastgrpo.compiler import checkpoint_node, offload
from fastgrpo.compiler.regions import repeated_blocks
from fastgrpo.compiler.tiny import tiny_model
from fastgrpo.compiler.offload import (
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_handle,
)
from fastgrpo.compiler.options import Options

LAYERS = 4  # 3 offloaded + 1 kept: the prefetch chain has more than one link
EAGER = {"inner": "eager"}


pytestmark = pytest.mark.usefixtures("one_thread")


def make(arch, lora, device="cpu", **overrides):
    return tiny_model(arch, lora=lora, **({"num_hidden_layers": LAYERS} | overrides)).to(device)


def batch(device="cpu", rows=2, length=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the layers get a real attention mask
    return ids.to(device), mask.to(device)


def loss_of(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return (logits.log_softmax(-1)[..., 5] * mask).sum() / mask.sum()


def step(model, ids, mask):
    """Loss and every parameter gradient of one forward + backward."""
    loss = loss_of(model, ids, mask)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(ref, got, rtol=1e-5, atol=1e-6):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert grads.keys() == ref_grads.keys() and grads
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)


def max_differences(ref, got) -> dict:
    """Largest absolute difference of the loss ("loss") and of each gradient between two steps."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert grads.keys() == ref_grads.keys() and grads
    return {"loss": (loss - ref_loss).abs().item()} | {
        name: (grads[name] - ref_grads[name]).abs().max().item() for name in ref_grads}


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("qwen3", True)])
def test_equals_plain_and_hf_checkpointing(arch, lora):
    model = make(arch, lora)
    ids, mask = batch()
    reference = step(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(reference, step(model, ids, mask))
    with enable_offloaded_checkpointing(model) as handle:
        # HF's per-layer flag now reads (and switches) ours; HF's own checkpoint must never run.
        assert model.is_gradient_checkpointing and offload_handle(model) is handle
        for block in repeated_blocks(model):
            block._gradient_checkpointing_func = hf_checkpoint_must_not_run
        offloaded = step(model, ids, mask)
        assert_same(reference, offloaded, rtol=0, atol=0)  # the same ops on the same values
        assert handle.stats.offloaded == LAYERS - 1 and handle.stats.kept == 1
        # Every copy back was started one layer ahead, none waited for on demand (as the layer's recompute started:
        # these layers have no gated-MLP op to say when their backward's peak has passed).
        assert handle.stats.prefetched == LAYERS - 1 and handle.stats.loaded_on_demand == 0
        assert handle.stats.prefetched_after_peak == 0
        # torch.autograd.grad works too (non-reentrant checkpointing underneath).
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_of(model, ids, mask), params)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, grad in zip(names, grads):
            torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
    assert all(block.gradient_checkpointing for block in repeated_blocks(model))
    assert offload_handle(model) is None


def test_dropout_masks_are_replayed_in_the_recompute():
    """Attention dropout draws from the RNG in the forward; the recompute must draw the same masks (the forward's RNG
    state restored), so the step equals one without checkpointing from the same seed, to the bit."""
    model = make("llama", lora=True, attention_dropout=0.3)
    ids, mask = batch()
    torch.manual_seed(7)
    reference = step(model, ids, mask)
    with enable_offloaded_checkpointing(model):
        torch.manual_seed(7)
        offloaded = step(model, ids, mask)
        torch.manual_seed(8)
        other_seed = step(model, ids, mask)
    assert_same(reference, offloaded, rtol=0, atol=0)
    assert other_seed[0] != reference[0]  # the masks matter


def test_under_autocast_the_gradients_equal_torchs_checkpoint():
    """The recompute replays the forward's autocast; the backward of the recomputed graph runs as torch's checkpoint
    runs it, under the backward's own state (autocast off), not the forward's: equal to the bit."""
    model = make("llama", lora=True)
    ids, mask = batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def autocast_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, ids, mask)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    reference = autocast_step()
    with enable_offloaded_checkpointing(model):
        offloaded = autocast_step()
    assert_same(reference, offloaded, rtol=0, atol=0)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden_states, scale):
        return torch.tanh(self.linear(hidden_states)) * scale


class _ScaledStack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Scaled() for _ in range(3))

    def forward(self, x, scale):
        for layer in self.layers:
            x = layer(x, scale)
        return x


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("scale_needs_grad", [True, False])
def test_a_layer_input_besides_the_hidden_states_that_requires_grad_gets_its_gradient(lean, scale_needs_grad,
                                                                                       monkeypatch):
    """`LayerCheckpoint`'s node takes the hidden states and the parameters as inputs; a layer called with another
    input that requires grad goes through torch's checkpoint instead, and that input's gradient is right."""
    monkeypatch.setattr(offload, "LEAN_CHECKPOINT", lean)
    model = _ScaledStack()
    x = torch.randn(4, 8, requires_grad=True)
    nodes = []

    def grads_of():
        scale = torch.tensor(1.5, requires_grad=scale_needs_grad)
        model.zero_grad()
        x.grad = None
        out = model(x, scale)
        nodes.append(type(out.grad_fn).__name__)
        out.square().sum().backward()
        return [scale.grad, x.grad] + [p.grad.clone() for p in model.parameters()]

    expected = grads_of()
    with enable_offloaded_checkpointing(model) as handle:
        got = grads_of()
        assert handle.stats.offloaded == 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (nodes[1] == "LayerCheckpointBackward") == (lean and not scale_needs_grad)


class _Nested(_Scaled):
    def forward(self, hidden_states, scale):
        out = super().forward(hidden_states, scale)
        return out, (out.sum(),)  # a nested tuple: not what the checkpoint node returns


class _NestedStack(_ScaledStack):
    def __init__(self):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Nested() for _ in range(3))

    def forward(self, x, scale):
        total = 0
        for layer in self.layers:
            x, (partial,) = layer(x, scale)
            total = total + partial
        return x, total


def test_a_layer_whose_output_is_nested_falls_back_to_torchs_checkpoint_once_with_a_warning():
    model = _NestedStack()
    x = torch.randn(4, 8, requires_grad=True)

    def grads_of():
        model.zero_grad()
        x.grad = None
        out, total = model(x, 1.5)
        (out.square().sum() + total).backward()
        return [x.grad] + [p.grad.clone() for p in model.parameters()]

    expected = grads_of()
    with enable_offloaded_checkpointing(model) as handle:
        with pytest.warns(UserWarning, match=r"_Nested \(layer 0\) runs under torch.utils.checkpoint.*a tuple of "
                                             r"\(Tensor, tuple\)") as caught:
            got = grads_of()
        assert sum("runs under torch.utils.checkpoint" in str(w.message) for w in caught) == 3  # once a layer
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = grads_of()
        # Two offloaded layers (the last one's input is kept), copied twice in the first call (the node's attempt,
        # then torch's checkpoint) and once in the second.
        assert handle.stats.offloaded == 6
    for a, b, c in zip(got, expected, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(c, b, rtol=0, atol=0)


def test_a_recomputed_output_is_freed_only_where_its_graph_did_not_save_it():
    """The recompute's layer output is the root of `torch.autograd.grad`, which needs its graph, not its values: its
    memory is freed unless the compiled region's node saved it for its own backward."""
    torch._dynamo.reset()
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    out = torch.compile(lambda x, w: x @ w + 1, backend="aot_eager")(x, w)
    assert checkpoint_node.release_values(out, x) and out.untyped_storage().nbytes() == 0
    (grad,) = torch.autograd.grad(out, [w], torch.ones(3, 4))
    torch.testing.assert_close(grad, x.t() @ torch.ones(3, 4))
    out = torch.compile(lambda x, w: torch.exp(x @ w), backend="aot_eager")(x, w)  # exp's backward reads its output
    assert not checkpoint_node.release_values(out, x) and out.untyped_storage().nbytes() > 0
    assert not checkpoint_node.release_values(x @ w, x)  # an eager node: its saved tensors are not checked, so kept


def hf_checkpoint_must_not_run(*args, **kwargs):
    raise AssertionError("HF's checkpoint ran inside offloaded checkpointing")


@pytest.mark.parametrize("arch,save_projections", [("llama", False), ("llama", True), ("qwen3", True), ("phi3", False),
                                                   ("gemma2", False)])
def test_compiled_layers(arch, save_projections, monkeypatch):
    """Layers compiled one region each by the fastgrpo backend; the checkpoint stays outside them. Where the MLP's
    output only reaches the layer's output through the residual add, the checkpoint's recompute of a layer skips
    the MLP (its activation and down projection; all of it when the op recomputes the projections in backward
    anyway): the full MLP forward runs once per layer and step. Gemma2's post-feedforward norm saves the MLP's
    output, so there the recompute computes it. The gradients are unchanged either way."""
    from fastgrpo.kernels import _dispatch
    from fastgrpo.kernels import gated_mlp as gated_mlp_ops

    full_mlp_forwards = []
    forward_rows = gated_mlp_ops._forward_rows
    monkeypatch.setattr(gated_mlp_ops, "_forward_rows", lambda *a: full_mlp_forwards.append(1) or forward_rows(*a))
    torch._dynamo.reset()
    model = make(arch, lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    compiled = make(arch, lora=True)
    fastgrpo.clear_fusion_reports()
    fastgrpo.compile_repeated_blocks(compiled.get_base_model(), options=EAGER | {"save_mlp_projections": save_projections})
    handle = enable_offloaded_checkpointing(compiled)
    # In backward, each layer's gated-MLP backward (its peak passing) comes before the copy back of the layer
    # before's input, which then overlaps the rest of the layer's backward.
    events = []
    peak_passed, copy_back = _dispatch.backward_peak_passed, handle._copy_back
    monkeypatch.setattr(_dispatch, "backward_peak_passed", lambda: events.append("peak") or peak_passed())
    monkeypatch.setattr(gated_mlp_ops._dispatch, "backward_peak_passed", _dispatch.backward_peak_passed)
    handle._copy_back = lambda saved: events.append("copy") or copy_back(saved)
    for _ in range(2):
        assert_same(reference, step(compiled, ids, mask))
    assert events == (["peak", "copy"] * (LAYERS - 1) + ["peak"]) * 2, events
    assert handle.stats.prefetched == handle.stats.prefetched_after_peak == 2 * (LAYERS - 1)
    skips = arch != "gemma2"
    assert len(full_mlp_forwards) == (2 if skips else 4) * LAYERS
    # The layer graphs went through the backend (the rewrite happened) and hold no offload logic.
    reports = fastgrpo.fusion_reports()
    assert reports and sum(r["patterns"]["rms_norm"]["matched"] for r in reports) > 0
    mlp_sites = [site for r in reports for site in r["patterns"]["gated_mlp"]["sites"]]
    recompute = "output skipped in checkpoint recompute" if skips else "output computed in checkpoint recompute"
    assert mlp_sites and all(recompute in site["form"] for site in mlp_sites)
    assert handle.stats.offloaded == 2 * (LAYERS - 1) and handle.stats.loaded_on_demand == 0


def test_a_peak_signal_that_never_comes_loads_on_demand(monkeypatch):
    """A layer whose gated-MLP forward promised the signal but whose backward never gives it: the deferred copy back
    is dropped when the layer before's recompute arrives, which then loads its input on demand (same gradients)."""
    from fastgrpo.kernels import gated_mlp as gated_mlp_ops

    torch._dynamo.reset()
    model, compiled = make("llama", lora=True), make("llama", lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    fastgrpo.compile_repeated_blocks(compiled.get_base_model(), options=EAGER)
    handle = enable_offloaded_checkpointing(compiled)
    monkeypatch.setattr(gated_mlp_ops._dispatch, "backward_peak_passed", lambda: None)
    assert_same(reference, step(compiled, ids, mask))
    assert handle.stats.prefetched == 0 and handle.stats.loaded_on_demand == LAYERS - 1


@pytest.mark.parametrize("arch,inner", [("llama", "eager"), ("qwen3", "inductor"), ("gemma2", "aot_eager")])
def test_recompute_takes_back_the_attention_output(arch, inner, monkeypatch):
    """With the attention sites as fastgrpo::attention, each layer's attention output and log-sum-exp wait in the
    host buffers beside the layer's input (the last layer's on the device), and the checkpoint's recompute gets
    them back: attention's kernel runs once per layer and step, not twice. Gradients are those of the model
    without checkpointing."""
    from fastgrpo.kernels import attention as attention_kernel

    attention_forwards = []
    kernel = attention_kernel._kernel_forward

    def counted(query, *args):
        if not isinstance(query, torch._subclasses.FakeTensor):  # not the compiler's tracing with fakes
            attention_forwards.append(1)
        return kernel(query, *args)

    monkeypatch.setattr(attention_kernel, "_kernel_forward", counted)
    torch._dynamo.reset()
    ids, mask = batch()
    reference = step(make(arch, lora=True), ids, mask)
    compiled = make(arch, lora=True)
    fastgrpo.clear_fusion_reports()
    fastgrpo.compile_repeated_blocks(compiled.get_base_model(), options={"inner": inner, "keep_attention_output": True})
    handle = enable_offloaded_checkpointing(compiled)
    for steps in (1, 2):
        assert_same(reference, step(compiled, ids, mask), rtol=1e-4, atol=1e-5)
        assert len(attention_forwards) == steps * LAYERS
    sites = [site for r in fastgrpo.fusion_reports() for site in r["patterns"]["attention"]["sites"]]
    assert sites and all(site["form"] == "CPU flash, output kept for a checkpoint's re-run" for site in sites)
    stats = handle.stats
    assert stats.outputs_offloaded == 2 * 2 * (LAYERS - 1) and stats.outputs_on_device == 2 * 2
    assert stats.outputs_replayed == 2 * LAYERS and stats.outputs_missing == 0 and stats.loaded_on_demand == 0
    assert any(isinstance(key, tuple) for key in handle.host_buffers())  # the outputs' own host buffers


def test_kept_attention_outputs_stay_with_their_call():
    """Two forwards before their backwards (each layer call keeps its own outputs), and a backward run twice with
    retain_graph (the second recompute copies the kept outputs back again): gradients stay exact."""
    torch._dynamo.reset()
    model = make("qwen2", lora=True)
    first, second = batch(seed=1), batch(seed=2)
    grads_first, grads_second = step(model, *first)[1], step(model, *second)[1]
    fastgrpo.compile_repeated_blocks(model.get_base_model(), options=EAGER | {"keep_attention_output": True})
    handle = enable_offloaded_checkpointing(model)
    losses = [loss_of(model, *first), loss_of(model, *second)]
    (losses[0] + losses[1]).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads_first[name] + grads_second[name], rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, *first)
    loss.backward(retain_graph=True)
    loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, 2 * grads_first[name], rtol=1e-4, atol=1e-6, msg=name)
    assert handle.stats.outputs_replayed == 4 * LAYERS and handle.stats.outputs_missing == 0


def test_whole_model_compile():
    """Under a whole-model torch.compile each layer call is a graph break; results stay exact."""
    torch._dynamo.reset()
    model = make("llama", lora=False)
    ids, mask = batch()
    reference = step(model, ids, mask)
    handle = enable_offloaded_checkpointing(model)
    model.model.compile(backend="fastgrpo", options=EAGER)  # in place: parameter names unchanged
    assert_same(reference, step(model, ids, mask))
    assert handle.stats.offloaded == LAYERS - 1


def test_layer_inputs_live_in_host_buffers():
    """Between forward and backward, the offloaded layer inputs exist only as copies in the buffers."""
    model = make("llama", lora=True)
    ids, mask = batch()
    handle = enable_offloaded_checkpointing(model)
    inputs = {}  # layer -> (weak reference to the input's storage, a copy of its values)

    def record(layer):
        def hook(module, args):
            if layer not in inputs:  # the forward call, not the recompute (the layer may see an alias of its input)
                inputs[layer] = (weakref.ref(args[0].untyped_storage()), args[0].detach().clone())
        return hook

    hooks = [block.register_forward_pre_hook(record(i)) for i, block in enumerate(repeated_blocks(model))]
    loss = loss_of(model, ids, mask)
    gc.collect()
    buffers = handle.host_buffers()
    for layer in range(LAYERS - 1):
        alive, values = inputs[layer]
        assert alive() is None, f"layer {layer}'s input is still held on the compute device"
        (host,) = buffers[layer]
        torch.testing.assert_close(host.view(values.dtype).view(values.shape), values, rtol=0, atol=0)
    alive, _ = inputs[LAYERS - 1]
    assert alive() is not None and LAYERS - 1 not in buffers  # the last layer's input is kept
    loss.backward()
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_input_embeddings_leaf_is_not_held(arch):
    """PEFT's gradient_checkpointing_enable hooks the input embeddings to return a leaf that requires grad
    (enable_input_require_grads), which the leaf's AccumulateGrad node holds until backward. While offloading, the
    embeddings return an alias that is no leaf: it and the leaf are freed after the forward; gradients are unchanged."""
    model = make(arch, lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    leaves, layer_inputs = [], []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: leaves.append(weakref.ref(out)), prepend=True)
    repeated_blocks(model)[0].register_forward_pre_hook(lambda m, args: layer_inputs.append(weakref.ref(args[0])))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def freed_after_forward() -> bool:
        loss = loss_of(model, ids, mask)
        gc.collect()
        freed = leaves[-1]() is None and layer_inputs[-1]() is None
        loss.backward()
        model.zero_grad(set_to_none=True)
        return freed

    assert not freed_after_forward()  # HF's checkpointing: the leaf waits for backward
    with enable_offloaded_checkpointing(model):
        assert freed_after_forward()
        assert_same(reference, step(model, ids, mask), rtol=0, atol=0)
    assert not freed_after_forward()  # disabled: as before


def test_buffers_reused_across_steps():
    model = make("qwen3", lora=True)
    handle = enable_offloaded_checkpointing(model)
    short, long = batch(length=12), batch(length=20)
    step(model, *short)
    pointers = {layer: [b.data_ptr() for b in bufs] for layer, bufs in handle.host_buffers().items()}
    assert handle.stats.host_allocations == LAYERS - 1
    step(model, *short)
    assert handle.stats.host_allocations == LAYERS - 1
    assert {layer: [b.data_ptr() for b in bufs] for layer, bufs in handle.host_buffers().items()} == pointers
    step(model, *long)  # a larger input grows each layer's buffer once
    assert handle.stats.host_allocations == 2 * (LAYERS - 1)
    step(model, *short)
    step(model, *long)
    assert handle.stats.host_allocations == 2 * (LAYERS - 1)
    assert handle.stats.host_bytes == (LAYERS - 1) * 2 * 20 * 64 * 4  # rows x tokens x hidden x fp32


def test_two_forwards_before_backward():
    """Gradient accumulation through one summed loss: each forward gets its own buffers."""
    model = make("llama", lora=True)
    first, second = batch(seed=1), batch(seed=2)
    loss = loss_of(model, *first) + loss_of(model, *second)
    loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    handle = enable_offloaded_checkpointing(model)
    (loss_of(model, *first) + loss_of(model, *second)).backward()
    for name, param in model.named_parameters():
        if name in reference:
            torch.testing.assert_close(param.grad, reference[name], rtol=0, atol=0, msg=name)
    assert handle.stats.host_allocations == 2 * (LAYERS - 1)
    model.zero_grad(set_to_none=True)
    step(model, *first)  # the buffers are free again once the graph is gone
    assert handle.stats.host_allocations == 2 * (LAYERS - 1)


def test_retain_graph_and_keep_last():
    model = make("llama", lora=False)
    ids, mask = batch()
    _, reference = step(model, ids, mask)
    handle = enable_offloaded_checkpointing(model, keep_last=0)
    loss = loss_of(model, ids, mask)
    loss.backward(retain_graph=True)
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, 2 * reference[name], rtol=1e-6, atol=1e-7, msg=name)
    # keep_last=0: all LAYERS inputs offloaded; the second backward loads its first layer on demand.
    assert handle.stats.offloaded == LAYERS and handle.stats.kept == 0
    assert handle.stats.loaded_on_demand == 2


def test_hidden_states_by_keyword():
    """A layer called as layer(hidden_states=..., ...) offloads the same input."""
    model = make("llama", lora=False)
    base = model.model
    x = torch.randn(2, 12, 64, requires_grad=True)
    position_ids = torch.arange(12)[None].expand(2, -1)
    rope = base.rotary_emb(x, position_ids)

    def run(by_keyword):
        h = x
        for block in base.layers:
            h = block(hidden_states=h, position_embeddings=rope) if by_keyword else block(h, position_embeddings=rope)
        h.square().mean().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in base.layers.parameters()]
        x.grad = None
        model.zero_grad(set_to_none=True)
        return grads

    reference = run(by_keyword=False)
    handle = enable_offloaded_checkpointing(model)
    for got in (run(by_keyword=True), run(by_keyword=False)):
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert handle.stats.offloaded == 2 * (LAYERS - 1)


def test_inference_passes_through_and_disable_restores():
    model = make("llama", lora=True)
    ids, mask = batch()
    classes = [type(block) for block in repeated_blocks(model)]
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
    handle = enable_offloaded_checkpointing(model)
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_offloaded_checkpointing(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference, rtol=0, atol=0)
    model.eval()
    with torch.enable_grad():
        model(input_ids=ids, attention_mask=mask)
    model.train()
    assert handle.stats.offloaded == 0 and handle.stats.kept == 0  # nothing was checkpointed
    step(model, ids, mask)
    assert handle.stats.host_bytes > 0
    assert disable_offloaded_checkpointing(model)
    assert not disable_offloaded_checkpointing(model)
    assert [type(block) for block in repeated_blocks(model)] == classes
    assert not any("_fastgrpo_offload" in block.__dict__ for block in repeated_blocks(model))
    assert handle.host_buffers() == {} and handle.stats.host_bytes == 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference, rtol=0, atol=0)


def test_hf_flag_switches_offloading():
    """gradient_checkpointing_disable()/_enable() (what TRL does around generation and no-grad passes, and
    Trainer.train() at the start) pause and resume the offloading; HF's checkpoint never runs."""
    model = make("llama", lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    handle = enable_offloaded_checkpointing(model)
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    assert_same(reference, step(model, ids, mask), rtol=0, atol=0)
    assert handle.stats.offloaded == 0  # paused: the layers ran plainly
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # reentrant: ignored
    assert model.is_gradient_checkpointing
    for block in repeated_blocks(model):
        block._gradient_checkpointing_func = hf_checkpoint_must_not_run
    assert_same(reference, step(model, ids, mask), rtol=0, atol=0)
    assert handle.stats.offloaded == LAYERS - 1
    handle.disable()
    assert not any(block.gradient_checkpointing for block in repeated_blocks(model))  # as before enabling


@pytest.mark.parametrize("peft_wrapper", [False, True])
def test_compile_repeated_blocks_with_offload(peft_wrapper):
    """One call compiles the layers with the backend and offloads their inputs; on the PeftModel itself too."""
    torch._dynamo.reset()
    model = make("qwen3", lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    target = model if peft_wrapper else model.get_base_model()
    fastgrpo.clear_fusion_reports()
    torch._dynamo.utils.counters.clear()
    assert fastgrpo.compile_repeated_blocks(target, options=EAGER, dynamic=True, offload_checkpointing=True) == LAYERS
    for length in (12, 17):
        ids, mask = batch(length=length)
        model.gradient_checkpointing_disable()
        reference = step(model, ids, mask)  # the same compiled layers, offloading paused
        model.gradient_checkpointing_enable()
        assert_same(reference, step(model, ids, mask))
    handle = offload_handle(model)
    assert handle.stats.offloaded == 2 * (LAYERS - 1) and handle.stats.loaded_on_demand == 0
    reports = fastgrpo.fusion_reports()
    assert reports and sum(r["patterns"]["rms_norm"]["matched"] for r in reports) > 0
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("where", ["options", "inductor"])
def test_offload_refuses_inductor_cuda_graphs_naming_the_fix(where):
    """Inductor's cudagraph trees do not run the offloaded checkpoint's order: refused before anything compiles."""
    import contextlib

    from torch._inductor import config as inductor_config

    from fastgrpo.errors import UserError

    model = make("llama", lora=False)
    options = dict(EAGER)
    if where == "options":
        options["inductor_config"] = {"triton.cudagraphs": True}
    # inductor's config.patch puts the global setting back (monkeypatch's undo deletes the config key)
    globally = inductor_config.patch({"triton.cudagraphs": True}) if where == "inductor" else contextlib.nullcontext()
    with globally, pytest.raises(UserError, match="offload_checkpointing=False"):
        fastgrpo.compile_repeated_blocks(model, options=options, offload_checkpointing=True)
    assert inductor_config.triton.cudagraphs is False
    assert not any(getattr(block, "_fastgrpo_compiled", False) for block in repeated_blocks(model))
    fastgrpo.compile_repeated_blocks(model, options=options)  # without offloading: the user's choice


def test_generation_with_cache_runs_compiled_layers_eagerly():
    """A KV-cache call would make one graph per layer (the cache update keys on the layer index) and exhaust
    Dynamo's recompile limit: compiled repeated blocks run such calls uncompiled."""
    from fastgrpo.integrations.generation import EmbeddedGenerator

    torch._dynamo.reset()
    model = make("llama", lora=False, num_hidden_layers=10)  # more layers than the recompile limit (8)
    prompts = [[5, 6, 7, 8], [9, 10]]

    def greedy():
        return EmbeddedGenerator(model, pad_token_id=0, eos_token_ids=[2], max_new_tokens=5).generate(
            prompts, temperature=0)

    expected = greedy()
    fastgrpo.compile_repeated_blocks(model, options=EAGER, dynamic=True, offload_checkpointing=True)
    torch._dynamo.utils.counters.clear()
    step(model, *batch())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert greedy() == expected
    with torch.no_grad():  # a no-grad pass without a cache (TRL's log-prob passes) is compiled
        model(input_ids=batch()[0], use_cache=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_training_forward_with_a_cache_says_the_layers_run_uncompiled():
    torch._dynamo.reset()
    model = make("llama", lora=False)
    fastgrpo.compile_repeated_blocks(model, options=EAGER)
    model.train()
    with pytest.warns(UserWarning, match="pass use_cache=False"):
        model(input_ids=batch()[0], use_cache=True).logits.sum().backward()


def test_backend_option_points_to_compile_repeated_blocks():
    with pytest.raises(ValueError, match=r"compile_repeated_blocks\(model, offload_checkpointing=True\)"):
        Options.parse({"offload_checkpointing": True})
    with pytest.raises(ValueError, match="unknown fastgrpo backend option"):
        Options.parse({"inner_compiler": "eager"})


@pytest.mark.parametrize("device,keep_attention", [("cpu", False), ("cpu", True),
                                                   pytest.param("cuda", False, marks=pytest.mark.gpu),
                                                   pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_trainer_flag_matches_plain_checkpointing(tmp_path, device, keep_attention):
    """fastgrpo's GRPOTrainer with fastgrpo_offload_checkpointing: the same loss and LoRA gradients as without it
    (fixed completions, the layers compiled one region each on both sides), TRL's checkpointing toggles pass through, and
    the policy's layer inputs are in the host buffers between forward and backward. On CUDA: the backend's
    default inner compiler, fp32, side-stream copies into pinned buffers. With `keep_attention`, the recompute
    takes the layers' attention outputs back: on the CPU those of fastgrpo::attention (padded rows); on CUDA, in
    bf16, those of fastgrpo::flash_packed_attention (packed rows on flash's variable-length kernel), the graphs
    run as traced (inner "eager"), so that both sides round alike in bf16."""
    from datasets import Dataset
    from peft import LoraConfig

    import fastgrpo.integrations.trl as F
    from tests.test_trl_integration import (
        LORA, PROMPTS, VOCAB, common_args, low_id_fraction, lora_params, make_inputs, set_params,
    )
    from tests.tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(PROMPTS + ["the quick brown fox jumps", "a b c d e f g"], VOCAB)
    layers = 3
    packed_bf16 = device == "cuda" and keep_attention

    def trainer(offload: bool):
        torch.manual_seed(0)
        model = tiny_model(
            "qwen2", vocab_size=VOCAB, num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
        args = F.GRPOConfig(**common_args(
            # num_iterations=2: TRL runs a no-grad old-policy pass (toggling checkpointing off and on around it).
            tmp_path, num_iterations=2, beta=0.0, loss_type="dapo", bf16=packed_bf16, fastgrpo_mini_batch=3,
            # Inductor would fuse one layer compiled alone otherwise than the whole decoder: in bf16 the two
            # sides would then differ by their roundings, which would hide what the keep changes.
            fastgrpo_compile_options={"inner": "eager", "keep_attention_output": keep_attention}
            if device == "cpu" or packed_bf16 else None,
            # Packed rows on the CPU attend through SDPA a segment at a time, which keeps nothing.
            fastgrpo_packing=True if packed_bf16 else False if keep_attention else "auto",
            fastgrpo_offload_checkpointing=offload, use_cpu=device == "cpu"))
        built = F.GRPOTrainer(model=model, reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA))
        # What Trainer.train() does first; with offloading it switches ours on, not HF's.
        built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return built

    results = []
    for offload in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        t = trainer(offload)
        set_params(t.model, seed=1, scale=0.3, only_lora=True)
        inputs = make_inputs(t, tokenizer.eos_token_id)  # TRL toggles checkpointing off and on around its passes
        set_params(t.model, seed=2, scale=0.3, only_lora=True)
        t.model.zero_grad(set_to_none=True)
        t.current_gradient_accumulation_steps = 1
        handle = offload_handle(t.model)
        recorded = []
        if offload:
            assert t.model.is_gradient_checkpointing and handle.stats.offloaded == 0  # no-grad passes: nothing saved
            blocks = repeated_blocks(t.model)
            for block in blocks:
                block._gradient_checkpointing_func = hf_checkpoint_must_not_run
            # Inputs of the forward calls (a recompute in backward would add more; there is none before it). The
            # hook runs in its own frame (nn.Module's call machinery is not traced): keep Dynamo off it.
            record = torch._dynamo.disable(lambda module, args: recorded.append(args[0].detach().clone()))
            hooks = [b.register_forward_pre_hook(record) for b in blocks[:-1]]
        loss = t.compute_loss(t.model, inputs)
        if offload:
            for h in hooks:
                h.remove()
            rows = len(PROMPTS) * 4
            forwards = -(-rows // 3)  # mini-batches of 3 rows
            assert handle.stats.offloaded == forwards * (layers - 1) and handle.stats.kept == forwards
            assert len(recorded) == forwards * (layers - 1)
            if device == "cuda":
                torch.cuda.synchronize()  # the side-stream copies have landed
            host = [b for bufs in handle.host_buffers().values() for b in bufs]
            assert all(b.is_pinned() for b in host) or device == "cpu"
            for x in recorded:  # every offloaded input sits, bit for bit, in one of the host buffers
                x, nbytes = x.cpu(), x.numel() * x.element_size()
                assert any(b.numel() >= nbytes and torch.equal(b[:nbytes].view(x.dtype).view(x.shape), x) for b in host)
        loss.backward()
        if offload and keep_attention:  # every layer's recompute took its attention output back
            assert handle.stats.outputs_replayed == forwards * layers and handle.stats.outputs_missing == 0
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lora_params(t.model)}))
        assert not torch._dynamo.utils.counters["graph_break"]
        if offload and not packed_bf16:
            # Layer graphs: one for the no-grad old-policy pass (its calls detach their inputs, so the first layer's,
            # which the input-embeddings hook makes require grad even under no_grad, is traced like the others),
            # one for the training forward and recompute.
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    (plain_loss, plain_grads), (loss, grads) = results
    if packed_bf16:
        # The same layer graphs on both sides, but flash's backward sums dq with atomics in an order that changes
        # from run to run: that moves gradients by bf16 steps; a kept output of another layer or call would move
        # them by their own size. (When the plain side compiled the whole decoder, with inductor on both sides the
        # layer compiled alone and the decoder fused differently, and the worst gradient fell to 0.981.)
        torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=1e-5)
        assert grads.keys() == plain_grads.keys() and len(grads) == 2 * 7 * layers
        for name, grad in grads.items():
            similarity = torch.cosine_similarity(grad.flatten().float(), plain_grads[name].flatten().float(), 0)
            assert grad.abs().max() > 0 and similarity > 0.995, (name, similarity)
        return
    # CPU: the same ops in the same order. CUDA: inductor's layer graphs, under HF's checkpoint or the offloaded one.
    rtol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(loss, plain_loss, rtol=rtol, atol=rtol * 1e-2)
    assert grads.keys() == plain_grads.keys() and len(grads) == 2 * 7 * layers
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, plain_grads[name], rtol=10 * rtol, atol=rtol * 1e-1, msg=name)


def test_trainer_flag_needs_gradient_checkpointing(tmp_path):
    import fastgrpo.integrations.trl as F

    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False,
                     fastgrpo_offload_checkpointing=True)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equal_and_off_device(dtype, compiled, monkeypatch):
    """On CUDA: gradients equal plain checkpointing (a race between the side-stream copies and the
    compute stream would show as wrong values), and the offloaded inputs are off the device between
    forward and backward. Layers run as they are (a replayed layer keeps no attention outputs; its graphs are
    tested in test_layer_graphs.py)."""
    from fastgrpo.compiler import layer_graphs

    monkeypatch.setattr(layer_graphs, "ENABLED", False)
    torch._dynamo.reset()
    model = tiny_model("qwen3", dtype=dtype, lora=True, num_hidden_layers=8, hidden_size=256,
                       intermediate_size=512).cuda()
    if compiled:
        fastgrpo.compile_repeated_blocks(model.get_base_model())
    ids, mask = batch("cuda", rows=4, length=1024)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = step(model, ids, mask)
    # The padded rows send SDPA to its memory-efficient kernel, whose backward accumulates with atomics: plain
    # checkpointing against itself already differs, by a different amount each run (H200: up to 1e-4 of a
    # gradient's largest entry in fp32 against 2e-5 in the one sample taken as `noise`). A copy race would put
    # stale or foreign activations into a layer: errors of the order of the gradients themselves.
    noise = max_differences(reference, step(model, ids, mask))
    rtol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plain_loss = loss_of(model, ids, mask)
    plain_held = torch.cuda.memory_allocated() - before
    del plain_loss
    handle = enable_offloaded_checkpointing(model)
    for _ in range(3):
        differences = max_differences(reference, step(model, ids, mask))
        for name, difference in differences.items():
            scale = reference[1].get(name, reference[0]).abs().max().item()
            assert difference <= 4 * noise[name] + rtol * scale, (name, difference, noise[name], scale)
    before = torch.cuda.memory_allocated()
    loss = loss_of(model, ids, mask)
    # A device input freed after its copy (record_stream) stays counted until the allocator processes the
    # copy stream's events, which empty_cache() does after synchronizing.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() - before
    layer_input = 4 * 1024 * 256 * dtype.itemsize
    # 7 of the 8 layer inputs are offloaded; layer 0's too, though PEFT's gradient_checkpointing_enable hooks the
    # embeddings to return a leaf that requires grad (offloading swaps it for an alias that is no leaf).
    assert plain_held - held >= 0.9 * 7 * layer_input
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert all(b.is_pinned() for bufs in handle.host_buffers().values() for b in bufs)
    # Host buffers are allocated in the first step and reused after: one per offloaded layer input, and one per
    # tensor its attention kept for the recompute (output and log-sum-exp, where the compiled layers run
    # fastgrpo::attention: bf16 on cuDNN; float32 stays with SDPA).
    kept_per_layer = handle.stats.outputs_offloaded // handle.stats.offloaded
    assert kept_per_layer == (2 if compiled and dtype == torch.bfloat16 else 0)
    assert handle.stats.host_allocations == 7 * (1 + kept_per_layer) and handle.stats.loaded_on_demand == 0
    assert handle.stats.outputs_missing == 0


def test_trainer_flag_auto_means_cuda_with_checkpointing(tmp_path):
    # The default: offload whenever the policy trains on CUDA with checkpointing (measured: < 1 % slower than
    # plain checkpointing); never on CPU, where there is no device memory to save.
    import fastgrpo.integrations.trl as F
    from tests.tiny_models import trainer_rule

    def on(device: str, **config) -> bool:
        return trainer_rule("_offload_on", tmp_path, device, **config)

    assert F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True).fastgrpo_offload_checkpointing == "auto"
    assert on("cuda", gradient_checkpointing=True)
    assert not on("cuda", gradient_checkpointing=False)
    assert not on("cpu", gradient_checkpointing=True)
    assert not on("cuda", gradient_checkpointing=True, fastgrpo_offload_checkpointing="false")
    assert on("cpu", gradient_checkpointing=True, fastgrpo_offload_checkpointing="true")
    with pytest.raises(ValueError, match="use True, False or 'auto'"):
        F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fastgrpo_offload_checkpointing="sometimes")


@pytest.mark.parametrize("cpus, env, expected", [
    (16, {}, "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"),
    (64, {}, "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"),
    (6, {}, "pinned_use_cuda_host_register:True,pinned_num_register_threads:4"),
    (1, {}, "pinned_use_cuda_host_register:True,pinned_num_register_threads:1"),
    (16, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,pinned_use_background_threads:True"}, None),
    (16, {"PYTORCH_ALLOC_CONF": "pinned_num_register_threads:2"}, None),
])
def test_fast_pinning_once_a_process_a_power_of_two_of_threads_and_never_over_the_users_setting(
        cpus, env, expected, monkeypatch):
    from fastgrpo.compiler import offload

    applied = []
    monkeypatch.setattr(offload, "_fast_pinning_done", False)
    monkeypatch.setattr(offload.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert offload.fast_pinning() == expected
    assert offload.fast_pinning() is None  # once
    assert applied == ([expected] if expected else [])
