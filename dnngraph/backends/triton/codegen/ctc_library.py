"""Device functions of the CTC kernels (imported by the generated source as `ctc`).

A CTC kernel has no fused operand: its generated text is the signature (pointers, strides,
sizes) and one call of a function here: `loss_entry`, `reduce_losses`, `occupancy_entry` or
`frame_gradient`; the recursion lives here. One program
per batch entry holds the extended label sequence (blank, l1, blank, l2, ..., blank) in
registers as a BLOCK_L vector of states and runs the recursion over the frames in log space, a
frame's states taking their neighbours' values through tl.gather (a register shuffle, no
memory round trip). The loss kernel may store log_alpha for the gradient; the gradient's
recursion kernel takes it (or runs the alpha pass again into its scratch), walks the frames
backwards with log_beta and leaves each frame's per-state occupancy, which a parallel kernel
turns into every class of every frame of d log_probs.

Lengths are read on the device and clamped into range (input lengths into [0, T], target
lengths into what the targets hold), and a label outside [0, C) reads nothing (probability 0),
so no value makes a kernel read or write outside its tensors.
"""
import triton
import triton.language as tl

# reduction codes the kernels take as a constexpr
NONE = tl.constexpr(0)
SUM = tl.constexpr(1)
MEAN = tl.constexpr(2)


@triton.jit
def logsumexp3(a, b, c):
    """log(exp(a) + exp(b) + exp(c)): -inf where all three are, NaN where any is (the largest
    term is taken out only where it is finite)."""
    top = tl.maximum(tl.maximum(a, b), c)
    top = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top) + tl.exp(c - top))


@triton.jit
def entry_labels(n, targets_stride_0, targets_stride_1, target_lengths_ptr, target_lengths_stride, WIDTH,
                 CONCATENATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first, label_stride, length) of entry n's labels: element offset of its first label,
    stride between labels, and its target length clamped to what the targets hold. Concatenated
    targets start after the earlier entries' (clamped) lengths, summed here."""
    length = tl.load(target_lengths_ptr + n * target_lengths_stride).to(tl.int64)
    if CONCATENATED:
        start = tl.zeros([], dtype=tl.int64)
        earlier = tl.arange(0, BLOCK_N)
        for m0 in range(0, n, BLOCK_N):
            lengths = tl.load(target_lengths_ptr + (m0 + earlier) * target_lengths_stride,
                              mask=m0 + earlier < n, other=0).to(tl.int64)
            start += tl.sum(tl.minimum(tl.maximum(lengths, 0), WIDTH), 0)
        start = tl.minimum(start, WIDTH)
        length = tl.minimum(tl.maximum(length, 0), WIDTH - start)
        return start * targets_stride_0, targets_stride_0, length
    length = tl.minimum(tl.maximum(length, 0), WIDTH)
    return n * targets_stride_0, targets_stride_1, length


@triton.jit
def extended_states(targets_ptr, first, label_stride, length, blank, C, BLOCK_L: tl.constexpr):
    """The extended sequence: (s, count, states, skip, readable) with s the state positions,
    count = 2 * length + 1, states the class of each (blank at even s), skip where alpha may
    come from s - 2 (a label unlike the one two states back), readable where the state's class
    is one of log_probs' (s < count and within [0, C))."""
    s = tl.arange(0, BLOCK_L)
    count = 2 * length + 1
    is_label = (s % 2 == 1) & (s < count)
    label = tl.load(targets_ptr + first + (s // 2) * label_stride, mask=is_label, other=0).to(tl.int64)
    states = tl.where(is_label, label, blank)
    two_back = tl.gather(states, tl.maximum(s - 2, 0), 0)
    skip = is_label & (s >= 2) & (states != two_back)
    readable = (s < count) & (states >= 0) & (states < C)
    return s, count, states, skip, readable


@triton.jit
def emissions(row_ptr, class_stride, states, mask):
    """log_probs of each state's class in one frame (row_ptr: the frame's row of this entry);
    -inf where not `mask` (past the sequence, a label outside the classes, a frame not read)."""
    return tl.load(row_ptr + states * class_stride, mask=mask, other=float("-inf")).to(tl.float32)


@triton.jit
def alpha_pass(lp_ptr, lp_stride_t, lp_stride_c, frames, s, count, states, skip, readable, rows_ptr, row_stride,
               state_stride, STATES, STORE: tl.constexpr):
    """log_alpha of the last frame (frames 0: the empty alignment, 0 at state 0); where STORE,
    each frame's row (-inf past the sequence) at rows_ptr + t * row_stride + s * state_stride for
    the first STATES states."""
    first = emissions(lp_ptr, lp_stride_c, states, readable)
    alpha = tl.where(s < 2, first, float("-inf"))
    alpha = tl.where(frames > 0, alpha, tl.where(s == 0, 0.0, float("-inf")))
    if STORE:
        tl.store(rows_ptr + s * state_stride, tl.where(s < count, alpha, float("-inf")),
                 mask=(s < STATES) & (frames > 0))
    # each frame's emissions are loaded a step ahead: their latency hides behind the step before
    emit_next = emissions(lp_ptr + lp_stride_t, lp_stride_c, states, readable & (frames > 1))
    for t in range(1, frames):
        emit = emit_next
        emit_next = emissions(lp_ptr + (t + 1) * lp_stride_t, lp_stride_c, states, readable & (t + 1 < frames))
        one_back = tl.where(s >= 1, tl.gather(alpha, tl.maximum(s - 1, 0), 0), float("-inf"))
        two_back = tl.where(skip, tl.gather(alpha, tl.maximum(s - 2, 0), 0), float("-inf"))
        alpha = emit + logsumexp3(alpha, one_back, two_back)
        if STORE:
            tl.store(rows_ptr + t * row_stride + s * state_stride, tl.where(s < count, alpha, float("-inf")),
                     mask=s < STATES)
    return alpha


@triton.jit
def negative_log_likelihood(alpha, s, count):
    """-log(alpha[count - 1] + alpha[count - 2]) in probability space: the loss of one entry."""
    ends = tl.where((s == count - 1) | (s == count - 2), alpha, float("-inf"))
    top = tl.max(ends, 0)
    top = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
    return -(top + tl.log(tl.sum(tl.exp(ends - top), 0)))


@triton.jit
def entry_states(n, targets_ptr, targets_stride_0, targets_stride_1, input_lengths_ptr, input_lengths_stride,
                 target_lengths_ptr, target_lengths_stride, T, C, WIDTH, blank, CONCATENATED: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    """(frames, length, s, count, states, skip, readable) of entry n: its clamped lengths and
    extended labels."""
    frames = tl.load(input_lengths_ptr + n * input_lengths_stride).to(tl.int64)
    frames = tl.minimum(tl.maximum(frames, 0), T)
    first, label_stride, length = entry_labels(n, targets_stride_0, targets_stride_1, target_lengths_ptr,
                                               target_lengths_stride, WIDTH, CONCATENATED, BLOCK_N)
    s, count, states, skip, readable = extended_states(targets_ptr, first, label_stride, length, blank, C, BLOCK_L)
    return frames, length, s, count, states, skip, readable


@triton.jit
def given_nll(rows_ptr, row_stride, state_stride, STATES, frames, s, count):
    """The loss of an entry from its stored log_alpha rows (the last frame's)."""
    last = tl.load(rows_ptr + (frames - 1) * row_stride + s * state_stride,
                   mask=(s < STATES) & (s < count) & (frames > 0), other=float("-inf"))
    return negative_log_likelihood(tl.where(frames > 0, last, tl.where(s == 0, 0.0, float("-inf"))), s, count)


@triton.jit
def loss_entry(lp_ptr, lp_stride_t, lp_stride_n, lp_stride_c, targets_ptr, targets_stride_0, targets_stride_1,
               input_lengths_ptr, input_lengths_stride, target_lengths_ptr, target_lengths_stride, loss_ptr,
               loss_stride, alpha_ptr, alpha_stride_n, alpha_stride_t, alpha_stride_s, STATES, T, C, WIDTH, blank,
               ZERO_INFINITY: tl.constexpr, REDUCTION: tl.constexpr, CONCATENATED: tl.constexpr,
               STORE_ALPHA: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    """Entry n's loss (this program's): zeroed where infinite and ZERO_INFINITY, divided by its
    target length (at least 1) for MEAN, stored at loss_ptr + n * loss_stride; where STORE_ALPHA,
    its log_alpha [T, STATES] too (-inf past its frames and states), for the gradient."""
    n = tl.program_id(0).to(tl.int64)
    frames, length, s, count, states, skip, readable = entry_states(
        n, targets_ptr, targets_stride_0, targets_stride_1, input_lengths_ptr, input_lengths_stride,
        target_lengths_ptr, target_lengths_stride, T, C, WIDTH, blank, CONCATENATED, BLOCK_L, BLOCK_N)
    rows_ptr = alpha_ptr + n * alpha_stride_n
    alpha = alpha_pass(lp_ptr + n * lp_stride_n, lp_stride_t, lp_stride_c, frames, s, count, states, skip, readable,
                       rows_ptr, alpha_stride_t, alpha_stride_s, STATES, STORE_ALPHA)
    if STORE_ALPHA:
        for t in range(frames, T):
            tl.store(rows_ptr + t * alpha_stride_t + s * alpha_stride_s,
                     tl.full([BLOCK_L], float("-inf"), tl.float32), mask=s < STATES)
    nll = negative_log_likelihood(alpha, s, count)
    if ZERO_INFINITY:
        nll = tl.where(nll == float("inf"), 0.0, nll)
    if REDUCTION == MEAN:
        nll = nll / tl.maximum(length, 1).to(tl.float32)
    tl.store(loss_ptr + n * loss_stride, nll.to(loss_ptr.dtype.element_ty))


@triton.jit
def reduce_losses(losses_ptr, N, out_ptr, REDUCTION: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sum (MEAN: the mean) of the N entry losses, in one program, in a fixed order."""
    offsets = tl.arange(0, BLOCK_N)
    total = tl.zeros([], dtype=tl.float32)
    for m0 in range(0, N, BLOCK_N):
        total += tl.sum(tl.load(losses_ptr + m0 + offsets, mask=m0 + offsets < N, other=0.0), 0)
    if REDUCTION == MEAN:
        total = total / N
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@triton.jit
def loss_scale(grad_loss_ptr, grad_loss_stride, n, length, N, REDUCTION: tl.constexpr):
    """g_n: the gradient of the reduced loss with respect to entry n's loss."""
    if REDUCTION == NONE:
        scale = tl.load(grad_loss_ptr + n * grad_loss_stride).to(tl.float32)
    else:
        scale = tl.load(grad_loss_ptr).to(tl.float32)
    if REDUCTION == MEAN:
        scale = scale / tl.maximum(length, 1).to(tl.float32) / N
    return scale


@triton.jit
def store_frame(lp_row_ptr, lp_stride_c, grad_row_ptr, grad_stride_c, states, per_state, nll, scale, zeroed, C,
                BLOCK_C: tl.constexpr):
    """One frame of d log_probs, BLOCK_C classes at a time: (exp(lp) - occupancy) * scale, the
    occupancy of class c the sum of per_state over the states of class c, plus torch's start
    value exp(-inf + nll) (0, NaN for an infinite loss); 0 where `zeroed`."""
    absent = tl.exp(float("-inf") + nll)
    for c0 in range(0, C, BLOCK_C):
        classes = c0 + tl.arange(0, BLOCK_C)
        hits = states[None, :] == classes[:, None]
        occupancy = tl.sum(tl.where(hits, per_state[None, :], 0.0), 1) + absent
        lp = tl.load(lp_row_ptr + classes * lp_stride_c, mask=classes < C, other=0.0).to(tl.float32)
        value = tl.where(zeroed, 0.0, (tl.exp(lp) - occupancy) * scale)
        tl.store(grad_row_ptr + classes * grad_stride_c, value.to(grad_row_ptr.dtype.element_ty), mask=classes < C)


@triton.jit
def occupancy_entry(lp_ptr, lp_stride_t, lp_stride_n, lp_stride_c, targets_ptr, targets_stride_0, targets_stride_1,
                    input_lengths_ptr, input_lengths_stride, target_lengths_ptr, target_lengths_stride, rows_ptr,
                    nll_ptr, alpha_ptr, alpha_stride_n, alpha_stride_t, alpha_stride_s, STATES, T, C, WIDTH, blank,
                    CONCATENATED: tl.constexpr, ALPHA_GIVEN: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The recursions of entry n (this program's): log_alpha (the forward's rows where
    ALPHA_GIVEN, else an alpha pass into its scratch rows), then the frames from the last one
    back with log_beta, each frame's scratch row becoming its states' exp(log_alpha + log_beta +
    nll - log_probs): the probability of the alignments through (t, s) over that of the state's
    class at t. The entry's nll goes to nll_ptr[n]; frame_gradient turns the rows into
    d log_probs, every frame in parallel."""
    n = tl.program_id(0).to(tl.int64)
    entry_rows_ptr = rows_ptr + n * T * BLOCK_L
    frames, length, s, count, states, skip, readable = entry_states(
        n, targets_ptr, targets_stride_0, targets_stride_1, input_lengths_ptr, input_lengths_stride,
        target_lengths_ptr, target_lengths_stride, T, C, WIDTH, blank, CONCATENATED, BLOCK_L, BLOCK_N)
    lp_entry_ptr = lp_ptr + n * lp_stride_n
    if ALPHA_GIVEN:
        alpha_rows_ptr = alpha_ptr + n * alpha_stride_n
        alpha_row_stride = alpha_stride_t
        alpha_state_stride = alpha_stride_s
        alpha_states = STATES
        nll = given_nll(alpha_rows_ptr, alpha_row_stride, alpha_state_stride, alpha_states, frames, s, count)
    else:
        alpha_rows_ptr = entry_rows_ptr
        alpha_row_stride = BLOCK_L
        alpha_state_stride = 1
        alpha_states = BLOCK_L
        alpha = alpha_pass(lp_entry_ptr, lp_stride_t, lp_stride_c, frames, s, count, states, skip, readable,
                           alpha_rows_ptr, alpha_row_stride, alpha_state_stride, alpha_states, True)
        nll = negative_log_likelihood(alpha, s, count)
        tl.debug_barrier()  # the alpha rows are read back by other threads of the program
    tl.store(nll_ptr + n, nll)
    # beta may come from s + 2 where alpha of s + 2 may come from s: two different labels
    two_on_states = tl.gather(states, tl.minimum(s + 2, BLOCK_L - 1), 0)
    skip_down = (s % 2 == 1) & (s + 2 < count) & (two_on_states != states)
    last = tl.maximum(frames - 1, 0)
    emit = emissions(lp_entry_ptr + last * lp_stride_t, lp_stride_c, states, readable)
    beta = tl.where((s == count - 1) | (s == count - 2), emit, float("-inf"))
    for step in range(0, frames):
        t = frames - 1 - step
        # the frame before's emissions load a step ahead, while this frame's row is written
        emit_before = emissions(lp_entry_ptr + (t - 1) * lp_stride_t, lp_stride_c, states, readable & (t >= 1))
        alpha = tl.load(alpha_rows_ptr + t * alpha_row_stride + s * alpha_state_stride, mask=s < alpha_states,
                        other=float("-inf"))
        # alpha and beta both hold the frame's emission: it is taken out once
        tl.store(entry_rows_ptr + t * BLOCK_L + s, tl.where(readable, tl.exp(alpha + beta + nll - emit), 0.0))
        one_on = tl.where(s + 1 < count, tl.gather(beta, tl.minimum(s + 1, BLOCK_L - 1), 0), float("-inf"))
        two_on = tl.where(skip_down, tl.gather(beta, tl.minimum(s + 2, BLOCK_L - 1), 0), float("-inf"))
        beta = emit_before + logsumexp3(beta, one_on, two_on)  # frame t - 1's (unused past frame 0)
        emit = emit_before


@triton.jit
def frame_gradient(lp_ptr, lp_stride_t, lp_stride_n, lp_stride_c, targets_ptr, targets_stride_0, targets_stride_1,
                   input_lengths_ptr, input_lengths_stride, target_lengths_ptr, target_lengths_stride,
                   grad_loss_ptr, grad_loss_stride, grad_ptr, grad_stride_t, grad_stride_n, grad_stride_c, rows_ptr,
                   nll_ptr, N, T, C, WIDTH, blank, ZERO_INFINITY: tl.constexpr, REDUCTION: tl.constexpr,
                   CONCATENATED: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """d log_probs of frames [t0, t0 + BLOCK_T) of entry n (this program's, grid
    (cdiv(T, BLOCK_T), N)) from occupancy_entry's rows and nll: 0 past the entry's input, 0 for
    an infinite loss under ZERO_INFINITY."""
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    n = tl.program_id(1).to(tl.int64)
    frames, length, s, count, states, skip, readable = entry_states(
        n, targets_ptr, targets_stride_0, targets_stride_1, input_lengths_ptr, input_lengths_stride,
        target_lengths_ptr, target_lengths_stride, T, C, WIDTH, blank, CONCATENATED, BLOCK_L, BLOCK_N)
    nll = tl.load(nll_ptr + n)
    scale = loss_scale(grad_loss_ptr, grad_loss_stride, n, length, N, REDUCTION)
    if ZERO_INFINITY:
        infinite = nll == float("inf")
    else:
        infinite = nll < float("-inf")  # never
    for t in range(t0, tl.minimum(t0 + BLOCK_T, T)):
        zeroed = infinite | (t >= frames)  # past the input: no gradient
        per_state = tl.load(rows_ptr + (n * T + t) * BLOCK_L + s, mask=readable & (t < frames), other=0.0)
        store_frame(lp_ptr + t * lp_stride_t + n * lp_stride_n, lp_stride_c,
                    grad_ptr + t * grad_stride_t + n * grad_stride_n, grad_stride_c, states, per_state, nll, scale,
                    zeroed, C, BLOCK_C)
