"""On a GPU machine, with nothing set: one built graph runs CUDA tensors on the GPU and CPU
tensors through the interpreter process, in one process, from several threads at once (a CUDA
build compiling while CPU kernels are interpreted included)."""
import os
import threading

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import interpreter as runtime
from dnngraph.runtime import interpreter_client
from helpers import check, poisoned, rel_err

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(17)
TOLERANCE = 1e-4


def _randn(*dims):
    return torch.randn(*dims, generator=GEN)


def _block(rows=7):
    """Three or more kernels: matmul + bias + gelu, layernorm, matmul, softmax; w column-major."""
    x_t, w_t, b_t, v_t = _randn(rows, 13), _randn(11, 13).t(), _randn(1, 11), _randn(11, 5)
    g = dg.Graph(name=f"block{rows}")
    x, w, b, v = (g.tensor_like(t, n) for t, n in ((x_t, "x"), (w_t, "w"), (b_t, "b"), (v_t, "v")))
    scale, bias = g.tensor(name="scale", dim=[1, 11]), g.tensor(name="bias", dim=[1, 11])
    normed, _, _ = g.layernorm(g.gelu(g.add(g.matmul(x, w), b)), scale, bias)
    normed.set_output(True)
    g.softmax(g.matmul(normed, v), axis=1).set_output(True)
    return g, {"x": x_t, "w": w_t, "b": b_t, "v": v_t, "scale": _randn(1, 11), "bias": _randn(1, 11)}


def _on(inputs: dict, device) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}  # .to keeps the strides


@pytest.fixture(autouse=True)
def _not_interpreting():
    if runtime.interpreting():
        pytest.skip("TRITON_INTERPRET is set: this process interprets every tensor")
    assert "TRITON_INTERPRET" not in os.environ and runtime.cpu_kernels_in_worker()


def test_one_graph_serves_cuda_and_cpu_tensors():
    g, inputs = _block()
    g.build()
    for device in ("cuda", "cpu", "cuda", "cpu"):
        check(g, _on(inputs, device), device=device, tolerance=TOLERANCE)
    assert interpreter_client._process is not None and interpreter_client._process.alive
    with pytest.raises(dg.ExecutionError, match="bind every tensor on one device"):
        g.execute({**_on(inputs, "cuda"), "v": inputs["v"], **{t.name: poisoned(t, "cuda") for t in g.outputs()}})


def test_as_function_gradients_on_both_devices():
    g, inputs = _block()
    fn = g.as_function()
    grads = {}
    for device in ("cpu", "cuda"):
        args = [inputs[t.name].detach().clone().to(device).requires_grad_() for t in fn.inputs]
        y, z = fn(*args)
        (y.square().sum() + z.square().sum()).backward()
        grads[device] = [a.grad.cpu() for a in args]
    for cpu_grad, cuda_grad in zip(grads["cpu"], grads["cuda"]):
        assert rel_err(cpu_grad, cuda_grad.double()) < TOLERANCE


def test_cpu_executes_while_other_threads_compile_and_run_on_the_gpu():
    shared, inputs = _block()
    shared.build()
    refs = shared.reference(inputs)
    failures = []

    def cpu_work():
        for _ in range(2):
            outputs = {t.name: poisoned(t) for t in shared.outputs()}
            shared.execute({**inputs, **outputs})
            for name, out in outputs.items():
                assert rel_err(out, refs[name]) < TOLERANCE, name

    def cuda_work(rows):
        g, own = _block(rows)  # a new graph: its kernels compile now
        check(g, _on(own, "cuda"), device="cuda", tolerance=TOLERANCE)
        check(shared, _on(inputs, "cuda"), device="cuda", tolerance=TOLERANCE)

    def guarded(work, *args):
        try:
            work(*args)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(cpu_work,)) for _ in range(2)]
    threads += [threading.Thread(target=guarded, args=(cuda_work, rows)) for rows in (19, 33)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
