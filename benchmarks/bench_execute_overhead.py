"""Host time of one execute of a two-kernel graph with a workspace, by where the workspace comes
from: the plan's per-stream one, a caller's buffer reused, or a caller's buffer allocated through
torch's caching allocator on every execute. Also the concurrent throughput of THREADS threads on
their own streams.  python benchmarks/bench_execute_overhead.py"""
import threading
import time

import torch

import dnngraph as dg
from common import host_overhead_us

EXECUTES = 3000
THREADS = 8


def _graph():
    g = dg.Graph(name="colsoftmax_rmsnorm")
    x = g.tensor(name="x", dim=[64, 64])
    scale = g.tensor(name="scale", dim=[1, 64])
    y, _ = g.rmsnorm(g.softmax(x, axis=0), scale)
    y.set_output(True)
    return g.build(), x, scale, y


def _threaded_us(g, bindings) -> float:
    """Wall microseconds per execute with THREADS threads executing at once on own streams."""
    def work():
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(EXECUTES // THREADS):
                g.execute(bindings)
    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (EXECUTES // THREADS * THREADS) * 1e6


def main():
    g, x, scale, y = _graph()
    bindings = {x: torch.randn(64, 64, device="cuda"), scale: torch.rand(1, 64, device="cuda"),
                y: torch.empty(64, 64, device="cuda")}
    size = g.plan.workspace_size("cuda")
    reused = torch.empty(size, dtype=torch.uint8, device="cuda")
    rows = [("plan workspace (per stream)", lambda: g.execute(bindings)),
            ("caller workspace, reused", lambda: g.execute(bindings, workspace=reused)),
            ("caller workspace, torch.empty per execute",
             lambda: g.execute(bindings, workspace=torch.empty(size, dtype=torch.uint8, device="cuda")))]
    print(f"host time per execute, {len(g.plan.launches)} kernels, workspace {size} bytes "
          f"({torch.cuda.get_device_name()})")
    for label, run in rows:
        print(f"  {label:45s} {host_overhead_us(run, EXECUTES):7.1f} us")
    print(f"  {THREADS} threads on own streams (wall / execute)   {_threaded_us(g, bindings):7.1f} us")


if __name__ == "__main__":
    main()
