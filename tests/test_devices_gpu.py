"""Plans on a GPU that is not the current one (run on a machine with two CUDA devices; skipped
with "needs 2 CUDA devices" elsewhere): tensors on cuda:1 run on cuda:1 while cuda:0 is current,
on cuda:1's current stream and with a workspace there; as_function (forward and backward) on
cuda:1; bindings on two devices refused before anything is written."""
import pytest
import torch

import dnngraph as dg
from dnngraph.target import target_of
from helpers import check, poisoned

pytestmark = pytest.mark.gpu
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


@needs_two_gpus
def test_target_and_tuning_key_name_the_tensors_gpu():
    assert target_of(SECOND).name == torch.cuda.get_device_properties(1).name
    with torch.cuda.device(FIRST):
        assert target_of(SECOND).capability == torch.cuda.get_device_capability(1)


def test_one_gpu_runs_on_its_current_stream_with_a_workspace_there():
    g, x, w, scale = _graph()
    g.build()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        check(g, _inputs(x, w, scale, FIRST), device=FIRST)
    side.synchronize()
    assert [key[2] for key in g.plan._streams] == [side.cuda_stream]
