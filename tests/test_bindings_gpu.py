"""On a GPU: the binding rules on CUDA tensors, whose repeated executes launch prepared argument
lists of addresses (the fast path): lazily negated inputs resolved (never bound by address),
negated outputs refused, dQ/dK/dV and rotary halves written into views of one buffer; and cache
files changed after the build never run, for CUDA tensors nor for CPU tensors (the interpreter
process)."""
import pytest
import torch

import dnngraph as dg
from dnngraph.plan import cache as plan_cache
from helpers import poisoned, rel_err
from test_binding_overlap import _attention_forward, _packed_bhsd, _two_outputs
from test_binding_kinds import _plain_twin
from test_kernel_source_integrity import _graph as _integrity_graph, _tamper

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(262)


def _randn(*dims, device="cuda"):
    return torch.randn(*dims, generator=GEN).to(device)


def _mul_graph(x_stride, y_stride=None):
    g = dg.Graph(name="kinds_gpu")
    x = g.tensor(name="x", dim=[64, 96], stride=x_stride)
    w = g.tensor(name="w", dim=[1, 96])
    y = g.mul(x, w).set_output(True).set_name("y")
    if y_stride is not None:
        y.set_stride(y_stride)
    return g.build(), x, w, y


def test_negated_inputs_on_the_fast_path():
    z = torch.complex(_randn(64, 96), _randn(64, 96))
    view = z.conj().imag
    g, x, w, y = _mul_graph(list(view.stride()))
    wt, out = _randn(1, 96), poisoned(y, "cuda")
    g.execute({x: _plain_twin(view), w: wt, y: out})  # bound by address
    assert rel_err(out, z.imag * wt) < 1e-6
    for _ in range(2):
        out.fill_(float("nan"))
        g.execute({x: view, w: wt, y: out})
        assert rel_err(out, -z.imag * wt) < 1e-6
    fn = g.as_function()
    assert rel_err(fn(view, wt), -z.imag * wt) < 1e-6


def test_a_negated_output_is_refused_on_cuda():
    z = torch.complex(_randn(64, 96), _randn(64, 96))
    out = z.conj().imag
    g, x, w, y = _mul_graph(None, list(out.stride()))
    before = z.clone()
    with pytest.raises(dg.ExecutionError, match="lazily negated"):
        g.execute({x: _randn(64, 96), w: _randn(1, 96), y: out})
    torch.cuda.synchronize()
    assert torch.equal(z, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dqkv_in_one_buffer_on_cuda(dtype):
    """q, k, v read from one packed buffer, dQ, dK, dV written into views of another."""
    batch, seq, heads, dim = 2, 197, 4, 64
    data_type = dg.float16 if dtype == torch.float16 else dg.bfloat16
    packed, _ = _packed_bhsd(batch, seq, heads, dim)
    packed = packed.to(dtype)
    q_t, k_t, v_t = (part.permute(0, 2, 1, 3) for part in packed.unbind(2))  # CPU, the reference's
    o_t, stats_t = _attention_forward(q_t.float(), k_t.float(), v_t.float())
    o_t, do_t = o_t.to(dtype), torch.randn(*o_t.shape, generator=GEN).to(dtype)
    g = dg.Graph(name="dqkv_gpu", io_data_type=data_type)
    q, k, v = (g.tensor_like(t, name) for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, d_o, stats = g.tensor_like(o_t, "o"), g.tensor_like(do_t, "dO"), g.tensor_like(stats_t, "stats")
    buffer = torch.full((batch, seq, 3, heads, dim), float("nan"), dtype=dtype, device="cuda")
    views = [part.permute(0, 2, 1, 3) for part in buffer.unbind(2)]
    grads = g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
    for grad, name, view in zip(grads, ("dq", "dk", "dv"), views):
        grad.set_output(True).set_name(name).set_data_type(data_type).set_stride(list(view.stride()))
    g.build()
    on_gpu = [part.permute(0, 2, 1, 3) for part in packed.cuda().unbind(2)]  # the packed strides kept
    bound = dict(zip((q, k, v), on_gpu))
    bound.update({o: o_t.cuda(), d_o: do_t.cuda(), stats: stats_t.cuda()})
    g.execute({**bound, **dict(zip(grads, views))})
    reference = g.reference({q: q_t, k: k_t, v: v_t, o: o_t, d_o: do_t, stats: stats_t})
    for name, view in zip(("dq", "dk", "dv"), views):
        assert rel_err(view, reference[name]) < 2e-2, name
    assert not torch.isnan(buffer).any()


@pytest.mark.parametrize("split", ["halves", "even_odd"])
def test_interleaved_outputs_on_cuda(split):
    x_t = _randn(33, 128)
    out = torch.full((33, 128), float("nan"), device="cuda")
    views = (out[:, :64], out[:, 64:]) if split == "halves" else (out[:, 0::2], out[:, 1::2])
    g, x, y1, y2 = _two_outputs(x_t, *views)
    for _ in range(2):  # the second through the prepared launches
        g.execute({x: x_t, y1: views[0], y2: views[1]})
    reference = g.reference({x: x_t.cpu()})
    assert rel_err(views[0], reference["y1"]) < 1e-5 and rel_err(views[1], reference["y2"]) < 1e-5
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_cache_file_changed_after_build_never_runs_on_a_gpu_machine(device, tmp_path, monkeypatch):
    """CUDA tensors compile at their first execute; CPU tensors go to the interpreter process.
    A changed file would not compile (it calls open()) nor, interpreted, leave the marker."""
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    plan_cache.clear()
    g = _integrity_graph(5.5 if device == "cuda" else 6.5).build()
    marker = tmp_path / "tampered_code_ran"
    for launch in g.plan.launches:
        _tamper(launch.source_path, marker)
    x, y = g.tensor_by_name("x"), g.tensor_by_name("y")
    xt = torch.randn(5, 9, generator=GEN).to(device)
    out = poisoned(y, device)
    g.execute({x: xt, y: out})
    assert rel_err(out, g.reference({x: xt.cpu()})["y"]) < 2e-5
    assert not marker.exists()
