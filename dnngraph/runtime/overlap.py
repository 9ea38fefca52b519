"""Whether two strided views of one memory share a byte.

A view is a set of element addresses `start + sum(index[a] * stride[a])` over its index box, each
element covering `itemsize` bytes. Two views overlap exactly when some byte is in both. Byte
ranges that do not meet settle most pairs; the rest (views interleaved in one buffer: dQ, dK and
dV unbound from one dQKV tensor, rotary halves, even and odd columns) are decided exactly by
solving `sum(c[k] * m[k]) = d` for integers m[k] in intervals (see _solvable), and when that
search runs past its budget, by enumerating the addresses of small views. A pair too large for
both is reported as overlapping: refusing a safe binding is a nuisance, running an unsafe one
would be wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEARCH_BUDGET = 20_000  # nodes of the exact search before enumeration takes over
ENUMERATION_LIMIT = 1 << 22  # bytes of the two views together that enumeration may list


@dataclass(frozen=True)
class StridedBytes:
    """A view in bytes: its first byte's address, and per axis (size, stride in bytes); the last
    axis walks the bytes of one element."""

    start: int
    axes: tuple  # ((size, stride), ...)

    @classmethod
    def of(cls, start: int, sizes, strides, itemsize: int) -> "StridedBytes":
        """The bytes of a view at byte address `start` with element `sizes` and `strides`."""
        axes = tuple((size, stride * itemsize) for size, stride in zip(sizes, strides))
        return cls(start, axes + ((itemsize, 1),))

    @property
    def empty(self) -> bool:
        return any(size == 0 for size, _ in self.axes)

    @property
    def end(self) -> int:
        """One past the last byte (the view's strides are never negative)."""
        return self.start + sum((size - 1) * stride for size, stride in self.axes) + 1


def share_a_byte(first: StridedBytes, second: StridedBytes) -> bool:
    """Exactly whether the two views have a byte in common (conservatively True only for pairs
    past both the search's budget and the enumeration limit)."""
    if first.empty or second.empty or first.end <= second.start or second.end <= first.start:
        return False
    if first.start == second.start:
        return True  # the first byte of both
    terms = _combined_terms(first, second)
    found = _solvable(second.start - first.start, terms)
    if found is not None:
        return found
    if _bytes(first) + _bytes(second) <= ENUMERATION_LIMIT:
        return _share_by_enumeration(first, second)
    return True


def _bytes(view: StridedBytes) -> int:
    return math.prod(size for size, _ in view.axes)


def _combined_terms(first: StridedBytes, second: StridedBytes) -> list:
    """The pair as terms (coefficient, low, high): a shared byte is a choice of integers m in
    [low, high] with sum(coefficient * m) equal to the second start less the first. An axis of
    the first view adds stride * i (i in [0, size - 1]), one of the second subtracts it; axes of
    one stride add up to one integer interval (a sum of integer intervals is one), which is what
    makes equal layouts at an offset a one-term-per-stride problem."""
    intervals: dict = {}
    for view, sign in ((first, 1), (second, -1)):
        for size, stride in view.axes:
            if size == 1 or stride == 0:
                continue  # a size-1 or broadcast axis adds only 0
            low, high = intervals.get(stride, (0, 0))
            span = (size - 1) if sign > 0 else -(size - 1)
            intervals[stride] = (low + min(span, 0), high + max(span, 0))
    return sorted(((stride, low, high) for stride, (low, high) in intervals.items()), reverse=True)


def _solvable(target: int, terms: list):
    """True when sum(c * m) == target for some m in [low, high] per term (terms by falling c),
    False when for none, None when the search spent SEARCH_BUDGET nodes without knowing.

    Depth first from the largest coefficient. A branch is cut where what is left lies outside
    the interval the remaining terms can reach or is no multiple of their gcd (both necessary,
    not sufficient: hence the search), and the last term is solved directly. Views of one layout
    at an offset, interleaved or not, are decided in a handful of nodes."""
    count = len(terms)
    reach_low, reach_high, divisor = [0] * (count + 1), [0] * (count + 1), [0] * (count + 1)
    for k in range(count - 1, -1, -1):
        coefficient, low, high = terms[k]
        reach_low[k] = reach_low[k + 1] + coefficient * low
        reach_high[k] = reach_high[k + 1] + coefficient * high
        divisor[k] = math.gcd(divisor[k + 1], coefficient)
    budget = [SEARCH_BUDGET]

    def search(k: int, rest: int):
        if k == count:
            return rest == 0
        if not reach_low[k] <= rest <= reach_high[k] or rest % divisor[k]:
            return False
        coefficient, low, high = terms[k]
        if k == count - 1:
            return rest % coefficient == 0 and low <= rest // coefficient <= high
        # m keeps what is left within the reach of the terms after k
        first = max(low, -((reach_high[k + 1] - rest) // coefficient))
        last = min(high, (rest - reach_low[k + 1]) // coefficient)
        undecided = False
        for m in range(first, last + 1):
            budget[0] -= 1
            if budget[0] < 0:
                return None
            found = search(k + 1, rest - coefficient * m)
            if found:
                return True
            undecided = undecided or found is None
        return None if undecided else False

    return search(0, target)


def _addresses(view: StridedBytes) -> torch.Tensor:
    """Every byte address of `view`, relative to its start (int64, with repeats when it overlaps
    itself)."""
    addresses = torch.zeros((), dtype=torch.int64)
    for size, stride in view.axes:
        addresses = addresses.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return addresses.reshape(-1)


def _share_by_enumeration(first: StridedBytes, second: StridedBytes) -> bool:
    mine = _addresses(first)
    theirs = _addresses(second) + (second.start - first.start)
    return bool(torch.isin(theirs, mine).any())
