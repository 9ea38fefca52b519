"""Worst-case-but-legal graphs of every family whose generated code repeats over a user-sized
extent (pooling windows and the windows covering an element, LRN and divisive windows, depthwise
filters and multipliers, attention head dims), for timing their sm_90 compile: a kernel whose
source grows with the user's numbers is a compile-time cliff (a 3x3x3 max-pool backward once
took minutes of ptxas).

    TRITON_INTERPRET=0 python tests/sm90_compile.py compile_cliffs:representative
    python tests/compile_cliffs.py            # the full sweep, a table of seconds per kernel

`representative()` is the small set tests/backends/test_compile_time.py compiles in CI;
`sweep()` adds the rest of the worst cases, run by hand (a few minutes on two CPU cores).
"""
import os
import re
import sys
import tempfile
import time

import torch

import dnngraph as dg

H200 = dg.BuildOptions(target=dg.target.H200)


def _nhwc(shape, dtype=torch.bfloat16):
    """Random values of `shape` with channels innermost in memory."""
    order = [0] + list(range(2, len(shape))) + [1]
    stored = torch.randn([shape[i] for i in order], dtype=dtype)
    return stored.permute([0, len(shape) - 1] + list(range(1, len(shape) - 1)))


def _pooled_dims(shape, window, stride, padding):
    return list(shape[:2]) + [(s + 2 * p - w) // st + 1
                              for s, w, st, p in zip(shape[2:], window, stride, padding)]


def pooling(shape, window, stride, padding, mode, direction):
    """A bf16 NHWC pooling graph: "forward", "forward with indices" (a max's argmax too),
    "backward" (a max recomputes each covering window's argmax), or "indexed" (a max backward
    reading the forward's indices)."""
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(_nhwc(shape), "x")
    if direction in ("forward", "forward with indices"):
        outputs = g.pooling(x, mode, window, stride, padding, return_indices=direction != "forward")
        for output in outputs if isinstance(outputs, tuple) else (outputs,):
            output.set_output(True)
        return g
    dy = g.tensor_like(_nhwc(_pooled_dims(shape, window, stride, padding)), "dy")
    indices = None
    if direction == "indexed":
        indices = g.tensor(name="indices", dim=dy.dim, stride=dy.stride, data_type=dg.int64)
    g.pooling_backward(dy, x, mode, window, stride, padding, indices=indices).set_output(True)
    return g


def windowed_normalization(op, shape, size, backward):
    """A bf16 NHWC LRN ("lrn") or divisive normalization ("div") graph, forward or backward."""
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(_nhwc(shape), "x")
    name = {"lrn": "lrn", "div": "divisive_normalization"}[op]
    if backward:
        getattr(g, name + "_backward")(g.tensor_like(_nhwc(shape), "dy"), x, size).set_output(True)
    else:
        getattr(g, name)(x, size).set_output(True)
    return g


def depthwise(op, shape, filter_size, multiplier=1, padding=None):
    """A bf16 NHWC depthwise convolution graph (op: fprop, dgrad, wgrad), stride 1, 'same'."""
    rank = len(shape) - 2
    padding = [filter_size // 2] * rank if padding is None else padding
    attrs = dict(padding=padding, stride=[1] * rank, dilation=[1] * rank, groups=shape[1])
    w_dim = [shape[1] * multiplier, 1] + [filter_size] * rank
    y_dim = [shape[0], shape[1] * multiplier] + [s + 2 * p - filter_size + 1 for s, p in zip(shape[2:], padding)]
    g = dg.Graph(io_data_type=dg.bfloat16)
    if op == "fprop":
        g.conv_fprop(g.tensor_like(_nhwc(shape), "x"), g.tensor_like(_nhwc(w_dim), "w"), **attrs).set_output(True)
    elif op == "dgrad":
        g.conv_dgrad(g.tensor_like(_nhwc(y_dim), "dy"), g.tensor_like(_nhwc(w_dim), "w"), x_dim=list(shape),
                     **attrs).set_output(True)
    else:
        g.conv_wgrad(g.tensor_like(_nhwc(y_dim), "dy"), g.tensor_like(_nhwc(shape), "x"), w_dim=w_dim,
                     **attrs).set_output(True)
    return g


def attention(head_dim, backward):
    """bf16 causal attention of head dim `head_dim`, with its backward where asked."""
    g = dg.Graph(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q, k, v = (g.tensor(name=n, dim=[1, 2, 256, head_dim]) for n in "qkv")
    o, stats = g.sdpa(q, k, v, is_inference=not backward, use_causal_mask=True)
    o.set_output(True)
    if backward:
        stats.set_output(True)
        d_o = g.tensor(name="dO", dim=[1, 2, 256, head_dim])
        for grad in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True):
            grad.set_output(True)
    return g


def _built(label, graph):
    return label, graph.build(options=H200)


def representative():
    """One worst case per family: the sets CI times (tests/backends/test_compile_time.py)."""
    yield _built("pool 3d 3x3x3 s(2,2,1) max backward (the 339 s GPU test)",
                 pooling((2, 16, 9, 17, 15), [3, 3, 3], [2, 2, 1], [1, 1, 1], "max", "backward"))
    yield _built("pool 3d 5x5x5 s1 max backward", pooling((1, 8, 7, 7, 7), [5] * 3, [1] * 3, [2] * 3, "max", "backward"))
    yield _built("pool 3d 5x5x5 s1 max forward with indices",
                 pooling((1, 8, 7, 7, 7), [5] * 3, [1] * 3, [2] * 3, "max", "forward with indices"))
    yield _built("pool 2d 7x7 s4 max backward (16 owned dx a position, the window's rows rolled)",
                 pooling((1, 8, 23, 23), [7] * 2, [4] * 2, [3] * 2, "max", "backward"))
    yield _built("lrn size 64 backward", windowed_normalization("lrn", (2, 96, 5, 5), 64, True))
    yield _built("div 3d 5x5x5 backward", windowed_normalization("div", (1, 8, 7, 7, 7), 5, True))
    yield _built("depthwise 31x31 dgrad x4", depthwise("dgrad", (1, 8, 33, 33), 31, multiplier=4))
    yield _built("depthwise 1d 255 dgrad x4", depthwise("dgrad", (1, 8, 300), 255, multiplier=4))


def sweep():
    """Every worst case, the representative ones first."""
    yield from representative()
    yield _built("pool 3d 9x9x9 s1 max forward", pooling((1, 8, 9, 9, 9), [9] * 3, [1] * 3, [4] * 3, "max", "forward"))
    yield _built("pool 3d 5x5x5 s1 max indexed backward",
                 pooling((1, 8, 7, 7, 7), [5] * 3, [1] * 3, [2] * 3, "max", "indexed"))
    yield _built("pool 3d 5x5x5 s1 avg backward",
                 pooling((1, 8, 7, 7, 7), [5] * 3, [1] * 3, [2] * 3, "avg_exclude_pad", "backward"))
    yield _built("pool 2d 15x15 s1 max backward", pooling((1, 8, 17, 17), [15] * 2, [1] * 2, [7] * 2, "max", "backward"))
    yield _built("pool 3d 5x5x5 s2 avg backward (8 owned dx a position)",
                 pooling((1, 8, 9, 9, 9), [5] * 3, [2] * 3, [2] * 3, "avg_include_pad", "backward"))
    yield _built("lrn size 64 forward", windowed_normalization("lrn", (2, 96, 5, 5), 64, False))
    yield _built("div 2d 11x11 backward", windowed_normalization("div", (1, 8, 13, 13), 11, True))
    yield _built("div 2d 11x11 forward", windowed_normalization("div", (1, 8, 13, 13), 11, False))
    yield _built("div 3d 5x5x5 forward", windowed_normalization("div", (1, 8, 7, 7, 7), 5, False))
    yield _built("depthwise 31x31 fprop", depthwise("fprop", (1, 8, 33, 33), 31))
    yield _built("depthwise 31x31 wgrad", depthwise("wgrad", (1, 8, 33, 33), 31))
    yield _built("depthwise 1d 255 fprop", depthwise("fprop", (1, 8, 300), 255))
    yield _built("depthwise 3d 7x7x7 dgrad x4", depthwise("dgrad", (1, 8, 9, 9, 9), 7, multiplier=4))
    yield _built("sdpa head_dim 256 forward and backward", attention(256, True))


COMPILE_LINE = re.compile(r"^compile_seconds (\d+\.\d+) (.*)$", re.M)


def compile_seconds(spec: str, timeout: int = 1800) -> list:
    """(seconds, "label: kernel") of every kernel of `spec` ("module:function") compiled for sm_90
    by tests/sm90_compile.py in a process of its own, with an empty Triton cache (a cached
    binary would time nothing)."""
    from helpers import compiled_for_sm90
    with tempfile.TemporaryDirectory() as cache:
        # two kernels at a time (sm90_compile's default) at most double a kernel's seconds, as a
        # loaded CI machine does: a cliff (minutes) still stands out of test_compile_time's KERNEL_SECONDS_MAX
        output = compiled_for_sm90(spec, timeout=timeout, env={"TRITON_CACHE_DIR": cache})
    return [(float(seconds), what) for seconds, what in COMPILE_LINE.findall(output)]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    started = time.time()
    for seconds, what in compile_seconds("compile_cliffs:sweep"):
        print(f"{seconds:7.1f} s  {what}")
    print(f"total {time.time() - started:.0f} s")
