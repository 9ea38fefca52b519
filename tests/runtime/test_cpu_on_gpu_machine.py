"""CPU tensors in a process that compiles for the GPU: their kernels run in the interpreter process
(dnngraph/runtime/interpreter_client.py). Here, on any machine, force_interpreter_worker() sends
them there from this (interpreting) process, and one test runs a process started as a GPU
machine's would be (DNNGRAPH_INTERPRETER_WORKER=1: TRITON_INTERPRET never set, kernels compiled
as JITFunctions). Values against the float64 reference, poisoned outputs, odd sizes, strides;
review attacks that held up: every data type, bools and misaligned views, a process killed
again and again.

On a GPU machine, with nothing set (TestOnAGpuMachine, marked gpu): one built graph runs CUDA
tensors on the GPU and CPU tensors through the interpreter process, in one process, from several
threads at once (a CUDA build compiling while CPU kernels are interpreted included)."""
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import interpreter as runtime
from dnngraph.runtime.kernel_files import load_kernel
from dnngraph.runtime import interpreter_client
from dnngraph.runtime.launch import KernelLaunch
from helpers import check, poisoned, rel_err
from test_plan_cache import _relu

GEN = torch.Generator().manual_seed(13)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _through_the_interpreter_process(request, monkeypatch):
    """Every CPU launch goes to the process; interpreting here would fail the test. Not for the
    GPU tests (marked gpu): they run as a GPU machine's process would, with nothing forced."""
    if request.node.get_closest_marker("gpu"):
        yield
        return

    def here(self, tensors):
        raise AssertionError("a kernel ran through the interpreter in the test process")

    monkeypatch.setattr(KernelLaunch, "interpret", here)
    runtime.force_interpreter_worker(True)
    yield
    runtime.force_interpreter_worker(False)


def _randn(*dims):
    return torch.randn(*dims, generator=GEN)


def _mlp_block():
    """Four kernels: a matmul with a bias-gelu epilogue reading a transposed (column-major)
    weight, a layernorm, a second matmul and a row softmax, on odd sizes."""
    x_t, w_t = _randn(7, 13), _randn(11, 13).t()  # w: [13, 11], strides [1, 13]
    b_t, v_t = _randn(1, 11), _randn(11, 5)
    g = dg.Graph(name="mlp_block")
    x, w, b, v = (g.tensor_like(t, n) for t, n in ((x_t, "x"), (w_t, "w"), (b_t, "b"), (v_t, "v")))
    scale, bias = g.tensor(name="scale", dim=[1, 11]), g.tensor(name="bias", dim=[1, 11])
    h = g.gelu(g.add(g.matmul(x, w), b))
    normed, _, _ = g.layernorm(h, scale, bias)
    normed.set_output(True)
    g.softmax(g.matmul(normed, v), axis=1).set_output(True)
    inputs = {"x": x_t, "w": w_t, "b": b_t, "v": v_t, "scale": _randn(1, 11), "bias": _randn(1, 11)}
    return g, inputs


def test_a_multi_kernel_graph_with_strided_inputs():
    g, inputs = _mlp_block()
    g.build()
    assert len(g.plan.launches) >= 3
    check(g, inputs, tolerance=1e-5)
    check(g, {k: _randn(*v.shape).as_strided(v.shape, v.stride()) if v.stride() == v.contiguous().stride()
              else _randn(*reversed(v.shape)).t() for k, v in inputs.items()}, tolerance=1e-5)


def test_views_of_one_buffer_keep_their_aliasing_and_the_gaps_between_them():
    """Inputs and outputs carved out of one user buffer (a transposed view among them), a
    concatenate written in place by its producers: the process sees the same aliasing, and only
    the outputs' own elements are written back (the poisoned gaps stay)."""
    g = dg.Graph(name="carved")
    arena = torch.full((400,), float("nan"))
    x_t = arena[3:3 + 35].view(5, 7).copy_(_randn(5, 7))
    z_t = arena[50:50 + 21].view(7, 3).t().copy_(_randn(3, 7))  # [3, 7], strides [1, 3]
    x, z = g.tensor_like(x_t, "x"), g.tensor_like(z_t, "z")
    both = g.concatenate([g.relu(x), g.exp(g.neg(z)), g.sigmoid(x)], axis=0)
    both.set_output(True)
    g.reduction(g.slice(both, [slice(1, 12, 2), slice(None)]), "sum", [1]).set_output(True)
    g.build()
    out = arena[101:101 + 91].view(13, 7)
    total = arena[300:306].view(6, 1)
    g.execute({x: x_t, z: z_t, both: out, g.outputs()[1]: total})
    ref = g.reference({"x": x_t, "z": z_t})
    assert rel_err(out, ref[both.name]) < 1e-6
    assert rel_err(total, ref[g.outputs()[1].name]) < 1e-6
    untouched = torch.ones(400, dtype=torch.bool)
    for start, count in ((3, 35), (50, 21), (101, 91), (300, 6)):
        untouched[start:start + count] = False
    assert torch.isnan(arena[untouched]).all()


def test_bfloat16_attention_and_odd_sizes():
    """The bf16 dot widening happens over there too (it interprets)."""
    q_t, k_t, v_t = (_randn(1, 2, 9, 16).bfloat16() for _ in range(3))
    g = dg.Graph(name="attention", io_data_type=dg.bfloat16)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    g.matmul(o, g.transpose(v, [0, 1, 3, 2])).set_output(True)
    check(g, {"q": q_t, "k": k_t, "v": v_t}, torch.bfloat16)


def test_as_function_forward_and_backward():
    g, inputs = _mlp_block()
    fn = g.as_function()
    args = [inputs[t.name].clone().requires_grad_() for t in fn.inputs]
    outs = fn(*args)
    leaves = {n: v.double().requires_grad_() for n, v in inputs.items()}
    refs = g.reference(leaves)
    grads_out = [_randn(*o.shape) for o in outs]
    for out, tensor in zip(outs, fn.outputs):
        assert out.device.type == "cpu" and rel_err(out, refs[tensor.name]) < 1e-5
    torch.autograd.backward(list(outs), grads_out)
    wanted = [leaves[t.name] for t in fn.inputs]
    ref_grads = torch.autograd.grad([refs[t.name] for t in fn.outputs], wanted, [gy.double() for gy in grads_out])
    for arg, ref, tensor in zip(args, ref_grads, fn.inputs):
        assert rel_err(arg.grad, ref) < 1e-5, tensor.name


def test_mixed_devices_raise_naming_the_tensors_and_write_nothing():
    g, inputs = _mlp_block()
    g.build()
    outputs = {t.name: poisoned(t) for t in g.outputs()}
    bindings = {**inputs, **outputs, "v": torch.empty(11, 5, device="meta")}
    with pytest.raises(dg.ExecutionError, match=r"'v' is on meta and 'x' on cpu"):
        g.execute(bindings)
    assert all(torch.isnan(t).all() for t in outputs.values())
    fn = g.as_function()
    with pytest.raises(dg.ExecutionError, match="'v' is on meta"):
        fn(*[bindings[t.name] for t in fn.inputs])


def test_a_failing_kernel_writes_nothing_and_a_dead_process_is_replaced(tmp_path, monkeypatch):
    """A kernel that stores, then fails: the caller's tensor keeps its values (the store went to
    the arena only). The process survives it; killed, the next run starts another."""
    source = textwrap.dedent('''\
        import triton
        import triton.language as tl


        @triton.jit
        def stores_then_fails(out_ptr):
            tl.store(out_ptr + tl.arange(0, 4), tl.full([4], 1.0, tl.float32))
            tl.static_assert(False, "made to fail")
        ''')
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    kernel, path = load_kernel(source, "stores_then_fails")

    class Group:
        inputs, outputs = [], []

    class Launch:
        source_path, grid, template, slots, group, alternative = path, (1, 1, 1), (None,), ((0, 7),), Group, None

    Launch.kernel = kernel

    out = torch.full((4,), float("nan"))
    with pytest.raises(dg.ExecutionError, match="made to fail.*no output was written"):
        interpreter_client.run_in_interpreter_process([Launch], {7: out})
    assert torch.isnan(out).all()
    g, inputs = _mlp_block()
    check(g, inputs, tolerance=1e-5)  # the same process serves the next run
    first = interpreter_client._process.process
    first.kill()
    first.wait()
    check(g, inputs, tolerance=1e-5)
    assert interpreter_client._process.process is not first


def test_concurrent_executes_of_one_graph():
    """Threads executing one built graph on their own inputs (shared workspace, one process):
    each result is its own input's."""
    g, inputs = _mlp_block()
    g.build()
    sets = [{k: _randn(*v.shape).as_strided(v.shape, v.stride()) if v.is_contiguous() else _randn(*reversed(v.shape)).t()
             for k, v in inputs.items()} for _ in range(4)]
    refs = [g.reference(s) for s in sets]
    failures = []

    def work(thread: int):
        try:
            for step in range(3):
                index = (thread + step) % len(sets)
                outputs = {t.name: poisoned(t) for t in g.outputs()}
                g.execute({**sets[index], **outputs})
                for name, out in outputs.items():
                    assert rel_err(out, refs[index][name]) < 1e-5, (thread, step, name)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


SCRIPT = '''
import os, torch
import dnngraph as dg
from dnngraph.runtime import interpreter as runtime
from dnngraph.runtime.kernel_files import load_kernel
from triton.runtime.jit import JITFunction

assert "TRITON_INTERPRET" not in os.environ and not runtime.interpreting()
gen = torch.Generator().manual_seed(3)
x_t, w_t, b_t = torch.randn(6, 9, generator=gen), torch.randn(5, 9, generator=gen).t(), torch.randn(1, 5, generator=gen)
g = dg.Graph(name="gpu_like")
x, w, b = g.tensor_like(x_t, "x"), g.tensor_like(w_t, "w"), g.tensor_like(b_t, "b")
h = g.tanh(g.add(g.matmul(x, w), b))
g.softmax(h, axis=1).set_output(True)
g.reduction(h, "sum", [0]).set_output(True)
g.build()
assert len(g.plan.launches) >= 2 and all(type(l.kernel) is JITFunction for l in g.plan.launches)
outs = {t.name: torch.full(t.dim, float("nan")) for t in g.outputs()}
g.execute({x: x_t, w: w_t, b: b_t, **outs})
refs = g.reference({"x": x_t, "w": w_t, "b": b_t})
for name, out in outs.items():
    assert (out.double() - refs[name]).norm() <= 1e-5 * refs[name].norm(), name
args = [t.clone().requires_grad_() for t in (x_t, w_t, b_t)]
y, s = g.as_function()(*args)
(y.square().sum() + s.sum()).backward()
leaves = [t.double().requires_grad_() for t in (x_t, w_t, b_t)]
r = torch.tanh(leaves[0] @ leaves[1] + leaves[2])
(torch.softmax(r, 1).square().sum() + r.sum(0).sum()).backward()
for arg, leaf in zip(args, leaves):
    assert (arg.grad.double() - leaf.grad).norm() <= 1e-5 * leaf.grad.norm()
print("ok")
'''


def test_a_process_started_as_on_a_gpu_machine(tmp_path):
    """TRITON_INTERPRET never set in the process (kernels are JITFunctions): execute and
    as_function on CPU tensors go to the interpreter process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(DNNGRAPH_INTERPRETER_WORKER="1", DNNGRAPH_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


# --- review findings: attacks on the interpreter process that held up ----------------------------
@pytest.mark.parametrize("data_type", [dg.float16, dg.bfloat16, dg.int64, dg.int32])
def test_interpreter_process_data_types(data_type):
    g = dg.Graph(name="types", io_data_type=data_type)
    x, w = g.tensor(name="x", dim=[3, 7]), g.tensor(name="w", dim=[3, 7])
    s = g.add(g.mul(x, w), x).set_output(True)
    g.cmp_gt(x, w).set_output(True).set_name("b")
    g.reduction(s, "sum", [1]).set_output(True).set_name("r")
    torch_dtype = data_type.torch_dtype
    if torch_dtype.is_floating_point:
        inputs = {"x": _randn(3, 7).to(torch_dtype), "w": _randn(3, 7).to(torch_dtype)}
        check(g.build(), inputs, tolerance=2e-2)
    else:
        inputs = {n: torch.randint(-5, 5, (3, 7), generator=GEN).to(torch_dtype) for n in ("x", "w")}
        check(g.build(), inputs, tolerance=1e-12)


def test_interpreter_process_bool_and_misaligned_views_of_one_buffer():
    g = dg.Graph(name="bools")
    a, c = g.tensor(name="a", dim=[4, 5], data_type=dg.bool), g.tensor(name="c", dim=[4, 5], data_type=dg.bool)
    g.logical_and(a, g.logical_not(c)).set_output(True).set_name("y")
    check(g.build(), {"a": torch.rand(4, 5, generator=GEN) < 0.5, "c": torch.rand(4, 5, generator=GEN) < 0.5})
    g = dg.Graph(name="mm")
    x, w = g.tensor(name="x", dim=[5, 8]), g.tensor(name="w", dim=[8, 6])
    g.matmul(x, w).set_output(True).set_name("y")
    buffer = _randn(200)
    check(g.build(), {"x": buffer[1:41].view(5, 8), "w": buffer[43:91].view(8, 6)})
    out = torch.full((100,), float("nan"))
    inner = out[1:31].view(5, 6)  # an output 4 bytes past alignment
    g.execute({"x": buffer[1:41].view(5, 8), "w": buffer[43:91].view(8, 6), "y": inner})
    assert rel_err(inner, buffer[1:41].view(5, 8).double() @ buffer[43:91].view(8, 6).double()) < 2e-5
    assert torch.isnan(out[0]) and torch.isnan(out[31:]).all()


def test_interpreter_process_killed_repeatedly_raises_typed_and_writes_nothing():
    g, x, y = _relu()
    g.build()
    xt = _randn(5, 6)
    g.execute({x: xt, y: poisoned(y)})
    for _ in range(5):
        process = interpreter_client._process
        if process is None or not process.alive:
            g.execute({x: xt, y: poisoned(y)})
            process = interpreter_client._process
        process.process.kill()
        out = poisoned(y)
        try:
            g.execute({x: xt, y: out})
        except dg.ExecutionError:
            assert torch.isnan(out).all(), "a failed execute wrote its output"
        else:
            assert torch.equal(out, xt.relu())
    out = poisoned(y)
    g.execute({x: xt, y: out})
    assert torch.equal(out, xt.relu())


# --- on a GPU machine, with nothing set ----------------------------------------------------------
GPU_GEN = torch.Generator().manual_seed(17)
TOLERANCE = 1e-4


def _gpu_randn(*dims):
    return torch.randn(*dims, generator=GPU_GEN)


def _block(rows=7):
    """Three or more kernels: matmul + bias + gelu, layernorm, matmul, softmax; w column-major."""
    x_t, w_t, b_t, v_t = _gpu_randn(rows, 13), _gpu_randn(11, 13).t(), _gpu_randn(1, 11), _gpu_randn(11, 5)
    g = dg.Graph(name=f"block{rows}")
    x, w, b, v = (g.tensor_like(t, n) for t, n in ((x_t, "x"), (w_t, "w"), (b_t, "b"), (v_t, "v")))
    scale, bias = g.tensor(name="scale", dim=[1, 11]), g.tensor(name="bias", dim=[1, 11])
    normed, _, _ = g.layernorm(g.gelu(g.add(g.matmul(x, w), b)), scale, bias)
    normed.set_output(True)
    g.softmax(g.matmul(normed, v), axis=1).set_output(True)
    return g, {"x": x_t, "w": w_t, "b": b_t, "v": v_t, "scale": _gpu_randn(1, 11), "bias": _gpu_randn(1, 11)}


def _on(inputs: dict, device) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}  # .to keeps the strides


@pytest.mark.gpu
class TestOnAGpuMachine:
    """The process as a GPU machine starts it: CUDA tensors compiled for the GPU, CPU tensors sent
    to the interpreter process (the module's fixture forcing that stays off for these)."""

    @pytest.fixture(autouse=True)
    def _not_interpreting(self):
        if runtime.interpreting():
            pytest.skip("TRITON_INTERPRET is set: this process interprets every tensor")
        assert "TRITON_INTERPRET" not in os.environ and runtime.cpu_kernels_in_worker()

    def test_one_graph_serves_cuda_and_cpu_tensors(self):
        g, inputs = _block()
        g.build()
        for device in ("cuda", "cpu", "cuda", "cpu"):
            check(g, _on(inputs, device), device=device, tolerance=TOLERANCE)
        assert interpreter_client._process is not None and interpreter_client._process.alive
        with pytest.raises(dg.ExecutionError, match="bind every tensor on one device"):
            g.execute({**_on(inputs, "cuda"), "v": inputs["v"], **{t.name: poisoned(t, "cuda") for t in g.outputs()}})

    def test_as_function_gradients_on_both_devices(self):
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

    def test_cpu_executes_while_other_threads_compile_and_run_on_the_gpu(self):
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
