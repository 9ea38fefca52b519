"""Scaled dot-product attention, forward and backward.

q [B, H, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv]; H a multiple of Hkv (grouped-query).
Masks: causal (top-left aligned: key j is seen by query i when j <= i), padding through
per-batch lengths seq_len_q / seq_len_kv ([B, 1, 1, 1] int), an additive bias broadcast to
[B, H, Sq, Skv], dropout on the probabilities with the generator of ops/random.py.
Padded query rows give zeros; stats are the row log-sum-exp in float32, [B, H, Sq, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dtypes
from .base import OpDef, OutputSpec, boolean, broadcast_dims, fail, freeze, integer, real, register
from .random import keep_mask


@dataclass(frozen=True)
class SdpaAttrs:
    attn_scale: Optional[float] = None  # None: 1 / sqrt(D)
    is_inference: bool = True
    use_causal_mask: bool = False
    dropout: Optional[tuple] = None  # (p, seed, offset)

    def __post_init__(self):
        attn_scale = None if self.attn_scale is None else real("sdpa", "attn_scale", self.attn_scale)
        freeze(self, attn_scale=attn_scale, dropout=_dropout_triple(self.dropout),
               is_inference=boolean("sdpa", "is_inference", self.is_inference),
               use_causal_mask=boolean("sdpa", "use_causal_mask", self.use_causal_mask))


def _dropout_triple(dropout) -> Optional[tuple]:
    """sdpa's dropout as (p, seed, offset), checked as dropout checks its own attributes."""
    if dropout is None:
        return None
    if not isinstance(dropout, (list, tuple)) or len(dropout) != 3:
        fail("sdpa", f"dropout must be (p, seed, offset) or None, got {dropout!r}")
    p = real("sdpa", "dropout p", dropout[0])
    if not 0.0 <= p < 1.0:
        fail("sdpa", f"dropout p must be in [0, 1), got {p}")
    return (p, integer("sdpa", "dropout seed", dropout[1], 0, 2**64 - 1),
            integer("sdpa", "dropout offset", dropout[2], 0, 2**63 - 1))


def _check_qkv(op, q, k, v, bias, seq_len_q, seq_len_kv):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.dim) != 4:
            fail(op, f"{name} must be [B, H, S, D], got {list(t.dim)}")
    (batch, heads, s_q, head_dim), (kb, kv_heads, s_kv, kd) = q.dim, k.dim
    if kb != batch or v.dim[0] != batch:
        fail(op, f"batch sizes differ: q {list(q.dim)}, k {list(k.dim)}, v {list(v.dim)}")
    if kd != head_dim:
        fail(op, f"q and k head dims differ: {head_dim} vs {kd}")
    if v.dim[1] != kv_heads or v.dim[2] != s_kv:
        fail(op, f"k {list(k.dim)} and v {list(v.dim)} must agree on heads and sequence")
    if heads % kv_heads:
        fail(op, f"q heads {heads} must be a multiple of k/v heads {kv_heads}")
    if bias is not None:
        scores = (batch, heads, s_q, s_kv)
        if len(bias.dim) != 4 or broadcast_dims(op, [("bias", bias.dim), ("scores", scores)]) != scores:
            fail(op, f"bias {list(bias.dim)} does not broadcast to the scores {list(scores)}")
    for name, t in (("seq_len_q", seq_len_q), ("seq_len_kv", seq_len_kv)):
        if t is not None and tuple(t.dim) != (batch, 1, 1, 1):
            fail(op, f"{name} must be [{batch}, 1, 1, 1], got {list(t.dim)}")


def infer_forward(inputs, attrs: SdpaAttrs):
    q, k, v, bias, seq_len_q, seq_len_kv = inputs
    _check_qkv("sdpa", q, k, v, bias, seq_len_q, seq_len_kv)
    o_dim = q.dim[:3] + (v.dim[3],)
    stats = None if attrs.is_inference else OutputSpec(q.dim[:3] + (1,), dtypes.float32)
    return [OutputSpec(o_dim, layout_source=0), stats]


def infer_backward(inputs, attrs: SdpaAttrs):
    q, k, v, o, d_o, stats, bias, seq_len_q, seq_len_kv = inputs
    _check_qkv("sdpa_backward", q, k, v, bias, seq_len_q, seq_len_kv)
    o_dim = q.dim[:3] + (v.dim[3],)
    for name, t in (("o", o), ("dO", d_o)):
        if tuple(t.dim) != o_dim:
            fail("sdpa_backward", f"{name} must be {list(o_dim)}, got {list(t.dim)}")
    if tuple(stats.dim) != q.dim[:3] + (1,):
        fail("sdpa_backward", f"stats must be {list(q.dim[:3]) + [1]}, got {list(stats.dim)}")
    return [OutputSpec(q.dim, layout_source=0), OutputSpec(k.dim, layout_source=1),
            OutputSpec(v.dim, layout_source=2)]


def attention(q, k, v, bias, seq_len_q, seq_len_kv, attrs: SdpaAttrs):
    """Reference attention in torch: (o, row log-sum-exp)."""
    batch, heads, s_q, head_dim = q.shape
    repeat = heads // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    rows = torch.arange(s_q, device=q.device).view(1, 1, -1, 1)
    cols = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    visible = torch.ones_like(scores, dtype=torch.bool)
    if attrs.use_causal_mask:
        visible = visible & (cols <= rows)
    if seq_len_kv is not None:
        visible = visible & (cols < seq_len_kv.view(-1, 1, 1, 1))
    row_valid = torch.ones((batch, 1, s_q, 1), dtype=torch.bool, device=q.device)
    if seq_len_q is not None:
        row_valid = rows < seq_len_q.view(-1, 1, 1, 1)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    probs = torch.nan_to_num((scores - lse).exp(), nan=0.0)
    if attrs.dropout is not None:
        p, seed, offset = attrs.dropout
        keep = keep_mask(seed, offset, probs.shape, p, device=q.device)
        probs = torch.where(keep, probs / (1.0 - p), torch.zeros_like(probs))
    out = torch.matmul(probs, v) * row_valid
    return out, lse


def reference_forward(values, attrs: SdpaAttrs):
    o, lse = attention(*values, attrs)
    return [o, None if attrs.is_inference else lse]


def reference_backward(values, attrs: SdpaAttrs):
    q, k, v, o, d_o, stats, bias, seq_len_q, seq_len_kv = values
    with torch.enable_grad():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = attention(*leaves, bias, seq_len_q, seq_len_kv, attrs)
        return list(torch.autograd.grad(out, leaves, d_o))


register(OpDef("sdpa", "sdpa", "anchor", SdpaAttrs,
               ("q", "k", "v", "bias", "seq_len_q", "seq_len_kv"), ("o", "stats"),
               infer_forward, reference_forward, optional=("bias", "seq_len_q", "seq_len_kv")))
register(OpDef("sdpa_backward", "sdpa", "anchor", SdpaAttrs,
               ("q", "k", "v", "o", "dO", "stats", "bias", "seq_len_q", "seq_len_kv"),
               ("dq", "dk", "dv"), infer_backward, reference_backward,
               optional=("bias", "seq_len_q", "seq_len_kv")))
