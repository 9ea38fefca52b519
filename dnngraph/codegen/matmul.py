"""Render matmul kernels: the main loop of each variant, the shared epilogue, split-K combine
and the fold of row-reduction exits.

Every kernel walks output tiles [BLOCK_M, BLOCK_N] of one batch entry; batch axes (broadcast
per operand through zero strides) are decomposed from one flat index. The epilogue block is the
same text in the main kernel and in the split-K combine kernel: scales, epilogue operand loads,
the expression emitter's chain, stores of every stored value, and row-exit partials.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .emitter import SCALAR_AS_TILE, ExpressionEmitter, kind_of
from .names import NameAllocator
from .pointwise import KernelArgument, header

# Row-exit reductions riding on the epilogue: (value transform, combine, identity, finalize).
EXIT_MODES = {
    "sum": ("{0}", "sum", "0.0", "{0}"),
    "mean": ("{0}", "sum", "0.0", "{0} / N"),
    "norm1": ("tl.abs({0})", "sum", "0.0", "{0}"),
    "norm2": ("{0} * {0}", "sum", "0.0", "tl.sqrt({0})"),
    "max": ("{0}", "max", "-float('inf')", "{0}"),
    "min": ("{0}", "min", "float('inf')", "{0}"),
    "amax": ("tl.abs({0})", "max", "0.0", "{0}"),
}
# max and min propagate NaN as torch does (tl.max and the default tl.maximum drop it)
EXIT_REDUCE = {"sum": "tl.sum({0}, axis=1)", "max": "tl.reduce({0}, 1, tr.max_combine)",
               "min": "tl.reduce({0}, 1, tr.min_combine)"}
EXIT_FOLD = {"sum": "{0} + {1}", "max": "tr.max_combine({0}, {1})", "min": "tr.min_combine({0}, {1})"}
EXIT_READS_N = frozenset({"mean"})  # modes whose finalize divides by N
EXIT_FOLD_BLOCK = 128  # rows per program of the exit fold: a few KB of partials each
# identifiers the matmul kernels write themselves; the stems own every `stem_*` name too
# (tile_a, offs_m, bidx_0, batch_size_1, exit_0_partial_ptr, ...)
FIXED_NAMES = ("split", "rest", "acc", "kt", "ks", "mask", "start", "part", "M", "N", "K", "batches",
               "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "PROGRAMS", "FLATTEN",
               "WARP_SPECIALIZE", "BLOCK_ROWS", "EXIT_TILES")
FIXED_STEMS = ("tile", "tiles", "batch", "bidx", "group", "first", "rows", "cols", "pid", "offs", "mask",
               "k", "per", "partial", "desc", "row", "exit", "value")
# operand names by side: matrices A and B, epilogue operands, per-tensor scales, row exits
SIDE_HINTS = {"a": "a", "b": "b", "c": "c", "scalar": "scale", "exit": "out"}


@dataclass(frozen=True)
class MatmulOperand:
    """One tensor a matmul kernel touches, with strides over its side's [batch..., rows, cols].

    side: "a" (rows M, cols K), "b" (rows K, cols N), "c" (rows M, cols N: epilogue operands and
    stored values), "scalar" (per-tensor scales), "exit" (a row-reduction output [batch..., M, 1]).
    """

    uid: int
    data_type: object
    side: str
    batch_strides: tuple
    row_stride: int
    col_stride: int
    is_output: bool = False
    ident: str = ""  # its name in the kernel, given by the kernel's allocator at render


@dataclass(frozen=True)
class ExitPlan:
    node: object  # the reduction node
    source_uid: int  # the epilogue value it reduces
    partial_uid: int  # scratch [batches, exit tiles, M] fp32
    output: MatmulOperand


@dataclass(frozen=True)
class MatmulKernelSpec:
    name: str
    config: object  # heuristics.matmul.MatmulConfig
    problem: object  # heuristics.matmul.MatmulProblem
    batch_sizes: tuple  # output batch axes of size > 1
    a_uid: int  # the tensors the matmul node reads and writes
    b_uid: int
    c_uid: int
    operands: tuple  # MatmulOperand
    prologue_a: tuple  # pointwise nodes applied to A tiles at load
    prologue_b: tuple
    epilogue: tuple  # pointwise nodes applied to the accumulator
    exits: tuple  # ExitPlan
    scale_uids: tuple
    dot_a: str  # Triton types fed to tl.dot
    dot_b: str
    precision: str  # input_precision for fp32 dots ("ieee" | "tf32"), "" otherwise
    compute: str
    index_64: bool
    description: str
    partial_uid: int = 0  # split-K scratch [SPLIT_K, batches, M, N]
    epilogue_block: tuple = ()  # (BLOCK_M, BLOCK_N) of the kernel running the epilogue
    persistent_programs: int = 0  # grid of the persistent variant

    def side(self, side: str) -> list:
        return [op for op in self.operands if op.side == side]

    @property
    def batches(self) -> int:
        count = 1
        for size in self.batch_sizes:
            count *= size
        return count


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 1

    def __call__(self, *lines: str):
        self.lines.extend("    " * self.depth + line for line in lines)

    def indent(self):
        self.depth += 1

    def dedent(self):
        self.depth -= 1


# --- shared pieces ------------------------------------------------------------------------------
def _batch_lines(spec, w: _Writer, flat: str = "batch"):
    """Decompose the flat batch index into bidx_<axis> (row-major over batch_sizes)."""
    if not spec.batch_sizes:
        return
    w(f"rest = {flat}")
    for axis in range(len(spec.batch_sizes) - 1, 0, -1):
        w(f"bidx_{axis} = rest % batch_size_{axis}", f"rest = rest // batch_size_{axis}")
    w("bidx_0 = rest")


def _batch_offset(op: MatmulOperand) -> str:
    terms = [f"bidx_{axis} * {op.ident}_bstride_{axis}" for axis, s in enumerate(op.batch_strides) if s]
    return " + ".join(terms)


def _offset_2d(op: MatmulOperand, rows: str, cols: str, full: bool = False) -> str:
    """Offset expression of op over a [rows] x [cols] tile; broadcast axes are skipped unless
    `full` (dot operands and stores need the whole tile even where a size-1 axis has stride 0)."""
    terms = []
    base = _batch_offset(op)
    if base:
        terms.append(base)
    if op.row_stride:
        terms.append(f"{rows}[:, None] * {op.ident}_stride_r")
    elif full:
        terms.append(f"{rows}[:, None] * 0")
    if op.col_stride:
        terms.append(f"{cols}[None, :] * {op.ident}_stride_c")
    elif full:
        terms.append(f"{cols}[None, :] * 0")
    return " + ".join(terms) or "0"


def _tile_mask(op: MatmulOperand) -> str:
    """The mask matching an epilogue operand's loaded shape (a bias row loads [1, BLOCK_N])."""
    if op.row_stride and op.col_stride:
        return "mask"
    if op.col_stride:
        return "mask_n[None, :]"
    return "mask_m[:, None]" if op.row_stride else ""


def _load(op: MatmulOperand, rows: str, cols: str, mask: str, compute: str) -> str:
    pointer = f"{op.ident}_ptr + {_offset_2d(op, rows, cols)}"
    other = "0.0" if op.data_type.is_floating else "0"
    masked = f", mask={mask}, other={other}" if mask else ""
    cast = f".to({compute})" if kind_of(op.data_type) == "f" else ""
    one_element = "" if mask else SCALAR_AS_TILE
    return f"tl.load({pointer}{one_element}{masked}){cast}"


def _bind_load(emitter: ExpressionEmitter, op: MatmulOperand, variable: str):
    emitter.bind(op.uid, variable, kind_of(op.data_type))


def _grouped_order(w: _Writer, tile: str):
    """pid_m, pid_n of `tile` in grouped order: GROUP_M row tiles share B columns in L2."""
    w("group_size = GROUP_M * tiles_n",
      f"first_m = ({tile} // group_size) * GROUP_M",
      "rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)",
      f"pid_m = first_m + ({tile} % group_size) % rows_in_group",
      f"pid_n = ({tile} % group_size) // rows_in_group")


def _tile_offsets(spec, w: _Writer):
    w("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
      "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    if spec.index_64:
        w("offs_m = offs_m.to(tl.int64)", "offs_n = offs_n.to(tl.int64)")
    w("mask_m = offs_m < M", "mask_n = offs_n < N")


# --- operand tiles inside the k loop --------------------------------------------------------------
def _side_tile(spec, side: str, w: _Writer, pointer_loads: bool):
    """Statements leaving `tile_<side>` (dot type) for k step `ks`; A is [BLOCK_M, BLOCK_K],
    B is [BLOCK_K, BLOCK_N]. Prologue ops run in the compute type on what was loaded."""
    rows, cols = ("rows_a", "ks") if side == "a" else ("ks", "cols_b")
    k_mask = "" if spec.problem.k % spec.config.block_k == 0 else (
        "mask_k[None, :]" if side == "a" else "mask_k[:, None]")
    nodes = spec.prologue_a if side == "a" else spec.prologue_b
    target_uid, dot_type = (spec.a_uid, spec.dot_a) if side == "a" else (spec.b_uid, spec.dot_b)
    operands = spec.side(side)
    if not nodes and pointer_loads:
        (op,) = operands
        pointer = f"{op.ident}_ptr + {_offset_2d(op, rows, cols, full=True)}"
        load = f"tl.load({pointer}, mask={k_mask}, other=0.0)" if k_mask else f"tl.load({pointer})"
        convert = "" if op.data_type.triton_type == dot_type else f".to({dot_type})"
        w(f"tile_{side} = {load}{convert}")
        return
    if not nodes:  # loaded through a tensor descriptor by the caller
        return
    emitter = ExpressionEmitter(spec.compute, hint=f"p{side}", names=spec.names)
    for op in operands:
        walks_k = op.col_stride if side == "a" else op.row_stride
        w(f"{op.ident} = {_load(op, rows, cols, k_mask if walks_k else '', spec.compute)}")
        _bind_load(emitter, op, op.ident)
    for node in nodes:
        emitter.emit(node)
    w(*emitter.lines)
    value = emitter.value(target_uid, "f")
    if k_mask:  # padding past K must stay zero whatever the prologue maps zero to
        value = f"tl.where({k_mask}, {value}, 0.0)"
    shape = "(BLOCK_M, BLOCK_K)" if side == "a" else "(BLOCK_K, BLOCK_N)"
    w(f"tile_{side} = tl.broadcast_to(({value}).to({dot_type}), {shape})")


def _dot(spec) -> str:
    precision = f", input_precision=\"{spec.precision}\"" if spec.precision else ""
    return f"acc = tl.dot(tile_a, tile_b, acc{precision})"


def _wrapped_index(offsets: str, size: str, block: str, hinted: bool) -> str:
    """Tile indices wrapped into [0, size); with `hinted`, the contiguity hints of a full block."""
    wrapped = f"{offsets} % {size}"
    return f"tl.max_contiguous(tl.multiple_of({wrapped}, {block}), {block})" if hinted else wrapped


def _k_loop_pointer(spec, w: _Writer, k_first: str, k_last: str):
    # wrapped indices: loads need no M/N masks (stores mask the tail); the hints keep 16-byte
    # vector loads along a contiguous M or N axis: without them 3000x5000x1000 ran 9x slower.
    # An axis shorter than its block wraps inside the first tile, where the hints would be
    # false: on the H100 an N=13 operand under them faulted with a misaligned address.
    w(f"rows_a = {_wrapped_index('offs_m', 'M', 'BLOCK_M', spec.problem.m >= spec.config.block_m)}",
      f"cols_b = {_wrapped_index('offs_n', 'N', 'BLOCK_N', spec.problem.n >= spec.config.block_n)}",
      "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
      f"for kt in range({k_first}, {k_last}):")
    w.indent()
    w("ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)")
    if spec.problem.k % spec.config.block_k:
        w("mask_k = ks < K")
    _side_tile(spec, "a", w, pointer_loads=True)
    _side_tile(spec, "b", w, pointer_loads=True)
    w(_dot(spec))
    w.dedent()


# --- the epilogue ---------------------------------------------------------------------------------
def _epilogue(spec, w: _Writer):
    """acc [BLOCK_M, BLOCK_N] fp32 -> scales, the chain, stores and row-exit partials."""
    for uid in spec.scale_uids:
        op = next(o for o in spec.operands if o.uid == uid)
        w(f"acc = acc * tl.load({op.ident}_ptr).to(tl.float32)")
    emitter = ExpressionEmitter(spec.compute, hint="e", names=spec.names)
    emitter.bind(spec.c_uid, "acc", "f")
    w("mask = mask_m[:, None] & mask_n[None, :]")
    for op in spec.side("c"):
        if not op.is_output:
            w(f"{op.ident} = {_load(op, 'offs_m', 'offs_n', _tile_mask(op), spec.compute)}")
            _bind_load(emitter, op, op.ident)
    for node in spec.epilogue:
        emitter.emit(node)
    w(*emitter.lines)
    for op in spec.side("c"):
        if op.is_output:
            w(f"tl.store({op.ident}_ptr + {_offset_2d(op, 'offs_m', 'offs_n', full=True)}, "
              f"{emitter.stored(op.uid, op.data_type)}, mask=mask)")
    for index, plan in enumerate(spec.exits):
        transform, combine, identity, _ = EXIT_MODES[plan.node.attrs.mode]
        value = transform.format(emitter.value(plan.source_uid, "f"))
        w(f"exit_{index} = {EXIT_REDUCE[combine].format(f'tl.where(mask, {value}, {identity})')}",
          f"tl.store(exit_{index}_partial_ptr + (batch * tl.cdiv(N, BLOCK_N) + pid_n) * M + offs_m, "
          f"exit_{index}, mask=mask_m)")
    return emitter


# --- kernels --------------------------------------------------------------------------------------
def _main_tiled(spec, w: _Writer):
    split = spec.config.split_k > 1
    w("tile = tl.program_id(0)", "batch = tl.program_id(1)")
    if split:
        w("split = tl.program_id(2)")
    w("tiles_m = tl.cdiv(M, BLOCK_M)", "tiles_n = tl.cdiv(N, BLOCK_N)")
    _grouped_order(w, "tile")
    _batch_lines(spec, w)
    _tile_offsets(spec, w)
    w("k_tiles = tl.cdiv(K, BLOCK_K)")
    if split:
        w("per_split = tl.cdiv(k_tiles, SPLIT_K)", "k_first = split * per_split",
          "k_last = tl.minimum(k_first + per_split, k_tiles)")
        _k_loop_pointer(spec, w, "k_first", "k_last")
        w("mask = mask_m[:, None] & mask_n[None, :]",
          "partial = ((split * batches + batch) * M + offs_m[:, None]) * N + offs_n[None, :]",
          "tl.store(partial_ptr + partial, acc, mask=mask)")
        return None
    _k_loop_pointer(spec, w, "0", "k_tiles")
    return _epilogue(spec, w)


_DESCRIPTORS = {
    # side, layout -> (shape, strides, block, load coordinates, transpose after load)
    ("a", "row"): ("[M, K]", "[a_stride_r, 1]", "[BLOCK_M, BLOCK_K]", "[pid_m * BLOCK_M, kt * BLOCK_K]", False),
    ("a", "col"): ("[K, M]", "[a_stride_c, 1]", "[BLOCK_K, BLOCK_M]", "[kt * BLOCK_K, pid_m * BLOCK_M]", True),
    ("b", "row"): ("[K, N]", "[b_stride_r, 1]", "[BLOCK_K, BLOCK_N]", "[kt * BLOCK_K, pid_n * BLOCK_N]", False),
    ("b", "col"): ("[N, K]", "[b_stride_c, 1]", "[BLOCK_N, BLOCK_K]", "[pid_n * BLOCK_N, kt * BLOCK_K]", True),
}


def _descriptor(spec, side: str, w: _Writer):
    layout = spec.problem.a_layout if side == "a" else spec.problem.b_layout
    shape, strides, block, _, _ = _DESCRIPTORS[(side, layout)]
    (op,) = spec.side(side)
    base = _batch_offset(op)
    pointer = f"{op.ident}_ptr" + (f" + {base}" if base else "")
    strides = strides.replace(f"{side}_stride", f"{op.ident}_stride")
    w(f"desc_{side} = tl.make_tensor_descriptor({pointer}, shape={shape}, strides={strides}, "
      f"block_shape={block})")


def _descriptor_load(spec, side: str, w: _Writer):
    layout = spec.problem.a_layout if side == "a" else spec.problem.b_layout
    _, _, _, coords, transpose = _DESCRIPTORS[(side, layout)]
    w(f"tile_{side} = desc_{side}.load({coords})" + (".T" if transpose else ""))


def _main_persistent(spec, w: _Writer):
    """One program per SM walks tiles; A and B come through TMA descriptors."""
    batched = bool(spec.batch_sizes)
    w("start = tl.program_id(0)",
      "tiles_m = tl.cdiv(M, BLOCK_M)", "tiles_n = tl.cdiv(N, BLOCK_N)",
      "tiles_per_batch = tiles_m * tiles_n", "k_tiles = tl.cdiv(K, BLOCK_K)")
    if not batched:
        _descriptor(spec, "a", w)
        _descriptor(spec, "b", w)
    # FLATTEN: the pipeliner overlaps the next tile's first loads with this tile's epilogue;
    # WARP_SPECIALIZE: producer warps issue TMA loads while consumer warpgroups run wgmma
    w("for tile_id in tl.range(start, tiles_per_batch * batches, PROGRAMS, flatten=FLATTEN, "
      "warp_specialize=WARP_SPECIALIZE):")
    w.indent()
    w("batch = tile_id // tiles_per_batch", "tile = tile_id % tiles_per_batch")
    _grouped_order(w, "tile")
    _batch_lines(spec, w)
    if batched:  # the batch entry's base moves: descriptors per tile (128 B each, in scratch)
        _descriptor(spec, "a", w)
        _descriptor(spec, "b", w)
    w("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)", "for kt in range(k_tiles):")
    w.indent()
    _descriptor_load(spec, "a", w)
    _descriptor_load(spec, "b", w)
    w(_dot(spec))
    w.dedent()
    _tile_offsets(spec, w)
    emitter = _epilogue(spec, w)
    w.dedent()
    return emitter


def _combine(spec, w: _Writer):
    """Split-K: add the partials of every split in order, then run the epilogue."""
    w("tile = tl.program_id(0)", "batch = tl.program_id(1)",
      "tiles_n = tl.cdiv(N, BLOCK_N)", "pid_m = tile // tiles_n", "pid_n = tile % tiles_n")
    _batch_lines(spec, w)
    _tile_offsets(spec, w)
    w("mask = mask_m[:, None] & mask_n[None, :]",
      "partial = (batch * M + offs_m[:, None]) * N + offs_n[None, :]",
      "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
      "for split in range(SPLIT_K):")
    w.indent()
    w("acc += tl.load(partial_ptr + partial + split * batches * M * N, mask=mask, other=0.0)")
    w.dedent()
    return _epilogue(spec, w)


def _exit_fold(spec, w: _Writer):
    """Fold each exit's per-tile partials in tile order and store the row result."""
    w("rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)",
      "row_mask = rows < batches * M", "batch = rows // M", "offs_m = rows % M")
    _batch_lines(spec, w)
    for index, plan in enumerate(spec.exits):
        _, combine, identity, finalize = EXIT_MODES[plan.node.attrs.mode]
        fold = EXIT_FOLD[combine]
        w(f"value_{index} = tl.full((BLOCK_ROWS,), {identity}, tl.float32)", "for tile in range(EXIT_TILES):")
        w.indent()
        w(f"part = tl.load(exit_{index}_partial_ptr + (batch * EXIT_TILES + tile) * M + offs_m, mask=row_mask)",
          f"value_{index} = " + fold.format(f"value_{index}", "part"))
        w.dedent()
        op = plan.output
        row = f"offs_m * {op.ident}_stride_r" if op.row_stride else "offs_m * 0"  # keep the block shape
        terms = [t for t in (_batch_offset(op), row) if t]
        value = finalize.format(f"value_{index}")
        w(f"tl.store({op.ident}_ptr + {' + '.join(terms) or '0'}, ({value}).to({op.data_type.triton_type}), "
          f"mask=row_mask)")
    return None


BODIES = {"tiled": _main_tiled, "small_m": _main_tiled, "split_k": _main_tiled,
          "persistent": _main_persistent, "combine": _combine, "exit_fold": _exit_fold}


# --- arguments ------------------------------------------------------------------------------------
def _operands_of(spec, body: str) -> list:
    """The operands a kernel body reads or writes."""
    if body == "exit_fold":
        return [p.output for p in spec.exits]
    if body == "combine":
        return [o for o in spec.operands if o.side in ("c", "scalar")]
    if spec.config.split_k > 1:
        return [o for o in spec.operands if o.side in ("a", "b")]
    return [o for o in spec.operands if o.side != "exit"]


def _sizes_used(spec, body: str) -> tuple:
    """The problem sizes a kernel body reads."""
    if body == "exit_fold":
        reads_n = any(plan.node.attrs.mode in EXIT_READS_N for plan in spec.exits)
        return ("M", "batches") + (("N",) if reads_n else ())
    if body == "combine":
        return ("M", "N", "batches")
    batched = spec.config.split_k > 1 or body == "persistent"  # partial index, flat tile loop
    return ("M", "N", "K") + (("batches",) if batched else ())


def _strides_used(spec, body: str, op: MatmulOperand) -> list:
    """(suffix, stride) of the stride arguments the body reads for `op`: batch strides, then
    the row and column strides its offsets use (a TMA descriptor takes only its pitch; the exit
    fold walks rows only)."""
    used = [(f"bstride_{a}", s) for a, s in enumerate(op.batch_strides) if s]
    if body == "persistent" and op.side in ("a", "b"):
        layout = spec.problem.a_layout if op.side == "a" else spec.problem.b_layout
        pitch = ("stride_r", op.row_stride) if layout == "row" else ("stride_c", op.col_stride)
        return used + [pitch]
    used += [("stride_r", op.row_stride)] if op.row_stride else []
    if body != "exit_fold":
        used += [("stride_c", op.col_stride)] if op.col_stride else []
    return used


def _arguments(spec, body: str, operands: list, scalars) -> list:
    """Kernel arguments, decided from what the body uses (never from its text)."""
    args = [KernelArgument("tensor", f"{op.ident}_ptr", op.uid) for op in operands]
    split = spec.config.split_k > 1
    if body == "combine" or (body != "exit_fold" and split):
        args.append(KernelArgument("tensor", "partial_ptr", spec.partial_uid))
    if body in ("exit_fold", "combine") or (body != "exit_fold" and not split):
        args += [KernelArgument("tensor", f"exit_{i}_partial_ptr", p.partial_uid) for i, p in enumerate(spec.exits)]
    problem = spec.problem
    sizes = {"M": problem.m, "N": problem.n, "K": problem.k, "batches": spec.batches}
    args += [KernelArgument("int", name, sizes[name]) for name in _sizes_used(spec, body)]
    args += [KernelArgument("int", f"batch_size_{a}", s) for a, s in enumerate(spec.batch_sizes) if a > 0]
    for op in operands:
        args += [KernelArgument("int", f"{op.ident}_{suffix}", s) for suffix, s in _strides_used(spec, body, op)]
    args += [KernelArgument("int", name, value) for name, value in scalars]
    return args


def _constexprs(spec, body: str) -> list:
    cfg = spec.config
    if body == "exit_fold":
        tiles = -(-spec.problem.n // spec.epilogue_block[1])
        return [KernelArgument("constexpr", "BLOCK_ROWS", EXIT_FOLD_BLOCK),
                KernelArgument("constexpr", "EXIT_TILES", tiles)]
    if body == "combine":
        block_m, block_n = spec.epilogue_block
        return [KernelArgument("constexpr", "BLOCK_M", block_m), KernelArgument("constexpr", "BLOCK_N", block_n),
                KernelArgument("constexpr", "SPLIT_K", cfg.split_k)]
    result = [KernelArgument("constexpr", "BLOCK_M", cfg.block_m), KernelArgument("constexpr", "BLOCK_N", cfg.block_n),
              KernelArgument("constexpr", "BLOCK_K", cfg.block_k), KernelArgument("constexpr", "GROUP_M", cfg.group_m)]
    if cfg.split_k > 1:
        result.append(KernelArgument("constexpr", "SPLIT_K", cfg.split_k))
    if body == "persistent":
        result += [KernelArgument("constexpr", "PROGRAMS", spec.persistent_programs),
                   KernelArgument("constexpr", "FLATTEN", cfg.flatten),
                   KernelArgument("constexpr", "WARP_SPECIALIZE", cfg.warp_specialize)]
    return result


@dataclass(frozen=True)
class _NamedSpec:
    """A kernel spec whose operands carry the names of one kernel's allocator."""

    spec: MatmulKernelSpec
    names: NameAllocator

    def __getattr__(self, field):
        return getattr(self.spec, field)


def _named(spec) -> _NamedSpec:
    """`spec` with every operand named from a fresh allocator (by side, never by tensor name)."""
    names = NameAllocator(FIXED_NAMES + (spec.name,))
    names.reserve_stems(*FIXED_STEMS)
    named = lambda op: replace(op, ident=names.prefix(SIDE_HINTS[op.side]))
    operands = tuple(named(op) for op in spec.operands)
    exits = tuple(replace(plan, output=named(plan.output)) for plan in spec.exits)
    return _NamedSpec(replace(spec, operands=operands, exits=exits), names)


def render(spec, body: str):
    """(source, arguments) of one kernel of a matmul group: body is the config's variant,
    "combine" (split-K) or "exit_fold"."""
    spec = _named(spec)
    w = _Writer()
    emitter = BODIES[body](spec, w)
    scalars = emitter.scalars if emitter is not None else []
    operands = _operands_of(spec, body)
    args = _arguments(spec, body, operands, scalars) + _constexprs(spec, body)
    params = [a.name + (": tl.constexpr" if a.kind == "constexpr" else "") for a in args]
    source = header(spec.description) + "from dnngraph.codegen import triton_reduce as tr\n"
    if emitter is not None and emitter.globals:
        source += "\n" + "\n".join(emitter.globals) + "\n"
    source += f"\n\n@triton.jit\ndef {spec.name}(\n" + "".join(f"    {p},\n" for p in params) + "):\n"
    source += "\n".join(w.lines) + "\n"
    return source, args
