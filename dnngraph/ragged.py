"""Ragged (THD) operands of sdpa: sequences packed one after another in a buffer.

A ragged tensor keeps its logical dims [B, H, S_max, D] and the strides of the packed layout
(THD: token stride H * D, head stride D, element stride 1); its ragged offset, an int32 or int64
[B + 1, 1, 1, 1] tensor, holds the element offset where each sequence starts (the cuDNN
frontend's convention: offset[b] = D * H * (tokens before sequence b) for THD), and the sdpa
seq_len tensor of its axis holds each sequence's length. Element (b, h, s, d) lives at
offset[b] + h * stride[1] + s * stride[2] + d * stride[3]; rows s >= length are neither read
nor written. The batch stride is unused: bind the packed buffer as a view of the declared dims
and strides (`buffer.as_strided(dims, strides)`), whose span bounds what the offsets may reach.
That view's span counts the declared batch stride, which no kernel uses: with the dense one
(S_max * H * D) the buffer must hold B * S_max tokens (the padded size), of which the offsets may
use any part. (Checking the offsets against the storage instead of the view, so that a buffer of
the packed tokens alone can be bound, is not done yet.)
"""
from __future__ import annotations

import torch

from .errors import ExecutionError


def _extents(lengths, dims, strides):
    """[B] elements each sequence's rows span from its offset (0 for an empty one)."""
    _, heads, _, depth = dims
    rest = (heads - 1) * strides[1] + (depth - 1) * strides[3] + 1
    return torch.where(lengths > 0, (lengths - 1) * strides[2] + rest, torch.zeros_like(lengths))


def check_offsets(name: str, offsets: torch.Tensor, seq_len: torch.Tensor, dims, strides, span: int) -> None:
    """Raise ExecutionError unless every sequence of ragged tensor `name` lies in its slot:
    offsets non-negative and in order, each sequence's rows ending before the next one starts
    (offset[B] closes the last) and inside the `span` elements bound, no length past S_max."""
    starts = offsets.reshape(-1).long()
    lengths = seq_len.reshape(-1).long().clamp(min=0)
    if bool((starts < 0).any()):
        raise ExecutionError(f"ragged offsets of {name!r} must be non-negative, got {starts.tolist()}")
    if bool((starts[1:] < starts[:-1]).any()):
        raise ExecutionError(f"ragged offsets of {name!r} must not decrease, got {starts.tolist()}")
    if bool((lengths > dims[2]).any()):
        raise ExecutionError(f"a sequence of {name!r} is longer than its declared maximum {dims[2]}: "
                             f"lengths {lengths.tolist()}")
    ends = starts[:-1] + _extents(lengths, dims, strides)
    if bool((ends > starts[1:]).any()):
        bad = int(torch.nonzero(ends > starts[1:])[0, 0])
        raise ExecutionError(f"sequence {bad} of {name!r} ({int(lengths[bad])} rows from element "
                             f"{int(starts[bad])}) runs past the next offset {int(starts[bad + 1])}")
    if int(starts[-1]) > span:
        raise ExecutionError(f"ragged offsets of {name!r} reach element {int(starts[-1])}, past the "
                             f"{span} elements of the bound buffer")


def unpack(value: torch.Tensor, offsets: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """The logical [B, H, S_max, D] values of ragged `value` (a bound view of the packed buffer):
    sequence b's rows read from offset[b], rows past its length 0. Check the offsets first."""
    batch, heads, s_max, depth = value.shape
    strides = value.stride()
    span = sum((size - 1) * step for size, step in zip(value.shape, strides)) + 1
    memory = value.as_strided((span,), (1,), value.storage_offset())
    starts = offsets.reshape(-1).long()[:batch].to(value.device).view(-1, 1, 1, 1)
    lengths = seq_len.reshape(-1).long().to(value.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=value.device).view(1, -1, 1, 1)
    s = torch.arange(s_max, device=value.device).view(1, 1, -1, 1)
    d = torch.arange(depth, device=value.device).view(1, 1, 1, -1)
    index = starts + h * strides[1] + s * strides[2] + d * strides[3]
    present = (s < lengths).expand(batch, heads, s_max, depth)
    gathered = memory[torch.where(present, index, torch.zeros_like(index))]
    return torch.where(present, gathered, torch.zeros_like(gathered))
