import os, sys, torch
sys.path.insert(0, "bench")
import grpo_step
from fastgrpo.kernels import _dispatch
grpo_step.FASTGRPO_OPTIONS["fastgrpo"] = {"keep_attention_output": True, "join_projections": True}
model = grpo_step.build_policy("fastgrpo", 64, tiny=True)
ids, mask, adv, tokens, lengths = grpo_step.make_batch(model.config.vocab_size, 16, 16, False, "cpu")
step = grpo_step.make_step("fastgrpo", model, mask.shape[1], 16)
step(ids, mask, adv)
