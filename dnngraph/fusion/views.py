"""Layout ops (reshape, transpose, slice, concatenate) as views of memory, and copies where no
view exists.

Decided before partition, in topological order, as plain data:
  * a virtual output that strides can express over its input's memory is an alias: it is that
    memory, read with other dims, strides and an element offset (a transpose feeding a matmul is
    a stride change, not a kernel);
  * otherwise a virtual input that only the layout op reads is written straight into the
    output's memory by the kernel that makes it (a concatenate's parts, a transpose into a graph
    output): a pointwise kernel in any layout, any other kernel (a matmul, a norm's statistics)
    in the layout it writes anyway; through views only this chain reads (a transpose of a
    transpose, a reshape of a reshape), which are then restated over that memory;
  * otherwise a copy: one pointwise kernel from a view of the input to a view of the output
    (two, through a dense buffer, for a reshape that neither side can express).
Aliases are stated over their root's memory (a graph input, a graph output or a workspace
tensor, never another alias), so views of views compose; a tensor others alias becomes an alias
itself only with those views, restated over its new root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..ops.base import lookup
from ..ops.pointwise import PointwiseAttrs
from ..ops.shape import concat_parts, reshape_strides, view_of
from ..tensor import contiguous_strides

LAYOUT_OPS = frozenset({"reshape", "transpose", "slice", "concatenate"})
# Anchors whose kernels store every output through its own per-axis strides, whatever they are
# (attention's o, stats, dq, dk, dv): they write a value straight into any layout a view asks for.
STRIDED_STORES = frozenset({"sdpa", "sdpa_backward"})


@dataclass(frozen=True)
class Alias:
    """A tensor that is a view of its root's memory."""

    root: int  # uid of the tensor that owns the memory
    dims: tuple
    strides: tuple  # in elements of the root's memory
    offset: int  # elements from the root's first element


class ViewTensor:
    """A tensor the build makes up: a view that a copy kernel reads or writes, or a dense
    buffer between two copies. Carries what kernel builders read of a graph Tensor."""

    def __init__(self, uid: int, name: str, dim, stride, data_type):
        self.uid, self.name, self.dim, self.stride, self.data_type = uid, name, tuple(dim), tuple(stride), data_type
        self.producer, self.is_output, self.is_input, self.is_virtual = None, False, False, True
        self.blend = None  # never a blended output: build refuses blending a layout op's output


class CopyNode:
    """A cast node the pointwise kernels render: target = source (in the target's type)."""

    def __init__(self, uid: int, name: str, source, target):
        self.uid, self.name, self.op = uid, name, "cast"
        self.inputs, self.outputs = (source,), (target,)
        self.attrs = PointwiseAttrs(data_type=target.data_type.name)
        self.opdef = lookup("cast")

    def input_tensors(self):
        return list(self.inputs)

    def output_tensors(self):
        return list(self.outputs)


@dataclass
class Views:
    """What the layout ops became: aliases, copies (per layout node, in order) and the virtual
    tensors whose memory must exist because others alias it."""

    aliases: dict = field(default_factory=dict)  # uid -> Alias
    copies: dict = field(default_factory=dict)  # layout Node -> [CopyNode, ...]
    roots: set = field(default_factory=set)  # uids aliased by others
    made: dict = field(default_factory=dict)  # uid -> ViewTensor (views and buffers made up here)
    tensors: dict = field(default_factory=dict)  # uid -> graph Tensor or ViewTensor of every root

    def virtual_roots(self) -> list:
        """Virtual tensors others alias (their memory must exist even if no kernel writes them
        as a whole: a concatenate whose parts were all written in place)."""
        return [self.tensors[uid] for uid in sorted(self.roots) if self.tensors[uid].is_virtual]

    def materialize(self, tensors: dict) -> None:
        """Add each alias to `tensors` (uid -> torch tensor) as a view of its root's tensor."""
        for uid, alias in self.aliases.items():
            root = tensors[alias.root]
            tensors[uid] = root.as_strided(alias.dims, alias.strides, root.storage_offset() + alias.offset)

    def lend_strides(self, graph) -> None:
        """Give `graph`'s tensors the view strides a build gives its aliases (after undoing an
        earlier build's), as the partition did to the snapshot the plan was built on."""
        for tensor in graph.tensors:
            tensor.restore_strides()
        for uid, alias in self.aliases.items():
            tensor = graph._tensors.get(uid)
            if tensor is not None:
                tensor.view_strides(alias.strides)

    def aligned(self, itemsize_of) -> bool:
        """Whether every alias starts 16 bytes into its root's memory (roots are aligned)."""
        return all(alias.offset * itemsize_of(uid) % 16 == 0 for uid, alias in self.aliases.items())

    def root_of(self, uid: int) -> int:
        alias = self.aliases.get(uid)
        return uid if alias is None else alias.root

    def layout_of(self, tensor) -> Alias:
        """The tensor's memory as (root, dims, strides, offset)."""
        alias = self.aliases.get(tensor.uid)
        return alias if alias is not None else Alias(tensor.uid, tuple(tensor.dim), tuple(tensor.stride), 0)


class _Planner:
    def __init__(self, graph, order, consumers):
        self.graph, self.order, self.consumers = graph, order, consumers
        self.views = Views()

    def fresh(self) -> int:
        return next(self.graph._uids)

    def root(self, uid: int):
        self.views.roots.add(uid)
        self.views.tensors.setdefault(uid, self.views.made.get(uid) or self.graph._tensors[uid])

    def alias(self, tensor, layout: Alias):
        """Make a virtual graph tensor an alias: kernels read and write it with these strides."""
        self.views.aliases[tensor.uid] = layout
        self.root(layout.root)
        tensor.view_strides(layout.strides)

    def view_tensor(self, like, layout: Alias, data_type, what: str) -> ViewTensor:
        made = ViewTensor(self.fresh(), f"{like.name}.{what}", layout.dims, layout.strides, data_type)
        self.views.aliases[made.uid] = layout
        self.root(layout.root)
        self.views.made[made.uid] = made
        return made

    def copy(self, node, source, target):
        copy = CopyNode(self.fresh(), f"{node.name}.copy", source, target)
        self.views.copies.setdefault(node, []).append(copy)

    def aliasable(self, tensor) -> bool:
        """A virtual tensor whose strides are still free: no alias, nothing aliases it."""
        return (tensor.is_virtual and tensor.uid not in self.views.aliases
                and tensor.uid not in self.views.roots)

    def writable_into(self, tensor, node, layout: Alias) -> bool:
        """May `tensor`'s producer write it straight into the memory of `node`'s output, laid out
        as `layout`? The layout op reads it once, in one type (other readers read it from
        there: a matmul's result saved through a reshape and also taken by its epilogue); a
        pointwise or attention producer writes any strides, any other kernel only the layout it
        would give the tensor anyway (a reshape into an output: a matmul's result, a norm's
        statistics), 16-byte aligned. A tensor others alias qualifies only as the start of
        views leading here (`write_into`)."""
        producer = tensor.producer
        if not (tensor.is_virtual and tensor.uid not in self.views.aliases and producer is not None
                and producer.op not in LAYOUT_OPS and node in self.consumers(tensor)
                and self._read_once(tensor, node)):
            return False
        if producer.opdef.role == "pointwise":
            return True
        if producer.op in STRIDED_STORES:  # any strides, vectorized stores kept 16-byte aligned
            return layout.offset * tensor.data_type.itemsize % 16 == 0
        return _same_layout(tensor, layout)

    def _read_once(self, tensor, node) -> bool:
        return sum(t is tensor for t in node.inputs) == 1 and tensor.data_type == node.outputs[0].data_type

    def _passes_on(self, tensor, reader) -> bool:
        """Is `tensor` a view (reshape, transpose) of its input that only `reader` reads?"""
        producer = tensor.producer
        return (tensor.uid in self.views.aliases and tensor.uid not in self.views.roots
                and producer is not None and producer.op in ("reshape", "transpose")
                and self.consumers(tensor) == [reader] and self._read_once(tensor, reader))

    def write_into(self, tensor, node, layout: Alias) -> bool:
        """Have the kernel that makes `tensor` (or the value it is a view of, through views only
        this chain reads) write it straight into `layout`, the memory of `node`'s output; the
        views between are restated over that memory. False (nothing changed) where it may not."""
        views, reader = [], node
        while self._passes_on(tensor, reader):
            views.append(tensor)
            reader, tensor = tensor.producer, tensor.producer.inputs[0]
            layout = self.inverse_view(reader, layout)
            if layout is None:
                return False
        # a value views lead from is their root, and theirs only (another view of it, stated
        # over its memory, would not follow it into `layout`); one no view leads from may be no
        # one's root
        if (tensor.uid in self.views.roots) != bool(views) or not self.writable_into(tensor, reader, layout):
            return False
        chain = {view.uid for view in views}
        if any(alias.root == tensor.uid and uid not in chain for uid, alias in self.views.aliases.items()):
            return False
        restated = [_own_strides(tensor, layout)]
        for view in reversed(views):
            base = restated[-1]
            seen = view_of(view.producer, base.dims, base.strides, base.offset)
            if seen is None:
                return False
            restated.append(Alias(base.root, *seen))
        self.views.roots.discard(tensor.uid)  # its views now alias the memory it is written into
        for made, made_layout in zip([tensor] + views[::-1], restated):
            self.alias(made, made_layout)
        return True

    def run(self) -> Views:
        for tensor in self.graph.tensors:  # a previous build's views are undone first
            tensor.restore_strides()
        for node in self.order:
            if node.op == "concatenate":
                self.concatenate(node)
            elif node.op in LAYOUT_OPS:
                self.view_op(node)
        return self.views

    def target_layout(self, y) -> Alias:
        """The memory y is written to: its own (it becomes a root) or, if an alias, its root's."""
        return self.views.layout_of(y)

    def view_op(self, node):
        x, y = node.inputs[0], node.outputs[0]
        source = self.views.layout_of(x)
        seen = view_of(node, source.dims, source.strides, source.offset)
        if seen is not None and self.aliasable(y) and x.data_type == y.data_type:
            self.alias(y, Alias(source.root, *seen))
            return
        back = self.inverse_view(node, self.target_layout(y))
        if back is not None and self.write_into(x, node, back):
            return
        if seen is not None:  # copy a view of x into y
            self.copy(node, self.view_tensor(x, Alias(source.root, *seen), x.data_type, "view"), y)
        elif back is not None:  # a reshape: copy x into a view of y with x's dims
            self.copy(node, x, self.view_tensor(y, back, y.data_type, "view"))
        else:  # neither side is a view of the other: through a dense buffer
            dense = ViewTensor(self.fresh(), f"{x.name}.dense", x.dim, contiguous_strides(x.dim), x.data_type)
            self.views.made[dense.uid] = dense
            self.copy(node, x, dense)
            again = view_of(node, dense.dim, dense.stride, 0)
            self.copy(node, self.view_tensor(dense, Alias(dense.uid, *again), x.data_type, "view"), y)

    def inverse_view(self, node, target: Alias) -> Optional[Alias]:
        """x's dims over the memory of node's output y laid out as `target` (transpose,
        reshape), or None (a slice: x is larger)."""
        x = node.inputs[0]
        if node.op == "transpose":
            inverse = [0] * len(node.attrs.permutation)
            for position, axis in enumerate(node.attrs.permutation):
                inverse[axis] = position
            return Alias(target.root, tuple(target.dims[a] for a in inverse),
                         tuple(target.strides[a] for a in inverse), target.offset)
        if node.op == "reshape":
            strides = reshape_strides(target.dims, target.strides, tuple(x.dim))
            return None if strides is None else Alias(target.root, tuple(x.dim), strides, target.offset)
        return None

    def concatenate(self, node):
        y = node.outputs[0]
        target, axis = self.target_layout(y), node.attrs.axis
        for index, start in concat_parts(node):
            x = node.inputs[index]
            part = Alias(target.root, tuple(x.dim), target.strides, target.offset + start * target.strides[axis])
            if not self.write_into(x, node, part):
                self.copy(node, x, self.view_tensor(y, part, y.data_type, f"part{index}"))
        self.root(target.root)


def _same_layout(tensor, layout: Alias) -> bool:
    """Does `layout` walk `tensor`'s elements with its own strides (axes of size 1 aside), from an
    element 16 bytes into its root? Then the producer's kernel writes it as it would anyway."""
    same = all(size == 1 or mine == theirs for size, mine, theirs in zip(tensor.dim, tensor.stride, layout.strides))
    return same and layout.offset * tensor.data_type.itemsize % 16 == 0


def _own_strides(tensor, layout: Alias) -> Alias:
    """`layout` with `tensor`'s strides on its axes of size 1 (they address nothing, and a
    producer that derives its layout from them sees its own)."""
    strides = tuple(mine if size == 1 else theirs
                    for size, mine, theirs in zip(tensor.dim, tensor.stride, layout.strides))
    return Alias(layout.root, layout.dims, strides, layout.offset)


def plan_views(graph, order, consumers) -> Views:
    """Aliases and copies of every layout op of `graph` (nodes in topological `order`;
    `consumers(tensor)` lists the nodes reading a tensor)."""
    return _Planner(graph, order, consumers).run()
