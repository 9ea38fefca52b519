"""The fixed structure of the Gluon backend's convolutions (Hopper, sm_90a): an implicit GEMM on
the matmul's mainloop (library.py). A generated kernel (conv_codegen.py) renders only its
signature and fused epilogue, and calls implicit_gemm() below with them.

    y[n, p, q, k] = epilogue(sum over r, s, c of x[n, p + r*dil - pad, q + s*dil - pad, c] * w[k, r, s, c])

x is NHWC (C contiguous), w KRSC (C contiguous), y NHWC (K contiguous): the GEMM's rows are
output pixels, its columns output channels, its reduction R*S*C (tap-major, C inner).

- An output tile is a BLOCK_H x BLOCK_W rectangle of one image's pixels (BLOCK_M = BLOCK_H *
  BLOCK_W GEMM rows) by BLOCK_N output channels. A reduction step is one filter tap (r, s) and
  BLOCK_K channels from c0.
- The producer (library.load_partition's counterpart; the consumers are library's own
  cooperative_mainloop) loads each step's A block with ONE TMA copy of the box [1, BLOCK_H,
  BLOCK_W, BLOCK_K] of a rank-4 descriptor over x [N, H, W, C] at (n, p0 + r*dil - pad,
  q0 + s*dil - pad, c0): out-of-bounds rows, columns and channels are zeros, which is the
  padding (and the channel tail past C). A stride s reads phase views of x: view (a, b) is
  [N, ceil((H - a) / sh), ceil((W - b) / sw), C] from x[:, a, b, :] with strides (sh*W*C, sw*C),
  whose row v is x's row v*sh + a; tap offset o = r*dil - pad (and its column's) lands in phase
  o mod sh at view row p + floor(o / sh), so each tap's box is one TMA copy from one view. Stride
  1 has the one view x itself; a stride-2 axis two phases (PHASED_H / PHASED_W), where its taps'
  offsets take both parities; a stride whose taps all lie in phase 0 (a 1x1 filter without
  leading padding: the ResNet downsample, any stride) one view.
- The box's bytes in shared memory are those of a [BLOCK_M, BLOCK_K] tile in the same swizzled
  layout (the swizzle runs over the flattened rows alike): the ring holds [BLOCK_M, BLOCK_K]
  tiles, and the TMA copy writes them through a rank-4 view of the same buffer (`_reinterpret`).
- B: a rank-4 descriptor over w as [K, R, S, C] (its own strides), box [BLOCK_N, 1, 1,
  BLOCK_K] at (k0, r, s, c0), read by wgmma K-major (library.b_operand). Channels past C are
  zeros in both operands, so a partial channel block adds nothing. FLIP (mode="convolution")
  reads the filter back to front.
- dgrad at stride 1 is the same kernel (B_K_MAJOR False): dx = conv(dy, w flipped) with padding
  (R-1)*dil - pad (negative where pad is larger: every tap then starts inside dy), so the
  kernel's x is dy [N, P, Q, K] (its `channels`, the reduction, are K), its y is dx [N, H, W, C]
  (its `filters`, the GEMM's columns, are C), and w [K, R, S, C] is read with the reduction on
  its axis 0: a row-major B, box [BLOCK_K, 1, 1, BLOCK_N] at (k0, r, s, c0), C contiguous, read
  by wgmma as it is. The filter runs back to front in cross-correlation (FLIP True), front to
  back in mode="convolution".
- A strided 1x1 dgrad without padding (OUT_STRIDE_H / OUT_STRIDE_W 2) is the 1x1 over dy's
  first ceil(H/s) x ceil(W/s) pixels stored into phase view (0, 0) of dx (its pixels (s*p, s*q));
  dx's other phases, which no dy pixel reaches, hold the epilogue of zeros, written by the
  Triton backend's phase launches that follow this one (conv_backend.lower).
- The epilogue runs in column subtiles (library.column_subtiles) and stores each through a
  staging buffer and a rank-4 TMA store, box [1, SUB_H, BLOCK_W, EPILOGUE_N] over y [N, P, Q,
  K]: pixels past P or Q and channels past K are clipped by the descriptor.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .library import (WARPGROUP_WARPS, accumulator_layout, column_subtiles, cooperative_mainloop, held,
                      shared_layout, staging_buffers, subtile_at, tile_coordinates)


@gluon.jit
def pixel_box(buffer, BOX_H: gl.constexpr, BOX_W: gl.constexpr):
    """A [BOX_H * BOX_W, C] shared tile viewed as the box [1, BOX_H, BOX_W, C] of a rank-4 NHWC
    descriptor (the same bytes)."""
    C: gl.constexpr = buffer.type.shape[1]
    gl.static_assert(buffer.type.shape[0] == BOX_H * BOX_W)
    return buffer._reinterpret(buffer.dtype, [1, BOX_H, BOX_W, C], shared_layout([1, BOX_H, BOX_W, C], buffer.dtype))


@gluon.jit
def filter_box(buffer):
    """A [R, C] shared tile ([BLOCK_N, BLOCK_K] K-major, [BLOCK_K, BLOCK_N] row-major) viewed as
    the box [R, 1, 1, C] of the rank-4 filter descriptor (the same bytes)."""
    R: gl.constexpr = buffer.type.shape[0]
    C: gl.constexpr = buffer.type.shape[1]
    return buffer._reinterpret(buffer.dtype, [R, 1, 1, C], shared_layout([R, 1, 1, C], buffer.dtype))


@gluon.jit
def pixel_tile(tile, images, out_h, out_w, filters, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(image, first output row, first output column, tile column) of linear tile `tile`: the
    pixel rectangles of every image are the GEMM's row tiles, walked in library's grouped order."""
    tiles_h = gl.cdiv(out_h, BLOCK_H)
    tiles_w = gl.cdiv(out_w, BLOCK_W)
    _, pid_m, pid_n = tile_coordinates(tile, images * tiles_h * tiles_w, gl.cdiv(filters, BLOCK_N), GROUP_M)
    per_image = tiles_h * tiles_w
    image = pid_m // per_image
    local = pid_m - image * per_image
    row_tile = local // tiles_w
    return image, row_tile * BLOCK_H, (local - row_tile * tiles_w) * BLOCK_W, pid_n


@gluon.jit
def tile_count(images, out_h, out_w, filters, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tiles of the convolution: pixel rectangles of every image by channel blocks."""
    return images * gl.cdiv(out_h, BLOCK_H) * gl.cdiv(out_w, BLOCK_W) * gl.cdiv(filters, BLOCK_N)


@gluon.jit
def phase_view(x_ptr, phase_h, phase_w, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
               STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, BOX_H: gl.constexpr, BOX_W: gl.constexpr,
               BLOCK_K: gl.constexpr):
    """The rank-4 descriptor of phase view (phase_h, phase_w) of NHWC x (the module docstring):
    its row v, column u is x's row v*STRIDE_H + phase_h, column u*STRIDE_W + phase_w; rows and
    columns past x's read zeros. (Stride 1, phase 0: x itself.)"""
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    base = x_ptr + phase_h * x_stride_h + phase_w * x_stride_w
    return tma.make_tensor_descriptor(base, [images, gl.cdiv(x_rows - phase_h, STRIDE_H),
                                             gl.cdiv(x_cols - phase_w, STRIDE_W), channels],
                                      [x_stride_n, STRIDE_H * x_stride_h, STRIDE_W * x_stride_w, 1],
                                      [1, BOX_H, BOX_W, BLOCK_K], shared_layout([1, BOX_H, BOX_W, BLOCK_K], dtype))


@gluon.jit
def tap_offset(tap, dilation, padding, STRIDE: gl.constexpr):
    """(phase, view offset) of a tap along one axis: its input offset tap*dilation - padding is
    phase + STRIDE * view offset, phase in [0, STRIDE) (the offset lifted to >= 0 first: integer
    division and remainder round toward zero)."""
    lift = gl.cdiv(padding, STRIDE)
    lifted = tap * dilation - padding + lift * STRIDE
    return lifted % STRIDE, lifted // STRIDE - lift


@gluon.jit
def copy_pixels(views, phase_h, phase_w, coordinates, barrier, buffer, PHASED: gl.constexpr):
    """TMA copy of the box at `coordinates` of view (phase_h, phase_w) of `views` (x's phase
    views: (0, 0), (0, 1), (1, 0), (1, 1)) into `buffer`; PHASED False: view (0, 0), the only one."""
    if PHASED:
        if phase_h == 0:
            if phase_w == 0:
                tma.async_copy_global_to_shared(views[0], coordinates, barrier, buffer)
            else:
                tma.async_copy_global_to_shared(views[1], coordinates, barrier, buffer)
        else:
            if phase_w == 0:
                tma.async_copy_global_to_shared(views[2], coordinates, barrier, buffer)
            else:
                tma.async_copy_global_to_shared(views[3], coordinates, barrier, buffer)
    else:
        tma.async_copy_global_to_shared(views[0], coordinates, barrier, buffer)


@gluon.jit
def filter_descriptor(w_ptr, filters, taps_h, taps_w, channels, w_stride_k, w_stride_r, w_stride_s,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """The rank-4 descriptor of w over its own axes [axis 0, R, S, axis 3 (contiguous)]: K-major
    (fprop: axis 0 the GEMM's columns, `filters`; axis 3 the reduction, `channels`), box
    [BLOCK_N, 1, 1, BLOCK_K]; else row-major (dgrad: axis 0 the reduction, axis 3 the columns),
    box [BLOCK_K, 1, 1, BLOCK_N]."""
    dtype: gl.constexpr = w_ptr.dtype.element_ty
    if B_K_MAJOR:
        return tma.make_tensor_descriptor(w_ptr, [filters, taps_h, taps_w, channels],
                                          [w_stride_k, w_stride_r, w_stride_s, 1], [BLOCK_N, 1, 1, BLOCK_K],
                                          shared_layout([BLOCK_N, 1, 1, BLOCK_K], dtype))
    else:
        return tma.make_tensor_descriptor(w_ptr, [channels, taps_h, taps_w, filters],
                                          [w_stride_k, w_stride_r, w_stride_s, 1], [BLOCK_K, 1, 1, BLOCK_N],
                                          shared_layout([BLOCK_K, 1, 1, BLOCK_N], dtype))


@gluon.jit
def conv_load_partition(x_ptr, w_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                        x_stride_n, x_stride_h, x_stride_w, filters, taps_h, taps_w, w_stride_k, w_stride_r,
                        w_stride_s, out_h, out_w, pad_h, pad_w, dil_h, dil_w,  #
                        BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, A_PARTS: gl.constexpr, FLIP: gl.constexpr,
                        STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, PHASED_H: gl.constexpr,
                        PHASED_W: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """The producer (one warp): for each of the program's tiles and each (tap, channel block)
    step, wait for the slot to be empty, then load the tap's shifted pixel boxes (A_PARTS of
    BLOCK_H // A_PARTS rows each: one per consumer) and the filter block into it. It makes the
    descriptors it loads through itself (a device-side descriptor is acquired only by the warps
    that make it)."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    SUB_H: gl.constexpr = BLOCK_H // A_PARTS
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    # x's phase views (0, 0), (0, 1), (1, 0), (1, 1); those of no phased axis stand in as (0, 0)
    view00 = phase_view(x_ptr, 0, 0, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w, STRIDE_H,
                        STRIDE_W, SUB_H, BLOCK_W, BLOCK_K)
    view01 = view00
    view10 = view00
    view11 = view00
    if PHASED_W:
        view01 = phase_view(x_ptr, 0, 1, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                            STRIDE_H, STRIDE_W, SUB_H, BLOCK_W, BLOCK_K)
    if PHASED_H:
        view10 = phase_view(x_ptr, 1, 0, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                            STRIDE_H, STRIDE_W, SUB_H, BLOCK_W, BLOCK_K)
        if PHASED_W:
            view11 = phase_view(x_ptr, 1, 1, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w,
                                STRIDE_H, STRIDE_W, SUB_H, BLOCK_W, BLOCK_K)
    views = (view00, view01, view10, view11)
    w_desc = filter_descriptor(w_ptr, filters, taps_h, taps_w, channels, w_stride_k, w_stride_r, w_stride_s, BLOCK_N,
                               BLOCK_K, B_K_MAJOR)
    channel_steps = gl.cdiv(channels, BLOCK_K)
    k_steps = taps_h * taps_w * channel_steps
    step = 0
    for tile in range(gl.program_id(0), tile_count(images, out_h, out_w, filters, BLOCK_H, BLOCK_W, BLOCK_N),
                      gl.num_programs(0)):
        image, p0, q0, pid_n = pixel_tile(tile, images, out_h, out_w, filters, BLOCK_H, BLOCK_W, BLOCK_N, GROUP_M)
        for kk in range(k_steps):
            tap = kk // channel_steps
            c0 = (kk - tap * channel_steps) * BLOCK_K
            r = tap // taps_w
            s = tap - r * taps_w
            slot = step % STAGES
            # a fresh barrier counts as having completed the phase before its first
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            barrier = ready.index(slot)
            mbarrier.expect(barrier, A_PARTS * view00.block_type.nbytes + w_desc.block_type.nbytes)
            phase_h, shift_h = tap_offset(r, dil_h, pad_h, STRIDE_H)
            phase_w, shift_w = tap_offset(s, dil_w, pad_w, STRIDE_W)
            for part in gl.static_range(A_PARTS):
                # negative and past-the-end coordinates read zeros: the padding
                copy_pixels(views, phase_h, phase_w, [image, p0 + part * SUB_H + shift_h, q0 + shift_w, c0], barrier,
                            pixel_box(a_ring.index(slot * A_PARTS + part), SUB_H, BLOCK_W), PHASED_H or PHASED_W)
            if FLIP:  # mode="convolution": the filter back to front
                r = taps_h - 1 - r
                s = taps_w - 1 - s
            if B_K_MAJOR:  # fprop: [filters, R, S, channels]
                tma.async_copy_global_to_shared(w_desc, [pid_n * BLOCK_N, r, s, c0], barrier,
                                                filter_box(b_ring.index(slot)))
            else:  # dgrad: [channels (w's K), R, S, filters (w's C)]
                tma.async_copy_global_to_shared(w_desc, [c0, r, s, pid_n * BLOCK_N], barrier,
                                                filter_box(b_ring.index(slot)))
            step += 1


@gluon.jit
def conv_finish_subtile(part, j, y_desc, c_buffers, image, p0, q0, col0, pixels, filters, epilogue: gl.constexpr,
                        epilogue_args, HALF: gl.constexpr, STAGING: gl.constexpr, SUB_H: gl.constexpr,
                        BLOCK_W: gl.constexpr):
    """Subtile j (channels [col0 + j * EPILOGUE_N, ...)) of a consumer's pixel rectangle: the
    generated epilogue (it reads scalars and per-channel vectors only: `rows` are positions in
    the rectangle, not pixel indices), the cast, and the rank-4 TMA store through the
    consumer's staging buffer j % STAGING."""
    layout: gl.constexpr = part.type.layout
    SUB_M: gl.constexpr = part.type.shape[0]
    EPILOGUE_N: gl.constexpr = part.type.shape[1]
    left = col0 + j * EPILOGUE_N
    rows = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
    cols = left + gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, layout))
    value = epilogue(part, rows, cols, image, pixels, filters, epilogue_args)
    c_buffer = c_buffers.index(HALF * STAGING + j % STAGING)
    tma.store_wait(pendings=STAGING - 1)  # the store that last used c_buffer has read it
    c_buffer.store(value.to(c_buffers.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [image, p0, q0, left], pixel_box(c_buffer, SUB_H, BLOCK_W))


@gluon.jit
def conv_mma_partition(a_ring, b_ring, ready, empty, c_buffers, y_ptr, images, out_h, out_w, filters, k_steps,
                       y_rows, y_cols, y_stride_n, y_stride_h, y_stride_w, epilogue: gl.constexpr, epilogue_args,  #
                       HALF: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr,
                       GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, EPILOGUE_N: gl.constexpr,
                       EPILOGUE_LOOP: gl.constexpr, B_K_MAJOR: gl.constexpr, OUT_STRIDE_H: gl.constexpr,
                       OUT_STRIDE_W: gl.constexpr):
    """Consumer HALF: rows [HALF * SUB_H, (HALF + 1) * SUB_H) of every pixel rectangle of the
    program, through library.cooperative_mainloop, then the epilogue in column subtiles, stored
    into phase (0, 0) of y [N, y_rows, y_cols, filters]: y itself where OUT_STRIDE is 1 (out_h,
    out_w are y_rows, y_cols), else every OUT_STRIDE-th pixel (a strided 1x1 dgrad's: out_h =
    ceil(y_rows / OUT_STRIDE_H), ...; the other phases are another launch's)."""
    SUB_H: gl.constexpr = BLOCK_H // CONSUMERS
    SUB_M: gl.constexpr = SUB_H * BLOCK_W
    SPLITS: gl.constexpr = BLOCK_N // EPILOGUE_N
    STAGING: gl.constexpr = staging_buffers(SPLITS)
    layout: gl.constexpr = accumulator_layout(SUB_M, BLOCK_N, a_ring.dtype)
    y_desc = phase_view(y_ptr, 0, 0, images, y_rows, y_cols, filters, y_stride_n, y_stride_h, y_stride_w, OUT_STRIDE_H,
                        OUT_STRIDE_W, SUB_H, BLOCK_W, EPILOGUE_N)
    pixels = images * out_h * out_w
    step = 0
    for tile in range(gl.program_id(0), tile_count(images, out_h, out_w, filters, BLOCK_H, BLOCK_W, BLOCK_N),
                      gl.num_programs(0)):
        image, p0, q0, pid_n = pixel_tile(tile, images, out_h, out_w, filters, BLOCK_H, BLOCK_W, BLOCK_N, GROUP_M)
        acc, step = cooperative_mainloop(a_ring, b_ring, ready, empty, step, k_steps, layout, HALF, CONSUMERS,
                                         B_K_MAJOR)
        parts = column_subtiles(acc, SPLITS)
        row0 = p0 + HALF * SUB_H
        if EPILOGUE_LOOP:
            for j in range(SPLITS):
                conv_finish_subtile(subtile_at(parts, j), j, y_desc, c_buffers, image, row0, q0, pid_n * BLOCK_N,
                                    pixels, filters, epilogue, epilogue_args, HALF, STAGING, SUB_H, BLOCK_W)
        else:
            for j in gl.static_range(SPLITS):
                conv_finish_subtile(parts[j], j, y_desc, c_buffers, image, row0, q0, pid_n * BLOCK_N, pixels,
                                    filters, epilogue, epilogue_args, HALF, STAGING, SUB_H, BLOCK_W)
    tma.store_wait(pendings=0)


@gluon.jit
def implicit_gemm(x_ptr, w_ptr, y_ptr, images, x_rows, x_cols, channels, x_stride_n, x_stride_h, x_stride_w, filters,
               taps_h, taps_w, w_stride_k, w_stride_r, w_stride_s, out_h, out_w, y_stride_n, y_stride_h, y_stride_w,
               pad_h, pad_w, dil_h, dil_w, y_rows, y_cols, epilogue: gl.constexpr, epilogue_args,  #
               BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, EPILOGUE_N: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, FLIP: gl.constexpr,
               EPILOGUE_LOOP: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, PHASED_H: gl.constexpr,
               PHASED_W: gl.constexpr, B_K_MAJOR: gl.constexpr, OUT_STRIDE_H: gl.constexpr,
               OUT_STRIDE_W: gl.constexpr):
    """The whole kernel body: the ring of [SUB_M, BLOCK_K] pixel tiles (one per consumer a
    slot) and filter tiles ([BLOCK_N, BLOCK_K] K-major, [BLOCK_K, BLOCK_N] row-major), its
    barriers, the staging buffers, and the partitions: CONSUMERS warpgroups (the first the
    default partition) and the producer."""
    gl.static_assert(STAGES >= 2)
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(gl.num_warps() == WARPGROUP_WARPS)
    gl.static_assert(BLOCK_H % CONSUMERS == 0)
    gl.static_assert(BLOCK_N // EPILOGUE_N == 1 or BLOCK_N // EPILOGUE_N == 2 or BLOCK_N // EPILOGUE_N == 4)
    SUB_M: gl.constexpr = BLOCK_H // CONSUMERS * BLOCK_W
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [STAGES * CONSUMERS, SUB_M, BLOCK_K], shared_layout([SUB_M, BLOCK_K], dtype))
    if B_K_MAJOR:
        b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], shared_layout([BLOCK_N, BLOCK_K], dtype))
    else:
        b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], shared_layout([BLOCK_K, BLOCK_N], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # the consumers that read a slot
    out_dtype: gl.constexpr = y_ptr.dtype.element_ty
    c_buffers = gl.allocate_shared_memory(out_dtype, [CONSUMERS * staging_buffers(BLOCK_N // EPILOGUE_N), SUB_M, EPILOGUE_N],
                                          shared_layout([SUB_M, EPILOGUE_N], out_dtype))
    k_steps = taps_h * taps_w * gl.cdiv(channels, BLOCK_K)
    # the partitions' argument tuples are written out in each call (a tuple held in a variable
    # would turn the epilogue function into a value)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (conv_mma_partition, (a_ring, b_ring, ready, empty, c_buffers, y_ptr, images, out_h, out_w, filters,
                                  k_steps, y_rows, y_cols, y_stride_n, y_stride_h, y_stride_w, held(epilogue),
                                  epilogue_args,
                                  gl.constexpr(0), BLOCK_H, BLOCK_W, BLOCK_N, GROUP_M, CONSUMERS, EPILOGUE_N,
                                  EPILOGUE_LOOP, B_K_MAJOR, OUT_STRIDE_H, OUT_STRIDE_W)),
            (conv_mma_partition, (a_ring, b_ring, ready, empty, c_buffers, y_ptr, images, out_h, out_w, filters,
                                  k_steps, y_rows, y_cols, y_stride_n, y_stride_h, y_stride_w, held(epilogue),
                                  epilogue_args,
                                  gl.constexpr(1), BLOCK_H, BLOCK_W, BLOCK_N, GROUP_M, CONSUMERS, EPILOGUE_N,
                                  EPILOGUE_LOOP, B_K_MAJOR, OUT_STRIDE_H, OUT_STRIDE_W)),
            (conv_load_partition, (x_ptr, w_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                                   x_stride_n, x_stride_h, x_stride_w, filters, taps_h, taps_w, w_stride_k,
                                   w_stride_r, w_stride_s, out_h, out_w, pad_h, pad_w, dil_h, dil_w, BLOCK_H,
                                   BLOCK_W, BLOCK_N, BLOCK_K, GROUP_M, CONSUMERS, FLIP, STRIDE_H, STRIDE_W,
                                   PHASED_H, PHASED_W, B_K_MAJOR)),
        ], [WARPGROUP_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (conv_mma_partition, (a_ring, b_ring, ready, empty, c_buffers, y_ptr, images, out_h, out_w, filters,
                                  k_steps, y_rows, y_cols, y_stride_n, y_stride_h, y_stride_w, held(epilogue),
                                  epilogue_args,
                                  gl.constexpr(0), BLOCK_H, BLOCK_W, BLOCK_N, GROUP_M, CONSUMERS, EPILOGUE_N,
                                  EPILOGUE_LOOP, B_K_MAJOR, OUT_STRIDE_H, OUT_STRIDE_W)),
            (conv_load_partition, (x_ptr, w_ptr, a_ring, b_ring, ready, empty, images, x_rows, x_cols, channels,
                                   x_stride_n, x_stride_h, x_stride_w, filters, taps_h, taps_w, w_stride_k,
                                   w_stride_r, w_stride_s, out_h, out_w, pad_h, pad_w, dil_h, dil_w, BLOCK_H,
                                   BLOCK_W, BLOCK_N, BLOCK_K, GROUP_M, CONSUMERS, FLIP, STRIDE_H, STRIDE_W,
                                   PHASED_H, PHASED_W, B_K_MAJOR)),
        ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))

