"""Time forced row-kernel configs on a few problems (how the heuristics constants were chosen).

    python benchmarks/sweep_rows.py     # GPU; prints one line per (problem, config)
    python benchmarks/sweep_rows.py ln_fwd_4096x14336 norm_bwd_ln_4096x14336   # some problems

The norm_bwd_* problems (fused layernorm/rmsnorm backward) set the heuristics' FUSED_*
constants for each line (the model's choice otherwise) and print the kernels and their configs,
so that each constant's neighbours can be compared; ln_fwd_*, rms_fwd_* and softmax_fwd_* time
one-pass forward rows by warps (heuristics/rows.py ONE_PASS_WARPS) and persistent rows by warps
and programs (PERSISTENT_*).
"""
import itertools
import sys

import torch
import triton

import dnngraph as dg
from dnngraph.backends.triton.heuristics import rows
from dnngraph.runtime import plan_cache

BF16 = torch.bfloat16


def _batchnorm(backward):
    x_t = (torch.randn(32, 256, 56, 56, device="cuda") * 2 + 3).to(BF16).contiguous(memory_format=torch.channels_last)
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(x_t, "x")
    p = [1, 256, 1, 1]
    s = g.tensor(name="s", dim=p, data_type=dg.float32)
    feeds = {x: x_t, s: torch.rand(p, device="cuda") + 0.5}
    if backward:
        dy = g.tensor_like(x_t, "dy")
        m = g.tensor(name="m", dim=p, data_type=dg.float32)
        i = g.tensor(name="i", dim=p, data_type=dg.float32)
        outs = g.batchnorm_backward(dy, x, s, m, i)
        feeds.update({dy: torch.randn_like(x_t), m: torch.full(p, 3.0, device="cuda"), i: torch.full(p, 0.5, device="cuda")})
    else:
        b = g.tensor(name="b", dim=p, data_type=dg.float32)
        outs = g.batchnorm(x, s, b)
        feeds[b] = torch.randn(p, device="cuda")
    return g, outs, feeds


def _column_sum():
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[16384, 8192])
    y = g.reduction(x, "sum", [0]).set_data_type(dg.float32)
    return g, [y], {x: torch.randn(16384, 8192, device="cuda", dtype=BF16)}


def _layernorm(rows_, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, s, b = g.tensor(name="x", dim=[rows_, cols]), g.tensor(name="s", dim=[1, cols]), g.tensor(name="b", dim=[1, cols])
    outs = g.layernorm(x, s, b)
    return g, outs, {x: torch.randn(rows_, cols, device="cuda", dtype=BF16), s: torch.randn(1, cols, device="cuda", dtype=BF16),
                     b: torch.randn(1, cols, device="cuda", dtype=BF16)}


def _grid(mode, pairs, warps, splits=(1,)):
    return [(mode, k, r, w, s) for (k, r), w, s in itertools.product(pairs, warps, splits)]


PROBLEMS = {
    "bn_fwd": (lambda: _batchnorm(False), 103e6,
               [None] + _grid("split", [(256, 16), (256, 8), (128, 32), (64, 64)], (4, 8), (132, 264, 528))),
    "bn_bwd": (lambda: _batchnorm(True), 154e6,
               [None] + _grid("split", [(256, 16), (256, 8), (128, 32), (64, 64)], (4, 8), (132, 264, 528))),
    "colsum": (_column_sum, 268e6,
               [None] + _grid("looped", [(64, 32), (128, 16), (256, 8), (256, 16)], (4, 8))
               + _grid("split", [(128, 16), (256, 8), (256, 16)], (4, 8), (2, 4, 8))),
    "ln_4096x14336": (lambda: _layernorm(4096, 14336), 235e6,
                      [None] + _grid("one_pass", [(1, 16384)], (8, 16, 32))
                      + _grid("looped", [(1, 2048), (1, 4096), (1, 8192)], (4, 8, 16))),
    "ln_16384x8192": (lambda: _layernorm(16384, 8192), 537e6,
                      [None] + _grid("one_pass", [(1, 8192)], (4, 8, 16, 32)) + _grid("looped", [(1, 4096)], (8, 16))),
}


def _norm_backward(op, rows_, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    dy, x = g.tensor(name="dy", dim=[rows_, cols]), g.tensor(name="x", dim=[rows_, cols])
    s = g.tensor(name="s", dim=[1, cols])
    x_t = torch.randn(rows_, cols, device="cuda", dtype=BF16)
    feeds = {dy: torch.randn_like(x_t), x: x_t, s: torch.randn(1, cols, device="cuda", dtype=BF16)}
    inv = g.tensor(name="inv", dim=[rows_, 1], data_type=dg.float32)
    feeds[inv] = torch.rand(rows_, 1, device="cuda") + 0.5
    if op == "ln":
        mean = g.tensor(name="mean", dim=[rows_, 1], data_type=dg.float32)
        feeds[mean] = torch.randn(rows_, 1, device="cuda") * 0.1
        outs = g.layernorm_backward(dy, x, s, mean, inv)
    else:
        outs = g.rmsnorm_backward(dy, x, s, inv, has_dbias=False)
    return g, outs, feeds


# fused norm backward: (constants set on heuristics/rows.py, BuildOptions) per line; {} = the model
# (chunks of 4096, two prefetched); each chunk width by the chunks prefetched around the default
CHUNKED = [({}, {})] + [({"FUSED_LOOP_CHUNK": chunk, "FUSED_LOOP_PREFETCH": ahead}, {})
                        for chunk in (2048, 4096) for ahead in (1, 2, 3)] + [
    ({"FUSED_LOOP_ROWS": 2}, {}), ({"FUSED_LOOP_PROGRAMS_PER_SM": 2, "FUSED_LOOP_WARPS": 8}, {}),
    ({"FUSED_LOOP_PRIME_NEXT_ROWS": False}, {})]
ONE_TILE_OR_CHUNKED = [({}, {}), ({}, {"norm_backward_max_reduced": 4096}), ({}, {"norm_backward_max_reduced": 2048}),
                       ({"FUSED_PROGRAMS_PER_SM": 1}, {}), ({"FUSED_MIN_ROWS_PER_PROGRAM": 16}, {})]
# one-tile rows by the row blocks prefetched (FUSED_ROW_PREFETCH_VALUES: 0 off, else blocks of
# that many values ahead, at most FUSED_ROW_PREFETCH_MAX)
ONE_TILE_OR_CHUNKED += [({"FUSED_ROW_PREFETCH_VALUES": 0}, {}), ({"FUSED_ROW_PREFETCH_VALUES": 4096}, {}),
                        ({"FUSED_ROW_PREFETCH_VALUES": 16384, "FUSED_ROW_PREFETCH_MAX": 4}, {})]


def _norm_bwd_bytes(op, rows_, cols):
    return 3 * rows_ * cols * 2 + (2 if op == "ln" else 1) * rows_ * 4 + cols * 2 * (3 if op == "ln" else 2)


def _norm_bwd_problem(op, rows_, cols, configs):
    return (lambda: _norm_backward(op, rows_, cols), _norm_bwd_bytes(op, rows_, cols), configs)


NORM_BWD = {f"norm_bwd_{op}_{m}x{n}": _norm_bwd_problem(op, m, n, CHUNKED if n > 8192 else ONE_TILE_OR_CHUNKED)
            for op in ("ln", "rms") for m, n in ((4096, 14336), (4096, 8192), (4096, 4096))}
def _rmsnorm(rows_, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, s = g.tensor(name="x", dim=[rows_, cols]), g.tensor(name="s", dim=[1, cols])
    outs = g.rmsnorm(x, s)
    return g, outs, {x: torch.randn(rows_, cols, device="cuda", dtype=BF16), s: torch.randn(1, cols, device="cuda", dtype=BF16)}


def _softmax(rows_, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[rows_, cols])
    return g, [g.softmax(x, axis=-1)], {x: torch.randn(rows_, cols, device="cuda", dtype=BF16)}


# one-pass forward rows of 16384 lanes by warps (one row per program: heuristics/rows.py
# ONE_PASS_WARPS), then persistent rows (programs walking rows, the next one prefetched) by warps
# and programs per SM (132 SMs); layernorm's model takes persistent at 16 warps, one per SM
ONE_PASS_BY_WARPS = [(None, {})] + [(("one_pass", 1, 16384, w, 1), {}) for w in (4, 8, 16)]
PERSISTENT_16384 = [(("persistent", 1, 16384, w, p), {}) for w, p in ((16, 132), (8, 132))]
PERSISTENT_8192 = [(None, {})] + [(("one_pass", 1, 8192, w, 1), {}) for w in (8, 16)] + [
    (("persistent", 1, 8192, w, p), {}) for w, p in ((16, 264), (16, 132), (8, 264))]
ONE_PASS_FWD = {"ln_fwd_4096x14336": (lambda: _layernorm(4096, 14336), 235e6, ONE_PASS_BY_WARPS + PERSISTENT_16384),
          "ln_fwd_16384x8192": (lambda: _layernorm(16384, 8192), 537e6, PERSISTENT_8192),
          "rms_fwd_4096x14336": (lambda: _rmsnorm(4096, 14336), 235e6, ONE_PASS_BY_WARPS + PERSISTENT_16384),
          "softmax_fwd_4096x14336": (lambda: _softmax(4096, 14336), 235e6, ONE_PASS_BY_WARPS)}


def _time(name, make, nbytes, label, options):
    plan_cache.clear()  # the heuristics' constants are not in the plan key
    g, outs, feeds = make()
    for out in outs:
        if out is not None:
            out.set_output(True)
    try:
        g.build(options=options)
        feeds.update({t: torch.empty_strided(t.dim, t.stride, dtype=t.data_type.torch_dtype, device="cuda")
                      for t in g.outputs()})
        ms = triton.testing.do_bench(lambda: g.execute(feeds), warmup=5, rep=30)
        kernels = " | ".join(launch.config_text for launch in g.plan.launches)
        print(f"{name} {label}: {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s "
              f"{len(g.plan.launches)} kernels: {kernels}", flush=True)
    except Exception as error:  # a config may not compile (registers, shared memory)
        print(f"{name} {label}: failed {type(error).__name__}: {str(error)[:100]}", flush=True)


def _norm_bwd(name):
    make, nbytes, configs = NORM_BWD[name]
    for constants, options in configs:
        saved = {k: getattr(rows, k) for k in constants}
        for key, value in constants.items():
            setattr(rows, key, value)
        try:
            _time(name, make, nbytes, f"{constants or 'model'} {options or ''}".strip(), dg.BuildOptions(**options))
        finally:
            for key, value in saved.items():
                setattr(rows, key, value)


def _one_pass_fwd(name):
    make, nbytes, configs = ONE_PASS_FWD[name]
    for config, options in configs:
        forced = None if config is None else rows.RowConfig(*config, 0.0)
        _time(name, make, nbytes, f"{config or 'model'} {options or ''}".strip(),
              dg.BuildOptions(row_config=forced, **options))


def main(names):
    for name in names:
        if name in NORM_BWD:
            _norm_bwd(name)
        elif name in ONE_PASS_FWD:
            _one_pass_fwd(name)
    for name in [n for n in names if n in PROBLEMS] or ([] if names else PROBLEMS):
        make, nbytes, configs = PROBLEMS[name]
        for config in configs:
            options = dg.BuildOptions(row_config=None if config is None else rows.RowConfig(*config, 0.0))
            _time(name, make, nbytes, str(config or "model"), options)


if __name__ == "__main__":
    main(sys.argv[1:])
