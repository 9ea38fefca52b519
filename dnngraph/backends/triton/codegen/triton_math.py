"""Triton device functions the expression table calls where an op needs more than one line.

Only core triton.language is used (no libdevice) so the same source runs in the interpreter.
"""
import triton
import triton.language as tl

SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_CUBIC = tl.constexpr(0.044715)
# tanh's Taylor coefficients 2^2n (2^2n - 1) B_2n / (2n)! for x^3 ... x^13
TANH_SERIES_3 = tl.constexpr(-1.0 / 3.0)
TANH_SERIES_5 = tl.constexpr(2.0 / 15.0)
TANH_SERIES_7 = tl.constexpr(-17.0 / 315.0)
TANH_SERIES_9 = tl.constexpr(62.0 / 2835.0)
TANH_SERIES_11 = tl.constexpr(-1382.0 / 155925.0)
TANH_SERIES_13 = tl.constexpr(21844.0 / 6081075.0)
SIXTH = tl.constexpr(1.0 / 6.0)


@triton.jit
def tanh(x):
    # exp of a non-positive argument cannot overflow: tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|);
    # below 0.5, 1 - e cancels (2e-6 relative error at 0.01, which Gemma-2's logit soft-cap
    # multiplies by 30), so there the odd Taylor series to x^13 holds it within 2 ulp
    magnitude = tl.abs(x)
    e = tl.exp(-2.0 * magnitude)
    z = magnitude * magnitude
    series = TANH_SERIES_13
    series = series * z + TANH_SERIES_11
    series = series * z + TANH_SERIES_9
    series = series * z + TANH_SERIES_7
    series = series * z + TANH_SERIES_5
    series = series * z + TANH_SERIES_3
    series = (series * z + 1.0) * magnitude
    magnitude = tl.where(magnitude < 0.5, series, (1.0 - e) / (1.0 + e))
    # x itself where it is zero keeps the sign of -0.0, as torch's tanh does
    return tl.where(x == 0, x, tl.where(x < 0, -magnitude, magnitude))


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _integral_magnitude(magnitude, exponent):
    # |a| ** |b| for an integral |b| by squaring over its bits, in float64 so that one rounding
    # (to a's type, by the caller) is all the error: 7 ** 2 is 49 exactly, as in torch. |b| is
    # capped at 2^31: every fp32 |a| other than 1 has over- or underflowed by then.
    bits = tl.minimum(exponent, 2147483648.0).to(tl.int64)
    base = magnitude.to(tl.float64)
    result = tl.full(base.shape, 1.0, tl.float64)
    for bit in tl.static_range(32):
        result = tl.where(((bits >> bit) & 1) != 0, result * base, result)
        base = base * base
    return result


@triton.jit
def pow_(a, b):
    # torch's (C99's) pow: a ** 0 and 1 ** b are 1, NaN included; an integral b (infinities
    # too) multiplies (_integral_magnitude); a negative a, -0.0 and -inf included, gives a negative result for an odd
    # integral b, NaN for a non-integral b when finite. Either side may be a constant: give
    # both the broadcast shape first (zeros_like reads only the shape; where, not + 0.0,
    # which would turn -0.0 into +0.0).
    everywhere = tl.zeros_like(a * b) == 0
    a = tl.where(everywhere, a, a)
    b = tl.where(everywhere, b, b)
    magnitude = tl.abs(a)
    integral = tl.floor(b) == b
    odd = integral & (tl.floor(b * 0.5) * 2.0 != b)
    squared = _integral_magnitude(magnitude, tl.abs(b))
    squared = tl.where(b < 0, 1.0 / squared, squared).to(a.dtype)
    # other exponents in float64 too: float32's log2 lost up to |b log2 a| ulps (10 ** 2.5 was
    # 316.2277 for torch's 316.22775)
    logarithmic = tl.exp2(b.to(tl.float64) * tl.log2(magnitude.to(tl.float64))).to(a.dtype)
    result = tl.where(integral, squared, logarithmic)
    negative = (a < 0) | ((a == 0) & (1.0 / a < 0))  # the sign bit: -0.0 counts
    result = tl.where(negative & odd, result * -1.0, result)  # -result is 0 - result: +0.0
    finite_negative = (a < 0) & (magnitude != float("inf"))
    result = tl.where(finite_negative & (integral == 0), float("nan"), result)
    return tl.where((b == 0) | (a == 1), 1.0, result)


@triton.jit
def ipow(a, b):
    # integer a ** b exactly, wrapping like torch: squaring over b's bits in a's type; a
    # negative b gives 1 for a == 1, +-1 for a == -1 (by b's parity) and 0 otherwise
    shape = tl.zeros_like(a * b)
    base = a + shape
    exponent = (b + shape).to(tl.int64)
    result = shape + 1
    for bit in tl.static_range(63):
        result = tl.where(((exponent >> bit) & 1) != 0, result * base, result)
        base = base * base
    negative_power = tl.where(a + shape == 1, 1, 0)
    negative_power = tl.where(a + shape == -1, tl.where((exponent & 1) != 0, -1, 1), negative_power)
    return tl.where(exponent < 0, negative_power.to(result.dtype), result)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))


@triton.jit
def gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)))


# -- GELU for an epilogue whose result is stored in a float type narrower than float32
# -- (problems/base.py fast_math_outputs decides where): within 1e-6 of the value for x >= -3,
# -- as gelu / gelu_tanh above (2e-7 to 3e-5 measured there), and 1e-5 in the tail below, where
# -- those keep no digit past x = -5 (1 + erf or 1 + tanh cancels); 0.003 of a bf16 or fp16 ulp
# -- over every float (tests/ops/test_gelu_fast_math.py sweeps them), half the instructions.
# -- One exp2 and one division each: no series, no erf. On the GPU tl.exp2 is ex2.approx.ftz
# -- (2 ulp, and 0 below 2^-126) and the division div.full (2 ulp): a factor below 2^-126 (x past
# -- -10.1 for gelu_tanh, -13.2 for gelu) leaves -0.0 where the interpreter keeps values under
# -- |x| 2^-126 (reachable in bf16 only; torch's float32 GELU gives -0.0 from x = -5.9 on).
LOG2E = 1.4426950408889634
# gelu_tanh(x) = x * sigmoid(2u) = x / (1 + 2^t), t = -2 log2(e) u = x (GELU_EXP2_1 + GELU_EXP2_3 x^2)
GELU_EXP2_1 = tl.constexpr(-2.0 * 0.7978845608028654 * LOG2E)
GELU_EXP2_3 = tl.constexpr(-2.0 * 0.7978845608028654 * 0.044715 * LOG2E)
# gelu(x) = x * Phi(x); q = Phi(-|x|) = erfc(z) / 2, z = |x| / sqrt(2), by Numerical Recipes' erfcc
# (fractional error below 1.2e-7 for every z >= 0): erfc(z) = s exp(-z^2 + P(s)), s = 1 / (1 + z / 2),
# P's coefficients taken to base 2 (times log2(e)), the constant one less for the halving
ERFC_S = tl.constexpr(0.5 * 0.7071067811865476)
HALF_LOG2E = tl.constexpr(0.5 * LOG2E)
ERFC_P0 = tl.constexpr(-1.26551223 * LOG2E - 1.0)
ERFC_P1 = tl.constexpr(1.00002368 * LOG2E)
ERFC_P2 = tl.constexpr(0.37409196 * LOG2E)
ERFC_P3 = tl.constexpr(0.09678418 * LOG2E)
ERFC_P4 = tl.constexpr(-0.18628806 * LOG2E)
ERFC_P5 = tl.constexpr(0.27886807 * LOG2E)
ERFC_P6 = tl.constexpr(-1.13520398 * LOG2E)
ERFC_P7 = tl.constexpr(1.48851587 * LOG2E)
ERFC_P8 = tl.constexpr(-0.82215223 * LOG2E)
ERFC_P9 = tl.constexpr(0.17087277 * LOG2E)


@triton.jit
def gelu_tanh_fast(x):
    # 2^-|t| never overflows: where t > 0 (x < 0) the quotient is x 2^-t / (1 + 2^-t), so the
    # tail keeps its digits down to float32's underflow (to |x| 2^-126 on the GPU: see above).
    # -inf gives NaN (-inf * 0) and +inf gives inf, NaN stays NaN, -0.0 stays -0.0: as
    # gelu_tanh and torch.
    t = x * (GELU_EXP2_1 + GELU_EXP2_3 * x * x)
    e = tl.exp2(-tl.abs(t))
    return tl.where(t > 0, x * e, x) / (1.0 + e)


@triton.jit
def gelu_fast(x):
    # x q for x < 0 and x (1 - q) otherwise: 1 - q >= 1/2 cancels nothing, and x * q alone would
    # make +inf * 0 a NaN. -inf gives NaN (-inf * 0), as gelu and torch.
    magnitude = tl.abs(x)
    s = 1.0 / (1.0 + magnitude * ERFC_S)
    p = ERFC_P9
    p = p * s + ERFC_P8
    p = p * s + ERFC_P7
    p = p * s + ERFC_P6
    p = p * s + ERFC_P5
    p = p * s + ERFC_P4
    p = p * s + ERFC_P3
    p = p * s + ERFC_P2
    p = p * s + ERFC_P1
    p = p * s + ERFC_P0
    q = s * tl.exp2(p - magnitude * magnitude * HALF_LOG2E)
    return tl.where(x < 0, x * q, x * (1.0 - q))


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
def clipped_relu(x, lower, upper, slope):
    # the cuDNN frontend's relu with clips (ops/pointwise.py _relu): a zero slope is the constant
    # lower clip (0 * -inf would be NaN); a NaN x fails both comparisons and stays NaN
    below = tl.where(slope == 0, lower, lower + slope * (x - lower))
    return tl.where(x >= upper, upper, tl.where(x <= lower, below, x))


@triton.jit
def clipped_relu_backward(dy, x, lower, upper, slope):
    # dy between the clips and for a NaN x; slope * dy at and below the lower clip (0 for a zero
    # slope, an infinite dy included); 0 at and above the upper clip
    below = tl.where(slope == 0, 0.0, dy * slope)
    return tl.where(x >= upper, 0.0, tl.where(x <= lower, below, dy))


@triton.jit
def swish_backward(dy, x, beta):
    # d/dx x sigmoid(beta x) = s (1 + beta x (1 - s)), as torch's silu backward at beta = 1
    s = tl.sigmoid(beta * x)
    return dy * s * (1.0 + beta * x * (1.0 - s))


@triton.jit
def clamp_keeping_nan(x, low, high):
    # torch's clamp: a NaN stays NaN (comparisons with it are false)
    return tl.where(x < low, low, tl.where(x > high, high, x))


@triton.jit
def hardsigmoid(x):
    # torch's order of operations: min(max(x + 3, 0), 6) / 6
    return clamp_keeping_nan(x + 3.0, 0.0, 6.0) / 6.0


@triton.jit
def hardswish(x):
    # x * min(max(x + 3, 0), 6) / 6 as torch computes it (-inf gives -inf * 0, NaN)
    return x * clamp_keeping_nan(x + 3.0, 0.0, 6.0) / 6.0


@triton.jit
def hardswish_backward(dy, x):
    # torch's boundaries: 0 up to and at -3, the slope x / 3 + 1/2 inside, dy from 3 on (and
    # for a NaN x, whose comparisons are all false)
    inside = tl.where(x <= -3.0, 0.0, dy * (x / 3.0 + 0.5))
    return tl.where(x < 3.0, inside, dy)


@triton.jit
def hardsigmoid_backward(dy, x):
    # dy / 6 strictly inside (-3, 3), 0 elsewhere and for a NaN x (torch's rule)
    return tl.where((x > -3.0) & (x < 3.0), dy * SIXTH, 0.0)


@triton.jit
def hardtanh_backward(dy, x, low, high):
    # as torch: 0 at and beyond the bounds, dy inside; a NaN x passes dy on
    return tl.where((x <= low) | (x >= high), 0.0, dy)


@triton.jit
def dropout(x, seed, offset, counter, keep_threshold, keep_scale):
    # tl.randint is Philox 4x32-10 on counter (lo, hi, 0, 0) under key (seed lo, seed hi) and
    # returns the first output word: the generator ops/random.py defines, bit for bit (checked
    # against it for seeds and offsets past 2^32 in tests/ops/test_dropout.py)
    bits = tl.randint(seed, offset + counter)
    # the uniform is (bits >> 8) * 2^-24: compare its 24-bit numerator, no float rounding
    keep = (bits >> 8).to(tl.int32) >= keep_threshold
    return tl.where(keep, x * keep_scale, 0.0), keep


@triton.jit
def int_to_bfloat16(x):
    # torch rounds an integer to float32, then to bf16 (twice); sm_90's compiler folds the two
    # conversions into one (16842753 became 16908288 for torch's 16777216), so the second
    # rounding, to nearest even, is done on the float32's bits (finite: every integer is)
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def to_float8(x, FP8: tl.constexpr, FIRST_OVERFLOW: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
              INFINITY_BITS: tl.constexpr, NAN_BITS: tl.constexpr):
    # float32 x to fp8 as torch converts (codegen/conversions.py): Triton's conversion rounds to
    # nearest even, and on sm_90 saturates and drops NaN's sign, so the encodings torch gives
    # for overflow, infinity and NaN replace its answer there; the sign is always x's
    bits = x.to(FP8).to(tl.uint8, bitcast=True)
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    magnitude = tl.abs(x)
    bits = tl.where(magnitude >= FIRST_OVERFLOW, (sign | OVERFLOW_BITS).to(tl.uint8), bits)
    bits = tl.where(magnitude == float("inf"), (sign | INFINITY_BITS).to(tl.uint8), bits)
    bits = tl.where(x != x, (sign | NAN_BITS).to(tl.uint8), bits)
    return bits.to(tl.uint8).to(FP8, bitcast=True)


ROUNDING_SHIFT = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def float_to_int8(x):
    # cuDNN's int8 conversion (dtypes.to_int8): saturate to [-128, 127], round to nearest even,
    # NaN to 0. Clamping first keeps the value in range; adding and subtracting 1.5 * 2^23 then
    # rounds it to an integer through the add's own rounding (nearest even: exact IEEE float32
    # math, which the compiler may not reassociate), so the conversion to int8 is exact.
    x = x.to(tl.float32)
    clamped = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -128.0), 127.0)
    return ((clamped + ROUNDING_SHIFT) - ROUNDING_SHIFT).to(tl.int8)


@triton.jit
def saturate_int8(x):
    # an integer to int8 saturates as cuDNN's int8 outputs do (Triton's conversion would wrap)
    return tl.minimum(tl.maximum(x, -128), 127).to(tl.int8)


@triton.jit
def float_to_uint8(x):
    # float_to_int8's rounding to [0, 255] (dtypes.to_uint8): negative values and -inf to 0
    x = x.to(tl.float32)
    clamped = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), 0.0), 255.0)
    return ((clamped + ROUNDING_SHIFT) - ROUNDING_SHIFT).to(tl.uint8)


@triton.jit
def saturate_uint8(x):
    # an integer to uint8 saturates to [0, 255] (Triton's conversion would wrap)
    return tl.minimum(tl.maximum(x, 0), 255).to(tl.uint8)
