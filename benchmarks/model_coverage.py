"""Per model family: the dnngraph kernels one step launches (forward, backward) and the aten ops
still left to torch, for every family tests/models/ runs through torch.compile(backend="dnngraph")
(12 transformers, 5 torchvision, 8 timm), each in a fresh process that names the backend without
importing dnngraph, as a user does. Also each step's worst ratio of dnngraph's error to eager's
(both against float64) and whether it passes the tests' rule. Libraries that cannot be imported
are listed as such.

    python benchmarks/model_coverage.py [--families transformers,torchvision,timm | gpt2,llama,...]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--size tiny|realistic] [--modes inference,training]
        [--import-dnngraph-first]

Defaults: tiny float32 models on CPU (through Triton's interpreter), realistic bf16 ones on CUDA.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "models"))
from common import print_table, write_json  # noqa: E402
from model_results import FACTOR, FLOOR, misses, ops_left_text  # noqa: E402
from model_runs import Run, execute  # noqa: E402
from model_zoo import ALL  # noqa: E402

LIBRARIES = ("transformers", "torchvision", "timm")


def chosen_families(spec: str) -> list:
    """Family names of a comma-separated list of libraries and family names, in model_zoo's order."""
    wanted = set(spec.split(","))
    unknown = wanted - set(LIBRARIES) - {f.name for f in ALL}
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; choose from {LIBRARIES} or {[f.name for f in ALL]}")
    return [f for f in ALL if f.library in wanted or f.name in wanted]


def _status(result: dict) -> tuple:
    """(worst dnngraph / eager error ratio, verdict) of one result."""
    if "unavailable" in result:
        return "", result["unavailable"][:80]
    if "failure" in result:
        failure = result["failure"]
        return "", f"FAILED {failure['cause'][:160]}".replace("\n", " ").replace("|", "/")
    ratios = [e["ours"] / e["eager"] for e in result["errors"] if e["eager"] > 0]
    missed = misses(result)
    verdict = "ok" if not missed else f"{len(missed)} value(s) past {FACTOR}x eager + {FLOOR[result['dtype']]}"
    return f"{max(ratios):.2f}" if ratios else "exact", verdict


def row(result: dict) -> list:
    coverage = result.get("coverage", {})
    forward, backward = coverage.get("forward"), coverage.get("backward")
    ratio, verdict = _status(result)
    return [result["family"], result["mode"], forward["kernels"] if forward else "",
            backward["kernels"] if backward else "", ops_left_text(coverage), ratio, verdict, result.get("seconds", "")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(LIBRARIES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA unless given")
    parser.add_argument("--size", default=None, help="tiny on CPU, realistic on CUDA unless given")
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--import-dnngraph-first", action="store_true",
                        help="import dnngraph before compiling (not what a user writes)")
    args = parser.parse_args()
    on_cpu = args.device == "cpu"
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    size = args.size or ("tiny" if on_cpu else "realistic")
    families = chosen_families(args.families)
    rows = []
    for library in LIBRARIES:  # one process per library: its startup paid once
        names = tuple(f.name for f in families if f.library == library)
        if not names:
            continue
        run = Run(names, tuple(args.modes.split(",")), size, args.device, dtype, timeout_s=3600,
                  import_dnngraph_first=args.import_dnngraph_first)
        for result in execute(run).values():
            rows.append(row(result))
            print(" | ".join(str(cell) for cell in rows[-1]), flush=True)
    print_table(f"kernels per step and ops left to torch ({size}, {dtype}, {args.device})",
                ["family", "step", "kernels forward", "kernels backward", "aten ops left to torch",
                 "worst error / eager's", "verdict", "s"], rows)
    write_json(f"model_coverage_{args.device}_{dtype}.json", rows)


if __name__ == "__main__":
    main()
