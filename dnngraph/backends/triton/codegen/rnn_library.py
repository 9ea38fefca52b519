"""Device functions of the recurrence kernels (imported by generated sources as `rl`).

Persistent (the default): one program owns a block of batch entries and the whole hidden size,
and loops over every time step inside the kernel (one launch per layer and direction). Step mode
(a layer wider than one tile on the GPU, no projection): a launch per step (backward: two, the
gate gradients then dh), each program owning one hidden block; the kernel boundary orders a
step's reads of the whole previous state across programs. The state each step starts from
lives in h_prev / c_prev (float32, indexed by time: the backward reads them too); a step reads
slot t and writes slot t +- 1, so its hidden blocks never read what the same step writes. Within
a program, phases meet at a barrier (tl.debug_barrier: stores of one thread are seen by the
others of its program after it). Programs never share rows of a step, so no grid-wide sync.

Weights stay in memory (L2) and are read per step in [BLOCK_K, BLOCK_H] tiles; with RESIDENT
(hidden and state each fit one tile) the recurrent tiles are loaded once, before the time loop,
and kept in registers for every step.

Modes: 0 rnn_tanh, 1 rnn_relu, 2 lstm (gates i, f, g, o), 3 gru (r, z, n).
"""
import triton
import triton.language as tl

from dnngraph.backends.triton.codegen import triton_math as tm

RNN_TANH = tl.constexpr(0)
RNN_RELU = tl.constexpr(1)
LSTM = tl.constexpr(2)
GRU = tl.constexpr(3)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _dot(acc, a, w, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w, a cast to w's type (a 16-bit weight: tensor cores of that type, fp32 sums)."""
    if FP32_DOT:
        return tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)
    else:
        return tl.dot(a.to(w.dtype), w, acc)


@triton.jit
def weight_tile(w, w_s0, w_s1, row0, cols, col_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_H]: w[row0 + col, k0 + k] (a transposed weight: strides swapped)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w + (row0 + cols)[None, :] * w_s0 + ks[:, None] * w_s1,
                   mask=(ks < K)[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def times_weight(acc, src, s_t, s_b, s_c, t, rows, active, w, w_s0, w_s1, row0, cols, col_mask,
                 K: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc[b, j] + sum_k src[t_b, b, k] * w[row0 + j, k] over the active rows (K a multiple of
    nothing: the last tile is masked)."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(src + t[:, None] * s_t + rows[:, None] * s_b + ks[None, :] * s_c,
                    mask=active[:, None] & (ks < K)[None, :], other=0.0)
        acc = _dot(acc, a, weight_tile(w, w_s0, w_s1, row0, cols, col_mask, k0, K, BLOCK_K), FP32_DOT, PRECISION)
    return acc


@triton.jit
def state_gate(src, s_t, s_b, s_c, t, rows, active, w, w_s0, w_s1, tile, b_hh, b_s0, gate, cols, col_mask,
               H: tl.constexpr, P: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDENT: tl.constexpr,
               BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
               FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """w_hh[gate] h + b_hh[gate] for hidden columns `cols`: [BLOCK_B, BLOCK_H] float32."""
    acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if RESIDENT:
        ks = tl.arange(0, BLOCK_K)
        a = tl.load(src + t[:, None] * s_t + rows[:, None] * s_b + ks[None, :] * s_c,
                    mask=active[:, None] & (ks < P)[None, :], other=0.0)
        acc = _dot(acc, a, tile, FP32_DOT, PRECISION)
    else:
        acc = times_weight(acc, src, s_t, s_b, s_c, t, rows, active, w, w_s0, w_s1, gate * H, cols, col_mask,
                           P, BLOCK_K, FP32_DOT, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_hh + (gate * H + cols) * b_s0, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, gate, cols, col_mask, H: tl.constexpr):
    """xw[t_b, b, gate * H + cols] as float32 (0 on inactive rows)."""
    return tl.load(xw + t[:, None] * x_s0 + rows[:, None] * x_s1 + (gate * H + cols)[None, :] * x_s2,
                   mask=active[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, s0, s1, s2, t, rows, cols, value, mask):
    """ptr[t_b, b, cols] = value (cast to ptr's type) where mask."""
    tl.store(ptr + t[:, None] * s0 + rows[:, None] * s1 + cols[None, :] * s2, value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def load_rows(ptr, s0, s1, s2, t, rows, cols, mask):
    return tl.load(ptr + t[:, None] * s0 + rows[:, None] * s1 + cols[None, :] * s2, mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def emit_state(new, k, t, t_next, rows, row_mask, active, more, last, cols, col_mask,
               y, y_s0, y_s1, y_s2, h_prev, hp_s0, hp_s1, hp_s2, h_n, hn_s0, hn_s1):
    """A step's new state columns: y[t] (0 at y[k] on inactive rows), the next step's h_prev
    slot (h_prev[k] = 0 on inactive rows), h_n at a sequence's last step."""
    cm = col_mask[None, :]
    idle = (row_mask & (active == 0))[:, None] & cm
    zero = tl.zeros_like(new)
    store_rows(y, y_s0, y_s1, y_s2, t, rows, cols, new, active[:, None] & cm)
    store_rows(y, y_s0, y_s1, y_s2, t * 0 + k, rows, cols, zero, idle)
    store_rows(h_prev, hp_s0, hp_s1, hp_s2, t_next, rows, cols, new, more[:, None] & cm)
    store_rows(h_prev, hp_s0, hp_s1, hp_s2, t * 0 + k, rows, cols, zero, idle)
    tl.store(h_n + rows[:, None] * hn_s0 + cols[None, :] * hn_s1, new.to(h_n.dtype.element_ty),
             mask=last[:, None] & cm)


@triton.jit
def lengths_of(lengths, len_s0, rows, row_mask, T, HAS_LENGTHS: tl.constexpr, BLOCK_B: tl.constexpr):
    """Each row's length, clamped to [0, T] (bad lengths never address outside the tensors)."""
    if HAS_LENGTHS:
        n = tl.load(lengths + rows * len_s0, mask=row_mask, other=0).to(tl.int32)
        return tl.minimum(tl.maximum(n, 0), T)
    else:
        return tl.full([BLOCK_B], 0, tl.int32) + T


@triton.jit
def step_times(k, n, row_mask, REVERSE: tl.constexpr):
    """(active, t, t_next, more, last) of step k for rows of lengths n; inactive rows get t = k."""
    active = row_mask & (k < n)
    if REVERSE:
        t = n - 1 - k
        t_next = t - 1
    else:
        t = n * 0 + k
        t_next = t + 1
    t = tl.where(active, t, k)
    return active, t, t_next, active & (k + 1 < n), active & (k + 1 == n)


@triton.jit
def resident_tile(w, w_s0, w_s1, gate, G: tl.constexpr, H: tl.constexpr, P: tl.constexpr, RESIDENT: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The gate's whole [P, H] recurrent weight as one register tile (RESIDENT), else a stand-in."""
    cols = tl.arange(0, BLOCK_H)
    tile = tl.zeros([1, 1], dtype=tl.float32)
    if RESIDENT:
        if gate < G:
            tile = weight_tile(w, w_s0, w_s1, gate * H, cols, cols < H, 0, P, BLOCK_K)
    return tile


@triton.jit
def write_initial_state(h0, h0_s0, h0_s1, c0, c0_s0, c0_s1, h_n, hn_s0, hn_s1, c_n, cn_s0, cn_s1,
                        h_prev, hp_s0, hp_s1, hp_s2, c_prev, cp_s0, cp_s1, cp_s2, rows, row_mask, n,
                        j_start, p_stop, h_stop, MODE: tl.constexpr, REVERSE: tl.constexpr, BLOCK_H: tl.constexpr):
    """Step 0's h_prev / c_prev slot from h0 / c0, or h_n / c_n straight away for an empty
    sequence, over state columns [j_start, p_stop) and cell columns [j_start, h_stop)."""
    active, t, t_next, more, last = step_times(0, n, row_mask, REVERSE)
    empty = row_mask & (n == 0)
    for p0 in range(j_start, p_stop, BLOCK_H):
        cols = p0 + tl.arange(0, BLOCK_H)
        cm = (cols < p_stop)[None, :]
        value = tl.load(h0 + rows[:, None] * h0_s0 + cols[None, :] * h0_s1, mask=row_mask[:, None] & cm,
                        other=0.0)
        store_rows(h_prev, hp_s0, hp_s1, hp_s2, t, rows, cols, value, active[:, None] & cm)
        tl.store(h_n + rows[:, None] * hn_s0 + cols[None, :] * hn_s1, value, mask=empty[:, None] & cm)
    if MODE == LSTM:
        for j0 in range(j_start, h_stop, BLOCK_H):
            cols = j0 + tl.arange(0, BLOCK_H)
            cm = (cols < h_stop)[None, :]
            value = tl.load(c0 + rows[:, None] * c0_s0 + cols[None, :] * c0_s1, mask=row_mask[:, None] & cm,
                            other=0.0)
            store_rows(c_prev, cp_s0, cp_s1, cp_s2, t, rows, cols, value, active[:, None] & cm)
            tl.store(c_n + rows[:, None] * cn_s0 + cols[None, :] * cn_s1, value, mask=empty[:, None] & cm)


@triton.jit
def column_span(count, first, H, P, STEP_MODE: tl.constexpr, BLOCK_H: tl.constexpr):
    """(first hidden column, past the last, past the last state column, whether this launch
    writes the initial state) of a program: with STEP_MODE (no projection: the state is the
    hidden size) the hidden block of program axis 1, whose first launch has count 0; else every
    column, from the launch whose first step is 0."""
    if STEP_MODE:
        j_start = tl.program_id(1) * BLOCK_H
        j_stop = tl.minimum(j_start + BLOCK_H, H)
        p_stop = j_stop
        initial = count == 0
    else:
        j_start = 0
        j_stop = H
        p_stop = P
        initial = first == 0
    return j_start, j_stop, p_stop, initial


@triton.jit
def rnn_forward(xw, x_s0, x_s1, x_s2, h0, h0_s0, h0_s1, c0, c0_s0, c0_s1, w_hh, w_s0, w_s1, b_hh, b_s0,
                w_hr, r_s0, r_s1, lengths, len_s0,
                y, y_s0, y_s1, y_s2, h_n, hn_s0, hn_s1, c_n, cn_s0, cn_s1,
                h_prev, hp_s0, hp_s1, hp_s2, c_prev, cp_s0, cp_s1, cp_s2, h_raw, hr_s0, hr_s1, hr_s2,
                T, B, k_first, k_count, MODE: tl.constexpr, REVERSE: tl.constexpr, G: tl.constexpr,
                H: tl.constexpr, P: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROJ: tl.constexpr,
                HAS_LENGTHS: tl.constexpr, RESIDENT: tl.constexpr, STEP_MODE: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Steps k_first .. k_first + k_count - 1 of one layer and direction for one block of batch
    rows: all of them and every hidden column (persistent: one launch, program axis 1 of size 1),
    or, with STEP_MODE (no projection), one step for the hidden block of program axis 1 (a
    launch per step; a first launch with k_count = 0 writes the initial state)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    j_start, j_stop, p_stop, initial = column_span(k_count, k_first, H, P, STEP_MODE, BLOCK_H)
    n = lengths_of(lengths, len_s0, rows, row_mask, T, HAS_LENGTHS, BLOCK_B)
    if initial:
        write_initial_state(h0, h0_s0, h0_s1, c0, c0_s0, c0_s1, h_n, hn_s0, hn_s1, c_n, cn_s0, cn_s1,
                            h_prev, hp_s0, hp_s1, hp_s2, c_prev, cp_s0, cp_s1, cp_s2, rows, row_mask, n,
                            j_start, p_stop, j_stop, MODE, REVERSE, BLOCK_H)
    tile0 = resident_tile(w_hh, w_s0, w_s1, 0, G, H, P, RESIDENT, BLOCK_H, BLOCK_K)
    tile1 = resident_tile(w_hh, w_s0, w_s1, 1, G, H, P, RESIDENT, BLOCK_H, BLOCK_K)
    tile2 = resident_tile(w_hh, w_s0, w_s1, 2, G, H, P, RESIDENT, BLOCK_H, BLOCK_K)
    tile3 = resident_tile(w_hh, w_s0, w_s1, 3, G, H, P, RESIDENT, BLOCK_H, BLOCK_K)
    tl.debug_barrier()
    for k in range(k_first, k_first + k_count):
        active, t, t_next, more, last = step_times(k, n, row_mask, REVERSE)
        idle = row_mask & (active == 0)
        for j0 in range(j_start, j_stop, BLOCK_H):
            cols = j0 + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            am = active[:, None] & col_mask[None, :]
            hh0 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, tile0, b_hh, b_s0, 0,
                             cols, col_mask, H, P, HAS_BIAS, RESIDENT, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT, PRECISION)
            x0 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 0, cols, col_mask, H)
            if MODE == RNN_TANH:
                new = tm.tanh(x0 + hh0)
            elif MODE == RNN_RELU:
                new = tl.maximum(x0 + hh0, 0.0)
            else:
                hh1 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, tile1, b_hh, b_s0,
                                 1, cols, col_mask, H, P, HAS_BIAS, RESIDENT, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT,
                                 PRECISION)
                hh2 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, tile2, b_hh, b_s0,
                                 2, cols, col_mask, H, P, HAS_BIAS, RESIDENT, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT,
                                 PRECISION)
                x1 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 1, cols, col_mask, H)
                x2 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 2, cols, col_mask, H)
                if MODE == LSTM:
                    hh3 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, tile3, b_hh,
                                     b_s0, 3, cols, col_mask, H, P, HAS_BIAS, RESIDENT, BLOCK_B, BLOCK_H, BLOCK_K,
                                     FP32_DOT, PRECISION)
                    x3 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 3, cols, col_mask, H)
                    c_old = load_rows(c_prev, cp_s0, cp_s1, cp_s2, t, rows, cols, am)
                    c_new = sigmoid(x1 + hh1) * c_old + sigmoid(x0 + hh0) * tm.tanh(x2 + hh2)
                    new = sigmoid(x3 + hh3) * tm.tanh(c_new)
                    store_rows(c_prev, cp_s0, cp_s1, cp_s2, t_next, rows, cols, c_new, more[:, None] & col_mask[None, :])
                    store_rows(c_prev, cp_s0, cp_s1, cp_s2, t * 0 + k, rows, cols, tl.zeros_like(c_new),
                               idle[:, None] & col_mask[None, :])
                    tl.store(c_n + rows[:, None] * cn_s0 + cols[None, :] * cn_s1, c_new.to(c_n.dtype.element_ty),
                             mask=last[:, None] & col_mask[None, :])
                else:
                    r = sigmoid(x0 + hh0)
                    z = sigmoid(x1 + hh1)
                    cand = tm.tanh(x2 + r * hh2)
                    h_old = load_rows(h_prev, hp_s0, hp_s1, hp_s2, t, rows, cols, am)
                    new = (1.0 - z) * cand + z * h_old
            if HAS_PROJ:
                store_rows(h_raw, hr_s0, hr_s1, hr_s2, t, rows, cols, new, am)
                store_rows(h_raw, hr_s0, hr_s1, hr_s2, t * 0 + k, rows, cols, tl.zeros_like(new),
                           idle[:, None] & col_mask[None, :])
            else:
                emit_state(new, k, t, t_next, rows, row_mask, active, more, last, cols, col_mask,
                           y, y_s0, y_s1, y_s2, h_prev, hp_s0, hp_s1, hp_s2, h_n, hn_s0, hn_s1)
        if HAS_PROJ:
            tl.debug_barrier()  # every h_raw column of this step is stored before the projection reads it
            for p0 in range(0, P, BLOCK_H):
                cols = p0 + tl.arange(0, BLOCK_H)
                col_mask = cols < P
                acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
                new = times_weight(acc, h_raw, hr_s0, hr_s1, hr_s2, t, rows, active, w_hr, r_s0, r_s1, 0, cols,
                                   col_mask, H, BLOCK_K, FP32_DOT, PRECISION)
                emit_state(new, k, t, t_next, rows, row_mask, active, more, last, cols, col_mask,
                           y, y_s0, y_s1, y_s2, h_prev, hp_s0, hp_s1, hp_s2, h_n, hn_s0, hn_s1)
        tl.debug_barrier()  # the next step reads the state slots this one wrote


@triton.jit
def gate_grad(ptr, s0, s1, s2, t, k, rows, cols, gate, H: tl.constexpr, grad, active_mask, idle_mask):
    """One gate's pre-activation gradient at time t (active rows); 0 at slot k (idle rows)."""
    store_rows(ptr, s0, s1, s2, t, rows, gate * H + cols, grad, active_mask)
    store_rows(ptr, s0, s1, s2, t * 0 + k, rows, gate * H + cols, tl.zeros_like(grad), idle_mask)


@triton.jit
def rnn_backward(xw, x_s0, x_s1, x_s2, w_hh, w_s0, w_s1, b_hh, b_s0, w_hr, r_s0, r_s1, lengths, len_s0,
                 h_prev, hp_s0, hp_s1, hp_s2, c_prev, cp_s0, cp_s1, cp_s2, dy, dy_s0, dy_s1, dy_s2,
                 dh_n, dhn_s0, dhn_s1, dc_n, dcn_s0, dcn_s1,
                 dxw, dx_s0, dx_s1, dx_s2, dhh, dhh_s0, dhh_s1, dhh_s2, dh0, dh0_s0, dh0_s1, dc0, dc0_s0, dc0_s1,
                 d_proj, dp_s0, dp_s1, dp_s2,
                 T, B, back_first, back_count, phases, MODE: tl.constexpr, REVERSE: tl.constexpr, G: tl.constexpr,
                 H: tl.constexpr, P: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROJ: tl.constexpr,
                 HAS_LENGTHS: tl.constexpr, HAS_DY: tl.constexpr, HAS_DH: tl.constexpr, HAS_DC: tl.constexpr,
                 STEP_MODE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Steps T-1-back for back in back_first .. back_first + back_count - 1 (the steps in reverse
    order) for one block of batch rows; dh0 / dc0 carry the state gradients between steps
    (float32 math, stored in their type). Persistent: every step, both phases (`phases` 3), every
    column. STEP_MODE (no projection): the hidden block of program axis 1, one phase per launch
    (1: the gate gradients, 2: dh = dgates @ w_hh); a first launch with back_count = 0 writes
    the carries' initial values."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    j_start, j_stop, p_stop, initial = column_span(back_count, back_first, H, P, STEP_MODE, BLOCK_H)
    n = lengths_of(lengths, len_s0, rows, row_mask, T, HAS_LENGTHS, BLOCK_B)
    if initial:
        for p0 in range(j_start, p_stop, BLOCK_H):
            cols = p0 + tl.arange(0, BLOCK_H)
            m = row_mask[:, None] & (cols < p_stop)[None, :]
            start = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
            if HAS_DH:
                start = tl.load(dh_n + rows[:, None] * dhn_s0 + cols[None, :] * dhn_s1, mask=m, other=0.0)
            tl.store(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, start.to(dh0.dtype.element_ty), mask=m)
        if MODE == LSTM:
            for j0 in range(j_start, j_stop, BLOCK_H):
                cols = j0 + tl.arange(0, BLOCK_H)
                m = row_mask[:, None] & (cols < j_stop)[None, :]
                start = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
                if HAS_DC:
                    start = tl.load(dc_n + rows[:, None] * dcn_s0 + cols[None, :] * dcn_s1, mask=m, other=0.0)
                tl.store(dc0 + rows[:, None] * dc0_s0 + cols[None, :] * dc0_s1, start.to(dc0.dtype.element_ty),
                         mask=m)
    tl.debug_barrier()
    # an empty column range skips a phase: bit 0 of `phases` runs the gate gradients, bit 1 dh
    gate_stop = j_start + (j_stop - j_start) * (phases % 2)
    state_stop = j_start + (p_stop - j_start) * (phases // 2)
    for back in range(back_first, back_first + back_count):
        k = T - 1 - back
        active, t, t_next, more, last = step_times(k, n, row_mask, REVERSE)
        idle = row_mask & (active == 0)
        if HAS_PROJ:  # the gradient of the step's projected output, whole, before dh_raw = d_proj @ w_hr
            for p0 in range(0, P, BLOCK_H):
                cols = p0 + tl.arange(0, BLOCK_H)
                cm = (cols < P)[None, :]
                grad = tl.load(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, mask=active[:, None] & cm,
                               other=0.0).to(tl.float32)
                if HAS_DY:
                    grad += load_rows(dy, dy_s0, dy_s1, dy_s2, t, rows, cols, active[:, None] & cm)
                store_rows(d_proj, dp_s0, dp_s1, dp_s2, t, rows, cols, grad, active[:, None] & cm)
                store_rows(d_proj, dp_s0, dp_s1, dp_s2, t * 0 + k, rows, cols, tl.zeros_like(grad), idle[:, None] & cm)
            tl.debug_barrier()
        for j0 in range(j_start, gate_stop, BLOCK_H):  # phase 1
            cols = j0 + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            am = active[:, None] & col_mask[None, :]
            im = idle[:, None] & col_mask[None, :]
            if HAS_PROJ:  # P < H: the transposed projection, strides swapped
                d_out = times_weight(tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32), d_proj, dp_s0, dp_s1, dp_s2, t,
                                     rows, active, w_hr, r_s1, r_s0, 0, cols, col_mask, P, BLOCK_K, FP32_DOT, PRECISION)
            else:
                d_out = tl.load(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, mask=am, other=0.0) \
                    .to(tl.float32)
                if HAS_DY:
                    d_out += load_rows(dy, dy_s0, dy_s1, dy_s2, t, rows, cols, am)
            hh0 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, 0, b_hh, b_s0, 0,
                             cols, col_mask, H, P, HAS_BIAS, False, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT, PRECISION)
            x0 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 0, cols, col_mask, H)
            if MODE == RNN_TANH:
                new = tm.tanh(x0 + hh0)
                gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 0, H, d_out * (1.0 - new * new), am, im)
            elif MODE == RNN_RELU:
                gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 0, H, tl.where(x0 + hh0 > 0, d_out, 0.0), am, im)
            else:
                hh1 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, 0, b_hh, b_s0, 1,
                                 cols, col_mask, H, P, HAS_BIAS, False, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT, PRECISION)
                hh2 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, 0, b_hh, b_s0, 2,
                                 cols, col_mask, H, P, HAS_BIAS, False, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT, PRECISION)
                x1 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 1, cols, col_mask, H)
                x2 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 2, cols, col_mask, H)
                if MODE == LSTM:
                    hh3 = state_gate(h_prev, hp_s0, hp_s1, hp_s2, t, rows, active, w_hh, w_s0, w_s1, 0, b_hh, b_s0,
                                     3, cols, col_mask, H, P, HAS_BIAS, False, BLOCK_B, BLOCK_H, BLOCK_K, FP32_DOT,
                                     PRECISION)
                    x3 = input_gate(xw, x_s0, x_s1, x_s2, t, rows, active, 3, cols, col_mask, H)
                    i = sigmoid(x0 + hh0)
                    f = sigmoid(x1 + hh1)
                    g = tm.tanh(x2 + hh2)
                    o = sigmoid(x3 + hh3)
                    c_old = load_rows(c_prev, cp_s0, cp_s1, cp_s2, t, rows, cols, am)
                    tanh_c = tm.tanh(f * c_old + i * g)
                    dc = tl.load(dc0 + rows[:, None] * dc0_s0 + cols[None, :] * dc0_s1, mask=am, other=0.0) \
                        .to(tl.float32) + d_out * o * (1.0 - tanh_c * tanh_c)
                    tl.store(dc0 + rows[:, None] * dc0_s0 + cols[None, :] * dc0_s1, (dc * f).to(dc0.dtype.element_ty),
                             mask=am)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 0, H, dc * g * i * (1.0 - i), am, im)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 1, H, dc * c_old * f * (1.0 - f), am, im)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 2, H, dc * i * (1.0 - g * g), am, im)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 3, H, d_out * tanh_c * o * (1.0 - o), am, im)
                else:
                    r = sigmoid(x0 + hh0)
                    z = sigmoid(x1 + hh1)
                    cand = tm.tanh(x2 + r * hh2)
                    h_old = load_rows(h_prev, hp_s0, hp_s1, hp_s2, t, rows, cols, am)
                    d_cand = d_out * (1.0 - z) * (1.0 - cand * cand)
                    d_r = d_cand * hh2 * r * (1.0 - r)
                    d_z = d_out * (h_old - cand) * z * (1.0 - z)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 0, H, d_r, am, im)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 1, H, d_z, am, im)
                    gate_grad(dxw, dx_s0, dx_s1, dx_s2, t, k, rows, cols, 2, H, d_cand, am, im)
                    gate_grad(dhh, dhh_s0, dhh_s1, dhh_s2, t, k, rows, cols, 0, H, d_r, am, im)
                    gate_grad(dhh, dhh_s0, dhh_s1, dhh_s2, t, k, rows, cols, 1, H, d_z, am, im)
                    gate_grad(dhh, dhh_s0, dhh_s1, dhh_s2, t, k, rows, cols, 2, H, d_cand * r, am, im)
                    # the direct path h_old -> h: phase two adds the path through w_hh
                    tl.store(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, (d_out * z)
                             .to(dh0.dtype.element_ty), mask=am)
        tl.debug_barrier()  # every gate gradient of this step is stored before dh = dgates @ w_hh reads them
        for p0 in range(j_start, state_stop, BLOCK_H):  # phase 2
            cols = p0 + tl.arange(0, BLOCK_H)
            col_mask = cols < P
            am = active[:, None] & col_mask[None, :]
            acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
            if MODE == GRU:
                acc = tl.load(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, mask=am, other=0.0) \
                    .to(tl.float32)
                acc = times_weight(acc, dhh, dhh_s0, dhh_s1, dhh_s2, t, rows, active, w_hh, w_s1, w_s0, 0, cols,
                                   col_mask, 3 * H, BLOCK_K, FP32_DOT, PRECISION)
            else:
                acc = times_weight(acc, dxw, dx_s0, dx_s1, dx_s2, t, rows, active, w_hh, w_s1, w_s0, 0, cols,
                                   col_mask, G * H, BLOCK_K, FP32_DOT, PRECISION)
            tl.store(dh0 + rows[:, None] * dh0_s0 + cols[None, :] * dh0_s1, acc.to(dh0.dtype.element_ty), mask=am)
        tl.debug_barrier()
