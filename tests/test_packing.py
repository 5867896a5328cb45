"""Padding-free forwards (fastgrpo.integrations.packing): packed and shared-prompt log-probs, entropies and LoRA
gradients equal the padded path's, on tiny models of several architectures (CPU, fp32), and through the trainer.

On CPU packed rows and shared prompts run as variable-length segments (fastgrpo.kernels.packed_attention's torch
path; a completion's keys are its prompt's and its own), and layers that cannot take the model's SDPA/eager attention
with a dense mask (flex_attention has no CPU backward); the flex_attention BlockMask is checked here without gradients
and, with gradients, by the `gpu` tests, as is flash's variable-length kernel.
"""
import contextlib
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

import fastgrpo
from fastgrpo.integrations import packed_dispatch, packing, windows
from fastgrpo.compiler.layer_graphs import bucket_length, bucket_step
from fastgrpo.integrations.packing import Packer, block_mask, dense_mask, graph_segments, pad_plan, plan_packing
from fastgrpo.kernels._dispatch import next_power_of_2
from fastgrpo.integrations.trl import CompiledBackbone, LogprobHead
from fastgrpo.kernels.packed_attention import compute_dtype, packed_attention
from torch.nn.attention.flex_attention import BlockMask
from fastgrpo.compiler.tiny import tiny_config
from tests.tiny_models import tiny_model, trainer_rule

PROMPT_COLUMNS, COMPLETION_COLUMNS = 7, 9
# (prompt length, completion length) per row: groups of identical prompts (rows 0-2, 3-4, 6-7), very different
# lengths, a completion of one token, an empty completion (TRL's mask_truncated_completions), a one-token prompt,
# and completions that fill every column (truncated, no EOS).
ROWS = [(7, 9), (7, 1), (7, 5), (3, 9), (3, 0), (1, 2), (5, 9), (5, 3)]
SHARED = {1: 0, 2: 0, 4: 3, 7: 6}  # row -> the row whose prompt it repeats
# Rows spanning several 128-token flex_attention blocks (some blocks inside one row, some across rows).
LONG_ROWS, LONG_SHARED = [(60, 400), (60, 20), (60, 90), (1, 300), (33, 1), (33, 0)], {1: 0, 2: 0, 5: 4}
ARCHS = {
    "llama": {},
    "qwen3": {},  # q/k norms
    "gemma2": dict(sliding_window=4),  # softcaps, sliding + full layers (a {kind: mask} mapping), window < rows
    "gemma3": dict(sliding_window=4),  # q/k norms, both tiny layers sliding (one sliding mask)
    "phi3": dict(partial_rotary_factor=0.5),  # fused qkv / gate_up, partial rotary
    "doge": dict(sliding_window=4),  # the window only in the mask its decoder builds: its attention call names none
}


def padded_batch(vocab: int, rows=ROWS, shared=SHARED, seed: int = 0):
    """TRL's layout [left-padded prompt | right-padded completion] with labels on the completion tokens;
    `shared` maps a row to an earlier row whose prompt it repeats."""
    prompt_columns, completion_columns = max(p for p, _ in rows), max(c for _, c in rows)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(rows), prompt_columns + completion_columns), generator=generator)
    for row, source in shared.items():
        ids[row, :prompt_columns] = ids[source, :prompt_columns]
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(rows):
        mask[row, prompt_columns - prompt : prompt_columns + completion] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt_columns] = -100
    return ids, mask, labels


def head_on(model, compiled: bool = False) -> LogprobHead:
    backbone = CompiledBackbone(compiled, {"inner": "aot_eager"})
    head = LogprobHead(temperature=0.7, cast_lm_head_to_fp32=False, logprob_chunk=5, backbone=backbone)
    head.install(model.get_base_model())
    head.prompt_columns = PROMPT_COLUMNS
    return head


def run(model, head, packer, batch, completions=COMPLETION_COLUMNS, grad=True):
    """Log-probs, entropies, label mask (completion columns) and LoRA grads of one forward with `packer`."""
    head.packer = packer
    ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out = model.get_base_model()(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    log_probs, entropy = out.log_probs[:, -completions:], out.entropy[:, -completions:]
    grads = {}
    if grad:
        # Different weights per position and an entropy term, so a misplaced value changes the gradients.
        weights = torch.linspace(-1, 2, log_probs.numel(), device=log_probs.device).view_as(log_probs)
        ((log_probs * weights).sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), out.label_mask[:, -completions:], grads


def assert_same(expected, actual, rtol=1e-5):
    (lp, ent, mask, grads), (lp2, ent2, mask2, grads2) = expected, actual
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(lp2, lp, rtol=rtol, atol=rtol)
    torch.testing.assert_close(ent2, ent, rtol=rtol, atol=rtol)
    assert grads.keys() == grads2.keys()
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        scale = grad.abs().max()
        assert (grads2[name] - grad).abs().max() <= 10 * rtol * scale, name


# ---- the plan ----


def test_plan_layout_positions_and_sources():
    ids, mask, labels = padded_batch(vocab=50)
    plan, failure, no_sharing = plan_packing(ids, mask, labels, PROMPT_COLUMNS, share_prompt=False)
    assert failure is None and no_sharing is None and plan.shared_rows == 0
    assert plan.length == sum(p + c for p, c in ROWS)
    starts, cursor = [], 0
    for prompt, completion in ROWS:
        starts.append(cursor)
        assert plan.position_ids[0, cursor : cursor + prompt + completion].tolist() == list(range(prompt + completion))
        cursor += prompt + completion
    # Each scored token is read from the hidden state of the token before it, in its own row.
    for r, c, s, t in zip(plan.rows.tolist(), plan.cols.tolist(), plan.source.tolist(), plan.targets.tolist()):
        prompt = ROWS[r][0]
        assert s == starts[r] + (c + 1) - (PROMPT_COLUMNS - prompt) - 1
        assert plan.input_ids[0, s + 1] == t == ids[r, c + 1]
    assert plan.rows.numel() == sum(c for _, c in ROWS)

    shared, failure, no_sharing = plan_packing(ids, mask, labels, PROMPT_COLUMNS, share_prompt=True)
    assert failure is None and no_sharing is None
    groups = [[0, 1, 2], [3, 4], [5], [6, 7]]
    assert shared.shared_rows == 7
    assert shared.length == sum(ROWS[g[0]][0] + sum(ROWS[r][1] for r in g) for g in groups)
    # prompt (positions 0..P-1), then each completion at positions P.. ; first completion token from the prompt's end
    expected_positions = []
    for g in groups:
        prompt = ROWS[g[0]][0]
        expected_positions += list(range(prompt)) + [p for r in g for p in range(prompt, prompt + ROWS[r][1])]
    assert shared.position_ids[0].tolist() == expected_positions
    first_tokens = (shared.cols == PROMPT_COLUMNS - 1).nonzero().flatten()
    for i in first_tokens.tolist():
        row = shared.rows[i].item()
        assert shared.positions[shared.source[i]] == ROWS[row][0] - 1 and shared.is_prompt[shared.source[i]]
    assert plan.kv_index is None and plan.cu_seqlens_k is plan.cu_seqlens
    assert plan.cu_seqlens.tolist() == torch.tensor([0] + [p + c for p, c in ROWS if p + c]).cumsum(0).tolist()
    # Shared: per group the prompt, then each non-empty completion with the prompt's keys before its own.
    assert shared.cu_seqlens.diff().tolist() == [ROWS[g[0]][0] if i < 0 else ROWS[g[i]][1]
                                                 for g in groups for i in range(-1, len(g)) if i < 0 or ROWS[g[i]][1]]
    assert (shared.longest, shared.longest_k) == (max(max(c for _, c in ROWS), 7), 7 + 9)


def segments_as_mask(plan, window=None) -> torch.Tensor:
    """[T, T] what the variable-length segments let a query see: segment i's queries attend the keys that
    `kv_index` gathers into key segment i, causally with the two aligned at their ends (flash's rule)."""
    total = plan.length
    keys = plan.kv_index if plan.kv_index is not None else torch.arange(total)
    visible = torch.zeros(total, total, dtype=torch.bool)
    q_ends, k_ends = plan.cu_seqlens.tolist(), plan.cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(q_ends[:-1], q_ends[1:], k_ends[:-1], k_ends[1:]):
        n_q, n_k = q1 - q0, k1 - k0
        for j in range(n_q):
            for m in range(n_k):
                offset = j + n_k - n_q - m
                if offset >= 0 and (window is None or offset < window):
                    visible[q0 + j, keys[k0 + m]] = True
    return visible


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("window", [None, 1, 4])
def test_segments_give_the_packing_rule(share, window):
    # The segments (and the shared prompt's gathered keys) allow exactly what the mask allows, windows included.
    ids, mask, labels = padded_batch(vocab=50)
    plan = plan_packing(ids, mask, labels, PROMPT_COLUMNS, share_prompt=share)[0]
    rule = dense_mask(plan.mask_mod(window), plan.group.numel(), "cpu")[0, 0, : plan.length, : plan.length]
    assert torch.equal(segments_as_mask(plan, window), rule)


def test_plan_refuses_what_it_cannot_pack():
    ids, mask, labels = padded_batch(vocab=50)
    holes = mask.clone()
    holes[0, PROMPT_COLUMNS + 2] = 0
    assert plan_packing(ids, holes, labels.masked_fill(holes == 0, -100))[1] == (
        "a row's attention mask has holes (real tokens are not contiguous)")
    first_labelled = labels.clone()
    first_labelled[5, PROMPT_COLUMNS - 1] = ids[5, PROMPT_COLUMNS - 1]  # the one-token prompt of row 5
    assert "first real token is labelled" in plan_packing(ids, mask, first_labelled)[1]
    different = ids.clone()
    different[1:, PROMPT_COLUMNS - 1] = torch.arange(1, len(ROWS)) + 40  # every prompt differs
    plan, failure, no_sharing = plan_packing(different, mask, labels, PROMPT_COLUMNS, share_prompt=True)
    assert failure is None and plan.shared_rows == 0 and no_sharing == "no two rows have the same prompt"


def block_flags(counts, indices, blocks):
    flags = torch.zeros(blocks, blocks, dtype=torch.bool)
    for row in range(blocks):
        flags[row, indices[0, 0, row, : counts[0, 0, row]].long()] = True
    return flags


@pytest.mark.parametrize("share, window", [(False, None), (True, None), (True, 5), (False, 70)])
def test_block_mask_agrees_with_the_dense_mask(share, window):
    ids, mask, labels = padded_batch(50, LONG_ROWS, LONG_SHARED)
    plan = plan_packing(ids, mask, labels, 60, share)[0]
    dense = dense_mask(plan.mask_mod(window), plan.length, "cpu")[0, 0]
    blocks = block_mask(plan, window)
    assert blocks.shape[-2:] == (plan.length, plan.length)
    count = -(-plan.length // 128)
    padded = torch.zeros(count * 128, count * 128, dtype=torch.bool)
    padded[: plan.length, : plan.length] = dense
    tiles = padded.view(count, 128, count, 128)
    inside = torch.zeros(count * 128, dtype=torch.bool)
    inside[: plan.length] = True
    in_range = (inside[:, None] & inside[None, :]).view(count, 128, count, 128)
    exact_some, exact_every = tiles.any(3).any(1), (tiles | ~in_range).all(3).all(1)
    full = block_flags(blocks.full_kv_num_blocks, blocks.full_kv_indices, count)
    partial = block_flags(blocks.kv_num_blocks, blocks.kv_indices, count)
    # Full blocks skip mask_mod, so every pair in them must be visible; every visible pair must be in some block.
    assert bool((exact_every | ~full).all()) and not bool((full & partial).any())
    assert bool(((full | partial) | ~exact_some).all())
    assert bool((~(full | partial)).any())  # cross-row blocks are skipped
    assert bool(full.any()) == (window is None or window >= 128)
    q, k, v = torch.randn(3, 1, 2, plan.length, 16).unbind(0)
    from torch.nn.attention.flex_attention import flex_attention

    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    actual = torch.compile(flex_attention, backend="aot_eager", dynamic=False)(q, k, v, block_mask=blocks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ---- through the model ----


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_and_shared_prompt_match_padded(arch):
    model = tiny_model(arch, lora=True, **ARCHS[arch])
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    padded = run(model, head, None, batch)
    packer, sharing = Packer(), Packer(share_prompt=True)
    with _no_fallback():
        assert_same(padded, run(model, head, packer, batch))
        assert_same(padded, run(model, head, sharing, batch))
    assert packer.last_plan.shared_rows == 0 and sharing.last_plan.shared_rows == 7
    assert sharing.last_plan.length < packer.last_plan.length
    if "sliding_window" in ARCHS[arch]:  # the window cuts into these rows: the case checks the sliding masks
        model.config.sliding_window = 4096
        assert (run(model, head, None, batch, grad=False)[0] - padded[0]).abs().max() > 1e-3


def test_rows_share_their_prompt_in_any_order():
    # TRL shuffles a generation batch's rows before the loss's forward: rows with one prompt are found wherever they
    # are, and the log-probs and gradients still land on their own rows.
    model = tiny_model("llama", lora=True)
    head = head_on(model)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    ids, mask, labels = (t[order] for t in padded_batch(model.config.vocab_size))
    sharing = Packer(share_prompt=True)
    with _no_fallback():
        assert_same(run(model, head, None, (ids, mask, labels)), run(model, head, sharing, (ids, mask, labels)))
    in_order = plan_packing(*padded_batch(model.config.vocab_size), PROMPT_COLUMNS, share_prompt=True)[0]
    assert sharing.last_plan.shared_rows == 7 and sharing.last_plan.length == in_order.length
    # No prompt repeats: said once, and every row keeps the shared layout (its prompt, then its completion, as
    # two segments): the attention call, hence the compiled graph, is the same as for a shared batch.
    ids[:, PROMPT_COLUMNS - 1] = torch.arange(len(ROWS)) + 3
    with pytest.warns(UserWarning, match="no two rows have the same prompt"):
        assert_same(run(model, head, None, (ids, mask, labels)), run(model, head, sharing, (ids, mask, labels)))
    plan = sharing.last_plan
    assert plan.shared_rows == 0 and plan.kv_index is not None and plan.length == sum(p + c for p, c in ROWS)


@pytest.mark.parametrize("arch, takes_segments, note", [
    ("llama", True, None), ("phi3", True, None),
    ("gemma2", False, "attention logits are soft-capped"),
    ("gemma3", True, None),  # sliding layers, a window (4) shorter than the rows: windowed segments
])
def test_layers_take_variable_length_attention_where_they_can(monkeypatch, arch, takes_segments, note):
    # Packed rows carry their segments: every layer that can runs them as variable-length attention
    # (fastgrpo.kernels.packed_attention; sliding-window layers with their window), one that cannot takes the mask
    # and the packer says why, once. With shared prompts a completion's keys are its prompt's and its own, gathered.
    # The values: test_packed_and_shared_prompt_match_padded.
    calls = []

    def counting(query, key, value, cu_seqlens, max_len, scale, window, cu_seqlens_k, max_len_k):
        calls.append((cu_seqlens.tolist(), max_len, cu_seqlens_k.tolist(), max_len_k, key.shape[0]))
        return packed_attention(query, key, value, cu_seqlens, max_len, scale, window, cu_seqlens_k, max_len_k)

    monkeypatch.setattr(packed_dispatch, "packed_attention", counting)
    model = tiny_model(arch, lora=True, **ARCHS[arch])
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    lengths = [p + c for p, c in ROWS if p + c]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run(model, head, Packer(), batch, grad=False)
        notes = [str(w.message) for w in said if "variable-length" in str(w.message)]
        assert len(calls) == (model.config.num_hidden_layers if takes_segments else 0)
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert all(call == (bounds, max(lengths), bounds, max(lengths), bounds[-1]) for call in calls)
        assert (len(notes) == 0) if note is None else (len(notes) == 1 and re.search(note, notes[0]))
        calls.clear()
        sharing = Packer(share_prompt=True)
        run(model, head, sharing, batch, grad=False)
        plan = sharing.last_plan
        expected = (plan.cu_seqlens.tolist(), plan.longest, plan.cu_seqlens_k.tolist(), plan.longest_k,
                    plan.kv_index.numel())
        assert plan.shared_rows == 7 and plan.kv_index.numel() > plan.length
        assert len(calls) == (model.config.num_hidden_layers if takes_segments else 0)
        assert all(call == expected for call in calls)


def test_sliding_window_without_mask_mapping_falls_back(monkeypatch):
    model = tiny_model("gemma2", lora=True, **ARCHS["gemma2"])
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    padded = run(model, head, None, batch)
    decoder = model.get_base_model().base_model
    monkeypatch.setitem(packing._MAPPING_SUPPORT, type(decoder), False)
    packer = Packer()
    with pytest.warns(UserWarning, match="mixes sliding-window and full attention layers but takes a single"):
        assert_same(padded, run(model, head, packer, batch))
    assert packer.last_plan is None
    # A window the rows never reach needs no sliding mask: packed again.
    model.config.sliding_window = ROWS[0][0] + ROWS[0][1]
    padded = run(model, head, None, batch)
    with _no_fallback():
        assert_same(padded, run(model, head, packer, batch))


def test_batches_packing_barely_shortens_run_padded():
    # min_saved (the trainer's 'auto' on CUDA: PACK_MIN_SAVED): a batch that packing would shorten by less runs
    # padded, said once; one that it shortens by more runs packed. Either way the results are the padded ones.
    model = tiny_model("llama", lora=True)
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    padded = run(model, head, None, batch)
    probe = Packer()
    with _no_fallback():
        run(model, head, probe, batch, grad=False)
    saved = 1 - probe.last_plan.length / batch[0].numel()
    assert 0.05 < saved < 0.95
    barely = Packer(min_saved=saved + 0.01)
    with pytest.warns(UserWarning, match=f"shorten by less than {saved + 0.01:.0%} run padded"):
        assert_same(padded, run(model, head, barely, batch))
    assert barely.last_plan is None
    enough = Packer(min_saved=saved - 0.01)
    with _no_fallback():
        assert_same(padded, run(model, head, enough, batch))
    assert enough.last_plan is not None
    with pytest.raises(ValueError, match="min_saved"):
        Packer(min_saved=1.0)


def test_compiled_packed_graph_keeps_every_fusion():
    # Through the fastgrpo backend: the packed graphs (dense mask, with grads; flex_attention BlockMask, forward
    # only on CPU; variable-length segments, with grads) match the same patterns at the same number of sites as
    # the padded one, with no near misses. Each is a decoder-layer graph (the layers are compiled one region each;
    # with grads, layer 0, whose input needs no grad here, compiles a graph of its own).
    # Rows over several 128-token blocks, so the BlockMask has skipped, partial and full blocks. Several compiles:
    # the slowest test here.
    model = tiny_model("qwen3", lora=True)
    head = head_on(model, compiled=True)
    batch = padded_batch(model.config.vocab_size, LONG_ROWS, LONG_SHARED)
    head.prompt_columns = max(p for p, _ in LONG_ROWS)

    def reports(packer, grad):
        fastgrpo.clear_fusion_reports()
        result = run(model, head, packer, batch, max(c for _, c in LONG_ROWS), grad=grad)
        found = set()  # per compiled graph, what each pattern matched
        for report in fastgrpo.fusion_reports():
            for name, record in report["patterns"].items():
                assert not record["near_misses"], (name, record["near_misses"])
            found.add(tuple((name, record["matched"]) for name, record in report["patterns"].items()))
        return result, found

    padded, padded_found = reports(None, grad=False)
    assert len(padded_found) == 1
    matched = dict(next(iter(padded_found)))
    assert matched["rms_norm"] > 0 and matched["rope"] > 0 and matched["gated_mlp"] > 0
    with _no_fallback():
        packed, packed_found = reports(Packer(share_prompt=True), grad=True)
        flex, flex_found = reports(Packer(share_prompt=True, attention="flex_attention"), grad=False)
        segments, segments_found = reports(Packer(), grad=True)  # variable-length attention, no sharing
    assert packed_found == padded_found == flex_found == segments_found
    assert packed[3] and segments[3]  # gradients flowed through the compiled graphs (values: the uncompiled tests)
    assert flex[0].abs().max() > 0
    for result in (packed, flex, segments):
        torch.testing.assert_close(result[0], padded[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result[1], padded[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("own", ["sdpa", "eager"])
def test_attention_follows_the_mask_not_a_setting_around_the_call(own):
    # Non-reentrant checkpointing re-runs each layer's forward during backward, after whatever context wrapped the
    # forward has exited: a packed BlockMask must reach flex_attention in that re-run too (a context that switched
    # the model to flex_attention only around the forward sent it to SDPA there), and padded calls must keep the
    # model's own attention. Calling the decoder again with the packed arguments is what the re-run does.
    model = tiny_model("llama", lora=True, attn_implementation=own)
    base = model.get_base_model()
    ids, mask, labels = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        padded = base.model(input_ids=ids, attention_mask=mask).last_hidden_state
        call = Packer(attention="flex_attention").prepare(base, {"input_ids": ids, "attention_mask": mask}, labels,
                                                          PROMPT_COLUMNS)
        assert isinstance(call.kwargs["attention_mask"], BlockMask)
        first = base.model(**call.kwargs).last_hidden_state
        rerun = base.model(**call.kwargs).last_hidden_state
        padded_after = base.model(input_ids=ids, attention_mask=mask).last_hidden_state
        dense = Packer(attention="dense").prepare(base, {"input_ids": ids, "attention_mask": mask}, labels,
                                                  PROMPT_COLUMNS)
        dense_hidden = base.model(**dense.kwargs).last_hidden_state
    assert base.config._attn_implementation == packed_dispatch.PACKED_ATTENTION_PREFIX + own
    assert torch.equal(rerun, first)
    assert torch.equal(padded_after, padded)
    torch.testing.assert_close(first, dense_hidden, rtol=1e-5, atol=1e-5)


def test_trainer_packs_by_default(tmp_path):
    import fastgrpo.integrations.trl as F

    def on(device: str, **config) -> bool:
        return trainer_rule("_packing_on", tmp_path, device, **config)

    config = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert config.fastgrpo_packing == "auto" and config.fastgrpo_shared_prompt
    assert on("cuda") and on("cpu") and on("cpu", fastgrpo_packing="true")
    assert not on("cuda", fastgrpo_packing=False) and not on("cpu", fastgrpo_packing=False)


def test_packed_attention_never_takes_the_flex_decoding_kernel(monkeypatch):
    # Inductor lowers flex_attention with fewer than 128 queries to its flex-decoding kernel, an inference kernel
    # that found no valid config for packed masks on an H200 (NoValidChoicesError): a packed forward asks for the
    # flex_attention kernel at every length, keeping any kernel options of the caller.
    from transformers.integrations import flex_attention as hf_flex

    seen = []
    run_flex = hf_flex.compile_friendly_flex_attention

    def recording(*args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return run_flex(*args, kernel_options=kernel_options, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", recording)
    model = tiny_model("llama", lora=True)
    base = model.get_base_model()
    ids, mask, labels = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        call = Packer(attention="flex_attention").prepare(base, {"input_ids": ids, "attention_mask": mask}, labels,
                                                          PROMPT_COLUMNS)
        assert call.plan.length < 128
        base.model(**call.kwargs)
        base.model(**call.kwargs, kernel_options={"BLOCK_M": 64})
    layers = model.config.num_hidden_layers
    assert seen == [{"FORCE_USE_FLEX_ATTENTION": True}] * layers + [{"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64}] * layers


# ---- packed calls whose layer calls replay as CUDA graphs ----


def _replaying(share=False) -> Packer:
    packer = Packer(share_prompt=share)
    packer.replays = lambda tokens, device: True  # the trainer's answer where the layer graphs take the calls
    return packer


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3", "doge"])  # gemma3, doge: sliding windows cut the rows
@pytest.mark.parametrize("share", [False, True])
def test_a_call_whose_layers_replay_takes_a_bucket_s_shapes_and_gives_the_same_values(arch, share):
    # The layer graphs key a call by its inputs' shapes and ints: the packed call takes a length bucket's tokens
    # (the appended ones a segment of their own), a fixed number of segments, the keys' gather of a bucket's length,
    # and longest segments rounded up to a power of 2. Log-probs, entropies and LoRA gradients stay the padded
    # batch's; no mask is built (every layer takes the segments).
    model = tiny_model(arch, lora=True, **ARCHS[arch])
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    padded = run(model, head, None, batch)
    packer = _replaying(share)
    with _no_fallback():
        assert_same(padded, run(model, head, packer, batch))
    natural, plan = plan_packing(*batch, PROMPT_COLUMNS, share)[0], packer.last_plan
    assert plan.length == bucket_length(natural.length) > natural.length
    assert plan.cu_seqlens.numel() == graph_segments(len(ROWS)) + 1
    assert plan.cu_seqlens.tolist()[: natural.cu_seqlens.numel() + 1] == [*natural.cu_seqlens.tolist(), plan.length]
    # At least the most a bucket appends (here more than any row's length), so the appended segment moves neither.
    least = bucket_step(natural.length)
    assert plan.longest == next_power_of_2(max(natural.longest, least))
    keys = int(natural.cu_seqlens_k[-1])
    least_k = least + (bucket_step(keys + plan.length - natural.length) if share else 0)
    assert plan.longest_k == next_power_of_2(max(natural.longest_k, least_k))
    if share:
        keys = int(natural.cu_seqlens_k[-1])
        assert plan.kv_index.numel() == bucket_length(keys + plan.length - natural.length) == int(plan.cu_seqlens_k[-1])
        assert torch.equal(plan.kv_index[:keys], natural.kv_index)
        assert plan.kv_index[keys:].min() >= natural.length  # the appended segment sees appended tokens only
    else:
        assert plan.kv_index is None and plan.cu_seqlens_k is plan.cu_seqlens
    call = packer.prepare(model.get_base_model(), {"input_ids": batch[0], "attention_mask": batch[1]}, batch[2],
                          PROMPT_COLUMNS)
    assert call.kwargs["fastgrpo_mask_free"] and call.kwargs["attention_mask"].shape == (1, 1, 1, 1)


def test_batches_of_one_bucket_give_their_calls_one_key():
    # Two batches whose packed lengths differ but share a bucket: the same shapes and ints in every input of the
    # decoder's call (what a layer graph's key holds), so one graph serves both.
    model = tiny_model("llama", lora=True)
    base = model.get_base_model()
    shorter = [(p, max(c - 1, 0)) for p, c in ROWS]
    calls = []
    for rows in (ROWS, shorter):
        ids, mask, labels = padded_batch(model.config.vocab_size, rows=rows)
        call = _replaying(share=True).prepare(base, {"input_ids": ids, "attention_mask": mask}, labels,
                                              max(p for p, _ in rows))
        calls.append({k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                      for k, v in call.kwargs.items()})
        assert call.plan.length == bucket_length(plan_packing(ids, mask, labels, max(p for p, _ in rows),
                                                              True)[0].length)
    assert calls[0] == calls[1]


def test_layers_that_need_the_mask_get_it_and_no_bucket():
    # Soft-capped logits (gemma2): its layers take the mask, so the call carries it and keeps its own length (a mask's
    # closure would not follow a graph's replay).
    model = tiny_model("gemma2", lora=True, **ARCHS["gemma2"])
    ids, mask, labels = padded_batch(model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call = _replaying().prepare(model.get_base_model(), {"input_ids": ids, "attention_mask": mask}, labels,
                                    PROMPT_COLUMNS)
    assert not call.kwargs.get("fastgrpo_mask_free")
    assert call.plan.length == plan_packing(ids, mask, labels, PROMPT_COLUMNS)[0].length


def test_sliding_windows_are_mask_free_where_flash_takes_a_window(monkeypatch):
    # Sliding-window layers take their window from each call (flash's window on CUDA, SDPA's mask a segment at a
    # time on CPU), so a windowed model's packed calls need no mask, unless this torch's flash kernel takes no window.
    model = tiny_model("gemma3", lora=True, **ARCHS["gemma3"])
    decoder, cuda = model.get_base_model().base_model, torch.device("cuda")
    assert packed_dispatch.segments_everywhere(model.config, decoder, torch.bfloat16, torch.device("cpu"), True)
    monkeypatch.setattr(packed_dispatch, "FLASH_TAKES_WINDOW", True)
    assert packed_dispatch.segments_everywhere(model.config, decoder, torch.bfloat16, cuda, True)
    monkeypatch.setattr(packed_dispatch, "FLASH_TAKES_WINDOW", False)
    assert not packed_dispatch.segments_everywhere(model.config, decoder, torch.bfloat16, cuda, True)
    llama = tiny_model("llama", lora=True)
    llama_decoder = llama.get_base_model().base_model
    assert packed_dispatch.segments_everywhere(llama.config, llama_decoder, torch.bfloat16, cuda, True)


def test_a_layer_s_window_comes_from_its_call_or_else_from_the_config():
    # Most models pass `sliding_window` to the attention function; some (PhiMoE, Doge) put the window into the mask
    # alone, which segments do not read: the config's layer kinds give it then. A layer that cannot be placed in a
    # model of both kinds takes the mask.
    doge, gemma2 = tiny_config("doge", sliding_window=4), tiny_config("gemma2", sliding_window=4)
    layer = lambda config, index: SimpleNamespace(config=config, layer_idx=index)  # noqa: E731
    assert windows.layer_window(layer(doge, 1), {"sliding_window": None}) is None  # the call decides
    assert windows.layer_window(layer(doge, 1), {}) == 4
    assert windows.layer_window(layer(tiny_config("llama"), 0), {}) is None
    assert [windows.layer_window(layer(gemma2, i), {}) for i in (0, 1)] == [4, None]
    unplaced = layer(gemma2, None)
    assert windows.layer_window(unplaced, {}) == windows.UNKNOWN_WINDOW
    window = packed_dispatch._window_of_call(unplaced, 8, {})
    query = torch.zeros(8, 2, 16)
    assert not packed_dispatch._layer_takes_varlen(unplaced, query, query, window, {})
    assert packed_dispatch._window_of_call(layer(doge, 0), 4, {}) is None  # segments no longer than the window


@pytest.mark.parametrize("arch, overrides, cuts", [
    ("qwen2", dict(sliding_window=4, use_sliding_window=False), False),  # a window in the config, no sliding layer
    ("qwen2", dict(sliding_window=4, use_sliding_window=True, max_window_layers=0), True),
    ("mistral", dict(sliding_window=4), True), ("mistral", dict(sliding_window=None), False),
    ("gemma2", dict(sliding_window=4), True),  # sliding and full layers
    ("phi3", dict(sliding_window=4), True),
])
def test_window_cuts_rows_reads_the_sliding_layers(arch, overrides, cuts):
    config = tiny_config(arch, **overrides)
    assert packing.window_cuts_rows(config, 2 * 4) == cuts
    assert not packing.window_cuts_rows(config, 2 * 4 - 1)


@pytest.mark.parametrize("window, packs", [(4, True), (8, True), (9, False), (None, False)])
def test_a_sliding_window_that_cuts_the_rows_packs_whatever_padding_it_drops(window, packs):
    # Under min_saved, a batch runs packed all the same where its rows (16 columns) span at least WINDOW_PACK_ROWS
    # (2) windows: padded, its sliding layers would attend every key of a row through the mask. The values stay
    # the padded batch's either way.
    model = tiny_model("gemma3", lora=True, sliding_window=window) if window else tiny_model("llama", lora=True)
    head = head_on(model)
    batch = padded_batch(model.config.vocab_size)
    assert batch[0].size(1) == 16
    padded = run(model, head, None, batch)
    packer = Packer(min_saved=0.99)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert_same(padded, run(model, head, packer, batch))
    assert (packer.last_plan is not None) == packs
    assert any("run padded" in str(w.message) for w in said) == (not packs)


def test_a_mask_free_call_that_reaches_a_layer_without_segments_fails_loudly(monkeypatch):
    # segments_everywhere decides from the model; should a layer's call still refuse the segments, the call stops
    # with the setting that avoids it, rather than attending across rows.
    model = tiny_model("llama", lora=True)
    head = head_on(model)
    monkeypatch.setattr(packed_dispatch, "_layer_takes_varlen", lambda *args: False)
    with pytest.raises(RuntimeError, match="fastgrpo_packing=False"):
        run(model, head, Packer(), padded_batch(model.config.vocab_size), grad=False)


def test_a_padded_plan_refuses_shapes_that_cannot_hold_it():
    ids, mask, labels = padded_batch(vocab=50)
    plan = plan_packing(ids, mask, labels, PROMPT_COLUMNS, share_prompt=True)[0]
    segments = plan.cu_seqlens.numel() - 1
    with pytest.raises(ValueError, match="cannot hold"):
        pad_plan(plan, plan.length - 1, segments + 1)
    with pytest.raises(ValueError, match="cannot hold"):
        pad_plan(plan, plan.length, segments)
    with pytest.raises(ValueError, match="key gather"):
        pad_plan(plan, plan.length + 4, segments + 1, int(plan.cu_seqlens_k[-1]) + 3)


# What the packer says when layers take the mask rather than variable-length attention: packed all the same.
ATTENTION_NOTES = "fastgrpo: (packed rows|sliding-window layers) run .*, not variable-length attention"


@contextlib.contextmanager
def _no_fallback():
    """Fail on any fastgrpo warning but the attention notes (a fallback to the padded path would make a comparison
    vacuous)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastgrpo:")
        warnings.filterwarnings("ignore", message=ATTENTION_NOTES)
        yield


# ---- through the trainer ----


@pytest.fixture(scope="module")
def trainer_case():
    from tests import test_trl_integration as trl_case

    return trl_case


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_trainer_packing_matches_padded(trainer_case, tmp_path, shared_prompt):
    from datasets import Dataset
    from peft import LoraConfig

    import fastgrpo.integrations.trl as F

    case = trainer_case
    tokenizer = case.tiny_tokenizer(case.PROMPTS + ["the quick brown fox jumps", "a b c d e f g"], case.VOCAB)
    results = []
    for packing_on in (False, True):
        args = F.GRPOConfig(**case.common_args(
            tmp_path, fastgrpo_compile=False, fastgrpo_mini_batch=3, fastgrpo_logprob_chunk=5, bf16=False,
            num_iterations=2, beta=0.04, loss_type="dapo", fastgrpo_packing=packing_on,
            fastgrpo_shared_prompt=shared_prompt,
        ))
        trainer = F.GRPOTrainer(
            model=case.tiny_model(tokenizer), reward_funcs=case.low_id_fraction, args=args,
            train_dataset=Dataset.from_dict({"prompt": case.PROMPTS}), processing_class=tokenizer,
            peft_config=LoraConfig(**case.LORA),
        )
        case.set_params(trainer.model, seed=1, scale=0.3, only_lora=True)
        with _no_fallback() if packing_on is True else contextlib.nullcontext():
            inputs = case.make_inputs(trainer, tokenizer.eos_token_id)
            case.set_params(trainer.model, seed=2, scale=0.3, only_lora=True)
            loss, grads = case.loss_and_grads(trainer, inputs, case.lora_params)
        packer = trainer._fastgrpo_heads[0].packer
        if packing_on is True:
            assert packer.last_plan is not None
            # Mini-batches of 3 rows split the groups of 4; rows of a group inside one mini-batch still share.
            assert (packer.last_plan.shared_rows > 0) == shared_prompt
        else:
            assert packer is None
        results.append((inputs, loss, grads))
    (expected, expected_loss, expected_grads), (inputs, loss, grads) = results
    mask = inputs["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(inputs[key][mask], expected[key][mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert len(grads) == 2 * 7 * 2
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        error = (grads[name] - grad).abs().max() / grad.abs().max()
        assert error <= 1e-4, f"{name}: relative error {error:.2e}"


# ---- GPU: flex_attention with gradients, inductor, long sequences ----


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3"])
def test_gpu_flex_packed_and_shared_match_padded(arch):
    # float32: flash's variable-length kernel takes half precision only, so packed rows take flex_attention here.
    torch.manual_seed(0)
    model = tiny_model(arch, lora=True, **ARCHS[arch]).cuda()
    # As the trainer runs it: non-reentrant checkpointing around each layer, inside the compiled decoder.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = head_on(model)
    head.backbone = CompiledBackbone(True, None)  # the fastgrpo backend's defaults: inductor, Triton ops
    for rows, shared in ((ROWS, SHARED), (LONG_ROWS, LONG_SHARED)):
        batch = tuple(t.cuda() for t in padded_batch(model.config.vocab_size, rows, shared))
        head.prompt_columns = max(p for p, _ in rows)
        completions = max(c for _, c in rows)
        padded = run(model, head, None, batch, completions)
        with _no_fallback():
            for packer in (Packer(), Packer(share_prompt=True)):
                assert_same(padded, run(model, head, packer, batch, completions), rtol=1e-4)
                assert packer.last_plan is not None


@pytest.mark.parametrize("arch, device", [("llama", "cpu")] + [
    pytest.param(arch, "cuda", marks=pytest.mark.gpu) for arch in ("llama", "qwen3", "phi3", "gemma3")])
def test_bf16_segments_match_padded_attention(monkeypatch, arch, device):
    # Under bf16 autocast, as the trainer runs on CUDA, packed rows (and shared prompts) run variable-length attention
    # in every layer (flash's kernel on CUDA, with gemma3's sliding window: no mask at all), in bf16 (HF's RoPE hands attention fp32 q and k; autocast's dtype applies, as for
    # SDPA), through the compiled decoder with checkpointing. Against fp32 padded results its log-probs and LoRA
    # gradients are as close as the padded batch's under the same autocast (bf16 rounding only; rows attending across
    # segments would be off by O(1)).
    segment_dtypes = []

    @torch._dynamo.disable  # counted outside the graph: a list mutated inside it would be guarded on, call by call
    def counting(*args):
        segment_dtypes.append(compute_dtype(args[0]))
        return packed_attention(*args)

    monkeypatch.setattr(packed_dispatch, "packed_attention", counting)
    torch.manual_seed(0)
    model = tiny_model(arch, lora=True, **ARCHS[arch]).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = head_on(model)
    head.backbone = CompiledBackbone(True, None if device == "cuda" else {"inner": "aot_eager"})
    batch = tuple(t.to(device) for t in padded_batch(model.config.vocab_size, LONG_ROWS, LONG_SHARED))
    head.prompt_columns = max(p for p, _ in LONG_ROWS)
    completions = max(c for _, c in LONG_ROWS)
    reference = run(model, head, None, batch, completions)

    def error(packer):
        with torch.autocast(device, torch.bfloat16), _no_fallback():
            lp, _, mask, grads = run(model, head, packer, batch, completions)
        worst = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in reference[3].items())
        return (lp - reference[0])[mask].abs().max().item(), worst

    padded = error(None)
    assert not segment_dtypes
    # The last two as calls whose layers replay as CUDA graphs send them: a bucket's shapes, empty segments last.
    for packer in (Packer(), Packer(share_prompt=True), _replaying(), _replaying(share=True)):
        segment_dtypes.clear()
        segments = error(packer)
        assert packer.last_plan is not None and (packer.last_plan.kv_index is not None) == packer.share_prompt
        # Forward and checkpoint recompute of every layer.
        assert segment_dtypes == [torch.bfloat16] * 2 * model.config.num_hidden_layers
        for got, bound in zip(segments, padded):
            assert got <= 2 * bound + 1e-2, (packer.share_prompt, segments, padded)


@pytest.mark.gpu
def test_gpu_block_mask_for_long_packed_batch_stays_small():
    # 8 rows of up to 4.3k tokens behind one 256-token prompt: ~20k packed tokens (a dense bool mask: ~0.4 GB).
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(410, 4097, (8,), generator=generator).tolist()
    columns = 256 + max(completions)
    ids = torch.randint(3, 1000, (8, columns), generator=generator)
    ids[:, :256] = ids[0, :256]
    mask = torch.zeros_like(ids)
    for row, length in enumerate(completions):
        mask[row, : 256 + length] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :256] = -100
    ids, mask, labels = ids.cuda(), mask.cuda(), labels.cuda()
    for share in (False, True):
        plan = plan_packing(ids, mask, labels, 256, share)[0]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        blocks = block_mask(plan)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < 256 * 2**20
        assert blocks.shape[-1] == plan.length
        density = blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum()
        assert density < (plan.length / 128) ** 2 / 4  # block-sparse, not causal-dense
