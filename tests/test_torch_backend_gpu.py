"""torch.compile(backend="dnngraph") on the GPU: a bf16 Llama decoder layer (transformers' where
installed) and a small channels-last CNN, forward and backward against eager torch."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from dnngraph import torch_backend  # (registers the name "dnngraph" for a checkout)
from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def _step(module, forward, x):
    x = x.clone().requires_grad_()
    out = forward(module, x)
    grad = torch.randn_like(out)
    out.backward(grad)
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    module.zero_grad()
    return out.detach(), grads


def test_bf16_llama_decoder_layer_matches_eager():
    from llama_layer import make_layer

    torch.manual_seed(0)
    layer, forward, _ = make_layer(256, 4, 2, 512, torch.bfloat16, "cuda")
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1)
    want, want_grads = _step(layer, forward, x)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    compiled = torch.compile(lambda m, h: forward(m, h), backend="dnngraph", dynamic=False)
    torch.manual_seed(1)
    got, got_grads = _step(layer, compiled, x)
    assert rel_err(got, want) < 2e-2
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 3e-2
    kept = [t for r in torch_backend.REPORTS for t, _ in r.torch_ops]
    assert not [t for t in kept if "mm" in t or "attention" in t or "rsqrt" in t], kept


@pytest.mark.parametrize("norm", [False, True])
def test_bf16_channels_last_cnn_is_as_close_to_float64_as_eager(norm):
    """A bf16 channels-last CNN (with batch norms in training form): dnngraph's outputs and
    gradients are no further from the float64 computation than eager torch's (cuDNN), within a
    small allowance."""
    torch.manual_seed(2)
    layers = [torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Conv2d(32, 32, 3, padding=1, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10)]
    model = torch.nn.Sequential(*[layer for layer in layers if norm or not isinstance(layer, torch.nn.BatchNorm2d)])
    model = model.to(device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
    exact = copy.deepcopy(model).double()
    x = torch.randn(8, 16, 16, 16, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    torch.manual_seed(3)
    grad = torch.randn(8, 10, device="cuda", dtype=torch.bfloat16)

    def step(module, fn, value, g):
        value = value.clone().requires_grad_()
        out = fn(value)
        out.backward(g)
        grads = [p.grad.clone() for p in module.parameters()] + [value.grad.clone()]
        module.zero_grad()
        return [out.detach()] + grads

    reference = step(exact, exact, x.double(), grad.double())
    eager = step(model, model, x, grad)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dnngraph", dynamic=False)
    ours = step(model, compiled, x, grad)
    for mine, theirs, truth in zip(ours, eager, reference):
        assert rel_err(mine, truth) <= 2 * rel_err(theirs, truth) + 1e-2, (rel_err(mine, truth), rel_err(theirs, truth))


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_attention_through_flash_or_math_forms(masked):
    """F.scaled_dot_product_attention traced as torch's flash form (no mask: sdpa) or its math
    decomposition (a mask: an op-level chain), forward and backward, against eager in bf16."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 77, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = (torch.rand(77, 77, device="cuda") > 0.2) | torch.eye(77, dtype=torch.bool, device="cuda") if masked else None

    def attend(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=not masked) * 2.0

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    want = step(attend)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    got = step(torch.compile(attend, backend="dnngraph", dynamic=False))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 2e-2
    kept = [t for r in torch_backend.REPORTS for t, _ in r.torch_ops]
    assert not [t for t in kept if "attention" in t], kept
