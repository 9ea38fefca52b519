"""Shared benchmark helpers: timing, the copy ceiling, table printing."""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import triton


def median_ms(fn, warmup=25, rep=200) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_overhead_us(fn, iters=3000) -> float:
    """Host microseconds per call of `fn` (enqueue only; the device is synchronized around)."""
    import time

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def copy_ceiling_tbs(numel: int, dtype=torch.bfloat16) -> float:
    """Device-to-device copy bandwidth (bytes read + written) on a tensor of `numel` elements."""
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9


def print_table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over the logical elements (NaN when out has NaN)."""
    if out.numel() != ref.numel():
        raise ValueError(f"{out.numel()} elements against a reference of {ref.numel()}")
    out, ref = out.detach().reshape(-1).double(), ref.detach().to(out.device).reshape(-1).double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def write_json(filename: str, payload) -> str | None:
    """Write payload as JSON to $OUT/filename when OUT is set; returns the path written."""
    import json
    import os

    folder = os.environ.get("OUT")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, filename)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, default=str)
    return path


def rows_argument(rows: dict):
    """An argparse type for --rows: comma-separated keys of `rows`, checked."""
    def parse(text: str) -> list:
        chosen = [r.strip() for r in text.split(",") if r.strip()]
        unknown = [r for r in chosen if r not in rows]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown row(s) {unknown}; choose from {','.join(rows)}")
        return chosen
    return parse


def gpu_case_names(description: str, cases: dict, argv, script: str) -> list:
    """The case names a --cases command line selects among `cases` (default: all), in its
    order; exits where a name is unknown or where no CUDA device runs `script`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", default=",".join(cases),
                        help=f"comma-separated case names among {', '.join(cases)} (default: all)")
    args = parser.parse_args(argv)
    names = [name for name in args.cases.split(",") if name]
    unknown = [name for name in names if name not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose among {list(cases)}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device")
    return names


def family_parser(description: str, rows: dict, quick_help: str, item: str) -> argparse.ArgumentParser:
    """The options every family benchmark takes (rows, quick, only, anchors, budgets, cache, CPU
    check); `item` names what --only and --list-shapes select ("layers", "shapes")."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=rows_argument(rows), default=list(rows),
                        help=f"comma-separated rows (default all): {','.join(rows)}")
    parser.add_argument("--quick", action="store_true", help=quick_help.replace("%", "%%"))  # argparse formats help
    parser.add_argument("--only", default="", help=f"comma-separated words: {item} whose label has one")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchors")
    parser.add_argument("--no-cudnn", action="store_true", help="skip the cuDNN frontend anchors")
    parser.add_argument("--cudnn-fe-path", default=None,
                        help="a folder (pip install --target) holding the cuDNN frontend's `cudnn` package")
    parser.add_argument("--compile-budget-s", type=float, default=600.0,
                        help="skip torch.compile once the run has spent this many seconds")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    parser.add_argument("--reuse-cache", action="store_true",
                        help="build with the environment's DNNGRAPH_CACHE_DIR (default: a fresh one)")
    parser.add_argument("--list-shapes", action="store_true", help=f"print each row's {item} and exit")
    parser.add_argument("--check-cpu", action="store_true",
                        help="tiny fp32 shapes through dnngraph on CPU (interpreter), no timing")
    return parser


def run_family(args, prefix: str, list_shapes, check_cpu, run_gpu):
    """--list-shapes, --check-cpu or the GPU run, building in a fresh kernel cache unless
    --reuse-cache (a benchmark then compiles what it times)."""
    if args.list_shapes:
        return list_shapes(args)
    if args.reuse_cache:
        cache_dir, remove = os.environ.get("DNNGRAPH_CACHE_DIR", "~/.cache/dnngraph (default)"), False
    else:
        cache_dir, remove = tempfile.mkdtemp(prefix=prefix), True
        os.environ["DNNGRAPH_CACHE_DIR"] = cache_dir
    try:
        return check_cpu(args) if args.check_cpu else run_gpu(args, cache_dir)
    finally:
        if remove:
            shutil.rmtree(cache_dir, ignore_errors=True)


def run_rows(rows: dict, shapes_of, timed_case, report, json_name: str, header: dict, started: float) -> dict:
    """Time every shape of every row, saving the JSON after each (kept if a later one dies), then
    print the report; returns {row key: [case, ...]}."""
    results = {key: [] for key in rows}
    for key, row in rows.items():
        for shape in shapes_of(key):
            results[key].append(timed_case(row, shape))
            header["seconds"] = time.perf_counter() - started
            write_json(json_name, {"header": header, "results": results})
            torch.cuda.empty_cache()
    header["seconds"] = time.perf_counter() - started
    report(results, header)
    path = write_json(json_name, {"header": header, "results": results})
    if path:
        print(f"\nresults: {path}")
    return results


def cpu_exit(verdicts, missing: str):
    """Print a --check-cpu verdict; exit 1 on any wrong result, 2 when only `missing` (what
    dnngraph cannot build yet) kept checks from running."""
    wrong, unsupported = verdicts.count("wrong"), verdicts.count("unsupported")
    if wrong:
        print(f"\nFAILED: {wrong} result(s) wrong, failed or past tolerance"
              + (f"; {unsupported} not built yet" if unsupported else ""))
        sys.exit(1)
    if unsupported:
        print(f"\nNOT BUILT: {unsupported} {missing}; everything that ran agrees with the float64 reference")
        sys.exit(2)
    print(f"\nall {len(verdicts)} checks passed")
    return 0
