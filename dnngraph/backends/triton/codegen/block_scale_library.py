"""Device functions of the block-scale kernels (imported by the generated source as `bsq`).

A tile is [BLOCK_G // RUN, RUN, BLOCK]: BLOCK_G quantization blocks of BLOCK elements each, in
float32, a run of RUN consecutive blocks whole inside each thread (the layout the kernel's loads
give it, see codegen/block_scale.py): a block's amax, its scaling and the fp4 pair packing stay
in its thread, and a thread's RUN scales are neighbours in memory (one store). Memory is touched
as [.., N // W, W] tiles of W-element vectors (`vector_lanes`, `as_vectors`). The rules are ops/block_scale.py's, computed here on bits so that they are exact: the e8m0
exponent from the exponent and mantissa fields (no log2), the fp4 rounding by comparisons with
the midpoints between its codes.
"""
import triton
import triton.language as tl

from dnngraph.backends.triton.codegen import triton_math as tm

MANTISSA_MASK = tl.constexpr(0x7FFFFF)
E8M0_NAN = tl.constexpr(255)
TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)  # 2^-127, the value of e8m0 code 0
SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126, float32's


@triton.jit
def nan_maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(x):
    """(amax, finite) per block: the largest |x| and whether every element is finite, from one
    NaN-propagating max per element. A block that is not finite stores the NaN scale code and
    zeros whatever its amax: it gets amax 1, so that its scaling stays finite (no inf * 0)."""
    amax = tl.reduce(tl.abs(x), 2, nan_maximum)
    finite = amax < float("inf")  # False for +inf and NaN
    return tl.where(finite, amax, 1.0), finite


@triton.jit
def e8m0_exponent(amax, VMAX_EXPONENT: tl.constexpr, VMAX_MANTISSA: tl.constexpr, ROUND_UP: tl.constexpr):
    """k clamped to [-127, 127]: with ROUND_UP the smallest 2^k with 2^k * vmax >= amax (the
    exponent difference, one more where amax's mantissa is the larger), else floor(log2 amax) -
    floor(log2 vmax) (the OCP MX rule). vmax's exponent field (unbiased) and mantissa bits are
    constexprs. A subnormal or zero amax gives -127 (below 2^-126: either rule gives <= -127)."""
    bits = amax.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    mantissa = (bits & MANTISSA_MASK).to(tl.int32)
    k = exponent - VMAX_EXPONENT
    if ROUND_UP:
        k += (mantissa > VMAX_MANTISSA).to(tl.int32)
    k = tl.where(exponent == -127, -127, k)
    return tl.minimum(tl.maximum(k, -127), 127)


@triton.jit
def power_of_two(k):
    """2^k as float32 for k in [-126, 127] (a normal number: exponent field k + 127)."""
    return ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


# taken from |v|'s bits from 1 on: 252 << 22 less just under half of mantissa bit 22 (to which
# the bit itself is added: ties to even), so that bits >> 22 is the code (1.0, 254 << 22, is
# code 2; below 1, where the subtraction wraps, the other branch is taken)
LARGE_OFFSET = tl.constexpr((252 << 22) - 0x1FFFFF)


@triton.jit
def fp4_codes(values):
    """e2m1 codes (int32, sign in bit 3; only the low 4 bits are the code, as the pair packing's
    conversion to uint8 keeps them) of float32 values (saturated to +-6), nearest, ties to even, by
    float32's own rounding (a handful of operations per element, where comparing with the seven
    midpoints took about twenty: NVFP4 quantization is close to compute-bound). Below 1 the code
    is 2|v| rounded to an integer (0, 0.5 and 1 are codes 0, 1, 2); from 1 on, |v| rounded to one
    mantissa bit, whose exponent and mantissa fields are the code's."""
    bits = values.to(tl.uint32, bitcast=True)
    magnitude = tl.minimum(tl.abs(values), 6.0)  # past 6 (a float32 scale's rounding): 6
    magnitude_bits = magnitude.to(tl.uint32, bitcast=True)
    # 2|v| + 2^23 (exact before rounding) holds 2|v| rounded to an integer in its low bits, the
    # exponent of 2^23 (0x4B000000) above them: its low byte is the code alone
    small = (magnitude * 2.0 + 8388608.0).to(tl.uint32, bitcast=True)
    large = (magnitude_bits - LARGE_OFFSET + ((magnitude_bits >> 22) & 1)) >> 22
    code = tl.where(magnitude < 1.0, small, large)
    return (code | ((bits >> 28) & 8)).to(tl.int32)


@triton.jit
def fp4_values(codes):
    """float32 values of e2m1 codes (uint8, low 4 bits)."""
    magnitude_code = (codes & 7).to(tl.int32)
    # code = 2 * exponent + mantissa: 0.5 * mantissa where the exponent is 0 (0, 0.5), else
    # (1 + mantissa / 2) * 2^(exponent - 1) (1, 1.5, 2, 3, 4, 6)
    exponent = magnitude_code >> 1
    mantissa = (magnitude_code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * power_of_two(exponent - 1)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def e8m0_values(bits):
    """float32 values of e8m0 codes: 2^(bits - 127); code 0 is 2^-127, 255 NaN."""
    wide = bits.to(tl.uint32)
    value = (wide << 23).to(tl.float32, bitcast=True)
    value = tl.where(wide == 0, TWO_POW_M127, value)
    return tl.where(wide == E8M0_NAN, float("nan"), value)


@triton.jit
def normalized_e8m0(x, amax, VMAX: tl.constexpr, VMAX_EXPONENT: tl.constexpr, VMAX_MANTISSA: tl.constexpr,
                    ROUND_UP: tl.constexpr, CLAMP: tl.constexpr):
    """(elements in float32, clamped to [-vmax, vmax] where CLAMP, scale codes) of an e8m0-scaled
    tile. (Rounded up, 2^k * vmax >= amax: the clamp changes nothing.)"""
    k = e8m0_exponent(amax, VMAX_EXPONENT, VMAX_MANTISSA, ROUND_UP)
    inverse = power_of_two(-k)  # k in [-127, 126] for any finite float32 amax: 2^-k is normal
    elements = x * inverse[:, :, None]
    if CLAMP:
        elements = tl.minimum(tl.maximum(elements, -VMAX), VMAX)
    return elements, (k + 127).to(tl.uint8)


@triton.jit
def normalized_e4m3(x, amax, VMAX: tl.constexpr, CLAMP: tl.constexpr):
    """(elements in float32, clamped to [-vmax, vmax] where CLAMP, float32 scales) of an e4m3-scaled tile:
    x * (1 / (amax / vmax)), the two divisions (one per block) correctly rounded; 0 * x where
    the scale is below float32's smallest normal (its reciprocal could overflow)."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, VMAX, tl.float32))
    normal = scale >= SMALLEST_NORMAL
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(normal, scale, 1.0))
    inverse = tl.where(normal, inverse, 0.0)
    elements = x * inverse[:, :, None]
    if CLAMP:
        elements = tl.minimum(tl.maximum(elements, -VMAX), VMAX)
    return elements, scale


@triton.jit
def packed_pairs(codes):
    """[RUNS, RUN, BLOCK // 2] bytes of fp4 codes [RUNS, RUN, BLOCK]: the even element low (a
    pair is in one thread: the split takes no data movement)."""
    low, high = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1], codes.shape[2] // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def unpacked_pairs(packed):
    """fp4 codes [RUNS, RUN, BLOCK] of bytes [RUNS, RUN, BLOCK // 2]."""
    pairs = tl.join(packed & 0xF, packed >> 4)
    return tl.reshape(pairs, (packed.shape[0], packed.shape[1], packed.shape[2] * 2))


@triton.jit
def vector_lanes(N: tl.constexpr, W: tl.constexpr):
    """[N // W, W] offsets 0..N-1 of a block's elements as vectors of W: the last axis is what
    the compiler sees contiguous, so each thread's accesses are W wide, and the axes above it
    stay whole in the thread (a wider [.., N] tile would be split across threads at 16 bytes)."""
    return tl.arange(0, N // W)[:, None] * W + tl.arange(0, W)[None, :]


@triton.jit
def as_blocks(tile):
    """[RUNS, RUN, N] of a [RUNS, RUN, N // W, W] tile (in-thread: no data movement)."""
    return tl.reshape(tile, (tile.shape[0], tile.shape[1], tile.shape[2] * tile.shape[3]))


@triton.jit
def as_vectors(tile, W: tl.constexpr):
    """[RUNS, RUN, N // W, W] of a [RUNS, RUN, N] tile (in-thread: no data movement)."""
    return tl.reshape(tile, (tile.shape[0], tile.shape[1], tile.shape[2] // W, W))


@triton.jit
def nan_scale_bits(finite, bits, NAN_BITS: tl.constexpr):
    """Scale codes with the NaN code where a block is not finite."""
    return tl.where(finite, bits, NAN_BITS).to(tl.uint8)


@triton.jit
def e4m3_bits(scale, FIRST_OVERFLOW: tl.constexpr, OVERFLOW_BITS: tl.constexpr, INFINITY_BITS: tl.constexpr,
              NAN_BITS: tl.constexpr):
    """float32 scales as torch stores them in float8_e4m3fn, as codes (uint8)."""
    return tm.to_float8(scale, tl.float8e4nv, FIRST_OVERFLOW, OVERFLOW_BITS, INFINITY_BITS,
                        NAN_BITS).to(tl.uint8, bitcast=True)
