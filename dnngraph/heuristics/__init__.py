"""Heuristics: iteration spaces, candidate configs and their ranking, per kernel family."""
from .device import DeviceModel, device_model
from .layout import IterationSpace, iteration_space, operand_strides
from .pointwise import PointwiseConfig, rank as rank_pointwise

__all__ = ["DeviceModel", "device_model", "IterationSpace", "iteration_space", "operand_strides",
           "PointwiseConfig", "rank_pointwise"]
