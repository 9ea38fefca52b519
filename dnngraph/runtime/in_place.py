"""Which outputs may be bound to the very memory of an input (in-place execution).

An output may share its memory with an input only where the plan is known to read every element
of the input before it writes the output's element there, and to read it nowhere else after:

  * the group writing the output reads the input "one to one": each program loads the element
    at exactly the index where it stores the output's, before its store, and no other program
    loads it. That holds for a pointwise group whose output and input both span the group's
    whole domain (no broadcast: an output smaller than the domain is stored by one index while
    others still read), reading the input itself (not a view of it, which moves indices); and
    for the per-row pairs an anchor declares (IN_PLACE_ROWS: batchnorm's running statistics,
    read and written by the program that owns the channel);
  * every other group that reads the input (or a view of it) runs before that group.

Anything else (a matmul output over its A operand, a transpose written back, a reader after the
writer) has no safe order in the plan and execute() refuses the binding (runtime/plan.py).
"""
from __future__ import annotations

from ..fusion.partition import declared_row_pairs
from ..tensor import blend_factor_uids


def in_place_pairs(graph, groups) -> frozenset:
    """(output uid, input uid) pairs of `graph` that may be bound to the same memory."""
    views = groups.views
    order = list(groups)
    readers: dict = {}  # root uid of a graph input -> [(group index, read uid)]
    for index, group in enumerate(order):
        for tensor in group.inputs:
            readers.setdefault(views.root_of(tensor.uid), []).append((index, tensor.uid))
        for uid in blend_factor_uids(group.outputs):  # read by the stores, at no element's index
            readers.setdefault(uid, []).append((index, None))
    pairs = set()
    for index, group in enumerate(order):
        for output, source in _one_to_one(group):
            reads = readers.get(source.uid, [])
            later = [at for at, uid in reads if at > index or (at == index and uid != source.uid)]
            if source.is_input and output.is_output and not later:
                pairs.add((output.uid, source.uid))
    return frozenset(pairs)


def _one_to_one(group):
    """(output, input) tensor pairs `group`'s kernel reads one to one (see the module's text)."""
    if group.kind == "pointwise":
        domain = _domain(group)
        spanning = lambda t: tuple(t.dim) == domain
        return [(out, src) for out in group.outputs if spanning(out)
                for src in group.inputs if spanning(src) and src.data_type is out.data_type]
    return [(out, src) for out, src in declared_row_pairs(group.anchor)
            if out in group.outputs and _read_once(group, src)]


def _read_once(group, tensor) -> bool:
    """Whether `tensor` is read by exactly one input slot of one node of `group`: a row kernel
    may run in several launches (split mode: partial, combine, apply), and a second reader (a
    fused pointwise node, or another slot of the anchor such as bias) in a launch after the
    combine that stores the running statistic would read the value already overwritten."""
    return sum(1 for node in group.nodes for t in node.inputs if t is not None and t.uid == tensor.uid) == 1


def _domain(group) -> tuple:
    """The dims every tensor of a pointwise group broadcasts to."""
    tensors = list(group.inputs) + list(group.outputs)
    rank = max(len(t.dim) for t in tensors)
    sizes = [1] * rank
    for tensor in tensors:
        for axis, size in enumerate(tensor.dim[::-1]):
            sizes[rank - 1 - axis] = max(sizes[rank - 1 - axis], size)
    return tuple(sizes)
