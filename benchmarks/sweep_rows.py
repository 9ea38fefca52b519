"""Time forced row-kernel configs on a few problems (how the heuristics constants were chosen).

    python benchmarks/sweep_rows.py     # GPU; prints one line per (problem, config)
"""
import itertools
import sys

import torch
import triton

import dnngraph as dg
from dnngraph.backends.triton.heuristics import rows

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


def main(names):
    for name in names or PROBLEMS:
        make, nbytes, configs = PROBLEMS[name]
        for config in configs:
            options = dg.BuildOptions(row_config=None if config is None else rows.RowConfig(*config, 0.0))
            g, outs, feeds = make()
            for out in outs:
                if out is not None:
                    out.set_output(True)
            try:
                g.build(options=options)
                feeds.update({t: torch.empty_strided(t.dim, t.stride, dtype=t.data_type.torch_dtype, device="cuda")
                              for t in g.outputs()})
                ms = triton.testing.do_bench(lambda: g.execute(feeds), warmup=5, rep=30)
                print(f"{name} {config or 'model'}: {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s", flush=True)
            except Exception as error:  # a config may not compile (registers, shared memory)
                print(f"{name} {config}: failed {type(error).__name__}: {str(error)[:100]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
