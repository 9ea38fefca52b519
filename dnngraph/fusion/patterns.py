"""Fusion rules: what each anchor op may absorb, and multi-anchor patterns (attention).

An anchor (matmul, conv, sdpa, reduction, norm, softmax, pooling) absorbs pointwise producers
of some inputs as prologues (applied at load) and pointwise consumers of one output as epilogues
(applied before the store). Pure data: partition.py applies it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AnchorRule:
    prologue_inputs: tuple[int, ...]  # input positions whose pointwise producers fuse in
    epilogue_output: Optional[int]  # output whose pointwise consumers fuse in (None: none)
    exit_modes: frozenset = frozenset()  # reductions over the last axis that ride the epilogue
    stats_exit: bool = False  # genstats (per-channel sum, sum of squares) of an epilogue value rides it


_NORM_FORWARD = AnchorRule(prologue_inputs=(0,), epilogue_output=0)
_NORM_BACKWARD = AnchorRule(prologue_inputs=(0,), epilogue_output=0)

ANCHOR_RULES: dict[str, AnchorRule] = {
    # row amax (fp8 scaling) or row sums of the epilogue value, folded across N tiles
    "matmul": AnchorRule((0, 1), 0, frozenset({"sum", "mean", "max", "min", "amax", "norm1", "norm2"})),
    # conv input prologue: the scale-bias-relu of a preceding batchnorm applied at load; the
    # batchnorm statistics of the output (genstats) folded from per-tile column sums
    "conv_fprop": AnchorRule((0,), 0, stats_exit=True),
    "conv_dgrad": AnchorRule((0,), 0),
    "conv_wgrad": AnchorRule((0,), 0),
    "sdpa": AnchorRule((), 0),
    "sdpa_backward": AnchorRule((), None),
    "reduction": AnchorRule((0,), 0),
    "softmax": AnchorRule((0,), 0),
    "softmax_backward": AnchorRule((0,), 0),
    "pooling": AnchorRule((0,), 0),
    "pooling_backward": AnchorRule((0,), 0),
    "genstats": AnchorRule((0,), None),
    "batchnorm_inference": _NORM_FORWARD,
}
for _norm in ("layernorm", "rmsnorm", "batchnorm", "instancenorm", "groupnorm"):
    ANCHOR_RULES[_norm] = _NORM_FORWARD
    ANCHOR_RULES[_norm + "_backward"] = _NORM_BACKWARD

# Pointwise ops whose value depends on the element's logical row-major index (the Philox counter
# of dropout is offset + that index). Only the pointwise kernel computes that index, so these
# never ride in an anchor's prologue or epilogue, and their group's domain is their own shape.
COUNTER_OPS = frozenset({"dropout"})

# Attention written as ops: matmul(q, k^T) -> pointwise (scale, bias, mask) -> softmax over the
# last axis -> matmul(probabilities, v). The whole chain becomes one flash-attention kernel.
ATTENTION_SCORE_OPS = frozenset({"mul", "scale", "div", "add", "sub", "where", "maximum", "minimum"})
