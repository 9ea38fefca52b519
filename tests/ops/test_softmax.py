"""Softmax / log-softmax forward and backward kernels, fused prologues and epilogues; bf16 rows up
to 50001 wide on the GPU (marked gpu)."""
import pytest
import torch

import dnngraph as dg
from helpers import check
from rowmodes import modes_used, row_mode, row_options  # noqa: F401 (row_mode: a fixture)

DTYPES = {torch.float32: dg.float32, torch.float16: dg.float16}


def sample(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * 3 + 1).to(dtype)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_forward_any_axis(log, dtype, axis):
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x = g.tensor(name="x", dim=[6, 37, 5])
    g.softmax(x, axis=axis, log=log).set_output(True)
    check(g, {x: sample(6, 37, 5, dtype=dtype)}, dtype)


@pytest.mark.parametrize("log", [False, True])
def test_forward_and_backward_every_mode(row_mode, log):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[7, 93])
    g.softmax(x, axis=1, log=log).set_output(True)
    check(g, {x: sample(7, 93)}, options=row_options(row_mode))
    assert row_mode in modes_used(g) or row_mode == "split"  # softmax forward does not split
    g = dg.Graph()
    dy, y = g.tensor(name="dy", dim=[7, 93]), g.tensor(name="y", dim=[7, 93])
    g.softmax_backward(dy, y, axis=1, log=log).set_output(True)
    y_t = torch.softmax(sample(7, 93), 1)
    check(g, {dy: sample(7, 93), y: y_t.log() if log else y_t}, options=row_options(row_mode))
    assert row_mode in modes_used(g)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_matches_autograd(log, dtype):
    x_t = sample(9, 51).double().requires_grad_(True)
    fn = torch.log_softmax if log else torch.softmax
    y_t = fn(x_t, 1)
    dy_t = torch.randn(9, 51, dtype=torch.float64)
    (dx_expected,) = torch.autograd.grad(y_t, x_t, dy_t)
    g = dg.Graph(io_data_type=DTYPES[dtype])
    dy, y = g.tensor(name="dy", dim=[9, 51]), g.tensor(name="y", dim=[9, 51])
    g.softmax_backward(dy, y, axis=1, log=log).set_output(True).set_name("dx")
    out = check(g, {dy: dy_t.to(dtype), y: y_t.detach().to(dtype)}, dtype)
    err = (out["dx"].double() - dx_expected).norm() / dx_expected.norm()
    assert err < {torch.float32: 1e-5, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_layouts(layout):
    base = sample(2, 6, 5, 7)
    x_t = base.contiguous(memory_format=torch.channels_last) if layout == "channels_last" \
        else base.transpose(2, 3)
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    g.softmax(x, axis=1).set_output(True)
    g.softmax(x, axis=3, log=True).set_output(True)
    check(g, {x: x_t})


def test_scale_and_mask_fuse_into_one_kernel():
    g = dg.Graph(io_data_type=dg.float16)
    s = g.tensor(name="scores", dim=[2, 3, 17, 17])
    keep = g.tensor(name="keep", dim=[1, 1, 17, 17], data_type=dg.bool)
    masked = g.where(keep, g.scale(s, 0.125) if hasattr(g, "scale") else g.mul(s, 0.125), float("-inf"))
    g.cast(g.softmax(masked, axis=3), dg.float16).set_output(True)
    keep_t = torch.ones(17, 17, dtype=torch.bool).tril().view(1, 1, 17, 17)
    check(g, {s: sample(2, 3, 17, 17, dtype=torch.float16), keep: keep_t}, torch.float16)
    assert len(g.plan.launches) == 1


def test_bad_axis_is_validation_error():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 5])
    with pytest.raises(dg.ValidationError):
        g.softmax(x, axis=2)


# --- on the GPU: bf16 rows up to 50001 wide ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("cols", [1000, 8192, 50001])
def test_softmax_bf16(log, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[37, cols])
    g.softmax(x, axis=1, log=log).set_output(True)
    check(g, {x: (torch.randn(37, cols) * 3).to("cuda", torch.bfloat16)}, torch.bfloat16, device="cuda")
    g = dg.Graph(io_data_type=dg.bfloat16)
    dy, y = g.tensor(name="dy", dim=[37, cols]), g.tensor(name="y", dim=[37, cols])
    g.softmax_backward(dy, y, axis=1, log=log).set_output(True)
    y_t = torch.softmax(torch.randn(37, cols, device="cuda"), 1)
    check(g, {dy: torch.randn(37, cols, device="cuda").bfloat16(),
              y: (y_t.log() if log else y_t).bfloat16()}, torch.bfloat16, device="cuda")
