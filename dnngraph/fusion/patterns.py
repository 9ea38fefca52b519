"""Fusion rules: what each anchor op may absorb, and multi-anchor patterns (attention).

An anchor (matmul, conv, sdpa, reduction, norm, softmax, pooling) absorbs pointwise producers
of some inputs as prologues (applied at load) and pointwise consumers of one output as epilogues
(applied before the store): its op's catalog entry says which (OpDef.fusion, an AnchorRule, kept
with the op in ops/<family>.py). Pure data: partition.py applies it.
"""
from __future__ import annotations

from typing import Optional

from ..ops.base import REGISTRY, AnchorRule


def anchor_rule(op: str) -> Optional[AnchorRule]:
    """What the anchor op `op` absorbs: its catalog entry's rule (ops/<family>.py), None for an
    op that is no anchor or absorbs nothing."""
    found = REGISTRY.get(op)
    return found.fusion if found is not None else None

# Pointwise ops whose value depends on the element's logical row-major index (the Philox counter
# of dropout is offset + that index). Only the pointwise kernel computes that index, so these
# never ride in an anchor's prologue or epilogue, and their group's domain is their own shape.
COUNTER_OPS = frozenset({"dropout", "gen_index"})  # gen_index: the index along an axis

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
