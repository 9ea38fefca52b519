"""Problems: one backend-neutral description per fused group (plain frozen data).

problem_of(graph, group) reads the group's operands, its prologue/epilogue/exit chains and its
family's geometry (problems/<family>.py) from the graph and the group alone: no kernel language,
no runtime. Backends (backends/) say which problems they support and lower them.
"""
from __future__ import annotations

from ..errors import UnsupportedError
from .attention import AttentionGeometry, attention_backward_problem, attention_problem, sdpa_fp8_problem, sdpa_problem
from .base import Operand, Problem
from .conv import ConvGeometry, conv_problem
from .ctc import CtcGeometry, ctc_problem
from .gather import GatherGeometry, gather_problem
from .gemm import GemmGeometry, matmul_problem
from .lrn import LrnGeometry, lrn_problem
from .block_scale import BlockScaleGeometry, block_scale_problem
from .moe import MoeGeometry, moe_problem
from .pointwise import PointwiseGeometry, pointwise_problem
from .pooling import PoolingGeometry, pooling_problem
from .rows import RowsGeometry, rows_problem
from .rnn import RnnGeometry, rnn_problem

# group kind -> problem builder(graph, group)
PROBLEM_BUILDERS = {
    "pointwise": pointwise_problem, "copy": pointwise_problem,
    "reduction": rows_problem, "softmax": rows_problem, "norm": rows_problem,
    "pooling": pooling_problem, "matmul": matmul_problem, "conv": conv_problem,
    "sdpa": sdpa_problem, "attention": attention_problem, "attention_backward": attention_backward_problem,
    "gather": gather_problem, "moe": moe_problem,
    "ctc": ctc_problem, "lrn": lrn_problem,
    "block_scale": block_scale_problem,
}
PROBLEM_BUILDERS["rnn"] = rnn_problem
PROBLEM_BUILDERS["sdpa_fp8"] = sdpa_fp8_problem


def problem_of(graph, group) -> Problem:
    """The Problem of `group` (a fusion group of `graph`)."""
    builder = PROBLEM_BUILDERS.get(group.kind)
    if builder is None:
        anchor = group.anchor or group.nodes[0]
        raise UnsupportedError(f"node {anchor.name!r} ({anchor.op}): no {group.kind} problem is defined")
    return builder(graph, group)


__all__ = ["AttentionGeometry", "BlockScaleGeometry", "ConvGeometry", "CtcGeometry", "GatherGeometry", "GemmGeometry", "LrnGeometry", "MoeGeometry", "Operand", "PROBLEM_BUILDERS",
           "PointwiseGeometry", "PoolingGeometry", "Problem", "RnnGeometry", "RowsGeometry", "problem_of"]
