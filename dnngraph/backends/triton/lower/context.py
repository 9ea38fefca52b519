"""What every kernel builder of one build reads besides its graph and group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ....runtime.autotune import Tuner
from ..heuristics.sdpa import ForcedAttention
from ....runtime.workspace import WorkspaceBudget
from ....target import Target

if TYPE_CHECKING:  # the options import the backend registry, which imports the builders
    from ....options import BuildOptions


@dataclass(frozen=True)
class BuildContext:
    """The device a plan's launches are built for (autotuning times candidates there), its
    target, the build's options, the tuner (None: the model's choices) and the workspace budget
    the groups draw optional scratch from in graph order (None: unlimited)."""

    device: torch.device
    target: Target
    options: BuildOptions
    tuner: Optional[Tuner] = None
    budget: Optional[WorkspaceBudget] = None

    @property
    def attention(self) -> ForcedAttention:
        """What the options force of the attention kernels."""
        o = self.options
        return ForcedAttention(o.sdpa_config, o.sdpa_dkdv_config, o.sdpa_dq_config, o.sdpa_splits, o.sdpa_head_group)
