"""Gluon matmul epilogues under forced configs beside cuBLASLt's fused epilogue (issue 28), H200.

    python benchmarks/bench_gelu_epilogue.py                 # 4096^3 and 8192^3, bf16, under two minutes
    python benchmarks/bench_gelu_epilogue.py --precise       # the GELU rows again with the precise (fp32) math
    python benchmarks/bench_gelu_epilogue.py --shapes 4096x4096x4096
    python benchmarks/bench_gelu_epilogue.py --epilogue-walk both --epilogues none,gelu_tanh,gelu \
        --configs 128x256s4,128x128s6
        # each config with its epilogue's subtiles in a loop and unrolled (GluonConfig.epilogue_loop)

y = act(a @ b + bias), bf16 in and out, fp32 accumulation, for act in none (bias), relu,
gelu_tanh, gelu (erf), each under the configs 128x256 4 stages, 128x256 3 stages and 128x128
6 stages (2 consumers each; the heavy-epilogue filter lifted). GELU of a bf16 output takes the
16-bit math (problems/base.py fast_math_outputs); --precise also times the precise forms
(FAST_MATH_OPS emptied), in the same process. Anchors: cuBLASLt's fused epilogue
(torch.addmm; torch._addmm_activation with use_gelu=False (relu) and True (tanh GELU, which
also stands in for the erf rows: cuBLASLt's GELU epilogue is the tanh form). Every output is
checked against a float32 torch reference before timing. TFLOP/s over 2*M*N*K; "vs Lt" is the
anchor's time over the config's (above 1: dnngraph faster). "cuBLAS mm" is torch.mm without a bias
or activation: the GEMM alone, what an epilogue costs is the gap to it.

--configs: the columns (default: the three above; also the ping-pong configs, "pp ..."), each
under every subtile width --epilogue-n gives (a config's own where none is given).
--epilogue-walk: the configs' epilogues walk their column subtiles in a loop (the default build,
"loop"), unrolled ("unrolled", the kernel before issue 28's loop), or both (each config twice,
"/loop" and "/unrol" columns).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import dnngraph as dg  # noqa: E402
import dnngraph.backends.gluon.backend as gluon_backend  # noqa: E402
import dnngraph.problems.base as problems_base  # noqa: E402
from bench_matmul import build_graph, make_inputs, parse_shapes  # noqa: E402
from common import median_ms, rel_error  # noqa: E402
from dnngraph.backends.gluon.backend import GluonConfig  # noqa: E402
from dnngraph.runtime import plan_cache  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]
CONFIGS = {"128x256 s4": GluonConfig(128, 256, 64, 4, 2), "128x256 s3": GluonConfig(128, 256, 64, 3, 2),
           "128x128 s6": GluonConfig(128, 128, 64, 6, 2)}
EPILOGUES = ("none", "relu", "gelu_tanh", "gelu")
# more configs --configs may name: the ping-pong ones (PINGPONG_CONFIGS), offered by no default build
EXTRA_CONFIGS = {"pp 128x128 s4": gluon_backend.PINGPONG_CONFIGS[0], "pp 64x256 s4": gluon_backend.PINGPONG_CONFIGS[1]}
ALL_CONFIGS = {**CONFIGS, **EXTRA_CONFIGS}
WALKS = {"loop": (True, ), "unrolled": (False, ), "both": (True, False)}
MAX_ERROR = 1e-2
WARMUP_MS, REP_MS = 10, 40


def reference(a, b, bias, epilogue):
    pre = a.float() @ b.float() + bias.float()
    if epilogue == "gelu":
        return F.gelu(pre)
    if epilogue == "gelu_tanh":
        return F.gelu(pre, approximate="tanh")
    if epilogue == "relu":
        return F.relu(pre)
    return pre


def anchor(a, b, bias, epilogue):
    """cuBLASLt's fused epilogue for `epilogue` (the tanh GELU for both GELU rows)."""
    if epilogue in ("gelu", "gelu_tanh"):
        return lambda: torch._addmm_activation(bias, a, b, use_gelu=True)
    if epilogue == "relu":
        return lambda: torch._addmm_activation(bias, a, b, use_gelu=False)
    return lambda: torch.addmm(bias, a, b)


def forced(config: GluonConfig, m, n, k, epilogue, inputs, expected):
    """(ms, config text, fast math?) of the gluon kernel under `config`, its output checked."""
    a, b, bias = inputs
    names = ("CONFIGS", "PINGPONG_CONFIGS", "OFFER_PINGPONG", "HEAVY_EPILOGUE_ACCUMULATORS")
    saved = {name: getattr(gluon_backend, name) for name in names}
    offered = {"CONFIGS": () if config.pingpong else (config, ),
               "PINGPONG_CONFIGS": (config, ) if config.pingpong else (), "OFFER_PINGPONG": config.pingpong,
               "HEAVY_EPILOGUE_ACCUMULATORS": 1 << 20}
    try:
        for name, value in offered.items():
            setattr(gluon_backend, name, value)
        plan_cache.clear()
        graph, (ta, tb, tbias, ty) = build_graph(m, n, k, epilogue)
        graph.build(options=dg.BuildOptions(backends=("gluon",)))
    finally:
        for name, value in saved.items():
            setattr(gluon_backend, name, value)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    bindings = {ta: a, tb: b, tbias: bias.view(1, n), ty: y}
    graph.execute(bindings)
    error = rel_error(y, expected)
    if not error < MAX_ERROR:
        raise AssertionError(f"{config} {epilogue}: relative error {error:.2e}")
    launch = graph.plan.launches[0]
    if ("epilogue-unrolled" in launch.config_text) == config.epilogue_loop:
        raise AssertionError(f"{config} ran as {launch.config_text}")
    fast = "_fast(" in open(launch.source_path).read()
    return median_ms(lambda: graph.execute(bindings), warmup=WARMUP_MS, rep=REP_MS), launch.config_text, fast


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def walked_configs(walk: str, names=tuple(CONFIGS), widths=()) -> dict:
    """column name -> config: those of ALL_CONFIGS `names` gives, with each subtile width of
    `widths` (none: each config's own; those that do not divide a config's BLOCK_N into 1, 2 or
    4 subtiles are left out), each with the epilogue walks `walk` names (WALKS)."""
    loops = WALKS[walk]
    chosen = {name: ALL_CONFIGS[name] for name in names}
    if widths:
        chosen = {f"{name} e{width}": replace(config, epilogue_n=width) for name, config in chosen.items()
                  for width in widths if config.block_n % width == 0 and config.block_n // width in (1, 2, 4)}
    if len(loops) == 1:
        return {name: replace(config, epilogue_loop=loops[0]) for name, config in chosen.items()}
    return {f"{name}/{'loop' if loop else 'unrol'}": replace(config, epilogue_loop=loop)
            for name, config in chosen.items() for loop in loops}


def run(shapes, precise: bool, epilogues=EPILOGUES, walk: str = "loop", config_names=tuple(CONFIGS), widths=()):
    variants = [(e, True) for e in epilogues] + ([(e, False) for e in ("gelu_tanh", "gelu") if e in epilogues]
                                                 if precise else [])
    configs = walked_configs(walk, config_names, widths)
    print("| M x N x K | epilogue | math | cuBLAS mm | cuBLASLt epi | " + " | ".join(configs) + " | best vs Lt |")
    print("|---|---|---|---|---|" + "---|" * len(configs) + "---|")
    for m, n, k in shapes:
        a, b, bias = make_inputs(m, n, k, "cuda")
        mm_ms = median_ms(lambda: torch.mm(a, b), warmup=WARMUP_MS, rep=REP_MS)
        for epilogue, fast_math in variants:
            expected = reference(a, b, bias, epilogue)
            lt_ms = median_ms(anchor(a, b, bias, epilogue), warmup=WARMUP_MS, rep=REP_MS)
            saved_ops = problems_base.FAST_MATH_OPS
            if not fast_math:
                problems_base.FAST_MATH_OPS = frozenset()  # every output takes the precise math
            cells, best, kinds = [], math.inf, set()
            try:
                for config in configs.values():
                    try:
                        ms, _, fast = forced(config, m, n, k, epilogue, (a, b, bias), expected)
                        kinds.add("16-bit" if fast else "precise")
                        best = min(best, ms)
                        cells.append(f"{tflops(m, n, k, ms):.0f} ({lt_ms / ms:.2f})")
                    except Exception as error:  # noqa: BLE001 - shown in the cell, the others go on
                        cells.append(f"failed: {type(error).__name__}: {str(error)[:60]}")
            finally:
                problems_base.FAST_MATH_OPS = saved_ops
            math_name = "/".join(sorted(kinds)) if epilogue.startswith("gelu") else "-"
            print(f"| {m}x{n}x{k} | {epilogue} | {math_name} | {tflops(m, n, k, mm_ms):.0f} | "
                  f"{tflops(m, n, k, lt_ms):.0f} | " + " | ".join(cells)
                  + f" | {lt_ms / best:.2f} |", flush=True)
        del expected


def config_list(text: str) -> tuple:
    """ALL_CONFIGS names from "128x256s4,128x128s6,pp128x128s4" (spaces optional)."""
    by_key = {name.replace(" ", ""): name for name in ALL_CONFIGS}
    keys = [key.replace(" ", "") for key in text.split(",") if key.strip()]
    if not keys or any(key not in by_key for key in keys):
        raise argparse.ArgumentTypeError(f"configs are of {', '.join(by_key)}, not {text!r}")
    return tuple(by_key[key] for key in keys)


def epilogue_list(text: str) -> tuple:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in EPILOGUES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"epilogues are of {', '.join(EPILOGUES)}, not {text!r}")
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=None, help="comma-separated MxNxK")
    parser.add_argument("--precise", action="store_true", help="the GELU rows with the precise math too")
    parser.add_argument("--epilogues", type=epilogue_list, default=EPILOGUES,
                        help=f"comma-separated, of {','.join(EPILOGUES)} (none: the bias alone)")
    parser.add_argument("--epilogue-walk", choices=sorted(WALKS), default="loop",
                        help="the subtiles of each config's epilogue in a loop, unrolled, or each config both ways")
    parser.add_argument("--configs", type=config_list, default=tuple(CONFIGS),
                        help="comma-separated, of " + ",".join(name.replace(" ", "") for name in ALL_CONFIGS)
                        + " (default: the first three; pp: ping-pong)")
    parser.add_argument("--epilogue-n", type=lambda text: tuple(int(w) for w in text.split(",")), default=(),
                        help="comma-separated subtile widths, each config under each (default: its own, 64)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dnngraph {dg.__version__}")
    print("cells: TFLOP/s (cuBLASLt time / config time)\n")
    run(args.shapes or SHAPES, args.precise, args.epilogues, args.epilogue_walk, args.configs, args.epilogue_n)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
