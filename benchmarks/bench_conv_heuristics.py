"""Convolution heuristic quality: how close the model's first-choice config is to the best one timed.

Each problem (bf16 NHWC, float32 accumulate) is built with g.build(autotune=True) and
DNNGRAPH_AUTOTUNE_TOP=all, so every candidate config is timed, in a throw-away DNNGRAPH_CACHE_DIR
(nothing is read from an earlier run's tuning cache). A conv graph can have several tuned parts:
dgrad is one launch group per stride phase, each tuned on its own, and one config can span more
than one launch (split-K partials + combine, a row-exit fold), all sharing one tuning record.
A part is one distinct record with timings; its `timings` hold (config text, model rank, ms) per
candidate, model rank 0 being the model's first choice, and

    quality = min(ms over candidates) / ms(model rank 0)      (<= 1; 1: the model picked the best)

A problem's quality is that of its worst part (the table also gives the time-weighted figure,
summed best ms / summed model-choice ms over every part). A part whose record came from the
tuning cache with the same problem signature and timings as an earlier part of the same graph
(two dgrad phases whose GEMMs share a tuning key) is listed but not counted twice. Parts ranked
by the conv model (heuristics/conv.py: implicit GEMMs) and by the matmul model (1x1 stride-1
poses, dgrad phases reaching one tap per axis, wgrad) are told apart by the record's signature.

Goals: geometric mean of quality >= 0.95, worst case >= 0.80. A problem whose model-rank-0
candidate has no timing (it failed, or was not timed) counts against the worst case. Before a
problem counts, the tuned plan's output is checked against a float32 torch reference (TF32 off);
past 2e-2 relative error it is reported as wrong and not counted (--no-check skips the check).

Problems (N=32 unless noted; benchmarks/bench_conv.py's shapes):
  fprop  y = relu(conv(x, w) + bias) on every distinct ResNet-50 conv layer
  dgrad  dx on 8 ResNet-50 layers: the 3x3 of each stage, the stride-2 3x3 of layer2, two 1x1
         stride-1 (the matmul path) and a 1x1 stride-2 downsample (one 1x1 phase, three that no
         tap reaches)
  wgrad  dw on 8 ResNet-50 layers: the 3x3 of each stage, the stride-2 3x3 of layer2, the 7x7
         stem (C = 3) and two 1x1
  other  fprop + bias + relu of a 3x3x3 3D conv (N=4) and a kernel-3 1D conv
  dw     fprop + bias + relu of MobileNetV2 and ConvNeXt-T depthwise layers

    python benchmarks/bench_conv_heuristics.py                    # GPU; $OUT/conv_heuristics.json
    python benchmarks/bench_conv_heuristics.py --only dgrad,wgrad
    python benchmarks/bench_conv_heuristics.py --skip 12          # resume after a budget stop
    python benchmarks/bench_conv_heuristics.py --list             # the problems, numbered; no device
    python benchmarks/bench_conv_heuristics.py --check-cpu        # tiny fp32 problems, interpreter

The run stops starting problems after --budget-s seconds (default 420, to fit one 10-minute
device call) and prints the --skip value that resumes it; the JSON is rewritten after every
problem, so what ran survives a later failure.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

if "--check-cpu" in sys.argv[1:]:  # CPU tensors run through Triton's interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")
# this checkout's dnngraph, whatever copy is installed (the tuning records' fields are read below)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "dnngraph")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from bench_conv import (BF16, CPU_TOLERANCE, DEPTHWISE, F32, F64, FLAVOUR, OTHER, TOLERANCE, ConvShape, conv_shape,
                        dg_graph, make_inputs, poisoned, references, resnet50_layers)
from bench_matmul import _short, timing_entries
from bench_matmul_heuristics import (GOAL_GEOMEAN, GOAL_WORST, _cut, _finite, _fmt, _geomean, quality_of,
                                     run_within_budget, select)
from common import print_table, rel_error, write_json
from dnngraph.options import autotune_top_from_environment

DGRAD_LAYERS = ("layer1.0.conv2", "layer2.1.conv2", "layer3.1.conv2", "layer4.1.conv2",  # 3x3 per stage
                "layer2.0.conv2",  # 3x3 stride 2: four phases of 1x1, 1x2, 2x1 and 2x2 taps
                "layer1.0.conv1", "layer3.1.conv1",  # 1x1 stride 1: the matmul path
                "layer2.0.downsample.0")  # 1x1 stride 2
WGRAD_LAYERS = ("layer1.0.conv2", "layer2.1.conv2", "layer3.1.conv2", "layer4.1.conv2",
                "layer2.0.conv2", "conv1",  # 7x7 stride 2 over C = 3
                "layer1.0.conv1", "layer4.1.conv1")


@dataclass(frozen=True)
class Problem:
    op: str  # fprop (+ bias + relu), dgrad, wgrad
    category: str  # rn50, other, dw, cpu
    shape: ConvShape

    @property
    def label(self) -> str:
        return f"{self.op} {self.category} {self.shape.label}"


def problems() -> tuple:
    """(problems, where the ResNet-50 layers came from)."""
    resnet, source = resnet50_layers()
    by_name = {s.label: s for s in resnet}
    found = [Problem("fprop", "rn50", s) for s in resnet]
    found += [Problem("dgrad", "rn50", by_name[n]) for n in DGRAD_LAYERS if n in by_name]
    found += [Problem("wgrad", "rn50", by_name[n]) for n in WGRAD_LAYERS if n in by_name]
    found += [Problem("fprop", "other", s) for s in OTHER]
    found += [Problem("fprop", "dw", s) for s in DEPTHWISE]
    return found, source


CPU_PROBLEMS = (  # tiny fp32 problems for --check-cpu
    Problem("fprop", "cpu", conv_shape("3x3/2", 2, 5, 6, (9, 7), 3, 2, 1)),
    Problem("fprop", "cpu", conv_shape("1x1", 2, 8, 4, 5, 1)),  # the matmul path
    Problem("dgrad", "cpu", conv_shape("3x3/2", 2, 5, 6, 8, 3, 2, 1)),  # 4 phases, two sharing a key
    Problem("wgrad", "cpu", conv_shape("3x3/2", 2, 5, 6, (9, 7), 3, 2, 1)),
    Problem("fprop", "cpu", conv_shape("1d", 2, 5, 4, 11, 3, 1, 1, spatial=1)),
)


# --- tuned parts ---------------------------------------------------------------------------------
def _kernel_name(launch) -> str:
    name = getattr(getattr(launch, "kernel", None), "__name__", None)
    if not name:
        name = os.path.splitext(os.path.basename(str(getattr(launch, "source_path", "?"))))[0]
    return name[len("dnngraph_"):] if name.startswith("dnngraph_") else name


def _model_of(record) -> str:
    """Which model ranked the candidates: heuristics/conv.py ("conv") or heuristics/matmul.py."""
    signature = getattr(record, "signature", "") or ""
    if not signature:
        return getattr(record, "family", "") or "?"
    return "conv" if signature.startswith("conv ") else "matmul"


def tuned_parts(launches) -> tuple:
    """(parts, launches without a tuned record): one part per distinct tuning record (launches
    sharing a record, e.g. split-K partials and their combine, are one part), with its quality."""
    parts, by_record, untuned = [], {}, []
    for launch in launches:
        record = getattr(launch, "tuning", None)
        if record is None or (not getattr(record, "timings", None) and not getattr(record, "family", "")):
            untuned.append(_kernel_name(launch))  # no tuner ran for it (not a tuned family)
            continue
        part = by_record.get(id(record))
        if part is not None:
            part["launches"] += 1
            part["kernels"].append(_kernel_name(launch))
            continue
        entries = timing_entries(record)
        candidates = int(getattr(record, "candidates", 0) or 0)
        part = {"kernel": _kernel_name(launch), "kernels": [_kernel_name(launch)], "launches": 1,
                "source": getattr(record, "source", None), "chosen": getattr(record, "chosen", None),
                "family": getattr(record, "family", ""), "signature": getattr(record, "signature", ""),
                "model": _model_of(record), "candidates": candidates, "timings": entries,
                "config": getattr(launch, "config_text", None)}
        if entries:
            part.update(quality_of(entries))
            if candidates:  # exact: the candidates the tuner meant to time, less those timed
                part["failed"] = top_count(candidates) - part.get("timed", 0)
        else:
            part.update(quality=None, why="every candidate failed (the model's choice runs untimed)",
                        timed=0, failed=top_count(candidates) if candidates else None)
        # the same tuning key and timings as an earlier part of this graph: one measurement
        for index, earlier in enumerate(parts):
            if (part["signature"] and earlier["signature"] == part["signature"]
                    and earlier["timings"] == part["timings"] and "duplicate_of" not in earlier):
                part["duplicate_of"] = index
                break
        by_record[id(record)] = part
        parts.append(part)
    return parts, untuned


def summarize_parts(row: dict, parts: list):
    """The problem's quality: its worst counted part, plus time-weighted totals over every part."""
    counted = [p for p in parts if "duplicate_of" not in p]
    row.update(tuned_parts=len(counted), reused_parts=len(parts) - len(counted),
               timed=sum(p.get("timed", 0) for p in counted),
               failed=sum(p.get("failed") or 0 for p in counted),
               models=sorted({p["model"] for p in counted}))
    if not counted:
        row.update(quality=None, why="no launch carries a tuned record")
        return
    missing = [p for p in counted if p.get("quality") is None]
    worst = missing[0] if missing else min(counted, key=lambda p: p["quality"])
    row.update(worst_part=worst["kernel"], worst_model=worst["model"], model_config=worst.get("model_config"),
               best_config=worst.get("best_config"), best_rank=worst.get("best_rank"),
               model_ms=worst.get("model_ms"), best_ms=worst.get("best_ms"), quality=worst.get("quality"))
    if missing:
        row["why"] = f"{worst['kernel']}: {worst.get('why')}"
    if all(_finite(p.get("model_ms")) and _finite(p.get("best_ms")) for p in parts):
        row["model_ms_total"] = sum(p["model_ms"] for p in parts)
        row["best_ms_total"] = sum(p["best_ms"] for p in parts)
        row["weighted_quality"] = row["best_ms_total"] / row["model_ms_total"]


# --- one problem ---------------------------------------------------------------------------------
@dataclass
class Setting:
    device: str
    dtype: torch.dtype
    ref_dtype: torch.dtype
    tolerance: float
    check: bool


def run_problem(problem: Problem, index: int, setting: Setting) -> dict:
    shape = problem.shape
    row = {"label": problem.label, "op": problem.op, "category": problem.category, "layer": shape.label,
           "shape": shape.describe(), "gflop": shape.flops / 1e9}
    start = time.perf_counter()
    try:
        inputs = make_inputs(shape, setting.device, setting.dtype)
        io_type = dg.bfloat16 if setting.dtype == BF16 else dg.float32
        g, bindings, outputs = dg_graph(problem.op, shape, inputs, io_type, name=f"conv_heur_{index}")
        g.build(autotune=True)
        row["build_s"] = time.perf_counter() - start
        launches = list(getattr(g.plan, "launches", None) or [])
        parts, untuned = tuned_parts(launches)
        row.update(status="ok", launches=len(launches), parts=parts, untuned_launches=untuned)
        summarize_parts(row, parts)
        for key, ms in (("model", row.get("model_ms_total")), ("best", row.get("best_ms_total"))):
            if _finite(ms):
                row[f"{key}_tflops"] = shape.flops / ms / 1e9
    except dg.UnsupportedError as error:
        row.update(status="n/a", error=f"not implemented yet: {_short(error, 400)}",
                   build_s=time.perf_counter() - start)
        return row
    except Exception as error:  # noqa: BLE001 - one problem failing leaves the others measured
        row.update(status="n/a", error=_short(error, 400), build_s=time.perf_counter() - start)
        return row
    if setting.check:
        try:
            row["rel_error"] = check_output(problem, g, bindings, outputs, inputs, setting)
            if not (math.isfinite(row["rel_error"]) and row["rel_error"] <= setting.tolerance):
                row["status"] = "wrong"
        except Exception as error:  # noqa: BLE001
            row.update(status="wrong", check_error=_short(error, 200))
    row["seconds"] = time.perf_counter() - start
    return row


def check_output(problem: Problem, g, bindings, outputs, inputs, setting: Setting) -> float:
    """Relative error of the tuned plan's output against the torch reference (float32 on GPU,
    float64 for the fp32 CPU problems)."""
    ref = references(problem.op, problem.shape, inputs, setting.ref_dtype)[FLAVOUR[problem.op]][0]
    (out,) = [poisoned(t.dim, t.stride, t.data_type.torch_dtype, setting.device) for t in outputs]
    g.execute({**bindings, outputs[0]: out})
    if setting.device == "cuda":
        torch.cuda.synchronize()
    return rel_error(out, ref)


# --- reporting -----------------------------------------------------------------------------------
def _us(ms) -> str:
    return _fmt(ms * 1e3 if _finite(ms) else None, ".1f")


def _quality_cell(item) -> str:
    quality = item.get("quality")
    return f"{quality:.3f}" if quality is not None else f"n/a ({_cut(item.get('why', ''), 60)})"


def _timed_cell(item) -> str:
    failed = item.get("failed")
    return f"{item.get('timed', 0)}" + (f" ({failed} failed)" if failed else "")


def _error_cell(row, tolerance) -> str:
    if "check_error" in row:
        return "failed"
    error = row.get("rel_error")
    if error is None:
        return "-"
    return f"{error:.0e}" + ("" if math.isfinite(error) and error <= tolerance else " (!)")


def _parts_cell(row) -> str:
    text = f"{row.get('tuned_parts', 0)}/{row.get('launches', 0)}"
    return text + (f" (+{row['reused_parts']} reused)" if row.get("reused_parts") else "")


def table(rows, tolerance):
    out = []
    for index, row in enumerate(rows):
        head = [index, row["label"], row["shape"], f"{row['gflop']:.3g}"]
        if row.get("status") == "n/a":
            out.append(head + [f"n/a: {_cut(row.get('error', ''), 90)}"] + ["-"] * 10
                       + [_fmt(row.get("build_s"), ".1f")])
            continue
        same = row.get("model_config") is not None and row.get("model_config") == row.get("best_config")
        out.append(head + [_parts_cell(row), f"{row.get('worst_part', '-')} ({row.get('worst_model', '-')})",
                           _cut(row.get("model_config")), "= model" if same else _cut(row.get("best_config")),
                           _us(row.get("model_ms")), _us(row.get("best_ms")), _quality_cell(row),
                           _fmt(row.get("weighted_quality"), ".3f"), row.get("best_rank", "-"), _timed_cell(row),
                           _error_cell(row, tolerance) + (" WRONG" if row.get("status") == "wrong" else ""),
                           _fmt(row.get("build_s"), ".1f")])
    return out


def parts_table(rows):
    out = []
    for index, row in enumerate(rows):
        parts = row.get("parts") or []
        if len(parts) < 2:
            continue
        for part in parts:
            dup = part.get("duplicate_of")
            out.append([index, row["label"], part["kernel"] + (f" (+{part['launches'] - 1})" if part["launches"] > 1 else ""),
                        part["model"], part.get("source"), _cut(part.get("model_config"), 48),
                        _cut(part.get("best_config"), 48), _us(part.get("model_ms")), _us(part.get("best_ms")),
                        f"= part {parts[dup]['kernel']}" if dup is not None else _quality_cell(part),
                        part.get("best_rank", "-"), f"{_timed_cell(part)} of {part.get('candidates') or '?'}"])
    return out


def summary(rows) -> dict:
    ok = [r for r in rows if r.get("status") == "ok"]
    measured = [r for r in ok if r.get("quality") is not None]
    unmeasured = [r for r in ok if r.get("quality") is None]
    failed = [r for r in rows if r.get("status") == "n/a"]
    wrong = [r for r in rows if r.get("status") == "wrong"]
    geo = _geomean([r["quality"] for r in measured])
    worst = min(measured, key=lambda r: r["quality"]) if measured else None
    parts = [p for r in measured for p in r.get("parts", []) if "duplicate_of" not in p and p.get("quality") is not None]
    by = {}
    for key in ("op", "category"):
        for value in dict.fromkeys(r[key] for r in measured):
            by[f"{key}={value}"] = _geomean([r["quality"] for r in measured if r[key] == value])
    for model in dict.fromkeys(p["model"] for p in parts):
        by[f"parts ranked by the {model} model"] = _geomean([p["quality"] for p in parts if p["model"] == model])
    clean = not failed and not wrong
    return {"problems": len(rows), "measured": len(measured), "no_model_timing": len(unmeasured),
            "failed": len(failed), "wrong": len(wrong), "tuned_parts": len(parts),
            "geomean_quality": geo, "worst_quality": worst["quality"] if worst else None,
            "worst_problem": f"{worst['label']} [{worst.get('worst_part')}]" if worst else None,
            "weighted_geomean": _geomean([r.get("weighted_quality") for r in measured]),
            "picked_best": sum(r.get("best_rank") == 0 for r in measured),
            "parts_picked_best": sum(p.get("best_rank") == 0 for p in parts),
            "below_0.9": sum(r["quality"] < 0.9 for r in measured), "geomean_by": by,
            "geomean_pass": geo is not None and geo >= GOAL_GEOMEAN and clean,
            "worst_pass": worst is not None and worst["quality"] >= GOAL_WORST and not unmeasured and clean}


def report(rows, header, tolerance):
    print_table("Conv heuristic quality (every candidate timed; per tuned part quality = best ms / model-choice "
                "ms; a problem's is its worst part's)",
                ["#", "problem", "shape", "GFLOP", "tuned parts/launches", "worst part (model)", "model choice",
                 "tuned best", "model us", "best us", "quality", "time-weighted", "best's model rank", "timed",
                 "err", "build s"], table(rows, tolerance))
    detail = parts_table(rows)
    if detail:
        print_table("Parts of the problems tuned in several parts (dgrad phases; launches sharing a record "
                    "are one part)",
                    ["#", "problem", "part", "model", "source", "model choice", "tuned best", "model us",
                     "best us", "quality", "best's model rank", "timed of candidates"], detail)
    s = summary(rows)
    header["summary"] = s
    print(f"\n{s['measured']} of {s['problems']} problem(s) measured ({s['tuned_parts']} tuned parts); "
          f"{s['failed']} failed to build; {s['wrong']} wrong (output check); {s['no_model_timing']} without a "
          f"timing of the model's first choice; the model picked the best config in {s['picked_best']} "
          f"problem(s) ({s['parts_picked_best']} of {s['tuned_parts']} parts), came within 0.9 of it in "
          f"{s['measured'] - s['below_0.9']}")
    print(f"geomean quality: {_fmt(s['geomean_quality'], '.3f')} (goal >= {GOAL_GEOMEAN}): "
          f"{'PASS' if s['geomean_pass'] else 'MISS'}   (time-weighted: {_fmt(s['weighted_geomean'], '.3f')})")
    print(f"worst quality:   {_fmt(s['worst_quality'], '.3f')} (goal >= {GOAL_WORST}): "
          f"{'PASS' if s['worst_pass'] else 'MISS'}" + (f"  [{s['worst_problem']}]" if s["worst_problem"] else ""))
    if s["geomean_by"]:
        print("geomean by " + ", ".join(f"{k}: {_fmt(v, '.3f')}" for k, v in s["geomean_by"].items()))
    notes = []
    for row in rows:
        if row.get("status") == "n/a":
            continue
        error = row.get("rel_error")
        if row.get("status") == "wrong":
            notes.append(f"- {row['label']}: NOT COUNTED, tuned output check "
                         + (f"failed: {row['check_error']}" if "check_error" in row
                            else f"rel error {error:.1e} past {tolerance:g}"))
        if row.get("untuned_launches"):
            notes.append(f"- {row['label']}: launches without a tuned record: {', '.join(row['untuned_launches'])}")
        for part in row.get("parts", []):
            where = f"- {row['label']} [{part['kernel']}]"
            if "duplicate_of" in part:
                twin = row["parts"][part["duplicate_of"]]["kernel"]
                notes.append(f"{where}: shares its tuning key with {twin} ({_cut(part['signature'], 90)}): "
                             f"took that part's winner untimed, counted once")
            elif part.get("source") != "tuned":
                notes.append(f"{where}: tuning source {part.get('source')!r}, not 'tuned' (a problem earlier in "
                             f"this run had the same tuning key, or no candidate ran)")
            if part.get("chosen") and part.get("best_config") and part["chosen"] != part["best_config"]:
                notes.append(f"{where}: the plan's chosen config differs from the fastest timing "
                             f"({_cut(part['chosen'], 50)} vs {_cut(part['best_config'], 50)})")
            if part.get("failed") and "duplicate_of" not in part:
                notes.append(f"{where}: {part['failed']} of {top_count(part['candidates']) if part['candidates'] else '?'}"
                             f" candidate(s) failed to compile or run")
    if notes:
        print("\nNotes:\n" + "\n".join(notes))


# --- main ----------------------------------------------------------------------------------------


def progress_text(row, tolerance) -> str:
    if row.get("status") == "n/a":
        return f"n/a: {_cut(row.get('error'), 160)}"
    quality = row.get("quality")
    text = (f"quality {quality:.3f}" if quality is not None else f"quality n/a ({row.get('why')})")
    text += (f" (worst of {row.get('tuned_parts', 0)} tuned part(s): {row.get('worst_part', '-')}, "
             f"{row.get('worst_model', '-')} model), model {_us(row.get('model_ms'))} us, best "
             f"{_us(row.get('best_ms'))} us (rank {row.get('best_rank')}), {row.get('timed', 0)} timed")
    if row.get("failed"):
        text += f" ({row['failed']} failed)"
    text += f", err {_error_cell(row, tolerance)}"
    return text + ("  WRONG: not counted" if row.get("status") == "wrong" else "")


def top_count(candidates: int) -> int:
    """How many of `candidates` the tuner times under this run's DNNGRAPH_AUTOTUNE_TOP."""
    top = autotune_top_from_environment()
    return candidates if top is None else min(candidates, top)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated words: problems whose label has one "
                                                   "(e.g. fprop, dgrad, wgrad, rn50, other, dw, layer3, 3d)")
    parser.add_argument("--max-problems", type=int, default=0, help="run at most this many (0: all)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first SKIP selected problems")
    parser.add_argument("--top", default="all", help="DNNGRAPH_AUTOTUNE_TOP for the builds (default: all)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new problem after this many seconds (0: no limit)")
    parser.add_argument("--no-check", action="store_true",
                        help="do not check the tuned plans' outputs (every tuned problem counts)")
    parser.add_argument("--quiet", action="store_true", help="DNNGRAPH_AUTOTUNE_QUIET=1: no per-candidate lines")
    parser.add_argument("--keep-cache", action="store_true", help="leave the throw-away cache folder on disk")
    parser.add_argument("--list", action="store_true", help="print the selected problems, numbered, and exit")
    parser.add_argument("--check-cpu", action="store_true",
                        help=f"{len(CPU_PROBLEMS)} tiny fp32 problems on CPU through the interpreter "
                             "(script smoke test; checked against float64)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    if args.check_cpu:
        chosen, resnet_source = select(CPU_PROBLEMS, args), "-"
    else:
        all_problems, resnet_source = problems()
        chosen = select(all_problems, args)
    if args.list:
        print(f"ResNet-50 layers: {resnet_source}")
        print_table("Problems (--skip counts in this order, after --only)", ["#", "problem", "shape", "GFLOP"],
                    [[args.skip + i, p.label, p.shape.describe(), f"{p.shape.flops / 1e9:.3g}"]
                     for i, p in enumerate(chosen)])
        return chosen
    if args.check_cpu:
        setting = Setting("cpu", F32, F64, CPU_TOLERANCE, not args.no_check)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --check-cpu for the CPU smoke test (or --list)")
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is full float32
        torch.backends.cudnn.allow_tf32 = False
        setting = Setting("cuda", BF16, F32, TOLERANCE, not args.no_check)
    cache_dir = tempfile.mkdtemp(prefix="dnngraph-conv-heuristics-")
    os.environ["DNNGRAPH_CACHE_DIR"] = cache_dir  # before any build: nothing cached is reused
    os.environ["DNNGRAPH_AUTOTUNE_TOP"] = str(args.top)
    if args.quiet:
        os.environ["DNNGRAPH_AUTOTUNE_QUIET"] = "1"
    device = setting.device
    header = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(setting.dtype),
              "reference": str(setting.ref_dtype), "tolerance": setting.tolerance, "checked": setting.check,
              "autotune_top": args.top, "cache_dir": cache_dir, "goal_geomean": GOAL_GEOMEAN,
              "goal_worst": GOAL_WORST, "resnet_source": resnet_source, "selected": len(chosen),
              "only": args.only, "skip": args.skip}
    print(f"{len(chosen)} problem(s) on {header['device']}, DNNGRAPH_AUTOTUNE_TOP={args.top}, "
          f"cache {cache_dir}; ResNet-50 layers: {resnet_source}", flush=True)
    if device == "cpu":
        print("interpreter timings: the quality figures test this script, not the model", flush=True)
    def run_one(index, problem):
        row = run_problem(problem, args.skip + index, setting)
        row["index"] = args.skip + index
        return row

    rows = run_within_budget(chosen, args, header, "conv_heuristics.json", cache_dir, device, run_one,
                             lambda row: progress_text(row, setting.tolerance))
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}; "
          f"run took {header['seconds']:.0f} s")
    report(rows, header, setting.tolerance)
    path = write_json("conv_heuristics.json", {"header": header, "rows": rows})
    if path:
        print(f"\nresults: {path}")
    if "resume_skip" in header:  # repeated last: the line a resuming caller looks for
        print(f"resume with --skip {header['resume_skip']}" + (f" --only {args.only}" if args.only else ""))
    if args.check_cpu and not (rows and all(r.get("status") == "ok" and r.get("quality") is not None
                                            for r in rows)):
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
