"""Memory-bound families against torch eager, torch.compile and the cuDNN frontend, in one process.

Rows: layernorm, rmsnorm and softmax forward and backward at 16384x8192 and the LLM shapes
4096 x {4096, 8192, 14336}; residual add + rmsnorm; batchnorm training forward and backward at
32x256x56x56 NHWC; a column sum of 16384x8192; max-pool 3x3/2 pad 1 at 32x64x112x112 NHWC and its
backward at ResNet-50's 64x64x112x112 NHWC (the argmax recomputed from x, or read from the
forward's int64 indices; anchor: aten.max_pool2d_with_indices_backward). All
bf16 in and out, float32 statistics and math. Throughput is TB/s over the minimal bytes (each input
read once, each output written once; the model is stated per family), next to the copy ceiling
measured in the same process. Every implementation's outputs are checked against the float64
reference of the dnngraph graph (`Graph.reference`) before it is timed.

    python benchmarks/bench_memory_bound.py                  # GPU: table, and $OUT/memory_bound.json
    python benchmarks/bench_memory_bound.py --only rmsnorm   # rows whose label contains a word
    python benchmarks/bench_memory_bound.py --only "max pool bwd" --no-compile --no-cudnn
    python benchmarks/bench_memory_bound.py --check-cpu      # anchors vs float64 at small shapes

A dnngraph build or an anchor that fails prints "n/a: <error>" in its cell and the run goes on.
The cuDNN frontend (`import cudnn`) comes from the environment or, failing that, from the wheel
carried in .whl/ (installed with pip --no-deps --no-index). torch.compile anchors are compiled once
per function (dynamic=False, so each shape is one static recompile) and skipped once the run has
spent DNNGRAPH_MEMBOUND_BUDGET_S seconds (default 200).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from common import copy_ceiling_tbs, median_ms, print_table, rel_error, write_json

BF16, F32 = torch.bfloat16, torch.float32
EPS, MOMENTUM = 1e-5, 0.1
TOLERANCE = 2e-2  # bf16 outputs land near 4e-3 of the float64 reference; flag anything past this
NORM_SHAPES = [(16384, 8192), (4096, 4096), (4096, 8192), (4096, 14336)]
BN_SHAPE, POOL_SHAPE, COLSUM_SHAPE = (32, 256, 56, 56), (32, 64, 112, 112), (16384, 8192)
POOL_BWD_SHAPE, CPU_POOL_BWD_SHAPE = (64, 64, 112, 112), (2, 8, 15, 13)  # ResNet-50's stem at batch 64
POOL_GEOMETRY = ([3, 3], [2, 2], [1, 1])  # window, stride, padding
CPU_NORM_SHAPES = [(64, 256), (33, 200)]
CPU_BN_SHAPE, CPU_POOL_SHAPE, CPU_COLSUM_SHAPE = (4, 16, 10, 10), (2, 8, 14, 14), (64, 200)
DEVICE = "cuda"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BYTES_MODEL = {
    "layernorm fwd": "read x, scale, bias; write y, mean, inv_variance (f32 [M,1])",
    "layernorm bwd": "read dy, x, scale, mean, inv_variance; write dx, dscale, dbias",
    "rmsnorm fwd": "read x, scale; write y, inv_variance (f32 [M,1])",
    "rmsnorm bwd": "read dy, x, scale, inv_variance; write dx, dscale",
    "softmax fwd": "read x; write y",
    "softmax bwd": "read dy, y; write dx",
    "add+rmsnorm fwd": "read x, residual, scale; write h = x + residual, y = rmsnorm(h) (inference)",
    "batchnorm fwd": "read x, scale, bias, running mean/var (f32); write y, mean, inv_variance, "
                     "next running mean/var (f32)",
    "batchnorm bwd": "read dy, x, scale, mean, inv_variance; write dx, dscale, dbias (f32)",
    "column sum": "read x; write sum over axis 0 (f32 [1,N])",
    "max-pool": "read x; write y [N,C,56,56]",
    "max-pool bwd (recompute)": "read dy [N,C,56,56], x; write dx",
    "max-pool bwd (indices)": "read dy, indices (int64) [N,C,56,56]; write dx (x is bound, not read)",
}


# --- torch anchors (module level: torch.compile caches per function) ---------------------------
def layernorm_fwd(x, w, b):
    return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, EPS)


def layernorm_bwd(dy, x, w, b, mean, rstd):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b,
                                                     [True, True, True])


def rmsnorm_fwd_fused(x, w):
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, EPS)


def rmsnorm_fwd_composite(x, w):
    xf = x.float()
    inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    return (xf * inv * w.float()).to(x.dtype), inv


def rmsnorm_bwd_fused(dy, x, w, rstd):
    return torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, w, [True, True])


def rmsnorm_bwd_composite(dy, x, w, rstd):
    xf, dyf = x.float(), dy.float()
    xhat = xf * rstd
    grad = dyf * w.float()
    dx = rstd * (grad - xhat * (grad * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)


def softmax_fwd(x):
    return torch.softmax(x, -1)


def softmax_bwd(dy, y):
    return torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)


def add_rmsnorm_eager(x, r, w):
    h = x + r
    return h, F.rms_norm(h, (h.shape[-1],), w, EPS)


def add_rmsnorm_composite(x, r, w):
    h = x + r
    hf = h.float()
    y = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + EPS) * w.float()
    return h, y.to(h.dtype)


def batchnorm_fwd(x, w, b, running_mean, running_var):
    """What a torch user runs: y, with the running statistics updated in place."""
    return F.batch_norm(x, running_mean, running_var, w, b, True, MOMENTUM, EPS)


def batchnorm_bwd_dispatch(dy, x, w, running_mean, running_var, save_mean, save_invstd, reserve):
    """torch's backend choice (cuDNN where eligible), fed by _batch_norm_with_update."""
    return torch.ops.aten.batch_norm_backward(dy, x, w, running_mean, running_var, save_mean,
                                              save_invstd, True, EPS, [True, True, True], reserve)


def batchnorm_bwd_native(dy, x, w, save_mean, save_invstd):
    return torch.ops.aten.native_batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd,
                                                     True, EPS, [True, True, True])


def column_sum(x):
    return x.sum(0, keepdim=True, dtype=torch.float32)


def max_pool(x):
    return F.max_pool2d(x, 3, 2, 1)


def max_pool_backward(dy, x, indices):
    window, stride, padding = POOL_GEOMETRY
    return torch.ops.aten.max_pool2d_with_indices_backward(dy, x, window, stride, padding, [1, 1], False,
                                                           indices)


# --- cases ------------------------------------------------------------------------------------
@dataclass
class Anchor:
    """A torch implementation: candidate functions (the first that runs is used), their
    arguments, and the output names of what they return (None: not compared)."""

    fns: tuple
    args: Callable[[], tuple]
    outs: tuple
    fallback_args: Optional[Callable[[], tuple]] = None  # arguments of the later candidates


@dataclass
class Case:
    family: str
    shape: str
    inputs: dict  # graph input name -> torch tensor (what every implementation reads)
    graph: Callable  # () -> (dg.Graph, {output name: dg.Tensor})
    eager: Anchor
    compiled: Optional[Anchor]
    cudnn: Optional[Callable] = None  # (CudnnFrontend) -> (run, {output name: torch tensor})
    notes: list = field(default_factory=list)
    unread: tuple = ()  # inputs the graph binds but its kernels never read (left out of the bytes)


def _rand(shape, device, scale=1.0, shift=0.0, dtype=BF16, channels_last=False):
    """Fresh normal values, scaled and shifted so means and variances are not the trivial 0, 1."""
    t = torch.randn(shape, device=device) * scale + shift
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last)
    return t.to(dtype)


def _new_graph(name):
    return dg.Graph(name=name, io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32)


def _declare(g, inputs):
    return {name: g.tensor_like(value, name) for name, value in inputs.items()}


def _outputs(**tensors):
    return {name: t.set_name(name).set_output(True) for name, t in tensors.items() if t is not None}


def case_layernorm_fwd(m, n, device):
    x, w, b = _rand((m, n), device, 2.0, 0.5), _rand((n,), device, 0.5, 1.0), _rand((n,), device, 0.5)
    inputs = {"x": x, "scale": w.view(1, n), "bias": b.view(1, n)}

    def graph():
        g = _new_graph("layernorm_fwd")
        t = _declare(g, inputs)
        y, mean, inv = g.layernorm(t["x"], t["scale"], t["bias"], epsilon=EPS)
        return g, _outputs(y=y, mean=mean, inv_variance=inv)
    anchor = Anchor((layernorm_fwd,), lambda: (x, w, b), ("y", "mean", "inv_variance"))
    return Case("layernorm fwd", f"{m}x{n}", inputs, graph, anchor, anchor,
                lambda fe: fe.layernorm_fwd(x, w, b))


def case_layernorm_bwd(m, n, device):
    x, w, b = _rand((m, n), device, 2.0, 0.5), _rand((n,), device, 0.5, 1.0), _rand((n,), device, 0.5)
    dy = _rand((m, n), device)
    _, mean, rstd = layernorm_fwd(x, w, b)  # the device's own statistics dtype (f32 on CUDA)
    inputs = {"dy": dy, "x": x, "scale": w.view(1, n), "mean": mean.float(), "inv_variance": rstd.float()}

    def graph():
        g = _new_graph("layernorm_bwd")
        t = _declare(g, inputs)
        dx, dscale, dbias = g.layernorm_backward(t["dy"], t["x"], t["scale"], t["mean"], t["inv_variance"])
        return g, _outputs(dx=dx, dscale=dscale, dbias=dbias)
    anchor = Anchor((layernorm_bwd,), lambda: (dy, x, w, b, mean, rstd), ("dx", "dscale", "dbias"))
    return Case("layernorm bwd", f"{m}x{n}", inputs, graph, anchor, anchor,
                lambda fe: fe.layernorm_bwd(dy, x, w, inputs["mean"], inputs["inv_variance"]))


def case_rmsnorm_fwd(m, n, device):
    x, w = _rand((m, n), device, 2.0, 0.5), _rand((n,), device, 0.5, 1.0)
    inputs = {"x": x, "scale": w.view(1, n)}

    def graph():
        g = _new_graph("rmsnorm_fwd")
        t = _declare(g, inputs)
        y, inv = g.rmsnorm(t["x"], t["scale"], None, epsilon=EPS)
        return g, _outputs(y=y, inv_variance=inv)
    outs = ("y", "inv_variance")
    return Case("rmsnorm fwd", f"{m}x{n}", inputs, graph,
                Anchor((rmsnorm_fwd_fused, rmsnorm_fwd_composite), lambda: (x, w), outs),
                Anchor((rmsnorm_fwd_composite,), lambda: (x, w), outs),
                lambda fe: fe.rmsnorm_fwd(x, w))


def case_rmsnorm_bwd(m, n, device):
    x, w, dy = _rand((m, n), device, 2.0, 0.5), _rand((n,), device, 0.5, 1.0), _rand((m, n), device)
    _, rstd = rmsnorm_fwd_composite(x, w)
    inputs = {"dy": dy, "x": x, "scale": w.view(1, n), "inv_variance": rstd}

    def graph():
        g = _new_graph("rmsnorm_bwd")
        t = _declare(g, inputs)
        dx, dscale, _ = g.rmsnorm_backward(t["dy"], t["x"], t["scale"], t["inv_variance"], has_dbias=False)
        return g, _outputs(dx=dx, dscale=dscale)
    outs = ("dx", "dscale")
    return Case("rmsnorm bwd", f"{m}x{n}", inputs, graph,
                Anchor((rmsnorm_bwd_fused, rmsnorm_bwd_composite), lambda: (dy, x, w, rstd), outs),
                Anchor((rmsnorm_bwd_composite,), lambda: (dy, x, w, rstd), outs),
                lambda fe: fe.rmsnorm_bwd(dy, x, w, rstd))


def case_softmax_fwd(m, n, device):
    x = _rand((m, n), device, 3.0, 0.5)
    inputs = {"x": x}

    def graph():
        g = _new_graph("softmax_fwd")
        return g, _outputs(y=g.softmax(_declare(g, inputs)["x"], axis=1))
    anchor = Anchor((softmax_fwd,), lambda: (x,), ("y",))
    return Case("softmax fwd", f"{m}x{n}", inputs, graph, anchor, anchor)


def case_softmax_bwd(m, n, device):
    y, dy = softmax_fwd(_rand((m, n), device, 3.0, 0.5)), _rand((m, n), device)
    inputs = {"dy": dy, "y": y}

    def graph():
        g = _new_graph("softmax_bwd")
        t = _declare(g, inputs)
        return g, _outputs(dx=g.softmax_backward(t["dy"], t["y"], axis=1))
    anchor = Anchor((softmax_bwd,), lambda: (dy, y), ("dx",))
    return Case("softmax bwd", f"{m}x{n}", inputs, graph, anchor, anchor)


def case_add_rmsnorm(m, n, device):
    x, r, w = _rand((m, n), device, 2.0, 0.5), _rand((m, n), device, 1.0, -0.25), _rand((n,), device, 0.5, 1.0)
    inputs = {"x": x, "residual": r, "scale": w.view(1, n)}

    def graph():
        g = _new_graph("add_rmsnorm")
        t = _declare(g, inputs)
        h = g.add(t["x"], t["residual"])
        y, _ = g.rmsnorm(h, t["scale"], None, epsilon=EPS, norm_forward_phase="inference")
        return g, _outputs(h=h, y=y)
    return Case("add+rmsnorm fwd", f"{m}x{n}", inputs, graph,
                Anchor((add_rmsnorm_eager,), lambda: (x, r, w), ("h", "y")),
                Anchor((add_rmsnorm_composite,), lambda: (x, r, w), ("h", "y")),
                lambda fe: fe.add_rmsnorm(x, r, w))


def _bn_params(c, device):
    scale, bias = _rand((1, c, 1, 1), device, 0.5, 1.0, F32), _rand((1, c, 1, 1), device, 0.5, 0.0, F32)
    running_mean = _rand((1, c, 1, 1), device, 0.2, 0.0, F32)
    running_var = torch.rand((1, c, 1, 1), device=device) + 0.5
    return scale, bias, running_mean, running_var


def _bn_input(shape, device):
    """NHWC bf16 with a per-channel mean and spread, so the batch statistics differ by channel."""
    c = shape[1]
    spread, offset = 0.5 + torch.rand(1, c, 1, 1, device=device), torch.randn(1, c, 1, 1, device=device)
    x = (torch.randn(shape, device=device) * spread + offset).contiguous(memory_format=torch.channels_last)
    return x.to(BF16)


def case_batchnorm_fwd(shape, device):
    x = _bn_input(shape, device)
    scale, bias, running_mean, running_var = _bn_params(shape[1], device)
    inputs = {"x": x, "scale": scale, "bias": bias, "in_running_mean": running_mean,
              "in_running_var": running_var}

    def graph():
        g = _new_graph("batchnorm_fwd")
        t = _declare(g, inputs)
        y, mean, inv, next_mean, next_var = g.batchnorm(
            t["x"], t["scale"], t["bias"], t["in_running_mean"], t["in_running_var"], epsilon=EPS,
            momentum=MOMENTUM)
        return g, _outputs(y=y, mean=mean, inv_variance=inv, next_running_mean=next_mean,
                           next_running_var=next_var)

    def args():  # running statistics of its own: the anchors update them in place
        return (x, scale.view(-1), bias.view(-1), running_mean.view(-1).clone(), running_var.view(-1).clone())
    anchor = Anchor((batchnorm_fwd,), args, ("y",))
    case = Case("batchnorm fwd", "x".join(map(str, shape)) + " NHWC", inputs, graph, anchor, anchor,
                lambda fe: fe.batchnorm_fwd(x, scale, bias, running_mean, running_var))
    case.notes.append("eager/compile: F.batch_norm(training=True), y checked (statistics stay internal)")
    return case


def case_batchnorm_bwd(shape, device):
    x, dy = _bn_input(shape, device), _rand(shape, device, channels_last=True)
    scale, bias, running_mean, running_var = _bn_params(shape[1], device)
    w = scale.view(-1)
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
        x, w, bias.view(-1), running_mean.view(-1).clone(), running_var.view(-1).clone(), True, MOMENTUM, EPS)
    c = shape[1]
    inputs = {"dy": dy, "x": x, "scale": scale, "mean": save_mean.view(1, c, 1, 1),
              "inv_variance": save_invstd.view(1, c, 1, 1)}

    def graph():
        g = _new_graph("batchnorm_bwd")
        t = _declare(g, inputs)
        dx, dscale, dbias = g.batchnorm_backward(t["dy"], t["x"], t["scale"], t["mean"], t["inv_variance"])
        return g, _outputs(dx=dx, dscale=dscale.set_data_type(dg.float32),
                           dbias=dbias.set_data_type(dg.float32))

    notes = []

    def dispatch_args():  # torch's forward (backend of its choice) leaves the reserve its backward reads
        rm, rv = running_mean.view(-1).clone(), running_var.view(-1).clone()
        _, mean, invstd, reserve = torch.ops.aten._batch_norm_with_update(x, w, bias.view(-1), rm, rv, MOMENTUM, EPS)
        notes.append(f"eager: aten.batch_norm_backward after _batch_norm_with_update (reserve of "
                     f"{reserve.numel()} bytes: {'cuDNN' if reserve.numel() else 'native'} backend)")
        return dy, x, w, rm, rv, mean, invstd, reserve
    outs = ("dx", "dscale", "dbias")
    eager = Anchor((batchnorm_bwd_dispatch, batchnorm_bwd_native), dispatch_args, outs,
                   fallback_args=lambda: (dy, x, w, save_mean, save_invstd))
    return Case("batchnorm bwd", "x".join(map(str, shape)) + " NHWC", inputs, graph, eager,
                Anchor((batchnorm_bwd_native,), lambda: (dy, x, w, save_mean, save_invstd), outs),
                lambda fe: fe.batchnorm_bwd(dy, x, scale, inputs["mean"], inputs["inv_variance"]), notes)


def case_column_sum(m, n, device):
    x = _rand((m, n), device, 1.0, 0.25)
    inputs = {"x": x}

    def graph():
        g = _new_graph("column_sum")
        y = g.reduction(_declare(g, inputs)["x"], "sum", [0]).set_data_type(dg.float32)
        return g, _outputs(y=y)
    anchor = Anchor((column_sum,), lambda: (x,), ("y",))
    return Case("column sum", f"{m}x{n}", inputs, graph, anchor, anchor, lambda fe: fe.column_sum(x))


def case_max_pool(shape, device):
    x = _rand(shape, device, 1.0, 0.1, channels_last=True)
    inputs = {"x": x}

    def graph():
        g = _new_graph("max_pool")
        return g, _outputs(y=g.pooling(_declare(g, inputs)["x"], "max", [3, 3], [2, 2], [1, 1]))
    anchor = Anchor((max_pool,), lambda: (x,), ("y",))
    return Case("max-pool", "x".join(map(str, shape)) + " NHWC", inputs, graph, anchor, anchor)


def max_pool_backward_inputs(shape, device) -> dict:
    """x, dy and the int64 indices of x's max pool (torch's), all channels-last."""
    x = _rand(shape, device, 1.0, 0.1, channels_last=True)
    _, indices = F.max_pool2d(x, *POOL_GEOMETRY, return_indices=True)
    dy = _rand(tuple(indices.shape), device, 1.0, 0.1, channels_last=True)
    return {"x": x, "dy": dy, "indices": indices.contiguous(memory_format=torch.channels_last)}


def case_max_pool_backward(shape, device, with_indices: bool):
    """The max-pool backward, its argmax recomputed from x or routed by the forward's indices;
    the anchor reads the indices either way."""
    inputs = max_pool_backward_inputs(shape, device)
    declared = inputs if with_indices else {k: v for k, v in inputs.items() if k != "indices"}

    def graph():
        g = _new_graph("max_pool_bwd")
        t = _declare(g, declared)
        return g, _outputs(dx=g.pooling_backward(t["dy"], t["x"], "max", *POOL_GEOMETRY, indices=t.get("indices")))
    anchor = Anchor((max_pool_backward,), lambda: (inputs["dy"], inputs["x"], inputs["indices"]), ("dx",))
    family = f"max-pool bwd ({'indices' if with_indices else 'recompute'})"
    return Case(family, "x".join(map(str, shape)) + " NHWC", declared, graph, anchor, anchor,
                unread=("x",) if with_indices else ())


def case_factories(check_cpu: bool):
    """(label, factory(device)) in table order; inputs are made only when a row runs."""
    norm_shapes = CPU_NORM_SHAPES if check_cpu else NORM_SHAPES
    bn, pool, colsum = (CPU_BN_SHAPE, CPU_POOL_SHAPE, CPU_COLSUM_SHAPE) if check_cpu else \
        (BN_SHAPE, POOL_SHAPE, COLSUM_SHAPE)
    rows = []
    for family, make in (("layernorm fwd", case_layernorm_fwd), ("layernorm bwd", case_layernorm_bwd),
                         ("rmsnorm fwd", case_rmsnorm_fwd), ("rmsnorm bwd", case_rmsnorm_bwd),
                         ("softmax fwd", case_softmax_fwd), ("softmax bwd", case_softmax_bwd),
                         ("add+rmsnorm fwd", case_add_rmsnorm)):
        rows += [(f"{family} {m}x{n}", lambda d, make=make, m=m, n=n: make(m, n, d)) for m, n in norm_shapes]
    rows.append((f"batchnorm fwd {'x'.join(map(str, bn))} NHWC", lambda d: case_batchnorm_fwd(bn, d)))
    rows.append((f"batchnorm bwd {'x'.join(map(str, bn))} NHWC", lambda d: case_batchnorm_bwd(bn, d)))
    rows.append((f"column sum {colsum[0]}x{colsum[1]}", lambda d: case_column_sum(*colsum, d)))
    rows.append((f"max-pool {'x'.join(map(str, pool))} NHWC", lambda d: case_max_pool(pool, d)))
    pool_bwd = CPU_POOL_BWD_SHAPE if check_cpu else POOL_BWD_SHAPE
    for path, with_indices in (("recompute", False), ("indices", True)):
        rows.append((f"max pool bwd {'x'.join(map(str, pool_bwd))} NHWC, {path}",
                     lambda d, w=with_indices: case_max_pool_backward(pool_bwd, d, w)))
    return rows


# --- the cuDNN frontend -------------------------------------------------------------------------
def _torch_libcudnn_dir() -> Optional[str]:
    """The folder of the libcudnn that torch loaded (so the frontend binds the same library)."""
    torch.backends.cudnn.version()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcudnn.so" in path:
                    return os.path.dirname(path)
    except OSError:
        pass
    return None


def import_cudnn_frontend():
    """(module, note): `import cudnn`; when it is missing, the carried wheel is installed first
    (pip --no-index --no-deps --target, as the device README does for carried wheels)."""
    libdir = _torch_libcudnn_dir()
    if libdir:  # cudnn/__init__ searches LD_LIBRARY_PATH first when it dlopens libcudnn
        os.environ["LD_LIBRARY_PATH"] = libdir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    where = f"libcudnn from {libdir or 'the default search'}"
    try:
        import cudnn
        return cudnn, f"from the environment, {where}"
    except ImportError as error:
        missing = error
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", f"nvidia_cudnn_frontend-*-{tag}-*.whl")))
    if not wheels:
        return None, f"not importable ({missing}) and no {tag} wheel in .whl/"
    target = os.path.join(tempfile.gettempdir(), "dnngraph-cudnn-frontend")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                             "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, wheels[-1]],
                            capture_output=True, text=True)
    if result.returncode:
        return None, f"pip install {os.path.basename(wheels[-1])} failed: {result.stderr.strip()[-300:]}"
    sys.path.insert(0, target)
    importlib.invalidate_caches()
    import cudnn
    return cudnn, f"installed from {os.path.basename(wheels[-1])}, {where}"


def _poison(shape, dtype, device="cuda", like=None):
    t = torch.empty_like(like, dtype=dtype) if like is not None else torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan"))


class CudnnFrontend:
    """Graphs of the cuDNN frontend Python API (cudnn.pygraph), one per row.

    Each builder returns (run, outputs): run() executes the built plan on the bound buffers;
    outputs are NaN-poisoned torch tensors named like the dnngraph outputs. Norm tensors are 4-D
    ([M, N, 1, 1] for a row of N features), as the frontend's samples declare them."""

    def __init__(self, module):
        self.fe = module
        self.handle = module.create_handle()
        module.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.types = {BF16: module.data_type.BFLOAT16, F32: module.data_type.FLOAT}

    def _graph(self):
        fe = self.fe
        return fe.pygraph(io_data_type=fe.data_type.BFLOAT16, intermediate_data_type=fe.data_type.FLOAT,
                          compute_data_type=fe.data_type.FLOAT, handle=self.handle)

    def _scalar(self, g, value, name):
        host = torch.full((1, 1, 1, 1), value, dtype=F32)  # host tensor: passed by value
        return g.tensor_like(host, name=name), host

    def _finish(self, g, pack):
        g.build([self.fe.heur_mode.A, self.fe.heur_mode.FALLBACK])
        workspace = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
        handle = self.handle
        return lambda: g.execute(pack, workspace, handle=handle)

    def _out(self, tensor, buffer):
        tensor.set_output(True).set_data_type(self.types[buffer.dtype])
        return tensor

    def layernorm_fwd(self, x, w, b):
        m, n = x.shape
        g = self._graph()
        x4, w4, b4 = x.view(m, n, 1, 1), w.view(1, n, 1, 1), b.view(1, n, 1, 1)
        X, S, B = (g.tensor_like(t, name=k) for k, t in (("x", x4), ("scale", w4), ("bias", b4)))
        E, eps = self._scalar(g, EPS, "epsilon")
        Y, MEAN, INV = g.layernorm(name="ln", norm_forward_phase=self.fe.norm_forward_phase.TRAINING,
                                   input=X, scale=S, bias=B, epsilon=E)
        outs = {"y": _poison(None, BF16, like=x), "mean": _poison((m, 1), F32), "inv_variance": _poison((m, 1), F32)}
        pack = {X: x4, S: w4, B: b4, E: eps, self._out(Y, outs["y"]): outs["y"].view(m, n, 1, 1),
                self._out(MEAN, outs["mean"]): outs["mean"].view(m, 1, 1, 1),
                self._out(INV, outs["inv_variance"]): outs["inv_variance"].view(m, 1, 1, 1)}
        return self._finish(g, pack), outs

    def layernorm_bwd(self, dy, x, w, mean, inv):
        m, n = x.shape
        g = self._graph()
        views = {"dy": dy.view(m, n, 1, 1), "x": x.view(m, n, 1, 1), "scale": w.view(1, n, 1, 1),
                 "mean": mean.view(m, 1, 1, 1), "inv_variance": inv.view(m, 1, 1, 1)}
        T = {k: g.tensor_like(v, name=k) for k, v in views.items()}
        DX, DS, DB = g.layernorm_backward(name="dln", grad=T["dy"], input=T["x"], scale=T["scale"],
                                          mean=T["mean"], inv_variance=T["inv_variance"])
        outs = {"dx": _poison(None, BF16, like=x), "dscale": _poison((1, n), BF16), "dbias": _poison((1, n), BF16)}
        pack = {T[k]: v for k, v in views.items()}
        pack.update({self._out(DX, outs["dx"]): outs["dx"].view(m, n, 1, 1),
                     self._out(DS, outs["dscale"]): outs["dscale"].view(1, n, 1, 1),
                     self._out(DB, outs["dbias"]): outs["dbias"].view(1, n, 1, 1)})
        return self._finish(g, pack), outs

    def rmsnorm_fwd(self, x, w):
        m, n = x.shape
        g = self._graph()
        x4, w4 = x.view(m, n, 1, 1), w.view(1, n, 1, 1)
        X, S = g.tensor_like(x4, name="x"), g.tensor_like(w4, name="scale")
        E, eps = self._scalar(g, EPS, "epsilon")
        Y, INV = g.rmsnorm(name="rms", norm_forward_phase=self.fe.norm_forward_phase.TRAINING,
                           input=X, scale=S, bias=None, epsilon=E)
        outs = {"y": _poison(None, BF16, like=x), "inv_variance": _poison((m, 1), F32)}
        pack = {X: x4, S: w4, E: eps, self._out(Y, outs["y"]): outs["y"].view(m, n, 1, 1),
                self._out(INV, outs["inv_variance"]): outs["inv_variance"].view(m, 1, 1, 1)}
        return self._finish(g, pack), outs

    def rmsnorm_bwd(self, dy, x, w, inv):
        m, n = x.shape
        g = self._graph()
        views = {"dy": dy.view(m, n, 1, 1), "x": x.view(m, n, 1, 1), "scale": w.view(1, n, 1, 1),
                 "inv_variance": inv.view(m, 1, 1, 1)}
        T = {k: g.tensor_like(v, name=k) for k, v in views.items()}
        DX, DS, _ = g.rmsnorm_backward(name="drms", grad=T["dy"], input=T["x"], scale=T["scale"],
                                       inv_variance=T["inv_variance"], has_dbias=False)
        outs = {"dx": _poison(None, BF16, like=x), "dscale": _poison((1, n), BF16)}
        pack = {T[k]: v for k, v in views.items()}
        pack.update({self._out(DX, outs["dx"]): outs["dx"].view(m, n, 1, 1),
                     self._out(DS, outs["dscale"]): outs["dscale"].view(1, n, 1, 1)})
        return self._finish(g, pack), outs

    def add_rmsnorm(self, x, r, w):
        m, n = x.shape
        g = self._graph()
        x4, r4, w4 = x.view(m, n, 1, 1), r.view(m, n, 1, 1), w.view(1, n, 1, 1)
        X, R, S = (g.tensor_like(t, name=k) for k, t in (("x", x4), ("residual", r4), ("scale", w4)))
        E, eps = self._scalar(g, EPS, "epsilon")
        H = g.add(X, R, name="add")
        Y, _ = g.rmsnorm(name="rms", norm_forward_phase=self.fe.norm_forward_phase.INFERENCE,
                         input=H, scale=S, bias=None, epsilon=E)
        outs = {"h": _poison(None, BF16, like=x), "y": _poison(None, BF16, like=x)}
        pack = {X: x4, R: r4, S: w4, E: eps, self._out(H, outs["h"]): outs["h"].view(m, n, 1, 1),
                self._out(Y, outs["y"]): outs["y"].view(m, n, 1, 1)}
        return self._finish(g, pack), outs

    def batchnorm_fwd(self, x, scale, bias, running_mean, running_var):
        g = self._graph()
        params = {"scale": scale, "bias": bias, "in_running_mean": running_mean, "in_running_var": running_var}
        X = g.tensor_like(x, name="x")
        T = {k: g.tensor_like(v, name=k) for k, v in params.items()}
        E, eps = self._scalar(g, EPS, "epsilon")
        MOM, momentum = self._scalar(g, MOMENTUM, "momentum")
        Y, MEAN, INV, NEXT_MEAN, NEXT_VAR = g.batchnorm(
            name="bn", input=X, scale=T["scale"], bias=T["bias"], in_running_mean=T["in_running_mean"],
            in_running_var=T["in_running_var"], epsilon=E, momentum=MOM)
        outs = {"y": _poison(None, BF16, like=x)}
        outs.update({k: _poison(None, F32, like=scale) for k in
                     ("mean", "inv_variance", "next_running_mean", "next_running_var")})
        self._out(Y, outs["y"]).set_stride(list(x.stride()))
        pack = {X: x, E: eps, MOM: momentum, Y: outs["y"], **{T[k]: v for k, v in params.items()}}
        for name, tensor in (("mean", MEAN), ("inv_variance", INV), ("next_running_mean", NEXT_MEAN),
                             ("next_running_var", NEXT_VAR)):
            pack[self._out(tensor, outs[name])] = outs[name]
        return self._finish(g, pack), outs

    def batchnorm_bwd(self, dy, x, scale, mean, inv):
        g = self._graph()
        views = {"dy": dy, "x": x, "scale": scale, "mean": mean, "inv_variance": inv}
        T = {k: g.tensor_like(v, name=k) for k, v in views.items()}
        DX, DS, DB = g.batchnorm_backward(name="dbn", grad=T["dy"], input=T["x"], scale=T["scale"],
                                          mean=T["mean"], inv_variance=T["inv_variance"])
        outs = {"dx": _poison(None, BF16, like=x), "dscale": _poison(None, F32, like=scale),
                "dbias": _poison(None, F32, like=scale)}
        self._out(DX, outs["dx"]).set_stride(list(x.stride()))
        pack = {T[k]: v for k, v in views.items()}
        pack.update({DX: outs["dx"], self._out(DS, outs["dscale"]): outs["dscale"],
                     self._out(DB, outs["dbias"]): outs["dbias"]})
        return self._finish(g, pack), outs

    def column_sum(self, x):
        m, n = x.shape
        g = self._graph()
        x3 = x.view(1, m, n)
        X = g.tensor_like(x3, name="x")
        Y = g.reduction(X, mode=self.fe.reduction_mode.ADD, name="colsum")
        outs = {"y": _poison((1, n), F32)}
        self._out(Y, outs["y"]).set_dim([1, 1, n]).set_stride([n, n, 1])
        return self._finish(g, {X: x3, Y: outs["y"].view(1, 1, n)}), outs


# --- measuring ----------------------------------------------------------------------------------
def _short(error: BaseException, width: int = 90) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= width else text[:width - 3] + "..."


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn) -> float:
    """Median ms; every row moves >= 64 MB, so 100 ms of repeats gives hundreds of samples."""
    return median_ms(fn, warmup=10, rep=100)


def _host_us(fn, calls: int = 30) -> float:
    """Host time per call with the launch queue not full: were it near the device time, the
    device would idle between calls and the timings would include host time."""
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _sync()
    return elapsed / calls * 1e6


def _errors(outputs: dict, reference: dict) -> dict:
    return {name: rel_error(out, reference[name]) for name, out in outputs.items()
            if out is not None and name in reference}


def _result(errors: dict, ms: Optional[float], nbytes: int, **extra) -> dict:
    worst = max(errors.values(), default=float("nan"))
    result = {"status": "ok", "errors": errors, "max_error": worst,
              "checked": bool(errors) and worst <= TOLERANCE}
    if ms is not None:
        result.update(us=ms * 1e3, tbs=nbytes / ms / 1e9)
    return {**result, **extra}


def _failed(error: BaseException, status: str = "n/a") -> dict:
    return {"status": status, "error": _short(error, 400)}


def _poisoned_like(handle, device):
    return torch.empty_strided(handle.dim, handle.stride, dtype=handle.data_type.torch_dtype,
                               device=device).fill_(float("nan"))


def reference_outputs(case: Case) -> tuple:
    """(name -> tensor, source): the float64 reference of the dnngraph graph, else eager."""
    try:
        g, outputs = case.graph()
        reference = g.reference(case.inputs)
        return {name: reference[t.name] for name, t in outputs.items()}, "float64 Graph.reference"
    except Exception as error:  # noqa: BLE001 - fall back to the eager outputs
        outs = _call_anchor(case.eager)[1]
        return {k: v for k, v in outs.items()}, f"eager ({_short(error)})"


def minimal_bytes(case: Case, reference: dict) -> int:
    read = sum(t.numel() * t.element_size() for name, t in case.inputs.items() if name not in case.unread)
    try:
        _, outputs = case.graph()
        written = sum(math.prod(t.dim) * t.data_type.itemsize for t in outputs.values())
    except Exception:  # noqa: BLE001
        written = sum(t.numel() * 2 for t in reference.values())
    return read + written


def measure_dnngraph(case: Case, reference: dict, nbytes: int, timed: bool) -> dict:
    try:
        g, outputs = case.graph()
        start = time.perf_counter()
        g.build()
        build_s = time.perf_counter() - start
        device = next(iter(case.inputs.values())).device
        buffers = {name: _poisoned_like(t, device) for name, t in outputs.items()}
        bindings = {**case.inputs, **buffers}
        g.execute(bindings)
        _sync()
        errors = _errors(buffers, reference)
        run = lambda: g.execute(bindings)  # noqa: E731
        ms, host = (_time(run), _host_us(run)) if timed else (None, None)
        launches = getattr(g.plan, "launches", [])
        return _result(errors, ms, nbytes, host_us=host, build_s=build_s, kernels=len(launches),
                       configs=[getattr(launch, "config_text", "") for launch in launches])
    except Exception as error:  # noqa: BLE001 - kernels for these families are in progress
        return _failed(error)


def _call_anchor(anchor: Anchor, wrap=None):
    """(fn, outputs by name, implementation name, args): the first candidate that runs; the name
    says why earlier candidates were passed over."""
    passed_over = []
    for position, fn in enumerate(anchor.fns):
        callable_ = wrap(fn) if wrap else fn
        try:
            args = (anchor.fallback_args or anchor.args)() if position else anchor.args()
            result = callable_(*args)
        except Exception as error:  # noqa: BLE001 - e.g. a fused op this torch lacks
            passed_over.append((fn.__name__, error))
            continue
        result = result if isinstance(result, (tuple, list)) else (result,)
        outs = {name: value for name, value in zip(anchor.outs, result) if name}
        name = fn.__name__ + "".join(f" (not {n}: {_short(e, 120)})" for n, e in passed_over)
        return callable_, outs, name, args
    raise passed_over[-1][1]


_COMPILED: dict = {}


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def measure_anchor(anchor: Anchor, reference: dict, nbytes: int, timed: bool, compile_: bool) -> dict:
    try:
        start = time.perf_counter()
        fn, outs, name, args = _call_anchor(anchor, _compiled if compile_ else None)
        _sync()
        first_s = time.perf_counter() - start
        errors = _errors(outs, reference)
        ms, host = (_time(lambda: fn(*args)), _host_us(lambda: fn(*args))) if timed else (None, None)
        return _result(errors, ms, nbytes, host_us=host, impl=name, first_call_s=first_s)
    except Exception as error:  # noqa: BLE001
        return _failed(error)


def measure_cudnn(case: Case, frontend, reference: dict, nbytes: int) -> dict:
    if case.cudnn is None:
        return {"status": "-", "error": "no cuDNN frontend equivalent"}
    if frontend is None:
        return {"status": "n/a", "error": "cuDNN frontend not available"}
    try:
        start = time.perf_counter()
        run, outs = case.cudnn(frontend)
        build_s = time.perf_counter() - start
        run()
        _sync()
        errors = _errors(outs, reference)
        return _result(errors, _time(run), nbytes, host_us=_host_us(run), build_s=build_s)
    except Exception as error:  # noqa: BLE001 - graph not supported by this cuDNN, API change, ...
        return _failed(error)


def run_row(label, make, device, frontend, deadline, use_compile, timed=True) -> dict:
    case = make(device)
    reference, source = reference_outputs(case)
    nbytes = minimal_bytes(case, reference)
    row = {"label": label, "family": case.family, "shape": case.shape, "bytes": nbytes,
           "bytes_model": BYTES_MODEL[case.family], "reference": source, "notes": case.notes}
    # anchors first: a dnngraph kernel that faults the context then still leaves them measured
    row["eager"] = measure_anchor(case.eager, reference, nbytes, timed, compile_=False)
    if not use_compile or case.compiled is None:
        row["compile"] = {"status": "-", "error": "not requested"}
    elif time.perf_counter() > deadline:
        row["compile"] = {"status": "skipped", "error": "time budget spent"}
    else:
        row["compile"] = measure_anchor(case.compiled, reference, nbytes, timed, compile_=True)
    row["cudnn"] = measure_cudnn(case, frontend, reference, nbytes) if timed else {"status": "-"}
    row["dnngraph"] = measure_dnngraph(case, reference, nbytes, timed)
    return row


# --- reporting ----------------------------------------------------------------------------------
def _tbs(result) -> str:
    if result["status"] == "ok":
        return f"{result['tbs']:.2f}" + ("" if result["checked"] else " (!)")
    return "-" if result["status"] == "-" else result["status"]


def _ratio(anchor, ours) -> str:
    if anchor["status"] != "ok" or ours["status"] != "ok":
        return "-"
    return f"{anchor['us'] / ours['us']:.2f}x"


def _err(result) -> str:
    return f"{result['max_error']:.0e}" if result["status"] == "ok" else "-"


def table_rows(rows, ceiling):
    table = []
    for row in rows:
        ours = row["dnngraph"]
        if ours["status"] == "ok":
            mine = [f"{ours['us']:.0f}", _tbs(ours), f"{ours['tbs'] / ceiling:.0%}"]
        else:
            mine = [f"n/a: {ours['error'][:70]}", "-", "-"]
        table.append([row["label"], f"{row['bytes'] / 1e6:.0f}", *mine, _tbs(row["eager"]),
                      _tbs(row["compile"]), _tbs(row["cudnn"]), _ratio(row["eager"], ours),
                      _ratio(row["compile"], ours), _ratio(row["cudnn"], ours),
                      "/".join(_err(row[k]) for k in ("dnngraph", "eager", "compile", "cudnn")),
                      ours.get("kernels", "-")])
    return table


def anchor_rows(rows):
    """Per family, what each anchor ran (from its first measured row) and the row notes."""
    families = {}
    for row in rows:
        entry = families.setdefault(row["family"], {"eager": "-", "compile": "-", "notes": []})
        for impl in ("eager", "compile"):
            if entry[impl] == "-" and row[impl]["status"] == "ok":
                entry[impl] = row[impl]["impl"]
        entry["notes"] += [n for n in row["notes"] if n not in entry["notes"]]
    return [[family, e["eager"], e["compile"], "; ".join(e["notes"])] for family, e in families.items()]


def failure_notes(rows):
    """One line per (implementation, reason): the rows it applies to."""
    reasons = {}
    for row in rows:
        for impl in ("dnngraph", "eager", "compile", "cudnn"):
            result = row[impl]
            if result["status"] in ("n/a", "skipped"):
                reason = result["error"]
            elif result["status"] == "ok" and not result["checked"]:
                reason = "errors vs reference " + ", ".join(f"{k} {v:.1e}" for k, v in result["errors"].items())
            elif result["status"] == "ok" and (result.get("host_us") or 0) > result.get("us", math.inf) + 60:
                # do_bench clears the L2 (a ~90 us memset) before each call: host time past the
                # call's device time plus that slack leaves the device idle inside the timed span
                reason = "host time per call exceeds the device time + 60 us: the timing may hold host time"
            else:
                continue
            reasons.setdefault((impl, reason), []).append(row["label"])
    return [f"- {impl}: {reason} [{'; '.join(labels)}]" for (impl, reason), labels in reasons.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated words; run rows whose label has one")
    parser.add_argument("--check-cpu", action="store_true", help="small shapes on CPU, no timing")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchors")
    parser.add_argument("--no-cudnn", action="store_true", help="skip the cuDNN frontend anchors")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.check_cpu:
        return check_cpu(args)
    started = time.perf_counter()
    deadline = started + float(os.environ.get("DNNGRAPH_MEMBOUND_BUDGET_S", "200"))
    for knob in ("recompile_limit", "cache_size_limit"):  # one static compile per shape and function
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 16))
    ceiling = copy_ceiling_tbs(16384 * 8192)  # also brings torch's CUDA context up before cuDNN's
    frontend, fe_note = None, "skipped (--no-cudnn)"
    if not args.no_cudnn:
        try:
            module, fe_note = import_cudnn_frontend()
            if module is not None:
                frontend = CudnnFrontend(module)
                fe_note = f"cudnn frontend {module.__version__}, backend {module.backend_version()}; {fe_note}"
        except Exception as error:  # noqa: BLE001
            fe_note = f"unavailable: {_short(error, 300)}"
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "torch_cudnn": torch.backends.cudnn.version(),
              "cudnn_frontend": fe_note, "copy_ceiling_tbs": ceiling, "tolerance": TOLERANCE}
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    rows = []
    for label, make in case_factories(check_cpu=False):
        if words and not any(w in label for w in words):
            continue
        try:
            rows.append(run_row(label, make, DEVICE, frontend, deadline, not args.no_compile))
        except Exception as error:  # noqa: BLE001 - inputs or reference of the row failed
            failed = _failed(error)
            rows.append({"label": label, "family": label, "bytes": 0, "notes": [],
                         **{impl: failed for impl in ("dnngraph", "eager", "compile", "cudnn")}})
        print(f"[{time.perf_counter() - started:5.0f} s] {label}: " + ", ".join(
            f"{k} {_tbs(rows[-1][k])}" for k in ("dnngraph", "eager", "compile", "cudnn")), flush=True)
        header["seconds"] = time.perf_counter() - started
        write_json("memory_bound.json", {"header": header, "rows": rows})  # kept if a later row dies
        torch.cuda.empty_cache()
    header["seconds"] = time.perf_counter() - started
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}, "
          f"cuDNN (torch) {header['torch_cudnn']}")
    print(f"cuDNN frontend: {fe_note}")
    print(f"copy ceiling (16384x8192 bf16, read + write): {ceiling:.2f} TB/s; run took {header['seconds']:.0f} s")
    print_table("Bytes model (minimal: each input read once, each output written once)",
                ["family", "bytes"], [[k, v] for k, v in BYTES_MODEL.items()])
    print_table("Memory-bound families, bf16 (TB/s over minimal bytes; ratios = anchor time / dnngraph time)",
                ["row", "MB", "dnngraph us", "dnngraph TB/s", "of copy", "eager TB/s", "compile TB/s",
                 "cuDNN FE TB/s", "vs eager", "vs compile", "vs cuDNN", "err dg/eager/compile/cuDNN",
                 "kernels"], table_rows(rows, ceiling))
    print_table("Anchors (torch functions timed; torch.compile(fn, dynamic=False), default mode)",
                ["family", "eager", "torch.compile of", "notes"], anchor_rows(rows))
    notes = failure_notes(rows)
    if notes:
        print("\nNot measured or not matching the float64 reference (tolerance "
              f"{TOLERANCE:g}; (!) in the table):\n" + "\n".join(notes))
    path = write_json("memory_bound.json", {"header": header, "rows": rows})
    if path:
        print(f"\nresults: {path}")
    return rows


def check_cpu(args):
    """Eager and compiled anchors (and dnngraph where it builds) against float64, small shapes."""
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    rows, failures = [], 0
    for label, make in case_factories(check_cpu=True):
        if words and not any(w in label for w in words):
            continue
        row = run_row(label, make, "cpu", None, float("inf"), not args.no_compile, timed=False)
        rows.append(row)
        cells = []
        for impl in ("dnngraph", "eager", "compile"):
            result = row[impl]
            if result["status"] == "ok":
                worst = max(result["errors"].values(), default=float("nan"))
                cells.append(f"{worst:.1e} {result.get('impl', '')}".strip())
                failures += impl != "dnngraph" and not result["checked"]
            else:
                cells.append(f"{result['status']}: {result.get('error', '')[:60]}")
                failures += impl != "dnngraph" and result["status"] == "n/a"
        print(f"{label}: " + " | ".join(cells), flush=True)
    print_table("CPU check: max relative error vs float64 Graph.reference",
                ["row", "reference", "dnngraph", "eager", "compile"],
                [[r["label"], r["reference"][:40]] + [_err(r[k]) if r[k]["status"] == "ok" else r[k]["status"]
                                                     for k in ("dnngraph", "eager", "compile")] for r in rows])
    print(f"\n{failures} anchor result(s) missing or past tolerance {TOLERANCE:g}")
    if failures:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
