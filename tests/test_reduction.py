"""Reduction kernels: every mode, inner / outer / several axes, one-pass, looped and split."""
import pytest
import torch

import dnngraph as dg
from helpers import check, run
from rowmodes import modes_used, row_mode  # noqa: F401 (fixture)

MODES = ("sum", "mean", "max", "min", "amax", "prod", "norm1", "norm2")
DTYPES = {torch.float32: dg.float32, torch.float16: dg.float16}


def sample(shape, mode, dtype=torch.float32):
    if mode == "prod":  # products of values near 1 stay finite and meaningful
        return (1 + 0.05 * torch.randn(*shape)).to(dtype)
    return (torch.randn(*shape) * 2 + 3).to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("axes", [[2], [0], [1], [0, 2], [0, 1, 2]])
def test_every_mode_and_axes(mode, dtype, axes):
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x = g.tensor(name="x", dim=[5, 37, 3])
    g.reduction(x, mode, axes).set_output(True)
    check(g, {x: sample([5, 37, 3], mode, dtype)}, dtype)


@pytest.mark.parametrize("mode", ["sum", "max", "mean", "prod", "norm2"])
@pytest.mark.parametrize("axes", [[1], [0]])
def test_looped_and_split(row_mode, mode, axes):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[6, 75])
    g.reduction(x, mode, axes).set_output(True)
    check(g, {x: sample([6, 75], mode)})
    if axes == [1]:
        assert row_mode in modes_used(g)


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "sliced"])
def test_layouts(layout, row_mode):
    base = torch.randn(3, 7, 5, 6) * 2 + 3
    x_t = {"transposed": base.transpose(1, 3), "sliced": base[:, 1:6:2],
           "channels_last": base.contiguous(memory_format=torch.channels_last)}[layout]
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    g.reduction(x, "sum", [0, 2, 3]).set_output(True)
    g.reduction(x, "max", [1]).set_output(True)
    check(g, {x: x_t})


def test_float32_output_of_half_input():
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[9, 301])
    g.reduction(x, "sum", [1]).set_output(True).set_data_type(dg.float32)
    check(g, {x: sample([9, 301], "sum", torch.float16)}, torch.float16)


def test_prologue_and_epilogue_fuse_into_one_kernel():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[11, 29])
    b = g.tensor(name="b", dim=[11, 1])
    total = g.reduction(g.mul(x, x), "sum", [1])
    g.add(g.sqrt(total), b).set_output(True).set_name("norm_plus_b")
    check(g, {x: sample([11, 29], "sum"), b: torch.randn(11, 1)})
    assert len(g.plan.launches) == 1


def test_bad_axes_are_validation_errors():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 5])
    with pytest.raises(dg.ValidationError):
        g.reduction(x, "sum", [2])
    with pytest.raises(dg.ValidationError):
        g.reduction(x, "median", [1])


def test_product_below_the_smallest_normal_half_is_rounded_once(row_mode):
    # 26 values of size ~1: the product (~1e-6) is an fp16 subnormal. The kernel multiplies in
    # fp32 and rounds once at the store, so it holds the reference rounded to fp16 exactly.
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[13, 2])
    y = g.reduction(x, "prod", [0, 1]).set_output(True)
    values = torch.tensor([0.5, 0.7] * 13).reshape(13, 2).half()
    outputs = run(g, {x: values})
    ref = g.reference({x: values})[y.name]
    assert 0 < ref.abs().item() < torch.finfo(torch.float16).smallest_normal
    assert outputs[y.name].double().equal(ref.half().double())


def test_product_below_float32_range_stores_about_a_signed_zero(row_mode):
    # 207 values of 0.6 and one of -0.6: the product (-7e-47) is below fp32's smallest subnormal.
    # Its partial products pass through subnormals in an order the mode picks, so the stored value
    # is -0 or one step from it, never a normal number or a positive one
    g = dg.Graph()
    x = g.tensor(name="x", dim=[16, 13])
    y = g.reduction(x, "prod", [0, 1]).set_output(True)
    values = torch.full((16, 13), 0.6)
    values[3, 5] = -0.6
    outputs = run(g, {x: values})
    one_step = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
    assert abs(outputs[y.name].item()) <= one_step and outputs[y.name].signbit().item()
