"""Tensors shared with the interpreter process: one file-backed buffer mapped by both processes.

The kernels' pointer arguments are copied into the arena before a run and the tensors they write
copied back after it. Memory is laid out by address: tensors whose bytes overlap (views of one
buffer, a workspace and its views) land in one region with their relative positions kept, so a
kernel sees the same aliasing it would on the caller's tensors; each region keeps its address
modulo ARENA_ALIGNMENT, so every pointer keeps its alignment. Bytes are reserved when the file is
made (a full tmpfs is an error here, not a SIGBUS in a kernel), in /dev/shm where it has room,
else in the temporary directory.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

ARENA_ALIGNMENT = 256
ARENA_GRANULE = 1 << 20  # arenas grow in whole MiB (and at least double), so few are made


def _directories() -> list:
    found = ["/dev/shm"] if os.path.isdir("/dev/shm") else []
    return found + [tempfile.gettempdir()]


def create_arena(nbytes: int) -> tuple:
    """(path, uint8 tensor of `nbytes`) over a new file both processes can map; raises OSError
    when no directory has room."""
    failure = None
    for directory in _directories():
        try:
            fd, path = tempfile.mkstemp(prefix="dnngraph-arena-", dir=directory)
        except OSError as error:
            failure = error
            continue
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            failure = error
            os.close(fd)
            os.unlink(path)
            continue
        os.close(fd)
        return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    raise OSError(f"no room for a {nbytes}-byte arena in {', '.join(_directories())}: {failure}")


def map_arena(path: str, nbytes: int) -> torch.Tensor:
    """The arena file at `path` as a uint8 tensor (the interpreter process's side)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def arena_size(needed: int, current: int) -> int:
    """Bytes of the arena to make when `needed` exceeds `current`."""
    wanted = max(needed, 2 * current, ARENA_GRANULE)
    return -(-wanted // ARENA_GRANULE) * ARENA_GRANULE


def alias(storage_of: torch.Tensor, byte_offset: int, dtype, shape, stride) -> torch.Tensor:
    """A tensor of `dtype`, `shape` and `stride` at `byte_offset` in the memory of `storage_of`
    (a fresh tensor: no autograd history, not an inference tensor, its own version counter)."""
    itemsize = dtype.itemsize
    return torch.empty(0, dtype=dtype).set_(storage_of.untyped_storage(), byte_offset // itemsize,
                                            tuple(shape), tuple(stride))


def extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when it has none)."""
    if tensor.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return span * tensor.element_size()


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor's elements span, as a uint8 tensor over its memory."""
    start = tensor.storage_offset() * tensor.element_size()
    return alias(tensor, start, torch.uint8, (extent_bytes(tensor),), (1,))


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lives in the arena: what the other process rebuilds it from."""

    offset: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple

    def view(self, arena: torch.Tensor) -> torch.Tensor:
        """The tensor, over `arena`."""
        return alias(arena, self.offset, self.dtype, self.shape, self.stride)


def lay_out(tensors: list) -> tuple:
    """([TensorPlace per tensor], arena bytes needed) for `tensors`: overlapping ones share a
    region, each region keeps its address modulo ARENA_ALIGNMENT."""
    spans = sorted((t.data_ptr(), t.data_ptr() + extent_bytes(t), i) for i, t in enumerate(tensors)
                   if t.numel() > 0)
    region_of, regions = {}, []  # tensor index -> region index; [start, end) of each region
    for start, end, index in spans:
        if regions and start < regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], end)
        else:
            regions.append([start, end])
        region_of[index] = len(regions) - 1
    bases, cursor = [], 0
    for start, end in regions:
        base = -(-cursor // ARENA_ALIGNMENT) * ARENA_ALIGNMENT + start % ARENA_ALIGNMENT
        bases.append(base)
        cursor = base + end - start
    places = []
    for index, tensor in enumerate(tensors):
        offset = 0
        if index in region_of:
            region = region_of[index]
            offset = bases[region] + tensor.data_ptr() - regions[region][0]
        places.append(TensorPlace(offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())))
    return places, cursor


def copy_in(arena: torch.Tensor, tensors: list, places: list) -> None:
    """The bytes of each tensor into its place in the arena."""
    for tensor, place in zip(tensors, places):
        count = extent_bytes(tensor)
        if count:
            arena[place.offset:place.offset + count].copy_(_raw_bytes(tensor))


def copy_out(arena: torch.Tensor, tensor: torch.Tensor, place: TensorPlace) -> None:
    """The elements of `tensor` from its place in the arena (only its elements: memory between
    them, which another execute may be writing, is left alone)."""
    if tensor.numel():
        alias(tensor, tensor.storage_offset() * tensor.element_size(), tensor.dtype, tensor.shape,
              tensor.stride()).copy_(place.view(arena))
