"""Recurrence geometry: one layer and direction of an RNN over time (rnn_recurrence, backward)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem


@dataclass(frozen=True)
class RnnGeometry:
    op: str  # "rnn_recurrence" | "rnn_recurrence_backward"
    mode: str  # "rnn_tanh" | "rnn_relu" | "lstm" | "gru"
    reverse: bool
    steps: int  # T
    batch: int  # B
    hidden: int  # H: the cell
    state: int  # P: the recurrent state (proj_size, or H)
    gates: int
    allow_tf32: bool


def rnn_problem(graph, group):
    node = group.anchor
    xw, w_hh = node.inputs[0], node.inputs[3 if node.op == "rnn_recurrence" else 1]
    steps, batch, width = (int(d) for d in xw.dim)
    gates = node.attrs.gates
    geometry = RnnGeometry(node.op, node.attrs.mode, bool(node.attrs.reverse), steps, batch, width // gates,
                           int(w_hh.dim[1]), gates, bool(node.attrs.allow_tf32))
    return problem(graph, group, geometry)
