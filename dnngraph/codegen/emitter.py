"""The expression emitter: renders a chain of pointwise nodes as Triton statements.

Every family uses it for prologues and epilogues; the pointwise family is nothing but it.
Values are kept in the compute type ("f") or as predicates ("b"); conversions are inserted
where a consumer needs the other kind.
"""
from __future__ import annotations

import math

from .. import dtypes
from ..ops.pointwise import PointwiseAttrs
from .expressions import CAST_TO_BOOL, CAST_TO_FLOAT, CAST_TO_INT, CONVERT, EXPRESSIONS


class ExpressionEmitter:
    """Collects statements; `values` maps tensor uid -> (variable, kind)."""

    def __init__(self, compute_type: str):
        self.compute = compute_type
        self.lines: list[str] = []
        self.globals: list[str] = []  # module-level constexprs (non-finite constants)
        self.values: dict[int, tuple[str, str]] = {}
        self._count = 0

    def bind(self, uid: int, variable: str, kind: str):
        self.values[uid] = (variable, kind)

    def literal(self, value: float) -> str:
        if math.isfinite(value):
            return repr(float(value))
        name = f"CONST_{len(self.globals)}"
        self.globals.append(f'{name} = tl.constexpr(float("{value}"))')
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

    def emit(self, node) -> str:
        """Emit the statement of one pointwise node; returns its variable."""
        expression = self._expression(node)
        attrs: PointwiseAttrs = node.attrs
        constants = dict(attrs.constants)
        operands = []
        for position, kind in enumerate(expression.inputs):
            if position in constants:
                operands.append(self.literal(constants[position]) if kind == "f"
                                else str(constants[position] != 0))
            else:
                operands.append(self.value(node.inputs[position].uid, kind))
        fields = {name: self.literal(getattr(attrs, name))
                  for name in ("negative_slope", "alpha", "beta", "threshold")}
        if node.op == "cast":
            fields["target"] = dtypes.by_name(attrs.data_type).triton_type
        variable = f"v{self._count}"
        self._count += 1
        text = expression.template.format(*operands, compute=self.compute, **fields)
        self.lines.append(f"{variable} = {text}  # {node.op} {node.name}")
        self.bind(node.outputs[0].uid, variable, expression.result)
        return variable
