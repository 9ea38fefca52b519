"""Plan choice: Graph.plans() ranks each kernel group's candidates, build(plan=k) and a plan per
group build exactly the candidate named, and the frontend's get_execution_plan_count /
build_plan_at_index / execute_plan_at_index."""
import pytest
import torch

import dnngraph as dg
from helpers import check, poisoned, rel_err


def _declared(m=37, k=45, n=19):
    """A matmul with a transposed operand and a relu epilogue, then a softmax of its result:
    two kernel groups, the first with many candidates, the second with its builder's choice."""
    g = dg.Graph(name="choice")
    x = g.tensor(name="x", dim=[2, m, k])
    w = g.tensor(name="w", dim=[2, k, n], stride=[k * n, 1, k])
    y = g.softmax(g.relu(g.matmul(x, w)), axis=-1)
    y.set_output(True).set_name("y")
    return g


def _inputs():
    return {"x": torch.randn(2, 37, 45), "w": torch.randn(2, 19, 45).transpose(1, 2)}


def test_plans_rank_each_groups_candidates():
    g = _declared()
    plans = g.plans()
    assert [group.kind for group in plans] == ["matmul", "softmax"]
    matmul, softmax = plans
    assert matmul.ops[0] == "matmul" and len(matmul.candidates) > 1
    estimates = [candidate.estimate for candidate in matmul.candidates]
    assert all(e is not None for e in estimates) and estimates == sorted(estimates)
    assert len({candidate.config for candidate in matmul.candidates}) == len(matmul.candidates)
    # the row family's builder chooses its own config: one candidate, config None
    assert [(c.backend, c.config) for c in softmax.candidates] == [("triton", None)]
    assert g.get_execution_plan_count() == len(matmul.candidates)
    assert g.plan is None  # listing builds nothing


def test_each_plan_builds_its_candidate_and_computes_the_same():
    g = _declared()
    candidates = g.plans()[0].candidates
    inputs = _inputs()
    for index in (0, 1, len(candidates) - 1):
        g.build(plan=index)
        launch = next(launch for launch in g.plan.launches if launch.group.kind == "matmul")
        assert launch.config_text.startswith(candidates[index].config.text)
        assert f"plan choice {index} of {len(candidates)}" in launch.backend_reason
        softmax = next(launch for launch in g.plan.launches if launch.group.kind == "softmax")
        assert "plan choice 0 of 1" in softmax.backend_reason  # fewer candidates: its first
        check(g, inputs)


def test_plan_per_group_and_bad_choices():
    g = _declared()
    count = len(g.plans()[0].candidates)
    g.build(plan=(count - 1, 0))
    check(g, _inputs())
    for bad in ((0,), (0, 0, 0), (count, 0), (0, 1)):  # wrong length; out of range for a group
        with pytest.raises(dg.ValidationError, match="BuildOptions.plan"):
            g.build(plan=bad)
    for bad in (-1, 1.0, "0", (), (0, -2), True):
        with pytest.raises(dg.ValidationError, match="BuildOptions.plan"):
            dg.BuildOptions(plan=bad)


def test_an_index_past_the_plan_count_is_refused():
    """As the frontend's build_plan_at_index: plan k exists for k < get_execution_plan_count();
    an index past the last plan raises instead of building plan 0 under another number, and the
    graph keeps the plan it had."""
    g = _declared()
    count = g.get_execution_plan_count()
    g.build(plan=count - 1)
    built = g.plan
    for bad in (count, count + 7):
        with pytest.raises(dg.ValidationError, match=f"plan {bad}.*{count} plans"):
            g.build(plan=bad)
        with pytest.raises(dg.ValidationError, match=f"plan {bad}.*{count} plans"):
            g.build_plan_at_index(bad)
        with pytest.raises(dg.ExecutionError, match="build_plan_at_index"):
            g.execute_plan_at_index({**_inputs(), "y": poisoned(g.tensor_by_name("y"))}, bad)
    assert g.plan is built


def test_execute_plan_at_index():
    g = _declared()
    inputs = _inputs()
    reference = g.reference(inputs)["y"]
    for unbuilt in (1, [0], {0: 1}, None):  # a list or dict index (unhashable) names no plan either
        with pytest.raises(dg.ExecutionError, match="build_plan_at_index"):
            g.execute_plan_at_index({**inputs, "y": poisoned(g.tensor_by_name("y"))}, unbuilt)
    for index in (1, 2):
        g.build_plan_at_index(index)
    assert g.plan is None  # the graph's own plan is left alone
    for index in (2, 1):
        out = poisoned(g.tensor_by_name("y"))
        g.execute_plan_at_index({**inputs, "y": out}, index)
        assert rel_err(out, reference) < 2e-5
    g.tensor_by_name("y").set_name("z")  # a changed graph forgets its plans
    with pytest.raises(dg.ExecutionError, match="build_plan_at_index"):
        g.execute_plan_at_index({**inputs, "z": poisoned(g.tensor_by_name("z"))}, 1)


def test_workspace_sizes_by_the_frontends_names():
    """get_workspace_size() and get_workspace_size_plan_at_index(i) (0 for a plan not built, as
    the frontend answers) size the caller's workspace of execute and execute_plan_at_index."""
    g = dg.Graph(name="split")
    x, w = g.tensor(name="x", dim=[3, 2500]), g.tensor(name="w", dim=[2500, 5])
    y = g.matmul(x, w).set_output(True).set_name("y")
    with pytest.raises(dg.ExecutionError, match="build"):
        g.get_workspace_size()
    g.build(workspace_limit=1 << 20)
    inputs = {"x": torch.randn(3, 2500), "w": torch.randn(2500, 5)}
    reference = g.reference(inputs)["y"]
    size = g.get_workspace_size()
    assert size == g.plan.workspace_size() > 0  # split-K partials
    with pytest.raises(dg.ExecutionError, match="bytes"):
        g.execute({**inputs, "y": poisoned(y)}, torch.empty(size - 1, dtype=torch.uint8))
    out = poisoned(y)
    g.execute({**inputs, "y": out}, torch.empty(size, dtype=torch.uint8))
    assert rel_err(out, reference) < 2e-5
    assert g.get_workspace_size_plan_at_index(1) == 0
    g.build_plan_at_index(1)
    size_at = g.get_workspace_size_plan_at_index(1)
    assert size_at > 0
    with pytest.raises(dg.ExecutionError, match="bytes"):
        g.execute_plan_at_index({**inputs, "y": poisoned(y)}, 1, workspace=torch.empty(size_at - 1, dtype=torch.uint8))
    out = poisoned(y)
    g.execute_plan_at_index({**inputs, "y": out}, 1, workspace=torch.empty(size_at, dtype=torch.uint8))
    assert rel_err(out, reference) < 2e-5
    # the frontend's positional order, (variant pack, workspace, index), runs the same plan
    out = poisoned(y)
    g.execute_plan_at_index({**inputs, "y": out}, torch.empty(size_at, dtype=torch.uint8), 1)
    assert rel_err(out, reference) < 2e-5
    with pytest.raises(dg.ExecutionError, match="build_plan_at_index"):
        g.execute_plan_at_index({**inputs, "y": poisoned(y)}, torch.empty(size_at, dtype=torch.uint8), 2)


@pytest.mark.gpu
def test_each_plan_runs_on_the_gpu():
    g = _declared(m=301, k=200, n=129)
    inputs = {"x": torch.randn(2, 301, 200, device="cuda"),
              "w": torch.randn(2, 129, 200, device="cuda").transpose(1, 2)}
    candidates = g.plans()[0].candidates
    assert len(candidates) > 1
    for index in range(min(len(candidates), 6)):
        g.build(plan=index)
        launch = next(launch for launch in g.plan.launches if launch.group.kind == "matmul")
        assert launch.config_text.startswith(candidates[index].config.text)
        check(g, inputs, device="cuda")
