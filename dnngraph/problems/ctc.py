"""CTC geometry: the loss (ctc_loss) and its gradient (ctc_loss_backward)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem


@dataclass(frozen=True)
class CtcGeometry:
    op: str  # "ctc_loss" | "ctc_loss_backward"
    steps: int  # T: frames
    batch: int  # N
    classes: int  # C
    label_width: int  # what one entry's labels may take at most: S (padded) or the concatenated total
    concatenated: bool  # targets are 1-D, the entries' labels one after another
    blank: int
    reduction: str
    zero_infinity: bool


def ctc_problem(graph, group):
    node = group.anchor
    log_probs, targets = node.inputs[:2]
    steps, batch, classes = (int(d) for d in log_probs.dim)
    concatenated = len(targets.dim) == 1
    width = int(targets.dim[0] if concatenated else targets.dim[1])
    geometry = CtcGeometry(node.op, steps, batch, classes, width, concatenated, int(node.attrs.blank),
                           node.attrs.reduction, bool(node.attrs.zero_infinity))
    return problem(graph, group, geometry)
