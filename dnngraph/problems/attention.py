"""Attention geometry: B, H, H_kv, S_q, S_kv, D, D_v, the mask, dropout, paging; for the sdpa
ops and for attention written as ops (a chain, and its backward)."""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.sdpa import kv_length
from .base import problem


@dataclass(frozen=True)
class AttentionGeometry:
    """direction: "forward" | "backward". mask: "none", "causal" (top left), "causal_bottom_right",
    "band" (diagonal bounds), or "ops" (score ops of an op-level chain). causal: a right bound and
    no left one. dropout: the probability (0.0: none). paged: K/V read through page tables."""

    direction: str
    batch: int
    heads: int
    kv_heads: int
    s_q: int
    s_kv: int
    head_dim: int
    value_dim: int
    mask: str
    causal: bool
    dropout: float
    paged: bool
    bias: bool = False
    alibi: bool = False  # use_alibi_mask: position-dependent slopes added to the scores


def _clamped_ramp(rows: int, first: int, cap: int) -> int:
    """sum over i < rows of min(cap, max(0, first + i)): keys seen by rows whose reach grows by one."""
    start = min(rows, max(0, -first))  # rows before it see no key
    stop = min(rows, max(start, cap - first))  # rows from it see all cap keys
    return (stop - start) * (2 * first + start + stop - 1) // 2 + (rows - stop) * cap


def visible_pairs(geometry: AttentionGeometry):
    """The (query, key) pairs a forward's mask keeps, counted exactly (what a TFLOP/s figure of
    BENCHMARKS.md counts: 4 * B * H * D flops a pair), for no mask or a causal one (either
    alignment); None for other masks, whose bounds the geometry does not hold."""
    g = geometry
    if g.mask == "none":
        return g.s_q * g.s_kv
    if g.mask not in ("causal", "causal_bottom_right"):
        return None
    shift = g.s_kv - g.s_q if g.mask == "causal_bottom_right" else 0
    return _clamped_ramp(g.s_q, shift + 1, g.s_kv)  # row i sees keys j <= i + shift


def forward_work(problem) -> tuple:
    """(flops, bytes) of a plain forward (forward_shape_class): 4 * B * H * D a visible pair (the
    two matrix products), and every operand and output moved once."""
    g = problem.geometry
    moved = sum(o.numel * o.data_type.itemsize for o in problem.operands + problem.outputs)
    return 4.0 * g.batch * g.heads * g.head_dim * visible_pairs(g), moved


PLAIN_FORWARD_ROLES = frozenset({"q", "k", "v", "o", "stats"})
PLAIN_FORWARD_TYPES = frozenset({"float16", "bfloat16"})


def forward_shape_class(problem):
    """(head dim, mask) of a plain sdpa forward: q, k, v and o of one 16-bit type, D == Dv, no
    mask or a causal one, no bias, dropout, ALiBi, paging, other operand or fused op (stats may
    be stored). What BENCHMARKS.md measures each backend's attention forward on, so the classes
    its models hold measured rates for; None for any other problem."""
    g = problem.geometry
    if problem.family != "sdpa" or g.direction != "forward" or problem.prologue or problem.epilogue or problem.exits:
        return None
    if g.dropout or g.bias or g.alibi or g.paged or g.head_dim != g.value_dim or visible_pairs(g) is None:
        return None
    present = problem.operands + problem.outputs
    if any(o.role not in PLAIN_FORWARD_ROLES for o in present):
        return None
    types = {o.data_type.name for o in present if o.role != "stats"}
    if len(types) != 1 or not types <= PLAIN_FORWARD_TYPES:
        return None
    return g.head_dim, g.mask


def _bhsd(dims) -> tuple:
    """A rank-3 or rank-4 [B, H, rows, cols] as four sizes (H = 1 for rank 3)."""
    return (1,) * (4 - len(dims)) + tuple(int(d) for d in dims)


def mask_bounds(attrs, s_q: int, s_kv: int) -> tuple:
    """(left, right) bounds of the node's mask as its kernels see them (None: no bound): a bound
    of Sq + Skv or more masks nothing and is dropped."""
    mask, reach = attrs.mask, s_q + s_kv
    left = mask.left if mask.left is not None and mask.left < reach else None
    right = mask.right if mask.right is not None and mask.right < reach else None
    return left, right


def _mask(attrs, s_q: int, s_kv: int) -> tuple:
    """(kind, causal) of the node's mask, as its kernels see it (mask_bounds); causal: a right
    bound and no left one (a sliding window, with both, is a band)."""
    left, right = mask_bounds(attrs, s_q, s_kv)
    if left is None and right is None:
        return "none", False
    if left is None and right == 0:
        return ("causal_bottom_right" if attrs.mask.bottom_right else "causal"), True
    return "band", left is None


def sdpa_problem(graph, group):
    node = group.anchor
    names = node.opdef.input_names
    q, k, v = node.inputs[:3]
    k_table = node.inputs[names.index("paged_attention_k_table")]
    bias = node.inputs[names.index("bias")]
    attrs = node.attrs
    mask, causal = _mask(attrs, int(q.dim[2]), int(kv_length(k, k_table, attrs)))
    dropout = float(attrs.dropout[0]) if attrs.dropout else 0.0
    direction = "backward" if node.op == "sdpa_backward" else "forward"
    geometry = AttentionGeometry(direction, int(q.dim[0]), int(q.dim[1]), int(k.dim[1]), int(q.dim[2]),
                                 int(kv_length(k, k_table, attrs)), int(q.dim[3]), int(v.dim[3]), mask, causal,
                                 dropout, k_table is not None, bias is not None, bool(attrs.use_alibi_mask))
    return problem(graph, group, geometry)


def _dropout(nodes) -> float:
    for n in nodes:
        if n.op == "dropout":
            return float(n.attrs.p)
    return 0.0


def attention_problem(graph, group):
    """An op-level chain matmul(q, k^T) -> score ops -> softmax -> matmul(., v)."""
    first, second = group.nodes[0], group.nodes[-1]
    q, kt, v = first.inputs[0], first.inputs[1], second.inputs[1]
    b, h, s_q, d = _bhsd(q.dim)
    _, h_kv, _, s_kv = _bhsd(kt.dim)
    dv = _bhsd(v.dim)[3]
    middle = [n.op for n in group.nodes[1:-1] if n.op not in ("softmax", "dropout")]
    geometry = AttentionGeometry("forward", b, h, h_kv, s_q, s_kv, d, dv, "ops" if middle else "none", False,
                                 _dropout(group.nodes), False)
    return problem(graph, group, geometry)


def attention_backward_problem(graph, group):
    """The backward of an op-level chain (fusion/attention.py's roles)."""
    roles = group.roles
    b, h, s_q, s_kv = _bhsd(roles.scores.outputs[0].dim)
    q = roles.scores.inputs[0]
    d = int(q.dim[-1])
    dv = int(roles.dp.inputs[0].dim[-1]) if roles.dp is not None else d
    geometry = AttentionGeometry("backward", b, h, h, s_q, s_kv, d, dv, "ops" if roles.score_ops else "none",
                                 False, _dropout(roles.nodes()), False)
    return problem(graph, group, geometry)


def sdpa_fp8_problem(graph, group):
    """An sdpa_fp8 or sdpa_fp8_backward node: the attention geometry, causal or unmasked."""
    node = group.anchor
    q, k, v = node.inputs[:3]
    causal = bool(node.attrs.use_causal_mask)
    geometry = AttentionGeometry("backward" if node.op == "sdpa_fp8_backward" else "forward", int(q.dim[0]),
                                 int(q.dim[1]), int(k.dim[1]), int(q.dim[2]), int(k.dim[2]), int(q.dim[3]),
                                 int(v.dim[3]), "causal" if causal else "none", causal, 0.0, False)
    return problem(graph, group, geometry)
