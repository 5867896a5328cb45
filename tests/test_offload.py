"""Offloaded activation checkpointing (fastgrpo.integrations.offload).

Loss and every gradient must equal plain non-reentrant checkpointing and no checkpointing, eager and
with the layers compiled; layer inputs must live in the host buffers (not on the compute device)
between forward and backward; buffers must be reused across steps; disable() must restore the model.
"""
import gc
import weakref

import pytest
import torch

import fastgrpo
from fastgrpo.compiler.regions import repeated_blocks
from fastgrpo.compiler.tiny import tiny_model
from fastgrpo.integrations.offload import (
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
)

LAYERS = 4  # 3 offloaded + 1 kept: the prefetch chain has more than one link
EAGER = {"inner": "eager"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on a shared 2-core machine: extra threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(arch, lora, device="cpu", **overrides):
    return tiny_model(arch, lora=lora, num_hidden_layers=LAYERS, **overrides).to(device)


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


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("qwen3", True)])
def test_equals_plain_and_hf_checkpointing(arch, lora):
    model = make(arch, lora)
    ids, mask = batch()
    reference = step(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(reference, step(model, ids, mask))
    with enable_offloaded_checkpointing(model) as handle:
        # HF's per-layer flag is switched off: ours replaces it instead of nesting in it.
        assert not any(block.gradient_checkpointing for block in repeated_blocks(model))
        offloaded = step(model, ids, mask)
        assert_same(reference, offloaded, rtol=0, atol=0)  # the same ops on the same values
        assert handle.stats.offloaded == LAYERS - 1 and handle.stats.kept == 1
        # Every copy back was started one layer ahead, none waited for on demand.
        assert handle.stats.prefetched == LAYERS - 1 and handle.stats.loaded_on_demand == 0
        # torch.autograd.grad works too (non-reentrant checkpointing underneath).
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_of(model, ids, mask), params)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, grad in zip(names, grads):
            torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
    assert all(block.gradient_checkpointing for block in repeated_blocks(model))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_layers(arch):
    """Layers compiled one region each by the fastgrpo backend; the checkpoint stays outside them."""
    torch._dynamo.reset()
    model = make(arch, lora=True)
    ids, mask = batch()
    reference = step(model, ids, mask)
    compiled = make(arch, lora=True)
    fastgrpo.clear_fusion_reports()
    fastgrpo.compile_repeated_blocks(compiled.get_base_model(), options=EAGER)
    handle = enable_offloaded_checkpointing(compiled)
    for _ in range(2):
        assert_same(reference, step(compiled, ids, mask))
    # The layer graphs went through the backend (the rewrite happened) and hold no offload logic.
    reports = fastgrpo.fusion_reports()
    assert reports and sum(r["patterns"]["rms_norm"]["matched"] for r in reports) > 0
    assert handle.stats.offloaded == 2 * (LAYERS - 1) and handle.stats.loaded_on_demand == 0


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
    inputs = {}  # layer -> (weak reference to the input tensor, a copy of its values)

    def record(layer):
        def hook(module, args):
            if layer not in inputs:  # the forward call, not the recompute
                inputs[layer] = (weakref.ref(args[0]), args[0].detach().clone())
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
    # HF checkpointing switched on again over ours would checkpoint each layer twice: refused.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RuntimeError, match="switched on again"):
        loss_of(model, ids, mask)
    model.gradient_checkpointing_disable()
    assert disable_offloaded_checkpointing(model)
    assert not disable_offloaded_checkpointing(model)
    assert [type(block) for block in repeated_blocks(model)] == classes
    assert not any("_fastgrpo_offload" in block.__dict__ for block in repeated_blocks(model))
    assert handle.host_buffers() == {} and handle.stats.host_bytes == 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equal_and_off_device(dtype, compiled):
    """On CUDA: gradients equal plain checkpointing (a race between the side-stream copies and the
    compute stream would show as wrong values), and the offloaded inputs are off the device between
    forward and backward."""
    torch._dynamo.reset()
    model = tiny_model("qwen3", dtype=dtype, lora=True, num_hidden_layers=8, hidden_size=256,
                       intermediate_size=512).cuda()
    if compiled:
        fastgrpo.compile_repeated_blocks(model.get_base_model())
    ids, mask = batch("cuda", rows=4, length=1024)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = step(model, ids, mask)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plain_loss = loss_of(model, ids, mask)
    plain_held = torch.cuda.memory_allocated() - before
    del plain_loss
    handle = enable_offloaded_checkpointing(model)
    for _ in range(3):
        assert_same(reference, step(model, ids, mask), **tol)
    before = torch.cuda.memory_allocated()
    loss = loss_of(model, ids, mask)
    held = torch.cuda.memory_allocated() - before
    layer_input = 4 * 1024 * 256 * dtype.itemsize
    assert plain_held - held >= 0.9 * 7 * layer_input
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert all(b.is_pinned() for bufs in handle.host_buffers().values() for b in bufs)
    assert handle.stats.host_allocations == 7 and handle.stats.loaded_on_demand == 0
