"""Multi-kernel plans of every family that keeps values between kernels run on poisoned
workspaces (DNNGRAPH_POISON_WORKSPACE=each, runtime/launch.py: poisoned when made and before
every execute): workspace contents are undefined, so a kernel that reads bytes no earlier launch of
the same execute wrote (split-K partials, a combine reading past them, padding of an intermediate,
scratch assumed zero, what an earlier execute left) gives NaN here and fails its test's reference
check. The variable is read once at import, so the cases run in a pytest subprocess; the plugin
tests/poison_plugin.py clears the plan cache per case and fails a case that made no workspace."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)

# One representative multi-kernel plan per family, each checked against g.reference by its own
# test; all of them make a workspace (the plugin checks). Pooling and MoE plans keep nothing
# between kernels (no workspace), so they have no case here.
CASES = (
    "tests/ops/test_matmul.py::test_split_k_is_deterministic",  # split-K partials + combine
    "tests/ops/test_conv.py::test_wgrad_folded_stem_matches_autograd_and_is_bitwise_reproducible",
    "tests/ops/test_depthwise.py::test_wgrad_is_bitwise_reproducible",  # depthwise wgrad splits
    "tests/fusion/test_column_split.py::test_combine_folds_many_splits",  # column split combine
    "tests/ops/test_norms.py::test_fused_norm_backward_multi_axis",  # norm backward partial sums
    "tests/ops/test_softmax.py::test_forward_and_backward_every_mode[split-False]",  # chunked rows
    "tests/ops/test_sdpa.py::test_backward_forced_tiles_walk_every_run",  # attention backward
    "tests/ops/test_rnn.py::test_backward_op_matches_reference_with_empty_sequences",
    "tests/ops/test_ctc.py::test_gradient_blank_concatenated_strided[0]",
)


def poisoned_environment() -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["DNNGRAPH_POISON_WORKSPACE"] = "each"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    return env


def test_multi_kernel_plans_of_every_family_run_on_poisoned_workspaces():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-p", "poison_plugin", *CASES]
    done = subprocess.run(command, cwd=ROOT, env=poisoned_environment(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(CASES)} passed" in done.stdout, done.stdout[-2000:]
