"""The quick check of a repeated binding set (runtime/binding_guard.py): taken when the very set
checked last comes again, refused (so the full stamp decides) by every change the binding checks
care about, including ones torch's guard cannot see by itself, and optional: without it execute
is the same. The in-place changes of test_execute_bindings run through it as well (each executes a
set twice before changing it)."""
import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import binding_guard
import dnngraph.runtime.plan as plan_module
from helpers import rel_err
from pretend_gpu import pretend_gpu

GEN = torch.Generator().manual_seed(43)


def _graph():
    g = dg.Graph(name="guarded")
    x = g.tensor(name="x", dim=[5, 6])
    b = g.tensor(name="b", dim=[1, 6])
    g.mul(g.sigmoid(g.add(x, b)), x).set_output(True).set_name("y")
    return g.build()


def _bindings():
    return {"x": torch.randn(5, 6, generator=GEN), "b": torch.randn(1, 6, generator=GEN),
            "y": torch.full((5, 6), float("nan"))}


def _expected(g, bindings):
    return g.reference({"x": bindings["x"], "b": bindings["b"]})["y"]


@pytest.fixture
def quick_hits(monkeypatch):
    """How often the quick check said a set is still bound."""
    hits = []
    real = plan_module.still_bound

    def counted(quick, bindings):
        found = real(quick, bindings)
        hits.append(found)
        return found
    monkeypatch.setattr(plan_module, "still_bound", counted)
    return hits


def test_a_repeated_set_takes_the_quick_check(quick_hits):
    """Checked in full on the first execute, its guard made on the second (a set bound once never
    pays for one), the quick check from the third on."""
    assert binding_guard.usable(), "this torch's TensorGuards passes the self-test"
    g, bindings = _graph(), _bindings()
    for step in range(4):
        bindings["y"].fill_(float("nan"))
        g.execute(bindings)
        assert rel_err(bindings["y"], _expected(g, bindings)) < 1e-6
        assert (g.plan._last[1].quick is None) == (step == 0)
    assert quick_hits == [True, True]


def test_a_set_bound_once_makes_no_guard(monkeypatch):
    made = []
    real = plan_module.guard_of
    monkeypatch.setattr(plan_module, "guard_of", lambda *args: made.append(1) or real(*args))
    g, x = _graph(), torch.randn(5, 6, generator=GEN)
    outputs = [torch.empty(5, 6) for _ in range(4)]  # held: every execute a new address
    for y in outputs:
        g.execute({"x": x, "b": torch.ones(1, 6), "y": y})
    assert made == []


def test_another_set_of_the_same_layout_is_not_taken_for_the_last(quick_hits):
    g = _graph()
    first, second = _bindings(), _bindings()
    for bindings in (first, second, first):
        g.execute(bindings)
        assert rel_err(bindings["y"], _expected(g, bindings)) < 1e-6
    assert quick_hits == []  # no set came again right after its full check: no guard was made


def test_a_negative_bit_the_thread_excludes_is_still_seen(quick_hits):
    """The guard compares dispatch keys through the thread's exclude set: a negative bit given in
    place while the thread excludes that key would pass it; the quick check reads the bit."""
    g, bindings = _graph(), _bindings()
    for _ in range(3):
        g.execute(bindings)
    assert quick_hits == [True]
    x = bindings["x"]
    x.data = x._neg_view()
    negative = torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)
    with torch._C._ExcludeDispatchKeyGuard(negative):
        assert not plan_module.still_bound(g.plan._last[1].quick, bindings)
    g.execute(bindings)
    assert rel_err(bindings["y"], _expected(g, bindings)) < 1e-6


def test_inference_mode_and_grad_flags_only_cost_the_stamp(quick_hits):
    """A thread in inference mode computes other dispatch keys than the one that checked the set,
    and requires_grad is part of the guard: both send execute to the stamp, with the same result."""
    g, bindings = _graph(), _bindings()
    g.execute(bindings)
    with torch.inference_mode():
        g.execute(bindings)
        assert rel_err(bindings["y"], _expected(g, bindings)) < 1e-6
    bindings["b"].requires_grad_()
    g.execute(bindings)
    assert rel_err(bindings["y"], _expected(g, bindings).detach()) < 1e-6
    assert len(g.plan._ready) == 1, "the same binding set throughout"


@pytest.mark.parametrize("gpu", [False, True])
def test_without_the_quick_check_execute_is_the_same(monkeypatch, gpu):
    monkeypatch.setattr(binding_guard, "_USABLE", [False])
    calls = []
    with (pretend_gpu(monkeypatch, calls) if gpu else _nothing()):
        g, bindings = _graph(), _bindings()
        for _ in range(3):
            g.execute(bindings)
        assert g.plan._last[1].quick is False
        bindings["x"].set_(torch.randn(5, 6, generator=GEN))
        g.execute(bindings)
        if not gpu:
            assert rel_err(bindings["y"], _expected(g, bindings)) < 1e-6
        assert len(g.plan._ready) == 2


def test_a_subclass_or_a_caller_workspace_keeps_to_the_stamp():
    """Sets with a tensor subclass (its Python attributes may differ from the C++ tensor the guard
    reads) or a caller's workspace get no quick check."""
    class Sub(torch.Tensor):
        pass

    g, bindings = _graph(), _bindings()
    bindings["x"] = bindings["x"].as_subclass(Sub)
    for _ in range(2):
        g.execute(bindings)
    assert g.plan._last[1].quick is False
    g, bindings = _graph(), _bindings()
    workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8)
    for _ in range(2):
        g.execute(bindings, workspace=workspace)
    assert g.plan._last[1].quick is False


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
