"""The backward of attention written as ops, recognized as one group (the flash backward).

The derivation of an op-level attention chain (autodiff.py) writes, per chain:

    s = matmul(q, kt); s' = score ops(s, sides); p = softmax(s')           recomputed
    dv = matmul(transpose(dropout(p)), dO)                                  gradient of v
    dp = dropout(matmul(dO, vt)); ds' = mul(p, sub(dp, delta))              softmax backward
    ds = gradient ops(ds', s, s', p, sides)                                 the score ops' rules
    dq = matmul(ds, transpose(kt)); dkt = matmul(transpose(q), ds)          gradients of q, k

with delta = rowsum(o * dO) made outside (a row reduction). Every part after the softmax is
optional (only the gradients some input wants are there). Recognized, these nodes become one
group that never materializes a [Sq, Skv] value: the plan runs a log-sum-exp pass, then the dK/dV
and dQ kernels, which render the score ops and their gradient ops through the emitter. The
pattern is matched on what the nodes compute, not on who wrote them, so a graph written by hand
in this form fuses too; anything else stays unfused and runs op by op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .patterns import ATTENTION_SCORE_OPS, ATTENTION_TYPES, COUNTER_OPS


@dataclass
class AttentionBackward:
    """The roles of a recognized attention backward (nodes of the graph; None where absent)."""

    scores: object  # matmul(q, kt)
    score_ops: list  # s -> s' (the forward's score modifier)
    softmax: object
    probs_dropout: Optional[object] = None  # dropout(p) feeding dV
    probs_transpose: Optional[object] = None  # transpose of (dropped) p
    dv: Optional[object] = None  # matmul(transpose(pd), dO)
    dp: Optional[object] = None  # matmul(dO, vt)
    dp_dropout: Optional[object] = None  # dropout(dp), the probabilities' mask again
    subtract: Optional[object] = None  # dp - delta
    multiply: Optional[object] = None  # p * (dp - delta) = ds'
    grad_ops: list = field(default_factory=list)  # ds' -> ds (the score ops' gradients)
    dq: Optional[object] = None  # matmul(ds, transpose(kt))
    dk: Optional[object] = None  # matmul(transpose(q), ds) (dk transposed) or matmul(transpose(ds), q)
    dk_transpose: Optional[object] = None  # the transpose of ds in the second form
    casts: dict = field(default_factory=dict)  # "dq" | "dk" | "dv" -> the cast a product's value goes to

    def nodes(self) -> list:
        """Every member node."""
        single = (self.scores, self.softmax, self.probs_dropout, self.probs_transpose, self.dv, self.dp,
                  self.dp_dropout, self.subtract, self.multiply, self.dq, self.dk, self.dk_transpose)
        return [n for n in single if n is not None] + self.score_ops + self.grad_ops + list(self.casts.values())

    def products(self) -> dict:
        """"dq" | "dk" | "dv" -> the tensor the group writes for it (a cast's output where the
        product's only reader casts it)."""
        found = {stem: node for stem, node in (("dq", self.dq), ("dk", self.dk), ("dv", self.dv)) if node is not None}
        return {stem: (self.casts[stem] if stem in self.casts else node).outputs[0] for stem, node in found.items()}

    @property
    def q(self):
        return self.scores.inputs[0]

    @property
    def kt(self):
        return self.scores.inputs[1]

    @property
    def vt(self):
        return self.dp.inputs[1] if self.dp is not None else None

    @property
    def d_o(self):
        return self.dv.inputs[1] if self.dv is not None else self.dp.inputs[0]

    @property
    def delta(self):
        return self.subtract.inputs[1] if self.subtract is not None else None

    @property
    def dk_scores(self):
        """The value of the scores' gradient the dK product reads."""
        if self.dk is None:
            return None
        return self.dk_transpose.inputs[0] if self.dk_transpose is not None else self.dk.inputs[1]

    @property
    def dk_transposed(self) -> bool:
        """Does the group write dK transposed ([.., D, Skv], the form matmul(transpose(q), ds))?"""
        return self.dk is not None and self.dk_transpose is None

    @property
    def dropout(self):
        return self.probs_dropout or self.dp_dropout


def swaps_last_axes(node, source=None) -> bool:
    """Is `node` a transpose of the last two axes (of `source`, where given)?"""
    if node is None or node.op != "transpose":
        return False
    rank = len(node.inputs[0].dim)
    order = list(range(rank - 2)) + [rank - 1, rank - 2]
    return list(node.attrs.permutation) == order and (source is None or node.inputs[0] is source)


def _plain_matmul(node) -> bool:
    return node is not None and node.op == "matmul" and all(t is None for t in node.inputs[2:])


def _plain_dropout(node) -> bool:
    return node is not None and node.op == "dropout" and not node.attrs.return_mask


def _broadcasts_into(dims, into) -> bool:
    """Do `dims` broadcast into `into` (numpy rules, no wider)?"""
    if len(dims) > len(into):
        return False
    padded = (1,) * (len(into) - len(dims)) + tuple(dims)
    return all(d in (1, s) for d, s in zip(padded, into))


class _Matcher:
    def __init__(self, softmax, consumers: Callable, free: Callable, position: dict):
        self.consumers, self.free, self.position = consumers, free, position
        self.roles: Optional[AttentionBackward] = None
        self.dims = tuple(softmax.outputs[0].dim)

    def only_reader(self, tensor):
        readers = self.consumers(tensor)
        return readers[0] if len(readers) == 1 and not tensor.is_output else None

    # --- s = matmul(q, kt) -> score ops -> softmax ------------------------------------------------
    def score_chain(self, logits):
        """(matmul, score ops in graph order) making `logits`, or None."""
        walked, stack, matmuls, seen = [], [logits], [], set()
        while stack:
            node = stack.pop().producer
            if node is None or node in seen or not self.free(node):
                continue
            seen.add(node)
            if tuple(node.outputs[0].dim) != self.dims:
                continue
            if node.op == "matmul":
                matmuls.append(node)
            elif node.op in ATTENTION_SCORE_OPS:
                walked.append(node)
                stack.extend(node.input_tensors())
        if len(matmuls) != 1 or not _plain_matmul(matmuls[0]):
            return None
        made, ops = {matmuls[0].outputs[0].uid}, []
        for node in sorted(walked, key=self.position.__getitem__):
            if any(t.uid in made for t in node.input_tensors()):
                made.add(node.outputs[0].uid)
                ops.append(node)
        return (matmuls[0], ops) if logits.uid in made else None

    # --- p's readers: the dV path and ds' -------------------------------------------------------
    def probability_readers(self, p) -> bool:
        roles = self.roles
        for reader in self.consumers(p):
            # ds' = p * (dP - delta): a tensor operand (p times a constant is no gradient)
            if reader.op == "mul" and reader.inputs[0] is p and reader.inputs[1] is not None and \
                    reader.inputs[1] is not p and roles.multiply is None:
                roles.multiply = reader
            elif _plain_dropout(reader) and reader.inputs[0] is p and roles.probs_dropout is None:
                roles.probs_dropout = reader
            elif swaps_last_axes(reader, p) and roles.probs_transpose is None:
                roles.probs_transpose = reader
            else:
                return False
        if roles.probs_dropout is not None:
            if roles.probs_transpose is not None:
                return False
            roles.probs_transpose = self.only_reader(roles.probs_dropout.outputs[0])
            if not swaps_last_axes(roles.probs_transpose):
                return False
        if roles.probs_transpose is not None:
            roles.dv = self.only_reader(roles.probs_transpose.outputs[0])
            if not _plain_matmul(roles.dv) or roles.dv.inputs[0] is not roles.probs_transpose.outputs[0]:
                return False
        return True

    def softmax_gradient(self) -> bool:
        """ds' = mul(p, sub(dropout(matmul(dO, vt)), delta))."""
        roles = self.roles
        subtract = roles.multiply.inputs[1].producer
        if subtract is None or subtract.op != "sub" or self.only_reader(subtract.outputs[0]) is not roles.multiply:
            return False
        roles.subtract = subtract
        d_probs, delta = subtract.inputs
        if d_probs is None or delta is None or delta.dim[-1] != 1 or not _broadcasts_into(delta.dim, self.dims):
            return False
        if self.only_reader(d_probs) is not subtract:
            return False
        producer = d_probs.producer
        if _plain_dropout(producer):
            roles.dp_dropout, d_probs = producer, producer.inputs[0]
            if self.only_reader(d_probs) is not producer:
                return False
            producer = d_probs.producer
        roles.dp = producer
        if not _plain_matmul(producer) or tuple(d_probs.dim) != self.dims:
            return False
        if roles.dv is not None and roles.dv.inputs[1] is not producer.inputs[0]:
            return False  # dV and dP read one dO
        first, second = roles.probs_dropout, roles.dp_dropout
        if first is not None and second is not None and (first.attrs != second.attrs or
                                                         tuple(first.inputs[1:]) != tuple(second.inputs[1:])):
            return False  # one mask, drawn once
        return roles.dv is None or (first is None) == (second is None)

    def gradient_ops(self) -> bool:
        """The pointwise ops from ds' to the dQ and dK products."""
        roles, values = self.roles, {self.roles.multiply.outputs[0].uid}
        frontier = [roles.multiply.outputs[0]]
        while frontier:
            tensor = frontier.pop()
            for reader in self.consumers(tensor):
                if reader in roles.grad_ops or reader in (roles.dq, roles.dk, roles.dk_transpose):
                    continue
                if _plain_matmul(reader) and reader.inputs[0] is tensor and roles.dq is None and \
                        swaps_last_axes(reader.inputs[1].producer, roles.kt):
                    roles.dq = reader
                elif _plain_matmul(reader) and reader.inputs[1] is tensor and roles.dk is None and \
                        swaps_last_axes(reader.inputs[0].producer, roles.q):
                    roles.dk = reader
                elif swaps_last_axes(reader, tensor) and roles.dk is None and self.transposed_dk(reader):
                    roles.dk_transpose = reader
                elif (self.free(reader) and reader.opdef.role == "pointwise" and reader.op not in COUNTER_OPS
                      and tuple(reader.outputs[0].dim) == self.dims and reader.outputs[0].data_type.is_floating):
                    roles.grad_ops.append(reader)
                    values.add(reader.outputs[0].uid)
                    frontier.append(reader.outputs[0])
                else:
                    return False
        roles.grad_ops.sort(key=self.position.__getitem__)
        return roles.dq is not None or roles.dk is not None

    def transposed_dk(self, transpose) -> bool:
        """dk = matmul(transpose(ds), q): the transpose read only by that product."""
        product = self.only_reader(transpose.outputs[0])
        if not _plain_matmul(product) or product.inputs[0] is not transpose.outputs[0] or \
                product.inputs[1] is not self.roles.q:
            return False
        self.roles.dk = product
        return True

    # --- the whole -------------------------------------------------------------------------------
    def match(self, softmax) -> Optional[AttentionBackward]:
        p = softmax.outputs[0]
        if softmax.attrs.log or softmax.attrs.axis != len(self.dims) - 1 or len(self.dims) not in (3, 4):
            return None
        found = self.score_chain(softmax.inputs[0])
        if found is None or p.is_output:
            return None
        self.roles = roles = AttentionBackward(found[0], found[1], softmax)
        if not self.probability_readers(p):
            return None
        if roles.multiply is not None and not (self.softmax_gradient() and self.gradient_ops()):
            return None
        if roles.dv is None and roles.multiply is None:
            return None
        self.stored_casts()
        return roles if self.closed() and self.typed() else None

    def stored_casts(self):
        """A product read only by a cast to a float type is stored in that type, as the cast."""
        for stem, node in (("dq", self.roles.dq), ("dk", self.roles.dk), ("dv", self.roles.dv)):
            reader = None if node is None else self.only_reader(node.outputs[0])
            if reader is not None and reader.op == "cast" and self.free(reader) and \
                    reader.outputs[0].data_type.is_floating:
                self.roles.casts[stem] = reader

    def closed(self) -> bool:
        """Only the dQ, dK and dV products leave the group; the score and gradient ops read the
        values the kernels hold (s, the score ops', p, dS', the gradient ops') or operands from
        outside that broadcast into the scores; delta and dO come from outside, dO no wider
        than the scores."""
        roles = self.roles
        members = set(roles.nodes())
        leaving = {t.uid for t in roles.products().values()}
        for node in members:
            for tensor in node.output_tensors():
                if tensor.uid in leaving:
                    continue
                if tensor.is_output or any(c not in members for c in self.consumers(tensor)):
                    return False
        held = {roles.scores.outputs[0].uid} | {n.outputs[0].uid for n in roles.score_ops}
        if not self.operands_ok(roles.score_ops, held, members):
            return False
        held |= {roles.softmax.outputs[0].uid} | {n.outputs[0].uid for n in roles.grad_ops}
        if roles.multiply is not None:
            held.add(roles.multiply.outputs[0].uid)
        outside = [roles.d_o] + ([roles.delta] if roles.delta is not None else [])
        return self.operands_ok(roles.grad_ops, held, members) and \
            all(t.producer not in members for t in outside) and \
            _broadcasts_into(roles.d_o.dim[:-2], self.dims[:-2])

    def operands_ok(self, nodes, held: set, members: set) -> bool:
        """Every operand of `nodes` is a held value or comes from outside, broadcasting into the
        scores."""
        for node in nodes:
            for tensor in node.input_tensors():
                if tensor.uid in held:
                    continue
                if tensor.producer in members or not _broadcasts_into(tensor.dim, self.dims):
                    return False
        return True

    def typed(self) -> bool:
        """q, kt (and vt) share one float type; every operand has the scores' rank; the score
        values are floating."""
        roles = self.roles
        products = [roles.q, roles.kt] + ([roles.vt] if roles.vt is not None else [])
        names = {t.data_type.name for t in products}
        if len(names) != 1 or next(iter(names)) not in ATTENTION_TYPES:
            return False
        return all(len(t.dim) == len(self.dims) for t in products + [roles.d_o]) and \
            all(n.outputs[0].data_type.is_floating for n in roles.score_ops)


def match_attention_backward(softmax, consumers: Callable, free: Callable,
                             position: dict) -> Optional[AttentionBackward]:
    """The attention backward around `softmax` (a softmax node), or None. `consumers(tensor)`
    lists a tensor's readers, `free(node)` says whether no group has claimed a node yet and
    `position` maps each node to its place in a topological order."""
    if softmax.op != "softmax" or not free(softmax):
        return None
    return _Matcher(softmax, consumers, free, position).match(softmax)
