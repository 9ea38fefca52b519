"""Pointwise geometry: the elements a pointwise (or copy) group visits, and whether an operand
broadcasts."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem, product


@dataclass(frozen=True)
class PointwiseGeometry:
    """dims: the domain (the largest output's dims); elements: its size; broadcast: an input
    holds fewer elements than the domain; copy: a layout copy (reshape, transpose, ...)."""

    dims: tuple
    elements: int
    broadcast: bool
    copy: bool = False


def pointwise_problem(graph, group):
    outputs = list(group.outputs) or [t for n in group.nodes for t in n.outputs if t is not None]
    domain = max((tuple(int(d) for d in t.dim) for t in outputs), key=product, default=())
    elements = product(domain)
    broadcast = any(product(t.dim) < elements for t in group.inputs)
    return problem(graph, group, PointwiseGeometry(domain, elements, broadcast, group.kind == "copy"))
