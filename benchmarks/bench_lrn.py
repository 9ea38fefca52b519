"""LRN and divisive normalization (forward and backward) against torch eager
`F.local_response_norm` and torch.compile of it, in TB/s over the minimal bytes (each input read
once, each output written once), with the device copy ceiling measured in the same process.
Goal: >= 80% of copy.

    python benchmarks/bench_lrn.py            # GPU table (bf16 and fp32, NCHW and NHWC)
    python benchmarks/bench_lrn.py --dtypes bf16 --only alexnet   # a part of it
    python benchmarks/bench_lrn.py --cpu      # a small CPU check through Triton's interpreter
    python benchmarks/bench_lrn.py --no-compile-anchor   # both dtypes in under two minutes
    python benchmarks/bench_lrn.py --schedule tile        # one form only (tile|persistent|both|model);
                                                          # the default, both, times each side by side
"""
import argparse
import concurrent.futures
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dnngraph as dg  # noqa: E402
from common import copy_ceiling_tbs, median_ms, print_table, rel_error  # noqa: E402

TYPES = {torch.bfloat16: dg.bfloat16, torch.float32: dg.float32, torch.float16: dg.float16}
# (name, shape, size): AlexNet's two LRN layers (batch 128) and a wider, ResNet-like activation
SHAPES = [("alexnet-lrn1", (128, 96, 55, 55), 5), ("alexnet-lrn2", (128, 256, 27, 27), 5),
          ("wide-even", (64, 128, 56, 56), 4)]
DIVISIVE_SHAPES = [("lcn-3x3", (64, 64, 56, 56), 3), ("lcn-5x5", (32, 32, 64, 64), 5)]
LRN = dict(alpha=1e-4, beta=0.75, k=2.0)
DIVISIVE = dict(alpha=1.0, beta=0.5, k=1e-2)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}
# do_bench's budget a timing (ms): 100 keeps both dtypes, both schedules inside two minutes, and
# still averages hundreds of runs of these 50-500 us kernels
TIMING = dict(warmup=10, rep=100)


def layout_of(value: torch.Tensor, layout: str) -> torch.Tensor:
    return value.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else value


def lrn_graphs(x: torch.Tensor, op: str, size: int, attrs: dict):
    """(forward graph, backward graph) of `op` over x's dims, layout and type."""
    io = TYPES[x.dtype]
    forward = dg.Graph(name=f"{op}", io_data_type=io)
    fx = forward.tensor_like(x, "x")
    getattr(forward, op)(fx, size=size, **attrs).set_name("y").set_output(True)
    backward = dg.Graph(name=f"{op}_backward", io_data_type=io)
    bx, bdy = backward.tensor_like(x, "x"), backward.tensor_like(x, "dy")
    getattr(backward, f"{op}_backward")(bdy, bx, size=size, **attrs).set_name("dx").set_output(True)
    return forward, backward


def divisive_torch(x, size, alpha, beta, k):
    """divisive_normalization without means, in torch ops (eager and compiled anchors)."""
    spatial = x.dim() - 2
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[spatial - 1]
    before, after = size // 2, (size - 1) // 2
    squares = F.pad(x * x, [before, after] * spatial)
    sums = pool(squares, size, 1) * size ** spatial
    return x / (k + alpha / size ** spatial * sums) ** beta


def torch_function(op, size, attrs):
    if op == "lrn":
        return lambda x: F.local_response_norm(x, size, **attrs)
    return lambda x: divisive_torch(x, size, **attrs)


# --schedule: the forms each case is built in (BuildOptions.lrn_schedule; None: the model's)
FORMS = {"tile": ("tile",), "persistent": ("persistent",), "both": ("tile", "persistent"), "model": (None,)}


def prepared_case(op, name, shape, size, attrs, dtype, layout, device, forms):
    """x, dy, the float64 torch results, and per form its built (forward, backward, y, dx)."""
    x = layout_of(torch.randn(shape, device=device, dtype=torch.float32).to(dtype), layout)
    dy = layout_of(torch.randn(shape, device=device, dtype=torch.float32).to(dtype), layout)
    fn = torch_function(op, size, attrs)
    leaf = x.double().requires_grad_(True)
    want = fn(leaf)
    (want_dx,) = torch.autograd.grad(want, leaf, dy.double())
    built = {}
    for form in forms:
        forward, backward = lrn_graphs(x, op, size, attrs)
        options = dg.BuildOptions(lrn_schedule=form)
        forward.build(options=options)
        backward.build(options=options)
        built[form] = (forward, backward, torch.empty_like(x), torch.empty_like(x))
    picked = []  # the model's form forward and backward, planned only (kernels compile at first execute)
    for model in lrn_graphs(x, op, size, attrs):
        model.build()
        picked.append("persistent" if "persistent=" in model.plan.launches[0].config_text else "tile")
    return dict(op=op, name=name, size=size, attrs=attrs, dtype=dtype, layout=layout, x=x, dy=dy, fn=fn,
                want=want.detach(), want_dx=want_dx, built=built, picked=picked)


def first_runs(case):
    """Execute every form once: its kernels compile (checked() then compares the outputs)."""
    x, dy = case["x"], case["dy"]
    for form, (forward, backward, y, dx) in case["built"].items():
        forward.execute({"x": x, "y": y})
        backward.execute({"x": x, "dy": dy, "dx": dx})
    if x.is_cuda:
        torch.cuda.synchronize()


def checked(case) -> dict:
    """form -> (y error, dx error) against float64 torch; each within the dtype's tolerance."""
    errors = {}
    for form, (forward, backward, y, dx) in case["built"].items():
        errors[form] = (rel_error(y, case["want"]), rel_error(dx, case["want_dx"]))
        assert max(errors[form]) < TOLERANCE[case["dtype"]], (case["name"], form, errors[form])
    return errors


def measured_rows(case, ceiling, compile_anchor):
    """One table row per form: TB/s and % of copy forward and backward, ratios to torch."""
    x, dy, fn = case["x"], case["dy"], case["fn"]
    nbytes = x.numel() * x.element_size()
    tbs = lambda ms, tensors: tensors * nbytes / ms / 1e9
    t_eager = median_ms(lambda: fn(x), **TIMING)
    eager_leaf = x.detach().clone().requires_grad_(True)
    eager_out = fn(eager_leaf)
    t_eager_bwd = median_ms(lambda: torch.autograd.grad(eager_out, eager_leaf, dy, retain_graph=True), **TIMING)
    t_compiled = None
    if compile_anchor:  # torch.compile takes seconds a case: most of the script's time
        compiled = torch.compile(fn)
        compiled(x)
        t_compiled = median_ms(lambda: compiled(x), **TIMING)
    rows = []
    for form, (forward, backward, y, dx) in case["built"].items():
        t_fwd = median_ms(lambda: forward.execute({"x": x, "y": y}), **TIMING)
        t_bwd = median_ms(lambda: backward.execute({"x": x, "dy": dy, "dx": dx}), **TIMING)
        rows.append([case["op"], case["name"], str(case["dtype"]).split(".")[-1], case["layout"], form or "model",
                     "/".join(case["picked"]),
                     f"{tbs(t_fwd, 2):.2f}", f"{tbs(t_fwd, 2) / ceiling:.0%}", f"{t_eager / t_fwd:.2f}x",
                     f"{t_compiled / t_fwd:.2f}x" if t_compiled else "-", f"{tbs(t_bwd, 3):.2f}",
                     f"{tbs(t_bwd, 3) / ceiling:.0%}", f"{t_eager_bwd / t_bwd:.2f}x",
                     forward.plan.launches[0].config_text, backward.plan.launches[0].config_text])
    return rows


def cases(quick: bool):
    lrn_shapes = [("small", (2, 7, 5, 6), 5), ("even", (2, 6, 3, 5), 4)] if quick else SHAPES
    div_shapes = [("small", (2, 3, 6, 5), 3)] if quick else DIVISIVE_SHAPES
    for name, shape, size in lrn_shapes:
        yield "lrn", name, shape, size, LRN
    for name, shape, size in div_shapes:
        yield "divisive_normalization", name, shape, size, DIVISIVE


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="check small cases on the CPU (interpreter) only")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated among bf16, fp32")
    parser.add_argument("--only", default="", help="comma-separated words: cases whose name has one")
    parser.add_argument("--no-compile-anchor", action="store_true", help="leave out the torch.compile anchor")
    parser.add_argument("--schedule", default="both", choices=sorted(FORMS),
                        help="tile: one tile a program; persistent: programs walk tiles; both (default): "
                             "each, side by side; model: the heuristics' choice")
    args = parser.parse_args()
    forms = FORMS[args.schedule]
    if args.cpu or not torch.cuda.is_available():
        rows = []
        for op, name, shape, size, attrs in cases(True):
            for layout in ("nchw", "nhwc"):
                case = prepared_case(op, name, shape, size, attrs, torch.float32, layout, "cpu", forms)
                first_runs(case)
                for form, (y_err, dx_err) in checked(case).items():
                    rows.append([op, name, "float32", layout, form or "model", "/".join(case["picked"]),
                                 f"{y_err:.1e}", f"{dx_err:.1e}"])
        print_table("LRN / divisive normalization, CPU check (rel. error vs float64 torch)",
                    ["op", "case", "dtype", "layout", "schedule", "model fwd/bwd", "y err", "dx err"], rows)
        return
    started = time.perf_counter()
    words = [w for w in args.only.split(",") if w]
    dtypes = [{"bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in args.dtypes.split(",")]
    prepared = [prepared_case(op, name, shape, size, attrs, dtype, layout, "cuda", forms)
                for dtype in dtypes for op, name, shape, size, attrs in cases(False)
                if not words or any(w in name for w in words) for layout in ("nchw", "nhwc")]
    # every kernel compiles before anything is timed, many at once (Triton's compiler leaves the
    # GIL), so the run's minutes go to measuring
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(first_runs, prepared))
    ceilings, rows = {}, []
    for case in prepared:
        checked(case)
        key = (case["x"].numel(), case["dtype"])
        if key not in ceilings:
            ceilings[key] = copy_ceiling_tbs(*key)
        for row in measured_rows(case, ceilings[key], compile_anchor=not args.no_compile_anchor):
            rows.append(row)
            print(" | ".join(row), flush=True)  # a run cut short keeps its rows
        case["built"].clear()  # its tensors' memory back before the next case is timed
    print(f"device: {torch.cuda.get_device_name()}; {time.perf_counter() - started:.0f} s")
    print_table("LRN and divisive normalization (TB/s over minimal bytes; ratios: torch time / dnngraph time; "
                "model fwd/bwd: the schedule the heuristics pick)",
                ["op", "case", "dtype", "layout", "schedule", "model fwd/bwd", "fwd TB/s", "fwd % copy", "vs eager",
                 "vs compile",
                 "bwd TB/s", "bwd % copy", "bwd vs eager", "fwd config", "bwd config"], rows)


if __name__ == "__main__":
    main()
