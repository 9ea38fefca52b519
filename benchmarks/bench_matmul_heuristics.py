"""Matmul heuristic quality: how close the model's first-choice config is to the best one timed.

Each problem (bf16; plain matmul, or matmul + bias + erf GELU) is built with
g.build(autotune=True) and DNNGRAPH_AUTOTUNE_TOP=all, so every candidate config is timed, in a
throw-away DNNGRAPH_CACHE_DIR (nothing is read from an earlier run's tuning cache). The matmul
launch's `tuning.timings` holds (config text, model rank, ms) per candidate, model rank 0 being
the model's first choice; the quality of a problem is

    quality = min(ms over candidates) / ms(model rank 0)      (<= 1; 1: the model picked the best)

Goals: geometric mean of quality >= 0.95, worst case >= 0.80. A problem whose model-rank-0
candidate has no timing (it failed, or was not timed) counts against the worst case.

Problems: LLM projections and MLPs (Llama-ish (N, K) pairs, M from 1 to 16384, the 128256-wide
LM head), convolutions as GEMMs (M = batch*H*W, K = C*R*S) and odd sizes. The tuned plan's output
is also checked against a float32 torch reference (--no-check skips it).

    python benchmarks/bench_matmul_heuristics.py                       # GPU; $OUT/matmul_heuristics.json
    python benchmarks/bench_matmul_heuristics.py --only llm --max-problems 10
    python benchmarks/bench_matmul_heuristics.py --skip 16             # resume after a budget stop
    python benchmarks/bench_matmul_heuristics.py --check-cpu           # 2 tiny fp32 problems, interpreter

The run stops starting problems after --budget-s seconds (default 420, to fit one 10-minute
device call) and prints the --skip value that resumes it; the JSON is rewritten after every
problem, so what ran survives a later failure.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

if "--check-cpu" in sys.argv[1:]:  # CPU tensors run through Triton's interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from bench_matmul import (TOLERANCE, _short, activation, build_graph, make_inputs, matmul_launch,
                          reference_pre, timing_entries)
from common import print_table, rel_error, write_json

GOAL_GEOMEAN, GOAL_WORST = 0.95, 0.80


@dataclass(frozen=True)
class Problem:
    category: str  # llm, cnn, odd, cpu
    name: str
    m: int
    n: int
    k: int
    epilogue: str  # "plain" (matmul only) or "bias+gelu" (matmul + bias + erf GELU)

    @property
    def label(self) -> str:
        return f"{self.category} {self.name} {self.m}x{self.n}x{self.k} {self.epilogue}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def _llm(name, n, k, epilogue, ms):
    return [Problem("llm", name, m, n, k, epilogue) for m in ms]


# Llama-2-7B: hidden 4096, MLP 11008; Llama-3-8B: MLP 14336, vocabulary 128256. M = tokens.
PROBLEMS = (
    _llm("attn-proj", 4096, 4096, "plain", (1, 16, 128, 512, 2048, 4096, 16384))
    + _llm("mlp-up", 11008, 4096, "bias+gelu", (1, 128, 2048, 16384))
    + _llm("mlp-down", 4096, 11008, "plain", (16, 512, 4096))
    + _llm("mlp-up-l3", 14336, 4096, "bias+gelu", (16, 512, 4096, 16384))
    + _llm("lm-head", 128256, 4096, "plain", (1, 128, 2048))
    + [
        # ResNet-50-like 3x3 convolutions as GEMMs at batch 256, 64 and 4 (M = N*H*W, K = C*3*3)
        Problem("cnn", "conv56", 802816, 64, 576, "plain"),
        Problem("cnn", "conv28", 200704, 128, 1152, "bias+gelu"),
        Problem("cnn", "conv14", 50176, 256, 2304, "plain"),
        Problem("cnn", "conv7", 12544, 512, 4608, "bias+gelu"),
        Problem("cnn", "conv56-b4", 12544, 64, 576, "bias+gelu"),
        Problem("cnn", "conv7-b64", 3136, 512, 4608, "plain"),
        # sizes off every power of two; 777x1234x555 rows are not 16-byte aligned (K*2, N*2 bytes)
        Problem("odd", "cube1000", 1000, 1000, 1000, "bias+gelu"),
        Problem("odd", "ragged", 777, 1234, 555, "plain"),
        Problem("odd", "thin", 33, 4099, 513, "bias+gelu"),
        Problem("odd", "cube4000", 4000, 4000, 4000, "plain"),
        Problem("odd", "wide", 3000, 5000, 1000, "bias+gelu"),
    ]
)
CPU_PROBLEMS = (Problem("cpu", "tiny", 16, 32, 24, "bias+gelu"), Problem("cpu", "odd", 33, 47, 29, "plain"))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def quality_of(entries) -> dict:
    """Model choice, tuned best and quality from [(config, model_rank, ms)]."""
    timed = [e for e in entries if _finite(e[2])]
    if not timed:
        return {"quality": None, "why": "no candidate has a timing"}
    best = min(timed, key=lambda e: e[2])
    model = next((e for e in entries if e[1] == 0), None)
    # candidates that fail to compile or run are left out of the timings: count the ranks missing
    # below the highest one timed (a lower bound when the last-ranked candidates failed)
    ranks = {e[1] for e in entries if e[1] >= 0}
    missing = (max(ranks) + 1 - len(ranks)) if ranks else 0
    result = {"best_config": best[0], "best_ms": best[2], "best_rank": best[1], "timed": len(timed),
              "failed": missing + len(entries) - len(timed)}
    if model is None:
        return {**result, "quality": None, "why": "the model's first choice (rank 0) is not among the timings"}
    result.update(model_config=model[0], model_ms=model[2] if _finite(model[2]) else None)
    if result["model_ms"] is None:
        return {**result, "quality": None, "why": "the model's first choice has no timing (failed?)"}
    return {**result, "quality": best[2] / model[2]}


def run_problem(problem: Problem, device, dtype, check: bool) -> dict:
    row = {"label": problem.label, "category": problem.category, "name": problem.name,
           "m": problem.m, "n": problem.n, "k": problem.k, "epilogue": problem.epilogue,
           "gflop": problem.flops / 1e9}
    start = time.perf_counter()
    try:
        graph_dtype = dg.bfloat16 if dtype == torch.bfloat16 else dg.float32
        g, (ta, tb, tbias, ty) = build_graph(problem.m, problem.n, problem.k, _activation(problem),
                                             dtype=graph_dtype, name=f"mm_{problem.category}_{problem.name}",
                                             with_bias=problem.epilogue != "plain")
        g.build(autotune=True)
        row["build_s"] = time.perf_counter() - start
        launches = list(getattr(g.plan, "launches", None) or [])
        launch = matmul_launch(g.plan)
        row["launches"] = len(launches)
        row["configs"] = [getattr(l, "config_text", "") for l in launches]
        tuning = getattr(launch, "tuning", None) if launch is not None else None
        if launch is None:
            row.update(status="n/a", error="the plan has no matmul launch")
        elif tuning is None:
            row.update(status="n/a", error="the matmul launch has no tuning record")
        else:
            entries = timing_entries(tuning)
            row.update(status="ok", source=getattr(tuning, "source", None),
                       chosen=getattr(tuning, "chosen", None), timings=entries,
                       launch_config=getattr(launch, "config_text", None), **quality_of(entries))
            for key, ms in (("model", row.get("model_ms")), ("best", row.get("best_ms"))):
                if _finite(ms):
                    row[f"{key}_tflops"] = problem.flops / ms / 1e9
    except Exception as error:  # noqa: BLE001 - the matmul kernels are work in progress
        row.update(status="n/a", error=_short(error, 400), build_s=time.perf_counter() - start)
        return row
    if check:
        try:
            row["rel_error"] = check_output(problem, g, (ta, tb, tbias, ty), device, dtype)
        except Exception as error:  # noqa: BLE001
            row["check_error"] = _short(error, 200)
    row["seconds"] = time.perf_counter() - start
    return row


def check_output(problem, g, tensors, device, dtype) -> float:
    """Relative error of the tuned plan's output against the float32 torch reference."""
    ta, tb, tbias, ty = tensors
    a, b, bias = make_inputs(problem.m, problem.n, problem.k, device, dtype)
    if tbias is None:
        bias = None
    y = torch.full((problem.m, problem.n), float("nan"), dtype=dtype, device=device)
    bindings = {ta: a, tb: b, ty: y}
    if tbias is not None:
        bindings[tbias] = bias.view(1, problem.n)
    g.execute(bindings)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return rel_error(y, activation(_activation(problem), reference_pre(a, b, bias)))


def _activation(problem) -> str:
    return "gelu" if problem.epilogue == "bias+gelu" else "none"


# --- reporting -----------------------------------------------------------------------------------
def _cut(text, width=64) -> str:
    text = "-" if text is None else str(text)
    return text if len(text) <= width else text[:width - 3] + "..."


def _geomean(values):
    values = [v for v in values if _finite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _fmt(value, spec) -> str:
    return format(value, spec) if _finite(value) else "-"


def _error_cell(row) -> str:
    if "check_error" in row:
        return "failed"
    error = row.get("rel_error")
    if error is None:
        return "-"
    return f"{error:.0e}" + ("" if math.isfinite(error) and error <= TOLERANCE else " (!)")


def table(rows):
    out = []
    for index, row in enumerate(rows):
        if row.get("status") != "ok":
            out.append([index, row["label"], row["m"], row["n"], row["k"], row["epilogue"],
                        f"{row.get('status', '-')}: {_cut(row.get('error', ''), 90)}"] + ["-"] * 9
                       + [_fmt(row.get("build_s"), ".1f")])
            continue
        same = row.get("model_config") is not None and row.get("model_config") == row.get("best_config")
        quality = row.get("quality")
        out.append([index, row["label"], row["m"], row["n"], row["k"], row["epilogue"],
                    _cut(row.get("model_config")), "= model" if same else _cut(row.get("best_config")),
                    _fmt((row.get("model_ms") or 0) * 1e3, ".1f"), _fmt(row.get("best_ms", 0) * 1e3, ".1f"),
                    _fmt(row.get("model_tflops"), ".1f"), _fmt(row.get("best_tflops"), ".1f"),
                    f"{quality:.3f}" if quality is not None else f"n/a ({row.get('why', '')})",
                    row.get("best_rank", "-"), f"{row.get('timed', 0)}" + (f" ({row['failed']} failed)" if row.get("failed") else ""),
                    _error_cell(row), _fmt(row.get("build_s"), ".1f")])
    return out


def summary(rows) -> dict:
    measured = [r for r in rows if r.get("status") == "ok" and r.get("quality") is not None]
    unmeasured = [r for r in rows if r.get("status") == "ok" and r.get("quality") is None]
    failed = [r for r in rows if r.get("status") == "n/a"]
    geo = _geomean([r["quality"] for r in measured])
    worst = min(measured, key=lambda r: r["quality"]) if measured else None
    by = {}
    for key in ("category", "epilogue"):
        for value in dict.fromkeys(r[key] for r in measured):
            by[f"{key}={value}"] = _geomean([r["quality"] for r in measured if r[key] == value])
    return {"problems": len(rows), "measured": len(measured), "no_model_timing": len(unmeasured),
            "failed": len(failed), "geomean_quality": geo,
            "worst_quality": worst["quality"] if worst else None, "worst_problem": worst["label"] if worst else None,
            "picked_best": sum(r.get("best_rank") == 0 for r in measured),
            "below_0.9": sum(r["quality"] < 0.9 for r in measured), "geomean_by": by,
            "geomean_pass": geo is not None and geo >= GOAL_GEOMEAN and not failed,
            "worst_pass": worst is not None and worst["quality"] >= GOAL_WORST and not unmeasured and not failed}


def report(rows, header):
    print_table("Matmul heuristic quality (every candidate timed; quality = best ms / model-choice ms)",
                ["#", "problem", "M", "N", "K", "epilogue", "model choice", "tuned best", "model us",
                 "best us", "model TFLOP/s", "best TFLOP/s", "quality", "best's model rank", "timed",
                 "err", "build s"], table(rows))
    s = summary(rows)
    header["summary"] = s
    geo, worst = s["geomean_quality"], s["worst_quality"]
    print(f"\n{s['measured']} of {s['problems']} problem(s) measured; {s['failed']} failed to build; "
          f"{s['no_model_timing']} without a timing of the model's first choice; the model picked the "
          f"best config in {s['picked_best']}, came within 0.9 of it in {s['measured'] - s['below_0.9']}")
    print(f"geomean quality: {_fmt(geo, '.3f')} (goal >= {GOAL_GEOMEAN}): "
          f"{'PASS' if s['geomean_pass'] else 'MISS'}")
    print(f"worst quality:   {_fmt(worst, '.3f')} (goal >= {GOAL_WORST}): "
          f"{'PASS' if s['worst_pass'] else 'MISS'}" + (f"  [{s['worst_problem']}]" if s["worst_problem"] else ""))
    if s["geomean_by"]:
        print("geomean by " + ", ".join(f"{k}: {_fmt(v, '.3f')}" for k, v in s["geomean_by"].items()))
    notes = []
    for row in rows:
        if row.get("status") != "ok":
            continue
        if row.get("source") != "tuned":
            notes.append(f"- {row['label']}: tuning source {row.get('source')!r}, not 'tuned' "
                         f"(a cache entry from before this run, or no tuning)")
        if row.get("chosen") and row.get("best_config") and row["chosen"] != row["best_config"]:
            notes.append(f"- {row['label']}: the plan's chosen config differs from the fastest timing "
                         f"({_cut(row['chosen'], 50)} vs {_cut(row['best_config'], 50)})")
        error = row.get("rel_error")
        if "check_error" in row or (error is not None and not (math.isfinite(error) and error <= TOLERANCE)):
            notes.append(f"- {row['label']}: tuned output check "
                         + (f"failed: {row['check_error']}" if "check_error" in row
                            else f"rel error {row['rel_error']:.1e} > {TOLERANCE:g}"))
    if notes:
        print("\nNotes:\n" + "\n".join(notes))


# --- main ----------------------------------------------------------------------------------------
def run_within_budget(problems, args, header, json_name, cache_dir, device, run_one, progress) -> list:
    """Rows of `run_one(index, problem)` in order until args.budget_s is spent (then the --skip
    that resumes is printed and kept in `header`); the JSON is rewritten after every problem and
    the throw-away cache removed at the end."""
    started = time.perf_counter()
    rows, stopped_at = [], None
    try:
        for index, problem in enumerate(problems):
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                stopped_at = index
                break
            row = run_one(index, problem)
            rows.append(row)
            print(f"[{time.perf_counter() - started:5.0f} s] {index + 1}/{len(problems)} {problem.label} "
                  f"({row.get('seconds', row.get('build_s', 0)):.1f} s): {progress(row)}", flush=True)
            header["seconds"] = time.perf_counter() - started
            write_json(json_name, {"header": header, "rows": rows})
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    header["seconds"] = time.perf_counter() - started
    if stopped_at is not None:
        header["stopped_at"] = stopped_at
        header["resume_skip"] = args.skip + stopped_at
        print(f"\nbudget of {args.budget_s:.0f} s spent: {len(problems) - stopped_at} problem(s) not run; "
              f"resume with --skip {args.skip + stopped_at}" + (f" --only {args.only}" if args.only else ""))
    return rows


def select(problems, args):
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = [p for p in problems if not words or any(w in p.label for w in words)]
    chosen = chosen[args.skip:]
    return chosen[:args.max_problems] if args.max_problems else chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated words: problems whose label has one "
                                                   "(e.g. llm, cnn, odd, gelu, lm-head, 4096x4096)")
    parser.add_argument("--max-problems", type=int, default=0, help="run at most this many (0: all)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first SKIP selected problems")
    parser.add_argument("--top", default="all", help="DNNGRAPH_AUTOTUNE_TOP for the builds (default: all)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new problem after this many seconds (0: no limit)")
    parser.add_argument("--no-check", action="store_true", help="do not check the tuned plans' outputs")
    parser.add_argument("--quiet", action="store_true", help="DNNGRAPH_AUTOTUNE_QUIET=1: no per-candidate lines")
    parser.add_argument("--keep-cache", action="store_true", help="leave the throw-away cache folder on disk")
    parser.add_argument("--check-cpu", action="store_true",
                        help="2 tiny fp32 problems on CPU through the interpreter (script smoke test)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    if args.check_cpu:
        device, dtype, problems = "cpu", torch.float32, select(CPU_PROBLEMS, args)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --check-cpu for the CPU smoke test")
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is full float32
        device, dtype, problems = "cuda", torch.bfloat16, select(PROBLEMS, args)
    cache_dir = tempfile.mkdtemp(prefix="dnngraph-heuristics-")
    os.environ["DNNGRAPH_CACHE_DIR"] = cache_dir  # before any build: nothing cached is reused
    os.environ["DNNGRAPH_AUTOTUNE_TOP"] = str(args.top)
    if args.quiet:
        os.environ["DNNGRAPH_AUTOTUNE_QUIET"] = "1"
    header = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype),
              "autotune_top": args.top, "cache_dir": cache_dir, "goal_geomean": GOAL_GEOMEAN,
              "goal_worst": GOAL_WORST, "selected": len(problems)}
    print(f"{len(problems)} problem(s) on {header['device']}, DNNGRAPH_AUTOTUNE_TOP={args.top}, "
          f"cache {cache_dir}", flush=True)
    def progress(row) -> str:
        if row.get("status") != "ok":
            return f"{row.get('status')}: {_cut(row.get('error'), 160)}"
        quality = row.get("quality")
        return (f"quality {quality:.3f}" if quality is not None else f"quality n/a ({row.get('why')})") + \
            f", model {_fmt((row.get('model_ms') or 0) * 1e3, '.1f')} us, best " \
            f"{_fmt(row.get('best_ms', 0) * 1e3, '.1f')} us (rank {row.get('best_rank')}), " \
            f"{row.get('timed', 0)} timed, source {row.get('source')}"

    rows = run_within_budget(problems, args, header, "matmul_heuristics.json", cache_dir, device,
                             lambda index, problem: run_problem(problem, device, dtype, check=not args.no_check),
                             progress)
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}; "
          f"run took {header['seconds']:.0f} s")
    report(rows, header)
    path = write_json("matmul_heuristics.json", {"header": header, "rows": rows})
    if path:
        print(f"\nresults: {path}")
    if args.check_cpu and not any(r.get("status") == "ok" for r in rows):
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
