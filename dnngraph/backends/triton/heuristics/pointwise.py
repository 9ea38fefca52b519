"""Configs for elementwise kernels: tile shape and warps, ranked by a bandwidth model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....errors import UnsupportedError
from ....fusion.patterns import COUNTER_OPS
from ....ops.base import broadcast_dims
from ....target import Target
from .layout import INT32_LIMIT, IterationSpace, iteration_space, operand_strides, row_major_index_strides

# Columns per tile. Rows at least this wide get one row segment per program: on the H100 at
# 16384x8192 bf16 with a broadcast bias, [1, 1024] tiles ran 273 us (2.95 TB/s) and
# [4, 2048] tiles 312 us (the bias tile is re-broadcast per row and registers double).
MAX_BLOCK_COLS = 1024
# Elements per program: 4096 keeps two 16-byte bf16 loads in flight per thread at 8 warps.
TILE_ELEMENTS = (1024, 2048, 4096, 8192)
MAX_BLOCK_ROWS = 256
ELEMENTS_PER_THREAD = 16
# Fixed cost of one program (launch slot, index math, tail of its loads), in seconds.
PROGRAM_OVERHEAD = 0.4e-6


@dataclass(frozen=True)
class PointwiseConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    estimate_us: float  # model time


def pow2_at_least(value: int) -> int:
    result = 1
    while result < value:
        result *= 2
    return result


# Columns a tile of a kernel storing bit-packed booleans spans at least: whole bytes (8 bits).
BIT_PACKED_MIN_COLS = 8


def candidates(space: IterationSpace, min_cols: int = 1) -> list[tuple[int, int, int]]:
    """(block_rows, block_cols, num_warps) triples worth ranking for this space; tiles at least
    `min_cols` (a power of two) wide."""
    cols_cap = max(min(pow2_at_least(space.cols), MAX_BLOCK_COLS), min_cols)
    rows_cap = min(pow2_at_least(space.rows), MAX_BLOCK_ROWS)
    result = set()
    for tile in TILE_ELEMENTS:
        block_cols = min(cols_cap, tile)
        wide = space.cols >= MAX_BLOCK_COLS
        block_rows = 1 if wide else max(1, min(rows_cap, tile // block_cols))
        elements = block_rows * block_cols
        warps = max(1, min(8, elements // (32 * ELEMENTS_PER_THREAD)))
        result.add((block_rows, block_cols, warps))
        # fewer warps than 2 measured slower at 1024-wide tiles (285 vs 273 us, H100)
        result.add((block_rows, block_cols, max(min(warps, 2), warps // 2)))
    return sorted(result)


def estimate(space: IterationSpace, block_rows: int, block_cols: int, num_warps: int,
             bytes_per_element: int, target: Target) -> float:
    """Model time in seconds on `target`: padded bytes at full bandwidth plus per-program cost
    over waves."""
    row_tiles = -(-space.rows // block_rows)
    col_tiles = -(-space.cols // block_cols)
    programs = row_tiles * col_tiles
    padded = row_tiles * block_rows * col_tiles * block_cols
    resident = target.sms * max(1, target.threads_per_sm // (32 * num_warps))
    waves = -(-programs // resident)
    return padded * bytes_per_element / target.bandwidth + waves * PROGRAM_OVERHEAD


def rank(space: IterationSpace, bytes_per_element: int, target: Target, min_cols: int = 1) -> list[PointwiseConfig]:
    """Candidate configs, best model time on `target` first."""
    configs = [PointwiseConfig(r, c, w, 1e6 * estimate(space, r, c, w, bytes_per_element, target))
               for r, c, w in candidates(space, min_cols)]
    return sorted(configs, key=lambda cfg: (cfg.estimate_us, -cfg.block_rows * cfg.block_cols))


@dataclass(frozen=True)
class OperandPlan:
    """One tensor a pointwise kernel reads or writes, with its strides over the space."""

    uid: int
    is_output: bool
    data_type: object  # DataType
    strides: tuple
    # a bit-packed operand whose tile runs of 8 columns are whole bytes (column stride 1, row
    # strides multiples of 8): read a byte per run (library.load_bit_runs)
    byte_runs: bool = False


@dataclass(frozen=True)
class PointwiseSchedule:
    space: IterationSpace
    operands: tuple  # inputs first, then outputs
    config: PointwiseConfig
    candidates: int
    reason: str
    counter: Optional[OperandPlan] = None  # logical row-major index, where counter ops need it
    counter_64: bool = False  # offset + index may pass 2^31: the counter in int64
    # the column tile is [BLOCK_C // 8, 8], runs of 8 columns each held by one thread: a bit-packed
    # operand of column stride 1 then packs or unpacks a byte per thread, no data crossing threads
    bit_runs: bool = False

    @property
    def programs(self) -> int:
        return -(-self.space.rows // self.config.block_rows) * -(-self.space.cols // self.config.block_cols)


def _counter_needs_int64(counter_nodes, domain, space: IterationSpace) -> bool:
    numel = 1
    for size in domain:
        numel *= size
    # an offset held in a tensor is an int64 value: offset + counter is int64 whatever the counter
    last_counter = max(getattr(n.attrs, "offset", 0) or 0 for n in counter_nodes) + numel - 1  # gen_index: none
    return space.index_64 or last_counter > INT32_LIMIT


def _order_operand(group) -> int:
    """The operand whose strides order the space: the first bit-packed output (its packed axis
    becomes the column axis, so 8 neighbouring columns fill one byte), else the first output."""
    packed = [i for i, t in enumerate(group.outputs) if t.data_type.is_bit_packed]
    return len(group.inputs) + (packed[0] if packed else 0)


def _byte_runs(tensor, strides) -> bool:
    """Whether a bit-packed operand's runs of 8 tile columns are whole bytes of it."""
    return tensor.data_type.is_bit_packed and strides[-1] == 1 and all(s % 8 == 0 for s in strides[:-1])


def _check_bit_packed_stores(group, tensors, space: IterationSpace) -> None:
    """Each bit-packed output's rows start on a byte (row strides multiples of 8) and its columns
    either walk its bytes in whole runs (stride 1: a tile of whole-byte columns owns its bytes)
    or step by whole bytes (a multiple of 8: each element alone in its byte, as a packed axis of
    extent 1 leaves it). Two bit-packed outputs of different packed axes in one kernel cannot both."""
    first_output = len(group.inputs)
    for tensor, strides in zip(tensors[first_output:], space.strides[first_output:]):
        if not tensor.data_type.is_bit_packed:
            continue
        if (space.cols > 1 and strides[-1] != 1 and strides[-1] % 8) or any(s % 8 for s in strides[:-1]):
            raise UnsupportedError(f"bit-packed output {tensor.name!r} (strides {list(tensor.stride)}) is not "
                                   f"packed along this kernel's column axis (strides {list(strides)} over "
                                   f"{list(space.sizes)}): store it from a kernel of its own layout")


def schedule(group, target: Target) -> PointwiseSchedule:
    """Iteration space, operand strides and the best-ranked config on `target` of a pointwise group."""
    tensors = list(group.inputs) + list(group.outputs)
    domain = broadcast_dims("pointwise", [(n.name, n.outputs[0].dim) for n in group.nodes])
    strides = [operand_strides(domain, t.dim, t.stride) for t in tensors]
    counter_nodes = [n for n in group.nodes if n.op in COUNTER_OPS]
    if counter_nodes:  # the partitioner made the domain their shape: one index serves them all
        strides.append(row_major_index_strides(domain))
    packs = any(t.data_type.is_bit_packed for t in group.outputs)
    # a packed output narrower than the domain still packs along its columns: its broadcast axes outermost
    space = iteration_space(domain, strides, order_operand=_order_operand(group), broadcast_outermost=packs)
    if len(space.sizes) == 1:  # the kernel always walks rows x columns
        space = IterationSpace((1,) + space.sizes, tuple((0,) + s for s in space.strides), space.index_64)
    _check_bit_packed_stores(group, tensors, space)
    operands = tuple(OperandPlan(t.uid, i >= len(group.inputs), t.data_type, s, _byte_runs(t, s))
                     for i, (t, s) in enumerate(zip(tensors, space.strides)))
    bit_runs = any(t.data_type.is_bit_packed and s[-1] == 1 for t, s in zip(tensors, space.strides))
    counter, counter_64 = None, False
    if counter_nodes:
        counter = OperandPlan(None, False, None, space.strides[len(tensors)])
        counter_64 = _counter_needs_int64(counter_nodes, domain, space)
    bytes_per_element = sum(t.data_type.itemsize for t in tensors if tuple(t.dim) == tuple(domain)
                            and not t.data_type.is_bit_packed) or 1
    ranked = rank(space, bytes_per_element, target, BIT_PACKED_MIN_COLS if packs or bit_runs else 1)
    best = ranked[0]
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us at "
              f"{target.bandwidth / 1e12:.1f} TB/s for {bytes_per_element} B/element over "
              f"{space.rows}x{space.cols}")
    return PointwiseSchedule(space, operands, best, len(ranked), reason, counter, counter_64, bit_runs)
