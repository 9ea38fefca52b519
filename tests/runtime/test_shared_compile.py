"""Kernels are named by content, so the same kernel of several groups (a ResNet's repeated blocks)
is one JITFunction; each of its compiles happens once per process, even when several threads ask
for it at once. The key is the kernel object, Triton's warmup arguments with their types, the
options, the device and Triton's debug state."""
import copy
import threading
import time
from types import SimpleNamespace

import pytest

import torch

import dnngraph as dg
from dnngraph.runtime import launch as launch_module
from dnngraph.runtime.launch import shared_compile


def _plan_launches(second="relu"):
    """Launches of relu(a @ w1), second(b @ w2) and relu(b @ w1): the first and last run one
    kernel (their groups differ in position, nodes and tensors alone)."""
    g = dg.Graph(name="blocks", io_data_type=dg.float32)
    a, b = g.tensor(name="a", dim=[8, 16]), g.tensor(name="b", dim=[8, 16])
    w1, w2 = g.tensor(name="w1", dim=[16, 8]), g.tensor(name="w2", dim=[16, 8])
    g.relu(g.matmul(a, w1)).set_output(True).set_name("y1")
    getattr(g, second)(g.matmul(b, w2)).set_output(True).set_name("y2")
    g.relu(g.matmul(b, w1)).set_output(True).set_name("y3")
    g.build()
    return g.plan.launches


def test_groups_of_one_kernel_share_one_jit_function():
    first, other, last = _plan_launches("sigmoid")
    assert first.kernel is last.kernel and first.source_path == last.source_path
    assert first.group is not last.group
    assert other.kernel is not first.kernel


def test_shared_compile_runs_once_per_key_across_threads(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    calls, results = [], []

    def slow():
        calls.append(1)
        time.sleep(0.05)
        return object()
    threads = [threading.Thread(target=lambda: results.append(shared_compile("k", slow))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 6 and all(r is results[0] for r in results)
    assert shared_compile("other", object) is not results[0]


def test_a_failed_compile_raises_and_is_tried_again(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})

    def broken():
        raise RuntimeError("ptxas said no")
    with pytest.raises(RuntimeError, match="ptxas"):
        shared_compile("k", broken)
    made = object()
    assert shared_compile("k", lambda: made) is made


class _FakeKernel:
    """Stands in for a JITFunction: counts warmups (slowly, so that threads overlap), returns a
    compiled stand-in."""

    def __init__(self, name, warmups, delay=0.0):
        self.__name__, self.warmups, self.delay = name, warmups, delay

    def warmup(self, *args, grid, **options):
        self.warmups.append((self.__name__, args, options))
        time.sleep(self.delay)
        compiled = SimpleNamespace(run=lambda *a: None, function=len(self.warmups), packed_metadata=(4, 1, 0),
                                   metadata=SimpleNamespace(global_scratch_size=0), module=None)
        compiled._init_handles = lambda: setattr(compiled, "module", "loaded")
        return compiled


def _faked(monkeypatch, launches, warmups, delay=0.0):
    """Each launch's kernel replaced by a stand-in, one per kernel object (launches that shared a
    JITFunction share its stand-in)."""
    fakes = {}
    for launch in launches:
        fake = fakes.setdefault(id(launch.kernel), _FakeKernel(launch.kernel.__name__, warmups, delay))
        monkeypatch.setattr(launch, "kernel", fake)


def test_launches_share_a_compile_only_where_kernel_arguments_and_options_agree(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    first, other, last = _plan_launches("sigmoid")
    warmups = []
    _faked(monkeypatch, (first, other, last), warmups)
    args = list(first.template)
    assert first._compiled(args, 0) is last._compiled(args, 0)
    assert len(warmups) == 1
    other._compiled(args, 0)
    assert len(warmups) == 2
    for changed in (1, True, 1.0):  # equal in Python, not to Triton's specialization
        last._compiled(args[:-1] + [changed], 0)
    last._compiled(args, 1)  # another device
    assert len(warmups) == 6
    monkeypatch.setattr(last, "num_warps", last.num_warps * 2)
    last._compiled(args, 0)
    assert len(warmups) == 7


def test_one_kernel_warmed_from_many_threads_compiles_once(monkeypatch):
    """Threads binding launches of one kernel at the same moment: one compile, one binary."""
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    first, _, last = _plan_launches("sigmoid")
    warmups = []
    _faked(monkeypatch, (first, last), warmups, delay=0.05)
    args, results = list(first.template), []
    start = threading.Barrier(8)

    def warm(launch):
        start.wait()
        results.append(launch._compiled(args, 0))
    threads = [threading.Thread(target=warm, args=(launch,)) for launch in (first, last) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(warmups) == 1 and len(results) == 8 and all(r is results[0] for r in results)
    assert results[0].module == "loaded"  # loaded before any thread got it


def test_bind_shares_one_compile_and_keeps_each_launch_its_own(monkeypatch):
    """Through bind(), as a plan binds: two launches of one kernel get one compile, loaded
    before it is handed out, and each its own bound launch (grid, arguments); a kernel without
    multiply-add contraction, or with other stages, compiles apart."""
    from pretend_gpu import PretendDevices, patch_current_device
    patch_current_device(monkeypatch, PretendDevices())
    first, _, last = (copy.copy(launch) for launch in _plan_launches("sigmoid"))
    warmups = []
    fake = _FakeKernel(first.kernel.__name__, warmups)
    for launch in (first, last):
        launch._bound, launch._bind_lock = {}, threading.Lock()
        launch.kernel = fake
    dtypes = {uid: torch.float32 for _, uid in first.slots + last.slots}
    bound_first, bound_last = first.bind(0, dtypes), last.bind(0, dtypes)
    assert len(warmups) == 1 and bound_first is not bound_last
    assert bound_first.function == bound_last.function == 1  # one binary
    assert (bound_first.template, bound_first.slots) == (first.template, first.slots)
    assert (bound_last.template, bound_last.slots, bound_last.grid) == (last.template, last.slots, last.grid)
    for change in (dict(fp_fusion=False), dict(num_stages=(last.num_stages or 2) + 1)):
        other = copy.copy(last)
        other._bound, other._bind_lock = {}, threading.Lock()
        for field, value in change.items():
            setattr(other, field, value)
        other.bind(0, dtypes)
    assert len(warmups) == 3
    assert warmups[1][2].get("enable_fp_fusion") is False and "num_stages" in warmups[2][2]


def test_nested_and_debug_state_split_the_key(monkeypatch):
    """Tuples are keyed element by element with types; Triton's debug setting is in the key."""
    import triton
    from dnngraph.runtime.launch import _typed
    assert _typed((1,)) != _typed((True,)) and _typed((0.0,)) != _typed((-0.0,))
    assert _typed((1, (2, 3.5))) == _typed((1, (2, 3.5)))
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    first, _, last = _plan_launches("sigmoid")
    warmups = []
    _faked(monkeypatch, (first, last), warmups)
    first._compiled(list(first.template), 0)
    monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    last._compiled(list(last.template), 0)
    assert len(warmups) == 2


def test_the_key_holds_its_kernel_by_identity(monkeypatch):
    """Two kernel objects are two keys however they hash; the key keeps its kernel alive, so an
    id is never another kernel's while the compiled binary is kept."""
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    first, _, _ = _plan_launches("sigmoid")
    warmups = []

    class SameHash(_FakeKernel):
        def __hash__(self):
            return 1

        def __eq__(self, other):
            return True
    clone = copy.copy(first)
    monkeypatch.setattr(first, "kernel", SameHash("a", warmups))
    monkeypatch.setattr(clone, "kernel", SameHash("b", warmups))
    first._compiled(list(first.template), 0)
    clone._compiled(list(clone.template), 0)
    assert len(warmups) == 2
    assert any(key[0].held is first.kernel for key in launch_module._COMPILED)
