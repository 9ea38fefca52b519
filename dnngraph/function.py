"""A graph as a torch function: `Graph.as_function(inputs, outputs)`.

The callable takes torch tensors positionally, allocates the outputs in their inferred layouts
on the inputs' device and runs on the current stream. When autograd records (grad enabled and
an input requires grad) it runs the forward graph of a derivation (autodiff.py), which also
keeps the values the backward reads, and the backward graph fills the input gradients; each
derivation is built once per set of inputs that want gradients. Inputs that want none cost
nothing: their gradients are not computed.
"""
from __future__ import annotations

import itertools
import threading

import torch

from . import dtypes
from .autodiff import derive, replay
from .errors import ExecutionError, ValidationError
from .runtime.bindings import check_bindable, resolved_input, unbindable
from .tensor import overlaps, stride_order


def _layout(tensor) -> tuple:
    """(shape, strides) of the torch tensor holding graph tensor `tensor` (packed fp4: half the
    items along its stride-1 axis)."""
    return dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)


def _conformed(tensor, arg: torch.Tensor, what: str) -> torch.Tensor:
    """`arg` in the declared layout of graph tensor `tensor` (copied when its strides differ)."""
    if not isinstance(arg, torch.Tensor):
        raise ExecutionError(f"{what}: expects a torch.Tensor, got {type(arg).__name__}")
    shape, stride = _layout(tensor)
    if tuple(arg.shape) != shape:
        raise ExecutionError(f"{what}: expects shape {list(shape)}, got {list(arg.shape)}")
    if arg.dtype != tensor.data_type.torch_dtype:
        raise ExecutionError(f"{what}: expects {tensor.data_type.torch_dtype}, got {arg.dtype}")
    strides = arg.stride()
    if any(size > 1 and strides[a] != stride[a] for a, size in enumerate(shape)):
        if overlaps(shape, stride):
            raise ExecutionError(f"{what}: declared with overlapping strides {list(stride)} (an expanded "
                                 f"tensor), got strides {list(strides)}: pass a tensor expanded the same way")
        copy = torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device)
        if tensor.data_type.is_block_scale_storage:  # torch copies these as their bytes only
            copy.view(torch.uint8).copy_(arg.view(torch.uint8))
        else:
            copy.copy_(arg)
        arg = copy
    return arg.detach()


def _text(what, position: int) -> str:
    """An input's name for an error: `what` itself, or what it gives for `position`."""
    return what if isinstance(what, str) else what(position)


def _allocated(tensor, device) -> torch.Tensor:
    return torch.empty_strided(*_layout(tensor), dtype=tensor.data_type.torch_dtype, device=device)


class _Runner:
    """One built graph run on torch tensors, its layouts read once: inputs that already have their
    declared dtype, shape and strides pass as they are (else _conformed checks and copies), outputs
    are allocated in theirs, and the plan reads only addresses on a repeated call."""

    def __init__(self, graph, inputs: list, outputs: list):
        self.graph = graph
        self.inputs = [(t, *_layout(t), t.data_type.torch_dtype,
                        tuple(a for a, size in enumerate(_layout(t)[0]) if size > 1)) for t in inputs]
        self.outputs = [(*_layout(t), t.data_type.torch_dtype) for t in outputs]
        self.keys = tuple(inputs) + tuple(outputs)
        self.token = object()

    def conformed(self, position: int, arg, what, checked: bool = False) -> torch.Tensor:
        """Input `position` as the plan reads it: a kind of tensor kernels can bind (a lazily
        negated view resolved), in its declared layout. Every run of the function passes here,
        the custom ops' (torch.compile, autograd's backward) included. `what` names the input in
        errors: a str, or a function of `position` giving it (called only to raise or copy).
        `checked`: the caller has just checked `arg` is a bindable tensor (GraphFunction's eager
        call), so that is not read again."""
        tensor, shape, stride, dtype, checked_axes = self.inputs[position]
        is_tensor = checked or isinstance(arg, torch.Tensor)
        if is_tensor:
            if not checked and unbindable(arg) is not None:
                check_bindable(arg, _text(what, position), is_output=False)
            if arg.is_neg():
                arg = resolved_input(arg)
        if is_tensor and arg.dtype == dtype and arg.shape == shape:
            strides = arg.stride()
            if strides == stride or all(strides[a] == stride[a] for a in checked_axes):
                return arg.detach() if arg.requires_grad or arg.__class__ is not torch.Tensor else arg
        if tensor.ragged_offset is not None:  # a copy would move the packed rows away from their offsets
            raise ExecutionError(f"{_text(what, position)} is ragged: pass a view of its packed buffer with the "
                                 f"declared dtype {dtype}, shape {list(shape)} and strides {list(stride)}")
        return _conformed(tensor, arg, _text(what, position))

    def __call__(self, args: list, device) -> list:
        """The outputs of the graph on `args` (already conformed), allocated on `device`."""
        results = [torch.empty_strided(dim, stride, dtype=dtype, device=device) for dim, stride, dtype in self.outputs]
        plan = self.graph.plan
        if plan is None:
            raise ExecutionError(f"graph {self.graph.name!r} is not built (or changed since): call build()")
        plan.execute_conformed(self.token, self.keys, args + results)
        return results


def _resolve(graph, items, default, what: str) -> list:
    if items is None:
        return list(default)
    if not isinstance(items, (list, tuple)):
        raise ValidationError(f"as_function: {what} must be a list of tensors or names, got {type(items).__name__}")
    resolved = []
    for item in items:
        tensor = graph.tensor_by_name(item) if isinstance(item, str) else item
        if getattr(tensor, "graph", None) is not graph:
            raise ValidationError(f"as_function: {item!r} is not a tensor of graph {graph.name!r}")
        resolved.append(tensor)
    if len({t.uid for t in resolved}) != len(resolved):
        raise ValidationError(f"as_function: {what} name a tensor twice")
    return resolved


_NUMBER = itertools.count()


class GraphFunction:
    """A graph's ops as a callable on torch tensors, differentiable through torch.autograd.

    Under torch.compile, and whenever gradients are wanted, calls go through torch.library custom
    ops (dnngraph::function<N>, with fake implementations), so torch.compile(fullgraph=True)
    traces them and CUDA graphs capture them: one op without autograd, and a training op that
    takes the mask of inputs wanting gradients and returns the outputs, then the values the
    backward reads, with a backward op registered as its gradient. An eager call without
    gradients runs the plan directly."""

    def __init__(self, graph, inputs=None, outputs=None, options=None):
        graph.validate()
        self.options = options  # the BuildOptions of every graph it builds (None: the defaults)
        self.inputs = _resolve(graph, inputs, graph.inputs(), "inputs")
        self.outputs = _resolve(graph, outputs, graph.outputs(), "outputs")
        if any(t.producer is not None for t in self.inputs):
            raise ValidationError("as_function: inputs must be graph inputs")
        if not self.outputs:
            raise ValidationError(f"as_function: graph {graph.name!r} has no outputs to return")
        blended = [t.name for t in graph.outputs() if t.blend is not None]
        if blended:  # its outputs are fresh memory: no prior content to blend with
            raise ValidationError(f"as_function: output {blended[0]!r} is blended (set_blend), and the function "
                                  f"allocates its outputs; execute the graph on your own tensors instead")
        read = {t.uid for n in graph.nodes for t in n.input_tensors()}
        missing = [t.name for t in graph.inputs() if t.uid in read and all(t is not i for i in self.inputs)]
        if missing:
            raise ValidationError(f"as_function: graph inputs {missing} are read but not among the inputs")
        self.graph = graph
        self.op_name = f"dnngraph::function{next(_NUMBER)}"
        self._lock = threading.RLock()
        self._plain = self._plain_runner = None
        self._derivation_runners: dict = {}  # wanted mask -> (forward runner, input positions, backward runner)
        self._derivations: dict = {}  # wanted mask -> (Derivation, input positions it reads)
        self._plain_op, self._training_op = _custom_ops(self)

    def __call__(self, *args):
        inputs = self.inputs
        if len(args) != len(inputs):
            raise ExecutionError(f"{self.graph.name}: takes {len(inputs)} tensors, got {len(args)}")
        compiling = torch.compiler.is_compiling()
        grad = torch.is_grad_enabled()
        wanted = False
        for position, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                raise ExecutionError(f"{self._input_text(position)}: expects a torch.Tensor, got {type(arg).__name__}")
            # before torch.library's dispatch, which has no sparse or nested kernel to find; a traced
            # call is checked where its op runs (_Runner.conformed)
            if not compiling and unbindable(arg) is not None:
                check_bindable(arg, self._input_text(position), is_output=False)
            wanted = wanted or (grad and arg.requires_grad and inputs[position].data_type.is_floating)
        if wanted:
            wanted = [a.requires_grad and t.data_type.is_floating for a, t in zip(args, inputs)]
            results = self._training_op(list(args), wanted)[:len(self.outputs)]
        elif compiling:
            results = self._plain_op(list(args))
        else:  # eager: no custom op dispatch (CUDA graphs capture this path as well)
            results = self._run_eager(args)
        return results[0] if len(results) == 1 else tuple(results)

    def _input_text(self, position: int) -> str:
        """How errors name input `position` (formatted only when one is raised)."""
        return f"{self.graph.name} input {self.inputs[position].name!r}"

    # --- without autograd ------------------------------------------------------------------------
    def _plain_graph(self, build: bool = True):
        with self._lock:
            if self._plain is None:
                plain, mapped = replay(self.graph, self.graph.name + ".function", outputs=self.outputs)
                outputs = [mapped[t.uid] for t in self.outputs]
                self._plain = (plain, [mapped[t.uid] for t in self.inputs], outputs)
                self._plain_runner = _Runner(*self._plain)
            if build and self._plain[0].plan is None:
                self._plain[0].build(options=self.options)
            return self._plain

    def _run_plain(self, args) -> list:
        """The plain custom op's implementation: every input checked here (a traced call's
        arguments were not checked before it)."""
        self._plain_graph()
        runner = self._plain_runner
        conformed = [runner.conformed(i, a, self._input_text) for i, a in enumerate(args)]
        device = args[0].device if args else torch.device("cpu")
        return runner(conformed, device)

    def _run_eager(self, args) -> list:
        """An eager call without gradients, its arguments checked by __call__ just before: no lock
        once the plain graph is built, and each input's kind is not read twice. Loops, not
        comprehensions: each of those is a call of its own on every function call."""
        runner = self._plain_runner
        plan = runner.graph.plan if runner is not None else None
        if plan is None:
            self._plain_graph()
            runner = self._plain_runner
        device = args[0].device if args else torch.device("cpu")
        values = []
        conformed, what = runner.conformed, self._input_text
        for position, arg in enumerate(args):
            values.append(conformed(position, arg, what, True))
        if plan is None:
            return runner(values, device)
        # what _Runner.__call__ does, with the plan already in hand: one call less
        results = []
        for dim, stride, dtype in runner.outputs:
            results.append(torch.empty_strided(dim, stride, dtype=dtype, device=device))
        plan.execute_conformed(runner.token, runner.keys, values + results, device)
        return results

    # --- with autograd ---------------------------------------------------------------------------
    def derivation(self, wanted: tuple):
        """The derivation for inputs `wanted` (built graphs), made once per mask."""
        with self._lock:
            found = self._derivations.get(wanted)
            if found is None:
                derivation = derive(self.graph, self.inputs, self.outputs, list(wanted))
                position = {t.name: i for i, t in enumerate(self.inputs)}
                found = (derivation, [position[t.name] for t in derivation.forward_inputs])
                self._derivations[wanted] = found
            return found

    def _built(self, wanted: tuple):
        derivation, reads = self.derivation(wanted)
        with self._lock:
            if derivation.forward.plan is None:
                derivation.forward.build(options=self.options)
            if any(g is not None for g in derivation.grads) and derivation.backward.plan is None:
                derivation.backward.build(options=self.options)
        return derivation, reads

    def _runners(self, wanted: tuple):
        """(forward runner, positions of the inputs it reads, backward runner or None) of
        derivation `wanted`, built."""
        derivation, _ = self._built(wanted)
        with self._lock:
            found = self._derivation_runners.get(wanted)
            if found is None:
                twins = {t.name: t for t in derivation.forward.inputs()}
                taken = [i for i, t in enumerate(self.inputs) if t.name in twins]
                forward = _Runner(derivation.forward, [twins[self.inputs[i].name] for i in taken],
                                  derivation.outputs + _saved_apart(derivation))
                grads = list({t.uid: t for t in derivation.grads if t is not None}.values())
                backward = None
                if grads:
                    bound = (list(derivation.forward_input_twins) + list(derivation.saved_inputs)
                             + [t for t in derivation.grad_inputs if t is not None])
                    backward = _Runner(derivation.backward, bound, grads)
                found = self._derivation_runners[wanted] = (forward, taken, backward)
            return found

    def run_forward(self, wanted: tuple, args) -> list:
        """Outputs, then the saved values, of the forward graph of derivation `wanted`."""
        forward, taken, _ = self._runners(wanted)
        conformed = [forward.conformed(k, args[i], f"{self.graph.name} input {self.inputs[i].name!r}")
                     for k, i in enumerate(taken)]
        return forward(conformed, args[0].device)

    def run_backward(self, wanted: tuple, reads, saved, grads) -> list:
        """The gradients of the wanted inputs (zeros where no path leads to an output)."""
        derivation, _ = self._built(wanted)
        _, _, backward = self._runners(wanted)
        device = grads[0].device
        results = {}
        if backward is not None:
            values = list(reads) + list(saved)
            values += [grad.to(twin.data_type.torch_dtype)
                       for twin, grad in zip(derivation.grad_inputs, grads) if twin is not None]
            twins = len(reads)
            conformed = [backward.conformed(k, v, backward.inputs[k][0].name) if (k < twins or k >= twins + len(saved))
                         else v for k, v in enumerate(values)]
            computed = backward(conformed, device)
            results = {t.uid: r for (t, r) in zip(backward.keys[len(backward.inputs):], computed)}
        return [results[g.uid] if g is not None else torch.zeros(t.dim, dtype=t.data_type.torch_dtype, device=device)
                for t, g, want in zip(self.inputs, derivation.grads, wanted) if want]


def _saved_apart(derivation) -> list:
    """Saved values that are not outputs too (a custom op returns each tensor once)."""
    return [t for t in derivation.saved if all(t is not o for o in derivation.outputs)]


def _saved_positions(derivation) -> list:
    """Where each saved value is among the forward op's results (outputs, then the rest)."""
    returned = derivation.outputs + _saved_apart(derivation)
    return [next(i for i, t in enumerate(returned) if t is s) for s in derivation.saved]


def _custom_ops(fn: GraphFunction):
    """The function's custom ops: (plain, training). The training op takes the mask of inputs
    that want gradients; its gradient is the backward op."""
    name = fn.op_name
    plain = torch.library.custom_op(name, fn._run_plain, mutates_args=(), schema="(Tensor[] inputs) -> Tensor[]")
    plain.register_fake(lambda args: [_allocated(t, args[0].device) for t in fn._plain_graph(build=False)[2]])

    def run_forward(args, wanted):
        return fn.run_forward(tuple(wanted), args)

    def fake_forward(args, wanted):
        derivation, _ = fn.derivation(tuple(wanted))
        return [_allocated(t, args[0].device) for t in derivation.outputs + _saved_apart(derivation)]

    def run_backward(reads, saved, grads, wanted):
        return fn.run_backward(tuple(wanted), reads, saved, grads)

    def fake_backward(reads, saved, grads, wanted):
        return [_allocated(t, grads[0].device) for t, want in zip(fn.inputs, wanted) if want]

    forward = torch.library.custom_op(name + "_training", run_forward, mutates_args=(),
                                      schema="(Tensor[] inputs, bool[] wanted) -> Tensor[]")
    forward.register_fake(fake_forward)
    backward = torch.library.custom_op(name + "_backward", run_backward, mutates_args=(),
                                       schema="(Tensor[] reads, Tensor[] saved, Tensor[] grads, bool[] wanted) -> Tensor[]")
    backward.register_fake(fake_backward)
    count = len(fn.outputs)

    def setup_context(ctx, inputs, output):
        args, wanted = inputs
        derivation, reads = fn.derivation(tuple(wanted))
        ctx.save_for_backward(*[args[i] for i in reads], *[output[i] for i in _saved_positions(derivation)])
        ctx.reads, ctx.wanted = len(reads), list(wanted)

    def gradient(ctx, grads):
        stored = ctx.saved_tensors
        outputs = fn.derivation(tuple(ctx.wanted))[0].outputs
        grads = [g if g is not None else torch.zeros(t.dim, dtype=t.data_type.torch_dtype, device=stored[0].device)
                 for g, t in zip(grads[:count], outputs)]
        if not torch.compiler.is_compiling():  # before the backward op's dispatch (as in __call__)
            for grad, tensor in zip(grads, outputs):
                check_bindable(grad, f"{fn.graph.name}: the gradient of output {tensor.name!r}", is_output=False)
        computed = iter(backward(list(stored[:ctx.reads]), list(stored[ctx.reads:]), grads, ctx.wanted))
        result = [next(computed) if want else None for want in ctx.wanted]
        if torch.is_grad_enabled():  # create_graph=True: the gradients must not pass for constants
            result = _not_twice(result)
        return result, None

    forward.register_autograd(gradient, setup_context=setup_context)
    return plain, forward


class _NotTwice(torch.autograd.Function):
    """Gradients handed out under create_graph=True. The backward graph has no backward of its
    own: differentiating them raises (as torch's once_differentiable does), where gradients
    without a history would silently drop the second-order term (a gradient penalty)."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("as_function: trying to differentiate twice; the gradients of a graph "
                           "function are not differentiable (no double backward)")


def _not_twice(grads: list) -> list:
    """`grads` (None where an input wants none) through _NotTwice."""
    tensors = [g for g in grads if g is not None]
    attached = iter(_NotTwice.apply(*[g.detach().requires_grad_() for g in tensors]))
    return [None if g is None else next(attached) for g in grads]


class DynamicFunction:
    """as_function of a graph with dynamic extents: per set of sizes the arguments have (read
    from the inputs' dynamic axes, checked against the declared ranges and against each other),
    a GraphFunction of the graph at those sizes, made on first use and then found by one lookup
    (its plan and derivations built once per size; kernels shared by content). Traced by
    torch.compile it is one custom op whatever the sizes, differentiable through a second op
    that runs the derivation's forward and backward graphs of the arguments' sizes (the
    forward runs twice: the values its backward reads have per-size shapes no fake could give)."""

    def __init__(self, graph, inputs=None, outputs=None, options=None):
        from .runtime.dynamic_plan import DynamicExtents, PerSize

        graph.validate()
        self.graph, self.options = graph, options
        self.inputs = _resolve(graph, inputs, graph.inputs(), "inputs")
        self.outputs = _resolve(graph, outputs, graph.outputs(), "outputs")
        self.extents = DynamicExtents(graph, self.inputs)
        given = {s.name for s in self.extents.symbols}
        for tensor in self.outputs:
            unknown = [s.symbol.name for s in tensor.dynamic_dim_symbols or ()
                       if s is not None and s.symbol.name not in given]
            if unknown:
                raise ValidationError(f"as_function: output {tensor.name!r} has dynamic extent(s) {unknown} that no "
                                      f"input carries: the function could not size it")
        position = {t.uid: p for p, t in enumerate(self.inputs)}
        self.positions = tuple((position[t.uid], name, axis, index, coefficient)
                               for t, name, axis, index, coefficient in self.extents.sources)
        self._functions = PerSize()  # tuple of sizes -> GraphFunction of the graph at those sizes
        # per output: (dims with each dynamic axis as (input position, axis, coefficient): that
        # input axis (an input's dynamic axis is one symbol) times the output axis's coefficient,
        # its axes outermost first, torch dtype): what a traced call's outputs look like
        first = {}
        for at, _, axis, index, _ in self.positions:
            first.setdefault(index, (at, axis))
        names = [s.name for s in self.extents.symbols]
        self._layouts = [(tuple(d if s is None else (*first[names.index(s.symbol.name)], s.coefficient)
                                for d, s in zip(t.dim, t.dynamic_dim_symbols or (None,) * len(t.dim))),
                          stride_order(t.dim, t.stride), t.data_type.torch_dtype) for t in self.outputs]
        self.op_name = f"dnngraph::dynamic_function{next(_NUMBER)}"
        self._traced_op = torch.library.custom_op(self.op_name, self._run_listed, mutates_args=(),
                                                  schema="(Tensor[] inputs) -> Tensor[]")
        self._traced_op.register_fake(self._traced_outputs)
        # traced with gradients: the backward is a second op, which runs the forward of the size
        # again under autograd (its saved values have per-size shapes no fake output could give)
        self._traced_backward = torch.library.custom_op(self.op_name + "_backward", self._recomputed_gradients,
                                                        mutates_args=(),
                                                        schema="(Tensor[] inputs, Tensor[] grads, bool[] wanted) -> Tensor[]")
        self._traced_backward.register_fake(self._traced_gradients)
        self._traced_op.register_autograd(self._traced_gradient, setup_context=self._traced_saved)

    def __call__(self, *args):
        if len(args) != len(self.inputs):
            raise ExecutionError(f"{self.graph.name}: takes {len(self.inputs)} tensors, got {len(args)}")
        if torch.compiler.is_compiling():  # one custom op whose outputs take their sizes from the inputs
            results = self._traced_op(list(args))
            return results[0] if len(results) == 1 else tuple(results)
        key = self.extents.key_of_values(args, self.positions, self.graph.name)
        return self._functions.get(key, lambda: self._function_at(key))(*args)

    def _run_listed(self, args: list) -> list:
        results = self(*args)
        return list(results) if isinstance(results, tuple) else [results]

    def _traced_outputs(self, args: list) -> list:
        """The outputs of a call on `args` as empty tensors (fake or symbolic sizes): each dynamic
        axis as long as the input axis that gives it, densely packed in its own axis order."""
        made = []
        for dims, order, dtype in self._layouts:
            sizes = [args[d[0]].shape[d[1]] * d[2] if isinstance(d, tuple) else d for d in dims]
            strides, running = [0] * len(sizes), 1
            for axis in reversed(order):
                strides[axis] = running
                running = running * sizes[axis]
            made.append(args[0].new_empty_strided(sizes, strides, dtype=dtype))
        return made

    def _traced_saved(self, ctx, inputs, output) -> None:
        (args,) = inputs
        ctx.wanted = [isinstance(a, torch.Tensor) and a.requires_grad and t.data_type.is_floating
                      for a, t in zip(args, self.inputs)]
        ctx.save_for_backward(*args)

    def _traced_gradient(self, ctx, grads):
        args = list(ctx.saved_tensors)
        grads = [g if g is not None else torch.zeros_like(out) for g, out in zip(grads, self._traced_outputs(args))]
        computed = iter(self._traced_backward(args, list(grads), ctx.wanted))
        return [next(computed) if want else None for want in ctx.wanted]

    def _recomputed_gradients(self, args: list, grads: list, wanted: list) -> list:
        """The gradients of the wanted inputs: the forward graph of the derivation at the
        arguments' sizes run again (for the values its backward reads), then the backward graph."""
        key = self.extents.key_of_values(args, self.positions, self.graph.name)
        function = self._functions.get(key, lambda: self._function_at(key))
        mask = tuple(wanted)
        derivation, reads = function.derivation(mask)
        produced = function.run_forward(mask, args)
        saved = [produced[i] for i in _saved_positions(derivation)]
        computed = function.run_backward(mask, [args[i] for i in reads], saved, grads)
        return [grad.contiguous() for grad in computed]  # the layout _traced_gradients gives

    @staticmethod
    def _traced_gradients(args: list, grads: list, wanted: list) -> list:
        return [a.new_empty(a.shape) for a, want in zip(args, wanted) if want]

    def _function_at(self, key: tuple) -> GraphFunction:
        sizes = dict(zip((s.name for s in self.extents.symbols), key))
        try:
            sized = self.graph.specialised(sizes)
        except ValidationError as error:
            raise ExecutionError(f"{self.graph.name} at {sizes}: {error}") from None
        return GraphFunction(sized, [t.name for t in self.inputs], [t.name for t in self.outputs], self.options)
