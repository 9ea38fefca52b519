"""torch.compile(model, backend="dnngraph") of nn.LSTM / nn.GRU models: the layer reaches the
backend as one dnngraph::rnn op (and its gradient as dnngraph::rnn_backward), both converted;
outputs and gradients against eager torch. Dynamo traces recurrent modules only with
torch._dynamo.config.allow_rnn (else it runs them in torch, which these tests also check)."""
import pytest
import torch

from dnngraph import torch_backend
from helpers import rel_err


class _Tagger(torch.nn.Module):
    """A recurrent layer and a linear head over its outputs, and the final state."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        width = layer.hidden_size if not layer.proj_size else layer.proj_size
        self.head = torch.nn.Linear(width * (2 if layer.bidirectional else 1), 3)

    def forward(self, x):
        y, state = self.layer(x)
        h_n = state[0] if isinstance(state, tuple) else state
        return torch.relu(self.head(y)).sum() + (h_n * h_n).sum()


@pytest.fixture
def rnn_tracing():
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    with torch._dynamo.config.patch(allow_rnn=True):
        yield
    torch._dynamo.reset()


def _step(model, x, compiled_model):
    """(output, gradients of the parameters and of x) of one training step."""
    leaf = x.clone().requires_grad_(True)
    out = compiled_model(leaf)
    seed = torch.ones_like(out)
    out.backward(seed)
    grads = [p.grad.clone() for p in model.parameters()] + [leaf.grad]
    model.zero_grad()
    return out, grads


@pytest.mark.parametrize("layer", [
    lambda: torch.nn.LSTM(3, 4, bidirectional=True),
    lambda: torch.nn.GRU(3, 4, num_layers=2, batch_first=True),
    lambda: torch.nn.LSTM(3, 5, proj_size=2),
], ids=["lstm-bidirectional", "gru-2-layers-batch-first", "lstm-projection"])
def test_training_step_runs_in_dnngraph(rnn_tracing, layer):
    torch.manual_seed(0)
    model = _Tagger(layer())
    x = torch.randn(3, 2, 3)
    out, grads = _step(model, x, torch.compile(model, backend="dnngraph", fullgraph=True, dynamic=False))
    expected, expected_grads = _step(model, x, model)
    assert rel_err(out, expected) < 1e-5
    for position, (got, want) in enumerate(zip(grads, expected_grads)):
        assert rel_err(got, want) < 1e-4, f"gradient {position}"
    kept = [target for report in torch_backend.REPORTS for target, _ in report.torch_ops]
    assert not any("rnn" in target or "lstm" in target or "gru" in target for target in kept), kept
    assert len(torch_backend.REPORTS) == 2


def test_inference_and_the_decomposition_left_as_it_was(rnn_tracing):
    """Under no_grad only the forward op is made; after compiling, aten.lstm traces as torch's
    own decomposition again (the substitution lives only while the backend traces)."""
    torch.manual_seed(1)
    layer = torch.nn.GRU(3, 4, num_layers=2)
    x = torch.randn(3, 2, 3)
    with torch.no_grad():
        got = torch.compile(layer, backend="dnngraph", fullgraph=True, dynamic=False)(x)
        want = layer(x)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5
    traced = torch.fx.experimental.proxy_tensor.make_fx(lambda v: torch.nn.functional.relu(layer(v)[0]),
                                                        pre_dispatch=False)(x)
    assert not any("dnngraph" in str(n.target) for n in traced.graph.nodes)


def test_without_allow_rnn_the_layer_runs_in_torch():
    torch._dynamo.reset()
    layer = torch.nn.LSTM(3, 4)
    x = torch.randn(3, 2, 3)
    with torch._dynamo.config.patch(allow_rnn=False):
        got = torch.compile(layer, backend="dnngraph")(x)[0]
    assert rel_err(got, layer(x)[0]) < 1e-6
    torch._dynamo.reset()
