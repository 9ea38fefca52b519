"""Per-kernel profiles of bench_models.py's rows: for each row, the torch profiler's GPU kernels of
eager torch, dnngraph's backend (and optionally inductor), summed per kernel name over a few steps
and divided by the steps, printed as top-N tables with the step's kernel total and wall time.

    python benchmarks/profile_models.py [--rows llama,resnet] [--seq 4096] [--top 12] [--inductor]
"""
import argparse
import collections
import time

import torch

from bench_models import cases
from common import write_json


def _short(name: str, width: int = 70) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_profile(step, fn, steps: int = 3) -> dict:
    """{"kernels": [(name, us per step, launches per step)], "kernel_us", "wall_us"} of `steps` steps."""
    step(fn)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(fn)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e6
    per_name, count = collections.defaultdict(float), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name] += event.device_time_total / steps
            count[event.name] += 1
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])
    return {"kernels": [(n, us, count[n] / steps) for n, us in ranked],
            "kernel_us": sum(per_name.values()), "wall_us": wall}


def print_profile(label: str, variant: str, profile: dict, top: int) -> None:
    launches = sum(c for _, _, c in profile["kernels"])
    print(f"\n#### {label}: {variant} (kernels {profile['kernel_us'] / 1e3:.2f} ms, "
          f"{launches:.0f} launches, wall {profile['wall_us'] / 1e3:.2f} ms per step)\n")
    print("| kernel | us per step | share | launches |")
    print("|---|---|---|---|")
    for name, us, calls in profile["kernels"][:top]:
        print(f"| {_short(name)} | {us:.0f} | {us / profile['kernel_us']:.0%} | {calls:.0f} |")
    rest = profile["kernels"][top:]
    if rest:
        print(f"| ({len(rest)} others) | {sum(us for _, us, _ in rest):.0f} | "
              f"{sum(us for _, us, _ in rest) / profile['kernel_us']:.0%} | {sum(c for _, _, c in rest):.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama,resnet")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--match", default="", help="profile only the rows whose label contains this")
    parser.add_argument("--variants", default="eager,dnngraph,inductor", help="which variants to profile")
    args = parser.parse_args()
    results = {}
    for label, step, make_variants in cases(args.rows, args.seq, args.inductor):
        if args.match not in label:
            continue
        for variant, fn in make_variants().items():
            if variant not in args.variants.split(","):
                continue
            profile = kernel_profile(step, fn)
            print_profile(label, variant, profile, args.top)
            results[f"{label} / {variant}"] = profile
    write_json(f"profiles_{args.rows.replace(',', '_')}.json", results)


if __name__ == "__main__":
    main()
