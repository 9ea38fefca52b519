"""fp8 scaled dot-product attention, forward and backward, as the cuDNN frontend's `sdpa_fp8`
and `sdpa_fp8_backward` compose it (include/cudnn_frontend/node/sdpa_fp8.h, the frontend's
test/python/sdpa/fp8_ref.py).

q [B, H, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] in one fp8 type (float8_e4m3 or
float8_e5m2); every descale and scale a one-element float32 tensor. Forward:

    S = (q descale_q)(k descale_k)^T * attn_scale        (masked: -inf)
    P = softmax(S)                     amax_s = max |P|
    O = fp8(P * scale_s) (v descale_v) * descale_s        amax_o = max |O|
    o = O * scale_o stored in o's type (default q's: fp8)

P is rounded to q's fp8 type at the softmax's true (normalized) value, so the result depends on
no tiling. stats: the row log-sum-exp of S, float32 [B, H, Sq, 1], None when is_inference.

Backward (o, dO and stats from the forward; dO may be either fp8 type):

    P = exp(S - stats)                 dV = fp8(P * scale_s)^T (dO descale_dO) * descale_s
    dP = (dO descale_dO)(v descale_v)^T
    delta = rowsum(o * dO) * descale_o * descale_dO
    dS = P * (dP - delta) * attn_scale                    amax_dP = max |dS|
    dQ = fp8(dS * scale_dP) (k descale_k) * descale_dP    dK = fp8(dS * scale_dP)^T (q descale_q) * descale_dP
    dq = dQ * scale_dQ, dk = dK * scale_dK, dv = dV * scale_dV (their types: q's, k's, v's)

with amax_dQ, amax_dK, amax_dV the max |.| of dQ, dK, dV before the scale. P is rounded to q's
fp8 type, dS to dO's (the hybrid recipe's e5m2 gradient), as the frontend's graph
(node/sdpa_fp8_bwd.h) sets their types. amax_dP is the amax of the value scale_dP scales, dS:
the frontend names the softmax input's gradient "dP" (its reference, test/python/sdpa/fp8_ref.py,
takes max |dO V^T| only to pick a scale). Every amax is over the elements the op defines (rows
and keys inside the tensors; amax_s and amax_dP over the (query, key) pairs the mask lets
through); NaN propagates into it. The backward's P and dS are exactly 0 at the pairs the mask
hides (a NaN in stats or in dO v^T stays out of them). A NaN or inf in q, k, v or dO still meets
the zeros of P or dS at hidden pairs (0 * NaN) in the products, but only where a kernel's tile
holds the pair: the kernels skip the blocks a mask hides whole, while the reference multiplies
the full matrices.
Masks: use_causal_mask (key j visible to query i when j <= i, top-left).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dtypes
from .base import AnchorRule, OpDef, OutputSpec, boolean, fail, freeze, real, register

FP8_TYPES = (dtypes.float8_e4m3, dtypes.float8_e5m2)
LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38
AMAX = (1, 1, 1, 1)  # every amax output: one float32

FORWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BACKWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                   "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


@dataclass(frozen=True)
class SdpaFp8Attrs:
    attn_scale: Optional[float] = None  # None: 1 / sqrt(D)
    is_inference: bool = True  # the forward: no stats output
    use_causal_mask: bool = False
    # the fp8 type P is rounded to: q's, as the frontend makes it (the Graph methods set it; the
    # float64 reference reads it, since it sees q's values and not its type)
    fp8_type: str = "float8_e4m3"
    # the backward's: the fp8 type dS is rounded to, dO's (None: fp8_type)
    ds_fp8_type: Optional[str] = None

    def __post_init__(self):
        op = "sdpa_fp8"
        for field, value in (("fp8_type", self.fp8_type), ("ds_fp8_type", self.ds_fp8_type or self.fp8_type)):
            if value not in tuple(t.name for t in FP8_TYPES):
                fail(op, f"{field} must be float8_e4m3 or float8_e5m2, got {value!r}")
        scale = None if self.attn_scale is None else real(op, "attn_scale", self.attn_scale)
        if scale is not None and abs(scale) * LOG2E > FLOAT32_MAX:  # the kernels scale by attn_scale * log2(e)
            fail(op, f"attn_scale must be within float32 range once scaled by log2(e), got {scale!r}")
        freeze(self, attn_scale=scale, is_inference=boolean(op, "is_inference", self.is_inference),
               use_causal_mask=boolean(op, "use_causal_mask", self.use_causal_mask))

    def ds_type(self):
        """The fp8 type the backward rounds dS to (dO's)."""
        return dtypes.by_name(self.ds_fp8_type or self.fp8_type)

    def scale(self, head_dim: int) -> float:
        """The score scale: attn_scale, or 1 / sqrt(D)."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(head_dim)


def _check_scales(op: str, names, tensors):
    for name, tensor in zip(names, tensors):
        if tensor is None:
            fail(op, f"{name} is required (a one-element float32 tensor)")
        if any(d != 1 for d in tensor.dim):
            fail(op, f"{name} must hold one element, got dims {list(tensor.dim)}")
        if tensor.data_type is not dtypes.float32:
            fail(op, f"{name} must be float32, got {tensor.data_type.name}")


def _check_qkv(op: str, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.dim) != 4:
            fail(op, f"{name} must be [B, H, S, D], got {list(t.dim)}")
        if t.data_type not in FP8_TYPES:
            fail(op, f"{name} must be float8_e4m3 or float8_e5m2, got {t.data_type.name}")
    if len({q.data_type, k.data_type, v.data_type}) != 1:
        fail(op, f"q, k and v must share one fp8 type, got {q.data_type.name}, {k.data_type.name}, "
                 f"{v.data_type.name}")
    (batch, heads, _, head_dim), (kb, kv_heads, s_kv, kd) = q.dim, k.dim
    if kb != batch or v.dim[0] != batch:
        fail(op, f"batch sizes differ: q {list(q.dim)}, k {list(k.dim)}, v {list(v.dim)}")
    if kd != head_dim:
        fail(op, f"q and k head dims differ: {head_dim} vs {kd}")
    if tuple(v.dim[1:3]) != (kv_heads, s_kv):
        fail(op, f"k {list(k.dim)} and v {list(v.dim)} must agree on heads and sequence")
    if heads % kv_heads:
        fail(op, f"q heads {heads} must be a multiple of k/v heads {kv_heads}")


def _check_fp8_type(op: str, q, attrs):
    if attrs.fp8_type != q.data_type.name:
        fail(op, f"fp8_type {attrs.fp8_type} must be q's type, {q.data_type.name}")


def infer_forward(inputs, attrs: SdpaFp8Attrs):
    q, k, v = inputs[:3]
    _check_qkv("sdpa_fp8", q, k, v)
    _check_fp8_type("sdpa_fp8", q, attrs)
    _check_scales("sdpa_fp8", FORWARD_SCALES, inputs[3:9])
    o_dim = q.dim[:3] + (v.dim[3],)
    amax = OutputSpec(AMAX, dtypes.float32)
    stats = None if attrs.is_inference else OutputSpec(q.dim[:3] + (1,), dtypes.float32)
    return [OutputSpec(o_dim, q.data_type, layout_source=0), stats, amax, amax]


def infer_backward(inputs, attrs: SdpaFp8Attrs):
    op = "sdpa_fp8_backward"
    q, k, v, o, d_o, stats = inputs[:6]
    _check_qkv(op, q, k, v)
    _check_fp8_type(op, q, attrs)
    _check_scales(op, BACKWARD_SCALES, inputs[6:18])
    o_dim = q.dim[:3] + (v.dim[3],)
    for name, t in (("o", o), ("dO", d_o)):
        if tuple(t.dim) != o_dim:
            fail(op, f"{name} must be {list(o_dim)}, got {list(t.dim)}")
    if not o.data_type.is_floating or o.data_type.is_block_scale_storage:
        fail(op, f"o must be a floating type, got {o.data_type.name}")
    if d_o.data_type not in FP8_TYPES:
        fail(op, f"dO must be float8_e4m3 or float8_e5m2, got {d_o.data_type.name}")
    if attrs.ds_type() is not d_o.data_type:
        fail(op, f"ds_fp8_type {attrs.ds_type().name} must be dO's type, {d_o.data_type.name}")
    if tuple(stats.dim) != q.dim[:3] + (1,) or stats.data_type is not dtypes.float32:
        fail(op, f"stats must be float32 {list(q.dim[:3]) + [1]}, got {stats.data_type.name} {list(stats.dim)}")
    amax = OutputSpec(AMAX, dtypes.float32)
    return [OutputSpec(q.dim, q.data_type, layout_source=0), OutputSpec(k.dim, k.data_type, layout_source=1),
            OutputSpec(v.dim, v.data_type, layout_source=2), amax, amax, amax, amax]


def check_types(node):
    """ValidationError unless the node's tensors still hold the types the op was called with and
    the kernels store: set_data_type may change them after the call, so the lowering asks again.
    The inputs pass the op's rule again (q's and dO's fp8 types are in its attributes: P and dS
    round to them); the amaxes (atomic maxima on float32 bits) and stats stay float32; o, dq, dk,
    dv may take any floating type."""
    node.opdef.infer(list(node.inputs), node.attrs)
    for name, tensor in zip(node.opdef.output_names, node.outputs):
        if tensor is None:
            continue
        data_type = tensor.data_type
        if name.startswith("amax_") or name == "stats":
            if data_type is not dtypes.float32:
                fail(node.op, f"{name} must be float32, got {data_type.name} (tensor {tensor.name!r})")
        elif not data_type.is_floating or data_type.is_block_scale_storage:
            fail(node.op, f"{name} must be a floating type, got {data_type.name} (tensor {tensor.name!r})")


# --- float64 reference: the quantization points exactly where the kernels have them -------------
def quantized(value, data_type):
    """`value` (float64) rounded to float32, then to `data_type` as torch's `.to` does, back in
    float64: the kernels compute in float32 and convert with torch's rules (conversions.py)."""
    return value.to(torch.float32).to(data_type.torch_dtype).to(torch.float64)


def _one(tensor):
    return tensor.reshape(()).to(torch.float64)


def _visible(s_q: int, s_kv: int, causal: bool, device):
    """[Sq, Skv] bool: the keys each query sees."""
    if not causal:
        return torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
    return torch.arange(s_kv, device=device)[None, :] <= torch.arange(s_q, device=device)[:, None]


def _amax(values, where=None):
    """max |values| over `where` (all where None) as a float32 [1, 1, 1, 1]; NaN propagates; 0
    over no element."""
    magnitudes = values.abs()
    if where is not None:
        magnitudes = torch.where(where, magnitudes, torch.zeros_like(magnitudes))
    found = magnitudes.amax() if magnitudes.numel() else magnitudes.new_zeros(())
    return found.reshape(AMAX).to(torch.float32)


def _grouped(t, heads: int):
    """k or v [B, Hkv, S, D] repeated to the query heads."""
    return t.repeat_interleave(heads // t.shape[1], 1)


def _scores(q, k, scale, visible):
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))


def reference_forward(values, attrs: SdpaFp8Attrs, types):
    """o, stats, amax_s, amax_o computed in float64 with P and o rounded where the kernels round."""
    q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = values[:9]
    heads, s_q, head_dim = q.shape[1:]
    fp8, (o_type, *_) = dtypes.by_name(attrs.fp8_type), types
    qf, kf = q * _one(descale_q), _grouped(k, heads) * _one(descale_k)
    vf = _grouped(v, heads) * _one(descale_v)
    visible = _visible(s_q, k.shape[2], attrs.use_causal_mask, q.device)
    scores = _scores(qf, kf, attrs.scale(head_dim), visible)
    probs = torch.softmax(scores, -1)
    out = quantized(probs * _one(scale_s), fp8) @ vf * _one(descale_s)
    stats = None if attrs.is_inference else torch.logsumexp(scores, -1, keepdim=True)
    o = quantized(out * _one(scale_o), o_type)
    return [o, stats, _amax(probs, visible), _amax(out)]


def reference_backward(values, attrs: SdpaFp8Attrs, types):
    """dq, dk, dv and their amaxes and amax_dP (max |dS|), in float64 with P, dS and the gradients
    rounded where the kernels round them; P recomputed from the given stats, as the kernels do."""
    q, k, v, o, d_o, stats = values[:6]
    (descale_q, descale_k, descale_v, descale_o, descale_do, descale_s, descale_dp,
     scale_s, scale_dq, scale_dk, scale_dv, scale_dp) = (_one(t) for t in values[6:18])
    batch, heads, s_q, head_dim = q.shape
    kv_heads, s_kv = k.shape[1:3]
    fp8, scale = dtypes.by_name(attrs.fp8_type), attrs.scale(head_dim)
    qf, kf, vf = q * descale_q, _grouped(k, heads) * descale_k, _grouped(v, heads) * descale_v
    dof = d_o * descale_do
    visible = _visible(s_q, s_kv, attrs.use_causal_mask, q.device)
    # stats of -inf (a row that sees no key) make the row's P zero, as the kernels take them
    row_lse = stats.to(torch.float64).masked_fill(stats == float("-inf"), float("inf"))
    # P and dS are 0 at hidden pairs (as in the kernels: no NaN of stats or dO v^T reaches them)
    probs = torch.exp(_scores(qf, kf, scale, visible) - row_lse).masked_fill(~visible, 0.0)
    d_v = quantized(probs * scale_s, fp8).transpose(-1, -2) @ dof * descale_s
    d_probs = dof @ vf.transpose(-1, -2)
    delta = (o * d_o).sum(-1, keepdim=True) * descale_o * descale_do
    d_scores = (probs * (d_probs - delta) * scale).masked_fill(~visible, 0.0)
    d_scores_fp8 = quantized(d_scores * scale_dp, attrs.ds_type())
    d_q = d_scores_fp8 @ kf * descale_dp
    d_k = d_scores_fp8.transpose(-1, -2) @ qf * descale_dp

    def folded(grad):  # the query heads of each k/v head summed
        return grad.reshape(batch, kv_heads, heads // kv_heads, s_kv, grad.shape[-1]).sum(2)

    d_k, d_v = folded(d_k), folded(d_v)
    return [quantized(d_q * scale_dq, types[0]), quantized(d_k * scale_dk, types[1]),
            quantized(d_v * scale_dv, types[2]), _amax(d_q), _amax(d_k), _amax(d_v),
            _amax(d_scores, visible)]


register(OpDef("sdpa_fp8", "sdpa_fp8", "anchor", SdpaFp8Attrs, ("q", "k", "v") + FORWARD_SCALES,
               ("o", "stats", "amax_s", "amax_o"), infer_forward, reference_forward,
               fusion=AnchorRule((), None), typed_reference=True))
register(OpDef("sdpa_fp8_backward", "sdpa_fp8", "anchor", SdpaFp8Attrs,
               ("q", "k", "v", "o", "dO", "stats") + BACKWARD_SCALES,
               ("dq", "dk", "dv", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"), infer_backward, reference_backward,
               fusion=AnchorRule((), None), typed_reference=True))
