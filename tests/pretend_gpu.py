"""A pretend GPU for CPU tests of the CUDA execute path: plans take the bound-launch path with
recording launchers, torch's current CUDA device is a counter, and each launch records the
device that was current when it ran."""
import contextlib
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
