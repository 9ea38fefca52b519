"""MoE geometry: grouped GEMMs over experts' token rows (moe_grouped_matmul and its wgrad)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem


@dataclass(frozen=True)
class MoeGeometry:
    op: str  # "moe_grouped_matmul" | "moe_grouped_matmul_wgrad"
    rows: int  # T: the token rows every expert's range lies in
    k: int
    n: int
    experts: int
    allow_tf32: bool
    paired: bool = False  # the forward's two column halves ride as a pair (n: both halves)


def moe_problem(graph, group):
    node = group.anchor
    token = node.inputs[0]
    k = int(token.dim[-1])
    if node.op == "moe_grouped_matmul":
        experts, _, n = (int(d) for d in node.inputs[1].dim)
    else:
        experts, n = int(node.outputs[0].dim[0]), int(node.inputs[1].dim[-1])
    geometry = MoeGeometry(node.op, int(token.dim[-2]), k, n, experts, bool(node.attrs.allow_tf32),
                           getattr(group, "column_pairs", None) is not None)
    return problem(graph, group, geometry)
