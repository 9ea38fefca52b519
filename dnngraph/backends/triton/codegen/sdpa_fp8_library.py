"""Device library of fp8 attention (ops/sdpa_fp8.py), imported by generated kernels as `fp8a`.

The kernels have nothing to fuse, so their structure is fixed here and a generated kernel is one
call with the group's pointers, strides and constexprs. Scores are in base 2 (scale * log2(e)),
every product runs on fp8 operands with float32 accumulation, and each quantization point
converts as torch does (tm.to_float8 with the encodings conversions.py reads from torch):

* forward, one program per (query tile, batch, head): a first walk over the keys takes each
  row's log-sum-exp; a second recomputes the scores, P = exp2(s - lse) is the softmax's true
  value (no running max: its rounding to fp8 depends on no tiling), and acc += fp8(P * scale_s)
  v. amax_s (per row: exp2(max score - lse)) and amax_o are max-reduced over the tile, then
  atomically into the output. Each walk (and the dQ kernel's) runs the key blocks every row
  sees whole without the mask, then the rest (the causal diagonal, the keys' ragged end) with it.
* P and dS feed dots only, so where torch's encodings of overflow and infinity are what the
  hardware's satfinite conversion gives (e4m3fn in recent torch) or P * scale_s cannot reach the
  range's end, they convert with that instruction alone (quantize_operand,
  quantize_probabilities): a NaN's sign, the one difference, reaches no output through a dot.
* backward, as the bf16 kernels (codegen/sdpa.py): a dK/dV program per key block walks the
  query tiles of every query head of its group; a dQ program per query tile walks its keys
  (and takes amax_dP = max |dS|, each (query, key) pair being seen there once). delta =
  rowsum(o dO) is taken once by a launch before them (row_deltas) and read by both. P is
  rounded to q's fp8 type, dS to dO's.

Why two walks in the forward: the op rounds P at its normalized value (the frontend's graph and
our reference: amax_s is max P, and P * scale_s is what reaches fp8). A one-walk kernel would
round exp(s - running max) * scale_s, whose fp8 rounding depends on the tiling and on the
running max, so its results would differ from the reference by P's rounding (~3% per element)
rather than by accumulation order. The first walk is QK^T, a max and a sum only (no v, no PV
dot): about a third of the forward's tensor-core work. Conversions to fp8 are the hardware's
(cvt.rn.satfinite on sm_90) with torch's overflow, infinity and NaN encodings selected after
(tm.to_float8): no software rounding.

Amaxes: a non-negative float32's bits order like int32, so the tile's max is an integer max of
|x|'s bits and the atomic an int32 max on the output's bits (zeroed by a launch before): NaN,
whose magnitude's bits exceed inf's, wins, as torch's amax propagates it.

Operands of tl.dot are K-major (the fp8 wgmma of sm_90 reads its shared-memory operands with the
reduced axis contiguous). k is loaded [D, keys] straight from memory, D being contiguous. A dot
that reduces over keys or query rows (P v, dS k, P^T dO, dS^T q) needs its operand with the keys
or rows contiguous, which no row-major tensor gives: read from the tensor itself, the compiler
loaded it synchronously into registers and wrote it to shared memory byte by byte every
iteration (no cp.async pipelining). So the group first copies v (forward), k, q and dO
(backward) to keys-minor buffers [B, H, D, S padded to 16] (`keys_minor_copy`), and those dots
read them, pipelined like k.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import library as lib
from . import triton_math as tm

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def zero_amax(first_ptr, second_ptr, third_ptr, fourth_ptr, COUNT: tl.constexpr):
    """Zero COUNT (2 or 4) amax outputs: the atomics of the kernels after it max into them."""
    tl.store(first_ptr, 0.0)
    tl.store(second_ptr, 0.0)
    if COUNT > 2:
        tl.store(third_ptr, 0.0)
        tl.store(fourth_ptr, 0.0)


@triton.jit
def keys_minor_copy(src_ptr, dst_ptr, src_s0, src_s1, src_s2, src_s3, HEADS, ROWS, ROWS_PAD,
                    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """dst[b, h, w, r] = src[b, h, r, w] for one tile of rows of one (batch, head): dst is
    contiguous [B, HEADS, WIDTH, ROWS_PAD], the rows contiguous (ROWS_PAD a multiple of 16, so
    every line starts 16-byte aligned for cp.async); the padding is never read unmasked."""
    pid_bh = tl.program_id(1)
    batch = (pid_bh // HEADS).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    in_rows = rows < ROWS
    in_cols = cols < WIDTH
    tile = tl.load(src_ptr + batch * src_s0 + (pid_bh % HEADS) * src_s1 + rows[:, None] * src_s2
                   + cols[None, :] * src_s3, mask=in_rows[:, None] & in_cols[None, :], other=0.0)
    dst_base = dst_ptr + pid_bh.to(tl.int64) * WIDTH * ROWS_PAD
    tl.store(dst_base + cols[:, None] * ROWS_PAD + rows[None, :], tl.trans(tile),
             mask=in_cols[:, None] & in_rows[None, :])


@triton.jit
def magnitude_bits(values, keep):
    """The int32 bits of |values| where `keep`, 0 elsewhere (a non-negative float's bits order
    as the float; NaN's exceed inf's)."""
    return tl.where(keep, tl.abs(values), 0.0).to(tl.int32, bitcast=True)


@triton.jit
def amax_into(amax_ptr, bits):
    """Max-reduce the int32 magnitude bits of a tile into the float32 amax at amax_ptr."""
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(tl.ravel(bits), 0))


@triton.jit
def quantize(x, FP8: tl.constexpr, RULE: tl.constexpr):
    """float32 x to fp8 type FP8 as torch converts; RULE = (first overflow, overflow, infinity,
    NaN encodings, saturates) of that type (conversions.float8_rule, codegen rule_literal)."""
    return tm.to_float8(x, FP8, RULE[0], RULE[1], RULE[2], RULE[3])


@triton.jit
def quantize_operand(x, FP8: tl.constexpr, RULE: tl.constexpr):
    """quantize(x) for a dot operand (dS): where torch saturates overflow and infinity (RULE[4]),
    the hardware's satfinite conversion alone is torch's but for a NaN's sign, which no product
    keeps; otherwise the full correction."""
    if RULE[4]:
        rounded = x.to(FP8)
    else:
        rounded = quantize(x, FP8, RULE)
    return rounded


# P <= 1 up to exp2's approximation (a few ulps), so |P * scale_s| <= |scale_s| * P_BOUND
P_BOUND = tl.constexpr(1.0078125)


@triton.jit
def quantize_probabilities(scaled, scale_s, FP8: tl.constexpr, RULE: tl.constexpr):
    """quantize(P * scale_s) for a dot operand: quantize_operand's, and besides, where |scale_s| *
    P_BOUND stays below the type's first overflow (one uniform test per tile), no value can
    overflow, so the hardware conversion alone is torch's (a NaN stays NaN; its sign, which only
    the encoding torch would give keeps, reaches no output through a dot)."""
    if RULE[4]:
        rounded = scaled.to(FP8)
    elif tl.abs(scale_s) * P_BOUND < RULE[0]:
        rounded = scaled.to(FP8)
    else:
        rounded = quantize(scaled, FP8, RULE)
    return rounded


@triton.jit
def store_as(ptr, offsets, values, mask, IS_FP8: tl.constexpr, RULE: tl.constexpr):
    """Store float32 `values` in the pointer's type as torch's `.to` would put them there."""
    if IS_FP8:
        tl.store(ptr + offsets, quantize(values, ptr.dtype.element_ty, RULE), mask=mask)
    else:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scores(q_tile, k_cols, qk_scale, rows, keys, SKV, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Base-2 scores of q_tile [M, D] against k_cols [D, N] (K-major), -inf where not visible
    (MASKED False: a block every row sees whole, whose mask the compiler then drops)."""
    scores = tl.dot(q_tile, k_cols) * qk_scale
    visible = (keys < SKV)[None, :] & (rows >= 0)[:, None]
    if CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    return scores, visible


@triton.jit
def _gradient_terms(scores, lse, d_probs, delta, visible, SCALE: tl.constexpr, MASKED: tl.constexpr):
    """(P, dS) of a block of base-2 scores, exactly 0 at the pairs the mask hides: a NaN in
    stats, or in dO v^T at a hidden pair, stays out of them whatever the tiling (MASKED False: a
    block every row sees whole)."""
    probs = tl.math.exp2(scores - lse)
    d_scores = probs * (d_probs - delta) * SCALE
    if MASKED:
        probs = tl.where(visible, probs, 0.0)
        d_scores = tl.where(visible, d_scores, 0.0)
    return probs, d_scores


@triton.jit
def _key_end(first_row, SQ, SKV, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of the keys any row of a query tile starting at first_row sees (the bf16
    kernels' rule, lib.key_range: causal is a right bound of 0, top-left)."""
    _, hi, _, _ = lib.key_range(first_row, first_row + BLOCK_M - 1, 0, SQ, SKV, 0, 0, False, CAUSAL, False, BLOCK_N)
    return hi


@triton.jit
def _full_key_end(first_row, SQ, SKV, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of the key blocks that every row of a query tile starting at first_row sees whole
    (lib.key_range's full range, on a BLOCK_N edge): those blocks need no mask."""
    _, _, _, full_hi = lib.key_range(first_row, first_row + BLOCK_M - 1, 0, SQ, SKV, 0, 0, False, CAUSAL, False,
                                     BLOCK_N)
    return full_hi // BLOCK_N * BLOCK_N


@triton.jit
def _row_statistics(m_i, l_i, q_tile, k_base, k_s2, k_s3, qk_scale, rows, start, end, SKV, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """(running max, running sum of exp2(score - max)) of the rows over key blocks [start, end)."""
    cols_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k_cols = tl.load(k_base + keys[None, :] * k_s2 + cols_d[:, None] * k_s3,
                         mask=(keys < SKV)[None, :] & (cols_d < HEAD_DIM)[:, None], other=0.0)
        scores, _ = _scores(q_tile, k_cols, qk_scale, rows, keys, SKV, CAUSAL, MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(scores - m_use[:, None]), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _probabilities_times_values(acc, q_tile, k_base, v_t_base, k_s2, k_s3, v_t_s2, v_t_s3, qk_scale, lse, scale_s,
                                rows, start, end, SKV, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                                HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, P_RULE: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """acc + fp8(P * scale_s) v over key blocks [start, end), P exactly normalized (lse)."""
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k_cols = tl.load(k_base + keys[None, :] * k_s2 + cols_d[:, None] * k_s3,
                         mask=(keys < SKV)[None, :] & (cols_d < HEAD_DIM)[:, None], other=0.0)
        scores, _ = _scores(q_tile, k_cols, qk_scale, rows, keys, SKV, CAUSAL, MASKED)
        probs = tl.math.exp2(scores - lse[:, None])
        v_cols = tl.load(v_t_base + keys[None, :] * v_t_s3 + cols_dv[:, None] * v_t_s2,
                         mask=(keys < SKV)[None, :] & (cols_dv < VALUE_DIM)[:, None], other=0.0)
        acc += tl.dot(quantize_probabilities(probs * scale_s, scale_s, q_tile.dtype, P_RULE), tl.trans(v_cols))
    return acc


@triton.jit
def _first_query(first_key, SQ, SKV, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first query tile that sees any key of the block starting at first_key (lib.query_range)."""
    lo, _, _, _ = lib.query_range(first_key, 0, SQ, SKV, 0, 0, False, CAUSAL, BLOCK_M, BLOCK_N)
    return lo


@triton.jit
def _query_program(HEADS, GROUP, SQ, BLOCK_M: tl.constexpr):
    """(batch as int64, head, its k/v head, query rows, rows inside SQ) of a program over grid
    (query tiles, batch * heads)."""
    pid_bh = tl.program_id(1)
    head = pid_bh % HEADS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return (pid_bh // HEADS).to(tl.int64), head, head // GROUP, rows, rows < SQ


@triton.jit
def forward(q_ptr, k_ptr, v_t_ptr, o_ptr, stats_ptr, descale_q_ptr, descale_k_ptr, descale_v_ptr, descale_s_ptr,
            scale_s_ptr, scale_o_ptr, amax_s_ptr, amax_o_ptr,
            q_s0, q_s1, q_s2, q_s3, k_s0, k_s1, k_s2, k_s3, v_t_s0, v_t_s1, v_t_s2, v_t_s3, o_s0, o_s1, o_s2,
            o_s3, stats_s0, stats_s1, stats_s2, HEADS, GROUP, SQ, SKV,
            SCALE: tl.constexpr, CAUSAL: tl.constexpr, HAS_STATS: tl.constexpr, HEAD_DIM: tl.constexpr,
            VALUE_DIM: tl.constexpr, P_RULE: tl.constexpr, O_FP8: tl.constexpr, O_RULE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """o, stats, amax_s and amax_o of one query tile of one (batch, head); v_t is v keys-minor
    ([B, Hkv, Dv, keys]: keys_minor_copy)."""
    batch, head, kv_head, rows, row_in = _query_program(HEADS, GROUP, SQ, BLOCK_M)
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    q_tile = tl.load(q_ptr + batch.to(tl.int64) * q_s0 + head * q_s1 + rows[:, None] * q_s2 + cols_d[None, :] * q_s3,
                     mask=row_in[:, None] & (cols_d < HEAD_DIM)[None, :], other=0.0)
    k_base = k_ptr + batch.to(tl.int64) * k_s0 + kv_head * k_s1
    v_t_base = v_t_ptr + batch.to(tl.int64) * v_t_s0 + kv_head * v_t_s1
    qk_scale = tl.load(descale_q_ptr) * tl.load(descale_k_ptr) * (SCALE * LOG2E)
    scale_s = tl.load(scale_s_ptr)
    key_end = _key_end(tl.program_id(0) * BLOCK_M, SQ, SKV, CAUSAL, BLOCK_M, BLOCK_N)
    # blocks before full_end are seen whole by every row: their loop runs without the mask
    full_end = _full_key_end(tl.program_id(0) * BLOCK_M, SQ, SKV, CAUSAL, BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i = _row_statistics(m_i, l_i, q_tile, k_base, k_s2, k_s3, qk_scale, rows, 0, full_end, SKV, CAUSAL,
                               False, HEAD_DIM, BLOCK_N, BLOCK_D)
    m_i, l_i = _row_statistics(m_i, l_i, q_tile, k_base, k_s2, k_s3, qk_scale, rows, full_end, key_end, SKV, CAUSAL,
                               True, HEAD_DIM, BLOCK_N, BLOCK_D)
    # every row inside SQ sees key 0 (top-left causal), so l_i == 0 means its scores are all -inf:
    # lse = -inf and P = exp2(-inf + inf) = NaN, as torch's softmax of such a row
    lse = m_i + tl.math.log2(l_i)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc = _probabilities_times_values(acc, q_tile, k_base, v_t_base, k_s2, k_s3, v_t_s2, v_t_s3, qk_scale, lse,
                                      scale_s, rows, 0, full_end, SKV, CAUSAL, False, HEAD_DIM, VALUE_DIM, P_RULE,
                                      BLOCK_N, BLOCK_D, BLOCK_DV)
    acc = _probabilities_times_values(acc, q_tile, k_base, v_t_base, k_s2, k_s3, v_t_s2, v_t_s3, qk_scale, lse,
                                      scale_s, rows, full_end, key_end, SKV, CAUSAL, True, HEAD_DIM, VALUE_DIM,
                                      P_RULE, BLOCK_N, BLOCK_D, BLOCK_DV)
    out = acc * (tl.load(descale_v_ptr) * tl.load(descale_s_ptr))
    o_mask = row_in[:, None] & (cols_dv < VALUE_DIM)[None, :]
    # a row's largest P is exp2(m - lse), its max score being one of its visible scores (exp2 and
    # the subtraction are monotone, so no element's P exceeds it): no per-element max. Every row
    # inside SQ sees a key when SKV > 0; a NaN or all -inf row gives NaN here as in P.
    amax_into(amax_s_ptr, magnitude_bits(tl.math.exp2(m_i - lse), row_in & (SKV > 0)))
    amax_into(amax_o_ptr, magnitude_bits(out, o_mask))
    store_as(o_ptr, batch.to(tl.int64) * o_s0 + head * o_s1 + rows[:, None] * o_s2 + cols_dv[None, :] * o_s3,
             out * tl.load(scale_o_ptr), o_mask, O_FP8, O_RULE)
    if HAS_STATS:
        tl.store(stats_ptr + batch.to(tl.int64) * stats_s0 + head * stats_s1 + rows * stats_s2,
                 lse / LOG2E, mask=row_in)


@triton.jit
def row_deltas(o_ptr, do_ptr, delta_ptr, descale_o_ptr, descale_do_ptr,
               o_s0, o_s1, o_s2, o_s3, do_s0, do_s1, do_s2, do_s3, HEADS, SQ,
               VALUE_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta = rowsum(o dO) (descaled) of one query tile of one (batch, head), into the
    contiguous float32 [B, HEADS, SQ] at delta_ptr. Taken once here, the backward kernels read it:
    the dK/dV program, which meets every query tile once per key block, no longer loads o and
    reduces o dO each time."""
    batch, head, _, rows, row_in = _query_program(HEADS, 1, SQ, BLOCK_M)
    cols_dv = tl.arange(0, BLOCK_DV)
    dv_in = row_in[:, None] & (cols_dv < VALUE_DIM)[None, :]
    o_tile = tl.load(o_ptr + batch * o_s0 + head * o_s1 + rows[:, None] * o_s2 + cols_dv[None, :] * o_s3,
                     mask=dv_in, other=0.0)
    do_tile = tl.load(do_ptr + batch * do_s0 + head * do_s1 + rows[:, None] * do_s2 + cols_dv[None, :] * do_s3,
                      mask=dv_in, other=0.0)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1) * (tl.load(descale_o_ptr)
                                                                          * tl.load(descale_do_ptr))
    tl.store(delta_ptr + (batch * HEADS + head) * SQ + rows, delta, mask=row_in)


@triton.jit
def _query_rows(q_ptr, do_ptr, delta_ptr, stats_ptr, q_off, do_off, delta_off, stats_off, rows, SQ,
                q_s2, q_s3, do_s2, do_s3, stats_s2,
                HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(q, dO, base-2 lse, delta) of query rows `rows` (delta from row_deltas' buffer); rows past
    SQ, and rows whose stats are -inf (the forward's for a row that sees no key), get an lse of
    +inf, so their P is 0; a NaN in stats stays NaN and reaches the row's P, as in the reference."""
    row_in = rows < SQ
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    d_in = row_in[:, None] & (cols_d < HEAD_DIM)[None, :]
    dv_in = row_in[:, None] & (cols_dv < VALUE_DIM)[None, :]
    q_tile = tl.load(q_ptr + q_off + rows[:, None] * q_s2 + cols_d[None, :] * q_s3, mask=d_in, other=0.0)
    do_tile = tl.load(do_ptr + do_off + rows[:, None] * do_s2 + cols_dv[None, :] * do_s3, mask=dv_in, other=0.0)
    delta = tl.load(delta_ptr + delta_off + rows, mask=row_in, other=0.0)
    lse = tl.load(stats_ptr + stats_off + rows * stats_s2, mask=row_in, other=0.0)
    lse = tl.where(row_in & (lse != float("-inf")), lse * LOG2E, float("inf"))
    return q_tile, do_tile, lse, delta


@triton.jit
def _dkdv_tiles(dk_acc, dv_acc, k_tile, v_tile, keys, key_in, q_ptr, do_ptr, delta_ptr, stats_ptr, q_t_base,
                do_t_base, q_off, do_off, delta_off, stats_off, q_s2, q_s3, do_s2, do_s3, stats_s2, q_t_s2, q_t_s3,
                do_t_s2, do_t_s3, qk_scale, dp_scale, scale_s, scale_dp, start, end, SQ, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                P_RULE: tl.constexpr, DS_RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """(dk_acc + fp8(dS)^T q, dv_acc + fp8(P)^T dO) over the query tiles [start, end) of one head."""
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_tile, do_tile, lse, delta = _query_rows(q_ptr, do_ptr, delta_ptr, stats_ptr, q_off, do_off, delta_off,
                                                  stats_off, rows, SQ, q_s2, q_s3, do_s2, do_s3, stats_s2,
                                                  HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV)
        # [keys, rows]: the block's scores transposed
        scores = tl.dot(k_tile, tl.trans(q_tile)) * qk_scale
        visible = key_in[:, None] & (rows < SQ)[None, :]
        if CAUSAL:
            visible = visible & (keys[:, None] <= rows[None, :])
        d_probs = tl.dot(v_tile, tl.trans(do_tile)) * dp_scale
        probs, d_scores = _gradient_terms(scores, lse[None, :], d_probs, delta[None, :], visible, SCALE, MASKED)
        row_in = (rows < SQ)[None, :]
        do_t_tile = tl.load(do_t_base + cols_dv[:, None] * do_t_s2 + rows[None, :] * do_t_s3,
                            mask=row_in & (cols_dv < VALUE_DIM)[:, None], other=0.0)
        dv_acc += tl.dot(quantize_probabilities(probs * scale_s, scale_s, q_tile.dtype, P_RULE), tl.trans(do_t_tile))
        q_t_tile = tl.load(q_t_base + cols_d[:, None] * q_t_s2 + rows[None, :] * q_t_s3,
                           mask=row_in & (cols_d < HEAD_DIM)[:, None], other=0.0)
        dk_acc += tl.dot(quantize_operand(d_scores * scale_dp, do_tile.dtype, DS_RULE), tl.trans(q_t_tile))
    return dk_acc, dv_acc


@triton.jit
def backward_dkdv(q_ptr, k_ptr, v_ptr, delta_ptr, do_ptr, stats_ptr, q_t_ptr, do_t_ptr, dk_ptr, dv_ptr,
                  descale_q_ptr, descale_k_ptr, descale_v_ptr, descale_do_ptr, descale_s_ptr,
                  descale_dp_ptr, scale_s_ptr, scale_dk_ptr, scale_dv_ptr, scale_dp_ptr, amax_dk_ptr, amax_dv_ptr,
                  q_s0, q_s1, q_s2, q_s3, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3,
                  do_s0, do_s1, do_s2, do_s3, stats_s0, stats_s1, stats_s2, q_t_s0, q_t_s1, q_t_s2, q_t_s3,
                  do_t_s0, do_t_s1, do_t_s2, do_t_s3, dk_s0, dk_s1, dk_s2, dk_s3, dv_s0, dv_s1, dv_s2, dv_s3,
                  HEADS, GROUP, SQ, SKV,
                  SCALE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                  P_RULE: tl.constexpr, DS_RULE: tl.constexpr, DK_FP8: tl.constexpr, DK_RULE: tl.constexpr,
                  DV_FP8: tl.constexpr, DV_RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dK, dV (and their amaxes) of one key block of one (batch, k/v head), the query heads of
    its group summed in registers. q_t and do_t are q and dO keys-minor (keys_minor_copy): the
    dots reducing over query rows read them."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // (HEADS // GROUP)).to(tl.int64)
    kv_head = pid_bh % (HEADS // GROUP)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_in = keys < SKV
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    k_tile = tl.load(k_ptr + batch * k_s0 + kv_head * k_s1 + keys[:, None] * k_s2 + cols_d[None, :] * k_s3,
                     mask=key_in[:, None] & (cols_d < HEAD_DIM)[None, :], other=0.0)
    v_tile = tl.load(v_ptr + batch * v_s0 + kv_head * v_s1 + keys[:, None] * v_s2 + cols_dv[None, :] * v_s3,
                     mask=key_in[:, None] & (cols_dv < VALUE_DIM)[None, :], other=0.0)
    qk_scale = tl.load(descale_q_ptr) * tl.load(descale_k_ptr) * (SCALE * LOG2E)
    dp_scale = tl.load(descale_do_ptr) * tl.load(descale_v_ptr)
    scale_s = tl.load(scale_s_ptr)
    scale_dp = tl.load(scale_dp_ptr)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # causal: query i sees key j when j <= i, so the block's first key bounds the rows from below
    first_row = _first_query(pid_n * BLOCK_N, SQ, SKV, CAUSAL, BLOCK_M, BLOCK_N)
    for member in range(GROUP):
        head = kv_head * GROUP + member
        q_off = batch * q_s0 + head * q_s1
        do_off = batch * do_s0 + head * do_s1
        delta_off = (batch * HEADS + head) * SQ
        stats_off = batch * stats_s0 + head * stats_s1
        q_t_base = q_t_ptr + batch * q_t_s0 + head * q_t_s1
        do_t_base = do_t_ptr + batch * do_t_s0 + head * do_t_s1
        # one masked loop: split at the tiles that see the block whole (as the forward and dQ do),
        # three pipelined loops inside the group's loop spilled 24 to 64 bytes (ptxas, sm_90a)
        dk_acc, dv_acc = _dkdv_tiles(dk_acc, dv_acc, k_tile, v_tile, keys, key_in, q_ptr, do_ptr, delta_ptr,
                                     stats_ptr, q_t_base, do_t_base, q_off, do_off, delta_off, stats_off,
                                     q_s2, q_s3, do_s2, do_s3, stats_s2, q_t_s2, q_t_s3, do_t_s2, do_t_s3,
                                     qk_scale, dp_scale, scale_s, scale_dp, first_row, SQ, SQ, CAUSAL, True,
                                     SCALE, HEAD_DIM, VALUE_DIM, P_RULE, DS_RULE, BLOCK_M, BLOCK_D, BLOCK_DV)
    d_k = dk_acc * (tl.load(descale_q_ptr) * tl.load(descale_dp_ptr))
    d_v = dv_acc * (tl.load(descale_s_ptr) * tl.load(descale_do_ptr))
    dk_mask = key_in[:, None] & (cols_d < HEAD_DIM)[None, :]
    dv_mask = key_in[:, None] & (cols_dv < VALUE_DIM)[None, :]
    amax_into(amax_dk_ptr, magnitude_bits(d_k, dk_mask))
    amax_into(amax_dv_ptr, magnitude_bits(d_v, dv_mask))
    store_as(dk_ptr, batch * dk_s0 + kv_head * dk_s1 + keys[:, None] * dk_s2 + cols_d[None, :] * dk_s3,
             d_k * tl.load(scale_dk_ptr), dk_mask, DK_FP8, DK_RULE)
    store_as(dv_ptr, batch * dv_s0 + kv_head * dv_s1 + keys[:, None] * dv_s2 + cols_dv[None, :] * dv_s3,
             d_v * tl.load(scale_dv_ptr), dv_mask, DV_FP8, DV_RULE)


@triton.jit
def _dq_blocks(dq_acc, amax_dp, q_tile, do_tile, lse, delta, k_base, v_base, k_t_base, k_s2, k_s3, v_s2, v_s3,
               k_t_s2, k_t_s3, qk_scale, dp_scale, scale_dp, rows, row_in, start, end, SKV, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
               DS_RULE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(dq_acc + fp8(dS * scale_dP) k, the rows' max |dS| bits) over key blocks [start, end)."""
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_in = keys < SKV
        k_cols = tl.load(k_base + keys[None, :] * k_s2 + cols_d[:, None] * k_s3,
                         mask=key_in[None, :] & (cols_d < HEAD_DIM)[:, None], other=0.0)
        v_cols = tl.load(v_base + keys[None, :] * v_s2 + cols_dv[:, None] * v_s3,
                         mask=key_in[None, :] & (cols_dv < VALUE_DIM)[:, None], other=0.0)
        scores, visible = _scores(q_tile, k_cols, qk_scale, rows, keys, SKV, CAUSAL, MASKED)
        d_probs = tl.dot(do_tile, v_cols) * dp_scale
        probs, d_scores = _gradient_terms(scores, lse[:, None], d_probs, delta[:, None], visible, SCALE, MASKED)
        # the frontend's amax_dP is of the value scale_dP scales: dS (its "dP")
        if MASKED:
            counted = visible & row_in[:, None]
        else:
            counted = row_in[:, None]
        amax_dp = tl.maximum(amax_dp, tl.max(magnitude_bits(d_scores, counted), 1))
        k_t_cols = tl.load(k_t_base + keys[None, :] * k_t_s3 + cols_d[:, None] * k_t_s2,
                           mask=key_in[None, :] & (cols_d < HEAD_DIM)[:, None], other=0.0)
        dq_acc += tl.dot(quantize_operand(d_scores * scale_dp, do_tile.dtype, DS_RULE), tl.trans(k_t_cols))
    return dq_acc, amax_dp


@triton.jit
def backward_dq(q_ptr, k_ptr, v_ptr, delta_ptr, do_ptr, stats_ptr, k_t_ptr, dq_ptr,
                descale_q_ptr, descale_k_ptr, descale_v_ptr, descale_do_ptr, descale_dp_ptr,
                scale_dq_ptr, scale_dp_ptr, amax_dq_ptr, amax_dp_ptr,
                q_s0, q_s1, q_s2, q_s3, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3,
                do_s0, do_s1, do_s2, do_s3, stats_s0, stats_s1, stats_s2, k_t_s0, k_t_s1, k_t_s2, k_t_s3,
                dq_s0, dq_s1, dq_s2, dq_s3, HEADS, GROUP, SQ, SKV,
                SCALE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                P_RULE: tl.constexpr, DS_RULE: tl.constexpr, DQ_FP8: tl.constexpr, DQ_RULE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dQ (and amax_dQ, amax_dP = max |dS|) of one query tile of one (batch, head); k_t is k
    keys-minor (keys_minor_copy), read by the dot reducing over keys."""
    batch, head, kv_head, rows, row_in = _query_program(HEADS, GROUP, SQ, BLOCK_M)
    cols_d = tl.arange(0, BLOCK_D)
    cols_dv = tl.arange(0, BLOCK_DV)
    q_tile, do_tile, lse, delta = _query_rows(q_ptr, do_ptr, delta_ptr, stats_ptr, batch * q_s0 + head * q_s1,
                                              batch * do_s0 + head * do_s1, (batch * HEADS + head) * SQ,
                                              batch * stats_s0 + head * stats_s1, rows, SQ, q_s2, q_s3, do_s2,
                                              do_s3, stats_s2, HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV)
    k_base = k_ptr + batch * k_s0 + kv_head * k_s1
    v_base = v_ptr + batch * v_s0 + kv_head * v_s1
    k_t_base = k_t_ptr + batch * k_t_s0 + kv_head * k_t_s1
    qk_scale = tl.load(descale_q_ptr) * tl.load(descale_k_ptr) * (SCALE * LOG2E)
    dp_scale = tl.load(descale_do_ptr) * tl.load(descale_v_ptr)
    scale_dp = tl.load(scale_dp_ptr)
    dq_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    amax_dp = tl.zeros([BLOCK_M], tl.int32)
    first_row = tl.program_id(0) * BLOCK_M
    # blocks before full_end are seen whole by every row: their loop runs without the mask
    full_end = _full_key_end(first_row, SQ, SKV, CAUSAL, BLOCK_M, BLOCK_N)
    dq_acc, amax_dp = _dq_blocks(dq_acc, amax_dp, q_tile, do_tile, lse, delta, k_base, v_base, k_t_base,
                                 k_s2, k_s3, v_s2, v_s3, k_t_s2, k_t_s3, qk_scale, dp_scale, scale_dp, rows, row_in,
                                 0, full_end, SKV, CAUSAL, False, SCALE, HEAD_DIM, VALUE_DIM, DS_RULE,
                                 BLOCK_N, BLOCK_D, BLOCK_DV)
    dq_acc, amax_dp = _dq_blocks(dq_acc, amax_dp, q_tile, do_tile, lse, delta, k_base, v_base, k_t_base,
                                 k_s2, k_s3, v_s2, v_s3, k_t_s2, k_t_s3, qk_scale, dp_scale, scale_dp, rows, row_in,
                                 full_end, _key_end(first_row, SQ, SKV, CAUSAL, BLOCK_M, BLOCK_N), SKV, CAUSAL, True,
                                 SCALE, HEAD_DIM, VALUE_DIM, DS_RULE, BLOCK_N, BLOCK_D, BLOCK_DV)
    d_q = dq_acc * (tl.load(descale_k_ptr) * tl.load(descale_dp_ptr))
    dq_mask = row_in[:, None] & (cols_d < HEAD_DIM)[None, :]
    amax_into(amax_dq_ptr, magnitude_bits(d_q, dq_mask))
    amax_into(amax_dp_ptr, amax_dp)
    store_as(dq_ptr, batch * dq_s0 + head * dq_s1 + rows[:, None] * dq_s2 + cols_d[None, :] * dq_s3,
             d_q * tl.load(scale_dq_ptr), dq_mask, DQ_FP8, DQ_RULE)
