"""Sweep matmul kernel knobs (variant, tiles, stages, flatten, warp specialization) on the GPU.

Each config is forced through the heuristics' FORCE_CONFIG hook on y = gelu(a @ b + bias) in
bf16 and timed with do_bench; the table is what the candidate lists and the model's constants in
dnngraph/heuristics/matmul.py were set from.

    python benchmarks/sweep_matmul.py [--shapes 4096x4096x4096,8192x8192x8192]
"""
from __future__ import annotations

import argparse
import itertools

import torch

import dnngraph as dg
from dnngraph.heuristics import matmul as mm
from common import median_ms, print_table, write_json

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096)]


def configs():
    """The knob grid: persistent TMA around the 128x256 tile, tiled references."""
    found = []
    for (bm, bn), stages, flatten, specialize in itertools.product(((128, 256), (256, 128)), (3, 4),
                                                                    (False, True), (False, True)):
        found.append(mm.MatmulConfig("persistent", bm, bn, 64, 8, stages, flatten=flatten,
                                     warp_specialize=specialize))
    found += [mm.MatmulConfig("persistent", 128, 128, 64, 8, 4), mm.MatmulConfig("persistent", 128, 128, 64, 4, 4),
              mm.MatmulConfig("persistent", 128, 128, 128, 8, 3),
              mm.MatmulConfig("tiled", 128, 256, 64, 8, 3), mm.MatmulConfig("tiled", 128, 128, 64, 8, 4),
              mm.MatmulConfig("tiled", 256, 128, 64, 8, 3)]
    return found


def time_config(config, m, n, k, tensors) -> float:
    mm.FORCE_CONFIG = config
    try:
        g = dg.Graph(name="sweep", io_data_type=dg.bfloat16)
        a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
        bias = g.tensor(name="bias", dim=[1, n])
        g.gelu(g.add(g.matmul(a, b), bias)).set_output(True).set_name("y")
        g.build()
        assert g.plan.launches[0].config_text.startswith(config.text.split(" ")[0])
        return median_ms(lambda: g.execute(tensors))
    finally:
        mm.FORCE_CONFIG = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="comma-separated MxNxK")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows, results = [], []
    for m, n, k in shapes:
        tensors = {"a": torch.randn(m, k, device="cuda").bfloat16(),
                   "b": (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16(),
                   "bias": torch.randn(1, n, device="cuda").bfloat16(),
                   "y": torch.empty(m, n, device="cuda", dtype=torch.bfloat16)}
        for config in configs():
            try:
                ms = time_config(config, m, n, k, tensors)
                tflops = 2 * m * n * k / ms / 1e9
                cell = f"{tflops:.0f}"
            except Exception as error:  # report and go on: a knob may not compile on this chip
                ms, cell = None, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:60] if str(error) else ''}"
            print(f"{m}x{n}x{k} {config.text}: {cell}", flush=True)
            rows.append([f"{m}x{n}x{k}", config.text, cell])
            results.append({"shape": [m, n, k], "config": config.to_record(), "ms": ms})
    print_table("matmul + bias + gelu bf16, forced configs", ["M x N x K", "config", "TFLOP/s"], rows)
    write_json("sweep_matmul.json", results)


if __name__ == "__main__":
    main()
