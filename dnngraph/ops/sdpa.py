"""Scaled dot-product attention, forward and backward.

q [B, H, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv]; H a multiple of Hkv (grouped-query).
Masks (as the cuDNN frontend names them): key j is visible to query i when
`j - i' <= right_bound` and `i' - j < left_bound`, with `i' = i` ("top_left") or
`i' = i + len_kv - len_q` ("bottom_right"), per batch where seq_len_q / seq_len_kv
([B, 1, 1, 1] int, clamped to [0, S]) are given; use_causal_mask is right bound 0 top-left,
use_causal_mask_bottom_right right bound 0 bottom-right. Padding masks keys j >= seq_len_kv and
zeroes query rows i >= seq_len_q; a row that sees no key is zero. An additive bias broadcasts to
[B, H, Sq, Skv]; dropout acts on the probabilities with the generator of ops/random.py, element
(b, h, i, j) drawing counter offset + ((b * H + h) * Sq + i) * Skv + j.
Paged K/V: k and v are page pools [pages, Hkv, page_size, D], the tables [B, 1, pages_per_seq, 1]
int32 page indices, Skv = paged_attention_max_seq_len_kv (default pages_per_seq * page_size),
seq_len_kv required; a key whose page id in either table lies outside [0, pages) is invisible,
as if past seq_len_kv (whatever a table holds, no kernel reads outside the pools). stats are the row log-sum-exp in float32, [B, H, Sq, 1] (-inf for a row
that sees no key).

Ragged (THD) operands (dnngraph/ragged.py): q, k, v, o (and dO, dq, dk, dv) may each carry an
int32/int64 [B + 1, 1, 1, 1] tensor of element offsets where each sequence starts in a packed
buffer (node inputs `<operand>_ragged_offset`, set by Tensor.set_ragged_offset); the seq_len of
the operand's axis is then required, rows past it are neither read nor written, and stats stay
dense [B, H, S_max, 1]. Paged K/V is not ragged; autograd refuses ragged operands.

Softmax extras (the cuDNN frontend's names): `sink_token`, a float32 [1, H, 1, 1] learned logit
per query head, joins every row's softmax denominator and takes no value column (a row that sees
no key then has only the sink in its denominator: o = 0, stats = the sink); `use_alibi_mask` adds
(j - i) * slope_h to score (b, h, i, j) after the scale and bias, i and j the top-left row and
key positions as the frontend generates them, slope_h = 2^(-8 (h + 1) / n) for h < n, n the
largest power of two <= H, and 2^(-4 (2 (h - n) + 1) / n) for the heads past n; `score_max` and
`score_sum_exp` request the row max of the scaled, biased, masked scores over the keys (the sink
apart) and the row sum of exp(score - max), float32 [B, H, Sq, 1] (-inf and 0 for a row that
sees no key); `attn_scale` may be a one-element floating graph tensor instead of a number
(autograd differentiates it: d scale = sum(q * dq) / scale).

Block-sparse mask (the cuDNN frontend's `block_mask` input): a bool or int32 tensor
[B or 1, H or 1, ceil(Sq / bm), ceil(Skv / bn)] for `block_mask_size` = (bm, bn) (default the
frontend's 128 x 128): key j is visible to query i only where entry (b, h, i // bm, j // bn) is
true (nonzero), on top of every other mask; the kernels never visit a key block no entry of
their tile allows. K and V may have their own head counts (each dividing H): query head h reads
k head h // (H / Hk) and v head h // (H / Hv).
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dtypes
from ..errors import UnsupportedError
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, broadcast_dims, fail, freeze, integer, real, register
from .dropout import check_random_inputs, random_values
from .random import keep_mask

ALIGNMENTS = ("top_left", "bottom_right")
LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class AttentionMask:
    """Plain data the kernels render: bounds (None: unbounded) and the diagonal's alignment."""

    left: Optional[int]
    right: Optional[int]
    bottom_right: bool

    @property
    def banded(self) -> bool:
        return self.left is not None or self.right is not None


@dataclass(frozen=True)
class SdpaAttrs:
    attn_scale: Optional[float] = None  # None: 1 / sqrt(D)
    is_inference: bool = True
    use_causal_mask: bool = False
    dropout: Optional[tuple] = None  # (p, seed, offset)
    use_causal_mask_bottom_right: bool = False
    diagonal_alignment: str = "top_left"
    diagonal_band_left_bound: Optional[int] = None
    diagonal_band_right_bound: Optional[int] = None
    paged_attention_max_seq_len_kv: Optional[int] = None
    # sdpa_backward, as the cuDNN frontend names it. Every backward here is deterministic: dQ has
    # its own kernel, no float atomics, which measured the fastest too (dQ added with atomics from
    # the dK/dV kernel ran 9x slower on the H100: 63.8 ms against 6.9 at B4 H32 S4096 D128)
    use_deterministic_algorithm: bool = False
    # sdpa_backward: a fourth output, dbias (the bias's shape and type: dS summed over the axes the
    # bias broadcasts over)
    compute_dbias: bool = False
    use_alibi_mask: bool = False
    score_max: bool = False  # sdpa: the row max of the scores, an output [B, H, Sq, 1] float32
    score_sum_exp: bool = False  # sdpa: the row sum of exp(score - max), an output likewise
    block_mask_size: tuple = (128, 128)  # (query rows, keys) of one block_mask entry

    def __post_init__(self):
        op = "sdpa"
        attn_scale = None if self.attn_scale is None else real(op, "attn_scale", self.attn_scale)
        if attn_scale is not None and abs(attn_scale) * LOG2E > FLOAT32_MAX:
            # the kernels scale scores by attn_scale * log2(e) in float32
            fail(op, f"attn_scale must be within float32 range once scaled by log2(e), got {attn_scale!r}")
        causal = boolean(op, "use_causal_mask", self.use_causal_mask)
        causal_br = boolean(op, "use_causal_mask_bottom_right", self.use_causal_mask_bottom_right)
        if self.diagonal_alignment not in ALIGNMENTS:
            fail(op, f"diagonal_alignment must be one of {ALIGNMENTS}, got {self.diagonal_alignment!r}")
        left = _bound("diagonal_band_left_bound", self.diagonal_band_left_bound, 1)
        right = _bound("diagonal_band_right_bound", self.diagonal_band_right_bound, 0)
        if causal and causal_br:
            fail(op, "use_causal_mask and use_causal_mask_bottom_right exclude each other")
        if (causal or causal_br) and right is not None:
            fail(op, "a causal mask sets the right bound (0): diagonal_band_right_bound must be None")
        wanted = "bottom_right" if causal_br else "top_left" if causal else None
        if wanted is not None and self.diagonal_alignment not in (wanted, "top_left"):
            fail(op, f"use_causal_mask{'_bottom_right' if causal_br else ''} aligns the diagonal "
                     f"{wanted}, but diagonal_alignment is {self.diagonal_alignment!r}")
        max_kv = self.paged_attention_max_seq_len_kv
        if max_kv is not None:
            max_kv = integer(op, "paged_attention_max_seq_len_kv", max_kv, 1, 2**31 - 1)
        freeze(self, attn_scale=attn_scale, dropout=_dropout_triple(self.dropout),
               is_inference=boolean(op, "is_inference", self.is_inference), use_causal_mask=causal,
               use_causal_mask_bottom_right=causal_br, diagonal_alignment=wanted or self.diagonal_alignment,
               diagonal_band_left_bound=left, diagonal_band_right_bound=right,
               paged_attention_max_seq_len_kv=max_kv,
               use_deterministic_algorithm=boolean(op, "use_deterministic_algorithm",
                                                   self.use_deterministic_algorithm),
               compute_dbias=boolean(op, "compute_dbias", self.compute_dbias),
               use_alibi_mask=boolean(op, "use_alibi_mask", self.use_alibi_mask),
               score_max=boolean(op, "score_max", self.score_max),
               score_sum_exp=boolean(op, "score_sum_exp", self.score_sum_exp),
               block_mask_size=_block_size(self.block_mask_size))

    @property
    def mask(self) -> AttentionMask:
        """The visibility rule as bounds and alignment."""
        causal = self.use_causal_mask or self.use_causal_mask_bottom_right
        right = 0 if causal else self.diagonal_band_right_bound
        return AttentionMask(self.diagonal_band_left_bound, right, self.diagonal_alignment == "bottom_right")


def alibi_slopes(heads: int) -> list:
    """ALiBi's slope of each of `heads` query heads: a geometric run 2^(-8 k / n), k = 1..n, for
    the largest power of two n <= heads, then the odd steps of the run for 2n (2^(-4 k / n),
    k = 1, 3, 5, ...) for the heads past n."""
    n = 1 << (heads.bit_length() - 1)
    return [2.0 ** (-8.0 * (h + 1) / n) if h < n else 2.0 ** (-4.0 * (2 * (h - n) + 1) / n) for h in range(heads)]


def _block_size(size) -> tuple:
    """block_mask_size as (rows, keys), each a positive int."""
    if not isinstance(size, (list, tuple)) or len(size) != 2:
        fail("sdpa", f"block_mask_size must be (query rows, keys) of one mask block, got {size!r}")
    return tuple(integer("sdpa", "block_mask_size", extent, 1, 2**31 - 1) for extent in size)


def _bound(name, value, minimum) -> Optional[int]:
    if value is None:
        return None
    return integer("sdpa", name, value, minimum, 2**31 - 1)


def _dropout_triple(dropout) -> Optional[tuple]:
    """sdpa's dropout as (p, seed, offset), checked as dropout checks its own attributes."""
    if dropout is None:
        return None
    if not isinstance(dropout, (list, tuple)) or len(dropout) != 3:
        fail("sdpa", f"dropout must be (p, seed, offset) or None, got {dropout!r}")
    p = real("sdpa", "dropout p", dropout[0])
    if not 0.0 <= p < 1.0:
        fail("sdpa", f"dropout p must be in [0, 1), got {p}")
    # None: the value is a one-element int64 tensor input (dropout_seed / dropout_offset)
    seed = None if dropout[1] is None else integer("sdpa", "dropout seed", dropout[1], 0, 2**64 - 1)
    offset = None if dropout[2] is None else integer("sdpa", "dropout offset", dropout[2], 0, 2**63 - 1)
    return (p, seed, offset)


def _check_paged(op, k, v, k_table, v_table, seq_len_kv, batch):
    """Paged K/V: both tables or neither, [B, 1, pages, 1] int32, seq_len_kv given."""
    if (k_table is None) != (v_table is None):
        fail(op, "paged attention needs both paged_attention_k_table and paged_attention_v_table")
    if k_table is None:
        return
    for name, table in (("paged_attention_k_table", k_table), ("paged_attention_v_table", v_table)):
        if len(table.dim) != 4 or table.dim[0] != batch or table.dim[1] != 1 or table.dim[3] != 1:
            fail(op, f"{name} must be [{batch}, 1, pages_per_sequence, 1], got {list(table.dim)}")
        if table.data_type is not dtypes.int32:
            fail(op, f"{name} must be int32, got {table.data_type.name}")
    if k_table.dim[2] != v_table.dim[2]:
        fail(op, f"paged_attention_k_table and paged_attention_v_table must hold as many pages per "
                 f"sequence: {k_table.dim[2]} vs {v_table.dim[2]}")
    if seq_len_kv is None:
        fail(op, "paged K/V needs seq_len_kv (the length of each sequence)")
    if k.dim[2] != v.dim[2]:
        fail(op, f"k and v pools must share the page size: {k.dim[2]} vs {v.dim[2]}")


def kv_length(k, k_table, attrs: SdpaAttrs) -> int:
    """Skv: k's sequence axis, or for page pools the tables' pages times the page size (or the
    stated maximum)."""
    if k_table is None:
        return k.dim[2]
    return attrs.paged_attention_max_seq_len_kv or k_table.dim[2] * k.dim[2]


def _check_qkv(op, q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, attrs):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.dim) != 4:
            fail(op, f"{name} must be [B, H, S, D], got {list(t.dim)}")
        if not t.data_type.is_floating:
            fail(op, f"{name} must be a floating type, got {t.data_type.name}")
    (batch, heads, s_q, head_dim), (kb, kv_heads, _, kd) = q.dim, k.dim
    _check_paged(op, k, v, k_table, v_table, seq_len_kv, batch)
    if attrs.paged_attention_max_seq_len_kv is not None and k_table is None:
        fail(op, "paged_attention_max_seq_len_kv needs paged K/V tables")
    if k_table is None and (kb != batch or v.dim[0] != batch):
        fail(op, f"batch sizes differ: q {list(q.dim)}, k {list(k.dim)}, v {list(v.dim)}")
    if k_table is not None and v.dim[0] != kb:
        fail(op, f"k and v pools must hold as many pages: {kb} vs {v.dim[0]}")
    if kd != head_dim:
        fail(op, f"q and k head dims differ: {head_dim} vs {kd}")
    if k_table is None and v.dim[2] != k.dim[2]:
        fail(op, f"k {list(k.dim)} and v {list(v.dim)} must agree on the sequence")
    if k_table is not None and v.dim[1] != kv_heads:
        fail(op, f"paged k {list(k.dim)} and v {list(v.dim)} pools must hold as many heads")
    for name, count in (("k", kv_heads), ("v", v.dim[1])):
        if heads % count:
            fail(op, f"q heads {heads} must be a multiple of {name} heads {count}")
    s_kv = kv_length(k, k_table, attrs)
    if k_table is not None and s_kv > k_table.dim[2] * k.dim[2]:
        fail(op, f"paged_attention_max_seq_len_kv {s_kv} exceeds the tables' {k_table.dim[2]} pages "
                 f"of {k.dim[2]}")
    if bias is not None:
        scores = (batch, heads, s_q, s_kv)
        if len(bias.dim) != 4 or broadcast_dims(op, [("bias", bias.dim), ("scores", scores)]) != scores:
            fail(op, f"bias {list(bias.dim)} does not broadcast to the scores {list(scores)}")
    for name, t in (("seq_len_q", seq_len_q), ("seq_len_kv", seq_len_kv)):
        if t is not None and tuple(t.dim) != (batch, 1, 1, 1):
            fail(op, f"{name} must be [{batch}, 1, 1, 1], got {list(t.dim)}")
        if t is not None and t.data_type not in (dtypes.int32, dtypes.int64):
            fail(op, f"{name} must be int32 or int64, got {t.data_type.name}")


def _check_dropout_inputs(op, attrs: SdpaAttrs, seed, offset):
    if attrs.dropout is None:
        if seed is not None or offset is not None:
            fail(op, "dropout seed/offset tensors given without dropout")
        return
    check_random_inputs(op, attrs.dropout[1], attrs.dropout[2], seed, offset)


def _check_extras(op, q, sink, scale, attrs: SdpaAttrs):
    """The sink token ([1, H, 1, 1] float32) and a tensor attn_scale (one floating element, and
    then no number too)."""
    if sink is not None:
        wanted = (1, q.dim[1], 1, 1)
        if tuple(sink.dim) != wanted:
            fail(op, f"sink_token must be {list(wanted)} (one logit per query head), got {list(sink.dim)}")
        if sink.data_type is not dtypes.float32:
            fail(op, f"sink_token must be float32, got {sink.data_type.name}")
    if scale is not None:
        if any(d != 1 for d in scale.dim):
            fail(op, f"a tensor attn_scale must hold one element, got dims {list(scale.dim)}")
        if not scale.data_type.is_floating:
            fail(op, f"a tensor attn_scale must be floating, got {scale.data_type.name}")
        if attrs.attn_scale is not None:
            fail(op, "attn_scale is given both as a number and as a tensor")


def _check_block_mask(op, q, k, k_table, block_mask, attrs: SdpaAttrs):
    """block_mask: bool or int32 [B or 1, H or 1, ceil(Sq / bm), ceil(Skv / bn)], a graph input
    (the kernels read it as given)."""
    if block_mask is None:
        return
    rows, keys = attrs.block_mask_size
    (batch, heads, s_q, _), s_kv = q.dim, kv_length(k, k_table, attrs)
    blocks = (-(-s_q // rows), -(-s_kv // keys))
    dims = tuple(block_mask.dim)
    if len(dims) != 4 or dims[0] not in (1, batch) or dims[1] not in (1, heads) or dims[2:] != blocks:
        fail(op, f"block_mask must be [{batch} or 1, {heads} or 1, {blocks[0]}, {blocks[1]}] (Sq {s_q} and "
                 f"Skv {s_kv} in blocks of {rows} x {keys}), got {list(dims)}")
    if block_mask.data_type not in (dtypes.bool_, dtypes.int32):
        fail(op, f"block_mask must be bool or int32, got {block_mask.data_type.name}")


def infer_forward(inputs, attrs: SdpaAttrs):
    q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, seed, offset, sink, scale = inputs[:12]
    _check_block_mask("sdpa", q, k, k_table, block_mask_of(inputs, FORWARD_BLOCK_MASK), attrs)
    _check_ragged("sdpa", dict(zip(FORWARD_RAGGED, inputs[12:])), q.dim[0], seq_len_q, seq_len_kv, k_table)
    _check_dropout_inputs("sdpa", attrs, seed, offset)
    if attrs.compute_dbias:
        fail("sdpa", "compute_dbias is an sdpa_backward attribute")
    _check_qkv("sdpa", q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, attrs)
    _check_extras("sdpa", q, sink, scale, attrs)
    o_dim = q.dim[:3] + (v.dim[3],)
    row = OutputSpec(q.dim[:3] + (1,), dtypes.float32)
    return [OutputSpec(o_dim, layout_source=0), None if attrs.is_inference else row,
            row if attrs.score_max else None, row if attrs.score_sum_exp else None]


def infer_backward(inputs, attrs: SdpaAttrs):
    q, k, v, o, d_o, stats, bias, seq_len_q, seq_len_kv, k_table, v_table, seed, offset, sink, scale = inputs[:15]
    _check_block_mask("sdpa_backward", q, k, k_table, block_mask_of(inputs, BACKWARD_BLOCK_MASK), attrs)
    _check_ragged("sdpa_backward", dict(zip(BACKWARD_RAGGED, inputs[15:])), q.dim[0], seq_len_q, seq_len_kv,
                  k_table)
    _check_dropout_inputs("sdpa_backward", attrs, seed, offset)
    _check_qkv("sdpa_backward", q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, attrs)
    _check_extras("sdpa_backward", q, sink, scale, attrs)
    if attrs.score_max or attrs.score_sum_exp:
        fail("sdpa_backward", "score_max and score_sum_exp are sdpa outputs")
    if k_table is not None:
        fail("sdpa_backward", "paged K/V is for inference: sdpa_backward takes contiguous k and v")
    o_dim = q.dim[:3] + (v.dim[3],)
    for name, t in (("o", o), ("dO", d_o)):
        if tuple(t.dim) != o_dim:
            fail("sdpa_backward", f"{name} must be {list(o_dim)}, got {list(t.dim)}")
    if tuple(stats.dim) != q.dim[:3] + (1,):
        fail("sdpa_backward", f"stats must be {list(q.dim[:3]) + [1]}, got {list(stats.dim)}")
    if stats.data_type is not dtypes.float32:
        fail("sdpa_backward", f"stats (the forward's log-sum-exp) must be float32, got {stats.data_type.name}")
    dbias = None
    if attrs.compute_dbias:
        if bias is None:
            fail("sdpa_backward", "compute_dbias needs a bias")
        if not bias.data_type.is_floating:
            fail("sdpa_backward", f"compute_dbias needs a floating bias, got {bias.data_type.name}")
        dbias = OutputSpec(bias.dim, bias.data_type, layout_source=6)
    dsink = None if sink is None else OutputSpec(sink.dim, dtypes.float32)
    return [OutputSpec(q.dim, layout_source=0), OutputSpec(k.dim, layout_source=1),
            OutputSpec(v.dim, layout_source=2), dbias, dsink]


def gather_pages(pool, table, s_kv: int):
    """[B, Hkv, s_kv, D] from a page pool [pages, Hkv, page_size, D] and a table [B, 1, P, 1]."""
    page_size = pool.shape[2]
    positions = torch.arange(s_kv, device=pool.device)
    # ids outside the pool (past a sequence's length, or invalid) name keys that are masked
    # (pages_in_pool): clamped here only to have something to index with
    pages = table[:, 0, :, 0].long()[:, positions // page_size].clamp(0, pool.shape[0] - 1)
    rows = pool[pages, :, (positions % page_size).view(1, -1)]  # [B, s_kv, Hkv, D]
    return rows.permute(0, 2, 1, 3)


def pages_in_pool(pool, table, s_kv: int):
    """[B, s_kv] bool: whether each key's page id in `table` names a page of `pool`."""
    positions = torch.arange(s_kv, device=pool.device)
    pages = table[:, 0, :, 0].long()[:, positions // pool.shape[2]]
    return (pages >= 0) & (pages < pool.shape[0])


def lengths(seq_len, size: int, device):
    """[B, 1, 1, 1] int64 per-batch lengths clamped to [0, size] (a length past the axis is the
    whole axis, a negative one empty), or the axis' size when `seq_len` is None."""
    if seq_len is None:
        return torch.tensor(size, device=device)
    return seq_len.reshape(-1, 1, 1, 1).long().clamp(0, size)


def visible_keys(attrs: SdpaAttrs, s_q: int, s_kv: int, seq_len_q, seq_len_kv, device):
    """[B or 1, 1, Sq, Skv] bool: which keys each query sees (bounds and key padding)."""
    rows = torch.arange(s_q, device=device).view(1, 1, -1, 1)
    cols = torch.arange(s_kv, device=device).view(1, 1, 1, -1)
    len_q, len_kv = lengths(seq_len_q, s_q, device), lengths(seq_len_kv, s_kv, device)
    mask = attrs.mask
    aligned = rows + (len_kv - len_q) if mask.bottom_right else rows
    visible = cols < len_kv
    if mask.right is not None:
        visible = visible & (cols - aligned <= mask.right)
    if mask.left is not None:
        visible = visible & (aligned - cols < mask.left)
    return visible


def _masked_scores(q, k, bias, scale, visible, alibi):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if alibi is not None:
        scores = scores + alibi
    return scores.masked_fill(~visible, float("-inf"))


def _alibi(attrs: SdpaAttrs, heads: int, s_q: int, s_kv: int, like):
    """[1, H, Sq, Skv] (j - i) * slope_h, or None without use_alibi_mask."""
    if not attrs.use_alibi_mask:
        return None
    slopes = torch.tensor(alibi_slopes(heads), dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
    rows = torch.arange(s_q, device=like.device).view(1, 1, -1, 1)
    cols = torch.arange(s_kv, device=like.device).view(1, 1, 1, -1)
    return (cols - rows).to(like.dtype) * slopes


def _scale(attrs: SdpaAttrs, scale_tensor, head_dim: int):
    """The score scale: the tensor's element (a 0-d tensor, so gradients may flow), the number,
    or 1 / sqrt(D)."""
    if scale_tensor is not None:
        return scale_tensor.reshape(())
    return attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(head_dim)


def _row_stats(scores, sink):
    """(log-sum-exp with the sink, max over the keys, sum of exp(score - max) over the keys) of
    each row; a row of -inf scores has max -inf and sum 0."""
    score_max = scores.amax(-1, keepdim=True)
    finite_max = torch.where(score_max == float("-inf"), torch.zeros_like(score_max), score_max)
    score_sum = torch.exp(scores - finite_max).sum(-1, keepdim=True)
    if sink is None:
        return torch.logsumexp(scores, -1, keepdim=True), score_max, score_sum
    sinks = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.logsumexp(torch.cat([scores, sinks], -1), -1, keepdim=True), score_max, score_sum


def block_visible(block_mask, size: tuple, s_q: int, s_kv: int):
    """[B or 1, H or 1, Sq, Skv] bool: the block mask expanded to its elements (the last blocks
    cut at Sq and Skv)."""
    rows, keys = size
    return (block_mask != 0).repeat_interleave(rows, 2)[:, :, :s_q].repeat_interleave(keys, 3)[..., :s_kv]


def attention(q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, attrs: SdpaAttrs, seed=None, offset=None,
              sink=None, scale_tensor=None, block_mask=None):
    """Reference attention in torch: (o, row log-sum-exp, row score max, row sum of exp(score - max)).

    NaN and inf in what a row sees propagate as in torch's softmax; what lies past the lengths
    (keys j >= seq_len_kv, query rows i >= seq_len_q: an unwritten cache, padding) may hold
    anything and never reaches o or, through autograd, the gradients. A row that sees no key
    (every score -inf, from the mask or the bias) is 0 with gradients 0. A sink token joins each
    row's denominator (the log-sum-exp counts it; the score max and sum do not).
    """
    batch, heads, s_q, head_dim = q.shape
    paged_keys = None  # [B, 1, 1, Skv]: keys whose pages both tables place in the pools
    if k_table is not None:
        s_kv = attrs.paged_attention_max_seq_len_kv or k_table.shape[2] * k.shape[2]
        paged_keys = (pages_in_pool(k, k_table, s_kv) & pages_in_pool(v, v_table, s_kv)).view(batch, 1, 1, s_kv)
        k, v = gather_pages(k, k_table, s_kv), gather_pages(v, v_table, s_kv)
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    s_kv = k.shape[2]
    scale = _scale(attrs, scale_tensor, head_dim)
    alibi = _alibi(attrs, heads, s_q, s_kv, q)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    key_valid = torch.arange(s_kv, device=q.device).view(1, 1, -1, 1) < lengths(seq_len_kv, s_kv, q.device)
    visible = visible_keys(attrs, s_q, s_kv, seq_len_q, seq_len_kv, q.device)
    if paged_keys is not None:  # a key on a page outside the pools is invisible, as if past seq_len_kv
        key_valid = key_valid & paged_keys.transpose(-1, -2)
        visible = visible & paged_keys
    if block_mask is not None:
        visible = visible & block_visible(block_mask, attrs.block_mask_size, s_q, s_kv)
    k, v = torch.where(key_valid, k, zero), torch.where(key_valid, v, zero)
    row_valid = torch.arange(s_q, device=q.device).view(1, 1, -1, 1) < lengths(seq_len_q, s_q, q.device)
    # the stats of every row, padded ones included (the kernels store them too)
    lse, score_max, score_sum = _row_stats(_masked_scores(q, k, bias, scale, visible, alibi), sink)
    scores = _masked_scores(torch.where(row_valid, q, zero), k, bias, scale, visible, alibi)
    if sink is not None:  # every row has the sink in its denominator: p = exp(s - lse), no row is empty
        probs = torch.exp(scores - _row_stats(scores, sink)[0])
    else:
        attends = (scores != float("-inf")).any(-1, keepdim=True) & row_valid  # NaN counts as seen
        probs = torch.where(attends, torch.softmax(torch.where(attends, scores, zero), -1), zero)
    if attrs.dropout is not None:
        p, seed_attr, offset_attr = attrs.dropout
        seed, offset = random_values(seed_attr, offset_attr, seed, offset)
        keep = keep_mask(seed, offset, probs.shape, p, device=q.device)
        probs = torch.where(keep, probs / (1.0 - p), torch.zeros_like(probs))
    out = torch.where(row_valid, torch.matmul(probs, v), zero)
    return out, lse, score_max, score_sum


def reference_forward(values, attrs: SdpaAttrs):
    """Ragged operands reach here unpacked (Graph.reference reads them through their offsets,
    ragged.unpack): the offsets themselves change nothing."""
    *tensors, seed, offset, sink, scale = values[:12]
    o, lse, score_max, score_sum = attention(*tensors, attrs, seed, offset, sink, scale,
                                             block_mask_of(values, FORWARD_BLOCK_MASK))
    return [o, None if attrs.is_inference else lse, score_max if attrs.score_max else None,
            score_sum if attrs.score_sum_exp else None]


def reference_backward(values, attrs: SdpaAttrs):
    """dq, dk, dv (dbias, dsink) by float64 autograd through the reference forward. dsink_h works
    out to -sum over (b, i) of p_sink(b, h, i) * delta(b, h, i), delta = rowsum(dO * o): o_i
    scales by -p_sink when the sink's logit grows."""
    q, k, v, o, d_o, stats, bias, seq_len_q, seq_len_kv, k_table, v_table, seed, offset, sink, scale = values[:15]
    with torch.enable_grad():
        wanted = {"q": q, "k": k, "v": v}
        if attrs.compute_dbias:
            wanted["bias"] = bias
        if sink is not None:
            wanted["sink"] = sink
        leaves = {name: t.detach().clone().requires_grad_(True) for name, t in wanted.items()}
        out = attention(leaves["q"], leaves["k"], leaves["v"], leaves.get("bias", bias), seq_len_q, seq_len_kv,
                        None, None, attrs, seed, offset, leaves.get("sink"), scale,
                        block_mask_of(values, BACKWARD_BLOCK_MASK))[0]
        grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), d_o)))
        return [grads["q"], grads["k"], grads["v"], grads.get("bias"), grads.get("sink")]


def _check_ragged(op, offsets: dict, batch: int, seq_len_q, seq_len_kv, k_table):
    """Ragged (THD) operands: each offset [B + 1, 1, 1, 1] int32 or int64 (Tensor.set_ragged_offset
    checks that), the lengths of its sequence axis given, no paged K/V."""
    for role, offset in offsets.items():
        if offset is None:
            continue
        if tuple(offset.dim) != (batch + 1, 1, 1, 1) or offset.data_type not in (dtypes.int32, dtypes.int64):
            fail(op, f"the ragged offset of {role[:-len(RAGGED_SUFFIX)]} must be int32 or int64 "
                     f"[{batch + 1}, 1, 1, 1], got {offset.data_type.name} {list(offset.dim)}")
        if offset.producer is not None:
            fail(op, f"the ragged offset {offset.name!r} must be a graph input")
        key_side = role[:-len(RAGGED_SUFFIX)] in KEY_SIDE
        if (seq_len_kv if key_side else seq_len_q) is None:
            fail(op, f"a ragged {role[:-len(RAGGED_SUFFIX)]} needs {'seq_len_kv' if key_side else 'seq_len_q'} "
                     f"(the length of each sequence)")
        if key_side and k_table is not None:
            fail(op, "paged K/V cannot be ragged: the page tables place the keys")


PAGED = ("paged_attention_k_table", "paged_attention_v_table")
# Ragged (THD) operands: an [B + 1, 1, 1, 1] int tensor of element offsets per operand, where each
# sequence of a packed buffer starts (Tensor.set_ragged_offset); the kernels add offset[b] where a
# dense layout adds b * stride[0]
RAGGED_SUFFIX = "_ragged_offset"
KEY_SIDE = ("k", "v", "dk", "dv")  # operands whose sequence axis is the keys' (seq_len_kv)
FORWARD_RAGGED = tuple(role + RAGGED_SUFFIX for role in ("q", "k", "v", "o"))
BACKWARD_RAGGED = FORWARD_RAGGED + tuple(role + RAGGED_SUFFIX for role in ("dO", "dq", "dk", "dv"))
# the block-sparse mask comes after the ragged offsets (appended: older documents list fewer inputs)
BLOCK_MASK = ("block_mask",)
FORWARD_BLOCK_MASK = 12 + 4  # its index among sdpa's inputs
BACKWARD_BLOCK_MASK = 15 + 8  # and sdpa_backward's


def block_mask_of(inputs, index: int):
    """The block_mask of a node's inputs (or values), None where absent."""
    return inputs[index] if len(inputs) > index else None


RANDOM = ("dropout_seed", "dropout_offset")  # one-element int64 tensors, when dropout names them
EXTRAS = ("sink_token", "attn_scale")  # the sink logits [1, H, 1, 1]; a one-element tensor scale
register(OpDef("sdpa", "sdpa", "anchor", SdpaAttrs,
               ("q", "k", "v", "bias", "seq_len_q", "seq_len_kv") + PAGED + RANDOM + EXTRAS + FORWARD_RAGGED
               + BLOCK_MASK,
               ("o", "stats", "score_max", "score_sum_exp"),
               infer_forward, reference_forward,
               optional=("bias", "seq_len_q", "seq_len_kv") + PAGED + RANDOM + EXTRAS + FORWARD_RAGGED + BLOCK_MASK,
               fusion=AnchorRule((), 0)))
register(OpDef("sdpa_backward", "sdpa", "anchor", SdpaAttrs,
               ("q", "k", "v", "o", "dO", "stats", "bias", "seq_len_q", "seq_len_kv") + PAGED + RANDOM + EXTRAS
               + BACKWARD_RAGGED + BLOCK_MASK,
               ("dq", "dk", "dv", "dbias", "dsink"), infer_backward, reference_backward,
               optional=("bias", "seq_len_q", "seq_len_kv") + PAGED + RANDOM + EXTRAS + BACKWARD_RAGGED + BLOCK_MASK,
               fusion=AnchorRule((), None)))


@backward_rule("sdpa")
def _sdpa_backward(d, node, grads):
    """sdpa_backward from the saved o and stats (the forward runs in training form); dbias
    when the bias takes a gradient."""
    q, k, v, bias, seq_len_q, seq_len_kv, k_table, v_table, seed, offset, sink, scale = node.inputs[:12]
    q_off, k_off, v_off, o_off = node.inputs[12:16]
    if k_table is not None:
        raise UnsupportedError("sdpa: paged K/V takes no gradient")
    if any(t is not None for t in (q_off, k_off, v_off, o_off)):
        # torch sees a ragged operand as a dense view of its buffer: a gradient it routes through
        # that view lands on the wrong elements
        raise UnsupportedError("sdpa: ragged operands take no gradient through autograd; call sdpa_backward "
                               "with ragged dO, dq, dk and dv")
    if any(g is not None for g in grads[1:]):
        raise UnsupportedError("sdpa: no gradient through the stats, score_max or score_sum_exp")
    wants_bias = bias is not None and bias.data_type.is_floating and d.needs(bias)
    attrs = dataclasses.replace(node.attrs, is_inference=False, compute_dbias=wants_bias, score_max=False,
                                score_sum_exp=False)
    read = [None if t is None else d.value(t) for t in (q, k, v)]
    o, stats = d.value(node.outputs[0]), d.value(node.outputs[1])
    extra = [None if t is None else d.value(t) for t in (bias, seq_len_q, seq_len_kv)]
    random = [None if t is None else d.value(t) for t in (seed, offset)]
    extras = [None if t is None else d.value(t) for t in (sink, scale)]
    block_mask = block_mask_of(node.inputs, FORWARD_BLOCK_MASK)
    block_mask = None if block_mask is None else d.value(block_mask)
    dq, dk, dv, dbias, dsink = d.graph._add_op("sdpa_backward", read + [o, grads[0], stats] + extra + [None, None]
                                               + random + extras + [None] * len(BACKWARD_RAGGED) + [block_mask],
                                               attrs)
    return [dq, dk, dv, dbias] + [None] * 6 + [dsink, _scale_gradient(d, scale, read[0], dq)] + [None] * 4 \
        + [None] * (len(node.inputs) - 16)


def _scale_gradient(d, scale, q, dq):
    """d attn_scale of a tensor scale: scores = scale * q k^T + ..., so d scale = sum(dS * q k^T),
    and dq = scale * dS k makes that sum(q * dq) / scale (NaN for a scale of 0)."""
    if scale is None or not d.needs(scale):
        return None
    g = d.graph
    total = g.reduction(g.mul(q, dq), "sum", [0, 1, 2, 3])
    return g.reshape(g.div(total, d.value(scale)), list(scale.dim))


def ragged_slots(node) -> list:
    """(operand tensor, index of its offset among the node's inputs) of each ragged-capable
    operand of an sdpa or sdpa_backward node present (the offset may be None); [] for other ops."""
    if node.op not in ("sdpa", "sdpa_backward"):
        return []
    names = node.opdef.input_names
    roles = FORWARD_RAGGED if node.op == "sdpa" else BACKWARD_RAGGED
    slots = []
    for role in roles:
        stem = role[:-len(RAGGED_SUFFIX)]
        if stem in names:
            tensor = node.inputs[names.index(stem)]
        else:
            tensor = node.outputs[node.opdef.output_names.index(stem)] if node.outputs else None
        if tensor is not None:
            slots.append((tensor, names.index(role)))
    return slots


def ragged_operands(node) -> list:
    """(operand, offset) of each ragged operand of an sdpa node."""
    return [(t, node.inputs[i]) for t, i in ragged_slots(node) if node.inputs[i] is not None]


def slot_length(node, index):
    """The seq_len tensor of `node` giving the lengths of the sequences in its ragged slot `index`:
    seq_len_kv for k, v, dk, dv, else seq_len_q."""
    names = node.opdef.input_names
    role = names[index][:-len(RAGGED_SUFFIX)]
    return node.inputs[names.index("seq_len_kv" if role in KEY_SIDE else "seq_len_q")]


def ragged_length(graph, tensor):
    """The seq_len tensor giving the lengths of ragged `tensor`'s sequences (Graph.validate makes
    every sdpa node that has it in a ragged slot name the same one)."""
    for node in graph.nodes:
        for operand, index in ragged_slots(node):
            if operand is tensor:
                return slot_length(node, index)
    return None
