"""The workspace strategy of a build, as cuDNN's: "prefer fastest" (no limit) or "specify a
workspace limit" in bytes, 0 meaning no workspace for optional scratch.

The limit covers what a config choice adds on top of the graph's own values: split-K partials
(matmul, conv fprop/dgrad, wgrad), split-row partials (reductions and norms). Values between
kernels and the small per-tile partials of fused exits belong to the graph, not to a choice, and
are reported by explain() next to it. Groups draw from one budget in graph order: a plan's
choices together stay within the limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class WorkspaceBudget:
    """Bytes of optional scratch still allowed (None: unlimited, "prefer fastest")."""

    limit: Optional[int] = None
    spent: int = 0

    def allows(self, nbytes: int) -> bool:
        return self.limit is None or self.spent + nbytes <= self.limit

    def spend(self, nbytes: int):
        self.spent += nbytes

    def describe(self, nbytes: int) -> str:
        """How much workspace a choice costs, against the limit where there is one."""
        bound = "no limit" if self.limit is None else f"limit {self.limit}"
        return f"workspace {nbytes} bytes ({bound})"

    def fresh(self) -> "WorkspaceBudget":
        """The same limit with nothing spent (another device's build)."""
        return WorkspaceBudget(self.limit)


def first_allowed(ranked, scratch_bytes, budget: Optional[WorkspaceBudget]):
    """(config, bytes, skipped): the best-ranked config whose scratch fits the budget, and how
    many better ones the limit left out. Configs without scratch always fit."""
    for skipped, config in enumerate(ranked):
        nbytes = scratch_bytes(config)
        if budget is None or budget.allows(nbytes):
            return config, nbytes, skipped
    raise ValueError("no candidate fits the workspace limit, not even one without scratch")
