"""Time the depthwise kernels' ranked configs on the benchmark layers (how heuristics/depthwise.py
was calibrated), against cuDNN through torch (channels_last bf16, cudnn.benchmark).

    python benchmarks/sweep_depthwise.py [--phase compile|time|all] [--ops fprop,dgrad,wgrad] [--budget S]

Each op sweeps a grid of tiles (gather: plain and merged columns, several widths and tile/warp
pairs; wgrad: pixels x taps x channels per program, the model's splits) and the model's choice,
each checked against torch's output. Every config is compiled first in parallel worker processes
(Triton's disk cache keeps the binaries; `--phase compile` stops there), then timed one by one.
Prints one line per (layer, op, config): model rank, model
microseconds, measured microseconds, TB/s over x + w + y (+ bias), and writes depthwise_sweep.json
to $OUT.
"""
import argparse
import multiprocessing
from dataclasses import replace
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_ceiling_tbs, median_ms, rel_error, write_json  # noqa: E402

import dnngraph as dg  # noqa: E402
from dnngraph.backends.triton.heuristics import depthwise as heuristics  # noqa: E402
from dnngraph.backends.triton.lower.depthwise import DepthwiseBuild  # noqa: E402
from dnngraph.target import target_of  # noqa: E402

BF16 = torch.bfloat16
DEVICE = "cuda"
LAYERS = {  # N, C, size, filter, stride, padding
    "mbv2 144@56": (32, 144, 56, 3, 1, 1),
    "mbv2 384@28": (32, 384, 28, 3, 1, 1),
    "convnext 96@56 7x7": (32, 96, 56, 7, 1, 3),
}


def _nhwc(tensor):
    return tensor.contiguous(memory_format=torch.channels_last)


def inputs_of(layer):
    n, c, size, r, s, p = LAYERS[layer]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = _nhwc(torch.randn(n, c, size, size, device=DEVICE, generator=gen).to(BF16))
    w = _nhwc((torch.randn(c, 1, r, r, device=DEVICE, generator=gen) / r).to(BF16))
    bias = _nhwc(torch.randn(1, c, 1, 1, device=DEVICE, generator=gen).to(BF16))
    y = F.conv2d(x, w, stride=s, padding=p, groups=c)
    dy = _nhwc(torch.randn(y.shape, device=DEVICE, generator=gen).to(BF16))
    return dict(x=x, w=w, bias=bias, dy=dy, geo=dict(stride=s, padding=p, groups=c))


def graph_of(layer, op, tensors):
    """(graph, bindings, output buffers) of one op on one layer."""
    n, c, size, r, s, p = LAYERS[layer]
    g = dg.Graph(name="dw", io_data_type=dg.bfloat16)
    geo = dict(padding=[p, p], stride=[s, s], dilation=[1, 1], groups=c)
    if op == "fprop":
        x, w, b = (g.tensor_like(tensors[k], name=k) for k in ("x", "w", "bias"))
        out = g.relu(g.add(g.conv_fprop(x, w, **geo), b))
        bound = {x: tensors["x"], w: tensors["w"], b: tensors["bias"]}
    elif op == "dgrad":
        dy, w = (g.tensor_like(tensors[k], name=k) for k in ("dy", "w"))
        out = g.conv_dgrad(dy, w, x_dim=list(tensors["x"].shape), **geo)
        bound = {dy: tensors["dy"], w: tensors["w"]}
    else:
        dy, x = (g.tensor_like(tensors[k], name=k) for k in ("dy", "x"))
        out = g.conv_wgrad(dy, x, w_dim=list(tensors["w"].shape), **geo)
        bound = {dy: tensors["dy"], x: tensors["x"]}
    out.set_output(True).set_name("out")
    buffer = torch.empty_strided(out.dim, out.stride, dtype=BF16, device=DEVICE)
    bound[out] = buffer
    return g, bound, buffer


GATHER_GRID = {  # op -> (merge, block_cols, tile elements, warps)
    "fprop": [(m, c, e, w) for m, widths in ((False, (16, 32, 64, 128)), (True, (64, 128, 256, 512)))
              for c in widths for e, w in ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8))],
    "dgrad": [(m, c, e, w) for m, widths in ((False, (16, 32, 64)), (True, (128, 256, 512)))
              for c in widths for e, w in ((2048, 4), (4096, 8))],
}
WGRAD_GRID = [(32, 16, 16), (16, 16, 32), (32, 8, 32), (64, 8, 16), (16, 8, 64), (64, 4, 32), (32, 4, 64),
              (128, 4, 16), (128, 2, 32), (64, 16, 8)]  # (pixels, taps, channels) per program


def ranked(layer, op, tensors):
    g, _, _ = graph_of(layer, op, tensors)
    g.build()
    build = DepthwiseBuild(g, g.plan.groups[0], target_of(tensors["x"].device))
    return list(heuristics.schedule(build.problem, build.target).ranked), build.problem, build.target


def grid(op, problem, device, model: list) -> list:
    """Configs to time: the op's grid (merged columns where the problem merges), the model's
    estimates kept, and the model's choice."""
    by_text = {c.text: c for c in model}
    configs = []
    if op == "wgrad":
        for pixels, taps, channels in WGRAD_GRID:
            warps = max(1, min(8, pixels * taps * channels // (32 * heuristics.WGRAD_ELEMENTS_PER_THREAD)))
            splits = heuristics.wgrad_splits(problem, pixels, taps, channels, device)
            configs.append(heuristics.DepthwiseConfig("wgrad", pixels, channels, warps, taps, splits))
    else:
        for merge, width, elements, warps in GATHER_GRID[op]:
            if merge and not problem.merged_cols:
                continue
            configs.append(heuristics.DepthwiseConfig("gather", max(1, elements // width), width, warps, merge=merge))
    estimate = heuristics.wgrad_estimate if op == "wgrad" else heuristics.gather_estimate
    configs = [by_text.get(c.text) or replace(c, estimate_us=estimate(c, problem, device) * 1e6) for c in configs]
    if all(c.text != model[0].text for c in configs):
        configs.insert(0, model[0])  # the model's choice is always timed
    return configs


def _compile(jobs):
    """Worker: build (and so compile) each (layer, op, config)."""
    torch.cuda.init()
    done = 0
    for layer, op, config in jobs:
        try:
            tensors = inputs_of(layer)
            graph_of(layer, op, tensors)[0].build(options=dg.BuildOptions(depthwise_config=config))
            done += 1
        except Exception as error:  # noqa: BLE001 - reported when timed
            print(f"compile failed {layer} {op} {config.text}: {type(error).__name__}: {error}", flush=True)
    return done


def torch_ms(layer, op, tensors):
    x, w, b, dy, geo = tensors["x"], tensors["w"], tensors["bias"], tensors["dy"], tensors["geo"]
    if op == "fprop":
        return {"torch conv": median_ms(lambda: F.conv2d(x, w, **geo)),
                "torch conv+bias+relu": median_ms(lambda: torch.relu(F.conv2d(x, w, **geo) + b))}
    if op == "dgrad":
        return {"torch dgrad": median_ms(lambda: torch.nn.grad.conv2d_input(x.shape, w, dy, **geo))}
    return {"torch wgrad": median_ms(lambda: torch.nn.grad.conv2d_weight(x, w.shape, dy, **geo))}


def reference(op, tensors):
    """torch's output (cuDNN) of the op, the float32 reference for every config."""
    x, w, b, dy, geo = (tensors[k].float() if k != "geo" else tensors[k] for k in ("x", "w", "bias", "dy", "geo"))
    if op == "fprop":
        return torch.relu(F.conv2d(x, w, **geo) + b)
    if op == "dgrad":
        return torch.nn.grad.conv2d_input(x.shape, w, dy, **geo)
    return torch.nn.grad.conv2d_weight(x, w.shape, dy, **geo)


def traffic(op, tensors, out):
    names = {"fprop": ("x", "w", "bias"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}[op]
    return sum(tensors[k].numel() * tensors[k].element_size() for k in names) + out.numel() * out.element_size()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default="all", choices=("compile", "time", "all"))
    parser.add_argument("--ops", default="fprop,dgrad,wgrad")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; stop timing after")
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    start = time.time()
    torch.backends.cudnn.benchmark = True
    ops = args.ops.split(",")
    plans, jobs = {}, []
    for op in ops:  # every layer's fprop first: what the budget keeps
        for layer in LAYERS:
            tensors = inputs_of(layer)
            try:
                model, problem, device = ranked(layer, op, tensors)
            except Exception as error:  # noqa: BLE001 - the other layers and ops still run
                print(f"{layer} {op}: model's build failed: {type(error).__name__}: {str(error)[-400:]}", flush=True)
                continue
            configs = grid(op, problem, device, model)
            ranks = {c.text: i + 1 for i, c in enumerate(model)}
            plans[(layer, op)] = (configs, problem, ranks)
            jobs += [(layer, op, c) for c in configs]
    if args.phase in ("compile", "all"):
        print(f"{len(jobs)} kernels to compile ({time.time() - start:.0f} s)", flush=True)
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.workers) as pool:
            compiled = sum(pool.map(_compile, [jobs[i::args.workers] for i in range(args.workers)]))
        print(f"compiled {compiled} in parallel ({time.time() - start:.0f} s)", flush=True)
        if args.phase == "compile":
            return
    ceiling = copy_ceiling_tbs(1 << 28)
    print(f"device copy: {ceiling:.2f} TB/s", flush=True)
    results = {"copy_tbs": ceiling, "rows": []}
    for (layer, op), (configs, problem, ranks) in plans.items():
        tensors = inputs_of(layer)
        anchors = torch_ms(layer, op, tensors)
        expected = reference(op, tensors)
        print(f"\n{layer} {op}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in anchors.items()), flush=True)
        measured = []
        for config in configs:
            rank = ranks.get(config.text, 0) - 1
            if time.time() - start > args.budget:
                print("  (budget spent)")
                break
            try:
                g, bound, out = graph_of(layer, op, tensors)
                g.build(options=dg.BuildOptions(depthwise_config=config))
                out.fill_(float("nan"))
                g.execute(bound)
                err = rel_error(out, expected)
                ms = median_ms(lambda: g.execute(bound), warmup=5, rep=25)
            except Exception as error:  # noqa: BLE001
                print(f"  {rank + 1:3d} {config.text}: failed {type(error).__name__}: {str(error)[:200]}")
                continue
            tbs = traffic(op, tensors, out) / ms / 1e9
            wrong = "" if err < 2e-2 else f"  WRONG (error {err:.2g})"
            measured.append((ms, rank, config.text) if not wrong else (float("inf"), rank, config.text))
            print(f"  {rank + 1:3d} {config.text:40s} model {config.estimate_us:7.1f} us  "
                  f"measured {ms * 1e3:7.1f} us  {tbs:.2f} TB/s{wrong}", flush=True)
        if measured:
            best = min(measured)
            first = next((m for m in measured if m[1] == 0), None)  # the model's choice, if timed
            print(f"  best {best[2]} (rank {best[1] + 1}) {best[0] * 1e3:.1f} us; rank 1 / best = "
                  f"{(first[0] / best[0]) if first else float('nan'):.2f}", flush=True)
            for name, base in anchors.items():
                print(f"  vs {name}: best {base / best[0]:.2f}x, rank 1 "
                      f"{(base / first[0]) if first else float('nan'):.2f}x", flush=True)
        results["rows"].append({"layer": layer, "op": op, "anchors_ms": anchors, "problem": problem.signature(),
                                "measured": [(ms, rank, text) for ms, rank, text in measured]})
    write_json("depthwise_sweep.json", results)
    print(f"\ndone in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
