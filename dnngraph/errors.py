"""Typed errors: every failure names the op and tensors involved."""


class GraphError(Exception):
    """Base class of every error dnngraph raises."""


class ValidationError(GraphError, ValueError):
    """Bad shapes, dtypes, attributes or graph structure."""


class UnsupportedError(GraphError):
    """A valid graph that no kernel can run yet."""


class ExecutionError(GraphError):
    """Bad bindings at execute: missing, wrong shape, dtype, stride, device, aliasing."""


class SerializationError(GraphError):
    """A malformed, inconsistent or newer-version JSON document."""
