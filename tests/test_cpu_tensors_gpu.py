"""CPU tensors on a GPU machine run through Triton's interpreter, kernel by kernel, with nothing
set by the user; the same built graph serves CUDA and CPU tensors."""
import pytest
import torch

import dnngraph as dg
from helpers import check

pytestmark = pytest.mark.gpu


def _graph():
    g = dg.Graph(name="mixed")
    x, w, b = g.tensor(name="x", dim=[5, 12]), g.tensor(name="w", dim=[12, 7]), g.tensor(name="b", dim=[1, 7])
    y = g.softmax(g.add(g.matmul(x, w), b), axis=1)
    g.dropout(g.gelu(y), 0.25, seed=3, offset=1).set_output(True)
    return g, x, w, b


def _inputs(device):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*d, generator=gen).to(device) for d in ((5, 12), (12, 7), (1, 7))]


def test_cpu_tensors_run_through_the_interpreter_then_cuda_then_cpu_again():
    g, x, w, b = _graph()
    g.build()
    for device in ("cpu", "cuda", "cpu"):
        values = _inputs(device)
        check(g, dict(zip((x, w, b), values)), device=device)


def test_sdpa_and_a_bf16_matmul_with_cpu_tensors():
    g = dg.Graph(name="attn", io_data_type=dg.bfloat16)
    gen = torch.Generator().manual_seed(1)
    q_t, k_t, v_t = (torch.randn(1, 2, 9, 16, generator=gen).bfloat16() for _ in range(3))
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    g.matmul(o, g.transpose(v, [0, 1, 3, 2])).set_output(True)
    g.build()
    check(g, {q: q_t, k: k_t, v: v_t}, torch.bfloat16)


def test_as_function_with_cpu_tensors_and_gradients():
    g, *_ = _graph()
    fn = g.as_function()
    args = [t.requires_grad_() for t in _inputs("cpu")]
    fn(*args).sum().backward()
    assert all(a.grad is not None and a.grad.device.type == "cpu" for a in args)
