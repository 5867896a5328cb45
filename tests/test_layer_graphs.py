"""Checkpointed layer calls replayed as CUDA graphs (fastgrpo.compiler.layer_graphs).

On CUDA: gradients with replayed layers equal those of the calls run as they are, every layer is captured and
replayed once its key repeats, a layer that draws random numbers is never replayed and says why, a moved parameter
drops the graphs that read it, and a layer keeps at most MAX_KEYS_PER_LAYER keys. On the CPU the pieces that need no
device: the input keys, the staging buffers, the agreement check, and that nothing is replayed there.
"""
import contextlib
import gc
import types
import warnings
import weakref

import pytest
import torch

import fastgrpo
from fastgrpo.compiler import layer_graphs
from fastgrpo.compiler.layer_graphs import _agree, _flatten, _NotReplayable, _Staging, _substitute
from fastgrpo.compiler.offload import enable_offloaded_checkpointing
from fastgrpo.compiler.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_inputs_flatten_to_a_key_and_substitute_back():
    cos, sin, mask = torch.ones(2, 3), torch.zeros(2, 3), torch.ones(1, 1, 3, 3, dtype=torch.bool)
    args, kwargs = (mask, None), {"position_embeddings": (cos, sin), "use_cache": False, "scale": 0.5}
    tensors, key = _flatten(args, kwargs)
    assert [t is u for t, u in zip(tensors, (mask, cos, sin))] == [True] * 3
    # The same layouts and values give the same key; another shape, grad flag or value another one.
    assert _flatten((mask.clone(), None), {**kwargs, "position_embeddings": (cos + 1, sin)})[1] == key
    assert _flatten((mask, None), {**kwargs, "scale": 0.25})[1] != key
    assert _flatten((mask, None), {**kwargs, "position_embeddings": (cos[:1], sin)})[1] != key
    assert _flatten((mask, None), {**kwargs, "position_embeddings": (cos.requires_grad_(), sin)})[1] != key
    new = [torch.full_like(t, 7) for t in tensors]
    args2, kwargs2 = _substitute(args, kwargs, new)
    assert args2[0] is new[0] and args2[1] is None
    assert kwargs2["position_embeddings"][0] is new[1] and kwargs2["position_embeddings"][1] is new[2]
    assert isinstance(kwargs2["position_embeddings"], tuple) and kwargs2["use_cache"] is False
    with pytest.raises(_NotReplayable, match="of type object"):
        _flatten((object(),), {})


def test_staging_keeps_layouts_and_copies_only_what_changed():
    staging = _Staging()
    row = torch.arange(6.0).view(1, 1, 6)
    broadcast = row.expand(4, 3, 6)  # stride 0 on two dims, as an expanded mask or embedding is
    transposed = torch.randn(6, 5).t()
    buffers = [staging.like("in", i, t) for i, t in enumerate((broadcast, transposed))]
    assert buffers[0].stride() == broadcast.stride() and buffers[1].stride() == transposed.stride()
    assert buffers[0].untyped_storage().nbytes() == 6 * 4 and buffers[0]._is_view()  # the distinct elements once
    staging.stage(buffers, [broadcast, transposed])
    assert torch.equal(buffers[0], broadcast) and torch.equal(buffers[1], transposed)
    buffers[1].zero_()  # the same tensor, unchanged: not copied again
    staging.stage(buffers, [broadcast, transposed])
    assert not buffers[1].any()
    transposed.add_(1)  # changed in place (its version moved): copied
    staging.stage(buffers, [broadcast, transposed])
    assert torch.equal(buffers[1], transposed)
    assert staging.like("in", 1, transposed) is buffers[1]
    # Staging a tensor that requires grad leaves every buffer out of autograd (on CUDA one foreach copy from such a
    # tensor made all its buffers require grad, and the capture then traced the layer anew).
    hidden = torch.randn(6, 5, requires_grad=True) * 2
    buffers.append(staging.like("in", 3, hidden))
    staging.stage(buffers, [broadcast, transposed + 1, hidden])
    assert not any(b.requires_grad or b.grad_fn is not None for b in buffers)
    # What was staged is not held alive by the staging (a layer's hidden states are large).
    watched = weakref.ref(hidden)
    del hidden
    assert watched() is None
    with pytest.raises(_NotReplayable, match="overlap"):
        staging.like("in", 2, torch.arange(8.0).as_strided((3, 3), (2, 1)))  # rows that share elements


def test_agreement_names_what_differs():
    a = [torch.ones(4), None, torch.full((2,), 3.0)]
    assert _agree(a, [t.clone() if t is not None else None for t in a]) is None
    assert _agree(a, [a[0] * (1 + 1e-3), None, a[2]]) is None  # within AGREEMENT of the largest value
    assert "output 0 differs" in _agree(a, [a[0] * 2, None, a[2]])
    assert "NaN" not in _agree(a, [a[0], None, torch.tensor([3.0, float("nan")])]) and _agree(
        a, [a[0], None, torch.tensor([3.0, float("nan")])])
    assert "None in one run" in _agree(a, [a[0], torch.ones(1), a[2]])


def _step(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits.float()
    loss = logits.log_softmax(-1)[..., 5].mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_nothing_is_replayed_off_cuda(monkeypatch):
    monkeypatch.setattr(layer_graphs, "ENABLED", True)
    model = tiny_model("llama", lora=True, num_hidden_layers=3)
    fastgrpo.compile_repeated_blocks(model.get_base_model(), options={"inner": "eager"})
    handle = enable_offloaded_checkpointing(model)
    ids = torch.randint(3, 100, (2, 10))
    for _ in range(4):
        _step(model, ids)
    assert handle.graphs.stats["captured"] == handle.graphs.stats["eager"] == 0 and not handle.graphs.entries


DEVICES = [pytest.param("cpu", id="cpu-emulated"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def emulated(monkeypatch):
    """Layer graphs on; on the CPU, calls take every step with the stand-in graph (EMULATE_ON_CPU)."""
    monkeypatch.setattr(layer_graphs, "ENABLED", True)
    monkeypatch.setattr(layer_graphs, "EMULATE_ON_CPU", True)


def _model(arch, dtype, device, layers=4, **overrides):
    torch._dynamo.reset()
    size = dict(hidden_size=256, intermediate_size=512) if device == "cuda" else dict(hidden_size=64,
                                                                                       intermediate_size=128)
    model = tiny_model(arch, dtype=dtype, lora=True, num_hidden_layers=layers, **size, **overrides).to(device)
    # On the CPU the layers compile through the passes without inductor (seconds, not minutes).
    fastgrpo.compile_repeated_blocks(model.get_base_model(), options=None if device == "cuda" else {"inner": "eager"})
    return model


def _ids(device, rows=4, length=64, seed=0):
    return torch.randint(3, 100, (rows, length), generator=torch.Generator().manual_seed(seed)).to(device)


def _close(reference, got, rtol):
    (ref_loss, ref_grads), (loss, grads) = reference, got
    assert grads.keys() == ref_grads.keys() and grads
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        assert (grads[name] - ref).abs().max().item() <= rtol * scale + 1e-30, name


def _reference(model, ids):
    enabled = layer_graphs.ENABLED
    layer_graphs.ENABLED = False
    try:
        return _step(model, ids)
    finally:
        layer_graphs.ENABLED = enabled


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,dtype", [("qwen3", torch.bfloat16), ("llama", torch.float32), ("gemma2", torch.bfloat16),
                                        ("phi3", torch.bfloat16)])
def test_replayed_layers_give_the_gradients_of_the_calls_run_as_they_are(arch, dtype, device):
    layers = 3
    model = _model(arch, dtype, device, layers)
    handle = enable_offloaded_checkpointing(model)
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(5):  # eager, capture, compare, replay, replay; new tokens each step
            ids = _ids(device, length=256 if device == "cuda" else 32, seed=seed)
            _close(_reference(model, ids), _step(model, ids), rtol)
    assert not [w for w in caught if "not replayed" in str(w.message)], [str(w.message) for w in caught]
    stats = handle.graphs.stats
    assert not handle.graphs.off, handle.graphs.off
    # Each layer: one forward and one backward graph; replayed from the fourth step on (steps 4 and 5).
    assert stats["captured"] == 2 * layers
    assert stats["replayed_forward"] == stats["replayed_backward"] == 2 * layers
    assert handle.stats.loaded_on_demand == 0
    # The staging buffers stay out of autograd (a replayed forward's input requires grad).
    assert not any(b.requires_grad for b in handle.graphs.staging.buffers.values())
    fields = handle.graphs.log_fields()
    assert fields["layer_graphs/replayed_backward"] == 2 * layers and handle.graphs.staging.bytes() > 0


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_that_draws_random_numbers_is_not_replayed_and_says_why(device):
    model = _model("llama", torch.float32, device, layers=2, attention_dropout=0.2)
    handle = enable_offloaded_checkpointing(model)
    with pytest.warns(UserWarning, match="draws random numbers"):
        for _ in range(4):
            _step(model, _ids(device))
    assert set(handle.graphs.off) == {0, 1} and handle.graphs.stats["captured"] == 0


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("device", DEVICES)
def test_a_moved_parameter_drops_the_layers_graphs(device):
    model = _model("qwen3", torch.float32, device, layers=2)
    handle = enable_offloaded_checkpointing(model)
    ids = _ids(device)
    for _ in range(4):
        _step(model, ids)
    assert handle.graphs.stats["replayed_forward"] == 2
    layer0 = dict(handle.blocks[0].named_parameters())
    name = next(n for n in layer0 if "lora_B" in n)
    layer0[name].data = layer0[name].data.clone() * 3  # a new storage: a graph would read the freed old one
    dropped = handle.graphs.stats["dropped"]
    reference = _reference(model, ids)
    got = _step(model, ids)
    assert handle.graphs.stats["dropped"] > dropped
    _close(reference, got, 1e-4)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_keeps_at_most_its_number_of_keys(device, monkeypatch):
    monkeypatch.setattr(layer_graphs, "MAX_KEYS_PER_LAYER", 2)
    model = _model("qwen3", torch.float32, device, layers=2)
    handle = enable_offloaded_checkpointing(model)
    for length in (32, 48, 64, 32, 48, 64):
        _step(model, _ids(device, length=length))
    assert all(len(entries) <= 2 for entries in handle.graphs.entries.values())
    assert handle.graphs.stats["dropped"] >= 2
    for length in (32, 32, 32, 48, 48, 48, 64, 64, 64):  # each length captured, then 32's keys dropped
        _step(model, _ids(device, length=length))
    # The staging buffers of dropped keys are freed: only lengths some layer still keeps have buffers.
    gc.collect()
    kept = {key[0][1][1] for entries in handle.graphs.entries.values() for key in entries}  # the hidden states' length
    staged = {key[2][1] for key in handle.graphs.staging.buffers.keys() if key[:2] == ("in", 0)}
    assert staged == kept == {48, 64}, (staged, kept)


@pytest.mark.usefixtures("emulated")
def test_a_call_with_an_input_no_key_can_hold_runs_as_it_is_and_its_layer_stays_on():
    # A flex_attention BlockMask (packed rows of a model whose layers need the mask) says nothing about the layer:
    # that call runs as it is, counted and said once; the layer's other calls are captured and replayed.
    model = _model("qwen3", torch.float32, "cpu", layers=2)
    handle = enable_offloaded_checkpointing(model)
    graphs = handle.graphs
    odd = types.SimpleNamespace(layer=1, args=(), kwargs={"attention_mask": object()}, autocast=())
    hidden = torch.zeros(1, 8, model.config.hidden_size)
    with pytest.warns(UserWarning, match="calls with a layer input of type object run as they are"):
        assert graphs.entry(odd, hidden) is None
    assert graphs.entry(odd, hidden) is None and graphs.stats["unkeyed"] == 2 and not graphs.off
    ids = _ids("cpu", rows=2, length=32)
    for _ in range(4):
        _close(_reference(model, ids), _step(model, ids), 1e-4)
    assert graphs.stats["replayed_forward"] > 0 and not graphs.off


@pytest.mark.usefixtures("emulated")
def test_a_call_whose_work_bounds_the_gpu_runs_as_it_is_and_is_counted(monkeypatch):
    """Calls above MAX_WORK_PER_CALL (2 x the layer's parameters x tokens) are neither captured nor replayed; smaller
    calls of the same model are."""
    model = _model("qwen3", torch.float32, "cpu", layers=2)
    handle = enable_offloaded_checkpointing(model)
    elements = sum(p.numel() for p in handle.blocks[0].parameters())
    small, large = _ids("cpu", rows=2, length=32), _ids("cpu", rows=4, length=64)
    monkeypatch.setattr(layer_graphs, "MAX_WORK_PER_CALL", 2 * elements * small.numel())
    assert handle.graphs.worth_it(small.numel()) and not handle.graphs.worth_it(small.numel() + 1)
    for _ in range(4):
        _close(_reference(model, large), _step(model, large), 1e-4)
    stats = handle.graphs.stats
    assert stats["gpu_bound"] == 8 and stats["eager"] == stats["captured"] == 0 and not handle.graphs.entries
    for _ in range(4):
        _step(model, small)
    assert stats["replayed_forward"] == stats["replayed_backward"] == 2


@pytest.mark.usefixtures("emulated")
def test_a_layer_whose_lengths_change_faster_than_it_replays_stops_capturing(monkeypatch):
    """Keys captured and dropped before they replay (more lengths than MAX_KEYS_PER_LAYER, in turn) cost captures and
    win nothing: after CHURN_CAPTURES such captures the layer runs as it is, said once; gradients stay exact."""
    monkeypatch.setattr(layer_graphs, "MAX_KEYS_PER_LAYER", 2)
    monkeypatch.setattr(layer_graphs, "CHURN_CAPTURES", 4)
    model = _model("qwen3", torch.float32, "cpu", layers=2)
    handle = enable_offloaded_checkpointing(model)
    with pytest.warns(UserWarning, match="lengths change faster than its graphs are replayed"):
        for length in (32, 32, 40, 40, 48, 48) * 3:  # each key captured at its second call, dropped before a replay
            ids = _ids("cpu", length=length)
            _close(_reference(model, ids), _step(model, ids), 1e-4)
    assert set(handle.graphs.off) == {0, 1}
    # forward and backward graphs of 4 keys in each of 2 layers, none replayed
    assert handle.graphs.stats["captured"] == 2 * 2 * 4 and handle.graphs.stats["replayed_forward"] == 0


@pytest.mark.usefixtures("emulated")
def test_a_layer_that_replays_its_keys_keeps_capturing(monkeypatch):
    """Lengths that come back while their keys are kept replay, so captures go on past CHURN_CAPTURES."""
    monkeypatch.setattr(layer_graphs, "MAX_KEYS_PER_LAYER", 2)
    monkeypatch.setattr(layer_graphs, "CHURN_CAPTURES", 2)
    model = _model("qwen3", torch.float32, "cpu", layers=2)
    handle = enable_offloaded_checkpointing(model)
    for length in (32,) * 6 + (40,) * 6 + (48,) * 6:  # each: eager, capture, compare, then 3 replays
        _step(model, _ids("cpu", length=length))
    assert not handle.graphs.off and handle.graphs.stats["replayed_forward"] == 2 * 9


@pytest.mark.usefixtures("emulated")
def test_op_graphs_stand_aside_in_the_calls_of_a_layer_whose_graphs_come(monkeypatch):
    """The gated-MLP op's own graphs (fastgrpo.kernels._graphs) are suspended in a layer call that has a key (the
    layer graph replaces them), forward and backward, and not in a call too large for a layer graph."""
    from fastgrpo.kernels import _graphs

    model = _model("qwen3", torch.float32, "cpu", layers=2)
    handle = enable_offloaded_checkpointing(model)
    seen = []
    record = torch._dynamo.disable(lambda module, args: seen.append(_graphs._suspended))
    handle.blocks[0].mlp.register_forward_pre_hook(record)
    ids = _ids("cpu", length=32)
    _step(model, ids)  # each layer's first call: run as it is, forward and recompute
    assert len(seen) == 2 and all(seen), seen
    seen.clear()
    monkeypatch.setattr(layer_graphs, "MAX_WORK_PER_CALL", 0)
    _step(model, ids)
    assert len(seen) == 2 and not any(seen) and handle.graphs.stats["gpu_bound"] == 2
    assert _graphs._suspended == 0


def test_a_4bit_parameter_counts_the_elements_of_its_weight():
    bnb = pytest.importorskip("bitsandbytes")
    packed = bnb.nn.Linear4bit(32, 64, bias=False, quant_type="nf4").to("cpu").weight
    assert packed.numel() == 64 * 32 // 2 and layer_graphs._elements(packed) == 64 * 32
    assert layer_graphs._elements(torch.nn.Parameter(torch.zeros(3, 5))) == 15


def test_a_staging_buffer_is_a_view_exactly_where_its_input_is_one():
    """Dynamo guards on whether a compiled region's input is a view: a staging buffer that differed would make the
    capture recompile the layer (where autotuning cannot run)."""
    staging = _Staging()
    plain, sliced = torch.randn(2, 3, 4), torch.randn(2, 3, 8)[..., :4]
    assert not staging.like("in", 0, plain)._is_view() and staging.like("in", 1, sliced)._is_view()
    assert staging.like("in", 1, sliced).stride() == sliced.stride()
    # A tensor output: `flat_outputs` takes it as a flat tuple of one.
    from fastgrpo.compiler.checkpoint_node import flat_outputs

    assert len(flat_outputs(plain)) == 1 and flat_outputs((plain, None, 3))[2] == 3


@pytest.mark.parametrize("packing", [False, True])
def test_the_trainer_pads_to_a_length_bucket_and_replays_its_layers(tmp_path, monkeypatch, packing):
    """fastgrpo's GRPOTrainer with offloaded checkpointing: a training forward's rows are padded to a length bucket
    (appended columns, masked; packed rows: appended tokens, `packing.pad_plan`), its layers are captured and replayed
    (emulated here), and loss and LoRA gradients equal those of the trainer without offloading, graphs or padding, in
    every step. Two batches of one bucket take turns (a completion one token shorter): their calls share graphs."""
    from datasets import Dataset
    from peft import LoraConfig

    import fastgrpo.integrations.trl as F
    from fastgrpo.compiler.offload import offload_handle
    from fastgrpo.compiler.regions import repeated_blocks
    from tests.test_trl_integration import LORA, PROMPTS, VOCAB, common_args, low_id_fraction, lora_params, make_inputs
    from tests.tiny_models import tiny_tokenizer

    monkeypatch.setattr(layer_graphs, "ENABLED", True)
    monkeypatch.setattr(layer_graphs, "EMULATE_ON_CPU", True)
    tokenizer = tiny_tokenizer(PROMPTS + ["the quick brown fox jumps", "a b c d e f g"], VOCAB)
    lengths = []

    def trainer(offload: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_model("qwen2", vocab_size=VOCAB, num_hidden_layers=2, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
        args = F.GRPOConfig(**common_args(tmp_path, beta=0.0, loss_type="dapo", fastgrpo_packing=packing,
                                          fastgrpo_compile_options={"inner": "eager"},
                                          fastgrpo_offload_checkpointing=offload))
        built = F.GRPOTrainer(model=model, reward_funcs=low_id_fraction, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**LORA))
        built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        built.current_gradient_accumulation_steps = 1
        blocks = repeated_blocks(built.model)
        record = torch._dynamo.disable(lambda module, args: lengths.append(args[0].shape[1]))
        blocks[0].register_forward_pre_hook(record)
        return built

    results = {}
    for offload in (False, True):
        t = trainer(offload)
        inputs = make_inputs(t, tokenizer.eos_token_id)
        shorter = dict(inputs, completion_mask=inputs["completion_mask"].clone())
        row = int(inputs["completion_mask"].sum(1).argmax())
        shorter["completion_mask"][row, int(inputs["completion_mask"][row].nonzero().max())] = 0
        steps = []
        for step in range(4):  # eager, capture, compare, replay
            lengths.clear()
            loss = t.compute_loss(t.model, shorter if step % 2 else inputs)
            loss.backward()
            steps.append((loss.detach(), {n: p.grad.clone() for n, p in lora_params(t.model)}, list(lengths)))
            t.model.zero_grad(set_to_none=True)
        results[offload] = steps
        if offload:
            stats = offload_handle(t.model).graphs.stats
            assert stats["replayed_forward"] == stats["replayed_backward"] == 2 and stats["captured"] == 4
            # Padding only where a layer call (the mini-batch's rows) is small enough to be replayed.
            ids, bucket = torch.ones(8, 40, dtype=torch.long), layer_graphs.bucket_length(40)
            elements = sum(p.numel() for p in offload_handle(t.model).blocks[0].parameters())
            monkeypatch.setattr(layer_graphs, "MAX_WORK_PER_CALL", 2 * elements * 2 * bucket)  # two rows a call
            assert t._bucket_padding(ids, {}, 2) == bucket - 40 > 0
            assert t._bucket_padding(ids, {}, None) == t._bucket_padding(ids, {}, 3) == 0
    if packing:  # the packed batches' own lengths differ; their bucket, and so their graphs, do not
        assert results[False][0][2][0] != results[False][1][2][0] and results[True][0][2][0] == results[True][1][2][0]
    for (plain_loss, plain_grads, plain_lengths), (loss, grads, padded_lengths) in zip(results[False], results[True]):
        assert all(n == layer_graphs.bucket_length(m) for n, m in zip(padded_lengths, plain_lengths))
        assert padded_lengths != plain_lengths  # the fixed rows' length is not a bucket's: padding ran
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.usefixtures("emulated")
def test_a_failed_capture_stops_all_captures_and_the_calls_run_as_they_are(monkeypatch):
    """A capture that raises (on CUDA it may leave the allocator recording into the pool) turns every layer's
    graphs off with one warning naming the error; every step's gradients stay those of the calls run as they are."""
    keeping_outputs = layer_graphs._dispatch.keeping_outputs

    def failing_in_captures(frame):  # only the captured bodies keep no outputs
        if frame is None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return keeping_outputs(frame)

    model = _model("qwen3", torch.float32, "cpu", layers=3)
    handle = enable_offloaded_checkpointing(model)
    monkeypatch.setattr(layer_graphs._dispatch, "keeping_outputs", failing_in_captures)
    with pytest.warns(UserWarning, match="capture failed.*not permitted"):
        for seed in range(4):
            ids = _ids("cpu", seed=seed)
            _close(_reference(model, ids), _step(model, ids), 1e-5)
    assert handle.graphs.broken and handle.graphs.stats["captured"] == 0
    assert handle.graphs.stats["eager"] == 3 + 1  # the first step's calls, then layer 0's second, whose capture failed


@pytest.mark.gpu
def test_a_backward_capture_that_fails_leaves_the_device_as_it_was(monkeypatch):
    """On CUDA: a host sync in the captured backward breaks its capture. Every layer then runs as it is with one
    warning, the gradients stay those of the calls run as they are, and the device's random generator, its current
    stream and later captures into the graphs' pool all work (torch leaves them broken after a failed capture)."""
    layer_graphs.ENABLED, enabled = True, layer_graphs.ENABLED
    try:
        recompute = layer_graphs._dispatch.checkpoint_recompute

        @contextlib.contextmanager
        def syncing_in_captures():
            with recompute():
                if torch.cuda.is_current_stream_capturing():
                    torch.cuda.synchronize()
                yield

        model = _model("qwen3", torch.bfloat16, "cuda", layers=3)
        handle = enable_offloaded_checkpointing(model)
        monkeypatch.setattr(layer_graphs._dispatch, "checkpoint_recompute", syncing_in_captures)
        stream = torch.cuda.current_stream()
        with pytest.warns(UserWarning, match="capture failed.*capturing"):
            for seed in range(4):
                ids = _ids("cuda", length=256, seed=seed)
                _close(_reference(model, ids), _step(model, ids), 2e-2)
        assert handle.graphs.broken and handle.graphs.stats["replayed_backward"] == 0
        assert torch.cuda.current_stream() == stream
        torch.rand(4, device="cuda")
        pool, capture_stream = layer_graphs._graphs.capture_pool(torch.device("cuda", torch.cuda.current_device()))
        x = torch.ones(4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        capture_stream.wait_stream(stream)
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
            y = x * 2
        graph.replay()
        torch.testing.assert_close(y, torch.full((4,), 2.0, device="cuda"))
    finally:
        layer_graphs.ENABLED = enabled


@pytest.mark.gpu
def test_a_large_call_before_a_small_one_in_a_step_leaves_the_small_ones_replayable(monkeypatch):
    """A call too large to replay, run first in a step, holds its layer's gradient accumulators until the backward;
    the small call after it still captures and replays (its leaves' accumulators were made on the capture stream at
    the layer's first call), and the gradients are those of the calls run as they are."""
    layer_graphs.ENABLED, enabled = True, layer_graphs.ENABLED
    try:
        model = _model("qwen3", torch.bfloat16, "cuda", layers=3)
        handle = enable_offloaded_checkpointing(model)
        elements = sum(p.numel() for p in handle.graphs.blocks[0].parameters())
        monkeypatch.setattr(layer_graphs, "MAX_WORK_PER_CALL", 2 * elements * 512)  # 4 x 64 replays, 4 x 256 not

        def step(big, small):
            loss = sum(model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[..., 5].mean()
                       for ids in (big, small))
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            return loss.detach(), grads

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(5):
                big, small = _ids("cuda", length=256, seed=seed), _ids("cuda", length=64, seed=seed + 10)
                layer_graphs.ENABLED = False
                want = step(big, small)
                layer_graphs.ENABLED = True
                _close(want, step(big, small), 2e-2)
        assert not [w for w in caught if "not replayed" in str(w.message)], [str(w.message) for w in caught]
        assert handle.graphs.stats["replayed_backward"] > 0 and handle.graphs.stats["gpu_bound"] > 0
    finally:
        layer_graphs.ENABLED = enabled
