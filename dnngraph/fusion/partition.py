"""Partition a graph into kernel groups.

Passes, in order:
  0. attention backwards (the derivation of an op-level chain, attention.py) become one group
     each, before the layout ops, since the transpose of their probabilities is inside them;
  0. layout ops become views of memory or copy kernels (views.py); they join no other group;
  1. attention chains (matmul -> scale/mask -> softmax -> matmul) become one group, only where
     the caller has a kernel for that pattern (a group with no kernel behind it would turn a
     runnable graph, whose ops each run alone, into an unrunnable one);
  2. each remaining anchor, in topological order, absorbs pointwise prologues and epilogues
     (row kernels also pointwise consumers of their other outputs: a norm's statistics' casts);
  3. leftover pointwise nodes merge into groups along producer -> consumer edges;
  4. pointwise groups of one domain that read a common graph input merge (siblings).
Counter ops (dropout) join only pointwise groups, and only groups whose domain is their shape.
A group is accepted only while it stays convex (no path leaves it and comes back), so the
groups always form a DAG. Values made inside a group that are graph outputs or read by other
groups are stored by its kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


from ..bitpack import packed_layouts_agree, touches_bit_packed
from ..dag import CycleError, Dag, node_dag
from ..errors import ValidationError
from ..ops.base import broadcast_dims
from .attention import match_attention_backward
from .patterns import ATTENTION_SCORE_OPS, COUNTER_OPS, AnchorRule, anchor_rule, attention_chain_fits
from .views import LAYOUT_OPS, Views, plan_views


@dataclass(eq=False)
class FusionGroup:
    """A set of nodes that one kernel runs, with what it reads and writes."""

    kind: str  # kernel family: "pointwise", "matmul", "sdpa", "attention" (an op-level chain), ...
    anchor: Optional[object]  # the anchor Node (None for pointwise groups)
    nodes: list = field(default_factory=list)  # topological order
    prologue: list = field(default_factory=list)
    epilogue: list = field(default_factory=list)
    exits: list = field(default_factory=list)  # reductions of epilogue values (last axis)
    inputs: list = field(default_factory=list)  # tensors read from memory
    outputs: list = field(default_factory=list)  # tensors written to memory
    origin: Optional[object] = None  # a copy group's layout Node (its nodes are made-up casts)
    roles: Optional[object] = None  # an attention backward's AttentionBackward
    # (first half, second half): the slice nodes of an anchor whose column halves ride as a pair
    column_pairs: Optional[tuple] = None

    def summary(self) -> str:
        """What the group's kernel computes, in words of code alone (no node or tensor names):
        what a generated source's docstring says, the same for every group of the same ops."""
        return f"[{self.kind}] {', '.join(n.op for n in self.nodes)}"

    def describe(self) -> str:
        ops = ", ".join(f"{n.op}({n.name})" for n in self.nodes)
        reads = ", ".join(t.name for t in self.inputs)
        writes = ", ".join(t.name for t in self.outputs)
        return f"[{self.kind}] {ops} | reads {reads} | writes {writes}"


# anchor op -> {output role: input role} of per-row values an anchor's row kernel loads and stores
# in the same program (the recipe's row outputs): the only anchor outputs that may be bound over an
# input (runtime/in_place.py)
IN_PLACE_ROWS = {"batchnorm": {"next_running_mean": "in_running_mean", "next_running_var": "in_running_var"}}

_NO_EXITS = AnchorRule((), None)  # a side output's epilogue: pointwise nodes only
# Anchors whose kernels store every output they have, read or not (sdpa_backward's dq, dk, dv:
# an unread one, a gradient nobody wants, still needs memory to be written to)
ALWAYS_WRITTEN = frozenset({"sdpa_backward", "rnn_recurrence", "rnn_recurrence_backward"})


def _is_pointwise(node) -> bool:
    return node.opdef.role == "pointwise"


def _numel(dim) -> int:
    count = 1
    for size in dim:
        count *= size
    return count


def _counters_well_defined(members, domain) -> bool:
    """Every counter op spans the whole domain, so its logical index is the kernel's index."""
    return all(_numel(n.outputs[0].dim) == _numel(domain) for n in members if n.op in COUNTER_OPS)


class _Partitioner:
    def __init__(self, graph, kernel_kinds=None):
        self.graph = graph
        self.kernel_kinds = kernel_kinds
        self.dag = node_dag(graph.nodes)
        try:
            self.order = self.dag.topological_sort()
        except CycleError:
            raise ValidationError(f"graph {graph.name!r} has a cycle") from None
        self.position = {node: i for i, node in enumerate(self.order)}
        self.group_of: dict = {}
        self.groups: list[FusionGroup] = []
        self.views = Views()

    # --- pass 0: layout ops ----------------------------------------------------------------------
    def layout_views(self):
        """Aliases decided here; each copy becomes a group of its own (a pointwise kernel)."""
        free = [node for node in self.order if node not in self.group_of]
        self.views = plan_views(self.graph, free, self.consumers)
        for node in free:
            if node.op not in LAYOUT_OPS:
                continue
            chain = []
            for copy in self.views.copies.get(node, []):
                group = FusionGroup("copy", None, [copy], inputs=[copy.inputs[0]], outputs=[copy.outputs[0]],
                                    origin=node)
                chain.append(group)
                self.groups.append(group)
            self.group_of[node] = chain  # layout nodes map to their copy groups (maybe none)

    # --- helpers ---------------------------------------------------------------------------------
    def consumers(self, tensor):
        return [n for n in self.dag.successors(tensor.producer) if tensor in n.inputs] \
            if tensor.producer is not None else []

    def convex(self, members: set) -> bool:
        """No path from the set leaves it and re-enters it. A path that reaches a node of another
        group goes on from every node of that group: its kernel runs after everything it reads,
        so each of its values comes after the set (groups made convex one by one could otherwise
        still wait on each other in a ring)."""
        frontier = [s for m in members for s in self.dag.successors(m) if s not in members]
        seen = set()
        while frontier:
            node = frontier.pop()
            if node in seen:
                continue
            owner = self.group_of.get(node)
            reached = owner.nodes if isinstance(owner, FusionGroup) else [node]
            seen.update(reached)
            for member in reached:
                for succ in self.dag.successors(member):
                    if succ in members:
                        return False
                    frontier.append(succ)
        return True

    def claim(self, group: FusionGroup, nodes):
        for node in nodes:
            self.group_of[node] = group

    def free_pointwise(self, node) -> bool:
        """May an anchor absorb `node`? Anchor kernels know no logical index: no counter ops;
        their loads and stores address bytes: no bit-packed booleans."""
        return (node is not None and node not in self.group_of and _is_pointwise(node)
                and node.op not in COUNTER_OPS and not touches_bit_packed(node))

    # --- pass 0: attention backwards --------------------------------------------------------------
    def attention_backwards(self):
        if not self.has_kernel("attention_backward"):
            return
        for node in self.order:
            roles = match_attention_backward(node, self.consumers, lambda n: n not in self.group_of,
                                             self.position)
            if roles is not None and self.convex(set(roles.nodes())):
                group = FusionGroup("attention_backward", roles.scores, roles.nodes(), roles=roles)
                self.claim(group, group.nodes)
                self.groups.append(group)

    # --- pass 0: column pairs --------------------------------------------------------------------
    def column_pairs(self):
        """An anchor whose rule pairs columns, read only by two slices that take the two halves of
        its last axis, forms its group with them (before the slices become views) and grows its
        epilogue over both halves."""
        for node in self.order:
            rule = anchor_rule(node.op)
            if node in self.group_of or rule is None or not rule.column_pairs:
                continue
            pair = self._column_halves(node.outputs[rule.epilogue_output])
            if pair is None or not self.convex({node, *pair}):
                continue
            group = FusionGroup(node.opdef.family, node, [node, *pair], column_pairs=tuple(pair))
            self.claim(group, group.nodes)
            self.groups.append(group)
            self._grow_epilogue(group, pair[0].outputs[0], rule, paired=pair[1].outputs[0])

    def _column_halves(self, tensor):
        """[first half, second half]: the slice nodes reading `tensor`, a virtual value whose only
        readers they are, whole along every axis but the last, which they split in two; else None."""
        readers = self.consumers(tensor)
        if tensor.is_output or len(readers) != 2 or any(r.op != "slice" or r in self.group_of for r in readers):
            return None
        columns = tensor.dim[-1]
        half = columns // 2
        whole = tuple((0, size, 1) for size in tensor.dim[:-1])
        by_start = {}
        for reader in readers:
            slices = tuple(tuple(axis) for axis in reader.attrs.slices)
            if slices[:-1] != whole or slices[-1] not in ((0, half, 1), (half, columns, 1)):
                return None
            by_start[slices[-1][0]] = reader
        if columns % 2 or half == 0 or set(by_start) != {0, half}:
            return None
        return [by_start[0], by_start[half]]

    # --- pass 1: attention chains ----------------------------------------------------------------
    def has_kernel(self, kind: str) -> bool:
        return self.kernel_kinds is None or kind in self.kernel_kinds

    def attention_chains(self):
        if not self.has_kernel("attention"):
            return
        for node in self.order:
            chain = self._attention_chain(node)
            if chain is not None and self.convex(set(chain)):
                group = FusionGroup("attention", chain[0], list(chain))
                self.claim(group, chain)
                self.groups.append(group)

    def _single_virtual_consumer(self, tensor):
        consumers = self.consumers(tensor)
        if tensor.is_output or len(consumers) != 1 or consumers[0] in self.group_of:
            return None
        return consumers[0]

    def _attention_chain(self, first):
        if first.op != "matmul" or first in self.group_of:
            return None
        chain, current = [first], first
        while True:
            nxt = self._single_virtual_consumer(current.outputs[0])
            if nxt is None:
                return None
            if nxt.op == "softmax":
                if nxt.attrs.axis != len(nxt.outputs[0].dim) - 1 or nxt.attrs.log:
                    return None
                chain.append(nxt)
                break
            if nxt.op not in ATTENTION_SCORE_OPS or nxt.outputs[0].dim != first.outputs[0].dim:
                return None
            chain.append(nxt)
            current = nxt
        second = self._single_virtual_consumer(chain[-1].outputs[0])
        if second is not None and second.op == "dropout" and not second.attrs.return_mask:
            chain.append(second)  # dropout on the probabilities: the kernel draws the same counters
            second = self._single_virtual_consumer(second.outputs[0])
        if second is None or second.op != "matmul" or second.inputs[0] is not chain[-1].outputs[0]:
            return None
        return chain + [second] if attention_chain_fits(chain + [second]) else None

    # --- pass 2: anchors -------------------------------------------------------------------------
    def anchors(self):
        for node in self.order:
            if node in self.group_of or _is_pointwise(node) or node.op in LAYOUT_OPS:
                continue
            if self._dequantizing_loader(node) is not None:
                continue  # joins its matmul's group below: dequantized in the operand loader
            rule = anchor_rule(node.op)
            group = FusionGroup(node.opdef.family, node, [node])
            loaders = self._loader_dequantizations(node)  # asked before the anchor is claimed
            self.claim(group, [node])
            self.groups.append(group)
            for producer in loaders:
                group.prologue.insert(0, producer)
                group.nodes.insert(0, producer)
                self.claim(group, [producer])
            if rule is None:
                continue
            for position in rule.prologue_inputs:
                tensor = node.inputs[position] if position < len(node.inputs) else None
                # a value the anchor also reads at a position without a prologue stays in memory
                others = [t for i, t in enumerate(node.inputs) if i not in rule.prologue_inputs]
                if tensor is not None and all(t is not tensor for t in others):
                    self._grow_prologue(group, tensor.dim, tensor)
            if rule.epilogue_output is not None:
                self._grow_epilogue(group, node.outputs[rule.epilogue_output], rule)
            if rule.side_epilogues:
                for position, tensor in enumerate(node.outputs):
                    if tensor is not None and position != rule.epilogue_output:
                        self._grow_epilogue(group, tensor, _NO_EXITS)

    def _dequantizing_loader(self, node):
        """The matmul whose operand loader runs block_scale_dequantize `node` (the frontend's
        block-scaled GEMM: matmul(dequantize(a), dequantize(b))), or None: its value is virtual
        and read by one matmul only, as A or B (not both), with its blocks along K."""
        if node.op != "block_scale_dequantize":
            return None
        value = node.outputs[0]
        matmul = self._single_virtual_consumer(value)
        if matmul is None or matmul.op != "matmul" or any(t is not None for t in matmul.inputs[2:]):
            return None
        a, b = matmul.inputs[:2]
        if (a is value) == (b is value):
            return None
        k_axis = len(value.dim) - 1 if a is value else len(value.dim) - 2
        return matmul if node.attrs.axis == k_axis else None

    def _loader_dequantizations(self, anchor) -> list:
        """The dequantizations feeding `anchor`'s loaders: they join its group as prologue nodes
        (a backend that fuses no such prologue refuses the group by its problem's prologue)."""
        tensors = anchor.inputs[:2] if anchor.op == "matmul" else ()
        return [t.producer for t in tensors
                if t.producer is not None and self._dequantizing_loader(t.producer) is anchor]

    def _grow_prologue(self, group, operand_dim, tensor):
        producer = tensor.producer
        if not self.free_pointwise(producer) or tensor.dim != operand_dim:
            return
        members = set(group.nodes) | {producer}
        outside = [c for c in self.consumers(tensor) if c not in members]
        if outside or not self.convex(members):
            return
        group.prologue.insert(0, producer)
        group.nodes.insert(0, producer)
        self.claim(group, [producer])
        for source in producer.input_tensors():
            self._grow_prologue(group, operand_dim, source)

    def _grow_epilogue(self, group, tile_tensor, rule, paired=None):
        """Pointwise consumers of `tile_tensor` (and of `paired`, the other column half of a
        column pair, of the same dims) join as the epilogue while the group stays convex."""
        tile_dim = tile_tensor.dim
        tiles = [tile_tensor] + ([paired] if paired is not None else [])
        visible = {t.uid for t in tiles}
        start = min(self.position[t.producer] for t in tiles) + 1
        for node in self.order[start:]:
            if self._is_exit(node, tile_dim, visible, rule) and self.convex(set(group.nodes) | {node}):
                group.exits.append(node)
                group.nodes.append(node)
                self.claim(group, [node])
                continue
            if not self.free_pointwise(node) or node.outputs[0].dim != tile_dim:
                continue
            if not any(t.uid in visible for t in node.input_tensors()):
                continue
            # values made inside the group but outside the epilogue (prologues) are not at hand
            if any(t.producer in group.nodes and t.uid not in visible for t in node.input_tensors()):
                continue
            side = self._side_producers(group, node, visible, tile_dim)
            if not self.convex(set(group.nodes) | {node} | set(side)):
                side = []
                if not self.convex(set(group.nodes) | {node}):
                    continue
            for member in side + [node]:
                group.epilogue.append(member)
                group.nodes.append(member)
                self.claim(group, [member])
                visible.add(member.outputs[0].uid)

    def _side_producers(self, group, node, visible, tile_dim) -> list:
        """Pointwise producers of `node`'s other inputs that the epilogue can compute in place of
        loading their value (a ReLU backward's mask from the saved activation): of the tile's
        shape, read only by `node`, from values outside the group; producers first."""
        chosen = []
        for tensor in node.input_tensors():
            producer = tensor.producer
            if tensor.uid in visible or not self.free_pointwise(producer) or producer in chosen:
                continue
            if tensor.dim != tile_dim or self.consumers(tensor) != [node] or tensor.is_output:
                continue
            if any(t.producer in group.nodes for t in producer.input_tensors()):
                continue
            chosen.append(producer)
        return chosen

    def _is_exit(self, node, tile_dim, visible, rule) -> bool:
        """A reduction over the last axis of an epilogue value, of a mode the anchor folds, or the
        per-channel statistics (genstats) of one where the anchor folds those."""
        if node in self.group_of:
            return False
        if node.op == "genstats":
            reduces = rule.stats_exit
        else:
            reduces = (node.op == "reduction" and node.attrs.mode in rule.exit_modes
                       and tuple(node.attrs.axes) == (len(tile_dim) - 1,))
        source = node.inputs[0]
        # exits fold in the anchor's float; an integer value is reduced exactly by a row kernel
        return (reduces and source.uid in visible and source.data_type.is_floating
                and tuple(source.dim) == tuple(tile_dim))

    # --- pass 3: leftover pointwise --------------------------------------------------------------
    def pointwise(self):
        for node in self.order:
            if node in self.group_of or not _is_pointwise(node):
                continue
            producer_groups = []
            for tensor in node.input_tensors():
                group = self.group_of.get(tensor.producer)
                if isinstance(group, FusionGroup) and group.kind == "pointwise" and group not in producer_groups:
                    producer_groups.append(group)
            if not self._join(node, producer_groups) and not any(
                    self._join(node, [g]) for g in producer_groups):
                group = FusionGroup("pointwise", None, [node])
                self.claim(group, [node])
                self.groups.append(group)

    def _join(self, node, groups) -> bool:
        if not groups:
            return False
        members = {node}.union(*(set(g.nodes) for g in groups))
        try:
            domain = broadcast_dims("fusion", [(n.name, n.outputs[0].dim) for n in members])
        except ValidationError:
            return False
        if not _counters_well_defined(members, domain) or not self.convex(members) \
                or not packed_layouts_agree(members, domain):
            return False
        target = groups[0]
        for other in groups[1:]:
            target.nodes.extend(other.nodes)
            self.claim(target, other.nodes)
            self.groups.remove(other)
        target.nodes.append(node)
        target.nodes.sort(key=self.position.__getitem__)
        self.claim(target, [node])
        return True

    def pointwise_siblings(self):
        """Pointwise groups of one domain that read a common graph input merge (where the union
        stays convex): the input is read once, and one kernel reading each element of it and
        writing its outputs at that index serves in-place bindings (rotary halves written back
        into x: runtime/in_place.py), which two kernels, each reading what the other overwrites,
        could not."""
        for tensor in self.graph.inputs():
            readers = []
            for node in self.graph.consumers(tensor):
                group = self.group_of.get(node)
                if isinstance(group, FusionGroup) and group.kind == "pointwise" and group not in readers:
                    readers.append(group)
            for other in readers[1:]:
                if readers[0] in self.groups and other in self.groups:
                    self._merge_siblings(readers[0], other)

    def _merge_siblings(self, target: FusionGroup, other: FusionGroup) -> bool:
        domain_of = lambda nodes: broadcast_dims("fusion", [(n.name, n.outputs[0].dim) for n in nodes])
        members = set(target.nodes) | set(other.nodes)
        try:
            domain = domain_of(members)
            if domain != domain_of(target.nodes) or domain != domain_of(other.nodes):
                return False  # a kernel over a wider domain would recompute the narrower group
        except ValidationError:
            return False
        if not _counters_well_defined(members, domain) or not self.convex(members) \
                or not packed_layouts_agree(members, domain):
            return False
        target.nodes.extend(other.nodes)
        target.nodes.sort(key=self.position.__getitem__)
        self.claim(target, other.nodes)
        self.groups.remove(other)
        return True

    # --- result ----------------------------------------------------------------------------------
    def finish(self) -> list[FusionGroup]:
        for group in self.groups:
            if group.kind == "copy":  # reads and writes set when made
                continue
            members = set(group.nodes)
            group.nodes.sort(key=self.position.__getitem__)
            inputs, outputs = {}, {}
            for node in group.nodes:
                for tensor in node.input_tensors():
                    if tensor.producer not in members:
                        inputs.setdefault(tensor.uid, tensor)
                for tensor in node.output_tensors():
                    if tensor.is_output or any(c not in members for c in self.consumers(tensor)) or (
                            node.op in ALWAYS_WRITTEN and not self.consumers(tensor)):
                        outputs.setdefault(tensor.uid, tensor)
            group.inputs, group.outputs = list(inputs.values()), list(outputs.values())
        return Partition(self._ordered(), self.views)

    def _ordered(self) -> list:
        """Groups in an order that respects every dependency, graph order among equals. A layout
        node stands for its copy groups, in order; one that is only a view passes its inputs'
        producers on to its readers."""
        index = {id(g): i for i, g in enumerate(self.groups)}
        group_dag = Dag(range(len(self.groups)))
        made_by = {}

        def producers(node) -> set:  # the groups whose kernels finish what `node` makes
            if node not in made_by:
                owner = self.group_of[node]
                if isinstance(owner, FusionGroup):
                    made_by[node] = {index[id(owner)]}
                elif owner:
                    made_by[node] = {index[id(owner[-1])]}
                else:
                    made_by[node] = set().union(*(producers(p) for p in self.dag.predecessors(node)))
            return made_by[node]

        for node in self.order:
            owner = self.group_of[node]
            if not isinstance(owner, FusionGroup):
                for first, second in zip(owner, owner[1:]):
                    group_dag.add_edge(index[id(first)], index[id(second)])
                if not owner:
                    continue
            target = index[id(owner if isinstance(owner, FusionGroup) else owner[0])]
            for predecessor in self.dag.predecessors(node):
                for source in producers(predecessor):
                    if source != target:
                        group_dag.add_edge(source, target)
        first_node = {i: min(self.position[n] for n in (g.nodes if g.origin is None else [g.origin]))
                      for i, g in enumerate(self.groups)}
        # a group that may overwrite a shared input in place runs after the readers ready with it
        late = _may_overwrite_shared_inputs(self.groups, self.views)
        ordered = group_dag.lexicographical_topological_sort(key=lambda i: (i in late, first_node[i]))
        return [self.groups[i] for i in ordered]


def _may_overwrite_shared_inputs(groups, views) -> set:
    """Indices of the groups that write a graph output of the dims and data type of a graph input
    they read that another group reads too (itself, or through a view of it: readers are counted
    by the memory they read, as runtime/in_place.py counts them): an in-place binding of the two
    runs only when every other reader comes first, so these are ordered after the readers that do
    not depend on them."""
    readers: dict = {}
    for group in groups:
        for tensor in group.inputs:
            root = views.root_of(tensor.uid)
            readers[root] = readers.get(root, 0) + 1
    late = set()
    for index, group in enumerate(groups):
        shared = [t for t in group.inputs if t.is_input and readers.get(t.uid, 0) > 1]
        if any(out.is_output and tuple(out.dim) == tuple(t.dim) and out.data_type is t.data_type
               for out, t in _in_place_candidates(group, shared)):
            late.add(index)
    return late


def _in_place_candidates(group, sources) -> list:
    """(output, input) pairs of `group`, its inputs among `sources`, that it could write in place:
    any of a pointwise group's; of an anchor's, only the row pairs it declares (IN_PLACE_ROWS). An
    anchor reading a value across programs (a matmul, a norm's rows) never overwrites it, whatever
    its output's dims, so it is no reason to run that anchor late."""
    if group.kind == "pointwise":
        return [(out, src) for out in group.outputs for src in sources]
    source_uids = {t.uid for t in sources}
    return [(out, src) for out, src in declared_row_pairs(group.anchor) if src.uid in source_uids]


def declared_row_pairs(anchor) -> list:
    """The (output, input) tensor pairs `anchor` declares it reads and writes row for row
    (IN_PLACE_ROWS: batchnorm's running statistics), those of them the node has."""
    declared = IN_PLACE_ROWS.get(getattr(anchor, "op", None), {})
    if not declared:
        return []
    outputs = dict(zip(anchor.opdef.output_names, anchor.outputs))
    inputs = dict(zip(anchor.opdef.input_names, anchor.inputs))
    return [(outputs[o], inputs[i]) for o, i in declared.items()
            if outputs.get(o) is not None and inputs.get(i) is not None]


class Partition(list):
    """The kernel groups in order, and what the layout ops became (`views`)."""

    def __init__(self, groups, views: Views):
        super().__init__(groups)
        self.views = views


def partition(graph, kernel_kinds=None) -> "Partition":
    """Kernel groups of `graph`, in an order that respects every dependency.

    `kernel_kinds` names the group kinds the caller can build (None: every pattern); patterns
    that fuse several anchors into one group form only where their kind is among them.
    """
    partitioner = _Partitioner(graph, kernel_kinds)
    partitioner.attention_backwards()
    partitioner.column_pairs()
    partitioner.layout_views()
    partitioner.attention_chains()
    partitioner.anchors()
    partitioner.pointwise()
    partitioner.pointwise_siblings()
    return partitioner.finish()
