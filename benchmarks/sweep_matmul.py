"""Sweep matmul kernel knobs (variant, tiles, stages, flatten, warp specialization, epilogue
subtiles, TMA stores) on the GPU.

Each config is forced through BuildOptions(matmul_config=...) on one epilogue in bf16 and
timed with do_bench; the table is what the candidate lists and the model's constants in
dnngraph/backends/triton/heuristics/matmul.py were set from. Epilogues (--epilogue):
  gelu           y = gelu(a @ b + bias); anchor: cuBLASLt (bias + GELU in its epilogue,
                 torch._addmm_activation; tanh GELU)
  swiglu         y = silu(gate) * (a @ b), gate a [M, N] input (a Llama MLP's up projection)
  silu_backward  d = a @ b; d_up = d * silu(gate), d_gate = silu_backward(d * up, gate): two
                 [M, N] inputs, two outputs (the MLP's backward through its down projection)
The last two are anchored on torch.compile of the same function (cuBLAS and one fused Triton
pointwise kernel, what inductor runs in the model). Each shape starts with its anchor timed in
the same process and every row carries its ratio to it.

    python benchmarks/sweep_matmul.py [--shapes 4096x4096x4096,8192x8192x8192] [--only subtile,tma-store]
                                      [--epilogue gelu|swiglu|silu_backward]
"""
from __future__ import annotations

import argparse
import itertools

import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
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
    return found + epilogue_configs()


def epilogue_configs():
    """Epilogue subtiles and TMA stores around the model's first choice (128x256x64 w8 s3), the
    256x128 s4 tile and 128x128: the rows the knobs' candidates were chosen from (benchmarks/history/2026.md)."""
    wide = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    knobs = [dict(epilogue_subtile=2), dict(epilogue_subtile=2, tma_store=True),
             dict(epilogue_subtile=2, tma_store=True, flatten=True),
             dict(epilogue_subtile=2, tma_store=True, warp_specialize=True),
             dict(epilogue_subtile=4, tma_store=True), dict(tma_store=True), dict(epilogue_subtile=4)]
    found = [mm.MatmulConfig("persistent", **wide, **knob) for knob in knobs]
    tall = dict(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=4)
    found += [mm.MatmulConfig("persistent", **tall, epilogue_subtile=2),
              mm.MatmulConfig("persistent", **tall, epilogue_subtile=2, tma_store=True),
              mm.MatmulConfig("persistent", **tall, epilogue_subtile=4, tma_store=True),
              mm.MatmulConfig("persistent", 128, 128, 64, 8, 4, epilogue_subtile=2, tma_store=True)]
    return found


def selected(only):
    """configs(), or those whose text holds one of the comma-separated words in `only`, after
    the reference row."""
    if not only:
        return configs()
    words = only.split(",")
    reference = mm.MatmulConfig("persistent", 128, 256, 64, 8, 3)
    return [reference] + [c for c in configs() if c != reference and any(w in c.text for w in words)]


def _gelu_graph(g, product, m, n):
    g.gelu(g.add(product, g.tensor(name="bias", dim=[1, n]))).set_output(True).set_name("y")


def _swiglu_graph(g, product, m, n):
    g.mul(g.silu(g.tensor(name="gate", dim=[m, n])), product).set_output(True).set_name("y")


def _silu_backward_graph(g, product, m, n):
    gate, up = g.tensor(name="gate", dim=[m, n]), g.tensor(name="up", dim=[m, n])
    g.mul(product, g.silu(gate)).set_output(True).set_name("d_up")
    g.silu_backward(g.mul(product, up), gate).set_output(True).set_name("d_gate")


def _torch_swiglu(t):
    return torch.nn.functional.silu(t["gate"]) * (t["a"] @ t["b"])


def _torch_silu_backward(t):
    d = t["a"] @ t["b"]
    return d * torch.nn.functional.silu(t["gate"]), torch.ops.aten.silu_backward(d * t["up"], t["gate"])


# name -> (graph builder, extra [M, N] inputs, outputs, torch function for the compiled anchor)
EPILOGUES = {"gelu": (_gelu_graph, (), ("y",), None),
             "swiglu": (_swiglu_graph, ("gate",), ("y",), _torch_swiglu),
             "silu_backward": (_silu_backward_graph, ("gate", "up"), ("d_up", "d_gate"), _torch_silu_backward)}


def time_config(config, m, n, k, tensors, epilogue="gelu") -> float:
    g = dg.Graph(name="sweep", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
    EPILOGUES[epilogue][0](g, g.matmul(a, b), m, n)
    g.build(options=dg.BuildOptions(matmul_config=config))
    assert g.plan.launches[0].config_text.startswith(config.text)  # no knob dropped
    return median_ms(lambda: g.execute(tensors))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="comma-separated MxNxK")
    parser.add_argument("--only", default=None,
                        help="comma-separated words; time only configs whose text holds one (and the plain "
                             "persistent 128x256x64 w8 s3 as the reference row)")
    parser.add_argument("--epilogue", default="gelu", choices=sorted(EPILOGUES))
    args = parser.parse_args()
    _, inputs, outputs, torch_fn = EPILOGUES[args.epilogue]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows, results = [], []
    for m, n, k in shapes:
        tensors = {"a": torch.randn(m, k, device="cuda").bfloat16(),
                   "b": (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16(),
                   **({"bias": torch.randn(1, n, device="cuda").bfloat16()} if args.epilogue == "gelu" else {})}
        tensors.update({name: torch.randn(m, n, device="cuda").bfloat16() for name in inputs})
        tensors.update({name: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for name in outputs})
        flops = 2 * m * n * k
        if torch_fn is None:
            anchor = "cuBLASLt epilogue (anchor)"
            lt_ms = median_ms(lambda: torch._addmm_activation(tensors["bias"][0], tensors["a"], tensors["b"],
                                                              use_gelu=True))
        else:
            anchor, compiled = "torch.compile (anchor)", torch.compile(torch_fn)
            lt_ms = median_ms(lambda: compiled(tensors))
        rows.append([f"{m}x{n}x{k}", anchor, f"{flops / lt_ms / 1e9:.0f}", "1.00"])
        results.append({"shape": [m, n, k], "config": "cublaslt" if torch_fn is None else "torch.compile",
                        "epilogue": args.epilogue, "ms": lt_ms})
        for config in selected(args.only):
            try:
                ms = time_config(config, m, n, k, tensors, args.epilogue)
                cell, ratio = f"{flops / ms / 1e9:.0f}", f"{lt_ms / ms:.2f}"
            except Exception as error:  # report and go on: a knob may not compile on this chip
                ms, ratio = None, ""
                cell = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:60] if str(error) else ''}"
            print(f"{m}x{n}x{k} {config.text}: {cell} ({ratio} of the anchor)", flush=True)
            rows.append([f"{m}x{n}x{k}", config.text, cell, ratio])
            results.append({"shape": [m, n, k], "config": config.to_record(), "epilogue": args.epilogue, "ms": ms})
    print_table(f"matmul + {args.epilogue} epilogue bf16, forced configs", ["M x N x K", "config", "TFLOP/s", "/ anchor"],
                rows)
    write_json("sweep_matmul.json" if args.epilogue == "gelu" else f"sweep_matmul_{args.epilogue}.json", results)


if __name__ == "__main__":
    main()
