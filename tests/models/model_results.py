"""The judgement of tests/models/: the rule a (family, mode) result passes by, its pytest
params and the coverage line each test prints. (model_runs.py runs the worker processes.)"""
from __future__ import annotations

import importlib.util

import pytest

import model_zoo

# beyond `FACTOR` times eager's distance from float64: the rounding of a value computed
# exactly in both (a few units in the last place of the dtype)
FACTOR = 2.0
FLOOR = {"torch.float32": 1e-6, "torch.bfloat16": 1e-2}


def cases(runs: dict, known_failures: dict) -> list:
    """pytest params (family, mode) of every family in `runs`, in its Run's modes; a (family,
    mode) in `known_failures` is a strict expected failure with its cause, so it flips once fixed."""
    params = []
    for family, run in runs.items():
        for mode in run.modes:
            why = known_failures.get((family, mode))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            params.append(pytest.param(family, mode, id=f"{family}-{mode}", marks=marks))
    return params


def selected_runs(session_items, test, runs: dict) -> list:
    """The distinct Runs the selected items of the test function `test` need (a -k selection
    runs only those), where their libraries are installed."""
    needed = [runs[item.callspec.params["family"]] for item in session_items
              if getattr(item, "originalname", None) == test.__name__ and item.callspec.params.get("family") in runs]
    return [run for run in dict.fromkeys(needed) if all(_installed(name) for name in run.families)]


def _installed(family: str) -> bool:
    library = next(f.library for f in model_zoo.ALL if f.name == family)
    return importlib.util.find_spec(library) is not None


def skip_unless_installed(library: str) -> None:
    """Skip at once where the library is not installed (the worker reports one that is but fails
    to import: a broken torchvision raises RuntimeError, not ImportError)."""
    if importlib.util.find_spec(library) is None:  # no process started for it
        pytest.skip(f"{library} is not installed")


def misses(result: dict) -> list:
    """The judged values where dnngraph is further from float64 than FACTOR times eager (plus
    FLOOR): (name, dnngraph's error, eager's error)."""
    floor = FLOOR[result["dtype"]]
    found = []
    for entry in result["errors"]:
        ours, eager = entry["ours"], entry["eager"]
        if not ours <= FACTOR * eager + floor:  # an infinite error (NaN, another shape) too
            found.append((entry["name"], ours, eager))
    return found


def coverage_line(result: dict) -> str:
    """Kernels per step and the aten ops left to torch, one line (printed by each test)."""
    dtype = result.get("dtype", "torch.float32").removeprefix("torch.")
    label = f"{result['family']} {result['mode']}" + ("" if dtype == "float32" else f" {dtype}")
    return f"{label}: {_coverage_text(result)}"


def _coverage_text(result: dict) -> str:
    if "unavailable" in result:
        return f"not run ({result['unavailable'][:120]})"
    if "failure" in result:
        cause = result["failure"]["cause"].splitlines()[0][:160] if result["failure"]["cause"] else ""
        return f"failed ({cause})"
    kernels = " + ".join(f"{phase} {c['kernels']}" for phase, c in result["coverage"].items())
    return f"kernels {kernels}; left to torch: {ops_left_text(result['coverage']) or 'none'}"


def ops_left_text(coverage: dict) -> str:
    """The aten ops a step left to torch, forward and backward together: "embedding x2, ..."."""
    left = {}
    for phase in coverage.values():
        for op, count in phase["torch_ops"].items():
            left[op] = left.get(op, 0) + count
    return ", ".join(f"{op.removeprefix('aten.').removesuffix('.default')} x{count}"
                     for op, count in sorted(left.items()))


def check(result: dict) -> None:
    """Assert one (family, mode) result: it ran, and every judged value is as close to float64
    as eager's (FACTOR, FLOOR)."""
    print(coverage_line(result))
    if "unavailable" in result:
        pytest.skip(result["unavailable"])
    failure = result.get("failure")
    assert failure is None, f"{failure['type']}: {failure['cause']}\n  at {failure['frames']}"
    judged = result["judged"]
    assert judged[0] == judged[1] == judged[2], f"float64, eager and dnngraph judged {judged} values"
    found = misses(result)
    assert not found, "further from float64 than eager: " + "; ".join(
        f"{name}: dnngraph {ours}, eager {eager}" for name, ours, eager in found)
