"""Runtime latency: host microseconds per execute (one kernel, four kernels) against a torch eager
op, a CUDA graph replay, the cuDNN frontend's execute and an as_function call; and build times:
an identical graph rebuilt in the same process, a new graph whose kernels are on disk (warm
process), the first build in a fresh process with everything on disk, and the cold build of the
Llama MLP (nothing on disk).  python benchmarks/bench_latency.py [--cudnn-fe-path DIR] [--executes-only]"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

import dnngraph as dg
from dnngraph.runtime import plan_cache as plan_cache
from common import host_overhead_us, print_table, write_json

EXECUTES = 3000
REBUILDS = 51


def one_kernel(name="one"):
    g = dg.Graph(name=name)
    x = g.tensor(name="x", dim=[1024])
    g.relu(x).set_output(True).set_name("y")
    return g


def four_kernels(name="four"):
    """matmul -> row softmax -> matmul -> row sum: four kernels."""
    g = dg.Graph(name=name)
    a, b, c = (g.tensor(name=n, dim=[64, 64]) for n in ("a", "b", "c"))
    y = g.matmul(g.softmax(g.matmul(a, b), axis=1), c)
    g.reduction(y, "sum", [1]).set_output(True).set_name("y")
    return g


def llama_mlp(hidden=4096, inner=14336, tokens=64):
    """down(silu(x @ gate) * (x @ up)) in bf16."""
    g = dg.Graph(name="llama_mlp", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[tokens, hidden])
    gate, up, down = (g.tensor(name=n, dim=d) for n, d in (("gate", [hidden, inner]), ("up", [hidden, inner]),
                                                           ("down", [inner, hidden])))
    g.matmul(g.mul(g.silu(g.matmul(x, gate)), g.matmul(x, up)), down).set_output(True).set_name("y")
    return g


def bindings_of(g):
    values = {t: torch.randn(t.dim, device="cuda").to(t.data_type.torch_dtype) for t in g.inputs()}
    values.update({t: torch.empty(t.dim, device="cuda", dtype=t.data_type.torch_dtype) for t in g.outputs()})
    return values


def cudnn_frontend_relu(path):
    """(execute callable, error) of a one-op cuDNN frontend graph on the same [1024] relu."""
    if path:
        sys.path.insert(0, path)
    try:
        import cudnn
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    x, y = torch.randn(1, 1, 1024, device="cuda"), torch.empty(1, 1, 1024, device="cuda")
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    xt = graph.tensor_like(x)
    yt = graph.relu(input=xt)
    yt.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    graph.build([cudnn.heur_mode.A])
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    pack = {xt: x, yt: y}
    return (lambda: graph.execute(pack, workspace)), None


def execute_rows(fe_path):
    rows = []
    g1 = one_kernel().build()
    b1 = bindings_of(g1)
    rows.append(("dnngraph execute, 1 kernel", host_overhead_us(lambda: g1.execute(b1), EXECUTES)))
    g4 = four_kernels().build()
    b4 = bindings_of(g4)
    rows.append((f"dnngraph execute, {len(g4.plan.launches)} kernels", host_overhead_us(lambda: g4.execute(b4), EXECUTES)))
    fn = one_kernel("fn").as_function()
    x = torch.randn(1024, device="cuda")
    rows.append(("dnngraph as_function call, 1 kernel", host_overhead_us(lambda: fn(x), EXECUTES)))
    y = torch.empty_like(x)
    rows.append(("torch eager op (clamp_min, out=)", host_overhead_us(lambda: torch.clamp(x, min=0, out=y), EXECUTES)))
    graph = torch.cuda.CUDAGraph()
    g1.execute(b1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        g1.execute(b1)
    rows.append(("CUDA graph replay (dnngraph, 1 kernel)", host_overhead_us(graph.replay, EXECUTES)))
    fe, error = cudnn_frontend_relu(fe_path)
    rows.append(("cuDNN frontend execute, 1 op", host_overhead_us(fe, EXECUTES) if fe else f"n/a ({error})"))
    return rows


def _in_fresh_process(code: str, cache: str) -> float:
    """Seconds a snippet reports from a fresh interpreter with DNNGRAPH_CACHE_DIR=cache."""
    env = dict(os.environ, DNNGRAPH_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def build_rows():
    rows, samples = [], []
    for _ in range(REBUILDS):  # the graph made outside the timing: build() alone, median
        g = one_kernel("again")
        start = time.perf_counter()
        g.build()
        samples.append((time.perf_counter() - start) * 1e3)
    rows.append(("identical graph rebuilt, same process (median)", sorted(samples)[len(samples) // 2]))
    g = one_kernel("warm")
    plan_cache.clear()  # a build that misses, its kernels loaded already
    start = time.perf_counter()
    g.build()
    g.execute(bindings_of(g))
    torch.cuda.synchronize()
    rows.append(("new graph, kernels on disk, warm process (build + first execute)",
                 (time.perf_counter() - start) * 1e3))
    here = os.path.dirname(os.path.abspath(__file__))
    snippet = ("import time; t = time.perf_counter(); import torch, dnngraph as dg, sys; "
               f"sys.path.insert(0, {here!r}); from bench_latency import one_kernel, bindings_of; "
               "g = one_kernel().build(); g.execute(bindings_of(g)); torch.cuda.synchronize(); "
               "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        _in_fresh_process(snippet, cache)  # compiles into the cache
        rows.append(("first build, fresh process, everything on disk (import + build + execute)",
                     _in_fresh_process(snippet, cache) * 1e3))
    mlp = snippet.replace("one_kernel", "llama_mlp")
    with tempfile.TemporaryDirectory() as cache:
        rows.append(("Llama MLP cold build, nothing on disk (import + build + execute)",
                     _in_fresh_process(mlp, cache) * 1e3))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cudnn-fe-path", default=None)
    parser.add_argument("--executes-only", action="store_true",
                        help="only the host-time rows (seconds), not the build rows (fresh processes, a cold build)")
    args = parser.parse_args()
    executes = execute_rows(args.cudnn_fe_path)
    print_table(f"host us per call ({torch.cuda.get_device_name()})", ["what", "us"],
                [(w, f"{v:.1f}" if isinstance(v, float) else v) for w, v in executes])
    if args.executes_only:
        write_json("latency.json", {"executes": executes})
        return
    builds = build_rows()
    print_table("build times", ["what", "ms"], [(w, f"{v:.2f}" if v < 100 else f"{v:.0f}") for w, v in builds])
    write_json("latency.json", {"executes": executes, "builds": builds})


if __name__ == "__main__":
    main()
