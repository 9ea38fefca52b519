"""Whole models through torch.compile(backend="dnngraph") on the GPU: torchvision's ResNet-50
(random weights, channels-last bf16), a training step (batch-norm statistics included) and
inference, each no further from the float64 computation than eager torch (cuDNN) is, within a
small allowance. (transformers' LlamaDecoderLayer: test_torch_backend.py.)"""
import copy

import pytest
import torch

from dnngraph import torch_backend  # noqa: F401  (registers the name "dnngraph" for a checkout)
from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
torchvision = pytest.importorskip("torchvision")

ALLOWANCE = 1e-2  # beyond twice eager's own distance from float64


def _resnet50():
    torch.manual_seed(9)
    return torchvision.models.resnet50().to(device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)


def _training_step(model, forward, x, grad):
    """[logits, every parameter gradient, the batch norms' running statistics] of one step."""
    logits = forward(x)
    logits.backward(grad)
    values = [logits.detach().clone()] + [p.grad.clone() for p in model.parameters()]
    values += [b.clone() for b in model.buffers() if b.is_floating_point()]
    model.zero_grad()
    return values


def _assert_as_close_as_eager(ours, eager, exact):
    for index, (mine, theirs, truth) in enumerate(zip(ours, eager, exact)):
        mine_err, eager_err = rel_err(mine, truth), rel_err(theirs, truth)
        assert mine_err <= 2 * eager_err + ALLOWANCE, (index, mine_err, eager_err)


def test_resnet50_training_step_is_as_close_to_float64_as_eager():
    model = _resnet50().train()
    exact, eager_model = copy.deepcopy(model).double(), copy.deepcopy(model)
    x = torch.randn(4, 3, 96, 96, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    grad = torch.randn(4, 1000, device="cuda", dtype=torch.bfloat16)
    truth = _training_step(exact, exact, x.double(), grad.double())
    eager = _training_step(eager_model, eager_model, x, grad)
    torch._dynamo.reset()
    ours = _training_step(model, torch.compile(model, backend="dnngraph", dynamic=False), x, grad)
    assert len(ours) == len(eager) == len(truth)
    _assert_as_close_as_eager(ours, eager, truth)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_resnet50_inference_is_as_close_to_float64_as_eager(mode):
    model = _resnet50().eval()
    exact = copy.deepcopy(model).double()
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dnngraph", dynamic=False, mode=mode)
    with torch.no_grad():
        truth, eager = exact(x.double()), model(x)
        for _ in range(3):  # warm-up, recording, replay in reduce-overhead
            torch.compiler.cudagraph_mark_step_begin()
            ours = compiled(x).clone()
    _assert_as_close_as_eager([ours], [eager], [truth])
