"""Tiny random-init causal LMs of any installed architecture, for `fastgrpo report` and tests."""
import torch
import transformers

from fastgrpo.errors import UserError

# Small sizes that every decoder-only config accepts; head_dim 32 keeps vLLM's CPU attention happy.
_SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# Short names users type -> transformers model_type.
ALIASES = {"gemma3": "gemma3_text"}


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    model_type = ALIASES.get(arch, arch)
    try:
        return transformers.AutoConfig.for_model(model_type, **(_SMALL | overrides))
    except ValueError as err:
        raise UserError(f"unknown architecture {arch!r}: give a transformers model_type such as llama, qwen3, gemma2") from err


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, lora: bool = False, seed: int = 0, **overrides):
    """A random-init causal LM in training mode, optionally wrapped in PEFT LoRA on every projection."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(dtype)
    if lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
            target_modules=[t for t in targets if t in present],
        )
        model = peft.get_peft_model(model, config)
    model.train()
    return model
