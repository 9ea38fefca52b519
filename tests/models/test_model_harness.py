"""The harness of tests/models/ itself: a library that is installed but breaks at import makes a
skip with its reason (not an error), the rule catches a value further from float64 than eager's
(NaN and a wrong shape too), a worker that dies leaves each unreached case a failure, and a group
shared by concurrent askers runs once."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import model_runs
from model_results import check, misses
from model_runs import HERE, RESULT_PREFIX, ROOT, Run, SharedRuns, environment
from model_worker import ZERO_GRADIENT_FRACTION, gradient_floors, relative_error

BROKEN = "raise RuntimeError('operator torchvision::nms does not exist')\n"


def test_a_library_broken_at_import_is_a_skip_with_its_reason(tmp_path):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(BROKEN)
    env = environment()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    command = Run(("torchvision_resnet18",), modes=("inference",)).command()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line[len(RESULT_PREFIX):]) for line in done.stdout.splitlines()
             if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, done.stderr[-2000:]
    assert "RuntimeError" in lines[0]["unavailable"] and "nms" in lines[0]["unavailable"]
    with pytest.raises(pytest.skip.Exception, match="torchvision cannot be imported: RuntimeError"):
        check(lines[0])


def _result(*errors, dtype="torch.float32"):
    return {"family": "f", "mode": "training", "dtype": dtype, "judged": [len(errors)] * 3,
            "coverage": {"forward": {"kernels": 3, "torch_ops": {}}},
            "errors": [{"name": f"v{i}", "ours": ours, "eager": eager} for i, (ours, eager) in enumerate(errors)]}


def test_the_rule_flags_what_is_further_than_twice_eager():
    assert misses(_result((2e-7, 1e-7), (0.0, 0.0), (0.9e-6, 0.0))) == []  # within 2x, exact, the ulp floor
    assert [m[0] for m in misses(_result((1.1e-6, 0.0)))] == ["v0"]  # past the floor
    assert [m[0] for m in misses(_result((3.5e-6, 1e-6), (2e-7, 1e-7)))] == ["v0"]
    assert [m[0] for m in misses(_result((float("inf"), 1e-7), (float("nan"), 1e-7)))] == ["v0", "v1"]
    assert misses(_result((2.5e-2, 1e-2), dtype="torch.bfloat16")) == []
    with pytest.raises(AssertionError, match="further from float64 than eager: v0"):
        check(_result((3.5e-6, 1e-6)))


def test_relative_error_of_nan_or_another_shape_is_infinite():
    import torch

    truth = torch.randn(5, 3, dtype=torch.float64)
    assert relative_error(truth.float(), truth) < 1e-7
    assert relative_error(torch.full((5, 3), float("nan")), truth) == float("inf")
    assert relative_error(truth.float().t(), truth) == float("inf")
    assert relative_error(torch.full((2,), 1e-9), torch.zeros(2, dtype=torch.float64)) < 1e-8  # absolute at 0


def test_cases_a_worker_never_reached_are_failures():
    run = Run(("a", "b"), modes=("inference",))
    reached = RESULT_PREFIX + json.dumps({"family": "a", "mode": "inference", "ok": 1})
    results = model_runs._parse(run, f"noise\n{reached}\n", "worker timed out after 1 s")
    assert results["a/inference"]["ok"] == 1
    assert results["b/inference"]["failure"]["cause"] == "worker timed out after 1 s"
    with pytest.raises(AssertionError, match="WorkerDied: worker timed out"):
        check(dict(results["b/inference"], dtype="torch.float32"))


def test_a_group_asked_for_at_once_runs_once(tmp_path, monkeypatch):
    runs = [Run(("a",)), Run(("b",))]
    started, gate = [], threading.Event()

    def fake_execute(run):
        started.append(run.families)
        gate.wait(timeout=30)  # hold the lock until every asker has asked
        return {f"{run.families[0]}/inference": {"from": run.families[0]}}

    monkeypatch.setattr(model_runs, "execute", fake_execute)
    shared = SharedRuns(str(tmp_path), runs)
    answers = []
    askers = [threading.Thread(target=lambda: answers.append(shared.results(runs[0]))) for _ in range(3)]
    for asker in askers:
        asker.start()
    while len(started) < 2:  # one asker runs "a", the next finds it held and runs "b" meanwhile
        threading.Event().wait(0.01)
    gate.set()
    for asker in askers:
        asker.join(timeout=30)
    assert sorted(started) == [("a",), ("b",)]
    assert answers == [{"a/inference": {"from": "a"}}] * 3
    assert SharedRuns(str(tmp_path), runs).results(runs[1]) == {"b/inference": {"from": "b"}}  # no rerun
    assert sorted(started) == [("a",), ("b",)]


def test_the_worker_imports_no_dnngraph_before_the_compile():
    """The process a user runs: the worker and the zoo never import dnngraph themselves."""
    for name in ("model_worker.py", "model_zoo.py"):
        with open(os.path.join(HERE, name)) as f:
            source = f.read()
        imports = [line for line in source.splitlines() if line.strip().startswith(("import ", "from "))
                   and "dnngraph" in line]
        assert imports == (["        import dnngraph  # noqa: F401"] if name == "model_worker.py" else []), imports
    assert sys.modules.get("model_worker") is not None


def test_a_gradient_zero_in_exact_math_is_judged_against_the_steps_scale():
    """An attention key bias's gradient is zero in exact math (softmax ignores a constant added to
    a whole row): float64 leaves 1e-16 of noise, fp32 1e-6. Relative to its own norm that noise is
    an error of 1e9 for every implementation; against the step's largest gradient, a few ulps."""
    truth = [("output", torch.ones(3, dtype=torch.float64)), ("grad w", torch.full((4,), 50.0, dtype=torch.float64)),
             ("grad small", torch.full((4,), 1e-3, dtype=torch.float64)),
             ("grad k_bias", torch.full((4,), 1e-16, dtype=torch.float64))]
    floors = gradient_floors(truth)
    assert floors == [0.0, 0.0, 0.0, 100.0] and 1e-16 * 2 < ZERO_GRADIENT_FRACTION * 100.0
    noise = torch.full((4,), 3e-6)
    assert relative_error(noise, truth[3][1]) > 1e9
    assert relative_error(noise, truth[3][1], floors[3]) < 1e-7
    # a small gradient that is not zero keeps its own scale: an error there is still one
    assert relative_error(torch.full((4,), 1.1e-3), truth[2][1], floors[2]) == pytest.approx(0.1)
    # a zero gradient that is not noise (a defect writing a real value) fails against the floor too
    assert relative_error(torch.full((4,), 0.5), truth[3][1], floors[3]) > 1e-3
