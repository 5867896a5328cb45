"""Decode attention over a static KV cache (torch reference path)."""
import torch


def decode_attention(q, k_new, v_new, k_cache, v_cache, rows, start, length, *, scale, window=None, softcap=None,
                     sinks=None):
    b, hq, d = q.shape
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    last = (length - 1).reshape(1).expand(b)
    k_cache[rows, :, last] = k_new.to(k_cache.dtype)
    v_cache[rows, :, last] = v_new.to(v_cache.dtype)
    kc = k_cache[rows].float()
    vc = v_cache[rows].float()
    group = hq // hkv
    qf = q.float().reshape(b, hkv, group, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, kc) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(slots, device=q.device)
    visible = (j[None, :] >= start[rows][:, None]) & (j[None, :] <= last[:, None])
    if window:
        visible &= last[:, None] - j[None, :] < window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, group, 1).expand(b, -1, -1, -1)
        full = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        full = scores.softmax(-1)
    out = torch.einsum("bhgl,bhld->bhgd", full, vc)
    return out.reshape(b, hq, d).to(q.dtype)
