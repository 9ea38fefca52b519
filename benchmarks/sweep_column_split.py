"""Time column-split configs of NHWC batchnorm (how heuristics/rows.py's COLUMN_* constants were
chosen), next to the copy ceiling and torch's batch_norm measured in the same process.

A column split (K = channels, the contiguous side) runs a partial kernel (per-chunk statistics),
a combine kernel and an apply kernel. Each variant sets a tile [BLOCK_K channels, BLOCK_R pixels]
with its warps, the programs per SM the grid is sized for, whether tile loops prefetch the next
tile, and whether the apply pass walks backwards with evict-first hints. Kernels are compiled in
worker processes first (Triton's disk cache), then timed here one after the other.

    python benchmarks/sweep_column_split.py                # GPU; table last, JSON in $OUT
    python benchmarks/sweep_column_split.py --grid full    # the first round (37 per direction)

Bytes: forward moves x twice (statistics, apply) and y once; backward dy and x twice and dx once
(the per-channel tensors are noise at this size). TB/s are over those "pass bytes"; the bench's
minimal bytes (each tensor once) are stated too.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time

import torch

import dnngraph as dg  # first: picks Triton's interpreter on a CPU-only machine
from dnngraph.backends.triton.heuristics import rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_ceiling_tbs, median_ms, write_json  # noqa: E402

SHAPE = (32, 256, 56, 56)
BF16 = torch.bfloat16
TILES = ((64, 32, 4), (64, 64, 8), (128, 32, 4))  # block_k, block_r, warps
PROGRAMS_PER_SM = (4, 6, 8)
# The second round, around the first's winners: programs per SM and prefetch depth.
REFINED = ([((64, 32, 4), per_sm, depth, True) for per_sm in (4, 5, 6) for depth in (1, 2)]
           + [((64, 64, 8), 4, depth, True) for depth in (1, 2)] + [((128, 32, 4), 4, 1, True)])


def variants(grid: str) -> list:
    """(tile, programs per SM, tiles prefetched, streaming apply) tuples; None first: the
    model's own choice. "full": every tile x programs per SM x prefetch on/off x stream on/off
    (the first round); "refined": the second round; "quick": the model and three others."""
    if grid == "quick":
        return [None] + [((64, 32, 4), p, 1, True) for p in PROGRAMS_PER_SM]
    if grid == "refined":
        return [None] + REFINED
    return [None] + list(itertools.product(TILES, PROGRAMS_PER_SM, (1, 0), (True, False)))


def variant_options(variant, rows_count: int, reduced: int, sms: int) -> dg.BuildOptions:
    """The BuildOptions a variant names (None: the model's defaults)."""
    if variant is None:
        return dg.BuildOptions()
    (block_k, block_r, warps), per_sm, prefetch, stream = variant
    blocks = -(-rows_count // block_k)
    splits = min(-(-sms * per_sm // blocks), -(-reduced // block_r))
    splits = -(-reduced // rows.split_chunk(reduced, splits, block_r))
    return dg.BuildOptions(row_config=rows.RowConfig("split", block_k, block_r, warps, splits, 0.0),
                           column_prefetch_tiles=prefetch, column_stream_apply=stream)


def make_graph(backward: bool, shape=SHAPE, device="cuda"):
    """(graph, feeds, outputs) of batchnorm training forward or backward, NHWC bf16."""
    c = shape[1]
    p = [1, c, 1, 1]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x_t = ((torch.randn(shape, generator=gen) * (0.5 + torch.rand(p, generator=gen)) + torch.randn(p, generator=gen))
           .to(BF16).contiguous(memory_format=torch.channels_last).to(device))
    g = dg.Graph(name="bn", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    x = g.tensor_like(x_t, "x")
    s = g.tensor(name="scale", dim=p, data_type=dg.float32)
    feeds = {x: x_t, s: (torch.rand(p, generator=gen) + 0.5).to(device)}
    if backward:
        dy = g.tensor_like(x_t, "dy")
        m = g.tensor(name="mean", dim=p, data_type=dg.float32)
        i = g.tensor(name="inv", dim=p, data_type=dg.float32)
        xf = x_t.float()
        dy_t = torch.randn(shape, generator=gen).to(BF16).contiguous(memory_format=torch.channels_last)
        feeds.update({dy: dy_t.to(device),
                      m: xf.mean((0, 2, 3), keepdim=True),
                      i: (xf.var((0, 2, 3), unbiased=False, keepdim=True) + 1e-5).rsqrt()})
        outs = list(g.batchnorm_backward(dy, x, s, m, i))
        outs[1].set_data_type(dg.float32)
        outs[2].set_data_type(dg.float32)
    else:
        b = g.tensor(name="bias", dim=p, data_type=dg.float32)
        rm = g.tensor(name="rm", dim=p, data_type=dg.float32)
        rv = g.tensor(name="rv", dim=p, data_type=dg.float32)
        feeds.update({b: torch.randn(p, generator=gen).to(device), rm: torch.zeros(p, device=device),
                      rv: torch.ones(p, device=device)})
        outs = list(g.batchnorm(x, s, b, rm, rv, momentum=0.1))
    for out in outs:
        out.set_output(True)
    return g, feeds, outs


def _build(backward: bool, variant, sms: int):
    options = variant_options(variant, SHAPE[1], SHAPE[0] * SHAPE[2] * SHAPE[3], sms)
    g, feeds, outs = make_graph(backward)
    g.build(options=options)
    return g, feeds, outs


def _prewarm(job):
    """Worker: build (compile) one variant so the timing process finds Triton's cache warm."""
    backward, variant = job
    try:
        _build(backward, variant, torch.cuda.get_device_properties(0).multi_processor_count)
        return None
    except Exception as error:  # noqa: BLE001 - reported when timed
        return f"{variant}: {type(error).__name__}: {str(error)[:200]}"


def time_variant(backward, variant, sms, reference):
    g, feeds, outs = _build(backward, variant, sms)
    buffers = {o: torch.empty_strided(o.dim, o.stride, dtype=o.data_type.torch_dtype, device="cuda").fill_(float("nan"))
               for o in outs}
    bindings = {**feeds, **buffers}
    g.execute(bindings)
    torch.cuda.synchronize()
    errors = {}
    for o in outs:
        want = reference[o.name].double()
        errors[o.name] = ((buffers[o].double() - want).norm() / want.norm()).item()
    ms = median_ms(lambda: g.execute(bindings), warmup=10, rep=40)
    return ms, errors, [launch.config_text for launch in g.plan.launches]


def kernel_times(backward, variant, sms) -> dict:
    """Per-kernel device microseconds of one variant (torch profiler, mean over 20 calls)."""
    g, feeds, outs = _build(backward, variant, sms)
    bindings = {**feeds, **{o: torch.empty_strided(o.dim, o.stride, dtype=o.data_type.torch_dtype, device="cuda")
                            for o in outs}}
    for _ in range(3):
        g.execute(bindings)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.execute(bindings)
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / e.count, 2) for e in prof.key_averages() if e.count}


def torch_anchors(backward: bool):
    """Median ms of torch's batch_norm training forward, or its backward through autograd."""
    g, feeds, outs = make_graph(backward)
    x = next(v for k, v in feeds.items() if k.name == "x")
    c = SHAPE[1]
    w = torch.rand(c, device="cuda") + 0.5
    b = torch.randn(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    if not backward:
        return median_ms(lambda: torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1),
                         warmup=10, rep=40)
    dy = next(v for k, v in feeds.items() if k.name == "dy")
    leaf = x.detach().requires_grad_(True)
    wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = torch.nn.functional.batch_norm(leaf, rm, rv, wl, bl, training=True, momentum=0.1)
    return median_ms(lambda: torch.autograd.grad(y, (leaf, wl, bl), dy, retain_graph=True), warmup=10, rep=40)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("refined", "full", "quick"), default="refined")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--only", choices=("fwd", "bwd"), default=None)
    parser.add_argument("--phase", choices=("compile", "time", "all"), default="all",
                        help="compile: fill the caches only; time: time only (caches filled before)")
    args = parser.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    numel = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    directions = [d for d in (False, True) if args.only is None or args.only == ("bwd" if d else "fwd")]
    jobs = [(backward, v) for backward in directions for v in variants(args.grid)]
    if args.phase in ("compile", "all"):
        start = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            failures = [f for f in pool.map(_prewarm, jobs, chunksize=1) if f]
        print(f"compiled {len(jobs)} variants in {time.perf_counter() - start:.0f} s; failures: {failures}",
              flush=True)
        if args.phase == "compile":
            return
    ceiling = copy_ceiling_tbs(numel)
    print(f"copy ceiling {ceiling:.3f} TB/s (bf16 tensor of {numel} elements, read + write)", flush=True)
    results = {"copy_tbs": ceiling, "device": torch.cuda.get_device_name(0), "rows": []}
    for backward in directions:
        name = "bwd" if backward else "fwd"
        pass_bytes = numel * 2 * (5 if backward else 3)
        minimal_bytes = numel * 2 * (3 if backward else 2)
        g, feeds, outs = make_graph(backward)
        reference = g.reference({k: v for k, v in feeds.items()})
        del g
        torch_ms = torch_anchors(backward)
        print(f"{name}: torch {torch_ms * 1e3:.1f} us ({pass_bytes / torch_ms / 1e9:.2f} TB/s of pass bytes)",
              flush=True)
        best = None
        for variant in variants(args.grid):
            try:
                ms, errors, configs = time_variant(backward, variant, sms, reference)
            except Exception as error:  # noqa: BLE001
                print(f"{name} {variant}: failed {type(error).__name__}: {str(error)[:150]}", flush=True)
                continue
            tbs = pass_bytes / ms / 1e9
            row = {"dir": name, "variant": variant, "us": ms * 1e3, "pass_tbs": tbs, "of_copy": tbs / ceiling,
                   "minimal_tbs": minimal_bytes / ms / 1e9, "vs_torch": torch_ms / ms,
                   "max_err": max(errors.values()), "configs": configs}
            results["rows"].append(row)
            print(f"{name} {variant or 'model'}: {ms * 1e3:.1f} us {tbs:.2f} TB/s {tbs / ceiling:.0%} of copy, "
                  f"{torch_ms / ms:.2f}x torch, err {row['max_err']:.1e}", flush=True)
            if best is None or ms < best[0]:
                best = (ms, variant)
        results[f"{name}_torch_us"] = torch_ms * 1e3
        for label, variant in (("model", None), ("best", best[1])):
            times = kernel_times(backward, variant, sms)
            results[f"{name}_{label}_kernels"] = times
            print(f"{name} {label} {variant} kernels (us): {times}", flush=True)
    write_json("sweep_column_split.json", results)
    print("\n| dir | variant | us | TB/s (pass bytes) | of copy | vs torch |\n|---|---|---|---|---|---|")
    for row in sorted(results["rows"], key=lambda r: (r["dir"], r["us"]))[:60]:
        print(f"| {row['dir']} | {row['variant'] or 'model'} | {row['us']:.1f} | {row['pass_tbs']:.2f} | "
              f"{row['of_copy']:.0%} | {row['vs_torch']:.2f}x |")


if __name__ == "__main__":
    main()
