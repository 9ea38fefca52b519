"""Dynamic shapes through the dnngraph backend (default torch.compile's automatic dynamic shapes
after a second input shape, and dynamic=True): dynamo hands the backend a graph with symbolic
sizes, AOTAutograd traces it once, and each partition is converted into a dnngraph graph per
concrete shape it meets (no retrace, no recompile), said in the log and in explain(); every
result against eager."""
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dnngraph as dg
from dnngraph import torch_backend
from helpers import rel_err

SEQUENCE_LENGTHS = (3, 5, 7)


class _Attention(torch.nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


class _Pooler(torch.nn.Module):
    """BERT's pooler: the first token of each sequence (a view whose stride is the sequence length)."""

    def __init__(self, dim=8):
        super().__init__()
        self.dense = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.dense(x[:, 0]))


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 8))


def _steps_match_eager(model, lengths=SEQUENCE_LENGTHS, device="cpu"):
    """One training step per sequence length under default torch.compile, each against eager."""
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    model = model.to(device)
    compiled = torch.compile(model, backend="dnngraph")
    for step, length in enumerate(lengths):
        x = torch.randn(2, length, 8, generator=torch.Generator().manual_seed(step)).to(device)
        leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        model.zero_grad()
        got = compiled(leaf)
        grad = torch.randn_like(got)
        got.backward(grad)
        compiled_grads = [leaf.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        want = model(eager_leaf)
        want.backward(grad)
        assert rel_err(got, want) < 1e-5, length
        for got_grad, want_grad in zip(compiled_grads, [eager_leaf.grad] + [p.grad for p in model.parameters()]):
            assert rel_err(got_grad, want_grad) < 1e-5, length


def _converted_shapes(report) -> list:
    """Per partition of a report of a graph traced with symbolic sizes, the shapes it was
    converted at into dnngraph graphs (not left to torch)."""
    return [[text for key, text in module.shapes.items() if module.modules[key] is not module.sub]
            for module in report.per_shape]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make_model", [_mlp, _Attention, _Pooler], ids=["mlp", "attention", "pooler"])
def test_new_sequence_lengths_run_in_dnngraph_from_one_symbolic_trace(make_model, device, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="dnngraph"):
        _steps_match_eager(make_model(), device=device)
    reports = list(torch_backend.REPORTS)
    # forward and backward of the first (static) length, then of dynamo's one symbolic recompile
    assert len(reports) == 4
    assert all(report.torch_ops == () for report in reports), [r.torch_ops for r in reports]
    assert all(report.dnngraph_ops > 0 and report.graphs >= 1 for report in reports)
    assert not any(report.specialized for report in reports)  # no whole-graph compile per shape
    symbolic = reports[2:]
    assert all(report.per_shape for report in symbolic) and not any(report.per_shape for report in reports[:2])
    texts = []
    for report in symbolic:  # each partition converted once at every later length
        for shapes in _converted_shapes(report):
            assert len(set(shapes)) == len(shapes) == len(SEQUENCE_LENGTHS) - 1, shapes
            texts += shapes
    for length in SEQUENCE_LENGTHS[1:]:
        assert any(f"2x{length}x8" in text for text in texts), (length, texts)
    assert "partitions converted per shape" in torch_backend.explain()


def test_the_shapes_kept_are_bounded_and_reused(monkeypatch, caplog):
    monkeypatch.setattr(torch_backend, "SHAPE_LIMIT", 2)
    torch.manual_seed(2)
    with caplog.at_level(logging.INFO, logger="dnngraph"):
        _steps_match_eager(_mlp(), lengths=(2, 3, 4, 4, 5, 3))
    # from the symbolic trace: 3, 4 converted; 4 again reuses its graph; 5 drops 3 (least
    # recently used), which then converts again and drops 4 -- in the forward's partition and
    # in the backward's alike
    dropped = [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]
    assert len(dropped) == 2 * 2 and sum("2x3x8" in d for d in dropped) == 2 and sum("2x4x8" in d for d in dropped) == 2
    assert len(torch_backend.REPORTS) == 2 * 2  # forward and backward: the static length 2, then one symbolic trace


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dynamic_true_compiles_once_for_every_length(device):
    """torch.compile(dynamic=True): dynamo's one frame compile, AOTAutograd's one symbolic trace
    (forward and backward), every length against eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    model = _Attention().to(device)
    torch._dynamo.reset()
    counters.clear()
    torch_backend.REPORTS.clear()
    compiled = torch.compile(model, backend="dnngraph", dynamic=True)
    for length in (3, 6, 11):
        x = torch.randn(2, length, 8, device=device)
        leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = compiled(leaf)
        got.sum().backward()
        want = model(eager_leaf)
        want.sum().backward()
        assert rel_err(got, want) < 1e-5 and rel_err(leaf.grad, eager_leaf.grad) < 1e-5, length
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["ok"] == 1
    assert len(torch_backend.REPORTS) == 2 and all(r.per_shape and r.torch_ops == () for r in torch_backend.REPORTS)
    for report in torch_backend.REPORTS:
        assert all(len(shapes) == 3 for shapes in _converted_shapes(report))


def test_explain_names_the_ops_left_to_torch():
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    assert "no aten graph" in torch_backend.explain()
    compiled = torch.compile(lambda x: torch.sort(torch.relu(x), -1)[0] * 2, backend="dnngraph", dynamic=False)
    compiled(torch.randn(3, 4))
    text = torch_backend.explain()
    assert "aten graph 0:" in text and "stays in torch: aten.sort" in text


def test_an_aten_graph_with_symbolic_sizes_converts_per_shape():
    """An aten graph traced with symbolic sizes (a view whose stride is a size, a reduction over
    a symbolic axis) runs its partitions as dnngraph graphs of each concrete shape it meets."""
    def pooled(x, w):
        return torch.tanh(x[:, 0] @ w) + x.sum(1)

    graph = make_fx(pooled, tracing_mode="symbolic")(torch.randn(2, 5, 4), torch.randn(4, 4))
    torch_backend.REPORTS.clear()
    compiled = torch_backend._compile(graph, [])
    for batch, length in ((2, 5), (3, 7), (2, 5)):
        x, w = torch.randn(batch, length, 4), torch.randn(4, 4)
        assert torch.allclose(compiled([x, w]), pooled(x, w), atol=1e-6)
    report = torch_backend.REPORTS[-1]
    assert report.per_shape and report.dnngraph_ops > 0
    assert all(len(shapes) == 2 for shapes in _converted_shapes(report))  # (2, 5) again reuses its graph


@pytest.mark.parametrize("call", [lambda x: torch.add(x, 2, alpha=3), lambda x: torch.sub(x, 0.5, alpha=-2),
                                  lambda x: torch.sum(x, dim=[], keepdim=True),
                                  lambda x: torch.amax(x, dim=[], keepdim=True) + x,
                                  lambda x: torch.mean(x, dim=[], keepdim=True)],
                         ids=["add alpha", "sub alpha", "sum dim=[]", "amax dim=[]", "mean dim=[]"])
def test_scalar_alpha_and_empty_dims_compile_through_torch_compile(call):
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    x = torch.randn(3, 5)
    got = torch.compile(call, backend="dnngraph", dynamic=False)(x)
    assert torch.allclose(got, call(x), atol=1e-5)
    assert torch_backend.REPORTS[-1].dnngraph_ops >= 1


def _llama_dynamic_steps(device, dtype, hidden, heads, kv_heads, inner, lengths, tolerance):
    """The Llama decoder layer bench_models.py runs (transformers' where installed), compiled once
    with dynamic=True, a training step at each length against eager: one dynamo compile, one
    symbolic trace, the layer's tensor ops in dnngraph."""
    import sys
    from pathlib import Path
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from llama_layer import make_layer

    torch.manual_seed(4)
    layer, forward, _ = make_layer(hidden, heads, kv_heads, inner, dtype, device)
    torch._dynamo.reset()
    counters.clear()
    torch_backend.REPORTS.clear()
    compiled = torch.compile(lambda m, h: forward(m, h), backend="dnngraph", dynamic=True)
    for length in lengths:
        x = torch.randn(1, length, hidden, device=device, dtype=dtype)
        leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = compiled(layer, leaf)
        got.float().sum().backward()
        want = forward(layer, eager_leaf)
        want.float().sum().backward()
        assert rel_err(got, want) < tolerance and rel_err(leaf.grad, eager_leaf.grad) < tolerance, length
    assert counters["stats"]["unique_graphs"] == 1
    reports = list(torch_backend.REPORTS)
    assert len(reports) == 2 and all(r.per_shape for r in reports)  # forward and backward, traced once
    # the layer's products, attention and norms run in dnngraph (on the CPU only the rotary
    # embedding's float64 casts of positions stay in torch)
    heavy = ("mm", "attention", "rsqrt", "silu", "mean")
    assert not any(word in target for r in reports for target, _ in r.torch_ops for word in heavy), \
        [r.torch_ops for r in reports]
    assert all(r.dnngraph_ops > 10 and r.kernels() > 0 for r in reports)


def test_llama_layer_dynamic_true_three_lengths():
    _llama_dynamic_steps("cpu", torch.float32, hidden=32, heads=2, kv_heads=1, inner=48, lengths=(3, 6, 11),
                         tolerance=1e-5)


@pytest.mark.gpu
def test_llama_layer_dynamic_true_three_lengths_gpu():
    _llama_dynamic_steps("cuda", torch.bfloat16, hidden=1024, heads=8, kv_heads=2, inner=2816,
                         lengths=(257, 511, 1024), tolerance=3e-2)


def test_a_shape_a_partition_does_not_convert_at_is_reported_not_hidden(monkeypatch):
    """A partition judged convertible at the traced sizes that fails to convert at some other
    shape runs that shape in torch: still correct, and said in explain() (it was only a log line:
    the report claimed every op in dnngraph)."""
    def pooled(x, w):
        return torch.tanh(x[:, 0] @ w) + x.sum(1)

    graph = make_fx(pooled, tracing_mode="symbolic")(torch.randn(2, 5, 4), torch.randn(4, 4))
    torch_backend.REPORTS.clear()
    compiled = torch_backend._compile(graph, [])
    converting = torch_backend.DnngraphModule

    def refusing_length_7(sub, options=None):
        if any(node.op == "placeholder" and getattr(node.meta.get("val"), "shape", ())[1:2] == (7,)
               for node in sub.graph.nodes):
            raise dg.UnsupportedError("no kernel at length 7")
        return converting(sub, options)

    monkeypatch.setattr(torch_backend, "DnngraphModule", refusing_length_7)
    for batch, length in ((2, 5), (3, 7)):
        x, w = torch.randn(batch, length, 4), torch.randn(4, 4)
        assert torch.allclose(compiled([x, w]), pooled(x, w), atol=1e-6)
    text = torch_backend.explain()
    assert "3x7x4" in text and "no kernel at length 7" in text, text
    assert "2x5x4" not in text  # converted: nothing to say


@pytest.fixture(params=["numbers recorded", "numbers not recorded"])
def propagation(request, monkeypatch):
    """torch's FakeTensorProp as this torch has it, and as torch 2.11 (the GPU machine's) has it:
    a node whose value is a number (a SymInt placeholder at a concrete size, s0 * 2) keeps the
    meta "val" of its trace, the symbol."""
    if request.param == "numbers not recorded":
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        recording = FakeTensorProp.run_node

        def keeping_the_traced_symbol(self, node):
            traced = node.meta.get("val")
            result = recording(self, node)
            if isinstance(result, (int, float, bool)):
                node.meta["val"] = traced
            return result

        monkeypatch.setattr(FakeTensorProp, "run_node", keeping_the_traced_symbol)
    return request.param


def test_size_placeholders_and_size_arithmetic_read_as_numbers_at_each_shape(propagation):
    """A graph with a SymInt placeholder (as AOTAutograd's backward saves sizes) and arithmetic on
    it (n * 2) feeding a view: every size-valued node is the number it is at the shape converted,
    so the view converts, whichever torch propagates the shapes."""
    def viewed(x, n):
        return torch.tanh(x.view(n * 2, -1)) * 2

    graph = make_fx(viewed, tracing_mode="symbolic")(torch.randn(6, 4), 3)
    assert any(node.op == "placeholder" and isinstance(node.meta["val"], torch.SymInt) for node in graph.graph.nodes)
    twin = torch_backend._at_sizes(graph, [torch.randn(10, 4), 5])
    for node in twin.graph.nodes:
        assert not torch_backend._is_symbolic_value(node.meta.get("val")), node.name
    view = next(node for node in twin.graph.nodes if node.target is torch.ops.aten.view.default)
    assert list(view.args[1]) == [10, -1] and view.meta["val"].shape == (10, 4)
    torch_backend.REPORTS.clear()
    compiled = torch_backend._compile(graph, [])
    for rows, n in ((6, 3), (10, 5), (4, 2)):
        x = torch.randn(rows, 4)
        assert torch.allclose(compiled([x, n]), viewed(x, n), atol=1e-6)
    report = torch_backend.REPORTS[-1]
    assert report.torch_ops == () and report.dnngraph_ops == 3, report.torch_ops
    assert [len(shapes) for shapes in _converted_shapes(report)] == [3]


@pytest.mark.parametrize("make_model", [_mlp, _Attention, _Pooler], ids=["mlp", "attention", "pooler"])
def test_backward_graphs_saving_sizes_run_in_dnngraph_whichever_torch_propagates(make_model, propagation):
    """The forms the GPU run (torch 2.11) left in torch: backward graphs whose views and
    select_backward read sizes AOTAutograd saved as SymInt placeholders (primals_1) or computed
    from them (mul_6)."""
    torch.manual_seed(0)
    _steps_match_eager(make_model(), lengths=SEQUENCE_LENGTHS[:2])
    reports = list(torch_backend.REPORTS)
    assert len(reports) == 4 and all(report.torch_ops == () for report in reports), [r.torch_ops for r in reports]
    assert all(len(shapes) == 1 for report in reports[2:] for shapes in _converted_shapes(report))
