"""The backend seam: problems (problems/), the backend contract and registry (backends/), and the
build's choice of a backend per group (those that support it ranked together: by the model's
estimates, else BuildOptions.backends order; autotuning times the top ones on a GPU)."""
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
    with pytest.raises(dg.ValidationError, match="cutlass"):
        dg.BuildOptions(backends=("cutlass",))
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


# -- ranking backends together (registry.ranked, build_launches, explain) ------------------------

class EstimatingToy(ToyBackend):
    """The toy backend with one candidate whose model time is `seconds` (None: no estimate)."""

    def __init__(self, seconds, interpretable=True):
        self.seconds, self.interpretable = seconds, interpretable

    def candidates(self, problem, target, options=None):
        return [Candidate(self.name, None, self.seconds)]

    def estimate(self, problem, config, target):
        return self.seconds


def _register(monkeypatch, backend):
    monkeypatch.setitem(registry.BACKENDS, backend.name, backend)
    return backend


def _pointwise_problem():
    g, _ = _pointwise_graph()
    (problem,) = _problems(g).values()
    return problem


def _ranked_names(problem, backends, interpreted=False):
    pairs = registry.ranked(problem, H200, dg.BuildOptions(backends=backends), interpreted)
    return [backend.name for backend, _ in pairs]


def test_a_smaller_estimate_ranks_first_whatever_the_preference(monkeypatch):
    _register(monkeypatch, EstimatingToy(1e-12))
    problem = _pointwise_problem()
    names = _ranked_names(problem, ("triton", "toy"))
    assert names[0] == "toy" and "triton" in names
    pairs = registry.ranked(problem, H200, dg.BuildOptions(backends=("triton", "toy")))
    assert [c.estimate for _, c in pairs] == sorted(c.estimate for _, c in pairs)
    assert registry.choose(problem, H200, dg.BuildOptions(backends=("triton", "toy"))).name == "toy"
    assert "by the model" in registry.ranking_reason(pairs)


def test_without_an_estimate_the_preference_order_decides(monkeypatch):
    _register(monkeypatch, EstimatingToy(None))
    problem = _pointwise_problem()
    for backends in (("triton", "toy"), ("toy", "triton")):
        names = _ranked_names(problem, backends)
        assert names[0] == backends[0]
        # the backend's own order is kept within its pairs, and the pairs of one backend stay together
        assert names == sorted(names, key=backends.index)
        assert registry.choose(problem, H200, dg.BuildOptions(backends=backends)).name == backends[0]
    pairs = registry.ranked(problem, H200, dg.BuildOptions(backends=("triton", "toy")))
    assert "preference order" in registry.ranking_reason(pairs)
    assert [c for b, c in pairs if b.name == "triton"] == TRITON.candidates(problem, H200, dg.BuildOptions())


def test_equal_estimates_fall_back_to_the_preference_order(monkeypatch):
    problem = _pointwise_problem()
    best = TRITON.candidates(problem, H200, dg.BuildOptions())[0].estimate
    _register(monkeypatch, EstimatingToy(best))
    assert _ranked_names(problem, ("triton", "toy"))[0] == "triton"
    assert _ranked_names(problem, ("toy", "triton"))[0] == "toy"


def test_the_ranked_choice_builds_and_explain_names_it(monkeypatch):
    _register(monkeypatch, EstimatingToy(1e-12))
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("triton", "toy")))
    text = g.explain()
    assert _backends_in(text) == ["toy"]
    assert "  ranked: backend toy ranked over triton by the model" in text


def test_interpreted_builds_skip_a_backend_the_interpreter_cannot_run(monkeypatch):
    _register(monkeypatch, EstimatingToy(1e-12, interpretable=False))
    problem = _pointwise_problem()
    assert _ranked_names(problem, ("toy", "triton"))[0] == "toy"
    assert set(_ranked_names(problem, ("toy", "triton"), interpreted=True)) == {"triton"}
    with pytest.raises(dg.UnsupportedError, match="interpreter"):
        registry.ranked(problem, H200, dg.BuildOptions(backends=("toy",)), interpreted=True)
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton")))  # the CPU build interprets
    assert _backends_in(g.explain()) == ["triton"] and "  ranked:" not in g.explain()


def _no_timing(*args):
    raise AssertionError("the build timed backends")


def test_autotune_on_the_interpreter_times_no_backend_and_keeps_the_first_ranked(monkeypatch):
    import dnngraph.build as build

    _register(monkeypatch, EstimatingToy(None))
    monkeypatch.setattr(build, "time_backends", _no_timing)
    monkeypatch.setattr(build, "choose_by_timing", _no_timing)
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton"), autotune=True))
    assert _backends_in(g.explain()) == ["toy"]
    assert "ranked over triton by preference order" in g.explain()


@pytest.mark.parametrize("backends, kept, reason", [
    (("toy", "triton"), "triton", "backend triton chosen over toy by timing: 12.1 us vs toy 15.3 us"),
    (("triton", "toy"), "triton", "backend triton chosen over toy by timing: 12.1 us vs toy 15.3 us")])
def test_autotune_times_the_top_backends_together_and_keeps_the_fastest(monkeypatch, backends, kept, reason):
    import dnngraph.build as build

    _register(monkeypatch, EstimatingToy(None))
    timed = []

    def fixed_times(trials, group, device):
        timed.append([backend.name for backend, _ in trials])
        assert all(launches for _, launches in trials)
        return [{"toy": 15.3e-3, "triton": 12.1e-3}[backend.name] for backend, _ in trials]

    monkeypatch.setattr(build, "times_on", lambda device: True)  # the GPU path, on the CPU
    monkeypatch.setattr(build, "time_backends", fixed_times)
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=backends, autotune=True))
    assert timed == [list(backends)]  # lowered by each, in rank order, and timed together
    assert _backends_in(g.explain()) == [kept]
    assert f"  ranked: {reason}" in g.explain()


def test_autotune_top_bounds_the_backends_timed(monkeypatch):
    import dnngraph.build as build

    _register(monkeypatch, EstimatingToy(None))
    monkeypatch.setattr(build, "times_on", lambda device: True)
    monkeypatch.setattr(build, "time_backends", _no_timing)
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton"), autotune=True, autotune_top=1))
    assert _backends_in(g.explain()) == ["toy"]


def test_a_backend_whose_timing_fails_loses(monkeypatch):
    import dnngraph.build as build

    _register(monkeypatch, EstimatingToy(None))
    monkeypatch.setattr(build, "times_on", lambda device: True)
    monkeypatch.setattr(build, "time_backends",
                        lambda trials, group, device: [None if b.name == "toy" else 1e-3 for b, _ in trials])
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton"), autotune=True))
    assert _backends_in(g.explain()) == ["triton"] and "(toy failed)" in g.explain()


def test_one_supporting_backend_is_neither_ranked_nor_timed(monkeypatch, toy):
    import dnngraph.build as build

    monkeypatch.setattr(build, "times_on", lambda device: True)
    monkeypatch.setattr(build, "time_backends", _no_timing)
    monkeypatch.setattr(registry, "ranked", _no_timing)
    g, inputs = _matmul_graph()  # toy has no matmul kernel
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton"), autotune=True))
    assert _backends_in(g.explain()) == ["triton"] and "  ranked:" not in g.explain()


def _kernels(g) -> list:
    return [(launch.kernel.__name__, launch.config_text, launch.reason) for launch in g.plan.launches]


def test_the_default_build_is_triton_alone(toy):
    """The default options (triton alone), triton named alone, and a second backend that does
    not support the group: the same kernels, configs and reasons, and no ranking line."""
    built = []
    for options in (None, dg.BuildOptions(backends=("triton",)), dg.BuildOptions(backends=("triton", "toy"))):
        g, inputs = _matmul_graph()
        check(g, inputs, options=options)
        assert "  ranked:" not in g.explain()
        built.append(_kernels(g))
    assert built[0] == built[1] == built[2]


def test_triton_lowers_a_forced_matmul_candidate():
    from dnngraph.backends.contract import BuildContext
    from dnngraph.target import INTERPRETER

    g = dg.Graph(name="mm")  # large enough for the model to rank several configs (lowered, not run)
    g.matmul(g.tensor(name="a", dim=[256, 512]), g.tensor(name="b", dim=[512, 256]), name="mm").set_output(True)
    group = next(gr for gr in partition(g, registry.families()) if gr.kind == "matmul")
    problem = problem_of(g, group)
    options = dg.BuildOptions()
    context = BuildContext(torch.device("cpu"), INTERPRETER, options)
    candidates = TRITON.candidates(problem, INTERPRETER, options)
    own = TRITON.lower(g, group, problem, context)
    assert TRITON.lower(g, group, problem, context, None)[-1].config_text == own[-1].config_text
    other = next(c for c in candidates if c.config.text not in own[-1].config_text)
    (forced,) = [launch for launch in TRITON.lower(g, group, problem, context, other)
                 if other.config.text in launch.config_text]  # a split-K config adds its combine kernel
    assert "forced" in forced.reason
    softmax = Candidate("triton", None, None)
    assert TRITON.lower(g, group, problem, context, softmax)[-1].config_text == own[-1].config_text


class RefusingToy(ToyBackend):
    """Supports pointwise problems, then refuses at lowering (what only the group shows)."""

    def lower(self, graph, group, problem, context, candidate=None):
        raise dg.UnsupportedError(f"{problem.where}: toy cannot lower this group after all")


def test_a_backend_refusing_at_lowering_passes_the_group_to_the_next_ranked(monkeypatch):
    """Ranked first, refused at lowering: the next ranked lowers the group, and explain says
    why; timed together, the refusing backend is no trial; alone, its refusal is the error."""
    import dnngraph.build as build

    _register(monkeypatch, RefusingToy())
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton")))
    assert _backends_in(g.explain()) == ["triton"] and "toy refused at lowering" in g.explain()
    monkeypatch.setattr(build, "times_on", lambda device: True)
    monkeypatch.setattr(build, "time_backends", lambda trials, group, device: [1e-3 for _ in trials])
    g, inputs = _pointwise_graph()
    check(g, inputs, options=dg.BuildOptions(backends=("toy", "triton"), autotune=True))
    assert _backends_in(g.explain()) == ["triton"]
    g, _ = _pointwise_graph()
    with pytest.raises(dg.UnsupportedError, match="toy cannot lower"):
        g.build(options=dg.BuildOptions(backends=("toy",)))
