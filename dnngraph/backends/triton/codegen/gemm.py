"""The GEMM mainloop every GEMM-shaped family renders through (matmul, convolution).

A kernel walks output tiles [BLOCK_M, BLOCK_N] of one batch entry (batch axes broadcast per
operand through zero strides, decomposed from one flat index). Three pluggable pieces decide how
the operands reach tl.dot; the mainloop only orders them:

  k walk    what one k step covers: `k_tiles` before the loop, then per step the offsets and
            masks both sides share (a linear K for matmul, filter taps x channels for conv);
  loader A  statements per program, per output tile and per k step leaving `tile_a`
  loader B  [BLOCK_M, BLOCK_K] and `tile_b` [BLOCK_K, BLOCK_N] in their dot types.

Loaders are plain data (codegen/matmul.py: strided pointers, TMA descriptors; codegen/conv.py:
the implicit-GEMM activation gather and the filter). The epilogue is one path for all: scales,
epilogue operand loads, the expression emitter's chain, stores of every stored value and
row-exit partials, the same text in the main kernel and in the split-K combine kernel. Output
rows and columns may decompose into several axes (a conv output's rows are (n, p, q), a folded
wgrad's columns (channel, taps...)), each with its own stride per operand.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .emitter import SCALAR_AS_TILE, ExpressionEmitter, kind_of, load_conversion
from .grid import folded_program_ids
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, blend_arguments, kernel_module

# Row-exit reductions riding on the epilogue: (value transform, combine, identity, finalize).
EXIT_MODES = {
    "sum": ("{0}", "sum", "0.0", "{0}"),
    "mean": ("{0}", "sum", "0.0", "{0} / N"),
    "norm1": ("tl.abs({0})", "sum", "0.0", "{0}"),
    "norm2": ("{0} * {0}", "sum", "0.0", "tl.sqrt_rn({0})"),
    "max": ("{0}", "max", "-float('inf')", "{0}"),
    "min": ("{0}", "min", "float('inf')", "{0}"),
    "amax": ("tl.abs({0})", "max", "0.0", "{0}"),
    "sq_sum": ("{0} * {0}", "sum", "0.0", "{0}"),  # genstats' sum of squares
}
# max and min propagate NaN as torch does (tl.max and the default tl.maximum drop it)
EXIT_REDUCE = {"sum": "tl.sum({0}, axis=1)", "max": "tl.reduce({0}, 1, tr.max_combine)",
               "min": "tl.reduce({0}, 1, tr.min_combine)"}
# column exits (per-channel statistics of a conv output) reduce the tile's rows instead
EXIT_REDUCE_COLUMNS = {"sum": "tl.sum({0}, axis=0)", "max": "tl.reduce({0}, 0, tr.max_combine)",
                       "min": "tl.reduce({0}, 0, tr.min_combine)"}
EXIT_FOLD = {"sum": "{0} + {1}", "max": "tr.max_combine({0}, {1})", "min": "tr.min_combine({0}, {1})"}
EXIT_READS_N = frozenset({"mean"})  # modes whose finalize divides by N
EXIT_FOLD_BLOCK = 128  # rows per program of the exit fold: a few KB of partials each
# identifiers the mainloop writes itself; the stems own every `stem_*` name too
# (tile_a, offs_m, bidx_0, batch_size_1, exit_0_partial_ptr, row_1, ...); loaders add theirs
FIXED_NAMES = ("split", "rest", "acc", "kt", "ks", "mask", "start", "part", "M", "N", "K", "batches",
               "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "PROGRAMS", "FLATTEN",
               "WARP_SPECIALIZE", "BLOCK_ROWS", "EXIT_TILES", "BLOCK_COLS", "FOLD_TILES", "SUB_N", "start_n")
FIXED_STEMS = ("tile", "tiles", "batch", "bidx", "group", "first", "rows", "cols", "pid", "offs", "mask",
               "k", "per", "partial", "desc", "row", "col", "exit", "value", "rest", "sub")
# operand names by side: matrices A and B, epilogue operands, per-tensor scales, row exits
SIDE_HINTS = {"a": "a", "b": "b", "c": "c", "scalar": "scale", "exit": "out",
              "a_scale": "sfa", "b_scale": "sfb"}  # block scales of a block-scaled A or B (their loaders')
# sides the k loop reads (split-K's partial kernels take these alone)
LOADED_SIDES = ("a", "b", "a_scale", "b_scale")


@dataclass(frozen=True)
class GemmOperand:
    """One tensor a GEMM kernel touches: strides over its side's [batch..., rows..., cols...].

    side: "a" (rows M, cols K), "b" (rows K, cols N), "c" (rows M, cols N: epilogue operands and
    stored values), "scalar" (per-tensor scales), "exit" (a row-reduction output [batch..., M, 1]).
    Rows and columns are one axis each for a matmul; a loader or an output may split them into
    several (a conv output's rows are (n, p, q)), a stride for each.
    """

    uid: int
    data_type: object
    side: str
    batch_strides: tuple
    row_strides: tuple
    col_strides: tuple
    is_output: bool = False
    ident: str = ""  # its name in the kernel, given by the kernel's allocator at render
    offset: int = 0  # elements from its base to the first one the kernel walks (a dgrad phase)

    @property
    def row_stride(self) -> int:
        (stride,) = self.row_strides
        return stride

    @property
    def col_stride(self) -> int:
        (stride,) = self.col_strides
        return stride


@dataclass(frozen=True)
class ExitPlan:
    """A reduction riding on the epilogue: over each output row (axis "row": partials
    [batches, column tiles, M]) or each output column (axis "column": [batches, row tiles, N])."""

    node: object  # the reduction node
    partial_uid: int  # fp32 scratch of the per-tile partials
    output: GemmOperand
    mode: str = ""  # an EXIT_MODES key ("": the reduction node's mode)
    axis: str = "row"

    @property
    def source(self):
        """The epilogue value it reduces (a graph tensor: an output is reduced as stored)."""
        return self.node.inputs[0]

    @property
    def reduce_mode(self) -> str:
        return self.mode or self.node.attrs.mode


def exit_axis(spec) -> str:
    """The axis every exit of the spec reduces ("row" or "column")."""
    axes = {plan.axis for plan in spec.exits}
    if len(axes) > 1:
        raise ValueError(f"exits over rows and columns in one kernel: {sorted(axes)}")
    return axes.pop() if axes else "row"


@dataclass(frozen=True)
class GemmKernelSpec:
    """Everything one GEMM-shaped kernel renders from (plain data)."""

    name: str
    config: object  # block_m, block_n, block_k, group_m, split_k (+ the variant's own fields)
    problem: object  # m, n, k of the GEMM
    batch_sizes: tuple  # output batch axes of size > 1
    c_uid: int  # the value the accumulator holds
    operands: tuple  # GemmOperand of every side
    k_walk: object  # codegen.matmul.LinearK | codegen.conv.TapWalk ...
    loader_a: object
    loader_b: object
    epilogue: tuple  # pointwise nodes applied to the accumulator
    exits: tuple  # ExitPlan
    scale_uids: tuple
    precision: str  # input_precision for fp32 dots ("ieee" | "tf32"), "" otherwise
    compute: str
    index_64: bool
    description: str
    row_sizes: tuple = ()  # the output rows' axes, outer first (empty: one axis, offs_m)
    col_sizes: tuple = ()  # the output columns' axes, outer first (empty: one axis, offs_n)
    partial_uid: int = 0  # split-K scratch [SPLIT_K, batches, M, N]
    epilogue_block: tuple = ()  # (BLOCK_M, BLOCK_N) of the kernel running the epilogue
    persistent_programs: int = 0  # grid of the persistent variant
    column_fold: tuple = (1, 1)  # (tiles, columns) per chunk of a column-exit fold (heuristics)
    tma_store_uids: tuple = ()  # outputs the persistent kernel stores through tensor descriptors
    fold_batch: bool = False  # batch entries past grid axis y's limit: (tile, batch, split) from axis x
    extra_constexprs: tuple = field(default=())  # (name, value) the loaders read
    blends: tuple = ()  # ((uid, (alpha, beta)), ...): outputs stored blended (emitter.store_statement)
    varying: frozenset = frozenset()  # "m" "n" "k" that take other sizes in the bucket (symbolic.BucketExtents)
    fast_math: frozenset = frozenset()  # epilogue outputs of 16-bit math (problems/base.py fast_math_outputs)

    def side(self, side: str) -> list:
        return [op for op in self.operands if op.side == side]

    @property
    def batches(self) -> int:
        count = 1
        for size in self.batch_sizes:
            count *= size
        return count


@dataclass(frozen=True)
class LinearK:
    """K walked in steps of BLOCK_K: `ks` the step's offsets, `mask_k` where K is ragged."""

    ragged: bool  # K % BLOCK_K != 0
    names = ()
    stems = ()
    sizes = ("K",)

    @property
    def size_values(self) -> dict:
        return {}

    def arguments(self) -> list:
        return []

    def count(self, spec, w):
        w("k_tiles = tl.cdiv(K, BLOCK_K)")

    def step(self, spec, w):
        w("ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)")
        if self.ragged:
            w("mask_k = ks < K")


class Loader:
    """What an operand loader does where it has nothing to do; loaders override the rest:
    tile_setup(spec, w) and step(spec, w) always, program_setup where they set up per program."""

    names = ()  # identifiers the loader writes itself (reserved in the kernel's allocator)
    stems = ()  # stems whose `stem_*` names it writes
    reads_rows = False  # decomposes the tile's rows into row_<axis> (the epilogue reuses them)
    reads_cols = False  # decomposes the tile's columns into col_<axis> (the epilogue reuses them)
    uses_k_offsets = True  # reads the k walk's per-step offsets (ks, mask_k)

    def program_setup(self, spec, w):
        pass

    def arguments(self, spec) -> list:
        return []

    def strides_used(self, spec, body, op) -> list:
        """(argument name, stride) of every row and column stride of `op` it addresses."""
        used = [(stride_name(op, "r", i), s) for i, s in enumerate(op.row_strides) if s]
        return used + [(stride_name(op, "c", i), s) for i, s in enumerate(op.col_strides) if s]


class Writer:
    """Indented statement lines of a kernel body."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 1
        self.emitters: list[ExpressionEmitter] = []  # every chain rendered (their scalars, globals)

    def __call__(self, *lines: str):
        self.lines.extend("    " * self.depth + line for line in lines)

    def indent(self):
        self.depth += 1

    def dedent(self):
        self.depth -= 1


# --- shared pieces ------------------------------------------------------------------------------
def batch_lines(spec, w: Writer, flat: str = "batch"):
    """Decompose the flat batch index into bidx_<axis> (row-major over batch_sizes)."""
    if not spec.batch_sizes:
        return
    w(f"rest = {flat}")
    for axis in range(len(spec.batch_sizes) - 1, 0, -1):
        w(f"bidx_{axis} = rest % batch_size_{axis}", f"rest = rest // batch_size_{axis}")
    w("bidx_0 = rest")


def batch_offset(op: GemmOperand) -> str:
    terms = [f"bidx_{axis} * {op.ident}_bstride_{axis}" for axis, s in enumerate(op.batch_strides) if s]
    return " + ".join(terms)


def start_offset(op: GemmOperand) -> str:
    """The argument holding op's start offset, where it has one."""
    return f"{op.ident}_offset" if op.offset else ""


def stride_name(op: GemmOperand, axis: str, index: int) -> str:
    """The argument holding op's stride along row (axis "r") or column ("c") axis `index`."""
    count = len(op.row_strides if axis == "r" else op.col_strides)
    return f"{op.ident}_stride_{axis}" + (str(index) if count > 1 else "")


def axis_terms(op: GemmOperand, axis: str, indices: list, full: bool, shape: str) -> list:
    """Offset terms of op along its row or column axes, `indices` the index vector per axis
    and `shape` the broadcast suffix ("[:, None]" ...); a broadcast axis (stride 0) adds nothing
    unless `full`, where one zero term keeps the tile's shape."""
    strides = op.row_strides if axis == "r" else op.col_strides
    terms = [f"{index}{shape} * {stride_name(op, axis, i)}" for i, (index, s) in enumerate(zip(indices, strides)) if s]
    if not terms and full:
        terms = [f"{indices[-1]}{shape} * 0"]
    return terms


def offset_2d(op: GemmOperand, rows, cols, full: bool = False) -> str:
    """Offset expression of op over a [rows] x [cols] tile (each a name or a list of per-axis
    index names); broadcast axes are skipped unless `full` (dot operands and stores need the
    whole tile even where a size-1 axis has stride 0)."""
    rows = [rows] if isinstance(rows, str) else rows
    cols = [cols] if isinstance(cols, str) else cols
    terms = [t for t in [batch_offset(op), start_offset(op)] if t]
    terms += axis_terms(op, "r", rows, full, "[:, None]")
    terms += axis_terms(op, "c", cols, full, "[None, :]")
    return " + ".join(terms) or "0"


def _tile_mask(op: GemmOperand) -> str:
    """The mask matching an epilogue operand's loaded shape (a bias row loads [1, BLOCK_N])."""
    rows, cols = any(op.row_strides), any(op.col_strides)
    if rows and cols:
        return "mask"
    if cols:
        return "mask_n[None, :]"
    return "mask_m[:, None]" if rows else ""


def load(op: GemmOperand, rows, cols, mask: str, compute: str) -> str:
    """A masked load of op's [rows] x [cols] tile (broadcast axes load once), in `compute`."""
    pointer = f"{op.ident}_ptr + {offset_2d(op, rows, cols)}"
    other = "0.0" if op.data_type.is_floating else "0"
    masked = f", mask={mask}, other={other}" if mask else ""
    cast = load_conversion(op.data_type, compute)
    one_element = "" if mask else SCALAR_AS_TILE
    return f"tl.load({pointer}{one_element}{masked}){cast}"


def bind_load(emitter: ExpressionEmitter, op: GemmOperand, variable: str):
    emitter.bind(op.uid, variable, kind_of(op.data_type))


def converted(op: GemmOperand, dot_type: str) -> str:
    """The conversion a loaded tile of `op` needs to feed tl.dot as `dot_type` ("" if none)."""
    return "" if op.data_type.triton_type == dot_type else f".to({dot_type})"


def prologue_tile(spec, w: Writer, side: str, loads: list, nodes: tuple, target_uid: int, zero_mask: str,
                  dot_type: str):
    """tile_<side> from a pointwise prologue applied at load: `loads` are (operand, load
    expression) of the leaf operands; the chain runs in the compute type and the result is zero
    where `zero_mask` is false (padding, K past its end), whatever the chain maps zero to."""
    emitter = ExpressionEmitter(spec.compute, hint=f"p{side}", names=spec.names)
    w.emitters.append(emitter)
    for op, expression in loads:
        w(f"{op.ident} = {expression}")
        bind_load(emitter, op, op.ident)
    for node in nodes:
        emitter.emit(node)
    w(*emitter.lines)
    value = emitter.value(target_uid, "f")
    if zero_mask:
        value = f"tl.where({zero_mask}, {value}, 0.0)"
    shape = "(BLOCK_M, BLOCK_K)" if side == "a" else "(BLOCK_K, BLOCK_N)"
    w(f"tile_{side} = tl.broadcast_to(({value}).to({dot_type}), {shape})")


def _grouped_order(w: Writer, tile: str):
    """pid_m, pid_n of `tile` in grouped order (library.tile_of): GROUP_M row tiles share B
    columns in L2."""
    w(f"pid_m, pid_n = lib.tile_of({tile}, tiles_m, tiles_n, GROUP_M)")


def _tile_offsets(spec, w: Writer):
    w("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
      "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    if spec.index_64:
        w("offs_m = offs_m.to(tl.int64)", "offs_n = offs_n.to(tl.int64)")
    w("mask_m = offs_m < M", "mask_n = offs_n < N")


def decompose_lines(w: Writer, flat: str, indices: list, sizes: list):
    """Decompose the flat index `flat` into `indices` (outer first), row-major over `sizes`
    (names of the extents; the outermost's is not read). Each decomposition has a remainder of
    its own (rest_<first index>): one made in the k loop must not reuse a name the tile setup
    gave a [BLOCK_M] value, or Triton sees a loop-carried value change its shape."""
    rest = f"rest_{indices[0]}"
    w(f"{rest} = {flat}")
    for axis in range(len(indices) - 1, 0, -1):
        w(f"{indices[axis]} = {rest} % {sizes[axis]}", f"{rest} = {rest} // {sizes[axis]}")
    w(f"{indices[0]} = {rest}")


def _axis_lines(w: Writer, flat: str, stem: str, count: int):
    """Decompose the flat index `flat` into <stem>_<axis>, row-major over <stem>_size_<axis>."""
    axes = range(max(count, 1))
    decompose_lines(w, flat, [f"{stem}_{a}" for a in axes], [f"{stem}_size_{a}" for a in axes])


def _axis_names(stem: str, sizes, flat: str) -> list:
    return [f"{stem}_{axis}" for axis in range(len(sizes))] if sizes else [flat]


def row_lines(spec, w: Writer, flat: str):
    """Decompose output rows `flat` into row_<axis> (row-major over spec.row_sizes)."""
    _axis_lines(w, flat, "row", len(spec.row_sizes))


def output_rows(spec) -> list:
    """Index names of the output's row axes."""
    return _axis_names("row", spec.row_sizes, "offs_m")


def col_lines(spec, w: Writer, flat: str):
    """Decompose output columns `flat` into col_<axis> (row-major over spec.col_sizes)."""
    _axis_lines(w, flat, "col", len(spec.col_sizes))


def output_cols(spec) -> list:
    """Index names of the output's column axes."""
    return _axis_names("col", spec.col_sizes, "offs_n")


# --- the k loop -----------------------------------------------------------------------------------
def accumulator_kind(spec) -> str:
    """The emitter kind of the accumulator: "i" (int32) for an int8 dot, "f" (float32) else."""
    return "i" if spec.problem.dot == "int8" else "f"


def accumulator_type(spec) -> str:
    """The Triton type of the accumulator (and of split-K partials): int8 x int8 products sum
    exactly in int32 on the tensor cores (the ops refuse a K that could overflow it)."""
    return "tl.int32" if accumulator_kind(spec) == "i" else "tl.float32"


def _dot(spec) -> str:
    precision = f", input_precision=\"{spec.precision}\"" if spec.precision else ""
    out_type = ", out_dtype=tl.int32" if accumulator_kind(spec) == "i" else ""
    return f"acc = tl.dot(tile_a, tile_b, acc{precision}{out_type})"


def k_loop(spec, w: Writer, k_range: str):
    """acc over the k steps `range(k_range)` of the current tile, through the two loaders."""
    spec.loader_a.tile_setup(spec, w)
    spec.loader_b.tile_setup(spec, w)
    w(f"acc = tl.zeros((BLOCK_M, BLOCK_N), dtype={accumulator_type(spec)})", f"for kt in range({k_range}):")
    w.indent()
    if spec.loader_a.uses_k_offsets or spec.loader_b.uses_k_offsets:
        spec.k_walk.step(spec, w)
    spec.loader_a.step(spec, w)
    spec.loader_b.step(spec, w)
    w(_dot(spec))
    w.dedent()


# --- the epilogue ---------------------------------------------------------------------------------
def _epilogue_body(spec, w: Writer, tma_outputs: frozenset):
    """acc -> scales, the chain, stores and column-exit partials over the current columns
    (offs_n, mask_n: the whole tile or one column subtile); returns the chain's emitter."""
    for uid in spec.scale_uids:
        op = next(o for o in spec.operands if o.uid == uid)
        w(f"acc = acc * tl.load({op.ident}_ptr).to(tl.float32)")
    emitter = ExpressionEmitter(spec.compute, hint="e", names=spec.names, blends=spec.blends,
                                fast_math=spec.fast_math)
    emitter.bind(spec.c_uid, "acc", accumulator_kind(spec))
    w("mask = mask_m[:, None] & mask_n[None, :]")
    rows, cols = output_rows(spec), output_cols(spec)
    for op in spec.side("c"):
        if not op.is_output:
            w(f"{op.ident} = {load(op, rows, cols, _tile_mask(op), spec.compute)}")
            bind_load(emitter, op, op.ident)
    for node in spec.epilogue:
        emitter.emit(node)
    w(*emitter.lines)
    for op in spec.side("c"):
        if op.is_output and op.uid in tma_outputs:
            w(f"desc_{op.ident}.store([pid_m * BLOCK_M, start_n], "
              f"tl.broadcast_to({emitter.stored(op.uid, op.data_type)}, (BLOCK_M, SUB_N)))")
        elif op.is_output:
            w(emitter.store(f"{op.ident}_ptr + {offset_2d(op, rows, cols, full=True)}", op.uid, op.data_type, "mask"))
    for index, plan in enumerate(spec.exits):
        if plan.axis == "column":
            _, combine, _, _ = EXIT_MODES[plan.reduce_mode]
            w(f"exit_{index} = {EXIT_REDUCE_COLUMNS[combine].format(_exit_value(plan, emitter))}",
              f"tl.store(exit_{index}_partial_ptr + (batch * tl.cdiv(M, BLOCK_M) + pid_m) * N + offs_n, "
              f"exit_{index}, mask=mask_n)")
    return emitter


def _exit_value(plan, emitter) -> str:
    """An exit's source value, transformed, with its identity where the tile is masked."""
    transform, _, identity, _ = EXIT_MODES[plan.reduce_mode]
    return f"tl.where(mask, {transform.format(emitter.consumed(plan.source, 'f'))}, {identity})"


def _row_exits(spec, w: Writer, emitter, part: int, last: bool):
    """Reduce each row exit over the current columns: the first (or only) part starts the tile's
    partial, later column subtiles fold into it in order; the last stores it."""
    for index, plan in enumerate(spec.exits):
        if plan.axis == "column":
            continue
        combine = EXIT_MODES[plan.reduce_mode][1]
        reduced = EXIT_REDUCE[combine].format(_exit_value(plan, emitter))
        w(f"exit_{index} = " + (reduced if part == 0 else EXIT_FOLD[combine].format(f"exit_{index}", reduced)))
        if last:
            w(f"tl.store(exit_{index}_partial_ptr + (batch * tl.cdiv(N, BLOCK_N) + pid_n) * M + offs_m, "
              f"exit_{index}, mask=mask_m)")


def _subtile_lines(w: Writer, parts: int):
    """Cut acc [BLOCK_M, BLOCK_N] into `parts` column subtiles sub_0.. [BLOCK_M, SUB_N], left to
    right: each step halves a block (its columns viewed as [2, half], the 2 moved last, split)."""
    step = parts
    while step > 1:
        half = step // 2
        for first in range(0, parts, step):
            source = "acc" if step == parts else f"sub_{first}"
            width = "SUB_N" if half == 1 else f"SUB_N * {half}"
            w(f"sub_{first}, sub_{first + half} = tl.split(tl.permute(tl.reshape({source}, "
              f"(BLOCK_M, 2, {width})), (0, 2, 1)))")
        step = half


def _part_offsets(spec, w: Writer, part: int, decomposed: bool):
    """offs_n, mask_n (and the column axes) of column subtile `part`, from start_n."""
    w("start_n = pid_n * BLOCK_N" + (f" + {part} * SUB_N" if part else ""), "offs_n = start_n + tl.arange(0, SUB_N)")
    if spec.index_64:
        w("offs_n = offs_n.to(tl.int64)")
    w("mask_n = offs_n < N")
    _epilogue_cols(spec, w, decomposed)


def _epilogue(spec, w: Writer, parts: int = 1, tma_outputs: frozenset = frozenset()):
    """acc [BLOCK_M, BLOCK_N] fp32 -> scales, the chain, stores and exit partials. With `parts`
    > 1 the tile is cut into column subtiles that run the one epilogue text in turn (fewer
    values live at once, one subtile's stores overlapping the next one's math); outputs in
    `tma_outputs` are stored through their descriptors (desc_<output>, SUB_N columns wide)."""
    body = Writer()
    body.depth = 0
    emitter = _epilogue_body(spec, body, tma_outputs)
    w.emitters.append(emitter)
    if parts == 1:
        if tma_outputs:
            w("start_n = pid_n * BLOCK_N")
        w(*body.lines)
        _row_exits(spec, w, emitter, 0, last=True)
        return emitter
    _subtile_lines(w, parts)
    for part in range(parts):
        _part_offsets(spec, w, part, decomposed=False)
        w(f"acc = sub_{part}", *body.lines)
        _row_exits(spec, w, emitter, part, last=part == parts - 1)
    return emitter


def _epilogue_rows(spec, w: Writer, decomposed: bool = False):
    """Decompose the tile's rows where the output's rows have several axes (unless a loader
    did already: it decomposes the wrapped rows, the same indices wherever a store is masked in)."""
    if spec.row_sizes and not decomposed:
        row_lines(spec, w, "offs_m")


def _epilogue_cols(spec, w: Writer, decomposed: bool = False):
    """The same for the columns (a folded wgrad's (channel, taps...))."""
    if spec.col_sizes and not decomposed:
        col_lines(spec, w, "offs_n")


def _loaders_read_rows(spec) -> bool:
    return spec.loader_a.reads_rows or spec.loader_b.reads_rows


def _loaders_read_cols(spec) -> bool:
    return spec.loader_a.reads_cols or spec.loader_b.reads_cols


# --- kernels --------------------------------------------------------------------------------------
def _main_tiled(spec, w: Writer):
    split = spec.config.split_k > 1
    if spec.fold_batch:
        w("tiles_m = tl.cdiv(M, BLOCK_M)", "tiles_n = tl.cdiv(N, BLOCK_N)")
        w(*folded_program_ids(("tile", "batch", "split") if split else ("tile", "batch"),
                              ("tiles_m * tiles_n", "batches")))
    else:
        w("tile = tl.program_id(0)", "batch = tl.program_id(1)")
        if split:
            w("split = tl.program_id(2)")
        w("tiles_m = tl.cdiv(M, BLOCK_M)", "tiles_n = tl.cdiv(N, BLOCK_N)")
    _grouped_order(w, "tile")
    batch_lines(spec, w)
    _tile_offsets(spec, w)
    spec.k_walk.count(spec, w)
    if split:
        w("per_split = tl.cdiv(k_tiles, SPLIT_K)", "k_first = split * per_split",
          "k_last = tl.minimum(k_first + per_split, k_tiles)")
        k_loop(spec, w, "k_first, k_last")
        w("mask = mask_m[:, None] & mask_n[None, :]",
          "partial = ((split * batches + batch) * M + offs_m[:, None]) * N + offs_n[None, :]",
          "tl.store(partial_ptr + partial, acc, mask=mask)")
        return None
    k_loop(spec, w, "0, k_tiles")
    _epilogue_rows(spec, w, decomposed=_loaders_read_rows(spec))
    _epilogue_cols(spec, w, decomposed=_loaders_read_cols(spec))
    return _epilogue(spec, w)


def _store_descriptors(spec, w: Writer):
    """desc_<output> of each output stored through a descriptor ([M, N] at its batch entry's
    base, unit column stride, [BLOCK_M, SUB_N] blocks: one column subtile per store)."""
    for op in spec.side("c"):
        if op.is_output and op.uid in spec.tma_store_uids:
            base = " + ".join(t for t in (batch_offset(op), start_offset(op)) if t)
            pointer = f"{op.ident}_ptr" + (f" + {base}" if base else "")
            w(f"desc_{op.ident} = tl.make_tensor_descriptor({pointer}, shape=[M, N], "
              f"strides=[{stride_name(op, 'r', 0)}, 1], block_shape=[BLOCK_M, SUB_N])")


def _main_persistent(spec, w: Writer):
    """One program per SM walks tiles; the loaders may set up once per program (descriptors)."""
    w("start = tl.program_id(0)",
      "tiles_m = tl.cdiv(M, BLOCK_M)", "tiles_n = tl.cdiv(N, BLOCK_N)",
      "tiles_per_batch = tiles_m * tiles_n")
    spec.k_walk.count(spec, w)
    spec.loader_a.program_setup(spec, w)
    spec.loader_b.program_setup(spec, w)
    if not spec.batch_sizes:
        _store_descriptors(spec, w)
    # FLATTEN: the pipeliner overlaps the next tile's first loads with this tile's epilogue;
    # WARP_SPECIALIZE: producer warps issue TMA loads while consumer warpgroups run wgmma
    w("for tile_id in tl.range(start, tiles_per_batch * batches, PROGRAMS, flatten=FLATTEN, "
      "warp_specialize=WARP_SPECIALIZE):")
    w.indent()
    w("batch = tile_id // tiles_per_batch", "tile = tile_id % tiles_per_batch")
    _grouped_order(w, "tile")
    batch_lines(spec, w)
    if spec.batch_sizes:
        _store_descriptors(spec, w)
    k_loop(spec, w, "k_tiles")
    _tile_offsets(spec, w)
    _epilogue_rows(spec, w)
    parts = spec.config.epilogue_subtile
    if parts == 1:
        _epilogue_cols(spec, w)
    emitter = _epilogue(spec, w, parts, frozenset(spec.tma_store_uids))
    w.dedent()
    return emitter


def _combine(spec, w: Writer):
    """Split-K: add the partials of every split in order, then run the epilogue."""
    if spec.fold_batch:
        w("tiles_n = tl.cdiv(N, BLOCK_N)", *folded_program_ids(("tile", "batch"), ("tl.cdiv(M, BLOCK_M) * tiles_n",)),
          "pid_m = tile // tiles_n", "pid_n = tile % tiles_n")
    else:
        w("tile = tl.program_id(0)", "batch = tl.program_id(1)",
          "tiles_n = tl.cdiv(N, BLOCK_N)", "pid_m = tile // tiles_n", "pid_n = tile % tiles_n")
    batch_lines(spec, w)
    _tile_offsets(spec, w)
    w("mask = mask_m[:, None] & mask_n[None, :]",
      "partial = (batch * M + offs_m[:, None]) * N + offs_n[None, :]",
      f"acc = tl.zeros((BLOCK_M, BLOCK_N), dtype={accumulator_type(spec)})",
      "for split in range(SPLIT_K):")
    w.indent()
    w("acc += tl.load(partial_ptr + partial + split * batches * M * N, mask=mask, other=0)")
    w.dedent()
    _epilogue_rows(spec, w)
    _epilogue_cols(spec, w)
    return _epilogue(spec, w)


# the row-exit fold: (index, valid mask, extent, the index within one batch entry, its stride axis)
_FOLD_AXES = {"row": ("rows", "row_mask", "M", "offs_m", "r")}


def _column_fold(spec, w: Writer):
    """Fold each column exit's per-row-tile partials ([FOLD_TILES, BLOCK_COLS] chunks, chunks in
    tile order: deterministic) and store the column result."""
    w("cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)",
      "col_mask = cols < batches * N", "batch = cols // N", "offs_n = cols % N")
    batch_lines(spec, w)
    for index, plan in enumerate(spec.exits):
        _, combine, identity, finalize = EXIT_MODES[plan.reduce_mode]
        w(f"value_{index} = tl.full((BLOCK_COLS,), {identity}, tl.float32)",
          "for first in range(0, EXIT_TILES, FOLD_TILES):")
        w.indent()
        w("tiles = first + tl.arange(0, FOLD_TILES)",
          f"part = tl.load(exit_{index}_partial_ptr + (batch[None, :] * EXIT_TILES + tiles[:, None]) * N "
          f"+ offs_n[None, :], mask=(tiles < EXIT_TILES)[:, None] & col_mask[None, :], other={identity})",
          f"value_{index} = " + EXIT_FOLD[combine].format(f"value_{index}", EXIT_REDUCE_COLUMNS[combine].format("part")))
        w.dedent()
        op = plan.output
        along = f"offs_n * {op.ident}_stride_c" if op.col_stride else "offs_n * 0"  # keep the block shape
        terms = [t for t in (batch_offset(op), along) if t]
        w(_fold_store(spec, w, f"{op.ident}_ptr + {' + '.join(terms)}", finalize.format(f'value_{index}'), op,
                      "col_mask"))


def _fold_store(spec, w: Writer, pointer: str, value: str, op, mask: str) -> str:
    """The store of a folded exit's result: blended through an emitter of the kernel (its blend
    factors' pointers join the signature)."""
    emitter = ExpressionEmitter(spec.compute, hint="e", names=spec.names, blends=spec.blends)
    w.emitters.append(emitter)
    return emitter.store_value(pointer, value, "f", op.uid, op.data_type, mask)


def _exit_fold(spec, w: Writer):
    """Fold each exit's per-tile partials in tile order and store the row (or column) result."""
    if exit_axis(spec) == "column":
        _column_fold(spec, w)
        return
    flat, valid, extent, inner, stride_axis = _FOLD_AXES[exit_axis(spec)]
    w(f"{flat} = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)",
      f"{valid} = {flat} < batches * {extent}", f"batch = {flat} // {extent}", f"{inner} = {flat} % {extent}")
    batch_lines(spec, w)
    for index, plan in enumerate(spec.exits):
        _, combine, identity, finalize = EXIT_MODES[plan.reduce_mode]
        fold = EXIT_FOLD[combine]
        w(f"value_{index} = tl.full((BLOCK_ROWS,), {identity}, tl.float32)", "for tile in range(EXIT_TILES):")
        w.indent()
        w(f"part = tl.load(exit_{index}_partial_ptr + (batch * EXIT_TILES + tile) * {extent} + {inner}, "
          f"mask={valid})", f"value_{index} = " + fold.format(f"value_{index}", "part"))
        w.dedent()
        op = plan.output
        stride = op.row_stride if stride_axis == "r" else op.col_stride
        along = f"{inner} * {op.ident}_stride_{stride_axis}" if stride else f"{inner} * 0"  # keep the block shape
        terms = [t for t in (batch_offset(op), along) if t]
        value = finalize.format(f"value_{index}")
        w(_fold_store(spec, w, f"{op.ident}_ptr + {' + '.join(terms) or '0'}", value, op, valid))


BODIES = {"tiled": _main_tiled, "small_m": _main_tiled, "split_k": _main_tiled,
          "persistent": _main_persistent, "combine": _combine, "exit_fold": _exit_fold}
MAIN_BODIES = frozenset({"tiled", "small_m", "split_k", "persistent"})


# --- arguments ------------------------------------------------------------------------------------
def _operands_of(spec, body: str) -> list:
    """The operands a kernel body reads or writes."""
    if body == "exit_fold":
        return [p.output for p in spec.exits]
    if body == "combine":
        return [o for o in spec.operands if o.side in ("c", "scalar")]
    if spec.config.split_k > 1:
        return [o for o in spec.operands if o.side in LOADED_SIDES]
    return [o for o in spec.operands if o.side != "exit"]


def _sizes_used(spec, body: str) -> tuple:
    """The problem sizes a kernel body reads."""
    if body == "exit_fold" and exit_axis(spec) == "column":
        return ("N", "batches")
    if body == "exit_fold":
        reads_n = any(plan.reduce_mode in EXIT_READS_N for plan in spec.exits)
        return ("M", "batches") + (("N",) if reads_n else ())
    if body == "combine":
        return ("M", "N", "batches")
    batched = spec.config.split_k > 1 or body == "persistent" or spec.fold_batch  # partial index, flat tiles
    return ("M", "N") + spec.k_walk.sizes + (("batches",) if batched else ())


def _strides_used(spec, body: str, op: GemmOperand) -> list:
    """(argument name, stride) of the strides the body reads for `op`: batch strides, then what
    its loader addresses (sides a and b), or its row and column strides (the exit fold walks
    rows only)."""
    used = [(f"{op.ident}_bstride_{a}", s) for a, s in enumerate(op.batch_strides) if s]
    used += [(start_offset(op), op.offset)] if op.offset else []
    if op.side in ("a", "b"):
        loader = spec.loader_a if op.side == "a" else spec.loader_b
        return used + loader.strides_used(spec, body, op)
    if body != "exit_fold" or exit_axis(spec) == "row":
        used += [(stride_name(op, "r", i), s) for i, s in enumerate(op.row_strides) if s]
    through_descriptor = body == "persistent" and op.uid in spec.tma_store_uids  # unit columns
    if (body != "exit_fold" or exit_axis(spec) == "column") and not through_descriptor:
        used += [(stride_name(op, "c", i), s) for i, s in enumerate(op.col_strides) if s]
    return used


def _arguments(spec, body: str, operands: list, scalars) -> list:
    """Kernel arguments, decided from what the body uses (never from its text)."""
    args = [KernelArgument("tensor", f"{op.ident}_ptr", op.uid) for op in operands]
    split = spec.config.split_k > 1
    if body == "combine" or (body != "exit_fold" and split):
        args.append(KernelArgument("tensor", "partial_ptr", spec.partial_uid))
    if body in ("exit_fold", "combine") or (body != "exit_fold" and not split):
        args += [KernelArgument("tensor", f"exit_{i}_partial_ptr", p.partial_uid) for i, p in enumerate(spec.exits)]
    sizes = {"M": spec.problem.m, "N": spec.problem.n, "K": spec.problem.k, "batches": spec.batches}
    sizes.update(spec.k_walk.size_values)
    args += [KernelArgument("int", name, sizes[name]) for name in _sizes_used(spec, body)]
    args += [KernelArgument("int", f"batch_size_{a}", s) for a, s in enumerate(spec.batch_sizes) if a > 0]
    epilogue = body == "combine" or (body in MAIN_BODIES and not split)
    if epilogue or (body in MAIN_BODIES and _loaders_read_rows(spec)):  # rows decomposed
        args += [KernelArgument("int", f"row_size_{a}", s) for a, s in enumerate(spec.row_sizes) if a > 0]
    if epilogue or (body in MAIN_BODIES and _loaders_read_cols(spec)):  # columns decomposed
        args += [KernelArgument("int", f"col_size_{a}", s) for a, s in enumerate(spec.col_sizes) if a > 0]
    if body in MAIN_BODIES:
        args += spec.k_walk.arguments() + spec.loader_a.arguments(spec) + spec.loader_b.arguments(spec)
    for op in operands:
        args += [KernelArgument("int", name, s) for name, s in _strides_used(spec, body, op)]
    args += [KernelArgument("int", name, value) for name, value in scalars]
    return args


def _constexprs(spec, body: str) -> list:
    cfg = spec.config
    if body == "exit_fold" and exit_axis(spec) == "column":
        fold_tiles, block_cols = spec.column_fold
        return [KernelArgument("constexpr", "BLOCK_COLS", block_cols),
                KernelArgument("constexpr", "EXIT_TILES", -(-spec.problem.m // spec.epilogue_block[0])),
                KernelArgument("constexpr", "FOLD_TILES", fold_tiles)]
    if body == "exit_fold":
        return [KernelArgument("constexpr", "BLOCK_ROWS", EXIT_FOLD_BLOCK),
                KernelArgument("constexpr", "EXIT_TILES", -(-spec.problem.n // spec.epilogue_block[1]))]
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
        if cfg.epilogue_subtile > 1 or spec.tma_store_uids:
            result.append(KernelArgument("constexpr", "SUB_N", cfg.block_n // cfg.epilogue_subtile))
    result += [KernelArgument("constexpr", name, value) for name, value in spec.extra_constexprs]
    return result


@dataclass(frozen=True)
class _NamedSpec:
    """A kernel spec whose operands carry the names of one kernel's allocator."""

    spec: GemmKernelSpec
    names: NameAllocator

    def __getattr__(self, name):
        return getattr(self.spec, name)


def _named(spec) -> _NamedSpec:
    """`spec` with every operand named from a fresh allocator (by side, never by tensor name);
    the loaders' and the k walk's own identifiers are reserved first."""
    pieces = (spec.k_walk, spec.loader_a, spec.loader_b)
    fixed = FIXED_NAMES + (spec.name,) + tuple(n for p in pieces for n in p.names)
    fixed += tuple(name for name, _ in spec.extra_constexprs)
    names = NameAllocator(fixed)
    names.reserve_stems(*FIXED_STEMS, *(s for p in pieces for s in p.stems))
    named = lambda op: replace(op, ident=names.prefix(SIDE_HINTS[op.side]))
    operands = tuple(named(op) for op in spec.operands)
    exits = tuple(replace(plan, output=named(plan.output)) for plan in spec.exits)
    return _NamedSpec(replace(spec, operands=operands, exits=exits), names)


def render(spec: GemmKernelSpec, body: str):
    """The KernelSource (name, source, arguments) of one kernel of a GEMM-shaped group: body is the config's variant,
    "combine" (split-K) or "exit_fold"."""
    spec = _named(spec)
    w = Writer()
    BODIES[body](spec, w)
    emitters = w.emitters
    scalars = [s for e in emitters for s in e.scalars]
    operands = _operands_of(spec, body)
    args = _arguments(spec, body, operands, scalars) + _constexprs(spec, body)
    args[len(operands):len(operands)] = blend_arguments(emitters)  # what the stores blend with
    module_globals = [g for e in emitters for g in e.globals]
    loader_libraries = tuple(a for loader in (spec.loader_a, spec.loader_b) for a in getattr(loader, "libraries", ()))
    source = kernel_module(spec.description, module_globals, spec.name, args, "\n".join(w.lines) + "\n",
                           libraries=("tr", "lib") + loader_libraries)
    return KernelSource(spec.name, source, args)
