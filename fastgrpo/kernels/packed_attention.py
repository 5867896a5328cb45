"""Causal attention over packed rows: one sequence of segments laid end to end, each attending only to itself.

The packed GRPO forward (fastgrpo.integrations.packing) puts a batch's rows one after the other. Given the segments
as cumulative lengths, CUDA runs flash attention's variable-length kernel, torch's own
(`aten._flash_attention_forward` and its backward), as the op `fastgrpo::flash_packed_attention`, which keeps its
output and log-sum-exp for a gradient checkpoint's re-run of the layer (as `fastgrpo::attention` does for padded
batches: the re-run takes them back instead of running attention again): on an H200 at the GRPO step's spread batch
(8 rows of 10-100 % of 4096 behind a 256-token prompt, Qwen2.5-1.5B heads) its forward + backward took 2.47 ms
against 3.74 ms for flex_attention with the packed BlockMask, 1.51x (`python bench/bench_packed_attention.py`). The
CPU path (and any tensor flash refuses) runs SDPA one segment at a time as the custom op
`fastgrpo::packed_attention`, whose backward recomputes each segment's attention from q, k and v, the only tensors
it saves.

Layout: q [T, heads, D], k and v [T, kv_heads, D] (heads a multiple of kv_heads: grouped-query attention),
`cu_seqlens` int32 [segments + 1] from 0 to T, `max_len` the longest segment. Returns [T, heads, D].
`window`: a sliding window as transformers' (a query sees keys fewer than `window` positions back), or None.

Segments with more keys than queries: with `cu_seqlens_k` (and `max_len_k`), k and v are [Tk, kv_heads,
D] and query segment i attends key segment i, aligned at their ends (as flash aligns causal attention when the two
lengths differ): the j-th of a segment's n_q queries sees its first j + n_k - n_q + 1 keys. A completion packed after
its group's shared prompt is such a segment: its queries are its own tokens, its keys the prompt's followed by its
own (gathered by the caller), so one prompt serves every completion of the group.
"""
import torch
import torch.nn.functional as F

from fastgrpo.kernels._dispatch import kept_or_computed

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
# Whether this torch's flash op takes a window (window_size_left; 2.13 does, and 2.11's varlen_attn passes one). Where
# it does not, windowed layers take the mask.
FLASH_TAKES_WINDOW = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def flash_refusal(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
                  window: int | None = None) -> str | None:
    """Why flash's variable-length kernel cannot take such inputs (None: it can)."""
    if device.type != "cuda":
        return f"flash attention runs on CUDA only (the tensors are on {device.type})"
    if dtype not in FLASH_DTYPES:
        return f"flash attention takes float16 or bfloat16, not {dtype}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"flash attention takes head dims that are multiples of 8 up to {FLASH_MAX_HEAD_DIM}, not {head_dim}"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    if window is not None and not FLASH_TAKES_WINDOW:
        return f"this torch's flash kernel ({torch.__version__}) takes no sliding window"
    return None


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (as SDPA under autocast, whatever the inputs' dtype;
    HF's RoPE multiplies bf16 projections by fp32 cos/sin into fp32 q and k), else the inputs'."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, scale: float | None = None, window: int | None = None,
                     cu_seqlens_k: torch.Tensor | None = None, max_len_k: int | None = None) -> torch.Tensor:
    """Causal attention within each segment of a packed sequence (layout in the module docstring), in
    `compute_dtype(query)`."""
    # The lengths stay untouched on the torch path: Dynamo guards on an int input's value once it is read.
    same_keys = cu_seqlens_k is None
    if same_keys:
        cu_seqlens_k = cu_seqlens
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape or (same_keys and query.shape[0] != key.shape[0]):
        raise ValueError(f"packed_attention takes q [T, heads, D] and k, v [T, kv_heads, D] (or [Tk, kv_heads, D] "
                         f"with cu_seqlens_k); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a sliding window spans at least the query itself (1)")
    dtype = compute_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    if flash_refusal(query.device, query.dtype, query.shape[-1], query.shape[1], key.shape[1], window) is None:
        if not same_keys and max_len_k is None:
            raise ValueError("packed_attention: cu_seqlens_k needs max_len_k, the longest key segment")
        return _flash_op(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len if same_keys else max_len_k,
                         scale, window, True)[0]
    return _packed_attention_op(query, key, value, cu_seqlens, cu_seqlens_k, scale, window)


def _flash_window(window: int | None) -> dict:
    # Flash's window counts the keys before the query it may see: transformers' window less one.
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _flash_forward(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scale, window):
    """(output, log-sum-exp) of flash's variable-length kernel."""
    out, lse = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, 0.0, True, False, scale=scale,
        **_flash_window(window))[:2]
    return out, lse


@torch.library.custom_op("fastgrpo::flash_packed_attention", mutates_args=())
def _flash_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_len: int, max_len_k: int, scale: float | None,
              window: int | None, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash's kernel as an op returning (output, log-sum-exp), whose backward is flash's own. With `keep` (the
    attention pass clears it under `keep_attention_output=False`), inside a checkpointed call the forward keeps both
    and the checkpoint's re-run takes them back instead of running attention again (`_dispatch.kept_or_computed`,
    as `fastgrpo::attention` does for padded batches)."""
    def compute():
        return _flash_forward(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scale, window)

    return kept_or_computed(compute) if keep else compute()


@_flash_op.register_fake
def _(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scale, window, keep):
    return _flash_forward(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scale, window)


def _flash_setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scale, window, _ = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens, cu_seqlens_k, *output)
    ctx.max_len, ctx.max_len_k, ctx.scale, ctx.window = max_len, max_len_k, scale, window


def _flash_backward(ctx, grad_out, grad_lse):
    query, key, value, cu_seqlens, cu_seqlens_k, out, lse = ctx.saved_tensors
    # No dropout: the kernel reads no random state (torch's own varlen_attn passes these placeholders too).
    rng_state, unused = torch.zeros(2, dtype=torch.uint64, device=query.device), query.new_empty(0)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), query, key, value, out, lse, cu_seqlens, cu_seqlens_k, ctx.max_len, ctx.max_len_k,
        0.0, True, rng_state, unused, scale=ctx.scale, **_flash_window(ctx.window))
    return dq, dk, dv, None, None, None, None, None, None, None


_flash_op.register_autograd(_flash_backward, setup_context=_flash_setup_context)


def _hidden_keys(n_q: int, n_k: int, window: int | None, device) -> torch.Tensor:
    """[n_q, n_k] True where a query may not see a key: keys after it (the two aligned at their ends), and keys
    `window` or more positions back."""
    offset = torch.arange(n_k - n_q, n_k, device=device)[:, None] - torch.arange(n_k, device=device)[None, :]
    return (offset < 0) | (offset >= window) if window is not None else offset < 0


def _segment_attention(query, key, value, scale, window):
    """One segment, [n_q, heads, D] with keys [n_k, kv_heads, D] -> [n_q, heads, D], through SDPA."""
    n_q, n_k = query.shape[0], key.shape[0]
    # SDPA's is_causal aligns queries and keys at their starts: only right for segments of equal lengths.
    plain = n_q == n_k and (window is None or window >= n_k)
    mask = None if plain else ~_hidden_keys(n_q, n_k, window, query.device)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                         attn_mask=mask, is_causal=plain, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(0, 1)


def _bounds(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of every segment with queries. The torch path's one host read of the layout."""
    ends, ends_k = cu_seqlens.tolist(), cu_seqlens_k.tolist()
    return [(slice(start, stop), slice(start_k, stop_k))
            for start, stop, start_k, stop_k in zip(ends[:-1], ends[1:], ends_k[:-1], ends_k[1:]) if stop > start]


@torch.library.custom_op("fastgrpo::packed_attention", mutates_args=())
def _packed_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, scale: float | None, window: int | None) -> torch.Tensor:
    out = torch.zeros_like(query)  # covers tokens outside every segment, if a caller leaves any
    for rows, keys in _bounds(cu_seqlens, cu_seqlens_k):
        out[rows] = _segment_attention(query[rows], key[keys], value[keys], scale, window)
    return out


@_packed_attention_op.register_fake
def _(query, key, value, cu_seqlens, cu_seqlens_k, scale, window):
    return torch.empty_like(query)


def _segment_attention_backward(grad, query, key, value, scale, window):
    """d(query, key, value) of one segment from its recomputed attention, in float32. (Autograd is off inside a
    custom op, so the softmax's backward is written out: dS = P * (dP - rowsum(dO * O)).)"""
    group = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, g = query.float().transpose(0, 1), grad.float().transpose(0, 1)  # [heads, n, D]
    k, v = (t.float().transpose(0, 1).repeat_interleave(group, 0) for t in (key, value))
    hidden = _hidden_keys(q.shape[1], k.shape[1], window, q.device)
    probs = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(hidden, float("-inf")), dim=-1)
    out = probs @ v
    d_scores = probs * (g @ v.transpose(1, 2) - (g * out).sum(-1, keepdim=True))
    dq = d_scores @ k * scale
    dk = (d_scores.transpose(1, 2) @ q * scale).unflatten(0, (-1, group)).sum(1)
    dv = (probs.transpose(1, 2) @ g).unflatten(0, (-1, group)).sum(1)
    return [d.transpose(0, 1).to(t.dtype) for d, t in ((dq, query), (dk, key), (dv, value))]


@torch.library.custom_op("fastgrpo::packed_attention_backward", mutates_args=())
def _packed_attention_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float | None,
                                  window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))
    for rows, keys in _bounds(cu_seqlens, cu_seqlens_k):
        parts = _segment_attention_backward(grad[rows], query[rows], key[keys], value[keys], scale, window)
        for total, part, where in zip((dq, dk, dv), parts, (rows, keys, keys)):
            total[where] = part
    return dq, dk, dv


@_packed_attention_backward_op.register_fake
def _(grad, query, key, value, cu_seqlens, cu_seqlens_k, scale, window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens, cu_seqlens_k, scale, window = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens, cu_seqlens_k)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, grad):
    query, key, value, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
    grads = _packed_attention_backward_op(grad, query, key, value, cu_seqlens, cu_seqlens_k, ctx.scale, ctx.window)
    return *grads, None, None, None, None


_packed_attention_op.register_autograd(_backward, setup_context=_setup_context)
