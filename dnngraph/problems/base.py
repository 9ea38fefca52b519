"""What every problem holds, whatever its family: operands, the fused op chains, the anchor.

Plain frozen data built from (graph, group) alone: tensors become Operands (name, uid, dims,
strides, data type, role), nodes become their op names. Nothing here names a kernel language.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..dtypes import DataType, narrower_than_compute
from ..tensor import plain_blend


@dataclass(frozen=True)
class Operand:
    """One tensor a group reads or writes. role: the anchor's name for it ("a", "b", "x", "w",
    "q", "k", "v", "dy", ...), else "input" (a prologue or epilogue operand) or "output"."""

    name: str
    uid: int
    dims: tuple
    strides: tuple
    data_type: DataType
    role: str
    blend: Optional[tuple] = None  # (alpha, beta) of an output stored blended (Tensor.set_blend)

    @property
    def numel(self) -> int:
        return product(self.dims)


@dataclass(frozen=True)
class Problem:
    """A fused group, backend-neutral: family (the group kind), the anchor node (name and op;
    None for pointwise groups), operands read and written, the prologue, epilogue and exit op
    chains (op names in order), every op of the group in order, and the family's geometry (a
    frozen dataclass of problems/<family>.py)."""

    family: str
    anchor_name: Optional[str]
    anchor_op: Optional[str]
    operands: tuple
    outputs: tuple
    prologue: tuple
    epilogue: tuple
    exits: tuple
    ops: tuple
    geometry: object
    node_names: tuple = ()
    fast_math: frozenset = frozenset()  # uids of the outputs whose op may take 16-bit math (fast_math_outputs)

    @property
    def blended(self) -> bool:
        """Whether an output is stored blended with its prior content (Tensor.set_blend)."""
        return any(o.blend is not None for o in self.outputs)

    def operand(self, role: str) -> Optional[Operand]:
        """The operand of `role` (the first one), or None."""
        return next((o for o in self.operands + self.outputs if o.role == role), None)

    @property
    def where(self) -> str:
        """The node a message about this problem names: "node 'mm' (matmul)"."""
        if self.anchor_name is None:
            return f"node {self.node_names[0]!r} ({self.ops[0]})" if self.node_names else f"a {self.family} group"
        return f"node {self.anchor_name!r} ({self.anchor_op})"


def product(sizes) -> int:
    count = 1
    for size in sizes:
        count *= int(size)
    return count


def operand_of(tensor, role: str) -> Operand:
    return Operand(tensor.name, tensor.uid, tuple(int(d) for d in tensor.dim),
                   tuple(int(s) for s in tensor.stride), tensor.data_type, role, plain_blend(tensor.blend))


def _roles(node, names, tensors) -> dict:
    return {t.uid: role for role, t in zip(names, tensors) if t is not None}


def problem(graph, group, geometry) -> Problem:
    """The Problem of `group` with `geometry`: operands named by the anchor's input and output
    names where the anchor reads or writes them."""
    anchor = group.anchor
    in_roles, out_roles = {}, {}
    if anchor is not None:
        in_roles = _roles(anchor, anchor.opdef.input_names, anchor.inputs)
        out_roles = _roles(anchor, anchor.opdef.output_names, anchor.outputs)
    operands = tuple(operand_of(t, in_roles.get(t.uid, "input")) for t in group.inputs)
    outputs = tuple(operand_of(t, out_roles.get(t.uid, "output")) for t in group.outputs)
    return Problem(group.kind, anchor.name if anchor is not None else None,
                   anchor.op if anchor is not None else None, operands, outputs,
                   tuple(n.op for n in group.prologue), tuple(n.op for n in group.epilogue),
                   tuple(n.op for n in group.exits), tuple(n.op for n in group.nodes), geometry,
                   tuple(n.name for n in group.nodes), fast_math_outputs(group))


# The epilogue ops with a cheaper form for results only rounded to a float type narrower than
# float32 (backends/triton/codegen/triton_math.py gelu_fast, gelu_tanh_fast: within 1e-6 of the
# value for x >= -3, as the float32 forms, and 1e-5 in the tail where those keep no digit; a
# hundredth of a bf16 or fp16 ulp and less of an fp8 one) and the anchors whose epilogues render
# them (the GEMM-shaped kernels of both backends).
FAST_MATH_OPS = frozenset({"gelu", "gelu_tanh"})
FAST_MATH_ANCHORS = frozenset({"matmul", "conv_fprop", "conv_dgrad", "conv_wgrad"})


def fast_math_outputs(group) -> frozenset:
    """The uids of the epilogue outputs that may be computed with the 16-bit math: those of a
    FAST_MATH_OPS node of a GEMM-shaped group (FAST_MATH_ANCHORS) whose value reaches nothing but
    its rounding to a float type narrower than float32 (_only_rounded). The one place this is
    decided: each backend renders what it says."""
    anchor = getattr(group, "anchor", None)
    if anchor is None or anchor.op not in FAST_MATH_ANCHORS:
        return frozenset()
    stored = {t.uid: t for t in group.outputs}
    readers: dict = {}
    for node in group.nodes:
        for tensor in node.inputs:
            if tensor is not None:
                readers.setdefault(tensor.uid, []).append(node)
    return frozenset(node.outputs[0].uid for node in group.epilogue
                     if node.op in FAST_MATH_OPS and _only_rounded(node.outputs[0], stored, readers))


def _only_rounded(value, stored: dict, readers: dict) -> bool:
    """Whether `value` reaches memory only rounded to a float type narrower than float32, and
    nothing else: stored in such a type (a graph output, blended too: alpha * value + beta * prior
    cancels the float32 forms' error as much; or an intermediate another group reads, stored in
    a narrow intermediate_data_type) and read by no node of the group, or read only by casts to
    such a type whose results are so in turn (an fp32 intermediate cast to bf16, the cast
    stored). A node of the group reading a stored value sees it as stored (rounded:
    emitter.as_stored_conversion), but the cheaper math may round it to the other side of a
    midpoint now and then, as the float32 forms may, and that node's own output may be float32:
    such a value keeps the float32 forms, conservatively."""
    uses = readers.get(value.uid, ())
    if value.uid in stored:
        return not uses and narrower_than_compute(stored[value.uid].data_type)
    return bool(uses) and all(node.op == "cast" and narrower_than_compute(node.outputs[0].data_type)
                              and _only_rounded(node.outputs[0], stored, readers) for node in uses)


def as_tuple(value) -> tuple:
    """An attribute value (an int, a sequence, None) as a hashable tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)
