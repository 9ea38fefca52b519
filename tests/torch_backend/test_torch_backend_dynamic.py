"""Default torch.compile (automatic dynamic shapes) through the dnngraph backend: after a second
input shape dynamo hands the backend a graph with symbolic sizes; the backend compiles each
concrete shape instead (dnngraph compiles static shapes), says so in the log and in explain(),
and keeps the ops in dnngraph graphs."""
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make_model", [_mlp, _Attention, _Pooler], ids=["mlp", "attention", "pooler"])
def test_new_sequence_lengths_are_compiled_static_and_stay_in_dnngraph(make_model, device, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="dnngraph"):
        _steps_match_eager(make_model(), device=device)
    reports = list(torch_backend.REPORTS)
    # forward and backward per length: the first static, the others specialized from dynamo's symbolic graph
    assert len(reports) == 2 * len(SEQUENCE_LENGTHS)
    assert all(report.torch_ops == () for report in reports), [r.torch_ops for r in reports]
    assert all(report.dnngraph_ops > 0 and report.graphs >= 1 for report in reports)
    specialized = [report.specialized for report in reports if report.specialized]
    assert len(specialized) == 2 * (len(SEQUENCE_LENGTHS) - 1)
    for length in SEQUENCE_LENGTHS[1:]:
        assert any(f"2x{length}x8" in text for text in specialized), (length, specialized)
    said = [r.getMessage() for r in caplog.records if "symbolic sizes" in r.getMessage()]
    assert len(said) == len(SEQUENCE_LENGTHS) - 1 and all("specializing it to the static shapes" in s for s in said)
    assert "specialized to" in torch_backend.explain() and "dynamo traced symbolic sizes" in torch_backend.explain()


def test_the_shapes_kept_are_bounded_and_reused(monkeypatch, caplog):
    monkeypatch.setattr(torch_backend, "SHAPE_LIMIT", 2)
    torch.manual_seed(2)
    with caplog.at_level(logging.INFO, logger="dnngraph"):
        _steps_match_eager(_mlp(), lengths=(2, 3, 4, 4, 5, 3))
    # 3, 4, 5 specialized; 4 again reuses its compile; 5 drops 3 (least recently used), which
    # then compiles again
    dropped = [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]
    assert len(dropped) == 2 and "2x3x8" in dropped[0] and "2x4x8" in dropped[1]
    assert sum("specializing it" in r.getMessage() for r in caplog.records) == 4
    assert len(torch_backend.REPORTS) == 2 * 5  # forward and backward per compile: 2, then 3, 4, 5, 3


def test_explain_names_the_ops_left_to_torch():
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    assert "no aten graph" in torch_backend.explain()
    compiled = torch.compile(lambda x: torch.sort(torch.relu(x), -1)[0] * 2, backend="dnngraph", dynamic=False)
    compiled(torch.randn(3, 4))
    text = torch_backend.explain()
    assert "aten graph 0:" in text and "stays in torch: aten.sort" in text


def test_symbolic_sizes_and_strides_in_an_aten_graph_stay_in_torch_with_why():
    """Converters never see a symbolic size or stride: such ops are left to torch, named."""
    def pooled(x, w):
        return torch.tanh(x[:, 0] @ w) + x.sum(1)

    graph = make_fx(pooled, tracing_mode="symbolic")(torch.randn(2, 5, 4), torch.randn(4, 4))
    torch_backend.REPORTS.clear()
    compiled = torch_backend._compile(graph, [])
    x, w = torch.randn(2, 5, 4), torch.randn(4, 4)
    assert torch.allclose(compiled([x, w]), pooled(x, w), atol=1e-6)
    reasons = [why for _, why in torch_backend.REPORTS[-1].torch_ops]
    assert reasons and all("symbolic" in why or "in torch" in why or "no converter" in why for why in reasons), reasons
    assert any("symbolic" in why for why in reasons)


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
