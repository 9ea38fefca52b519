"""Run many random graphs (tests/graphgen.py) on the GPU, compiled in parallel worker processes.

    python tests/fuzz_gpu.py --graphs 1000 --workers 12 --out $OUT
    python tests/fuzz_gpu.py --graphs 300 --families negated_view,interleaved,paged_attention --out $OUT

Each worker process (spawned) generates, builds, executes and judges whole cases, so Triton
compiles in parallel; the device is shared. Prints one summary line with the counts (passed,
mismatch, binding, errors by type, unsupported) and writes under --out:
  summary.json  the counts and every seed's verdict;
  failures.log  every failing or unsupported seed with its graph description and g.explain().
Without CUDA it runs on CPU through Triton's interpreter (use small --graphs there).
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _init_worker(cache_root: str, device: str, plain_names: bool, families):
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.dirname(HERE))
    # one compile cache per worker: no two processes write the same kernel file
    os.environ["DNNGRAPH_CACHE_DIR"] = os.path.join(cache_root, f"worker-{os.getpid()}")
    import warnings

    warnings.filterwarnings("ignore")
    global DEVICE, PLAIN_NAMES, FAMILIES
    DEVICE, PLAIN_NAMES, FAMILIES = device, plain_names, families


def _run_seed(seed: int) -> dict:
    import graphgen

    started = time.time()
    try:
        case = graphgen.generate(seed, device=DEVICE, plain_names=PLAIN_NAMES, families=FAMILIES)
        verdict = graphgen.run_case(case, device=DEVICE)
        status, detail, description = verdict.status, verdict.detail, case.describe()
    except Exception:  # noqa: BLE001 - a crash of the harness is a verdict too
        status, detail, description, case = "error:harness", traceback.format_exc(), "", None
    explain = ""
    if status != "passed" and case is not None:
        try:
            explain = case.graph.explain()
        except Exception as error:  # noqa: BLE001
            explain = f"explain() failed: {type(error).__name__}: {error}"
    return {"seed": seed, "status": status, "detail": detail, "description": description,
            "explain": explain, "seconds": round(time.time() - started, 3)}


def summarize(results: list[dict]) -> dict:
    """Counts: passed, mismatch, binding (a refused binding that ran or wrote, a write outside an
    output's view), unsupported and errors by type."""
    counts = collections.Counter(r["status"] for r in results)
    errors = {k[len("error:"):]: v for k, v in counts.items() if k.startswith("error:")}
    return {"graphs": len(results), "passed": counts.get("passed", 0),
            "mismatch": counts.get("mismatch", 0), "binding": counts.get("binding", 0),
            "unsupported": counts.get("unsupported", 0),
            "errors": sum(errors.values()), "errors_by_type": errors}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--first-seed", type=int, default=100000,
                        help="seeds first..first+graphs-1 (CI on CPU runs 0..299)")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto")
    parser.add_argument("--out", default="fuzz-out")
    parser.add_argument("--plain-names", action="store_true",
                        help="the same graphs with harmless names (tells name defects from others)")
    parser.add_argument("--families", default=None,
                        help="comma-separated GraphBuilder.FAMILIES names: graphs of those alone")
    args = parser.parse_args(argv)
    families = args.families.split(",") if args.families else None
    import torch

    if families:
        sys.path[:0] = [HERE, os.path.dirname(HERE)]
        import graphgen

        unknown = set(families) - {name for name, _ in graphgen.GraphBuilder.FAMILIES}
        if unknown:
            parser.error(f"no such families: {', '.join(sorted(unknown))}")

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    os.makedirs(args.out, exist_ok=True)
    cache_root = os.path.join(args.out, "cache") if device == "cpu" else \
        os.path.join(os.environ.get("TMPDIR", "/tmp"), "dnngraph-fuzz-cache")
    seeds = range(args.first_seed, args.first_seed + args.graphs)
    started = time.time()
    context = multiprocessing.get_context("spawn")
    results = []
    with context.Pool(args.workers, initializer=_init_worker,
                      initargs=(cache_root, device, args.plain_names, families)) as pool:
        for done, result in enumerate(pool.imap_unordered(_run_seed, seeds, chunksize=1), 1):
            results.append(result)
            if result["status"] != "passed":
                print(f"seed {result['seed']}: {result['status']}: {result['detail'][:200]}", flush=True)
            if done % 100 == 0:
                print(f"{done}/{args.graphs} graphs, {time.time() - started:.0f} s", flush=True)
    results.sort(key=lambda r: r["seed"])
    summary = summarize(results)
    summary.update(device=device if device == "cpu" else torch.cuda.get_device_name(),
                   seconds=round(time.time() - started, 1), first_seed=args.first_seed, families=families)
    with open(os.path.join(args.out, "failures.log"), "w") as log:
        for r in results:
            if r["status"] != "passed":
                log.write(f"=== seed {r['seed']}: {r['status']}\n{r['detail']}\n{r['description']}\n"
                          f"{r['explain']}\n\n")
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"summary": summary, "verdicts": {r["seed"]: r["status"] for r in results}}, handle, indent=1)
    errors = ", ".join(f"{k} {v}" for k, v in sorted(summary["errors_by_type"].items())) or "none"
    print(f"FUZZ {summary['graphs']} graphs on {summary['device']} in {summary['seconds']} s: "
          f"passed {summary['passed']}, mismatched {summary['mismatch']}, binding {summary['binding']}, "
          f"errors {summary['errors']} ({errors}), unsupported {summary['unsupported']}")
    return 0 if summary["passed"] + summary["unsupported"] == summary["graphs"] else 1


if __name__ == "__main__":
    sys.exit(main())
