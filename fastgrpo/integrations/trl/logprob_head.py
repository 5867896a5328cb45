"""The log-prob head that replaces TRL's fused LM head: log-probs from hidden states through
`fastgrpo::selective_logprob`, the decoder called through the compiled backbone."""
from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass

import torch
from trl.trainer.utils import FusedCausalLMOutput

from fastgrpo.compiler import compile_repeated_blocks, fastgrpo_backend
from fastgrpo.compiler.regions import repeated_blocks, unsplit_by_ddp
from fastgrpo.integrations.generation.experts import is_expert_lora
from fastgrpo.integrations.packing import Packer
from fastgrpo.kernels.selective_logprob import selective_logprob
from fastgrpo.integrations.trl.sizing import auto_logprob_chunk


def _logit_scale(text_config) -> float:
    """The multiplier the model applies to its logits before the softcap (same reading as TRL's fused head)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        # Granite and MiniCPM3 divide by `logits_scaling`; HyperCLOVA X multiplies by it.
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def load_balancing_loss(router_logits, text_config, attention_mask) -> torch.Tensor:
    """The MoE load-balancing loss of a forward's router logits, as TRL's fused head computes it: Mixtral's
    function (every MoE family's through transformers' modular system) over the rows' unmasked tokens."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


class CompiledBackbone:
    """Calls a decoder through `torch.compile(backend="fastgrpo")`, compiled once.

    A decoder with repeated blocks (its layers) has each block compiled as one region, in place
    (`compile_repeated_blocks`): one layer graph then serves every layer of the training forward and backward,
    and one more the no-grad scoring passes (a third when those run with other adapters than training), where
    the whole decoder traced as one graph was traced and compiled again for every kind of pass: the main job's
    first step on the 2-core CPU machine spent 111 s compiling two whole-decoder graphs (`fastgrpo train
    --max-steps 2`, SmolLM2-135M, aot_eager). Layers called with a KV cache (generation) run uncompiled. A decoder
    without repeated blocks is compiled whole, its wrapper kept here, so the model's modules, state dict and
    `generate` stay untouched; it is compiled again only if the module is replaced.
    """

    def __init__(self, enabled: bool, options: dict | None):
        self.enabled = enabled
        self.options = options
        self._module = None
        self._compiled = None

    def __call__(self, module: torch.nn.Module, *args, **kwargs):
        if not self.enabled:
            return module(*args, **kwargs)
        if self._module is not module:
            self._module = module
            self._compiled = self._compile(module)
        if self._compiled is module:  # the blocks are the compiled regions; they mark their own dynamic sizes
            return module(*args, **kwargs)
        # Lengths change every batch and the last mini-batch is often shorter: mark rows and sequence dynamic up
        # front instead of compiling a static graph first and a dynamic one on the next shape.
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(value, 0)
                torch._dynamo.maybe_mark_dynamic(value, 1)
        with unsplit_by_ddp():
            return self._compiled(*args, **kwargs)

    def _compile(self, module: torch.nn.Module):
        if any(is_expert_lora(m) for m in module.modules()):
            warnings.warn(
                "fastgrpo: the decoder runs uncompiled: it has LoRA on fused MoE experts (PEFT's ParamWrapper, what "
                "target_modules naming gate_proj/up_proj/down_proj gives on such a model), whose per-call "
                "parametrization, compiled, breaks non-reentrant checkpointing's recompute (CheckpointError). Target "
                "the attention projections (and any shared expert's) to compile it; the rollouts still merge the "
                "experts' LoRA.",
                stacklevel=2,
            )
            return module
        blocks = repeated_blocks(module)
        if blocks is None:
            # The backend registered as "fastgrpo", passed as the function so no installed entry point is needed.
            return torch.compile(module, backend=fastgrpo_backend, options=self.options)
        if not getattr(blocks[0], "_fastgrpo_compiled", False):  # another head on this decoder compiled them
            # dynamic: rows and lengths change every batch (packed or padded); one graph serves them all.
            compile_repeated_blocks(module, options=self.options, dynamic=True)
        return module


@dataclass
class LogprobHead:
    """Replaces TRL's fused LM head: `model(..., labels=..., fused_lm_head=True)` scores labels from hidden states.

    Mirrors `trl.trainer.utils.add_fused_lm_head`'s contract (labels shifted by one unless
    `shift_labels` is given; -100 ignored; a `FusedCausalLMOutput` whose per-token fields are zero at
    ignored positions), computing `log_probs` and, when `with_entropy` is set, `entropy`.
    """

    temperature: float
    cast_lm_head_to_fp32: bool
    logprob_chunk: int | str
    backbone: CompiledBackbone
    with_entropy: bool = True
    # Packs the rows of each forward (fastgrpo.integrations.packing); None runs them padded.
    packer: Packer | None = None
    # Columns of TRL's rows that hold the prompt (the rest is completion), set per call by the trainer.
    prompt_columns: int | None = None

    def install(self, model: torch.nn.Module) -> None:
        """Patch `model.forward` (the causal LM, not a PEFT wrapper); other calls go to the forward it had."""
        if model.get_output_embeddings().bias is not None:
            raise NotImplementedError(
                "fastgrpo's GRPOTrainer computes log-probs with selective_logprob, which has no LM-head bias; "
                f"{type(model).__name__} has one. Use TRL's GRPOTrainer for this model."
            )
        previous_forward = model.forward
        head = self
        text_config = model.config.get_text_config()
        logit_scale = _logit_scale(text_config)
        softcap = float(getattr(text_config, "final_logit_softcapping", None) or 0.0)

        # The model's own signature, seen through `__wrapped__`: generate() passes `logits_to_keep` and
        # `position_ids` only to forwards that name them (without it, every prefill computed the logits of every
        # prompt position, [rows, prompt, vocab]).
        @functools.wraps(type(model).forward)
        def fastgrpo_forward(
            self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
        ):
            if not fused_lm_head:
                return previous_forward(
                    *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
                )
            router = bool(kwargs.get("output_router_logits"))
            kwargs["use_cache"] = False
            packed = None
            # The load-balancing loss counts each row's tokens as TRL's padded rows do: its batches run padded.
            if head.packer is not None and not args and shift_labels is None and not router:
                packed = head.packer.prepare(self, kwargs, labels, head.prompt_columns)
            # Looked up on each call: PEFT and FSDP replace modules after the head is installed.
            if packed is not None:
                outputs = head.backbone(self.base_model, **packed.kwargs)
                # Only the scored positions: [1, N] hidden states and their targets.
                hidden, labels = outputs.last_hidden_state[:, packed.plan.source], packed.plan.targets[None]
            else:
                outputs = head.backbone(self.base_model, *args, **kwargs)
                if shift_labels is None:
                    hidden, labels = outputs.last_hidden_state[:, :-1], labels[:, 1:]
                else:
                    hidden, labels = outputs.last_hidden_state, shift_labels
            weight = self.get_output_embeddings().weight
            hidden, labels = hidden.to(weight.device), labels.to(weight.device)
            log_probs, entropy, mask = head.score(hidden, weight, labels, logit_scale, softcap)
            if packed is not None:  # back to the padded [B, S - 1] layout TRL slices
                log_probs = packed.plan.scatter(log_probs[0])
                entropy = None if entropy is None else packed.plan.scatter(entropy[0])
                mask = packed.plan.scored_mask()
            loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
            aux_loss = None
            if router:
                aux_loss = load_balancing_loss(outputs.router_logits, text_config, kwargs.get("attention_mask"))
                loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
            return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask,
                                       aux_loss=aux_loss)

        model.forward = types.MethodType(fastgrpo_forward, model)

    def score(self, hidden, weight, labels, logit_scale: float, softcap: float):
        """Log-probs (and entropy) of `labels` at the positions where they are not -100, zero elsewhere."""
        if self.cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        else:
            dtype = hidden.dtype
        mask = labels != -100
        # Only the scored positions go through the LM head: prompts and padding cost nothing.
        tokens, targets = hidden[mask].to(dtype), labels[mask]
        weight = weight.to(dtype)
        if tokens.shape[0] == 0:
            # Nothing to score: a zero that is still attached to the model, so backward() works.
            zero = hidden.new_zeros(mask.shape, dtype=torch.float32) + 0 * hidden.sum()
            return zero, (zero if self.with_entropy else None), mask
        chunk = self.logprob_chunk
        if chunk == "auto":
            chunk = auto_logprob_chunk(tokens.shape[1], tokens.element_size(), tokens.device)

        def score_chunk(start):
            result = selective_logprob(
                tokens[start : start + chunk],
                weight,
                targets[start : start + chunk],
                temperature=self.temperature,
                logit_scale=logit_scale,
                softcap=softcap,
                with_entropy=self.with_entropy,
            )
            return result if self.with_entropy else (result, None)

        pieces = [score_chunk(start) for start in range(0, tokens.shape[0], chunk)]
        # masked_scatter puts each value back at its position; every other position is 0.
        log_probs = torch.cat([p[0] for p in pieces])
        log_probs = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
        entropy = None
        if self.with_entropy:
            entropy = torch.cat([p[1] for p in pieces])
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        return log_probs, entropy, mask
