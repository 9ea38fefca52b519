"""Kernels are named by content: `dnngraph_<family words>_<digest of the source>`. The same
kernel of two groups, at any positions of any graphs, is one name, one module and one
JITFunction (Triton's caches then compile it once); what changes the source changes the name;
explain() tells the groups apart; no user text is in a name or a source."""
import re

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import kernel_files as kernel_cache
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check

NAME = re.compile(r"dnngraph_[a-z0-9_]+_[0-9a-f]{16}")


def _matmul_relu(g, a, w):
    return g.relu(g.matmul(a, w))


def _blocks(first_op="sigmoid", names=("a", "b", "w1", "w2"), io=dg.float32, k=16):
    """relu(a @ w1), first_op(b @ w2), relu(b @ w1): the first and last are one kernel."""
    g = dg.Graph(io_data_type=io)
    a, b = g.tensor(name=names[0], dim=[8, k]), g.tensor(name=names[1], dim=[8, k])
    w1, w2 = g.tensor(name=names[2], dim=[k, 8]), g.tensor(name=names[3], dim=[k, 8])
    _matmul_relu(g, a, w1).set_output(True)
    getattr(g, first_op)(g.matmul(b, w2)).set_output(True)
    _matmul_relu(g, b, w1).set_output(True)
    return g.build()


def _kernels(g) -> list:
    return [launch.kernel for launch in g.plan.launches]


def test_one_kernel_at_different_positions_of_different_graphs_is_one_jit_function():
    g = _blocks()
    first, other, last = _kernels(g)
    assert first is last and first.__name__ == last.__name__ and other is not first
    # another graph, the kernel at another position, every tensor and node named otherwise
    h = dg.Graph(name="another")
    x = h.tensor(name="x", dim=[8, 16])
    extra = h.exp(x)
    extra.set_output(True)
    _matmul_relu(h, h.tensor(name="p", dim=[8, 16]), h.tensor(name="q", dim=[16, 8])).set_output(True)
    h.build()
    assert first in _kernels(h) and first is _kernels(h)[1]
    assert [p.name for p in (g.plan.launches[0].source_path, h.plan.launches[1].source_path)] == [f"{first.__name__}.py"] * 2


def test_the_name_is_the_family_words_and_the_digest_of_the_rendered_source():
    g = _blocks()
    for launch in g.plan.launches:
        name = launch.kernel.__name__
        assert NAME.fullmatch(name) and launch.source_path.name == f"{name}.py"
        text = kernel_cache.kernel_source(launch.kernel)
        rendered = kernel_cache.rendered_source(text, name)
        assert rendered is not None and name.endswith(kernel_cache.source_digest(rendered))
        assert name.startswith("dnngraph_matmul_")


def test_what_changes_the_source_changes_the_name():
    base = _kernels(_blocks())[0].__name__
    assert _kernels(_blocks(io=dg.float16))[0].__name__ != base  # dtypes
    assert _kernels(_blocks(k=17))[0].__name__ != base  # a reduced size that is not a tile's multiple
    assert _kernels(_blocks(names=("m", "n", "o", "p")))[0].__name__ == base  # names change nothing


def _forced(config):
    g = dg.Graph(io_data_type=dg.float32)
    a, w = g.tensor(name="a", dim=[64, 16]), g.tensor(name="w", dim=[16, 64])
    _matmul_relu(g, a, w).set_output(True)
    return g.build(options=dg.BuildOptions(matmul_config=config)).plan.launches


def test_configs_differ_in_name_where_they_differ_in_source():
    """A variant is other code, another name; tile sizes are constexpr arguments of one kernel
    (Triton compiles one binary per value), the same name with other launch arguments."""
    tiled = _forced(mm.MatmulConfig("tiled", 32, 32, 16, 4, 2))
    smaller = _forced(mm.MatmulConfig("tiled", 16, 16, 16, 4, 2))
    split = _forced(mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=2))
    assert tiled[0].kernel is smaller[0].kernel and tiled[0].template != smaller[0].template
    assert split[0].kernel.__name__ != tiled[0].kernel.__name__
    assert len({launch.kernel.__name__ for launch in split}) == len(split)  # main and combine


def test_explain_tells_the_groups_of_one_kernel_apart():
    g = _blocks()
    text = g.explain()
    name = g.plan.launches[0].kernel.__name__
    lines = [line for line in text.splitlines() if line.startswith("kernel ")]
    assert lines[0] == f"kernel 0 [matmul] {name} (group 0)" and lines[2] == f"kernel 2 [matmul] {name} (group 2)"
    blocks = text.split("\nkernel ")
    assert "reads:  a " in blocks[1] and "reads:  b " in blocks[3]


@pytest.mark.parametrize("word", ["dnngraph_matmul_relu", "zz_user_name", "relu", "a" * 60])
def test_no_user_text_in_a_name_or_a_source(word):
    g = dg.Graph(name=word)
    x = g.tensor(name=f"{word}_x", dim=[5, 9])
    w = g.tensor(name=f"{word}_w", dim=[9, 4])
    y = g.matmul(g.relu(x, name=f"{word}_relu"), w, name=f"{word}_mm")
    g.softmax(y, name=f"{word}_softmax").set_output(True).set_name(f"{word}_y")
    g.build()
    for launch in g.plan.launches:
        name = launch.kernel.__name__
        assert NAME.fullmatch(name) and f"{word}_" not in name
        assert f"{word}_" not in kernel_cache.kernel_source(launch.kernel)
    check(g, {x: torch.randn(5, 9), w: torch.randn(9, 4)})


def _conv(g, t):
    x, w = t("x", [2, 4, 7, 7]), t("w", [6, 4, 3, 3])
    return [g.relu(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]))]


def _depthwise(g, t):
    x, w = t("x", [2, 4, 7, 7]), t("w", [4, 1, 3, 3])
    return [g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=4)]


def _conv_grads(g, t):
    dy, x, w = t("dy", [2, 6, 7, 7]), t("x", [2, 4, 7, 7]), t("w", [6, 4, 3, 3])
    geometry = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    return [g.conv_dgrad(dy, w, [2, 4, 7, 7], **geometry), g.conv_wgrad(dy, x, [6, 4, 3, 3], **geometry)]


def _sdpa(g, t):
    q, k, v = t("q", [1, 2, 5, 16]), t("k", [1, 2, 7, 16]), t("v", [1, 2, 7, 16])
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
    do = t("do", [1, 2, 5, 16])
    return [o, stats] + list(g.sdpa_backward(q, k, v, o, do, stats, use_causal_mask=True))


def _attention_chain(g, t):
    q, k, v = t("q", [1, 2, 5, 16]), t("k", [1, 2, 7, 16]), t("v", [1, 2, 7, 16])
    scores = g.scale(g.matmul(q, g.transpose(k, [0, 1, 3, 2])), 0.25)
    return [g.matmul(g.softmax(scores, axis=-1), v)]


def _rows_and_pooling(g, t):
    x, s, b = t("x", [2, 3, 6, 6]), t("s", [1, 3, 6, 6]), t("b", [1, 3, 6, 6])
    y, mean, inv = g.layernorm(x, s, b)
    pooled = g.pooling(y, "avg_include_pad", [2, 2], [2, 2], [0, 0])
    dy = t("dy", [2, 3, 6, 6])
    return [pooled, mean, inv] + list(g.layernorm_backward(dy, x, s, mean, inv))


def _gather(g, t):
    table, ids = t("table", [10, 8]), t("ids", [5, 1], dg.int64)
    return [g.concatenate([g.gather(table, ids, 0), t("other", [5, 8])], 1)]


@pytest.mark.parametrize("family", [_conv, _depthwise, _conv_grads, _sdpa, _attention_chain, _rows_and_pooling,
                                    _gather])
def test_every_family_names_its_kernels_by_content(family):
    """Built twice, the second time after another kernel and with other tensor and node names:
    the same kernels, one JITFunction each."""
    kernels = []
    for prefix, lead in (("zzfirst", False), ("zzsecond", True)):
        g = dg.Graph(name=prefix)
        tensor = lambda name, dim, dtype=None: g.tensor(name=f"{prefix}_{name}", dim=dim, data_type=dtype)
        if lead:
            g.exp(tensor("lead", [3, 3])).set_output(True)
        for index, output in enumerate(family(g, tensor)):
            output.set_output(True).set_name(f"{prefix}_out_{index}")
        g.build()
        launches = g.plan.launches[1:] if lead else g.plan.launches
        for launch in launches:
            assert NAME.fullmatch(launch.kernel.__name__) and prefix not in kernel_cache.kernel_source(launch.kernel)
        kernels.append([launch.kernel for launch in launches])
    first, second = kernels
    assert len(first) == len(second) and all(a is b for a, b in zip(first, second))


def test_threads_loading_one_kernel_get_one_jit_function(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    import threading
    rendered = "import triton\n\n\n@triton.jit\ndef dnngraph_test_threads(x_ptr):\n    pass\n"
    start, kernels = threading.Barrier(6), []

    def load():
        start.wait()
        kernels.append(kernel_cache.load_kernel(rendered, "dnngraph_test_threads")[0])
    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(kernels) == 6 and all(kernel is kernels[0] for kernel in kernels)
