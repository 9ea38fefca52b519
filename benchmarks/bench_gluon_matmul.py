"""Gluon matmul (the opt-in backend) beside the Triton backend and what a user would pick instead.

    cd benchmarks && python3 bench_gluon_matmul.py                  # bias and bias+gelu_tanh, 12 shapes
    python3 bench_gluon_matmul.py --fp8                              # fp8 e4m3 and bf16 with K-major B
    python3 bench_gluon_matmul.py --configs --shapes 4096x4096x4096  # every gluon config forced in turn
    python3 bench_gluon_matmul.py --configs --pingpong               # the same, the ping-pong configs too

bf16 in and out, fp32 accumulation, y = act(a @ b + bias). "gluon" is a build with
BuildOptions(backends=("gluon", "triton")): the registry takes the backend and config its models
rank first (Triton's for the shapes gluon does not take, or where its model wins). Anchors in the
same process: cuBLASLt's fused epilogue (torch.addmm / torch._addmm_activation, whose GELU is the
tanh form, so the dnngraph rows compute gelu_tanh too), cuBLAS with separate torch ops, and for
fp8 torch._scaled_mm. TFLOP/s over 2*M*N*K; every dnngraph output is checked against a float32
reference before timing. Ratios are anchor time / dnngraph time (above 1: dnngraph faster).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dnngraph as dg  # noqa: E402
import dnngraph.backends.gluon.backend as gluon_backend  # noqa: E402
from bench_matmul import build_graph, make_inputs, parse_shapes  # noqa: E402
from common import median_ms, rel_error  # noqa: E402
from dnngraph.runtime import plan_cache  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096), (4096, 4096, 11008), (2048, 8192, 2048),
          (8192, 2048, 8192), (4000, 4000, 4000), (3000, 5000, 1000), (4096, 14336, 4096), (1024, 1024, 1024),
          (16, 8192, 8192), (777, 1234, 560)]
FP8_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096), (16, 8192, 8192)]
GLUON_FIRST = ("gluon", "triton")
MAX_ERROR = 2e-2


def run_graph(graph, bindings: dict, output: torch.Tensor, reference: torch.Tensor, backends: tuple) -> tuple:
    """(milliseconds, config text) of `graph` built for `backends` (a fresh plan), its output
    checked first."""
    plan_cache.clear()
    graph.build(options=dg.BuildOptions(backends=backends))
    graph.execute(bindings)
    error = rel_error(output, reference)
    if not error < MAX_ERROR:
        raise AssertionError(f"relative error {error:.2e} against the reference")
    launch = graph.plan.launches[0]
    return median_ms(lambda: graph.execute(bindings), rep=80), f"{launch.backend}: {launch.config_text}"


def epilogue_row(m, n, k, epilogue: str, backends_rows: dict) -> dict:
    a, b, bias = make_inputs(m, n, k, "cuda")
    reference = a.float() @ b.float() + bias.float()
    if epilogue == "gelu_tanh":
        reference = F.gelu(reference, approximate="tanh")
        anchors = {"cuBLASLt epi": lambda: torch._addmm_activation(bias, a, b, use_gelu=True),
                   "cuBLAS + separate": lambda: F.gelu(a @ b + bias, approximate="tanh")}
    else:
        anchors = {"cuBLASLt epi": lambda: torch.addmm(bias, a, b), "cuBLAS + separate": lambda: a @ b + bias}
    row = {name: median_ms(fn, rep=80) for name, fn in anchors.items()}
    for label, backends in backends_rows.items():
        graph, (ta, tb, tbias, ty) = build_graph(m, n, k, epilogue)
        y = torch.full((m, n), float("nan"), dtype=a.dtype, device="cuda")
        bindings = {ta: a, tb: b, tbias: bias.view(1, n), ty: y}
        row[label], row[label + " config"] = run_graph(graph, bindings, y, reference, backends)
    return row


def fp8_graph(m, n, k, data_type):
    g = dg.Graph(name="fp8", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[m, k], data_type=data_type)
    b = g.tensor(name="b", dim=[k, n], stride=[1, k], data_type=data_type)  # K-major (B^T dense)
    scales = {}
    if data_type is dg.float8_e4m3:
        scales = {"scale_a": g.tensor(name="scale_a", dim=[1], data_type=dg.float32),
                  "scale_b": g.tensor(name="scale_b", dim=[1], data_type=dg.float32)}
    g.matmul(a, b, name="mm", **scales).set_output(True).set_name("y")
    return g


def fp8_row(m, n, k, data_type) -> dict:
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda").to(data_type.torch_dtype)
    b = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(data_type.torch_dtype).t()
    scale_a, scale_b = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
    reference = (a.float() @ b.float()) * (0.5 * 2.0 if data_type is dg.float8_e4m3 else 1.0)
    if data_type is dg.float8_e4m3:
        row = {"anchor": median_ms(lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                                             out_dtype=torch.bfloat16), rep=80)}
        bindings = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b}
    else:
        row = {"anchor": median_ms(lambda: a @ b, rep=80)}
        bindings = {"a": a, "b": b}
    for label, backends in (("gluon", GLUON_FIRST), ("triton", ("triton",))):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        row[label], row[label + " config"] = run_graph(fp8_graph(m, n, k, data_type), {**bindings, "y": y}, y,
                                                       reference, backends)
    return row


def tflops(m, n, k, ms: float) -> str:
    return f"{2 * m * n * k / ms / 1e9:.0f}"


def geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def epilogue_tables(shapes, epilogues):
    columns = {"triton": ("triton",), "gluon": GLUON_FIRST}
    for epilogue in epilogues:
        print(f"\n### {epilogue}: y = {'gelu_tanh(a @ b + bias)' if epilogue == 'gelu_tanh' else 'a @ b + bias'}\n")
        print("| M x N x K | cuBLAS + separate | cuBLASLt epi | dg triton | dg gluon | gluon vs Lt | gluon vs best "
              "anchor | gluon vs triton | gluon's choice |")
        print("|---|---|---|---|---|---|---|---|---|")
        ratios = {"lt": [], "best": [], "triton": []}
        for m, n, k in shapes:
            row = epilogue_row(m, n, k, epilogue, columns)
            best = min(row["cuBLASLt epi"], row["cuBLAS + separate"])
            found = {"lt": row["cuBLASLt epi"] / row["gluon"], "best": best / row["gluon"],
                     "triton": row["triton"] / row["gluon"]}
            for key, value in found.items():
                ratios[key].append(value)
            print(f"| {m}x{n}x{k} | {tflops(m, n, k, row['cuBLAS + separate'])} | {tflops(m, n, k, row['cuBLASLt epi'])}"
                  f" | {tflops(m, n, k, row['triton'])} | {tflops(m, n, k, row['gluon'])} | {found['lt']:.2f} | "
                  f"{found['best']:.2f} | {found['triton']:.2f} | {row['gluon config'][:70]} |", flush=True)
        print(f"\nGeometric means: gluon vs cuBLASLt {geomean(ratios['lt']):.3f}, vs the best anchor "
              f"{geomean(ratios['best']):.3f}, vs the Triton backend {geomean(ratios['triton']):.3f}")


def fp8_table(shapes):
    print("\n### fp8 e4m3 with per-tensor scales (bf16 out), and bf16 with K-major B\n")
    print("| operands | M x N x K | anchor | dg gluon | dg triton | gluon vs anchor | gluon's choice |")
    print("|---|---|---|---|---|---|---|")
    for data_type, anchor in ((dg.float8_e4m3, "torch._scaled_mm"), (dg.bfloat16, "cuBLAS")):
        for m, n, k in shapes:
            row = fp8_row(m, n, k, data_type)
            print(f"| {data_type.name} ({anchor}) | {m}x{n}x{k} | {tflops(m, n, k, row['anchor'])} | "
                  f"{tflops(m, n, k, row['gluon'])} | {tflops(m, n, k, row['triton'])} | "
                  f"{row['anchor'] / row['gluon']:.2f} | {row['gluon config'][:70]} |", flush=True)


def config_table(shapes, epilogues, pingpong: bool):
    """Every config of CONFIGS (and PINGPONG_CONFIGS) forced in turn (the heavy-epilogue filter
    lifted), gluon alone."""
    configs = gluon_backend.CONFIGS + (gluon_backend.PINGPONG_CONFIGS if pingpong else ())
    print("\n### Every gluon config forced (TFLOP/s)\n")
    print("| M x N x K | epilogue | " + " | ".join(c.text.replace("gluon warp-specialized ", "") for c in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    limit = gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS
    try:
        gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS = 1 << 20
        for m, n, k in shapes:
            for epilogue in epilogues:
                cells = []
                for config in configs:
                    gluon_backend.CONFIGS = (config,)
                    try:
                        row = epilogue_row(m, n, k, epilogue, {"gluon": ("gluon",)})
                        cells.append(tflops(m, n, k, row["gluon"]))
                    except Exception as error:  # noqa: BLE001 - a config the problem refuses
                        cells.append(f"refused ({type(error).__name__})")
                print(f"| {m}x{n}x{k} | {epilogue} | " + " | ".join(cells) + " |", flush=True)
    finally:
        gluon_backend.CONFIGS, gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS = configs, limit


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=None, help="comma-separated MxNxK")
    parser.add_argument("--epilogues", default="none,gelu_tanh", help="comma-separated: none (bias), gelu_tanh")
    parser.add_argument("--fp8", action="store_true", help="the fp8 / K-major table instead")
    parser.add_argument("--configs", action="store_true", help="every gluon config forced instead")
    parser.add_argument("--pingpong", action="store_true", help="with --configs: the ping-pong configs too")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dnngraph {dg.__version__}")
    epilogues = [e for e in args.epilogues.split(",") if e]
    if args.fp8:
        fp8_table(args.shapes or FP8_SHAPES)
    elif args.configs:
        config_table(args.shapes or SHAPES[:2], epilogues, args.pingpong)
    else:
        epilogue_tables(args.shapes or SHAPES, epilogues)


if __name__ == "__main__":
    main()
