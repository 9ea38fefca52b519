"""The expression emitter: renders a chain of pointwise nodes as Triton statements.

Every family uses it for prologues and epilogues; the pointwise family is nothing but it.
Values are kept in the compute type ("f") or as predicates ("b"); conversions are inserted
where a consumer needs the other kind.

A consumer sees a graph output as stored (DESIGN.md, "Data types"): the emitter holds every such
value rounded to its narrow float type (or converted to its integer or bool type) the moment it
is made, and rounds a value a family bound itself (an anchor's result) where a node reads it.
Virtual intermediates keep the compute type.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

from .... import dtypes
from ....tensor import plain_blend
from ....errors import UnsupportedError, ValidationError
from .conversions import converted_to
from ....ops.pointwise import integer_closed, relu_is_clipped
from .expressions import (CLIPPED_RELU, CONVERT, EXPRESSIONS, FAST_MATH, INTEGER_TEMPLATES, INTEGER_TYPES, SCALAR_ROOTS,
                          cast_expression, dropout_from_tensors, index_along_expression)
from .names import NameAllocator

# -0.0 as a kernel literal: Triton builds every scalar equal to 0 as a null (+0.0) constant,
# so `x * -0.0` compiled as `x * 0.0`; the sign survives only through the bits.
NEGATIVE_ZERO = "tl.full([], -2147483648, tl.int32).to(tl.float32, bitcast=True)"
QUIET_NAN = "tl.full([], 2143289344, tl.int32).to(tl.float32, bitcast=True)"  # 0x7fc00000
POSITIVE_INFINITY = "tl.full([], 2139095040, tl.int32).to(tl.float32, bitcast=True)"  # 0x7f800000
NEGATIVE_INFINITY = "tl.full([], -8388608, tl.int32).to(tl.float32, bitcast=True)"  # 0xff800000


# Appended to the pointer of a one-element operand: it loads as a [1, 1] tile, not a 0-d value.
# Triton's interpreter keeps the operand's type on a 0-d comparison, so a 0-d bool broadcast
# into a tile became float data, and `&` / `|` with it failed ("bitwise_and not supported");
# a [1, 1] tile broadcasts like any tile, on the interpreter and on the GPU alike.
SCALAR_AS_TILE = " + tl.zeros((1, 1), dtype=tl.int32)"


def kind_of(data_type) -> str:
    """The kind a value of `data_type` is held in once loaded: integers stay integers (int8 and
    uint8 widened to int32, so that math on them is exact as in torch's int32 promotion, never an
    8-bit wrap)."""
    if data_type.is_boolean:  # one byte or one bit each: held as a predicate
        return "b"
    if dtypes.is_saturating(data_type):
        return "i"
    return {dtypes.int32: "i", dtypes.int64: "l"}.get(data_type, "f")


def load_conversion(data_type, compute: str) -> str:
    """The conversion appended to a load of `data_type` to hold it in its kind (kind_of): floats
    to the compute type, int8 and uint8 widened to int32, other types as loaded."""
    if kind_of(data_type) == "f":
        return f".to({compute})"
    return ".to(tl.int32)" if dtypes.is_saturating(data_type) else ""


def element_load(pointer: str, offset: str, mask: str, data_type) -> str:
    """The text of a load of the elements at `offset` (in elements) from `pointer` under `mask`
    (0 where masked): a bit-packed boolean reads its bit of its byte (library.load_bits, `lib`)."""
    if data_type.is_bit_packed:
        return f"lib.load_bits({pointer}, {offset}, {mask})"
    return f"tl.load({pointer} + {offset}, mask={mask}, other=0)"


def masked_epilogue(emitter, nodes, made: set, operands: dict, offset, outputs) -> list:
    """The lines of a tile epilogue under one `mask` (gather's and MoE's kernels): each operand of
    `nodes` not `made` in the group loaded at `offset(uid)`, the nodes' expressions, and a store of
    each of `outputs`. `operands`: uid -> (identifier, ...) of the kernel's pointer parameters."""
    lines = []
    for node in nodes:
        for tensor in node.input_tensors():
            if tensor.uid in made or tensor.uid in emitter.values:
                continue
            identifier = operands[tensor.uid][0]
            load = f"tl.load({identifier}_ptr + {offset(tensor.uid)}, mask=mask)"
            lines.append(f"{identifier}_val = {emitter.loaded(load, tensor.data_type)}")
            emitter.bind(tensor.uid, f"{identifier}_val", kind_of(tensor.data_type))
        start = len(emitter.lines)
        emitter.emit(node)
        lines += emitter.lines[start:]
    for tensor in outputs:
        identifier = operands[tensor.uid][0]
        lines.append(f"tl.store({identifier}_ptr + {offset(tensor.uid)}, "
                     f"{emitter.stored(tensor.uid, tensor.data_type)}, mask=mask)")
    return lines


def store_statement(pointer: str, value: str, kind: str, data_type, mask: str, compute: str,
                    blend=None, extra: str = "") -> str:
    """The one store of every family's outputs: `value` (of `kind`) converted to `data_type` and
    stored at `pointer` under `mask`. A blended output (`blend` = (alpha, beta), Tensor.set_blend)
    is a read-modify-write in this same statement, `alpha * value + beta * prior`, in the compute
    type before the conversion: the program that owns the element reads it just before it writes
    it, so no second pass and no other program touches it. A factor is a number (a literal) or
    the source text of a value the kernel reads (a one-element tensor: ExpressionEmitter.store_value
    writes its load). beta == 0 never lets the prior in (NaN there must not propagate, as in
    cuDNN): a literal 0 never loads it, a tensor beta selects 0 where it is 0. `extra`: more keyword
    arguments (", eviction_policy=...")."""
    masked = f", mask={mask}" if mask else ""
    if blend is not None:
        alpha, beta = blend
        if kind != "f":
            value = CONVERT[(kind, "f")].format(value, compute=compute)
        value = f"{_factor_text(alpha)} * ({value})"
        prior = f"tl.load({pointer}{masked}).to({compute})"
        if isinstance(beta, str):
            value = f"{value} + tl.where({beta} == 0, 0.0, {beta} * {prior})"
        elif beta != 0.0:
            value = f"{value} + {ExpressionEmitter.literal(beta)} * {prior}"
        kind = "f"
    return f"tl.store({pointer}, {converted_to(value, kind, data_type)}{masked}{extra})"


def _factor_text(factor) -> str:
    return factor if isinstance(factor, str) else ExpressionEmitter.literal(factor)


def blends_of(tensors) -> tuple:
    """((uid, (alpha, beta)), ...) of the blended tensors among `tensors` (graph tensors or
    problem operands): what a kernel spec carries to its stores, each factor a number or
    ("tensor", uid) (tensor.plain_blend)."""
    return tuple((t.uid, plain_blend(t.blend)) for t in tensors if getattr(t, "blend", None) is not None)


def as_stored_conversion(tensor, variable: str, have: str, compute: str):
    """(text, kind) of `tensor`'s value, held as `variable` of kind `have`, as its consumers see
    it, or None where the held value already is that. Integer and bool tensors are exact
    everywhere (a float stored to an integer truncates toward zero, as the store does); a graph
    output of a float type is rounded to it through the same conversion its store makes."""
    data_type = tensor.data_type
    want = kind_of(data_type)
    if dtypes.is_saturating(data_type):  # held widened to int32, the value saturated as stored
        return f"{converted_to(variable, have, data_type)}.to(tl.int32)", "i"
    if want != "f":
        if have == want:
            return None
        if have == "f" and want in INTEGER_TYPES:
            return f"{variable}.to({INTEGER_TYPES[want]})", want
        return CONVERT[(have, want)].format(variable, compute=compute), want
    if not tensor.is_output:
        return None  # a virtual intermediate stays at least as wide as the compute type
    value = variable if have == "f" else CONVERT[(have, "f")].format(variable, compute=compute)
    if not dtypes.narrower_than_compute(data_type):
        return None if have == "f" else (value, "f")
    return f"{value}.to({data_type.triton_type}).to({compute})", "f"


def _integral(constant) -> bool:
    return isinstance(constant, int) and not isinstance(constant, bool)


class ExpressionEmitter:
    """Collects statements; `values` maps tensor uid -> (variable, kind).

    Every variable, module constant and scalar argument it introduces comes from `names`, the
    kernel's allocator (several emitters may share one kernel and one allocator). `counter`
    names the variable holding each element's logical row-major index, where the kernel
    computes one (the pointwise family); `scalars` lists (argument name, int) that the kernel
    must take as runtime integer arguments.
    """

    def __init__(self, compute_type: str, counter: Optional[str] = None, hint: str = "v",
                 names: Optional[NameAllocator] = None, blends=(), fast_math=frozenset()):
        self.compute = compute_type
        # uids of the outputs whose op takes its 16-bit form (problems/base.py fast_math_outputs)
        self.fast_math = frozenset(fast_math)
        self.names = names if names is not None else NameAllocator()
        self.hint = hint  # value variables are hint, hint1, ...
        self.counter = counter
        self.lines: list[str] = []
        self.globals: list[str] = []  # module-level constexprs (non-finite constants)
        self.scalars: list[tuple[str, int]] = []
        self.values: dict[int, tuple[str, str]] = {}
        self.as_stored: set[int] = set()  # uids whose held value already is what consumers see
        self.blends: dict = dict(blends)  # uid -> (alpha, beta) of the outputs stored blended
        # pointer argument -> uid of each one-element tensor a blended store reads its factor from
        self.blend_pointers: dict[str, int] = {}

    def bind(self, uid: int, variable: str, kind: str):
        """Hold tensor `uid` as `variable` of `kind`, as computed (not yet as stored)."""
        self.values[uid] = (variable, kind)
        self.as_stored.discard(uid)

    def inherit(self, parent: "ExpressionEmitter"):
        """Start from the values `parent` holds (a nested scope of the same kernel)."""
        self.values = dict(parent.values)
        self.as_stored = set(parent.as_stored)

    def consumed(self, tensor, kind: str) -> str:
        """Graph tensor `tensor`'s value as a consumer sees it (as stored), converted to `kind`."""
        conversion = None if tensor.uid in self.as_stored else self._conversion(tensor)
        if conversion is None:
            return self.value(tensor.uid, kind)
        text, have = conversion
        return text if have == kind else CONVERT[(have, kind)].format(f"({text})", compute=self.compute)

    def consumed_kind(self, tensor) -> str:
        """The kind a consumer reads graph tensor `tensor` in."""
        conversion = None if tensor.uid in self.as_stored else self._conversion(tensor)
        return self.values[tensor.uid][1] if conversion is None else conversion[1]

    def _conversion(self, tensor):
        variable, have = self.values[tensor.uid]
        return as_stored_conversion(tensor, variable, have, self.compute)

    def _hold_as_stored(self, tensor):
        """Hold a value just made as its consumers see it: one statement, read by every consumer
        (nodes and the anchor alike), so the store and the consumers see the same bits. A value
        nothing reads is left to its store's conversion."""
        conversion = self._conversion(tensor)
        # a buffer the build made up (fusion/views.py: a copy's target, which an int8 value still
        # converts for) has no graph: nothing in the kernel reads it, and its store converts it
        graph = getattr(tensor, "graph", None)
        if conversion is not None and graph is not None and graph.consumers(tensor):
            text, kind = conversion
            variable = self.names.fresh(self.hint)
            self.lines.append(f"{variable} = {text}  # as stored ({tensor.data_type.name})")
            self.values[tensor.uid] = (variable, kind)
        self.as_stored.add(tensor.uid)

    def loaded(self, load: str, data_type) -> str:
        """The text of a load of `data_type` held in its kind (load_conversion)."""
        return load + load_conversion(data_type, self.compute)

    def stored(self, uid: int, data_type) -> str:
        """Tensor `uid` converted for a store to `data_type`: integers go straight to the
        target type, floats stored to integers truncate toward zero (as torch's .to does)."""
        have = self.values[uid][1]
        kind = "b" if data_type.is_boolean else (have if have in INTEGER_TYPES else "f")
        return converted_to(self.value(uid, kind), kind, data_type)

    def store(self, pointer: str, uid: int, data_type, mask: str, extra: str = "") -> str:
        """The store statement of tensor `uid` as its store converts it (see `stored`), blended
        where `blends` says so (store_statement)."""
        blend = self.blends.get(uid)
        if blend is None:
            masked = f", mask={mask}" if mask else ""
            return f"tl.store({pointer}, {self.stored(uid, data_type)}{masked}{extra})"
        return self.store_value(pointer, self.value(uid, "f"), "f", uid, data_type, mask, extra)

    def store_value(self, pointer: str, value: str, kind: str, uid: int, data_type, mask: str,
                    extra: str = "") -> str:
        """store_statement of `value` (of `kind`) as output `uid`, blended where `blends` says so:
        a factor held in a one-element tensor is read through a pointer argument of its own
        (`blend_pointers`, which the kernel's signature takes), so one build serves every value."""
        blend = self.blends.get(uid)
        if blend is not None:
            blend = tuple(self._blend_factor(factor) for factor in blend)
        return store_statement(pointer, value, kind, data_type, mask, self.compute, blend, extra)

    def _blend_factor(self, factor):
        if not isinstance(factor, tuple):
            return factor
        _, uid = factor  # ("tensor", uid)
        pointer = next((p for p, u in self.blend_pointers.items() if u == uid), None)
        if pointer is None:
            pointer = self.names.prefix("blend_factor") + "_ptr"
            self.blend_pointers[pointer] = uid
        return f"tl.load({pointer}).to({self.compute})"

    @staticmethod
    def literal(value) -> str:
        """Source text of a number: repr of an int or finite float, a float32 bit pattern for
        -0.0, inf and NaN. Anything else raises ValidationError: attribute values reach the source
        only as numbers, never as text."""
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real)):
            raise ValidationError(f"a kernel literal must be an int or a float, got "
                                  f"{type(value).__name__}")
        if isinstance(value, numbers.Integral):
            return repr(int(value))
        value = float(value)
        if value == 0.0 and math.copysign(1.0, value) < 0:
            return NEGATIVE_ZERO
        if math.isfinite(value):
            return repr(value)
        # bit patterns, not module constants: Triton compares a kernel's globals at each GPU launch
        # and NaN is unequal to itself ("Global variable CONST has changed ... from nan to nan"),
        # and the interpreter's constexpr infinity broke pow's broadcast (zeros_like(inf * b))
        if math.isnan(value):
            return QUIET_NAN
        return POSITIVE_INFINITY if value > 0 else NEGATIVE_INFINITY

    def value(self, uid: int, kind: str) -> str:
        """The variable holding tensor `uid`, converted to `kind`."""
        variable, have = self.values[uid]
        if have == kind:
            return variable
        return CONVERT[(have, kind)].format(variable, compute=self.compute)

    def _expression(self, node):
        if node.op == "dropout" and any(t is not None for t in node.inputs[1:]):
            return dropout_from_tensors(node)
        if node.op == "gen_index":
            return index_along_expression(node.outputs[0].dim, node.attrs.axis)
        if node.op == "pow" and dict(node.attrs.constants).get(1) in SCALAR_ROOTS:
            return SCALAR_ROOTS[dict(node.attrs.constants)[1]]
        if node.op in CLIPPED_RELU and relu_is_clipped(node.attrs):
            return CLIPPED_RELU[node.op]
        if node.op in FAST_MATH and node.outputs[0].uid in self.fast_math:
            return FAST_MATH[node.op]
        if node.op != "cast":
            return EXPRESSIONS[node.op]
        have = self.values[node.inputs[0].uid][1]
        return cast_expression(dtypes.by_name(node.attrs.data_type), have if have in INTEGER_TYPES else "f")

    def _literal_of(self, node, what: str, value) -> str:
        try:
            return self.literal(value)
        except ValidationError as error:
            raise ValidationError(f"node {node.name!r} ({node.op}): {what}: {error}") from None

    def _integer_kind(self, node, expression):
        """"i" or "l" when `node` computes in integers, else None."""
        constants = dict(getattr(node.attrs, "constants", ()))
        if node.op == "cast":
            have = self.consumed_kind(node.inputs[0])
            return have if have in INTEGER_TYPES else None
        if not integer_closed(node.op, node.attrs):
            return None
        kinds = set()
        for position, kind in enumerate(expression.inputs):
            if kind != "f":
                continue
            if position in constants:
                if not _integral(constants[position]):
                    return None  # a float constant makes the op a float op, as in torch
                continue
            have = self.consumed_kind(node.inputs[position])
            if have == "f":
                return None
            kinds.add(have)
        if not kinds & set(INTEGER_TYPES):
            return None  # predicates alone keep the float path
        return "l" if "l" in kinds else "i"

    def _operands(self, node, expression, integer) -> list[str]:
        constants = dict(getattr(node.attrs, "constants", ()))
        operands = []
        for position, kind in enumerate(expression.inputs):
            if kind == "-":  # an absent optional input (its value is an attribute)
                operands.append("")
                continue
            if integer and kind == "f":
                kind = integer
            if position in constants:
                constant = constants[position]
                if kind == "f" and _integral(constant):
                    constant = float(constant)  # a float op: the constant is a float literal
                text = self._literal_of(node, f"constant operand {position}", constant)
                operands.append(text if kind == "f" or kind in INTEGER_TYPES else f"({text} != 0)")
            else:
                operands.append(self.consumed(node.inputs[position], kind))
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
        integer = self._integer_kind(node, expression)
        operands = self._operands(node, expression, integer)
        fields = self._fields(node, expression)
        variables = [self.names.fresh(self.hint) for _ in expression.result]
        template = expression.template
        results = expression.result
        if integer and node.op != "cast":
            template = INTEGER_TEMPLATES.get(node.op, template)
            results = "".join(integer if kind == "f" else kind for kind in results)
        text = template.format(*operands, compute=self.compute, **fields)
        self.lines.append(f"{', '.join(variables)} = {text}  # {node.op}")
        for tensor, variable, kind in zip(node.outputs, variables, results):
            if tensor is not None:
                self.bind(tensor.uid, variable, kind)
                self._hold_as_stored(tensor)
        first = node.outputs[0]
        return variables[0] if first is None else self.values[first.uid][0]
