"""Block-scale quantization (MXFP8, MXFP4, NVFP4): block_scale_quantize / block_scale_dequantize
bit-exact against the float64 reference, the block-scaled matmul (dequantized in its operand
loader) against float64, the packed fp4 and e8m0 data types, and typed errors."""
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dnngraph as dg
from dnngraph import dtypes
from dnngraph.backends.triton.heuristics.block_scale import BlockScaleConfig
from dnngraph.fusion import partition
from dnngraph.ops.block_scale import FP4_BOUNDARIES, FP4_MAGNITUDES, pack_fp4, round_fp4, unpack_fp4

# (y type, scale type, block size): MXFP8 (both fp8 kinds), MXFP4, NVFP4, fp8 with e4m3 scales
FORMATS = [(dg.float8_e4m3, dg.float8_e8m0, 32), (dg.float8_e5m2, dg.float8_e8m0, 32),
           (dg.float4_e2m1, dg.float8_e8m0, 32), (dg.float4_e2m1, dg.float8_e4m3, 16),
           (dg.float8_e4m3, dg.float8_e4m3, 16)]
FORMAT_IDS = ["mxfp8-e4m3", "mxfp8-e5m2", "mxfp4", "nvfp4", "fp8-e4m3-scale"]
POISON = 0xAB


def storage(handle, device="cpu") -> torch.Tensor:
    """A poisoned torch tensor holding graph tensor `handle` (packed fp4: half the items)."""
    shape, strides = dtypes.storage_layout(handle.dim, handle.stride, handle.data_type)
    out = torch.empty_strided(shape, strides, dtype=handle.data_type.torch_dtype, device=device)
    out.view(torch.uint8).fill_(POISON) if out.element_size() == 1 else out.fill_(math.nan)
    return out


def codes(values: torch.Tensor, data_type) -> torch.Tensor:
    """The bytes fp8 `data_type` stores float64 `values` as (they are values it holds)."""
    return values.to(data_type.torch_dtype).view(torch.uint8)


def special_blocks(rows: int, cols: int, block: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Random rows of blocks, some of them adversarial: zeros, -0, a NaN, +-inf, float32
    subnormals, huge values, elements on fp4 and fp8 rounding midpoints, one tiny element,
    subnormal elements under a small normal amax."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=generator))
    kinds = [lambda b: b.zero_(), lambda b: b.copy_(-0.0 * b.abs()), lambda b: b.index_fill_(0, torch.tensor([3]), math.nan),
             lambda b: b.index_fill_(0, torch.tensor([1]), math.inf), lambda b: b.index_fill_(0, torch.tensor([2]), -math.inf),
             lambda b: b.copy_(torch.randn(block, generator=generator) * 1e-40),
             lambda b: b.copy_(torch.randn(block, generator=generator) * 1e37),
             # midpoints of e2m1 and e4m3 after a scale of 2^-3 (amax 6 * 2^-3 -> scale exactly 2^-3)
             lambda b: b.copy_(torch.tensor(([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -5.0, 4.5, 0.3125]
                                             * block)[:block]) / 8),
             lambda b: b.copy_(torch.tensor(([448.0, 17.0, 19.0, 9.5, 0.0029296875, -0.0009765625, 1.0625]
                                             * block)[:block])),
             lambda b: b.copy_(torch.full((block,), 1.0)).index_fill_(0, torch.tensor([0]), 1e-30),
             # a normal amax just above float32's subnormals, the other elements subnormal: each
             # scales to a code above zero (a device that flushed subnormal inputs would store 0)
             lambda b: b.copy_(torch.randn(block, generator=generator) * 1e-38).index_fill_(0, torch.tensor([0]), 6e-38)]
    blocks = x.view(rows, cols // block, block)
    for index, kind in enumerate(kinds):
        if index < blocks.shape[0] * blocks.shape[1]:
            kind(blocks[index % rows, index // rows])
    return x.to(dtype)


def quantize_graph(x_t, block, y_type, scale_type, axis=-1, y_stride=None, scale_stride=None, rounding="up"):
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    y, scale = g.block_scale_quantize(x, block_size=block, axis=axis, scale_rounding=rounding)
    y.set_output(True).set_data_type(y_type)
    scale.set_output(True).set_data_type(scale_type)
    if y_stride is not None:
        y.set_stride(y_stride)
    if scale_stride is not None:
        scale.set_stride(scale_stride)
    return g, x, y, scale


def run_quantize(g, x, y, scale, x_t):
    if g.plan is None:
        g.build()
    y_t, scale_t = storage(y, x_t.device), storage(scale, x_t.device)
    g.execute({x: x_t, y: y_t, scale: scale_t})
    return y_t, scale_t


def assert_quantize_bit_exact(g, x, y, scale, x_t):
    y_t, scale_t = run_quantize(g, x, y, scale, x_t)
    ref = g.reference({x: x_t.cpu()})
    expected_scale = ref[scale.name].to(scale.data_type.torch_dtype).view(torch.uint8)
    assert torch.equal(scale_t.cpu().view(torch.uint8), expected_scale)
    if y.data_type is dg.float4_e2m1:
        axis = dtypes.packed_axis(y.dim, y.stride)
        expected = pack_fp4(ref[y.name].movedim(axis, -1)).view(torch.uint8)
        assert torch.equal(y_t.cpu().view(torch.uint8).movedim(axis, -1), expected)
    else:
        assert torch.equal(y_t.cpu().view(torch.uint8), codes(ref[y.name], y.data_type))


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_quantize_is_bit_exact_with_the_reference(y_type, scale_type, block, dtype):
    x_t = special_blocks(7, 3 * block, block, seed=block)  # 7 rows: a partial last tile
    if dtype in (torch.float16, torch.float8_e5m2):
        x_t = x_t.nan_to_num(posinf=math.inf, neginf=-math.inf).clamp(-5e4, 5e4)
    x_t = x_t.to(dtype)
    assert_quantize_bit_exact(*quantize_graph(x_t, block, y_type, scale_type), x_t)


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
def test_quantize_non_contiguous_input_and_blocks_along_a_middle_axis(y_type, scale_type, block):
    wide = special_blocks(5 * 4, 2 * block, block, seed=3).view(5, 4, 2 * block)
    x_t = wide.transpose(1, 2)[:, :, 1:4]  # [5, 2 * block, 3]: strided, blocks along axis 1
    y_stride = [3 * 2 * block, 1, 2 * block] if y_type is dg.float4_e2m1 else None  # packed along the blocks
    g, x, y, scale = quantize_graph(x_t, block, y_type, scale_type, axis=1, y_stride=y_stride,
                                    scale_stride=[1, 3 * 5, 5])  # scale [5, 2, 3] stored axis-permuted
    assert_quantize_bit_exact(g, x, y, scale, x_t)


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
def test_transpose_lays_y_and_scale_out_with_the_block_axis_innermost(y_type, scale_type, block):
    """transpose=True (the frontend's): y and scale take x's stride order rotated so the block
    axis is the stride-1 one (column-wise quantization of a row-major x), bit-exact with the
    reference; the layout is plain strides, which set_stride may still override."""
    # row-major [3, 2 * block, 5], the special blocks along axis 1
    x_t = special_blocks(3 * 5, 2 * block, block, seed=6).view(3, 5, 2 * block).transpose(1, 2).contiguous()
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    y, scale = g.block_scale_quantize(x, block_size=block, axis=1, transpose=True)
    y.set_output(True).set_data_type(y_type)
    scale.set_output(True).set_data_type(scale_type)
    # x's order innermost first: 2, 1, 0; rotated to start at axis 1: 1, 0, 2
    assert y.stride == (2 * block, 1, 3 * 2 * block) and scale.stride == (2, 1, 3 * 2)
    assert_quantize_bit_exact(g, x, y, scale, x_t)
    plain = dg.Graph()
    x2 = plain.tensor_like(x_t, "x")
    y2, scale2 = plain.block_scale_quantize(x2, block_size=block, axis=1)
    assert y2.stride == tuple(x_t.stride())  # without transpose: x's layout
    untouched = dg.Graph.from_json(g.to_json())
    assert untouched.tensor_by_name(y.name).stride == y.stride


@pytest.mark.parametrize("shape,expanded", [((1, 64), (5, 64)), ((3, 1, 32), (3, 4, 32)), ((1, 1, 32), None)])
def test_broadcast_and_size_one_axes(shape, expanded):
    """(dnngraph has no size-0 axes: dims are positive)"""
    x_t = special_blocks(math.prod(shape[:-1]), shape[-1], 16, seed=4).reshape(shape)
    if expanded is not None:
        x_t = x_t.expand(expanded)  # stride-0 axes
    for y_type, scale_type, block in (FORMATS[0], FORMATS[3]):
        assert_quantize_bit_exact(*quantize_graph(x_t, block, y_type, scale_type), x_t)


@pytest.mark.parametrize("y_type", [dg.float8_e4m3, dg.float8_e5m2, dg.float4_e2m1])
def test_ocp_floor_rounding_of_e8m0_scales(y_type):
    """scale_rounding="floor": k = floor(log2 amax) - emax, bit-exact; the largest elements of a
    block whose amax mantissa exceeds vmax's clamp to vmax; NVFP4's e4m3 scales refuse it."""
    x_t = special_blocks(5, 96, 32, seed=21)
    g, x, y, scale = quantize_graph(x_t, 32, y_type, dg.float8_e8m0, rounding="floor")
    assert_quantize_bit_exact(g, x, y, scale, x_t)
    probe = torch.zeros(1, 32)
    probe[0, 0] = 500.0  # floor(log2 500) = 8
    g, x, y, scale = quantize_graph(probe, 32, dg.float8_e4m3, dg.float8_e8m0, rounding="floor")
    ref = g.reference({x: probe})
    assert ref[scale.name].item() == 1.0 and ref[y.name][0, 0].item() == 448.0
    g, *_ = quantize_graph(probe, 32, dg.float4_e2m1, dg.float8_e4m3, rounding="floor")
    with pytest.raises(dg.ValidationError, match="scale_rounding"):
        g.build()


def test_reference_rules_by_hand():
    """MXFP8: the smallest power-of-two scale with scale * 448 >= amax (e8m0 code 127 + k), the
    elements x / scale rounded to e4m3; an all-zero block takes code 0; NaN and inf blocks a
    NaN scale and zero elements. NVFP4: scale = amax / 6 as e4m3, elements x * (1 / (amax / 6))."""
    x_t = torch.zeros(4, 32)
    x_t[0, :2] = torch.tensor([449.0, -3.0])  # amax just past 448: scale 2
    x_t[1, :2] = torch.tensor([448.0, 1.0])  # exactly 448: scale 1
    x_t[3, 5] = math.nan
    g, x, y, scale = quantize_graph(x_t, 32, dg.float8_e4m3, dg.float8_e8m0)
    ref = g.reference({x: x_t})
    assert ref[scale.name][:, 0].tolist()[:3] == [2.0, 1.0, 2.0 ** -127] and math.isnan(ref[scale.name][3, 0])
    assert ref[y.name][0, :2].tolist() == [224.0, -1.5] and ref[y.name][1, :2].tolist() == [448.0, 1.0]
    assert not ref[y.name][3].any()
    x_t = torch.zeros(1, 16)
    x_t[0, :3] = torch.tensor([3.0, 0.75, -0.3])
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e4m3)
    ref = g.reference({x: x_t})
    assert ref[scale.name].item() == 0.5  # 3 / 6
    assert ref[y.name][0, :3].tolist() == [6.0, 1.5, -0.5]  # -0.6 -> -0.5


class CudaScalarDivision(TorchFunctionMode):
    """torch's floating division as its CUDA kernels compute it, on the CPU: a tensor divided by a
    CPU scalar (a Python number or a 0-dim CPU tensor) is multiplied by the scalar's reciprocal,
    rounded to the tensor's type (ATen's div_true_kernel_cuda; float32 here). Rules written in
    torch ops must give the same bytes under it as without it to hold on a GPU."""

    DIVISIONS = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide, torch.Tensor.__truediv__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.DIVISIONS and not kwargs and len(args) == 2 and self.is_cpu_scalar(args[1]) \
                and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.float32, torch.float64):
            numerator, divisor = args
            reciprocal = 1.0 / torch.tensor(float(divisor), dtype=numerator.dtype)  # in the type's precision
            return numerator * reciprocal
        return func(*args, **(kwargs or {}))

    @staticmethod
    def is_cpu_scalar(value) -> bool:
        if isinstance(value, torch.Tensor):
            return value.dim() == 0 and value.device.type == "cpu"
        return isinstance(value, (int, float))


def reciprocal_sensitive_blocks(count: int, block: int = 16, seed: int = 0) -> torch.Tensor:
    """[count, block] float32 blocks whose NVFP4 elements depend on how amax / 6 is rounded: amax
    (element 0) is one where amax * fl(1/6) (CUDA's division by a scalar) is not the correctly
    rounded fl(amax / 6), and element 1 is a float32 step or a few from an e2m1 midpoint times the
    scale, where x * (1 / s) takes another code under the two scales; the rest random, below amax."""
    generator = torch.Generator().manual_seed(seed)
    amax = (1 + torch.rand(1 << 14, generator=generator)) * torch.exp2(torch.randint(-8, 8, (1 << 14,), generator=generator).float())
    exact, product = amax / torch.full_like(amax, 6.0), amax * (1.0 / torch.tensor(6.0))
    rounded_apart = exact != product
    amax, exact, product = amax[rounded_apart], exact[rounded_apart], product[rounded_apart]
    midpoints = torch.tensor([boundary for boundary, _ in FP4_BOUNDARIES])
    steps = torch.arange(-4, 5, dtype=torch.int32)
    near = (midpoints[None, :] * exact[:, None]).view(torch.int32)[:, :, None] + steps  # positive: steps in bits
    x = near.view(torch.float32).flatten(1)  # [amaxes, midpoints * steps]
    codes_apart = round_fp4(x * (1.0 / exact)[:, None]) != round_fp4(x * (1.0 / product)[:, None])
    found = codes_apart.any(1).nonzero().flatten()[:count]
    assert len(found) == count, "too few amax values whose quotients round apart"
    blocks = (torch.rand(count, block, generator=generator) * 2 - 1) * amax[found, None] * 0.9
    blocks[:, 0] = amax[found]
    blocks[:, 1] = x[found, codes_apart[found].int().argmax(1)]
    return blocks


def test_nvfp4_rules_hold_under_cuda_division():
    """The float64 reference's NVFP4 scale is amax / 6 correctly rounded on any device: under
    CUDA's division by a CPU scalar (CudaScalarDivision) it still gives the kernel's bytes, on
    blocks whose elements take other codes where the scale is amax * fl(1/6) (the sweep's eager
    check on the H200 computed that, and reported every NVFP4 config as a mismatch)."""
    x_t = reciprocal_sensitive_blocks(24).reshape(6, 64)
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e4m3)
    y_t, scale_t = run_quantize(g, x, y, scale, x_t)
    blocks = x_t.view(24, 16)
    under_cuda = blocks * (1.0 / (blocks[:, :1] * (1.0 / torch.tensor(6.0))))
    assert (pack_fp4(round_fp4(under_cuda)).view(torch.uint8).view(6, 32) != y_t.view(torch.uint8)).any()
    with CudaScalarDivision():
        ref = g.reference({x: x_t})
    assert torch.equal(y_t.view(torch.uint8), pack_fp4(ref[y.name]).view(torch.uint8))
    assert torch.equal(scale_t.view(torch.uint8), ref[scale.name].to(torch.float8_e4m3fn).view(torch.uint8))


def test_every_fp4_midpoint_rounds_to_even():
    midpoints = [(a + b) / 2 for a, b in zip(FP4_MAGNITUDES, FP4_MAGNITUDES[1:])]
    evens = [FP4_MAGNITUDES[i] if i % 2 == 0 else FP4_MAGNITUDES[i + 1] for i in range(len(midpoints))]
    x_t = torch.zeros(1, 16)
    x_t[0, 0] = 6.0  # scale exactly 1
    x_t[0, 1:8] = torch.tensor(midpoints)
    x_t[0, 8:15] = -torch.tensor(midpoints)
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e8m0)
    y_t, _ = run_quantize(g, x, y, scale, x_t)
    values = unpack_fp4(y_t)[0]
    assert values[1:8].tolist() == evens and values[8:15].tolist() == [-e for e in evens]


def test_fp4_codes_next_to_every_midpoint_and_code():
    """The fp4 encoding (float32 rounding on the bits) against the reference at each midpoint
    and code and the float32 neighbours of both, below 1 and above, a dense sweep of [0, 6],
    tiny and subnormal magnitudes, both signs: blocks of 32 led by 6.0 (scale exactly 1)."""
    points = torch.tensor(list(FP4_MAGNITUDES) + [(a + b) / 2 for a, b in zip(FP4_MAGNITUDES, FP4_MAGNITUDES[1:])])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(math.inf)),
                      torch.nextafter(points, torch.tensor(-math.inf)).clamp(min=0)])
    magnitudes = torch.cat([near, torch.linspace(0, 6, 1001), torch.tensor([1e-30, 1e-40, 2.0 ** -126])])
    values = torch.cat([magnitudes, -magnitudes])
    values = torch.cat([values, torch.zeros(-len(values) % 31)]).view(-1, 31)
    x_t = torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1)
    assert_quantize_bit_exact(*quantize_graph(x_t, 32, dg.float4_e2m1, dg.float8_e8m0), x_t)


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("out_type", [dg.float32, dg.bfloat16])
def test_dequantize_every_code_bit_exact(y_type, scale_type, block, out_type):
    generator = torch.Generator().manual_seed(block)
    rows, cols = 9, 2 * block
    if y_type is dg.float4_e2m1:
        values = torch.tensor(FP4_MAGNITUDES)[torch.randint(0, 8, (rows, cols), generator=generator)]
        q_t = pack_fp4(values * (torch.randint(0, 2, (rows, cols), generator=generator) * 2 - 1))
    else:  # every byte, NaN codes included
        q_t = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator).view(y_type.torch_dtype)
    s_t = torch.randint(0, 256, (cols // block, rows), dtype=torch.uint8, generator=generator).t()  # column-major
    s_t = s_t.view(scale_type.torch_dtype)
    g = dg.Graph()
    q = g.tensor(name="q", dim=[rows, cols], data_type=y_type)
    s = g.tensor_like(s_t, "s")
    out = g.block_scale_dequantize(q, s, block_size=[1, block]).set_output(True).set_data_type(out_type)
    out_t = storage(out)
    g.build()
    g.execute({q: q_t, s: s_t, out: out_t})
    ref = g.reference({q: q_t, s: s_t})[out.name]
    same = (out_t.double() == ref) | (out_t.double().isnan() & ref.isnan())
    assert same.all()


# blocks per program and warps whose threads hold runs of 2 and 4 blocks (the model's configs
# on a GPU-sized tensor; the small tensors above fit one block per thread)
RUN_CONFIGS = [BlockScaleConfig(64, 1), BlockScaleConfig(128, 1)]


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda config: config.text())
@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
def test_runs_of_blocks_per_thread_bit_exact_with_a_partial_last_program(y_type, scale_type, block, config):
    """A config whose threads hold several consecutive blocks: quantize (from bfloat16 and from a
    strided float32 x with blocks along a middle axis) and dequantize bit-exact, the last program
    and the last thread's run cut by the tensor's end (75 rows of 3 blocks: 225 blocks)."""
    options = dg.BuildOptions(block_scale_config=config)
    x_t = special_blocks(75, 3 * block, block, seed=11).to(torch.bfloat16)
    g, x, y, scale = quantize_graph(x_t, block, y_type, scale_type)
    g.build(options=options)
    assert f"RUN={config.run}" in g.plan.launches[0].config_text and config.run > 1
    assert_quantize_bit_exact(g, x, y, scale, x_t)
    wide = special_blocks(75 * 2, 2 * block, block, seed=12).view(75, 2, 2 * block)
    x_t = wide.transpose(1, 2)  # [75, 2 * block, 2]: strided, blocks along axis 1
    y_stride = [2 * 2 * block, 1, 2 * block] if y_type is dg.float4_e2m1 else None
    g, x, y, scale = quantize_graph(x_t, block, y_type, scale_type, axis=1, y_stride=y_stride)
    g.build(options=options)
    assert_quantize_bit_exact(g, x, y, scale, x_t)
    q_t, s_t = run_quantize(g, x, y, scale, x_t)
    g = dg.Graph()
    if y_type is dg.float4_e2m1:  # bound as packed pairs: the logical tensor has twice the block axis
        q = g.tensor(name="q", dim=list(x_t.shape), stride=list(y_stride), data_type=y_type)
    else:
        q = g.tensor_like(q_t, "q")
    s = g.tensor_like(s_t, "s")
    out = g.block_scale_dequantize(q, s, block_size=[1, block, 1]).set_output(True)
    out_t = storage(out)
    g.build(options=options)
    g.execute({q: q_t, s: s_t, out: out_t})
    ref = g.reference({q: q_t, s: s_t})[out.name]
    assert ((out_t.double() == ref) | (out_t.double().isnan() & ref.isnan())).all()


def test_configs_fit_the_problem_and_hold_whole_runs():
    """Every candidate holds RUN blocks per thread exactly (BLOCK_G = RUN * 32 * warps) on a
    large problem; on a small one, programs no wider than the blocks there are, warps cut to
    match; the model's pick at the sweep's shape on an H200 is the config the sweep measured
    fastest (BENCHMARKS.md, 2026-11-29: one block per thread at 4 warps for both formats; within
    1.3% of the best where another config won)."""
    from dnngraph.backends.triton.heuristics.block_scale import candidates, fitted, rank
    from dnngraph.target import H200
    measured_best = {32: BlockScaleConfig(128, 4), 16: BlockScaleConfig(128, 4)}
    for block in (16, 32):
        for config in candidates(8192 * 14336 // block, block):
            assert config.block_g == config.run * 32 * config.num_warps
        for x_bytes in (2, 4):  # bf16, fp32 x; the elements and scales written
            bytes_per_element = x_bytes + (0.5 if block == 16 else 1) + 1 / block
            assert rank(8192 * 14336 // block, block, bytes_per_element, H200)[0] == measured_best[block]
    for (y_type, scale_type, block), dtype in zip([FORMATS[0], FORMATS[3]] * 2, [torch.bfloat16] * 2 + [torch.float32] * 2):
        g, *_ = quantize_graph(torch.empty(8192, 14336, dtype=dtype), block, y_type, scale_type)
        g.build(options=dg.BuildOptions(target=H200))
        assert g.plan.launches[0].config_text == measured_best[block].text()
    assert fitted(BlockScaleConfig(512, 4), 21) == BlockScaleConfig(32, 1)
    assert fitted(BlockScaleConfig(512, 8), 100) == BlockScaleConfig(128, 4)


def test_block_scale_config_is_validated():
    with pytest.raises(dg.ValidationError):
        BlockScaleConfig(96, 4)
    with pytest.raises(dg.ValidationError):
        dg.BuildOptions(block_scale_config=(256, 4))


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
def test_round_trip_through_a_virtual_quantized_tensor(y_type, scale_type, block):
    """quantize -> dequantize in one graph: the quantized pair lives in the workspace (fp4 packed
    there too); the error stays under the format's bound relative to each block's amax."""
    # amax in [16, 2^9]: an e4m3 scale (amax / vmax) stays in e4m3's normal range, where it
    # keeps 4 significant bits (below, a subnormal or zero scale loses the block; above 448 * 6,
    # NVFP4's e4m3 scale saturates: its users divide by a global scale first)
    x_t = torch.randn(6, 4 * block).clamp(-3, 3) * torch.exp2(torch.randint(2, 7, (6, 1)).float())
    x_t[:, ::block] = 4 * torch.exp2(torch.randint(2, 7, (6, 4)).float())
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    y, scale = g.block_scale_quantize(x, block_size=block)
    y.set_data_type(y_type), scale.set_data_type(scale_type)
    back = g.block_scale_dequantize(y, scale, block_size=[1, block]).set_output(True)
    back_t = storage(back)
    g.build()
    g.execute({x: x_t, back: back_t})
    assert torch.equal(back_t.double(), g.reference({x: x_t})[back.name])
    amax = x_t.view(6, 4, block).abs().amax(-1, keepdim=True)
    bound = 0.25 if y_type is dg.float4_e2m1 else 0.125
    assert ((back_t.view(6, 4, block) - x_t.view(6, 4, block)).abs() <= bound * amax).all()


@pytest.mark.parametrize("y_type,scale_type,block", [FORMATS[0], FORMATS[3]], ids=[FORMAT_IDS[0], FORMAT_IDS[3]])
def test_pointwise_producers_fuse_into_the_quantize_kernel(y_type, scale_type, block):
    """NVFP4's global scale (a one-element tensor) and a per-row factor multiply x at load; a
    prologue value that is also a graph output is stored apart, exactly."""
    x_t = special_blocks(6, 4 * block, block, seed=11).nan_to_num(0.0).clamp(-3e4, 3e4)
    global_t, rows_t = torch.tensor([1 / 16.0]), torch.rand(6, 1) + 0.5
    g = dg.Graph()
    x, global_scale, rows = g.tensor_like(x_t, "x"), g.tensor_like(global_t, "global_scale"), g.tensor_like(rows_t, "rows")
    scaled = g.mul(g.relu(x), global_scale)
    shown = g.mul(scaled, rows)
    y, scale = g.block_scale_quantize(shown, block_size=block)
    y.set_output(True).set_data_type(y_type)
    scale.set_output(True).set_data_type(scale_type)
    scaled.set_output(True)
    kinds = [(group.kind, [n.op for n in group.nodes]) for group in partition(g)]
    assert ("block_scale", ["relu", "mul", "mul", "block_scale_quantize"]) in kinds
    g.build()
    y_t, scale_t, scaled_t = storage(y), storage(scale), storage(scaled)
    g.execute({x: x_t, global_scale: global_t, rows: rows_t, y: y_t, scale: scale_t, scaled: scaled_t})
    ref = g.reference({x: x_t, global_scale: global_t, rows: rows_t})
    assert torch.equal(scale_t.view(torch.uint8), ref[scale.name].to(scale_type.torch_dtype).view(torch.uint8))
    expected = pack_fp4(ref[y.name]).view(torch.uint8) if y_type is dg.float4_e2m1 else codes(ref[y.name], y_type)
    assert torch.equal(y_t.view(torch.uint8), expected)
    assert torch.equal(scaled_t, ref[scaled.name].float())  # one float32 rounding of one product


# --- the block-scaled matmul -----------------------------------------------------------------------
def quantized_operand(rows, cols, y_type, scale_type, block, blocks_along_rows, generator):
    """(elements, scales) as torch tensors: `rows` x `cols`, blocks along the rows' axis
    (B's K) or the columns' (A's K), packed fp4 along the block axis."""
    k_first = blocks_along_rows
    shape = (cols, rows) if k_first else (rows, cols)  # K last in memory
    if y_type is dg.float4_e2m1:
        values = torch.tensor(FP4_MAGNITUDES)[torch.randint(0, 8, shape, generator=generator)]
        q = pack_fp4(values * (torch.randint(0, 2, shape, generator=generator) * 2 - 1))
    else:
        q = (torch.randn(shape, generator=generator) * 40).to(y_type.torch_dtype)
    scale_shape = shape[:-1] + (shape[-1] // block,)
    if scale_type is dg.float8_e8m0:
        s = torch.randint(118, 136, scale_shape, dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu)
    else:
        s = (torch.rand(scale_shape, generator=generator) + 0.05).to(torch.float8_e4m3fn)
    return (q.transpose(0, 1), s.transpose(0, 1)) if k_first else (q, s)


def block_scaled_matmul(m, n, k, y_type, scale_type, block, batch=None, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    g = dg.Graph()
    a_t, sa_t = quantized_operand(m, k, y_type, scale_type, block, False, generator)
    b_t, sb_t = quantized_operand(k, n, y_type, scale_type, block, True, generator)
    if batch is not None:  # A batched, B shared (a weight): the batch folds into the rows
        a_t, sa_t = a_t.expand(batch, m, a_t.shape[-1]), sa_t.expand(batch, m, sa_t.shape[-1])
    a = g.tensor(name="a", dim=list(a_t.shape[:-1]) + [k], stride=_logical_strides(a_t, y_type), data_type=y_type)
    b = g.tensor(name="b", dim=[k, n], stride=_logical_strides(b_t, y_type), data_type=y_type)
    sa, sb = g.tensor_like(sa_t, "sa"), g.tensor_like(sb_t, "sb")
    a_dim = [1] * (len(a.dim) - 1) + [block]
    c = g.matmul(g.block_scale_dequantize(a, sa, block_size=a_dim),
                 g.block_scale_dequantize(b, sb, block_size=[block, 1])).set_output(True)
    inputs = {a: a_t, sa: sa_t, b: b_t, sb: sb_t}
    return g, {key: value.to(device) for key, value in inputs.items()}, c


def _logical_strides(packed: torch.Tensor, data_type):
    """Element strides of a torch tensor holding `data_type` (fp4: its byte strides doubled,
    the packed stride-1 axis kept)."""
    if data_type is not dg.float4_e2m1:
        return list(packed.stride())
    return [s if s == 1 else 2 * s for s in packed.stride()]


@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("m,n,k,batch", [(33, 20, 96, None), (5, 3, 32, 2)])
def test_block_scaled_matmul_dequantizes_in_the_loader(y_type, scale_type, block, m, n, k, batch):
    g, inputs, c = block_scaled_matmul(m, n, k, y_type, scale_type, block, batch, seed=m)
    groups = partition(g)
    assert [[n.op for n in group.nodes] for group in groups] == \
        [["block_scale_dequantize", "block_scale_dequantize", "matmul"]]
    c_t = torch.full(c.dim, math.nan)
    g.build()
    g.execute({**inputs, c: c_t})
    ref = g.reference({key: value for key, value in inputs.items()})[c.name]
    assert (c_t.double() - ref).norm() <= 1e-6 * ref.norm()


def test_block_scaled_a_with_a_plain_bfloat16_b():
    generator = torch.Generator().manual_seed(1)
    a_t, sa_t = quantized_operand(7, 64, dg.float8_e4m3, dg.float8_e8m0, 32, False, generator)
    b_t = torch.randn(64, 9, generator=generator).to(torch.bfloat16)
    g = dg.Graph()
    a, sa, b = g.tensor_like(a_t, "a"), g.tensor_like(sa_t, "sa"), g.tensor_like(b_t, "b")
    c = g.matmul(g.block_scale_dequantize(a, sa, block_size=[1, 32]), b).set_output(True)
    c_t = torch.full(c.dim, math.nan)
    g.build()
    g.execute({a: a_t, sa: sa_t, b: b_t, c: c_t})
    ref = g.reference({a: a_t, sa: sa_t, b: b_t})[c.name]
    assert (c_t.double() - ref).norm() <= 1e-6 * ref.norm()


def test_dequantize_with_blocks_across_k_or_read_twice_runs_apart():
    """Blocks along M are no K blocks: the dequantization is its own kernel (still correct)."""
    generator = torch.Generator().manual_seed(2)
    q_t = (torch.randn(32, 8, generator=generator) * 10).to(torch.float8_e4m3fn)
    s_t = torch.randint(120, 130, (1, 8), dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu)
    b_t = torch.randn(8, 5, generator=generator)
    g = dg.Graph()
    q, s, b = g.tensor_like(q_t, "q"), g.tensor_like(s_t, "s"), g.tensor_like(b_t, "b")
    c = g.matmul(g.block_scale_dequantize(q, s, block_size=[32, 1]), b).set_output(True)
    assert [gr.kind for gr in partition(g)] == ["block_scale", "matmul"]
    c_t = torch.full(c.dim, math.nan)
    g.build()
    g.execute({q: q_t, s: s_t, b: b_t, c: c_t})
    ref = g.reference({q: q_t, s: s_t, b: b_t})[c.name]
    assert (c_t.double() - ref).norm() <= 1e-6 * ref.norm()


# --- data types and typed errors -------------------------------------------------------------------
def test_data_types_and_their_storage():
    assert dg.float4_e2m1.torch_dtype is torch.float4_e2m1fn_x2 and dg.float4_e2m1.elements_per_item == 2
    assert dg.float8_e8m0.torch_dtype is torch.float8_e8m0fnu and dg.float8_e8m0.itemsize == 1
    assert dtypes.from_torch(torch.float8_e8m0fnu) is dg.float8_e8m0 and dtypes.by_name("float4_e2m1") is dg.float4_e2m1
    assert dtypes.storage_layout((3, 4, 8), (32, 8, 1), dg.float4_e2m1) == ((3, 4, 4), (16, 4, 1))
    assert dtypes.storage_layout((8, 6), (1, 8), dg.float4_e2m1) == ((4, 6), (1, 4))
    assert dtypes.packed_layout_problem((3, 5), (5, 1), dg.float4_e2m1) is not None
    values = torch.tensor([[0.0, -0.0, 0.5, -6.0, 3.0, 1.5]])
    assert torch.equal(unpack_fp4(pack_fp4(values)), values.double())
    assert torch.equal(torch.signbit(unpack_fp4(pack_fp4(values))), torch.signbit(values))


@pytest.mark.parametrize("call", [
    lambda g, x: g.block_scale_quantize(x, block_size=24),
    lambda g, x: g.block_scale_quantize(x, block_size=32, axis=0),  # 6 rows: a partial block
    lambda g, x: g.block_scale_quantize(x, block_size=32, axis=5),
    lambda g, x: g.block_scale_quantize(g.tensor(name="i", dim=[2, 32], data_type=dg.int32), block_size=32),
    lambda g, x: g.block_scale_dequantize(x, g.tensor(name="s", dim=[6, 2], data_type=dg.float8_e8m0), block_size=[1, 32]),
    lambda g, x: g.block_scale_dequantize(g.tensor(name="q", dim=[6, 64], data_type=dg.float8_e4m3),
                                          g.tensor(name="s", dim=[6, 3], data_type=dg.float8_e8m0), block_size=[1, 32]),
    lambda g, x: g.block_scale_dequantize(g.tensor(name="q", dim=[6, 64], data_type=dg.float8_e4m3),
                                          g.tensor(name="s", dim=[6, 2], data_type=dg.float8_e8m0), block_size=[2, 32]),
    lambda g, x: g.block_scale_dequantize(g.tensor(name="q", dim=[6, 64], data_type=dg.float8_e4m3),
                                          g.tensor(name="s", dim=[6, 8], data_type=dg.float8_e8m0), block_size=[1, 8]),
])
def test_bad_calls_raise_validation_errors_and_change_nothing(call):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[6, 64])
    before = len(g.nodes)
    with pytest.raises(dg.ValidationError):
        call(g, x)
    assert len(g.nodes) == before


def test_formats_outside_the_family_are_refused_at_build():
    g, x, y, scale = quantize_graph(torch.randn(2, 32), 32, dg.bfloat16, dg.float8_e8m0)
    with pytest.raises(dg.ValidationError, match="quantized tensor"):
        g.build()
    g, x, y, scale = quantize_graph(torch.randn(2, 32), 32, dg.float8_e4m3, dg.float16)
    with pytest.raises(dg.ValidationError, match="scale"):
        g.build()


def test_other_families_refuse_block_scale_types():
    g = dg.Graph()
    q = g.tensor(name="q", dim=[4, 32], data_type=dg.float4_e2m1)
    with pytest.raises(dg.ValidationError, match="float4_e2m1"):
        g.add(q, 1.0)
    q.set_data_type(dg.float32)
    g.add(q, 1.0).set_output(True)
    q.set_data_type(dg.float4_e2m1)  # changed after the op was added: refused at build
    with pytest.raises(dg.UnsupportedError, match="float4_e2m1"):
        g.build()
    g = dg.Graph()
    q = g.tensor(name="q", dim=[4, 32], data_type=dg.float8_e8m0)
    with pytest.raises(dg.ValidationError, match="float8_e8m0"):
        g.matmul(q, g.tensor(name="w", dim=[32, 4]))
    g = dg.Graph()
    q = g.tensor(name="q", dim=[4, 32], data_type=dg.float8_e4m3)
    with pytest.raises(dg.ValidationError, match="float8_e8m0"):
        g.cast(q, data_type=dg.float8_e8m0)
    g.cast(q, data_type=dg.float32).set_output(True).set_data_type(dg.float8_e8m0)
    with pytest.raises(dg.UnsupportedError, match="float8_e8m0"):
        g.build()


def test_fp4_layouts_that_cannot_pack_are_refused():
    g = dg.Graph()
    q = g.tensor(name="q", dim=[16, 3], data_type=dg.float4_e2m1)  # an odd packed extent (3, stride 1)
    s = g.tensor(name="s", dim=[1, 3], data_type=dg.float8_e4m3)
    g.block_scale_dequantize(q, s, block_size=[16, 1]).set_output(True)
    with pytest.raises(dg.ValidationError, match="packs 2 elements"):
        g.build()
    # blocks along the rows of a row-major fp4 y: its pairs would span two blocks
    g, x, y, scale = quantize_graph(torch.randn(32, 4), 16, dg.float4_e2m1, dg.float8_e4m3, axis=0)
    with pytest.raises(dg.UnsupportedError, match="packed along the block axis"):
        g.build()


def test_wrong_bindings_raise_and_write_nothing():
    x_t = torch.randn(2, 32)
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e4m3)
    g.build()
    y_t, scale_t = storage(y), storage(scale)
    with pytest.raises(dg.ExecutionError):
        g.execute({x: x_t, y: torch.empty(2, 32, dtype=torch.float4_e2m1fn_x2), scale: scale_t})
    with pytest.raises(dg.ExecutionError):
        g.execute({x: x_t, y: y_t.view(torch.uint8), scale: scale_t})
    assert (scale_t.view(torch.uint8) == POISON).all()


def test_json_round_trip_runs_the_same():
    x_t = special_blocks(3, 64, 16, seed=5)
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e4m3)
    again = dg.Graph.from_json(g.to_json())
    first, second = run_quantize(g, x, y, scale, x_t), run_quantize(again, again.tensor_by_name("x"),
                                                                   again.tensor_by_name(y.name),
                                                                   again.tensor_by_name(scale.name), x_t)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(first, second))


def test_as_function_allocates_packed_outputs_and_takes_packed_inputs():
    x_t = special_blocks(4, 64, 16, seed=9)
    g, x, y, scale = quantize_graph(x_t, 16, dg.float4_e2m1, dg.float8_e4m3)
    y_t, scale_t = run_quantize(g, x, y, scale, x_t)
    packed, scales = g.as_function()(x_t)
    assert packed.dtype == torch.float4_e2m1fn_x2 and tuple(packed.shape) == (4, 32)
    assert torch.equal(packed.view(torch.uint8), y_t.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), scale_t.view(torch.uint8))
    g = dg.Graph()
    q, s = g.tensor(name="q", dim=[4, 64], data_type=dg.float4_e2m1), g.tensor_like(scale_t, "s")
    g.block_scale_dequantize(q, s, block_size=[1, 16]).set_output(True)
    strided = torch.empty(4, 64, dtype=torch.uint8)[:, ::2].copy_(y_t.view(torch.uint8))  # copied to the layout
    back = g.as_function()(strided.view(torch.float4_e2m1fn_x2), scale_t)
    assert torch.equal(back.double().nan_to_num(7.0), g.reference({q: y_t, s: scale_t})[g.outputs()[0].name].nan_to_num(7.0))


def test_frontend_keyword_names_port():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 32])
    y, scale = g.block_scale_quantize(input=x, block_size=32, axis=1, transpose=False, name="quantize")
    back = g.block_scale_dequantize(input=y, descale=scale, block_size=[1, 32], compute_data_type=dg.float32)
    assert back.dim == (4, 32) and scale.dim == (4, 1)
    # the frontend's defaults and keywords: axis=None is the last axis, compute_data_type float32
    x3 = g.tensor(name="x3", dim=[2, 16, 32])
    y3, scale3 = g.block_scale_quantize(input=x3, block_size=32, axis=None, compute_data_type=dg.float32)
    assert scale3.dim == (2, 16, 1) and y3.producer.attrs.axis == 2
    before = len(g.nodes)
    with pytest.raises(dg.ValidationError, match="compute_data_type"):
        g.block_scale_quantize(input=x3, block_size=32, compute_data_type=dg.float16)
    assert len(g.nodes) == before


def sm90_graphs():
    """Every kernel form: each format quantized from dense and strided x (a prologue too),
    dequantized, and the block-scaled matmul (for tests/sm90_compile.py)."""
    for (y_type, scale_type, block), label in zip(FORMATS, FORMAT_IDS):
        x_t = torch.randn(64, 4 * block)
        g, *_ = quantize_graph(x_t, block, y_type, scale_type)
        g.build()
        yield f"quantize {label} dense", g
        strided = torch.randn(8, 2 * block, 4).transpose(1, 2)[:, 1:3]  # [8, 2, 2 * block] non-contiguous
        g, *_ = quantize_graph(strided, block, y_type, scale_type, axis=2, scale_stride=[1, 8, 16],
                               y_stride=[4 * block, 2 * block, 1])
        g.build()
        yield f"quantize {label} strided", g
        g = dg.Graph()
        x, factor = g.tensor_like(x_t, "x"), g.tensor(name="factor", dim=[1])
        y, scale = g.block_scale_quantize(g.mul(g.gelu(x), factor), block_size=block)
        y.set_output(True).set_data_type(y_type)
        scale.set_output(True).set_data_type(scale_type)
        back = g.block_scale_dequantize(y, scale, block_size=[1, block]).set_output(True).set_data_type(dg.bfloat16)
        g.build()
        yield f"quantize {label} prologue, dequantize", g
        g, _, _ = block_scaled_matmul(64, 48, 4 * block, y_type, scale_type, block)
        g.build()
        yield f"matmul {label}", g


def test_kernels_compile_for_sm90():
    """The interpreter skips Triton's type checks: compile every kernel form for sm_90 in a
    process without the interpreter."""
    from helpers import compiled_for_sm90
    assert f"compiled {4 * len(FORMATS) + len(FORMATS)} kernels for sm_90" in \
        compiled_for_sm90("test_block_scale:sm90_graphs", timeout=900)


# --- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_quantize_bit_exact(y_type, scale_type, block, dtype):
    x_t = special_blocks(1000, 8 * block, block, dtype, seed=7).cuda()
    assert_quantize_bit_exact(*quantize_graph(x_t, block, y_type, scale_type), x_t)


@pytest.mark.gpu
@pytest.mark.parametrize("y_type,scale_type,block", FORMATS, ids=FORMAT_IDS)
def test_gpu_block_scaled_matmul(y_type, scale_type, block):
    g, inputs, c = block_scaled_matmul(257, 129, 512, y_type, scale_type, block, seed=3, device="cuda")
    c_t = torch.full(c.dim, math.nan, device="cuda")
    g.build()
    g.execute({**inputs, c: c_t})
    ref = g.reference({key: value.cpu() for key, value in inputs.items()})[c.name]
    assert (c_t.cpu().double() - ref).norm() <= 1e-5 * ref.norm()


@pytest.mark.gpu
@pytest.mark.parametrize("y_type,scale_type,block", [FORMATS[0], FORMATS[3]], ids=[FORMAT_IDS[0], FORMAT_IDS[3]])
def test_gpu_autotuned_block_scaled_matmul_samples_packed_operands(y_type, scale_type, block):
    """Autotuning times candidates on sample tensors: packed fp4 and e8m0 ones are random bytes."""
    g, inputs, c = block_scaled_matmul(512, 256, 1024, y_type, scale_type, block, seed=5, device="cuda")
    g.build(options=dg.BuildOptions(autotune=True))
    c_t = torch.full(c.dim, math.nan, device="cuda")
    g.execute({**inputs, c: c_t})
    ref = g.reference({key: value.cpu() for key, value in inputs.items()})[c.name]
    assert (c_t.cpu().double() - ref).norm() <= 1e-5 * ref.norm()



def sm90_quantize_graphs():
    """(label, graph) of the block-scale kernels at the benchmark's shapes, planned for an H200
    (tests/sm90_compile.py): each format quantized from bfloat16 and float32 under the model's
    config, under every candidate config for MXFP8 and NVFP4 from bfloat16, from a fused
    prologue, and dequantized."""
    from dnngraph.backends.triton.heuristics.block_scale import candidates
    from dnngraph.target import H200
    rows, cols = 8192, 14336
    planned = lambda g, config=None: g.build(options=dg.BuildOptions(target=H200, block_scale_config=config))
    for (y_type, scale_type, block), label in zip(FORMATS, FORMAT_IDS):
        for dtype in (torch.bfloat16, torch.float32):
            g, *_ = quantize_graph(torch.empty(rows, cols, dtype=dtype), block, y_type, scale_type)
            yield f"quantize {label} {dtype}", planned(g)
        g = dg.Graph(io_data_type=dg.bfloat16)
        x = g.tensor(name="x", dim=[rows, cols])
        y, scale = g.block_scale_quantize(g.gelu(x), block_size=block)
        y.set_output(True).set_data_type(y_type)
        scale.set_output(True).set_data_type(scale_type)
        yield f"quantize {label} gelu prologue", planned(g)
        g = dg.Graph()
        q = g.tensor(name="q", dim=[rows, cols], data_type=y_type)
        s = g.tensor(name="s", dim=[rows, cols // block], data_type=scale_type)
        g.block_scale_dequantize(q, s, block_size=[1, block]).set_output(True).set_data_type(dg.bfloat16)
        yield f"dequantize {label}", planned(g)
    for (y_type, scale_type, block), label in ((FORMATS[0], FORMAT_IDS[0]), (FORMATS[3], FORMAT_IDS[3])):
        for config in candidates(rows * cols // block, block):
            g, *_ = quantize_graph(torch.empty(rows, cols, dtype=torch.bfloat16), block, y_type, scale_type)
            yield f"quantize {label} {config.text()}", planned(g, config)


def test_quantize_kernels_keep_blocks_inside_threads_on_sm90():
    """Each thread holds its quantization blocks whole: a block's amax, its fp4 pair packing and
    a run of scales compile to no shared memory (the first kernels split a block across threads
    at 16 bytes and reshaped pairs and scales through shared memory: 68% of copy for bf16 ->
    MXFP8 and 28% for NVFP4 on an H200)."""
    from helpers import compiled_for_sm90
    output = compiled_for_sm90("test_block_scale:sm90_quantize_graphs", timeout=900)
    shared = [line for line in output.splitlines() if line.startswith("shared ")]
    from dnngraph.backends.triton.heuristics.block_scale import candidates
    swept = sum(len(candidates(8192 * 14336 // block, block)) for block in (32, 16))  # MXFP8, NVFP4
    assert len(shared) == 4 * len(FORMATS) + swept, output[-2000:]
    assert all(line.endswith(": 0") for line in shared), [line for line in shared if not line.endswith(": 0")]
