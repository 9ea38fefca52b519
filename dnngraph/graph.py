"""The frontend: a Graph of op nodes over Tensor values, with eager shape inference.

Every op call validates its inputs and attributes, infers the output dims, data types and
strides, and only then adds the node: a failed call leaves the graph as it was.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    import networkx

from . import dtypes
from .errors import ExecutionError, UnsupportedError, ValidationError
from . import frontend
from .ops import REGISTRY, lookup
from .ops.pointwise import POINTWISE_OPS
from .ops.sdpa import ragged_length, ragged_operands, ragged_slots, slot_length
from .ops.shape import normalize_slices
from .ops.base import boolean, integer, normalize_axes, per_axis, real
from .options import BuildOptions
from .symbolic import BucketExtents, check_dense, check_sizes, extent_at, is_extent, propagate, split_dims, symbols_of
from .tensor import (Tensor, bit_packed_strides, check_dims, check_not_overlapping, check_strides, contiguous_strides,
                     dense_strides, span, stride_order)


def _dropout_tensors(dropout) -> tuple:
    """sdpa's dropout=(p, seed, offset) with tensor seeds/offsets moved out: ((p, seed or None,
    offset or None), [seed tensor or None, offset tensor or None])."""
    if not isinstance(dropout, (list, tuple)) or len(dropout) != 3:
        return dropout, [None, None]
    p, seed, offset = dropout
    tensors = [v if isinstance(v, Tensor) else None for v in (seed, offset)]
    return (p, None if tensors[0] is not None else seed, None if tensors[1] is not None else offset), tensors


def _attrs_of(op: str, *args, **kwargs):
    """The validated attributes of `op`, built by the class its catalog entry names."""
    return lookup(op).attrs_type(*args, **kwargs)


def _symbolic_reshape(x, dim) -> tuple:
    """(dims, from_input) of reshape attributes for `dim`, whose dynamic entries (a dg.dynamic
    symbol, or a multiple of one: `2 * seq`) name an extent in terms of a symbol of a dynamic axis
    of `x`: the entry stands at its extent at the symbol's max in dims, and from_input ties the
    output axis to x's first axis of that symbol, scaled by the ratio of the two coefficients
    ([B, seq, H] -> [2 * seq, H] takes x's axis 1 times 2; [2 * seq, H] -> [2, seq, H] takes
    x's axis 0 over 2)."""
    if not isinstance(dim, (list, tuple)) or not any(is_extent(d) for d in dim):
        return dim, ()
    axis_of = {}
    for axis, entry in enumerate(x.dynamic_dim_symbols or ()):
        if entry is not None:
            axis_of.setdefault(entry.symbol, (axis, entry.coefficient))
    pairs = []
    for out, entry in enumerate(dim):
        if is_extent(entry):
            if entry.symbol not in axis_of:
                raise ValidationError(f"reshape of {x.name!r}: {entry!r} in dim is no multiple of a dynamic axis's "
                                      f"symbol of it (its dims are {list(x.dynamic_dim)})")
            source, coefficient = axis_of[entry.symbol]
            common = math.gcd(entry.coefficient, coefficient)
            multiplier, divisor = entry.coefficient // common, coefficient // common
            pairs.append((out, source) if multiplier == divisor == 1 else (out, source, multiplier, divisor))
    return [d.extent(d.symbol.max) if is_extent(d) else d for d in dim], tuple(pairs)


def _symbol_names(x) -> str:
    return "/".join(sorted({s.symbol.name for s in x.dynamic_dim_symbols if s is not None}))


def _fp8_type_of(q) -> str:
    """The fp8 type sdpa_fp8 rounds P to: q's (a q of another type is refused by the op's check)."""
    data_type = getattr(q, "data_type", None)
    return data_type.name if data_type in (dtypes.float8_e4m3, dtypes.float8_e5m2) else "float8_e4m3"


def _refuse_block_scale_types(op: str, opdef, inputs, specs):
    """ValidationError where an op other than the block-scale ones would read or make fp4 or
    e8m0 (their bytes mean something to those ops' kernels only)."""
    if opdef.family == "block_scale":
        return
    for tensor in inputs:
        if tensor is not None and tensor.data_type.is_block_scale_storage:
            raise ValidationError(f"{op}: {tensor.name!r} is {tensor.data_type.name}, which only "
                                  f"block_scale_quantize and block_scale_dequantize take")
    for spec in specs:
        if spec is not None and spec.data_type is not None and spec.data_type.is_block_scale_storage:
            raise ValidationError(f"{op}: cannot make {spec.data_type.name}, which only block_scale_quantize makes")


def _one_of(op: str, name: str, value, alias: str, alias_value):
    """An argument given by its name or by the frontend's name for it (not both)."""
    if value is not None and alias_value is not None:
        raise ValidationError(f"{op}: give {name} or {alias}, not both")
    chosen = value if value is not None else alias_value
    if chosen is None:
        raise ValidationError(f"{op}: {name} is required")
    return chosen


@dataclass(eq=False)
class Node:
    """One op application: inputs and outputs are Tensors (None where optional and absent)."""

    uid: int
    op: str
    name: str
    inputs: tuple
    outputs: tuple
    attrs: object

    @property
    def opdef(self):
        return REGISTRY[self.op]

    def input_tensors(self):
        return [t for t in self.inputs if t is not None]

    def output_tensors(self):
        return [t for t in self.outputs if t is not None]

    def __repr__(self) -> str:
        ins = ", ".join(t.name if t is not None else "-" for t in self.inputs)
        outs = ", ".join(t.name if t is not None else "-" for t in self.outputs)
        return f"{self.op} {self.name!r}({ins}) -> ({outs})"


def _graph_data_types(io_data_type, intermediate_data_type, compute_data_type):
    """The graph's three data types, resolved and checked."""
    io_type = dtypes.resolve(io_data_type)
    intermediate = dtypes.resolve(intermediate_data_type)
    compute = dtypes.resolve(compute_data_type)
    if not intermediate.is_floating:
        raise ValidationError(f"intermediate_data_type must be a floating type, got {intermediate.name}")
    if compute is not dtypes.float32:
        # every kernel computes in float32 registers (integer kinds stay exact separately)
        raise ValidationError(f"compute_data_type must be float32, the type the kernels compute "
                              f"in; got {compute.name}")
    return io_type, intermediate, compute


def _spatial_rank(op: str, role: str, tensor: Tensor, extra: int = 2) -> int:
    """Spatial axes of a [N, C, *S] tensor: 1 to 3."""
    spatial = len(tensor.dim) - extra
    if not 1 <= spatial <= 3:
        raise ValidationError(f"{op}: {role} {tensor.name!r} {list(tensor.dim)} must have 1 to 3 "
                              f"spatial dims after [N, C]")
    return spatial


class Graph:
    """A deep-learning operation graph: declare tensors and ops, mark outputs, build, execute."""

    bucket = None  # a graph specialised at sizes of a dynamic one: its symbolic.BucketExtents
    _ranked = None  # create_execution_plans' GroupPlans (build.GroupPlans), until the graph changes

    def __init__(self, name: str = "graph", io_data_type=dtypes.float32,
                 intermediate_data_type=dtypes.float32, compute_data_type=dtypes.float32,
                 allow_tf32: bool = False):
        if not isinstance(name, str) or not name:
            raise ValidationError(f"graph names must be non-empty strings, got {name!r}")
        self.name = name
        self.io_data_type, self.intermediate_data_type, self.compute_data_type = \
            _graph_data_types(io_data_type, intermediate_data_type, compute_data_type)
        self.allow_tf32 = boolean("Graph", "allow_tf32", allow_tf32)
        self._tensors: dict[int, Tensor] = {}
        self._names: dict[str, Tensor] = {}
        self._nodes: list[Node] = []
        self._node_names: set[str] = set()
        self._uids = itertools.count(1)
        self._plan = None
        self._pass_by_value: tuple = ()  # the inputs passed by value, as of the last build
        self._plans_at: dict = {}  # plan index -> the plan build_plan_at_index built

    # --- bookkeeping -----------------------------------------------------------------------------
    @property
    def tensors(self) -> list[Tensor]:
        return list(self._tensors.values())

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes)

    @property
    def plan(self):
        return self._plan

    def inputs(self) -> list[Tensor]:
        """Tensors the user binds as inputs."""
        return [t for t in self._tensors.values() if t.producer is None]

    def outputs(self) -> list[Tensor]:
        """Tensors marked as outputs."""
        return [t for t in self._tensors.values() if t.is_output]

    def consumers(self, tensor: Tensor) -> list[Node]:
        return [n for n in self._nodes if any(t is tensor for t in n.inputs)]

    def tensor_by_name(self, name: str) -> Tensor:
        try:
            return self._names[name]
        except (KeyError, TypeError):  # TypeError: an unhashable non-name
            raise ValidationError(f"graph {self.name!r} has no tensor named {name!r}") from None

    def _invalidate(self):
        self._plan = None
        self._plans_at = {}
        self._ranked = None

    def _fresh_name(self, base: str) -> str:
        name, counter = base, itertools.count(1)
        while name in self._names or name in self._node_names:
            name = f"{base}_{next(counter)}"
        return name

    def _rename_tensor(self, tensor: Tensor, name: str):
        if not isinstance(name, str) or not name:
            raise ValidationError(f"tensor names must be non-empty strings, got {name!r}")
        if name == tensor.name:
            return
        if name in self._names:
            raise ValidationError(f"duplicate tensor name {name!r} in graph {self.name!r}")
        del self._names[tensor.name]
        tensor._name = name
        self._names[name] = tensor
        self._invalidate()

    def _snapshot(self) -> "Graph":
        """A private copy with the same uids, names, order and settings, for a plan to build on
        and keep: later changes to this graph never reach it (nor its view strides, undone)."""
        twin = copy.copy(self)
        twin._plan, twin._plans_at = None, {}
        twin._tensors, twin._names, twin._nodes = {}, {}, []
        twin._node_names = set(self._node_names)
        twin._uids = itertools.count(max([t.uid for t in self._tensors.values()]
                                         + [n.uid for n in self._nodes], default=0) + 1)
        nodes = {}
        for tensor in self._tensors.values():
            copied = copy.copy(tensor)
            copied._graph = twin
            copied.restore_strides()
            twin._tensors[copied.uid] = twin._names[copied.name] = copied
        for node in self._nodes:
            copied = nodes[node.uid] = copy.copy(node)
            copied.inputs = tuple(None if t is None else twin._tensors[t.uid] for t in node.inputs)
            copied.outputs = tuple(None if t is None else twin._tensors[t.uid] for t in node.outputs)
            twin._nodes.append(copied)
        for tensor in twin._tensors.values():
            tensor.producer = None if tensor.producer is None else nodes[tensor.producer.uid]
            if tensor._ragged_offset is not None:
                tensor._ragged_offset = twin._tensors[tensor._ragged_offset.uid]
            tensor._type_source = tuple(twin._tensors[t.uid] for t in tensor._type_source)
        return twin

    def to_networkx(self) -> "networkx.DiGraph":
        """The node DAG (edges producer -> consumer), nodes keyed by Node. (networkx is imported
        here, on the first call: a build orders nodes with dnngraph/dag.py.)"""
        import networkx as nx

        dag = nx.DiGraph()
        dag.add_nodes_from(self._nodes)
        for node in self._nodes:
            for t in node.input_tensors():
                if t.producer is not None:
                    dag.add_edge(t.producer, node)
        return dag

    # --- tensors -------------------------------------------------------------------------------
    def tensor(self, name: Optional[str] = None, dim=None, stride=None, data_type=None,
               is_pass_by_value: bool = False) -> Tensor:
        """Declare an input tensor: logical dims, physical strides (None: contiguous), type.
        is_pass_by_value (one element): execute and reference take a Python number or a CPU
        tensor for it, as the cuDNN frontend's host scalars."""
        name = self._fresh_name("tensor") if name is None else name
        if not isinstance(name, str) or not name:
            raise ValidationError(f"tensor names must be non-empty strings, got {name!r}")
        if name in self._names:
            raise ValidationError(f"duplicate tensor name {name!r} in graph {self.name!r}")
        if dim is None:
            raise ValidationError(f"tensor {name!r} needs dims")
        dim, dynamic_axes = split_dims(dim, f"tensor {name!r}")  # dg.dynamic entries at their max
        dims = check_dims(dim, f"tensor {name!r}")
        strides = contiguous_strides(dims) if stride is None else \
            check_strides(stride, dims, f"tensor {name!r}")
        data_type = self.io_data_type if data_type is None else dtypes.resolve(data_type)
        if data_type.is_bit_packed:  # rows start on a byte (dtypes.packed_layout_problem)
            strides = bit_packed_strides(dims, strides) if stride is None else strides
            problem = dtypes.packed_layout_problem(dims, strides, data_type)
            if problem is not None:
                raise ValidationError(f"tensor {name!r}: {problem}")
        if dynamic_axes is not None:
            if data_type.is_bit_packed:
                raise UnsupportedError(f"tensor {name!r}: a bit-packed tensor has no dynamic extents yet")
            self._check_symbols(name, dims, strides, dynamic_axes)
        tensor = Tensor(self, next(self._uids), name, dims, strides, data_type)
        tensor._dynamic = dynamic_axes
        if is_pass_by_value is not False:  # before the graph holds the tensor: a refusal adds nothing
            tensor.set_is_pass_by_value(is_pass_by_value)
        self._tensors[tensor.uid] = tensor
        self._names[name] = tensor
        self._invalidate()
        return tensor

    def _check_symbols(self, name: str, dims, strides, dynamic_axes) -> None:
        """A dynamic input: densely packed, each symbol with one range in the whole graph."""
        check_dense(dims, strides, f"tensor {name!r}")
        known = symbols_of(self.inputs())
        for symbol in dynamic_axes:
            if symbol is not None and known.get(symbol.name, symbol) != symbol:
                raise ValidationError(f"tensor {name!r}: {symbol!r} has the name of {known[symbol.name]!r} with "
                                      f"another range: one symbol, one range")

    @property
    def is_dynamic(self) -> bool:
        """Whether some input has a dynamic extent (dg.dynamic in its dims)."""
        return any(t.dynamic_dim_symbols for t in self._tensors.values() if t.producer is None)

    def specialised(self, sizes: dict) -> "Graph":
        """A static copy of this graph with each dynamic extent at `sizes` (symbol name -> size),
        replayed through every shape rule; the tensors keep their names. Its `bucket`
        (symbolic.BucketExtents) says what varies in the sizes' buckets: builds choose there."""
        from .serialization import specialised

        check_sizes(self, sizes)
        sized = specialised(self, sizes, Graph)
        self._check_specialised(sized, sizes)
        # where a build chooses configs: at the top of the sizes' buckets (one compile per bucket)
        sized.bucket = BucketExtents.of(self, sizes)
        return sized

    def _check_specialised(self, sized: "Graph", sizes: dict) -> None:
        """Every tensor of `sized` has this graph's dims with each symbol at its size: the probes
        of symbolic.propagate run the rules at a few sizes only, this holds it at every size run."""
        for tensor in self._tensors.values():
            symbols = tensor.dynamic_dim_symbols or (None,) * len(tensor.dim)
            expected = tuple(d if s is None else extent_at(s, sizes) for d, s in zip(tensor.dim, symbols))
            got = sized.tensor_by_name(tensor.name).dim
            if got != expected:
                raise ValidationError(f"graph {self.name!r} at {sizes}: tensor {tensor.name!r} is {list(got)}, "
                                      f"not {list(expected)} as its dims {list(tensor.dynamic_dim)} say")

    def tensor_like(self, like: torch.Tensor, name: Optional[str] = None) -> Tensor:
        """Declare an input with the dims, strides and data type of a torch tensor."""
        if not isinstance(like, torch.Tensor):
            raise ValidationError(f"tensor_like needs a torch.Tensor, got {type(like).__name__}")
        if like.dim() == 0:
            raise ValidationError("tensor_like needs a tensor of rank >= 1 (reshape scalars to [1])")
        return self.tensor(name=name, dim=list(like.shape), stride=list(like.stride()),
                           data_type=dtypes.from_torch(like.dtype))

    # --- adding ops ------------------------------------------------------------------------------
    def _check_input(self, op: str, role: str, value) -> Tensor:
        if not isinstance(value, Tensor):
            raise ValidationError(f"{op}: {role} must be a dnngraph Tensor, got {type(value).__name__}")
        if value.graph is not self or self._tensors.get(value.uid) is not value:
            raise ValidationError(f"{op}: {role} {value.name!r} belongs to graph {value.graph.name!r}, "
                                  f"not {self.name!r}")
        return value

    def _add_op(self, op: str, inputs: Sequence, attrs, name: Optional[str] = None):
        """Validate, infer, then add node `op`; returns its output tensors (a tuple)."""
        opdef = lookup(op)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValidationError(f"{op}: node names must be non-empty strings, got {name!r}")
        if name is not None and (name in self._node_names or name in self._names):
            raise ValidationError(f"{op}: duplicate name {name!r}")
        roles = [f"{opdef.input_names[0]}[{i}]" for i in range(len(inputs))] if opdef.variadic \
            else opdef.input_names
        if len(inputs) != len(roles):
            raise ValidationError(f"{op}: takes inputs {list(roles)}, got {len(inputs)} inputs")
        checked = []
        for role, value in zip(roles, inputs):
            if value is None and role in opdef.optional:
                checked.append(None)
            elif value is None:
                raise ValidationError(f"{op}: input {role} is required")
            else:
                checked.append(self._check_input(op, role, value))
        node_name = name or self._fresh_name(op)
        try:
            specs = opdef.infer(checked, attrs)
        except ValidationError as error:
            names = ", ".join(t.name for t in checked if t is not None)
            raise ValidationError(f"node {node_name!r} ({op} of {names}): {error}") from None
        _refuse_block_scale_types(op, opdef, checked, specs)
        dynamic_axes = propagate(op, opdef.infer, checked, attrs, specs) \
            if any(t is not None and t.dynamic_dim_symbols for t in checked) else [None] * len(specs)
        node = Node(next(self._uids), op, node_name, tuple(checked), (), attrs)
        outputs = []
        for out_name, spec, axes in zip(opdef.output_names, specs, dynamic_axes):
            if spec is None:
                outputs.append(None)
                continue
            tensor_name = self._fresh_name(f"{node_name}.{out_name}")
            stride = spec.stride or self._inferred_strides(spec, checked)
            tensor = Tensor(self, next(self._uids), tensor_name, tuple(spec.dim), stride, None,
                            producer=node, fixed_data_type=spec.data_type,
                            type_source=tuple(checked[i] for i in spec.type_source or ()))
            tensor._dynamic = axes
            outputs.append(tensor)
        node.outputs = tuple(outputs)
        for tensor in node.output_tensors():  # commit only once everything succeeded
            self._tensors[tensor.uid] = tensor
            self._names[tensor.name] = tensor
        for tensor, offset in ragged_operands(node):  # the node's offsets mark its operands ragged
            tensor._ragged_offset = offset
        self._nodes.append(node)
        self._node_names.add(node_name)
        self._invalidate()
        return node.outputs

    @staticmethod
    def _inferred_strides(spec, inputs) -> tuple:
        """The stride order of the layout source (same rank), densely packed; else row-major. A
        bit-packed result (a cast to dg.bool_bit_packed) starts each row on a byte."""
        source = inputs[spec.layout_source] if spec.layout_source is not None else None
        if source is not None and len(source.dim) == len(spec.dim):
            strides = dense_strides(spec.dim, stride_order(source.dim, source.own_stride))  # not a view's
        else:
            strides = contiguous_strides(spec.dim)
        if spec.data_type is not None and spec.data_type.is_bit_packed:
            return bit_packed_strides(spec.dim, strides)
        return strides

    def _set_ragged_offset(self, tensor: Tensor, offset: Optional[Tensor]):
        """Tensor.set_ragged_offset: the sdpa nodes reading or writing `tensor` take `offset`, each
        checked by its op's rule before anything changes."""
        updated = []
        for node in self._nodes:
            slots = [index for t, index in ragged_slots(node) if t is tensor]
            if not slots:
                continue
            inputs = list(node.inputs)
            for index in slots:
                inputs[index] = offset
            try:
                node.opdef.infer(inputs, node.attrs)
            except ValidationError as error:
                raise ValidationError(f"set_ragged_offset of {tensor.name!r}: node {node.name!r} "
                                      f"({node.op}): {error}") from None
            updated.append((node, tuple(inputs)))
        for node, inputs in updated:
            node.inputs = inputs
        tensor._ragged_offset = offset
        self._invalidate()

    # --- ops: matmul, conv ---------------------------------------------------------------------
    def matmul(self, a: Tensor, b: Tensor, allow_tf32: Optional[bool] = None, name=None,
               scale_a: Optional[Tensor] = None, scale_b: Optional[Tensor] = None) -> Tensor:
        """C = A @ B over [..., M, K] x [..., K, N] with broadcast batch dims; fp8 operands may
        carry per-tensor scales (one-element tensors): C = (A @ B) * scale_a * scale_b."""
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return self._add_op("matmul", [a, b, scale_a, scale_b], _attrs_of("matmul", tf32), name)[0]

    def moe_grouped_matmul(self, token: Tensor, weight: Tensor, first_token_offset: Tensor,
                           allow_tf32: Optional[bool] = None, name=None) -> Tensor:
        """Grouped GEMMs of a mixture of experts: token [T, K] (or [1, T, K]) sorted by expert,
        weight [E, K, N], first_token_offset [E] (or [E, 1, 1]) int32/int64 the first row of each
        expert; rows [off[e], off[e+1]) (the last up to T) give token[rows] @ weight[e]."""
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return self._add_op("moe_grouped_matmul", [token, weight, first_token_offset],
                            _attrs_of("moe_grouped_matmul", tf32), name)[0]

    def moe_grouped_matmul_wgrad(self, token: Tensor, dout: Tensor, first_token_offset: Tensor,
                                 allow_tf32: Optional[bool] = None, name=None) -> Tensor:
        """The grouped weight gradient [E, K, N]: token[rows of e]^T @ dout[rows of e] per expert
        (zero for an expert with no rows)."""
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return self._add_op("moe_grouped_matmul_wgrad", [token, dout, first_token_offset],
                            _attrs_of("moe_grouped_matmul_wgrad", tf32), name)[0]

    @staticmethod
    def _conv_attrs(op, spatial, padding, stride, dilation, groups, mode, shape=(), pre_padding=None,
                    post_padding=None):
        """Padding, stride and dilation: None (the default), one int for every axis, or a list.
        pre_padding and post_padding (the cuDNN frontend's: before the first and after the last
        element of each spatial axis) default to `padding`."""
        pre = per_axis(op, "pre_padding", padding if pre_padding is None else pre_padding, spatial, 0, minimum=0)
        post = per_axis(op, "post_padding", padding if post_padding is None else post_padding, spatial, 0, minimum=0)
        return _attrs_of(op, pre, per_axis(op, "stride", stride, spatial, 1, minimum=1),
                         per_axis(op, "dilation", dilation, spatial, 1, minimum=1), groups, mode,
                         shape, post)

    @staticmethod
    def _conv_groups(op: str, groups, x_dim, w_dim) -> int:
        """`groups`, or None: inferred from the shapes as the frontend does (channels of x over
        the channels per group of w), which must divide. Dims of unequal ranks infer 1 (the op's
        shape rule says what is wrong with them)."""
        if groups is not None:
            return groups
        if len(x_dim) != len(w_dim) or len(x_dim) < 2:
            return 1
        channels, per_group = x_dim[1], w_dim[1]
        if per_group < 1 or channels % per_group:
            raise ValidationError(f"{op}: x has {channels} channels, which w's {per_group} channels per group "
                                  f"do not divide: no group count fits")
        return channels // per_group

    def conv_fprop(self, x, w, padding=None, stride=None, dilation=None, groups=None,
                   mode="cross_correlation", name=None, *, pre_padding=None, post_padding=None) -> Tensor:
        """Convolution forward: y[N, K, *O] from x[N, C, *S] and w[K, C/groups, *R]; groups None:
        C / w's channels."""
        x = self._check_input("conv_fprop", "x", x)
        spatial = _spatial_rank("conv_fprop", "w", self._check_input("conv_fprop", "w", w))
        groups = self._conv_groups("conv_fprop", groups, x.dim, w.dim)
        attrs = self._conv_attrs("conv_fprop", spatial, padding, stride, dilation, groups, mode, (),
                                 pre_padding, post_padding)
        return self._add_op("conv_fprop", [x, w], attrs, name)[0]

    def conv_dgrad(self, dy, w, x_dim, padding=None, stride=None, dilation=None, groups=None,
                   mode="cross_correlation", name=None, *, pre_padding=None, post_padding=None) -> Tensor:
        """Convolution data gradient: dx of dims x_dim from dy and w; groups None: x_dim's
        channels / w's channels."""
        x_dim = check_dims(x_dim, "conv_dgrad x_dim")
        spatial = len(x_dim) - 2
        if not 1 <= spatial <= 3:
            raise ValidationError(f"conv_dgrad: x_dim {list(x_dim)} must have 1 to 3 spatial dims")
        w = self._check_input("conv_dgrad", "w", w)
        groups = self._conv_groups("conv_dgrad", groups, x_dim, w.dim)
        attrs = self._conv_attrs("conv_dgrad", spatial, padding, stride, dilation, groups, mode, x_dim,
                                 pre_padding, post_padding)
        return self._add_op("conv_dgrad", [dy, w], attrs, name)[0]

    def conv_wgrad(self, dy, x, w_dim, padding=None, stride=None, dilation=None, groups=None,
                   mode="cross_correlation", name=None, *, pre_padding=None, post_padding=None) -> Tensor:
        """Convolution weight gradient: dw of dims w_dim from dy and x; groups None: x's channels
        / w_dim's channels."""
        w_dim = check_dims(w_dim, "conv_wgrad w_dim")
        spatial = len(w_dim) - 2
        if not 1 <= spatial <= 3:
            raise ValidationError(f"conv_wgrad: w_dim {list(w_dim)} must have 1 to 3 spatial dims")
        x = self._check_input("conv_wgrad", "x", x)
        groups = self._conv_groups("conv_wgrad", groups, x.dim, w_dim)
        attrs = self._conv_attrs("conv_wgrad", spatial, padding, stride, dilation, groups, mode, w_dim,
                                 pre_padding, post_padding)
        return self._add_op("conv_wgrad", [dy, x], attrs, name)[0]

    # --- ops: reductions, softmax ---------------------------------------------------------------
    def reduction(self, x, mode, axes, name=None) -> Tensor:
        """Reduce x over `axes` with `mode`; reduced axes are kept with size 1."""
        x = self._check_input("reduction", "x", x)
        axes = normalize_axes("reduction", axes, len(x.dim))
        return self._add_op("reduction", [x], _attrs_of("reduction", mode, axes), name)[0]

    def softmax(self, x, axis=-1, log=False, name=None) -> Tensor:
        """Softmax (log-softmax with log=True) along `axis`."""
        x = self._check_input("softmax", "x", x)
        (axis,) = normalize_axes("softmax", integer("softmax", "axis", axis), len(x.dim))
        return self._add_op("softmax", [x], _attrs_of("softmax", axis, log), name)[0]

    def softmax_backward(self, dy, y, axis=-1, log=False, name=None) -> Tensor:
        """dx of softmax from dy and the forward output y."""
        y = self._check_input("softmax_backward", "y", y)
        (axis,) = normalize_axes("softmax_backward", integer("softmax_backward", "axis", axis), len(y.dim))
        return self._add_op("softmax_backward", [dy, y], _attrs_of("softmax_backward", axis, log), name)[0]

    # --- ops: normalizations --------------------------------------------------------------------
    @staticmethod
    def _scalar(value, default: float) -> tuple:
        """(attribute value, tensor or None) of a norm's epsilon or momentum: a number is the
        attribute; a Tensor (one element, the frontend's way) is read by the kernel."""
        return (default, value) if isinstance(value, Tensor) else (value, None)

    def layernorm(self, x, scale, bias, epsilon=1e-5, norm_forward_phase="training", name=None):
        """(y, mean, inv_variance) normalized over the axes where scale is not 1. epsilon: a
        number or a one-element floating tensor (as every norm's)."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        return self._add_op("layernorm", [x, scale, bias, epsilon_t],
                            _attrs_of("layernorm", epsilon, norm_forward_phase), name)

    def adalayernorm(self, x, scale, bias=None, epsilon=1e-5, norm_forward_phase="training", name=None):
        """(y, mean, inv_variance): the cuDNN frontend's adaptive layernorm, a layernorm whose
        scale and bias may differ per sample ([B, 1, D] for x [B, S, D]): every axis but the
        batch axis where scale is not 1 is normalized."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        return self._add_op("adalayernorm", [x, scale, bias, epsilon_t],
                            _attrs_of("adalayernorm", epsilon, norm_forward_phase), name)

    def adalayernorm_backward(self, dy, x, scale, mean, inv_variance, name=None):
        """(dx, dscale, dbias) of adalayernorm; dscale and dbias have scale's dims (per sample
        where scale is)."""
        return self._add_op("adalayernorm_backward", [dy, x, scale, mean, inv_variance],
                            _attrs_of("adalayernorm_backward"), name)

    def rmsnorm(self, x, scale, bias=None, epsilon=1e-5, norm_forward_phase="training", name=None):
        """(y, inv_variance): y = x * rsqrt(mean(x^2) + eps) * scale (+ bias)."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        return self._add_op("rmsnorm", [x, scale, bias, epsilon_t], _attrs_of("rmsnorm", epsilon, norm_forward_phase),
                            name)

    def batchnorm(self, x, scale, bias, in_running_mean=None, in_running_var=None, epsilon=1e-5,
                  momentum=0.1, name=None):
        """(y, mean, inv_variance, next_running_mean, next_running_var) over batch and space;
        epsilon and momentum: numbers or one-element floating tensors."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        momentum, momentum_t = self._scalar(momentum, 0.1)
        attrs = _attrs_of("batchnorm", epsilon, "training", momentum)
        return self._add_op("batchnorm", [x, scale, bias, in_running_mean, in_running_var, epsilon_t, momentum_t],
                            attrs, name)

    def batchnorm_inference(self, x, mean, inv_variance, scale, bias, name=None) -> Tensor:
        """y = (x - mean) * inv_variance * scale + bias with given per-channel statistics."""
        return self._add_op("batchnorm_inference", [x, mean, inv_variance, scale, bias],
                            _attrs_of("batchnorm_inference"), name)[0]

    def instancenorm(self, x, scale, bias, epsilon=1e-5, norm_forward_phase="training", name=None):
        """(y, mean, inv_variance) per sample and channel over spatial axes."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        return self._add_op("instancenorm", [x, scale, bias, epsilon_t],
                            _attrs_of("instancenorm", epsilon, norm_forward_phase), name)

    def groupnorm(self, x, scale, bias, groups, epsilon=1e-5, norm_forward_phase="training",
                  name=None):
        """(y, mean, inv_variance) per sample over groups of channels and spatial axes."""
        epsilon, epsilon_t = self._scalar(epsilon, 1e-5)
        attrs = _attrs_of("groupnorm", epsilon, norm_forward_phase, groups=groups)
        return self._add_op("groupnorm", [x, scale, bias, epsilon_t], attrs, name)

    def genstats(self, x, name=None):
        """(sum, sq_sum) per channel over batch and spatial axes."""
        return self._add_op("genstats", [x], _attrs_of("genstats"), name)

    def layernorm_backward(self, dy, x, scale, mean, inv_variance, name=None):
        """(dx, dscale, dbias) of layernorm."""
        return self._add_op("layernorm_backward", [dy, x, scale, mean, inv_variance], _attrs_of("layernorm_backward"), name)

    def rmsnorm_backward(self, dy, x, scale, inv_variance, has_dbias=False, name=None):
        """(dx, dscale, dbias) of rmsnorm; dbias is None unless has_dbias."""
        attrs = _attrs_of("rmsnorm_backward", has_dbias=has_dbias)
        return self._add_op("rmsnorm_backward", [dy, x, scale, inv_variance], attrs, name)

    def batchnorm_backward(self, dy, x, scale, mean, inv_variance, name=None):
        """(dx, dscale, dbias) of batchnorm training."""
        return self._add_op("batchnorm_backward", [dy, x, scale, mean, inv_variance], _attrs_of("batchnorm_backward"), name)

    def instancenorm_backward(self, dy, x, scale, mean, inv_variance, name=None):
        """(dx, dscale, dbias) of instancenorm."""
        return self._add_op("instancenorm_backward", [dy, x, scale, mean, inv_variance], _attrs_of("instancenorm_backward"),
                            name)

    def groupnorm_backward(self, dy, x, scale, mean, inv_variance, groups, name=None):
        """(dx, dscale, dbias) of groupnorm."""
        return self._add_op("groupnorm_backward", [dy, x, scale, mean, inv_variance],
                            _attrs_of("groupnorm_backward", groups=groups), name)

    # --- ops: pooling, dropout, attention ------------------------------------------------------
    def _pool_attrs(self, op, x, mode, window, stride, padding, return_indices=False, ceil_mode=False,
                    divisor=None):
        """Window, stride and padding: one int for every spatial axis of x, or a list; the
        stride defaults to 1 and the padding to 0."""
        spatial = _spatial_rank(op, "x", self._check_input(op, "x", x))
        if window is None:
            raise ValidationError(f"{op}: window is required (an int or one value per spatial axis)")
        return _attrs_of(op, mode, per_axis(op, "window", window, spatial, 1, minimum=1),
                         per_axis(op, "stride", stride, spatial, 1, minimum=1),
                         per_axis(op, "padding", padding, spatial, 0, minimum=0), return_indices,
                         ceil_mode, divisor)

    def pooling(self, x, mode, window, stride=None, padding=None, return_indices=False, name=None, *,
                ceil_mode=False, divisor=None):
        """Max or average pooling over the spatial axes of [N, C, *S]; with return_indices=True
        (max only) returns (y, indices): torch's int64 argmax index within each input plane.
        ceil_mode and divisor (averages: torch's divisor_override) are torch's."""
        attrs = self._pool_attrs("pooling", x, mode, window, stride, padding, return_indices, ceil_mode, divisor)
        y, indices = self._add_op("pooling", [x], attrs, name)
        return (y, indices) if return_indices else y

    def pooling_backward(self, dy, x, mode, window, stride=None, padding=None, name=None, *,
                         indices=None, ceil_mode=False, divisor=None) -> Tensor:
        """dx of pooling from dy and the forward input x. For max pooling, `indices` (int64, dy's
        dims: what pooling(return_indices=True) gives) route each dy to the element it names,
        when that element lies in the window; without them the kernel recomputes the argmax."""
        attrs = self._pool_attrs("pooling_backward", x, mode, window, stride, padding, False, ceil_mode, divisor)
        return self._add_op("pooling_backward", [dy, x, indices], attrs, name)[0]

    # --- ops: windowed normalization (LRN, divisive normalization; ops/lrn.py) -----------------
    def lrn(self, x, size, alpha=1e-4, beta=0.75, k=1.0, name=None) -> Tensor:
        """Cross-channel local response normalization of x [N, C, *S], torch's
        F.local_response_norm: y = x / (k + alpha / size * sum of x^2 over channels
        [c - size // 2, c + (size - 1) // 2], zeros outside)^beta."""
        return self._add_op("lrn", [x], _attrs_of("lrn", size, alpha, beta, k), name)[0]

    def lrn_backward(self, dy, x, size, alpha=1e-4, beta=0.75, k=1.0, name=None) -> Tensor:
        """dx of lrn from dy and the forward input x (the scale is recomputed from x)."""
        return self._add_op("lrn_backward", [dy, x], _attrs_of("lrn_backward", size, alpha, beta, k), name)[0]

    def divisive_normalization(self, x, size, alpha=1.0, beta=0.5, k=0.0, means=None, name=None) -> Tensor:
        """cuDNN's divisive normalization over a spatial window, per channel: c = x - means
        (means optional, broadcast to x), y = c / (k + alpha / size^d * sum of c^2 over the
        size^d window around each element, zeros outside)^beta (d: x's spatial rank)."""
        attrs = _attrs_of("divisive_normalization", size, alpha, beta, k)
        return self._add_op("divisive_normalization", [x, means], attrs, name)[0]

    def divisive_normalization_backward(self, dy, x, size, alpha=1.0, beta=0.5, k=0.0, means=None,
                                        name=None) -> Tensor:
        """dx of divisive_normalization from dy, x and its means (the gradient of the means is -dx)."""
        attrs = _attrs_of("divisive_normalization_backward", size, alpha, beta, k)
        return self._add_op("divisive_normalization_backward", [dy, x, means], attrs, name)[0]

    def local_contrast_normalization(self, x, size, alpha=1.0, beta=0.5, k=0.0, name=None) -> Tensor:
        """Local contrast normalization: the local mean (an average pooling of x over the odd
        spatial window `size`, stride 1, counting only elements inside x) subtracted, then
        divisive_normalization with the same window: two kernels."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size % 2 == 0:
            raise ValidationError(f"local_contrast_normalization: size must be a positive odd int "
                                  f"(a centred mean window), got {size!r}")
        # attributes, x's rank and type checked before the pooling node is added: a failed call
        # leaves the graph as it was
        attrs = _attrs_of("divisive_normalization", size, alpha, beta, k)
        x = self._check_input("local_contrast_normalization", "x", x)
        lookup("divisive_normalization").infer([x, None], attrs)
        means = self.pooling(x, "avg_exclude_pad", size, 1, size // 2)
        return self._add_op("divisive_normalization", [x, means], attrs, name)[0]

    # --- ops: block-scale quantization (MXFP8, MXFP4, NVFP4; ops/block_scale.py) ---------------
    def block_scale_quantize(self, x=None, block_size=32, axis=-1, transpose=False, name=None, input=None,
                             scale_rounding="up", compute_data_type=None):
        """(y, scale): x quantized in blocks of `block_size` elements along `axis` (None: the
        last, as the frontend's unset axis), one scale per block (the cuDNN frontend's op;
        `input=` is taken for x, through frontend.FRONTEND_KEYWORDS; compute_data_type is float32, the only type kernels compute
        in). The formats are y's and scale's data types (set_data_type): 32 -> float8_e4m3 with
        float8_e8m0 scales (MXFP8), 16 -> float4_e2m1 with float8_e4m3 scales (NVFP4) by
        default. e8m0 scales round up (the frontend's rule) or, with scale_rounding="floor", as
        the OCP MX spec says. Rounding, saturation and NaN rules: ops/block_scale.py."""
        x = _one_of("block_scale_quantize", "x", x, "input", input)
        x = self._check_input("block_scale_quantize", "x", x)
        if compute_data_type is not None and dtypes.resolve(compute_data_type) is not dtypes.float32:
            raise ValidationError("block_scale_quantize: compute_data_type must be float32")
        rank = len(x.dim)
        if axis is None:
            axis = rank - 1
        if isinstance(axis, int) and not isinstance(axis, bool) and -rank <= axis < rank:
            axis %= rank
        transposed = boolean("block_scale_quantize", "transpose", transpose)
        attrs = _attrs_of("block_scale_quantize", block_size, axis, False, scale_rounding)
        y, scale = self._add_op("block_scale_quantize", [x], attrs, name)
        if transposed:  # a layout, which dnngraph states as strides
            order = _block_axis_innermost(x, axis)
            y.set_stride(dense_strides(y.dim, order))
            scale.set_stride(dense_strides(scale.dim, order))
        return y, scale

    def block_scale_dequantize(self, x=None, scale=None, block_size=None, compute_data_type=None, name=None,
                               input=None, descale=None) -> Tensor:
        """y = x * scale, each scale over its block (the cuDNN frontend's op; `input=` and
        `descale=` are taken for x and scale, through frontend.FRONTEND_KEYWORDS): block_size gives
        the elements per scale along each axis of x ([1, 32]: rows of 32), an int the last axis's.
        compute_data_type is float32,
        the only type kernels compute in."""
        x = self._check_input("block_scale_dequantize", "x", _one_of("block_scale_dequantize", "x", x, "input", input))
        scale = _one_of("block_scale_dequantize", "scale", scale, "descale", descale)
        if compute_data_type is not None and dtypes.resolve(compute_data_type) is not dtypes.float32:
            raise ValidationError("block_scale_dequantize: compute_data_type must be float32")
        if isinstance(block_size, int) and not isinstance(block_size, bool):
            block_size = [1] * (len(x.dim) - 1) + [block_size]
        attrs = _attrs_of("block_scale_dequantize", block_size)
        return self._add_op("block_scale_dequantize", [x, scale], attrs, name)[0]

    def gather(self, x, index, axis, name=None) -> Tensor:
        """y[..., i, ...] = x[..., index[..., i, ...], ...] along `axis` (x and an int32/int64
        index of one rank, broadcast on the other axes: torch's gather, index_select, an
        embedding). An id outside x's axis reads nothing: NaN (floats) or 0 there."""
        x = self._check_input("gather", "x", x)
        (axis,) = normalize_axes("gather", integer("gather", "axis", axis), len(x.dim))
        return self._add_op("gather", [x, index], _attrs_of("gather", axis), name)[0]

    def scatter_add(self, src, index, axis, size, name=None) -> Tensor:
        """y (src's dims, `size` along `axis`) = 0, then src added at the element each id names
        along `axis` (index broadcast to src): the gather's gradient. Deterministic (each
        element sums its ids in order); an id outside [0, size) adds nothing."""
        src = self._check_input("scatter_add", "src", src)
        (axis,) = normalize_axes("scatter_add", integer("scatter_add", "axis", axis), len(src.dim))
        return self._add_op("scatter_add", [src, index], _attrs_of("scatter_add", axis, size), name)[0]

    def ctc_loss(self, log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                 zero_infinity=False, name=None) -> Tensor:
        """The CTC loss as torch's F.ctc_loss: log_probs [T, N, C] (log-softmax'ed), targets
        padded [N, S] or concatenated [sum of lengths], input_lengths and target_lengths [N]
        (int32/int64); reduction "none" gives [N], "sum" and "mean" [1]."""
        attrs = _attrs_of("ctc_loss", blank, reduction, zero_infinity)
        return self._add_op("ctc_loss", [log_probs, targets, input_lengths, target_lengths], attrs, name)[0]

    def ctc_loss_backward(self, log_probs, targets, input_lengths, target_lengths, grad_loss, blank=0,
                          reduction="mean", zero_infinity=False, log_alpha=None, name=None) -> Tensor:
        """d log_probs [T, N, C] of ctc_loss from grad_loss (the loss's dims), as torch gives it;
        log_alpha (ctc_loss's second output) spares the kernel its alpha pass."""
        attrs = _attrs_of("ctc_loss_backward", blank, reduction, zero_infinity)
        return self._add_op("ctc_loss_backward", [log_probs, targets, input_lengths, target_lengths, grad_loss,
                                                  log_alpha], attrs, name)[0]

    def dropout(self, x, p, seed, offset=0, return_mask=False, name=None):
        """y = x * keep / (1 - p); with return_mask=True returns (y, mask). seed and offset are
        ints or int64 graph tensors of one element (one built graph for every step)."""
        seed_t, offset_t = (v if isinstance(v, Tensor) else None for v in (seed, offset))
        attrs = _attrs_of("dropout", p, None if seed_t is not None else seed,
                          None if offset_t is not None else offset, return_mask)
        y, mask = self._add_op("dropout", [x, seed_t, offset_t], attrs, name)
        return (y, mask) if return_mask else y

    def rnn_recurrence(self, xw, h0, c0, w_hh, b_hh=None, w_hr=None, seq_lengths=None, mode="lstm",
                       reverse=False, allow_tf32: Optional[bool] = None, name=None):
        """The time steps of one recurrent layer in one direction over the input projection
        xw [T, B, G*H]: (y, h_n, c_n, h_prev, c_prev, h_raw) (ops/rnn.py says each)."""
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return self._add_op("rnn_recurrence", [xw, h0, c0, w_hh, b_hh, w_hr, seq_lengths],
                            _attrs_of("rnn_recurrence", mode, reverse, tf32), name)

    def rnn_recurrence_backward(self, xw, w_hh, b_hh, w_hr, seq_lengths, h_prev, c_prev, dy, dh_n, dc_n,
                                mode="lstm", reverse=False, allow_tf32: Optional[bool] = None, name=None):
        """(dxw, dhh, dh0, dc0, d_proj) of rnn_recurrence from the gradients of its outputs
        (dy, dh_n, dc_n; None: zero) and the states it saved (h_prev, c_prev)."""
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return self._add_op("rnn_recurrence_backward",
                            [xw, w_hh, b_hh, w_hr, seq_lengths, h_prev, c_prev, dy, dh_n, dc_n],
                            _attrs_of("rnn_recurrence_backward", mode, reverse, tf32), name)

    def rnn(self, x, h0, c0=None, weights=(), mode="lstm", num_layers=1, bidirectional=False, proj_size=0,
            dropout=0.0, dropout_seed=None, dropout_offset=0, seq_lengths=None, bias=True, batch_first=False,
            allow_tf32: Optional[bool] = None):
        """(y, h_n, c_n) of torch's nn.RNN/nn.LSTM/nn.GRU (mode "rnn_tanh", "rnn_relu", "lstm",
        "gru"): x [T, B, I] ([B, T, I] with batch_first), h0 [layers * directions, B, P], c0 the
        same with H (lstm), weights in torch's _flat_weights order, seq_lengths [B] int32/int64
        (padded layout: steps past a length keep the state and give y = 0). c_n is None but
        for lstm. rnn_network.py builds it from matmuls and rnn_recurrence nodes."""
        from .rnn_network import build_rnn
        tf32 = self.allow_tf32 if allow_tf32 is None else allow_tf32
        return build_rnn(self, x, h0, c0, weights, mode, num_layers, bidirectional, proj_size, dropout,
                         dropout_seed, dropout_offset, seq_lengths, bias, batch_first, tf32)

    def sdpa(self, q, k, v, attn_scale=None, is_inference=True, use_causal_mask=False, bias=None,
             dropout=None, seq_len_q=None, seq_len_kv=None, use_causal_mask_bottom_right=False,
             diagonal_alignment="top_left", diagonal_band_left_bound=None, diagonal_band_right_bound=None,
             paged_attention_k_table=None, paged_attention_v_table=None,
             paged_attention_max_seq_len_kv=None, sink_token=None, use_alibi_mask=False, score_max=False,
             score_sum_exp=False, block_mask=None, block_mask_size=(128, 128), name=None):
        """(o, stats) of softmax(q k^T * scale + bias, masked) v; stats None when is_inference.
        With score_max or score_sum_exp True: (o, stats, score_max, score_sum_exp), the one not
        asked for None (row max of the scores over the keys, row sum of exp(score - max);
        float32 [B, H, Sq, 1]).

        attn_scale: a number, or a one-element floating graph tensor. sink_token: float32
        [1, H, 1, 1] logits that join each row's softmax denominator (no value column).
        use_alibi_mask: scores += (j - i) * slope_h (ops/sdpa.py: alibi_slopes).
        Paged K/V: k and v are page pools [pages, Hkv, page_size, D] and the tables
        [B, 1, pages_per_sequence, 1] int32 page ids. A key whose id in the k table or the v table
        lies outside [0, pages) is masked, invisible as if past seq_len_kv (a row left with no
        key is zero): no kernel reads outside the pools, whatever the tables hold.
        Ragged (THD) q, k, v and o: see Tensor.set_ragged_offset (q, k and v carry theirs into
        the node; set o's on the returned o). block_mask: bool or int32 [B or 1, H or 1,
        ceil(Sq / bm), ceil(Skv / bn)] for block_mask_size (bm, bn): key j is visible to query i
        only where entry (b, h, i // bm, j // bn) is true; blocks it rules out are never visited."""
        dropout, random = _dropout_tensors(dropout)
        scale_t, attn_scale = (attn_scale, None) if isinstance(attn_scale, Tensor) else (None, attn_scale)
        attrs = _attrs_of("sdpa", attn_scale, is_inference, use_causal_mask, dropout,
                          use_causal_mask_bottom_right, diagonal_alignment, diagonal_band_left_bound,
                          diagonal_band_right_bound, paged_attention_max_seq_len_kv,
                          use_alibi_mask=use_alibi_mask, score_max=score_max, score_sum_exp=score_sum_exp,
                          block_mask_size=block_mask_size)
        outputs = self._add_op("sdpa", [q, k, v, bias, seq_len_q, seq_len_kv, paged_attention_k_table,
                                        paged_attention_v_table, *random, sink_token, scale_t]
                               + [_ragged_of(t) for t in (q, k, v)] + [None, block_mask], attrs, name)
        return outputs if attrs.score_max or attrs.score_sum_exp else outputs[:2]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, use_causal_mask=False,
                      bias=None, dropout=None, seq_len_q=None, seq_len_kv=None,
                      use_causal_mask_bottom_right=False, diagonal_alignment="top_left",
                      diagonal_band_left_bound=None, diagonal_band_right_bound=None,
                      use_deterministic_algorithm=False, compute_dbias=False, sink_token=None,
                      use_alibi_mask=False, block_mask=None, block_mask_size=(128, 128), name=None):
        """(dq, dk, dv) of sdpa from the forward tensors, dO and the stats, then dbias (the bias's
        shape and type) when compute_dbias and dsink (float32 [1, H, 1, 1]) when a sink_token is
        given; bitwise reproducible whatever use_deterministic_algorithm says (the fastest
        kernels here use no atomics). attn_scale, block_mask: as in sdpa."""
        dropout, random = _dropout_tensors(dropout)
        scale_t, attn_scale = (attn_scale, None) if isinstance(attn_scale, Tensor) else (None, attn_scale)
        attrs = _attrs_of("sdpa_backward", attn_scale, False, use_causal_mask, dropout,
                          use_causal_mask_bottom_right, diagonal_alignment, diagonal_band_left_bound,
                          diagonal_band_right_bound, None, use_deterministic_algorithm, compute_dbias,
                          use_alibi_mask=use_alibi_mask, block_mask_size=block_mask_size)
        grads = self._add_op("sdpa_backward", [q, k, v, o, dO, stats, bias, seq_len_q, seq_len_kv, None, None,
                                               *random, sink_token, scale_t]
                             + [_ragged_of(t) for t in (q, k, v, o, dO)] + [None] * 3 + [block_mask], attrs, name)
        return tuple(grads[:3]) + ((grads[3],) if attrs.compute_dbias else ()) + \
            ((grads[4],) if sink_token is not None else ())

    def sdpa_fp8(self, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_inference=True,
                 attn_scale=None, use_causal_mask=False, name=None):
        """(o, stats, amax_s, amax_o) of fp8 attention as the cuDNN frontend's sdpa_fp8 (ops/sdpa_fp8.py):
        fp8 q, k, v (one type), one-element float32 descales and scales; o in q's type (set_data_type
        changes it), stats None when is_inference, the amaxes float32 [1, 1, 1, 1]."""
        attrs = _attrs_of("sdpa_fp8", attn_scale, is_inference, use_causal_mask, _fp8_type_of(q))
        return tuple(self._add_op("sdpa_fp8", [q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                                               scale_o], attrs, name))

    def sdpa_fp8_backward(self, q, k, v, o, dO, stats, descale_q, descale_k, descale_v, descale_o, descale_dO,
                          descale_s, descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, attn_scale=None,
                          use_causal_mask=False, name=None):
        """(dq, dk, dv, amax_dQ, amax_dK, amax_dV, amax_dP) of sdpa_fp8 as the cuDNN frontend's
        sdpa_fp8_backward (ops/sdpa_fp8.py): dq, dk, dv in q's, k's and v's types; amax_dP is max |dS|
        (the value scale_dP scales), dS rounded to dO's type."""
        attrs = _attrs_of("sdpa_fp8_backward", attn_scale, False, use_causal_mask, _fp8_type_of(q), _fp8_type_of(dO))
        return tuple(self._add_op("sdpa_fp8_backward", [q, k, v, o, dO, stats, descale_q, descale_k, descale_v,
                                                        descale_o, descale_dO, descale_s, descale_dP, scale_s,
                                                        scale_dQ, scale_dK, scale_dV, scale_dP], attrs, name))

    # --- ops: layout ----------------------------------------------------------------------------
    def reshape(self, x, dim, name=None) -> Tensor:
        """The same elements in row-major order with new dims. A dynamic axis of the output is
        named in `dim` by the symbol of a dynamic axis of `x`, or a constant multiple of it:
        kept whole, `[batch, seq, heads, head_dim]` with `seq` the dg.dynamic of x's axis;
        merged with static axes, `[2 * seq, hidden]` of x `[2, seq, hidden]`; split back,
        `[2, seq, hidden]` of x `[2 * seq, hidden]`. The output axis is that extent at every size."""
        x = self._check_input("reshape", "x", x)
        dim, from_input = _symbolic_reshape(x, dim)
        try:
            return self._add_op("reshape", [x], _attrs_of("reshape", dim, from_input), name)[0]
        except UnsupportedError as error:
            if not x.dynamic_dim_symbols:
                raise
            raise UnsupportedError(f"{error}. A reshape of a tensor with dynamic axes names each dynamic axis of "
                                   f"its output by a constant multiple of a symbol ({_symbol_names(x)}) in dim, "
                                   f"such as k * symbol: an extent any other function of a symbol (split "
                                   f"into two axes that both vary, a product of two symbols) cannot be "
                                   f"dynamic yet") from None

    def identity(self, x, name=None) -> Tensor:
        """y = x (the cuDNN frontend's identity): a cast to x's own type; y's data type, set
        otherwise, converts it as any output's does."""
        x = self._check_input("identity", "x", x)
        return self.cast(x, data_type=x.data_type, name=name)

    def transpose(self, x, permutation, name=None) -> Tensor:
        """Permute the logical axes."""
        return self._add_op("transpose", [x], _attrs_of("transpose", permutation), name)[0]

    def slice(self, x, slices, name=None) -> Tensor:
        """Slice every axis with a Python slice or (start, stop[, step])."""
        x = self._check_input("slice", "x", x)
        return self._add_op("slice", [x], _attrs_of("slice", normalize_slices(slices, x.dim)), name)[0]

    def concatenate(self, tensors, axis, name=None) -> Tensor:
        """Join tensors along `axis`."""
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise ValidationError(f"concatenate: tensors must be a non-empty list, got {tensors!r}")
        tensors = list(tensors)
        rank = len(self._check_input("concatenate", "tensors[0]", tensors[0]).dim)
        (axis,) = normalize_axes("concatenate", integer("concatenate", "axis", axis), rank)
        try:
            return self._add_op("concatenate", tensors, _attrs_of("concatenate", axis), name)[0]
        except UnsupportedError as error:
            dynamic = [t for t in tensors if isinstance(t, Tensor) and t.dynamic_dim_symbols]
            if not dynamic:
                raise
            raise UnsupportedError(f"{error}. Joined along axis {axis}, a dynamic axis's extents add up, and an "
                                   f"extent that is a sum with a constant (S + 4) or of two symbols is no constant "
                                   f"multiple of one symbol: concatenate beside the dynamic axes, or parts of "
                                   f"one symbol along it (S + S = 2 * S), only") from None

    # --- pipeline -------------------------------------------------------------------------------
    def validate(self) -> "Graph":
        """Graph-level checks that op calls cannot make: outputs exist, no op whose results are all
        unused (a statistics output nobody reads is fine: it is simply not stored)."""
        if not self._nodes:
            raise ValidationError(f"graph {self.name!r} has no ops")
        if not self.outputs():
            raise ValidationError(f"graph {self.name!r} has no outputs: mark one with set_output(True)")
        for tensor in self.outputs():
            check_not_overlapping(tensor)
        self._validate_ragged()
        self._recheck_operand_types()
        used = {t.uid for n in self._nodes for t in n.input_tensors()}
        for node in self._nodes:
            results = node.output_tensors()
            if all(not t.is_output and t.uid not in used for t in results):
                raise ValidationError(
                    f"virtual tensor {results[0].name!r} (output of {node.op} {node.name!r}) is never "
                    f"used: mark it as an output or remove the op")
        return self

    def _recheck_operand_types(self):
        """Each op's own checks again, on its operands as they are now: set_data_type after an op
        call can give it operands the call would have refused (an int8 operand beside a float
        one; an int8 reduction past what int32 accumulates exactly)."""
        for node in self._nodes:
            try:
                node.opdef.infer(list(node.inputs), node.attrs)
            except ValidationError as error:
                raise ValidationError(f"node {node.name!r} ({node.op}), with its operands' types as set since: "
                                      f"{error}") from None

    def _validate_ragged(self):
        """A ragged tensor is an input or output that only sdpa nodes read or write, in a ragged
        slot (what else would read it densely, past its sequences), all with one seq_len tensor
        for its lengths (the one execute checks its offsets against)."""
        slotted = {(node.uid, t.uid) for node in self._nodes for t, _ in ragged_slots(node)}
        lengths = {}
        for node in self._nodes:
            for tensor, index in ragged_slots(node):
                length = slot_length(node, index)
                first = lengths.setdefault(tensor.uid, length)
                if first is not length:
                    raise ValidationError(
                        f"ragged tensor {tensor.name!r} takes its lengths from {first.name!r} and, at "
                        f"{node.op} {node.name!r}, from {length.name!r}: one ragged tensor has one seq_len tensor")
        for tensor in self._tensors.values():
            if tensor._ragged_offset is None:
                continue
            if tensor.is_virtual:
                raise ValidationError(f"ragged tensor {tensor.name!r} must be a graph input or output")
            for node in self._nodes:
                touches = any(t is tensor for t in node.input_tensors() + node.output_tensors())
                if touches and (node.uid, tensor.uid) not in slotted:
                    raise ValidationError(f"ragged tensor {tensor.name!r} is used by {node.op} {node.name!r}, "
                                          f"which reads it densely: only sdpa operands may be ragged")

    def build(self, autotune=None, workspace_limit=None, *, options=None, plan=None, sizes=None) -> "Graph":
        """Validate, fuse, pick configs and generate kernels; execute() then runs the plan.
        `options`: a BuildOptions (None: the defaults). `autotune` and `workspace_limit` are
        shorthand for the options of those names (given, they replace the options' values):
        autotune times the model's top candidates; workspace_limit bounds the bytes of optional
        scratch the chosen configs may use together (split-K and split-row partials): None
        prefers the fastest, 0 uses none (cuDNN's strategies). `plan`: the plan to build among
        plans() (BuildOptions.plan: an index k below get_execution_plan_count(), every group's
        k-th candidate or its first where it has fewer, or a tuple of one index per group). `sizes` (a graph with dynamic extents
        only): a list of dicts of symbol name -> size whose plans are built now, ahead of time,
        besides the range's min and max (serialize() then ships them). A list of
        dnngraph.heur_mode members in autotune's place is the frontend's build(heur_modes)."""
        from .build import build_plan  # the plan is the last pipeline stage

        if isinstance(autotune, (list, tuple)):  # the frontend's build(heur_modes): every mode ranks alike
            frontend.heur_modes("build", autotune)
            autotune = None
        options = _build_options(options, autotune, workspace_limit, plan)
        self.validate()
        if plan is not None:
            self._check_plan_index(options)
        if sizes is not None and (not self.is_dynamic or not isinstance(sizes, (list, tuple))):
            raise ValidationError(f"build of graph {self.name!r}: sizes (a list of dicts of symbol name -> size) "
                                  f"are for a graph with dynamic extents, got {sizes!r}")
        if self.is_dynamic:  # one plan per size seen, each built from the graph at that size
            from .build import build_dynamic_plan

            self._plan = build_dynamic_plan(self, options, sizes=sizes or ())
            self._pass_by_value = tuple(t for t in self.inputs() if t.is_pass_by_value)
            return self
        # a build works on a snapshot of the graph: a failed one leaves the tensors as they were
        self._plan = build_plan(self, options)
        self._pass_by_value = tuple(t for t in self.inputs() if t.is_pass_by_value)
        return self

    # --- the cuDNN frontend's build steps: build() split in its order, each repeatable ----------
    def build_operation_graph(self) -> "Graph":
        """The frontend's first build step: the graph-level checks (validate())."""
        return self.validate()

    def create_execution_plans(self, heur_modes=None) -> "Graph":
        """The frontend's second step: rank each kernel group's candidates (plans()). Every
        heur_mode ranks them by the backends' cost models; the modes are checked, not told apart."""
        frontend.heur_modes("create_execution_plans", heur_modes)
        self._ranked = self.plans()
        return self

    def check_support(self) -> "Graph":
        """The frontend's third step: the UnsupportedError a build would raise. A kernel group no
        backend ranks is refused at once; a backend refuses the rest only as it lowers, so the
        graph's plan is built here (build_plans keeps it) and a refusal raised as build() would."""
        ranked = self._ranked if self._ranked is not None else self.plans()
        for group in ranked:
            if not group.candidates:
                raise UnsupportedError(f"graph {self.name!r}: no backend runs the {group.kind} group of "
                                       f"{', '.join(group.ops)}")
        self._ranked = ranked
        if self._plan is None:
            self.build()
        return self

    def build_plans(self, policy=frontend.build_plan_policy.HEURISTICS_CHOICE) -> "Graph":
        """The frontend's last step: compile. HEURISTICS_CHOICE builds the graph's plan (execute()),
        unless check_support or build() has; ALL also builds every plan index for
        execute_plan_at_index."""
        policy = frontend.plan_policy("build_plans", policy)
        if self._plan is None:
            self.build()
        if policy is frontend.build_plan_policy.ALL:
            for index in range(self.get_execution_plan_count()):
                self.build_plan_at_index(index)
        return self

    def get_engine_count(self) -> int:
        """The frontend's engine count: the plans plans() offers (get_execution_plan_count())."""
        return self.get_execution_plan_count()

    def get_plan_name_at_index(self, index: int) -> str:
        """A name for plan `index`: each kernel group's backend and config, '; ' between groups."""
        count = self.get_execution_plan_count()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValidationError(f"graph {self.name!r}: plan index {index!r} asked, the graph has {count} plans")
        return "; ".join(_candidate_name(group, group.candidates[index if index < len(group.candidates) else 0])
                         for group in self.plans())

    def _restore_strides(self):
        """Undo the view strides a partition lent virtual tensors (explain and to_dot of an
        unbuilt graph, a failed build)."""
        for tensor in self._tensors.values():
            tensor.restore_strides()

    # --- plan choice (the cuDNN frontend's execution plan list) --------------------------------
    def plans(self, options=None) -> list:
        """The ranked candidates of each kernel group a build under `options` (None: the
        defaults) would make, as build.GroupPlans (kind, ops, candidates: backend, config, model
        seconds; config None is the backend's own choice), best first. Plan k of the graph is
        every group's candidate k, or its first where it has fewer (build(plan=k)); a tuple
        of one index per group picks each (build(plan=(i, j, ...)))."""
        from .build import plan_choices

        self.validate()
        try:
            return plan_choices(self, _build_options(options))
        finally:
            self._restore_strides()

    def get_execution_plan_count(self, options=None) -> int:
        """How many plans plans() offers: the most candidates any kernel group has."""
        return max(len(group.candidates) for group in self.plans(options))

    def build_plan_at_index(self, index: int, options=None) -> "Graph":
        """Build plan `index` (see plans()) and keep it for execute_plan_at_index; the graph's
        own plan (execute()) is left as it is."""
        from .build import build_dynamic_plan, build_plan

        chosen = _build_options(options, plan=index)
        self.validate()
        self._check_plan_index(chosen)
        self._plans_at[index] = build_dynamic_plan(self, chosen) if self.is_dynamic else build_plan(self, chosen)
        return self

    def get_workspace_size(self, device=None) -> int:
        """Bytes of workspace execute(bindings, workspace) needs on `device` (default: the one the
        plan was built for), the frontend's name for plan.workspace_size()."""
        if self._plan is None:
            raise ExecutionError(f"graph {self.name!r} is not built (or changed since): call build()")
        return self._plan.workspace_size(device)

    def get_workspace_size_plan_at_index(self, index: int, device=None) -> int:
        """Bytes of workspace execute_plan_at_index(bindings, index, workspace) needs; 0 for a plan
        build_plan_at_index has not built, as the frontend answers."""
        try:
            plan = self._plans_at.get(index)
        except TypeError:  # an unhashable index names no plan built
            plan = None
        return 0 if plan is None else plan.workspace_size(device)

    def _check_plan_index(self, options) -> None:
        """ValidationError for a plan index (an int) past the last plan plans() offers, as the
        frontend's build_plan_at_index refuses it. BuildOptions.plan handed on by as_function
        and dg.jit to forward and backward graphs alike is not checked: there a group with
        fewer candidates takes its first."""
        if isinstance(options.plan, int):
            count = self.get_execution_plan_count(options)
            if options.plan >= count:
                raise ValidationError(f"graph {self.name!r}: plan {options.plan} asked, the graph has {count} plans "
                                      f"(get_execution_plan_count(); plans() lists them)")

    def execute_plan_at_index(self, bindings: dict, index: int, workspace=None) -> None:
        """execute() with the plan build_plan_at_index(index) built. The frontend's positional
        order, (bindings, workspace, index), is taken too: a workspace tensor where the index
        goes and an int after it."""
        if isinstance(index, torch.Tensor) and isinstance(workspace, int) and not isinstance(workspace, bool):
            index, workspace = workspace, index
        try:
            plan = self._plans_at.get(index)
        except TypeError:  # an unhashable index (a list) names no plan built
            plan = None
        if plan is None:
            raise ExecutionError(f"graph {self.name!r}: plan {index!r} is not built (or the graph changed since): "
                                 f"call build_plan_at_index({index!r})")
        plan.execute(bindings, workspace)

    def serialize(self) -> bytes:
        """The built plan as bytes (the cuDNN frontend's name): Graph.deserialize(blob) runs it in
        another process without lowering or compiling (shipping.py says what a blob holds). A
        graph with dynamic extents ships every plan it holds, one per size (build(sizes=...)
        makes the ones a server needs ahead of time)."""
        from .shipping import serialize_dynamic, serialize_plan

        if self._plan is None:
            raise ExecutionError(f"graph {self.name!r} is not built (or changed since): call build() before serialize()")
        if self.is_dynamic:
            return serialize_dynamic(self, self._plan)
        return serialize_plan(self._plan)

    @classmethod
    def deserialize(cls, blob: bytes, rebuild: bool = False) -> "Graph":
        """A built graph from a blob of serialize(), nothing lowered or compiled. A blob of
        another dnngraph or Triton, or for another target than this machine's (another GPU
        model), raises SerializationError; with `rebuild` the graph is built afresh instead. A
        graph with dynamic extents runs the sizes the blob holds as loaded, and builds any other
        size of its range on first use, as a built dynamic graph does."""
        from .shipping import deserialize_plan

        return deserialize_plan(blob, cls, rebuild=boolean("Graph.deserialize", "rebuild", rebuild))

    def execute(self, bindings: dict, workspace=None) -> None:
        """Run the built plan; bindings map Tensors or names to torch tensors, outputs in place.
        `workspace`: a uint8 tensor of at least plan.workspace_size() bytes on the tensors' device
        for the values between kernels; without it each (device, stream) uses one of its own."""
        if self._plan is None:
            raise ExecutionError(f"graph {self.name!r} is not built (or changed since): call build()")
        if self._pass_by_value:  # found by build(): an execute without them pays nothing
            bindings = self._staged(bindings)
        self._plan.execute(bindings, workspace)

    def _staged(self, bindings) -> dict:
        """`bindings` with each pass-by-value input's host value (a Python number, a one-element
        tensor) as a fresh tensor of its dims, strides and type on the other bindings' device:
        one per execute, so that concurrent executes never share it (the kernels read it as
        any one-element input)."""
        if not isinstance(bindings, dict):
            return bindings  # the plan says what is wrong
        staged = dict(bindings)
        by_value = self._pass_by_value
        device = next((v.device for k, v in bindings.items() if isinstance(v, torch.Tensor)
                       and not any(k is t or k == t.name for t in by_value)), torch.device("cpu"))
        for tensor in by_value:
            key = tensor if tensor in bindings else tensor.name
            if key in bindings:
                staged[key] = _host_scalar(tensor, bindings[key], device, ExecutionError)
        return staged

    def as_function(self, inputs=None, outputs=None, options=None):
        """The graph as a callable on torch tensors: it takes `inputs` (Tensors or names; default
        the graph inputs in declaration order) positionally, allocates and returns `outputs`
        (default the graph outputs; one tensor or a tuple), and is differentiable through
        torch.autograd (the backward graph derives from the ops' backward rules). Every graph it
        builds (forward, backward) is built with `options` (a BuildOptions; None: the defaults)."""
        from .function import DynamicFunction, GraphFunction

        if self.is_dynamic:
            return DynamicFunction(self, inputs, outputs, _build_options(options))
        return GraphFunction(self, inputs, outputs, _build_options(options))

    def to_dot(self) -> str:
        """Graphviz text of the graph, each kernel's ops in a cluster (the built plan's groups,
        else the fusion groups a build would make)."""
        from .dot import render_dot
        from .fusion import partition
        from .backends import registry

        if self._plan is not None and not self.is_dynamic:  # a dynamic graph's plans are other graphs'
            return render_dot(self, self._plan.groups)
        self.validate()
        try:
            return render_dot(self, partition(self, registry.families()))
        finally:
            self._restore_strides()

    def explain(self) -> str:
        """Groups, kernels, configs with their reasons, and generated source paths."""
        if self._plan is None:
            from .fusion import partition
            from .backends import registry

            self.validate()
            try:
                groups = partition(self, registry.families())
                return "not built; fusion groups:\n" + "\n".join(g.describe() for g in groups)
            finally:
                self._restore_strides()
        return self._plan.explain()

    def reference(self, bindings: dict, dtype=torch.float64, all_tensors: bool = False) -> dict:
        """Outputs computed op by op in torch: dict name -> tensor. Floating tensors are computed
        and returned in `dtype`; integer and bool tensors hold their own data type (a float
        result stored as an integer is truncated toward zero, as the kernels store it). A graph
        output of a float type narrower than the compute type (fp16, bf16, fp8) is held as
        stored, rounded to that type (then widened to `dtype`), and its consumers read that
        value; float32 outputs and virtual intermediates stay in `dtype`, which stands for the
        compute type (DESIGN.md, "Data types"). A ragged input is read through its offsets (its
        offsets checked as execute checks them), and a ragged output comes back as its logical
        [B, H, S_max, D] values, rows past each sequence's length 0 (compare with ragged.unpack
        of what execute wrote)."""
        if not isinstance(bindings, dict):
            raise ExecutionError(f"reference: bindings must be a dict, got {type(bindings).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ExecutionError(f"reference: dtype must be a floating torch dtype, got {dtype!r}")
        if self.is_dynamic:  # the graph at the sizes the bindings have
            from .runtime.dynamic_plan import DynamicExtents

            extents = DynamicExtents(self)
            sized = self.specialised(extents.sizes(bindings, "reference"))
            return sized.reference(extents.by_name(bindings), dtype, all_tensors)
        values = {}
        for tensor in self.inputs():
            if any(tensor in n.inputs for n in self._nodes):
                value = self._reference_input(bindings, tensor)
                if tensor.ragged_offset is not None:  # the packed rows, read through the offsets
                    value = self._ragged_reference(bindings, tensor, value)
                values[tensor.uid] = value.to(dtype) if value.is_floating_point() else value
        for node in self._nodes:
            floating = node.opdef.family in FLOATING_FAMILIES
            inputs = [None if t is None else _widened(values[t.uid], floating, dtype) for t in node.inputs]
            typed = ([None if t is None else t.data_type for t in node.outputs],) if node.opdef.typed_reference else ()
            results = node.opdef.reference(inputs, node.attrs, *typed)
            for tensor, result in zip(node.outputs, results):
                if tensor is not None:
                    values[tensor.uid] = _as_stored(result, tensor, dtype)
        chosen = self._tensors.values() if all_tensors else self.outputs()
        return {t.name: values[t.uid] for t in chosen if t.uid in values}

    def _ragged_reference(self, bindings: dict, tensor: Tensor, value: torch.Tensor) -> torch.Tensor:
        """Ragged input `tensor` bound as `value`: its [B, H, S_max, D] values unpacked through its
        offsets (rows past a sequence's length 0), the offsets checked as execute checks them."""
        from . import ragged

        offsets = self._reference_input(bindings, tensor.ragged_offset)
        lengths = self._reference_input(bindings, ragged_length(self, tensor))
        ragged.check_offsets(tensor.name, offsets, lengths, tensor.dim, tuple(value.stride()),
                             span(value.shape, value.stride()))
        return ragged.unpack(value, offsets, lengths)

    def _reference_input(self, bindings: dict, tensor: Tensor) -> torch.Tensor:
        """The bound value of input `tensor`: a torch tensor of its dims and data type."""
        value = self._lookup_binding(bindings, tensor)
        if value is None:
            raise ExecutionError(f"reference: no binding for input {tensor.name!r}")
        if tensor.is_pass_by_value:
            value = _host_scalar(tensor, value, torch.device("cpu"), ExecutionError)
        if not isinstance(value, torch.Tensor):
            raise ExecutionError(f"reference: input {tensor.name!r} must be a torch.Tensor, "
                                 f"got {type(value).__name__}")
        if tensor.data_type.is_bit_packed:
            value = _unpacked_bits(tensor, value)
        elif tensor.data_type.elements_per_item > 1 and value.dtype == tensor.data_type.torch_dtype:
            from .ops.block_scale import unpack_storage  # packed fp4: its values, logical dims
            value = unpack_storage(value, tensor.dim, tensor.stride)
        if tuple(value.shape) != tuple(tensor.dim):
            raise ExecutionError(f"reference: input {tensor.name!r} has dims {list(tensor.dim)}, "
                                 f"got a tensor of shape {list(value.shape)}")
        # a floating input may come in any floating dtype (float64 values give an exact reference
        # of the math); integer and bool inputs must have their own type
        matches = value.is_floating_point() if tensor.data_type.is_floating \
            else value.dtype == (torch.bool if tensor.data_type.is_boolean else tensor.data_type.torch_dtype)
        if not matches:
            raise ExecutionError(f"reference: input {tensor.name!r} is {tensor.data_type.name}, "
                                 f"got a tensor of {value.dtype}")
        return value

    def _lookup_binding(self, bindings: dict, tensor: Tensor):
        value = bindings.get(tensor)
        return bindings.get(tensor.name) if value is None else value

    # --- serialization --------------------------------------------------------------------------
    def to_json(self) -> str:
        """The graph as a JSON document (schema-versioned)."""
        from .serialization import graph_to_json

        return graph_to_json(self)

    def blank(self, name: str) -> "Graph":
        """An empty plain Graph named `name` with this graph's data types and tf32 setting (the
        graphs autodiff derives are made through it: it sits below this module)."""
        return Graph(name=name, io_data_type=self.io_data_type, intermediate_data_type=self.intermediate_data_type,
                     compute_data_type=self.compute_data_type, allow_tf32=self.allow_tf32)

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        """Rebuild a graph from to_json's document; raises SerializationError when malformed."""
        from .serialization import graph_from_json

        return graph_from_json(text, Graph)  # a plain Graph, whatever class it is called on

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self._nodes)} ops, {len(self._tensors)} tensors)"


def _host_scalar(tensor: Tensor, value, device, error) -> torch.Tensor:
    """A pass-by-value input's value (a Python number or a one-element tensor) as a tensor of its
    dims, strides and data type on `device`; `error` (an error class) for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise error(f"{tensor.name!r} is passed by value: it takes one element, got a tensor of shape "
                        f"{list(value.shape)}")
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{tensor.name!r} is passed by value: it takes a number or a one-element tensor, got "
                    f"{type(value).__name__}")
    if not tensor.data_type.is_floating and value != int(value):
        raise error(f"{tensor.name!r} is passed by value as {tensor.data_type.name}: {value!r} is no integer")
    if tensor.data_type.is_bit_packed:  # its one element is bit 0 of its byte: true for any nonzero number
        value = int(value != 0)
    if not tensor.data_type.is_floating and tensor.data_type is not dtypes.bool_:
        limits = torch.iinfo(tensor.data_type.torch_dtype)  # filling the staging tensor would raise
        if not limits.min <= value <= limits.max:
            raise error(f"{tensor.name!r} is passed by value as {tensor.data_type.name}: {value!r} is past its "
                        f"range [{limits.min}, {limits.max}]")
    staged = torch.empty_strided(tensor.dim, tensor.stride, dtype=tensor.data_type.torch_dtype, device=device)
    return staged.fill_(value)


# families whose kernels compute on 8-bit integer inputs as floats (lower/rows.py
# require_floating_inputs: norms, softmax, pooling; the windowed norms refuse integers at the op)
FLOATING_FAMILIES = frozenset({"norm", "softmax", "pooling"})


def _widened(value: torch.Tensor, floating: bool, float_dtype) -> torch.Tensor:
    """An op's reference input: int8 and uint8 values as int32, as kernels hold them (codegen
    kind_of), so integer math on them is exact instead of wrapping in 8 bits; as `float_dtype`
    for an op that computes in floating point (`floating`), exact either way."""
    if value.dtype not in (torch.int8, torch.uint8):
        return value
    return value.to(float_dtype if floating else torch.int32)


def _unpacked_bits(tensor: Tensor, value: torch.Tensor) -> torch.Tensor:
    """A bit-packed input's booleans: its bound uint8 storage (as execute binds it) unpacked, or
    a bool tensor of its logical dims as it is."""
    from .bitpack import unpack_bits

    if value.dtype != torch.uint8:
        return value  # checked below as any bool input: its dims, the bool dtype
    shape, strides = dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)
    if tuple(value.shape) != shape or any(value.stride(a) != strides[a] for a in range(len(shape)) if shape[a] > 1):
        raise ExecutionError(f"reference: bit-packed input {tensor.name!r} of dims {list(tensor.dim)} binds uint8 "
                             f"storage of shape {list(shape)} and strides {list(strides)}, got shape "
                             f"{list(value.shape)} and strides {list(value.stride())}")
    return unpack_bits(value, tensor.dim, tensor.stride)


def _as_stored(result: torch.Tensor, tensor: Tensor, float_dtype) -> torch.Tensor:
    """A reference result as `tensor` holds it for its consumers: an integer or bool tensor in
    its own type, a graph output of floats rounded to its type, a virtual one as computed; floats
    are held in `float_dtype`."""
    data_type = tensor.data_type
    if data_type.is_block_scale_storage:  # the block-scale ops' references give values these hold
        return result.to(float_dtype)
    if data_type.is_boolean:  # bit-packed ones too: the reference holds booleans unpacked
        return result if result.dtype == torch.bool else result != 0
    if dtypes.is_saturating(data_type):
        return dtypes.to_saturated(result, data_type)
    if not data_type.is_floating:
        if result.is_floating_point():
            result = torch.trunc(result)
        return result.to(data_type.torch_dtype)
    if tensor.is_output and dtypes.narrower_than_compute(data_type):
        # narrower than the compute type (float64 stands for it here): torch's rounding, as the
        # kernel stores it and its consumers read it
        result = result.to(data_type.torch_dtype)
    return result.to(float_dtype)


# --- pointwise methods, one per catalog entry ----------------------------------------------------
_PARAM_DEFAULTS = {"negative_slope": 0.01, "alpha": 1.0, "beta": 1.0, "threshold": 20.0, "min_val": -1.0,
                   "max_val": 1.0, "relu_lower_clip": 0.0, "relu_upper_clip": math.inf,
                   "relu_lower_clip_slope": 0.0, "swish_beta": 1.0}
# parameters the cuDNN frontend declares Optional: None stands for the default
_NONE_IS_DEFAULT = frozenset({"swish_beta", "relu_lower_clip", "relu_upper_clip", "relu_lower_clip_slope"})


def _block_axis_innermost(x, axis) -> tuple:
    """block_scale_quantize(transpose=True)'s axis order, outermost first: x's, rotated (as the
    frontend rotates it) until the block axis is the innermost."""
    inner_first = list(reversed(stride_order(x.dim, x.stride)))
    at = inner_first.index(axis)
    return tuple(reversed(inner_first[at:] + inner_first[:at]))


def _ragged_of(value):
    return value.ragged_offset if isinstance(value, Tensor) else None


def _pointwise_method(op_name: str):
    entry = POINTWISE_OPS[op_name]
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in entry.operand_names]
    for param in entry.params:
        default = _PARAM_DEFAULTS.get(param, inspect.Parameter.empty)
        parameters.append(inspect.Parameter(param, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    parameters.append(inspect.Parameter("name", inspect.Parameter.KEYWORD_ONLY, default=None))
    signature = inspect.Signature(parameters)

    def method(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise ValidationError(f"{op_name}: {error}") from None
        bound.apply_defaults()
        graph, arguments = bound.arguments["self"], bound.arguments
        operands, constants = [], []
        for position, operand_name in enumerate(entry.operand_names):
            value = arguments[operand_name]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                real(op_name, operand_name, value, finite=False)  # a float, not an overflow
                constants.append((position, value if isinstance(value, int) else float(value)))  # ints stay exact
                value = None
            elif value is None:
                raise ValidationError(f"{op_name}: operand {operand_name} is required")
            operands.append(value)
        params = {p: _PARAM_DEFAULTS[p] if arguments[p] is None and p in _NONE_IS_DEFAULT else arguments[p]
                  for p in entry.params}
        if "data_type" in params:
            params["data_type"] = dtypes.resolve(params["data_type"]).name
        attrs = _attrs_of(op_name, constants=tuple(constants), **params)
        return graph._add_op(op_name, operands, attrs, arguments["name"])[0]

    method.__name__ = op_name
    method.__signature__ = signature
    method.__doc__ = f"Pointwise {op_name} of {', '.join(entry.operand_names)} (numpy broadcasting)."
    return method


for _op_name in POINTWISE_OPS:
    setattr(Graph, _op_name, _pointwise_method(_op_name))


_RELU_DOC = ("y = upper_clip at and above it, x between the clips, lower_clip + negative_slope * (x - lower_clip) "
             "at and below lower_clip; NaN stays NaN. The keywords are the cuDNN frontend's, None for torch's relu "
             "(lower clip 0, slope 0, no upper clip).")
_generated_relu, _generated_relu_backward = Graph.relu, Graph.relu_backward


def _relu(self, x, negative_slope=None, lower_clip=None, upper_clip=None, name=None):
    return _generated_relu(self, x, relu_lower_clip=lower_clip, relu_upper_clip=upper_clip,
                           relu_lower_clip_slope=negative_slope, name=name)


def _relu_backward(self, dy, x, negative_slope=None, lower_clip=None, upper_clip=None, name=None):
    return _generated_relu_backward(self, dy, x, relu_lower_clip=lower_clip, relu_upper_clip=upper_clip,
                                    relu_lower_clip_slope=negative_slope, name=name)


_relu.__name__, _relu.__doc__ = "relu", "Pointwise relu of x: " + _RELU_DOC
_relu_backward.__name__, _relu_backward.__doc__ = "relu_backward", "dy * relu'(x), relu as in relu(): " + _RELU_DOC
Graph.relu, Graph.relu_backward = _relu, _relu_backward


def _candidate_name(group, candidate) -> str:
    """One kernel group's part of a plan name: its kind, backend and config."""
    config = getattr(candidate.config, "text", None) or ("default" if candidate.config is None
                                                         else repr(candidate.config))
    return f"{group.kind}:{candidate.backend}:{config}"


# the cuDNN frontend's spellings (frontend.py): its keyword names on the op methods, its method names
for _op_name, _aliases in frontend.FRONTEND_KEYWORDS.items():
    setattr(Graph, _op_name, frontend.frontend_keywords(getattr(Graph, _op_name), _op_name, _aliases))
for _name, (_target, _theirs, _ours) in frontend.FRONTEND_METHODS.items():
    setattr(Graph, _name, frontend.frontend_method(_name, _target, _theirs, _ours))


def _build_options(options, autotune=None, workspace_limit=None, plan=None) -> BuildOptions:
    """`options` (None: the defaults) with build()'s shorthand arguments applied, validated."""
    if options is None:
        options = BuildOptions()
    elif not isinstance(options, BuildOptions):
        raise ValidationError(f"build: options must be a dnngraph.BuildOptions, got {type(options).__name__}")
    options = options.with_arguments(autotune, workspace_limit)
    return options if plan is None else replace(options, plan=plan)
