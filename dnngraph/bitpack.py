"""Bit-packed booleans (dg.bool_bit_packed): cuDNN's CUDNN_DATA_BOOLEAN layout in torch terms.

An element at offset `o` (in elements, from its strides) is bit `o % 8` of byte `o // 8` of the
bound uint8 storage, the least significant bit first. The packed axis is the innermost one
(stride 1); every other axis steps by whole bytes (strides that are multiples of 8), so a row
that ends in a partial byte shares that byte with no other row (dtypes.packed_layout_problem).
The storage a user binds is a uint8 tensor of dtypes.storage_layout's shape and strides: the
logical dims with the packed axis's extent rounded up to bytes.

pack_bits / unpack_bits convert between torch bool tensors and that storage (the reference and
tests unpack; users pack masks with them). Kernels read and write the bits in the pointwise
family only; `refuse_elsewhere` says so at build.
"""
from __future__ import annotations

import torch

from . import dtypes
from .errors import UnsupportedError, ValidationError

# Kernel groups whose loads of pointwise operands read bits (codegen's emitter.element_load): the
# pointwise kernels and the op-level attention kernels' score-op side tensors (a where mask).
UNPACKING_KINDS = ("pointwise", "attention", "attention_backward")
# bit i of a byte holds the i-th element of its 8 (the frontend's order: least significant first)
_BIT_WEIGHTS = tuple(1 << i for i in range(8))


def pack_bits(values: torch.Tensor) -> torch.Tensor:
    """A bool tensor packed along its innermost axis of extent > 1 (the last axis when none):
    uint8 of that axis's extent n rounded up to ceil(n / 8), element j of a row in bit j % 8 of
    byte j // 8; the dense storage of a dg.bool_bit_packed tensor of the same dims and row-major
    order (dg.bit_packed_strides)."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.bool or values.dim() == 0:
        raise ValidationError(f"pack_bits takes a bool tensor of rank >= 1, got "
                              f"{values.dtype if isinstance(values, torch.Tensor) else type(values).__name__}")
    axis = next((a for a in reversed(range(values.dim())) if values.shape[a] > 1), values.dim() - 1)
    return _pack_last_axis(values.movedim(axis, -1)).movedim(-1, axis).contiguous()


def _pack_last_axis(values: torch.Tensor) -> torch.Tensor:
    n = values.shape[-1]
    padded = torch.nn.functional.pad(values.to(torch.uint8), (0, -(-n // 8) * 8 - n))
    groups = padded.reshape(*values.shape[:-1], -1, 8).to(torch.int32)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=values.device)
    return (groups * weights).sum(-1).to(torch.uint8)


def unpack_bits(storage: torch.Tensor, dim, stride) -> torch.Tensor:
    """The logical bool values (dims `dim`) of a dg.bool_bit_packed tensor of element strides
    `stride` bound as uint8 `storage` (dtypes.storage_layout's shape and strides)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for axis, (size, step) in enumerate(zip(dim, stride)):
        shape = [1] * len(dim)
        shape[axis] = size
        offsets = offsets + (torch.arange(size, dtype=torch.int64) * step).reshape(shape)
    offsets = offsets.expand(tuple(dim)).to(storage.device)
    flat = torch.as_strided(storage, (_span_bytes(storage),), (1,))  # every byte the view reaches
    return ((flat[offsets // 8].to(torch.int32) >> (offsets % 8).to(torch.int32)) & 1) != 0


def _span_bytes(storage: torch.Tensor) -> int:
    return sum((size - 1) * step for size, step in zip(storage.shape, storage.stride())) + 1 if storage.numel() else 0


def refuse_elsewhere(graph, groups) -> None:
    """ValidationError where a bit-packed tensor's layout cannot pack, UnsupportedError where a
    node other than a pointwise op, or a kernel other than the pointwise family's, reads or
    writes one (their loads and stores address bytes, not bits)."""
    for tensor in graph.tensors:
        if not tensor.data_type.is_bit_packed:
            continue
        problem = dtypes.packed_layout_problem(tensor.dim, tensor.stride, tensor.data_type)
        if problem is not None:
            raise ValidationError(f"tensor {tensor.name!r}: {problem}")
        nodes = graph.consumers(tensor) + ([tensor.producer] if tensor.producer is not None else [])
        for node in nodes:
            if node.opdef.role != "pointwise":
                raise UnsupportedError(f"node {node.name!r} ({node.op}) reads or writes {tensor.name!r} of "
                                       f"{tensor.data_type.name}: only pointwise ops read or write bit-packed "
                                       f"booleans")
    for group in groups:
        written = [t for t in group.outputs if t.data_type.is_bit_packed]
        read = [t for t in group.inputs if t.data_type.is_bit_packed]
        if (written and group.kind != "pointwise") or (read and group.kind not in UNPACKING_KINDS):
            tensor = (written + read)[0]
            raise UnsupportedError(f"a {group.kind} kernel would read or write {tensor.name!r} of "
                                   f"{tensor.data_type.name}: only pointwise kernels pack bits, and only they and "
                                   f"attention written as ops (a where mask on the scores) unpack them")


def packed_layouts_agree(nodes, domain=None) -> bool:
    """Whether one pointwise kernel over `domain` should store every bit-packed tensor `nodes`
    make: all of one layout (the kernel's column axis is their packed axis:
    heuristics/pointwise.py), and no graph output among them narrower than the domain (the
    kernel would walk its columns along that output's packed axis, across the rows of every
    wider operand: uncoalesced; apart, both kernels walk their own rows)."""
    packed = [t for n in nodes for t in n.outputs if t is not None and t.data_type.is_bit_packed]
    if len({(tuple(t.dim), tuple(t.stride)) for t in packed}) > 1:
        return False
    return domain is None or all(_spans(t.dim, domain) for t in packed if t.is_output)


def _spans(dim, domain) -> bool:
    return (1,) * (len(domain) - len(dim)) + tuple(dim) == tuple(domain)


def touches_bit_packed(node) -> bool:
    """Whether `node` reads or writes a bit-packed tensor (an anchor's loads and stores cannot)."""
    return any(t is not None and t.data_type.is_bit_packed for t in list(node.inputs) + list(node.outputs))
