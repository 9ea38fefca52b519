"""Host microseconds per execute of dnngraph's own Python, on any machine (no GPU needed).

The CUDA execute path runs with Triton's launcher replaced by a no-op: the plan is "bound" for a
pretend GPU whose compiled kernels do nothing, so what is timed is everything dnngraph does per
execute (resolve and check the bindings, find the launches and the stream's workspace, fill
each launch's arguments) and nothing of Triton's launcher or the driver. Also the time of a
second build of an identical graph (a plan-cache hit) and of a build that misses.

    python benchmarks/bench_host.py [--executes N] [--cpu-time]

--cpu-time times with the process's CPU time instead of the wall clock: on a machine shared with
other work, the time this process waits for a core is then left out (caches shared with the other
work still slow it down).
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dnngraph

import dnngraph as dg  # noqa: E402
import dnngraph.runtime.plan as plan_module  # noqa: E402
from bench_latency import four_kernels, one_kernel  # noqa: E402  (the same graphs)
from dnngraph.runtime import launch as launch_module  # noqa: E402

EXECUTES = 20000
REPEATS = 5  # the median of this many timed loops is reported
BUILDS = 200
clock = time.perf_counter  # --cpu-time: time.process_time


def bindings_of(g):
    values = {t: torch.randn(t.dim).to(t.data_type.torch_dtype) for t in g.inputs()}
    values.update({t: torch.empty(t.dim, dtype=t.data_type.torch_dtype) for t in g.outputs()})
    return values


class _NoOpLauncher:
    """Stands in for Triton's compiled launcher: takes the arguments, launches nothing. Its C entry
    point `launch` is a C builtin that takes any positional arguments and does nothing with them
    (str.format of an empty string), as the generated launcher is a C function: a Python stand-in
    would add a frame per kernel that is neither dnngraph's nor Triton's."""

    launch_cooperative_grid = launch_pdl = False
    launch = "".format

    def __call__(self, *args):
        return None


def _fake_compiled():
    return SimpleNamespace(_init_handles=lambda: None, run=_NoOpLauncher(), function=0, packed_metadata=(),
                           metadata=SimpleNamespace(global_scratch_size=0, num_ctas=1))


@contextlib.contextmanager
def pretend_gpu():
    """Make CPU tensors take the CUDA execute path, with every kernel a no-op."""
    saved = {
        (plan_module, "_kernel_device"): plan_module._kernel_device,
        (launch_module.KernelLaunch, "_compile"): launch_module.KernelLaunch._compile,
        (torch._C, "_cuda_getCurrentRawStream"): getattr(torch._C, "_cuda_getCurrentRawStream", None),
        (torch.cuda, "_exchange_device"): torch.cuda._exchange_device,
        (torch.cuda, "_maybe_exchange_device"): torch.cuda._maybe_exchange_device,
    }
    cpu_target = plan_module.target_of(torch.device("cpu"))
    saved[(plan_module, "target_of")] = plan_module.target_of

    def compile_no_op(self, device_index, dtypes_of):
        return launch_module.BoundLaunch(_fake_compiled(), self.grid, self.template, self.slots, None)

    plan_module._kernel_device = lambda device: torch.device("cuda", 0)
    plan_module.target_of = lambda device=None: cpu_target
    launch_module.KernelLaunch._compile = compile_no_op
    # builtins that take the device index and give back an int, as the C functions of a CUDA
    # build of torch do (a CPU-only torch has none: its Python stand-ins raise)
    torch._C._cuda_getCurrentRawStream = abs
    torch.cuda._exchange_device = torch.cuda._maybe_exchange_device = abs
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _per_call_us(fn, iterations: int) -> float:
    for _ in range(min(iterations, 1000)):
        fn()
    samples = []
    for _ in range(REPEATS):
        start = clock()
        for _ in range(iterations):
            fn()
        samples.append((clock() - start) / iterations * 1e6)
    return statistics.median(samples)


def eager_row(executes: int) -> tuple:
    """A torch eager op on this machine's CPU, for scale: clamp_min(x, 0) (relu) of [1024] into a given tensor (its
    host time includes the CPU's work on 1024 values, which a GPU op's does not)."""
    x, y = torch.randn(1024), torch.empty(1024)
    return "torch eager clamp_min(out=), [1024] on the CPU (for scale)", _per_call_us(lambda: torch.clamp_min(x, 0.0, out=y),
                                                                                   executes)


def execute_rows(executes: int) -> list:
    rows = [eager_row(executes)]
    for make in (one_kernel, four_kernels):
        g = make().build()
        bindings = bindings_of(g)
        with pretend_gpu():
            g.execute(bindings)  # binds the no-op launches
            us = _per_call_us(lambda: g.execute(bindings), executes)
        rows.append((f"execute, {len(g.plan.launches)} kernel(s), same tensors", us))
        with pretend_gpu():
            fresh = [bindings_of(g) for _ in range(64)]
            cycle = iter(range(10 ** 9))
            us = _per_call_us(lambda: g.execute(fresh[next(cycle) % len(fresh)]), executes)
        rows.append((f"execute, {len(g.plan.launches)} kernel(s), 64 binding sets in turn", us))
    return rows + [function_row(executes)]


def function_row(executes: int) -> tuple:
    """An as_function call of the one-kernel graph: its output allocated by the call (a torch.empty
    of [1024] on the CPU: the allocation is in it, as in torch's eager relu)."""
    g = one_kernel("function")
    fn = g.as_function()
    x = torch.randn(1024)
    with pretend_gpu():
        fn(x)  # builds and binds the no-op launch
        us = _per_call_us(lambda: fn(x), executes)
    return "as_function call, 1 kernel(s), same input", us


def build_rows() -> list:
    rows = []
    for make in (one_kernel, four_kernels):
        make().build()  # kernels generated and loaded, the plan cached where there is a cache
        graphs = [make("again") for _ in range(BUILDS)]
        start = time.perf_counter()
        for g in graphs:
            g.build()
        rows.append((f"identical graph rebuilt ({make.__name__})", (time.perf_counter() - start) / BUILDS * 1e3))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executes", type=int, default=EXECUTES)
    parser.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (a shared machine)")
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.cpu_time else time.perf_counter
    print("| host time (no-op launcher, CPU) | us per call |\n|---|---|")
    for what, us in execute_rows(args.executes):
        print(f"| {what} | {us:.2f} |")
    print("\n| build | ms |\n|---|---|")
    for what, ms in build_rows():
        print(f"| {what} | {ms:.3f} |")


if __name__ == "__main__":
    main()
