"""Row kernels (reductions, softmax, norms): geometry and configs ranked by a bandwidth model.

A row kernel sees its domain as kept axes K (one output row each) times reduced axes R. Both
sides are ordered by the main input's strides and merged like pointwise iteration spaces, so an
NHWC batchnorm is K=[C] x R=[N*H*W] and a layernorm is K=[rows] x R=[hidden]. Each program
owns BLOCK_K rows and walks R in one tile (one-pass: the row lives in registers), in a loop
(looped: statistics loops, then an output loop whose re-reads hit L2), or split over several
programs whose partials a second kernel combines in a fixed order (split: few rows, long R).
Where K is the vectorized side (NHWC batchnorm, column sums) a split is a column split: tiles of
COLUMN_TILES, a grid of one wave, loops that prefetch, and an apply pass that walks backwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ....ops.norm import geometry as norm_geometry
from ....tensor import contiguous_strides
from ....errors import UnsupportedError
from ....target import Target
from .layout import INT32_LIMIT, iteration_space, operand_strides
from .pointwise import pow2_at_least
from ....runtime.tuning_cache import WARPS, record_choice, record_field, record_int

# fp32 values a program holds per live tile in one-pass mode: 16384 at 16 warps is 32 registers
# per thread and value; wider rows spill, so they loop instead.
ONE_PASS_MAX = 16384
# Tile of the looped and split modes: 4096 fp32 values, eight 16-byte bf16 loads per thread at 8
# warps in flight per loop trip. (BuildOptions.row_loop_tile and row_split_min_reduced lower
# this and SPLIT_MIN_REDUCED so that tests loop and split small shapes.)
LOOP_TILE = 4096
# A tile of at least this many elements per program keeps enough loads in flight at 3 TB/s.
MIN_TILE = 2048
MAX_WARPS = 16
# Split when one program per row block leaves more than half the SMs idle and R is long.
SPLIT_MIN_REDUCED = 8192
PROGRAMS_PER_SM = 4
# Fixed cost of one program, seconds (index math, reduction tree, tail of its loads).
PROGRAM_OVERHEAD = 0.6e-6
# Bytes re-read from L2 cost this fraction of HBM bytes (looped statistics passes).
L2_REREAD_COST = 0.25
# Column splits: split mode where K is the vectorized side (NHWC batchnorm: K=[C] channels
# contiguous, R=[N*H*W] pixels). The constants below come from benchmarks/sweep_column_split.py
# on the H100 (batchnorm 32x256x56x56 NHWC bf16, copy ceiling 2.58 TB/s in the same run; forward
# / backward microseconds, model config unless said).
# Tiles [BLOCK_K channels, BLOCK_R pixels], best first: (64, 32) at 4 warps 69.9 / 101.6 us;
# (128, 32) at 4 warps 69.5 / 106.6 and (64, 64) at 8 warps 72.0 / 107.3 at 4 programs per SM.
COLUMN_TILES = ((64, 32), (64, 64), (128, 32))
COLUMN_WARPS = 4
# Resident programs per SM the grid is sized for, by tiles loaded per trip (1, 2 or more): each
# tile input costs registers (its raw tiles in flight), and a grid past what fits runs a second
# wave. Forward (x; 65 registers, 7 programs fit): 69.9 us at 6, 77.0 at 5, 74.1 at 4, 77.9 at 8;
# backward (dy, x; 95 registers, 5 fit): 101.6 us at 4, 107.9 at 5, 108.2 at 6.
COLUMN_PROGRAMS_PER_SM = (6, 4)
# Column problems split from 1/COLUMN_SPLIT_SHARE of SPLIT_MIN_REDUCED on: unsplit, they get one
# program per BLOCK_K rows (C=64 channels: one program for the whole tensor).
COLUMN_SPLIT_SHARE = 8
# Column-split partial and apply loops keep this many tiles' loads in flight ahead of the one
# they work on (register buffering: Triton pipelines no plain loads); 0: none. First round, 4
# programs per SM: 74.0 / 103.0 us with one tile ahead, 81.1 / 113.7 without; second round, at
# the model's 6 / 4 per SM: two ahead 69.4 / 101.5 against 69.9 / 101.6 (noise, more registers).
PREFETCH_COLUMN_TILES = 1
# The apply pass of a column split walks programs and chunks last to first (the tiles the
# partial pass read last may still sit in L2) and loads and stores with evict-first hints (what
# it writes must not push out what it is about to read again): 74.0 / 103.0 us, against
# 77.9 / 105.8 without (first round, 4 programs per SM, prefetch on). The apply kernels then run
# past the copy rate over their bytes (forward 31.7 us for 103 MB).
STREAM_APPLY = True
# The combine kernel folds a [COMBINE_BLOCK_K rows, split_tile] tile of partials per trip, with
# split_tile up to COMBINE_VALUES // COMBINE_BLOCK_K: one trip for a few hundred splits (2-3 us
# for 256 channels x 196 splits; four programs of three trips each took about 5).
COMBINE_VALUES = 2048
COMBINE_BLOCK_K = 8
# Persistent one-pass rows: programs that each walk a contiguous block of rows, the next row
# block's loads in flight while one reduces (the fused norm backward's walk and prefetch rule,
# FUSED_ROW_PREFETCH_VALUES), operands along R that the statistics read (none in a forward norm)
# loaded once per program, those only the element outputs read (scale, bias) after the
# reductions. One row per program: layernorm 4096x14336 bf16 held x, scale and bias as fp32
# (rmsnorm two tiles) and took 255 registers at 4 warps with 128 bytes spilled, 179 at 8 (sm_90):
# at most two programs per SM, none loading while it reduced: 108 us, 53% of copy (H200
# 2026-11-29). Persistent at 16 warps compiled for sm_90: 104 registers at rows of 16384 lanes
# (one program per SM), 64 at 8192 (two fit: PERSISTENT_TWO_PER_SM_VALUES); holding scale and
# bias across the loop took 128 and spilled. The model ranks it where the row re-reads of
# R-only operands it saves are worth more than nothing (softmax and reductions tie and keep
# one_pass). Timed: see PERSISTENT_MIN_ROW_VALUES.
PERSISTENT_ROWS = True
PERSISTENT_TWO_PER_SM_VALUES = 8192
# Inputs along R (tile and R-only) from which rows go persistent: rmsnorm's (x, scale) fit two
# programs per SM at 16 warps and 64 registers one row per program, and reached 95% of copy
# (4096x14336 bf16, H100); persistent, one program per SM at 100 registers (not timed).
PERSISTENT_MIN_TILE_INPUTS = 3
# Rows (a power of two of lanes) from which rows go persistent. H200, 2026-11-29, layernorm fwd
# bf16, persistent against one_pass: 4096x14336 79 us against 108, 16384x8192 154 against 153,
# 4096x8192 44 against 44, 4096x4096 31 against 25 (bench_memory_bound.py): it pays where one row
# per program fits only one program per SM.
PERSISTENT_MIN_ROW_VALUES = 16384
MODES = ("one_pass", "looped", "split", "persistent")
# bounds a tuning-cache record must respect (wider than any candidate, far below nonsense)
MAX_BLOCK = 1 << 17
MAX_SPLITS = 1 << 16


@dataclass(frozen=True)
class RowOperand:
    """A tensor a row kernel reads or writes, with strides over the merged K and R axes."""

    uid: int
    data_type: object  # DataType, or None for float32 scratch
    k_strides: tuple
    r_strides: tuple
    is_output: bool

    @property
    def kind(self) -> str:
        """'tile' (varies over K and R), 'row' (over K only), 'col' (over R only) or 'scalar'."""
        over_k, over_r = any(self.k_strides), any(self.r_strides)
        return {(True, True): "tile", (True, False): "row", (False, True): "col",
                (False, False): "scalar"}[(over_k, over_r)]


@dataclass(frozen=True)
class RowGeometry:
    k_sizes: tuple
    r_sizes: tuple
    operands: tuple  # RowOperand
    index_64: bool
    r_contiguous: bool  # the main input's smallest stride is on R (rows are vectorized)
    # the reduced length a kernel's source is written for: the longest it runs (the bucket's top
    # where a dynamic graph was specialised at sizes of a bucket; None: this one's)
    source_reduced: Optional[int] = None

    @property
    def rows(self) -> int:
        return _product(self.k_sizes)

    @property
    def reduced(self) -> int:
        return _product(self.r_sizes)

    def operand(self, uid: int) -> RowOperand:
        return next(op for op in self.operands if op.uid == uid)


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


def geometry(domain: tuple, reduced_axes: tuple, operands: list, main: int) -> RowGeometry:
    """Split `domain` into merged K and R axes; operands are (uid, dtype, strides, is_output) with strides over the domain, `main` the index of the input that orders axes."""
    kept = [a for a in range(len(domain)) if a not in reduced_axes]
    reduced = [a for a in range(len(domain)) if a in reduced_axes]
    strides = [op[2] for op in operands]

    def side(axes):
        space = iteration_space(tuple(domain[a] for a in axes) or (1,),
                                [tuple(s[a] for a in axes) or (0,) for s in strides], main)
        return space

    k_space, r_space = side(kept), side(reduced)
    planned = tuple(RowOperand(uid, dtype, ks, rs, out)
                    for (uid, dtype, _, out), ks, rs in zip(operands, k_space.strides, r_space.strides))
    reach = max(sum((n - 1) * s for n, s in zip(k_space.sizes, op.k_strides))
                + sum((n - 1) * s for n, s in zip(r_space.sizes, op.r_strides)) for op in planned)
    main_op = planned[main]
    smallest_r = min((s for s in main_op.r_strides if s), default=None)
    smallest_k = min((s for s in main_op.k_strides if s), default=None)
    r_contiguous = smallest_k is None or (smallest_r is not None and smallest_r < smallest_k)
    total = _product(k_space.sizes) * _product(r_space.sizes)
    return RowGeometry(k_space.sizes, r_space.sizes, planned,
                       reach > INT32_LIMIT or total > INT32_LIMIT, r_contiguous)


@dataclass(frozen=True)
class RowConfig:
    mode: str  # "one_pass", "looped" or "split"
    block_k: int
    block_r: int
    num_warps: int
    splits: int  # programs per row block (split mode), else 1
    estimate_us: float

    @property
    def text(self) -> str:
        return (f"{self.mode} BLOCK_K={self.block_k} BLOCK_R={self.block_r} SPLITS={self.splits} "
                f"warps={self.num_warps}")

    def to_record(self) -> dict:
        return {"mode": self.mode, "block_k": self.block_k, "block_r": self.block_r,
                "num_warps": self.num_warps, "splits": self.splits}

    @staticmethod
    def from_record(record: dict) -> "RowConfig":
        """The config a tuning-cache record holds; ValueError for an unknown mode or an illegal
        value (wrong type, a block size that is not a power of two in range, ...)."""
        num_warps = record_field(record, "num_warps", int)
        if num_warps not in WARPS:
            raise ValueError(f"num_warps {num_warps} is not one of {list(WARPS)}")
        return RowConfig(record_choice(record, "mode", MODES),
                         record_int(record, "block_k", 1, MAX_BLOCK, power_of_two=True),
                         record_int(record, "block_r", 1, MAX_BLOCK, power_of_two=True),
                         num_warps, record_int(record, "splits", 1, MAX_SPLITS), 0.0)


@dataclass(frozen=True)
class RowTraits:
    """What the recipe tells the model: passes over R and whether it may split."""

    stat_passes: int  # statistics loops over R before the output pass (looped mode)
    has_tile_outputs: bool
    can_split: bool
    live_tiles: int  # tile values alive at once in one-pass mode
    tile_inputs: int = 1  # inputs loaded per tile (they vary along R)
    # the anchor op, for the measured tables (ONE_PASS_WARPS); a tuning key names it already
    op: str = field(default="", repr=False)
    # bytes per reduced index of the inputs that vary along R only (a norm's scale and bias)
    col_bytes: int = 0


# Values per thread of a tile, by what the H100 sweep (benchmarks/sweep_rows.py) measured best:
# one-pass forward rows hold 32 (layernorm 16384x8192 bf16: 184 us at 8 warps, 205 at 16);
# loops over rows and register-heavy backward rows keep 8 (layernorm 4096x14336 looped by 2048:
# 108 us at 8 warps, 126 at 4). Column splits take COLUMN_WARPS.
DENSE_VALUES_PER_THREAD = 32
LIGHT_VALUES_PER_THREAD = 8
# One-pass rows whose warps were measured to beat that rule, by (op, BLOCK_R). Layernorm forward
# 4096x14336 bf16 on the H200 (2026-11-29, benchmarks/sweep_rows.py ln_fwd_4096x14336): 108.9 us
# at 4 warps, 117.0 at 8, 115.7 at 16. Compiled for sm_90 its kernel takes 255 registers at 4
# warps (128 spill bytes), so two programs share an SM, against 179 at 8 and 115 at 16: one
# program per SM, whose loads likely stall while it waits on the row's two dependent
# reductions. (Rmsnorm and softmax rows of 16384 take 64 registers at 16 warps: two programs
# per SM already; benchmarks/sweep_rows.py rms_fwd_* and softmax_fwd_* time them by warps.)
ONE_PASS_WARPS = {("layernorm", 16384): 4}


def _warps(elements: int, values_per_thread: int = LIGHT_VALUES_PER_THREAD) -> int:
    return max(1, min(MAX_WARPS, pow2_at_least(elements // (32 * values_per_thread) or 1)))


def _values_per_thread(geo: RowGeometry, traits: RowTraits, mode: str) -> int:
    dense = mode == "one_pass" and geo.r_contiguous and traits.live_tiles <= 2
    return DENSE_VALUES_PER_THREAD if dense else LIGHT_VALUES_PER_THREAD


def _config_warps(geo: RowGeometry, traits: RowTraits, mode: str, block_k: int, block_r: int) -> int:
    if mode == "split" and not geo.r_contiguous:  # column split: at least 4 values per thread
        return max(1, min(COLUMN_WARPS, block_k * block_r // 128))
    if mode == "one_pass" and geo.r_contiguous and (traits.op, block_r) in ONE_PASS_WARPS:
        return ONE_PASS_WARPS[traits.op, block_r]
    return _warps(block_k * block_r, _values_per_thread(geo, traits, mode))


def candidates(geo: RowGeometry, traits: RowTraits, target: Target, loop_tile: int = LOOP_TILE,
               split_min_reduced: int = SPLIT_MIN_REDUCED) -> list[tuple]:
    """(mode, block_k, block_r, splits) tuples worth ranking on `target`, the looped and split
    tiles of `loop_tile` values, splits from `split_min_reduced` reduced values on."""
    rows, reduced = geo.rows, geo.reduced
    r_pow2 = pow2_at_least(reduced)
    k_pow2 = pow2_at_least(rows)
    result = []
    one_pass_budget = ONE_PASS_MAX // max(1, traits.live_tiles // 2)
    if geo.r_contiguous:
        if r_pow2 <= one_pass_budget:
            for tile in (MIN_TILE, 2 * MIN_TILE, 4 * MIN_TILE):
                block_k = max(1, min(k_pow2, tile // r_pow2))
                result.append(("one_pass", block_k, r_pow2, 1))
        if r_pow2 <= one_pass_budget and PERSISTENT_ROWS and traits.tile_inputs >= PERSISTENT_MIN_TILE_INPUTS \
                and r_pow2 >= PERSISTENT_MIN_ROW_VALUES:
            result += persistent_rows(rows, r_pow2, target)
        for block_r in (loop_tile // 2, loop_tile, 2 * loop_tile):
            if block_r <= r_pow2:
                result.append(("looped", 1, block_r, 1))
    else:  # K is the vectorized side: wide K blocks, a loop down R
        for block_k in (64, 128, 256):
            block_k = min(block_k, k_pow2)
            block_r = max(1, min(r_pow2, loop_tile // block_k))
            mode = "one_pass" if r_pow2 <= block_r else "looped"
            result.append((mode, block_k, block_r, 1))
    if traits.can_split and not geo.r_contiguous and reduced * COLUMN_SPLIT_SHARE >= split_min_reduced:
        result += column_splits(geo, target, traits.tile_inputs, loop_tile)
    elif traits.can_split and reduced >= split_min_reduced:
        for mode, block_k, block_r, _ in list(result):
            if mode == "persistent" or (mode == "one_pass" and block_k > 1 and geo.r_contiguous):
                continue
            blocks = -(-rows // block_k)
            for waves in (1, 2, 4):
                splits = min(-(-waves * target.sms * PROGRAMS_PER_SM // blocks), reduced // block_r)
                if splits >= 2:
                    result.append(("split", block_k, block_r, splits))
    return sorted(set(result))


def persistent_rows(rows: int, r_pow2: int, target: Target) -> list[tuple]:
    """Persistent one-pass candidates (mode, block_k, block_r, programs): a tile of at least
    MIN_TILE values a trip, one or two programs per SM of `target` as their registers allow
    (PERSISTENT_TWO_PER_SM_VALUES); none where the rows would leave a program fewer than two
    trips (nothing to prefetch)."""
    block_k = max(1, min(pow2_at_least(rows), MIN_TILE // r_pow2))
    programs = target.sms * (2 if block_k * r_pow2 <= PERSISTENT_TWO_PER_SM_VALUES else 1)
    if -(-rows // block_k) < 2 * programs:
        return []
    return [("persistent", block_k, r_pow2, programs)]


def column_splits(geo: RowGeometry, target: Target, tile_inputs: int = 1, loop_tile: int = LOOP_TILE) -> list[tuple]:
    """Split candidates where K is the vectorized side: one tile shape per COLUMN_TILES entry
    (R widened where K is narrower than the tile, no more than `loop_tile` values), chunks sized
    so the programs fill the SMs of `target` as deep as COLUMN_PROGRAMS_PER_SM says, and no
    chunk empty."""
    found = []
    per_sm = COLUMN_PROGRAMS_PER_SM[min(max(tile_inputs, 1), len(COLUMN_PROGRAMS_PER_SM)) - 1]
    k_pow2, r_pow2 = pow2_at_least(geo.rows), pow2_at_least(geo.reduced)
    for tile_k, tile_r in COLUMN_TILES:
        block_k = min(tile_k, k_pow2)
        block_r = max(1, min(r_pow2, min(tile_k * tile_r, loop_tile) // block_k))
        blocks = -(-geo.rows // block_k)
        splits = min(-(-target.sms * per_sm // blocks), -(-geo.reduced // block_r))
        splits = -(-geo.reduced // split_chunk(geo.reduced, splits, block_r))
        if splits >= 2:
            found.append(("split", block_k, block_r, splits))
    return found


def split_chunk(reduced: int, splits: int, block_r: int) -> int:
    """Elements of R one split program walks: whole BLOCK_R tiles (the kernels' `chunk`)."""
    return -(-(-(-reduced // splits)) // block_r) * block_r


def is_column_split(geo: RowGeometry, config) -> bool:
    """Split mode with K the vectorized side: the partial and apply kernels prefetch."""
    return config.mode == "split" and not geo.r_contiguous


def _column_rank(geo: RowGeometry, mode, block_k, block_r) -> int:
    """Position of a column split's tile in COLUMN_TILES (measured best first); 0 otherwise."""
    if mode != "split" or geo.r_contiguous:
        return 0
    for index, (tile_k, tile_r) in enumerate(COLUMN_TILES):
        if block_k * block_r == tile_k * tile_r and block_k == min(tile_k, pow2_at_least(geo.rows)):
            return index
    return len(COLUMN_TILES)


def combine_blocks(rows: int, splits: int, values: int = COMBINE_VALUES) -> tuple:
    """(BLOCK_K, SPLIT_TILE) of the split combine kernel: few rows per program, as many splits
    per trip as `values` partials allow."""
    block_k = min(COMBINE_BLOCK_K, pow2_at_least(rows))
    return block_k, min(pow2_at_least(splits), max(1, values // block_k))


def estimate(geo: RowGeometry, traits: RowTraits, mode, block_k, block_r, splits,
             bytes_main: int, bytes_rows: int, target: Target) -> float:
    """Model seconds on `target`: HBM bytes (padded tiles, re-reads) plus per-program cost over waves."""
    rows_padded = -(-geo.rows // block_k) * block_k
    r_padded = -(-geo.reduced // block_r) * block_r
    tile_bytes = rows_padded * r_padded * bytes_main
    if mode == "persistent":  # the R-only operands once per program, not once per row block
        tile_bytes -= (rows_padded - splits * block_k) * r_padded * traits.col_bytes
    rereads = 0.0
    if mode == "looped":
        rereads = traits.stat_passes * tile_bytes * L2_REREAD_COST
    if mode == "split":
        # statistics pass reads the inputs, the apply pass reads them again (too big for L2)
        rereads = tile_bytes if traits.has_tile_outputs else 0.0
    # a persistent program pays the per-program cost per trip all the same (its reductions)
    programs = -(-geo.rows // block_k) * (1 if mode == "persistent" else splits)
    warps = _config_warps(geo, traits, mode, block_k, block_r)
    resident = target.sms * max(1, target.threads_per_sm // 32 // warps)
    waves = -(-programs // resident)
    # a program streams its share serially: few programs cannot fill HBM
    fill = min(1.0, programs / (target.sms * 2))
    seconds = (tile_bytes + rereads + geo.rows * bytes_rows) / (target.bandwidth * max(fill, 0.05))
    return seconds + waves * PROGRAM_OVERHEAD * (1 + (mode == "split"))


@dataclass(frozen=True)
class RowSchedule:
    geometry: RowGeometry
    config: RowConfig
    candidates: int
    reason: str
    ranked: tuple = ()  # every candidate, best first (autotuning draws from it)

    def signature(self, traits: "RowTraits") -> str:
        """The problem as the tuning cache keys it: merged sizes, strides and types, no uids."""
        operands = ";".join(f"{o.kind}:{o.data_type.name if o.data_type else 'f32'}:{o.k_strides}:{o.r_strides}"
                            f"{':out' if o.is_output else ''}" for o in self.geometry.operands)
        return f"K{self.geometry.k_sizes} R{self.geometry.r_sizes} {traits} {operands}"

    @property
    def programs(self) -> int:
        if self.config.mode == "persistent":  # `splits` holds the program count
            return self.config.splits
        return -(-self.geometry.rows // self.config.block_k) * self.config.splits


def schedule(geo: RowGeometry, traits: RowTraits, bytes_main: int, bytes_rows: int, target: Target,
             mode: str | None = None, forced: RowConfig | None = None, loop_tile: int = LOOP_TILE,
             split_min_reduced: int = SPLIT_MIN_REDUCED) -> RowSchedule:
    """The best-ranked config on `target` for a row kernel of this geometry: among the
    candidates of `mode` where one is forced (and there are any), or `forced` itself;
    `loop_tile` and `split_min_reduced` as candidates() takes them."""
    ranked = []
    for shape, block_k, block_r, splits in candidates(geo, traits, target, loop_tile, split_min_reduced):
        seconds = estimate(geo, traits, shape, block_k, block_r, splits, bytes_main, bytes_rows, target)
        warps = _config_warps(geo, traits, shape, block_k, block_r)
        ranked.append(RowConfig(shape, block_k, block_r, warps, splits, seconds * 1e6))
    ranked.sort(key=lambda c: (c.estimate_us, c.mode != "one_pass",
                               _column_rank(geo, c.mode, c.block_k, c.block_r), -c.block_k * c.block_r))
    how = "model"
    if mode is not None and any(c.mode == mode for c in ranked):
        ranked, how = [c for c in ranked if c.mode == mode], f"{mode} (BuildOptions.row_mode)"
    if forced is not None:
        if forced.mode == "split" and not traits.can_split:
            raise UnsupportedError(f"BuildOptions.row_config forces a split row kernel on a recipe that cannot "
                                   f"split its rows ({traits})")
        ranked.insert(0, replace(forced, estimate_us=0.0))
        how = "BuildOptions.row_config"
    best = ranked[0]
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us for K={geo.rows} rows x "
              f"R={geo.reduced} reduced, {bytes_main} B/element at {target.bandwidth / 1e12:.1f} TB/s")
    if how != "model":
        reason = f"forced by {how}; " + reason
    return RowSchedule(geo, best, len(ranked), reason, tuple(ranked))


# --- fused norm backward (layernorm, rmsnorm) ---------------------------------------------------
# dscale = sum over rows of dy * xhat and dbias = sum of dy, taken in the dx kernel: each program
# walks a contiguous block of rows (the whole row in registers, mean and rstd given), stores dx
# per row and folds the rows' dy * xhat and dy into fp32 column sums held in registers, written
# once as one row of [programs, C] partials; a small combine kernel sums the partials in program
# order (deterministic) and casts. dy and x are read once and dx written once, against a second
# read of dy and x by a dscale/dbias kernel of their own (5 row-sized transfers instead of 3: the
# separate form peaked at 36-59% of the copy rate on the H100, issue 14).
FUSE_NORM_BACKWARD = True
# Longest row (power of two) a fused program holds: dy, x and the two column sums are four live
# fp32 row tiles, 4 x 8192 / 512 threads = 64 registers per thread at 16 warps; 16384 would take
# 128 with the temporaries on top and spill. Longer rows keep the separate dx and dscale/dbias
# kernels (their looped mode re-reads from L2 and their column split reduces across rows).
FUSED_MAX_REDUCED = 8192
# Elements per row block of a fused program: short rows take several per trip (a trip of one
# 256-element row would issue too few loads to keep HBM busy); rows of 4096 and up take one.
FUSED_TILE = 4096
# Programs per SM: two row blocks in flight per SM, about 2 x 32 KB of dy and x at C=8192 bf16,
# what Little's law asks at 3.35 TB/s and ~1 us latency spread over 132 SMs (25 KB).
FUSED_PROGRAMS_PER_SM = 2
# Rows each program walks at least: its partial row (2 sums x C x 4 B, written, then read by the
# combine) against 32 rows of dy, x and dx (32 x 3 x C x 2 B at bf16) adds 8% to the bytes moved;
# 4096 rows therefore take 128 programs, 16384 rows 264 (two per SM).
FUSED_MIN_ROWS_PER_PROGRAM = 32
# Wider rows take the chunked fused form: a trip of FUSED_LOOP_ROWS rows walks the row in
# FUSED_LOOP_CHUNK-wide chunks twice (a loop folding the row sums, then dx from the same chunks,
# re-read from L2), the column sums of every chunk held in registers across the program's rows
# (the second walk is unrolled: registers cannot be indexed). dy and x come from HBM once.
# The column sums cost accumulators x (row in whole chunks) / threads registers per thread: 64
# for a layernorm row of 14336 (four chunks of 4096) at 16 warps. Past FUSED_COLUMN_VALUES per
# thread (or FUSED_MAX_CHUNKS chunks of unrolled source) the separate dx and dscale/dbias kernels
# run instead. One program per SM: the column sums fill half the register file.
# H200 2026-11-29, 4096x14336 bf16, layernorm / rmsnorm microseconds (benchmarks/sweep_rows.py
# norm_bwd_*, two chunks prefetched): chunk 4096 208.4 / 170.2, chunk 2048 223.8 / 198.2; two
# rows a trip 260.0 / 173.2 at chunk 4096, 952.1 / 607.8 at 2048 (spilled); two programs per SM
# at 8 warps 232.0 / 209.7. Spill stores compiled for sm_90 (16 warps, 128 registers, layernorm /
# rmsnorm with dbias, bytes) by chunks prefetched 0, 1, 2, 3: chunk 4096 76 / 4, 96 / 48,
# 160 / 60, 304 / 204; chunk 2048 28 / 0, 48 / 0, 32 / 0, 32 / 0; chunk 1024 unprefetched
# 92 / 84; two rows a trip at chunk 2048 924+.
FUSED_LOOP_CHUNK = 4096
FUSED_LOOP_ROWS = 1
FUSED_LOOP_WARPS = 16
FUSED_LOOP_PROGRAMS_PER_SM = 1
FUSED_COLUMN_VALUES = 64
FUSED_MAX_CHUNKS = 16
# Chunks whose loads the row-sum loop keeps in flight ahead of the one it folds (Triton pipelines
# no plain loads). HBM wants about 25 KB in flight per SM (3.35 TB/s x ~1 us over 132 SMs; 36 KB
# at the H200's 4.8 TB/s). H200 at chunk 2048 (8 KB of dy and x at bf16), layernorm / rmsnorm
# microseconds by chunks ahead: 0 240.2 / 208.0, 1 222.9 / 205.7, 2 223.8 / 198.2, 3 212.1 /
# 192.2. A chunk of 4096 holds 16 KB: two ahead (32 KB, the 208.4 / 170.2 above) keep more in
# flight than three of 2048 did, while three (48 KB, not timed) double the spills.
FUSED_LOOP_PREFETCH = 2
# The chunked form's next row block: its first FUSED_LOOP_PREFETCH chunks load while this block's
# dx walks its chunks from L2 (else the row-sum loop of every trip starts with nothing in
# flight). Compiled for sm_90, spill stores grow from 160 / 60 to 164 / 104 bytes (layernorm /
# rmsnorm with dbias). Reasoned, not yet timed: benchmarks/sweep_rows.py norm_bwd_*_4096x14336.
FUSED_LOOP_PRIME_NEXT_ROWS = True


# Values of dy (and of x) a one-tile fused program keeps loading ahead of the row block it
# reduces, in whole blocks (at least one). Unprefetched, a program (one per SM at 16 warps: 80
# registers compiled for sm_90) had one block of dy and x in flight and none while it reduced:
# layernorm / rmsnorm 4096x4096 bf16 ran at 69 / 59 us (35% / 41% of copy, H200 2026-11-29,
# BENCHMARKS.md). 8192 values (two blocks of 4096, 32 KB of dy and x) cover the ~36 KB per SM
# HBM wants at 4.8 TB/s; compiled for sm_90 at 16 warps: 96 registers at 4096, 127 at 8192 (one
# block ahead; two spilled 44 bytes). Reasoned, not yet timed: benchmarks/sweep_rows.py
# norm_bwd_*_4096x4096 times 0 (off), 4096 and 16384.
FUSED_ROW_PREFETCH_VALUES = 8192
# ... and no more than two blocks: short rows' tiles of 2048 (rmsnorm 16x100 at 8 warps) took
# 191 registers four blocks ahead.
FUSED_ROW_PREFETCH_MAX = 2


def fused_prefetch(config: RowConfig, geo: RowGeometry) -> int:
    """Loads the fused kernel keeps in flight ahead: chunks of the chunked form's row-sum loop,
    row blocks of the one-tile form."""
    if config.block_r < (geo.source_reduced or geo.reduced):
        return FUSED_LOOP_PREFETCH
    if not FUSED_ROW_PREFETCH_VALUES:
        return 0
    return min(FUSED_ROW_PREFETCH_MAX, max(1, FUSED_ROW_PREFETCH_VALUES // (config.block_k * config.block_r)))


def _pow2_at_most(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


def fused_norm_backward(geo: RowGeometry, accumulators: int, bytes_main: int, target: Target,
                        programs: int | None = None,
                        max_reduced: int = FUSED_MAX_REDUCED) -> RowConfig | None:
    """The fused dx + dscale/dbias config on `target` of a feature-norm backward (mode "fused",
    `splits` holding the program count; `programs` forces it), or None where it does not
    apply: switched off, rows not vectorized (K the contiguous side), or rows whose column sums
    do not fit a program's registers. Rows up to `max_reduced` (power of two) are one tile
    (BLOCK_R covers the row); wider ones are walked in BLOCK_R chunks (the looped form)."""
    if not FUSE_NORM_BACKWARD:
        return None
    block_r = pow2_at_least(geo.reduced)
    # one column is vectorized along K as well: the tile loads walk rows, still coalesced
    if not (geo.r_contiguous or geo.reduced == 1):
        return None
    if block_r <= max_reduced:
        block_k = max(1, min(pow2_at_least(geo.rows), FUSED_TILE // block_r))
        warps = _warps(block_k * block_r)
        wanted = min(target.sms * FUSED_PROGRAMS_PER_SM, -(-geo.rows // FUSED_MIN_ROWS_PER_PROGRAM))
        default_programs = max(target.sms, wanted)
    else:
        block_r = min(FUSED_LOOP_CHUNK, _pow2_at_most(max_reduced))
        chunks = -(-geo.reduced // block_r)
        warps = FUSED_LOOP_WARPS
        if chunks > FUSED_MAX_CHUNKS or accumulators * chunks * block_r > FUSED_COLUMN_VALUES * warps * 32:
            return None
        # several rows a trip keep more loads in flight, unless there are too few rows to fill the SMs
        block_k = FUSED_LOOP_ROWS if geo.rows >= target.sms * FUSED_LOOP_ROWS else 1
        default_programs = target.sms * FUSED_LOOP_PROGRAMS_PER_SM
    blocks = -(-geo.rows // block_k)
    programs = max(1, min(blocks, programs or default_programs))
    partial_bytes = 2 * accumulators * programs * geo.reduced * 4  # written, then read back
    seconds = (geo.rows * geo.reduced * bytes_main + partial_bytes) / target.bandwidth
    return RowConfig("fused", block_k, block_r, warps, programs, seconds * 1e6 + PROGRAM_OVERHEAD * 1e6)


def fused_candidates(best: RowConfig, rows: int, target: Target) -> list[RowConfig]:
    """What autotuning times for a fused norm backward: the model's config first, then one or
    two programs per SM of `target` and half or twice its warps (the constants above are
    reasoned, not swept)."""
    blocks = -(-rows // best.block_k)
    found = [best]
    for programs in (target.sms, target.sms * 2):
        found.append(replace(best, splits=max(1, min(blocks, programs))))
    for warps in (best.num_warps // 2, best.num_warps * 2):
        if warps in WARPS and 1 <= warps <= MAX_WARPS:
            found.append(replace(best, num_warps=warps))
    unique = []
    for config in found:
        if all(config.to_record() != seen.to_record() for seen in unique):
            unique.append(config)
    return unique


def fused_from_record(record: dict) -> RowConfig:
    """A fused norm backward's config from a tuning-cache record; ValueError for any other mode."""
    if record.get("mode") != "fused":
        raise ValueError(f"mode {record.get('mode')!r} is not 'fused'")
    config = RowConfig.from_record(dict(record, mode="one_pass"))
    return replace(config, mode="fused")


# --- the problem a row anchor poses -------------------------------------------------------------
@dataclass(frozen=True)
class PackedDims:
    """A densely packed stand-in for a tensor: only its dims matter."""

    dim: tuple

    @property
    def stride(self) -> tuple:
        return contiguous_strides(self.dim)


@dataclass(frozen=True)
class RowProblem:
    """The domain a row anchor reduces over: x's dims, channels split into groups if grouped."""

    x_dim: tuple
    domain: tuple
    reduced_axes: tuple
    groups: int | None  # channels split as [G, C/G] (groupnorm, instancenorm)

    def strides(self, tensor) -> tuple:
        """Strides of `tensor` over the domain (0 where it broadcasts)."""
        strides = operand_strides(self.x_dim, tensor.dim, tensor.stride)
        if self.groups is None:
            return strides
        sizes = (1,) * (len(self.x_dim) - len(tensor.dim)) + tuple(tensor.dim)
        channels, stride = self.x_dim[1], strides[1]
        if sizes[1] == channels:
            split = (stride * (channels // self.groups), stride)
        elif sizes[1] == self.groups:  # per-group statistics
            split = (stride, 0)
        else:
            split = (0, 0)
        grouped = strides[:1] + split + strides[2:]
        return tuple(0 if size == 1 else st for size, st in zip(self.domain, grouped))

    def extent(self, tensor) -> tuple:
        """Per domain axis, whether `tensor` holds distinct elements along it (its size is not 1),
        whatever its strides: an expanded (stride-0) operand still has one value per index."""
        return tuple(bool(s) for s in self.strides(PackedDims(tuple(tensor.dim))))

    def with_reduced(self, axes) -> "RowProblem":
        return RowProblem(self.x_dim, self.domain, tuple(axes), self.groups)


def row_problem(anchor) -> RowProblem:
    """Domain and reduced axes of a reduction, softmax or norm node."""
    backward_norm = anchor.op.endswith("_backward") and anchor.opdef.family == "norm"
    x = anchor.inputs[1] if backward_norm else anchor.inputs[0]
    x_dim = tuple(x.dim)
    if anchor.op == "reduction":
        return RowProblem(x_dim, x_dim, tuple(anchor.attrs.axes), None)
    if anchor.op.startswith("softmax"):
        return RowProblem(x_dim, x_dim, (anchor.attrs.axis,), None)
    if anchor.op == "batchnorm_inference":
        inner = min((a for a in range(len(x_dim)) if x_dim[a] > 1), key=lambda a: x.stride[a], default=0)
        return RowProblem(x_dim, x_dim, (inner,), None)
    scale = None if anchor.op == "genstats" else anchor.inputs[2 if anchor.op.endswith("_backward") else 1]
    geo = norm_geometry(anchor.op, x, scale, anchor.attrs)
    if geo.groups is None:
        return RowProblem(x_dim, x_dim, geo.stat_axes, None)
    domain = x_dim[:1] + (geo.groups, x_dim[1] // geo.groups) + x_dim[2:]
    return RowProblem(x_dim, domain, geo.stat_axes, geo.groups)
