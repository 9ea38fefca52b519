"""Combine functions row kernels reduce with (tl.reduce and the split combine loop)."""
import triton
import triton.language as tl


@triton.jit
def mul_combine(a, b):
    return a * b


@triton.jit
def max_combine(a, b):
    # NaN wins, as in torch (tl.max and the default tl.maximum drop it)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def welford_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    """Chan's parallel update: (count, mean, sum of squared deviations) of the union."""
    count = count_a + count_b
    weight_b = tl.where(count > 0, count_b / tl.maximum(count, 1.0), 0.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * weight_b
    # an infinite mean on a side: the union's is the sum of the two (inf, or NaN for +inf and
    # -inf), as a plain sum gives; the update would compute inf - inf
    infinite = (tl.abs(mean_a) == float("inf")) | (tl.abs(mean_b) == float("inf"))
    mean = tl.where(infinite, mean_a + mean_b, mean)
    return count, mean, m2_a + m2_b + delta * delta * count_a * weight_b
