"""Reverse-mode differentiation of a graph into two graphs that compile like any other.

`derive(graph, inputs, outputs, wanted)` returns a Derivation:
  * `forward`: the graph replayed with the values the backward reads marked as outputs (norms and
    sdpa switched to their training form, which also returns their statistics);
  * `backward`: a graph whose inputs are the output gradients, the saved values and the forward
    inputs it reads, and whose outputs are the gradients of the wanted inputs.
Each op's backward rule (registered beside the op, ops/base.py BACKWARD_RULES) writes its part
of the backward graph. Values made by pointwise and layout ops are recomputed in the backward
graph from what they read (they fuse into the backward kernels, as the norms recompute x-hat);
values made by anchors (matmul, conv, norms, softmax, reductions, pooling, sdpa) are saved.

Attention written as ops (matmul -> score ops -> softmax -> (dropout) -> matmul, the chains the
partitioner fuses into one flash kernel) is recomputed instead: its scores and probabilities are
never saved, so the forward stays one kernel, and the softmax's row sums come from the chain's
output, delta = rowsum(o * dO), so that the backward graph is the pattern the partitioner fuses
into the flash backward kernels (fusion/attention.py).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional


from .dag import node_dag
from . import dtypes, ops  # noqa: F401  (registers every op and its backward rule)
from .errors import UnsupportedError
from .fusion import partition
from .ops.base import BACKWARD_RULES
from .tensor import overlaps

if TYPE_CHECKING:  # pragma: no cover  (Graph sits above: the graphs made here are of the input's type)
    from .graph import Graph

RECOMPUTED_ROLES = frozenset({"pointwise"})
RECOMPUTED_FAMILIES = frozenset({"layout"})
# Ops whose training form the forward takes so the backward has their statistics; their y is
# the same in either form.
TRAINING_FORM = {"layernorm", "rmsnorm", "instancenorm", "groupnorm", "sdpa", "adalayernorm"}


def _training_attrs(node):
    if node.op == "sdpa" and node.attrs.is_inference:
        return dataclasses.replace(node.attrs, is_inference=False)
    if node.op in TRAINING_FORM and node.op != "sdpa" and node.attrs.norm_forward_phase != "training":
        return dataclasses.replace(node.attrs, norm_forward_phase="training")
    return node.attrs


def replay(graph: Graph, name: str, attrs_of=lambda node: node.attrs, outputs=None) -> tuple[Graph, dict]:
    """A copy of `graph` (names, types, strides, outputs) with each node's attributes from
    `attrs_of`; returns (copy, original uid -> copied tensor). `outputs` (original tensors, or
    None: the graph's) are the copy's outputs, in their own layouts; ops that feed none of them
    are left out. A graph output of a narrow float type left out becomes a cast to that type,
    so that its consumers compute what they compute in `graph`."""
    copy = graph.blank(name)
    kept = None if outputs is None else {t.uid for t in outputs}
    mapped = {}
    for tensor in graph.inputs():
        mapped[tensor.uid] = copy.tensor(name=tensor.name, dim=list(tensor.dim), stride=list(tensor.stride),
                                         data_type=tensor.data_type)
    for node in graph.nodes:
        inputs = [None if t is None else mapped[t.uid] for t in node.inputs]
        made = copy._add_op(node.op, inputs, attrs_of(node), node.name)
        for original, twin in zip(node.outputs, made):
            if original is None or twin is None:
                continue
            mapped[original.uid] = twin
            if twin.name != original.name:
                twin.set_name(original.name)
            if original._data_type is not None:
                twin.set_data_type(original._data_type)
            if original.is_output if kept is None else original.uid in kept:
                twin.set_output(True)
                if tuple(twin.stride) != tuple(original.own_stride):
                    twin.set_stride(original.own_stride)
            elif original.is_output and dtypes.narrower_than_compute(original.data_type):
                # an output left out is not stored, but its consumers still read it as stored
                mapped[original.uid] = copy.cast(twin, data_type=original.data_type)
    if kept is not None:
        prune(copy)
    return copy, mapped


def _stored_narrow(tensor) -> bool:
    """A forward output stored in a float type narrower than the compute type: its consumers
    read it rounded (DESIGN.md, "Data types"), so the backward reads the stored value rather than
    recompute a wider one."""
    return tensor.is_output and dtypes.narrower_than_compute(tensor.data_type)


@dataclasses.dataclass
class Derivation:
    """The forward and backward graphs of one differentiation, and how their tensors line up."""

    forward: Graph
    backward: Graph
    outputs: list  # forward-graph tensors the caller gets (in `forward`)
    saved: list  # forward-graph tensors (in `forward`) the backward reads, outputs of `forward`
    forward_inputs: list  # forward inputs (original graph) the backward reads
    grad_inputs: list  # backward inputs: the gradient of each output (None: not floating)
    saved_inputs: list  # backward inputs, one per saved value
    forward_input_twins: list  # backward inputs, one per forward input it reads
    grads: list  # backward outputs: the gradient of each wanted input (None: none flows)


class _Deriver:
    def __init__(self, graph: Graph, inputs, outputs, wanted):
        self.source = graph
        self.forward, self.mapped = replay(graph, graph.name + ".forward", _training_attrs, list(outputs))
        self.graph = graph.blank(graph.name + ".backward")
        self.inputs, self.outputs, self.wanted = list(inputs), list(outputs), list(wanted)
        self.values: dict = {}  # forward uid (in self.forward) -> backward tensor
        self.saved, self.saved_inputs = [], []
        self.forward_inputs, self.forward_input_twins = [], []
        self.flows: set = set()
        self.grads: dict = {}  # forward uid -> gradient contributions (one, once totalled)
        self.recomputed: set = set()  # forward uids of attention chains' scores and probabilities
        self.chain_softmax: dict = {}  # forward softmax node -> its chain's output o

    # --- values the rules read ---------------------------------------------------------------
    def value(self, tensor):
        """A forward tensor's value in the backward graph: read (an input or a saved value) or
        recomputed (pointwise and layout ops)."""
        found = self.values.get(tensor.uid)
        if found is not None:
            return found
        producer = tensor.producer
        if producer is None:
            twin = self.graph.tensor(name=f"input.{tensor.name}", dim=list(tensor.dim), stride=list(tensor.stride),
                                     data_type=tensor.data_type)
            self.forward_inputs.append(tensor)
            self.forward_input_twins.append(twin)
        elif ((producer.opdef.role in RECOMPUTED_ROLES or producer.opdef.family in RECOMPUTED_FAMILIES
               or tensor.uid in self.recomputed) and not _stored_narrow(tensor)):
            inputs = [None if t is None else self.value(t) for t in producer.inputs]
            made = self.graph._add_op(producer.op, inputs, producer.attrs)
            for original, twin in zip(producer.outputs, made):
                if original is not None:
                    if original._data_type is not None:  # an integer type set on it truncates
                        twin.set_data_type(original._data_type)
                    self.values[original.uid] = twin
            return self.values[tensor.uid]
        else:  # the forward keeps it, in the type it has inside (an output would take the io type)
            tensor.set_data_type(tensor.data_type).set_output(True)
            twin = self.graph.tensor(name=f"saved.{tensor.name}", dim=list(tensor.dim), stride=list(tensor.stride),
                                     data_type=tensor.data_type)
            self.saved.append(tensor)
            self.saved_inputs.append(twin)
        self.values[tensor.uid] = twin
        return twin

    def needs(self, tensor) -> bool:
        """Does a gradient flow back through forward `tensor` (to a wanted input)?"""
        return tensor is not None and tensor.uid in self.flows

    def operand(self, node, position: int):
        """Operand `position` of a pointwise node: its backward value, or its constant."""
        constants = dict(node.attrs.constants)
        if position in constants:
            return constants[position]
        return self.value(node.inputs[position])

    def zeros(self, like):
        """Zeros with the dims of backward tensor `like` (NaN and inf in it included)."""
        g = self.graph
        return g.where(g.cmp_eq(like, like), 0.0, 0.0)

    def expand(self, value, like):
        """`value` broadcast to the dims of backward tensor `like`."""
        if tuple(value.dim) == tuple(like.dim):
            return value
        g = self.graph
        return g.where(g.cmp_eq(like, like), value, value)

    def fit(self, grad, tensor):
        """A gradient summed over the axes the forward broadcast `tensor` over, or expanded over
        axes it lacks, to `tensor`'s dims."""
        g, dims = self.graph, tuple(tensor.dim)
        if tuple(grad.dim) == dims:
            return grad
        lead = len(grad.dim) - len(dims)
        if lead < 0:
            grad, lead = g.reshape(grad, [1] * -lead + list(grad.dim)), 0
        axes = [a for a in range(len(grad.dim)) if a < lead or (grad.dim[a] > 1 and dims[a - lead] == 1)]
        if axes:
            grad = g.reduction(grad, "sum", axes)
        if lead:
            grad = g.reshape(grad, list(grad.dim[lead:]))
        return grad if tuple(grad.dim) == dims else self.expand(grad, self.value(tensor))

    def attention_chains(self):
        """Mark the forward's op-level attention chains (those the partitioner would fuse) to be
        recomputed, not saved."""
        for group in partition(self.forward, frozenset({"attention"})):
            if group.kind != "attention":
                continue
            nodes = group.nodes
            self.recomputed.update(t.uid for n in nodes[:-1] for t in n.output_tensors())
            softmax = next(n for n in nodes if n.op == "softmax")
            self.chain_softmax[softmax] = nodes[-1].outputs[0]
        self.forward._restore_strides()

    def chain_softmax_backward(self, node, grads):
        """dx = p * (dp - delta) with delta = rowsum(o * dO) of the chain's output o (equal to
        rowsum(p * dp): o is p v, dropout included), the flash backward's row sums."""
        g, o = self.graph, self.chain_softmax[node]
        d_o = self.total(o)
        delta = g.reduction(g.mul(self.value(o), d_o), "sum", [len(o.dim) - 1])
        return [g.mul(self.value(node.outputs[0]), g.sub(grads[0], delta))]

    def total(self, tensor):
        """The summed gradient of forward `tensor` (its contributions added once)."""
        contributions = self.grads[tensor.uid]
        if len(contributions) > 1:
            self.grads[tensor.uid] = contributions = [self._total(contributions)]
        return contributions[0]

    # --- the walk ------------------------------------------------------------------------------
    def run(self) -> Derivation:
        forward = self.forward
        twins = [self.mapped[t.uid] for t in self.outputs]
        for twin in twins:
            twin.set_output(True)
        self.attention_chains()
        grads = self.grads
        grad_inputs = []
        for twin in twins:
            if twin.data_type.is_floating:
                seed = self.graph.tensor(name=f"grad.{twin.name}", dim=list(twin.dim), stride=list(twin.stride),
                                         data_type=twin.data_type)
                grads.setdefault(twin.uid, []).append(seed)
                grad_inputs.append(seed)
            else:
                grad_inputs.append(None)
        wanted = {self.mapped[t.uid].uid for t, w in zip(self.inputs, self.wanted) if w}
        flows = self.flows = self._flows(wanted)
        order = node_dag(forward.nodes).topological_sort()
        for node in reversed(order):
            if not any(o is not None and o.uid in grads for o in node.outputs):
                continue
            if not any(t.uid in flows for t in node.input_tensors()):
                continue
            rule = _Deriver.chain_softmax_backward if node in self.chain_softmax else BACKWARD_RULES.get(node.op)
            if rule is None:
                raise UnsupportedError(f"node {node.name!r} ({node.op}) has no backward rule: its inputs get no "
                                       f"gradient here")
            out_grads = [None if o is None or o.uid not in grads else self.total(o) for o in node.outputs]
            for tensor, grad in zip(node.inputs, rule(self, node, out_grads)):
                if tensor is None or grad is None or tensor.uid not in flows:
                    continue
                grads.setdefault(tensor.uid, []).append(self.fit(grad, tensor))
        results = []
        for tensor, want in zip(self.inputs, self.wanted):
            twin = self.mapped[tensor.uid]
            if not want or twin.uid not in grads:
                results.append(None)
                continue
            grad = self.graph.cast(self.total(twin), tensor.data_type)
            grad.set_output(True).set_data_type(tensor.data_type)
            if tuple(grad.stride) != tuple(tensor.stride) and not overlaps(tensor.dim, tensor.stride):
                grad.set_stride(tensor.stride)  # (an expanded input's gradient is dense)
            results.append(grad)
        prune(self.graph)
        return Derivation(forward, self.graph, twins, self.saved, self.forward_inputs, grad_inputs,
                          self.saved_inputs, self.forward_input_twins, results)

    def _flows(self, wanted: set) -> set:
        """uids of floating tensors a wanted input reaches (gradients flow back through them)."""
        flows = set(wanted)
        for node in self.forward.nodes:
            if any(t.uid in flows for t in node.input_tensors()):
                flows.update(t.uid for t in node.output_tensors() if t.data_type.is_floating)
        return flows

    def _total(self, contributions):
        total = contributions[0]
        for more in contributions[1:]:
            total = self.graph.add(total, more)
        return total


def prune(graph: Graph):
    """Drop nodes whose results nothing reads (a value a rule asked for and did not use)."""
    while True:
        read = {t.uid for n in graph._nodes for t in n.input_tensors()}
        dead = [n for n in graph._nodes
                if all(not t.is_output and t.uid not in read for t in n.output_tensors())]
        if not dead:
            return
        for node in dead:
            graph._nodes.remove(node)
            graph._node_names.discard(node.name)
            for tensor in node.output_tensors():
                graph._tensors.pop(tensor.uid, None)
                graph._names.pop(tensor.name, None)
        graph._invalidate()


def derive(graph: Graph, inputs, outputs, wanted) -> Derivation:
    """The forward graph with saved values and the backward graph giving the gradients of
    `inputs` where `wanted` (a bool per input) from the gradients of `outputs`."""
    graph.validate()
    return _Deriver(graph, inputs, outputs, wanted).run()
