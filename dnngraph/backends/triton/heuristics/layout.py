"""Iteration spaces: the loop nest an elementwise kernel walks, decided from strides alone.

Axes are ordered by the first output's strides (outermost first), axes of size 1 are dropped,
and neighbouring axes that every operand walks contiguously are merged (a dense graph becomes
one long axis). The last axis is the one vectorized; the others are decomposed per row.
"""
from __future__ import annotations

from dataclasses import dataclass

INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class IterationSpace:
    sizes: tuple  # merged axes, outermost first; the last is the column axis
    strides: tuple  # per operand, strides over `sizes` (0 where it broadcasts)
    index_64: bool  # some offset may pass 2^31: index math in int64

    @property
    def rows(self) -> int:
        count = 1
        for size in self.sizes[:-1]:
            count *= size
        return count

    @property
    def cols(self) -> int:
        return self.sizes[-1]


def operand_strides(domain: tuple, dim: tuple, stride: tuple) -> tuple:
    """Strides of an operand over the domain axes (right-aligned; broadcast axes get 0)."""
    pad = len(domain) - len(dim)
    full_dim, full_stride = (1,) * pad + tuple(dim), (0,) * pad + tuple(stride)
    return tuple(0 if size == 1 else s for size, s in zip(full_dim, full_stride))


def merged_stride(sizes: tuple, strides: tuple):
    """The one stride that walks axes `sizes` (outermost first) with `strides` as a single axis
    of their product, or None where they do not merge (size-1 axes do not matter)."""
    merged = None
    size_inside = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if merged is None:
            merged = stride
        elif stride != merged * size_inside:
            return None
        size_inside *= size
    return 0 if merged is None else merged


def row_major_index_strides(domain: tuple) -> tuple:
    """Strides of the logical row-major element index over the domain (a virtual operand).

    Passed to iteration_space with the real operands, it merges and orders with them, so the
    kernel recovers each element's logical index whatever the physical layouts are.
    """
    strides, step = [], 1
    for size in reversed(domain):
        strides.append(0 if size == 1 else step)
        step *= size
    return tuple(reversed(strides))


def iteration_space(domain: tuple, operands: list, order_operand: int = 0,
                    broadcast_outermost: bool = False) -> IterationSpace:
    """Merge and order the domain axes for operands given as domain-aligned stride tuples.
    `broadcast_outermost`: the axes the order operand broadcasts along (stride 0) go outermost
    instead of innermost, so that its own innermost axis is the column axis (a bit-packed output
    narrower than the domain packs along its own axis)."""
    key_strides = operands[order_operand]

    def order(a):
        return (key_strides[a] != 0 if broadcast_outermost else 0, -key_strides[a], a)

    axes = [a for a in sorted(range(len(domain)), key=order) if domain[a] > 1]
    if not axes:
        return IterationSpace((1,), tuple((0,) for _ in operands), False)
    sizes = [domain[axes[0]]]
    strides = [[s[axes[0]]] for s in operands]
    for axis in axes[1:]:
        mergeable = all(s[-1] == op[axis] * domain[axis] for s, op in zip(strides, operands))
        if mergeable:
            sizes[-1] *= domain[axis]
            for s, op in zip(strides, operands):
                s[-1] = op[axis]
        else:
            sizes.append(domain[axis])
            for s, op in zip(strides, operands):
                s.append(op[axis])
    reach = max(sum((n - 1) * st for n, st in zip(sizes, s)) for s in strides)
    total = 1
    for n in sizes:
        total *= n
    return IterationSpace(tuple(sizes), tuple(tuple(s) for s in strides),
                          reach > INT32_LIMIT or total > INT32_LIMIT)
