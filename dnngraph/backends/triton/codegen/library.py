"""Device functions of the fixed structure generated kernels share (imported as `lib`).

A generated kernel holds only what fusion changes; what every kernel of a family does the same
way lives here, as @triton.jit functions that Triton inlines into the caller (the same IR as the
text they replace, so the same loop structure, loads and dots). Like triton_math (`tm`) and
triton_reduce (`tr`), this module is imported by the generated source:

    from dnngraph.backends.triton.codegen import library as lib
"""
import triton
import triton.language as tl


@triton.jit
def tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile` (row-major over tiles_m x tiles_n) in grouped
    order: GROUP_M row tiles walk their columns together, so they share B's columns in L2.

    The order is tl.swizzle2d(tile // tiles_n, tile % tiles_n, tiles_m, tiles_n, GROUP_M)
    (tests/backends/test_library.py checks it); written on the flat index, it skips swizzle2d's
    round trip through (row, column) and back, the arithmetic the kernels ran before this helper."""
    group_size = GROUP_M * tiles_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_size) % rows_in_group
    pid_n = (tile % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def block_runs(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """(run_a, run_b): the run of blocks of BLOCK every row sees whole, [full_lo, full_hi)
    shrunk to block edges and clamped into [lo, hi] (lo on a block edge). An attention loop walks
    [lo, run_a) masked, [run_a, run_b) unmasked, [run_b, hi) masked."""
    run_a = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, lo), hi)
    run_b = tl.maximum(tl.minimum(full_hi // BLOCK * BLOCK, hi), run_a)
    return run_a, run_b


@triton.jit
def key_range(first_pos, last_pos, shift, len_q, len_kv, LEFT: tl.constexpr, RIGHT: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, IDLE_PAST_LEN_Q: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """(lo, hi, full_lo, full_hi) of a query tile whose rows sit at positions [first_pos,
    last_pos]: [lo, hi) bounds the keys any row sees (lo on a BLOCK_N edge), [full_lo, full_hi)
    the keys every row sees. Row i sees key j when j < len_kv and, where the mask has the bound,
    j >= i + shift - LEFT + 1 and j <= i + shift + RIGHT (LEFT/RIGHT ignored without HAS_LEFT/
    HAS_RIGHT). IDLE_PAST_LEN_Q: a tile whose rows all lie past len_q sees no key (hi = 0)."""
    lo = 0
    hi = len_kv
    full_lo = 0
    full_hi = len_kv
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_pos + 1 + shift + RIGHT)
        full_hi = tl.minimum(full_hi, first_pos + shift + RIGHT + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, first_pos + shift - LEFT + 1)
        full_lo = tl.maximum(lo, last_pos + shift - LEFT + 1)
    hi = tl.maximum(hi, 0)
    if IDLE_PAST_LEN_Q:
        hi = tl.where(first_pos < len_q, hi, 0)
    lo = tl.minimum(lo, hi) // BLOCK_N * BLOCK_N
    return lo, hi, full_lo, full_hi


@triton.jit
def query_range(first_key, shift, len_q, len_kv, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, hi, full_lo, full_hi) of the key block [first_key, first_key + BLOCK_N), the
    transpose of key_range's rule: [lo, hi) bounds the queries that see any of its keys (lo on a
    BLOCK_M edge), [full_lo, full_hi) those that see every one of them (none when the block
    passes len_kv)."""
    q_lo = 0
    q_hi = len_q
    full_lo = 0
    full_hi = len_q
    if HAS_RIGHT:
        q_lo = tl.maximum(q_lo, first_key - shift - RIGHT)
        full_lo = tl.maximum(q_lo, first_key + BLOCK_N - 1 - shift - RIGHT)
    if HAS_LEFT:
        q_hi = tl.minimum(q_hi, first_key + BLOCK_N - 1 + LEFT - shift)
        full_hi = tl.minimum(full_hi, first_key + LEFT - shift)
    full_hi = tl.where(first_key + BLOCK_N <= len_kv, full_hi, 0)
    q_hi = tl.maximum(q_hi, 0)
    lo = tl.minimum(tl.maximum(q_lo, 0), q_hi) // BLOCK_M * BLOCK_M
    return lo, q_hi, full_lo, full_hi


@triton.jit
def expert_rows(offsets_ptr, offsets_stride, expert, experts, rows):
    """(start, end) of `expert`'s token rows: first_token_offset[expert] up to the next expert's
    (T for the last), each clamped into [0, T] and the end to at least the start, so offsets
    that decrease or pass T never send a load or store outside the tensors."""
    start = tl.load(offsets_ptr + expert * offsets_stride).to(tl.int64)
    following = tl.minimum(expert + 1, experts - 1)
    next_start = tl.load(offsets_ptr + following * offsets_stride).to(tl.int64)
    end = tl.where(expert + 1 < experts, next_start, rows)
    start = tl.minimum(tl.maximum(start, 0), rows)
    end = tl.maximum(tl.minimum(end, rows), start)
    return start, end


@triton.jit
def expert_tile(slot, offsets_ptr, offsets_stride, experts, rows, BLOCK_M: tl.constexpr):
    """(expert, first_row, end_row) of row tile `slot` of a grouped GEMM: the experts' row
    ranges cut into BLOCK_M tiles and numbered in expert order, read from the offsets on the
    device (no host sync). A slot past the last tile gets first_row == end_row (no rows)."""
    expert = tl.zeros([], dtype=tl.int64)
    first_row = tl.zeros([], dtype=tl.int64)
    end_row = tl.zeros([], dtype=tl.int64)
    tiles_before = tl.zeros([], dtype=tl.int64)
    for candidate in range(0, experts):
        start, end = expert_rows(offsets_ptr, offsets_stride, candidate, experts, rows)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (slot >= tiles_before) & (slot < tiles_before + tiles)
        expert = tl.where(hit, candidate, expert)
        first_row = tl.where(hit, start + (slot - tiles_before) * BLOCK_M, first_row)
        end_row = tl.where(hit, end, end_row)
        tiles_before += tiles
    return expert, first_row, end_row


@triton.jit
def load_bits(base_ptr, offsets, mask):
    """The booleans at element `offsets` of a bit-packed tensor at byte pointer `base_ptr`
    (dtypes.bool_bit_packed: bit offset % 8 of byte offset // 8, least significant first)."""
    byte = tl.load(base_ptr + (offsets >> 3), mask=mask, other=0).to(tl.int32)
    return ((byte >> (offsets & 7).to(tl.int32)) & 1) != 0


@triton.jit
def load_bit_runs(pointer, mask):
    """The booleans of the bytes at `pointer` ([..., 1]: runs of 8 elements of a bit-packed
    tensor, each a whole byte) as a [..., 8] tile: one byte load per run, its bits taken apart
    by the thread that loaded it."""
    byte = tl.load(pointer, mask=mask, other=0).to(tl.int32)
    return ((byte >> tl.arange(0, 8)[None, None, :]) & 1) != 0


@triton.jit
def store_bit_runs(pointer, values, mask):
    """Store the predicates `values` under `mask` (both [BLOCK_R, BLOCK_C // 8, 8] tiles, or
    `values` broadcast to it) into the bytes at `pointer` ([BLOCK_R, BLOCK_C // 8, 1]: runs of 8
    elements of a bit-packed tensor, each a whole byte: the column axis has stride 1 and a run
    starts on a byte, as the schedule and the layout rule see to it): each
    run packs into its byte inside the thread holding it. The program owns every byte it
    touches, so a byte of which the mask covers only some bits (a row's last partial byte, bits
    past the tensor's extent) is read, and its other bits kept, in this one read-modify-write:
    no other program writes that byte."""
    weights = 1 << tl.arange(0, 8)[None, None, :]
    covered = tl.sum(mask.to(tl.int32) * weights, axis=2, keep_dims=True)
    packed = tl.sum((values & mask).to(tl.int32) * weights, axis=2, keep_dims=True)
    partial = (covered != 0) & (covered != 255)
    prior = tl.load(pointer, mask=partial, other=0).to(tl.int32)
    tl.store(pointer, ((prior & (255 - covered)) | packed).to(tl.uint8), mask=covered != 0)


@triton.jit
def store_lone_bits(base_ptr, offsets, values, mask):
    """Store the predicates `values` under `mask` at element `offsets` of a bit-packed tensor
    whose stored elements each sit alone in their byte (column and row strides multiples of 8,
    as a packed axis of extent 1 leaves them): each lane reads its byte, sets or clears its bit
    and keeps the others (padding) in one read-modify-write; no other lane or program writes it."""
    pointer = base_ptr + (offsets >> 3)
    bit = 1 << (offsets & 7).to(tl.int32)
    prior = tl.load(pointer, mask=mask, other=0).to(tl.int32)
    tl.store(pointer, tl.where(values, prior | bit, prior & (255 - bit)).to(tl.uint8), mask=mask)


@triton.jit
def reduction_major_copy(src_ptr, dst_ptr, REDUCED, COLUMNS, LINES, src_reduced, src_column, src_tap_0, src_tap_1,
                         src_tap_2, tap_size_1, tap_size_2, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """dst[line * REDUCED + r] = src at (reduced r, column c, taps t_0, t_1, t_2) for a filter
    staged reduction-major: line = ((t_0 * tap_size_1 + t_1) * tap_size_2 + t_2) * COLUMNS + c
    of LINES = COLUMNS x taps, the reduced axis contiguous in dst. One program copies a
    [BLOCK_L, BLOCK_R] tile (lines along axis 0 of the grid, reduced values along axis 1): read
    along the source's own layout, written along the reduced axis (Triton converts the tile's
    layout between the two through shared memory)."""
    lines = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    reduced = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    column = lines % COLUMNS
    tap = lines // COLUMNS
    tap_2 = tap % tap_size_2
    tap = tap // tap_size_2
    line_offsets = column * src_column + (tap // tap_size_1) * src_tap_0 + (tap % tap_size_1) * src_tap_1 \
        + tap_2 * src_tap_2
    mask = (lines < LINES)[:, None] & (reduced < REDUCED)[None, :]
    tile = tl.load(src_ptr + line_offsets[:, None] + reduced[None, :] * src_reduced, mask=mask)
    tl.store(dst_ptr + lines[:, None] * REDUCED + reduced[None, :], tile, mask=mask)



@triton.jit
def _input_coordinate(pixel_axis, tap, STRIDE: tl.constexpr, PADDING: tl.constexpr, DILATION: tl.constexpr,
                      FILTER_BASE: tl.constexpr, FILTER_STEP: tl.constexpr):
    """Where output pixel `pixel_axis` reads its input along one axis at filter tap `tap`."""
    return pixel_axis * STRIDE - PADDING + (FILTER_BASE + FILTER_STEP * tap) * DILATION


@triton.jit
def pixel_major_gather(src_ptr, dst_ptr, CHANNELS, PIXELS, PIXELS_PAD, src_n, src_c, src_s0, src_s1, src_s2,
                       out_0, out_1, out_2, in_0, in_1, in_2, taps_1, taps_2,
                       STRIDE_0: tl.constexpr, STRIDE_1: tl.constexpr, STRIDE_2: tl.constexpr,
                       PADDING_0: tl.constexpr, PADDING_1: tl.constexpr, PADDING_2: tl.constexpr,
                       DILATION_0: tl.constexpr, DILATION_1: tl.constexpr, DILATION_2: tl.constexpr,
                       FILTER_BASE_0: tl.constexpr, FILTER_BASE_1: tl.constexpr, FILTER_BASE_2: tl.constexpr,
                       FILTER_STEP_0: tl.constexpr, FILTER_STEP_1: tl.constexpr, FILTER_STEP_2: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """dst[(tap * CHANNELS + c) * PIXELS_PAD + p] = src[n, c, input of pixel p at the tap] (0 where
    the tap lands in the padding): an operand of a convolution's wgrad gathered pixel-major, the
    reduction contiguous. Pixel p < PIXELS = N x out_0 x out_1 x out_2 decomposes as (n, o_0, o_1,
    o_2), the tap (program axis 2) as (t_0, t_1, t_2) over (., taps_1, taps_2); a rank below 3
    pads the spatial axes in front with size 1 and stride 0. One program moves [BLOCK_C, BLOCK_P]:
    read along the source's layout, written along the pixels (Triton converts the layout)."""
    tap = tl.program_id(2)
    tap_2 = tap % taps_2
    tap_1 = (tap // taps_2) % taps_1
    tap_0 = tap // (taps_2 * taps_1)
    pixels = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    o_2 = pixels % out_2
    rest = pixels // out_2
    o_1 = rest % out_1
    rest = rest // out_1
    o_0 = rest % out_0
    n = rest // out_0
    i_0 = _input_coordinate(o_0, tap_0, STRIDE_0, PADDING_0, DILATION_0, FILTER_BASE_0, FILTER_STEP_0)
    i_1 = _input_coordinate(o_1, tap_1, STRIDE_1, PADDING_1, DILATION_1, FILTER_BASE_1, FILTER_STEP_1)
    i_2 = _input_coordinate(o_2, tap_2, STRIDE_2, PADDING_2, DILATION_2, FILTER_BASE_2, FILTER_STEP_2)
    inside = (i_0 >= 0) & (i_0 < in_0) & (i_1 >= 0) & (i_1 < in_1) & (i_2 >= 0) & (i_2 < in_2)
    in_pixels = pixels < PIXELS
    in_channels = channels < CHANNELS
    pixel_offsets = n * src_n + i_0 * src_s0 + i_1 * src_s1 + i_2 * src_s2
    tile = tl.load(src_ptr + channels[:, None] * src_c + pixel_offsets[None, :],
                   mask=in_channels[:, None] & (in_pixels & inside)[None, :], other=0.0)
    lines = tap * CHANNELS + channels
    tl.store(dst_ptr + lines[:, None] * PIXELS_PAD + pixels[None, :], tile,
             mask=in_channels[:, None] & in_pixels[None, :])
