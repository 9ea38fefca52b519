"""Tiny transformers models (random weights, 1-2 layers, hidden 32-64) through
`torch.compile(model, backend="dnngraph")` on CPU, run the way a user writes it: a fresh process
imports torch and transformers and names the backend, never importing dnngraph itself.

Inference and a training step per family, each judged against the same model in float64:
dnngraph's relative error is at most twice eager fp32's (plus a few fp32 ulps), for the output
and, in training, every parameter gradient. Each test prints the kernels per step and the aten
ops left to torch (benchmarks/model_coverage.py prints the table).
"""
import subprocess
import sys

import pytest

from model_results import cases, check, skip_unless_installed
from model_runs import ROOT, Run, environment, shared_runs_for
from model_zoo import TRANSFORMERS

# one worker process per group: startup (torch, transformers, dynamo) paid once per group, and
# the groups spread over pytest-xdist's workers
GROUPS = [("gpt2", "bert", "distilbert"), ("t5", "llama", "mistral"), ("qwen2", "gemma2", "phi"),
          ("vit", "clip", "whisper_encoder")]
RUNS = {family: Run(group) for group in GROUPS for family in group}
assert sorted(RUNS) == sorted(f.name for f in TRANSFORMERS), "every family in one group"

# (family, mode) -> why it fails today (strict: the mark goes once the cause is fixed)
KNOWN_FAILURES: dict = {}


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, request):
    return shared_runs_for(request, tmp_path_factory, test_model_matches_float64_as_closely_as_eager, RUNS)


@pytest.mark.parametrize("family, mode", cases(RUNS, KNOWN_FAILURES))
def test_model_matches_float64_as_closely_as_eager(shared_runs, family, mode):
    skip_unless_installed("transformers")
    check(shared_runs.results(RUNS[family])[f"{family}/{mode}"])


# bf16 on CPU: what Triton's interpreter does with narrow floats (its conversions round as torch's)
BF16_RUNS = {family: Run(("vit", "llama"), modes=("training",), dtype="bfloat16") for family in ("vit", "llama")}
BF16_FAILURES: dict = {}


@pytest.fixture(scope="session")
def bf16_runs(tmp_path_factory, request):
    return shared_runs_for(request, tmp_path_factory, test_bf16_training_matches_float64_as_closely_as_eager, BF16_RUNS)


@pytest.mark.parametrize("family, mode", cases(BF16_RUNS, BF16_FAILURES))
def test_bf16_training_matches_float64_as_closely_as_eager(bf16_runs, family, mode):
    """A bf16 training step on CPU, judged by eager bf16's error (twice it, plus 1e-2)."""
    skip_unless_installed("transformers")
    check(bf16_runs.results(BF16_RUNS[family])[f"{family}/{mode}"])


NAME_ONLY = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
x = torch.randn(3, 8)
compiled = torch.compile(model, backend="dnngraph")
with torch.no_grad():
    error = (compiled(x) - model(x)).abs().max().item()
assert error < 1e-5, error
print("ran")
"""


def test_backend_name_alone_runs_kernels():
    """A fresh process that never imports dnngraph: torch loads it through the backend's name,
    after torch imported Triton (on CPU, Triton's interpreter must still run every kernel)."""
    done = subprocess.run([sys.executable, "-c", NAME_ONLY], env=environment(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
