"""The backend seam: problems (problems/), the backend contract and registry (backends/), and the
build's choice of a backend per group (the first of BuildOptions.backends that supports it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import check

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import Backend, Candidate
from dnngraph.backends.triton.backend import TRITON, TritonBackend
from dnngraph.fusion import partition
from dnngraph.problems import PROBLEM_BUILDERS, problem_of
from dnngraph.target import H200


class ToyBackend:
    """A second backend for tests: pointwise problems only, lowered by the Triton builder."""

    name = "toy"
    version = "toy 1"
    families = frozenset({"pointwise"})
    interpretable = True
    prologue_stored_apart = frozenset()

    def supports(self, problem, target):
        return True if problem.family == "pointwise" else f"toy lowers pointwise groups only"

    def candidates(self, problem, target, options=None):
        return [Candidate(self.name, None, None)]

    def estimate(self, problem, config, target):
        return None

    def cache_key(self):
        return (self.name, self.version)

    def lower(self, graph, group, problem, context):
        return TRITON.lower(graph, group, problem, context)


@pytest.fixture
def toy(monkeypatch):
    backend = ToyBackend()
    monkeypatch.setitem(registry.BACKENDS, "toy", backend)
    return backend


def _pointwise_graph():
    g = dg.Graph(name="pw")
    x = g.tensor(name="x", dim=[4, 6])
    g.exp(g.relu(x, name="r"), name="e").set_output(True)
    return g, {"x": torch.randn(4, 6)}


def _matmul_graph():
    g = dg.Graph(name="mm")
    a, b = g.tensor(name="a", dim=[2, 8, 16]), g.tensor(name="b", dim=[2, 16, 4])
    g.matmul(a, b, name="mm").set_output(True)
    return g, {"a": torch.randn(2, 8, 16), "b": torch.randn(2, 16, 4)}


def _backends_in(text: str) -> list:
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("  backend:")]


def test_the_triton_backend_keeps_the_contract():
    assert isinstance(TRITON, Backend) and isinstance(ToyBackend(), Backend)
    assert registry.BACKENDS["triton"] is TRITON and TRITON.interpretable
    assert registry.families() == frozenset(PROBLEM_BUILDERS)


def test_a_second_backend_takes_the_problems_it_supports(toy):
    options = dg.BuildOptions(backends=("toy", "triton"))
    g, inputs = _pointwise_graph()
    check(g, inputs, options=options)
    assert _backends_in(g.explain()) == ["toy"]
    assert {launch.backend for launch in g.plan.launches} == {"toy"}
    g, inputs = _matmul_graph()
    check(g, inputs, options=options)
    assert _backends_in(g.explain()) == ["triton"]


def test_the_default_build_names_triton():
    g, inputs = _pointwise_graph()
    check(g, inputs)
    assert _backends_in(g.explain()) == ["triton"]


def test_the_preference_order_is_in_the_plan_key(toy):
    g, inputs = _pointwise_graph()
    g.build(options=dg.BuildOptions(backends=("toy", "triton")))
    toy_plan = g.plan
    g.build(options=dg.BuildOptions(backends=("triton", "toy")))
    assert g.plan is not toy_plan and {launch.backend for launch in g.plan.launches} == {"triton"}


def test_no_backend_that_supports_the_problem_names_the_node_and_the_backends(toy):
    g, _ = _matmul_graph()
    with pytest.raises(dg.UnsupportedError, match=r"'mm' \(matmul\).*toy"):
        g.build(options=dg.BuildOptions(backends=("toy",)))


def test_an_unknown_backend_is_a_validation_error():
    with pytest.raises(dg.ValidationError, match="gluon"):
        dg.BuildOptions(backends=("gluon",))
    with pytest.raises(dg.ValidationError):
        dg.BuildOptions(backends=("triton", "triton"))


def test_a_registered_backend_is_a_valid_name(toy):
    assert dg.BuildOptions(backends=["toy"]).backends == ("toy",)


def _problems(g) -> dict:
    return {group.kind: problem_of(g, group) for group in partition(g, registry.families())}


def test_matmul_problem():
    g, _ = _matmul_graph()
    problem = _problems(g)["matmul"]
    geo = problem.geometry
    assert (geo.batch, geo.m, geo.n, geo.k) == (2, 8, 4, 16) and (geo.a_layout, geo.b_layout) == ("row", "row")
    assert problem.operand("a").dims == (2, 8, 16) and problem.operand("b").role == "b"
    assert problem.anchor_name == "mm" and problem.ops == ("matmul",)
    hash(problem)
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.family = "conv"


def test_matmul_problem_sees_a_transposed_operand_and_the_epilogue():
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[8, 16]), g.tensor(name="b", dim=[4, 16])
    g.relu(g.matmul(a, g.transpose(b, [1, 0]))).set_output(True)
    problem = _problems(g)["matmul"]
    assert problem.geometry.b_layout == "col" and problem.epilogue == ("relu",)


def test_conv_problem():
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[2, 4, 9, 9]), g.tensor(name="w", dim=[6, 4, 3, 3])
    g.conv_fprop(x, w, padding=1, stride=2, name="c").set_output(True)
    geo = _problems(g)["conv"].geometry
    assert (geo.direction, geo.n, geo.c, geo.k, geo.groups) == ("fprop", 2, 4, 6, 1)
    assert geo.input_spatial == (9, 9) and geo.output_spatial == (5, 5) and geo.filter == (3, 3)
    assert geo.stride == (2, 2) and geo.padding == (1, 1) and geo.dilation == (1, 1)
    hash(_problems(g)["conv"])


def test_sdpa_problem():
    g = dg.Graph()
    q, k, v = (g.tensor(name=n, dim=[2, 4, s, 8]) for n, s in (("q", 5), ("k", 7), ("v", 7)))
    g.sdpa(q, k, v, use_causal_mask=True, name="att")[0].set_output(True)
    geo = _problems(g)["sdpa"].geometry
    assert (geo.batch, geo.heads, geo.kv_heads, geo.s_q, geo.s_kv, geo.head_dim, geo.value_dim) == \
        (2, 4, 4, 5, 7, 8, 8)
    assert geo.causal and geo.mask == "causal" and geo.dropout == 0.0 and not geo.paged
    hash(_problems(g)["sdpa"])


def test_softmax_row_problem():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3, 5, 12])
    g.softmax(x, axis=-1, name="s").set_output(True)
    geo = _problems(g)["softmax"].geometry
    assert (geo.kind, geo.rows, geo.row_length, geo.reduced_axes) == ("softmax", 15, 12, (2,))


def test_every_group_kind_has_a_problem_and_a_backend():
    """Every kind the partition forms (the op families that are anchors or pointwise, the copy
    kernels of layout ops, the op-level attention chains) has a problem builder and a backend
    that lowers it."""
    from dnngraph.ops.base import REGISTRY

    kinds = {op.family for op in REGISTRY.values() if op.family != "layout"}
    kinds |= {"copy", "attention", "attention_backward"}
    assert kinds <= set(PROBLEM_BUILDERS), kinds - set(PROBLEM_BUILDERS)
    assert kinds <= registry.families(), kinds - registry.families()
    assert set(PROBLEM_BUILDERS) == set(TritonBackend().families)


def test_candidates_come_from_the_heuristics():
    g, _ = _matmul_graph()
    problem = _problems(g)["matmul"]
    candidates = TRITON.candidates(problem, H200, dg.BuildOptions())
    assert candidates and all(c.backend == "triton" and c.estimate > 0 for c in candidates)
    assert [c.estimate for c in candidates] == sorted(c.estimate for c in candidates)
    assert TRITON.estimate(problem, candidates[0].config, H200) == pytest.approx(candidates[0].estimate)
    g, _ = _pointwise_graph()
    (pointwise,) = _problems(g).values()
    assert TRITON.candidates(pointwise, H200)[0].estimate > 0
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3, 5, 12])
    g.softmax(x).set_output(True)
    assert TRITON.candidates(_problems(g)["softmax"], H200) == [Candidate("triton", None, None)]


def test_problems_import_no_backend_and_no_runtime():
    from test_layers import MODULES, imports_of

    found = [(module, target) for module in MODULES if module.startswith("dnngraph.problems")
             for target, _ in imports_of(module)
             if target.startswith(("dnngraph.backends", "dnngraph.runtime", "dnngraph.build"))]
    assert not found, found


def test_a_builder_or_backend_swapped_in_place_misses_the_plan_cache(monkeypatch):
    """The key holds each backend object and the code that lowers each family: a builder
    replaced in TRITON.builders, or another instance registered as "triton", builds afresh."""
    from dnngraph.backends.triton.backend import TritonBackend

    calls = []
    original = TRITON.builders["pointwise"]

    def spy(graph, group, context):
        calls.append(group.kind)
        return original(graph, group, context)

    first = _pointwise_graph()[0].build()
    monkeypatch.setitem(TRITON.builders, "pointwise", spy)
    second = _pointwise_graph()[0].build()
    assert calls and second.plan.launches is not first.plan.launches
    monkeypatch.setitem(TRITON.builders, "pointwise", original)
    calls.clear()
    monkeypatch.setitem(registry.BACKENDS, "triton", TritonBackend({**TRITON.builders, "pointwise": spy}))
    _pointwise_graph()[0].build()
    assert calls


@pytest.mark.parametrize("left, right, causal_flag, mask, causal", [
    (None, None, True, "causal", True), (5, None, True, "band", False), (None, 3, False, "band", True),
    (4, 2, False, "band", False), (None, 10**6, False, "none", False)])
def test_sdpa_problem_mask_as_the_kernels_see_it(left, right, causal_flag, mask, causal):
    """A sliding window (a left bound beside the causal one) is a band, not causal; a bound past
    Sq + Skv masks nothing."""
    g = dg.Graph(name="att")
    q, k, v = (g.tensor(name=n, dim=[1, 2, 9, 8]) for n in "qkv")
    o, _ = g.sdpa(q, k, v, use_causal_mask=causal_flag, diagonal_band_left_bound=left,
                  diagonal_band_right_bound=right)
    o.set_output(True)
    group = next(gr for gr in partition(g, registry.families()) if gr.kind == "sdpa")
    geometry = problem_of(g, group).geometry
    assert (geometry.mask, geometry.causal) == (mask, causal)
