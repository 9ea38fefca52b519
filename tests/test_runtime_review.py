"""Adversarial review of the plan cache, the binding cache and the interpreter process.

Tests that fail on the reviewed commit name the defect in their docstring ("DEFECT"); the others
are regression tests for attacks that held up."""
import dataclasses
import gc
import os
import shutil
import sys
import threading
import weakref

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import interpreting
from dnngraph import runtime
from dnngraph.plan import cache as plan_cache
from dnngraph.plan import interpreter_client
from helpers import check, poisoned, rel_err

GEN = torch.Generator().manual_seed(29)


def _randn(*dims):
    return torch.randn(*dims, generator=GEN)


def _mlp(name="mlp"):
    """relu(x @ w) then a row softmax: two kernels, a workspace tensor between them."""
    g = dg.Graph(name=name)
    x = g.tensor(name="x", dim=[5, 24])
    w = g.tensor(name="w", dim=[24, 40])
    y = g.softmax(g.relu(g.matmul(x, w)), axis=1).set_output(True).set_name("y")
    return g, x, w, y


def _relu(name="relu"):
    g = dg.Graph(name=name)
    x = g.tensor(name="x", dim=[5, 6])
    y = g.relu(x).set_output(True).set_name("y")
    return g, x, y


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear()
    yield
    plan_cache.clear()
    runtime.force_interpreter_worker(False)


@pytest.fixture
def worker():
    """CPU kernels go to the interpreter process (as on a GPU machine)."""
    runtime.force_interpreter_worker(True)
    yield
    runtime.force_interpreter_worker(False)


# ================================================================================================
# Failing: defects found
# ================================================================================================
def _unary(op: str, name: str):
    """x -> op(cos(x)): a kernel no other test of this file makes."""
    g = dg.Graph(name=name)
    x = g.tensor(name="x", dim=[3, 11])
    y = getattr(g, op)(g.cos(x)).set_output(True).set_name("y")
    return g, x, y


@pytest.fixture
def forget_missing_kernels():
    """Afterwards, take kernels whose file is gone out of sys.modules, so the defect below cannot
    spread to later tests of the session."""
    yield
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith("dnngraph_kernels.") and path and not os.path.exists(path):
            sys.modules.pop(name, None)


def test_changed_cache_folder_gets_its_kernel_files(monkeypatch, tmp_path):
    """DEFECT: load_kernel returns a kernel already imported in this process with a path in the
    *new* DNNGRAPH_CACHE_DIR without ever writing the file there. explain() then points at files
    that do not exist, and (below) the interpreter process, which reads sources from disk, cannot
    run the plan at all. (test_plan_cache's test_cache_folder_is_in_the_key checks the folder
    of the path, not that the file exists.)"""
    _unary("sigmoid", "a")[0].build()  # the kernel is imported under the default folder
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    g = _unary("sigmoid", "a")[0].build()
    missing = [str(launch.source_path) for launch in g.plan.launches if not launch.source_path.exists()]
    assert not missing, f"explain() names kernel sources that were never written: {missing}"


@pytest.mark.parametrize("how", ["folder_changed", "folder_deleted"])
def test_interpreter_process_runs_after_the_cache_folder_changes(monkeypatch, tmp_path, worker, how,
                                                                 forget_missing_kernels):
    """DEFECT: the client sends the interpreter process the kernel source read from disk at
    execute time. With the file absent (cache folder changed, or cleaned by a tmp cleaner / user)
    every CPU execute raises 'cannot be read ...: build the graph again' - and building again
    (even after plan_cache.clear()) returns the same missing path, so it never recovers for the
    life of the process (on a GPU machine: CPU tensors of that kernel are dead)."""
    op = "exp" if how == "folder_changed" else "softplus"
    if how == "folder_changed":
        _unary(op, "b")[0].build()
        monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    else:
        monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path / "c"))
        _unary(op, "b")[0].build()
        shutil.rmtree(tmp_path / "c")
        plan_cache.clear()
    g, x, y = _unary(op, "b")
    g.build()  # "build the graph again", as the error says
    xt, out = _randn(3, 11), poisoned(y)
    g.execute({x: xt, y: out})
    assert rel_err(out, g.reference({x: xt})["y"]) < 2e-5


def test_dead_interpreter_process_is_not_kept_alive_by_the_plan_cache(worker):
    """DEFECT (leak): every plan-cache key holds every module-level value of dnngraph, among them
    interpreter_client._process. A replaced (dead) InterpreterProcess - with its Popen, its
    connection and its shared-memory arena mapping (the arena grows to the largest request and
    its /dev/shm pages stay resident while mapped) - stays alive as long as any cached key
    references it: up to PLAN_CACHE_ENTRIES dead processes' arenas."""
    interpreter_client._stop()
    g, x, y = _relu()
    g.build()
    g.execute({x: _randn(5, 6), y: poisoned(y)})  # starts process 1
    first = interpreter_client._process
    _relu()[0].build()  # a key taken while process 1 is the module's value
    first.process.kill()
    first.process.wait()
    out = poisoned(y)
    g.execute({x: _randn(5, 6), y: out})  # process 2 replaces it
    assert interpreter_client._process is not first
    dead = weakref.ref(first)
    del first
    gc.collect()
    assert dead() is None, "the dead interpreter process (and its arena) is still referenced"


def test_starting_the_interpreter_process_keeps_plan_cache_hits(worker):
    """DEFECT (performance): the key includes interpreter_client._process, so the first CPU
    execute through the interpreter process (and every restart of it) changes every key: each
    graph built before misses and is built again. The cache's docstring lists only things a
    build reads."""
    interpreter_client._stop()
    g, x, y = _relu()
    g.build()
    g.execute({x: _randn(5, 6), y: poisoned(y)})  # starts the process
    hits = plan_cache.PLANS.hits
    _relu()[0].build()
    assert plan_cache.PLANS.hits == hits + 1


def test_interpreter_process_switch_changes_no_plan_key():
    """DEFECT (performance): commit ece6197 says the interpreter-process switch changes no plan,
    but force_interpreter_worker() assigns runtime._forced_worker, a module value in the key:
    toggling it makes every build miss."""
    _relu()[0].build()
    runtime.force_interpreter_worker(True)
    hits = plan_cache.PLANS.hits
    _relu()[0].build()
    assert plan_cache.PLANS.hits == hits + 1


def test_a_plan_is_filed_under_the_options_it_was_built_with():
    """What once was a race (a module knob assigned while a build ran filed the plan, built
    without it, under the knob's key) cannot recur: a build reads only its BuildOptions, a
    frozen value in its key."""
    looped = dg.BuildOptions(row_mode="looped", row_loop_tile=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        looped.row_mode = None
    first = _mlp()[0].build()
    forced = _mlp()[0].build(options=looped)
    assert "(looped)" not in first.plan.launches[-1].config_text
    assert "(looped)" in forced.plan.launches[-1].config_text
    hits = plan_cache.PLANS.hits
    again = _mlp()[0].build()
    assert plan_cache.PLANS.hits == hits + 1 and again.plan.launches is first.plan.launches


# ================================================================================================
# Passing: attacks that held up (regression tests)
# ================================================================================================
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA device")]),
])
def test_negative_zero_constant_keeps_its_sign(device):
    """DEFECT (fixed; wrong result on the GPU and the interpreter alike): Triton builds every
    scalar equal to 0 as +0.0, so a kernel written as `x * -0.0` gave 1 / (x * -0.0) = +inf where
    the reference gives -inf. The plan cache keeps -0.0 and 0.0 apart (separate plans); the
    literal now keeps its sign in products, maxima and selects alike."""
    def make(zero):
        g = dg.Graph(name="z")
        x = g.tensor(name="x", dim=[8])
        g.div(1.0, g.mul(x, zero)).set_output(True).set_name("y")
        g.div(1.0, g.maximum(g.neg(x), zero)).set_output(True).set_name("m")
        return g

    positive = make(0.0).build()
    negative = make(-0.0).build()
    assert negative.plan.launches is not positive.plan.launches  # the key tells them apart
    xt = (torch.rand(8, generator=GEN) + 0.5).to(device)
    for g, expected in ((positive, float("inf")), (negative, float("-inf"))):
        out, most = (torch.full((8,), float("nan"), device=device) for _ in range(2))
        g.execute({"x": xt, "y": out, "m": most})
        reference = g.reference({"x": xt})
        assert (reference["y"] == expected).all() and (reference["m"] == expected).all()
        assert (out == expected).all() and (most == expected).all(), (expected, out, most)


def test_renamed_output_on_an_identical_structure_is_its_own_plan():
    g1, x1, w1, y1 = _mlp()
    g1.build()
    g2, x2, w2, y2 = _mlp()
    y2.set_name("out")
    g2.build()
    assert g2.plan.launches is not g1.plan.launches
    inputs = {x2: _randn(5, 24), w2: _randn(24, 40)}
    out = poisoned(y2)
    g2.execute({"x": inputs[x2], "w": inputs[w2], "out": out})
    assert rel_err(out, g2.reference(inputs)["out"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="not a tensor"):
        g2.execute({"x": inputs[x2], "w": inputs[w2], "y": poisoned(y2)})


def test_graph_built_then_renamed_then_rebuilt_binds_the_new_name():
    g, x, w, y = _mlp()
    g.build()
    x.set_name("x_renamed")
    with pytest.raises(dg.ExecutionError, match="not built"):
        g.execute({x: _randn(5, 24), w: _randn(24, 40), y: poisoned(y)})
    g.build()
    inputs = {x: _randn(5, 24), w: _randn(24, 40)}
    out = poisoned(y)
    g.execute({"x_renamed": inputs[x], "w": inputs[w], "y": out})
    assert rel_err(out, g.reference(inputs)["y"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="not a tensor"):
        g.execute({"x": inputs[x], "w": inputs[w], "y": poisoned(y)})


def test_same_tensor_bound_by_handle_and_by_name_uses_one_value_consistently():
    g, x, w, y = _mlp()
    g.build()
    good, bad = _randn(5, 24), torch.randn(3, 3)
    for _ in range(2):  # the second call takes the remembered binding set
        out = poisoned(y)
        g.execute({x: bad, "x": good, w: (wt := _randn(24, 40)), y: out})
        assert rel_err(out, g.reference({x: good, w: wt})["y"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="expects shape"):
        g.execute({"x": good, x: bad, w: wt, y: poisoned(y)})


def test_restrided_in_place_at_the_same_address_is_checked_again():
    g, x, w, y = _mlp()
    g.build()
    bindings = {x: _randn(5, 24), w: _randn(24, 40), y: poisoned(y)}
    g.execute(bindings)
    address = bindings[w].data_ptr()
    bindings[w].as_strided_((24, 40), (1, 24))  # same address, transposed layout
    assert bindings[w].data_ptr() == address
    bindings[y].fill_(float("nan"))
    with pytest.raises(dg.ExecutionError, match="strides"):
        g.execute(bindings)
    assert torch.isnan(bindings[y]).all()


def test_address_reused_by_a_tensor_of_another_shape_is_checked():
    g, x, w, y = _mlp()
    g.build()
    storage = torch.empty(4096)
    xt = storage[:120].view(5, 24).normal_(generator=GEN)
    out = poisoned(y)
    g.execute({x: xt, w: _randn(24, 40), y: out})
    other = storage[:120].view(24, 5)  # same address, other shape
    with pytest.raises(dg.ExecutionError, match="expects shape"):
        g.execute({x: other, w: _randn(24, 40), y: out})


def test_output_moved_onto_a_view_of_an_input_with_the_same_stamp_otherwise_is_caught():
    g, x, w, y = _mlp()
    g.build()
    big = _randn(4096)
    xt = big[:120].view(5, 24)
    g.execute({x: xt, w: _randn(24, 40), y: poisoned(y)})
    alias = big[64:264].view(5, 40)  # overlaps x's extent
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute({x: xt, w: _randn(24, 40), y: alias})


def test_threads_building_and_executing_identical_graphs():
    failures = []
    built = _mlp()[0].build()
    bx, bw, by = (built.tensor_by_name(n) for n in ("x", "w", "y"))

    def executor():
        try:
            for _ in range(4):
                inputs = {bx: _randn(5, 24), bw: _randn(24, 40)}
                out = poisoned(by)
                built.execute({**inputs, by: out})
                assert rel_err(out, built.reference(inputs)["y"]) < 2e-5
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    def builder():
        try:
            for _ in range(4):
                g, x, w, y = _mlp("other")
                g.build()
                inputs = {x: _randn(5, 24), w: _randn(24, 40)}
                out = poisoned(y)
                g.execute({**inputs, y: out})
                assert rel_err(out, g.reference(inputs)["y"]) < 2e-5
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=f) for f in (executor, builder, executor, builder)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


@pytest.mark.parametrize("data_type", [dg.float16, dg.bfloat16, dg.int64, dg.int32])
def test_interpreter_process_data_types(worker, data_type):
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


def test_interpreter_process_bool_and_misaligned_views_of_one_buffer(worker):
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


def test_interpreter_process_killed_repeatedly_raises_typed_and_writes_nothing(worker):
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
