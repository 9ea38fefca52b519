"""The fixed structure of the Gluon backend's attention forward kernel (Hopper, sm_90a), as
@gluon.jit device functions. A generated kernel (attention_codegen.py) renders only its
signature and calls attention() below.

    o[b, h] = softmax(q[b, h] k[b, h // G]^T * scale, masked) v[b, h // G]     G = H / H_kv
    stats[b, h, i] = log(sum_j exp(scale * q_i . k_j))   (natural log, -inf where no key is seen)

q, k, v, o are [B, H, S, D] with the last axis contiguous (any other strides TMA takes: 16-byte
multiples); D is 64 or 128 (the same for q, k and v); q, k, v and o share one 16-bit type.

- One program per (query block of BLOCK_M = 128 rows, batch x head): grid (cdiv(Sq, 128), B * H).
  Each partition makes the rank-2 TMA descriptors it copies through, over its (batch, head)'s
  [S, D] matrix, so a block past S reads zeros and a store past Sq is clipped.
- Warp specialized: a 1-warp producer loads Q once (two [64, D] halves on the `q_ready`
  barrier) and then the K and V blocks the program visits into a STAGES-deep ring: each slot of
  K (and of V) has a `ready` barrier (count 1: the producer's expect, completed by the TMA
  bytes) and an `empty` barrier (count 2: each consumer arrives once when its wgmma has read
  the slot). Block j takes slot j % STAGES, phase (j // STAGES) & 1; the producer waits `empty`
  at the opposite phase (a fresh barrier counts as having completed the phase before its first).
- Two 4-warp consumer warpgroups, 64 query rows each, share the ring. Per key block j: issue
  S_j = Q K_j^T (async wgmma) and then O += P_{j-1} V_{j-1} (async wgmma, P from registers),
  wait for S_j alone, release K_j, run the online softmax of block j in fp32 on the CUDA cores
  while P_{j-1} V_{j-1} runs on the tensor cores, then wait for it, release V_{j-1} and rescale O.
  Scores are in base 2: the scale times log2(e) is one positive constexpr, applied to the row
  max and inside p = exp2(qk * QK_SCALE - m) (one fused multiply-add per score, as FA3 does).
- Ping-pong (PINGPONG): the two consumers take turns issuing their wgmmas, one key block's
  (S_j and P_{j-1} V_{j-1}) a turn, consumer 0 first, through two `order` mbarriers (count 1:
  order[h] is arrived on by consumer 1 - h after each of its issues), so one consumer's softmax
  runs while the other's matrix products hold the tensor cores (FA3's inter-warpgroup overlap).
  Both consumers of a program visit the same key blocks, so they issue equally often (count + 1
  times: block 0's S alone, then one turn per block, then the last P V); consumer 0 waits for
  the other's issue i - 1 before its issue i, consumer 1 for consumer 0's issue i, at parity
  i & 1 of the barrier. That phase is never aliased: the arrival after it needs the issue this
  wait guards.
- Masks: key j is visible to query i when j <= i + shift (CAUSAL: a right bound; shift is the
  bound plus 0 top left or Skv - Sq bottom right) and j >= i + window_shift (WINDOW: a left
  bound, a sliding window or band; window_shift = the alignment's offset - left bound + 1). A
  program visits only the key blocks [lo, hi) some row of it sees (`key_blocks`: blocks past
  its last row's right bound or before its first row's left bound are never loaded); blocks
  every row sees whole, [full_lo, full_hi), take no mask arithmetic; the others (the diagonal
  blocks and the last, partial one) mask keys past Skv and outside the bounds. The ring counts
  the program's blocks from lo. A row that sees no key has m = -inf and l = 0: its o is 0, its
  stats -inf.
- The end: o = acc / l cast to the input type, staged in the consumer's own Q buffer (its last
  reader, the final S wgmma, has completed) and stored by TMA; the stats by masked pointer
  stores of rows < Sq.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from dnngraph.backends.gluon.library import accumulator_layout, shared_layout

WARPGROUP_WARPS = gl.constexpr(4)
CONSUMERS = gl.constexpr(2)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def head_descriptor(base, batch, head, batch_stride, head_stride, rows, row_stride, BLOCK_R: gl.constexpr,
                    COLS: gl.constexpr):
    """A device-side TMA descriptor over one (batch, head)'s [rows, COLS] matrix (column stride
    1), in blocks of [BLOCK_R, COLS]."""
    layout: gl.constexpr = shared_layout([BLOCK_R, COLS], base.dtype.element_ty)
    start = base + batch.to(gl.int64) * batch_stride + head.to(gl.int64) * head_stride
    return tma.make_tensor_descriptor(start, [rows, COLS], [row_stride, 1], [BLOCK_R, COLS], layout)


@gluon.jit
def key_blocks(first_row, s_kv, shift, window_shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(lo, full_lo, full_hi, hi): the program (query rows [first_row, first_row + BLOCK_M))
    visits key blocks [lo, hi); every row of it sees every key of blocks [full_lo, full_hi).
    Row i sees keys j <= i + shift (CAUSAL: a right bound) and j >= i + window_shift (WINDOW: a
    left bound), j < Skv."""
    last_row = first_row + BLOCK_M - 1
    if CAUSAL:
        seen_end = min(s_kv, max(last_row + 1 + shift, 0))  # keys below it: the last row sees some
        whole_end = min(s_kv, max(first_row + 1 + shift, 0))  # keys below it: the first row sees all
    else:
        seen_end = s_kv
        whole_end = s_kv
    if WINDOW:
        seen_start = min(s_kv, max(first_row + window_shift, 0))  # keys from it: the first row sees some
        whole_start = min(s_kv, max(last_row + window_shift, 0))  # keys from it: the last row sees all
    else:
        seen_start = 0
        whole_start = 0
    lo = seen_start // BLOCK_N
    hi = max((seen_end + BLOCK_N - 1) // BLOCK_N, lo)  # no block where no row sees a key
    full_lo = (whole_start + BLOCK_N - 1) // BLOCK_N
    full_hi = max(whole_end // BLOCK_N, full_lo)
    return lo, full_lo, full_hi, hi


@gluon.jit
def needs_mask(block, full_lo, full_hi):
    """Whether key block `block` holds a key some row of the program does not see."""
    return (block < full_lo) | (block >= full_hi)


@gluon.jit
def program_head(HEADS_ARG, group):
    """(batch, query head, key/value head) of this program."""
    bh = gl.program_id(1)
    batch = bh // HEADS_ARG
    head = bh - batch * HEADS_ARG
    return batch, head, head // group


@gluon.jit
def attention_load_partition(q_ptr, k_ptr, v_ptr, q_strides, k_strides, v_strides, q_ring, k_ring, v_ring, q_ready,
                             k_ready, v_ready, k_empty, v_empty, s_q, s_kv, heads, group, shift, window_shift,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """The producer (one warp): Q's two halves once, then K and V block by block into the ring."""
    STAGES: gl.constexpr = k_ring.type.shape[0]
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    batch, head, kv_head = program_head(heads, group)
    q_desc = head_descriptor(q_ptr, batch, head, q_strides[0], q_strides[1], s_q, q_strides[2], SUB_M, HEAD_DIM)
    k_desc = head_descriptor(k_ptr, batch, kv_head, k_strides[0], k_strides[1], s_kv, k_strides[2], BLOCK_N,
                             HEAD_DIM)
    v_desc = head_descriptor(v_ptr, batch, kv_head, v_strides[0], v_strides[1], s_kv, v_strides[2], BLOCK_N,
                             HEAD_DIM)
    first_row = gl.program_id(0) * BLOCK_M
    mbarrier.expect(q_ready.index(0), CONSUMERS * q_desc.block_type.nbytes)
    for half in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [first_row + half * SUB_M, 0], q_ready.index(0), q_ring.index(half))
    lo, _, _, hi = key_blocks(first_row, s_kv, shift, window_shift, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    for j in range(hi - lo):  # the program's j-th block, key block lo + j, takes slot j % STAGES
        slot = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1  # the first pass through the ring does not wait
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [(lo + j) * BLOCK_N, 0], k_ready.index(slot), k_ring.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [(lo + j) * BLOCK_N, 0], v_ready.index(slot), v_ring.index(slot))


@gluon.jit
def block_scores(qk, rows, start, masked, s_kv, shift, window_shift, CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """The block's raw scores q . k; where `masked`, keys past Skv, (CAUSAL) right of the right
    bound and (WINDOW) left of the left bound are -inf (the scale, positive, keeps them -inf)."""
    if masked:
        BLOCK_N: gl.constexpr = qk.type.shape[1]
        cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
        visible = gl.expand_dims(cols < s_kv, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        if WINDOW:
            visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + window_shift, 1))
        qk = gl.where(visible, qk, float("-inf"))
    return qk


@gluon.jit
def online_softmax(qk, m_i, l_i, QK_SCALE: gl.constexpr):
    """(p, alpha, m, l) of one block of raw scores: the running max and sum in base 2 (scores
    times QK_SCALE = scale * log2(e), positive, so the max of the scaled scores is the scaled max
    and p = exp2(qk * QK_SCALE - m) is one fused multiply-add and an exp2 per score); a row
    that has seen no key yet (max -inf) subtracts 0, so its p and alpha are 0, not NaN."""
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * QK_SCALE)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * QK_SCALE - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def take_turn(order, issue, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: before this consumer's issue `issue` (its wgmmas of one key block, counted
    from 0), wait until the other consumer has issued its own issue `issue - 1` (consumer 1) or
    `issue` (consumer 0 goes first: none before its issue 0)."""
    if PINGPONG:
        if HALF == 0:
            mbarrier.wait(order.index(0), (issue - 1) & 1, pred=issue > 0)
        else:
            mbarrier.wait(order.index(1), issue & 1)


@gluon.jit
def pass_turn(order, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this consumer's wgmmas of one key block are issued; the other may issue its own."""
    if PINGPONG:
        mbarrier.arrive(order.index(1 - HALF), count=1)


@gluon.jit
def attention_mma_partition(q_ring, k_ring, v_ring, q_ready, k_ready, v_ready, k_empty, v_empty, order, o_ptr,
                            stats_ptr, o_strides, stats_strides, s_q, s_kv, heads, group, shift, window_shift,
                            HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                            STATS: gl.constexpr, QK_SCALE: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup: query rows [HALF * 64, HALF * 64 + 64) of the program's block."""
    STAGES: gl.constexpr = k_ring.type.shape[0]
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    dtype: gl.constexpr = q_ring.dtype
    s_layout: gl.constexpr = accumulator_layout(SUB_M, BLOCK_N)
    o_layout: gl.constexpr = accumulator_layout(SUB_M, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    batch, head, kv_head = program_head(heads, group)
    first_row = gl.program_id(0) * BLOCK_M
    row0 = first_row + HALF * SUB_M
    rows = row0 + gl.arange(0, SUB_M, layout=row_layout)
    lo, full_lo, full_hi, hi = key_blocks(first_row, s_kv, shift, window_shift, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    count = hi - lo  # the program's block j is key block lo + j, in ring slot j % STAGES
    q = q_ring.index(HALF)
    zero = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=s_layout)
    acc = gl.zeros((SUB_M, HEAD_DIM), dtype=gl.float32, layout=o_layout)
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([SUB_M], 0.0, gl.float32, layout=row_layout)
    mbarrier.wait(q_ready.index(0), 0)
    if count > 0:
        # block 0: its scores alone
        mbarrier.wait(k_ready.index(0), 0)
        take_turn(order, 0, HALF, PINGPONG)
        qk = warpgroup_mma(q, k_ring.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        pass_turn(order, HALF, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        scores = block_scores(qk, rows, lo * BLOCK_N, needs_mask(lo, full_lo, full_hi), s_kv, shift, window_shift,
                              CAUSAL, WINDOW)
        p, alpha, m_i, l_i = online_softmax(scores, m_i, l_i, QK_SCALE)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, count):
            slot = j % STAGES
            before = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            take_turn(order, j, HALF, PINGPONG)
            qk = warpgroup_mma(q, k_ring.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(before), ((j - 1) // STAGES) & 1)
            p_before = p16
            acc = warpgroup_mma(p_before, v_ring.index(before), acc, is_async=True)
            pass_turn(order, HALF, PINGPONG)
            qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S_j done; P_{j-1} V_{j-1} may run on
            mbarrier.arrive(k_empty.index(slot), count=1)
            scores = block_scores(qk, rows, (lo + j) * BLOCK_N, needs_mask(lo + j, full_lo, full_hi), s_kv, shift,
                                  window_shift, CAUSAL, WINDOW)
            p, alpha, m_i, l_i = online_softmax(scores, m_i, l_i, QK_SCALE)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            # the wgmma reads P_{j-1} from registers until it completes: it stays a dependency
            acc, p_before = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_before))
            mbarrier.arrive(v_empty.index(before), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        last = (count - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((count - 1) // STAGES) & 1)
        take_turn(order, count, HALF, PINGPONG)
        acc = warpgroup_mma(p16, v_ring.index(last), acc, is_async=True)
        pass_turn(order, HALF, PINGPONG)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(last), count=1)
    l_use = gl.where(l_i == 0.0, 1.0, l_i)
    if STATS:
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_use)) / LOG2E)
        offsets = (batch.to(gl.int64) * stats_strides[0] + head.to(gl.int64) * stats_strides[1] +
                   rows.to(gl.int64) * stats_strides[2])
        gl.store(stats_ptr + offsets, lse, mask=rows < s_q)
    out = acc / gl.expand_dims(gl.convert_layout(l_use, gl.SliceLayout(1, o_layout)), 1)
    o_desc = head_descriptor(o_ptr, batch, head, o_strides[0], o_strides[1], s_q, o_strides[2], SUB_M, HEAD_DIM)
    q.store(out.to(dtype))  # the last wgmma reading this Q buffer has completed
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, 0], q)
    tma.store_wait(pendings=0)


@gluon.jit
def attention(q_ptr, k_ptr, v_ptr, o_ptr, stats_ptr, q_strides, k_strides, v_strides, o_strides, stats_strides, s_q,
              s_kv, heads, group, shift, window_shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              STATS: gl.constexpr, QK_SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
              PINGPONG: gl.constexpr):
    """The whole kernel body: Q's buffers, the K/V ring and the barriers, then the partitions.
    The strides are (batch, head, row) tuples in elements."""
    gl.static_assert(STAGES >= 2)
    gl.static_assert(gl.num_warps() == WARPGROUP_WARPS)
    gl.static_assert(BLOCK_M == 128)
    SUB_M: gl.constexpr = BLOCK_M // CONSUMERS
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_ring = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB_M, HEAD_DIM], shared_layout([SUB_M, HEAD_DIM], dtype))
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], shared_layout([BLOCK_N, HEAD_DIM], dtype))
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], shared_layout([BLOCK_N, HEAD_DIM], dtype))
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(order.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    gl.warp_specialize([
        (attention_mma_partition, (q_ring, k_ring, v_ring, q_ready, k_ready, v_ready, k_empty, v_empty, order,
                                   o_ptr, stats_ptr, o_strides, stats_strides, s_q, s_kv, heads, group, shift,
                                   window_shift, gl.constexpr(0), BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, WINDOW,
                                   STATS, QK_SCALE, PINGPONG)),
        (attention_mma_partition, (q_ring, k_ring, v_ring, q_ready, k_ready, v_ready, k_empty, v_empty, order,
                                   o_ptr, stats_ptr, o_strides, stats_strides, s_q, s_kv, heads, group, shift,
                                   window_shift, gl.constexpr(1), BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, WINDOW,
                                   STATS, QK_SCALE, PINGPONG)),
        (attention_load_partition, (q_ptr, k_ptr, v_ptr, q_strides, k_strides, v_strides, q_ring, k_ring, v_ring,
                                    q_ready, k_ready, v_ready, k_empty, v_empty, s_q, s_kv, heads, group, shift,
                                    window_shift, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, WINDOW)),
    ], [WARPGROUP_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(q_ready.index(0))
    for i in gl.static_range(CONSUMERS):
        mbarrier.invalidate(order.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
