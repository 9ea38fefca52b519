"""Runs model families through torch.compile(backend="dnngraph") in a process of its own, as a
user writes it: torch and the model library are imported, the backend is named, dnngraph is
never imported before the compile (torch loads it through the name). One process runs many
families, one line of JSON per (family, mode) on stdout, each prefixed with RESULT_PREFIX:

    python tests/models/model_worker.py --families gpt2,bert --modes inference,training \
        [--size tiny] [--device cpu] [--dtype float32]

A result holds, per judged value (the output, then every parameter gradient and floating buffer
of a training step), the relative norm error from the float64 model of dnngraph's run and of
eager torch's in the same dtype; the kernels dnngraph launched per step (forward and backward)
and the aten ops left to torch, from the backend's compile reports; or the error that stopped it.
"""
from __future__ import annotations

import argparse
import collections
import copy
import importlib
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_zoo  # noqa: E402

RESULT_PREFIX = "MODEL-RESULT "
SEED = 1234
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# A gradient whose float64 norm is below this fraction of the step's largest is zero in exact math
# (float64 leaves ~1e-15 of rounding: an attention's key bias, whose addition to a whole row softmax
# ignores; a query no output reaches). Its fp32 value is rounding noise in every implementation,
# so it is judged by its distance from zero against the step's largest gradient (what a few fp32
# ulps of the step are), not against its own norm of float64 noise (errors of 1e9 for eager too).
ZERO_GRADIENT_FRACTION = 1e-10


def relative_error(value: torch.Tensor, truth: torch.Tensor, floor: float = 0.0) -> float:
    """||value - truth|| / max(||truth||, floor) in float64 (an all-zero truth and floor: the
    absolute norm)."""
    value, truth = value.detach().double().cpu(), truth.detach().double().cpu()
    if value.shape != truth.shape:
        return math.inf
    scale = max(truth.norm().item(), floor) or 1.0
    error = (value - truth).norm().item() / scale
    return error if math.isfinite(error) else math.inf


def gradient_floors(truth: list) -> list:
    """Per judged value, the floor of its relative error's scale: the step's largest float64
    gradient norm for a gradient zero in exact math (ZERO_GRADIENT_FRACTION), else 0."""
    norms = [value.detach().double().norm().item() if name.startswith("grad ") else None for name, value in truth]
    largest = max((n for n in norms if n is not None), default=0.0)
    return [largest if n is not None and n < ZERO_GRADIENT_FRACTION * largest else 0.0 for n in norms]


def _cast_inputs(inputs: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _judged(model, output, grad_output) -> list:
    """(name, tensor) of what a step is judged by: the output, then (after a backward) every
    parameter's gradient and every floating buffer (batch-norm running statistics)."""
    values = [("output", output.detach().clone())]
    if grad_output is None:
        return values
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            # no gradient is a zero one (a parameter no path reaches): the same in exact math
            grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
            values.append((f"grad {name}", grad.detach().clone()))
    values += [(f"buffer {name}", b.clone()) for name, b in model.named_buffers() if b.is_floating_point()]
    return values


def _step(model, forward, inputs: dict, output, grad_output) -> list:
    """One step: inference (no grad) when grad_output is None, else forward and backward."""
    if grad_output is None:
        with torch.no_grad():
            return _judged(model, output(forward(**inputs)), None)
    result = output(forward(**inputs))
    result.backward(grad_output.to(result.dtype))
    return _judged(model, result, grad_output)


class _Reports:
    """The backend's compile reports made since `mark()`: dnngraph is imported only once torch
    has loaded it through the backend's name (or the compile failed first)."""

    def __init__(self):
        self.start = 0

    @staticmethod
    def _all() -> list:
        module = sys.modules.get("dnngraph.torch_backend")
        return list(module.REPORTS) if module is not None else []

    def mark(self):
        self.start = len(self._all())

    def since(self) -> list:
        return self._all()[self.start:]


def _coverage(reports: list) -> dict:
    """Kernel launches per call and aten ops left to torch (by name) of these compile reports."""
    kept = collections.Counter(target for report in reports for target, _ in report.torch_ops)
    return {"kernels": sum(report.kernels() for report in reports), "graphs": sum(r.graphs for r in reports),
            "dnngraph_ops": sum(r.dnngraph_ops for r in reports), "torch_ops": dict(sorted(kept.items()))}


def _compiled_step(model, inputs, output, grad_output) -> tuple:
    """(judged values, coverage) of one step through the backend; the forward's reports and the
    backward's (AOTAutograd compiles the backward at its first call) counted apart."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dnngraph")  # as a user writes it
    reports = _Reports()
    reports.mark()
    if grad_output is None:
        with torch.no_grad():
            values = _judged(model, output(compiled(**inputs)), None)
        return values, {"forward": _coverage(reports.since())}
    result = output(compiled(**inputs))
    forward = reports.since()
    result.backward(grad_output.to(result.dtype))
    backward = reports.since()[len(forward):]
    return _judged(model, result, grad_output), {"forward": _coverage(forward), "backward": _coverage(backward)}


def _failure(error: BaseException) -> dict:
    """The error, and the innermost dnngraph frames that raised it (where a converter failed)."""
    frames = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(error.__traceback__)
              if "dnngraph" in f.filename and "tests" not in f.filename]
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return {"type": type(error).__name__, "cause": f"{type(cause).__name__}: {cause}"[:3000],
            "message": str(error)[:3000], "frames": frames[-4:]}


def run_case(family, mode: str, size: str, device: str, dtype) -> dict:
    """One family in one mode: errors of dnngraph and of eager against float64, and coverage."""
    started = time.perf_counter()
    result = {"family": family.name, "mode": mode, "size": size, "device": device, "dtype": str(dtype)}
    try:
        importlib.import_module(family.library)
    except Exception as error:  # noqa: BLE001  (a broken install raises RuntimeError, not ImportError)
        result["unavailable"] = f"{family.library} cannot be imported: {type(error).__name__}: {error}"[:500]
        return result
    try:
        torch.manual_seed(SEED)
        model, inputs, output = family.build(size, device)
        model.train(mode == "training")
        exact = copy.deepcopy(model).double()
        eager, ours = copy.deepcopy(model).to(dtype), copy.deepcopy(model).to(dtype)
        grad_output = None
        if mode == "training":
            with torch.no_grad():
                shape = output(exact(**_cast_inputs(inputs, torch.float64))).shape
            grad_output = torch.randn(shape, dtype=torch.float64, device=device)
        truth = _step(exact, exact, _cast_inputs(inputs, torch.float64), output, grad_output)
        theirs = _step(eager, eager, _cast_inputs(inputs, dtype), output, grad_output)
        mine, coverage = _compiled_step(ours, _cast_inputs(inputs, dtype), output, grad_output)
        result["coverage"] = coverage
        floors = gradient_floors(truth)
        result["errors"] = [{"name": name, "ours": relative_error(value, want, floor),
                             "eager": relative_error(other, want, floor)}
                            for (name, want), (_, other), (_, value), floor in zip(truth, theirs, mine, floors)]
        result["judged"] = [len(truth), len(theirs), len(mine)]
    except Exception as error:  # noqa: BLE001  (every failure is the case's result, reported per model)
        result["failure"] = _failure(error)
    result["seconds"] = round(time.perf_counter() - started, 2)
    loaded = sys.modules.get("dnngraph")
    result["dnngraph"] = None if loaded is None else os.path.dirname(os.path.dirname(loaded.__file__))
    return result


def _families(names: list) -> list:
    table = {f.name: f for f in model_zoo.ALL}
    return [table[name] for name in names]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", required=True, help="comma-separated names from model_zoo.ALL")
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--size", default="tiny", choices=model_zoo.SIZES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--import-dnngraph-first", action="store_true",
                        help="import dnngraph before compiling (not what a user writes: for comparison)")
    args = parser.parse_args()
    if args.import_dnngraph_first:
        import dnngraph  # noqa: F401
    for family in _families(args.families.split(",")):
        for mode in args.modes.split(","):
            result = run_case(family, mode, args.size, args.device, DTYPES[args.dtype])
            print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
