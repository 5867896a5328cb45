"""Run by tests/test_compile_cache.py in a fresh process: `python -m tests.compile_cache_qlora_child CACHE`.

Enables the persistent compile cache at CACHE and builds bench/grpo_qlora_step.py's tiny policy (Qwen2.5-1.5B's
config shrunk to 2 layers, a bitsandbytes 4-bit NF4 base with PEFT LoRA in bf16, decoder layers compiled one
region each through the fastgrpo backend with inductor, dynamic shapes, offloaded checkpointing). Runs the policy
update's decoder forward and backward, then a no-grad scoring forward. Prints one JSON line: SHA-256 digests of
the hidden states, the LoRA gradients and the scoring pass's hidden states, and what Dynamo's, AOTAutograd's and
inductor's counters counted.
"""
import hashlib
import json
import sys

import torch
from torch._dynamo.utils import counters

from fastgrpo.compiler.cache import enable_compile_cache


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(cache: str) -> None:
    torch.set_num_threads(1)
    enable_compile_cache(cache)
    from bench.grpo_qlora_step import build_policy

    model = build_policy(tiny=True, offload=True, inner="inductor", device=torch.device("cpu"))
    decoder = model.get_base_model().get_decoder()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    counters.clear()
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    hidden.float().square().mean().backward()
    grads = [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None]
    assert grads
    with torch.no_grad():
        scored = decoder(input_ids=ids, use_cache=False).last_hidden_state
    print(json.dumps({
        "hidden": digest(hidden), "grads": digest(*grads), "scored": digest(scored),
        "counters": {group: dict(counters[group]) for group in ("stats", "aot_autograd", "inductor")},
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
