"""`dnngraph.jit`: a function that declares a graph becomes a function on torch tensors, its
graph built once per key and cached (the cuDNN frontend's `jit` / `graph_cache` helpers).

    @dg.jit
    def block(g, x, w, alpha=1.0):            # g: a fresh Graph; x, w: its tensors, made from
        return g.relu(g.scale(g.matmul(x, w), alpha))   # the torch arguments (tensor_like)

    y = block(xt, wt, alpha=0.5)               # declared and built on the first call of this key

The key of a call is, per argument, a torch tensor's shape, dtype, strides and device type, or
any other argument's type and value (hashable: it reaches the graph as a constant), together
with the build options. A call whose key is cached runs the built graph (Graph.as_function:
outputs allocated and returned, differentiable through torch.autograd); a new key declares the
graph again and builds it. Up to `maxsize` graphs are kept, the least recently used dropped.
"""
from __future__ import annotations

import collections
import functools
import inspect
import threading
from typing import Callable, Optional

import torch

from .errors import ValidationError
from .graph import Graph
from .options import BuildOptions
from .tensor import Tensor

GRAPH_CACHE_ENTRIES = 256


def _argument_key(name: str, value) -> tuple:
    """What of one argument decides the graph: a tensor's layout, any other value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, tuple(value.stride()), value.device.type)
    try:
        hash(value)
    except TypeError:
        raise ValidationError(f"dnngraph.jit: argument {name!r} ({type(value).__name__}) is neither a torch.Tensor "
                              f"nor hashable, so it cannot key the graph cache") from None
    return ("value", type(value), value)


class GraphCache:
    """The decorated function: its graphs by key (see the module's docstring); thread-safe."""

    def __init__(self, declare: Callable, options: Optional[BuildOptions], maxsize: int, graph_settings: dict,
                 key: Optional[Callable] = None):
        if not callable(declare):
            raise ValidationError(f"dnngraph.jit decorates a function, got {type(declare).__name__}")
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValidationError(f"dnngraph.jit: maxsize expects an int >= 1, got {maxsize!r}")
        if options is not None and not isinstance(options, BuildOptions):
            raise ValidationError(f"dnngraph.jit: options must be a dnngraph.BuildOptions, got {type(options).__name__}")
        if key is not None and not callable(key):
            raise ValidationError(f"dnngraph.jit: key must be a function of the call's arguments, got {key!r}")
        self.declare, self.options, self.maxsize, self.key = declare, options, maxsize, key
        self.graph_settings = dict(graph_settings)
        self.signature = inspect.signature(declare)
        self._functions: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        functools.update_wrapper(self, declare)

    def _bound(self, args, kwargs) -> inspect.BoundArguments:
        """The call's arguments by parameter name (the first parameter, the graph, left out)."""
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as error:
            raise ValidationError(f"{self.declare.__name__}: {error}") from None
        bound.apply_defaults()
        return bound

    def _declared(self, bound: inspect.BoundArguments):
        """(as_function callable, graph) of a new key: the graph declared by the decorated
        function on graph tensors made from the tensor arguments, its results as outputs."""
        graph = Graph(name=self.declare.__name__, **self.graph_settings)
        arguments, inputs = collections.OrderedDict(bound.arguments), []
        graph_parameter, *names = list(arguments)
        arguments[graph_parameter] = graph
        for name in names:
            if isinstance(arguments[name], torch.Tensor):
                arguments[name] = graph.tensor_like(arguments[name], name=name)
                inputs.append(arguments[name])
        call = inspect.BoundArguments(self.signature, arguments)
        results = self.declare(*call.args, **call.kwargs)
        outputs = list(results) if isinstance(results, (tuple, list)) else [results]
        if not outputs or not all(isinstance(t, Tensor) for t in outputs):
            raise ValidationError(f"{self.declare.__name__}: a jit function returns the graph tensor(s) to output, "
                                  f"got {results!r}")
        for tensor in outputs:
            tensor.set_output(True)
        return graph.as_function(inputs, outputs, self.options), graph

    def _key(self, bound: inspect.BoundArguments):
        """The cache key of a call: the `key` function's value of its arguments where one was
        given (the frontend's graph_cache(key_fn)), else each argument's _argument_key."""
        if self.key is not None:
            found = self.key(*bound.args[1:], **bound.kwargs)
            try:
                hash(found)
            except TypeError:
                raise ValidationError(f"dnngraph.jit: key returned an unhashable {type(found).__name__}") from None
            return ("key", found)
        return tuple(_argument_key(name, value) for name, value in list(bound.arguments.items())[1:])

    def __call__(self, *args, **kwargs):
        bound = self._bound(args, kwargs)
        key = self._key(bound)
        with self._lock:
            found = self._functions.get(key)
            if found is not None:
                self._functions.move_to_end(key)
                self.hits += 1
        if found is None:
            found = self._declared(bound)
            with self._lock:
                self.misses += 1
                self._functions[key] = found
                while len(self._functions) > self.maxsize:
                    self._functions.popitem(last=False)
        function, _ = found
        return function(*[value for value in list(bound.arguments.values())[1:] if isinstance(value, torch.Tensor)])

    def graph_for(self, *args, **kwargs) -> Graph:
        """The graph a call with these arguments runs, declared (not built) where its key is new:
        explain() or plans() of it say what a call runs."""
        key = self._key(self._bound(args, kwargs))
        with self._lock:
            found = self._functions.get(key)
        return found[1] if found is not None else self._declared(self._bound(args, kwargs))[1]

    def cache_info(self) -> dict:
        """Hits, misses and graphs kept (as functools' caches say it)."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._functions), "maxsize": self.maxsize}

    def cache_clear(self) -> None:
        """Forget every graph (the next call of each key declares and builds again)."""
        with self._lock:
            self._functions.clear()
            self.hits = self.misses = 0


def jit(function: Optional[Callable] = None, *, options: Optional[BuildOptions] = None,
        maxsize: int = GRAPH_CACHE_ENTRIES, key: Optional[Callable] = None, **graph_settings):
    """Decorate `function(graph, *arguments)`, which declares a graph on `graph` from graph
    tensors in place of the torch tensor arguments and returns its output tensor(s): calls on
    torch tensors build the graph once per key (tensor shapes, dtypes, strides and device type,
    other arguments' values, `options`; or the value of `key(*arguments)`, which must then tell
    apart every graph the function declares) and run it. `graph_settings` are the Graph's own
    (io_data_type, intermediate_data_type, compute_data_type, allow_tf32). Usable bare
    (@dg.jit) or with arguments (@dg.jit(options=...))."""
    def decorate(declare):
        return GraphCache(declare, options, maxsize, graph_settings, key)

    return decorate if function is None else decorate(function)
