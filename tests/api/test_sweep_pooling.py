"""benchmarks/sweep_pooling.py's correctness column: the torch result each case is checked against
is dnngraph's float64 reference, on the CPU at the check's shapes and on the GPU at the sweep's,
and stays so where torch's channels-last average-pool backward with padding is wrong (as its
CUDA kernel is: pytorch/pytorch#188344)."""
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sweep_pooling as sweep  # noqa: E402


def float64_reference(label, tensors) -> torch.Tensor:
    """dnngraph's float64 reference of the case's graph (explicit zero padding, no torch pool
    backward with padding)."""
    g, bound, _ = sweep.graph_of(label, tensors)
    inputs = {tensor: value for tensor, value in bound.items() if tensor.name != "out"}
    return g.reference(inputs)["out"]


# the float64 reference is rounded to the graph's bf16 output (about 2e-3 relative); torch's
# defect makes 1.0
TOLERANCE = 1e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


class _PaddedGradientShifted(torch.autograd.Function):
    """avg_pool2d whose backward is what torch's channels-last CUDA kernel computes with padding:
    each dx element gets the gradient of the padded-input element at its own (unpadded) index,
    the neighbour one padding up and left of it."""

    @staticmethod
    def forward(ctx, x, window, stride, padding):
        ctx.geometry, ctx.shape = (window, stride, padding), x.shape
        return F.avg_pool2d(x, window, stride, padding)

    @staticmethod
    def backward(ctx, dy):
        window, stride, padding = ctx.geometry
        height, width = ctx.shape[2:]
        with torch.enable_grad():
            padded = torch.zeros(ctx.shape[:2] + (height + 2 * padding[0], width + 2 * padding[1]),
                                 dtype=dy.dtype, requires_grad=True)
            F.avg_pool2d(padded, window, stride).backward(dy)
        return padded.grad[:, :, :height, :width], None, None, None


def _avg_pool2d_of_cuda_nhwc(x, window, stride=None, padding=0, *args, **kwargs):
    padding = [padding] * 2 if isinstance(padding, int) else list(padding)
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    if channels_last and any(padding) and not args and not kwargs:
        return _PaddedGradientShifted.apply(x, list(window), list(stride), padding)
    return F.avg_pool2d(x, window, stride, padding, *args, **kwargs)


def test_the_emulated_torch_kernel_is_wrong_where_torchs_is():
    """The stand-in below gives the 1.0 relative error the H200 sweep printed for 'avg bwd nhwc'
    when handed channels-last tensors (a stand-in that is right could not catch anything)."""
    tensors = sweep.inputs_of("avg bwd nhwc", "cpu")
    leaf = tensors["x"].float().requires_grad_(True)
    _avg_pool2d_of_cuda_nhwc(leaf, *sweep.GEOMETRY).backward(tensors["dy"].float())
    assert relative_error(leaf.grad, float64_reference("avg bwd nhwc", tensors)) > 0.5


@pytest.mark.parametrize("label", list(sweep.CASES))
def test_reference_is_the_float64_reference_where_torchs_nhwc_kernel_is_wrong(label, monkeypatch):
    """Every case's reference, torch's channels-last average-pool backward replaced by one with
    the CUDA kernel's defect, equals dnngraph's float64 reference at the CPU check's shapes."""
    functional = types.SimpleNamespace(max_pool2d=F.max_pool2d, avg_pool2d=_avg_pool2d_of_cuda_nhwc)
    monkeypatch.setattr(sweep, "F", functional)
    tensors = sweep.inputs_of(label, "cpu")
    assert relative_error(sweep.reference(label, tensors), float64_reference(label, tensors)) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("label", [label for label in sweep.CASES if not sweep.per_element(label)])
def test_reference_is_the_float64_reference_at_the_sweep_shapes_on_the_gpu(label):
    tensors = sweep.inputs_of(label, "cuda")
    want = float64_reference(label, tensors)
    assert relative_error(sweep.reference(label, tensors), want) < TOLERANCE
