"""Plans on a device other than the current one, checked on CPU: every kernel is compiled, its
module loaded, launched and timed with the tensors' device made current (Triton works on the
current device), the previous device restored after; the device model and the tuning key come
from the tensors' device; bindings on two devices are refused before anything is written.
The tests marked gpu run the same on two real GPUs (skipped with "needs 2 CUDA devices" on one),
and one GPU runs on its current stream with a workspace there."""
import copy
import threading
from types import SimpleNamespace

import pytest
import torch

import dnngraph as dg
import dnngraph.runtime.plan as plan_module
import dnngraph.target as target_module
from dnngraph.runtime import plan_cache as plan_cache
from dnngraph.target import target_of
from dnngraph.runtime import launch as launch_module
from helpers import check, poisoned
from pretend_gpu import PretendDevices, Recorder, patch_current_device, pretend_gpu


def _two_kernel_graph():
    """matmul, then a column softmax and an rmsnorm: three kernels with a workspace between."""
    g = dg.Graph(name="devices")
    x = g.tensor(name="x", dim=[37, 29])
    w = g.tensor(name="w", dim=[29, 19])
    scale = g.tensor(name="scale", dim=[1, 19])
    h = g.matmul(g.relu(x), w)
    y = g.rmsnorm(g.softmax(h, axis=0), scale)[0].set_output(True).set_name("y")
    return g.build(), x, w, scale, y


def _bindings(x, w, scale, y):
    generator = torch.Generator().manual_seed(3)
    return {x: torch.randn(37, 29, generator=generator), w: torch.randn(29, 19, generator=generator),
            scale: torch.rand(1, 19, generator=generator) + 0.5, y: poisoned(y)}


def test_prepared_launches_run_with_the_tensors_device_current(monkeypatch):
    plan_cache.clear()
    g, x, w, scale, y = _two_kernel_graph()
    bindings = _bindings(x, w, scale, y)
    calls = []
    with pretend_gpu(monkeypatch, calls, device_index=1, devices=PretendDevices(current=0)) as devices:
        g.execute(bindings)  # checks, binds, prepares the argument lists
        g.execute(bindings)  # the prepared path
        launches = len(g.plan.launches)
        assert len(calls) == 2 * launches
        assert devices.launched_on == [1] * (2 * launches)
        assert devices.current == 0, "the caller's current device is restored"
        assert set(devices.streams_asked) == {1}, "the current stream of the tensors' device"
        assert ("cuda", 1) in g.plan._by_device
        assert all(1 in launch._bound and 0 not in launch._bound for launch in g.plan.launches)


def test_unaligned_launches_run_with_the_tensors_device_current(monkeypatch):
    plan_cache.clear()
    g, x, w, scale, y = _two_kernel_graph()
    bindings = _bindings(x, w, scale, y)
    storage = torch.randn(37 * 29 + 1)
    bindings[x] = storage[1:].view(37, 29)  # 4 bytes past an aligned address: the JIT path
    seen = []
    with pretend_gpu(monkeypatch, [], device_index=1, devices=PretendDevices(current=0)) as devices:
        monkeypatch.setattr(launch_module.KernelLaunch, "launch_unaligned",
                            lambda self, tensors: seen.append(devices.current))
        g.execute(bindings)
        assert seen == [1] * len(g.plan.launches)
        assert devices.current == 0
        assert set(devices.streams_asked) == {1}


def test_compile_and_module_load_happen_on_the_launch_device(monkeypatch):
    g, *_ = _two_kernel_graph()
    launch = copy.copy(g.plan.launches[0])  # a private copy: its bindings are this test's
    launch._bound, launch._bind_lock = {}, threading.Lock()
    devices = PretendDevices(current=0)
    patch_current_device(monkeypatch, devices)
    seen = {}
    compiled = SimpleNamespace(_init_handles=lambda: seen.setdefault("load", devices.current),
                               run=Recorder([], devices), function=7, packed_metadata=(4, 1, 0),
                               metadata=SimpleNamespace())

    class CompilingKernel:
        fn = launch.kernel.fn  # its generated source is the real kernel's (kernel_source)

        def warmup(self, *args, grid, **options):
            seen["compile"] = devices.current
            return compiled

    launch.kernel = CompilingKernel()
    launch.bind(1, g.plan.dtypes)
    # Triton's _init_handles loads the module into the current device's context: loaded under
    # cuda:0 a kernel for cuda:1 tensors fails to launch ("invalid device context")
    assert seen == {"compile": 1, "load": 1}
    assert devices.current == 0


def test_timing_records_its_events_on_the_launch_device(monkeypatch):
    import triton.testing

    devices = PretendDevices(current=0)
    patch_current_device(monkeypatch, devices)
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **options: devices.launched_on.append(devices.current) or 0.25)
    assert launch_module.time_launches([], {}, torch.device("cuda", 1), {}) == 0.25
    assert devices.launched_on == [1], "do_bench's events are recorded on the current device's stream"
    assert devices.current == 0


def test_target_reads_the_named_device_not_the_current_one(monkeypatch):
    names = {0: "GPU Zero", 1: "GPU One"}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name=names[index], multi_processor_count=100 + index,
                                                      major=9, minor=index, shared_memory_per_block_optin=101376,
                                                      regs_per_multiprocessor=65536,
                                                      max_threads_per_multi_processor=1536))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    target_module._target_of_index.cache_clear()
    try:
        assert target_of("cuda:1").name == "GPU One"
        assert target_of(torch.device("cuda", 1)).sms == 101
        assert target_of(1).capability == (9, 1)
        assert target_of("cuda").name == "GPU Zero"  # no index: the current device
        assert target_of(torch.device("cpu")).name == "interpreter"
    finally:
        target_module._target_of_index.cache_clear()


def test_kernel_device_is_the_tensors_device(monkeypatch):
    monkeypatch.setattr(plan_module, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert plan_module._kernel_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert plan_module._kernel_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(dg.ExecutionError, match="meta"):
        plan_module._kernel_device(torch.device("meta"))


@pytest.mark.parametrize("stray", ["input", "output", "workspace"])
def test_bindings_on_two_devices_are_refused_before_anything_is_written(stray):
    g, x, w, scale, y = _two_kernel_graph()
    bindings = _bindings(x, w, scale, y)
    workspace = None
    if stray == "input":
        bindings[w] = bindings[w].to("meta")
    elif stray == "output":
        bindings[y] = torch.empty(37, 19, device="meta")
    else:
        workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8, device="meta")
    with pytest.raises(dg.ExecutionError, match="meta"):
        g.execute(bindings, workspace=workspace)
    if stray != "output":
        assert torch.isnan(bindings[y]).all(), "nothing was written"
    fn = g.as_function()
    with pytest.raises(dg.ExecutionError, match="one device"):
        fn(bindings[x], torch.randn(29, 19, device="meta"), bindings[scale])


def test_work_on_its_own_thread_returns_its_value_or_raises_its_error():
    """plan.launch.on_own_thread (how persistent workspaces escape a caller's pool routing): the
    value comes back, an exception is raised in the caller, and it runs on another thread, also
    from a thread started after the main thread's work (no executor to be shut down)."""
    import threading

    from dnngraph.runtime.launch import on_own_thread

    caller = threading.get_ident()
    assert on_own_thread(threading.get_ident) != caller
    with pytest.raises(KeyError, match="boom"):
        on_own_thread(lambda: {}["boom"])
    seen = []
    late = threading.Thread(target=lambda: seen.append(on_own_thread(lambda: 7)))
    late.start()
    late.join()
    assert seen == [7]


# --- on real GPUs: a second device, its stream and workspace -------------------------------------
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices")


FIRST, SECOND = torch.device("cuda", 0), torch.device("cuda", 1)


def _graph(io=dg.float32):
    """matmul, a column softmax, an rmsnorm: three kernels with workspace tensors between."""
    g = dg.Graph(name="devices", io_data_type=io)
    x = g.tensor(name="x", dim=[133, 71])
    w = g.tensor(name="w", dim=[71, 45])
    scale = g.tensor(name="scale", dim=[1, 45])
    h = g.matmul(g.relu(x), w)
    g.rmsnorm(g.softmax(h, axis=0), scale)[0].set_output(True).set_name("y")
    return g, x, w, scale


def _inputs(x, w, scale, device, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = {x: torch.randn(133, 71, generator=generator), w: torch.randn(71, 45, generator=generator) / 8,
              scale: torch.rand(1, 45, generator=generator) + 0.5}
    return {key: value.to(device=device, dtype=dtype) for key, value in values.items()}


def _kernel_devices(profile) -> set:
    """The device index of every dnngraph kernel a torch profile saw run."""
    return {event.device_index for event in profile.events()
            if event.name.startswith("dnngraph_") and event.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("io, dtype", [(dg.float32, torch.float32), (dg.bfloat16, torch.bfloat16)])
def test_tensors_on_cuda1_run_on_cuda1(io, dtype):
    g, x, w, scale = _graph(io)
    with torch.cuda.device(FIRST):
        g.build()
        inputs = _inputs(x, w, scale, SECOND, dtype)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            outputs = check(g, inputs, dtype, device=SECOND)
            torch.cuda.synchronize(SECOND)
        assert torch.cuda.current_device() == 0, "execute restores the caller's device"
    assert outputs["y"].device == SECOND
    assert _kernel_devices(profile) == {1}, "every kernel ran on the tensors' device"
    assert ("cuda", 1) in g.plan._by_device
    assert all(1 in launch._bound for launch in g.plan._by_device[("cuda", 1)].launches)


@pytest.mark.gpu
@needs_two_gpus
def test_graph_built_on_cuda0_runs_on_cuda1_with_its_own_workspace():
    g, x, w, scale = _graph()
    with torch.cuda.device(FIRST):
        g.build()
        assert g.plan.workspace_bytes > 0
        check(g, _inputs(x, w, scale, FIRST), device=FIRST)
        side = torch.cuda.Stream(device=SECOND)
        with torch.cuda.stream(side):  # makes cuda:1 current: make cuda:0 current again inside
            with torch.cuda.device(FIRST):
                assert torch.cuda.current_stream(SECOND) == side
                check(g, _inputs(x, w, scale, SECOND, seed=1), device=SECOND)
        side.synchronize()
    workspaces = {key: shared.buffer.device for key, shared in g.plan._streams.items()}
    first_stream = torch.cuda.default_stream(FIRST).cuda_stream
    assert workspaces == {("cuda", 0, first_stream): FIRST, ("cuda", 1, side.cuda_stream): SECOND}
    assert g.plan.workspace_size(SECOND) == g.plan.workspace_size(FIRST)


@pytest.mark.gpu
@needs_two_gpus
def test_caller_workspace_must_be_on_the_tensors_device():
    g, x, w, scale = _graph()
    g.build()
    inputs = _inputs(x, w, scale, SECOND)
    y = poisoned(g.tensor_by_name("y"), SECOND)
    wrong = torch.empty(g.plan.workspace_size(SECOND), dtype=torch.uint8, device=FIRST)
    with pytest.raises(dg.ExecutionError, match="workspace is on cuda:0"):
        g.execute({**inputs, "y": y}, workspace=wrong)
    assert torch.isnan(y).all()
    right = torch.empty(g.plan.workspace_size(SECOND), dtype=torch.uint8, device=SECOND)
    with torch.cuda.device(FIRST):
        g.execute({**inputs, "y": y}, workspace=right)
    assert not torch.isnan(y).any()


@pytest.mark.gpu
@needs_two_gpus
def test_as_function_on_cuda1_forward_and_backward():
    g, x, w, scale = _graph()
    fn = g.as_function()
    inputs = _inputs(x, w, scale, SECOND)
    leaves = [value.clone().requires_grad_(True) for value in inputs.values()]
    with torch.cuda.device(FIRST):
        y = fn(*leaves)
        assert y.device == SECOND
        weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(SECOND)
        (y * weight).sum().backward()
    reference = [value.detach().cpu().double().requires_grad_(True) for value in inputs.values()]
    x64, w64, scale64 = reference
    h = torch.softmax(torch.relu(x64) @ w64, dim=0)
    y64 = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * scale64
    (y64 * weight.cpu().double()).sum().backward()
    assert (y.detach().cpu().double() - y64.detach()).norm() / y64.norm() < 2e-5
    for leaf, expected in zip(leaves, reference):
        assert leaf.grad.device == SECOND
        error = (leaf.grad.cpu().double() - expected.grad).norm() / expected.grad.norm()
        assert error < 1e-4, error.item()


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("stray", ["input", "output"])
def test_bindings_on_two_gpus_are_refused_before_anything_is_written(stray):
    g, x, w, scale = _graph()
    g.build()
    inputs = _inputs(x, w, scale, SECOND)
    y = poisoned(g.tensor_by_name("y"), SECOND)
    if stray == "input":
        inputs[w] = inputs[w].to(FIRST)
    else:
        y = poisoned(g.tensor_by_name("y"), FIRST)
    with pytest.raises(dg.ExecutionError, match="bind every tensor on one device"):
        g.execute({**inputs, "y": y})
    assert torch.isnan(y).all(), "nothing was written"
    with pytest.raises(dg.ExecutionError, match="one device"):
        g.as_function()(inputs[x], inputs[w].to(FIRST), inputs[scale])


@pytest.mark.gpu
@needs_two_gpus
def test_target_and_tuning_key_name_the_tensors_gpu():
    assert target_of(SECOND).name == torch.cuda.get_device_properties(1).name
    with torch.cuda.device(FIRST):
        assert target_of(SECOND).capability == torch.cuda.get_device_capability(1)


@pytest.mark.gpu
def test_one_gpu_runs_on_its_current_stream_with_a_workspace_there():
    g, x, w, scale = _graph()
    g.build()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        check(g, _inputs(x, w, scale, FIRST), device=FIRST)
    side.synchronize()
    assert [key[2] for key in g.plan._streams] == [side.cuda_stream]
