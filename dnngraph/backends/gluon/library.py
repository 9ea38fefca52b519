"""The fixed structure of the Gluon backend's matmul kernel (Hopper, sm_90a), as @gluon.jit
device functions. A generated kernel (codegen.py) renders only its signature and its fused
epilogue, and calls matmul() below with them.

    C[b] = epilogue(A[b] @ B[b] * scale_a * scale_b)      A [batch, M, K] (K contiguous), B [batch, K, N]

- B is row-major (N contiguous: the ring holds [BLOCK_K, BLOCK_N] tiles) or K-major (B_K_MAJOR:
  K contiguous, B^T [batch, N, K] dense; the ring holds [BLOCK_N, BLOCK_K] tiles, loaded through a
  descriptor over that [N, K] view, and wgmma reads them through the transposed view
  `permute((1, 0))`). fp8 (e4m3, e5m2) operands take K-major B only: wgmma reads both fp8
  operands K-major from shared memory.
- Per-tensor scales (SCALE_A, SCALE_B: one-element tensors, fp8 dequantization) are loaded once
  per consumer partition and multiply the fp32 accumulator before the fused epilogue.

- Persistent: one program per SM at most; program p takes tiles p, p + programs, ... of the
  batch x tiles_m x tiles_n tile space. Within a batch, tiles run in grouped order (GROUP_M rows
  of tiles share their B column tiles in L2).
- Warp specialized: a 1-warp producer partition issues the TMA loads of A and B tiles into a
  STAGES-deep shared-memory ring; each slot has a `ready` mbarrier (the producer expects its
  bytes) and an `empty` mbarrier (each consumer that reads the slot arrives once its wgmma has
  read it).
- Cooperative (the default schedule): CONSUMERS (1 or 2) 4-warp warpgroups each own
  BLOCK_M // CONSUMERS rows of every tile: they wait for a slot, issue an async wgmma (one in
  flight), release the previous slot, and run the epilogue: accumulator -> fused epilogue (the
  generated function) -> cast -> store, in column subtiles of EPILOGUE_N walked by a loop (the
  epilogue's code in the kernel once) or unrolled (EPILOGUE_LOOP; finish_tile). The store goes
  through shared memory and TMA where the output is dense and aligned (TMA_STORE), else through
  masked pointer stores.
- Ping-pong (PINGPONG): two consumer warpgroups each own WHOLE tiles (all BLOCK_M rows):
  consumer 0 the program's even tiles (its 0th, 2nd, ...), consumer 1 the odd ones, so one
  consumer's epilogue runs while the other's mainloop keeps the tensor cores busy. The producer
  loads the tiles in the program's order, one A block of BLOCK_M rows a slot; each slot is read
  by one consumer, so `empty` counts one arrival. Two `order` mbarriers make the mainloops take
  turns (pingpong_partition says how, and why the phases hold).
- Batched operands take rank-3 device-side TMA descriptors ([batch, rows, cols], a block of one
  batch), which keep each batch's rows and columns bounded (out-of-bounds reads are zeros); an
  operand shared by every batch (batch stride 0) takes a rank-2 descriptor.

The kernel takes plain pointers, sizes and strides: its descriptors are made on the device
(Triton places them in the launch's global scratch, which the runtime provides).
"""
import triton.language as tl
from dnngraph.backends.triton.codegen import triton_math as tm
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

WARPGROUP_WARPS = gl.constexpr(4)


@gluon.constexpr_function
def shared_layout(block_shape, dtype):
    """The swizzled shared-memory layout a TMA copy and a wgmma both read, for `block_shape`."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


@gluon.constexpr_function
def accumulator_layout(rows, cols, operand_dtype=None):
    """The wgmma accumulator layout of one 4-warp warpgroup holding a [rows, cols] fp32 tile:
    warps along M, the widest instruction N (a multiple of 8, at most 256) dividing `cols`; the
    instruction's K is 32 bytes of the operands (16 for 16-bit types, 32 for fp8)."""
    n = min(256, cols)
    while cols % n != 0:
        n -= 8
    k = 256 // (operand_dtype.primitive_bitwidth if operand_dtype is not None else 16)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


@gluon.constexpr_function
def held(function):
    """`function` (a jit function) kept as a constexpr, so it can ride in a partition's tuple of
    arguments (warp_specialize passes those on as values)."""
    return gl.constexpr(function)


@gluon.jit
def tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """(batch, tile row, tile column) of linear tile `tile`: batch outermost, then grouped order."""
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    local = tile - batch * per_batch
    in_group = GROUP_M * tiles_n
    first_m = (local // in_group) * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local % size_m)
    pid_n = (local % in_group) // size_m
    return batch, pid_m, pid_n


@gluon.jit
def operand_descriptor(base, batch_count, rows, cols, batch_stride, row_stride, BLOCK_R: gl.constexpr,
                       BLOCK_C: gl.constexpr, BATCHED: gl.constexpr):
    """A device-side TMA descriptor of a row-major operand (column stride 1): rank 3 with a
    block of one batch where BATCHED, else rank 2."""
    if BATCHED:
        layout: gl.constexpr = shared_layout([1, BLOCK_R, BLOCK_C], base.dtype.element_ty)
        return tma.make_tensor_descriptor(base, [batch_count, rows, cols], [batch_stride, row_stride, 1],
                                          [1, BLOCK_R, BLOCK_C], layout)
    else:
        layout: gl.constexpr = shared_layout([BLOCK_R, BLOCK_C], base.dtype.element_ty)
        return tma.make_tensor_descriptor(base, [rows, cols], [row_stride, 1], [BLOCK_R, BLOCK_C], layout)


@gluon.jit
def _rank3(buffer):
    """A [R, C] shared buffer viewed as [1, R, C], the block of a rank-3 descriptor (the same
    bytes: the swizzle runs over the rows alike)."""
    R: gl.constexpr = buffer.type.shape[0]
    C: gl.constexpr = buffer.type.shape[1]
    return buffer._reinterpret(buffer.dtype, [1, R, C], shared_layout([1, R, C], buffer.dtype))


@gluon.jit
def copy_in(desc, batch, row, col, barrier, buffer, BATCHED: gl.constexpr):
    """TMA load of the block at (batch, row, col) into `buffer`, completing on `barrier`."""
    if BATCHED:
        tma.async_copy_global_to_shared(desc, [batch, row, col], barrier, _rank3(buffer))
    else:
        tma.async_copy_global_to_shared(desc, [row, col], barrier, buffer)


@gluon.jit
def load_partition(a_ptr, b_ptr, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row, a_ring, b_ring, ready,
                   empty, M, N, K, batch_count,  #
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   A_PARTS: gl.constexpr, BATCHED_A: gl.constexpr, BATCHED_B: gl.constexpr,
                   B_K_MAJOR: gl.constexpr):
    """The producer (one warp): for each of the program's tiles and each K step, wait for the
    slot to be empty, then load the tile's A rows (in A_PARTS blocks of BLOCK_M // A_PARTS rows:
    one a cooperative consumer, or one whole block in ping-pong) and B's block into it. It makes the
    descriptors it loads through itself: a device-side descriptor is acquired (the tensormap
    proxy fence) only by the warps that make it, and this partition's warps run none of the
    default partition's code."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    SUB_M: gl.constexpr = BLOCK_M // A_PARTS
    a_desc = operand_descriptor(a_ptr, batch_count, M, K, a_stride_batch, a_stride_row, SUB_M, BLOCK_K, BATCHED_A)
    # B over [K, N] (row-major, blocks [BLOCK_K, BLOCK_N]) or over the [N, K] view of a K-major B
    # (blocks [BLOCK_N, BLOCK_K]); b_stride_row is the stride between that view's rows
    if B_K_MAJOR:
        b_desc = operand_descriptor(b_ptr, batch_count, N, K, b_stride_batch, b_stride_row, BLOCK_N, BLOCK_K,
                                    BATCHED_B)
    else:
        b_desc = operand_descriptor(b_ptr, batch_count, K, N, b_stride_batch, b_stride_row, BLOCK_K, BLOCK_N,
                                    BATCHED_B)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    tiles = tiles_m * tiles_n * batch_count
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        batch, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_steps):
            slot = step % STAGES
            # a fresh barrier counts as having completed the phase before its first: the first
            # pass through the ring does not wait
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            barrier = ready.index(slot)
            mbarrier.expect(barrier, A_PARTS * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for half in gl.static_range(A_PARTS):
                copy_in(a_desc, batch, pid_m * BLOCK_M + half * SUB_M, kk * BLOCK_K, barrier,
                        a_ring.index(slot * A_PARTS + half), BATCHED_A)
            if B_K_MAJOR:
                copy_in(b_desc, batch, pid_n * BLOCK_N, kk * BLOCK_K, barrier, b_ring.index(slot), BATCHED_B)
            else:
                copy_in(b_desc, batch, kk * BLOCK_K, pid_n * BLOCK_N, barrier, b_ring.index(slot), BATCHED_B)
            step += 1


@gluon.jit
def b_operand(b_ring, slot, B_K_MAJOR: gl.constexpr):
    """The slot's B tile as wgmma takes it, [BLOCK_K, BLOCK_N]: a K-major tile ([BLOCK_N,
    BLOCK_K] in shared memory) through its transposed view."""
    if B_K_MAJOR:
        return b_ring.index(slot).permute((1, 0))
    else:
        return b_ring.index(slot)


@gluon.jit
def load_scale(scale_ptr, PRESENT: gl.constexpr):
    """A per-tensor scale (one element) as fp32, or 1.0 where there is none."""
    if PRESENT:
        return gl.load(scale_ptr).to(gl.float32)
    else:
        return 1.0


@gluon.jit
def scaled(acc, scale_a, scale_b, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr):
    """acc * scale_a * scale_b (each where the matmul has it; multiplied in that order, as the
    reference does)."""
    if SCALE_A:
        acc = acc * scale_a
    if SCALE_B:
        acc = acc * scale_b
    return acc


@gluon.jit
def store_tile(value, c_desc, c_buffer, c_ptr, batch, rows, cols, row0, col0, M, N, c_stride_batch, c_stride_row,
               c_stride_col, TMA_STORE: gl.constexpr, BATCHED_C: gl.constexpr, PENDING: gl.constexpr):
    """Store one [SUB_M, EPILOGUE_N] subtile (already cast): through shared memory and TMA
    (clipped to the output's bounds by the descriptor), or by masked pointer stores. PENDING:
    how many earlier TMA stores may still be reading staging buffers (the others' count)."""
    if TMA_STORE:
        tma.store_wait(pendings=PENDING)  # the store that last used c_buffer has read it
        c_buffer.store(value)
        fence_async_shared()
        if BATCHED_C:
            tma.async_copy_shared_to_global(c_desc, [batch, row0, col0], _rank3(c_buffer))
        else:
            tma.async_copy_shared_to_global(c_desc, [row0, col0], c_buffer)
    else:
        row_offsets = gl.expand_dims(rows.to(gl.int64) * c_stride_row, 1)
        col_offsets = gl.expand_dims(cols.to(gl.int64) * c_stride_col, 0)
        mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
        pointers = c_ptr + batch.to(gl.int64) * c_stride_batch + row_offsets + col_offsets
        gl.store(pointers, value, mask=mask)


@gluon.constexpr_function
def staging_buffers(splits):
    """Staging buffers per consumer for TMA stores: two alternating where a tile has subtiles
    (a subtile is written while the one before it is still being stored), else one."""
    return 2 if splits > 1 else 1


@gluon.jit
def split_columns(tile):
    """The left and right column halves of a [R, C] register tile (no data moves: each thread
    keeps its own elements, in the layouts the reshape and split infer)."""
    R: gl.constexpr = tile.type.shape[0]
    C: gl.constexpr = tile.type.shape[1]
    halves = gl.permute(gl.reshape(tile, [R, 2, C // 2]), (0, 2, 1))
    return gl.split(halves)


@gluon.jit
def column_subtiles(acc, SPLITS: gl.constexpr):
    """The SPLITS (1, 2 or 4) column subtiles of a consumer's accumulator, left to right, as a
    tuple (split_columns: no data moves)."""
    if SPLITS == 1:
        return (acc, )
    elif SPLITS == 2:
        return split_columns(acc)
    else:
        gl.static_assert(SPLITS == 4)
        left, right = split_columns(acc)
        first, second = split_columns(left)
        third, fourth = split_columns(right)
        return (first, second, third, fourth)


@gluon.jit
def subtile_at(parts, j):
    """parts[j] for a runtime (warp-uniform) j: a branch per subtile, each moving one subtile's
    registers into the loop's, where selects would touch every subtile's."""
    part = parts[0]
    if len(parts) == 2:
        if j == 1:
            part = parts[1]
    elif len(parts) == 4:
        if j == 1:
            part = parts[1]
        elif j == 2:
            part = parts[2]
        elif j == 3:
            part = parts[3]
    return part


@gluon.jit
def finish_subtile(part, j, c_desc, c_buffers, c_ptr, batch, row0, col0, M, N, c_stride_batch, c_stride_row,
                   c_stride_col, epilogue: gl.constexpr, epilogue_args, HALF: gl.constexpr, STAGING: gl.constexpr,
                   TMA_STORE: gl.constexpr, BATCHED_C: gl.constexpr):
    """The epilogue of subtile j (columns [col0 + j * EPILOGUE_N, ...)) of a consumer's rows:
    the generated `epilogue(acc, rows, cols, batch, M, N, epilogue_args)`, the cast to the
    output's type and the store. Subtile j stages through the consumer's buffer j % STAGING
    (j a constant where the subtiles are unrolled, a loop counter where they loop)."""
    layout: gl.constexpr = part.type.layout
    SUB_M: gl.constexpr = part.type.shape[0]
    EPILOGUE_N: gl.constexpr = part.type.shape[1]
    left = col0 + j * EPILOGUE_N
    rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
    cols = left + gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, layout))
    value = epilogue(part, rows, cols, batch, M, N, epilogue_args)
    if TMA_STORE:
        c_buffer = c_buffers.index(HALF * STAGING + j % STAGING)
    else:
        c_buffer = c_buffers.index(HALF)  # unused: a placeholder
    store_tile(value.to(c_ptr.dtype.element_ty), c_desc, c_buffer, c_ptr, batch, rows, cols, row0, left, M, N,
               c_stride_batch, c_stride_row, c_stride_col, TMA_STORE, BATCHED_C, STAGING - 1)


@gluon.jit
def finish_tile(acc, c_desc, c_buffers, c_ptr, batch, row0, col0, M, N, c_stride_batch, c_stride_row, c_stride_col,
                epilogue: gl.constexpr, epilogue_args, HALF: gl.constexpr, SPLITS: gl.constexpr,
                TMA_STORE: gl.constexpr, BATCHED_C: gl.constexpr, LOOP: gl.constexpr):
    """The epilogue of a consumer's accumulator in SPLITS (1, 2 or 4) column subtiles, one
    after another: a subtile's temporaries die before the next one's, so the epilogue needs
    registers for a subtile beside the accumulator, not a second accumulator. The TMA store of
    a subtile runs while the next one is computed (two staging buffers alternate).

    LOOP: the subtiles in a loop, so the epilogue's code (a GELU: ~15 instructions an element)
    is in the kernel once, not SPLITS times: fewer instruction-cache misses in a consumer's
    epilogue, at the price of the whole accumulator live through the loop and a subtile's
    registers moved per step. Else unrolled (each subtile's registers free once it is stored)."""
    STAGING: gl.constexpr = staging_buffers(SPLITS)
    parts = column_subtiles(acc, SPLITS)
    if LOOP:
        for j in range(SPLITS):
            finish_subtile(subtile_at(parts, j), j, c_desc, c_buffers, c_ptr, batch, row0, col0, M, N,
                           c_stride_batch, c_stride_row, c_stride_col, epilogue, epilogue_args, HALF, STAGING,
                           TMA_STORE, BATCHED_C)
    else:
        for j in gl.static_range(SPLITS):
            finish_subtile(parts[j], j, c_desc, c_buffers, c_ptr, batch, row0, col0, M, N, c_stride_batch,
                           c_stride_row, c_stride_col, epilogue, epilogue_args, HALF, STAGING, TMA_STORE, BATCHED_C)


@gluon.jit
def a_operand(a_ring, index, A_M_MAJOR: gl.constexpr):
    """A block `index` of the ring as wgmma takes it, [SUB_M, BLOCK_K]: an M-major block
    ([BLOCK_K, SUB_M] in shared memory, M contiguous: a convolution wgrad's dy) through its
    transposed view (16-bit types only: wgmma reads fp8 A K-major)."""
    if A_M_MAJOR:
        return a_ring.index(index).permute((1, 0))
    else:
        return a_ring.index(index)


@gluon.jit
def cooperative_mainloop(a_ring, b_ring, ready, empty, step, k_steps, layout: gl.constexpr, HALF: gl.constexpr,
                         CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr, A_M_MAJOR: gl.constexpr = False):
    """(accumulator, next ring step) of one tile's rows of consumer HALF: ring steps step, ...,
    step + k_steps - 1 (k_steps >= 1), each reading A block slot * CONSUMERS + HALF of the slot.
    Async wgmma (one in flight), each slot released to the producer once the wgmma reading it has
    completed. Whatever the producer loaded (matmul blocks, convolution taps, wgrad's pixels) the
    consumer reads alike."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    SUB_M: gl.constexpr = a_ring.type.shape[2] if A_M_MAJOR else a_ring.type.shape[1]
    BLOCK_N: gl.constexpr = b_ring.type.shape[1] if B_K_MAJOR else b_ring.type.shape[2]
    acc = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=layout)
    for kk in range(k_steps):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_operand(a_ring, slot * CONSUMERS + HALF, A_M_MAJOR), b_operand(b_ring, slot, B_K_MAJOR),
                            acc, use_acc=kk > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # the wgmma of the step before has completed: its slot goes back to the producer
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
    return acc, step


@gluon.jit
def mma_partition(a_ring, b_ring, ready, empty, c_buffers, c_ptr, M, N, K, batch_count,  #
                  c_stride_batch, c_stride_row, c_stride_col, epilogue: gl.constexpr, epilogue_args,  #
                  HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, TMA_STORE: gl.constexpr,
                  BATCHED_C: gl.constexpr, EPILOGUE_N: gl.constexpr, scale_a_ptr, scale_b_ptr,
                  B_K_MAJOR: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, EPILOGUE_LOOP: gl.constexpr):
    """One consumer warpgroup: rows [HALF * SUB_M, (HALF + 1) * SUB_M) of every tile of the
    program. Async wgmma over the ring (one in flight; the slot before it is released), then
    the epilogue in column subtiles of EPILOGUE_N (finish_tile)."""
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    layout: gl.constexpr = accumulator_layout(SUB_M, BLOCK_N, a_ring.dtype)
    if TMA_STORE:  # made by the warps that store through it (as the producer makes its own)
        c_desc = operand_descriptor(c_ptr, batch_count, M, N, c_stride_batch, c_stride_row, SUB_M, EPILOGUE_N,
                                    BATCHED_C)
    else:
        c_desc = 0
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    tiles = tiles_m * tiles_n * batch_count
    scale_a = load_scale(scale_a_ptr, SCALE_A)  # once per partition
    scale_b = load_scale(scale_b_ptr, SCALE_B)
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        batch, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc, step = cooperative_mainloop(a_ring, b_ring, ready, empty, step, k_steps, layout, HALF, CONSUMERS,
                                         B_K_MAJOR)
        row0 = pid_m * BLOCK_M + HALF * SUB_M
        acc = scaled(acc, scale_a, scale_b, SCALE_A, SCALE_B)
        finish_tile(acc, c_desc, c_buffers, c_ptr, batch, row0, pid_n * BLOCK_N, M, N, c_stride_batch, c_stride_row,
                    c_stride_col, epilogue, epilogue_args, HALF, BLOCK_N // EPILOGUE_N, TMA_STORE, BATCHED_C,
                    EPILOGUE_LOOP)
    if TMA_STORE:
        tma.store_wait(pendings=0)


# -- the ping-pong schedule -------------------------------------------------------------------------

@gluon.jit
def pingpong_mainloop(a_ring, b_ring, ready, empty, order, t, k_steps, layout: gl.constexpr, HALF: gl.constexpr,
                      B_K_MAJOR: gl.constexpr):
    """The accumulator of the program's t-th tile (this consumer's), over its ring steps
    t * k_steps, ...: async wgmma (one in flight), each slot released to the producer once its
    wgmma has completed. Started once the other consumer's mainloop of tile t - 1 is done; its
    own done (the last wgmma issued), it lets the other consumer start tile t + 1."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    BLOCK_M: gl.constexpr = a_ring.type.shape[1]
    BLOCK_N: gl.constexpr = b_ring.type.shape[1] if B_K_MAJOR else b_ring.type.shape[2]
    # tile t - 1 was the other consumer's ((t - 1) // 2)-th mainloop (counting from 0): the
    # phase of that parity of order[HALF] (see pingpong_partition)
    mbarrier.wait(order.index(HALF), ((t - 1) // 2) & 1, pred=t > 0)
    step = t * k_steps
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    for kk in range(k_steps):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(slot), b_operand(b_ring, slot, B_K_MAJOR), acc, use_acc=kk > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        step += 1
    mbarrier.arrive(order.index(1 - HALF), count=1)  # every ready wait of tile t is passed
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
    return acc


@gluon.jit
def pingpong_partition(a_ring, b_ring, ready, empty, order, c_buffers, c_ptr, M, N, K, batch_count,  #
                       c_stride_batch, c_stride_row, c_stride_col, epilogue: gl.constexpr, epilogue_args,  #
                       HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr, BATCHED_C: gl.constexpr,
                       EPILOGUE_N: gl.constexpr, scale_a_ptr, scale_b_ptr, B_K_MAJOR: gl.constexpr,
                       SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, EPILOGUE_LOOP: gl.constexpr):
    """Ping-pong consumer HALF (0 or 1): the program's tiles t = HALF, HALF + 2, ... (t counts
    the program's tiles from 0), whole: mainloop, then the epilogue in column subtiles through
    this consumer's own staging buffers (finish_tile's HALF).

    Why the phases hold. order[h] is arrived on (count 1) by consumer 1 - h when it has passed
    every ready wait of one of its tiles; its j-th arrival (from 0) ends mainloop j of that
    consumer, the mainloop of tile t - 1 where j = (t - 1) // 2 (for either consumer), so
    consumer h waits for the phase of parity j & 1 before tile t (none before tile 0). That
    phase is never aliased: arrival j + 1 needs tile t + 1's mainloop, which waits for this one,
    and arrivals before j have been waited for (at tile t - 2), so j or j + 1 phases are done.
    The ready waits keep their parity too: when tile t starts, every ring step before t * k_steps
    has been waited for (by tile t - 1's consumer, whose mainloop has ended, or earlier), so no
    slot is two phases behind a wait; the producer cannot run ahead of a slot's release, so none
    is two phases ahead. Each slot is read by one consumer: `empty` counts one arrival, and a
    slot's releases come in its order (a slot is refilled only after its release). A program of
    one tile leaves consumer 1 idle; an odd count leaves consumer 0's last arrival unawaited."""
    layout: gl.constexpr = accumulator_layout(BLOCK_M, BLOCK_N, a_ring.dtype)
    if TMA_STORE:  # made by the warps that store through it (as the producer makes its own)
        c_desc = operand_descriptor(c_ptr, batch_count, M, N, c_stride_batch, c_stride_row, BLOCK_M, EPILOGUE_N,
                                    BATCHED_C)
    else:
        c_desc = 0
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    programs = gl.num_programs(0)
    first = gl.program_id(0)
    scale_a = load_scale(scale_a_ptr, SCALE_A)  # once per partition
    scale_b = load_scale(scale_b_ptr, SCALE_B)
    t = HALF
    for tile in range(first + HALF * programs, tiles_m * tiles_n * batch_count, 2 * programs):
        batch, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc = pingpong_mainloop(a_ring, b_ring, ready, empty, order, t, k_steps, layout, HALF, B_K_MAJOR)
        acc = scaled(acc, scale_a, scale_b, SCALE_A, SCALE_B)
        finish_tile(acc, c_desc, c_buffers, c_ptr, batch, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, c_stride_batch,
                    c_stride_row, c_stride_col, epilogue, epilogue_args, HALF, BLOCK_N // EPILOGUE_N, TMA_STORE,
                    BATCHED_C, EPILOGUE_LOOP)
        t += 2
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def pingpong(a_ptr, b_ptr, c_ptr, M, N, K, batch_count, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row,
             c_stride_batch, c_stride_row, c_stride_col, epilogue: gl.constexpr, epilogue_args, a_ring, b_ring,
             ready, empty, c_buffers,  #
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             BATCHED_A: gl.constexpr, BATCHED_B: gl.constexpr, BATCHED_C: gl.constexpr, TMA_STORE: gl.constexpr,
             EPILOGUE_N: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, scale_a_ptr,
             scale_b_ptr, B_K_MAJOR: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
             EPILOGUE_LOOP: gl.constexpr):
    """The ping-pong partitions over the ring: the two consumers (the default partition is
    consumer 0) and the producer, with the consumers' order barriers (one arrival a phase)."""
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    gl.warp_specialize([
        (pingpong_partition, (a_ring, b_ring, ready, empty, order, c_buffers, c_ptr, M, N, K, batch_count,
                              c_stride_batch, c_stride_row, c_stride_col, held(epilogue), epilogue_args,
                              gl.constexpr(0), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_STORE, BATCHED_C, EPILOGUE_N,
                              scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B, EPILOGUE_LOOP)),
        (pingpong_partition, (a_ring, b_ring, ready, empty, order, c_buffers, c_ptr, M, N, K, batch_count,
                              c_stride_batch, c_stride_row, c_stride_col, held(epilogue), epilogue_args,
                              gl.constexpr(1), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_STORE, BATCHED_C, EPILOGUE_N,
                              scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B, EPILOGUE_LOOP)),
        (load_partition, (a_ptr, b_ptr, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row, a_ring,
                          b_ring, ready, empty, M, N, K, batch_count, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                          gl.constexpr(1), BATCHED_A, BATCHED_B, B_K_MAJOR)),
    ], [WARPGROUP_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(2):
        mbarrier.invalidate(order.index(i))


@gluon.jit
def matmul(a_ptr, b_ptr, c_ptr, M, N, K, batch_count, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row,
           c_stride_batch, c_stride_row, c_stride_col, epilogue: gl.constexpr, epilogue_args,  #
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
           GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, BATCHED_A: gl.constexpr, BATCHED_B: gl.constexpr,
           BATCHED_C: gl.constexpr, TMA_STORE: gl.constexpr, EPILOGUE_N: gl.constexpr, PRODUCER_REGS: gl.constexpr,
           CONSUMER_REGS: gl.constexpr, scale_a_ptr, scale_b_ptr, B_K_MAJOR: gl.constexpr, SCALE_A: gl.constexpr,
           SCALE_B: gl.constexpr, PINGPONG: gl.constexpr = False, EPILOGUE_LOOP: gl.constexpr = False):
    """The whole kernel body: the ring and its barriers, the partitions (each makes the
    descriptors it copies through). PINGPONG: the ping-pong schedule (two consumers of whole
    tiles), else the cooperative one."""
    gl.static_assert(STAGES >= 2)
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(CONSUMERS == 2 or not PINGPONG)
    gl.static_assert(gl.num_warps() == WARPGROUP_WARPS)
    gl.static_assert(BLOCK_N // EPILOGUE_N == 1 or BLOCK_N // EPILOGUE_N == 2 or BLOCK_N // EPILOGUE_N == 4)
    A_PARTS: gl.constexpr = 1 if PINGPONG else CONSUMERS  # A blocks a ring slot
    SUB_M: gl.constexpr = BLOCK_M // A_PARTS  # a consumer's rows of a tile
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [STAGES * A_PARTS, SUB_M, BLOCK_K],
                                       shared_layout([SUB_M, BLOCK_K], dtype))
    if B_K_MAJOR:  # B^T's [BLOCK_N, BLOCK_K] tiles (wgmma reads them transposed)
        b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], shared_layout([BLOCK_N, BLOCK_K], dtype))
    else:
        b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], shared_layout([BLOCK_K, BLOCK_N], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=A_PARTS)  # the consumers that read a slot
    out_dtype: gl.constexpr = c_ptr.dtype.element_ty
    if TMA_STORE:  # per consumer: one staging buffer, or two alternating where the tile has subtiles
        c_buffers = gl.allocate_shared_memory(out_dtype, [CONSUMERS * staging_buffers(BLOCK_N // EPILOGUE_N), SUB_M, EPILOGUE_N],
                                              shared_layout([SUB_M, EPILOGUE_N], out_dtype))
    else:
        c_buffers = gl.allocate_shared_memory(out_dtype, [CONSUMERS, 8, 8], shared_layout([8, 8], out_dtype))
    # the partitions' argument tuples are written out in each call: a tuple held in a variable
    # would turn the epilogue function into a value
    if PINGPONG:
        pingpong(a_ptr, b_ptr, c_ptr, M, N, K, batch_count, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row,
                 c_stride_batch, c_stride_row, c_stride_col, epilogue, epilogue_args, a_ring, b_ring, ready, empty,
                 c_buffers, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BATCHED_A, BATCHED_B, BATCHED_C, TMA_STORE,
                 EPILOGUE_N, PRODUCER_REGS, CONSUMER_REGS, scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B,
                 EPILOGUE_LOOP)
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (mma_partition, (a_ring, b_ring, ready, empty, c_buffers, c_ptr, M, N, K, batch_count,
                             c_stride_batch, c_stride_row, c_stride_col, held(epilogue), epilogue_args,
                             gl.constexpr(0), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, CONSUMERS, TMA_STORE,
                             BATCHED_C, EPILOGUE_N, scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B,
                             EPILOGUE_LOOP)),
            (mma_partition, (a_ring, b_ring, ready, empty, c_buffers, c_ptr, M, N, K, batch_count,
                             c_stride_batch, c_stride_row, c_stride_col, held(epilogue), epilogue_args,
                             gl.constexpr(1), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, CONSUMERS, TMA_STORE,
                             BATCHED_C, EPILOGUE_N, scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B,
                             EPILOGUE_LOOP)),
            (load_partition, (a_ptr, b_ptr, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row, a_ring,
                              b_ring, ready, empty, M, N, K, batch_count, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              CONSUMERS, BATCHED_A, BATCHED_B, B_K_MAJOR)),
        ], [WARPGROUP_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (mma_partition, (a_ring, b_ring, ready, empty, c_buffers, c_ptr, M, N, K, batch_count,
                             c_stride_batch, c_stride_row, c_stride_col, held(epilogue), epilogue_args,
                             gl.constexpr(0), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, CONSUMERS, TMA_STORE,
                             BATCHED_C, EPILOGUE_N, scale_a_ptr, scale_b_ptr, B_K_MAJOR, SCALE_A, SCALE_B,
                             EPILOGUE_LOOP)),
            (load_partition, (a_ptr, b_ptr, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row, a_ring,
                              b_ring, ready, empty, M, N, K, batch_count, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              CONSUMERS, BATCHED_A, BATCHED_B, B_K_MAJOR)),
        ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# -- the epilogue's math: the Triton backend's own device functions (its formulas, so both
# -- backends round alike), called from Gluon code --------------------------------------------
sigmoid = tl.sigmoid  # what the Triton backend's expression table calls
tanh = tm.tanh
gelu = tm.gelu
gelu_tanh = tm.gelu_tanh
gelu_fast = tm.gelu_fast  # for outputs stored in 16 bits (codegen.FAST_MATH)
gelu_tanh_fast = tm.gelu_tanh_fast
