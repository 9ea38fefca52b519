"""Render a windowed normalization (LRN, divisive normalization) as one Triton kernel.

Pooling's kernel writer lays out the tile (its columns walk x's smallest-stride axis), loads
operands with their prologues and writes the epilogue and stores; this module adds the window.
Each program owns a [BLOCK_R, BLOCK_C] tile of y (or dx) and loads x, shifted by every offset
the window needs, as tiles: one straight-line variable per offset, so the sums of overlapping
windows share their loads and squares (the backward needs the window sums of every element
whose window holds the centre), and window sums are separable (one axis at a time), so they
share their partial sums too. Positions outside x are zeros, after any prologue, as torch
pads. The formulas are those of ops/lrn.py; S^-beta is exp2(-beta * log2(S)).

A backward whose straight-line body would pass BODY_TERMS_MAX additions (a 5x5 divisive window
makes 350, LRN size 64 4096: tens of seconds to minutes of sm_90 compile, most of it in Triton's
coalescing pass, whose cost grows with loads times operations) walks the covering centres of
its last windowed axes in runtime loops: the body computes the centres along the other axes
with the shared partial sums, its offsets along the rolled axes taken from the loop variables.
"""
from __future__ import annotations

import itertools

from ....ops.lrn import window_count
from ...contract import KernelSource
from .pointwise import KernelArgument
from . import pooling
from .pooling import Coord, _KernelWriter

# Stems of the values the window writes: centred x (cv), its square (sq), partial window sums
# (ps), the scale S (sc), the gain S^-beta (gn), dy (dv) and the loaded means (mv), each followed
# by an offset tag; in a rolled body the tags start with "r" (offsets from the loop's centre).
VALUE_STEMS = ("cv", "sq", "ps", "sc", "gn", "dv", "mv")
# Additions of window sums one straight-line backward body may hold. The cost of Triton's
# coalescing pass grows with loads times operations: 350 additions (a 5x5 divisive window) took
# 22 s to compile for sm_90 on a shared CPU, 70 take about a second. A runtime loop reloads the
# squares its centres share with the neighbouring iterations (L1 hits: the tile's rows are
# neighbours along the window), so the window unrolls whole wherever it fits.
BODY_TERMS_MAX = 256


def body_terms(size: int, windowed: int, rolled: int) -> int:
    """Additions of the window sums in the backward's body when the covering centres of the last
    `rolled` of `windowed` axes are walked by runtime loops (mirrors partial_sum: the distinct
    (level, point) pairs it visits, `size` additions each)."""
    before, after = size // 2, (size - 1) // 2
    fixed = windowed - rolled  # axes whose covering centres the body unrolls
    centres = itertools.product(*([range(-after, before + 1)] * fixed + [range(0, 1)] * rolled))
    points, terms = {tuple(c) for c in centres}, 0
    for axis in range(windowed):  # level `axis` sums along it, at the points the level above needs
        terms += size * len(points)
        points = {p[:axis] + (p[axis] + w,) + p[axis + 1:] for p in points for w in range(-before, after + 1)}
    return terms


def rolled_axes(size: int, windowed: int) -> int:
    """How many trailing windowed axes the backward walks in runtime loops: the fewest that keep
    its body within BODY_TERMS_MAX (all of them where even one centre's window does not fit)."""
    for rolled in range(windowed + 1):
        if body_terms(size, windowed, rolled) <= BODY_TERMS_MAX:
            return rolled
    return windowed


def offset_tag(offsets) -> str:
    """An identifier part naming an offset per windowed axis: (-2, 1) -> "m2_p1"."""
    return "_".join(f"m{-o}" if o < 0 else f"p{o}" for o in offsets)


class _WindowWriter(_KernelWriter):
    """Pooling's writer with the window of a windowed normalization."""

    def __init__(self, kernel_name, schedule, group, compute_type):
        super().__init__(kernel_name, schedule, group, compute_type)
        self.allocator.reserve_stems(*VALUE_STEMS)
        anchor = group.anchor
        first = 1 if schedule.backward else 0  # x's position among the anchor's inputs
        self.x = anchor.inputs[first]
        self.means = anchor.inputs[first + 1] if len(anchor.inputs) > first + 1 else None
        self.dy = anchor.inputs[0] if schedule.backward else None
        self.attrs = anchor.attrs
        forward_op = anchor.op[:-len("_backward")] if schedule.backward else anchor.op
        self.count = window_count(forward_op, self.rank, self.attrs)
        self.shifts_made: set = set()
        self.values_made: set = set()
        self.loop_centre: dict = {}  # windowed axis -> the runtime loop variable of a rolled body

    def tag(self, offsets) -> str:
        """The identifier part of a value at `offsets`: from the tile, or in a rolled body from
        the loops' centre (another value of the same offsets)."""
        return ("r" if self.loop_centre else "") + offset_tag(offsets)

    def tile_size_name(self, axis: int) -> str:
        return f"in_{self.names[axis]}"

    def literal(self, value) -> str:
        return self.emitter.literal(float(value))

    # --- coordinates ---------------------------------------------------------------------------
    def shifted(self, tile: dict, offsets) -> dict:
        """The tile's coordinates moved by `offsets` along the windowed axes (emitted once each)."""
        coords = dict(tile)
        for axis, offset in zip(self.schedule.axes, offsets):
            centre = self.loop_centre.get(axis)
            if offset == 0 and centre is None:
                continue
            name, tag = self.names[axis], self.tag((offset,))
            if (axis, offset) not in self.shifts_made:
                self.shifts_made.add((axis, offset))
                moved = f"{name}_idx + {offset}" if centre is None else f"{name}_idx + {centre} + {offset}"
                self.line(f"{name}_at_{tag} = {moved}")
                self.line(f"{name}_ok_{tag} = ({name}_at_{tag} >= 0) & ({name}_at_{tag} < in_{name})")
            coords[axis] = Coord(f"{name}_at_{tag}", self.side(axis), f"{name}_ok_{tag}")
        return coords

    # --- values at an offset -------------------------------------------------------------------
    def centred(self, tile: dict, offsets) -> str:
        """`cv_<tag>`: x - means at the offset, 0 outside x."""
        variable = f"cv_{self.tag(offsets)}"
        if variable not in self.values_made:
            self.values_made.add(variable)
            coords = self.shifted(tile, offsets)
            self.value_at(self.x, coords, "value")
            centred = "value"
            if self.means is not None:
                self.value_at(self.means, coords, "mv")
                centred = "value - mv"
            self.line(f"{variable} = tl.where({self.inside(coords)}, {centred}, 0.0)")
        return variable

    def square(self, tile: dict, offsets) -> str:
        variable = f"sq_{self.tag(offsets)}"
        if variable not in self.values_made:
            centred = self.centred(tile, offsets)
            self.values_made.add(variable)
            self.line(f"{variable} = {centred} * {centred}")
        return variable

    def partial_sum(self, tile: dict, axis_index: int, point) -> str:
        """`ps_<j>_<tag>`: the sum of squares at `point` over the window along the windowed axes
        from the j-th on (the j-th through the last), zeros outside x. The window is a box, so
        its sum is separable: each level sums `size` values of the next along one axis, and the
        overlapping windows of a backward share the partial sums of their common rows."""
        if axis_index == len(self.schedule.axes):
            return self.square(tile, point)
        variable = f"ps_{axis_index}_{self.tag(point)}"
        if variable not in self.values_made:
            before, after = self.attrs.size // 2, (self.attrs.size - 1) // 2
            parts = [self.partial_sum(tile, axis_index + 1, point[:axis_index] + (point[axis_index] + w,)
                                      + point[axis_index + 1:]) for w in range(-before, after + 1)]
            self.values_made.add(variable)
            # statements, not one long sum: a deep expression tree would strain Triton's AST walk
            self.line(f"{variable} = {parts[0]}")
            for part in parts[1:]:
                self.line(f"{variable} += {part}")
        return variable

    def scale(self, tile: dict, centre) -> tuple[str, str]:
        """(`sc_<tag>`, `gn_<tag>`): S and S^-beta of the element at offset `centre`."""
        tag = self.tag(centre)
        total = self.partial_sum(tile, 0, tuple(centre))
        a = self.literal(self.attrs.alpha / self.count)
        self.line(f"sc_{tag} = {self.literal(self.attrs.k)} + {a} * {total}")
        if self.attrs.beta == 0.0:  # S^0 is 1, even where S is 0 or inf
            self.line(f"gn_{tag} = tl.full([BLOCK_R, BLOCK_C], 1.0, {self.compute})")
        else:
            self.line(f"gn_{tag} = tl.exp2({self.literal(-self.attrs.beta)} * tl.log2(sc_{tag}))")
        return f"sc_{tag}", f"gn_{tag}"

    # --- the two directions ----------------------------------------------------------------------
    def forward(self, tile: dict):
        centre = (0,) * len(self.schedule.axes)
        _, gain = self.scale(tile, centre)
        self.line(f"result = {self.centred(tile, centre)} * {gain}")

    def backward(self, tile: dict):
        """dx_m = dy_m S_m^-beta - 2 beta alpha / count * c_m * sum over covering i of
        dy_i c_i S_i^-beta / S_i (i covers m when m is in i's window)."""
        if self.attrs.beta == 0.0:
            # y = c: the scale's gradient is an exact 0 (torch's pow backward gives a zero exponent
            # zeros, where the formula would make 0 * inf a NaN for an infinite dy), which reaches
            # c through dS/dc = 2 alpha / count * c: dx = dy + 0 * c, NaN where c is not finite
            centred = self.centred(tile, (0,) * len(self.schedule.axes))
            self.value_at(self.dy, tile, "grad")
            self.line(f"result = grad + 0.0 * {centred}")
            return
        axes = self.schedule.axes
        before, after = self.attrs.size // 2, (self.attrs.size - 1) // 2
        rolled = rolled_axes(self.attrs.size, len(axes))
        fixed = len(axes) - rolled
        centre = (0,) * len(axes)
        self.line(f"acc = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
        if rolled:  # the element's own dy and S^-beta, kept from the iteration centred on it
            self.line(f"dv_here = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
            self.line(f"gn_here = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
        for axis in axes[fixed:]:  # the rolled axes' covering centres, outermost first
            self.loop_centre[axis] = f"{self.names[axis]}_roll"
            self.open_loop(self.loop_centre[axis], f"{-after}, {before + 1}", unrolled=False)
        self.shifts_made, self.values_made = set(), set()  # a body's values live in the body
        for offsets in itertools.product(*[range(-after, before + 1)] * fixed + [range(0, 1)] * rolled):
            self.covering_term(tile, offsets)
        if rolled:
            here = " & ".join(f"({variable} == 0)" for variable in self.loop_centre.values())
            tag = self.tag(centre)
            self.line(f"dv_here = tl.where({here}, dv_{tag}, dv_here)")
            self.line(f"gn_here = tl.where({here}, gn_{tag}, gn_here)")
            self.close_loops(rolled)
            self.loop_centre.clear()
            self.shifts_made, self.values_made = set(), set()
            dv, gn = "dv_here", "gn_here"
        else:
            dv, gn = f"dv_{self.tag(centre)}", f"gn_{self.tag(centre)}"
        factor = self.literal(2.0 * self.attrs.beta * self.attrs.alpha / self.count)
        self.line(f"result = {dv} * {gn} - {factor} * {self.centred(tile, centre)} * acc")

    def covering_term(self, tile: dict, offsets):
        """acc += dy_i c_i S_i^-beta / S_i of the covering element at `offsets`."""
        tag = self.tag(offsets)
        scale, gain = self.scale(tile, offsets)
        coords = self.shifted(tile, offsets)
        self.value_at(self.dy, coords, "grad")
        inside = self.inside(coords)
        self.line(f"dv_{tag} = tl.where({inside}, grad, 0.0)")
        # masked: a covering element outside x adds nothing, whatever its S (0 / 0 where k is 0)
        self.line(f"acc += tl.where({inside}, dv_{tag} * {self.centred(tile, offsets)} * {gain} / {scale}, 0.0)")

    # --- signature -------------------------------------------------------------------------------
    def arguments(self) -> list:
        sched = self.schedule
        args = [KernelArgument("tensor", f"{op.identifier}_ptr", uid) for uid, op in self.operands.items()]
        sizes = {"rows": sched.rows, "cols": sched.cols}
        for axis in sorted(set(sched.row_axes[1:]) | set(sched.axes)):
            sizes[self.tile_size_name(axis)] = sched.x_dims[axis]
        args += [KernelArgument("int", name, value) for name, value in sizes.items()]
        for op in self.operands.values():
            args += [KernelArgument("int", f"{op.identifier}_stride_{self.names[a]}", s)
                     for a, s in enumerate(op.strides) if s]
        args += [KernelArgument("constexpr", "BLOCK_R", sched.config.block_rows),
                 KernelArgument("constexpr", "BLOCK_C", sched.config.block_cols)]
        return args


def render(kernel_name: str, schedule, group, compute_type, description: str) -> KernelSource:
    """The KernelSource of the kernel running a windowed normalization group under `schedule`:
    pooling's render with this module's writer."""
    return pooling.render(kernel_name, schedule, group, compute_type, description, writer_class=_WindowWriter)
