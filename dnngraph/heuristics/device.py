"""Facts about the target the ranking models need (measured or read off the device)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

# H100 SXM as measured here: 3.0 TB/s device copy (bytes read + written), 132 SMs.
DEFAULT_BANDWIDTH = 3.0e12
DEFAULT_SMS = 132
# CUDA's launch limits per grid axis (x, y, z): a grid past them fails at launch. Read at call
# time by everything that lays out a grid (tests lower it to reach the folded layouts cheaply).
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def grid_fits(grid) -> bool:
    """Whether programs `grid` (x[, y[, z]]) lie within GRID_LIMITS."""
    return all(count <= limit for count, limit in zip(grid, GRID_LIMITS))


def laid_out(grid, folded: bool) -> tuple:
    """The launch grid of programs `grid` per logical axis: as it is, or `folded` into axis x
    alone (the kernel decodes each axis' index from program_id(0), the first axis fastest)."""
    if not folded:
        return tuple(grid)
    programs = 1
    for count in grid:
        programs *= count
    return (programs,)


@dataclass(frozen=True)
class DeviceModel:
    name: str
    sms: int
    bandwidth: float  # bytes per second, read + write
    capability: Optional[tuple] = None  # (major, minor) of a CUDA device; None in the interpreter


INTERPRETER = DeviceModel("interpreter", DEFAULT_SMS, DEFAULT_BANDWIDTH)


def _cuda_index(device) -> Optional[int]:
    """The CUDA device index `device` names (None for the CPU); None names the current GPU."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def device_model(device=None) -> DeviceModel:
    """The model of `device` (a torch.device, a name like "cuda:1" or a CUDA index): its SM count
    and compute capability; the interpreter's model for the CPU. None: the current CUDA device,
    or the interpreter's model without one."""
    return _model_of_index(_cuda_index(device))


@lru_cache(maxsize=None)
def _model_of_index(index: Optional[int]) -> DeviceModel:
    if index is None:
        return INTERPRETER
    props = torch.cuda.get_device_properties(index)
    return DeviceModel(props.name, props.multi_processor_count, DEFAULT_BANDWIDTH, (props.major, props.minor))
