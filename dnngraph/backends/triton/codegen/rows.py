"""Render row kernels (reductions, softmax, norms) from a recipe and a row schedule.

Kernel shapes, all over [BLOCK_K rows, BLOCK_R reduced] tiles:
  main     one-pass (the rows live in registers) or looped (a loop over R per statistics stage,
           then an output loop); statistics, row outputs and element outputs in one kernel;
  partial  split mode, pass 1: each program reduces one chunk of R into per-row partials;
  combine  split mode, pass 2: partials combined in split order (deterministic), row outputs
           stored, the statistics the element outputs need stashed;
  apply    split mode, pass 3: element outputs from the stashed statistics;
  fused    norm backward (layernorm, rmsnorm): each program walks a contiguous block of rows,
           stores dx per row and folds dscale/dbias into column sums held in registers, stored
           as one row of [programs, C] partials that the combine shape sums in program order;
  persistent  one-pass rows walked as the fused shape walks them (the next blocks' loads in
           flight, R-only operands loaded once per program), without column sums.
Column splits (K contiguous) prefetch tiles in the partial and apply loops, and their apply
walks programs and chunks last to first, so it starts on what the partial pass read last.
Fused prologue nodes run wherever the tile is loaded, epilogue nodes before each store, both
through the shared expression emitter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .emitter import SCALAR_AS_TILE, ExpressionEmitter, blends_of, kind_of
from ....errors import UnsupportedError
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, blend_arguments, kernel_module

IDENTITY = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")', "prod": "1.0"}
# int64 accumulators: the extremes of int64 (its minimum as a difference: the literal
# 9223372036854775808 would not fit before its negation)
INTEGER_IDENTITY = {"sum": "0", "max": "(-9223372036854775807 - 1)", "min": "9223372036854775807",
                    "prod": "1"}
ACCUMULATOR_TYPES = {"f": "tl.float32", "l": "tl.int64"}
# max and min propagate NaN as torch does, in tiles, loop lanes and split combines alike
REDUCE_TILE = {"sum": "tl.sum({0}, axis=1, keep_dims=True)",
               "max": "tl.reduce({0}, 1, tr.max_combine, keep_dims=True)",
               "min": "tl.reduce({0}, 1, tr.min_combine, keep_dims=True)",
               "prod": "tl.reduce({0}, 1, tr.mul_combine, keep_dims=True)"}
COMBINE = {"sum": "{0} + {1}", "max": "tr.max_combine({0}, {1})", "min": "tr.min_combine({0}, {1})",
           "prod": "{0} * {1}"}
WELFORD_PARTS = ("count", "mean", "m2")


def _identity(acc) -> str:
    """The neutral value of an accumulator, in its kind."""
    return (INTEGER_IDENTITY if acc.kind == "l" else IDENTITY)[acc.combine]


def _filled(acc, shape: str) -> str:
    """A tile of `shape` holding the accumulator's neutral value, in its type."""
    return f"tl.full({shape}, {_identity(acc)}, {ACCUMULATOR_TYPES[acc.kind]})"
TILE_KINDS = ("tile", "col")  # values over R: made and stored where the tile is
# identifiers the row kernels write themselves; the stems own every `stem_*` name too
# (k_idx, r_mask, kd_0, part_<statistic>_ptr, stash_<statistic>_ptr)
FIXED_NAMES = ("pid", "split", "n_reduced", "tile_mask", "trip_weight", "chunk", "rows", "reduced",
               "trip", "trips", "BLOCK_K", "BLOCK_R", "SPLITS", "SPLIT_TILE", "row_begin", "row_end",
               "rows_per_program", "k_start")
FIXED_STEMS = ("k", "r", "kd", "rd", "part", "stash")


@dataclass
class RowKernelSpec:
    """Everything one row kernel renders from (plain data decided before rendering)."""

    name: str
    shape: str  # "main", "partial", "combine" or "apply"
    schedule: object  # RowSchedule
    recipe: object  # Recipe
    group: object  # FusionGroup
    kinds: dict  # tensor uid -> "tile" | "row" | "col" | "scalar"
    loads: tuple  # uids of inputs this kernel reads
    stores: tuple  # uids of outputs this kernel writes
    compute: str  # Triton compute type
    description: str
    partials: dict = field(default_factory=dict)  # accumulator part name -> scratch uid
    stash: dict = field(default_factory=dict)  # statistic name -> scratch uid
    # the group's epilogue nodes this kernel runs (None: all); a kernel that does not compute the
    # anchor's element output (norm backward's dscale/dbias kernel) runs none of them
    epilogue: Optional[tuple] = None
    prefetch: int = 0  # tiles a loop keeps in flight ahead of the one it works on
    # chunked fused backward: the next row block's first `prefetch` chunks load during the dx walk
    prime_next_rows: bool = False
    reverse: bool = False  # apply: programs and their chunks walked last to first
    streaming: bool = False  # tile loads and stores carry evict-first hints
    # fused norm backward: the column sums the fused kernel folds over its rows (Accumulators),
    # and the strides of the partials' column index over the merged R axes (fused kernel) or K
    # axes (its combine): the parameters' row-major index, whatever order each kernel's axes take
    param_accumulators: tuple = ()
    part_strides: Optional[tuple] = None
    split_tile: int = 0  # combine: partials folded per trip (heuristics/rows.py combine_blocks)

    def epilogue_nodes(self) -> tuple:
        return tuple(self.group.epilogue) if self.epilogue is None else self.epilogue


class _Source:
    """Parameters and indented statements of one kernel."""

    def __init__(self, spec: RowKernelSpec):
        self.spec, self.args, self.lines, self.depth = spec, [], [], 1
        self.globals: list[str] = []
        self.emitters: list[ExpressionEmitter] = []
        stems, statistics = spec.recipe.statistic_names()
        stems += tuple(acc.name for acc in spec.param_accumulators)
        self.names = NameAllocator(FIXED_NAMES + statistics + (spec.name,))
        self.names.reserve_stems(*(FIXED_STEMS + stems))
        # operands are named by whether they are read or written, never by their tensor's name
        self.ident = {op.uid: self.names.prefix("y" if op.is_output else "x")
                      for op in spec.schedule.geometry.operands}

    def line(self, text: str):
        self.lines.append("    " * self.depth + text)

    def emitter(self, parent: ExpressionEmitter | None = None) -> ExpressionEmitter:
        # one allocator: unique names; a blended output's store reads its prior (emitter.store)
        emitter = ExpressionEmitter(self.spec.compute, names=self.names, blends=blends_of(self.spec.group.outputs))
        emitter.globals = self.globals  # one list of module constants for the whole kernel
        self.emitters.append(emitter)  # (their blend factors' pointers: the signature's)
        if parent is not None:
            emitter.inherit(parent)
        return emitter


def _arguments(src: _Source):
    spec = src.spec
    geo = spec.schedule.geometry
    used = [op for op in geo.operands if op.uid in spec.loads or op.uid in spec.stores]
    src.args += [KernelArgument("tensor", f"{src.ident[op.uid]}_ptr", op.uid) for op in used]
    src.args += [KernelArgument("tensor", f"part_{name}_ptr", uid) for name, uid in spec.partials.items()]
    src.args += [KernelArgument("tensor", f"stash_{name}_ptr", uid) for name, uid in spec.stash.items()]
    src.args += [KernelArgument("int", "rows", geo.rows), KernelArgument("int", "reduced", geo.reduced)]
    src.args += [KernelArgument("int", f"k_size_{j}", s) for j, s in enumerate(geo.k_sizes) if j]
    src.args += [KernelArgument("int", f"r_size_{j}", s) for j, s in enumerate(geo.r_sizes) if j]
    for op in used:
        ident = src.ident[op.uid]
        src.args += [KernelArgument("int", f"{ident}_ks_{j}", s) for j, s in enumerate(op.k_strides) if s]
        src.args += [KernelArgument("int", f"{ident}_rs_{j}", s) for j, s in enumerate(op.r_strides) if s]
    if spec.part_strides is not None:
        side = "r" if spec.shape == "fused" else "k"
        src.args += [KernelArgument("int", f"part_{side}s_{j}", s) for j, s in enumerate(spec.part_strides) if s]
    cfg = spec.schedule.config
    src.args += [KernelArgument("constexpr", "BLOCK_K", cfg.block_k),
                 KernelArgument("constexpr", "BLOCK_R", cfg.block_r),
                 KernelArgument("constexpr", "SPLITS", cfg.splits)]
    if spec.shape == "combine":
        src.args.append(KernelArgument("constexpr", "SPLIT_TILE", spec.split_tile))
    return used


def _decompose(src: _Source, prefix: str, index: str, sizes, tag: str = ""):
    """Multi-axis digits of a flat index (innermost axis last); `tag` names a second set."""
    if len(sizes) == 1:
        src.line(f"{prefix}d{tag}_0 = {index}")
        return
    src.line(f"{prefix}{tag}_rest = {index}")
    for j in range(len(sizes) - 1, 0, -1):
        src.line(f"{prefix}d{tag}_{j} = {prefix}{tag}_rest % {prefix}_size_{j}")
        src.line(f"{prefix}{tag}_rest = {prefix}{tag}_rest // {prefix}_size_{j}")
    src.line(f"{prefix}d{tag}_0 = {prefix}{tag}_rest")


def _offsets(src: _Source, used, side: str, tag: str = ""):
    """Per-operand offsets along K ('k') or R ('r')."""
    for op in used:
        strides = op.k_strides if side == "k" else op.r_strides
        ident = src.ident[op.uid]
        terms = [f"{side}d{tag}_{j} * {ident}_{side}s_{j}" for j, s in enumerate(strides) if s]
        if terms:
            src.line(f"{ident}_{side}{tag} = {' + '.join(terms)}")


def _k_prelude(src: _Source, used):
    geo = src.spec.schedule.geometry
    pid = "tl.program_id(0)" + (".to(tl.int64)" if geo.index_64 else "")
    if src.spec.reverse:  # last program first: it reads what the partial pass read last
        pid = f"tl.num_programs(0) - 1 - {pid}"
    src.line(f"pid = {pid}")
    if src.spec.shape in ("partial", "apply"):  # SPLITS programs share one row block
        src.line("k_block = pid // SPLITS")
        src.line("split = pid % SPLITS")
    else:
        src.line("k_block = pid")
    src.line("k_idx = k_block * BLOCK_K + tl.arange(0, BLOCK_K)")
    src.line("k_mask = k_idx < rows")
    src.line("n_reduced = reduced * 1.0")
    _decompose(src, "k", "k_idx", geo.k_sizes)
    _offsets(src, used, "k")


def _r_prelude(src: _Source, used, start: str, stop: str, tag: str = "", lower: str | None = None,
               k_tag: str = ""):
    """R indices, masks and operand offsets of the tile at `start`; `tag` names a second set
    (the prefetched next tile), `lower` adds a lower bound to the mask (a walk downwards),
    `k_tag` the K indices its tile mask takes (default: this trip's)."""
    geo = src.spec.schedule.geometry
    index, mask = f"r{tag}_idx", f"r{tag}_mask"
    src.line(f"{index} = {start} + tl.arange(0, BLOCK_R)")
    bound = f"{index} < {stop}"
    src.line(f"{mask} = {bound}" if lower is None else f"{mask} = ({bound}) & ({index} >= {lower})")
    src.line(f"{_tile_mask(tag)} = k{k_tag}_mask[:, None] & {mask}[None, :]")
    _decompose(src, "r", index, geo.r_sizes, tag)
    _offsets(src, used, "r", tag)


def _tile_mask(tag: str) -> str:
    return f"r{tag}_tile_mask" if tag else "tile_mask"


def _pointer(src: _Source, op, kind: str, tag: str = "", k_tag: str = ""):
    """Pointer and mask of an operand's tile: `tag` names a second set of R indices (a
    prefetched chunk), `k_tag` a second set of K indices (a prefetched row block)."""
    ident = src.ident[op.uid]
    k = f"{ident}_k{k_tag}[:, None]" if any(op.k_strides) else None
    r = f"{ident}_r{tag}[None, :]" if any(op.r_strides) else None
    terms = [t for t in (k, r) if t]
    pointer = " + ".join([f"{ident}_ptr"] + terms)
    if tag or not k_tag:  # the R prelude of `tag` made the tile mask (for its own K indices)
        tile_mask = _tile_mask(tag)
    else:  # a prefetched row block of a one-tile row
        tile_mask = f"k{k_tag}_mask[:, None] & r_mask[None, :]"
    mask = {"tile": tile_mask, "row": f"k{k_tag}_mask[:, None]", "col": f"r{tag}_mask[None, :]",
            "scalar": None}[kind]
    return pointer, mask


def _load_text(src: _Source, op, kind: str, tag: str = "", k_tag: str = "") -> str:
    """The raw tl.load of an operand (evict-first in a streaming pass's tiles)."""
    pointer, mask = _pointer(src, op, kind, tag, k_tag)
    if not mask:
        return f"tl.load({pointer}{SCALAR_AS_TILE})"
    hint = ', eviction_policy="evict_first"' if src.spec.streaming and kind in TILE_KINDS else ""
    return f"tl.load({pointer}, mask={mask}{hint})"


def _load(src: _Source, emitter, op, kind: str):
    ident = src.ident[op.uid]
    src.line(f"{ident} = {emitter.loaded(_load_text(src, op, kind), op.data_type)}")
    emitter.bind(op.uid, ident, kind_of(op.data_type))


def _load_inputs(src: _Source, emitter, used, scope_kinds):
    for op in used:
        if op.uid in src.spec.loads and src.spec.kinds[op.uid] in scope_kinds:
            _load(src, emitter, op, src.spec.kinds[op.uid])


def _emit_nodes(src: _Source, emitter, nodes):
    start = len(emitter.lines)
    for node in nodes:
        emitter.emit(node)
    for text in emitter.lines[start:]:
        src.line(text)


def _accumulate_columns(src, spec, tile, suffix: str) -> None:
    """Add the tile's column sums of each parameter accumulator to `<name><suffix>`."""
    roles = _roles(spec, tile)
    for acc in spec.param_accumulators:
        element = _masked(acc.element.format(**roles), "0.0")
        src.line(f"{acc.name}{suffix} += tl.sum({element}, axis=0, keep_dims=True)")


def _roles(spec, emitter) -> dict:
    """Role -> the value's text in the recipe's kind (an integer recipe reads int64)."""
    kind = spec.recipe.kind
    return {role: _value_as(emitter, uid, kind) for role, uid in spec.recipe.roles.items()
            if uid in emitter.values}


def _value_as(emitter, uid, kind: str) -> str:
    """The value of `uid` in `kind`; a float read as an integer truncates toward zero, as a
    float stored to an integer tensor does (a prologue may compute what is typed an integer)."""
    if kind == "l" and emitter.values[uid][1] == "f":
        return f"{emitter.values[uid][0]}.to(tl.int64)"
    return emitter.value(uid, kind)


def _store(src: _Source, emitter, op, kind: str):
    if op.uid in emitter.blends and src.spec.kinds[op.uid] not in ("tile", "row"):
        # a value spanning only R (or neither) is stored alike by every row program: blending it
        # would add the prior once per program
        raise UnsupportedError(f"{src.spec.description}: a blended output must span the kept axes "
                               f"(a row statistic or an element output)")
    pointer, mask = _pointer(src, op, kind if kind != "scalar" else "row")
    if not any(op.k_strides) and not any(op.r_strides):  # one element: a block pointer all the same
        pointer += " + k_idx[:, None] * 0"
    hint = ', eviction_policy="evict_first"' if src.spec.streaming and kind in TILE_KINDS else ""
    src.line(emitter.store(pointer, op.uid, op.data_type, mask, hint))


def _tile_scope(src, parent, used, start, stop):
    """R indices, tile loads and the prologue; returns the scope's emitter."""
    _r_prelude(src, used, start, stop)
    emitter = src.emitter(parent)
    _load_inputs(src, emitter, used, ("tile", "col"))
    _emit_nodes(src, emitter, src.spec.group.prologue)
    return emitter


def _masked(element: str, identity: str) -> str:
    return f"tl.where(tile_mask, {element}, {identity})"


def _tile_loads(src, used) -> list:
    """Operands this kernel loads per tile (they vary along R)."""
    return [op for op in used if op.uid in src.spec.loads and src.spec.kinds[op.uid] in TILE_KINDS]


def _slot(ident: str, ahead: int) -> str:
    """The variable holding an operand's raw tile `ahead` tiles past the one being worked on."""
    return f"{ident}_next" + (str(ahead) if ahead > 1 else "")


def _tiles_ahead(r_start: str, ahead: int, reverse: bool) -> str:
    return f"{r_start} {'-' if reverse else '+'} {ahead} * BLOCK_R" if ahead else r_start


def _prefetch(src, used, start: str, lower: str, stop: str, ahead: int = 1, k_tag: str = ""):
    """Issue the raw loads of the tile at `start` into the operands' slot `ahead` (masked outside
    [lower, stop): tiles past the last one cost no memory traffic), in the rows of the K indices
    `k_tag` names (default: this trip's)."""
    tiles = _tile_loads(src, used)
    _r_prelude(src, tiles, start, stop, tag="_next", lower=lower if src.spec.reverse else None, k_tag=k_tag)
    for op in tiles:
        load = _load_text(src, op, src.spec.kinds[op.uid], "_next", k_tag)
        src.line(f"{_slot(src.ident[op.uid], ahead)} = {load}")


def _trip(src, top, used, r_start: str, start: str, stop: str):
    """One tile of a walk: its indices, values and prologue (with prefetch: the values loaded
    `spec.prefetch` trips earlier, the slots shifted and the farthest tile's loads issued first);
    returns the tile's emitter."""
    spec = src.spec
    if not spec.prefetch:
        return _tile_scope(src, top, used, r_start, stop)
    tiles = _tile_loads(src, used)
    for op in tiles:
        ident = src.ident[op.uid]
        src.line(f"{ident}_held = {_slot(ident, 1)}")
        for ahead in range(1, spec.prefetch):
            src.line(f"{_slot(ident, ahead)} = {_slot(ident, ahead + 1)}")
    _prefetch(src, used, _tiles_ahead(r_start, spec.prefetch, spec.reverse), start, stop, spec.prefetch)
    _r_prelude(src, used, r_start, stop)
    emitter = src.emitter(top)
    for op in tiles:
        ident = src.ident[op.uid]
        src.line(f"{ident} = {emitter.loaded(ident + '_held', op.data_type)}")
        emitter.bind(op.uid, ident, kind_of(op.data_type))
    _emit_nodes(src, emitter, spec.group.prologue)
    return emitter


def _tile_loop(src, top, used, start: str, stop: str, body, first=None, primed: bool = False):
    """Walk [start, stop) in BLOCK_R tiles, calling body(tile emitter) inside the loop;
    `first`, when given, is the body of the first tile, peeled out of the loop. A reverse spec
    walks from the last tile down; a prefetch spec keeps the next tiles' loads in flight while it
    works on this one (Triton pipelines no plain loads: a program would wait on every tile);
    `primed`: the first tiles' loads were issued already (_prime_chunks)."""
    spec = src.spec
    if not (spec.prefetch or spec.reverse or first):
        src.line(f"for r_start in range({start}, {stop}, BLOCK_R):")
        src.depth += 1
        body(_tile_scope(src, top, used, "r_start", stop))
        src.depth -= 1
        return
    src.line(f"trips = tl.cdiv({stop} - {start}, BLOCK_R)")
    src.line(f"r_first = {start} + (trips - 1) * BLOCK_R" if spec.reverse else f"r_first = {start}")
    for ahead in range(1, 0 if primed else spec.prefetch + 1):
        _prefetch(src, used, _tiles_ahead("r_first", ahead - 1, spec.reverse), start, stop, ahead)
    if first is not None:
        first(_trip(src, top, used, "r_first", start, stop))
    src.line(f"for trip in range({1 if first is not None else 0}, trips):")
    src.depth += 1
    src.line(f"r_start = r_first {'-' if spec.reverse else '+'} trip * BLOCK_R")
    body(_trip(src, top, used, "r_start", start, stop))
    src.depth -= 1


# --- statistics ---------------------------------------------------------------------------------
def _finalize(src, emitter, finalize):
    """A stage's row statements; they may read row and scalar operands by role (a norm's
    epsilon given as a tensor)."""
    roles = _roles(src.spec, emitter)
    for text in finalize:
        src.line(text.format(**roles))


def _stats_one_pass(src, tile, stages):
    for accumulators, finalize in stages:
        roles = _roles(src.spec, tile)
        for acc in accumulators:
            element = _masked(acc.element.format(**roles), _identity(acc))
            src.line(f"{acc.name} = {REDUCE_TILE[acc.combine].format(element)}")
        _finalize(src, tile, finalize)


def _accumulate_loop(src, top, used, accumulators, start, stop):
    """One loop over R folding every accumulator into [BLOCK_K, BLOCK_R] lanes, then across."""
    for acc in accumulators:
        if acc.combine == "welford":
            for part in WELFORD_PARTS:
                src.line(f"{acc.name}_{part}_lanes = tl.zeros([BLOCK_K, BLOCK_R], tl.float32)")
        else:
            src.line(f"{acc.name}_lanes = {_filled(acc, '[BLOCK_K, BLOCK_R]')}")
    src.line(f"for r_start in range({start}, {stop}, BLOCK_R):")
    src.depth += 1
    if any(acc.combine == "welford" for acc in accumulators):
        src.line(f"trip_weight = 1.0 / ((r_start - {start}) // BLOCK_R + 1.0)")
    tile = _tile_scope(src, top, used, "r_start", stop)
    roles = _roles(src.spec, tile)
    for acc in accumulators:
        element = acc.element.format(**roles)
        if acc.combine == "welford":
            n, mean, m2 = (f"{acc.name}_{p}_lanes" for p in WELFORD_PARTS)
            # every live lane has seen the same number of trips (only the last trip is ragged),
            # so one scalar reciprocal per trip replaces a division per element
            src.line(f"{acc.name}_value = {_masked(element, '0.0')}")
            src.line(f"{n} += tile_mask.to(tl.float32)")
            src.line(f"{acc.name}_delta = {acc.name}_value - {mean}")
            # a lane whose mean is already infinite adds the value as a plain sum does (inf stays,
            # -inf or NaN makes NaN); the update would compute inf - inf
            src.line(f"{mean} += tl.where(tile_mask, tl.where(tl.abs({mean}) == float('inf'), "
                     f"{acc.name}_value, {acc.name}_delta * trip_weight), 0.0)")
            src.line(f"{m2} += tl.where(tile_mask, {acc.name}_delta * ({acc.name}_value - {mean}), 0.0)")
        else:
            lanes = f"{acc.name}_lanes"
            masked = _masked(element, _identity(acc))
            src.line(f"{lanes} = {COMBINE[acc.combine].format(lanes, masked)}")
    src.depth -= 1
    for acc in accumulators:
        if acc.combine == "welford":
            names = ", ".join(f"{acc.name}_{p}" for p in WELFORD_PARTS)
            lanes = ", ".join(f"{acc.name}_{p}_lanes" for p in WELFORD_PARTS)
            src.line(f"{names} = tl.reduce(({lanes}), 1, tr.welford_merge, keep_dims=True)")
        else:
            src.line(f"{acc.name} = {REDUCE_TILE[acc.combine].format(acc.name + '_lanes')}")


def _partial_accumulate(src, top, used, accumulators, start, stop):
    """A split program's chunk folded into [BLOCK_K, BLOCK_R] lanes, then across. Welford
    statistics are taken as sums of (value - shift) and their squares, the shift being the first
    tile's mean per row: two adds per element instead of a running-mean update, and no
    cancellation where the mean is large against the spread. They leave the chunk as (count,
    mean, m2) partials for the combine kernel's Chan merges."""
    for acc in accumulators:
        if acc.combine == "welford":
            src.line(f"{acc.name}_sum_lanes = tl.zeros([BLOCK_K, BLOCK_R], tl.float32)")
            src.line(f"{acc.name}_sq_lanes = tl.zeros([BLOCK_K, BLOCK_R], tl.float32)")
        else:
            src.line(f"{acc.name}_lanes = {_filled(acc, '[BLOCK_K, BLOCK_R]')}")
    welford = [acc for acc in accumulators if acc.combine == "welford"]
    if welford:
        src.line(f"{welford[0].name}_count = (tl.zeros([BLOCK_K, 1], tl.float32) + "
                 f"tl.maximum({stop} - {start}, 0))")

    def fold(tile, first):
        roles = _roles(src.spec, tile)
        for acc in accumulators:
            element = acc.element.format(**roles)
            if acc.combine != "welford":
                lanes = f"{acc.name}_lanes"
                src.line(f"{lanes} = {COMBINE[acc.combine].format(lanes, _masked(element, _identity(acc)))}")
                continue
            if first:  # the mean of the tile's valid elements (the tile holds at least one)
                seen = f"tl.maximum(tl.minimum({welford[0].name}_count, BLOCK_R), 1.0)"
                src.line(f"{acc.name}_shift = tl.sum({_masked(element, '0.0')}, axis=1, keep_dims=True) / {seen}")
                # an inf or NaN shift would turn every centered value into NaN: shift by 0 there,
                # so an infinite element still makes the mean infinite, as a plain sum does
                src.line(f"{acc.name}_shift = tl.where(tl.abs({acc.name}_shift) < float('inf'), {acc.name}_shift, 0.0)")
            src.line(f"{acc.name}_centered = {_masked(f'({element}) - {acc.name}_shift', '0.0')}")
            src.line(f"{acc.name}_sum_lanes += {acc.name}_centered")
            src.line(f"{acc.name}_sq_lanes += {acc.name}_centered * {acc.name}_centered")

    _tile_loop(src, top, used, start, stop, lambda tile: fold(tile, False),
               first=(lambda tile: fold(tile, True)) if welford else None)
    for acc in accumulators:
        if acc.combine != "welford":
            src.line(f"{acc.name} = {REDUCE_TILE[acc.combine].format(acc.name + '_lanes')}")
            continue
        count = f"{welford[0].name}_count"
        if acc is not welford[0]:
            src.line(f"{acc.name}_count = {count}")
        src.line(f"{acc.name}_sum = tl.sum({acc.name}_sum_lanes, axis=1, keep_dims=True)")
        src.line(f"{acc.name}_sq = tl.sum({acc.name}_sq_lanes, axis=1, keep_dims=True)")
        src.line(f"{acc.name}_mean = {acc.name}_shift + {acc.name}_sum / tl.maximum({count}, 1.0)")
        src.line(f"{acc.name}_m2 = tl.maximum({acc.name}_sq - {acc.name}_sum * {acc.name}_sum / "
                 f"tl.maximum({count}, 1.0), 0.0, propagate_nan=tl.PropagateNan.ALL)")


def _stats_looped(src, top, used, stages):
    for accumulators, finalize in stages:
        _accumulate_loop(src, top, used, accumulators, "0", "reduced")
        _finalize(src, top, finalize)


def _load_stash(src):
    for name in src.spec.stash:
        src.line(f"{name} = tl.load(stash_{name}_ptr + k_idx[:, None], mask=k_mask[:, None])")


# --- outputs ------------------------------------------------------------------------------------
def _row_outputs(src, emitter, used):
    """Row values of the anchor, row epilogue nodes, then row stores."""
    spec = src.spec
    roles = _roles(spec, emitter)
    for uid, template in spec.recipe.row_outputs.items():
        variable = src.names.fresh("row_out")
        src.line(f"{variable} = {template.format(**roles)}")
        emitter.bind(uid, variable, spec.recipe.kind)  # an integer result stays exact for epilogues
    _emit_nodes(src, emitter, [n for n in spec.epilogue_nodes() if spec.kinds[n.outputs[0].uid] not in TILE_KINDS])
    for op in used:
        if op.uid in spec.stores and spec.kinds[op.uid] in ("row", "scalar") and op.uid in emitter.values:
            _store(src, emitter, op, spec.kinds[op.uid])


def _tile_outputs(src, tile, used):
    spec = src.spec
    roles = _roles(spec, tile)
    for uid, template in spec.recipe.tile_outputs.items():
        variable = src.names.fresh("tile_out")
        src.line(f"{variable} = {template.format(**roles)}")
        tile.bind(uid, variable, "f")
    _emit_nodes(src, tile, [n for n in spec.epilogue_nodes() if spec.kinds[n.outputs[0].uid] in TILE_KINDS])
    for op in used:
        if op.uid in spec.stores and spec.kinds[op.uid] in ("tile", "col") and op.uid in tile.values:
            _store(src, tile, op, "tile")


def _has_tile_stores(spec) -> bool:
    return any(spec.kinds[uid] in ("tile", "col") for uid in spec.stores)


# --- kernels ------------------------------------------------------------------------------------
def _main_body(src, used):
    """Statistics, row outputs and element outputs of a one-pass or looped kernel."""
    spec = src.spec
    mode = spec.schedule.config.mode
    top = src.emitter()
    _k_prelude(src, used)
    _load_inputs(src, top, used, ("row", "scalar"))
    geo = spec.schedule.geometry
    one_tile = spec.schedule.config.block_r >= (geo.source_reduced or geo.reduced)
    stages = spec.recipe.stages_for("one_pass" if one_tile else mode)  # a looped config may fit one tile
    if one_tile:
        tile = _tile_scope(src, top, used, "0", "reduced")
        _stats_one_pass(src, tile, stages)
        _row_outputs(src, tile, used)
        _tile_outputs(src, tile, used)
        return
    _stats_looped(src, top, used, stages)
    _row_outputs(src, top, used)
    if _has_tile_stores(spec):
        _output_loop(src, top, used, "0", "reduced")


def _output_loop(src, top, used, start, stop):
    _tile_loop(src, top, used, start, stop, lambda tile: _tile_outputs(src, tile, used))


def _chunk(src):
    """This program's share of R in split mode: whole BLOCK_R tiles, the last one ragged."""
    src.line("chunk = tl.cdiv(tl.cdiv(reduced, SPLITS), BLOCK_R) * BLOCK_R")
    src.line("r_begin = split * chunk")
    src.line("r_end = tl.minimum(r_begin + chunk, reduced)")


def _apply_body(src, used):
    """Split pass 3: element outputs over this program's chunk from the stashed statistics."""
    top = src.emitter()
    _k_prelude(src, used)
    _load_inputs(src, top, used, ("row", "scalar"))
    _chunk(src)
    _load_stash(src)
    _output_loop(src, top, used, "r_begin", "r_end")


def _partial_body(src, used):
    """Split pass 1: this program's chunk of R, partials stored at [split, row]."""
    spec = src.spec
    top = src.emitter()
    _k_prelude(src, used)
    _load_inputs(src, top, used, ("row", "scalar"))
    _chunk(src)
    (accumulators, _), = spec.recipe.stages_for("split")
    _partial_accumulate(src, top, used, accumulators, "r_begin", "r_end")
    for name in spec.partials:
        src.line(f"tl.store(part_{name}_ptr + split * rows + k_idx[:, None], {name}, mask=k_mask[:, None])")


def _combine_body(src, used):
    """Split pass 2: fold the partials in split order, finalize, store rows, stash statistics."""
    spec = src.spec
    top = src.emitter()
    _k_prelude(src, used)
    _load_inputs(src, top, used, ("row", "scalar"))
    (accumulators, finalize), = spec.recipe.stages_for("split")
    _part_offsets(src, "k")
    for acc in accumulators:
        if acc.combine == "welford":
            for part in WELFORD_PARTS:
                src.line(f"{acc.name}_{part} = tl.zeros([BLOCK_K, 1], tl.float32)")
        else:
            src.line(f"{acc.name} = {_filled(acc, '[BLOCK_K, 1]')}")
    # [BLOCK_K, SPLIT_TILE] partials per trip, folded by a fixed tree, then in trip order: a loop
    # of one load per split was latency-bound (132 dependent loads: 110 us of a 128 us batchnorm)
    src.line("for part_start in range(0, SPLITS, SPLIT_TILE):")
    src.depth += 1
    src.line("part_idx = part_start + tl.arange(0, SPLIT_TILE)")
    src.line("part_mask = k_mask[:, None] & (part_idx < SPLITS)[None, :]")
    src.line(f"part_offset = part_idx[None, :] * rows + {_part_column(src, 'k')}[:, None]")
    for acc in accumulators:
        if acc.combine == "welford":
            names = [f"{acc.name}_{p}" for p in WELFORD_PARTS]
            for name in names:
                src.line(f"{name}_tile = tl.load(part_{name}_ptr + part_offset, mask=part_mask, other=0.0)")
            tiles = ", ".join(n + "_tile" for n in names)
            src.line(f"{', '.join(n + '_part' for n in names)} = tl.reduce(({tiles}), 1, tr.welford_merge, "
                     f"keep_dims=True)")
            src.line(f"{', '.join(names)} = tr.welford_merge({', '.join(names)}, "
                     f"{', '.join(n + '_part' for n in names)})")
        else:
            src.line(f"{acc.name}_tile = tl.load(part_{acc.name}_ptr + part_offset, mask=part_mask, "
                     f"other={_identity(acc)})")
            part = REDUCE_TILE[acc.combine].format(acc.name + "_tile")
            src.line(f"{acc.name} = {COMBINE[acc.combine].format(acc.name, part)}")
    src.depth -= 1
    _finalize(src, top, finalize)
    _row_outputs(src, top, used)
    for name in spec.stash:
        src.line(f"tl.store(stash_{name}_ptr + k_idx[:, None], {name}, mask=k_mask[:, None])")


def _part_offsets(src, side: str):
    """The partials' column index from the `side` digits, where the spec gives its strides."""
    strides = src.spec.part_strides
    if strides is None:
        return
    terms = [f"{side}d_{j} * part_{side}s_{j}" for j, s in enumerate(strides) if s]
    src.line(f"part_{side} = {' + '.join(terms) or f'0 * {side}_idx'}")


def _part_column(src, side: str) -> str:
    """The partials' column index along `side` (the row index where no strides are given)."""
    return f"part_{side}" if src.spec.part_strides is not None else f"{side}_idx"


def _fused_rows(src):
    """pid and this fused program's contiguous block of rows [row_begin, row_end)."""
    geo = src.spec.schedule.geometry
    pid = "tl.program_id(0)" + (".to(tl.int64)" if geo.index_64 else "")
    src.line(f"pid = {pid}")
    src.line("n_reduced = reduced * 1.0")
    src.line("rows_per_program = tl.cdiv(tl.cdiv(rows, SPLITS), BLOCK_K) * BLOCK_K")
    src.line("row_begin = pid * rows_per_program")
    src.line("row_end = tl.minimum(row_begin + rows_per_program, rows)")


def _fused_row_trip(src, used):
    """The head of a fused program's trip over BLOCK_K rows: K indices, mask and offsets."""
    src.line("for k_start in range(row_begin, row_end, BLOCK_K):")
    src.depth += 1
    _fused_row_indices(src, used, "k_start")


def _fused_row_indices(src, used, start: str, tag: str = ""):
    """K indices, mask and operand offsets of the row block at `start` (within this program's
    rows); `tag` names a second set (a prefetched row block)."""
    geo = src.spec.schedule.geometry
    src.line(f"k{tag}_idx = {start} + tl.arange(0, BLOCK_K)")
    src.line(f"k{tag}_mask = k{tag}_idx < row_end")
    _decompose(src, "k", f"k{tag}_idx", geo.k_sizes, tag)
    _offsets(src, used, "k", tag)


def _row_slot(ident: str, ahead: int) -> str:
    """The variable holding an operand's raw row block `ahead` trips past the current one."""
    return f"{ident}_ahead{ahead}"


def _prefetch_rows(src, loads, start: str, ahead: int):
    """Issue the raw loads of the row block at `start` into the operands' slot `ahead` (rows
    past this program's are masked: no memory traffic)."""
    _fused_row_indices(src, loads, start, "_next")
    for op in loads:
        text = _load_text(src, op, src.spec.kinds[op.uid], k_tag="_next")
        src.line(f"{_row_slot(src.ident[op.uid], ahead)} = {text}")


def _fused_prefetched_trip(src, used, top):
    """The head of a fused program's trip over BLOCK_K one-tile rows whose loads were issued
    `spec.prefetch` trips earlier: the slots shift, the farthest block's loads are issued
    before this block's reductions (Triton pipelines no plain loads: unprefetched, a program
    with one row block in flight waits on every row), and the held values are bound; returns
    the trip's emitter."""
    spec = src.spec
    loads = [op for op in used if op.uid in spec.loads and spec.kinds[op.uid] in ("row", "tile")]
    for ahead in range(1, spec.prefetch + 1):
        _prefetch_rows(src, loads, f"row_begin + {ahead - 1} * BLOCK_K", ahead)
    src.line("for k_start in range(row_begin, row_end, BLOCK_K):")
    src.depth += 1
    for op in loads:
        ident = src.ident[op.uid]
        src.line(f"{ident}_held = {_row_slot(ident, 1)}")
        for ahead in range(1, spec.prefetch):
            src.line(f"{_row_slot(ident, ahead)} = {_row_slot(ident, ahead + 1)}")
    _prefetch_rows(src, loads, f"k_start + {spec.prefetch} * BLOCK_K", spec.prefetch)
    _fused_row_indices(src, used, "k_start")
    src.line("tile_mask = k_mask[:, None] & r_mask[None, :]")
    tile = src.emitter(top)
    for op in loads:
        ident = src.ident[op.uid]
        src.line(f"{ident} = {tile.loaded(ident + '_held', op.data_type)}")
        tile.bind(op.uid, ident, kind_of(op.data_type))
    return tile


def _fused_body(src, used):
    """Fused norm backward: this program's contiguous block of rows, BLOCK_K rows a trip, each
    whole row one tile; dx stored per trip, the parameter sums folded over the trips' rows into
    [1, BLOCK_R] columns and stored once as this program's row of the partials; with
    `spec.prefetch`, the next row blocks' loads are in flight while a trip reduces. Rows wider
    than BLOCK_R take the chunked form (_fused_chunked_body)."""
    spec = src.spec
    geo = spec.schedule.geometry
    if spec.schedule.config.block_r < (geo.source_reduced or geo.reduced):
        _fused_chunked_body(src, used)
        return
    top = src.emitter()
    _fused_rows(src)
    src.line("r_idx = tl.arange(0, BLOCK_R)")
    src.line("r_mask = r_idx < reduced")
    _decompose(src, "r", "r_idx", geo.r_sizes)
    _offsets(src, used, "r")
    _part_offsets(src, "r")
    # loop invariants: what is constant along K is read once per program, the operands along R
    # that the statistics read (a backward's scale) too; those only the element outputs read (a
    # forward's scale and bias) are read per trip after the reductions (from L2): held across
    # the loop, layernorm's scale and bias at rows of 16384 lanes (64 fp32 registers a thread at
    # 16 warps) made the persistent forward spill
    _load_inputs(src, top, used, ("scalar",))
    columns = [op for op in used if op.uid in spec.loads and spec.kinds[op.uid] == "col"]
    late = _read_after_statistics(spec, columns)
    _load_inputs(src, top, [op for op in columns if op not in late], ("col",))
    for acc in spec.param_accumulators:
        src.line(f"{acc.name}_cols = tl.zeros([1, BLOCK_R], tl.float32)")
    if spec.prefetch:
        tile = _fused_prefetched_trip(src, used, top)
    else:
        _fused_row_trip(src, used)
        src.line("tile_mask = k_mask[:, None] & r_mask[None, :]")
        tile = src.emitter(top)
        _load_inputs(src, tile, used, ("row", "tile"))
    _emit_nodes(src, tile, spec.group.prologue)
    _stats_one_pass(src, tile, spec.recipe.stages_for("one_pass"))
    _row_outputs(src, tile, used)
    _load_inputs(src, tile, late, ("col",))
    _tile_outputs(src, tile, used)
    _accumulate_columns(src, spec, tile, "_cols")
    src.depth -= 1
    for acc in spec.param_accumulators:
        src.line(f"tl.store(part_{acc.name}_ptr + pid * reduced + part_r[None, :], {acc.name}_cols, "
                 f"mask=r_mask[None, :])")


def _prime_chunks(src, used, k_start: str):
    """Issue the loads of the first `spec.prefetch` chunks of the row block at `k_start` into
    the row-sum loop's slots (rows past this program's are masked: no memory traffic)."""
    spec = src.spec
    _fused_row_indices(src, _tile_loads(src, used), k_start, "_next")
    for ahead in range(1, spec.prefetch + 1):
        _prefetch(src, used, f"{ahead - 1} * BLOCK_R", "0", "reduced", ahead, k_tag="_next")


def _read_after_statistics(spec, operands) -> list:
    """The `operands` that neither the prologue nor the statistics read: loads that can wait
    until the element outputs need them."""
    early = {t.uid for node in spec.group.prologue for t in node.input_tensors()}
    statements = [text for accumulators, finalize in spec.recipe.stages_for("one_pass")
                  for text in [acc.element for acc in accumulators] + list(finalize)]
    statements += list(spec.recipe.row_outputs.values())
    early |= {uid for role, uid in spec.recipe.roles.items()
              if any("{" + role + "}" in text for text in statements)}
    return [op for op in operands if op.uid not in early]


def _fused_chunked_body(src, used):
    """Fused norm backward over rows wider than a tile: each trip of BLOCK_K rows walks the row
    in BLOCK_R chunks twice, first folding the row sums, then storing dx from the same chunks
    (re-read from L2, so dy and x leave HBM once) while each chunk's dscale/dbias column sums
    grow in registers. The chunks are unrolled: a chunk's column sums are variables of their
    own (`<sum>_cols_<chunk>`), held across the program's rows and stored once at the end."""
    spec = src.spec
    geo = spec.schedule.geometry
    chunks = -(-(geo.source_reduced or geo.reduced) // spec.schedule.config.block_r)
    (accumulators, finalize), = spec.recipe.stages_for("looped")
    if any(acc.combine == "welford" for acc in accumulators):
        raise UnsupportedError(f"{spec.description}: the chunked fused form folds plain row sums only")
    top = src.emitter()
    _fused_rows(src)
    _load_inputs(src, top, used, ("scalar",))
    for acc in spec.param_accumulators:
        for chunk in range(chunks):
            src.line(f"{acc.name}_cols_{chunk} = tl.zeros([1, BLOCK_R], tl.float32)")
    primed = bool(spec.prefetch) and spec.prime_next_rows
    if primed:
        _prime_chunks(src, used, "row_begin")
    _fused_row_trip(src, used)
    rows = src.emitter(top)
    _load_inputs(src, rows, used, ("row",))
    for acc in accumulators:
        src.line(f"{acc.name}_lanes = {_filled(acc, '[BLOCK_K, BLOCK_R]')}")

    def fold(tile):
        roles = _roles(spec, tile)
        for acc in accumulators:
            masked = _masked(acc.element.format(**roles), _identity(acc))
            src.line(f"{acc.name}_lanes = {COMBINE[acc.combine].format(acc.name + '_lanes', masked)}")

    # the row sums in a loop (`spec.prefetch` chunks' loads ahead): unrolled, the compiler
    # hoisted every chunk's loads and spilled
    _tile_loop(src, rows, used, "0", "reduced", fold, primed=primed)
    if primed:  # the next row block's first chunks load while this one's dx walks its chunks from L2
        _prime_chunks(src, used, "k_start + BLOCK_K")
    for acc in accumulators:
        src.line(f"{acc.name} = {REDUCE_TILE[acc.combine].format(acc.name + '_lanes')}")
    _finalize(src, rows, finalize)
    _row_outputs(src, rows, used)
    for chunk in range(chunks):  # dx and the column sums from the same chunks
        tile = _tile_scope(src, rows, used, f"{chunk} * BLOCK_R", "reduced")
        _tile_outputs(src, tile, used)
        _accumulate_columns(src, spec, tile, f"_cols_{chunk}")
    src.depth -= 1
    for chunk in range(chunks):
        src.line(f"r_idx = {chunk} * BLOCK_R + tl.arange(0, BLOCK_R)")
        src.line("r_mask = r_idx < reduced")
        _decompose(src, "r", "r_idx", geo.r_sizes)
        _part_offsets(src, "r")
        for acc in spec.param_accumulators:
            src.line(f"tl.store(part_{acc.name}_ptr + pid * reduced + part_r[None, :], {acc.name}_cols_{chunk}, "
                     f"mask=r_mask[None, :])")


def _persistent_body(src, used):
    """Persistent one-pass rows: the fused walk (this program's contiguous block of rows, the
    next blocks' loads in flight, the operands along R only loaded once) with no column sums."""
    spec = src.spec
    geo = spec.schedule.geometry
    if spec.schedule.config.block_r < (geo.source_reduced or geo.reduced) or spec.param_accumulators:
        raise UnsupportedError(f"{spec.description}: a persistent row kernel holds whole rows (BLOCK_R "
                               f"{spec.schedule.config.block_r} < {geo.source_reduced or geo.reduced} reduced)")
    _fused_body(src, used)


BODIES = {"persistent": _persistent_body, "main": _main_body, "apply": _apply_body, "partial": _partial_body, "combine": _combine_body,
          "fused": _fused_body}


def render(spec: RowKernelSpec):
    """The KernelSource (name, source, arguments) of one row kernel."""
    src = _Source(spec)
    used = _arguments(src)
    BODIES[spec.shape](src, used)
    pointers = sum(a.kind == "tensor" for a in src.args)  # blended stores' factors: known once rendered
    src.args[pointers:pointers] = blend_arguments(src.emitters)
    source = kernel_module(spec.description, src.globals, spec.name, src.args, "\n".join(src.lines) + "\n",
                           libraries=("tr",))
    return KernelSource(spec.name, source, src.args)
