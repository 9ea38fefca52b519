"""BuildOptions: everything a build may be told besides the graph, as one frozen, validated value.

A plan is filed under its options (runtime/plan_cache.py): two builds with equal options share a plan,
different ones never do. The forced configs and thresholds below are how tests and sweeps make
a build take a config, a mode or a size the model would not pick; None (or the heuristics' own
constant, the default) leaves the choice to the model. The heuristics take them as arguments.

The one environment variable that sets an option, DNNGRAPH_AUTOTUNE_TOP, is read when a
BuildOptions is made (its default), so the value a build ran with is the option's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Optional

from .backends import registry
from .errors import ValidationError
from .backends.triton.heuristics import conv as conv_heuristics
from .backends.triton.heuristics import rows as row_heuristics
from .backends.triton.heuristics import lrn as lrn_heuristics
from .runtime.autotune import DEFAULT_TOP
from .backends.triton.heuristics.depthwise import DepthwiseConfig
from .backends.triton.heuristics.block_scale import BlockScaleConfig
from .backends.triton.heuristics.matmul import MatmulConfig
from .backends.triton.heuristics.moe import MoeConfig
from .backends.triton.heuristics.rows import RowConfig
from .backends.triton.heuristics.sdpa import AttentionConfig
from .runtime.tuning_cache import WARPS
from .target import Target

# The kernel languages a build prefers by default: the registry's verified ones, in its order,
# each for the families verified of it ("gluon:conv,sdpa": its attention and conv forwards, not its matmuls,
# which are chosen only when "gluon" is named alone).
BACKENDS = registry.verified()
ROW_MODES = row_heuristics.MODES + ("fused",)


def autotune_top_from_environment() -> Optional[int]:
    """Candidates autotuning times per problem: $DNNGRAPH_AUTOTUNE_TOP (a count, or "all" for
    None: every candidate), DEFAULT_TOP where unset or unreadable."""
    wanted = os.environ.get("DNNGRAPH_AUTOTUNE_TOP", str(DEFAULT_TOP)).strip().lower()
    if wanted == "all":
        return None
    try:
        return max(1, int(wanted))
    except ValueError:
        return DEFAULT_TOP


@dataclass(frozen=True)
class BuildOptions:
    """How to build a graph (cuDNN's engine configuration, as one hashable value).

    autotune: time the model's top candidates per kernel and keep the fastest (remembered in the
    tuning cache); autotune_top: how many (None: every one), also how many of the ranked backends
    are timed against each other where several support a group. workspace_limit: bytes of optional
    scratch the chosen configs may use together (split-K and split-row partials): None prefers
    the fastest, 0 uses none. backends: the kernel languages to use, preferred first (the order
    ranks them where their model estimates do not: backends/registry.py), each by name (all its
    families) or as "name:family,..." (those only; the default takes gluon for "sdpa"). target:
    the device model to plan for (None: the target of the device each execute runs on).

    Forced configs (None: the model's choice): matmul_config (matmuls, and 1x1 convs posed as
    one), conv_config (implicit-GEMM convs), depthwise_config, moe_config (the MoE grouped GEMMs'
    tiles), row_mode ("one_pass", "looped",
    "split", "persistent" where the model has such a candidate, or "fused" for a norm backward; any other mode switches the fused norm backward
    off), row_config (a whole row config), norm_backward_programs (the fused norm backward's
    program count), sdpa_config (the attention forward's tiles), sdpa_dkdv_config and
    sdpa_dq_config (the backward kernels'), sdpa_splits (decode key splits), sdpa_head_group
    (heads a causal grid interleaves; 0: the plain grid), sdpa_index_64 (int64 offsets in every
    attention kernel, as past 2^31 elements).

    Thresholds (default: the heuristics' own): row_loop_tile (the looped and split modes' tile),
    row_split_min_reduced (reduced length from which rows split), row_combine_values (partials a
    split combine folds per trip), norm_backward_max_reduced (longest row the fused norm
    backward holds as one tile; wider rows walk chunks of at most that width),
    column_prefetch_tiles and column_stream_apply (column splits' loads),
    conv_fold_channels_below (channels per group below which conv taps fold into the GEMM)."""

    autotune: bool = False
    autotune_top: Optional[int] = field(default_factory=autotune_top_from_environment)
    workspace_limit: Optional[int] = None
    backends: tuple = BACKENDS
    target: Optional[Target] = None
    matmul_config: Optional[MatmulConfig] = None
    conv_config: Optional[MatmulConfig] = None
    depthwise_config: Optional[DepthwiseConfig] = None
    moe_config: Optional[MoeConfig] = None
    row_mode: Optional[str] = None
    row_config: Optional[RowConfig] = None
    norm_backward_programs: Optional[int] = None
    sdpa_config: Optional[AttentionConfig] = None
    sdpa_dkdv_config: Optional[AttentionConfig] = None
    sdpa_dq_config: Optional[AttentionConfig] = None
    sdpa_splits: Optional[int] = None
    sdpa_head_group: Optional[int] = None
    sdpa_index_64: bool = False
    row_loop_tile: int = row_heuristics.LOOP_TILE
    row_split_min_reduced: int = row_heuristics.SPLIT_MIN_REDUCED
    row_combine_values: int = row_heuristics.COMBINE_VALUES
    norm_backward_max_reduced: int = row_heuristics.FUSED_MAX_REDUCED
    column_prefetch_tiles: int = row_heuristics.PREFETCH_COLUMN_TILES
    column_stream_apply: bool = row_heuristics.STREAM_APPLY
    conv_fold_channels_below: int = conv_heuristics.FOLD_CHANNELS_BELOW
    # Plan choice (Graph.plans()): None, the model's (or autotuning's) choice; an int k, every
    # kernel group's k-th ranked candidate (its first where it has fewer); a tuple, one index
    # per group in plan order. A chosen plan is built as chosen: never autotuned.
    plan: Optional[object] = None
    # block-scale quantize/dequantize kernels: blocks per program and warps (fitted to the problem)
    block_scale_config: Optional[BlockScaleConfig] = None
    # windowed normalization (LRN, divisive): the most elements one program's halo tile holds
    # (smaller forces several tiles along the window axes: how tests reach the halo seams)
    lrn_tile_elements: int = lrn_heuristics.MAX_TILE_ELEMENTS
    # windowed normalization's schedule: None, the model's; "tile", one tile a program;
    # "persistent", programs walking tiles in a pipelined loop, `lrn_programs` of them (None: as
    # many as the SMs hold at once; set with the schedule None, it forces the persistent form)
    lrn_schedule: Optional[str] = None
    lrn_programs: Optional[int] = None

    def __post_init__(self):
        for name, check in _CHECKS.items():
            checked = check(name, getattr(self, name))
            object.__setattr__(self, name, checked)

    def with_arguments(self, autotune=None, workspace_limit=None) -> "BuildOptions":
        """These options with build()'s shorthand arguments applied (None: keep the option)."""
        changes = {name: value for name, value in (("autotune", autotune), ("workspace_limit", workspace_limit))
                   if value is not None}
        return replace(self, **changes) if changes else self

    def forced(self) -> dict:
        """The fields set away from their defaults (what explain() shows); the autotune count
        only where the build autotunes."""
        # the count as this build took it (the environment may have changed since)
        default = BuildOptions(autotune_top=self.autotune_top)
        shown = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}
        if self.autotune:
            shown["autotune_top"] = self.autotune_top
        return shown


def _fail(name: str, expected: str, value):
    raise ValidationError(f"BuildOptions.{name}: expects {expected}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(name, value):
    if not isinstance(value, bool):
        _fail(name, "a bool", value)
    return value


def _count(minimum: int, optional: bool = False, power_of_two: bool = False):
    """A check of an int >= `minimum` (a power of two where asked; None allowed where optional)."""
    def check(name, value):
        if value is None and optional:
            return None
        if not _is_int(value) or value < minimum or (power_of_two and value & (value - 1)):
            shape = "a power of two" if power_of_two else "an int"
            _fail(name, f"{'None or ' if optional else ''}{shape} >= {minimum}", value)
        return value
    return check


def _backends(name, value):
    known = list(registry.names())  # read at each check: a backend registered later counts
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or not value:
        _fail(name, f"a non-empty tuple of backend names from {known}", value)
    for entry in value:
        if not isinstance(entry, str) or registry.parse(entry)[0] not in known:
            _fail(name, f"backend names from {known} (each alone, or as 'name:family,...')", entry)
        backend, taken = registry.parse(entry)
        families = registry.BACKENDS[backend].families
        listed = entry.partition(registry.FAMILY_SEPARATOR)[2].split(",")  # an empty name is a typo
        if taken is not None and (not taken or not taken <= families or "" in listed):
            _fail(name, f"families of backend {backend} after its name ({', '.join(sorted(families))})", entry)
    if len({registry.parse(entry)[0] for entry in value}) != len(value):
        _fail(name, "each backend once", value)
    return tuple(registry.canonical(entry) for entry in value)


def _instance(kind: type):
    def check(name, value):
        if value is not None and not isinstance(value, kind):
            _fail(name, f"None or a {kind.__name__}", value)
        return value
    return check


def _record_config(kind: type, decode):
    """A check of a forced config: of `kind`, and one its tuning-cache record would accept
    (block sizes powers of two in range, known variant, warps, stages...)."""
    def check(name, value):
        _instance(kind)(name, value)
        if value is not None:
            try:
                decode(value.to_record())
            except ValueError as error:
                raise ValidationError(f"BuildOptions.{name}: {error}") from None
            group_m = getattr(value, "group_m", 1)  # tile order: no record holds it
            if not _is_int(group_m) or group_m < 1:
                _fail(name, "a group_m that is an int >= 1", value)
        return value
    return check


def _attention_config(name, value):
    _instance(AttentionConfig)(name, value)
    if value is None:
        return None
    blocks_ok = all(_is_int(b) and b >= 16 and not b & (b - 1) for b in (value.block_m, value.block_n))
    if not blocks_ok or value.num_warps not in WARPS or not _is_int(value.num_stages) or value.num_stages < 1:
        _fail(name, f"blocks that are powers of two >= 16, warps in {list(WARPS)}, stages >= 1", value)
    return value


def _row_mode(name, value):
    if value is not None and value not in ROW_MODES:
        _fail(name, f"None or one of {list(ROW_MODES)}", value)
    return value


def _lrn_schedule(name, value):
    if value is not None and value not in lrn_heuristics.SCHEDULES:
        _fail(name, f"None or one of {list(lrn_heuristics.SCHEDULES)}", value)
    return value


def _plan_choice(name, value):
    if isinstance(value, list):
        value = tuple(value)
    indices = value if isinstance(value, tuple) else (value,)
    if value is not None and not (indices and all(_is_int(i) and i >= 0 for i in indices)):
        _fail(name, "None, an int >= 0 or a non-empty tuple of them (one per kernel group)", value)
    return value


_CHECKS = {
    "autotune": _flag,
    "autotune_top": _count(1, optional=True),
    "workspace_limit": _count(0, optional=True),
    "backends": _backends,
    "target": _instance(Target),
    "matmul_config": _record_config(MatmulConfig, MatmulConfig.from_record),
    "conv_config": _record_config(MatmulConfig, MatmulConfig.from_record),
    "depthwise_config": _record_config(DepthwiseConfig, DepthwiseConfig.from_record),
    "moe_config": _record_config(MoeConfig, MoeConfig.from_record),
    "row_mode": _row_mode,
    "row_config": _record_config(RowConfig, RowConfig.from_record),
    "norm_backward_programs": _count(1, optional=True),
    "sdpa_config": _attention_config,
    "sdpa_dkdv_config": _attention_config,
    "sdpa_dq_config": _attention_config,
    "sdpa_splits": _count(1, optional=True),
    "sdpa_head_group": _count(0, optional=True),
    "sdpa_index_64": _flag,
    "row_loop_tile": _count(2, power_of_two=True),
    "row_split_min_reduced": _count(1),
    "row_combine_values": _count(1, power_of_two=True),
    "norm_backward_max_reduced": _count(1),
    "column_prefetch_tiles": _count(0),
    "column_stream_apply": _flag,
    "conv_fold_channels_below": _count(0),
    "plan": _plan_choice,
    "block_scale_config": _instance(BlockScaleConfig),
    "lrn_tile_elements": _count(16, power_of_two=True),
    "lrn_schedule": _lrn_schedule,
    "lrn_programs": _count(1, optional=True),
}
assert set(_CHECKS) == {f.name for f in fields(BuildOptions)}, "every option has its check"
