"""The prepared launch path computes what the ordinary path computes.

On a GPU an execute launches argument lists prepared once per binding set and stream (device
addresses, grid, function handle, metadata, scratch) through the compiled launcher's C entry point.
Here the pretend GPU's launchers run each kernel through Triton's interpreter on the memory at the
addresses they are handed (pretend_gpu.interpreting_gpu), so the prepared lists are checked by the
numbers they produce: the same bits as the interpreter path on the same inputs, on the first
execute and on a repeated one, with the plan's workspace or the caller's, and whichever of the
launcher's two entry points it takes. An address no live binding holds fails the launch: a tensor
rebound, moved or replaced between executes must be launched where it is now (stale bindings)."""
import threading

import pytest
import torch

import dnngraph as dg
from helpers import poisoned, rel_err
from pretend_gpu import LiveMemory, interpreting_gpu

GEN = torch.Generator().manual_seed(41)


def _randn(*dims):
    return torch.randn(*dims, generator=GEN)


def _kernels_over_a_workspace():
    """relu(x + b) times its column sums: reduction kernels, then a pointwise one reading the
    sums from the workspace; b a [1, 6] row read broadcast."""
    g = dg.Graph(name="direct_two")
    x = g.tensor(name="x", dim=[5, 6])
    b = g.tensor(name="b", dim=[1, 6])
    activated = g.relu(g.add(x, b))
    g.mul(activated, g.reduction(activated, "sum", [0])).set_output(True).set_name("y")
    g.build()
    assert len(g.plan.launches) >= 2 and g.plan.workspace_bytes > 0
    return g, lambda: {"x": _randn(5, 6), "b": _randn(1, 6)}


def _views():
    """A transpose that becomes a view and a slice read at an offset into a matmul and a row
    softmax: aliases resolved to addresses at an offset from their root."""
    g = dg.Graph(name="direct_views")
    a = g.tensor(name="a", dim=[6, 8])
    w = g.tensor(name="w", dim=[6, 4])
    part = g.slice(g.transpose(g.relu(a), [1, 0]), [(4, 8), (0, 6)])
    g.softmax(g.matmul(part, w), axis=1).set_output(True).set_name("y")
    return g.build(), lambda: {"a": _randn(6, 8), "w": _randn(6, 4)}


def _transposed_odd():
    """One pointwise kernel over an odd-sized input stored transposed (strides (1, 7))."""
    like = _randn(5, 7).t()
    g = dg.Graph(name="direct_transposed")
    x = g.tensor_like(like, name="x")
    g.mul(g.sigmoid(x), x).set_output(True).set_name("y")
    return g.build(), lambda: {"x": _randn(5, 7).t()}


def _integers():
    """Integer math stays exact through the prepared path too."""
    g = dg.Graph(name="direct_int", io_data_type=dg.int32)
    x = g.tensor(name="x", dim=[9], data_type=dg.int32)
    g.add(g.mul(x, x), x).set_output(True).set_name("y")
    return g.build(), lambda: {"x": torch.randint(-50, 50, (9,), generator=GEN, dtype=torch.int32)}


GRAPHS = {"kernels over a workspace": _kernels_over_a_workspace, "views at offsets": _views,
          "transposed odd sizes": _transposed_odd, "int32": _integers}


def _outputs(g) -> dict:
    return {t.name: poisoned(t) for t in g.outputs()}


@pytest.mark.parametrize("profile_scratch_size", [0, 64], ids=["C entry point", "launcher call"])
@pytest.mark.parametrize("caller_workspace", [False, True])
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_prepared_launches_give_the_interpreter_paths_bits(monkeypatch, graph, caller_workspace,
                                                          profile_scratch_size):
    g, inputs_of = GRAPHS[graph]()
    inputs = inputs_of()
    expected = _outputs(g)
    g.execute({**inputs, **expected})  # the ordinary path: torch tensors to the interpreter
    reference = g.reference(inputs)
    for name, value in expected.items():
        assert rel_err(value, reference[name]) < 1e-5, name
    memory, calls = LiveMemory(), []
    with interpreting_gpu(monkeypatch, memory, calls, profile_scratch_size):
        g, _ = GRAPHS[graph]()  # built anew: its launches bound to the interpreting launchers
        workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8) if caller_workspace else None
        outputs = _outputs(g)
        bindings = {**inputs, **outputs}
        memory.bound = list(bindings.values()) + ([workspace] if caller_workspace else [])
        for step in range(2):  # the first execute prepares the lists, the second reuses them
            calls.clear()
            for value in outputs.values():
                value.fill_(-7 if not value.is_floating_point() else float("nan"))
            g.execute(bindings, workspace=workspace)
            for name, value in outputs.items():
                assert torch.equal(value, expected[name]), (name, step)
            entry = "launch" if profile_scratch_size == 0 else "run"
            assert [kind for kind, _ in calls] == [entry] * len(g.plan.launches), step
        assert len(g.plan._ready) == 1


def _rebind_in_dict(bindings, name):
    bindings[name] = _randn(*bindings[name].shape)


def _set_onto_other_memory(bindings, name):
    bindings[name].set_(_randn(*bindings[name].shape))


def _data_of_another_tensor(bindings, name):
    bindings[name].data = _randn(*bindings[name].shape)


CHANGES = {"another tensor in the dict": _rebind_in_dict, "set_ onto other memory": _set_onto_other_memory,
           ".data = another tensor": _data_of_another_tensor}


@pytest.mark.parametrize("role", ["x", "y"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_binding_changed_between_executes_is_launched_where_it_is_now(monkeypatch, change, role):
    """The same shape at another address, by a new dict value or in place: the launches take the
    new memory (the old is no longer live, so a stale address fails the launch), the numbers are
    the new inputs', and an output's old memory is left as it was."""
    memory, calls = LiveMemory(), []
    with interpreting_gpu(monkeypatch, memory, calls):
        g, _ = _kernels_over_a_workspace()
        bindings = {"x": _randn(5, 6), "b": _randn(1, 6), "y": torch.full((5, 6), float("nan"))}
        memory.bound = list(bindings.values())
        g.execute(bindings)
        g.execute(bindings)  # the remembered set
        held = [value.untyped_storage() for value in bindings.values()]  # no old address is reused
        old_output = bindings["y"].clone()
        old_output_memory = bindings["y"].detach().clone() if role != "y" else bindings["y"]
        CHANGES[change](bindings, role)
        bindings["y"].fill_(float("nan"))
        memory.bound = list(bindings.values())  # only the memory bound now is live
        for _ in range(2):
            g.execute(bindings)
            expected = g.reference({"x": bindings["x"], "b": bindings["b"]})["y"]
            assert rel_err(bindings["y"], expected) < 2e-5
        if role == "y" and change == "another tensor in the dict":
            assert torch.equal(old_output_memory, old_output), "the output's old memory is not written"
        del held


def test_a_binding_set_seen_before_is_launched_on_its_own_memory(monkeypatch):
    """Sets used in turn: each execute launches the lists of its own set, never the last one's."""
    memory, calls = LiveMemory(), []
    with interpreting_gpu(monkeypatch, memory, calls):
        g, _ = _kernels_over_a_workspace()
        sets = [{"x": _randn(5, 6), "b": _randn(1, 6), "y": torch.empty(5, 6)} for _ in range(3)]
        for _ in range(2):
            for bindings in sets:
                memory.bound = list(bindings.values())
                bindings["y"].fill_(float("nan"))
                g.execute(bindings)
                expected = g.reference({"x": bindings["x"], "b": bindings["b"]})["y"]
                assert rel_err(bindings["y"], expected) < 2e-5
        assert len(g.plan._ready) == len(sets)


def test_as_function_on_the_prepared_path_gives_the_interpreter_paths_bits(monkeypatch):
    """as_function's eager call (execute_conformed) launches prepared lists too: its outputs are
    fresh memory each call, so each call's addresses are checked and launched where they are."""
    x = _randn(5, 7).t()
    graph = lambda: _transposed_odd()[0]  # noqa: E731
    expected = graph().as_function()(x)
    memory, calls = LiveMemory(), []
    with interpreting_gpu(monkeypatch, memory, calls):
        fn = graph().as_function()
        made = []
        real_empty = torch.empty_strided

        def tracked(*args, **kwargs):  # outputs the function allocates are live memory
            tensor = real_empty(*args, **kwargs)
            made.append(tensor)
            return tensor

        monkeypatch.setattr(torch, "empty_strided", tracked)
        memory.bound = [x]
        memory.workspaces = made
        for _ in range(3):
            calls.clear()
            assert torch.equal(fn(x), expected)
            assert [kind for kind, _ in calls] == ["launch"]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_on_a_gpu_prepared_launches_take_the_c_entry_point_and_follow_rebinding(graph):
    """On a real GPU every bound launch of these plans is called at Triton's C entry point (a
    launcher of another shape would quietly fall back to its slower Python call), the numbers
    match the reference on the current stream and on a side stream, and a tensor rebound between
    executes (a new dict value, set_ in place) is read where it is now."""
    g, inputs_of = GRAPHS[graph]()
    inputs = {name: value.cuda() for name, value in inputs_of().items()}
    outputs = {t.name: poisoned(t, "cuda") for t in g.outputs()}
    bindings = {**inputs, **outputs}

    def check_against_reference():
        for value in outputs.values():
            value.fill_(-7 if not value.is_floating_point() else float("nan"))
        g.execute(bindings)
        torch.cuda.synchronize()
        reference = g.reference({name: bindings[name].cpu() for name in inputs})
        for name, value in outputs.items():
            assert rel_err(value.cpu(), reference[name]) < 1e-5, name

    check_against_reference()
    bound = [b for launch in g.plan._launches_for(torch.device("cuda", 0)).launches for b in launch._bound.values()]
    assert bound and all(b.direct for b in bound), "the launcher's C entry point is not taken"
    check_against_reference()  # the remembered set
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        check_against_reference()
    torch.cuda.current_stream().wait_stream(side)
    first = next(iter(inputs))
    bindings[first] = inputs_of()[first].cuda()  # a new tensor under the same key
    check_against_reference()
    bindings[first].set_(inputs_of()[first].cuda())  # moved in place, the same object
    check_against_reference()


def test_threads_sharing_a_stream_keep_each_executes_launches_together(monkeypatch):
    """Two threads executing one plan on one stream share its workspace: each execute's kernels
    run under the stream workspace's lock (launch_on_device), so the other thread's first
    kernel never overwrites the intermediate between this one's two kernels."""
    memory, calls = LiveMemory(), []
    with interpreting_gpu(monkeypatch, memory, calls, pause_s=0.002):
        g, _ = _kernels_over_a_workspace()
        sets = [{"x": _randn(5, 6), "b": _randn(1, 6), "y": torch.empty(5, 6)} for _ in range(2)]
        memory.bound = [value for bindings in sets for value in bindings.values()]
        errors = []

        def run(bindings):
            try:
                for _ in range(3):
                    bindings["y"].fill_(float("nan"))
                    g.execute(bindings)
                    expected = g.reference({"x": bindings["x"], "b": bindings["b"]})["y"]
                    assert rel_err(bindings["y"], expected) < 2e-5
            except BaseException as error:  # raised below, in the test's thread
                errors.append(error)

        threads = [threading.Thread(target=run, args=(bindings,)) for bindings in sets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        assert len(g.plan._streams) == 1, "both threads used the one stream's workspace"
