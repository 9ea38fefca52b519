"""Time every tile candidate of the fp8 attention kernels (lower/sdpa_fp8.py CANDIDATE_TILES) on
the GPU against the cuDNN frontend's sdpa_fp8 and dnngraph's bf16 kernel, each output checked
first against the float attention of the dequantized inputs (benchmarks/bench_attention.py's fp8
rows: same inputs, scales, providers and tolerances).

    python benchmarks/sweep_sdpa_fp8.py --cudnn-fe-path /tmp/fe      # B2 H16 S2048 D128, causal and not

The backward's two kernels are swept one at a time, the other at its GPU_TILES choice; the
forward's and backward's keys-minor copies and the delta launch are in every time (they are
part of the plan). Prints one line per measurement as it lands, then a table per shape; stops
starting new builds once --budget-s has passed. Writes $OUT/fp8_sweep.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # dnngraph from this checkout; bench_attention, common

import torch  # noqa: E402

import bench_attention as bench  # noqa: E402
from common import median_ms, rel_error  # noqa: E402
from dnngraph.backends.triton.lower import sdpa_fp8 as lowering  # noqa: E402
from dnngraph.runtime import plan_cache  # noqa: E402

SHAPE_LABELS = ("fp8 2k", "fp8 2k causal")  # bench_attention.FP8_SHAPES: B2 H16 S2048 D128
KERNELS = {False: ("forward",), True: ("dkdv", "dq")}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cudnn-fe-path", default=None, help="folder holding the cuDNN frontend's `cudnn` package")
    parser.add_argument("--rep-ms", type=int, default=25, help="do_bench repetition time per measurement")
    parser.add_argument("--budget-s", type=float, default=130.0, help="start no build after this many seconds")
    parser.add_argument("--only", default="", help="comma-separated: forward, backward (default both)")
    return parser.parse_args()


def timed(factory, refs: dict, tolerance: float, rep_ms: int) -> dict:
    """Build and run a provider once, check its outputs, then its median ms (None if it failed)."""
    try:
        run, outputs, flavour, _ = factory()
        run()
        torch.cuda.synchronize()
        produced = outputs()
        error = max(rel_error(out, ref) for out, ref in zip(produced, refs[flavour]))
        checked = math.isfinite(error) and error <= tolerance
        ms = median_ms(run, warmup=10, rep=rep_ms) if checked else None
        return {"ms": ms, "rel_error": error, "checked": checked}
    except (bench.Skipped, bench.NotBuilt) as reason:
        return {"ms": None, "status": f"skipped: {reason}"}
    except Exception as error:  # noqa: BLE001 - one provider failing leaves the others measured
        return {"ms": None, "status": f"failed: {type(error).__name__}: {str(error)[:300]}"}


def anchors(shape, inputs, dequantized, refs, backward: bool, ctx) -> dict:
    """dnngraph's bf16 kernel on the dequantized inputs and the frontend's sdpa_fp8, measured."""
    wide = {name: value.to(bench.BF16) for name, value in dequantized.items()}
    wide.update(o=refs["o"][0].to(bench.BF16), stats=inputs["stats"])
    factories = {"dg_bf16": (bench.dg_provider(shape, wide, bench.dg.bfloat16, backward), bench.TOLERANCE),
                 "cudnn_fe_fp8": (bench.cudnn_fp8_provider(shape, inputs, backward, ctx),
                                  bench.FP8_TOLERANCE[backward])}
    return {name: timed(factory, refs, tolerance, ctx.args.rep_ms) for name, (factory, tolerance) in factories.items()}


def sweep(shape, inputs, refs, backward: bool, args, deadline: float) -> list:
    """One measurement per candidate of each kernel of the shape's direction."""
    chosen = dict(lowering.GPU_TILES)
    results = []
    try:
        for which in KERNELS[backward]:
            for tiles in lowering.CANDIDATE_TILES[which]:
                if time.perf_counter() > deadline:
                    results.append({"kernel": which, "tiles": _tiles(tiles), "ms": None, "status": "out of budget"})
                    continue
                lowering.GPU_TILES = {**chosen, which: tiles}
                plan_cache.clear()
                result = timed(bench.dg_fp8_provider(shape, inputs, backward), refs, bench.FP8_TOLERANCE[backward],
                               args.rep_ms)
                result.update(kernel=which, tiles=_tiles(tiles), default=tiles == chosen[which])
                print(f"  {shape.label} {'bwd' if backward else 'fwd'} {which} {_tiles(tiles)}: {_cell(result)}",
                      flush=True)
                results.append(result)
    finally:
        lowering.GPU_TILES = chosen
        plan_cache.clear()
    return results


def _tiles(tiles) -> str:
    return f"BLOCK_M={tiles.block_m} BLOCK_N={tiles.block_n} warps={tiles.num_warps} stages={tiles.num_stages}"


def _cell(result: dict) -> str:
    if result.get("ms") is None:
        return result.get("status") or f"err {result.get('rel_error', float('nan')):.2e} (over tolerance)"
    return f"{result['ms'] * 1e3:.1f} us (err {result['rel_error']:.1e})"


def report(case: dict):
    """A table of one shape and direction: anchors, then each candidate with its ratios."""
    fe, bf16 = (case["anchors"][name].get("ms") for name in ("cudnn_fe_fp8", "dg_bf16"))
    print(f"\n== {case['label']} {case['direction']}: cuDNN FE fp8 {_cell(case['anchors']['cudnn_fe_fp8'])}; "
          f"dnngraph bf16 {_cell(case['anchors']['dg_bf16'])}")
    for result in case["candidates"]:
        ratios = "".join(f"  {name} {anchor / result['ms']:.2f}x" for name, anchor in (("vs FE", fe), ("vs bf16", bf16))
                         if anchor and result.get("ms"))
        mark = " (default)" if result.get("default") else ""
        print(f"  {result['kernel']:8s} {result['tiles']:42s} {_cell(result)}{ratios}{mark}")


def main():
    args = parse_args()
    started = time.perf_counter()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    bench_args = bench.parse_args(["--rows", "fp8_fwd,fp8_bwd", "--rep-ms", str(args.rep_ms)]
                                  + (["--cudnn-fe-path", args.cudnn_fe_path] if args.cudnn_fe_path else ["--no-cudnn"]))
    torch.empty(1, device="cuda")
    frontend, fe_note = bench.frontend_from_args(bench_args, bench.CudnnAttention)
    print(f"{torch.cuda.get_device_name()}; cuDNN frontend: {fe_note}", flush=True)
    ctx = bench.Context(bench_args, "cuda", bench.BF16, bench.F32, bench.TOLERANCE, True, frontend, fe_note,
                        math.inf, {})
    directions = [d for d in (False, True) if not args.only or ("backward" if d else "forward") in args.only]
    cases = []
    for shape in (s for s in bench.FP8_SHAPES if s.label in SHAPE_LABELS):
        for backward in directions:
            inputs, dequantized, refs = bench.fp8_inputs(shape, ctx, backward)
            case = {"label": shape.label, "direction": "backward" if backward else "forward",
                    "anchors": anchors(shape, inputs, dequantized, refs, backward, ctx)}
            print(f"  {shape.label} {case['direction']} anchors: "
                  + "; ".join(f"{name} {_cell(r)}" for name, r in case["anchors"].items()), flush=True)
            case["candidates"] = sweep(shape, inputs, refs, backward, args, started + args.budget_s)
            cases.append(case)
            del inputs, dequantized, refs
            torch.cuda.empty_cache()
    for case in cases:
        report(case)
    print(f"\nseconds {time.perf_counter() - started:.1f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_sweep.json"), "w") as handle:
            json.dump({"frontend": fe_note, "cases": cases}, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
