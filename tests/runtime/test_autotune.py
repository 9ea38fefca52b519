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


def test_conv_records_name_the_model_and_every_rank(tmp_path, monkeypatch):
    """A stride-2 dgrad tunes per stride phase; each launch's record names the family and problem
    signature that ranked its candidates and how many there were, and (every candidate timed)
    its timings hold each model rank once, rank 0 (the model's choice) included."""
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "all")
    dy_t = torch.randn(2, 6, 4, 4).contiguous(memory_format=torch.channels_last)
    w_t = torch.randn(6, 5, 3, 3).contiguous(memory_format=torch.channels_last)
    g = dg.Graph(name="dgrad")
    dy, w = g.tensor_like(dy_t, name="dy"), g.tensor_like(w_t, name="w")
    g.conv_dgrad(dy, w, x_dim=[2, 5, 8, 8], padding=[1, 1], stride=[2, 2]).set_output(True).set_name("dx")
    g.build(autotune=True)
    records = [launch.tuning for launch in g.plan.launches]
    assert len(records) == 4  # phases (0, 0) .. (1, 1)
    # phase (0, 0) reaches one tap per axis: a 1x1 stride-1 conv, ranked by the matmul model
    assert [r.family for r in records] == ["matmul", "conv", "conv", "conv"]
    assert records[0].signature.startswith("b1 m32 n5 k6 ") and records[3].signature.startswith("conv g1 m32 n5 c6 t4 ")
    for record in records:
        assert record.source in ("tuned", "cache") and record.candidates >= 1
        assert sorted(rank for _, rank, _ in record.timings) == list(range(record.candidates))
    check(g, {"dy": dy_t, "w": w_t})
    g.build(autotune=True)  # from the cache: the same names and counts
    again = [launch.tuning for launch in g.plan.launches]
    assert all(r.source == "cache" for r in again)
    assert [(r.family, r.signature, r.candidates) for r in again] == [(r.family, r.signature, r.candidates)
                                                                      for r in records]
