"""The fixed structure of the Gluon backend's convolution wgrad (Hopper, sm_90a): two kernels, the
partials (wgrad_partials: warp specialized, on the matmul's cooperative mainloop) and their
combine (wgrad_combine, with the generated epilogue). conv_codegen.py renders a signature over
each; conv_wgrad.py lowers a group to them. x is read as the forward reads it
(conv_library.phase_view, tap_offset, copy_pixels).

    dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * x[n, p*st + r*dil - pad, q*st + s*dil - pad, c]

A unit of work is (split, tap, filter block, channel block): a [BLOCK_M, BLOCK_N] fp32 partial
reduced over the BLOCK_H x BLOCK_W rectangles of dy's pixels of its split (a contiguous run of
the rectangles of every image). Per step the producer loads dy's box [1, BH, BW, SUB_M] at
(n, p0, q0, k0) (one per consumer: the A block, M-major, wgmma reads it transposed) and x's box
[1, BH, BW, BLOCK_N] of the tap at (n, p0 + shift, q0 + shift, c0) from the phase view the
forward reads (a row-major B): the two boxes list the same pixels in the same order, so the
reduction runs over the rectangle's pixels. dy's pixels past P or Q read zeros, so their x
values (finite) add nothing; x's past H or W (and before 0) are the padding. The consumers store
the partial to the workspace [splits, taps, K, C] (fp32); wgrad_combine then adds the splits in
order (deterministic), runs the epilogue and stores dw through its own strides.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .conv_library import copy_pixels, phase_view, pixel_box, tap_offset
from .library import WARPGROUP_WARPS, accumulator_layout, column_subtiles, cooperative_mainloop, shared_layout


@gluon.jit
def wgrad_unit(unit, taps, tiles_m, tiles_n):
    """(split, tap, filter block, channel block) of work unit `unit`: split outermost (the units
    of one pixel run are neighbours: they share dy and x in L2), then the tap, then the blocks."""
    per_split = taps * tiles_m * tiles_n
    split = unit // per_split
    rest = unit - split * per_split
    tap = rest // (tiles_m * tiles_n)
    rest = rest - tap * (tiles_m * tiles_n)
    pid_m = rest // tiles_n
    return split, tap, pid_m, rest - pid_m * tiles_n


@gluon.jit
def split_run(split, rectangles, per_split):
    """(first rectangle, count) of split `split`: per_split rectangles, fewer in the last split
    (the host chose per_split so that every split has at least one)."""
    first = split * per_split
    return first, min(per_split, rectangles - first)


@gluon.jit
def rectangle_at(index, tiles_h, tiles_w, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr):
    """(image, first row, first column) of dy's pixel rectangle `index` (images outermost)."""
    per_image = tiles_h * tiles_w
    image = index // per_image
    local = index - image * per_image
    row_tile = local // tiles_w
    return image, row_tile * BLOCK_H, (local - row_tile * tiles_w) * BLOCK_W


@gluon.jit
def wgrad_load_partition(dy_ptr, x_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                         x_stride_n, x_stride_h, x_stride_w, filters, dy_stride_n, dy_stride_h, dy_stride_w, taps_h,
                         taps_w, out_h, out_w, pad_h, pad_w, dil_h, dil_w, splits, per_split,  #
                         BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, A_PARTS: gl.constexpr, STRIDE_H: gl.constexpr,
                         STRIDE_W: gl.constexpr, PHASED_H: gl.constexpr, PHASED_W: gl.constexpr):
    """The producer (one warp): for each of the program's units and each rectangle of its split,
    wait for the slot, then load dy's boxes (A_PARTS filter blocks of SUB_M: one per consumer)
    and the tap's x box into it. It makes the descriptors it loads through itself."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    SUB_M: gl.constexpr = BLOCK_M // A_PARTS
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    dy_desc = tma.make_tensor_descriptor(dy_ptr, [images, out_h, out_w, filters],
                                         [dy_stride_n, dy_stride_h, dy_stride_w, 1], [1, BLOCK_H, BLOCK_W, SUB_M],
                                         shared_layout([1, BLOCK_H, BLOCK_W, SUB_M], dtype))
    view00 = phase_view(x_ptr, 0, 0, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w, STRIDE_H,
                        STRIDE_W, BLOCK_H, BLOCK_W, BLOCK_N)
    view01 = view00
    view10 = view00
    view11 = view00
    if PHASED_W:
        view01 = phase_view(x_ptr, 0, 1, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                            STRIDE_H, STRIDE_W, BLOCK_H, BLOCK_W, BLOCK_N)
    if PHASED_H:
        view10 = phase_view(x_ptr, 1, 0, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                            STRIDE_H, STRIDE_W, BLOCK_H, BLOCK_W, BLOCK_N)
        if PHASED_W:
            view11 = phase_view(x_ptr, 1, 1, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                                STRIDE_H, STRIDE_W, BLOCK_H, BLOCK_W, BLOCK_N)
    views = (view00, view01, view10, view11)
    tiles_h = gl.cdiv(out_h, BLOCK_H)
    tiles_w = gl.cdiv(out_w, BLOCK_W)
    tiles_m = gl.cdiv(filters, BLOCK_M)
    tiles_n = gl.cdiv(channels, BLOCK_N)
    taps = taps_h * taps_w
    rectangles = images * tiles_h * tiles_w
    step = 0
    for unit in range(gl.program_id(0), splits * taps * tiles_m * tiles_n, gl.num_programs(0)):
        split, tap, pid_m, pid_n = wgrad_unit(unit, taps, tiles_m, tiles_n)
        first, count = split_run(split, rectangles, per_split)
        r = tap // taps_w
        phase_h, shift_h = tap_offset(r, dil_h, pad_h, STRIDE_H)
        phase_w, shift_w = tap_offset(tap - r * taps_w, dil_w, pad_w, STRIDE_W)
        for kk in range(count):
            image, p0, q0 = rectangle_at(first + kk, tiles_h, tiles_w, BLOCK_H, BLOCK_W)
            slot = step % STAGES
            # a fresh barrier counts as having completed the phase before its first
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            barrier = ready.index(slot)
            mbarrier.expect(barrier, A_PARTS * dy_desc.block_type.nbytes + view00.block_type.nbytes)
            for part in gl.static_range(A_PARTS):
                # pixels past P or Q read zeros: they add nothing
                tma.async_copy_global_to_shared(dy_desc, [image, p0, q0, pid_m * BLOCK_M + part * SUB_M], barrier,
                                                pixel_box(a_ring.index(slot * A_PARTS + part), BLOCK_H, BLOCK_W))
            copy_pixels(views, phase_h, phase_w, [image, p0 + shift_h, q0 + shift_w, pid_n * BLOCK_N], barrier,
                        pixel_box(b_ring.index(slot), BLOCK_H, BLOCK_W), PHASED_H or PHASED_W)
            step += 1


@gluon.jit
def store_partial_subtile(part, base, row0, col0, filters, channels):
    """One [SUB_M, EPILOGUE_N] subtile of a partial, rows row0.., columns col0.., by masked stores
    into a tap's [K, C] plane of the workspace at `base`."""
    layout: gl.constexpr = part.type.layout
    rows = row0 + gl.arange(0, part.type.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, part.type.shape[1], layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(rows * channels, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < filters, 1) & gl.expand_dims(cols < channels, 0)
    gl.store(base + offsets, part, mask=mask)


@gluon.jit
def store_partial(acc, partial_ptr, split, tap, taps, row0, col0, filters, channels, SPLITS: gl.constexpr):
    """A consumer's fp32 partial (rows row0.., columns col0..) into the workspace [splits, taps,
    K, C], in SPLITS column subtiles (one subtile's offsets live at a time)."""
    parts = column_subtiles(acc, SPLITS)
    base = partial_ptr + ((split * taps + tap) * filters).to(gl.int64) * channels
    for j in gl.static_range(SPLITS):
        store_partial_subtile(parts[j], base, row0, col0 + j * parts[j].type.shape[1], filters, channels)


@gluon.jit
def wgrad_mma_partition(a_ring, b_ring, ready, empty, partial_ptr, images, filters, channels, taps_h, taps_w, out_h,
                        out_w, splits, per_split,  #
                        HALF: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr, EPILOGUE_N: gl.constexpr):
    """Consumer HALF: filters [HALF * SUB_M, (HALF + 1) * SUB_M) of every unit of the program,
    through library.cooperative_mainloop (A M-major, B row-major), then its partial stored."""
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    layout: gl.constexpr = accumulator_layout(SUB_M, BLOCK_N, a_ring.dtype)
    tiles_h = gl.cdiv(out_h, BLOCK_H)
    tiles_w = gl.cdiv(out_w, BLOCK_W)
    tiles_m = gl.cdiv(filters, BLOCK_M)
    tiles_n = gl.cdiv(channels, BLOCK_N)
    taps = taps_h * taps_w
    rectangles = images * tiles_h * tiles_w
    step = 0
    for unit in range(gl.program_id(0), splits * taps * tiles_m * tiles_n, gl.num_programs(0)):
        split, tap, pid_m, pid_n = wgrad_unit(unit, taps, tiles_m, tiles_n)
        _, count = split_run(split, rectangles, per_split)
        acc, step = cooperative_mainloop(a_ring, b_ring, ready, empty, step, count, layout, HALF, CONSUMERS, False,
                                         True)
        store_partial(acc, partial_ptr, split, tap, taps, pid_m * BLOCK_M + HALF * SUB_M, pid_n * BLOCK_N, filters,
                      channels, BLOCK_N // EPILOGUE_N)


@gluon.jit
def wgrad_partials(dy_ptr, x_ptr, partial_ptr, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                   filters, dy_stride_n, dy_stride_h, dy_stride_w, taps_h, taps_w, out_h, out_w, pad_h, pad_w, dil_h,
                   dil_w, splits, per_split,  #
                   BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, CONSUMERS: gl.constexpr, EPILOGUE_N: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, STRIDE_H: gl.constexpr,
                   STRIDE_W: gl.constexpr, PHASED_H: gl.constexpr, PHASED_W: gl.constexpr):
    """The wgrad's first kernel: the ring of [BLOCK_P, SUB_M] dy tiles (one per consumer a slot,
    filters contiguous) and [BLOCK_P, BLOCK_N] x tiles (channels contiguous), BLOCK_P = BLOCK_H *
    BLOCK_W pixels a step, its barriers, and the partitions."""
    gl.static_assert(STAGES >= 2)
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(gl.num_warps() == WARPGROUP_WARPS)
    gl.static_assert(BLOCK_N // EPILOGUE_N == 1 or BLOCK_N // EPILOGUE_N == 2 or BLOCK_N // EPILOGUE_N == 4)
    BLOCK_P: gl.constexpr = BLOCK_H * BLOCK_W
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [STAGES * CONSUMERS, BLOCK_P, SUB_M], shared_layout([BLOCK_P, SUB_M], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_P, BLOCK_N], shared_layout([BLOCK_P, BLOCK_N], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # the consumers that read a slot
    if CONSUMERS == 2:
        gl.warp_specialize([
            (wgrad_mma_partition, (a_ring, b_ring, ready, empty, partial_ptr, images, filters, channels, taps_h,
                                   taps_w, out_h, out_w, splits, per_split, gl.constexpr(0), BLOCK_H, BLOCK_W,
                                   BLOCK_M, BLOCK_N, CONSUMERS, EPILOGUE_N)),
            (wgrad_mma_partition, (a_ring, b_ring, ready, empty, partial_ptr, images, filters, channels, taps_h,
                                   taps_w, out_h, out_w, splits, per_split, gl.constexpr(1), BLOCK_H, BLOCK_W,
                                   BLOCK_M, BLOCK_N, CONSUMERS, EPILOGUE_N)),
            (wgrad_load_partition, (dy_ptr, x_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                                    x_stride_n, x_stride_h, x_stride_w, filters, dy_stride_n, dy_stride_h,
                                    dy_stride_w, taps_h, taps_w, out_h, out_w, pad_h, pad_w, dil_h, dil_w, splits,
                                    per_split, BLOCK_H, BLOCK_W, BLOCK_M, BLOCK_N, CONSUMERS, STRIDE_H, STRIDE_W,
                                    PHASED_H, PHASED_W)),
        ], [WARPGROUP_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (wgrad_mma_partition, (a_ring, b_ring, ready, empty, partial_ptr, images, filters, channels, taps_h,
                                   taps_w, out_h, out_w, splits, per_split, gl.constexpr(0), BLOCK_H, BLOCK_W,
                                   BLOCK_M, BLOCK_N, CONSUMERS, EPILOGUE_N)),
            (wgrad_load_partition, (dy_ptr, x_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                                    x_stride_n, x_stride_h, x_stride_w, filters, dy_stride_n, dy_stride_h,
                                    dy_stride_w, taps_h, taps_w, out_h, out_w, pad_h, pad_w, dil_h, dil_w, splits,
                                    per_split, BLOCK_H, BLOCK_W, BLOCK_M, BLOCK_N, CONSUMERS, STRIDE_H, STRIDE_W,
                                    PHASED_H, PHASED_W)),
        ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def wgrad_combine(partial_ptr, dw_ptr, filters, channels, taps_h, taps_w, splits, dw_stride_k, dw_stride_c,
                  dw_stride_r, dw_stride_s, epilogue: gl.constexpr, epilogue_args,  #
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, FLIP: gl.constexpr):
    """The wgrad's second kernel: program (tap, filter block, channel block) adds the splits'
    partials in split order (the same sum every run), runs the generated epilogue (rows the
    filters, columns the channels) and stores dw[k, c, r, s] through dw's strides (back to front
    where FLIP: mode="convolution")."""
    gl.static_assert(gl.num_warps() == WARPGROUP_WARPS)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPGROUP_WARPS, 1], [1, 0])
    tiles_m = gl.cdiv(filters, BLOCK_M)
    tiles_n = gl.cdiv(channels, BLOCK_N)
    taps = taps_h * taps_w
    _, tap, pid_m, pid_n = wgrad_unit(gl.program_id(0), taps, tiles_m, tiles_n)
    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(rows * channels, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < filters, 1) & gl.expand_dims(cols < channels, 0)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    # four splits' loads in flight (a plain loop waits out each load's latency: about 0.8 us a
    # split on the H200), then added in split order; a split past the last adds nothing
    split_step = (taps * filters).to(gl.int64) * channels
    base = partial_ptr + (tap * filters).to(gl.int64) * channels + offsets
    for first in range(0, splits, 4):
        part0 = gl.load(base + first * split_step, mask=mask, other=0.0)
        part1 = gl.load(base + (first + 1) * split_step, mask=mask & (first + 1 < splits), other=0.0)
        part2 = gl.load(base + (first + 2) * split_step, mask=mask & (first + 2 < splits), other=0.0)
        part3 = gl.load(base + (first + 3) * split_step, mask=mask & (first + 3 < splits), other=0.0)
        acc += part0
        acc += part1
        acc += part2
        acc += part3
    value = epilogue(acc, rows, cols, 0, filters, channels, epilogue_args)
    r = tap // taps_w
    s = tap - r * taps_w
    if FLIP:
        r = taps_h - 1 - r
        s = taps_w - 1 - s
    pointers = (dw_ptr + r.to(gl.int64) * dw_stride_r + s.to(gl.int64) * dw_stride_s
                + gl.expand_dims(rows.to(gl.int64) * dw_stride_k, 1) + gl.expand_dims(cols.to(gl.int64) * dw_stride_c, 0))
    gl.store(pointers, value.to(dw_ptr.dtype.element_ty), mask=mask)
