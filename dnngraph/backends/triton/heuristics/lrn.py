"""Configs for windowed normalization kernels (LRN, divisive normalization): pooling's tiles.

The tile covers x (y or dx have its dims); its columns walk x's smallest-stride axis, as a
pooling tile's do (pooling.tile_axes), its rows walk the windowed axes innermost, and configs
are ranked by pooling's bandwidth + wave model. What differs is how many tile-sized values a thread keeps live: the kernel unrolls the
window into one variable per offset (the backward keeps the union of the windows of every
element covering the centre), so the per-thread cap shrinks as the window grows.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import UnsupportedError
from ....target import Target
from .layout import INT32_LIMIT
from .pooling import AXIS_NAMES, PoolingConfig, TiledWindows, rank, tile_axes

# Additions of the window sums past which the unrolled kernel would be too long to compile
# well: LRN up to size 64 in its backward, a 2D divisive window up to 11x11, a 3D one up to 5.
MAX_WINDOW_TERMS = 4096
# Tile values a thread may keep live across all the unrolled offsets (registers: about 128 fp32
# values a thread, half of them left for addresses and masks). Model assumption, not measured.
LIVE_VALUES_PER_THREAD = 64


@dataclass(frozen=True)
class LrnSchedule(TiledWindows):
    """What codegen needs to write one kernel; the field names are those pooling's kernel writer reads."""

    backward: bool
    axes: tuple  # the windowed logical axes
    offsets: tuple  # per windowed axis, (first, last) offset of the values loaded around a centre
    x_dims: tuple
    vector_axis: int
    row_axes: tuple
    index_64: bool
    read_uids: frozenset
    config: PoolingConfig
    candidates: int
    reason: str

    @property
    def tile_dims(self) -> tuple:
        return self.x_dims

    @property
    def config_text(self) -> str:
        return self.tile_text()


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def loaded_offsets(attrs, axes, backward: bool) -> tuple:
    """Per windowed axis, the (first, last) offset from a centre of the values the kernel loads:
    the window (forward), or the windows of every element whose window holds the centre."""
    before, after = attrs.size // 2, (attrs.size - 1) // 2
    reach = (before + after, before + after) if backward else (before, after)
    return tuple((-reach[0], reach[1]) for _ in axes)


def window_terms(size: int, axes: tuple, backward: bool) -> int:
    """Additions of the kernel's separable window sums (codegen/lrn.py partial_sum): the sum
    along the j-th windowed axis is taken at every point the sums along the earlier axes need,
    size terms each; a backward needs the sums of size^d covering centres, a forward of one."""
    dims = len(axes)
    if not backward:
        return sum(size ** j for j in range(1, dims + 1))
    return size * sum((2 * size - 1) ** j * size ** (dims - j) for j in range(dims))


def schedule(group, target: Target, axes: tuple) -> LrnSchedule:
    """Tile layout and the best-ranked config on `target` of a windowed normalization group."""
    anchor = group.anchor
    backward = anchor.op.endswith("_backward")
    x = anchor.inputs[1] if backward else anchor.inputs[0]
    attrs = anchor.attrs
    terms = window_terms(attrs.size, axes, backward)
    if terms > MAX_WINDOW_TERMS:
        raise UnsupportedError(f"node {anchor.name!r} ({anchor.op}): a window of size {attrs.size} over "
                               f"{len(axes)} axes needs {terms} unrolled terms, more than the kernel's "
                               f"{MAX_WINDOW_TERMS}")
    offsets = loaded_offsets(attrs, axes, backward)
    loaded = _numel(last - first + 1 for first, last in offsets)
    live = loaded + (attrs.size ** len(axes) * 2 if backward else 1)  # + dy and a scale per covering centre
    vector_axis, row_axes = tile_axes(tuple(x.dim), tuple(x.stride))
    # windowed row axes innermost (NCHW LRN: rows walk channels, not heights), so a tile's rows
    # are neighbours along the window and its shifted loads mostly hit lines the tile loads too
    row_axes = tuple(a for a in row_axes if a not in axes) + tuple(a for a in row_axes if a in axes)
    tensors = list(group.inputs) + list(group.outputs)
    span = max(sum((d - 1) * s for d, s in zip(t.dim, t.stride)) + 1 for t in tensors)
    index_64 = max(span, _numel(x.dim)) > INT32_LIMIT
    traffic = sum(_numel(t.dim) * t.data_type.itemsize for t in tensors)
    elements = _numel(x.dim)
    cols = x.dim[vector_axis]
    rows = elements // max(cols, 1)
    # a power of two, as pooling's caps are: the warp counts derived from it must be one too
    per_thread = 1 << (max(1, LIVE_VALUES_PER_THREAD // live).bit_length() - 1)
    ranked = rank(rows, cols, traffic / max(elements, 1), target, per_thread)
    best = ranked[0]
    names = AXIS_NAMES[len(x.dim)]
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us at {target.bandwidth / 1e12:.1f} TB/s "
              f"for {traffic} bytes over {rows}x{cols}; vector axis {names[vector_axis]} has the smallest "
              f"stride of x ({x.stride[vector_axis]}); {loaded} unrolled loads around each element")
    return LrnSchedule(backward, tuple(axes), offsets, tuple(x.dim), vector_axis, row_axes, index_64,
                       frozenset(t.uid for t in group.inputs), best, len(ranked), reason)
