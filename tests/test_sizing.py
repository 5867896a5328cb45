"""The trainer's "auto" sizes (fastgrpo/integrations/trl/sizing.py): what they read of the device's memory, and the
mini-batches they cut a batch into."""
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from fastgrpo.integrations.trl import sizing

GIB = 1 << 30
CONFIG = SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=4096, num_hidden_layers=32,
                                                                 intermediate_size=14336))
CUDA = torch.device("cuda")


def fake_cuda(monkeypatch, free, reserved, allocated):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_free_memory_counts_what_the_allocator_holds_unused(monkeypatch):
    # After a step the caching allocator keeps what the update and the rollout freed: free to the next allocation,
    # taken to cudaMemGetInfo.
    fake_cuda(monkeypatch, free=20 * GIB, reserved=50 * GIB, allocated=25 * GIB)
    assert sizing._free_accelerator_bytes(CUDA) == 45 * GIB
    assert sizing._free_accelerator_bytes(torch.device("cpu")) is None


def test_the_mini_batch_does_not_shrink_as_the_allocator_caches(monkeypatch):
    """The same live tensors give the same mini-batch, however much the allocator keeps cached (an 8B update at
    64 x 768 once split into single rows in a later step)."""
    sizes = []
    for reserved in (26 * GIB, 40 * GIB, 70 * GIB):
        fake_cuda(monkeypatch, free=80 * GIB - reserved, reserved=reserved, allocated=25 * GIB)
        sizes.append(sizing.auto_mini_batch(CONFIG, rows=64, seq_len=768, device=CUDA, grad=True,
                                            checkpointing=True, offload=True))
    assert sizes == [64, 64, 64]


def test_offloaded_checkpoints_leave_the_budget_to_the_mini_batch(monkeypatch):
    # 64 rows x 768 of an 8B's layer inputs are 12.9 GB in bf16; offloaded they live in host memory.
    fake_cuda(monkeypatch, free=40 * GIB, reserved=0, allocated=0)
    kwargs = dict(rows=64, seq_len=768, device=CUDA, grad=True, checkpointing=True)
    on_device = sizing.auto_mini_batch(CONFIG, offload=False, **kwargs)
    offloaded = sizing.auto_mini_batch(CONFIG, offload=True, **kwargs)
    assert on_device < offloaded == 64
    # Without grad nothing is kept whatever the flags.
    assert sizing.auto_mini_batch(CONFIG, rows=64, seq_len=768, device=CUDA, grad=False, checkpointing=True) == 64


@given(rows=st.integers(1, 600), most=st.integers(1, 700))
def test_equal_parts(rows, most):
    size = sizing.equal_parts(rows, most)
    parts = math.ceil(rows / size)
    assert 1 <= size <= max(1, min(rows, most))
    assert parts == math.ceil(rows / max(1, min(rows, most)))  # no more parts than the limit needs
    last = rows - (parts - 1) * size
    assert 0 < last <= size and size - last < parts  # all but the last equal, the last short by less than a row a part


@pytest.mark.parametrize("rows, most, size", [(64, 40, 32), (64, 30, 22), (64, 64, 64), (64, 63, 32), (7, 1, 1)])
def test_equal_parts_examples(rows, most, size):
    assert sizing.equal_parts(rows, most) == size


def test_logprob_chunk_is_a_power_of_two_that_holds_between_steps(monkeypatch):
    chunks = set()
    for free in (30 * GIB, 31 * GIB, 33 * GIB):
        fake_cuda(monkeypatch, free=free, reserved=0, allocated=0)
        chunks.add(sizing.auto_logprob_chunk(4096, 2, CUDA))
    (chunk,) = chunks
    assert chunk & (chunk - 1) == 0 and chunk >= sizing.MIN_LOGPROB_CHUNK
    fake_cuda(monkeypatch, free=0, reserved=0, allocated=0)
    assert sizing.auto_logprob_chunk(4096, 2, CUDA) == sizing.MIN_LOGPROB_CHUNK
