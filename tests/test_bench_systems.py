"""bench/grpo_step.py's baselines run DESIGN.md §4's workload: every system checkpoints its decoder layers, inductor's
included (its layers are compiled inside HF's checkpoint, which still drops what they save). Its large peak is the
full logits', not saved activations."""
import torch

from bench.grpo_step import build_policy


def _forward_saved_tensors(model) -> int:
    """How many tensors autograd keeps from one forward of a short batch."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    ids = torch.randint(0, 512, (2, 48))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return len(saved)


def test_the_inductor_baseline_checkpoints_its_layers_as_eager_does():
    torch.manual_seed(0)
    eager = build_policy("eager", 64, tiny=True)
    inductor = build_policy("inductor", 64, tiny=True)
    checkpointed = _forward_saved_tensors(eager)
    assert _forward_saved_tensors(inductor) == checkpointed
    eager.gradient_checkpointing_disable()
    assert _forward_saved_tensors(eager) > 5 * checkpointed  # the count above is what checkpointing leaves
