"""`torch.compile(model, backend="dnngraph")` as the documentation writes it, in fresh processes:
dnngraph is loaded by torch through its entry point (never imported by the program), after
whatever the program imported first. Triton's jitted helpers decorated before dnngraph chose the
interpreter must still run interpreted (CPU-only machines)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A block whose kernels call triton.language's own jitted helpers (tl.sum and tl.max in the
# norm, softmax and reduction kernels) and dnngraph's device library (gelu): forward and backward
# against eager, and the report says the ops ran in dnngraph graphs.
PROGRAM = """
import sys
{first}
assert ({first!r} == "import dnngraph") == ("dnngraph" in sys.modules), "the import order under test"
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.LayerNorm(12), torch.nn.GELU(),
                            torch.nn.Linear(12, 5), torch.nn.Softmax(-1))
compiled = torch.compile(model, backend="dnngraph", dynamic=False)
x = torch.randn(3, 8)
leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
got, want = compiled(leaf), model(eager_leaf)
grad = torch.randn_like(want)
got.backward(grad)
want.backward(grad)
assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
assert torch.allclose(leaf.grad, eager_leaf.grad, atol=1e-5, rtol=1e-4), (leaf.grad - eager_leaf.grad).abs().max()
from dnngraph import torch_backend
forward, backward = torch_backend.REPORTS
assert forward.torch_ops == () and backward.torch_ops == (), (forward.torch_ops, backward.torch_ops)
print("ok", forward.dnngraph_ops, backward.dnngraph_ops)
"""


def _run_fresh(first: str) -> subprocess.CompletedProcess:
    """PROGRAM in a fresh interpreter with this checkout's dnngraph on the path (the entry point
    names the module; the path decides which checkout it is)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as a user's shell has it: dnngraph decides
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    code = textwrap.dedent(PROGRAM).format(first=first)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines interpret in process")
@pytest.mark.parametrize("first", ["import torch", "import triton", "import torch._inductor", "import dnngraph"])
def test_the_entry_point_runs_in_any_import_order(first):
    done = _run_fresh(first)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout


def _double(x):
    return x * 2


def _doubling_kernel(x_pointer, y_pointer, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = _DOUBLE(tl.load(x_pointer + offsets, mask=mask)) + tl.sum(offsets * 0)  # tl.sum: triton's own helper
    tl.store(y_pointer + offsets, y, mask=mask)


_DOUBLE = JITFunction(_double)  # compiled-mode, whatever TRITON_INTERPRET says, as an early import makes it


def test_a_jitted_helper_decorated_before_the_interpreter_was_chosen_runs_interpreted():
    """A compiled-mode JITFunction called from an interpreted kernel runs interpreted; outside a
    kernel it still refuses, as Triton's do."""
    from dnngraph.runtime.interpreter import run_interpreted

    x, y = torch.randn(37), torch.full((37,), float("nan"))
    run_interpreted(JITFunction(_doubling_kernel), (3,), [x, y, 37, 16])
    assert torch.equal(y, x * 2)
    with pytest.raises(RuntimeError, match="outside of the scope of a kernel"):
        _DOUBLE(x)
