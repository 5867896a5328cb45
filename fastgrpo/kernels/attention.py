"""SDPA's attention as an op whose output a gradient checkpoint's re-run takes back instead of computing again.

Under checkpointing (fastgrpo.compiler.offload) a decoder layer's forward runs twice: in the forward, and again in
backward to make the tensors the layer's backward reads. Attention's backward reads q, k and v, its output and the
softmax's log-sum-exp. q, k and v are cheap to make again (projections, RoPE); the output is not: at the GRPO step's
8 x 16640 positions (Qwen2.5-1.5B heads) a layer's causal attention forward is ~6.8 TFLOP, ~12 ms on cuDNN's kernel
on an H200 (`python bench/bench_attention.py --seq 16640`), paid a second time by every layer's re-run.
`fastgrpo::attention` runs the kernel SDPA runs (cuDNN's fused attention on CUDA, SDPA's flash kernel for the CPU)
and returns (output, log-sum-exp); its backward is that kernel's own backward from them. Inside a checkpointed call
it keeps both in the forward (`_dispatch.kept_or_computed`, which the checkpoint moves to host memory beside the
layer's input) and in the re-run returns them instead of running the kernel. Outside a checkpoint it is SDPA.

Layout as SDPA's: q [batch, heads, seq, D], k and v [batch, kv_heads, seq_k, D] (heads a multiple of kv_heads:
grouped-query attention), `attn_mask` boolean (True: may attend) or additive, broadcastable to [batch, heads, seq,
seq_k]. No dropout: a re-run would have to replay its mask.
"""
import torch

from fastgrpo.kernels._dispatch import kept_or_computed
from fastgrpo.kernels.packed_attention import compute_dtype

# What a boolean mask's hidden keys add to the scores on cuDNN: finite, as SDPA's own conversion for cuDNN
# (`convert_boolean_attn_mask_cudnn`, torch 2.5-2.10: -inf made cuDNN's softmax NaN on fully hidden rows).
_CUDNN_HIDDEN = -65504.0


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as SDPA hands it to the kernel: 0 where a key may be seen, a large negative number where not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    hidden = _CUDNN_HIDDEN if mask.is_cuda else float("-inf")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, hidden)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (same arguments, dropout 0) through `fastgrpo::attention`."""
    if dropout_p:
        raise ValueError(f"fastgrpo attention takes no dropout (got dropout_p={dropout_p}): its checkpoint re-run "
                         "returns the kept output, and a dropout mask would have to be replayed with it")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"{query.shape[1]} query heads against {key.shape[1]} key/value heads need enable_gqa=True")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    dtype = compute_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    return _attention_op(query, key, value, _additive_mask(attn_mask, dtype), is_causal, scale)[0]


def _repeat_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _kernel_forward(query, key, value, mask, is_causal, scale):
    """(output, log-sum-exp) from the kernel SDPA runs for these tensors."""
    if query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, True, 0.0, is_causal, False, scale=scale)[:2]
        return out, lse
    # SDPA's CPU flash kernel takes no grouped-query heads: repeat them (as SDPA's math path does).
    group = query.shape[1] // key.shape[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, _repeat_heads(key, group), _repeat_heads(value, group), 0.0, is_causal, attn_mask=mask, scale=scale)


@torch.library.custom_op("fastgrpo::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return kept_or_computed(lambda: _kernel_forward(query, key, value, mask, is_causal, scale))


@_attention_op.register_fake
def _(query, key, value, mask, is_causal, scale):
    # The aten kernels' own meta functions: the output's layout and the log-sum-exp's shape are theirs.
    return _kernel_forward(query, key, value, mask, is_causal, scale)


def _attention_backward(grad, query, key, value, mask, out, lse, is_causal, scale):
    if grad.stride() != out.stride():  # cuDNN reads the output's gradient in the output's layout
        grad = torch.empty_like(out).copy_(grad)
    if query.is_cuda:
        seed = torch.zeros((), dtype=torch.long, device=query.device)  # dropout's RNG state: no dropout
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, query, key, value, out, lse, seed, seed, mask, None, None, query.shape[2], key.shape[2], 0.0,
            is_causal, scale=scale)
    group = query.shape[1] // key.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, _repeat_heads(key, group), _repeat_heads(value, group), out, lse, 0.0, is_causal,
        attn_mask=mask, scale=scale)
    if group > 1:
        accumulate = torch.promote_types(dk.dtype, torch.float32)  # the group's sum in at least fp32
        dk, dv = (d.unflatten(1, (-1, group)).sum(2, dtype=accumulate).to(d.dtype) for d in (dk, dv))
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    query, key, value, mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, mask, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out, grad_lse):
    query, key, value, mask, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(grad_out, query, key, value, mask, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)
