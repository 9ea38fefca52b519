"""Heuristics: iteration spaces, candidate configs and their ranking, per kernel family."""
from .layout import IterationSpace, iteration_space, operand_strides
from .pointwise import PointwiseConfig, rank as rank_pointwise

__all__ = ["IterationSpace", "iteration_space", "operand_strides",
           "PointwiseConfig", "rank_pointwise"]
