"""A graph as a torch function: `Graph.as_function(inputs, outputs)`.

The callable takes torch tensors positionally, allocates the outputs in their inferred layouts
on the inputs' device and runs on the current stream. When autograd records (grad enabled and
an input requires grad) it runs the forward graph of a derivation (autodiff.py), which also
keeps the values the backward reads, and the backward graph fills the input gradients; each
derivation is built once per set of inputs that want gradients. Inputs that want none cost
nothing: their gradients are not computed.
"""
from __future__ import annotations

import threading

import torch

from .autodiff import derive, replay
from .errors import ExecutionError, ValidationError
from .tensor import overlaps


def _conformed(tensor, arg: torch.Tensor, what: str) -> torch.Tensor:
    """`arg` in the declared layout of graph tensor `tensor` (copied when its strides differ)."""
    if not isinstance(arg, torch.Tensor):
        raise ExecutionError(f"{what}: expects a torch.Tensor, got {type(arg).__name__}")
    if tuple(arg.shape) != tuple(tensor.dim):
        raise ExecutionError(f"{what}: expects shape {list(tensor.dim)}, got {list(arg.shape)}")
    if arg.dtype != tensor.data_type.torch_dtype:
        raise ExecutionError(f"{what}: expects {tensor.data_type.torch_dtype}, got {arg.dtype}")
    strides = arg.stride()
    if any(size > 1 and strides[a] != tensor.stride[a] for a, size in enumerate(tensor.dim)):
        if overlaps(tensor.dim, tensor.stride):
            raise ExecutionError(f"{what}: declared with overlapping strides {list(tensor.stride)} (an expanded "
                                 f"tensor), got strides {list(strides)}: pass a tensor expanded the same way")
        arg = torch.empty_strided(tensor.dim, tensor.stride, dtype=arg.dtype, device=arg.device).copy_(arg)
    return arg.detach()


def _allocated(tensor, device) -> torch.Tensor:
    return torch.empty_strided(tensor.dim, tensor.stride, dtype=tensor.data_type.torch_dtype, device=device)


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


class GraphFunction:
    """A graph's ops as a callable on torch tensors, differentiable through torch.autograd."""

    def __init__(self, graph, inputs=None, outputs=None):
        graph.validate()
        self.inputs = _resolve(graph, inputs, graph.inputs(), "inputs")
        self.outputs = _resolve(graph, outputs, graph.outputs(), "outputs")
        if any(t.producer is not None for t in self.inputs):
            raise ValidationError("as_function: inputs must be graph inputs")
        if not self.outputs:
            raise ValidationError(f"as_function: graph {graph.name!r} has no outputs to return")
        read = {t.uid for n in graph.nodes for t in n.input_tensors()}
        missing = [t.name for t in graph.inputs() if t.uid in read and all(t is not i for i in self.inputs)]
        if missing:
            raise ValidationError(f"as_function: graph inputs {missing} are read but not among the inputs")
        self.graph = graph
        self._lock = threading.Lock()
        self._plain = None
        self._derivations: dict = {}  # wanted mask -> (Derivation, input positions it reads)

    def __call__(self, *args):
        if len(args) != len(self.inputs):
            raise ExecutionError(f"{self.graph.name}: takes {len(self.inputs)} tensors, got {len(args)}")
        wanted = tuple(torch.is_grad_enabled() and isinstance(a, torch.Tensor) and a.requires_grad
                       and t.data_type.is_floating for a, t in zip(args, self.inputs))
        if any(wanted):
            results = _Autograd.apply(self, wanted, *args)
        else:
            results = self._run_plain(args)
        return results[0] if len(results) == 1 else tuple(results)

    # --- without autograd ------------------------------------------------------------------------
    def _plain_graph(self):
        with self._lock:
            if self._plain is None:
                plain, mapped = replay(self.graph, self.graph.name + ".function", outputs=self.outputs)
                outputs = [mapped[t.uid] for t in self.outputs]
                plain.build()
                self._plain = (plain, [mapped[t.uid] for t in self.inputs], outputs)
            return self._plain

    def _run_plain(self, args) -> list:
        graph, inputs, outputs = self._plain_graph()
        bindings = {t: _conformed(t, a, f"{self.graph.name} input {t.name!r}") for t, a in zip(inputs, args)}
        device = next(iter(bindings.values())).device if bindings else torch.device("cpu")
        results = [_allocated(t, device) for t in outputs]
        graph.execute({**bindings, **dict(zip(outputs, results))})
        return results

    # --- with autograd ---------------------------------------------------------------------------
    def derivation(self, wanted: tuple):
        """The derivation for inputs `wanted` (built graphs), made once per mask."""
        with self._lock:
            found = self._derivations.get(wanted)
            if found is None:
                derivation = derive(self.graph, self.inputs, self.outputs, list(wanted))
                derivation.forward.build()
                if any(g is not None for g in derivation.grads):
                    derivation.backward.build()
                position = {t.name: i for i, t in enumerate(self.inputs)}
                found = (derivation, [position[t.name] for t in derivation.forward_inputs])
                self._derivations[wanted] = found
            return found


class _Autograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: GraphFunction, wanted, *args):
        derivation, reads = fn.derivation(wanted)
        forward = derivation.forward
        inputs = {t.name: t for t in forward.inputs()}
        bindings = {}
        for original, arg in zip(fn.inputs, args):
            twin = inputs.get(original.name)
            if twin is not None:
                bindings[twin] = _conformed(twin, arg, f"{fn.graph.name} input {original.name!r}")
        device = args[0].device
        made = {t.uid: _allocated(t, device) for t in derivation.outputs + derivation.saved}
        forward.execute({**bindings, **{t: made[t.uid] for t in derivation.outputs + derivation.saved}})
        results = [made[t.uid] for t in derivation.outputs]
        ctx.fn, ctx.wanted = fn, wanted
        ctx.save_for_backward(*[args[i] for i in reads], *[made[t.uid] for t in derivation.saved])
        for tensor, result in zip(derivation.outputs, results):
            if not tensor.data_type.is_floating:
                ctx.mark_non_differentiable(result)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grad_outputs):
        derivation, reads = ctx.fn.derivation(ctx.wanted)
        stored = ctx.saved_tensors
        read_args, saved = stored[:len(reads)], stored[len(reads):]
        bindings = {}
        for twin, value in zip(derivation.forward_input_twins, read_args):
            bindings[twin] = _conformed(twin, value, f"{twin.name}")
        for twin, value in zip(derivation.saved_inputs, saved):
            bindings[twin] = value
        for twin, grad in zip(derivation.grad_inputs, grad_outputs):
            if twin is not None:
                bindings[twin] = _conformed(twin, grad.to(twin.data_type.torch_dtype), f"gradient {twin.name}")
        device = grad_outputs[0].device
        results = {t.uid: _allocated(t, device) for t in derivation.grads if t is not None}
        if results:
            derivation.backward.execute({**bindings, **{t: results[t.uid] for t in derivation.grads if t is not None}})
        grads = []
        for tensor, grad, want in zip(ctx.fn.inputs, derivation.grads, ctx.wanted):
            if not want:
                grads.append(None)
            elif grad is None:  # no path from this input to an output
                grads.append(torch.zeros(tensor.dim, dtype=tensor.data_type.torch_dtype, device=device))
            else:
                grads.append(results[grad.uid])
        if torch.is_grad_enabled():  # create_graph=True: the gradients must not pass for constants
            grads = _not_twice(grads)
        return (None, None, *grads)


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
