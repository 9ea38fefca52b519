"""Time pooling kernels config by config at the benchmark shapes (how heuristics/pooling.py is to
be calibrated), against torch eager (and torch.compile with --compile).

    python benchmarks/sweep_pooling.py [--cases WORDS] [--budget S] [--workers N] [--compile]
    python benchmarks/sweep_pooling.py --check-cpu     # small shapes in the interpreter, no timing

Cases: max and average pooling 3x3 stride 2 padding 1, bf16, forward at 32x64x112x112 and
backward at ResNet-50's 64x64x112x112 (from the forward's int64 indices, by argmax recompute, and
the average's), NHWC and NCHW, and the per-element gather that owned blocks replaced (the
before). Each case times the model's ranked configs plus a grid of tiles (heuristics.pooling.rank
is replaced in this process for the build of each config), each checked
against torch's float32 result first. Every kernel is compiled first in parallel worker
processes (Triton's disk cache keeps the binaries), then timed one by one. Prints one line per
(case, config): model rank (- where the model would not list it), tile, model microseconds,
measured microseconds, TB/s over the minimal bytes (each input read once, each output written
once), the share of the copy ceiling and the speed-up over torch eager; writes
pooling_sweep.json to $OUT.
"""
import argparse
import contextlib
import multiprocessing
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import dnngraph as dg  # noqa: E402  (first: on a CPU-only machine it selects Triton's interpreter)
from dnngraph.backends.triton.heuristics import pooling as heuristics  # noqa: E402
from dnngraph.runtime import plan_cache  # noqa: E402
from dnngraph.target import target_of  # noqa: E402

BF16 = torch.bfloat16
GEOMETRY = ([3, 3], [2, 2], [1, 1])  # window, stride, padding
FORWARD_SHAPE, BACKWARD_SHAPE = (32, 64, 112, 112), (64, 64, 112, 112)
CPU_FORWARD_SHAPE, CPU_BACKWARD_SHAPE = (2, 8, 14, 14), (2, 8, 15, 13)
CASES = {  # label -> (mode, direction, layout); direction: forward, indexed (backward) or backward
    "max fwd nhwc": ("max", "forward", "nhwc"),
    "max fwd nchw": ("max", "forward", "nchw"),
    "avg fwd nhwc": ("avg_include_pad", "forward", "nhwc"),
    "max bwd indices nhwc": ("max", "indexed", "nhwc"),
    "max bwd recompute nhwc": ("max", "backward", "nhwc"),
    # the gather per dx element the owned blocks replaced, at the model's config only: the before
    "max bwd recompute nhwc per-element": ("max", "backward", "nhwc"),
    "max bwd indices nhwc per-element": ("max", "indexed", "nhwc"),
    "max bwd recompute nchw": ("max", "backward", "nchw"),
    "avg bwd nhwc": ("avg_include_pad", "backward", "nhwc"),
    "avg fwd nchw": ("avg_include_pad", "forward", "nchw"),
    # issue 30's before, at the model's tiles: a load per tap along NCHW's strided width, and each
    # block recomputing every covering window's argmax
    "max fwd nchw before": ("max", "forward", "nchw"),
    "max bwd recompute nhwc before": ("max", "backward", "nhwc"),
    "max bwd recompute nchw before": ("max", "backward", "nchw"),
}
OWNED_BLOCK = heuristics.owned_block
ROW_SEGMENT_STRIDE, SHARED_ARGMAX_AXIS = heuristics.row_segment_stride, heuristics.shared_argmax_axis
# Extra tiles (elements, warps) timed besides the model's ranked ones, at its column width and at
# half of it: whether larger tiles (more window reuse in L1) or more warps pay.
GRID_TILES = ((2048, 4), (4096, 8), (8192, 8), (8192, 16))
RANK_OF_MODEL = heuristics.rank


def in_layout(tensor, layout):
    return tensor.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else tensor.contiguous()


def inputs_of(label, device):
    """x, dy and torch's indices of one case, in its layout."""
    mode, direction, layout = CASES[label]
    cpu = device == "cpu"
    shape = (CPU_FORWARD_SHAPE if cpu else FORWARD_SHAPE) if direction == "forward" else \
        (CPU_BACKWARD_SHAPE if cpu else BACKWARD_SHAPE)
    gen = torch.Generator(device=device).manual_seed(0)
    x = in_layout(torch.randn(shape, device=device, generator=gen).to(BF16), layout)
    y, indices = F.max_pool2d(x.float(), *GEOMETRY, return_indices=True)
    dy = in_layout(torch.randn(y.shape, device=device, generator=gen).to(BF16), layout)
    return dict(x=x, dy=dy, indices=in_layout(indices, layout))


def graph_of(label, tensors):
    """(graph, bindings, output buffer) of one case."""
    mode, direction, _ = CASES[label]
    g = dg.Graph(name="pool", io_data_type=dg.bfloat16)  # (a per-element case is the same graph)
    x = g.tensor_like(tensors["x"], name="x")
    bound = {x: tensors["x"]}
    if direction == "forward":
        out = g.pooling(x, mode, *GEOMETRY)
    else:
        dy = g.tensor_like(tensors["dy"], name="dy")
        bound[dy] = tensors["dy"]
        indices = None
        if direction == "indexed":
            indices = g.tensor_like(tensors["indices"], name="indices")
            bound[indices] = tensors["indices"]
        out = g.pooling_backward(dy, x, mode, *GEOMETRY, indices=indices)
    out.set_output(True).set_name("out")
    buffer = torch.empty_strided(out.dim, out.stride, dtype=BF16, device=tensors["x"].device)
    bound[out] = buffer
    return g, bound, buffer


def reference(label, tensors):
    """torch's float32 result of one case, computed on NCHW copies: torch's channels-last CUDA
    avg_pool2d backward with padding maps each dx element to the windows of its neighbour one
    padding up and left (pytorch/pytorch#188344, as in torch 2.11), a relative error of 1.0
    against a right gradient; its NCHW kernel is right, and so is every CPU kernel."""
    mode, direction, _ = CASES[label]
    x = tensors["x"].float().contiguous()
    pool = (lambda v: F.max_pool2d(v, *GEOMETRY)) if mode == "max" else (lambda v: F.avg_pool2d(v, *GEOMETRY))
    if direction == "forward":
        return pool(x)
    leaf = x.clone().requires_grad_(True)
    pool(leaf).backward(tensors["dy"].float().contiguous())
    return leaf.grad


def torch_op(label, tensors):
    """The torch bf16 call of one case (the anchor timed next to dnngraph)."""
    mode, direction, _ = CASES[label]
    x, dy, indices = tensors["x"], tensors["dy"], tensors["indices"]
    window, stride, padding = GEOMETRY
    if direction == "forward":
        return (lambda: F.max_pool2d(x, *GEOMETRY)) if mode == "max" else (lambda: F.avg_pool2d(x, *GEOMETRY))
    if mode == "max":
        return lambda: torch.ops.aten.max_pool2d_with_indices_backward(dy, x, window, stride, padding, [1, 1],
                                                                       False, indices)
    return lambda: torch.ops.aten.avg_pool2d_backward(dy, x, window, stride, padding, False, True, None)


def traffic(label, tensors, out):
    mode, direction, _ = CASES[label]
    read = {"forward": ("x",), "indexed": ("dy", "indices"),
            "backward": ("dy", "x") if mode == "max" else ("dy",)}[direction]
    return sum(tensors[k].numel() * tensors[k].element_size() for k in read) + out.numel() * out.element_size()


def per_element(label) -> bool:
    return label.endswith("per-element")


def before(label) -> bool:
    return label.endswith("before")


@contextlib.contextmanager
def forced(config, label):
    """Builds in this block take `config` (None: the model's choice) for their pooling kernel,
    and a backward gathers per dx element where the case says so."""
    if per_element(label):
        heuristics.owned_block = lambda *geometry: ()
    if before(label):
        heuristics.row_segment_stride = lambda *layout: 0
        heuristics.shared_argmax_axis = lambda *geometry: -1
    if config is not None:
        heuristics.rank = lambda *args, **kwargs: [config] + [
            c for c in RANK_OF_MODEL(*args, **kwargs) if tile_of(c) != tile_of(config)]
    plan_cache.clear()
    try:
        yield
    finally:
        heuristics.rank = RANK_OF_MODEL
        heuristics.owned_block = OWNED_BLOCK
        heuristics.row_segment_stride, heuristics.shared_argmax_axis = ROW_SEGMENT_STRIDE, SHARED_ARGMAX_AXIS
        plan_cache.clear()


def model_and_grid(label, tensors):
    """(configs to time, model ranks by tile): the model's ranked configs, then the grid's."""
    captured = []

    def capture(*args, **kwargs):
        ranked = RANK_OF_MODEL(*args, **kwargs)
        captured.append((args, kwargs, ranked))
        return ranked

    heuristics.rank = capture
    try:
        with forced(None, label):
            graph_of(label, tensors)[0].build()
    finally:
        heuristics.rank = RANK_OF_MODEL
    args, _, ranked = captured[-1]
    rows, cols, bytes_per_element, target = args[:4]
    configs = list(ranked)
    if per_element(label) or before(label):
        return configs[:1], {tile_of(configs[0]): 1}
    seen = {tile_of(c) for c in configs}
    width = ranked[0].block_cols
    for block_cols in sorted({max(1, width // 2), width}):
        for elements, warps in GRID_TILES:
            block_rows = max(1, elements // block_cols)
            if (block_rows, block_cols, warps) in seen or block_rows * block_cols < 32 * warps:
                continue
            seen.add((block_rows, block_cols, warps))
            estimate = heuristics.estimate(rows, cols, block_rows, block_cols, warps, bytes_per_element, target)
            configs.append(heuristics.PoolingConfig(block_rows, block_cols, warps, 1e6 * estimate))
    return configs, {tile_of(c): i + 1 for i, c in enumerate(ranked)}


def _compile(jobs):
    """Worker: build (and so compile) each (case, config)."""
    torch.cuda.init()
    done = 0
    for label, config in jobs:
        try:
            tensors = inputs_of(label, "cuda")
            with forced(config, label):
                graph_of(label, tensors)[0].build()
            done += 1
        except Exception as error:  # noqa: BLE001 - reported when timed
            print(f"compile failed {label} {config}: {type(error).__name__}: {error}", flush=True)
    return done


def kernel_flags(config_text: str) -> str:
    """What a pooling kernel's config says beyond its tile (owned blocks, row segments, the
    argmax's source), from its config text."""
    return " ".join(word for word in config_text.split() if word.split("=")[0].split("/")[0] in (
        "owned", "row-segments", "argmax", "int64-index"))


def tile_of(config) -> tuple:
    return config.block_rows, config.block_cols, config.num_warps


def tile_text(config) -> str:
    return f"{config.block_rows}x{config.block_cols} w{config.num_warps}"


def check_cpu(labels) -> int:
    """Every case's model choice and two grid tiles in the interpreter against torch."""
    failures = 0
    for label in labels:
        tensors = inputs_of(label, "cpu")
        configs, ranks = model_and_grid(label, tensors)
        want = reference(label, tensors)
        for config in configs[:1] + configs[-2:]:
            with forced(config, label):
                g, bound, out = graph_of(label, tensors)
                out.fill_(float("nan"))
                g.build()
                g.execute(bound)
            error = (out.double() - want.double()).norm().item() / want.double().norm().item()
            ok = error < 2e-2 and g.plan.launches[0].config_text.startswith(
                f"BLOCK_R={config.block_rows} BLOCK_C={config.block_cols} num_warps={config.num_warps}")
            failures += not ok
            print(f"{label:36s} {tile_text(config):16s} rank {ranks.get(tile_of(config), '-')}: rel err {error:.2e} "
                  f"{'ok' if ok else 'FAILED'} [{g.plan.launches[0].config_text}]", flush=True)
    return failures


def case_state(label, with_compile: bool) -> dict:
    """A case's tensors, torch's float32 result, its minimal bytes and its torch anchors' times."""
    from common import median_ms

    tensors = inputs_of(label, "cuda")
    eager = torch_op(label, tensors)
    anchors = {"torch eager": median_ms(eager)}
    if with_compile:
        anchors["torch.compile"] = median_ms(torch.compile(eager, dynamic=False))
    out = eager()
    return dict(tensors=tensors, want=reference(label, tensors), anchors=anchors,
                nbytes=traffic(label, tensors, out))


def time_config(label, config, ranks, state, ceiling, median_ms, rel_error) -> dict:
    """Build the case with `config`, check it against torch, time it; prints and returns its row."""
    with forced(config, label):
        g, bound, out = graph_of(label, state["tensors"])
        g.build()
    g.execute(bound)
    error = rel_error(out, state["want"])
    ms = median_ms(lambda: g.execute(bound))
    tbs = state["nbytes"] / ms / 1e9
    rank = ranks.get(tile_of(config), "-")
    print(f"{label:36s} {tile_text(config):16s} {rank!s:>4s} {config.estimate_us:9.1f} {ms * 1e3:9.1f} "
          f"{tbs:6.2f} {tbs / ceiling:5.0%} {state['anchors']['torch eager'] / ms:7.2f}x {error:8.1e} "
          f"{kernel_flags(g.plan.launches[0].config_text)}", flush=True)
    return dict(case=label, block_rows=config.block_rows, block_cols=config.block_cols, num_warps=config.num_warps,
                model_rank=rank, model_us=config.estimate_us, us=ms * 1e3, tbs=tbs, copy_share=tbs / ceiling,
                rel_err=error, config_text=g.plan.launches[0].config_text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated words; cases whose label has one")
    parser.add_argument("--budget", type=float, default=100.0, help="seconds; stop timing after")
    parser.add_argument("--workers", type=int, default=12, help="compile processes (0: compile while timing)")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too (about 10 s a case)")
    parser.add_argument("--check-cpu", action="store_true", help="small shapes in the interpreter, no timing")
    args = parser.parse_args()
    words = [w.strip() for w in args.cases.split(",") if w.strip()]
    labels = [label for label in CASES if not words or any(w in label for w in words)]
    if args.check_cpu:
        sys.exit(1 if check_cpu(labels) else 0)
    from common import copy_ceiling_tbs, median_ms, rel_error, write_json

    start = time.time()
    plans, jobs = {}, []
    for label in labels:
        configs, ranks = model_and_grid(label, inputs_of(label, "cuda"))
        plans[label] = (configs, ranks)
        jobs += [(label, c) for c in configs]
    if args.workers > 0:
        print(f"{len(jobs)} kernels to compile ({time.time() - start:.0f} s)", flush=True)
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            compiled = sum(pool.map(_compile, [jobs[i::args.workers] for i in range(args.workers)]))
        print(f"compiled {compiled} in parallel ({time.time() - start:.0f} s)", flush=True)
    ceiling = copy_ceiling_tbs(1 << 28)
    target = target_of(torch.device("cuda"))
    print(f"device copy: {ceiling:.2f} TB/s (model bandwidth {target.bandwidth / 1e12:.2f} TB/s, {target.sms} SMs)",
          flush=True)
    print(f"{'case':36s} {'tile':16s} {'rank':>4s} {'model us':>9s} {'us':>9s} {'TB/s':>6s} {'copy':>5s} "
          f"{'vs eager':>8s} {'rel err':>8s} kernel")
    cases = {label: case_state(label, args.compile) for label in labels}
    for label, state in cases.items():
        print(f"{label:36s} " + ", ".join(f"{name} {ms * 1e3:.1f} us ({state['nbytes'] / ms / 1e9:.2f} TB/s)"
                                          for name, ms in state["anchors"].items()), flush=True)
    # every case's model choice first, then the rest of each case's configs: what the budget keeps
    records, passes = [], [[(label, plans[label][0][0]) for label in labels],
                           [(label, config) for label in labels for config in plans[label][0][1:]]]
    for label, config in passes[0] + passes[1]:
        if time.time() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: stopped before {label} {tile_text(config)}", flush=True)
            break
        records.append(time_config(label, config, plans[label][1], cases[label], ceiling, median_ms, rel_error))
    path = write_json("pooling_sweep.json", dict(copy_tbs=ceiling, records=records))
    print(f"took {time.time() - start:.0f} s" + (f"; results: {path}" if path else ""))


if __name__ == "__main__":
    main()
