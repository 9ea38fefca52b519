"""Render a pooling schedule as one Triton kernel (forward or backward, 1D/2D/3D windows).

Forward: each program owns a [BLOCK_R, BLOCK_C] tile of y and walks the window with unrolled
loads of x; the prologue is applied at load, padding never wins a max and adds nothing to a sum.
Backward is a gather, so it needs no atomics and is deterministic: each program owns a tile of
dx and, for each of the few windows covering an element, adds dy / count (average) or dy where
the window's argmax is that element: recomputed from x (first maximum in window order, as
torch), or read from the forward's indices where the graph gives them (one int64 load and
compare per covering window instead of a window of x loads). A max forward asked for indices
tracks that same argmax as torch's flat index in the input plane.
With a stride above 1 (heuristics' owned_block), each tile position owns a stride-sized block of
dx: the windows covering the block are visited once for all its positions, their dy, index,
divisor or recomputed argmax (an int32 tap number within the window) shared by the block, one
accumulator and one store per owned position. A gather per element visited each covering
window once per element it covers (the recompute: 36 window loads and compares per dx element
for 3x3 stride 2, 176 registers a thread on sm_90: the 3% of copy bandwidth it measured).
Tile columns walk the schedule's vector axis; every other axis is a row coordinate.

Where the vector axis is a strided spatial one (NCHW's width at stride 2, 4 or 8), a forward
loads each window row as contiguous segments of stride x BLOCK_C elements and splits them into
their taps in registers (segmented_window): vector loads instead of a lane-strided scalar load
per tap. The recompute backward finds each window's argmax once a program where it can
(shared_argmax_backward): the windows of the tile's own blocks in one pass over the x elements
they cover, those further back along the shift axis from the neighbouring tile position
(tl.gather), recomputed only where that neighbour is in another program.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ....errors import UnsupportedError
from ....fusion import FusionGroup
from ..heuristics.layout import operand_strides
from ..heuristics.pooling import AXIS_NAMES
from .emitter import ExpressionEmitter, blends_of, kind_of
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, blend_arguments, kernel_module
from .unrolling import UNROLLED_BODIES_MAX, loop_header, unrolled_loops

INDENT = "    "
# identifiers the pooling kernel writes itself; the stems own every `stem_*` name too (each
# axis letter: h_idx, h_start, ...; in_h, out_h, WINDOW_H, ...)
FIXED_NAMES = ("pid", "col_tiles", "rows_idx", "cols_idx", "row_mask", "col_mask", "mask", "rest",
               "rows", "cols", "batch", "channels", "acc", "value", "result", "grad", "best", "hit",
               "better", "inside", "covered", "argmax", "here", "share", "tile_mask", "tap", "BLOCK_R", "BLOCK_C")
FIXED_STEMS = ("in", "out", "own", "WINDOW", "STRIDE", "PAD", "COVER", "acc", "here", "seg", "tap", "best",
               "lane", "halo", "gathered", "from")


@dataclass(frozen=True)
class Coord:
    """One logical axis's index vector at some point of the kernel."""

    variable: str
    side: str  # "row": a [BLOCK_R] vector, "col": a [BLOCK_C] vector, "seg": a row segment's columns
    valid: Optional[str]  # predicate on the same side; None where always in range


@dataclass(frozen=True)
class Operand:
    identifier: str  # its name in generated source (from the kernel's allocator)
    strides: tuple  # over the logical axes; 0 where the operand broadcasts


def _tag(offsets) -> str:
    """The suffix naming the owned position at `offsets` (acc_0_1, h_pos_0_1, ...)."""
    return "".join(f"_{r}" for r in offsets)


def _outer(row_terms, col_terms, joiner: str = " & ") -> str:
    """A [BLOCK_R, BLOCK_C]-broadcastable expression joining per-row and per-column terms."""
    parts = []
    if row_terms:
        parts.append(f"({joiner.join(row_terms)})[:, None]")
    if col_terms:
        parts.append(f"({joiner.join(col_terms)})[None, :]")
    return joiner.join(parts)


def prologue_values_to_store(group):
    """A pointwise group writing the prologue values that are graph outputs, or None.

    The pooling kernel cannot store them: its loads visit some x positions several times and,
    when the stride exceeds the window, others never.
    """
    members = set(group.prologue)
    outputs = [t for t in group.outputs if t.producer in members]
    if not outputs:
        return None
    inputs = {}
    for node in group.prologue:
        for tensor in node.input_tensors():
            if tensor.producer not in members:
                inputs.setdefault(tensor.uid, tensor)
    return FusionGroup("pointwise", None, list(group.prologue), inputs=list(inputs.values()),
                       outputs=outputs)


class _KernelWriter:
    """Collects the body of one pooling kernel; one method per part of it."""

    def __init__(self, kernel_name, schedule, group, compute_type):
        self.schedule, self.group = schedule, group
        self.anchor = group.anchor
        self.rank = len(schedule.x_dims)
        self.names = AXIS_NAMES[self.rank]
        self.spatial = range(2, self.rank)
        self.compute = compute_type.triton_type
        loop_names = [f"{loop}{self.names[a]}" for a in self.spatial for loop in "kj"]
        self.allocator = NameAllocator(FIXED_NAMES + tuple(loop_names) + (kernel_name,))
        self.allocator.reserve_stems(*(FIXED_STEMS + self.names))
        self.emitter = ExpressionEmitter(self.compute, names=self.allocator, blends=blends_of(group.outputs))
        prologue = set(group.prologue)
        self.outputs = [t for t in group.outputs if t.producer not in prologue]
        # a max forward's argmax indices, where the graph asks for them
        outputs = self.anchor.outputs
        self.indices = outputs[1] if self.anchor.op == "pooling" and len(outputs) > 1 else None
        # operands are named by whether they are read or written, never by their tensor's name;
        # x is no operand of a max backward that reads the forward's indices and nothing else of x
        read = [t for t in group.inputs if t.uid in schedule.read_uids]
        roles = [(t, "x") for t in read] + [(t, "y") for t in self.outputs]
        self.operands = {t.uid: Operand(self.allocator.prefix(hint),
                                        operand_strides(schedule.x_dims, t.dim, t.stride))
                         for t, hint in roles}
        self.input_uids = {t.uid for t in read}
        # a [BLOCK_R, BLOCK_C] predicate every load also needs, where set (shared_argmax's halo)
        self.load_guard: Optional[str] = None
        self.body: list[str] = []
        self.depth = 1

    # --- text ------------------------------------------------------------------------------------
    def line(self, text: str):
        self.body.append(INDENT * self.depth + text)

    def open_loop(self, variable: str, count: str, unrolled: bool):
        self.line(loop_header(variable, count, unrolled))
        self.depth += 1

    def close_loops(self, count: int):
        self.depth -= count

    def side(self, axis: int) -> str:
        return "col" if axis == self.schedule.vector_axis else "row"

    def by_side(self, pairs):
        """(row terms, col terms) of (axis, expression) pairs."""
        rows = [text for axis, text in pairs if self.side(axis) == "row"]
        cols = [text for axis, text in pairs if self.side(axis) == "col"]
        return rows, cols

    def inside(self, coords) -> str:
        """The tile mask narrowed to coordinates that are in range."""
        valid = [(axis, c.valid) for axis, c in coords.items() if c.valid]
        narrowed = _outer(*self.by_side(valid))
        return f"mask & {narrowed}" if narrowed else "mask"

    # --- the tile --------------------------------------------------------------------------------
    def tile_coordinates(self) -> dict:
        """Emit the program's row and column indices; returns axis -> Coord of the tile."""
        self.line("pid = tl.program_id(0)" + (".to(tl.int64)" if self.schedule.index_64 else ""))
        self.line("col_tiles = tl.cdiv(cols, BLOCK_C)")
        self.line("rows_idx = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)")
        self.line("cols_idx = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)")
        self.line("row_mask = rows_idx < rows")
        self.line("col_mask = cols_idx < cols")
        self.line("mask = row_mask[:, None] & col_mask[None, :]")
        self.line(f"{self.names[self.schedule.vector_axis]}_idx = cols_idx")
        row_axes = self.schedule.row_axes
        self.line("rest = rows_idx")
        for axis in reversed(row_axes[1:]):
            self.line(f"{self.names[axis]}_idx = rest % {self.tile_size_name(axis)}")
            self.line(f"rest = rest // {self.tile_size_name(axis)}")
        self.line(f"{self.names[row_axes[0]]}_idx = rest")
        return {axis: Coord(f"{self.names[axis]}_idx", self.side(axis), None) for axis in range(self.rank)}

    def tile_size_name(self, axis: int) -> str:
        if axis < 2:
            return ("batch", "channels")[axis]
        if getattr(self.schedule, "owned", ()):
            return f"own_{self.names[axis]}"
        return f"{'in' if self.schedule.backward else 'out'}_{self.names[axis]}"

    # --- operands --------------------------------------------------------------------------------
    def pointer(self, operand: Operand, coords: dict, full: bool = False):
        """Emit the operand's row and column offsets at `coords`; returns (pointer, mask or None).
        full=True gives a whole [BLOCK_R, BLOCK_C] tile even where it broadcasts (stores)."""
        # a row segment's columns run past the tile's own (col_mask's): its validity bounds them
        segment = any(coord.side == "seg" for coord in coords.values())
        rows, cols, row_ok, col_ok = [], [], ["row_mask"], [] if segment else ["col_mask"]
        for axis, coord in coords.items():
            if not operand.strides[axis]:
                continue
            term = f"{coord.variable} * {operand.identifier}_stride_{self.names[axis]}"
            row = self.side(axis) == "row"
            (rows if row else cols).append(term)
            if coord.valid:
                (row_ok if row else col_ok).append(coord.valid)
        if full:
            rows, cols = rows or ["rows_idx * 0"], cols or ["cols_idx * 0"]
        ident = operand.identifier
        pointer = f"{ident}_ptr"
        if rows:
            self.line(f"{ident}_row = {' + '.join(rows)}")
            pointer += f" + {ident}_row[:, None]"
        if cols:  # a segment's columns named apart: a rolled loop may load both (one type a name)
            column = f"{ident}_segcol" if segment else f"{ident}_col"
            self.line(f"{column} = {' + '.join(cols)}")
            pointer += f" + {column}[None, :]"
        return pointer, _outer(row_ok if rows else [], col_ok if cols else []) or None

    def load(self, tensor, coords: dict):
        """Emit the load of a group input at `coords` and bind it in the emitter."""
        if tensor.uid not in self.input_uids:
            raise UnsupportedError(f"node {self.anchor.name!r} ({self.anchor.op}): fused value "
                                   f"{tensor.name!r} is needed where the kernel cannot compute it")
        operand = self.operands[tensor.uid]
        guard = self.load_guard
        pointer, mask = self.pointer(operand, coords, full=guard is not None)
        if guard is not None:
            mask = f"({mask}) & {guard}" if mask else guard
        load = f"tl.load({pointer}, mask={mask})" if mask else f"tl.load({pointer})"
        segment = any(coord.side == "seg" for coord in coords.values())
        variable = f"{operand.identifier}_{'segval' if segment else 'val'}"
        self.line(f"{variable} = {self.emitter.loaded(load, tensor.data_type)}")
        self.emitter.bind(tensor.uid, variable, kind_of(tensor.data_type))

    def emit(self, node):
        start = len(self.emitter.lines)
        self.emitter.emit(node)
        for text in self.emitter.lines[start:]:
            self.line(text)

    def prologue_chain(self, tensor) -> list:
        """The prologue nodes `tensor` depends on, in order (empty for a group input)."""
        needed, chain = {tensor.uid}, []
        for node in reversed(self.group.prologue):
            if any(t.uid in needed for t in node.output_tensors()):
                chain.append(node)
                needed.update(t.uid for t in node.input_tensors())
        return chain[::-1]

    def chain_sources(self, tensor) -> tuple:
        """(prologue chain, group inputs it reads) of the value `tensor`."""
        chain = self.prologue_chain(tensor)
        made = {t.uid for node in chain for t in node.output_tensors()}
        sources = [t for node in chain for t in node.input_tensors()] if chain else [tensor]
        unique = {t.uid: t for t in sources if t.uid not in made}
        return chain, list(unique.values())

    def hoist_loads(self, tensor, tile: dict) -> set:
        """Load before the window loops the sources of `tensor` that do not vary over space
        (a per-channel bias), so the unrolled window does not reload them; returns their uids."""
        _, sources = self.chain_sources(tensor)
        return self.load_invariant(sources, tile)

    def load_invariant(self, tensors, tile: dict) -> set:
        """Load at `tile` those of `tensors` that do not vary over space, once; returns their uids."""
        hoisted = set()
        for source in tensors:
            operand = self.operands.get(source.uid)
            if operand is not None and not any(operand.strides[a] for a in self.spatial):
                self.load(source, tile)
                hoisted.add(source.uid)
        return hoisted

    def value_at(self, tensor, coords: dict, variable: str, hoisted=frozenset()):
        """Emit `variable` = the value of `tensor` at `coords`: a load, or loads and its prologue."""
        chain, sources = self.chain_sources(tensor)
        for source in sources:
            if source.uid not in hoisted:
                self.load(source, coords)
        for node in chain:
            self.emit(node)
        self.line(f"{variable} = {self.emitter.value(tensor.uid, 'f')}")

    # --- windows ---------------------------------------------------------------------------------
    def window_extents(self) -> list:
        return [self.schedule.window[axis - 2] for axis in self.spatial]

    def cover_extents(self) -> list:
        """Per spatial axis, the most windows that cover one element (the COVER_ constants)."""
        return [-(-self.schedule.window[axis - 2] // self.schedule.stride[axis - 2]) for axis in self.spatial]

    def open_window(self, base: dict, unrolled, axes=None) -> dict:
        """Open one loop per spatial axis (of `axes`, all by default) over the window starting at
        `{axis}_start` (unrolled where `unrolled` says, per axis); returns the coordinates of the
        current window element."""
        window = dict(base)
        for axis, unroll in zip(self.spatial if axes is None else axes, unrolled):
            name, upper = self.names[axis], self.names[axis].upper()
            self.open_loop(f"k{name}", f"WINDOW_{upper}", unroll)
            self.line(f"{name}_in = {name}_start + k{name}")
            self.line(f"{name}_ok = ({name}_in >= 0) & ({name}_in < in_{name})")
            window[axis] = Coord(f"{name}_in", self.side(axis), f"{name}_ok")
        self.line(f"inside = {self.inside(window)}")
        return window

    def window_count(self) -> str:
        """Elements of the window starting at `{axis}_start` that lie inside x."""
        return self._counted("tl.minimum({start} + WINDOW_{upper}, in_{name}) - tl.maximum({start}, 0)")

    def padded_window_count(self) -> str:
        """Elements of the window starting at `{axis}_start` inside the padded input: the whole
        window, except a ceil-mode last window running past the padding."""
        return self._counted("tl.minimum({start} + WINDOW_{upper}, in_{name} + PAD_{upper}) - {start}")

    def _counted(self, extent: str) -> str:
        """The product over the spatial axes of `extent` (a format of start, name and upper),
        each at least 1: lanes past the tile's end would divide by zero (masked, but noisy)."""
        counts = []
        for axis in self.spatial:
            name, upper = self.names[axis], self.names[axis].upper()
            counts.append((axis, f"{name}_count"))
            self.line(f"{name}_count = tl.maximum({extent.format(start=f'{name}_start', name=name, upper=upper)}, 1)")
        return f"({_outer(*self.by_side(counts), joiner=' * ')}).to({self.compute})"

    def divisor(self) -> str:
        if self.schedule.divisor is not None:  # a validated int: a literal
            return f"{float(self.schedule.divisor)!r}"
        if self.schedule.mode == "avg_include_pad":
            if self.schedule.ceil_mode:
                return self.padded_window_count()
            return "(" + " * ".join(f"WINDOW_{self.names[a].upper()}" for a in self.spatial) + ")"
        return self.window_count()

    def x_tensor(self):
        return self.anchor.inputs[1] if self.schedule.backward else self.anchor.inputs[0]

    def forward(self, tile: dict):
        for axis in self.spatial:
            name = self.names[axis]
            self.line(f"{name}_start = {name}_idx * STRIDE_{name.upper()} - PAD_{name.upper()}")
        is_max = self.schedule.mode == "max"
        if is_max:
            self.line(f"acc = tl.full([BLOCK_R, BLOCK_C], float('-inf'), {self.compute})")
            if self.indices is not None:  # torch's start: the window's first in-range element
                for axis in self.spatial:
                    name = self.names[axis]
                    self.line(f"{name}_first = tl.maximum({name}_start, 0)")
                self.line(f"argmax = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int64) + {self.plane_index('first')}")
        else:
            self.line(f"acc = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
        hoisted = self.hoist_loads(self.x_tensor(), tile)
        if self.schedule.segment_stride:
            self.segmented_window(tile, hoisted, is_max)
        else:
            window = self.open_window(tile, unrolled_loops(self.window_extents()))
            self.value_at(self.x_tensor(), window, "value", hoisted)
            self.accumulate(is_max)
            self.close_loops(len(self.spatial))
        self.line("result = acc" if is_max else f"result = acc / {self.divisor()}")

    def accumulate(self, is_max: bool):
        """Emit the forward's step over one window element: `value`, where `inside` holds."""
        if is_max:  # a NaN always takes over, as in torch's max_pool
            # NaN wins; tl.where keeps a hoisted (0-d) value's test from a bool 0-d | 2-d, which
            # the interpreter cannot do
            self.line("better = inside & tl.where(value != value, True, value > acc)")
            self.line("acc = tl.where(better, value, acc)")
            if self.indices is not None:
                self.line(f"argmax = tl.where(better, {self.plane_index('in')}, argmax)")
        else:
            self.line("acc += tl.where(inside, value, 0.0)")

    def segment_groups(self, shifts) -> list:
        """[(q, [(r, item), ...]), ...] of (item, shift) pairs, an item reading x column
        s * j + shift = s * (j + q) + r at tile column j (q = shift // s, r its remainder):
        column j of segment q's r-th split, segment q being the s * BLOCK_C columns from
        s * (first column + q). Items stay in order (shift grows with them)."""
        stride = self.schedule.segment_stride
        groups: dict = {}
        for item, shift in shifts:
            q, r = divmod(shift, stride)
            groups.setdefault(q, []).append((r, item))
        return sorted(groups.items())

    def segment_taps(self, window: dict, hoisted: set, shifts):
        """Emit, per row segment of `shifts` (segment_groups), its contiguous load (its prologue
        applied once an element) and its split into taps in registers; yields each item with
        `value` and `inside` emitted at its tap (the other axes at `window`)."""
        axis, stride = self.schedule.vector_axis, self.schedule.segment_stride
        name, upper = self.names[axis], self.names[axis].upper()
        width = f"BLOCK_C * {stride}"
        for q, taps in self.segment_groups(shifts):
            self.line(f"seg_cols = (pid % col_tiles) * ({width}) + ({q * stride}) + tl.arange(0, {width})")
            self.line(f"seg_ok = (seg_cols >= 0) & (seg_cols < in_{name})")
            segment = dict(window)
            segment[axis] = Coord("seg_cols", "seg", "seg_ok")
            self.value_at(self.x_tensor(), segment, "seg_value", hoisted)
            # an x constant along some axis (a size-1 or broadcast one, a hoisted load) is narrower
            self.line(f"seg_value = tl.broadcast_to(seg_value, [BLOCK_R, {width}])")
            parts = self.split_segment("seg_value", stride)
            for r, item in taps:
                self.line(f"{name}_in = (cols_idx + ({q})) * STRIDE_{upper} + {r}")
                self.line(f"{name}_ok = ({name}_in >= 0) & ({name}_in < in_{name})")
                tap = dict(window)
                tap[axis] = Coord(f"{name}_in", "col", f"{name}_ok")
                self.line(f"inside = {self.inside(tap)}")
                self.line(f"value = {parts[r]}")
                yield item

    def segmented_window(self, tile: dict, hoisted: set, is_max: bool):
        """The forward's window where the vector axis is strided (NCHW's width, row_segment_stride):
        the other axes' window loops as ever; inside them, the taps along the vector axis come
        from row segments (segment_taps): tap k of output column j reads s * j - pad + k."""
        axis = self.schedule.vector_axis
        others = [a for a in self.spatial if a != axis]
        window = self.open_window(tile, unrolled_loops([self.schedule.window[a - 2] for a in others]), others)
        pad = self.schedule.padding[axis - 2]
        for _ in self.segment_taps(window, hoisted, [(k, k - pad) for k in range(self.schedule.window[axis - 2])]):
            self.accumulate(is_max)
        self.close_loops(len(others))

    def split_segment(self, segment: str, stride: int) -> list:
        """Emit the split of a [BLOCK_R, BLOCK_C * stride] segment into its `stride` columns
        phases; returns their names, phase r (segment column stride * j + r) at index r.
        Each tl.split halves the lowest remaining bit of the phase."""
        bits = stride.bit_length() - 1
        shape = ", ".join(["BLOCK_R", "BLOCK_C"] + ["2"] * bits)
        self.line(f"seg_bits = tl.reshape({segment}, [{shape}])")
        pieces = {0: "seg_bits"}  # phase bits taken so far -> the tensor holding that phase
        for level in range(bits):
            split = {}
            for phase, tensor in pieces.items():
                low, high = f"seg_{level}_{phase}", f"seg_{level}_{phase | (1 << level)}"
                self.line(f"{low}, {high} = tl.split({tensor})")
                split[phase], split[phase | (1 << level)] = low, high
            pieces = split
        return [pieces[r] for r in range(stride)]

    def plane_index(self, suffix: str) -> str:
        """torch's int64 flat index within the input plane of the coordinates `{axis}_{suffix}`."""
        terms = []
        for axis in self.spatial:
            inner = "".join(f" * in_{self.names[later]}" for later in range(axis + 1, self.rank))
            terms.append((axis, f"{self.names[axis]}_{suffix}.to(tl.int64){inner}"))
        return f"({_outer(*self.by_side(terms), joiner=' + ')})"

    def backward(self, tile: dict):
        self.line(f"acc = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
        for axis in self.spatial:  # the last window starting at or before this element
            name, upper = self.names[axis], self.names[axis].upper()
            self.line(f"{name}_last = ({name}_idx + PAD_{upper}) // STRIDE_{upper}")
        is_max, indices = self.schedule.mode == "max", self.anchor.inputs[2]
        hoisted = self.hoist_loads(self.anchor.inputs[0], tile)
        if is_max and indices is None:  # only the recomputed argmax reads x
            hoisted |= self.hoist_loads(self.x_tensor(), tile)
        if indices is not None:
            self.line(f"here = {self.plane_index('idx')}")
        recompute = is_max and indices is None
        # one unrolling budget for the whole nest: the covering windows and, where the argmax is
        # recomputed, each one's window inside them
        nest = self.cover_extents() + (self.window_extents() if recompute else [])
        unrolled = unrolled_loops(nest)
        covering = dict(tile)
        for axis, unroll in zip(self.spatial, unrolled):
            name, upper = self.names[axis], self.names[axis].upper()
            self.open_loop(f"j{name}", f"COVER_{upper}", unroll)
            self.line(f"{name}_out = {name}_last - j{name}")
            self.line(f"{name}_start = {name}_out * STRIDE_{upper} - PAD_{upper}")
            self.line(f"{name}_cov = ({name}_out >= 0) & ({name}_out < out_{name}) & "
                      f"({name}_idx - {name}_start < WINDOW_{upper})")
            covering[axis] = Coord(f"{name}_out", self.side(axis), f"{name}_cov")
        self.line(f"covered = {self.inside(covering)}")
        self.value_at(self.anchor.inputs[0], covering, "grad", hoisted)
        if indices is not None:
            self.load(indices, covering)
            self.line(f"hit = {self.emitter.value(indices.uid, 'l')} == here")
        elif is_max:
            self.argmax_is_here(tile, hoisted, unrolled[len(self.spatial):])
        if is_max:
            self.line("acc += tl.where(covered & hit, grad, 0.0)")
        else:
            self.line(f"acc += tl.where(covered, grad / {self.divisor()}, 0.0)")
        self.close_loops(len(self.spatial))
        self.line("result = acc")

    # --- the owned-block backward ------------------------------------------------------------------
    def owned_positions(self) -> list:
        """Offsets (one per spatial axis) of the dx positions each tile position owns, in order."""
        offsets = [()]
        for axis in self.spatial:
            offsets = [o + (r,) for o in offsets for r in range(self.schedule.owned[axis - 2])]
        return offsets

    def owned_coords(self, tile: dict, offsets) -> dict:
        """Emit the coordinates of the owned dx position at `offsets`; returns axis -> Coord."""
        coords, tag = dict(tile), _tag(offsets)
        for axis, r in zip(self.spatial, offsets):
            name, upper = self.names[axis], self.names[axis].upper()
            variable = f"{name}_pos{tag}"
            self.line(f"{variable} = {name}_block * STRIDE_{upper} - PAD_{upper} + {r}")
            self.line(f"{name}_ok{tag} = ({variable} >= 0) & ({variable} < in_{name})")
            coords[axis] = Coord(variable, self.side(axis), f"{name}_ok{tag}")
        return coords

    def owned_backward(self, tile: dict):
        """dx of a block of prod(stride) positions per tile position: each covering window's
        dy (and index, or recomputed argmax, or divisor) is found once and shared by every
        position of the block it covers. `{axis}_block`, the last window starting at or before
        any of the block's positions, names the block: tile index `{axis}_idx` counts blocks
        from the first that reaches into the input (heuristics' owner_dims)."""
        positions = self.owned_positions()
        for axis in self.spatial:
            name, upper = self.names[axis], self.names[axis].upper()
            self.line(f"{name}_block = {name}_idx + PAD_{upper} // STRIDE_{upper}")
        for offsets in positions:
            self.line(f"acc{_tag(offsets)} = tl.zeros([BLOCK_R, BLOCK_C], dtype={self.compute})")
        is_max, indices = self.schedule.mode == "max", self.anchor.inputs[2]
        recompute = is_max and indices is None
        hoisted = self.hoist_loads(self.anchor.inputs[0], tile)
        if recompute:
            hoisted |= self.hoist_loads(self.x_tensor(), tile)
        if indices is not None:
            self.owned_plane_indices(tile)
        if recompute and self.schedule.argmax_shift_axis >= 0:
            self.shared_argmax_backward(tile, hoisted, positions)
            return
        cover_unrolled, window_unrolled = self.owned_unrolling(recompute, indices is not None, len(positions))
        covering = self.open_covering_windows(tile, cover_unrolled)
        self.value_at(self.anchor.inputs[0], covering, "grad", hoisted)
        if indices is not None:
            self.load(indices, covering)
            self.line(f"argmax = {self.emitter.value(indices.uid, 'l')}")
        elif recompute:
            self.window_argmax(tile, hoisted, window_unrolled)
        if not is_max:
            self.line(f"share = grad / {self.divisor()}")
        for offsets in positions:
            self.owned_contribution(offsets, is_max, indices is not None)
        self.close_loops(len(self.spatial))

    def covering_backs(self) -> list:
        """Every window covering a block, as per-spatial-axis counts of windows back from the
        block's own, row-major."""
        backs = [()]
        for extent in self.cover_extents():
            backs = [b + (j,) for b in backs for j in range(extent)]
        return backs

    def shared_argmax_backward(self, tile: dict, hoisted: set, positions: list):
        """The owned-block max backward with each window's argmax found once a program
        (heuristics' shared_argmax_axis): the windows of the tile positions first, then the
        windows further back along the shift axis taken from the neighbouring tile position,
        then dy routed to the owned positions as owned_backward does, every covering window
        unrolled (the budget held by the heuristic)."""
        taps = self.shared_window_taps(tile, hoisted)
        for backs in self.covering_backs():
            covering = dict(tile)
            for axis, back in zip(self.spatial, backs):
                covering[axis] = self.covering_coord(axis, str(back))
            self.line(f"covered = {self.inside(covering)}")
            self.value_at(self.anchor.inputs[0], covering, "grad", hoisted)
            self.line(f"tap = {taps[backs]}")
            for offsets in positions:
                self.owned_contribution(offsets, True, False, [str(back) for back in backs])

    def shared_window_taps(self, tile: dict, hoisted: set) -> dict:
        """Emit the argmax (tap number, window_argmax's) of every window covering the block;
        returns covering backs -> its variable. The windows zero back along the shift axis come
        from one pass over their neighbourhood (each x element loaded once); the others are a
        neighbour's along the shift axis (tl.gather), recomputed only where that neighbour is
        outside the program (the halo: loads masked to it)."""
        shift = self.schedule.argmax_shift_axis
        spatial = list(self.spatial)
        own = [backs for backs in self.covering_backs() if backs[spatial.index(shift)] == 0]
        taps = {backs: f"tap{_tag(backs)}" for backs in self.covering_backs()}
        loads = self.neighbourhood_argmax(tile, hoisted, own, taps)
        neighbours = [backs for backs in self.covering_backs() if backs not in own]
        # the halo's windows unroll within what the neighbourhood left of the budget (their
        # loads, masked to a few tile positions, cost little in memory but as much in code)
        budget = max(1, (UNROLLED_BODIES_MAX - loads) // max(1, len(neighbours)))
        for backs in neighbours:
            self.neighbour_argmax(tile, hoisted, backs, taps, unrolled_loops(self.window_extents(), budget))
        return taps

    def neighbourhood_argmax(self, tile: dict, hoisted: set, own: list, taps: dict) -> int:
        """Emit `taps[backs]` of the windows `own` in one row-major pass over the x elements
        they cover, each loaded once and compared into every window holding it (so each window
        still sees its elements in its own row-major order: the first maximum wins); returns
        the number of elements (unrolled loads)."""
        spatial = list(self.spatial)
        for backs in own:
            tag = _tag(backs)
            firsts = []
            for axis, back in zip(spatial, backs):
                name, upper = self.names[axis], self.names[axis].upper()
                self.line(f"{name}_start{tag} = ({name}_block - {back}) * STRIDE_{upper} - PAD_{upper}")
                inner = "".join(f" * WINDOW_{self.names[later].upper()}" for later in range(axis + 1, self.rank))
                firsts.append((axis, f"(tl.maximum({name}_start{tag}, 0) - {name}_start{tag}){inner}"))
            self.line(f"best{tag} = tl.full([BLOCK_R, BLOCK_C], float('-inf'), {self.compute})")
            self.line(f"{taps[backs]} = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32) + "
                      f"({_outer(*self.by_side(firsts), joiner=' + ')})")
        # offsets from the block's own window start: back to the furthest window's start
        reach = [range(-max(b[i] for b in own) * self.schedule.stride[axis - 2], self.schedule.window[axis - 2])
                 for i, axis in enumerate(spatial)]
        # a strided width (NCHW's, the shift axis and the last one) is read as row segments
        segmented = self.schedule.segment_stride and self.schedule.argmax_shift_axis == self.rank - 1
        outer = spatial[:-1] if segmented else spatial
        offsets_all = [()]
        for span in reach[:len(outer)]:
            offsets_all = [o + (d,) for o in offsets_all for d in span]
        for offsets in offsets_all:
            coords = dict(tile)
            for axis, d in zip(outer, offsets):
                name, upper = self.names[axis], self.names[axis].upper()
                self.line(f"{name}_in = {name}_block * STRIDE_{upper} - PAD_{upper} + ({d})")
                self.line(f"{name}_ok = ({name}_in >= 0) & ({name}_in < in_{name})")
                coords[axis] = Coord(f"{name}_in", self.side(axis), f"{name}_ok")
            if not segmented:
                self.line(f"inside = {self.inside(coords)}")
                self.value_at(self.x_tensor(), coords, "value", hoisted)
                self.compare_into_windows(offsets, own, taps)
                continue
            last = spatial[-1]
            stride, pad = self.schedule.stride[last - 2], self.schedule.padding[last - 2]
            # element d of block b's own window: x column s * (b + pad // s) - pad + d
            shifts = [(d, pad // stride * stride - pad + d) for d in reach[-1]]
            for d in self.segment_taps(coords, hoisted, shifts):
                self.compare_into_windows(offsets + (d,), own, taps)
        return len(offsets_all) * len(reach[-1]) if segmented else len(offsets_all)

    def compare_into_windows(self, offsets, own: list, taps: dict):
        """Emit the compare of `value` (x at `offsets` from the block's own window start, where
        `inside`) into every window of `own` holding it."""
        spatial = list(self.spatial)
        for backs in own:
            within = [d + back * self.schedule.stride[axis - 2] for axis, d, back in zip(spatial, offsets, backs)]
            if all(0 <= k < self.schedule.window[axis - 2] for axis, k in zip(spatial, within)):
                tag = _tag(backs)
                self.line(f"better = inside & tl.where(value != value, True, value > best{tag})")
                self.line(f"best{tag} = tl.where(better, value, best{tag})")
                self.line(f"{taps[backs]} = tl.where(better, {self.tap_code(within)}, {taps[backs]})")

    def neighbour_argmax(self, tile: dict, hoisted: set, backs: tuple, taps: dict, unrolled):
        """Emit `taps[backs]`, a window further back along the shift axis: the argmax the tile
        position that many back along it found for its own window, where that position is in
        this program (same row or column line, inside the tile); recomputed elsewhere."""
        shift = self.schedule.argmax_shift_axis
        spatial = list(self.spatial)
        back = backs[spatial.index(shift)]
        source = tuple(0 if axis == shift else b for axis, b in zip(spatial, backs))
        name = self.names[shift]
        column = self.side(shift) == "col"
        self.line(f"lane = tl.arange(0, {'BLOCK_C' if column else 'BLOCK_R'})")
        self.line(f"from_tile = (lane >= {back}) & ({name}_idx >= {back})")
        spread = "[None, :]" if column else "[:, None]"
        self.line(f"gathered = tl.gather({taps[source]}, tl.broadcast_to(tl.maximum(lane - {back}, 0){spread}, "
                  f"[BLOCK_R, BLOCK_C]), {1 if column else 0})")
        covering = dict(tile)
        for axis, b in zip(spatial, backs):
            covering[axis] = self.covering_coord(axis, str(b))
        self.line(f"halo = tl.where((from_tile){spread}, False, {self.inside(covering)})")
        self.load_guard = "halo"
        self.window_argmax(tile, hoisted, unrolled)
        self.load_guard = None
        self.line(f"{taps[backs]} = tl.where((from_tile){spread}, gathered, tap)")

    def open_covering_windows(self, tile: dict, unrolled) -> dict:
        """Open one loop per spatial axis over the windows covering the owned block, from the
        block's own window back; returns the coordinates of the current window (its dy)."""
        covering = dict(tile)
        for axis, unroll in zip(self.spatial, unrolled):
            self.open_loop(f"j{self.names[axis]}", f"COVER_{self.names[axis].upper()}", unroll)
            covering[axis] = self.covering_coord(axis, f"j{self.names[axis]}")
        self.line(f"covered = {self.inside(covering)}")
        return covering

    def covering_coord(self, axis: int, back: str) -> Coord:
        """Emit the index, start and validity along `axis` of the window `back` (an expression)
        windows before the block's own; returns its Coord."""
        name, upper = self.names[axis], self.names[axis].upper()
        self.line(f"{name}_out = {name}_block - {back}")
        self.line(f"{name}_start = {name}_out * STRIDE_{upper} - PAD_{upper}")
        self.line(f"{name}_cov = ({name}_out >= 0) & ({name}_out < out_{name})")
        return Coord(f"{name}_out", self.side(axis), f"{name}_cov")

    def owned_unrolling(self, recompute: bool, indexed: bool, positions: int) -> tuple:
        """(per covering loop, per window loop) whether to unroll it, within one budget: a
        covering window's body is its loads (dy, the index), its window of argmax loads
        (recomputed) and one contribution per owned position, so the window unrolls within what
        the rest leaves it (7x7 stride 4: 49 loads beside 16 positions passed the budget and
        took ptxas four times as long; its rows roll now), and the covering loops count it all."""
        covering_loads = 2 if indexed else 1
        extents = self.window_extents() if recompute else []
        window_unrolled = unrolled_loops(extents, UNROLLED_BODIES_MAX - positions - covering_loads)
        window_copies = math.prod(e for e, unrolled in zip(extents, window_unrolled) if unrolled) if extents else 0
        body = covering_loads + window_copies + positions
        return unrolled_loops(self.cover_extents() + [body])[:-1], window_unrolled

    def owned_contribution(self, offsets, is_max: bool, indexed: bool, backs=None):
        """Emit the current covering window's addition to the owned position at `offsets`:
        its dy where its argmax is that position (max), its share of dy where the window
        covers the position (average). `backs`: per spatial axis, how many windows before the
        block's own the current one is (the covering loops' variables by default)."""
        tag = _tag(offsets)
        backs = backs or [f"j{self.names[axis]}" for axis in self.spatial]
        # the position's offset from the window's start is j * stride + r along each axis:
        # scalars for the whole tile, constants where the covering loops are unrolled (a where,
        # not an &: the interpreter cannot and a 0-d bool with a 2-d one)
        reach = [f"({back} * STRIDE_{self.names[axis].upper()} + {r})"
                 for axis, back, r in zip(self.spatial, backs, offsets)]
        in_window = " & ".join(f"({term} < WINDOW_{self.names[axis].upper()})"
                               for axis, term in zip(self.spatial, reach))
        hit = f"tl.where({in_window}, covered, False)"
        if indexed:
            self.line(f"acc{tag} += tl.where({hit} & (argmax == here{tag}), grad, 0.0)")
        elif is_max:  # the window's tap at this position, in the order window_argmax numbers them
            self.line(f"acc{tag} += tl.where({hit} & (tap == {self.tap_code(reach)}), grad, 0.0)")
        else:
            self.line(f"acc{tag} += tl.where({hit}, share, 0.0)")

    def tap_code(self, offsets) -> str:
        """The row-major number within the window of the element at per-axis `offsets` from
        the window's start (expressions)."""
        terms = []
        for index, (axis, offset) in enumerate(zip(self.spatial, offsets)):
            inner = "".join(f" * WINDOW_{self.names[later].upper()}" for later in list(self.spatial)[index + 1:])
            terms.append(f"{offset}{inner}")
        return "(" + " + ".join(terms) + ")"

    def owned_plane_indices(self, tile: dict):
        """Emit `here{tag}`: torch's flat in-plane index of each owned position (what a
        forward's index names), once before the covering windows."""
        for offsets in self.owned_positions():
            terms = []
            for axis, r in zip(self.spatial, offsets):
                name, upper = self.names[axis], self.names[axis].upper()
                inner = "".join(f" * in_{self.names[later]}" for later in range(axis + 1, self.rank))
                terms.append((axis, f"({name}_block * STRIDE_{upper} - PAD_{upper} + {r}).to(tl.int64){inner}"))
            self.line(f"here{_tag(offsets)} = {_outer(*self.by_side(terms), joiner=' + ')}")

    def window_argmax(self, tile: dict, hoisted: set, unrolled):
        """Emit `tap`: the number (tap_code) within the window at `{axis}_start` of its first
        maximum, torch's rule as the forward's indices: it starts at the window's first
        in-range element and moves on every strictly greater value or NaN. An int32 window
        number, not an int64 plane index: its selects and compares are one instruction each."""
        firsts = [(axis, f"(tl.maximum({self.names[axis]}_start, 0) - {self.names[axis]}_start)"
                   + "".join(f" * WINDOW_{self.names[later].upper()}" for later in range(axis + 1, self.rank)))
                  for axis in self.spatial]
        self.line(f"best = tl.full([BLOCK_R, BLOCK_C], float('-inf'), {self.compute})")
        self.line(f"tap = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32) + ({_outer(*self.by_side(firsts), joiner=' + ')})")
        window = self.open_window(tile, unrolled)
        self.value_at(self.x_tensor(), window, "value", hoisted)
        self.line("better = inside & tl.where(value != value, True, value > best)")
        self.line("best = tl.where(better, value, best)")
        self.line(f"tap = tl.where(better, {self.tap_code([f'k{self.names[a]}' for a in self.spatial])}, tap)")
        self.close_loops(len(self.spatial))

    def owned_epilogues_and_stores(self, tile: dict):
        """The epilogue and stores of every owned position, each masked to its position; the
        epilogue's operands that do not vary over space are loaded once for the block."""
        hoisted = self.load_invariant(self.epilogue_inputs(), tile)
        self.line("tile_mask = mask")
        for offsets in self.owned_positions():
            coords = self.owned_coords(tile, offsets)
            self.line(f"mask = tile_mask & {_outer(*self.by_side([(a, c.valid) for a, c in coords.items() if c.valid]))}")
            self.line(f"result = acc{_tag(offsets)}")
            self.epilogue_and_stores(coords, hoisted)

    def argmax_is_here(self, tile: dict, hoisted: set, unrolled):
        """Emit `hit`: the window at `{axis}_start` has its first maximum at this element.

        Like torch, the index starts at the window's first in-range element (it stays there
        when nothing beats -inf) and moves on every strictly greater value or NaN.
        """
        firsts = [(axis, f"({self.names[axis]}_idx == tl.maximum({self.names[axis]}_start, 0))")
                  for axis in self.spatial]
        here = [(axis, f"({self.names[axis]}_in == {self.names[axis]}_idx)") for axis in self.spatial]
        self.line(f"best = tl.full([BLOCK_R, BLOCK_C], float('-inf'), {self.compute})")
        self.line(f"hit = mask & {_outer(*self.by_side(firsts))}")
        window = self.open_window(tile, unrolled)
        self.value_at(self.x_tensor(), window, "value", hoisted)
        self.line("better = inside & tl.where(value != value, True, value > best)")
        self.line("best = tl.where(better, value, best)")
        self.line(f"hit = tl.where(better, {_outer(*self.by_side(here))}, hit)")
        self.close_loops(len(self.spatial))

    # --- epilogue and stores ---------------------------------------------------------------------
    def epilogue_inputs(self) -> list:
        """The group inputs the epilogue reads (not the values it makes), each once, in order."""
        made = {self.anchor.outputs[0].uid} | {t.uid for n in self.group.epilogue for t in n.output_tensors()}
        inputs = {t.uid: t for n in self.group.epilogue for t in n.input_tensors() if t.uid not in made}
        return list(inputs.values())

    def epilogue_and_stores(self, tile: dict, hoisted=frozenset()):
        """The epilogue at `tile` and the stores of the group's outputs; the inputs in `hoisted`
        are loaded already."""
        self.emitter.bind(self.anchor.outputs[0].uid, "result", "f")
        if self.indices is not None:
            self.emitter.bind(self.indices.uid, "argmax", "l")
        needed = {t.uid for t in self.epilogue_inputs()}
        loaded = set(hoisted)
        for node in self.group.epilogue:
            for tensor in node.input_tensors():
                if tensor.uid in needed and tensor.uid not in loaded:
                    self.load(tensor, tile)  # at the output position, with its own strides
                    loaded.add(tensor.uid)
            self.emit(node)
        for tensor in self.outputs:
            pointer, _ = self.pointer(self.operands[tensor.uid], tile, full=True)
            self.line(self.emitter.store(pointer, tensor.uid, tensor.data_type, "mask"))

    # --- signature -------------------------------------------------------------------------------
    def arguments(self) -> list:
        sched, names = self.schedule, self.names
        args = [KernelArgument("tensor", f"{op.identifier}_ptr", uid) for uid, op in self.operands.items()]
        args += blend_arguments([self.emitter])  # (the body is rendered before the signature)
        sizes = {"rows": sched.rows, "cols": sched.cols}
        tile_dims = sched.tile_dims
        for axis in sched.row_axes[1:]:
            sizes[self.tile_size_name(axis)] = tile_dims[axis]
        for axis in self.spatial:
            sizes[f"in_{names[axis]}"] = sched.x_dims[axis]
            if sched.backward:
                sizes[f"out_{names[axis]}"] = sched.y_dims[axis]
        args += [KernelArgument("int", name, value) for name, value in sizes.items()]
        for op in self.operands.values():
            args += [KernelArgument("int", f"{op.identifier}_stride_{names[a]}", s)
                     for a, s in enumerate(op.strides) if s]
        for axis in self.spatial:
            k = axis - 2
            upper = names[axis].upper()
            args += [KernelArgument("constexpr", f"WINDOW_{upper}", sched.window[k]),
                     KernelArgument("constexpr", f"STRIDE_{upper}", sched.stride[k]),
                     KernelArgument("constexpr", f"PAD_{upper}", sched.padding[k])]
            if sched.backward:  # windows covering one element along this axis, at most
                args.append(KernelArgument("constexpr", f"COVER_{upper}", self.cover_extents()[k]))
        args += [KernelArgument("constexpr", "BLOCK_R", sched.config.block_rows),
                 KernelArgument("constexpr", "BLOCK_C", sched.config.block_cols)]
        return args


def render(kernel_name: str, schedule, group, compute_type, description: str, writer_class=None):
    """The KernelSource (name, source, arguments) of the kernel running a pooling group under
    `schedule`; written by `writer_class` (a _KernelWriter subclass, as LRN's) where given."""
    writer = (writer_class or _KernelWriter)(kernel_name, schedule, group, compute_type)
    tile = writer.tile_coordinates()
    if getattr(schedule, "owned", ()):  # pooling's owned-block backward (LRN's schedules have none)
        writer.owned_backward(tile)
        writer.owned_epilogues_and_stores(tile)
    else:
        if schedule.backward:
            writer.backward(tile)
        else:
            writer.forward(tile)
        writer.epilogue_and_stores(tile)
    args = writer.arguments()
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n"), args)
