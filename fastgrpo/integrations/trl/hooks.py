"""Small model and process adjustments the trainer makes: the input-embedding hook kept single, bitsandbytes' 4-bit
layers kept on their autograd path, long-lived objects frozen out of the garbage collector."""
from __future__ import annotations

import gc
import types

import torch
from transformers import TrainerCallback



def keep_one_input_require_grads_hook(model, needed: bool) -> None:
    """Stop `enable_input_require_grads` hooks piling up on the input embeddings.

    `gradient_checkpointing_enable()` registers a new hook every time it runs, and
    `gradient_checkpointing_disable()` removes it only for transformers-integrated PEFT. TRL turns
    checkpointing off and on around generation and every no-grad log-prob pass, so a PeftModel gains
    hooks every step; each changes the compiled decoder's guards, which recompiles it until Dynamo's
    recompile limit leaves the decoder uncompiled. Only reentrant checkpointing needs the hook (it
    backpropagates only through inputs that require grad): keep exactly one then, none otherwise.
    """
    register = type(model).enable_input_require_grads

    def enable_input_require_grads(self):
        self.disable_input_require_grads()
        if needed:
            register(self)

    model.enable_input_require_grads = types.MethodType(enable_input_require_grads, model)
    model.enable_input_require_grads()


def keep_bnb_4bit_on_its_autograd_path(model: torch.nn.Module) -> None:
    """bitsandbytes (0.50) on a CPU with AVX512-BF16 switches a 4-bit linear, at its first no-grad eval forward
    (generation), to an inference kernel that repacks the weight for good; every later call - generation
    included - then fails on the repacked shape, and training forwards have no autograd there. GRPO
    alternates generation and training on the same weights, so keep every 4-bit linear on the path that does
    both (a no-op on CUDA and on CPUs without AVX512-BF16)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


class FreezeLongLivedObjects(TrainerCallback):
    """gc.collect() then gc.freeze() after the first optimizer step, gc.unfreeze() when training ends.

    A full (generation-2) collection walks every tracked Python object; with a compiled model (Dynamo/inductor
    caches, FX graphs, the model, TRL, transformers) that is hundreds of thousands of them, so each one stalls the
    host for hundreds of ms, at a random step, with the GPU idle. Frozen objects are left out of every later
    collection. The one collection first frees what is already garbage, so that nothing unreachable is frozen;
    objects created later are collected as usual. (Unfreezing also unfreezes what other code froze: that only
    makes later collections walk those objects again.)"""

    def __init__(self):
        self.frozen = False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.frozen:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
