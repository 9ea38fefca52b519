"""Triton device functions the expression table calls where an op needs more than one line.

Only core triton.language is used (no libdevice) so the same source runs in the interpreter.
"""
import triton
import triton.language as tl

SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def tanh(x):
    # exp of a non-positive argument cannot overflow: tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|)
    e = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def pow_(a, b):
    # either side may be a constant: give both the broadcast shape first (zeros_like reads
    # only the shape, so NaN and inf operands stay as they are; subtracting +0 keeps a -0.0 base)
    shape = tl.zeros_like(a * b)
    a = a - shape
    b = b + shape
    magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
    b_integral = tl.floor(b) == b
    b_odd = b_integral & (tl.floor(b * 0.5) * 2.0 != b)
    negative = a < 0
    signed_zero = (a == 0.0) & (1.0 / a < 0)  # -0.0 ** odd b keeps the sign, as C's pow
    result = tl.where((negative | signed_zero) & b_odd, -magnitude, magnitude)
    finite = a - a == 0.0  # (-inf) ** b is +inf or +0 for a b that is not an odd integer, as C's pow
    result = tl.where(negative & finite & (b_integral == 0), tl.sqrt(a - tl.abs(a) - 1.0), result)  # NaN
    return tl.where(b == 0, 1.0, result)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))


@triton.jit
def gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)))


@triton.jit
def softplus(x, beta, threshold):
    bx = beta * x
    smooth = (tl.maximum(bx, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(bx)))) / beta
    return tl.where(bx > threshold, x, smooth)


@triton.jit
def relu_backward(dy, x):
    # as torch's threshold_backward: a NaN x passes dy on
    return tl.where(x <= 0, 0.0, dy)


@triton.jit
def leaky_relu_backward(dy, x, negative_slope):
    return tl.where(x > 0, dy, dy * negative_slope)


@triton.jit
def elu_backward(dy, x, alpha):
    return tl.where(x > 0, dy, dy * alpha * tl.exp(x))


@triton.jit
def gelu_backward(dy, x):
    cdf = 0.5 * (1.0 + tl.erf(x * SQRT_HALF))
    pdf = tl.exp(-0.5 * x * x) * INV_SQRT_2PI
    return dy * (cdf + x * pdf)


@triton.jit
def gelu_tanh_backward(dy, x):
    t = tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x))
    inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner)


@triton.jit
def silu_backward(dy, x):
    s = tl.sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


@triton.jit
def softplus_backward(dy, x, beta, threshold):
    bx = beta * x
    return tl.where(bx > threshold, dy, dy * tl.sigmoid(bx))


@triton.jit
def sigmoid_backward(dy, x):
    # 1 - sigmoid(x) is sigmoid(-x), which keeps its digits where sigmoid(x) rounds to 1
    return dy * tl.sigmoid(x) * tl.sigmoid(-x)


@triton.jit
def tanh_backward(dy, x):
    t = tanh(x)
    return dy * (1.0 - t * t)


@triton.jit
def dropout(x, seed, offset, counter, keep_threshold, keep_scale):
    # tl.randint is Philox 4x32-10 on counter (lo, hi, 0, 0) under key (seed lo, seed hi) and
    # returns the first output word: the generator ops/random.py defines, bit for bit (checked
    # against it for seeds and offsets past 2^32 in tests/test_dropout.py)
    bits = tl.randint(seed, offset + counter)
    # the uniform is (bits >> 8) * 2^-24: compare its 24-bit numerator, no float rounding
    keep = (bits >> 8).to(tl.int32) >= keep_threshold
    return tl.where(keep, x * keep_scale, 0.0), keep
