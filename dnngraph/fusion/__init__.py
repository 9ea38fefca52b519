"""Fusion: partition a graph into kernel groups (plain data for heuristics and codegen)."""
from .partition import FusionGroup, partition

__all__ = ["FusionGroup", "partition"]
