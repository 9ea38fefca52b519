"""execute() checks a binding set once: later executes with the same tensors (same keys, types,
addresses, dtypes, shapes, strides, devices) skip the checks and, on a GPU, launch prepared
argument lists of device addresses. Anything that moves or reshapes a bound tensor is checked
again; the addresses launched are the ones the tensor path would pass. Review findings: renamed
tensors, one tensor bound twice, restrided or reused addresses and outputs moved onto inputs."""
import contextlib

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import plan_cache as plan_cache
import dnngraph.runtime.plan as plan_module
from dnngraph.runtime import launch as launch_module
from helpers import check, poisoned, rel_err
from pretend_gpu import STREAM, pretend_gpu
from test_plan_cache import _mlp, _runs_by_names


def _graph():
    """x + b then relu, and a column softmax after it: two kernels, a workspace tensor between."""
    g = dg.Graph(name="bindings")
    x = g.tensor(name="x", dim=[5, 6])
    b = g.tensor(name="b", dim=[1, 6])
    y = g.softmax(g.relu(g.add(x, b)), axis=0).set_output(True).set_name("y")
    return g.build(), x, b, y


def _bindings(x, b, y, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {x: torch.randn(5, 6, generator=generator), b: torch.randn(1, 6, generator=generator), y: poisoned(y)}


def test_same_tensors_are_checked_once_and_contents_may_change():
    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    for step in range(3):
        bindings[x].copy_(torch.randn(5, 6))  # new contents, same tensor: still valid
        bindings[y].fill_(float("nan"))
        g.execute(bindings)
        expected = g.reference({x: bindings[x], b: bindings[b]})["y"]
        assert rel_err(bindings[y], expected) < 2e-5, step
    assert len(g.plan._ready) == 1


def _reshape_in_place(tensor):
    tensor.resize_(30)


def _transpose_in_place(tensor):
    tensor.set_(torch.randn(6, 5).t())


def _swap_data_wrong_shape(tensor):
    tensor.data = torch.randn(5, 7)


def _swap_data_wrong_dtype(tensor):
    tensor.data = torch.randn(5, 6, dtype=torch.float64)


def _storage_of_other(tensor, other):
    tensor.set_(other.untyped_storage(), 0, (5, 6), (6, 1))


@pytest.mark.parametrize("change", [_reshape_in_place, _transpose_in_place, _swap_data_wrong_shape,
                                    _swap_data_wrong_dtype])
def test_a_bound_tensor_changed_in_place_is_checked_again(change):
    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    g.execute(bindings)
    change(bindings[x])
    bindings[y].fill_(float("nan"))
    with pytest.raises(dg.ExecutionError):
        g.execute(bindings)
    assert torch.isnan(bindings[y]).all(), "nothing may be written on error"


def test_an_output_moved_onto_an_input_is_caught():
    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    g.execute(bindings)
    _storage_of_other(bindings[y], bindings[x])
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute(bindings)


def test_same_tensors_under_other_keys_are_checked():
    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    g.execute(bindings)
    with pytest.raises(dg.ExecutionError, match="not a tensor"):
        g.execute({"nope": bindings[x], b: bindings[b], y: bindings[y]})
    other, ox, _, _ = _graph()
    with pytest.raises(dg.ExecutionError, match="missing binding"):  # same names: by name it binds
        g.execute({b: bindings[b], y: bindings[y]})
    g.execute({"x": bindings[x], "b": bindings[b], "y": bindings[y]})  # names: a set of its own
    assert len(g.plan._ready) == 2


def test_a_value_that_is_not_a_tensor_after_a_good_set_raises():
    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    g.execute(bindings)
    with pytest.raises(dg.ExecutionError, match="not a torch.Tensor"):
        g.execute({**bindings, x: bindings[x].numpy()})


def test_many_binding_sets_stay_correct_past_the_remembered_count():
    g, x, b, y = _graph()
    sets = [_bindings(x, b, y, seed) for seed in range(plan_module.READY_BINDING_SETS + 5)]
    for bindings in sets + sets[:3]:
        bindings[y].fill_(float("nan"))
        g.execute(bindings)
        assert rel_err(bindings[y], g.reference({x: bindings[x], b: bindings[b]})["y"]) < 2e-5
    assert len(g.plan._ready) <= plan_module.READY_BINDING_SETS


def test_caller_workspace_is_part_of_the_set():
    g, a, w, y = _views_graph()
    bindings = {a: torch.randn(6, 8), w: torch.randn(6, 4), y: poisoned(y)}
    size = g.plan.workspace_size()
    assert size > 0
    g.execute(bindings, workspace=torch.empty(size, dtype=torch.uint8))
    assert rel_err(bindings[y], g.reference({a: bindings[a], w: bindings[w]})["y"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="holds"):
        g.execute(bindings, workspace=torch.empty(size - 1, dtype=torch.uint8))
    shared = torch.empty(size + 1024, dtype=torch.uint8)
    inside = shared[:64].view(torch.float32).view(4, 4)
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute({**bindings, y: inside}, workspace=shared)


# --- the CUDA path's prepared arguments, on a pretend GPU ----------------------------------------
def _kernel_arguments(calls) -> list:
    """The kernel arguments of each recorded launch, tensors as their addresses."""
    found = []
    for kind, args in calls:
        head = 13 if kind == "launch" else 9
        found.append([a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args[head:]])
    return found


def _views_graph():
    """A transpose that becomes a view, a slice read at an offset, two kernels and a workspace."""
    g = dg.Graph(name="views")
    a = g.tensor(name="a", dim=[6, 8])
    w = g.tensor(name="w", dim=[6, 4])
    at = g.transpose(g.relu(a), [1, 0])
    part = g.slice(at, [(4, 8), (0, 6)])  # 16 bytes into the memory: pointers stay aligned
    y = g.softmax(g.matmul(part, w), axis=1).set_output(True).set_name("y")
    return g.build(), a, w, y


@pytest.mark.parametrize("with_workspace", [False, True])
def test_prepared_addresses_match_the_tensor_path(monkeypatch, with_workspace):
    plan_cache.clear()  # launches of its own, not ones an earlier test bound to its recorder
    g, a, w, y = _views_graph()
    bindings = {a: torch.randn(6, 8), w: torch.randn(6, 4), y: poisoned(y)}
    workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8) if with_workspace else None
    calls = []
    with pretend_gpu(monkeypatch, calls):
        g.execute(bindings, workspace=workspace)
        g.execute(bindings, workspace=workspace)
        prepared = _kernel_arguments(calls)
        assert len(prepared) == 2 * len(g.plan.launches)
        assert prepared[:len(prepared) // 2] == prepared[len(prepared) // 2:]
        # the tensor path: materialized views handed to the same bound launches
        calls.clear()
        plan = g.plan
        tensors = plan._resolve(bindings)
        built = plan._launches_for(torch.device("cuda", 0))
        if with_workspace:
            tensors.update(built.views(workspace))
        else:
            tensors.update(plan._stream_workspace(built, torch.device("cpu"), STREAM).views)
        plan.views.materialize(tensors)
        for launch in built.launches:
            launch.bind(0, built.dtypes)(tensors, STREAM)
        assert _kernel_arguments(calls) == prepared[:len(prepared) // 2]
    assert all(isinstance(v, int) for args in prepared for v in args if v is not None)


def test_a_launcher_refusing_its_arguments_names_the_kernel(monkeypatch):
    """A compiled launcher that refuses a prepared call (Triton's TypeError on an argument count
    that is not its kernel's) becomes an ExecutionError naming that kernel and both counts, on
    the first execute and on a repeated one, and the launches before it ran."""
    plan_cache.clear()
    g, a, w, y = _views_graph()
    assert len(g.plan.launches) >= 2
    refused = g.plan.launches[1]
    bindings = {a: torch.randn(6, 8), w: torch.randn(6, 4), y: poisoned(y)}
    calls = []
    with pretend_gpu(monkeypatch, calls):
        original = launch_module.BoundLaunch.call

        def short_of_one(self, values, stream):
            launcher, args = original(self, values, stream)
            if self.template is refused.template:  # this kernel's call loses its last argument
                def refuse(*given):
                    raise TypeError(f"function takes exactly {len(args)} arguments ({len(given)} given)")
                return refuse, args[:-1]
            return launcher, args
        monkeypatch.setattr(launch_module.BoundLaunch, "call", short_of_one)
        for _ in range(2):
            calls.clear()
            with pytest.raises(dg.ExecutionError) as caught:
                g.execute(bindings)
            message = str(caught.value)
            assert refused.source_path.name in message and refused.config_text in message
            assert f"{len(refused.template)} prepared arguments" in message
            assert f"{len(refused.kernel.arg_names)} parameters" in message
            assert isinstance(caught.value.__cause__, TypeError)
            assert len(calls) == 1  # the first kernel ran, the refused one did not


def test_launch_on_device_says_which_call_was_refused(monkeypatch):
    """The launch loop reports the position of the refused call and restores the device."""
    from pretend_gpu import PretendDevices, patch_current_device
    devices = PretendDevices(current=3)
    patch_current_device(monkeypatch, devices)
    ran = []

    def refuse(*args):
        raise TypeError("function takes exactly 40 arguments (27 given)")
    calls = ((lambda *args: ran.append(args), (1, 2)), (refuse, (1, 2, 3)), (lambda *args: ran.append(args), ()))
    with pytest.raises(launch_module.LaunchRefused) as caught:
        launch_module.launch_on_device(calls, 0)
    assert (caught.value.position, caught.value.given) == (1, 3) and ran == [(1, 2)]
    assert devices.current == 3


# --- review findings: binding sets that held up against attack -----------------------------------
GEN = torch.Generator().manual_seed(29)


def _randn(*dims):
    return torch.randn(*dims, generator=GEN)


def test_graph_built_then_renamed_then_rebuilt_binds_the_new_name():
    g, x, w, y = _mlp()
    g.build()
    x.set_name("x_renamed")
    with pytest.raises(dg.ExecutionError, match="not built"):
        g.execute({x: _randn(5, 24), w: _randn(24, 40), y: poisoned(y)})
    g.build()
    _runs_by_names(g, x, w, y, ("x_renamed", "w", "y"), ("x", "w", "y"), "not a tensor")


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


# --- a bound tensor changed in place, the same Python object (and id) all along ------------------
# Every one of these keeps id(tensor); only torch.utils.swap_tensors changes its _cdata, and
# `.data =`, share_memory_ and a storage resize leave its _version as it was (a write of contents
# bumps it and changes nothing the checks read). So the binding fingerprint reads each field the
# checks read (address, dtype, shape, strides, device, negative bit) on every call: no subset of
# them, nor the object's identity, detects all of these.
def _swap(tensor):
    torch.utils.swap_tensors(tensor, torch.randn(5, 6, generator=GEN))


REFUSED_INPUT_CHANGES = {  # x [5, 6] of _graph() made unbindable in place: (change, the error's words)
    "resize_ to another numel": (lambda t: t.resize_(30), "shape"),
    "resize_ to another shape, same numel": (lambda t: t.resize_(6, 5), "shape"),
    "resize_ to fewer rows (the same address and strides)": (lambda t: t.resize_(4, 6), "shape"),
    "as_strided_ to fewer rows (the same address and strides)": (lambda t: t.as_strided_((4, 6), (6, 1)), "shape"),
    "t_()": (lambda t: t.t_(), "shape"),
    "unsqueeze_": (lambda t: t.unsqueeze_(0), "shape"),
    "as_strided_ at the same address": (lambda t: t.as_strided_((5, 6), (1, 5)), "strides"),
    "set_ of its own storage restrided": (lambda t: t.set_(t.untyped_storage(), 0, (5, 6), (1, 5)), "strides"),
    "set_ of a transposed tensor": (_transpose_in_place, "strides"),
    ".data = another shape": (_swap_data_wrong_shape, "shape"),
    ".data = another dtype": (_swap_data_wrong_dtype, "float64"),
    ".data = its own memory as int32 (only the dtype changes)": (lambda t: setattr(t, "data", t.view(torch.int32)),
                                                                  "int32"),
}

RECHECKED_INPUT_CHANGES = {  # x changed in place into another valid binding: kernels must read the new one
    "set_ of another tensor": lambda t: t.set_(torch.randn(5, 6, generator=GEN)),
    ".data = another tensor": lambda t: setattr(t, "data", torch.randn(5, 6, generator=GEN)),
    "share_memory_": lambda t: t.share_memory_(),
    "its storage resized": lambda t: t.untyped_storage().resize_(4096),
    "swap_tensors": _swap,
    ".data = a negated view of its memory (only the negative bit changes)": lambda t: setattr(t, "data",
                                                                                              t._neg_view()),
}


@pytest.mark.parametrize("name", list(REFUSED_INPUT_CHANGES))
@pytest.mark.parametrize("gpu", [False, True])
def test_an_input_made_unbindable_in_place_is_refused_and_nothing_is_written(monkeypatch, name, gpu):
    change, words = REFUSED_INPUT_CHANGES[name]
    calls = []
    with (pretend_gpu(monkeypatch, calls) if gpu else _nothing()):
        g, x, b, y = _graph()
        bindings = _bindings(x, b, y)
        for _ in range(2):  # the second call takes the remembered set
            g.execute(bindings)
        identity = id(bindings[x])
        change(bindings[x])
        assert id(bindings[x]) == identity
        bindings[y].fill_(float("nan"))
        launched = len(calls)
        for _ in range(2):
            with pytest.raises(dg.ExecutionError, match=words):
                g.execute(bindings)
        assert torch.isnan(bindings[y]).all(), "nothing may be written on error"
        assert len(calls) == launched, "nothing may be launched on error"


@pytest.mark.parametrize("name", list(RECHECKED_INPUT_CHANGES))
@pytest.mark.parametrize("gpu", [False, True])
def test_an_input_changed_in_place_is_checked_again_and_read_where_it_now_is(monkeypatch, name, gpu):
    change = RECHECKED_INPUT_CHANGES[name]
    calls = []
    with (pretend_gpu(monkeypatch, calls) if gpu else _nothing()):
        g, x, b, y = _graph()
        bindings = _bindings(x, b, y)
        for _ in range(2):
            g.execute(bindings)
        old = bindings[x].data_ptr()
        held = bindings[x].untyped_storage()  # its old memory stays allocated: no address is reused
        identity = id(bindings[x])
        change(bindings[x])
        assert id(bindings[x]) == identity
        prepared = len(g.plan._ready)
        for _ in range(2):
            calls.clear()
            bindings[y].fill_(float("nan"))
            g.execute(bindings)
            if gpu:  # the launches took the tensor's memory as it is now, never the stale address
                addresses = {a for args in _kernel_arguments(calls) for a in args}
                assert old not in addresses or bindings[x].data_ptr() == old and not bindings[x].is_neg()
                assert bindings[x].is_neg() or bindings[x].data_ptr() in addresses
            else:
                expected = g.reference({x: bindings[x], b: bindings[b]})["y"]
                assert rel_err(bindings[y], expected) < 2e-5
        assert len(g.plan._ready) == prepared + 1, "the changed binding is a set of its own, checked once"
        del held


@pytest.mark.parametrize("gpu", [False, True])
def test_an_output_changed_in_place_is_checked_again(monkeypatch, gpu):
    """An output given a negative bit in place (.data = a negated view: only that bit changes) is
    refused; one moved onto fresh memory is written there, its old memory untouched."""
    calls = []
    with (pretend_gpu(monkeypatch, calls) if gpu else _nothing()):
        g, x, b, y = _graph()
        bindings = _bindings(x, b, y)
        for _ in range(2):
            g.execute(bindings)
        out = bindings[y]
        out.fill_(float("nan"))
        out.data = out._neg_view()
        with pytest.raises(dg.ExecutionError, match="negat"):
            g.execute(bindings)
        assert out.resolve_neg().isnan().all()
        out.data = out._neg_view()  # back to its plain self: the first set again
        assert not out.is_neg()
        g.execute(bindings)
        before = out.data  # its memory now
        old = before.clone()
        moved = torch.empty(5, 6).fill_(float("nan"))
        out.set_(moved)
        calls.clear()
        g.execute(bindings)
        if gpu:
            addresses = {a for args in _kernel_arguments(calls) for a in args}
            assert moved.data_ptr() in addresses and before.data_ptr() not in addresses
        else:
            assert rel_err(out, g.reference({x: bindings[x], b: bindings[b]})["y"]) < 2e-5
        assert torch.allclose(before, old, equal_nan=True), "the memory it left is not written"


@pytest.mark.parametrize("name", ["resize_", "as_strided_", ".data = int32", "negative bit", "set_"])
def test_a_function_input_changed_in_place_is_checked_again(name):
    """as_function reads every input's kind, dtype, shape and strides on every call and its plan
    keys on addresses: an input changed in place between calls is refused or read as it now is."""
    _, fn = _function_of_graph()
    xt = torch.randn(5, 6, generator=GEN)
    reference = lambda value: value.double().relu()  # noqa: E731
    assert rel_err(fn(xt), reference(xt)) < 1e-6
    assert rel_err(fn(xt), reference(xt)) < 1e-6
    if name == "resize_":
        xt.resize_(6, 5)
        with pytest.raises(dg.ExecutionError, match="shape"):
            fn(xt)
        return
    if name == ".data = int32":
        xt.data = xt.view(torch.int32)
        with pytest.raises(dg.ExecutionError, match="int32"):
            fn(xt)
        return
    if name == "as_strided_":
        xt.as_strided_((5, 6), (1, 5))  # the same address and shape, other strides: copied to the layout
    elif name == "negative bit":
        xt.data = xt._neg_view()
    else:
        xt.set_(torch.randn(5, 6, generator=GEN))
    for _ in range(2):
        assert rel_err(fn(xt), reference(xt)) < 1e-6


def _function_of_graph():
    g = dg.Graph(name="relu_function")
    x = g.tensor(name="x", dim=[5, 6])
    g.relu(x).set_output(True).set_name("y")
    return g, g.as_function()


@contextlib.contextmanager
def _nothing():
    yield None


def test_a_key_that_claims_to_equal_every_key_is_not_taken_for_the_last_one():
    """The last binding set is matched by comparison without a hash: a key object whose __eq__
    says yes to anything, bound where the graph tensor was, is still refused."""
    class Agreeable:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    g.execute(bindings)
    agreeable = {Agreeable() if key is x else key: value for key, value in bindings.items()}
    bindings[y].fill_(float("nan"))
    with pytest.raises(dg.ExecutionError, match="not a tensor of graph"):
        g.execute(agreeable)
    assert torch.isnan(bindings[y]).all()


def test_a_bound_tensor_that_reports_another_device_at_the_same_address_is_checked_again():
    """A device change at the same address cannot be made on a CPU-only machine (`.data =` refuses
    a meta tensor, and graph tensors have elements, so no address is 0): a tensor subclass whose
    device is a class attribute stands in for one, everything else the same."""
    class Roaming(torch.Tensor):
        where = torch.device("cpu")

        @property
        def device(self):
            return Roaming.where

    g, x, b, y = _graph()
    bindings = _bindings(x, b, y)
    bindings[x] = torch.Tensor._make_subclass(Roaming, bindings[x])
    for _ in range(2):
        g.execute(bindings)
    Roaming.where = torch.device("meta")
    bindings[y].fill_(float("nan"))
    with pytest.raises(dg.ExecutionError, match="meta"):
        g.execute(bindings)
    assert torch.isnan(bindings[y]).all()
