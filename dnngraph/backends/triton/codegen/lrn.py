"""Render a windowed normalization (LRN, divisive normalization) as one Triton kernel.

Each program owns a box of positions along the windowed axes (heuristics/lrn.py) and loads x
(means, dy) once over the box widened by its halo: a [BLOCK_R, BLOCK_C] tile whose window side
flattens the windowed axes' blocks and whose batch side flattens the other axes. Window sums
never reload memory: a box sum along one axis adds shifted copies of the tile made by
`tl.gather` along the window side, built by doubling (a sum over 2k positions is the sum over k
plus its copy shifted by k), so a window of `size` costs about log2(size) + popcount(size)
shifts instead of `size` loads. (A small forward window may instead load x at each offset over
a tile without halo, `window_by="loads"`: heuristics/lrn.py LOADS_MAX_POINTS.) Box windows are
separable: the sum over H x W is the sum along W of the sums along H. Every term is a square,
so no difference of prefix sums can cancel: the window sums keep fp32's relative accuracy
whatever the dynamic range of x.

The backward is the transpose: dx_m = dy_m S_m^-beta - 2 beta alpha / count * c_m * U_m, where
U is the box sum, over the reversed window (the centres whose window holds m), of
u_i = dy_i c_i S_i^-beta / S_i. Positions outside x are zeros (torch's padding, after any
prologue) and contribute no u. Shifted lanes that leave the tile read zeros; they only reach
halo lanes, which are never stored. The formulas are those of ops/lrn.py; S^-beta is
exp2(-beta * log2(S)).

In the persistent schedule (heuristics/lrn.py choose_form) the same body runs inside a
`tl.range` loop over the tiles pid, pid + grid, ... whose stages the compiler pipelines, so the
next tiles' loads are in flight while this tile computes (`open_tiles`).
"""
from __future__ import annotations

import itertools
from ....ops.lrn import window_count
from ...contract import KernelSource
from .pointwise import KernelArgument
from . import pooling
from .pooling import Coord, _KernelWriter
from ..heuristics.lrn import box_plan

# Stems of the values the kernel writes: centred x (cv), its square (sq), box-sum partials (bx),
# the scale S (sc), the gain S^-beta (gn), dy (dv), the covering term (uv), the loaded means
# (mv), shifted lane indices and their validity (nb, nbok), window-side coordinates (loc) and
# the program's tile along each windowed axis (tile).
VALUE_STEMS = ("cv", "sq", "bx", "sc", "gn", "dv", "uv", "mv", "nb", "nbok", "nbax", "loc", "tile", "owned")
NAMES = ("win", "batch_tile", "win_tile", "store_mask", "inner_batch", "tile_index", "walk")


class _WindowWriter(_KernelWriter):
    """Pooling's writer (operands, prologues, epilogue, stores) with a halo tile and box sums."""

    def __init__(self, kernel_name, schedule, group, compute_type):
        super().__init__(kernel_name, schedule, group, compute_type)
        self.allocator.reserve_stems(*VALUE_STEMS)
        self.allocator.reserve(*NAMES)
        anchor = group.anchor
        first = 1 if schedule.backward else 0  # x's position among the anchor's inputs
        self.x = anchor.inputs[first]
        self.means = anchor.inputs[first + 1] if len(anchor.inputs) > first + 1 else None
        self.dy = anchor.inputs[0] if schedule.backward else None
        self.attrs = anchor.attrs
        forward_op = anchor.op[:-len("_backward")] if schedule.backward else anchor.op
        self.count = window_count(forward_op, self.rank, self.attrs)
        self.window_side = "col" if schedule.window_on_cols else "row"
        self.gather_axis = 1 if schedule.window_on_cols else 0
        self.shift_indices: dict = {}  # (axis, shift) -> (index variable, validity variable)
        self.offsets_made: set = set()  # (axis, offset) whose moved coordinates are emitted
        self.serial = itertools.count()

    # --- tile layout -----------------------------------------------------------------------------
    def side(self, axis: int) -> str:
        if axis in self.schedule.axes:
            return self.window_side
        return "row" if self.window_side == "col" else "col"

    def tile_size_name(self, axis: int) -> str:
        return f"in_{self.names[axis]}"

    def window_vector(self, variable: str) -> str:
        """A window-side [BLOCK] vector as a [BLOCK_R, BLOCK_C]-broadcastable expression."""
        return f"{variable}[None, :]" if self.window_side == "col" else f"{variable}[:, None]"

    def inner_lanes(self, index: int) -> int:
        """Window-side lanes between neighbours along the index-th windowed axis."""
        inner = 1
        for block in self.schedule.config.window_blocks[index + 1:]:
            inner *= block
        return inner

    def tile_coordinates(self) -> dict:
        """Emit the program's coordinates; returns axis -> Coord (window axes over the halo tile)."""
        sched = self.schedule
        window_block, batch_block = ("BLOCK_C", "BLOCK_R") if sched.window_on_cols else ("BLOCK_R", "BLOCK_C")
        batch_vector, batch_mask = ("rows_idx", "row_mask") if sched.window_on_cols else ("cols_idx", "col_mask")
        win_mask = "col_mask" if sched.window_on_cols else "row_mask"
        self.line(f"win_tile = tile_index % {_numel(sched.window_tiles)}")
        self.line(f"batch_tile = tile_index // {_numel(sched.window_tiles)}")
        # the block tiles the merged inner batch axes alone: an arange from a multiple of the
        # block, contiguous as Triton sees it; the outer batch axes are one position a program
        self.line(f"{batch_vector} = (batch_tile % {sched.inner_tiles}) * {batch_block} + tl.arange(0, {batch_block})")
        self.line(f"{batch_mask} = {batch_vector} < inner_batch")
        self.line(f"win = tl.arange(0, {window_block})")
        self.line(f"{'cols_idx' if sched.window_on_cols else 'rows_idx'} = win")
        self.line(f"{win_mask} = win < {window_block}")
        self.line("mask = row_mask[:, None] & col_mask[None, :]")
        coords = {}
        self.line("rest = win_tile")
        for index in reversed(range(len(sched.axes))):
            axis, name = sched.axes[index], self.names[sched.axes[index]]
            tiles, block = sched.window_tiles[index], sched.config.window_blocks[index]
            self.line(f"tile_{name} = rest % {tiles}")
            self.line(f"rest = rest // {tiles}")
            self.line(f"loc_{name} = (win // {self.inner_lanes(index)}) % {block}")
            before = sched.reach[index][0]
            self.line(f"{name}_idx = tile_{name} * {sched.owned[index]} - {before} + loc_{name}")
            self.line(f"{name}_ok = ({name}_idx >= 0) & ({name}_idx < in_{name})")
            coords[axis] = Coord(f"{name}_idx", self.window_side, f"{name}_ok")
        inner, outer = sched.inner_axes, [a for a in sched.batch_axes if a not in sched.inner_axes]
        # every operand walks the inner axes as their innermost one of more than one position
        # (inner_batch_axes: the merged stride is that axis's), which carries the merged index
        sized = [a for a in inner if sched.x_dims[a] > 1] or inner
        for axis in inner:
            value = batch_vector if axis == sized[-1] else f"{batch_vector} * 0"
            self.line(f"{self.names[axis]}_idx = {value}")
        # a vector of one value, so an operand that varies along the outer axes alone still gets
        # a batch-side vector of offsets
        self.line(f"rest = batch_tile // {sched.inner_tiles} + {batch_vector} * 0")
        for position, axis in enumerate(reversed(outer)):
            name = self.names[axis]
            if position == len(outer) - 1:
                self.line(f"{name}_idx = rest")
            else:
                self.line(f"{name}_idx = rest % in_{name}")
                self.line(f"rest = rest // in_{name}")
        for axis in sched.batch_axes:
            coords[axis] = Coord(f"{self.names[axis]}_idx", self.side(axis), None)
        return coords

    def open_tiles(self):
        """`tile_index`, the tile this program works on: its program id, or in the persistent form
        each of the tiles pid, pid + grid, ... walked by a loop whose stages the compiler
        pipelines (the next tile's loads issued as cp.async copies before this tile's math)."""
        sched = self.schedule
        if not sched.persistent:
            self.line("tile_index = tl.program_id(0)" + (".to(tl.int64)" if sched.index_64 else ""))
            return
        self.line(f"for walk in tl.range(tl.program_id(0), {sched.tiles}, {sched.grid}, num_stages={sched.stages}):")
        self.depth += 1
        # widened by promotion: the interpreter's loop variable is a Python int, which has no .to
        self.line("tile_index = walk" + (" + tl.zeros([], tl.int64)" if sched.index_64 else ""))

    def store_mask(self) -> str:
        """Lanes this program owns: inside x and past the halo along every windowed axis."""
        sched, terms = self.schedule, []
        for index, axis in enumerate(sched.axes):
            name, before = self.names[axis], sched.reach[index][0]
            terms.append(f"(loc_{name} >= {before}) & (loc_{name} < {before + sched.owned[index]}) & {name}_ok")
        return " & ".join(terms)

    # --- shifted copies --------------------------------------------------------------------------
    def shift_index(self, index: int, shift: int) -> tuple:
        """(lane variable, validity variable): the window-side lane `shift` positions along the
        index-th windowed axis, its own lane where that leaves the tile (then invalid)."""
        key = (index, shift)
        if key not in self.shift_indices:
            name = self.names[self.schedule.axes[index]]
            tag = f"{name}_{'m' if shift < 0 else 'p'}{abs(shift)}"
            block = self.schedule.config.window_blocks[index]
            self.line(f"nbok_{tag} = (loc_{name} + {shift} >= 0) & (loc_{name} + {shift} < {block})")
            if len(self.schedule.axes) == 1:  # several axes gather a view (gathered_along_axis)
                self.line(f"nb_{tag} = tl.where(nbok_{tag}, win + {shift * self.inner_lanes(index)}, win)")
            self.shift_indices[key] = (f"nb_{tag}", f"nbok_{tag}")
        return self.shift_indices[key]

    def shifted(self, source: str, index: int, shift: int) -> str:
        """An expression of `source` moved so each lane reads the one `shift` positions along
        the index-th windowed axis (zero where that leaves the tile)."""
        if shift == 0:
            return source
        lanes, valid = self.shift_index(index, shift)
        if len(self.schedule.axes) == 1:
            full = f"tl.broadcast_to({self.window_vector(lanes)}, [BLOCK_R, BLOCK_C])"
            return f"tl.where({self.window_vector(valid)}, tl.gather({source}, {full}, {self.gather_axis}), 0.0)"
        return f"tl.where({self.window_vector(valid)}, {self.gathered_along_axis(source, index, shift)}, 0.0)"

    def gathered_along_axis(self, source: str, index: int, shift: int) -> str:
        """`source` shifted along the index-th of several windowed axes, gathered on a view whose
        window side is split into one axis per windowed axis: Triton keeps a gather within a
        warp at a shuffle per register a thread holds along the gathered axis, so the cost is
        that axis's block / 32 (one), not the flattened window side's (16^3 lanes: 128)."""
        blocks = list(self.schedule.config.window_blocks)
        shape = ["BLOCK_R"] + blocks if self.schedule.window_on_cols else blocks + ["BLOCK_C"]
        position = index + 1 if self.schedule.window_on_cols else index
        name = self.names[self.schedule.axes[index]]
        tag = f"{name}_{'m' if shift < 0 else 'p'}{abs(shift)}"
        if ("axis", index, shift) not in self.shift_indices:
            block = blocks[index]
            self.line(f"nbax_{tag} = tl.arange(0, {block})")
            self.line(f"nbax_{tag} = tl.where((nbax_{tag} + {shift} >= 0) & (nbax_{tag} + {shift} < {block}), "
                      f"nbax_{tag} + {shift}, nbax_{tag})")
            self.shift_indices[("axis", index, shift)] = f"nbax_{tag}"
        spread = ", ".join(":" if p == position else "None" for p in range(len(shape)))
        view = f"[{', '.join(map(str, shape))}]"
        lanes = f"tl.broadcast_to(nbax_{tag}[{spread}], {view})"
        gathered = f"tl.gather(tl.reshape({source}, {view}), {lanes}, {position})"
        return f"tl.reshape({gathered}, [BLOCK_R, BLOCK_C])"

    def box_sum(self, source: str, index: int, lo: int, hi: int) -> str:
        """A variable holding, at each lane, the sum of `source` over offsets lo..hi along the
        index-th windowed axis (box_plan's doublings and pieces)."""
        plan = box_plan(lo, hi)
        powers = [source]
        for level, sign in enumerate(plan.doublings):
            variable = f"bx_{next(self.serial)}"
            self.line(f"{variable} = {powers[-1]} + {self.shifted(powers[-1], index, sign * (1 << level))}")
            powers.append(variable)
        if len(plan.pieces) == 1 and plan.pieces[0][1] == 0:
            return powers[plan.pieces[0][0]]
        total = f"bx_{next(self.serial)}"
        for position, (exponent, shift) in enumerate(plan.pieces):
            term = self.shifted(powers[exponent], index, shift)
            self.line(f"{total} = {term}" if position == 0 else f"{total} += {term}")
        return total

    def window_sum(self, source: str, reversed_window: bool) -> str:
        """The sum of `source` over each lane's window along every windowed axis (separable);
        reversed: over the centres whose window holds the lane."""
        before, after = self.attrs.size // 2, (self.attrs.size - 1) // 2
        lo, hi = (-after, before) if reversed_window else (-before, after)
        for index in range(len(self.schedule.axes)):
            source = self.box_sum(source, index, lo, hi)
        return source

    # --- window sums by a load per offset (heuristics' LOADS_MAX_POINTS) -------------------------
    def offset_coordinates(self, tile: dict, offsets) -> dict:
        """The tile's coordinates moved by `offsets` along the windowed axes (emitted once each)."""
        coords = dict(tile)
        for axis, offset in zip(self.schedule.axes, offsets):
            if offset == 0:
                continue
            name = self.names[axis]
            tag = f"{'m' if offset < 0 else 'p'}{abs(offset)}"
            if (axis, offset) not in self.offsets_made:
                self.offsets_made.add((axis, offset))
                self.line(f"{name}_at_{tag} = {name}_idx + {offset}")
                self.line(f"{name}_ok_{tag} = ({name}_at_{tag} >= 0) & ({name}_at_{tag} < in_{name})")
            coords[axis] = Coord(f"{name}_at_{tag}", self.window_side, f"{name}_ok_{tag}")
        return coords

    def loaded_window_sum(self, tile: dict) -> str:
        """The sum of squares over each lane's window, x loaded (with its prologue and means) at
        every window offset: neighbours' loads of the same lines hit L1. The tile owns every lane."""
        before, after = self.attrs.size // 2, (self.attrs.size - 1) // 2
        total = f"bx_{next(self.serial)}"
        offsets_all = itertools.product(range(-before, after + 1), repeat=len(self.schedule.axes))
        for position, offsets in enumerate(offsets_all):
            term = "sq_x"
            if any(offsets):
                coords = self.offset_coordinates(tile, offsets)
                self.value_at(self.x, coords, "value")
                centred = "value"
                if self.means is not None:
                    self.value_at(self.means, coords, "mv_x")
                    centred = "value - mv_x"
                term = f"sq_{next(self.serial)}"
                self.line(f"{term} = tl.where({self.inside(coords)}, {centred}, 0.0)")
                self.line(f"{term} = {term} * {term}")
            self.line(f"{total} = {term}" if position == 0 else f"{total} += {term}")
        return total

    # --- the two directions ----------------------------------------------------------------------
    def literal(self, value) -> str:
        return self.emitter.literal(float(value))

    def centred(self, tile: dict):
        """`cv_x`: x - means over the tile, 0 outside x; `sq_x` its square."""
        self.value_at(self.x, tile, "value")
        centred = "value"
        if self.means is not None:
            self.value_at(self.means, tile, "mv_x")
            centred = "value - mv_x"
        self.line(f"cv_x = tl.where({self.inside(tile)}, {centred}, 0.0)")
        self.line("sq_x = cv_x * cv_x")

    def scale(self, tile: dict):
        """`sc_x` and `gn_x`: S and S^-beta at every lane whose window the tile holds."""
        if self.schedule.config.window_by == "loads":
            total = self.loaded_window_sum(tile)
        else:
            total = self.window_sum("sq_x", reversed_window=False)
        a = self.literal(self.attrs.alpha / self.count)
        self.line(f"sc_x = {self.literal(self.attrs.k)} + {a} * {total}")
        if self.attrs.beta == 0.0:  # S^0 is 1, even where S is 0 or inf
            self.line(f"gn_x = tl.full([BLOCK_R, BLOCK_C], 1.0, {self.compute})")
        else:
            self.line(f"gn_x = tl.exp2({self.literal(-self.attrs.beta)} * tl.log2(sc_x))")

    def forward(self, tile: dict):
        self.centred(tile)
        self.scale(tile)
        self.line("result = cv_x * gn_x")

    def backward(self, tile: dict):
        """dx = dy S^-beta - 2 beta alpha / count * c * (reversed window sum of dy c S^-beta / S)."""
        self.centred(tile)
        self.value_at(self.dy, tile, "grad")
        if self.attrs.beta == 0.0:
            # y = c: the scale's gradient is an exact 0 (torch's pow backward gives a zero exponent
            # zeros, where the formula would make 0 * inf a NaN for an infinite dy), which reaches
            # c through dS/dc = 2 alpha / count * c: dx = dy + 0 * c, NaN where c is not finite
            self.line("result = grad + 0.0 * cv_x")
            return
        self.scale(tile)
        inside = self.inside(tile)
        self.line(f"dv_x = tl.where({inside}, grad, 0.0)")
        # masked: a centre outside x adds nothing, whatever its S (0 / 0 where k is 0)
        self.line(f"uv_x = tl.where({inside}, dv_x * cv_x * gn_x / sc_x, 0.0)")
        covering = self.window_sum("uv_x", reversed_window=True)
        factor = self.literal(2.0 * self.attrs.beta * self.attrs.alpha / self.count)
        self.line(f"result = dv_x * gn_x - {factor} * cv_x * {covering}")

    def narrow_mask_to_owned(self):
        """Stores (and the epilogue's loads) only where this program owns the lane."""
        self.line(f"store_mask = {self.store_mask()}")
        self.line(f"mask = mask & {self.window_vector('store_mask')}")

    # --- signature -------------------------------------------------------------------------------
    def arguments(self) -> list:
        sched = self.schedule
        args = [KernelArgument("tensor", f"{op.identifier}_ptr", uid) for uid, op in self.operands.items()]
        sizes = {"inner_batch": sched.inner}
        outer = [a for a in sched.batch_axes if a not in sched.inner_axes]
        for axis in sorted(set(outer[1:]) | set(sched.axes)):
            sizes[self.tile_size_name(axis)] = sched.x_dims[axis]
        args += [KernelArgument("int", name, value) for name, value in sizes.items()]
        for op in self.operands.values():
            args += [KernelArgument("int", f"{op.identifier}_stride_{self.names[a]}", s)
                     for a, s in enumerate(op.strides) if s]
        window, batch = _numel(sched.config.window_blocks), sched.config.batch_block
        rows, cols = (batch, window) if sched.window_on_cols else (window, batch)
        args += [KernelArgument("constexpr", "BLOCK_R", rows), KernelArgument("constexpr", "BLOCK_C", cols)]
        return args


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def render(kernel_name: str, schedule, group, compute_type, description: str) -> KernelSource:
    """The KernelSource of the kernel running a windowed normalization group under `schedule`."""
    writer = _WindowWriter(kernel_name, schedule, group, compute_type)
    writer.open_tiles()
    tile = writer.tile_coordinates()
    if schedule.backward:
        writer.backward(tile)
    else:
        writer.forward(tile)
    writer.narrow_mask_to_owned()
    writer.epilogue_and_stores(tile)
    args = writer.arguments()
    return KernelSource(kernel_name, pooling.kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                           "\n".join(writer.body) + "\n"), args)
