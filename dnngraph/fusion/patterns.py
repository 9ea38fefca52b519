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
    # pointwise consumers of the other outputs (a norm's statistics, per-channel parameter
    # gradients) ride the epilogue too: a row kernel computes those per row and stores them there
    side_epilogues: bool = False


_NORM_FORWARD = AnchorRule(prologue_inputs=(0,), epilogue_output=0, side_epilogues=True)
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
    "genstats": AnchorRule((0,), None, side_epilogues=True),
    # a gather's loads follow its ids: no prologue (it would run at gathered positions); its
    # pointwise consumers (an embedding's scale, a position add) ride the store
    "gather": AnchorRule((), 0),
    "batchnorm_inference": _NORM_FORWARD,
}
for _norm in ("layernorm", "rmsnorm", "batchnorm", "instancenorm", "groupnorm"):
    ANCHOR_RULES[_norm] = _NORM_FORWARD
    ANCHOR_RULES[_norm + "_backward"] = _NORM_BACKWARD
# batchnorm's dscale and dbias are per-row sums of its dx kernel (rows are channels); layernorm's
# and rmsnorm's are column sums, finished by a combine kernel (or a dscale/dbias kernel) that runs
# their epilogue (a cast, the add of another use's gradient); instance and group norm reduce them
# in a kernel of their own, which runs none
ANCHOR_RULES["batchnorm_backward"] = AnchorRule((0,), 0, side_epilogues=True)
ANCHOR_RULES["layernorm_backward"] = AnchorRule((0,), 0, side_epilogues=True)
ANCHOR_RULES["rmsnorm_backward"] = AnchorRule((0,), 0, side_epilogues=True)

# Pointwise ops whose value depends on the element's logical row-major index (the Philox counter
# of dropout is offset + that index). Only the pointwise kernel computes that index, so these
# never ride in an anchor's prologue or epilogue, and their group's domain is their own shape.
COUNTER_OPS = frozenset({"dropout"})

# Attention written as ops: matmul(q, k^T) -> pointwise (scale, bias, mask) -> softmax over the
# last axis -> (dropout) -> matmul(probabilities, v). The whole chain becomes one flash-attention
# kernel; its dropout draws the counters the dropout op would (offset + the probability's
# row-major index).
# The score ops (with tanh for a soft cap, tanh(s / c) * c) are rendered as the kernel's score
# modifier; their other operands (masks, biases, position terms) are read per key block.
ATTENTION_SCORE_OPS = frozenset({"mul", "scale", "div", "add", "sub", "where", "maximum", "minimum", "tanh"})
# A tuple, not a set: its order is the order error messages list the types in.
ATTENTION_TYPES = ("float16", "bfloat16", "float32")


def attention_chain_fits(chain) -> bool:
    """Can the flash kernel run this matmul -> score ops -> softmax -> matmul chain? Ranks 3 or 4
    (batch dims become (batch, heads)), one float type for q, k^T and v, no fp8 scales, an output
    with the scores' batch dims (v no wider than them), side operands of rank <= 4 broadcasting
    into the scores, a float scores chain."""
    first, second = chain[0], chain[-1]
    q, kt, v = first.inputs[0], first.inputs[1], second.inputs[1]
    if any(t is not None for t in first.inputs[2:] + second.inputs[2:]):
        return False
    if len({len(t.dim) for t in (q, kt, v)}) != 1 or len(q.dim) not in (3, 4):
        return False
    if len({t.data_type.name for t in (q, kt, v)}) != 1 or q.data_type.name not in ATTENTION_TYPES:
        return False
    scores = first.outputs[0].dim
    if tuple(second.outputs[0].dim[:-2]) != tuple(scores[:-2]):
        return False  # v wider than the probabilities: the kernel's rows would not be p's (dropout counters)
    made = {first.outputs[0].uid} | {n.outputs[0].uid for n in chain[1:-1]}
    for node in score_ops(chain):
        if not node.outputs[0].data_type.is_floating:
            return False
        for tensor in node.input_tensors():
            if tensor.uid in made:
                continue
            dims = (1,) * (len(scores) - len(tensor.dim)) + tuple(tensor.dim)
            if len(tensor.dim) > len(scores) or any(d not in (1, s) for d, s in zip(dims, scores)):
                return False
    return True


def score_ops(chain) -> list:
    """The score modifier of an attention chain: the nodes between q k^T and the softmax."""
    softmax = next(i for i, node in enumerate(chain) if node.op == "softmax")
    return chain[1:softmax]


def chain_dropout(chain):
    """The dropout node on an attention chain's probabilities, or None."""
    return chain[-2] if chain[-2].op == "dropout" else None
