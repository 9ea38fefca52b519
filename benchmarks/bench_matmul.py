"""Matmul + bias + activation, bf16, against cuBLAS, cuBLASLt, torch.compile and the cuDNN frontend.

One process, side by side per shape (M, N, K): y = act(a @ b + bias), a [M, K], b [K, N] row-major,
bias [N], y [M, N] bf16; float32 accumulation and epilogue math everywhere. Providers:

  cuBLAS+sep  `a @ b`, then `+ bias` and the activation as separate eager ops (3 kernels)
  cuBLASLt    `torch._addmm_activation(bias, a, b, use_gelu=...)`: bias and GELU/ReLU fused into the
              cuBLASLt epilogue. Its GELU is always the tanh approximation (see lt_function)
  compile     torch.compile(eager function), default mode, dynamic=False
  cuDNN FE    the cuDNN frontend graph matmul -> add(bias) -> gelu, heuristics A then FALLBACK
  dg heur     dnngraph, g.build(): the model's first choice, nothing timed
  dg tuned    dnngraph, g.build(autotune=True): the model's top candidates timed, winner cached

Throughput is TFLOP/s over 2*M*N*K (epilogue flops ignored). Ratios are anchor time / dnngraph
time (> 1: dnngraph faster). Every provider's output is checked against a float32 torch reference
on the same inputs (its own GELU flavour) before it is timed; errors past TOLERANCE print (!).

    python benchmarks/bench_matmul.py                        # GPU, all shapes; $OUT/matmul.json
    python benchmarks/bench_matmul.py --quick                # 4096^3 and 8192^3 only
    python benchmarks/bench_matmul.py --shapes 4096x4096x4096,16x8192x8192 --epilogue relu
    python benchmarks/bench_matmul.py --check-cpu            # tiny fp32 shapes through dnngraph on CPU
    python benchmarks/bench_matmul.py --table dtypes         # bf16, fp16, tf32, IEEE fp32, mixed pairs, int8
    python benchmarks/bench_matmul.py --table dtypes --cases int8,bf16   # some of them (no MLP block)
                                                             # vs torch; the Llama MLP block ($OUT/dtypes.json)

By default the dnngraph builds use a fresh DNNGRAPH_CACHE_DIR (a temporary folder), so the tuned
build really tunes in this run and the heuristics build cannot pick up a winner cached by an
earlier one; --reuse-cache keeps the environment's. The heuristics graph of a shape is built
before its autotuned twin for the same reason. An implementation that fails prints "n/a: <error>"
in its cell and the run goes on.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Optional

if "--check-cpu" in sys.argv[1:]:  # CPU tensors run through Triton's interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from common import median_ms, print_table, rel_error, write_json

BF16, F32 = torch.bfloat16, torch.float32
TOLERANCE = 2e-2  # bf16 outputs land near 3e-3 of the float32 reference; flag anything past this
EPILOGUES = ("gelu", "gelu_tanh", "relu", "none")

# (M, N, K). Squares; LLM projections and MLPs (Llama-2-7B 11008, Llama-3-8B 14336); sizes that are
# not multiples of 128 (777x1234x555 has K*2 bytes not a multiple of 16); decode-sized M.
SHAPES = [
    (4096, 4096, 4096), (8192, 8192, 8192),
    (2048, 8192, 2048), (8192, 2048, 8192),
    (4096, 11008, 4096), (4096, 4096, 11008), (4096, 14336, 4096),
    (4000, 4000, 4000), (3000, 5000, 1000), (777, 1234, 555),
    (16, 8192, 8192), (1, 4096, 4096),
]
QUICK_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]
CPU_SHAPES = [(33, 47, 29), (16, 64, 32), (1, 40, 24)]

PROVIDERS = ("cublas", "cublaslt", "compile", "cudnn", "dg_heur", "dg_tuned")
ANCHORS = ("cublaslt", "cublas", "compile", "cudnn")
TITLES = {"cublas": "cuBLAS+sep", "cublaslt": "cuBLASLt epi", "compile": "compile", "cudnn": "cuDNN FE",
          "dg_heur": "dg heur", "dg_tuned": "dg tuned"}


# --- eager anchors (module level: torch.compile caches per function) ----------------------------
def mm_bias_gelu(a, b, bias):
    return F.gelu(a @ b + bias)


def mm_bias_gelu_tanh(a, b, bias):
    return F.gelu(a @ b + bias, approximate="tanh")


def mm_bias_relu(a, b, bias):
    return F.relu(a @ b + bias)


def mm_bias(a, b, bias):
    return a @ b + bias


EAGER = {"gelu": mm_bias_gelu, "gelu_tanh": mm_bias_gelu_tanh, "relu": mm_bias_relu, "none": mm_bias}


def lt_function(epilogue: str):
    """fn(a, b, bias) for the cuBLASLt fused-epilogue anchor (lt_flavour: what it computes).

    torch._addmm_activation sends bias + activation to the cuBLASLt epilogue (CUBLASLT_EPILOGUE_
    GELU_BIAS / RELU_BIAS) when aten's Blas.cpp finds the inputs eligible (beta == 1, 1-D contiguous
    bias of size N, row-major result, every dim of a and b > 1, ...). cuBLASLt's GELU epilogue is the
    tanh approximation, and aten's non-Lt fallback (e.g. M == 1) also applies gelu(approximate=
    "tanh"), so on CUDA this anchor computes gelu_tanh even when erf GELU is asked for: it is
    checked against the tanh reference and marked "(tanh)". (On CPU, aten applies erf GELU.)
    There is no erf-GELU epilogue in torch's cuBLASLt path.
    """
    if epilogue in ("gelu", "gelu_tanh"):
        return lambda a, b, bias: torch._addmm_activation(bias, a, b, use_gelu=True)
    if epilogue == "relu":
        return lambda a, b, bias: torch._addmm_activation(bias, a, b, use_gelu=False)
    return lambda a, b, bias: torch.addmm(bias, a, b)  # cuBLASLt bias epilogue (no activation)


def lt_flavour(epilogue: str, device) -> str:
    if epilogue not in ("gelu", "gelu_tanh"):
        return epilogue
    return "gelu_tanh" if torch.device(device).type == "cuda" else "gelu"


# --- inputs and reference ------------------------------------------------------------------------
def make_inputs(m, n, k, device, dtype=BF16, seed=0):
    """a ~ N(0, 1), b ~ N(0, 1/K): a @ b ~ N(0, 1); bias ~ N(0, 0.25). The pre-activation values sit
    where GELU is curved (not saturated) and ReLU keeps about half."""
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: fast at 10^8+ elements
    a = torch.randn(m, k, generator=gen, device=device).to(dtype)
    b = (torch.randn(k, n, generator=gen, device=device) / math.sqrt(k)).to(dtype)
    bias = (0.5 * torch.randn(n, generator=gen, device=device)).to(dtype)
    return a, b, bias


def activation(epilogue: str, x: torch.Tensor) -> torch.Tensor:
    if epilogue == "gelu":
        return F.gelu(x)
    if epilogue == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if epilogue == "relu":
        return F.relu(x)
    return x


def reference_pre(a, b, bias=None) -> torch.Tensor:
    """float32 a @ b (+ bias) from the (rounded) inputs, full-precision float32 matmul (no TF32)."""
    out = torch.matmul(a.float(), b.float())
    return out if bias is None else out + bias.float()


# --- dnngraph ------------------------------------------------------------------------------------
def build_graph(m, n, k, epilogue, dtype=dg.bfloat16, name="mm", with_bias=True):
    """(graph, (a, b, bias, y)): y = act(matmul(a, b) + bias), io `dtype`, float32 inside; without
    the bias (bias None) when with_bias is False."""
    g = dg.Graph(name=name, io_data_type=dtype, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    a = g.tensor(name="a", dim=[m, k], data_type=dtype)
    b = g.tensor(name="b", dim=[k, n])
    bias = g.tensor(name="bias", dim=[1, n]) if with_bias else None
    y = g.matmul(a, b)
    if bias is not None:
        y = g.add(y, bias)
    if epilogue == "gelu":
        y = g.gelu(y)
    elif epilogue == "gelu_tanh":
        y = g.gelu_tanh(y)
    elif epilogue == "relu":
        y = g.relu(y)
    elif epilogue != "none":
        raise ValueError(f"unknown epilogue {epilogue!r}")
    y.set_output(True).set_name("y")
    return g, (a, b, bias, y)


def matmul_launch(plan):
    """The plan's launch of the matmul group that carries tuning information (split-K plans have
    a partial and a combine launch for one group: the one with a non-None .tuning), else the first
    matmul launch, else None."""
    launches = list(getattr(plan, "launches", None) or [])
    matmuls = [l for l in launches if getattr(getattr(l, "group", None), "kind", None) == "matmul"]
    tuned = [l for l in matmuls if getattr(l, "tuning", None) is not None]
    return (tuned or matmuls or [None])[0]


def timing_entries(tuning) -> list:
    """tuning.timings as [(config_text, model_rank, time_ms)]; time_ms is NaN where it is not a
    finite positive number (a candidate that failed to compile or run)."""
    entries = []
    for item in getattr(tuning, "timings", None) or ():
        if isinstance(item, (tuple, list)):
            config, rank, ms = (list(item) + [None, None, None])[:3]
        else:  # an object with named fields
            config = getattr(item, "config_text", getattr(item, "config", None))
            rank, ms = getattr(item, "model_rank", None), getattr(item, "time_ms", None)
        try:
            ms = float(ms)
        except (TypeError, ValueError):
            ms = float("nan")
        if not math.isfinite(ms) or ms <= 0:
            ms = float("nan")
        entries.append((str(config), -1 if rank is None else int(rank), ms))
    return entries


def tuning_summary(launch) -> dict:
    tuning = getattr(launch, "tuning", None) if launch is not None else None
    if tuning is None:
        return {"source": None}
    entries = timing_entries(tuning)
    return {"source": getattr(tuning, "source", None), "chosen": getattr(tuning, "chosen", None),
            "candidates": len(entries), "timings": entries}


def plan_summary(plan) -> dict:
    launches = list(getattr(plan, "launches", None) or [])
    launch = matmul_launch(plan)
    return {"launches": len(launches), "configs": [getattr(l, "config_text", "") for l in launches],
            "matmul_config": getattr(launch, "config_text", None) if launch is not None else None,
            "tuning": tuning_summary(launch)}


# --- the cuDNN frontend --------------------------------------------------------------------------
def load_cudnn_frontend():
    """(module, note): the memory-bound benchmark's loader (environment, else the wheel carried in
    .whl/, bound to the libcudnn torch loaded); plain `import cudnn` if that file cannot load."""
    try:
        from bench_memory_bound import import_cudnn_frontend
    except Exception as error:  # noqa: BLE001 - that file is edited independently
        try:
            import cudnn
            return cudnn, f"from the environment (bench_memory_bound loader unavailable: {_short(error)})"
        except ImportError as missing:
            return None, f"not importable: {missing}"
    return import_cudnn_frontend()


class CudnnMatmul:
    """cuDNN frontend (cudnn.pygraph) graphs: A [1,M,K] @ B [1,K,N] -> add bias [1,1,N] -> act.

    Calls, as in the frontend's samples/python (01_matmul_bias.ipynb, 10_matrix_multiplication.ipynb,
    test_matmul_bias_relu.py) and the 1.32 package's cudnn/_pygraph.py: pygraph(io_data_type,
    intermediate_data_type, compute_data_type, handle), tensor(name, dim, stride, data_type),
    matmul(A, B), add(a, b), gelu(input) / gelu_approx_tanh(input) / relu(input), set_output,
    validate, build_operation_graph, create_execution_plans([heur_mode.A, heur_mode.FALLBACK]),
    check_support, build_plans, get_workspace_size, execute(variant_pack, workspace, handle=...).

    cuDNN's gelu node is CUDNN_POINTWISE_GELU_FWD, the erf ("exact") GELU x * Phi(x); the tanh
    approximation is the separate CUDNN_POINTWISE_GELU_APPROX_TANH_FWD (gelu_approx_tanh here).
    """

    def __init__(self, module):
        self.fe = module
        self.handle = module.create_handle()
        module.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)

    def build(self, a, b, bias, epilogue):
        """(run, y, plan name): run() executes the built plan into y ([M, N] bf16, NaN-poisoned)."""
        fe = self.fe
        m, k = a.shape
        n = b.shape[1]
        a3, b3, bias3 = a.view(1, m, k), b.view(1, k, n), bias.view(1, 1, n)
        y = torch.full((m, n), float("nan"), dtype=BF16, device=a.device)
        y3 = y.view(1, m, n)
        g = fe.pygraph(io_data_type=fe.data_type.BFLOAT16, intermediate_data_type=fe.data_type.FLOAT,
                       compute_data_type=fe.data_type.FLOAT, handle=self.handle)
        A, B, BIAS = (g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                               data_type=fe.data_type.BFLOAT16)
                      for name, t in (("A", a3), ("B", b3), ("bias", bias3)))
        out = g.add(g.matmul(A, B, name="matmul"), BIAS, name="bias_add")
        if epilogue == "gelu":
            out = g.gelu(input=out, name="gelu")  # CUDNN_POINTWISE_GELU_FWD: erf GELU
        elif epilogue == "gelu_tanh":
            out = g.gelu_approx_tanh(input=out, name="gelu_tanh")
        elif epilogue == "relu":
            out = g.relu(input=out, name="relu")
        out.set_output(True).set_name("Y").set_data_type(fe.data_type.BFLOAT16)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=a.device)
        try:
            plan_name = g.get_plan_name_at_index(getattr(g, "_plan_index", 0))
        except Exception as error:  # noqa: BLE001 - naming is informative only
            plan_name = f"? ({_short(error, 60)})"
        pack, handle = {A: a3, B: b3, BIAS: bias3, out: y3}, self.handle
        return (lambda: g.execute(pack, workspace, handle=handle)), y, plan_name


# --- measuring -----------------------------------------------------------------------------------
def frontend_from_args(args, wrapper) -> tuple:
    """(wrapper(cudnn module) or None, note), honouring --no-cudnn and --cudnn-fe-path."""
    if args.no_cudnn:
        return None, "skipped (--no-cudnn)"
    if args.cudnn_fe_path:
        sys.path.insert(0, os.path.abspath(args.cudnn_fe_path))
    try:
        module, note = load_cudnn_frontend()
        if module is None:
            return None, note
        return wrapper(module), (f"cudnn frontend {getattr(module, '__version__', '?')}, backend "
                                 f"{module.backend_version()}; {note}")
    except Exception as error:  # noqa: BLE001
        return None, f"unavailable: {_short(error, 300)}"


def flush_us() -> float:
    """Device microseconds of the L2 flush do_bench runs before each timed call."""
    try:
        driver = triton.runtime.driver.active
        cache = driver.get_empty_cache_for_benchmark()
        return median_ms(lambda: driver.clear_cache(cache)) * 1e3
    except Exception:  # noqa: BLE001 - informative only
        return 0.0


def _short(error: BaseException, width: int = 90) -> str:
    text = (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= width else text[:width - 3] + "..."


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, device, calls: int = 30) -> float:
    """Host time per call: near or above the device time, the device idles between calls and the
    timing holds host time (decode shapes run for a few microseconds)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _sync(device)
    return elapsed / calls * 1e6


def _kernel_names(fn) -> Optional[list]:
    """Names of the CUDA kernels one call launches (torch profiler), None if profiling fails."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
        return [n for n in names if not n.startswith(("Memset", "Memcpy", "[memory]"))]
    except Exception:  # noqa: BLE001 - informative only
        return None


def _failed(error, status="n/a") -> dict:
    return {"status": status, "error": error if isinstance(error, str) else _short(error, 400)}


class Measure:
    """Checks and times one provider: run() fills `out()` (or returns the output)."""

    def __init__(self, flops, reference_of, device, timed, profile, rep_ms):
        self.flops, self.reference_of, self.device = flops, reference_of, device
        self.timed, self.profile, self.rep_ms = timed, profile and timed, rep_ms

    def __call__(self, run: Callable, flavour: str, output: Optional[Callable] = None, **extra) -> dict:
        try:
            result = run()
            _sync(self.device)
            out = output() if output is not None else result
            error = rel_error(out, self.reference_of(flavour))
            row = {"status": "ok", "flavour": flavour, "rel_error": error,
                   "checked": math.isfinite(error) and error <= TOLERANCE, **extra}
            del out, result
            if self.timed:
                ms = median_ms(run, warmup=25, rep=self.rep_ms)
                row.update(ms=ms, tflops=self.flops / ms / 1e9, host_us=_host_us(run, self.device))
                if self.profile:
                    row["kernels"] = _kernel_names(run)
            return row
        except Exception as error:  # noqa: BLE001 - one provider failing leaves the others measured
            return {**_failed(error), **{k: v for k, v in extra.items() if k in ("build_s", "plan")}}


def measure_dnngraph(m, n, k, epilogue, a, b, bias, measure: Measure, autotune: bool, dtype) -> dict:
    extra = {}
    try:
        g, (ta, tb, tbias, ty) = build_graph(m, n, k, epilogue, dtype=dtype,
                                             name="mm_tuned" if autotune else "mm_heur")
        start = time.perf_counter()
        g.build(autotune=autotune)
        extra["build_s"] = time.perf_counter() - start
        extra["plan"] = plan_summary(g.plan)
    except Exception as error:  # noqa: BLE001 - the matmul kernels are work in progress
        return {**_failed(error), **extra}
    y = torch.full((m, n), float("nan"), dtype=a.dtype, device=a.device)
    bindings = {ta: a, tb: b, tbias: bias.view(1, n), ty: y}
    return measure(lambda: g.execute(bindings), epilogue, output=lambda: y, **extra)


def run_shape(shape, epilogue, device, args, frontend, compiled: dict, deadline: float,
              providers=PROVIDERS, dtype=BF16, timed: Optional[bool] = None) -> dict:
    m, n, k = shape
    a, b, bias = make_inputs(m, n, k, device, dtype)
    pre = reference_pre(a, b, bias)
    references = {}

    def reference_of(flavour):
        if flavour not in references:
            references[flavour] = activation(flavour, pre)
        return references[flavour]

    timed = torch.device(device).type == "cuda" if timed is None else timed
    measure = Measure(2.0 * m * n * k, reference_of, device, timed, not args.no_profile, args.rep_ms)
    row = {"shape": list(shape), "label": "x".join(map(str, shape)), "epilogue": epilogue,
           "gflop": 2.0 * m * n * k / 1e9}
    skipped = {"status": "-", "error": "not requested"}
    # anchors first: a dnngraph kernel that faults the context then still leaves them measured
    if "cublas" in providers:
        fn = EAGER[epilogue]
        row["cublas"] = measure(lambda: fn(a, b, bias), epilogue)
    if "cublaslt" in providers:
        lt = lt_function(epilogue)
        row["cublaslt"] = measure(lambda: lt(a, b, bias), lt_flavour(epilogue, device),
                                  fused_eligible=min(m, n, k) > 1)
    if "compile" in providers:
        if args.no_compile:
            row["compile"] = skipped
        elif time.perf_counter() > deadline:
            row["compile"] = {"status": "skipped", "error": "torch.compile time budget spent"}
        else:
            fn = EAGER[epilogue]
            if fn not in compiled:
                compiled[fn] = torch.compile(fn, dynamic=False)
            cfn = compiled[fn]
            try:
                start = time.perf_counter()
                cfn(a, b, bias)  # compiles (a static recompile for each new shape)
                _sync(device)
                first_call_s = time.perf_counter() - start
                row["compile"] = measure(lambda: cfn(a, b, bias), epilogue, first_call_s=first_call_s)
            except Exception as error:  # noqa: BLE001 - e.g. no compiler on this machine
                row["compile"] = _failed(error)
    if "cudnn" in providers:
        if args.no_cudnn:
            row["cudnn"] = skipped
        elif frontend is None:
            row["cudnn"] = {"status": "n/a", "error": "cuDNN frontend not available"}
        else:
            try:
                start = time.perf_counter()
                run, y, plan_name = frontend.build(a, b, bias, epilogue)
                row["cudnn"] = measure(run, epilogue, output=lambda: y, build_s=time.perf_counter() - start,
                                       plan=plan_name)
            except Exception as error:  # noqa: BLE001 - graph not supported by this cuDNN, API change
                row["cudnn"] = _failed(error)
    # the heuristics build first: a tuned build may cache a winner the model-only build would read
    graph_dtype = dg.bfloat16 if dtype == BF16 else dg.float32
    if "dg_heur" in providers:
        row["dg_heur"] = measure_dnngraph(m, n, k, epilogue, a, b, bias, measure, False, graph_dtype)
    if "dg_tuned" in providers:
        row["dg_tuned"] = measure_dnngraph(m, n, k, epilogue, a, b, bias, measure, True, graph_dtype)
    for name in PROVIDERS:
        row.setdefault(name, skipped)
    del a, b, bias, pre, references
    return row


# --- reporting -----------------------------------------------------------------------------------
def _ok(result) -> bool:
    return result.get("status") == "ok" and "ms" in result


def _cell(result) -> str:
    if result.get("status") == "ok":
        text = _tflops(result["tflops"]) if "tflops" in result else "ok"
        return text + ("" if result["checked"] else " (!)")
    return result.get("status", "-")


def _tflops(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def _ratio(anchor, ours) -> str:
    return f"{anchor['ms'] / ours['ms']:.2f}" if _ok(anchor) and _ok(ours) else "-"


def _err(result) -> str:
    return f"{result['rel_error']:.0e}" if result.get("status") == "ok" else "-"


def _nkernels(result) -> str:
    names = result.get("kernels")
    return "-" if not names else str(len(names))


def _geomean(values) -> Optional[float]:
    values = [v for v in values if v and math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def report(rows, header):
    ep = header["epilogue"]
    lt_note = " (tanh)" if ep == "gelu" and header.get("device_type", "cuda") == "cuda" else ""
    print_table(f"matmul + bias + {ep}, bf16 in/out, float32 accumulate: TFLOP/s over 2*M*N*K",
                ["M x N x K", "GFLOP", "cuBLAS+sep", f"cuBLASLt epi{lt_note}", "compile", "cuDNN FE",
                 "dg heur", "dg tuned"],
                [[r["label"], f"{r['gflop']:.3g}"] + [_cell(r[p]) for p in PROVIDERS] for r in rows])
    print_table("dnngraph speed over each anchor (anchor time / dnngraph time, > 1: dnngraph faster): "
                "heuristics / autotuned",
                ["M x N x K", "vs cuBLASLt epi", "vs cuBLAS+sep", "vs compile", "vs cuDNN FE"],
                [[r["label"]] + [f"{_ratio(r[x], r['dg_heur'])} / {_ratio(r[x], r['dg_tuned'])}" for x in ANCHORS]
                 for r in rows])
    print_table(f"Relative error vs the float32 reference (tolerance {TOLERANCE:g}) and kernels per call",
                ["M x N x K"] + [f"err {TITLES[p]}" for p in PROVIDERS] + ["kernels " + "/".join(
                    TITLES[p] for p in PROVIDERS)],
                [[r["label"]] + [_err(r[p]) for p in PROVIDERS] + ["/".join(_nkernels(r[p]) for p in PROVIDERS)]
                 for r in rows])
    plan_rows = []
    for r in rows:
        cells = [r["label"]]
        for key in ("dg_heur", "dg_tuned"):
            plan = r[key].get("plan") or {}
            tuning = plan.get("tuning") or {}
            config = plan.get("matmul_config") or "-"
            cells.append(f"{config} [{plan.get('launches', '-')} launch(es)]" if plan else
                         (f"n/a: {r[key].get('error', '')[:80]}" if r[key].get("status") == "n/a" else "-"))
            cells.append(f"{tuning.get('source') or '-'}"
                         + (f", {tuning['candidates']} timed" if tuning.get("candidates") else ""))
            cells.append(f"{r[key]['build_s']:.1f}" if "build_s" in r[key] else "-")
        cells.append(r["cudnn"].get("plan", "-"))
        plan_rows.append(cells)
    print_table("Plans: dnngraph matmul config (heuristics, autotuned), tuning source, build seconds; cuDNN plan",
                ["M x N x K", "dg heur config", "source", "build s", "dg tuned config", "source", "build s",
                 "cuDNN FE plan"], plan_rows)
    footer = []
    for ours in ("dg_tuned", "dg_heur"):
        for anchor in ("cublas", "cublaslt", "compile", "cudnn"):
            ratios = [r[anchor]["ms"] / r[ours]["ms"] for r in rows if _ok(r[anchor]) and _ok(r[ours])]
            mean = _geomean(ratios)
            if mean is not None:
                footer.append(f"- geomean {TITLES[ours]} / {TITLES[anchor]} (TFLOP/s ratio): {mean:.3f} "
                              f"over {len(ratios)} shape(s)")
            elif anchor == "cublas":
                footer.append(f"- geomean {TITLES[ours]} / {TITLES[anchor]}: no shape with both measured")
    print("\nGeometric means over shapes (> 1: dnngraph faster):\n" + "\n".join(footer))
    notes = failure_notes(rows)
    if notes:
        print("\nNot measured, past tolerance, or timings that may hold host time:\n" + "\n".join(notes))


def failure_notes(rows):
    reasons = {}
    for row in rows:
        for name in PROVIDERS:
            result = row[name]
            if result.get("status") in ("n/a", "skipped"):
                reason = result.get("error", "")
            elif result.get("status") == "ok" and not result["checked"]:
                reason = f"rel error {result['rel_error']:.1e} vs the float32 {result['flavour']} reference"
            elif _ok(result) and result.get("host_us", 0) > result["ms"] * 1e3 + 20:
                reason = "host time per call exceeds the device time + 20 us: the timing may hold host time"
            elif name == "cublaslt" and result.get("status") == "ok" and not result.get("fused_eligible", True):
                reason = "a dim of size 1: aten skips the cuBLASLt epilogue (cuBLAS gemm + separate activation)"
            elif name == "dg_heur" and ((result.get("plan") or {}).get("tuning") or {}).get("source") in ("cache", "tuned"):
                reason = "the heuristics-only build reports a tuned/cached config: not a model-only number"
            else:
                continue
            reasons.setdefault((TITLES[name], reason), []).append(row["label"])
    return [f"- {name}: {reason} [{'; '.join(labels)}]" for (name, reason), labels in reasons.items()]


# --- the dtypes table: every dot type and mixed pair, and the Llama MLP block ----------------------
DTYPE_SHAPES = [(2048, 4096, 4096), (4096, 4096, 4096)]
MLP_SIZES = (4096, 4096, 11008)  # T, H, I (Llama-2-7B)
# (label, A dtype, B dtype, B layout, allow_tf32, output dtype); layout "col": B stored K-major
DTYPE_CASES = [
    ("bf16", BF16, BF16, "row", False, BF16),
    ("fp16", torch.float16, torch.float16, "row", False, torch.float16),
    ("tf32", F32, F32, "row", True, F32),
    ("tf32 B K-major", F32, F32, "col", True, F32),
    ("fp32 IEEE", F32, F32, "row", False, F32),
    ("fp32 x bf16", F32, BF16, "row", False, BF16),
    ("bf16 x fp32", BF16, F32, "row", False, BF16),
    # int8 x int8 -> int32 (TOPS in the TFLOP/s columns), B K-major as cuBLASLt's int8 GEMM takes it
    ("int8", torch.int8, torch.int8, "col", False, torch.int32),
]
# (anchor label, torch function of (a, b), allow_tf32 in torch) per case label
DTYPE_TOLERANCE = {"tf32": 2e-3, "fp32": 2e-5, "bf16": 1.6e-2, "fp16": 2e-3, "int8": 0.0}
INT8_CPU_SHAPES = [(33, 47, 29), (17, 40, 64), (1, 24, 40)]


def _dtype_inputs(m, n, k, a_type, b_type, b_layout, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    if a_type == torch.int8:  # quantized operands: the whole int8 range
        a = torch.randint(-128, 128, (m, k), generator=gen, device=device, dtype=torch.int8)
        b = torch.randint(-128, 128, (k, n), generator=gen, device=device, dtype=torch.int8)
        return a, (b.t().contiguous().t() if b_layout == "col" else b)
    a = torch.randn(m, k, generator=gen, device=device).to(a_type)
    b = (torch.randn(k, n, generator=gen, device=device) / math.sqrt(k))
    b = (b.t().contiguous().t() if b_layout == "col" else b).to(b_type)
    return a, b


def _int8_anchor(a, b):
    """torch's int8 GEMM (cuBLASLt int8 -> int32); _int_mm takes M > 16 and N, K multiples of 8
    on the GPU: other shapes get the exact int64 product instead, which is no speed anchor."""
    if a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:
        return (lambda: torch._int_mm(a, b)), "torch._int_mm"
    return (lambda: (a.long() @ b.long()).int()), "torch int64 mm (no _int_mm form)"


def _dtype_anchor(label, a, b):
    """(torch callable, anchor name): what torch runs for the same problem."""
    if label == "int8":
        return _int8_anchor(a, b)
    if label in ("bf16", "fp16", "fp32 IEEE"):
        return (lambda: a @ b), "torch " + label
    if label.startswith("tf32"):
        return (lambda: a @ b), "torch tf32"
    return (lambda: a.to(BF16) @ b.to(BF16)), "torch cast + bf16 mm"


def _dg_matmul(a, b, allow_tf32, out_dtype, autotune):
    g = dg.Graph(name="dtypes", io_data_type=dg.dtypes.from_torch(out_dtype), intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32, allow_tf32=allow_tf32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    c = g.matmul(ta, tb).set_output(True).set_name("c")
    g.build(autotune=autotune)
    poison = float("nan") if out_dtype.is_floating_point else -12345
    out = torch.full((a.shape[0], b.shape[1]), poison, dtype=out_dtype, device=a.device)
    bindings = {ta: a, tb: b, c: out}
    return g, (lambda: g.execute(bindings)), out


def _timed(fn, flops, rep_ms):
    ms = median_ms(fn, warmup=25, rep=rep_ms)
    return {"ms": ms, "tflops": flops / ms / 1e9}


def dtype_cases(wanted: str) -> list:
    """DTYPE_CASES whose label --cases names (comma-separated; empty: all)."""
    labels = [label.strip() for label in wanted.split(",") if label.strip()]
    unknown = sorted(set(labels) - {case[0] for case in DTYPE_CASES})
    if unknown:
        sys.exit(f"--cases: no dtype case {unknown}; the cases: {', '.join(c[0] for c in DTYPE_CASES)}")
    return [case for case in DTYPE_CASES if not labels or case[0] in labels]


def run_dtypes(args, cache_dir):
    """The dtypes table: dnngraph (model choice, autotuned) against torch per dot type."""
    rows = []
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    for shape in args.shapes or DTYPE_SHAPES:
        m, n, k = shape
        flops = 2.0 * m * n * k
        for label, a_type, b_type, b_layout, tf32, out_dtype in dtype_cases(args.cases):
            row = {"label": "x".join(map(str, shape)), "case": label}
            try:
                a, b = _dtype_inputs(m, n, k, a_type, b_type, b_layout)
                reference = a.double() @ b.double()
                torch.backends.cuda.matmul.allow_tf32 = label.startswith("tf32")
                anchor, row["anchor"] = _dtype_anchor(label, a, b)
                row["anchor_error"] = rel_error(anchor(), reference)
                row["torch"] = _timed(anchor, flops, args.rep_ms)
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
                for key, autotune in (("dg_heur", False), ("dg_tuned", True)):
                    g, run, out = _dg_matmul(a, b, tf32, out_dtype, autotune)
                    run()
                    torch.cuda.synchronize()
                    row[key] = {"error": rel_error(out, reference), "plan": plan_summary(g.plan),
                                **_timed(run, flops, args.rep_ms)}
                    del g, run, out
            except Exception as error:  # noqa: BLE001 - one case failing leaves the others measured
                row["failed"] = _short(error, 300)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            rows.append(row)
            print(f"{row['label']} {label}: " + (row.get("failed") or
                  f"torch {row['torch']['tflops']:.0f}, dg {row['dg_heur']['tflops']:.0f} / "
                  f"{row['dg_tuned']['tflops']:.0f} TFLOP/s"), flush=True)
            write_json("dtypes.json", {"rows": rows})
            torch.cuda.empty_cache()
    mlp_rows = [] if args.cases else run_mlp(args)  # the Llama MLP block with every case only
    report_dtypes(rows, mlp_rows)
    write_json("dtypes.json", {"rows": rows, "mlp": mlp_rows, "cache_dir": cache_dir})
    return rows, mlp_rows


def _rate(result) -> str:
    return _tflops(result["tflops"]) if result and "tflops" in result else "-"


def report_dtypes(rows, mlp_rows):
    by_key = {(r["label"], r["case"]): r for r in rows}
    table = []
    for r in rows:
        if "failed" in r:
            table.append([r["label"], r["case"], f"failed: {r['failed'][:120]}"] + ["-"] * 7)
            continue
        bf16 = by_key.get((r["label"], "bf16"), {})
        versus_bf16 = "-"
        if "x" in r["case"] and "dg_tuned" in bf16:
            versus_bf16 = f"{r['dg_tuned']['tflops'] / bf16['dg_tuned']['tflops']:.2f}"
        table.append([r["label"], r["case"], r["anchor"], _rate(r["torch"]), _rate(r["dg_heur"]),
                      _rate(r["dg_tuned"]), f"{r['dg_tuned']['tflops'] / r['torch']['tflops']:.2f}", versus_bf16,
                      f"{r['dg_tuned']['error']:.1e} ({r['anchor_error']:.1e})",
                      r["dg_tuned"]["plan"]["matmul_config"]])
    print_table("dtypes: matmul TFLOP/s per dot type (2*M*N*K; plain matmul, no epilogue)",
                ["M x N x K", "case", "anchor", "anchor TF/s", "dg heur", "dg tuned", "tuned / anchor",
                 "tuned / dg bf16", "dg error (anchor)", "dg tuned config"], table)
    if mlp_rows:
        print_table("Llama MLP block (rmsnorm -> gate/up -> silu * up -> down + residual), bf16 io, "
                    f"T={MLP_SIZES[0]} H={MLP_SIZES[1]} I={MLP_SIZES[2]}",
                    ["provider", "ms", "TFLOP/s", "vs dg bf16 intermediates", "rel error vs float64 graph ref",
                     "kernels"],
                    [[r["provider"], f"{r['ms']:.3f}" if "ms" in r else r.get("failed", "-")[:120],
                      _rate(r), r.get("versus", "-"), f"{r['error']:.1e}" if "error" in r else "-",
                      str(r.get("kernels", "-"))] for r in mlp_rows])


def build_mlp(tokens, hidden, inner, intermediate):
    """The Llama MLP block as one graph: x + down(silu(gate(n)) * up(n)), n = rmsnorm(x)."""
    g = dg.Graph(name="llama_mlp", io_data_type=dg.bfloat16, intermediate_data_type=intermediate,
                 compute_data_type=dg.float32)
    x = g.tensor(name="x", dim=[tokens, hidden])
    scale = g.tensor(name="scale", dim=[1, hidden])
    w_gate, w_up = g.tensor(name="w_gate", dim=[hidden, inner]), g.tensor(name="w_up", dim=[hidden, inner])
    w_down = g.tensor(name="w_down", dim=[inner, hidden])
    normed = g.rmsnorm(x, scale, epsilon=1e-5, norm_forward_phase="inference")[0]
    hidden_act = g.mul(g.silu(g.matmul(normed, w_gate)), g.matmul(normed, w_up))
    g.add(g.matmul(hidden_act, w_down), x).set_output(True).set_name("y")
    return g


def mlp_inputs(tokens, hidden, inner, device, dtype=BF16):
    gen = torch.Generator(device=device).manual_seed(1)
    return {"x": torch.randn(tokens, hidden, generator=gen, device=device).to(dtype),
            "scale": (1 + 0.1 * torch.randn(1, hidden, generator=gen, device=device)).to(dtype),
            "w_gate": (torch.randn(hidden, inner, generator=gen, device=device) / math.sqrt(hidden)).to(dtype),
            "w_up": (torch.randn(hidden, inner, generator=gen, device=device) / math.sqrt(hidden)).to(dtype),
            "w_down": (torch.randn(inner, hidden, generator=gen, device=device) / math.sqrt(inner)).to(dtype)}


def mlp_eager(x, scale, w_gate, w_up, w_down):
    """The Hugging Face Llama MLP with its RMSNorm (fp32 statistics, bf16 matmuls)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * scale
    return x + (F.silu(normed @ w_gate) * (normed @ w_up)) @ w_down


def run_mlp(args):
    tokens, hidden, inner = MLP_SIZES
    flops = 2.0 * tokens * hidden * inner * 3
    inputs = mlp_inputs(tokens, hidden, inner, "cuda")
    reference = build_mlp(tokens, hidden, inner, dg.float32).reference(inputs)["y"].double()  # float64, GPU
    rows = []
    for provider, intermediate in (("dg fp32 intermediates", dg.float32), ("dg bf16 intermediates", dg.bfloat16)):
        try:
            g = build_mlp(tokens, hidden, inner, intermediate)
            g.build()
            y = torch.full((tokens, hidden), float("nan"), dtype=BF16, device="cuda")
            bindings = {**inputs, "y": y}
            run = lambda: g.execute(bindings)  # noqa: E731
            run()
            torch.cuda.synchronize()
            rows.append({"provider": provider, "error": rel_error(y, reference), "kernels": len(g.plan.launches),
                         "configs": [l.config_text for l in g.plan.launches], **_timed(run, flops, args.rep_ms)})
        except Exception as error:  # noqa: BLE001
            rows.append({"provider": provider, "failed": _short(error, 300)})
    args_list = [inputs[k] for k in ("x", "scale", "w_gate", "w_up", "w_down")]
    for provider, fn in (("torch eager", mlp_eager), ("torch.compile", torch.compile(mlp_eager, dynamic=False))):
        try:
            out = fn(*args_list)
            torch.cuda.synchronize()
            rows.append({"provider": provider, "error": rel_error(out, reference),
                         **_timed(lambda: fn(*args_list), flops, args.rep_ms)})
        except Exception as error:  # noqa: BLE001
            rows.append({"provider": provider, "failed": _short(error, 300)})
    base = next((r for r in rows if r["provider"] == "dg bf16 intermediates" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r:
            r["versus"] = f"{r['ms'] / base['ms']:.2f}x"
    return rows


# --- main ----------------------------------------------------------------------------------------
def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        parts = item.split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxNxK")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def _use_cache_dir(args) -> tuple:
    """(folder, remove at exit): a fresh DNNGRAPH_CACHE_DIR unless --reuse-cache."""
    if args.reuse_cache:
        return os.environ.get("DNNGRAPH_CACHE_DIR", "~/.cache/dnngraph (default)"), False
    folder = tempfile.mkdtemp(prefix="dnngraph-bench-matmul-")
    os.environ["DNNGRAPH_CACHE_DIR"] = folder
    return folder, True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epilogue", default="gelu", choices=EPILOGUES,
                        help="activation after the bias (gelu: erf GELU)")
    parser.add_argument("--shapes", type=parse_shapes, default=None, help="comma-separated MxNxK")
    parser.add_argument("--quick", action="store_true", help="4096^3 and 8192^3 only")
    parser.add_argument("--only", default="", help="comma-separated words: shapes whose MxNxK label has one")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchor")
    parser.add_argument("--no-cudnn", action="store_true", help="skip the cuDNN frontend anchor")
    parser.add_argument("--no-profile", action="store_true", help="do not count kernels with the profiler")
    parser.add_argument("--reuse-cache", action="store_true",
                        help="build with the environment's DNNGRAPH_CACHE_DIR (default: a fresh one)")
    parser.add_argument("--autotune-top", default=None,
                        help="set DNNGRAPH_AUTOTUNE_TOP (candidates the tuned build times; 'all' for every one)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    parser.add_argument("--compile-budget-s", type=float, default=300.0,
                        help="skip torch.compile once the run has spent this many seconds")
    parser.add_argument("--table", default="epilogue", choices=("epilogue", "dtypes"),
                        help="epilogue: matmul + bias + activation per shape (default); dtypes: every dot "
                             "type and mixed pair against torch, and the Llama MLP block")
    parser.add_argument("--cases", default="",
                        help="with --table dtypes: comma-separated case labels (default every one, and then "
                             "the Llama MLP block too), e.g. int8,bf16")
    parser.add_argument("--check-cpu", action="store_true",
                        help="tiny fp32 shapes through dnngraph on CPU (interpreter), numbers only")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.autotune_top is not None:
        os.environ["DNNGRAPH_AUTOTUNE_TOP"] = str(args.autotune_top)
    cache_dir, remove_cache = _use_cache_dir(args)
    try:
        if args.check_cpu:
            return check_cpu(args)
        if args.table == "dtypes":
            if not torch.cuda.is_available():
                sys.exit("no CUDA device: the dtypes table times kernels on the GPU")
            return run_dtypes(args, cache_dir)
        return run_gpu(args, cache_dir)
    finally:
        if remove_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)


def run_gpu(args, cache_dir):
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: use --check-cpu for the CPU smoke test")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is full float32
    for knob in ("recompile_limit", "cache_size_limit"):  # one static compile per shape
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    started = time.perf_counter()
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    shapes = [s for s in shapes if not words or any(w in "x".join(map(str, s)) for w in words)]
    torch.empty(1, device="cuda")  # torch's CUDA context before cuDNN's
    frontend, fe_note = None, "skipped (--no-cudnn)"
    if not args.no_cudnn:
        try:
            module, fe_note = load_cudnn_frontend()
            if module is not None:
                frontend = CudnnMatmul(module)
                fe_note = f"cudnn frontend {getattr(module, '__version__', '?')}, backend " \
                          f"{module.backend_version()}; {fe_note}"
        except Exception as error:  # noqa: BLE001
            frontend, fe_note = None, f"unavailable: {_short(error, 300)}"
        print(f"cuDNN frontend: {fe_note}", flush=True)
    header = {"device": torch.cuda.get_device_name(), "device_type": "cuda", "torch": torch.__version__,
              "triton": triton.__version__, "torch_cudnn": torch.backends.cudnn.version(),
              "cudnn_frontend": fe_note, "epilogue": args.epilogue, "tolerance": TOLERANCE,
              "dnngraph_cache_dir": cache_dir, "fresh_cache": not args.reuse_cache,
              "autotune_top": os.environ.get("DNNGRAPH_AUTOTUNE_TOP", "(library default)"),
              "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
              "flops": "2*M*N*K", "lt_gelu": "tanh approximation (cuBLASLt GELU_BIAS epilogue)"}
    deadline = started + args.compile_budget_s
    compiled, rows = {}, []
    for shape in shapes:
        label = "x".join(map(str, shape))
        shape_start = time.perf_counter()
        try:
            row = run_shape(shape, args.epilogue, "cuda", args, frontend, compiled, deadline)
        except Exception as error:  # noqa: BLE001 - inputs or reference of the shape failed
            failed = _failed(error)
            row = {"shape": list(shape), "label": label, "epilogue": args.epilogue,
                   "gflop": 2.0 * math.prod(shape) / 1e9, **{p: failed for p in PROVIDERS}}
        row["seconds"] = time.perf_counter() - shape_start
        rows.append(row)
        print(f"[{time.perf_counter() - started:5.0f} s] {label} ({row['seconds']:.0f} s): " + ", ".join(
            f"{TITLES[p]} {_cell(row[p])}" for p in PROVIDERS), flush=True)
        header["seconds"] = time.perf_counter() - started
        write_json("matmul.json", {"header": header, "rows": rows})  # kept if a later shape dies
        torch.cuda.empty_cache()
    header["seconds"] = time.perf_counter() - started
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}, "
          f"cuDNN (torch) {header['torch_cudnn']}")
    print(f"cuDNN frontend: {fe_note}")
    print(f"dnngraph cache: {cache_dir} ({'fresh' if not args.reuse_cache else 'reused'}), "
          f"DNNGRAPH_AUTOTUNE_TOP={header['autotune_top']}; run took {header['seconds']:.0f} s")
    report(rows, header)
    path = write_json("matmul.json", {"header": header, "rows": rows})
    if path:
        print(f"\nresults: {path}")
    return rows


def check_cpu(args):
    """dnngraph (model-only and autotuned builds) on tiny fp32 shapes through Triton's interpreter,
    against the float32 torch reference and the graph's own float64 reference."""
    shapes = args.shapes or CPU_SHAPES
    rows, failures = [], 0
    for shape in shapes:
        for epilogue in dict.fromkeys((args.epilogue, "none")):
            m, n, k = shape
            start = time.perf_counter()
            row = run_shape(shape, epilogue, "cpu", args, None, {}, 0.0,
                            providers=("dg_heur", "dg_tuned"), dtype=F32)
            # cross-check the torch reference against the graph's float64 op-by-op reference
            try:
                a, b, bias = make_inputs(m, n, k, "cpu", F32)
                g, (ta, tb, tbias, _) = build_graph(m, n, k, epilogue, dtype=dg.float32)
                ref64 = g.reference({ta: a, tb: b, tbias: bias.view(1, n)})["y"]
                row["reference_check"] = rel_error(activation(epilogue, reference_pre(a, b, bias)), ref64)
            except Exception as error:  # noqa: BLE001
                row["reference_check"] = float("nan")
                print(f"  reference cross-check failed: {_short(error)}")
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            cells = []
            for name in ("dg_heur", "dg_tuned"):
                result = row[name]
                if result["status"] == "ok":
                    source = ((result.get("plan") or {}).get("tuning") or {}).get("source")
                    cells.append(f"{TITLES[name]} err {result['rel_error']:.1e}" + (f" ({source})" if source else "")
                                 + ("" if result["checked"] else " (!)"))
                    failures += not result["checked"]
                else:
                    cells.append(f"{TITLES[name]} {result['status']}: {result.get('error', '')[:100]}")
                    failures += 1
            print(f"{row['label']} {epilogue} ({row['seconds']:.1f} s): " + " | ".join(cells), flush=True)
    print_table("CPU check (Triton interpreter, fp32): relative error vs the float32 torch reference",
                ["M x N x K", "epilogue", "dg heur", "dg tuned", "dg heur config", "dg tuned config",
                 "torch ref vs float64 graph ref"],
                [[r["label"], r["epilogue"], _err(r["dg_heur"]), _err(r["dg_tuned"]),
                  (r["dg_heur"].get("plan") or {}).get("matmul_config") or "-",
                  (r["dg_tuned"].get("plan") or {}).get("matmul_config") or "-",
                  f"{r['reference_check']:.0e}"] for r in rows])
    bad_refs = sum(not (r["reference_check"] <= 1e-5) for r in rows)
    print(f"\n{failures} dnngraph result(s) missing or past tolerance {TOLERANCE:g}; "
          f"{bad_refs} reference cross-check(s) past 1e-5")
    int8_failures = check_cpu_int8()
    if failures or bad_refs or int8_failures:
        sys.exit(1)
    return rows


def check_cpu_int8() -> int:
    """The dtypes table's int8 row at tiny shapes through the interpreter: dnngraph's int32 product
    (model choice and autotuned) bit-exact against torch's int8 GEMM on the CPU; the count of
    mismatches."""
    table, failures = [], 0
    for m, n, k in INT8_CPU_SHAPES:
        a, b = _dtype_inputs(m, n, k, torch.int8, torch.int8, "col", device="cpu")
        anchor, anchor_name = _int8_anchor(a, b)
        want = anchor()
        cells = []
        for autotune in (False, True):
            g, run, out = _dg_matmul(a, b, False, torch.int32, autotune)
            run()
            same = torch.equal(out, want)
            failures += not same
            cells += ["exact" if same else f"off by {(out.long() - want.long()).abs().max().item()} (!)",
                      plan_summary(g.plan)["matmul_config"]]
        table.append([f"{m}x{n}x{k}", anchor_name] + cells)
    print_table("CPU check, int8 x int8 -> int32 (Triton interpreter) against torch",
                ["M x N x K", "anchor", "dg heur", "dg heur config", "dg tuned", "dg tuned config"], table)
    print(f"{failures} int8 result(s) not bit-exact")
    return failures


if __name__ == "__main__":
    main()
