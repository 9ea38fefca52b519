"""The workspace: a caller's buffer honoured and checked, one per (device, stream) otherwise,
launches per device model, and executes from several threads at once (CPU, interpreter)."""
import dataclasses
import threading
import time

import pytest
import torch

import dnngraph as dg
import dnngraph.runtime.plan as plan_module
from dnngraph.runtime import plan_cache as plan_cache
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.target import INTERPRETER, target_of
from helpers import check, poisoned, rel_err

SHAPE = (37, 19)


def _softmax_rmsnorm(options=None):
    """A column softmax feeding an rmsnorm (built with `options`): the softmax output lives in
    the workspace."""
    g = dg.Graph(name="colsoftmax_rms")
    x = g.tensor(name="x", dim=list(SHAPE))
    scale = g.tensor(name="scale", dim=[1, SHAPE[1]])
    y, _ = g.rmsnorm(g.softmax(x, axis=0), scale, epsilon=1e-5)
    y.set_output(True)
    return g.build(options=options), x, scale, y


def _inputs(x, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    return {x: torch.randn(SHAPE, generator=generator) * 2, scale: torch.rand(1, SHAPE[1], generator=generator) + 0.5}


SPLIT_ROWS = dg.BuildOptions(row_mode="split", row_loop_tile=16, row_split_min_reduced=8)


def test_caller_workspace_holds_every_internal_tensor():
    """Split row kernels: partials in the workspace besides the virtual tensor."""
    g, x, scale, y = _softmax_rmsnorm(SPLIT_ROWS)
    assert any("(split)" in launch.config_text for launch in g.plan.launches)
    size = g.plan.workspace_size()
    assert size == g.plan.workspace_bytes == g.plan.workspace_size("cpu") > 0
    inputs = _inputs(x, scale, 0)
    workspace = torch.full((size + 512,), 0xFF, dtype=torch.uint8)[256:]  # poisoned, offset view
    out = poisoned(y)
    g.execute({**inputs, y: out}, workspace=workspace)
    assert rel_err(out, g.reference(inputs)[y.name]) < 2e-5
    # the softmax output (first in the layout) is in the caller's buffer, not in a private one
    uid, dim, stride, dtype, nbytes, offset = g.plan.workspace_tensors[0]
    held = workspace[offset:offset + nbytes].view(dtype).as_strided(dim, stride)
    assert rel_err(held, torch.softmax(inputs[x].double(), 0)) < 2e-5
    assert not g.plan._streams, "no per-stream workspace was made"
    # a second execute with other inputs through the same buffer
    inputs = _inputs(x, scale, 1)
    g.execute({**inputs, y: out}, workspace=workspace)
    assert rel_err(out, g.reference(inputs)[y.name]) < 2e-5


def test_workspace_size_covers_split_partials():
    g, *_ = _softmax_rmsnorm(SPLIT_ROWS)
    virtual = SHAPE[0] * SHAPE[1] * 4
    assert g.plan.workspace_bytes > virtual  # the split partials are placed too
    offsets = sorted((entry[5], entry[5] + entry[4]) for entry in g.plan.workspace_tensors)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(offsets, offsets[1:]))
    assert offsets[-1][1] <= g.plan.workspace_bytes


def _bad_workspaces(size, out):
    storage = torch.zeros(2 * size + 64, dtype=torch.uint8)
    # the output is the start of a float buffer whose bytes the workspace would be
    out_backing = out.view(-1).untyped_storage()
    return {
        "too small": (torch.zeros(size - 1, dtype=torch.uint8), "bytes"),
        "wrong dtype": (torch.zeros(size, dtype=torch.float32), "uint8"),
        "wrong device": (torch.zeros(size, dtype=torch.uint8, device="meta"), "is on meta"),
        "not contiguous": (storage[::2], "contiguous"),
        "misaligned": (storage[1:size + 1], "multiple of"),
        "not a tensor": (bytearray(size), "torch.Tensor"),
        "overlaps an output": (torch.empty(0, dtype=torch.uint8).set_(out_backing), "overlaps"),
    }


def test_bad_workspace_is_rejected_and_nothing_is_written():
    g, x, scale, y = _softmax_rmsnorm()
    size = g.plan.workspace_size()
    inputs = _inputs(x, scale, 2)
    backing = torch.full((size,), float("nan"))  # 4 * size bytes: room for the workspace too
    out = backing[:y.dim[0] * y.dim[1]].view(y.dim)
    for what, (workspace, message) in _bad_workspaces(size, out).items():
        before = workspace.clone() if isinstance(workspace, torch.Tensor) and workspace.device.type == "cpu" else None
        with pytest.raises(dg.ExecutionError, match=message):
            g.execute({**inputs, y: out}, workspace=workspace)
        assert torch.isnan(backing).all(), f"{what}: the output was written"
        if before is not None:
            assert torch.equal(workspace, before), f"{what}: the workspace was written"
    assert not g.plan._streams


def test_graph_without_workspace_takes_an_empty_one():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 7], stride=[1, 5])
    y = g.exp(g.mul(x, x))
    y.set_output(True)
    g.build()
    assert g.plan.workspace_size() == 0
    out = poisoned(y)
    inputs = {x: torch.randn(7, 5).t()}
    g.execute({**inputs, y: out}, workspace=torch.empty(0, dtype=torch.uint8))
    assert rel_err(out, g.reference(inputs)[y.name]) < 2e-5


def test_workspace_per_stream_is_made_once_and_apart():
    g, *_ = _softmax_rmsnorm()
    plan = g.plan
    built = plan._launches_for(torch.device("cpu"))
    cpu = torch.device("cpu")
    found = []

    def take(stream):
        found.append((stream, plan._stream_workspace(built, cpu, stream)))

    threads = [threading.Thread(target=take, args=(stream,)) for stream in (11, 22) * 8]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = ({id(w) for s, w in found if s == stream} for stream in (11, 22))
    assert len(first) == len(second) == 1 and first != second
    a, b = (next(w for s, w in found if s == stream) for stream in (11, 22))
    a_start, b_start = a.buffer.data_ptr(), b.buffer.data_ptr()
    assert a_start + a.buffer.numel() <= b_start or b_start + b.buffer.numel() <= a_start
    assert a.buffer.numel() == b.buffer.numel() == plan.workspace_bytes
    assert a.lock is not b.lock


def test_threads_executing_one_plan_get_their_own_results():
    g, x, scale, y = _softmax_rmsnorm()
    inputs = [_inputs(x, scale, 10 + i) for i in range(4)]
    expected = [g.reference(i)[y.name] for i in inputs]
    results, errors = {}, []

    def work(index, with_workspace):
        try:
            for step in range(4):
                out = poisoned(y)
                workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8) if with_workspace else None
                g.execute({**inputs[index], y: out}, workspace=workspace)
                results[(index, step, with_workspace)] = out
        except Exception as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, w)) for i in range(4) for w in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 4 * 4 * 2
    for (index, _, _), out in results.items():
        assert rel_err(out, expected[index]) < 2e-5


def test_bind_compiles_once_under_concurrent_calls(monkeypatch):
    g, *_ = _softmax_rmsnorm()
    launch = g.plan.launches[0]
    compiled = []

    def slow_compile(device_index, dtypes_of):
        time.sleep(0.05)  # wide window for a second thread to compile too
        compiled.append(device_index)
        return object()

    monkeypatch.setattr(launch, "_compile", slow_compile)
    bound = []
    threads = [threading.Thread(target=lambda: bound.append(launch.bind(3, {}))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiled == [3]
    assert len({id(b) for b in bound}) == 1
    plan_cache.clear()  # the launch is shared through the plan cache: drop its fake binding


def test_target_is_taken_for_the_named_device():
    assert target_of("cpu") == target_of(torch.device("cpu")) == INTERPRETER
    assert target_of("cpu").name == "interpreter" and target_of("cpu").capability is None
    if torch.cuda.is_available():
        assert target_of(0).capability == torch.cuda.get_device_capability(0)


def _persistent_matmul():
    g = dg.Graph(name="persistent")
    a = g.tensor(name="a", dim=[3, 45, 24])
    b = g.tensor(name="b", dim=[3, 24, 40])
    c = g.relu(g.matmul(a, b))
    y = g.softmax(c, axis=1)  # a second kernel: the matmul output lives in the workspace
    y.set_output(True)
    return g, a, b, y


def test_a_device_of_another_model_gets_launches_of_its_own(monkeypatch):
    g, a, b, y = _persistent_matmul()
    g.build(options=dg.BuildOptions(matmul_config=mm.MatmulConfig("persistent", 16, 16, 16, 4, 2)))
    first = g.plan.launches[0]
    assert first.config_text.startswith("persistent") and first.grid[0] > 5
    # Tensors now on "another GPU" with 5 SMs: the plan must size its persistent grid for that one.
    small = dataclasses.replace(dg.target.H100, name="small", sms=5)
    monkeypatch.setattr(plan_module, "target_of", lambda device=None: small)
    g.plan._by_device.clear()  # as if the tensors' device had never been seen
    inputs = {a: torch.randn(3, 45, 24), b: torch.randn(3, 24, 40)}
    check(g, inputs)
    derived = g.plan._by_target[(small, True)]  # launch_set_key: (target, interpreted)
    assert derived.launches[0].grid[0] == 5 and derived.launches is not g.plan.launches
    assert g.plan.launches[0] is first  # the build's launches are kept for their target


def test_a_stale_plan_builds_from_its_own_snapshot_not_the_changed_graph(monkeypatch):
    g, x, scale, y = _softmax_rmsnorm()
    plan = g.plan
    inputs = _inputs(x, scale, 3)
    expected = g.reference(inputs)[y.name]
    g.tensor(name="extra", dim=[3])  # the graph changes: its plan is dropped
    y.set_data_type(dg.float16)
    assert g.plan is None
    other = dataclasses.replace(INTERPRETER, name="other", sms=5)
    monkeypatch.setattr(plan_module, "target_of", lambda device=None: other)
    plan._by_device.clear()
    out = poisoned(y).float()  # the plan still computes the graph as it was built: float32 y
    plan.execute({**inputs, y: out})
    assert rel_err(out, expected) < 2e-5


# --- workspace_limit: cuDNN's "specify workspace limit" strategy ---------------------------------------
def _split_k_graph():
    """A matmul the model splits over K (few output tiles, a long K)."""
    g = dg.Graph(name="ws", io_data_type=dg.float32)
    a, b = g.tensor(name="a", dim=[16, 4096]), g.tensor(name="b", dim=[4096, 16])
    g.matmul(a, b).set_output(True).set_name("c")
    return g


def _partial_bytes(g) -> int:
    return sum(s.nbytes for launch in g.plan.launches for s in launch.scratch)


def test_workspace_limit_zero_leaves_split_k_out():
    inputs = {"a": torch.randn(16, 4096), "b": torch.randn(4096, 16)}
    unlimited = _split_k_graph().build()
    assert _partial_bytes(unlimited) > 0, "the model splits this shape: the test needs it to"
    limited = _split_k_graph().build(workspace_limit=0)
    assert _partial_bytes(limited) == 0 and len(limited.plan.launches) == 1
    assert "workspace 0 bytes (limit 0)" in limited.explain()
    assert "need more workspace than the limit" in limited.explain()
    check(limited, inputs)
    # a limit of exactly what the split needs keeps it
    exact = _split_k_graph().build(workspace_limit=_partial_bytes(unlimited))
    assert _partial_bytes(exact) == _partial_bytes(unlimited)


def test_workspace_limit_is_shared_by_the_groups():
    """Two split-K matmuls, room for one: the second takes a config without partials."""
    g = dg.Graph(name="ws2", io_data_type=dg.float32)
    a, b = g.tensor(name="a", dim=[16, 4096]), g.tensor(name="b", dim=[4096, 16])
    g.matmul(a, b).set_output(True).set_name("c")
    g.matmul(a, b).set_output(True).set_name("d")
    one = _partial_bytes(_split_k_graph().build())
    g.build(workspace_limit=one)
    assert _partial_bytes(g) == one
    check(g, {"a": torch.randn(16, 4096), "b": torch.randn(4096, 16)})


def test_wgrad_without_workspace_runs_unsplit():
    g = dg.Graph(name="ws3", io_data_type=dg.float32)
    dy, x = g.tensor(name="dy", dim=[4, 8, 9, 9]), g.tensor(name="x", dim=[4, 3, 9, 9])
    g.conv_wgrad(dy, x, w_dim=[8, 3, 3, 3], padding=[1, 1]).set_output(True).set_name("dw")
    g.build(workspace_limit=0)
    assert len(g.plan.launches) == 1 and _partial_bytes(g) == 0
    check(g, {"dy": torch.randn(4, 8, 9, 9), "x": torch.randn(4, 3, 9, 9)})


@pytest.mark.parametrize("limit", [-1, 1.5, "1", True])
def test_workspace_limit_must_be_a_byte_count(limit):
    with pytest.raises(dg.ValidationError, match="workspace_limit"):
        _split_k_graph().build(workspace_limit=limit)


def test_workspace_limit_zero_leaves_split_rows_out():
    """A column sum over many rows splits its reduction (partials in the workspace); with no
    workspace the row kernel runs unsplit, and the result is the same."""
    x_t = torch.randn(65536, 3)

    def build(**options):
        g = dg.Graph(name="colsum", io_data_type=dg.float32)
        x = g.tensor_like(x_t, name="x")
        g.reduction(x, "sum", [0]).set_output(True).set_name("s")
        return g.build(**options)

    split = build()
    assert _partial_bytes(split) > 0, "the model splits this shape: the test needs it to"
    unsplit = build(workspace_limit=0)
    assert _partial_bytes(unsplit) == 0
    assert "need more workspace than the limit" in unsplit.explain()
    check(unsplit, {"x": x_t})


def test_depthwise_wgrad_without_room_for_its_partials_runs_the_gemm_kernels():
    """The direct depthwise wgrad always keeps partials; under a limit that cannot hold them the
    group runs the implicit-GEMM wgrad, which needs no workspace unsplit (found in review: it
    raised)."""
    g = dg.Graph(name="ws4", io_data_type=dg.float32)
    dy, x = g.tensor(name="dy", dim=[2, 4, 6, 6]), g.tensor(name="x", dim=[2, 4, 6, 6])
    g.conv_wgrad(dy, x, w_dim=[4, 1, 3, 3], padding=[1, 1], groups=4).set_output(True).set_name("dw")
    inputs = {"dy": torch.randn(2, 4, 6, 6), "x": torch.randn(2, 4, 6, 6)}
    g.build()
    assert "depthwise" in g.plan.launches[0].source_path.name
    g.build(workspace_limit=0)
    assert _partial_bytes(g) == 0 and "depthwise" not in g.plan.launches[0].source_path.name
    check(g, inputs)
