"""build(autotune=True) for the memory-bound families: the same tuner and cache as matmul."""
import pytest
import torch

import dnngraph as dg
from helpers import check


@pytest.mark.parametrize("build_graph", ["softmax", "layernorm_backward"])
def test_row_families_tune_then_hit_the_cache(build_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "2")
    g = dg.Graph(name="rows")
    x = g.tensor(name="x", dim=[6, 300])
    if build_graph == "softmax":
        g.softmax(x, axis=-1).set_output(True).set_name("y")
        inputs = {"x": torch.randn(6, 300)}
    else:
        dy, scale = g.tensor(name="dy", dim=[6, 300]), g.tensor(name="scale", dim=[1, 300])
        mean, inv = g.tensor(name="mean", dim=[6, 1]), g.tensor(name="inv", dim=[6, 1])
        for out, name in zip(g.layernorm_backward(dy, x, scale, mean, inv), ("dx", "dscale", "dbias")):
            out.set_output(True).set_name(name)
        inputs = {"x": torch.randn(6, 300), "dy": torch.randn(6, 300), "scale": torch.randn(1, 300),
                  "mean": torch.randn(6, 1), "inv": torch.rand(6, 1) + 0.5}
    g.build(autotune=True)
    records = [launch.tuning for launch in g.plan.launches]
    assert all(r.source == "tuned" and 1 <= len(r.timings) <= 2 for r in records)
    assert "autotuned" in g.explain()
    check(g, inputs)
    g.build(autotune=True)
    assert all(launch.tuning.source == "cache" for launch in g.plan.launches)
    check(g, inputs)
