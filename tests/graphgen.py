"""Random valid dnngraph graphs across every family with kernels, and their verdicts.

`generate(seed)` draws one graph (with its input data) from a seed alone, so a seed reproduces
its case. Every op added is evaluated at once in float64 (the op's own reference), and the
drawn values steer later choices: comparisons, floors and integer casts see no near-ties,
logs and reciprocals see positive values, exps see no overflow. `run_case` builds and executes
the graph with poisoned outputs and compares each output with `Graph.reference`. Some families
also shape the bindings themselves: a lazily negated input, outputs interleaved in one buffer
(`SharedBuffer`), and bindings execute must refuse without writing anything (`Refusal`).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

import dnngraph as dg
from dnngraph.errors import ExecutionError, GraphError, UnsupportedError
from dnngraph.backends.triton.heuristics.matmul import choose_dot
from dnngraph.ops.pointwise import DIFFERENTIABLE, FORWARD_UNARY
from dnngraph.ops.pooling import PoolingAttrs, output_spatial
from dnngraph.tensor import dense_strides

# Identifiers the codegen renderers write (collected from their generated sources), and names
# that break quoting, comments or source lines.
KERNEL_NAMES = (
    "acc", "pid", "pid_m", "pid_n", "mask", "row_mask", "col_mask", "tile_mask", "x_ptr", "y_ptr",
    "tl", "triton", "tm", "tr", "BLOCK_K", "BLOCK_R", "BLOCK_C", "BLOCK_M", "BLOCK_N", "SPLITS",
    "rows", "cols", "k_idx", "r_idx", "counter", "row_max", "row_sum", "mean", "inv", "var",
    "inv_variance", "x", "y", "dy", "dx", "scale", "bias", "tile", "tile_a", "tile_b", "offs_m",
    "offs_n", "k_mask", "r_mask", "seed_0", "seed_1", "stats_mean", "stats_m2", "stats_count",
    "sq_sum", "g_sum", "g_xhat", "dscale_sum", "dbias_sum", "partial_ptr", "n_reduced", "K", "M",
    "N", "T", "a", "b", "c", "p", "q", "r", "e0", "e1", "idx_0", "offset_0", "size_1", "float",
    "range", "max", "sum", "exp", "where", "other", "rest", "start", "zeros", "full", "load",
    "store", "program_id", "dot", "inf", "stash_mean_ptr", "part_idx", "trip_weight",
)
ODD_NAMES = (
    'x"""', "x'''", "a\nb", "name with spaces", "tab\there", "back\\slash", "#comment",
    "'); import os; ('", "{braces}", "ünïcødé", "名前", "Ω", "emoji😀", "0starts_with_digit",
    "a.b", "-", "\"", "'", "__init__", "None", "True", "lambda", "class",
)

ROW_MODES = (None, "one_pass", "looped", "split")
SIZES = (1, 1, 2, 3, 4, 5, 7, 8, 13, 16)
FLOAT_IO = {"float32": dg.float32, "float16": dg.float16, "bfloat16": dg.bfloat16}
UNARY_OPS = tuple(FORWARD_UNARY)
POSITIVE_DOMAIN = ("log", "sqrt", "rsqrt", "reciprocal")
DISCONTINUOUS = ("floor", "ceil")
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "scale", "mod", "add_square")
COMPARE_OPS = ("cmp_eq", "cmp_ne", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge")
REDUCTION_MODES = ("sum", "mean", "max", "min", "amax", "prod", "norm1", "norm2")
EXIT_MODES = ("sum", "mean", "max", "min", "amax", "norm1", "norm2")
MAGNITUDE_LIMIT = 1e3  # values stay well inside fp16 range, so conditioning stays sane


@dataclass
class Value:
    """A tensor of the graph with its float64 (or exact integer/bool) value."""

    tensor: object
    data: torch.Tensor
    depth: int  # ops between the graph inputs and this value

    @property
    def kind(self) -> str:
        """bool, int or float: the tensor's data type (a cast's reference may hold floats)."""
        data_type = self.tensor.data_type
        if data_type.name == "bool":
            return "bool"
        return "float" if data_type.is_floating else "int"


@dataclass
class Case:
    """One generated graph, its input data and a readable description."""

    seed: int
    graph: object
    inputs: dict  # tensor name -> torch tensor
    io: str
    row_mode: object
    steps: list = field(default_factory=list)
    generation_error: str = ""  # an op call or reference that failed on a valid graph
    exact: list = field(default_factory=list)  # output Tensors that must equal torch's .to bit for bit
    shared: list = field(default_factory=list)  # SharedBuffers: bindings that are views of one buffer
    refusals: list = field(default_factory=list)  # Refusals: bindings execute must refuse

    def describe(self) -> str:
        head = f"seed {self.seed}: io {self.io}, row mode {self.row_mode}"
        return "\n".join([head] + [f"  {s}" for s in self.steps])


@dataclass
class SharedBuffer:
    """Bindings that are views of one flat buffer, interleaved without an element in common.
    `memory` (on the CPU) holds poison and the values of the inputs among the views; `views`
    holds per binding (Tensor, storage offset, sizes, strides), in elements."""

    memory: torch.Tensor
    views: list

    def bind(self, device, moved=None, delta=0) -> tuple:
        """(a fresh copy of the memory on `device`, name -> view into it). With `moved`, the view
        of that index starts `delta` elements later, in a copy padded by its own size each side."""
        margin = 0 if moved is None else self.memory.numel()
        memory = torch.full((self.memory.numel() + 2 * margin,), math.nan, dtype=self.memory.dtype)
        memory[margin:margin + self.memory.numel()] = self.memory
        memory = memory.to(device)
        views = {}
        for index, (tensor, offset, sizes, strides) in enumerate(self.views):
            start = margin + offset + (delta if index == moved else 0)
            views[tensor.name] = memory.as_strided(sizes, strides, start)
        return memory, views

    def claimed(self, outputs_only: bool = False) -> torch.Tensor:
        """Per element of the memory, whether a view (an output's, with `outputs_only`) holds it."""
        claimed = torch.zeros(self.memory.numel(), dtype=torch.bool)
        for tensor, offset, sizes, strides in self.views:
            if tensor.is_output or not outputs_only:
                claimed.as_strided(sizes, strides, offset).fill_(True)
        return claimed

    def stray_writes(self, memory: torch.Tensor, pristine: torch.Tensor) -> str:
        """'' when no element of `memory` (as bound) changed but the outputs' (the gaps between
        the views and the inputs' elements keep their values, bit for bit), else what changed."""
        stray = (_bits(memory.cpu()) != _bits(pristine)) & ~self.claimed(outputs_only=True)
        if stray.any():
            return (f"shared buffer: {stray.sum().item()} elements outside the outputs' views written, "
                    f"the first at {stray.nonzero()[0].item()}")
        return ""


@dataclass
class Refusal:
    """Bindings execute must refuse with an ExecutionError, writing nothing: `kind` is 'negated
    output' (torch's negative bit on an output), 'conjugate input' or 'conjugate output' (a
    complex conjugate view in place of `tensor`), or 'overlap' (the views of `shared` with view
    `moved` shifted by `delta` elements onto another view's element). Tried before the good
    execute or after it (`before`): a refused set must not be remembered as checked."""

    kind: str
    before: bool
    tensor: object = None
    shared: SharedBuffer = None
    moved: int = 0
    delta: int = 0

    def describe(self) -> str:
        what = self.tensor.name if self.tensor is not None else self.shared.views[self.moved][0].name
        return f"{self.kind} {what!r}"

    def bindings(self, device) -> dict:
        """name -> the tensor to bind in place of the good one."""
        if self.kind == "overlap":
            return self.shared.bind(device, self.moved, self.delta)[1]
        tensor = self.tensor
        if self.kind == "negated output":
            return {tensor.name: torch._neg_view(poisoned(tensor, device))}
        value = torch.empty_strided(tensor.dim, tensor.stride, dtype=torch.complex64, device=device)
        return {tensor.name: value.fill_(complex(math.nan, math.nan)).conj()}


@dataclass
class Verdict:
    """The outcome of one case: passed, mismatch, binding (a refusal that ran or wrote, a write
    outside an output's view), unsupported or error:<type>."""

    status: str
    detail: str = ""


class _Skip(Exception):
    """A family could not add an op to this graph (no fitting operand): draw another."""


class GraphBuilder:
    """Grows one random graph; one method per op family."""

    def __init__(self, seed: int, device: str = "cpu", io: str | None = None, nan_inputs=None,
                 plain_names: bool = False):
        self.rng = random.Random(seed)
        self.plain_names = plain_names  # same draws, but names no kernel could confuse (triage)
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.io = io or self.rng.choice(["float32", "float16"] + (["bfloat16"] if device != "cpu" else []))
        graph_name = self.rng.choice(("fuzz",) + KERNEL_NAMES + ODD_NAMES)
        self.graph = dg.Graph(name="fuzz" if plain_names else graph_name,
                              io_data_type=FLOAT_IO[self.io])
        self.nan_inputs = self.rng.random() < 0.2 if nan_inputs is None else nan_inputs
        self.rank = self.rng.choice((1, 2, 2, 3, 3, 4))
        self.world = self._draw_world()
        self.values: list[Value] = []
        self.exact: list = []  # conversions' outputs: bit-exact, kept out of the operand pool
        self.shared: list[SharedBuffer] = []
        self.refusals: list[Refusal] = []
        self.pinned: set = set()  # ids of outputs whose data type and strides a binding fixed
        self.inputs: dict = {}
        self.steps: list[str] = []
        self.used_names: set = set()

    # --- names, shapes, inputs ---------------------------------------------------------------
    def name(self):
        """A fresh name: often one a kernel uses, sometimes one that breaks source text."""
        roll = self.rng.random()
        base = self.rng.choice(KERNEL_NAMES) if roll < 0.5 else \
            self.rng.choice(ODD_NAMES) if roll < 0.7 else None
        if base is None:
            return None
        candidate, count = base, 0
        taken = self.graph._names.keys() | self.graph._node_names  # names the graph made itself too
        while candidate in self.used_names or candidate in taken:
            count += 1
            candidate = f"{base}_{count}" if self.rng.random() < 0.5 else f"{base}{'_' * count}"
        self.used_names.add(candidate)
        return f"plain{len(self.used_names)}" if self.plain_names else candidate

    def _draw_world(self):
        budget = 320 if self.device == "cpu" else 4096
        while True:
            dims = [self.rng.choice(SIZES) for _ in range(self.rank)]
            if math.prod(dims) <= budget:
                return dims

    def broadcast_dims(self, dims=None):
        """`dims` (default the world) with some axes set to 1."""
        dims = list(self.world if dims is None else dims)
        return [1 if self.rng.random() < 0.3 else d for d in dims]

    def _layout(self, data: torch.Tensor, allow_broadcast=True) -> tuple[torch.Tensor, str]:
        """The same values in a random layout: contiguous, permuted, sliced, padded, expanded."""
        choice = self.rng.choice(("contiguous", "contiguous", "permuted", "sliced", "padded",
                                  "expanded" if allow_broadcast else "contiguous"))
        shape = list(data.shape)
        if choice == "permuted" and data.dim() > 1:
            order = list(range(data.dim()))
            self.rng.shuffle(order)
            storage = data.permute(order).contiguous()
            inverse = [order.index(a) for a in range(data.dim())]
            return storage.permute(inverse), f"permuted{order}"
        if choice == "sliced":
            axis = self.rng.randrange(data.dim())
            big = shape.copy()
            big[axis] = 2 * shape[axis] + 1
            storage = torch.zeros(big, dtype=data.dtype)
            index = [slice(None)] * data.dim()
            index[axis] = slice(1, None, 2)
            view = storage[tuple(index)]
            view.copy_(data)
            return view, f"sliced(axis {axis}, step 2)"
        if choice == "padded":
            storage = torch.zeros(shape[:-1] + [shape[-1] + 3], dtype=data.dtype)
            view = storage[..., :shape[-1]]
            view.copy_(data)
            return view, "padded(+3 last)"
        if choice == "expanded":
            axes = [a for a, s in enumerate(shape) if s > 1]
            if axes:
                axis = self.rng.choice(axes)
                index = [slice(None)] * data.dim()
                index[axis] = slice(0, 1)
                return data[tuple(index)].expand(shape), f"expanded(axis {axis})"
        return data.contiguous(), "contiguous"

    def _sprinkle(self, data: torch.Tensor) -> torch.Tensor:
        if not self.nan_inputs or not data.is_floating_point() or data.numel() < 2:
            return data
        flat = data.clone().reshape(-1)
        for _ in range(self.rng.randint(1, 3)):
            flat[self.rng.randrange(flat.numel())] = self.rng.choice((math.nan, math.inf, -math.inf))
        return flat.reshape(data.shape)

    def new_input(self, dims, kind="float", positive=False, distinct=False, data_type=None,
                  allow_broadcast=True, special=True, values=None, place=None) -> Value:
        """Declare an input with random data (or `values`, of `dims`) in a random layout (or the
        tensor and label `place(data)` gives) and add it to the pool."""
        dims = [int(d) for d in dims]
        dtype = (data_type or (dg.int32 if kind == "int" else dg.bool if kind == "bool"
                               else FLOAT_IO[self.io]))
        if values is not None:
            data, special = values, False
        elif kind == "bool":
            data = torch.rand(dims, generator=self.gen) < 0.5
        elif kind == "int":
            limit = 2**40 if dtype is dg.int64 else 2**15
            data = torch.randint(-limit, limit, dims, generator=self.gen, dtype=torch.int64)
        elif distinct:
            count = math.prod(dims)
            data = (torch.randperm(count, generator=self.gen).double() - count / 2) / max(count / 4, 1)
            data = data.reshape(dims)
        else:
            data = torch.randn(dims, generator=self.gen, dtype=torch.float64)
            if positive:
                data = data.abs() + 0.5
        data = data.to(dtype.torch_dtype)
        if special and not positive and not distinct:
            data = self._sprinkle(data)
        special_values = data.is_floating_point() and not bool(torch.isfinite(data).all())
        view, layout = place(data) if place is not None else self._layout(data, allow_broadcast)
        tensor = self.graph.tensor_like(view, name=self.name())
        self.inputs[tensor.name] = view
        exact = view.double() if view.is_floating_point() else view.clone()
        value = Value(tensor, exact, 0)
        self.values.append(value)
        self.steps.append(f"input {tensor.name!r} {dims} {dtype.name} {layout}"
                          + (" with NaN/inf" if special_values else ""))
        return value

    # --- picking operands ---------------------------------------------------------------------
    def pick(self, kind="float", dims=None, predicate=None, fresh=0.25, **fresh_args) -> Value:
        """A pooled value of `kind` (and `dims`) satisfying `predicate`, or a new input."""
        fits = [v for v in self.values if v.kind == kind and (dims is None or list(v.tensor.dim) == list(dims))
                and (predicate is None or predicate(v))]
        if fits and self.rng.random() > fresh:
            # prefer recent values so chains (and fusion groups) form
            return fits[-1] if self.rng.random() < 0.5 else self.rng.choice(fits)
        shape = dims if dims is not None else self.broadcast_dims()
        return self.new_input(shape, kind, **fresh_args)

    def pick_world(self, kind="float", predicate=None, **kwargs) -> Value:
        """A value whose dims broadcast against the world (and satisfies `predicate`)."""
        return self.pick(kind, predicate=lambda v: self._world_compatible(v.tensor.dim) and
                         (predicate is None or predicate(v)), **kwargs)

    def _world_compatible(self, dims) -> bool:
        return len(dims) == len(self.world) and all(d in (1, w) for d, w in zip(dims, self.world))

    # --- recording ----------------------------------------------------------------------------
    def record(self, results, label: str, operands) -> list:
        """Evaluate the new node in float64, pool its outputs, describe it."""
        results = results if isinstance(results, tuple) else (results,)
        first = next(r for r in results if r is not None)
        node = first.producer
        by_tensor = {id(v.tensor): v for v in self.values}
        inputs = [None if t is None else by_tensor[id(t)].data for t in node.inputs]
        datas = node.opdef.reference(inputs, node.attrs)
        depth = 1 + max((by_tensor[id(t)].depth for t in node.input_tensors()), default=0)
        added = []
        for tensor, data in zip(node.outputs, datas):
            if tensor is None:
                continue
            new_name = self.name()
            if new_name is not None:
                tensor.set_name(new_name)
            data = data.double() if data.is_floating_point() else data
            value = Value(tensor, data, depth)
            self.values.append(value)
            added.append(value)
        names = ", ".join(repr(v.tensor.name) if hasattr(v, "tensor") else repr(v) for v in operands)
        outs = ", ".join(repr(v.tensor.name) for v in added)
        self.steps.append(f"{label}({names}) node {node.name!r} -> {outs}")
        return added

    # --- families -----------------------------------------------------------------------------
    def unary(self):
        op = self.rng.choice(UNARY_OPS)
        if op in DISCONTINUOUS:  # exact only on stored inputs
            x = self.pick_world(predicate=lambda v: v.depth == 0)
        elif op in POSITIVE_DOMAIN:
            x = self.pick_world(predicate=lambda v: _positive(v.data), positive=True)
        elif op == "exp":
            x = self.pick_world(predicate=lambda v: _finite_max(v.data) < 6)
        elif op == "tan":  # away from the poles, where an ulp of x is any error at all
            x = self.pick_world(predicate=lambda v: _finite_max(v.data.abs()) < 1.2)
        else:
            x = self.pick_world()
        params = {}
        if op == "leaky_relu":
            params["negative_slope"] = round(self.rng.uniform(-0.5, 0.5), 3)
        elif op == "elu":
            params["alpha"] = round(self.rng.uniform(0.1, 2.0), 3)
        elif op == "softplus":
            params["beta"] = round(self.rng.choice((0.5, 1.0, 2.0)), 3)
            params["threshold"] = self.rng.choice((5.0, 20.0))
        elif op == "swish":
            params["swish_beta"] = round(self.rng.uniform(-2.0, 2.0), 3)
        elif op == "relu" and self.rng.random() < 0.5:  # the frontend's clips
            params = self._relu_clips()
        out = getattr(self.graph, op)(x.tensor, name=self.name(), **params)
        return self.record(out, f"{op}{params or ''}", [x])

    def _relu_clips(self) -> dict:
        lower = round(self.rng.uniform(-1.0, 0.5), 3)
        return {"lower_clip": lower, "upper_clip": round(lower + self.rng.uniform(0.1, 3.0), 3),
                "negative_slope": self.rng.choice((0.0, 0.1, -0.3))}

    def unary_backward(self):
        forward = self.rng.choice(DIFFERENTIABLE)
        dy = self.pick_world()
        # the derivative jumps at 0 (relu, leaky_relu, elu; the hard ones at +-3 or their bounds):
        # x must be exact, so an input
        at_input = forward in ("relu", "leaky_relu", "elu", "hardswish", "hardsigmoid", "hardtanh")
        x = self.pick(dims=dy.tensor.dim, predicate=(lambda v: v.depth == 0) if at_input else None)
        params = {"leaky_relu": {"negative_slope": 0.2}, "elu": {"alpha": 0.7},
                  "softplus": {"beta": 1.0, "threshold": 20.0}, "swish": {"swish_beta": 1.3},
                  "relu": self._relu_clips() if self.rng.random() < 0.5 else {}}.get(forward, {})
        out = getattr(self.graph, forward + "_backward")(dy.tensor, x.tensor, name=self.name(), **params)
        return self.record(out, forward + "_backward", [dy, x])

    def binary(self):
        op = self.rng.choice(BINARY_OPS)
        if op == "mod":
            return self._mod()
        a = self.pick_world(predicate=(lambda v: _positive(v.data)) if op == "pow" else None,
                            positive=op == "pow")
        if op in ("div", "pow") or self.rng.random() < 0.7:
            b_pred = (lambda v: _positive(v.data)) if op == "div" else \
                (lambda v: _finite_max(v.data.abs()) < 3) if op == "pow" else None
            b = self.pick_world(predicate=b_pred, positive=op == "div")
            operands = [a.tensor, b.tensor]
            label_operands = [a, b]
        else:
            constant = self.rng.choice((0.5, -1.25, 2.0, 3.0, 1e-3, 7.0))
            operands = [a.tensor, constant] if self.rng.random() < 0.5 else [constant, a.tensor]
            label_operands = [a if o is a.tensor else o for o in operands]
        out = getattr(self.graph, op)(*operands, name=self.name())
        if _finite_max(self._peek(out, operands)) > MAGNITUDE_LIMIT:
            raise _Skip()
        return self.record(out, op, label_operands)

    def _mod(self):
        """fmod jumps by |b| where a / b crosses an integer: both operands stored (exact), b away
        from zero."""
        a = self.pick_world(predicate=lambda v: v.depth == 0)
        b = self.pick_world(predicate=lambda v: v.depth == 0 and _positive(v.data), positive=True)
        out = self.graph.mod(a.tensor, b.tensor, name=self.name())
        return self.record(out, "mod", [a, b])

    def integer_chain(self):
        """Exact integer arithmetic: int32 products past 2**24, int64 values past 2**53."""
        dtype = self.rng.choice((dg.int32, dg.int64))
        a = self.new_input(self.broadcast_dims(), "int", data_type=dtype)
        op = self.rng.choice(("add", "sub", "mul", "maximum", "minimum", "neg", "abs", "pow", "mod", "add_square"))
        if op in ("neg", "abs"):
            out, operands = getattr(self.graph, op)(a.tensor, name=self.name()), [a]
        elif op == "pow":  # exact and wrapping like torch; negative exponents give 0 or +-1
            exponents = torch.randint(-3, 9, self.broadcast_dims(), generator=self.gen)
            b = self.new_input(list(exponents.shape), "int", data_type=dtype, values=exponents.to(dtype.torch_dtype))
            out, operands = self.graph.pow(a.tensor, b.tensor, name=self.name()), [a, b]
        else:
            b = self.new_input(self.broadcast_dims(), "int", data_type=dtype) \
                if op != "mul" or dtype is dg.int32 else self.new_input(self.broadcast_dims(), "int",
                                                                         data_type=dg.int32)
            out, operands = getattr(self.graph, op)(a.tensor, b.tensor, name=self.name()), [a, b]
        out.set_data_type(dtype)
        return self.record(out, f"{op}[{dtype.name}]", operands)

    def compare(self):
        op = self.rng.choice(COMPARE_OPS)
        a = self.pick_world()
        b = self.pick_world(predicate=lambda v: _separated(a.data, v.data, self._margin(a, v)))
        if not _separated(a.data, b.data, self._margin(a, b)):
            raise _Skip()
        out = getattr(self.graph, op)(a.tensor, b.tensor, name=self.name())
        return self.record(out, op, [a, b])

    def logic(self):
        op = self.rng.choice(("logical_and", "logical_or", "logical_not"))
        a = self.pick_world("bool")
        if op == "logical_not":
            return self.record(self.graph.logical_not(a.tensor, name=self.name()), op, [a])
        b = self.pick_world("bool")
        return self.record(getattr(self.graph, op)(a.tensor, b.tensor, name=self.name()), op, [a, b])

    def where(self):
        condition = self.pick_world("bool")
        a = self.pick_world()
        b = self.pick_world() if self.rng.random() < 0.7 else self.rng.choice((0.0, -2.5))
        operands = [condition.tensor, a.tensor, b if isinstance(b, float) else b.tensor]
        return self.record(self.graph.where(*operands, name=self.name()), "where", [condition, a, b])

    def cast(self):
        source_kind = self.rng.choice(("float", "float", "bool", "int"))
        if source_kind == "float":
            target = self.rng.choice(("float16", "float32", "bool", "int32") +
                                     (("bfloat16",) if self.device != "cpu" else ()))
            # truncation and != 0 jump: only on exactly stored inputs; NaN and inf have no
            # integer value (torch itself gives different ones on CPU and CUDA)
            predicate, fresh_args = None, {}
            if target == "bool":
                predicate = lambda v: v.depth == 0
            elif target == "int32":
                predicate = lambda v: v.depth == 0 and bool(torch.isfinite(v.data).all())
                fresh_args = {"special": False}  # a new input for it holds no NaN or inf either
            x = self.pick_world(predicate=predicate, **fresh_args)
        else:
            x = self.pick_world(source_kind)
            target = self.rng.choice(("float32", "float16", "int64" if source_kind == "int" else "int32"))
        out = self.graph.cast(x.tensor, getattr(dg, "bool" if target == "bool" else target), name=self.name())
        return self.record(out, f"cast[{target}]", [x])

    def reduction(self):
        x = self.pick_world(kind=self.rng.choice(("float",) * 5 + ("int",)))
        modes = ("sum", "max", "min") if x.kind == "int" else REDUCTION_MODES
        mode = self.rng.choice(modes)
        axes = self._axes(len(x.tensor.dim))
        out = self.graph.reduction(x.tensor, mode, axes, name=self.name())
        if x.kind == "int":
            out.set_data_type(dg.int64)
        if _finite_max(self._peek(out, [x.tensor])) > MAGNITUDE_LIMIT and x.kind == "float":
            raise _Skip()
        return self.record(out, f"reduction[{mode}, axes {axes}]", [x])

    def softmax(self):
        x = self.pick_world()
        axis = self.rng.randrange(len(x.tensor.dim))
        log = self.rng.random() < 0.4
        y = self.graph.softmax(x.tensor, axis=axis, log=log, name=self.name())
        added = self.record(y, f"softmax[axis {axis}, log {log}]", [x])
        if self.rng.random() < 0.4:
            dy = self.pick(dims=y.dim)
            dx = self.graph.softmax_backward(dy.tensor, y, axis=axis, log=log, name=self.name())
            added += self.record(dx, f"softmax_backward[axis {axis}, log {log}]", [dy, added[0]])
        return added

    def feature_norm(self):
        """layernorm / rmsnorm over trailing axes, forward and (sometimes) backward."""
        op = self.rng.choice(("layernorm", "rmsnorm"))
        x = self.pick(dims=self.world)
        rank = len(x.tensor.dim)
        first = self.rng.randrange(rank)
        param = [1] * first + list(x.tensor.dim[first:])
        scale = self.new_input(param, special=False)
        bias = self.new_input(param, special=False) if op == "layernorm" or self.rng.random() < 0.5 else None
        phase = self.rng.choice(("training", "training", "inference"))
        eps = self.rng.choice((1e-5, 1e-3, 0.1))
        call = getattr(self.graph, op)
        outs = call(x.tensor, scale.tensor, None if bias is None else bias.tensor, epsilon=eps,
                    norm_forward_phase=phase, name=self.name())
        added = self.record(outs, f"{op}[{phase}, eps {eps}, scale {param}]", [x, scale] + ([bias] if bias else []))
        if phase == "training" and self.rng.random() < 0.5:
            added += self._norm_backward(op, x, scale, added[1:])
        return added

    def _norm_backward(self, op, x, scale, stats, groups=None):
        dy = self.pick(dims=x.tensor.dim)
        extra = {} if groups is None else {"groups": groups}
        if op == "rmsnorm" and self.rng.random() < 0.5:
            extra["has_dbias"] = True
        call = getattr(self.graph, op + "_backward")
        outs = call(dy.tensor, x.tensor, scale.tensor, *[s.tensor for s in stats], name=self.name(), **extra)
        return self.record(outs, f"{op}_backward{extra or ''}", [dy, x, scale] + list(stats))

    def channel_norm(self):
        """batchnorm / instancenorm / groupnorm / batchnorm_inference / genstats on [N, C, ...]."""
        if len(self.world) < 2:
            raise _Skip()
        op = self.rng.choice(("batchnorm", "instancenorm", "groupnorm", "batchnorm_inference", "genstats"))
        x = self.pick(dims=self.world)
        channels, rank = x.tensor.dim[1], len(x.tensor.dim)
        param = [1, channels] + [1] * (rank - 2)
        if op == "genstats":
            return self.record(self.graph.genstats(x.tensor, name=self.name()), "genstats", [x])
        scale, bias = self.new_input(param, special=False), self.new_input(param, special=False)
        if op == "batchnorm_inference":
            mean = self.new_input(param, special=False)
            inv = self.new_input(param, positive=True)
            out = self.graph.batchnorm_inference(x.tensor, mean.tensor, inv.tensor, scale.tensor,
                                                 bias.tensor, name=self.name())
            return self.record(out, op, [x, mean, inv, scale, bias])
        eps = self.rng.choice((1e-5, 1e-2))
        if op == "batchnorm":
            running = [self.new_input(param, data_type=dg.float32, special=False),
                       self.new_input(param, data_type=dg.float32, positive=True)] \
                if self.rng.random() < 0.5 else [None, None]
            outs = self.graph.batchnorm(x.tensor, scale.tensor, bias.tensor,
                                        *[None if r is None else r.tensor for r in running],
                                        epsilon=eps, momentum=self.rng.choice((0.1, 0.5)), name=self.name())
            added = self.record(outs, f"batchnorm[eps {eps}]", [x, scale, bias] + [r for r in running if r])
            groups = None
        else:
            groups = self.rng.choice([g for g in range(1, channels + 1) if channels % g == 0]) \
                if op == "groupnorm" else None
            extra = {} if groups is None else {"groups": groups}
            phase = self.rng.choice(("training", "training", "inference"))
            outs = getattr(self.graph, op)(x.tensor, scale.tensor, bias.tensor, epsilon=eps,
                                           norm_forward_phase=phase, name=self.name(), **extra)
            added = self.record(outs, f"{op}[{phase}, eps {eps}, groups {groups}]", [x, scale, bias])
            if phase == "inference":
                return added
        if self.rng.random() < 0.5:
            added += self._norm_backward(op, x, scale, added[1:3], groups)
        return added

    def pooling(self):
        spatial = self.rng.randint(1, 3)
        dims = [self.rng.choice((1, 2, 3)), self.rng.choice((1, 2, 3))] + \
            [self.rng.choice((1, 2, 4, 5, 7)) for _ in range(spatial)]
        mode = self.rng.choice(("max", "avg_include_pad", "avg_exclude_pad"))
        window = [self.rng.randint(1, min(3, s + 2)) for s in dims[2:]]
        padding = [self.rng.randint(0, w // 2) for w in window]
        window = [min(w, s + 2 * p) for w, s, p in zip(window, dims[2:], padding)]
        padding = [min(p, w // 2) for p, w in zip(padding, window)]
        stride = [self.rng.randint(1, 2) for _ in window]
        backward = self.rng.random() < 0.3
        # max-pooling gradients go to the window's maximum: ties would be ambiguous, so distinct
        x = self.new_input(dims, distinct=backward and mode == "max") if backward else \
            self.pick(dims=dims, fresh=0.5)
        if not backward and self.rng.random() < 0.4:  # a prologue for the pooling kernel
            x = self.record(self.graph.mul(x.tensor, 0.5, name=self.name()), "mul", [x, 0.5])[0]
        label = f"[{mode}, window {window}, stride {stride}, padding {padding}]"
        if not backward:
            y = self.graph.pooling(x.tensor, mode, window, stride, padding, name=self.name())
            return self.record(y, "pooling" + label, [x])
        attrs = PoolingAttrs(mode, tuple(window), tuple(stride), tuple(padding))
        shape = dims[:2] + list(output_spatial("pooling", dims, attrs))
        dy = self.new_input(shape)
        if mode == "max" and self.rng.random() < 0.5:  # routed by the indices of x's pool, made here
            pooled = self.graph.pooling(x.tensor, mode, window, stride, padding, return_indices=True, name=self.name())
            indices = self.record(pooled, "pooling[indices]" + label, [x])[1]
            dx = self.graph.pooling_backward(dy.tensor, x.tensor, mode, window, stride, padding, name=self.name(),
                                             indices=indices.tensor)
            return self.record(dx, "pooling_backward[indices]" + label, [dy, x, indices])
        dx = self.graph.pooling_backward(dy.tensor, x.tensor, mode, window, stride, padding, name=self.name())
        return self.record(dx, "pooling_backward" + label, [dy, x])

    def lrn(self):
        """Cross-channel LRN or divisive normalization (means broadcast or not), forward or
        backward, sometimes behind a pointwise prologue; even and odd sizes, C below the size."""
        dims = [self.rng.choice((1, 2)), self.rng.choice((1, 3, 4))] + \
            [self.rng.choice((1, 2, 5)) for _ in range(self.rng.randint(1, 3))]
        op = self.rng.choice(("lrn", "divisive_normalization"))
        size = self.rng.randint(1, 5 if op == "lrn" else 3)
        attrs = dict(alpha=self.rng.choice((1e-4, 0.5, 2.0)), beta=self.rng.choice((0.0, 0.5, 0.75)),
                     k=self.rng.choice((0.5, 1.0, 2.0)))
        x = self.pick(dims=dims, fresh=0.5)
        if self.rng.random() < 0.4:  # a prologue for the windowed kernel
            x = self.record(self.graph.mul(x.tensor, 0.5, name=self.name()), "mul", [x, 0.5])[0]
        operands, extra = [x], {}
        if op != "lrn" and self.rng.random() < 0.6:
            means = self.new_input(self.rng.choice((dims, [1, dims[1]] + [1] * (len(dims) - 2))))
            operands.append(means)
            extra["means"] = means.tensor
        label = f"[size {size}, {attrs}]"
        if self.rng.random() < 0.6:
            y = getattr(self.graph, op)(x.tensor, size, name=self.name(), **attrs, **extra)
            return self.record(y, op + label, operands)
        dy = self.new_input(dims)
        dx = getattr(self.graph, f"{op}_backward")(dy.tensor, x.tensor, size, name=self.name(), **attrs, **extra)
        return self.record(dx, f"{op}_backward" + label, [dy] + operands)

    def dropout(self):
        x = self.pick_world()
        p = self.rng.choice((0.0, 0.1, 0.5, 0.9))
        seed, offset = self.rng.randrange(2**64), self.rng.randrange(2**40)
        with_mask = self.rng.random() < 0.3
        out = self.graph.dropout(x.tensor, p, seed, offset, return_mask=with_mask, name=self.name())
        return self.record(out, f"dropout[p {p}, seed {seed}, offset {offset}, mask {with_mask}]", [x])

    def matmul(self):
        """[..., M, K] @ [..., K, N] onto the world's last two axes, broadcast batch, an epilogue
        with a bias, sometimes a prologue and a row-reduction exit."""
        if len(self.world) < 2:
            raise _Skip()
        m, n = self.world[-2], self.world[-1]
        k = self.rng.choice((1, 2, 5, 8, 16, 19))
        batch = self.world[:-2]
        batch_a = [b if self.rng.random() < 0.7 else 1 for b in batch]
        batch_b = [b if self.rng.random() < 0.5 else 1 for b in batch]
        if self.rng.random() < 0.3 and batch:  # b without batch axes
            batch_b = []
        a = self.new_input(batch_a + [m, k], allow_broadcast=False)
        b = self.new_input(batch_b + [k, n], allow_broadcast=False)
        if self.rng.random() < 0.3:  # a pointwise prologue on A
            a = self.record(self.graph.tanh(a.tensor, name=self.name()), "tanh", [a])[0]
        c = self.record(self.graph.matmul(a.tensor, b.tensor, name=self.name()), "matmul", [a, b])[0]
        added = [c]
        if len(c.tensor.dim) == len(self.world) and self.rng.random() < 0.6:
            bias = self.new_input([1] * (len(self.world) - 1) + [n], special=False)
            op = self.rng.choice(("add", "sub", "mul"))
            c = self.record(getattr(self.graph, op)(c.tensor, bias.tensor, name=self.name()), op, [c, bias])[0]
            added.append(c)
            if self.rng.random() < 0.5:
                op = self.rng.choice(("relu", "gelu", "silu", "sigmoid"))
                c = self.record(getattr(self.graph, op)(c.tensor, name=self.name()), op, [c])[0]
                added.append(c)
        if self.rng.random() < 0.4:
            mode = self.rng.choice(EXIT_MODES)
            axis = len(c.tensor.dim) - 1
            exit_value = self.graph.reduction(c.tensor, mode, [axis], name=self.name())
            added += self.record(exit_value, f"reduction[{mode}, axes [{axis}]]", [c])
        if len(c.tensor.dim) != len(self.world):
            # not a pointwise partner of world values: keep it out of later picks, store it
            c.tensor.set_output(True)
        return added

    def conv(self):
        """conv_fprop, conv_dgrad or conv_wgrad over [N, C, *spatial] world values: random filter
        sizes, padding (past the filter too), stride, dilation, groups and mode; the output is a
        world value when its dims are the world's (later ops fuse as its epilogue), else stored,
        with genstats of an fprop output now and then."""
        rank = len(self.world)
        if not 3 <= rank <= 5:
            raise _Skip()
        channels, spatial = self.world[1], list(self.world[2:])
        groups = self.rng.choice([g for g in range(1, channels + 1) if channels % g == 0])
        filters = groups * self.rng.choice((1, 2)) if self.rng.random() < 0.5 else channels
        taps = [self.rng.choice((1, 2, 3)) for _ in spatial]
        padding = [self.rng.choice((0, 1, 1, 2, 4)) for _ in spatial]
        stride = [self.rng.choice((1, 1, 2, 3)) for _ in spatial]
        dilation = [self.rng.choice((1, 1, 2)) for _ in spatial]
        out = []
        for size, r, p, st, d in zip(spatial, taps, padding, stride, dilation):
            extent = size + 2 * p - d * (r - 1) - 1
            if extent < 0:
                raise _Skip()
            out.append(extent // st + 1)
        y_dims = [self.world[0], filters] + out
        geometry = dict(padding=padding, stride=stride, dilation=dilation, groups=groups,
                        mode=self.rng.choice(("cross_correlation", "convolution")))
        w_dims = [filters, channels // groups] + taps
        op = self.rng.choices(("conv_fprop", "conv_dgrad", "conv_wgrad"), (3, 1, 1))[0]
        label = f"{op}[w {w_dims}, {geometry}]"
        if op == "conv_fprop":
            x, w = self.pick(dims=self.world), self.new_input(w_dims, allow_broadcast=False, special=False)
            result = self.record(self.graph.conv_fprop(x.tensor, w.tensor, name=self.name(), **geometry), label, [x, w])
        elif op == "conv_dgrad":
            dy, w = self.new_input(y_dims, allow_broadcast=False), self.new_input(w_dims, allow_broadcast=False,
                                                                                   special=False)
            result = self.record(self.graph.conv_dgrad(dy.tensor, w.tensor, x_dim=list(self.world), name=self.name(),
                                                       **geometry), label, [dy, w])
        else:
            dy = self.new_input(y_dims, allow_broadcast=False, special=False)
            x = self.pick(dims=self.world)
            result = self.record(self.graph.conv_wgrad(dy.tensor, x.tensor, w_dim=w_dims, name=self.name(),
                                                       **geometry), label, [dy, x])
        value = result[0]
        if list(value.tensor.dim) != list(self.world):
            value.tensor.set_output(True)
            if op == "conv_fprop" and self.rng.random() < 0.3:
                result += self.record(self.graph.genstats(value.tensor, name=self.name()), "genstats", [value])
        return result

    FAMILIES = (("unary", 6), ("unary_backward", 2), ("binary", 6), ("integer_chain", 1),
                ("compare", 2), ("logic", 1), ("where", 2), ("cast", 2), ("reduction", 4),
                ("softmax", 3), ("feature_norm", 3), ("channel_norm", 3), ("pooling", 2),
                ("dropout", 2), ("matmul", 3), ("conv", 3), ("layout", 3), ("conversion", 2),
                ("pow_special", 1), ("negated_view", 1), ("interleaved", 1), ("paged_attention", 1),
                ("lrn", 1))

    def _unpooled(self, *values):
        """Take values out of the operand pool (their magnitudes would skew other families)."""
        self.values = [v for v in self.values if all(v is not u for u in values)]

    def conversion(self):
        """A cast to a narrow float, or a plain store to one, of values at its ties, just
        beside them, at its overflow edge and its subnormals: checked bit for bit."""
        target = getattr(dg, self.rng.choice(NARROW_TARGETS))
        dims = self.broadcast_dims()
        x = self.new_input(dims, data_type=dg.float32, values=conversion_edges(target, dims, self.gen))
        if self.rng.random() < 0.5:
            out = self.graph.cast(x.tensor, target, name=self.name())
            label = f"cast[{target.name}]"
        else:
            out = self.graph.mul(x.tensor, 1.0, name=self.name()).set_data_type(target)
            label = f"store[{target.name}]"
        results = self.record(out, label, [x])
        results[0].tensor.set_output(True)
        self.exact.append(results[0].tensor)
        self._unpooled(x, *results)
        return results

    def pow_special(self):
        """pow over C99's special values: +-0, +-1, +-inf, NaN bases; odd, even, non-integral,
        infinite and NaN exponents."""
        bases = _drawn_from(POW_BASES, self.broadcast_dims(), self.gen)
        exponents = _drawn_from(POW_EXPONENTS, self.broadcast_dims(), self.gen)
        a = self.new_input(list(bases.shape), data_type=dg.float32, values=bases)
        b = self.new_input(list(exponents.shape), data_type=dg.float32, values=exponents)
        results = self.record(self.graph.pow(a.tensor, b.tensor, name=self.name()), "pow[special]", [a, b])
        results[0].tensor.set_output(True)
        self._unpooled(a, b, *results)
        return results

    def negated_view(self):
        """A lazily negated input (torch's negative bit) read by a binary op, a reduction or a
        softmax: execute resolves it, and the reference sees the value it holds. Then a negated
        twin of the op's output, or a conjugate (complex) view in place of the input or the
        output, which execute must refuse, writing nothing."""
        x = self.new_input(self.broadcast_dims(), place=self._negated)
        op = self.rng.choice(("add", "sub", "mul", "maximum", "minimum", "reduction", "softmax"))
        if op == "reduction":
            mode, axes = self.rng.choice(EXIT_MODES), self._axes(len(x.tensor.dim))
            results = self.record(self.graph.reduction(x.tensor, mode, axes, name=self.name()),
                                  f"reduction[{mode}, axes {axes}, negated input]", [x])
        elif op == "softmax":
            axis = self.rng.randrange(len(x.tensor.dim))
            results = self.record(self.graph.softmax(x.tensor, axis=axis, name=self.name()),
                                  f"softmax[axis {axis}, negated input]", [x])
        else:
            other = self.pick_world(predicate=lambda v: v is not x)
            operands = [x.tensor, other.tensor] if self.rng.random() < 0.5 else [other.tensor, x.tensor]
            out = getattr(self.graph, op)(*operands, name=self.name())
            if _finite_max(self._peek(out, operands)) > MAGNITUDE_LIMIT:
                raise _Skip()
            results = self.record(out, f"{op}[negated input]", [x, other])
        results[0].tensor.set_output(True)
        kind = self.rng.choice(("negated output", "conjugate input", "conjugate output"))
        refusal = Refusal(kind, self.rng.random() < 0.5, x.tensor if kind == "conjugate input" else results[0].tensor)
        self.refusals.append(refusal)
        self.steps.append(f"refuse {refusal.describe()} {'before' if refusal.before else 'after'} executing")
        return results

    def _negated(self, data: torch.Tensor) -> tuple:
        """A lazily negated view holding `data`: a conjugate's imaginary part (float32), or
        torch's negated view of -data in a random layout."""
        if data.dtype == torch.float32 and self.rng.random() < 0.5:
            complex_data = torch.complex(torch.randn(data.shape, generator=self.gen), -data)
            return complex_data.conj().imag, "negated(a conjugate's imaginary part)"
        view, layout = self._layout(-data)
        return torch._neg_view(view), f"negated({layout})"

    def interleaved(self):
        """Outputs (and sometimes an input) bound as views of one buffer that interleave without
        an element in common: a slot axis inserted anywhere among the world's axes (q, k and v of
        a packed qkv buffer, even and odd columns, rotary halves), the buffer's axes stored in a
        random order, a slot or a tail that belongs to no binding. run_case checks that nothing
        but the outputs' elements changed; sometimes also a twin with one output moved onto
        another view's element, which execute must refuse."""
        dims = list(self.world)
        dtype = FLOAT_IO[self.io] if self.rng.random() < 0.6 else dg.float32
        count, with_input, spare = self.rng.choice((2, 2, 3)), self.rng.random() < 0.5, self.rng.random() < 0.6
        slots = count + with_input + spare
        axis = self.rng.randrange(len(dims) + 1)
        buffer_dims = dims[:axis] + [slots] + dims[axis:]
        order = list(range(len(buffer_dims)))
        if self.rng.random() < 0.3:
            self.rng.shuffle(order)
        buffer_strides = dense_strides(buffer_dims, order)
        strides = list(buffer_strides[:axis] + buffer_strides[axis + 1:])
        tail = self.rng.choice((0, 0, 1, 3))
        memory = torch.full((math.prod(buffer_dims) + tail,), math.nan, dtype=dtype.torch_dtype)
        offsets = [slot * buffer_strides[axis] for slot in self.rng.sample(range(slots), slots - spare)]
        label = f"slot axis {axis} of a buffer {buffer_dims} in order {order} (+{tail})"
        views, source = [], None
        if with_input:
            offset = offsets.pop()

            def place(data):
                view = memory.as_strided(dims, strides, offset)
                view.copy_(data)
                return view, f"interleaved(at {offset}, {label})"

            source = self.new_input(dims, data_type=dtype, place=place)
            views.append((source.tensor, offset, dims, strides))
        added = []
        for offset in offsets:
            value, new = self._interleaved_result(source, dims, {id(v[0]) for v in views})
            added += new
            value.tensor.set_output(True).set_data_type(dtype).set_stride(strides)
            self.pinned.add(id(value.tensor))
            views.append((value.tensor, offset, dims, strides))
            self.steps.append(f"output {value.tensor.name!r} interleaved at {offset}, {label}")
        shared = SharedBuffer(memory, views)
        self.shared.append(shared)
        if self.rng.random() < 0.5:
            moved = self.rng.randrange(int(with_input), len(views))  # an output's view
            onto = self.rng.choice([i for i in range(len(views)) if i != moved])
            delta = self._element_address(views[onto]) - self._element_address(views[moved])
            refusal = Refusal("overlap", self.rng.random() < 0.5, shared=shared, moved=moved, delta=delta)
            self.refusals.append(refusal)
            self.steps.append(f"refuse {refusal.describe()} moved by {delta} onto {views[onto][0].name!r} "
                              f"{'before' if refusal.before else 'after'} executing")
        return added

    def _interleaved_result(self, source, dims, taken) -> tuple:
        """(a float value of `dims` that an op made and no binding holds yet: a pooled one or a new
        op's, on `source` when given (always while nothing reads it: an input no kernel reads is
        no binding execute checks); the values added)."""
        unread = source is not None and not self.graph.consumers(source.tensor)
        pooled = [v for v in self.values if v.depth > 0 and v.kind == "float" and list(v.tensor.dim) == dims
                  and id(v.tensor) not in taken and id(v.tensor) not in self.pinned]
        if pooled and not unread and self.rng.random() < 0.5:
            return self.rng.choice(pooled), []
        operand = source if unread or source is not None and self.rng.random() < 0.7 else self.pick(dims=dims)
        op = self.rng.choice(("neg", "abs", "tanh", "sigmoid", "relu", "scale"))
        extra = (self.rng.choice((0.5, -2.0, 3.0)),) if op == "scale" else ()
        added = self.record(getattr(self.graph, op)(operand.tensor, *extra, name=self.name()), op, [operand])
        return added[0], added

    def _element_address(self, view) -> int:
        """The storage offset of a random element of a (tensor, offset, sizes, strides) view."""
        _, offset, sizes, strides = view
        return offset + sum(self.rng.randrange(size) * stride for size, stride in zip(sizes, strides))

    def paged_attention(self):
        """Paged K/V sdpa, decode or prefill, whose k and v tables hold page ids past the pools,
        negative ones and ones near +-2**31, on pages the sequences use and past them: such a
        key is invisible, as if past seq_len_kv. Each pool is a view into a buffer whose pages
        before and after it hold a canary (NaN, inf or the type's largest value) that a key read
        outside the pool would carry into o."""
        batch, kv_heads = self.rng.randint(1, 3), self.rng.choice((1, 2))
        heads, page, head_dim = kv_heads * self.rng.choice((1, 2)), self.rng.choice((4, 8)), 16
        pages, per_sequence, s_q = self.rng.randint(2, 6), self.rng.randint(1, 3), self.rng.choice((1, 1, 2, 5))
        lengths = [self.rng.randint(0, per_sequence * page) for _ in range(batch)]
        table = torch.randint(0, pages, (batch, 1, per_sequence, 1), generator=self.gen, dtype=torch.int32)
        corrupted = self.rng.choice(("k", "v", "kv"))
        tables = [self.new_input(list(table.shape), "int", data_type=dg.int32, allow_broadcast=False,
                                 values=self._bad_ids(table, pages, lengths, page) if which in corrupted else table)
                  for which in "kv"]
        lens = self.new_input([batch, 1, 1, 1], "int", data_type=dg.int32, allow_broadcast=False,
                              values=torch.tensor(lengths, dtype=torch.int32).view(batch, 1, 1, 1))
        q = self.new_input([batch, heads, s_q, head_dim], special=False)
        k, v = (self.new_input([pages, kv_heads, page, head_dim], special=False, place=self._pool_with_canary)
                for _ in range(2))
        mask = self.rng.choice(("none", "causal", "causal_bottom_right"))
        inference = self.rng.random() < 0.5
        o, stats = self.graph.sdpa(q.tensor, k.tensor, v.tensor, is_inference=inference, seq_len_kv=lens.tensor,
                                   use_causal_mask=mask == "causal",
                                   use_causal_mask_bottom_right=mask == "causal_bottom_right",
                                   paged_attention_k_table=tables[0].tensor,
                                   paged_attention_v_table=tables[1].tensor, name=self.name())
        label = f"sdpa[paged, bad ids in {corrupted}, lengths {lengths}, mask {mask}, inference {inference}]"
        results = self.record((o, stats), label, [q, k, v, *tables, lens])
        for value in results:
            value.tensor.set_output(True)
        return results

    def _bad_ids(self, table, pages, lengths, page) -> torch.Tensor:
        """A copy of `table` with one or two ids outside [0, pages), mostly on pages in use."""
        table = table.clone()
        per_sequence = table.shape[2]
        for _ in range(self.rng.randint(1, 2)):
            batch = self.rng.randrange(table.shape[0])
            used = max(1, -(-lengths[batch] // page))
            slot = self.rng.randrange(used if self.rng.random() < 0.8 else per_sequence)
            table[batch, 0, slot, 0] = self.rng.choice((pages, pages + 1, -1, -pages, 2**31 - 1, -2**31, 2**30))
        return table

    def _pool_with_canary(self, data: torch.Tensor) -> tuple:
        """`data`, a page pool [pages, Hkv, page, D], as a view into a buffer whose pages before
        and after it hold a canary; sometimes stored [pages, page, Hkv, D]."""
        canary = self.rng.choice((math.nan, math.inf, torch.finfo(data.dtype).max))
        before, after = self.rng.randint(0, 2), self.rng.randint(1, 2)
        token_major = self.rng.random() < 0.4
        stored = data.transpose(1, 2) if token_major else data
        buffer = torch.full((before + data.shape[0] + after, *stored.shape[1:]), canary, dtype=data.dtype)
        buffer[before:before + data.shape[0]] = stored
        view = buffer[before:before + data.shape[0]]
        layout = f"pool(canary {canary}, {before} pages before, {after} after{', token-major' if token_major else ''})"
        return (view.transpose(1, 2) if token_major else view), layout

    def layout(self):
        """A layout op and its way back to the world's dims (a transpose and its inverse, a
        reshape and back, slices concatenated), a pointwise op sometimes in between (written in
        place or through a view); the views and copies join the pool."""
        x = self.pick(dims=self.world)
        dims, rank = list(x.tensor.dim), len(x.tensor.dim)
        way = self.rng.choice(("transpose", "reshape", "split"))
        if way == "transpose":
            order = list(range(rank))
            self.rng.shuffle(order)
            y = self.record(self.graph.transpose(x.tensor, order, name=self.name()), f"transpose{order}", [x])[0]
            y = self._maybe_pointwise(y)
            back = [order.index(a) for a in range(rank)]
            return self.record(self.graph.transpose(y.tensor, back, name=self.name()), f"transpose{back}", [y])
        if way == "reshape":
            cut = self.rng.randrange(rank + 1)
            flat = [math.prod(dims[:cut]), math.prod(dims[cut:])]
            y = self.record(self.graph.reshape(x.tensor, flat, name=self.name()), f"reshape{flat}", [x])[0]
            y = self._maybe_pointwise(y)
            return self.record(self.graph.reshape(y.tensor, dims, name=self.name()), f"reshape{dims}", [y])
        axes = [a for a in range(rank) if dims[a] >= 2]
        if not axes:
            raise _Skip()
        axis = self.rng.choice(axes)
        at = self.rng.randrange(1, dims[axis])
        parts = []
        for start, stop in ((0, at), (at, dims[axis])):
            window = [slice(None)] * rank
            window[axis] = slice(start, stop)
            part = self.record(self.graph.slice(x.tensor, window, name=self.name()), f"slice[{start}:{stop}]", [x])[0]
            parts.append(self._maybe_pointwise(part))
        out = self.graph.concatenate([p.tensor for p in parts], axis=axis, name=self.name())
        return self.record(out, f"concatenate[axis {axis}]", parts)

    def _maybe_pointwise(self, value: Value) -> Value:
        if self.rng.random() < 0.5:
            return value
        out = self.graph.mul(value.tensor, 1.5, name=self.name())
        return self.record(out, "mul[1.5]", [value])[0]

    # --- helpers ------------------------------------------------------------------------------
    def _axes(self, rank):
        count = self.rng.randint(1, rank)
        return sorted(self.rng.sample(range(rank), count))

    def _margin(self, a: Value, b: Value) -> float:
        eps = torch.finfo(FLOAT_IO[self.io].torch_dtype).eps
        return 64 * eps * (1 + max(a.depth, b.depth))

    def _peek(self, out, operands) -> torch.Tensor:
        """The float64 value of a just-added single-output node (before recording it)."""
        node = out.producer
        by_tensor = {id(v.tensor): v for v in self.values}
        inputs = [None if t is None else by_tensor[id(t)].data for t in node.inputs]
        return node.opdef.reference(inputs, node.attrs)[0]

    def family(self, only=None):
        """A family drawn by weight (among `only`, when given)."""
        names, weights = zip(*[(name, weight) for name, weight in self.FAMILIES if only is None or name in only])
        return self.rng.choices(names, weights)[0]

    def finish(self):
        """Mark outputs: the last value, some others, and every value nobody reads."""
        graph = self.graph
        ops = [v for v in self.values if v.tensor.producer is not None]
        if ops:  # a graph of conversions alone has its outputs marked already
            ops[-1].tensor.set_output(True)
        for value in ops:
            if self.rng.random() < 0.25:
                value.tensor.set_output(True)
        for node in graph.nodes:
            results = node.output_tensors()
            if all(not t.is_output and not graph.consumers(t) for t in results):
                results[0].set_output(True)
        for value in ops:
            tensor = value.tensor
            if id(tensor) in self.pinned:  # its binding is a view into a shared buffer
                continue
            if tensor.is_output and value.kind == "float" and tensor.data_type.name != "float32" \
                    and self.rng.random() < 0.2:
                tensor.set_data_type(dg.float32)
            elif tensor.is_output and value.kind == "float" and self.rng.random() < self._narrow_chance(tensor):
                tensor.set_data_type(FLOAT_IO[self.rng.choice(["float16"] + (["bfloat16"] if self.device != "cpu" else []))])
            if tensor.is_output and self.rng.random() < 0.15 and len(tensor.dim) > 1:
                order = list(range(len(tensor.dim)))
                self.rng.shuffle(order)
                tensor.set_stride(dense_strides(tensor.dim, order))
                self.steps.append(f"output {tensor.name!r} strides {list(tensor.stride)}")

    def _narrow_chance(self, tensor) -> float:
        """How often an output is stored narrow: often where something also reads it, since its
        consumers (fused with it or not) must then read the stored value (DESIGN.md)."""
        return 0.5 if self.graph.consumers(tensor) else 0.15


NARROW_TARGETS = ("float16", "bfloat16", "float8_e4m3", "float8_e5m2")
POW_BASES = (0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 0.5, -0.5, 2.0, -2.0, 7.0, -3.0)
POW_EXPONENTS = (0.0, -0.0, 1.0, -1.0, 2.0, 3.0, -3.0, 0.5, -0.5, 2.5, math.inf, -math.inf, math.nan)


def _drawn_from(choices, dims, gen) -> torch.Tensor:
    table = torch.tensor(choices, dtype=torch.float32)
    return table[torch.randint(0, len(choices), dims, generator=gen)]


def _next_up(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The next representable value of `dtype` above each finite non-negative value (float32)."""
    codes = {1: torch.uint8, 2: torch.int16}[torch.finfo(dtype).bits // 8]
    return (values.to(dtype).view(codes).to(torch.int32) + 1).to(codes).view(dtype).float()


def conversion_edges(target, dims, gen) -> torch.Tensor:
    """float32 values where a conversion to `target` can go wrong: its exact ties, the floats
    just either side, the largest finite value and past it, subnormals, +-0, inf and NaN."""
    dtype = target.torch_dtype
    info = torch.finfo(dtype)
    count = math.prod(dims)
    grid = torch.randn(count, generator=gen).abs() * torch.rand(count, generator=gen) * 8 * info.max / 16
    grid = torch.where(torch.rand(count, generator=gen) < 0.3, grid * info.smallest_normal / info.max * 64, grid)
    below = grid.to(dtype).float().nan_to_num(info.max, info.max, info.max).clamp(max=info.max)
    top_step = info.max - float(torch.tensor([info.max]).to(dtype).view(
        {1: torch.uint8, 2: torch.int16}[info.bits // 8]).sub(1).view(dtype).float())
    # in float64: the step past bf16's largest value is past float32's range, its halfway point is not
    above = torch.where(below >= info.max, torch.full_like(below, info.max + top_step, dtype=torch.float64),
                        _next_up(below, dtype).double())
    tie = ((below.double() + above) / 2).float()  # exact in float32: one bit past the target's
    nudge = torch.randint(-1, 2, (count,), generator=gen)  # the tie, or the float beside it
    values = torch.where(nudge < 0, tie.nextafter(torch.zeros_like(tie)),
                         torch.where(nudge > 0, tie.nextafter(torch.full_like(tie, math.inf)), tie))
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, info.max, info.max + top_step,
                             info.max * 4, info.tiny, info.tiny / 2, info.smallest_normal, 2.0 ** -149, 1e30],
                            dtype=torch.float64).float()  # past float32's range: inf
    pick = torch.rand(count, generator=gen) < 0.25
    values = torch.where(pick, specials[torch.randint(0, len(specials), (count,), generator=gen)], values)
    sign = torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0)
    return (values * sign).reshape(dims)


def _finite_max(data: torch.Tensor) -> float:
    finite = data[torch.isfinite(data)] if data.is_floating_point() else data.double()
    return finite.abs().max().item() if finite.numel() else 0.0


def _positive(data: torch.Tensor) -> bool:
    """Positive and well away from zero wherever finite (NaN and inf may stay)."""
    if not data.is_floating_point():
        return False
    finite = data[torch.isfinite(data)]
    return bool((data[~torch.isnan(data)] > 0).all()) and (finite.numel() == 0 or finite.min().item() > 0.05)


def _separated(a: torch.Tensor, b: torch.Tensor, margin: float) -> bool:
    """No finite pair of a and b (broadcast) lies within `margin` relative of a tie."""
    a, b = torch.broadcast_tensors(a.double(), b.double())
    finite = torch.isfinite(a) & torch.isfinite(b)
    gap = (a - b).abs()
    return bool((gap[finite] > margin * (1 + a.abs()[finite] + b.abs()[finite])).all())


def _to_device(value: torch.Tensor, device: str) -> torch.Tensor:
    """`value` on `device` with its strides and storage offset kept (`.to` would make a strided
    view dense, and the graph declared the view's layout)."""
    if value.device.type == torch.device(device).type:
        return value
    storage = torch.empty(0, dtype=value.dtype).set_(value.untyped_storage())
    moved = storage.to(device).as_strided(value.shape, value.stride(), value.storage_offset())
    return torch._neg_view(moved) if value.is_neg() else moved  # the negative bit is no memory


def generate(seed: int, device: str = "cpu", max_ops: int = 6, io: str | None = None,
             plain_names: bool = False, families=None) -> Case:
    """The random graph of `seed`, with its input data (on `device`) and row mode; with
    `plain_names` the same graph under names no kernel could confuse (to triage a failure);
    with `families` (names of GraphBuilder.FAMILIES) a graph of those families alone."""
    unknown = set(families or ()) - {name for name, _ in GraphBuilder.FAMILIES}
    if unknown:
        raise ValueError(f"no such families: {sorted(unknown)}")
    builder = GraphBuilder(seed, device, io, plain_names=plain_names)
    if families:
        builder.steps.append(f"families {sorted(families)}")
    row_mode = builder.rng.choice(ROW_MODES)
    target = builder.rng.randint(1, max_ops)
    attempts, failure = 0, ""
    while len(builder.graph.nodes) < target and attempts < 40 and not failure:
        attempts += 1
        family = builder.family(families)
        try:
            getattr(builder, family)()
        except _Skip:
            continue
        except Exception as error:  # noqa: BLE001 - a valid op the frontend or reference rejects
            failure = f"{family}: {type(error).__name__}: {error}"
            builder.steps.append(f"FAILED {failure}")
    if builder.graph.nodes and not failure:
        builder.finish()
    inputs = {name: _to_device(value, device) for name, value in builder.inputs.items()}
    return Case(seed, builder.graph, inputs, builder.io, row_mode, builder.steps, failure, builder.exact,
                builder.shared, builder.refusals)


# --- running and judging -------------------------------------------------------------------------
def forced_row_mode(mode) -> dg.BuildOptions:
    """Options making the row heuristics pick `mode` on small shapes (None: the model's choice)."""
    if mode is None:
        return dg.BuildOptions()
    return dg.BuildOptions(row_mode=mode, row_loop_tile=16, row_split_min_reduced=8)


def poisoned(tensor, device) -> torch.Tensor:
    """An output buffer with the tensor's layout, filled with NaN or sentinel values."""
    buffer = torch.empty_strided(tensor.dim, tensor.stride, dtype=tensor.data_type.torch_dtype, device=device)
    if buffer.is_floating_point():
        return buffer.fill_(math.nan)
    if buffer.dtype == torch.bool:
        return buffer.copy_(torch.rand(buffer.shape, device=device) < 0.5)
    return buffer.fill_(-12345)


def noisy_reference(graph, inputs: dict, trials: int = 3, seed: int = 0) -> list[dict]:
    """The reference with every op result perturbed by its storage rounding (relative
    eps of its data type, at least float32's): how far an honest kernel may drift."""
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(trials):
        values = {}
        for tensor in graph.inputs():
            if tensor.name in inputs:
                value = inputs[tensor.name].cpu()
                values[tensor.uid] = value.double() if value.is_floating_point() else value
        for node in graph.nodes:
            operands = [None if t is None else values[t.uid] for t in node.inputs]
            if node.op in DOT_OPS:
                operands = _dot_rounding(node, operands, gen, graph.allow_tf32)
            results = node.opdef.reference(operands, node.attrs)
            for tensor, result in zip(node.outputs, results):
                if tensor is None:
                    continue
                if result.is_floating_point():
                    eps = max(torch.finfo(tensor.data_type.torch_dtype).eps, torch.finfo(torch.float32).eps) \
                        if tensor.data_type.is_floating else torch.finfo(torch.float32).eps
                    eps = max(eps, _probability_rounding(node, tensor))
                    noise = (torch.rand(result.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
                    result = result.double() * (1 + noise)
                values[tensor.uid] = result
        runs.append({t.name: values[t.uid] for t in graph.outputs()})
    return runs


_TORCH_OF_TRITON = {"tl.float32": torch.float32, "tl.float16": torch.float16, "tl.bfloat16": torch.bfloat16}


DOT_OPS = frozenset({"matmul", "conv_fprop", "conv_dgrad", "conv_wgrad"})  # operands rounded to the dot type


def _dot_rounding(node, operands, gen, graph_tf32: bool = False) -> list:
    """A matmul's or conv's operands as its dot takes them, by DESIGN.md's precision rule
    (choose_dot): an operand wider than the dot type (an fp32 virtual tensor times an fp16 weight)
    is rounded to it at load, so it gets that type's relative noise (tf32: 10 mantissa bits).
    Convolutions take tf32 from the graph, matmuls from their attribute."""
    a, b = node.inputs[:2]
    tf32 = getattr(node.attrs, "allow_tf32", graph_tf32)
    choice = choose_dot(a.data_type.name, b.data_type.name, a.data_type.triton_type, b.data_type.triton_type,
                        bool(tf32))
    rounded = []
    for tensor, value, dot_type in zip((a, b), operands, (choice.a_type, choice.b_type)):
        dot_dtype = _TORCH_OF_TRITON.get(dot_type)
        eps = 2.0 ** -10 if choice.precision == "tf32" else \
            torch.finfo(dot_dtype).eps if dot_dtype is not None else 0.0
        if value.is_floating_point() and eps > torch.finfo(tensor.data_type.torch_dtype).eps:
            noise = (torch.rand(value.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
            value = value.double() * (1 + noise)
        rounded.append(value)
    return rounded + list(operands[2:])


def _probability_rounding(node, tensor) -> float:
    """The relative eps sdpa's o drifts by beyond its storage: its kernels meet the probabilities
    with v in v's type (p.to(v.dtype), as flash attention does), so a 16-bit v rounds them."""
    if node.op != "sdpa" or tensor is not node.outputs[0]:
        return 0.0
    return torch.finfo(node.inputs[2].data_type.torch_dtype).eps


def subnormal_resolution(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The norm of one storage step per value below `dtype`'s smallest normal number: there the
    type's spacing is absolute (smallest normal x eps), so even a correctly rounded output is off
    by a relative error that no relative-eps term covers (a product of 1e-6 in fp16: 3%)."""
    if dtype == torch.float64:
        return 0.0
    info = torch.finfo(dtype)
    below_normal = (ref.abs() < info.smallest_normal).sum().item()
    return math.sqrt(below_normal) * info.smallest_normal * info.eps


def compare(name, out: torch.Tensor, ref: torch.Tensor, noisy: list, depth_eps: float) -> str:
    """'' when `out` matches the float64 reference, else what differs."""
    out = out.cpu()
    if tuple(ref.shape) != tuple(out.shape):
        return f"{name}: the reference has shape {list(ref.shape)}, the output {list(out.shape)}"
    if not ref.is_floating_point() or not out.is_floating_point():
        if ref.is_floating_point():  # integer or bool output of a float reference
            ref = torch.trunc(ref) if out.dtype != torch.bool else ref != 0
        if not torch.equal(out.to(torch.int64), ref.to(torch.int64)):
            wrong = (out.to(torch.int64) != ref.to(torch.int64)).sum().item()
            return f"{name}: {wrong} of {out.numel()} exact values differ"
        return ""
    stored_dtype = out.dtype
    stored = ref.to(stored_dtype).double()  # what the output can hold (overflow -> inf)
    out = out.double()
    special = ~torch.isfinite(stored) | ~torch.isfinite(out)
    same_special = torch.isnan(stored) & torch.isnan(out) | (stored == out)
    if (special & ~same_special).any():
        count = (special & ~same_special).sum().item()
        return f"{name}: {count} NaN/inf positions differ"
    finite = ~special
    scale = ref[finite].norm().item() or 1.0
    err = (out[finite] - ref[finite]).norm().item() / scale
    drift = max(((n[finite] - ref[finite]).norm().item() / scale for n in noisy), default=0.0)
    # the drift holds the output's relative storage rounding; below its smallest normal number
    # the output type's spacing is absolute, which relative noise does not model
    limit = 8 * drift + subnormal_resolution(ref[finite], stored_dtype) / scale + depth_eps
    if not err <= limit:
        return f"{name}: relative error {err:.3g} > limit {limit:.3g} (rounding drift {drift:.3g})"
    return ""


def compare_bits(name, out: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when `out` holds what torch's .to gives for the reference, bit for bit (a NaN matches
    any NaN: torch's own NaN payloads depend on where in a tensor they sit)."""
    out, want = out.cpu(), ref.to(out.dtype)
    codes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
    nan = want.isnan()
    wrong = ((out.view(codes) != want.view(codes)) & ~nan) | (out.isnan() != nan)
    if wrong.any():
        index = wrong.nonzero()[0].tolist()
        return (f"{name}: {wrong.sum().item()} of {out.numel()} values not bit-exact, e.g. "
                f"{ref[tuple(index)].item()!r} stored as {out[tuple(index)].item()!r}, torch "
                f"{want[tuple(index)].item()!r}")
    return ""


def _bits(value: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns as integers (NaN payloads and signed zeros told apart)."""
    return value.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()])


def _memory(value: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of `value`'s storage (its gaps and whatever else shares it too)."""
    return torch.empty(0, dtype=torch.uint8, device=value.device).set_(value.untyped_storage()).clone()


def _refused(graph, bindings: dict, refusal: Refusal, device) -> str:
    """'' when execute refuses `refusal`'s bindings with an ExecutionError and writes nothing into
    any output or swapped-in tensor, else what went wrong (other errors propagate)."""
    swapped = refusal.bindings(device)
    watched = [bindings[t.name] for t in graph.outputs()] + list(swapped.values())
    before = [_memory(value) for value in watched]
    try:
        graph.execute({**bindings, **swapped})
    except ExecutionError:
        pass
    else:
        pair = _allowed_in_place(graph, refusal)
        if pair is None:
            return f"{refusal.describe()}: executed, not refused"
        return _in_place_result(graph, bindings, swapped, pair, device)
    if device != "cpu":
        torch.cuda.synchronize()
    if any(not torch.equal(_memory(value), saved) for value, saved in zip(watched, before)):
        return f"{refusal.describe()}: refused, but memory was written"
    return ""


def _allowed_in_place(graph, refusal: Refusal):
    """(output, input) when `refusal` is an overlap that binds an output to exactly the view of
    an input the plan may overwrite (plan.in_place, runtime/in_place.py): a binding execute
    runs instead of refusing; else None."""
    if refusal.kind != "overlap":
        return None
    output, offset, sizes, strides = refusal.shared.views[refusal.moved]
    for tensor, other_offset, other_sizes, other_strides in refusal.shared.views:
        same_view = other_offset == offset + refusal.delta and other_sizes == sizes and other_strides == strides
        if tensor is not output and same_view and (output.uid, tensor.uid) in graph.plan.in_place:
            return output, tensor
    return None


def _in_place_result(graph, bindings: dict, swapped: dict, pair: tuple, device) -> str:
    """'' when the output executed in place holds what an execute into memory of its own writes
    (NaN where it has NaN, values within float32 rounding), else what differs."""
    output, source = pair
    apart = {**bindings, **{t.name: poisoned(t, device) for t in graph.outputs()}}
    graph.execute(apart)
    got, want = swapped[output.name].cpu().double(), apart[output.name].cpu().double()
    same = (got == want) | (got.isnan() & want.isnan()) | ((got - want).abs() <= 1e-6 * want.abs())
    if not same.all():
        return (f"in place {output.name!r} over {source.name!r}: {(~same).sum().item()} values differ from an "
                f"execute into its own memory")
    return ""


def _bind(case: Case, device) -> tuple:
    """(bindings: inputs, poisoned outputs and the shared buffers' views; per shared buffer
    (SharedBuffer, its memory on `device`, a CPU copy of that memory as bound))."""
    bindings = {**case.inputs, **{t.name: poisoned(t, device) for t in case.graph.outputs()}}
    shared = []
    for buffer in case.shared:
        memory, views = buffer.bind(device)
        bindings.update(views)
        shared.append((buffer, memory, memory.cpu().clone()))
    return bindings, shared


def run_case(case: Case, device: str = "cpu") -> Verdict:
    """Build and execute `case` with poisoned outputs (and its refusals, before or after);
    compare every output with the reference and check the shared buffers' gaps."""
    graph = case.graph
    if case.generation_error:
        return Verdict("error:generate " + case.generation_error.split(":")[1].strip(), case.generation_error)
    binding_problems = []
    try:
        graph.build(options=forced_row_mode(case.row_mode))
        bindings, shared = _bind(case, device)
        binding_problems += [_refused(graph, bindings, r, device) for r in case.refusals if r.before]
        graph.execute(bindings)
        if device != "cpu":
            torch.cuda.synchronize()
        binding_problems += [_refused(graph, bindings, r, device) for r in case.refusals if not r.before]
    except UnsupportedError as error:
        return Verdict("unsupported", str(error))
    except Exception as error:  # noqa: BLE001 - every failure is a verdict, typed or not
        kind = type(error).__name__ + ("" if isinstance(error, GraphError) else " (untyped)")
        return Verdict(f"error:{kind}", f"{error}"[:2000])
    outputs = {t.name: bindings[t.name] for t in graph.outputs()}
    binding_problems += [buffer.stray_writes(memory, pristine) for buffer, memory, pristine in shared]
    # the reference reads each input's value: a lazily negated one resolved
    cpu_inputs = {k: v.cpu().resolve_neg() for k, v in case.inputs.items()}
    refs = graph.reference(cpu_inputs)
    noisy = noisy_reference(graph, cpu_inputs, seed=case.seed)
    depth = len(graph.nodes)
    problems = []
    exact_names = {tensor.name for tensor in case.exact}
    for tensor in graph.outputs():
        if tensor.name in exact_names:
            problem = compare_bits(tensor.name, outputs[tensor.name], refs[tensor.name])
            if problem:
                problems.append(problem)
            continue
        problem = compare(tensor.name, outputs[tensor.name], refs[tensor.name], [n[tensor.name] for n in noisy],
                          64 * torch.finfo(torch.float32).eps * (1 + depth))
        if problem:
            problems.append(problem)
    binding_problems = [p for p in binding_problems if p]
    if binding_problems:
        return Verdict("binding", "; ".join(binding_problems + problems))
    return Verdict("mismatch", "; ".join(problems)) if problems else Verdict("passed")
