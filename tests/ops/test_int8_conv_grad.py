"""int8 convolution gradients (issue 33, item 2): conv_dgrad and conv_wgrad of int8 x int8
operands, int32 accumulation on the tensor cores (tl.dot int8 -> int32), int32 outputs bit-exact
with the float64 reference, the dequantizing float epilogues (per-tensor and per-channel scales)
and requantization to int8; dgrad's reduction bounded as fprop's (refused past INT8_MAX_K), wgrad's
wrapping modulo 2^32 past int32 as cuDNN's int32 accumulator does. CPU (interpreter) at odd sizes,
every layout and kernel pose; GPU (marked gpu) at ResNet-50 layer shapes."""
import re

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.ops.matmul import INT8_MAX_K, wrapped_to_int32
from helpers import poisoned, run

COMMON = dict(dilation=[1, 1])


def quantized(shape, low=-128, high=128, device="cpu") -> torch.Tensor:
    return torch.randint(low, high, list(shape), dtype=torch.int8, device=device)


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """int8 `values` stored NCHW, NHWC (channels last), or strided (every other channel of a wider
    buffer, the spatial axes transposed in memory)."""
    if layout == "nhwc" and values.dim() == 4:
        return values.to(memory_format=torch.channels_last)
    if layout == "strided" and values.dim() == 4:
        wide = torch.zeros([values.shape[0], values.shape[1] * 2, values.shape[3], values.shape[2]],
                           dtype=values.dtype)
        view = wide[:, ::2].transpose(-1, -2)
        view.copy_(values)
        return view
    return values.contiguous()


def exact(graph, inputs: dict, options=None) -> dict:
    """Execute with poisoned outputs; every output equals the reference bit for bit (a float one
    where its value is exact in the output type: the reference holds it in float64)."""
    outputs = run(graph, inputs, options=options)
    refs = graph.reference(inputs)
    for name, out in outputs.items():
        ref = refs[name]
        out = out.double() if ref.dtype == torch.float64 else out
        assert out.dtype == ref.dtype, name
        assert torch.equal(out, ref), f"{name}: {(out.double() - ref.double()).abs().max()} off"
    return outputs


def kernel_sources(graph) -> list:
    """The generated source of each kernel of a built graph (explain's source paths)."""
    paths = [line.split("source:")[1].strip() for line in graph.explain().splitlines() if "source:" in line]
    assert paths
    return [open(path).read() for path in paths]


def fprop_dims(x_dim, w_dim, padding, stride, dilation, groups=1, **_):
    out = [(size + 2 * p - d * (r - 1) - 1) // s + 1
           for size, r, p, s, d in zip(x_dim[2:], w_dim[2:], padding, stride, dilation)]
    return [x_dim[0], w_dim[0]] + out


def grad_graph(op: str, dy: torch.Tensor, other: torch.Tensor, shape, io=dg.float32, **conv):
    """(graph, dy handle, w or x handle, result) of an int8 conv_dgrad (other = w, shape = x_dim)
    or conv_wgrad (other = x, shape = w_dim)."""
    g = dg.Graph(name=op, io_data_type=io)
    tdy, tother = g.tensor_like(dy, name="dy"), g.tensor_like(other, name="w" if op == "conv_dgrad" else "x")
    result = getattr(g, op)(tdy, tother, list(shape), **conv)
    return g, tdy, tother, result


def grad_operands(op: str, x_dim, w_dim, conv: dict, layout: str):
    """int8 (dy, w or x, the shape the op takes) of a conv of x_dim and w_dim, in `layout`."""
    dy = laid_out(quantized(fprop_dims(x_dim, w_dim, **conv)), layout)
    if op == "conv_dgrad":
        return dy, laid_out(quantized(w_dim), layout), x_dim
    return dy, laid_out(quantized(x_dim), layout), w_dim


CASES = {
    "grouped-strided": dict(x=[2, 6, 9, 7], w=[8, 3, 3, 3], padding=[1, 2], stride=[2, 1], dilation=[1, 1], groups=2),
    "dilated": dict(x=[1, 16, 7, 6], w=[12, 16, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[2, 1]),
    "depthwise-s2": dict(x=[2, 5, 7, 6], w=[5, 1, 3, 3], padding=[1, 1], stride=[2, 2], dilation=[1, 1], groups=5),
    "pointwise": dict(x=[2, 24, 5, 3], w=[10, 24, 1, 1], padding=[0, 0], stride=[1, 1], dilation=[1, 1]),
    "stride3-wide": dict(x=[1, 3, 11, 10], w=[33, 3, 5, 4], padding=[2, 1], stride=[3, 2], dilation=[1, 1]),
}


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_conv_gradient_int32_is_exact(op, layout, case):
    torch.manual_seed(21)
    conv = dict(CASES[case])
    x_dim, w_dim = conv.pop("x"), conv.pop("w")
    dy, other, shape = grad_operands(op, x_dim, w_dim, conv, layout)
    g, tdy, tother, result = grad_graph(op, dy, other, shape, **conv)
    result.set_output(True)
    assert result.data_type is dg.int32
    exact(g, {tdy: dy, tother: other})


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
def test_int8_conv_gradients_in_1d_3d_convolution_mode_and_asymmetric_padding_are_exact(op):
    torch.manual_seed(22)
    cases = [([2, 4, 11], [5, 4, 3], dict(padding=[2], stride=[2], dilation=[1])),
             ([1, 4, 4, 5, 3], [6, 2, 3, 1, 2], dict(padding=[1, 0, 1], stride=[1, 1, 2], dilation=[1, 1, 1], groups=2)),
             ([2, 3, 6, 7], [4, 3, 3, 2], dict(padding=[1, 0], stride=[2, 1], dilation=[1, 2], mode="convolution")),
             ([1, 3, 6, 7], [4, 3, 3, 3], dict(pre_padding=[0, 2], post_padding=[2, 1], stride=[1, 2], dilation=[1, 1]))]
    for x_dim, w_dim, conv in cases:
        g = dg.Graph(name="grad8", io_data_type=dg.float32)
        tx = g.tensor(name="x", dim=x_dim, data_type=dg.int8)
        tw = g.tensor(name="w", dim=w_dim, data_type=dg.int8)
        y = g.conv_fprop(tx, tw, **conv)  # dy's dims (the fprop node only poses the gradients' shapes)
        dy = quantized(y.dim)
        h = dg.Graph(name="grad8", io_data_type=dg.float32)
        tdy = h.tensor_like(dy, name="dy")
        if op == "conv_dgrad":
            other = quantized(w_dim)
            tother = h.tensor_like(other, name="w")
            h.conv_dgrad(tdy, tother, x_dim, **conv).set_output(True)
        else:
            other = quantized(x_dim)
            tother = h.tensor_like(other, name="x")
            h.conv_wgrad(tdy, tother, w_dim, **conv).set_output(True)
        exact(h, {tdy: dy, tother: other})


STAGED_CASES = {  # per-tap poses (conv_fold_channels_below=0) over odd sizes
    "grouped-s2": dict(x=[2, 6, 9, 7], w=[10, 3, 3, 2], padding=[1, 0], stride=[2, 2], dilation=[1, 1], groups=2),
    "3d": dict(x=[1, 5, 4, 5, 3], w=[6, 5, 2, 3, 1], padding=[1, 1, 0], stride=[1, 2, 1], dilation=[1, 1, 1]),
    "1x1": dict(x=[3, 7, 5, 3], w=[9, 7, 1, 1], padding=[0, 0], stride=[1, 1], dilation=[1, 1]),
}


@pytest.mark.parametrize("op", ["conv_fprop", "conv_dgrad"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("case", sorted(STAGED_CASES))
def test_int8_filter_read_through_a_reduction_major_copy_is_exact(op, layout, case):
    """wgmma reads int8 operands K-major only, so a filter whose reduced axis is not contiguous
    (dgrad's filters in every layout; fprop's channels unless the filter is NHWC) is first copied
    reduction-major by a kernel of its own (lower/conv.py stage_filter); the GEMMs read the copy:
    exact over groups, a strided dgrad's phases, a 3D filter and a 1x1 (matmul) pose."""
    torch.manual_seed(29)
    conv = dict(STAGED_CASES[case])
    x_dim, w_dim = conv.pop("x"), conv.pop("w")
    w = laid_out(quantized(w_dim), layout)
    g = dg.Graph(name=op, io_data_type=dg.float32)
    tw = g.tensor_like(w, name="w")
    if op == "conv_dgrad":
        source = laid_out(quantized(fprop_dims(x_dim, w_dim, **conv)), layout)
        tsource = g.tensor_like(source, name="dy")
        g.conv_dgrad(tsource, tw, x_dim, **conv).set_output(True)
    else:
        source = laid_out(quantized(x_dim), layout)
        tsource = g.tensor_like(source, name="x")
        g.conv_fprop(tsource, tw, **conv).set_output(True)
    # planned for the H100 (run here interpreted): the interpreter's own plans copy nothing
    exact(g, {tsource: source, tw: w}, dg.BuildOptions(conv_fold_channels_below=0, target=dg.target.H100))
    reduced_axis = 0 if op == "conv_dgrad" else 1
    staged = w.stride(reduced_axis) != 1  # an NHWC filter's channels (and a 1x1 NCHW one's) are contiguous
    copies = [source for source in kernel_sources(g) if "lib.reduction_major_copy(" in source]
    assert len(copies) == staged, g.explain()
    g.build(options=dg.BuildOptions(conv_fold_channels_below=0))
    assert not any("lib.reduction_major_copy(" in source for source in kernel_sources(g))


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("case", sorted(STAGED_CASES) + ["flipped"])
def test_int8_wgrad_reads_pixel_major_copies_exactly(layout, case):
    """wgrad reduces over pixels, contiguous in neither dy nor x: with 8-bit operands planned for a
    GPU (the H100 here, run interpreted) dy is copied [filters, pixels] and x gathered [taps,
    channels, pixels] (zero in the padding) first, and the GEMM reads both K-major (lower/conv.py
    wgrad_stages); exact over groups, strides, a 3D filter, mode="convolution" (the taps read back
    to front) and split-K. A workspace limit that does not hold the copies keeps the gathering
    kernel, as exact."""
    torch.manual_seed(30)
    conv = dict(STAGED_CASES["grouped-s2" if case == "flipped" else case])
    if case == "flipped":
        conv["mode"] = "convolution"
    x_dim, w_dim = conv.pop("x"), conv.pop("w")
    dy, x, shape = grad_operands("conv_wgrad", x_dim, w_dim, {k: v for k, v in conv.items() if k != "mode"}, layout)
    for limit, gathers in ((None, 2), (0, 0)):
        g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, shape, **conv)
        dw.set_output(True)
        options = dg.BuildOptions(conv_fold_channels_below=0, workspace_limit=limit, target=dg.target.H100,
                                  conv_config=GRAD_CONFIGS["split_k"] if case == "grouped-s2" else None)
        exact(g, {tdy: dy, tx: x}, options)
        staged = [source for source in kernel_sources(g) if "lib.pixel_major_gather(" in source]
        assert len(staged) == gathers, g.explain()


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
def test_fp8_gradients_share_the_staged_operands(op):
    """fp8 operands take the same staging (wgmma reads them K-major only, as int8): e4m3 dy and
    filter or activation, NHWC, planned for the H100 and run interpreted, within float32's
    rounding of the float64 reference."""
    torch.manual_seed(31)
    x_dim, w_dim = [2, 40, 7, 5], [36, 40, 3, 3]
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    fp8 = lambda dim: torch.randn(dim).to(torch.float8_e4m3fn).to(memory_format=torch.channels_last)
    dy, other = fp8(fprop_dims(x_dim, w_dim, **conv)), fp8(w_dim if op == "conv_dgrad" else x_dim)
    g = dg.Graph(name=op, io_data_type=dg.float32)
    tdy, tother = g.tensor_like(dy, name="dy"), g.tensor_like(other, name="other")
    result = getattr(g, op)(tdy, tother, x_dim if op == "conv_dgrad" else w_dim, **conv)
    result.set_output(True).set_data_type(dg.float32)
    out = run(g, {tdy: dy, tother: other}, options=dg.BuildOptions(target=dg.target.H100))[result.name]
    ref = g.reference({tdy: dy, tother: other})[result.name]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
    copy = "lib.reduction_major_copy(" if op == "conv_dgrad" else "lib.pixel_major_gather("
    assert sum(copy in source for source in kernel_sources(g)) == (1 if op == "conv_dgrad" else 2)


GRAD_CONFIGS = {
    "tiled": mm.MatmulConfig("tiled", 32, 32, 32, 4, 2),
    "small_m": mm.MatmulConfig("small_m", 16, 32, 64, 4, 2),
    "split_k": mm.MatmulConfig("split_k", 32, 16, 32, 4, 2, split_k=3),
}


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
@pytest.mark.parametrize("config", sorted(GRAD_CONFIGS))
@pytest.mark.parametrize("fold", [0, 64], ids=["per-tap", "folded"])
def test_int8_conv_gradient_every_kernel_pose_is_exact(op, config, fold):
    """Forced configs (split-K with its int32 partials and combine) over the per-tap and folded
    poses: each sums the integers exactly."""
    if op == "conv_dgrad" and config == "split_k":
        pytest.skip("dgrad has no split-K pose")
    torch.manual_seed(23)
    conv = dict(padding=[1, 0], stride=[2, 2], dilation=[1, 1], groups=1)
    dy, other, shape = grad_operands(op, [2, 7, 9, 8], [9, 7, 3, 2], conv, "nhwc")
    g, tdy, tother, result = grad_graph(op, dy, other, shape, **conv)
    result.set_output(True)
    options = dg.BuildOptions(conv_config=GRAD_CONFIGS[config], conv_fold_channels_below=fold)
    exact(g, {tdy: dy, tother: other}, options)
    sources = kernel_sources(g)
    for source in sources:  # the products on the tensor cores' int8 dot, summed in int32
        assert "out_dtype=tl.int32" in source or "_combine" in source or "lib.reduction_major_copy(" in source
    assert any("out_dtype=tl.int32" in source for source in sources)


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
def test_int8_conv_gradient_dequantized_to_bf16_and_requantized_in_one_kernel(op):
    """int32 gradient times a per-tensor scale and a per-channel one, stored in bf16 (within its
    rounding of the float64 reference), and requantized to int8 by a power-of-two scale (exact:
    ties to even and saturation as the reference's), the int32 sum stored as well."""
    torch.manual_seed(24)
    conv = dict(padding=[1, 1], stride=[2, 1], dilation=[1, 1])
    dy, other, shape = grad_operands(op, [2, 6, 7, 5], [10, 6, 3, 3], conv, "nchw")
    channels = shape[1] if op == "conv_dgrad" else shape[0]  # dx's channels, or dw's filters
    per_channel = [1, channels, 1, 1] if op == "conv_dgrad" else [channels, 1, 1, 1]
    scale = torch.rand(per_channel) * 1e-3 + 1e-4
    g, tdy, tother, result = grad_graph(op, dy, other, shape, io=dg.bfloat16, **conv)
    result.set_output(True)
    tscale = g.tensor_like(scale, name="scale")
    dequantized = g.mul(g.mul(result, 0.5), tscale).set_output(True)
    requantized = g.mul(result, 1.0 / 1024).set_output(True).set_data_type(dg.int8)
    g.build()
    assert len(g.plan.launches) <= 2  # one kernel (and split-K's combine for wgrad)
    inputs = {tdy: dy, tother: other, tscale: scale}
    outputs = run(g, inputs)
    refs = g.reference(inputs)
    assert outputs[dequantized.name].dtype == torch.bfloat16
    error = (outputs[dequantized.name].double() - refs[dequantized.name]).norm() / refs[dequantized.name].norm()
    assert error < 1.6e-2
    assert torch.equal(outputs[result.name], refs[result.name])
    assert torch.equal(outputs[requantized.name], refs[requantized.name])


def test_int8_dgrad_at_the_reduction_limit_is_exact_and_one_past_it_is_refused():
    """dgrad sums (filters per group) x taps products per element: at INT8_MAX_K of -128 x -128
    the sum is 2147467264, 16384 short of 2^31 - 1, exact; one filter more could overflow and is
    refused at the op call (as fprop's reduction is), the graph unchanged."""
    filters = INT8_MAX_K  # a 1x1 filter: the reduction is the filter count
    dy = torch.full((1, filters, 1, 2), -128, dtype=torch.int8)
    w = torch.full((filters, 2, 1, 1), -128, dtype=torch.int8)
    w[:, 1] = 127
    g, tdy, tw, dx = grad_graph("conv_dgrad", dy, w, [1, 2, 1, 2], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    dx.set_output(True)
    config = mm.MatmulConfig("tiled", 16, 16, 512, 4, 2)  # a 1x1 conv runs as a matmul
    out = exact(g, {tdy: dy, tw: w}, dg.BuildOptions(conv_config=config, matmul_config=config))
    assert out[dx.name][0, 0].tolist() == [[INT8_MAX_K * 2**14] * 2]
    assert out[dx.name][0, 1].tolist() == [[-INT8_MAX_K * 128 * 127] * 2]
    g = dg.Graph(name="long", io_data_type=dg.float32)
    filters = INT8_MAX_K // 9 + 1  # x 3x3 taps: just past the limit
    with pytest.raises(dg.ValidationError, match="overflow"):
        g.conv_dgrad(g.tensor(name="dy_long", dim=[1, filters, 5, 5], data_type=dg.int8),
                     g.tensor(name="w_long", dim=[filters, 4, 3, 3], data_type=dg.int8), [1, 4, 5, 5],
                     padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    assert g.nodes == []


@pytest.mark.parametrize("pixels, wraps", [(INT8_MAX_K, False), (INT8_MAX_K + 3, True)], ids=["limit", "past"])
def test_int8_wgrad_past_int32_wraps_modulo_2_32_as_the_reference(pixels, wraps):
    """wgrad's reduction (N x output pixels) is not bounded: at INT8_MAX_K products of -128 x -128
    the sum is exact below 2^31; past it the int32 accumulator wraps (two's complement), as
    cuDNN's does, in the kernel (split-K partials and combine included) and the reference alike."""
    dy = torch.full((1, 2, 1, pixels), -128, dtype=torch.int8)
    dy[0, 1] = quantized([1, pixels])
    x = torch.full((1, 1, 1, pixels), -128, dtype=torch.int8)
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, [2, 1, 1, 1], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    dw.set_output(True)
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("split_k", 16, 16, 512, 4, 2, split_k=2))
    out = exact(g, {tdy: dy, tx: x}, options)[dw.name]
    true_sum = pixels * 2**14
    assert (true_sum > 2**31 - 1) is wraps
    assert out[0].item() == wrapped_to_int32(torch.tensor(true_sum)).item() == true_sum - wraps * 2**32
    assert out[1].item() == (dy[0, 1].long() * -128).sum().item()
    if not wraps:
        return
    # a dequantizing epilogue of a virtual dw reads the wrapped accumulator too (exact in float32:
    # multiples of 2^14, and sums below 2^24)
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, [2, 1, 1, 1], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    dequantized = g.mul(dw, 2.0 ** -20).set_output(True)
    out = exact(g, {tdy: dy, tx: x}, options)[dequantized.name]
    assert out[0].item() == (true_sum - 2**32) * 2.0 ** -20


def test_int8_depthwise_dgrad_runs_the_direct_kernels_while_float32_sums_exactly():
    """A depthwise dgrad sums channel multiplier x taps products per dx element: up to 1024
    (INT8_EXACT_TAPS: |sum| <= 2^24) the direct kernels' float32 sums hold them exactly and they
    run it, past it the int32 GEMM kernels do (built only: the interpreter takes minutes over
    hundreds of taps); extremes (-128 x -128, one odd product) exact on the direct kernels."""
    for taps, direct in ((256, True), (257, False)):  # x multiplier 4: 1024 and 1028 products
        g = dg.Graph(name="dw_dgrad8", io_data_type=dg.float32)
        dy = g.tensor(name="dy", dim=[1, 8, 300 - taps + 1], data_type=dg.int8)
        w = g.tensor(name="w", dim=[8, 1, taps], data_type=dg.int8)
        g.conv_dgrad(dy, w, [1, 2, 300], padding=[0], stride=[1], dilation=[1], groups=2).set_output(True)
        g.build()
        assert ("depthwise" in g.explain()) is direct, taps
    dy = torch.full((1, 4, 3, 5), -128, dtype=torch.int8)
    w = torch.full((4, 1, 3, 3), -128, dtype=torch.int8)
    dy[0, 1, 1, 2], w[1, 0, 1, 1] = -127, -127  # both meet at dx[0, 0, 2, 3]
    g, tdy, tw, dx = grad_graph("conv_dgrad", dy, w, [1, 2, 5, 7], padding=[0, 0], stride=[1, 1], dilation=[1, 1],
                                groups=2)
    dx.set_output(True)
    out = exact(g, {tdy: dy, tw: w})[dx.name]
    assert "depthwise" in g.explain()
    assert out[0, 0, 2, 3].item() == 17 * 2**14 + 127 * 127  # 2 filters x 9 taps


def test_wrapped_to_int32_is_twos_complement():
    values = torch.tensor([0, 2**31 - 1, 2**31, 2**32 + 5, -2**31, -2**31 - 1, -2**33 + 7])
    assert wrapped_to_int32(values).tolist() == torch.tensor(values.tolist()).to(torch.int32).tolist()


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
@pytest.mark.parametrize("other_type", [dg.bfloat16, dg.float32, dg.int32])
def test_int8_gradient_with_another_operand_type_is_a_validation_error(op, other_type):
    g = dg.Graph(name="mixed", io_data_type=dg.float32)
    int8_dy = g.tensor(name="dy", dim=[1, 4, 5, 5], data_type=dg.int8)
    other_dy = g.tensor(name="dy_other", dim=[1, 4, 5, 5], data_type=other_type)
    dims = [4, 3, 3, 3] if op == "conv_dgrad" else [1, 3, 5, 5]
    shape = [1, 3, 5, 5] if op == "conv_dgrad" else [4, 3, 3, 3]
    int8_other = g.tensor(name="o8", dim=dims, data_type=dg.int8)
    float_other = g.tensor(name="o", dim=dims, data_type=other_type)
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    for dy, other in ((int8_dy, float_other), (other_dy, int8_other)):
        with pytest.raises(dg.ValidationError, match="int8"):
            getattr(g, op)(dy, other, shape, **conv)
    assert g.nodes == []


@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
def test_int8_gradient_operand_typed_after_the_op_is_checked_at_build(op):
    """set_data_type(int8) on one operand after the op call: the build refuses the mix; with both
    int8 the build takes it (the output keeps the type it was given at the call)."""
    g = dg.Graph(name="late", io_data_type=dg.float32)
    dy = g.tensor(name="dy", dim=[1, 4, 5, 5])
    other = g.tensor(name="o", dim=[4, 3, 3, 3] if op == "conv_dgrad" else [1, 3, 5, 5])
    shape = [1, 3, 5, 5] if op == "conv_dgrad" else [4, 3, 3, 3]
    getattr(g, op)(dy, other, shape, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True)
    dy.set_data_type(dg.int8)
    with pytest.raises(dg.ValidationError, match="int8"):
        g.build()
    assert g.plan is None
    other.set_data_type(dg.int8)
    g.build()


def test_int8_gradient_execute_refuses_a_float_binding_and_writes_nothing():
    torch.manual_seed(25)
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    dy, w, shape = grad_operands("conv_dgrad", [1, 3, 5, 4], [4, 3, 3, 3], conv, "nchw")
    g, tdy, tw, dx = grad_graph("conv_dgrad", dy, w, shape, **conv)
    dx.set_output(True)
    g.build()
    out = poisoned(dx)
    for bad in ({tdy: dy.float(), tw: w}, {tdy: dy, tw: w.to(torch.int32)}):
        with pytest.raises(dg.ExecutionError):
            g.execute({**bad, dx: out})
        assert (out == -12345).all()
    with pytest.raises(dg.ExecutionError):  # an int32 result bound as float
        g.execute({tdy: dy, tw: w, dx: torch.full(shape, float("nan"))})


def test_int8_gradient_size_one_axes_and_broadcast_dy_are_exact():
    """Batch and spatial axes of one element, and a dy broadcast (stride 0) over its batch."""
    torch.manual_seed(26)
    dy = quantized([1, 5, 1, 3]).expand(3, 5, 1, 3)
    x = quantized([3, 2, 1, 5])
    w = quantized([5, 2, 1, 3])
    conv = dict(padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, [5, 2, 1, 3], **conv)
    dw.set_output(True)
    exact(g, {tdy: dy, tx: x})
    g, tdy, tw, dx = grad_graph("conv_dgrad", dy, w, [3, 2, 1, 5], **conv)
    dx.set_output(True)
    exact(g, {tdy: dy, tw: w})


def test_int8_wgrad_accumulates_into_a_float_gradient_and_refuses_an_int32_blend():
    """dW += scale * conv_wgrad(dy8, x8): the dequantized float32 gradient blended into its prior
    in the kernel's store (alpha 1, beta 1), within float32's rounding; an int32 output blended is a
    ValidationError at build (blending is float math), genstats of an int32 result an
    UnsupportedError (its kernel would round integers), neither building a plan."""
    torch.manual_seed(28)
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    dy, x, shape = grad_operands("conv_wgrad", [2, 3, 5, 6], [4, 3, 3, 3], conv, "nhwc")
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, shape, **conv)
    accumulated = g.mul(dw, 1e-3).set_output(True).set_blend(1.0, 1.0)
    g.build()
    prior = poisoned(accumulated).copy_(torch.randn(shape))  # in the output's (NHWC) layout
    out = prior.clone()
    g.execute({tdy: dy, tx: x, accumulated: out})
    ref = g.reference({tdy: dy, tx: x})[accumulated.name] + prior.double()  # the reference is unblended
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, shape, **conv)
    dw.set_output(True).set_blend(1.0, 1.0)
    with pytest.raises(dg.ValidationError, match="floating"):
        g.build()
    assert g.plan is None
    g, tdy, tx, dw = grad_graph("conv_wgrad", dy, x, shape, **conv)
    for statistic in g.genstats(dw):
        statistic.set_output(True)
    with pytest.raises(dg.UnsupportedError, match="int32"):
        g.build()
    assert g.plan is None


# --- the H200 plans of ResNet-50's layers (no GPU needed) ----------------------------------------------
PLANNED_LAYERS = {  # bench_conv.py's int8_dgrad row
    "layer1.0.conv2": dict(x=[32, 64, 56, 56], w=[64, 64, 3, 3], padding=[1, 1], stride=[1, 1]),
    "layer2.0.conv2": dict(x=[32, 128, 56, 56], w=[128, 128, 3, 3], padding=[1, 1], stride=[2, 2]),
    "layer3.1.conv1": dict(x=[32, 1024, 14, 14], w=[256, 1024, 1, 1], padding=[0, 0], stride=[1, 1]),
    "layer4.1.conv2": dict(x=[32, 512, 7, 7], w=[512, 512, 3, 3], padding=[1, 1], stride=[1, 1]),
}


def planned_dgrad(layer: str, data_type):
    """The launches of an NHWC conv_dgrad of `layer` planned for the H200 (Triton backend)."""
    conv = dict(PLANNED_LAYERS[layer], dilation=[1, 1])
    x_dim, w_dim = conv.pop("x"), conv.pop("w")
    g = dg.Graph(name="dgrad", io_data_type=dg.bfloat16)
    nhwc = lambda dim: [dim[1] * dim[2] * dim[3], 1, dim[3] * dim[1], dim[1]]
    dy_dim = fprop_dims(x_dim, w_dim, **conv)
    dy = g.tensor(name="dy", dim=dy_dim, stride=nhwc(dy_dim), data_type=data_type)
    w = g.tensor(name="w", dim=w_dim, stride=nhwc(w_dim), data_type=data_type)
    dx = g.conv_dgrad(dy, w, x_dim, **conv)
    (g.mul(dx, 0.5) if data_type is dg.int8 else dx).set_output(True)
    g.build(options=dg.BuildOptions(target=dg.target.H200, backends=("triton",)))
    return g.plan.launches


def _block_k(launch) -> int:
    return int(re.search(r" \d+x\d+x(\d+) ", launch.config_text).group(1))


@pytest.mark.parametrize("layer", sorted(PLANNED_LAYERS))
def test_int8_dgrad_steps_as_many_bytes_as_bf16_and_reads_a_k_major_filter(layer):
    """The H200 plan of an int8 dgrad at a ResNet-50 layer: its GEMMs step at least the bytes of K
    bf16's do, or a tap's whole run of filters (BLOCK_K in bytes, not elements: 32 int8 values a
    step over layer1's 64 filters took twice bf16's steps), after one copy of the filter
    filters-contiguous (wgmma reads int8 K-major only)."""
    int8, bf16 = planned_dgrad(layer, dg.int8), planned_dgrad(layer, dg.bfloat16)
    copies = [launch for launch in int8 if "reduction_major_copy" in open(launch.source_path).read()]
    assert len(copies) == 1 and int8[0] is copies[0], [launch.config_text for launch in int8]
    gemms = [launch for launch in int8 if launch not in copies and "combine" not in launch.config_text]
    bf16_gemms = [launch for launch in bf16 if "combine" not in launch.config_text]
    assert len(gemms) == len(bf16_gemms) >= 1
    filters = PLANNED_LAYERS[layer]["w"][0]  # dgrad's reduction per tap
    for ours, theirs in zip(gemms, bf16_gemms):
        assert _block_k(ours) * 1 >= min(_block_k(theirs) * 2, filters), (ours.config_text, theirs.config_text)


# --- sm_90 compiles (no GPU needed) -------------------------------------------------------------------
def sm90_graphs():
    """int8 gradient kernels planned for the H100: an NHWC strided dgrad (stride phases) with a
    dequantizing per-channel epilogue to bf16, and an NHWC wgrad split-K (int32 partials and their
    combine) with a per-tensor scale."""
    h100 = dg.target.H100
    g = dg.Graph(name="dgrad8", io_data_type=dg.bfloat16)
    dy = g.tensor(name="dy", dim=[8, 64, 14, 14], stride=[12544, 1, 896, 64], data_type=dg.int8)
    w = g.tensor(name="w", dim=[64, 32, 3, 3], stride=[288, 1, 96, 32], data_type=dg.int8)
    scale = g.tensor(name="scale", dim=[1, 32, 1, 1], data_type=dg.float32)
    dx = g.conv_dgrad(dy, w, [8, 32, 28, 28], padding=[1, 1], stride=[2, 2], dilation=[1, 1])
    g.mul(dx, scale).set_output(True)
    yield "dgrad NHWC stride 2", g.build(options=dg.BuildOptions(target=h100))
    g = dg.Graph(name="wgrad8", io_data_type=dg.bfloat16)
    dy = g.tensor(name="dy", dim=[8, 64, 28, 28], stride=[50176, 1, 1792, 64], data_type=dg.int8)
    x = g.tensor(name="x", dim=[8, 64, 28, 28], stride=[50176, 1, 1792, 64], data_type=dg.int8)
    dw = g.conv_wgrad(dy, x, [64, 64, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    g.mul(dw, 1e-6).set_output(True)
    split = mm.MatmulConfig("split_k", 64, 64, 128, 4, 3, split_k=4)
    yield "wgrad split-K", g.build(options=dg.BuildOptions(target=h100, conv_config=split))


def test_int8_gradient_kernels_compile_for_sm90_on_the_int8_tensor_cores():
    """Every GEMM kernel's dot multiplies s8 by s8 into s32 on wgmma, and reads both operands
    K-major through cp.async: no tile loaded into registers per k step (the transposing slow path
    Triton takes for an 8-bit operand whose reduction is not contiguous). The dotless kernels
    are dgrad's filter copy, wgrad's two pixel-major gathers and split-K's combine."""
    from helpers import compiled_for_sm90
    output = compiled_for_sm90("test_int8_conv_grad:sm90_graphs", timeout=500, env={"SM90_LOOP_LOADS": "1"})
    lines = output.splitlines()
    mma = [line for line in lines if line.startswith("mma ")]
    dotless = [line for line in mma if line.endswith(": -")]
    assert sorted(dotless) == ["mma dgrad NHWC stride 2: -"] + ["mma wgrad split-K: -"] * 3, mma
    dots = [line for line in mma if line not in dotless]
    assert len(dots) >= 2 and all("wgmma" in line and ".s32.s8.s8" in line for line in dots), mma
    loads = [line for line in lines if line.startswith("loop_loads ")]  # one a launch, in mma's order
    assert len(loads) == len(mma)
    assert all(load.endswith(": 0") for load, dot in zip(loads, mma) if dot in dots), loads


# --- GPU, at ResNet-50 layer shapes -----------------------------------------------------------------
RESNET_LAYERS = {
    "res2-3x3": dict(x=[32, 64, 56, 56], w=[64, 64, 3, 3], padding=[1, 1], stride=[1, 1]),
    "res3-down": dict(x=[32, 128, 56, 56], w=[128, 128, 3, 3], padding=[1, 1], stride=[2, 2]),
    "res4-1x1": dict(x=[32, 1024, 14, 14], w=[256, 1024, 1, 1], padding=[0, 0], stride=[1, 1]),
    "stem": dict(x=[32, 3, 224, 224], w=[64, 3, 7, 7], padding=[3, 3], stride=[2, 2]),
    "grouped": dict(x=[32, 512, 7, 7], w=[512, 16, 3, 3], padding=[1, 1], stride=[1, 1], groups=32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["conv_dgrad", "conv_wgrad"])
@pytest.mark.parametrize("layer", sorted(RESNET_LAYERS))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_gpu_int8_resnet_conv_gradients_exact_and_dequantized(op, layer, layout):
    if op == "conv_dgrad" and layer == "stem":
        pytest.skip("the stem's input has no gradient")
    torch.manual_seed(27)
    conv = dict(RESNET_LAYERS[layer])
    x_dim, w_dim = conv.pop("x"), conv.pop("w")
    conv.update(COMMON)
    dy, other, shape = grad_operands(op, x_dim, w_dim, conv, layout)
    dy, other = dy.cuda(), other.cuda()
    g, tdy, tother, result = grad_graph(op, dy, other, shape, io=dg.bfloat16, **conv)
    result.set_output(True)
    dequantized = g.mul(result, 2.0 ** -16).set_output(True)
    out = run(g, {tdy: dy, tother: other}, device="cuda")
    refs = g.reference({tdy: dy, tother: other})
    assert torch.equal(out[result.name].cpu(), refs[result.name].cpu())
    error = (out[dequantized.name].double() - refs[dequantized.name]).norm() / refs[dequantized.name].norm()
    assert error.item() < 1.6e-2
    assert "int8" in g.explain()
