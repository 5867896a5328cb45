"""The trainer's "auto" sizes: rows per forward pass and tokens per log-prob call, from free accelerator memory; and
what to change when a step does not fit."""
from __future__ import annotations

import torch


# Fraction of the free accelerator memory the "auto" sizes may plan to use. The rest is left to
# the optimizer step, the allocator's fragmentation and whatever else shares the device.
AUTO_MEMORY_FRACTION = 0.5
# "auto" sizes on CPU, where free memory says little about what is fast: a fixed, modest size.
CPU_MINI_BATCH = 8
CPU_LOGPROB_CHUNK = 4096
# Smallest "auto" token chunk on an accelerator.
MIN_LOGPROB_CHUNK = 4096


def _free_accelerator_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take: the device's free memory plus what torch's caching allocator holds
    unused. `mem_get_info` alone counts the allocator's cache as taken, and sizes planned from it shrink as the
    cache grows over a run (docs/measurements.md, "Rows per forward planned from what the allocator holds")."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(0, cached)
    return None


def _activation_bytes() -> int:
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda").itemsize
    return 4


def auto_mini_batch(
    model_config, rows: int, seq_len: int, device: torch.device, grad: bool, checkpointing: bool,
    offload: bool = False,
) -> int:
    """Rows per forward pass, so that one mini-batch's transient activations fit the memory budget.

    Per token, a decoder layer's intermediates are about 10 hidden-sized and 3 intermediate-sized
    tensors, alive one layer at a time. With grad, every row of the batch also keeps activations
    until the backward whatever the mini-batch (each layer's input under gradient checkpointing, in
    host memory when `offload`; all its intermediates without checkpointing), so those come off the
    budget first. Attention is assumed to be SDPA/flash (no [seq x seq] scores kept). The batch is cut
    into mini-batches as equal as can be (`equal_parts`): one call shape a pass, so that one compiled graph
    and one layer-graph key serve its mini-batches.
    """
    return equal_parts(rows, _rows_that_fit(model_config, rows, seq_len, device, grad, checkpointing, offload))


def equal_parts(rows: int, most: int) -> int:
    """Rows per part when `rows` are cut into the fewest parts of at most `most` rows, all but the last equal and
    the last at most one part's share smaller (64 rows, at most 40: 32 and 32; at most 30: 22, 22, 20)."""
    parts = -(-rows // max(1, min(rows, most)))
    return -(-rows // parts)


def _rows_that_fit(model_config, rows, seq_len, device, grad, checkpointing, offload) -> int:
    free = _free_accelerator_bytes(device)
    if free is None:
        return min(rows, CPU_MINI_BATCH)
    text = model_config.get_text_config()
    hidden, layers = text.hidden_size, text.num_hidden_layers
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    one_layer = (10 * hidden + 3 * inter) * _activation_bytes()
    kept = 0
    if grad and not (checkpointing and offload):
        kept = layers * (hidden * _activation_bytes() if checkpointing else one_layer)
    budget = free * AUTO_MEMORY_FRACTION - kept * rows * seq_len
    return max(1, min(rows, int(budget // (one_layer * seq_len))))


def auto_logprob_chunk(hidden_size: int, itemsize: int, device: torch.device) -> int:
    """Completion tokens per selective_logprob call.

    The op walks the [tokens x vocab] logits in fixed-size tiles, so what grows with the tokens of
    one call is per token: the gathered hidden row, its gradient and the op's d(hidden) output.
    A power of two, so that free memory that moves a little between steps leaves the call shapes as they were.
    """
    free = _free_accelerator_bytes(device)
    if free is None:
        return CPU_LOGPROB_CHUNK
    fits = int(free * AUTO_MEMORY_FRACTION) // (3 * hidden_size * itemsize)
    return max(MIN_LOGPROB_CHUNK, 1 << max(0, fits.bit_length() - 1))


def out_of_memory_note(args) -> str:
    """The note an out-of-memory error of a training step gets: the settings that size the step and what to change."""
    checkpointing = "" if args.gradient_checkpointing else "gradient_checkpointing=True (off now), "
    return (
        f"fastgrpo: the step did not fit in memory (per_device_train_batch_size={args.per_device_train_batch_size}, "
        f"num_generations={args.num_generations}, max_completion_length={args.max_completion_length}, "
        f"fastgrpo_mini_batch={args.fastgrpo_mini_batch!r}). Change one of: {checkpointing}fastgrpo_mini_batch to a "
        "few rows (rows per log-prob forward), a shorter max_completion_length, fewer rows per step "
        "(per_device_train_batch_size, with more gradient_accumulation_steps for the same batch), "
        "fastgrpo_generation_release_memory=True (the rollouts' cache freed for the update), or a 4-bit base (QLoRA). "
        "Checkpoints written so far are kept."
    )
