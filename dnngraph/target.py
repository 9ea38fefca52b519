"""The target of a build: the facts about a device that the heuristics' models read.

A CUDA device's target is read from its driver (torch.cuda.get_device_properties): the SM count,
the shared memory one block may opt into, registers and threads per SM, the compute capability.
What the driver does not report (the HBM bandwidth a kernel reaches and the tensor-core peak
rates) comes from a table per GPU model, MODEL_FACTS; a model missing from it takes the H100's
facts, which every GPU took before targets existed. CUDA's grid limits are not among torch's
properties either; they are the same on every GPU since compute capability 3.0.

CPU tensors run through Triton's interpreter, whose target (INTERPRETER) plans as for an H100:
CPU tests choose the tiles and splits a GPU would. Its capability is None, which the families
with GPU tables (attention) read as "the interpreter" and answer with small tiles.

Plans are built for the target of the tensors' device (build.py); BuildOptions.target
plans for a given one instead (what-if builds, tests of a made-up GPU).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from .errors import ValidationError

# CUDA's launch limits per grid axis (x, y, z) on every GPU since compute capability 3.0: a grid
# past them fails at launch.
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)
# The driver facts of the GPUs below, as torch reads them on the H100 and the H200 here: 132 SMs,
# 227 KiB of opt-in shared memory per block, 64 Ki registers and 2048 threads per SM.
HOPPER_SMS = 132
HOPPER_SHARED_MEMORY = 232448
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
DOTS = ("bf16", "fp16", "fp8", "tf32", "fp32", "int8")


@dataclass(frozen=True)
class ModelFacts:
    """What a GPU model's driver does not say: the bytes per second (read + write) a streaming
    kernel reaches, and the dense peak rates (flop/s) the matmul model runs each dot type at."""

    bandwidth: float
    bf16: float
    fp16: float
    fp8: float
    tf32: float
    fp32: float
    # int8 x int8 -> int32 on the tensor cores: the datasheet gives it fp8's dense rate (1979 TOPS
    # on the H100); not measured here yet, so the model takes fp8's measured figure
    int8: float = 1.5e15

    def __post_init__(self):
        for field in ("bandwidth",) + DOTS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValidationError(f"ModelFacts.{field}: expects a positive finite number, got {value!r}")


# Nominal (datasheet, dense): H100 SXM 3.35 TB/s HBM3, 989 TF/s bf16/fp16, 1979 fp8, 495 tf32,
# 67 fp32; H200 the same compute (the same GH100 at the same clocks) with 4.8 TB/s HBM3e.
# Measured here take precedence: H100 3.0 TB/s device copy (BENCHMARKS.md copy ceilings 2.95),
# cuBLAS 710 TF/s bf16 at 8192^3, so the model's bf16 peak sits a little above it (7.6e14), fp8
# doubles it, tf32 halves it, IEEE fp32 FMA sustains about 50 of its 67 TF/s.
H100_FACTS = ModelFacts(bandwidth=3.0e12, bf16=7.6e14, fp16=7.6e14, fp8=1.5e15, tf32=3.7e14, fp32=5.0e13)
# H200: nothing measured here yet. The compute rates are the H100's (same die and clocks); the
# bandwidth is its nominal 4.8 TB/s at the fraction of nominal the H100 reached (3.0 / 3.35).
H200_FACTS = dataclasses.replace(H100_FACTS, bandwidth=4.8e12 * 3.0 / 3.35)
MODEL_FACTS = {"NVIDIA H100 80GB HBM3": H100_FACTS, "NVIDIA H200": H200_FACTS}
DEFAULT_FACTS = H100_FACTS


def _positive_int(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"{owner}.{field}: expects a positive int, got {value!r}")


@dataclass(frozen=True)
class Target:
    """One device's facts as the heuristics read them (plain, hashable data: part of a plan's key)."""

    name: str
    capability: Optional[tuple]  # (major, minor) of a CUDA device; None: Triton's interpreter
    sms: int
    shared_memory: int  # bytes one block may use (the opt-in limit)
    registers: int  # 32-bit registers per SM
    threads_per_sm: int
    max_grid: tuple  # programs per grid axis (x, y, z)
    facts: ModelFacts

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError(f"Target.name: expects a non-empty str, got {self.name!r}")
        capability = self.capability
        if capability is not None and not (isinstance(capability, tuple) and len(capability) == 2 and all(
                isinstance(part, int) and not isinstance(part, bool) and part >= 0 for part in capability)):
            raise ValidationError(f"Target.capability: expects None or (major, minor), got {capability!r}")
        for field in ("sms", "shared_memory", "registers", "threads_per_sm"):
            _positive_int("Target", field, getattr(self, field))
        if not isinstance(self.max_grid, tuple) or len(self.max_grid) != 3:
            raise ValidationError(f"Target.max_grid: expects (x, y, z) limits, got {self.max_grid!r}")
        for limit in self.max_grid:
            _positive_int("Target", "max_grid", limit)
        if not isinstance(self.facts, ModelFacts):
            raise ValidationError(f"Target.facts: expects ModelFacts, got {type(self.facts).__name__}")

    @property
    def interpreted(self) -> bool:
        """Whether kernels for this target run through Triton's interpreter."""
        return self.capability is None

    @property
    def bandwidth(self) -> float:
        """Bytes per second (read + write) a streaming kernel reaches."""
        return self.facts.bandwidth

    def peak(self, dot: str) -> float:
        """Dense flop/s of a dot type ("bf16", "fp16", "fp8", "tf32", "fp32", "int8": op/s)."""
        return getattr(self.facts, dot)

    def grid_fits(self, grid) -> bool:
        """Whether programs `grid` (x[, y[, z]]) lie within the launch limits."""
        return all(count <= limit for count, limit in zip(grid, self.max_grid))


def laid_out(grid, folded: bool) -> tuple:
    """The launch grid of programs `grid` per logical axis: as it is, or `folded` into axis x
    alone (the kernel decodes each axis' index from program_id(0), the first axis fastest)."""
    if not folded:
        return tuple(grid)
    programs = 1
    for count in grid:
        programs *= count
    return (programs,)


def _hopper(name: str, facts: ModelFacts) -> Target:
    return Target(name, (9, 0), HOPPER_SMS, HOPPER_SHARED_MEMORY, REGISTERS_PER_SM, THREADS_PER_SM,
                  CUDA_GRID_LIMITS, facts)


H100 = _hopper("NVIDIA H100 80GB HBM3", H100_FACTS)
H200 = _hopper("NVIDIA H200", H200_FACTS)
INTERPRETER = dataclasses.replace(H100, name="interpreter", capability=None)


def from_properties(props) -> Target:
    """The target of a CUDA device whose driver properties are `props` (what
    torch.cuda.get_device_properties returns; properties an older torch lacks fall back to the
    conservative values: the shared memory of a block that does not opt in, 64 Ki registers)."""
    shared = getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block")
    return Target(str(props.name), (int(props.major), int(props.minor)), int(props.multi_processor_count),
                  int(shared), int(getattr(props, "regs_per_multiprocessor", None) or REGISTERS_PER_SM),
                  int(getattr(props, "max_threads_per_multi_processor", None) or THREADS_PER_SM),
                  CUDA_GRID_LIMITS, MODEL_FACTS.get(str(props.name), DEFAULT_FACTS))


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


def target_of(device=None) -> Target:
    """The target of `device` (a torch.device, a name like "cuda:1" or a CUDA index): read from
    its driver; the interpreter's for the CPU. None: the current CUDA device, or the interpreter
    without one."""
    return _target_of_index(_cuda_index(device))


@lru_cache(maxsize=None)
def _target_of_index(index: Optional[int]) -> Target:
    if index is None:
        return INTERPRETER
    return from_properties(torch.cuda.get_device_properties(index))
