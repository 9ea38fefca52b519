"""The expression emitter: renders a chain of pointwise nodes as Triton statements.

Every family uses it for prologues and epilogues; the pointwise family is nothing but it.
Values are kept in the compute type ("f") or as predicates ("b"); conversions are inserted
where a consumer needs the other kind.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

from .. import dtypes
from ..errors import UnsupportedError, ValidationError
from .expressions import CAST_TO_BOOL, CAST_TO_FLOAT, CAST_TO_INT, CONVERT, EXPRESSIONS
from .names import NameAllocator, comment_text


class ExpressionEmitter:
    """Collects statements; `values` maps tensor uid -> (variable, kind).

    Every variable, module constant and scalar argument it introduces comes from `names`, the
    kernel's allocator (several emitters may share one kernel and one allocator). `counter`
    names the variable holding each element's logical row-major index, where the kernel
    computes one (the pointwise family); `scalars` lists (argument name, int) that the kernel
    must take as runtime integer arguments.
    """

    def __init__(self, compute_type: str, counter: Optional[str] = None, hint: str = "v",
                 names: Optional[NameAllocator] = None):
        self.compute = compute_type
        self.names = names if names is not None else NameAllocator()
        self.hint = hint  # value variables are hint, hint1, ...
        self.counter = counter
        self.lines: list[str] = []
        self.globals: list[str] = []  # module-level constexprs (non-finite constants)
        self.scalars: list[tuple[str, int]] = []
        self.values: dict[int, tuple[str, str]] = {}

    def bind(self, uid: int, variable: str, kind: str):
        self.values[uid] = (variable, kind)

    def literal(self, value) -> str:
        """Source text of a number: repr of an int or finite float, or a module constant for
        inf and NaN. Anything else raises ValidationError: attribute values reach the source
        only as numbers, never as text."""
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real)):
            raise ValidationError(f"a kernel literal must be an int or a float, got "
                                  f"{type(value).__name__}")
        if isinstance(value, numbers.Integral):
            return repr(int(value))
        value = float(value)
        if math.isfinite(value):
            return repr(value)
        name = self.names.fresh("CONST")
        text = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        self.globals.append(f'{name} = tl.constexpr(float("{text}"))')
        return name

    def value(self, uid: int, kind: str) -> str:
        """The variable holding tensor `uid`, converted to `kind`."""
        variable, have = self.values[uid]
        if have == kind:
            return variable
        return CONVERT[(have, kind)].format(variable, compute=self.compute)

    def _expression(self, node):
        if node.op != "cast":
            return EXPRESSIONS[node.op]
        target = dtypes.by_name(node.attrs.data_type)
        if target is dtypes.bool_:
            return CAST_TO_BOOL
        return CAST_TO_FLOAT if target.is_floating else CAST_TO_INT

    def _literal_of(self, node, what: str, value) -> str:
        try:
            return self.literal(value)
        except ValidationError as error:
            raise ValidationError(f"node {node.name!r} ({node.op}): {what}: {error}") from None

    def _operands(self, node, expression) -> list[str]:
        constants = dict(getattr(node.attrs, "constants", ()))
        operands = []
        for position, kind in enumerate(expression.inputs):
            if position in constants:
                text = self._literal_of(node, f"constant operand {position}", constants[position])
                operands.append(text if kind == "f" else f"({text} != 0)")
            else:
                operands.append(self.value(node.inputs[position].uid, kind))
        return operands

    def _fields(self, node, expression) -> dict:
        fields = {}
        for name, value in expression.fields(node.attrs).items():
            # a data type is source text from the fixed table of types; the rest are numbers
            fields[name] = (value.triton_type if isinstance(value, dtypes.DataType)
                            else self._literal_of(node, f"attribute {name}", value))
        if expression.scalars is not None:
            for name, value in expression.scalars(node.attrs).items():
                argument = self.names.fresh(name)  # seed, offset; seed1, offset1 for the next
                self.scalars.append((argument, int(value)))
                fields[name] = argument
        if expression.counter:
            if self.counter is None:
                raise UnsupportedError(f"node {node.name!r} ({node.op}) needs each element's logical "
                                       f"index, which only pointwise kernels compute")
            fields["counter"] = self.counter
        return fields

    def emit(self, node) -> str:
        """Emit the statement of one pointwise node; returns the variable of its first output."""
        expression = self._expression(node)
        operands = self._operands(node, expression)
        fields = self._fields(node, expression)
        variables = [self.names.fresh(self.hint) for _ in expression.result]
        text = expression.template.format(*operands, compute=self.compute, **fields)
        self.lines.append(f"{', '.join(variables)} = {text}  # {comment_text(f'{node.op} {node.name}')}")
        for tensor, variable, kind in zip(node.outputs, variables, expression.result):
            if tensor is not None:
                self.bind(tensor.uid, variable, kind)
        return variables[0]
