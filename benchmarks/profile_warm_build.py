"""Where a build in a new process spends its time, on any machine (no GPU needed).

Two fresh processes build the same matmul + bias + relu graph with one DNNGRAPH_CACHE_DIR: the
first writes the kernel files, the second finds them on disk (a warm build). Each reports the
seconds of `import torch`, `import triton`, `import dnngraph` (after both) and `build()`, the
build's top functions under cProfile, and the third-party packages `import dnngraph` pulled in
(python -X importtime of the same child). Then, in a third process, the cost of what a GPU build
adds per process: Triton's installation key (triton.runtime.cache.triton_key, which every compile
and every hit in Triton's disk cache computes once per process) against dnngraph's cached key
(runtime/triton_key.py: the installation stamp and the key file).

    python benchmarks/profile_warm_build.py [--profile-lines N]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import cProfile, io, pstats, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import triton, triton.language
t2 = time.perf_counter()
import dnngraph as dg
t3 = time.perf_counter()
g = dg.Graph(name="mm")
a, w = g.tensor(name="a", dim=[64, 64]), g.tensor(name="w", dim=[64, 64])
b = g.tensor(name="b", dim=[64])
g.relu(g.add(g.matmul(a, w), b)).set_output(True).set_name("y")
profile = cProfile.Profile()
t4 = time.perf_counter()
profile.enable()
g.build()
profile.disable()
t5 = time.perf_counter()
print(f"TIMES torch={t1 - t0:.3f} triton={t2 - t1:.3f} dnngraph={t3 - t2:.3f} build={t5 - t4:.3f}")
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(LINES)
print(out.getvalue())
"""

KEY = r"""
import time
import dnngraph
from triton.runtime import cache
try:
    from dnngraph.runtime import triton_key as tk
except ImportError:  # a dnngraph from before the key was cached
    tk = None
t1 = time.perf_counter()
key = cache.triton_key()
t2 = time.perf_counter()
if tk is None:
    raise SystemExit(print(f"triton_key() {1e3 * (t2 - t1):.1f} ms; no cached key in this dnngraph"))
stamp = tk.installation_stamp()
t3 = time.perf_counter()
tk.install()
cached = cache.triton_key()  # reads the key file (or, the first time, writes it)
t4 = time.perf_counter()
assert cached == key
print(f"triton_key() {1e3 * (t2 - t1):.1f} ms; installation stamp {1e3 * (t3 - t2):.1f} ms; "
      f"stamp + key file {1e3 * (t4 - t2):.1f} ms")
"""


def run(code, cache_dir, *flags):
    env = {**os.environ, "DNNGRAPH_CACHE_DIR": cache_dir, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env,
                          check=True)


def imported_packages(importtime: str) -> list:
    """(ms, package) of the top-level packages imported under `import dnngraph`, by their own
    cumulative time as -X importtime reports it (inflated by the measurement itself)."""
    rows = []
    for line in importtime.splitlines():
        found = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if found:
            rows.append((int(found.group(2)), len(found.group(3)), found.group(4)))
    start = next(i for i, row in enumerate(rows) if row[2] == "triton.language")  # after the child's own imports
    seen = {}
    for cumulative, depth, name in rows[start + 1:]:
        top = name.split(".")[0]
        if "." not in name or depth <= 3:
            seen[top] = max(seen.get(top, 0), cumulative)
    return sorted(((us / 1e3, name) for name, us in seen.items() if us > 2000), reverse=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-lines", type=int, default=15)
    args = parser.parse_args()
    child = CHILD.replace("LINES", str(args.profile_lines))
    with tempfile.TemporaryDirectory() as cache_dir:
        for label in ("first process (kernels written)", "second process (kernels on disk)"):
            done = run(child, cache_dir)
            times = next(line for line in done.stdout.splitlines() if line.startswith("TIMES"))
            print(f"## {label}\n{times}\n")
        print("## the warm build's profile (cumulative)\n" + done.stdout.split("\n", 1)[1].strip()[:6000] + "\n")
        done = run(child, cache_dir, "-X", "importtime")
        print("## packages `import dnngraph` imports (ms, -X importtime cumulative)")
        for ms, name in imported_packages(done.stderr):
            print(f"{ms:9.1f}  {name}")
        with tempfile.TemporaryDirectory() as key_dir:
            print("\n## Triton's installation key, per process")
            print("first process: ", run(KEY, key_dir).stdout.strip())
            print("second process:", run(KEY, key_dir).stdout.strip())


if __name__ == "__main__":
    main()
