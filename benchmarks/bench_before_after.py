"""Kernel time per family for two source trees of dnngraph on the same GPU (a refactor's check).

Each tree is a folder holding a `dnngraph/` package (an old checkout, `git archive` output, ...).
For each tree, one child process imports dnngraph from that tree (PYTHONPATH=<tree> first, its own
fresh DNNGRAPH_CACHE_DIR so no plan or tuning record is shared), builds a fixed list of graphs
through the public API only (Graph, tensor, ops, set_output, build() with default options, so both
trees pick configs by heuristics), runs each once, times it with triton.testing.do_bench (warmup
25, rep 100, median) on random inputs, and prints one JSON line {case: median ms, or the error
text when the case did not build or run}.

The parent runs the trees alternately, before, after, before, after (--rounds), keeps the smaller
median of each case per tree, and prints a markdown table with the ratio before_ms / after_ms
(> 1: the after tree is faster) and a last line with the smallest ratio and its family. With OUT
set, every number goes to $OUT/before_after.json.

    python benchmarks/bench_before_after.py --before /tmp/old --after .            # GPU
    python benchmarks/bench_before_after.py --before /tmp/old --after . --quick    # smaller, fewer
    python benchmarks/bench_before_after.py --before . --after . --cpu-smoke       # interpreter, tiny

--cpu-smoke runs the children on CPU through Triton's interpreter with tiny shapes and times one
call with time.perf_counter: a check that the script and both trees work, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

GOAL = 0.97  # no family should run slower than this fraction of the before tree's speed
JSON_NAME = "before_after.json"

# kind: (family, sizes for the full run, --quick, --cpu-smoke); None: the case is left out of
# that mode (--quick keeps one case per family). A case's name (label) spells the sizes it runs.
CASES = {
    "matmul": ("matmul", (4096, 4096, 4096), (2048, 2048, 2048), (32, 48, 64)),
    "matmul_bias_gelu": ("matmul", (8192, 1024, 4096), None, (64, 32, 48)),
    "conv3x3": ("conv", (32, 56, 56, 64, 64, 3), (8, 56, 56, 64, 64, 3), (2, 6, 6, 8, 8, 3)),
    "conv1x1": ("conv", (32, 28, 28, 256, 512, 1), None, (2, 4, 4, 16, 16, 1)),
    "depthwise": ("depthwise", (32, 112, 112, 96), (8, 56, 56, 96), (2, 6, 6, 8)),
    "sdpa_fwd": ("sdpa_fwd", (4, 16, 2048, 128), (2, 8, 1024, 128), (1, 2, 32, 16)),
    "sdpa_bwd": ("sdpa_bwd", (4, 16, 2048, 128), (2, 8, 1024, 128), (1, 2, 32, 16)),
    "softmax": ("softmax", (8192, 4096), (4096, 4096), (8, 64)),
    "layernorm": ("norm", (8192, 4096), (4096, 4096), (8, 64)),
    "rmsnorm": ("norm", (8192, 4096), None, (8, 64)),
    "pointwise": ("pointwise", (8192, 8192), (4096, 4096), (8, 64)),
    "maxpool": ("pooling", (32, 112, 112, 64), (8, 112, 112, 64), (2, 8, 8, 8)),
    "sum": ("reduction", (8192, 8192), (4096, 4096), (8, 64)),
    "embedding": ("gather", (32000, 4096, 8192), (32000, 4096, 4096), (50, 16, 12)),
}
MODES = {"full": 1, "quick": 2, "cpu": 3}


def label(kind: str, sizes) -> str:
    """The case's name in the table and the JSON: what it computes, at which sizes."""
    x = "x".join
    if kind.startswith("matmul"):
        m, n, k = sizes
        return f"{'matmul+bias+gelu' if kind == 'matmul_bias_gelu' else 'matmul'} {m}x{n}x{k} (MxNxK)"
    if kind.startswith("conv"):
        n, h, w, c, k, r = sizes
        return f"conv fprop {r}x{r} NHWC {n}x{h}x{w}x{c}->{k}"
    if kind in ("depthwise", "maxpool"):
        what = "depthwise conv 3x3" if kind == "depthwise" else "max pool 3x3/2"
        return f"{what} NHWC {x(map(str, sizes))}"
    if kind.startswith("sdpa"):
        b, h, s, d = sizes
        return f"sdpa {kind[5:]} causal B{b} H{h} S{s} D{d}"
    if kind == "pointwise":
        return f"pointwise gelu((x+y)*s) {x(map(str, sizes))}"
    if kind == "sum":
        return f"sum last axis fp32 {x(map(str, sizes))}"
    if kind == "embedding":
        vocab, width, tokens = sizes
        return f"embedding gather {vocab}x{width}, {tokens} ids"
    return f"{kind} {x(map(str, sizes))}"


def case_list(mode: str) -> list:
    """[(name, kind, family, sizes)] for a mode, in CASES order."""
    column = MODES[mode]
    return [(label(kind, spec[column]), kind, spec[0], spec[column])
            for kind, spec in CASES.items() if spec[column] is not None]


# --- child: builds and times the cases of one tree ------------------------------------------------
def _outputs(g, device):
    return {t: _empty(t, device) for t in g.outputs()}


def _empty(t, device):
    import torch
    return torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype, device=device)


def _runner(g, bindings, device):
    """fn() executing the built graph g on bindings plus fresh outputs."""
    bindings = {**bindings, **_outputs(g, device)}
    return lambda: g.execute(bindings)


def _nhwc(torch, shape, device, dtype, scale=1.0):
    return (scale * torch.randn(*shape, device=device)).to(dtype).to(memory_format=torch.channels_last)


def make_case(kind, family, sizes, device, dtype):
    """A fn() that runs the case's built graph (dnngraph imported from the child's tree)."""
    import torch
    import dnngraph as dg
    io = dg.bfloat16 if dtype == torch.bfloat16 else dg.float32

    def randn(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, device=device)).to(dtype)

    if family == "matmul":
        m, n, k = sizes
        g = dg.Graph(name="mm", io_data_type=io)
        a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
        y = g.matmul(a, b)
        bindings = {a: randn(m, k), b: randn(k, n, scale=k ** -0.5)}
        if kind == "matmul_bias_gelu":
            bias = g.tensor(name="bias", dim=[1, n])
            y = g.gelu(g.add(y, bias))
            bindings[bias] = randn(1, n, scale=0.5)
        y.set_output(True)
        g.build()
        return _runner(g, bindings, device)
    if family == "conv":
        n, h, w_, c, k, r = sizes
        xt = _nhwc(torch, (n, c, h, w_), device, dtype)
        wt = _nhwc(torch, (k, c, r, r), device, dtype, scale=(c * r * r) ** -0.5)
        g = dg.Graph(name="conv", io_data_type=io)
        x, w = g.tensor_like(xt, name="x"), g.tensor_like(wt, name="w")
        g.conv_fprop(x, w, padding=[r // 2] * 2, stride=[1, 1], dilation=[1, 1]).set_output(True)
        g.build()
        return _runner(g, {x: xt, w: wt}, device)
    if family == "depthwise":
        n, h, w_, c = sizes
        xt = _nhwc(torch, (n, c, h, w_), device, dtype)
        wt = _nhwc(torch, (c, 1, 3, 3), device, dtype, scale=1 / 3)
        g = dg.Graph(name="depthwise", io_data_type=io)
        x, w = g.tensor_like(xt, name="x"), g.tensor_like(wt, name="w")
        g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=c).set_output(True)
        g.build()
        return _runner(g, {x: xt, w: wt}, device)
    if family in ("sdpa_fwd", "sdpa_bwd"):
        b, heads, s, d = sizes
        qkv = {key: randn(b, heads, s, d) for key in ("q", "k", "v")}
        g = dg.Graph(name="sdpa", io_data_type=io)
        q, k, v = (g.tensor(name=key, dim=[b, heads, s, d]) for key in ("q", "k", "v"))
        o, stats = g.sdpa(q, k, v, attn_scale=d ** -0.5, is_inference=family == "sdpa_fwd",
                          use_causal_mask=True)
        o.set_output(True)
        if stats is not None:
            stats.set_output(True)
        g.build()
        forward = _runner(g, {q: qkv["q"], k: qkv["k"], v: qkv["v"]}, device)
        if family == "sdpa_fwd":
            return forward
        # the backward alone, on the forward's real o and statistics
        outs = {t: _empty(t, device) for t in g.outputs()}
        g.execute({q: qkv["q"], k: qkv["k"], v: qkv["v"], **outs})
        o_t, stats_t = outs[o], outs[stats]
        gb = dg.Graph(name="sdpa_bwd", io_data_type=io)
        q2, k2, v2 = (gb.tensor(name=key, dim=[b, heads, s, d]) for key in ("q", "k", "v"))
        o2, stats2 = gb.tensor_like(o_t, name="o"), gb.tensor_like(stats_t, name="stats")
        do2 = gb.tensor(name="do", dim=[b, heads, s, d])
        for t in gb.sdpa_backward(q2, k2, v2, o2, do2, stats2, attn_scale=d ** -0.5, use_causal_mask=True):
            t.set_output(True)
        gb.build()
        return _runner(gb, {q2: qkv["q"], k2: qkv["k"], v2: qkv["v"], o2: o_t, stats2: stats_t,
                            do2: randn(b, heads, s, d)}, device)
    if family in ("softmax", "norm", "pointwise"):
        rows, cols = sizes
        g = dg.Graph(name=family, io_data_type=io)
        x = g.tensor(name="x", dim=[rows, cols])
        bindings = {x: randn(rows, cols)}
        if family == "softmax":
            g.softmax(x, axis=-1).set_output(True)
        elif kind == "layernorm":
            scale, bias = g.tensor(name="scale", dim=[1, cols]), g.tensor(name="bias", dim=[1, cols])
            y = g.layernorm(x, scale, bias, epsilon=1e-5, norm_forward_phase="inference")[0]
            y.set_output(True)
            bindings.update({scale: randn(1, cols, scale=0.1, shift=1.0), bias: randn(1, cols, scale=0.1)})
        elif kind == "rmsnorm":
            scale = g.tensor(name="scale", dim=[1, cols])
            g.rmsnorm(x, scale, epsilon=1e-5, norm_forward_phase="inference")[0].set_output(True)
            bindings[scale] = randn(1, cols, scale=0.1, shift=1.0)
        else:
            other, scale = g.tensor(name="y", dim=[rows, cols]), g.tensor(name="scale", dim=[1, cols])
            g.gelu(g.mul(g.add(x, other), scale)).set_output(True)
            bindings.update({other: randn(rows, cols), scale: randn(1, cols, scale=0.1, shift=1.0)})
        g.build()
        return _runner(g, bindings, device)
    if family == "pooling":
        n, h, w_, c = sizes
        xt = _nhwc(torch, (n, c, h, w_), device, dtype)
        g = dg.Graph(name="pool", io_data_type=io)
        x = g.tensor_like(xt, name="x")
        g.pooling(x, mode="max", window=[3, 3], stride=[2, 2], padding=[1, 1]).set_output(True)
        g.build()
        return _runner(g, {x: xt}, device)
    if family == "reduction":
        rows, cols = sizes
        g = dg.Graph(name="sum", io_data_type=dg.float32)
        x = g.tensor(name="x", dim=[rows, cols])
        g.reduction(x, "sum", axes=[1]).set_output(True)
        g.build()
        return _runner(g, {x: torch.randn(rows, cols, device=device)}, device)
    if family == "gather":
        vocab, width, tokens = sizes
        g = dg.Graph(name="embedding", io_data_type=io)
        table = g.tensor(name="table", dim=[vocab, width])
        ids = g.tensor(name="ids", dim=[tokens, 1], data_type=dg.int32)
        g.gather(table, ids, 0).set_output(True)
        g.build()
        return _runner(g, {table: randn(vocab, width),
                           ids: torch.randint(0, vocab, (tokens, 1), dtype=torch.int32, device=device)}, device)
    raise ValueError(f"no builder for case {kind!r}")


def _error_text(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return "error: " + (text if len(text) <= 300 else text[:297] + "...")


def child(args) -> int:
    """Build and time every case of the mode with the dnngraph of args.tree; print one JSON line."""
    import torch
    import dnngraph  # before triton: on a machine without a GPU it selects the interpreter

    tree = os.path.realpath(args.tree)
    where = os.path.realpath(dnngraph.__file__)
    assert where.startswith(tree + os.sep), f"dnngraph imported from {where}, not from the tree {tree}"
    cpu = args.mode == "cpu"
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    if not cpu:
        import triton.testing
        torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for name, kind, family, sizes in case_list(args.mode):
        torch.manual_seed(0)
        started = time.perf_counter()
        try:
            fn = make_case(kind, family, sizes, device, dtype)
            fn()  # the warm call: compiles and loads every kernel
            if cpu:
                start = time.perf_counter()
                fn()
                results[name] = (time.perf_counter() - start) * 1e3
            else:
                torch.cuda.synchronize()
                results[name] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as error:  # noqa: BLE001 - a case that fails is recorded, the run goes on
            results[name] = _error_text(error)
        fn = None
        if not cpu:
            torch.cuda.empty_cache()
        value = results[name]
        print(f"  {name}: {value if isinstance(value, str) else f'{value:.4f} ms'} "
              f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    print(json.dumps(results), flush=True)
    return 0


# --- parent: alternates the trees, compares --------------------------------------------------------
def run_tree(tree: str, mode: str, timeout_s: float) -> tuple[dict, float]:
    """One child on `tree`: ({case: ms or error text}, seconds). A child that dies gives every case
    its error text."""
    cache_dir = tempfile.mkdtemp(prefix="dnngraph-before-after-")
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DNNGRAPH_CACHE_DIR"] = cache_dir
    if mode == "cpu":
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree, "--mode", mode]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=timeout_s, cwd=tempfile.gettempdir())
        stdout, stderr, failure = done.stdout, done.stderr, f"child exited {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        failure = f"child timed out after {timeout_s:.0f} s"
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    sys.stderr.write(stderr)
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line), time.perf_counter() - started
            except json.JSONDecodeError:
                pass
    tail = " ".join(stderr.strip().splitlines()[-3:])[-300:]
    return ({name: f"error: {failure}: {tail}" for name, _, _, _ in case_list(mode)},
            time.perf_counter() - started)


def best(values: list):
    """The smallest time among a case's runs; the last error text when no run gave a time."""
    times = [v for v in values if isinstance(v, (int, float))]
    if times:
        return min(times)
    return values[-1] if values else "error: not run"


def compare(runs: dict, mode: str) -> dict:
    """{case: {family, before_ms, after_ms, ratio}} from the runs of each tree."""
    rows = {}
    for name, _, family, _ in case_list(mode):
        before = best([run.get(name, "error: missing") for run in runs["before"]])
        after = best([run.get(name, "error: missing") for run in runs["after"]])
        timed = all(isinstance(v, (int, float)) for v in (before, after))
        ratio = before / after if timed and after > 0 else None
        rows[name] = {"family": family, "before_ms": before, "after_ms": after, "ratio": ratio}
    return rows


def _cell(value) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.4f}"
    return str(value).replace("|", "/")[:160]


def report(rows: dict, mode: str) -> dict:
    """Print the table and the last line; returns the summary."""
    unit = "ms (one call, CPU interpreter)" if mode == "cpu" else "ms (do_bench median)"
    print(f"\n### dnngraph before/after, {unit}\n")
    print("| case | family | before ms | after ms | after/before speed ratio |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        print(f"| {name} | {row['family']} | {_cell(row['before_ms'])} | {_cell(row['after_ms'])} | {ratio} |")
    families, holders = {}, {}
    for name, row in rows.items():
        if row["ratio"] is not None and row["ratio"] < families.get(row["family"], math.inf):
            families[row["family"]], holders[row["family"]] = row["ratio"], name
    missing = [name for name, row in rows.items() if row["ratio"] is None]
    summary = {"families": families, "missing": missing, "goal": GOAL}
    if families:
        family = min(families, key=families.get)
        summary.update(min_ratio=families[family], min_family=family, min_case=holders[family])
        verdict = ("meets" if families[family] >= GOAL else "MISSES") + " the goal of"
        if mode == "cpu":
            verdict = "a smoke check through the interpreter, not a measurement; goal"
        print(f"\nminimum ratio {families[family]:.3f}x (family {family}: {holders[family]}); "
              f"{verdict} {GOAL:.2f}x"
              + (f"; {len(missing)} case(s) without a ratio: {', '.join(missing)}" if missing else ""))
    else:
        summary.update(min_ratio=None, min_family=None)
        print("\nminimum ratio: none (no case timed in both trees)")
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="folder holding the old tree's dnngraph/ package")
    parser.add_argument("--after", help="folder holding the new tree's dnngraph/ package")
    parser.add_argument("--quick", action="store_true", help="fewer cases, smaller sizes")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="children on CPU through Triton's interpreter, tiny sizes, one timed call")
    parser.add_argument("--rounds", type=int, default=2, help="before/after alternations (default 2)")
    parser.add_argument("--child-timeout-s", type=float, default=1800.0, help="limit per child process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=tuple(MODES), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    if not args.before or not args.after:
        parser.error("--before and --after are required")
    trees = {}
    for role in ("before", "after"):
        tree = os.path.realpath(getattr(args, role))
        if not os.path.isfile(os.path.join(tree, "dnngraph", "__init__.py")):
            parser.error(f"--{role} {tree} holds no dnngraph/ package")
        trees[role] = tree
    mode = "cpu" if args.cpu_smoke else "quick" if args.quick else "full"
    if mode != "cpu":
        import torch
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke for the CPU check")
    started = time.perf_counter()
    runs, seconds = {"before": [], "after": []}, {"before": [], "after": []}
    for round_index in range(max(1, args.rounds)):
        for role in ("before", "after"):
            print(f"[{time.perf_counter() - started:6.0f} s] round {round_index + 1}: {role} "
                  f"({trees[role]})", file=sys.stderr, flush=True)
            result, spent = run_tree(trees[role], mode, args.child_timeout_s)
            runs[role].append(result)
            seconds[role].append(spent)
    rows = compare(runs, mode)
    summary = report(rows, mode)
    header = {"mode": mode, "trees": trees, "rounds": max(1, args.rounds), "child_seconds": seconds,
              "seconds": time.perf_counter() - started, "timing": "one call (perf_counter)" if mode == "cpu"
              else "triton.testing.do_bench(warmup=25, rep=100, median) after one warm call; min over rounds"}
    if mode != "cpu":
        import torch
        import triton
        header.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write_json  # noqa: E402 - the benchmarks' folder, beside this file
    path = write_json(JSON_NAME, {"header": header, "runs": runs, "rows": rows, "summary": summary})
    if path:
        print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
