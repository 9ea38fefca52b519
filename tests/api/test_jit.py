"""dnngraph.jit: a function declaring a graph from torch arguments, declared and built once per
key (tensor shapes, dtypes, strides and device type, other arguments' values, options)."""
import pytest
import torch

import dnngraph as dg
from helpers import rel_err

DECLARED = []  # the arguments of each declaration (a graph declared, so built, once per key)


@dg.jit
def scaled_block(g, x, w, alpha=1.0):
    DECLARED.append((tuple(x.dim), tuple(x.stride), x.data_type.name, alpha))
    y = g.relu(g.scale(g.matmul(x, w), alpha))
    return y, g.reduction(y, "sum", [1])


def _expected(x, w, alpha):
    y = torch.relu(alpha * (x.double() @ w.double()))
    return y, y.sum(1, keepdim=True)


def test_built_once_per_key_and_computes_the_graph():
    scaled_block.cache_clear()
    DECLARED.clear()
    x, w = torch.randn(13, 7), torch.randn(7, 5)
    for _ in range(3):
        y, total = scaled_block(x, w, alpha=0.5)
        expected = _expected(x, w, 0.5)
        assert rel_err(y, expected[0]) < 2e-5 and rel_err(total, expected[1]) < 2e-5
    assert len(DECLARED) == 1
    assert scaled_block.cache_info() == {"hits": 2, "misses": 1, "size": 1, "maxsize": 256}
    # each part of the key declares anew: a value, a shape, strides (a transposed view), a dtype
    keys = [((x, w), {"alpha": 2.0}), ((torch.randn(9, 7), w), {"alpha": 0.5}),
            ((torch.randn(7, 13).t(), w), {"alpha": 0.5})]
    for args, kwargs in keys:
        y, total = scaled_block(*args, **kwargs)
        assert rel_err(y, _expected(*args, kwargs["alpha"])[0]) < 2e-5
    y, _ = scaled_block(x.half(), w.half(), 0.5)
    # fp16 inputs, outputs in the graph's io_data_type (the default float32), as any graph's
    assert y.dtype == torch.float32 and rel_err(y, _expected(x.half(), w.half(), 0.5)[0]) < 2e-5
    assert [entry[3] for entry in DECLARED] == [0.5, 2.0, 0.5, 0.5, 0.5]
    assert DECLARED[3][1] == (1, 13)  # the transposed input's strides were declared as they are
    assert scaled_block.cache_info()["size"] == 5
    scaled_block(x, w, alpha=0.5)  # positionally or by keyword: one key
    assert len(DECLARED) == 5


def test_least_recently_used_graph_is_dropped():
    calls = []

    @dg.jit(maxsize=2)
    def doubled(g, x):
        calls.append(tuple(x.dim))
        return g.add(x, x)

    for size in (3, 4, 3, 5, 4):
        assert torch.equal(doubled(torch.full((size,), 1.5)), torch.full((size,), 3.0))
    assert calls == [(3,), (4,), (5,), (4,)]
    assert doubled.cache_info()["size"] == 2


def test_a_key_function_keys_the_cache():
    """key= (the frontend's graph_cache(key_fn)): calls its value tells apart share a graph, so
    a key that leaves out a shape gives a graph that refuses the other shape."""
    calls = []

    @dg.jit(key=lambda x, scale: (x.shape[0], scale))
    def scaled(g, x, scale):
        calls.append(scale)
        return g.scale(x, scale)

    x = torch.randn(4, 3)
    assert torch.allclose(scaled(x, 2.0), 2.0 * x) and torch.allclose(scaled(x.clone(), 2.0), 2.0 * x)
    assert calls == [2.0]
    with pytest.raises(dg.ExecutionError, match="shape"):
        scaled(torch.randn(4, 5), 2.0)
    with pytest.raises(dg.ValidationError, match="unhashable"):
        dg.jit(key=lambda x: [x.shape])(lambda g, x: g.relu(x))(x)


def test_gradients_flow_through_a_jit_function():
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    y, _ = scaled_block(x, w, alpha=1.5)
    y.sum().backward()
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.relu(1.5 * (x_ref @ w_ref)).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 2e-5 and rel_err(w.grad, w_ref.grad) < 2e-5


def test_graph_settings_and_options_reach_the_graph():
    @dg.jit(options=dg.BuildOptions(plan=1), compute_data_type=dg.float32, io_data_type=dg.float16)
    def product(g, a, b):
        return g.matmul(a, b)

    a, b = torch.randn(16, 32).half(), torch.randn(32, 8).half()
    assert rel_err(product(a, b), a.double() @ b.double()) < 2e-3
    graph = product.graph_for(a, b)
    assert graph.io_data_type == dg.float16 and graph.name == "product"


def test_bad_uses_raise_typed_errors():
    @dg.jit
    def returns_nothing(g, x):
        g.relu(x)

    with pytest.raises(dg.ValidationError, match="returns the graph tensor"):
        returns_nothing(torch.randn(3))
    with pytest.raises(dg.ValidationError, match="hashable"):
        scaled_block(torch.randn(2, 7), torch.randn(7, 5), alpha=[1.0])
    with pytest.raises(dg.ValidationError, match="scaled_block"):
        scaled_block(torch.randn(2, 7))  # a missing argument
    with pytest.raises(dg.ValidationError, match="maxsize"):
        dg.jit(maxsize=0)(lambda g, x: x)
    with pytest.raises(dg.ValidationError, match="options"):
        dg.jit(options={"autotune": True})(lambda g, x: x)
    with pytest.raises(dg.ValidationError):
        dg.jit(3)


@pytest.mark.gpu
def test_jit_on_the_gpu_keys_on_the_device():
    x, w = torch.randn(33, 17), torch.randn(17, 9)
    on_cpu, _ = scaled_block(x, w, alpha=0.25)
    on_gpu, _ = scaled_block(x.cuda(), w.cuda(), alpha=0.25)
    assert on_gpu.is_cuda and rel_err(on_gpu, _expected(x, w, 0.25)[0]) < 2e-5
    assert rel_err(on_cpu, _expected(x, w, 0.25)[0]) < 2e-5
