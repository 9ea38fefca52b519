"""A pretend GPU for CPU tests of the CUDA execute path: plans take the bound-launch path with
recording launchers, torch's current CUDA device is a counter, and each launch records the
device that was current when it ran."""
import contextlib
import time
from types import SimpleNamespace

import torch

import dnngraph.runtime.plan as plan_module
from dnngraph.runtime import plan_cache as plan_cache
from dnngraph.runtime import launch as launch_module

STREAM = 1234  # the raw stream every pretend device reports as current


class PretendDevices:
    """Stands in for torch's current CUDA device (torch.cuda._exchange_device and
    _maybe_exchange_device, which torch.cuda.device uses too)."""

    def __init__(self, current: int = 0):
        self.current = current
        self.launched_on = []  # the current device at each recorded launch
        self.streams_asked = []  # the device index of each current-stream query

    def exchange(self, index: int) -> int:
        if index < 0:
            return -1
        previous, self.current = self.current, index
        return previous

    def current_stream(self, index) -> int:
        self.streams_asked.append(index)
        return STREAM


class Recorder:
    """Stands in for Triton's compiled launcher: records what each launch was given, and on which
    device."""

    launch_cooperative_grid = launch_pdl = False

    def __init__(self, calls, devices: PretendDevices):
        self.calls, self.devices = calls, devices

    def __call__(self, *args):
        self.devices.launched_on.append(self.devices.current)
        self.calls.append(("run", args))

    def launch(self, *args):
        self.devices.launched_on.append(self.devices.current)
        self.calls.append(("launch", args))


def patch_current_device(monkeypatch, devices: PretendDevices):
    """Make `devices` torch's current CUDA device for the test."""
    monkeypatch.setattr(torch.cuda, "_exchange_device", devices.exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", devices.exchange)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", devices.current_stream, raising=False)


@contextlib.contextmanager
def pretend_gpu(monkeypatch, calls, device_index: int = 0, devices: PretendDevices = None):
    """Plans run CPU tensors as if they lived on cuda:`device_index`, launching Recorders."""
    devices = devices if devices is not None else PretendDevices()
    cpu_target = plan_module.target_of(torch.device("cpu"))

    def compile_recording(self, index, dtypes_of):
        compiled = SimpleNamespace(_init_handles=lambda: None, run=Recorder(calls, devices), function=7,
                                   packed_metadata=(4, 1, 0))
        return launch_module.BoundLaunch(compiled, self.grid, self.template, self.slots, None)

    monkeypatch.setattr(plan_module, "_kernel_device", lambda device: torch.device("cuda", device_index))
    monkeypatch.setattr(plan_module, "target_of", lambda device=None: cpu_target)
    monkeypatch.setattr(launch_module.KernelLaunch, "_compile", compile_recording)
    patch_current_device(monkeypatch, devices)
    try:
        yield devices
    finally:
        plan_cache.clear()  # the recording bindings stay with these plans' launches


# --- a pretend GPU whose compiled launchers compute: the prepared argument lists, run --------------
class LiveMemory:
    """The CPU memory kernels of a pretend GPU may address: the tensors a test binds now and every
    workspace a plan allocates. An address no live tensor holds fails the test (a stale binding:
    a launch prepared for memory that is no longer bound)."""

    def __init__(self):
        self.bound = []  # the tensors of the current binding set (and a caller's workspace)
        self.workspaces = []  # every persistent workspace made while the pretend GPU lasts

    def tensor_at(self, address: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of `dtype` from `address` to the end of the live storage holding it."""
        for tensor in self.bound + self.workspaces:
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            if base <= address <= base + storage.nbytes():
                offset, misaligned = divmod(address - base, dtype.itemsize)
                assert not misaligned, f"address {address:#x} is not a multiple of {dtype} into its storage"
                count = (storage.nbytes() - (address - base)) // dtype.itemsize
                return torch.empty(0, dtype=dtype).set_(storage, offset, (count,), (1,))
        raise AssertionError(f"a launch addressed {address:#x}, which no live binding or workspace holds")


class InterpretingLauncher:
    """Stands in for Triton's compiled launcher of one kernel, and computes: each pointer argument
    (an address in the prepared list) becomes a view of the live memory at that address, and the
    kernel runs through Triton's interpreter on the grid it was given. `launch` is the generated C
    entry point's signature (grid, stream, function, cooperative, pdl, global scratch, profile
    scratch, packed metadata, launch metadata, enter and exit hooks, kernel arguments); calling the
    launcher itself is CudaLauncher.__call__'s (grid, stream, function, then the rest after the
    scratch), which allocates the scratch and calls `launch`."""

    launch_cooperative_grid = launch_pdl = False

    def __init__(self, kernel_launch, dtypes_of: dict, memory: LiveMemory, calls: list, profile_scratch_size: int,
                 pause_s: float = 0.0):
        self.kernel = kernel_launch.kernel
        self.pointers = {position: dtypes_of[uid] for position, uid in kernel_launch.slots}
        self.memory, self.calls = memory, calls
        self.profile_scratch_size = profile_scratch_size
        self.pause_s = pause_s  # after each kernel, as a GPU's asynchronous launch lets other threads run

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *rest):
        self.calls.append(("run", (grid_x, grid_y, grid_z, stream, function, *rest)))
        self._run((grid_x, grid_y, grid_z), rest[4:])  # packed and launch metadata, two hooks, then the kernel's

    def launch(self, grid_x, grid_y, grid_z, stream, function, cooperative, pdl, global_scratch, profile_scratch,
               packed_metadata, launch_metadata, enter_hook, exit_hook, *args):
        self.calls.append(("launch", (grid_x, grid_y, grid_z, stream, function, cooperative, pdl, global_scratch,
                                      profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)))
        self._run((grid_x, grid_y, grid_z), args)

    def _run(self, grid, args):
        from dnngraph.runtime.interpreter import run_interpreted
        from dnngraph.runtime.launch import INTERPRETER_LOCK

        values = list(args)
        for position, dtype in self.pointers.items():
            assert isinstance(values[position], int), f"argument {position} is {type(values[position]).__name__}, " \
                                                      f"not a device address"
            values[position] = self.memory.tensor_at(values[position], dtype)
        with INTERPRETER_LOCK:
            run_interpreted(self.kernel, grid, values)
        if self.pause_s:
            time.sleep(self.pause_s)


@contextlib.contextmanager
def interpreting_gpu(monkeypatch, memory: LiveMemory, calls: list, profile_scratch_size: int = 0,
                     pause_s: float = 0.0):
    """Plans run CPU tensors as if they lived on cuda:0, through the prepared launch path (argument
    lists of addresses made once per binding set and stream), with launchers that compute through
    Triton's interpreter on the memory at those addresses. A launcher without profiling scratch is
    called at its C entry point `launch`, as on a GPU; `profile_scratch_size` > 0 takes the
    launcher's own call instead. `pause_s`: each launcher sleeps that long after its kernel, so
    that threads executing at once take turns between kernels."""
    devices = PretendDevices()
    cpu_target = plan_module.target_of(torch.device("cpu"))
    made = plan_module.persistent_buffer

    def compile_interpreting(self, index, dtypes_of):
        launcher = InterpretingLauncher(self, dtypes_of, memory, calls, profile_scratch_size, pause_s)
        compiled = SimpleNamespace(_init_handles=lambda: None, run=launcher, function=7, packed_metadata=(4, 1, 0))
        return launch_module.BoundLaunch(compiled, self.grid, self.template, self.slots, None)

    def workspace_made(nbytes, device):
        buffer = made(nbytes, device)
        memory.workspaces.append(buffer)
        return buffer

    plan_cache.clear()  # launches bound here, not ones another test bound to its recorders
    monkeypatch.setattr(plan_module, "_kernel_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(plan_module, "target_of", lambda device=None: cpu_target)
    monkeypatch.setattr(plan_module, "persistent_buffer", workspace_made)
    monkeypatch.setattr(launch_module.KernelLaunch, "_compile", compile_interpreting)
    patch_current_device(monkeypatch, devices)
    try:
        yield devices
    finally:
        plan_cache.clear()
