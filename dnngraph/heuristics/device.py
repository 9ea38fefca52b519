"""Facts about the target the ranking models need (measured or read off the device)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

# H100 SXM as measured here: 3.0 TB/s device copy (bytes read + written), 132 SMs.
DEFAULT_BANDWIDTH = 3.0e12
DEFAULT_SMS = 132


@dataclass(frozen=True)
class DeviceModel:
    name: str
    sms: int
    bandwidth: float  # bytes per second, read + write


@lru_cache(maxsize=None)
def device_model(index: int | None = None) -> DeviceModel:
    """The model of the current CUDA device, or the H100 defaults without one."""
    if not torch.cuda.is_available():
        return DeviceModel("interpreter", DEFAULT_SMS, DEFAULT_BANDWIDTH)
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return DeviceModel(props.name, props.multi_processor_count, DEFAULT_BANDWIDTH)
