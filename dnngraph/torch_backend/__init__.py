"""`torch.compile(model, backend="dnngraph")`: aten graphs partitioned into dnngraph graphs.

AOTAutograd traces the forward and the backward into functional aten graphs (training works);
each is partitioned with torch's CapabilityBasedPartitioner by the converter table (convert.py):
every maximal group of supported ops becomes one dnngraph graph, built once (static shapes: a
new shape is a new compile, torch's guards decide), and runs through `Graph.as_function`; the
other ops run in torch. A returned value that is a view (transpose, view, ...) of an argument or
of a value the graph makes is made in torch as that view, as eager torch does, not copied into
an output of its own (AOTAutograd saves transposed weights and reshaped activations for the
backward). An op whose value depends only on its static arguments (arange, zeros, full_like,
...) is a constant input: made in torch on the first call, kept, bound at each call. A 0-d
tensor (a loss, a step counter) is held as [1]: bound as a view of the
argument, returned as a 0-d view of the output. DNNGRAPH_LOG=info shows the partition and why an
op stayed in torch; `explain()` the same for the graphs compiled so far.

Dynamic shapes (`dynamic=True`, or dynamo's automatic dynamic shapes after a second shape): a
graph dynamo hands over with symbolic sizes is traced by AOTAutograd once, symbolically, and its
aten graphs are partitioned by what the converters take at the sizes it was traced at
(`_judged_at_hints`). The converters read static sizes, so each partition is converted per
concrete input signature it is called with (`PerShapeModule`: the partition's metas recomputed
at those sizes, sizes computed in the graph (s0 * 2) read as their numbers, the last
SHAPE_LIMIT kept): host work of milliseconds per shape, no retrace and no dynamo recompile, and
the kernels of shapes whose sources match (dnngraph names kernels by content) are compiled once.
Under CUDA-graph replay a graph with symbolic sizes is still compiled whole per concrete shape
(`_PerShape`: one AOTAutograd + dnngraph compile per signature), as before.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import threading
from typing import Optional

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import dtypes
from ..autodiff import prune
from ..graph import Graph
from ..log import logger
from ..options import BuildOptions
from ..tensor import Tensor
from .rnn import traced_rnns
from .convert import (_VERDICT, TENSOR_TYPES, VIEW_OPS, Aux, ConstantSpec, convert, graph_input, read_as_value,
                      unsupported)

__all__ = ["backend", "explain", "REPORTS", "CompileReport"]

_NUMBER = itertools.count()
REPORT_LIMIT = 64  # compile reports kept (inspection and tests)
SHAPE_LIMIT = 16  # static shapes compiled and kept per graph dynamo hands over with symbolic sizes


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What one aten graph became: ops in dnngraph graphs, and the ops left to torch with why."""

    dnngraph_ops: int
    graphs: int
    torch_ops: tuple  # (target, reason) per op that runs in torch
    functions: tuple = ()  # the GraphFunction of each dnngraph graph (its plan once it has run)
    specialized: str = ""  # the input signature compiled for, where dynamo's graph had symbolic sizes
    per_shape: tuple = ()  # the PerShapeModule of each partition of a graph traced with symbolic sizes

    def kernels(self) -> int:
        """Kernels launched per call by the graphs that have run (their plans are built on first use;
        a partition converted per shape counts its most recently used shape's)."""
        functions = list(self.functions) + [module.latest_function() for module in self.per_shape]
        plans = [f._plain[0].plan for f in functions
                 if f is not None and f._plain is not None and f._plain[0].plan is not None]
        return sum(len(plan.launches) for plan in plans)


REPORTS: collections.deque = collections.deque(maxlen=REPORT_LIMIT)

aten = torch.ops.aten


def _view_chain(node):
    """(base, views): the FX node a returned value is a view of, and the view nodes from it to
    the value in order (none where the value is not a view)."""
    views = []
    while node.op == "call_function" and node.target in VIEW_OPS and isinstance(node.args[0], torch.fx.Node):
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def _replay(base, views):
    """The views applied to a torch tensor: what eager torch returns, with no copy."""
    for view in views:
        base = view.target(base, *view.args[1:], **view.kwargs)
    return base


class _Support(OperatorSupport):
    """Supported nodes are the converter table's; the reasons for the others are kept."""

    def __init__(self):
        super().__init__()
        self.reasons: dict = {}

    def is_node_supported(self, submodules, node) -> bool:
        why = unsupported(node)
        if why is not None and node.op == "call_function":
            self.reasons[node.name] = why
        return why is None


def _dense(meta) -> bool:
    """Non-overlapping and dense in some axis order (a layout dnngraph can allocate)."""
    order = sorted(range(meta.dim()), key=lambda a: meta.stride(a))
    expected = 1
    for axis in order:
        if meta.shape[axis] > 1 and meta.stride(axis) != expected:
            return False
        expected *= meta.shape[axis]
    return True


def _aux_value(meta, device):
    """What torch gets for an Aux result: zeros of its tensor kind, or its static int."""
    if isinstance(meta, torch.Tensor):
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    return int(meta)


class _Values:
    """What converters read: `value(arg)` is an FX argument's dnngraph tensor (other arguments
    as they are); `value.true(dims)` an all-true broadcast input made for `expand`;
    `value.seed()` an int64 seed input drawn per call (dropout); `value.constant(node)` an input
    bound to a constant op's value (made once, see ConstantSpec)."""

    def __init__(self, values: dict, graph, trues: list):
        self.values, self.graph, self.trues, self.true_inputs, self.seeds = values, graph, trues, [], []
        self.constants, self.constant_inputs = [], []

    def constant(self, node):
        tensor = graph_input(self.graph, f"constant{len(self.constants)}", node.meta["val"])
        self.constants.append(ConstantSpec(node))
        self.constant_inputs.append(tensor)
        return tensor

    def __call__(self, arg):
        return self.values.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg

    def seed(self):
        tensor = self.graph.tensor(name=f"seed{len(self.seeds)}", dim=[1], data_type=dtypes.int64)
        self.seeds.append(tensor)
        return tensor

    def true(self, dims):
        tensor = self.graph.tensor(name=f"true{len(self.trues)}", dim=list(dims), stride=[0] * len(dims),
                                   data_type=dtypes.bool_)
        self.trues.append(tuple(dims))
        self.true_inputs.append(tensor)
        return tensor


def _program_device(sub: torch.fx.GraphModule) -> Optional[torch.device]:
    """The device a partition's graph runs on: that of the values its ops make (the support
    predicate leaves ops with CPU results in a GPU program to torch); None when it makes none."""
    for node in sub.graph.nodes:
        value = node.meta.get("val") if node.op == "call_function" else None
        if isinstance(value, (tuple, list)):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _scalar_on(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d argument as the graph holds it ([1]), on the graph's device: torch lets a CPU scalar
    into an op on CUDA tensors; the graph reads its value of this call, filled on the device
    (no host-to-device copy to wait for)."""
    if value.device == device:
        return value.view(1)
    return torch.full((1,), value.item(), dtype=value.dtype, device=device)


def _made_now(specs: list) -> Optional[tuple]:
    """The constants' values, made at conversion (None where a size is symbolic: the first call
    makes them). Made here, not on the first call: under mode="reduce-overhead" the first call
    is the cudagraph trees' warm-up, whose allocations land in their pool, and a kept tensor
    there is one they refuse ("not tracked as outputs")."""
    if not specs or any(spec.symbolic for spec in specs):
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return tuple(spec.make() for spec in specs)


class DnngraphModule(torch.nn.Module):
    """One partition of an aten graph as a dnngraph graph, called through `as_function`."""

    def __init__(self, sub: torch.fx.GraphModule, options=None):
        super().__init__()
        self.graph_ = Graph(name=f"compiled{next(_NUMBER)}", intermediate_data_type=dtypes.float32,
                            allow_tf32=torch.backends.cuda.matmul.allow_tf32)
        g, values, inputs = self.graph_, {}, []
        self.trues: list = []  # dims of the all-true broadcast inputs (expand), bound at each call
        self.taken: list = []  # per argument: is it a graph input
        value = _Values(values, g, self.trues)
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                meta = node.meta["val"]
                # a 0-d argument is bound as [1] (a view); one only an sdpa's Aux operand is not taken
                taken = isinstance(meta, torch.Tensor) and meta.dtype in TENSOR_TYPES and (
                    meta.dim() > 0 or read_as_value(node))
                self.taken.append(taken)  # others are an sdpa's Aux values, read by no converter
                if taken:
                    values[node] = graph_input(g, f"input{len(inputs)}", meta)
                    inputs.append(values[node])
            elif node.op == "call_function":
                values[node] = convert(g, node, value)
            elif node.op == "output":
                returned = node.args[0]
        inputs += value.true_inputs + value.constant_inputs + value.seeds
        self.seeds = len(value.seeds)
        self.constant_specs = value.constants
        self.constants = _made_now(value.constants)
        self.single = not isinstance(returned, (tuple, list))
        returned = [returned] if self.single else list(returned)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        self.returned = len(returned)
        # returned positions whose value is 0-d: the graph holds it as [1], torch gets a 0-d view
        self.scalars = {position for position, node in enumerate(returned) if isinstance(node, torch.fx.Node)
                        and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 0}
        # per returned position: (("argument" | "output", index), the views torch applies to it)
        outputs, self.aux, self.views = [], {}, {}
        for position, node in enumerate(returned):
            base, views = _view_chain(node)
            if views and base in placeholders:  # a view of an argument: made in torch, as eager does
                self.views[position] = (("argument", placeholders.index(base)), views)
                continue
            if views and isinstance(values.get(base), Tensor) and base.meta["val"].numel() <= node.meta["val"].numel():
                # a view of a value the graph makes (no larger than the view): the graph returns
                # the value, torch the view
                self.views[position] = (("output", self._output(self._owned(g, values, base), base,
                                                                f"base{position}", outputs)), views)
                continue
            tensor = values[node]
            if isinstance(tensor, Aux):
                self.aux[position] = tensor.meta
                continue
            self.views[position] = (("output", self._output(self._owned(g, values, node), node,
                                                            f"output{position}", outputs)), [])
        # the device the graph runs on: its tensors' (a 0-d CPU argument beside them is a scalar
        # torch lets into a CUDA op: it is copied to that device at each call)
        self.device = _program_device(sub)
        self.function = None  # every returned value made in torch (views of the arguments): no graph to run
        if outputs:
            prune(g)  # results no output reads (an sdpa's log-sum-exp in inference), views made in torch
            self.function = g.as_function(inputs, outputs, options)
        self.ops = sum(1 for n in sub.graph.nodes if n.op == "call_function")

    @staticmethod
    def _owned(g, values, node):
        """`node`'s value, copied where it is a graph input (a slice_backward over the whole
        gradient is the gradient it got): an input is never a graph output, and eager's value is
        memory of its own. The copy stands for the node from then on (returned twice, one copy)."""
        tensor = values[node]
        if tensor.producer is None:
            tensor = values[node] = g.cast(tensor, data_type=tensor.data_type)
        return tensor

    @staticmethod
    def _output(tensor, node, name: str, outputs: list) -> int:
        """The position of `tensor` among the graph's outputs (made one, in torch's layout of
        `node`'s value, the first time)."""
        if tensor not in outputs:
            tensor.set_output(True).set_name(name)
            meta = node.meta["val"]
            if _dense(meta) and meta.dim() > 0:  # a 0-d value is held as [1]
                tensor.set_stride(list(meta.stride()))
            outputs.append(tensor)
        return outputs.index(tensor)

    def forward(self, *args):
        device, arguments = self.device or args[0].device, args
        args = tuple(_scalar_on(arg, device) if arg.dim() == 0 else arg for arg, taken in zip(args, self.taken) if taken)
        if self.trues:
            args = args + tuple(torch.ones((), dtype=torch.bool, device=device).expand(dims) for dims in self.trues)
        if self.constant_specs:
            if self.constants is None:  # symbolic sizes: made on the first call, then kept
                self.constants = tuple(spec.make() for spec in self.constant_specs)
            args = args + self.constants
        if self.seeds:  # from torch's generator of the device: torch.manual_seed makes runs repeat
            args = args + tuple(torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
                                for _ in range(self.seeds))
        results = self.function(*args) if self.function is not None else ()
        results = results if isinstance(results, tuple) else (results,)
        ordered = []
        for position in range(self.returned):
            if position in self.aux:
                ordered.append(_aux_value(self.aux[position], device))
                continue
            (kind, index), views = self.views[position]
            made = _replay(arguments[index] if kind == "argument" else results[index], views)
            ordered.append(made.view(()) if position in self.scalars and made.dim() else made)
        return ordered[0] if self.single else tuple(ordered)


def _compile(gm: torch.fx.GraphModule, example_inputs, specialized: str = "", options=None):
    """The aten graph with each supported partition replaced by a DnngraphModule, its graphs
    built with `options` (a BuildOptions, None: the defaults; `specialized`: the concrete input
    signature it was traced for, where dynamo's graph was symbolic). An aten graph AOTAutograd
    traced with symbolic sizes has its ops judged at the sizes it was traced at
    (`_judged_at_hints`) and each partition converted per concrete shape it is called with
    (`PerShapeModule`): no retrace, and kernels shared by content across shapes."""
    symbolic = _has_symbolic_sizes(gm)
    if symbolic:
        _judged_at_hints(gm)
    support = _Support()
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    converted, functions = 0, []
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            module = PerShapeModule(sub, options) if symbolic else DnngraphModule(sub, options)
            setattr(fused, node.target, module)
            converted += module.ops
            if getattr(module, "function", None) is not None:
                functions.append(module.function)
    per_shape = tuple(m for m in fused.children() if isinstance(m, PerShapeModule))
    graphs = len(functions) + len(per_shape)
    fused.recompile()
    kept = tuple((str(n.target), support.reasons.get(n.name, "not an op dnngraph takes")) for n in fused.graph.nodes
                 if n.op == "call_function" and n.target is not operator.getitem and not _size_arithmetic(n))
    REPORTS.append(CompileReport(converted, graphs, kept, tuple(functions), specialized, per_shape))
    logger.info("torch.compile backend: %d aten ops in %d dnngraph graph(s), %d in torch%s", converted, graphs,
                len(kept), f" (specialized to {specialized})" if specialized else "")
    for target, reason in kept:
        logger.info("  stays in torch: %s (%s)", target, reason)
    return make_boxed_func(fused.forward)


def _size_arithmetic(node) -> bool:
    """Is `node` arithmetic on sizes (s0 * 2 in a graph traced with symbolic sizes): no tensor
    op, torch's to compute and no op dnngraph is missing."""
    return isinstance(node.meta.get("val"), _SYMBOLS)


def _is_symbolic_value(value) -> bool:
    if isinstance(value, _SYMBOLS):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, _SYMBOLS) for d in (*value.shape, *value.stride()))


def _has_symbolic_sizes(gm: torch.fx.GraphModule) -> bool:
    """Did AOTAutograd trace `gm` with symbolic sizes (a placeholder that is or holds a symbol)?"""
    return any(_is_symbolic_value(node.meta.get("val")) for node in gm.graph.nodes if node.op == "placeholder")


def _hint(value):
    """A symbolic size as the int it was traced at (a plain int as it is)."""
    return value.node.hint if isinstance(value, _SYMBOLS) and value.node.hint is not None else value


def _at_sizes(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
    """A copy of `gm` whose node metas ("val") are recomputed for `inputs` (real tensors, fake
    tensors of static shape or ints, one per placeholder) under a fake mode of static shapes;
    `gm`'s own nodes keep theirs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    twin = torch.fx.GraphModule(gm, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
             for value in inputs]
    _NumbersRecorded(twin, mode).propagate_dont_convert_inputs(*fakes)
    for node in twin.graph.nodes:
        node.meta.pop(_VERDICT, None)  # judged again at these sizes
        if node.op == "call_function":  # a size computed in the graph (s0 * 2) as the number it now is
            node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _number_or_node)
    twin.graph.eliminate_dead_code()
    twin.recompile()
    return twin


class _NumbersRecorded(FakeTensorProp):
    """torch's FakeTensorProp that records every node's value in its meta ("val"), a number too:
    a size argument (a SymInt placeholder, saved for the backward) and arithmetic on sizes
    (s0 * 8) then hold the numbers they are at the sizes propagated, whatever torch's release:
    torch 2.11's records only tensors and symbols, which left such a node with the symbol it was
    traced with (a view to [s0 * 8, 12] was refused: "input mul_6 is not a tensor")."""

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, (int, float, bool)):
            node.meta["val"] = result
        return result


def _number_or_node(node):
    value = node.meta.get("val")
    return value if isinstance(value, (int, float, bool)) else node


def _hinted_inputs(gm: torch.fx.GraphModule) -> list:
    """Static stand-ins of `gm`'s placeholders at the sizes it was traced at."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    made, mode = [], FakeTensorMode()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            with mode:
                made.append(torch.empty_strided([_hint(d) for d in value.shape], [_hint(d) for d in value.stride()],
                                                dtype=value.dtype, device=value.device))
        else:
            made.append(_hint(value))
    return made


def _judged_at_hints(gm: torch.fx.GraphModule) -> None:
    """Mark each op of symbolic `gm` supported or not as its twin at the sizes it was traced at
    is (the converters read static sizes; a view to [s0 * 2, 8] reads [6, 8] there, and the
    partition converted per shape reads that shape's numbers). A partition that then fails to
    convert at some other shape runs in torch at that shape."""
    twin = _at_sizes(gm, _hinted_inputs(gm))
    twins = {node.name: node for node in twin.graph.nodes}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            twin_node = twins.get(node.name)
            node.meta[_VERDICT] = "a size computed in the graph" if twin_node is None else unsupported(twin_node)


class PerShapeModule(torch.nn.Module):
    """A partition of an aten graph traced with symbolic sizes, converted into a dnngraph graph
    (a DnngraphModule) per concrete input signature it is called with, the last SHAPE_LIMIT
    kept: the conversion and the plan are host work per shape; the kernels are shared by
    content, so a shape whose kernels an earlier shape already made compiles nothing. A shape
    at which the partition does not convert runs its aten ops in torch."""

    def __init__(self, sub: torch.fx.GraphModule, options=None):
        super().__init__()
        self.sub, self.options = sub, options
        self.ops = sum(1 for n in sub.graph.nodes if n.op == "call_function")
        self.modules: collections.OrderedDict = collections.OrderedDict()  # signature -> module
        self.shapes: dict = {}  # signature -> its shapes as the log says them
        self.in_torch: dict = {}  # signature -> why the partition runs in torch at it (explain() says)
        self.lock = threading.Lock()

    def forward(self, *args):
        key = _signature(args)
        with self.lock:
            module = self.modules.get(key)
            if module is None:
                module = self._converted(key, args)
            self.modules.move_to_end(key)
        return module(*args)

    def latest_function(self):
        """The graph function of the most recently used shape (None: none ran in dnngraph yet)."""
        with self.lock:
            latest = next(reversed(self.modules.values()), None)
        return getattr(latest, "function", None)

    def _converted(self, key, args):
        described = _described(args)
        try:
            module = DnngraphModule(_at_sizes(self.sub, list(args)), self.options)
            logger.info("torch.compile backend: a partition of %d ops converted at the shapes %s (%d of at most %d "
                        "kept)", self.ops, described, len(self.modules) + 1, SHAPE_LIMIT)
        except Exception as error:  # noqa: BLE001  (a form this shape gives that no converter takes)
            logger.info("torch.compile backend: a partition stays in torch at %s: %s: %s", described,
                        type(error).__name__, error)
            module = self.sub
            self.in_torch[key] = f"{type(error).__name__}: {error}"
        self.modules[key] = module
        self.shapes[key] = described
        if len(self.modules) > SHAPE_LIMIT:
            dropped, _ = self.modules.popitem(last=False)
            self.in_torch.pop(dropped, None)
            logger.info("torch.compile backend: a partition drops its least recently used shapes %s",
                        self.shapes.pop(dropped))
        return module


# The attention forms the converters take: torch's flash kernels (the sdpa op and its backward),
# else the math decomposition (matmuls and a softmax, an op-level chain). Chosen while AOTAutograd
# traces, so the traced graph holds one of them.
TRACED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


MODES = ("default", "reduce-overhead")
OPTIONS = ("cudagraphs", "build_options")


def _replays(mode, options) -> bool:
    """Does a compile replay its graphs as CUDA graphs: mode "reduce-overhead", or the option
    {"cudagraphs": True} (which overrides the mode)? Unknown modes and options are errors."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"torch.compile backend 'dnngraph': mode {mode!r} is not one of {MODES}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"torch.compile backend 'dnngraph': unknown options {unknown}; it takes {OPTIONS}")
    replay = options.get("cudagraphs", mode == "reduce-overhead")
    if not isinstance(replay, bool):
        raise TypeError(f"torch.compile backend 'dnngraph': option cudagraphs must be a bool, not {replay!r}")
    return replay


def _build_options(options):
    """The BuildOptions every graph of a compile is built with: the option "build_options"
    (None: the defaults)."""
    chosen = dict(options or {}).get("build_options")
    if chosen is not None and not isinstance(chosen, BuildOptions):
        raise TypeError(f"torch.compile backend 'dnngraph': option build_options must be a dnngraph.BuildOptions, "
                        f"not {type(chosen).__name__}")
    return chosen


_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_symbolic(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Did dynamo trace `gm` with symbolic sizes: a SymInt input, or an input whose dims or
    strides are symbols?"""
    if any(isinstance(x, _SYMBOLS) for x in example_inputs):
        return True
    for node in getattr(gm, "gm", gm).graph.nodes:  # a GmWrapper (boxed inputs) holds the graph
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and any(isinstance(d, _SYMBOLS) for d in (*value.shape, *value.stride())):
            return True
    return False


def _signature(args) -> tuple:
    """What a static compile of a graph is specific to: each tensor's sizes, strides, type,
    device and whether it requires grad, each other argument's value."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                 else (type(a), a) for a in args)


def _described(args) -> str:
    """The tensor arguments' sizes, as a log line shows them."""
    return ", ".join("x".join(map(str, a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args)


class _PerShape:
    """A graph dynamo traced with symbolic sizes, compiled for each concrete input signature it
    is called with (dnngraph compiles static shapes): the compiles of the last SHAPE_LIMIT
    signatures are kept, the least recently used one dropped first."""

    def __init__(self, gm: torch.fx.GraphModule, compile_static):
        self.gm, self.compile_static = gm, compile_static
        # dynamo calls what it gets for a GmWrapper with one list of inputs (boxed), as AOTAutograd's
        # compile of it expects; otherwise with the inputs themselves
        self.boxed = isinstance(gm, torch._dynamo.utils.GmWrapper)
        self.compiled: collections.OrderedDict = collections.OrderedDict()  # signature -> (shapes text, compiled)
        self.lock = threading.Lock()
        self.name = f"graph{next(_NUMBER)}"

    def __call__(self, *args):
        args = args[0] if self.boxed else args
        key = _signature(args)
        with self.lock:
            entry = self.compiled.get(key)
            if entry is None:
                entry = self._compiled(key, args)
            self.compiled.move_to_end(key)
        compiled = entry[1]
        return compiled(list(args)) if self.boxed else compiled(*args)

    def _compiled(self, key, args):
        described = _described(args)
        logger.info("torch.compile backend: %s has symbolic sizes (dynamic shapes, which dnngraph does not "
                    "compile); specializing it to the static shapes %s (%d of at most %d kept)", self.name,
                    described, len(self.compiled) + 1, SHAPE_LIMIT)
        entry = self.compiled[key] = (described, self.compile_static(self.gm, list(args),
                                                                     f"{self.name} at {described}"))
        if len(self.compiled) > SHAPE_LIMIT:
            _, (dropped, _) = self.compiled.popitem(last=False)
            logger.info("torch.compile backend: %s drops its least recently used shapes %s", self.name, dropped)
        return entry


def _static_compile(replay: bool, build_options=None):
    """compile(gm, example_inputs, specialized) -> the AOTAutograd-compiled callable of dynamo's
    graph `gm`, its forward and backward partitioned into dnngraph graphs built with
    `build_options` (replayed as CUDA graphs where `replay`); `specialized` names the signature
    in the reports ("" where dynamo's graph was static already)."""

    def compile_static(gm, example_inputs, specialized=""):
        partition = functools.partial(_compile, specialized=specialized, options=build_options)
        with sdpa_kernel(TRACED_ATTENTION), traced_rnns():
            if replay:
                from .cudagraphs import aot_with_cudagraphs

                return aot_with_cudagraphs(partition, gm, example_inputs)
            return aot_autograd(fw_compiler=partition, bw_compiler=partition)(gm, example_inputs)

    return compile_static


def backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The torch.compile backend: `torch.compile(model, backend="dnngraph")`. With
    `mode="reduce-overhead"` (or `options={"cudagraphs": True}`) each compiled forward and
    backward graph is recorded once as a CUDA graph and replayed (cudagraph trees, as inductor's
    reduce-overhead mode): one launch per graph instead of one per kernel;
    `options={"build_options": dnngraph.BuildOptions(...)}` builds every graph with them. A
    graph dynamo traced with symbolic sizes is compiled per concrete shape when it is called
    (see the module's doc)."""
    replay = _replays(mode, options)
    compile_static = _static_compile(replay, _build_options(options))
    if _is_symbolic(gm, example_inputs) and not replay:  # one symbolic trace, partitions per shape
        return compile_static(gm, example_inputs)
    if _is_symbolic(gm, example_inputs):
        per_shape = _PerShape(gm, compile_static)
        per_shape._boxed_call = per_shape.boxed
        return per_shape
    return compile_static(gm, example_inputs)


def explain() -> str:
    """What the graphs compiled so far (the last REPORT_LIMIT) became: per aten graph, its ops in
    dnngraph graphs, the shape it was specialized to where dynamo's graph had symbolic sizes, and
    each op left to torch with why."""
    lines = []
    for number, report in enumerate(REPORTS):
        shape = f", specialized to {report.specialized} (dynamo traced symbolic sizes)" if report.specialized else \
            (" (traced with symbolic sizes: partitions converted per shape)" if report.per_shape else "")
        lines.append(f"aten graph {number}: {report.dnngraph_ops} ops in {report.graphs} dnngraph graph(s), "
                     f"{len(report.torch_ops)} in torch{shape}")
        lines += [f"  stays in torch: {target} ({reason})" for target, reason in report.torch_ops]
        lines += [f"  a partition of {module.ops} ops stays in torch at the shapes {module.shapes.get(key, '?')} "
                  f"({why})" for module in report.per_shape for key, why in list(module.in_torch.items())]
    return "\n".join(lines) if lines else "no aten graph compiled by the dnngraph backend yet"


def _register():
    """The name "dnngraph" for torch.compile: an installed package has it through its entry
    point; a checkout on sys.path gets it when this module is imported."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "dnngraph" not in list_backends(exclude_tags=()):
        register_backend(backend, name="dnngraph")


_register()
