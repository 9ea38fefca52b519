"""Dynamic graphs that ship: serialize() of a built graph with dynamic extents writes its graph
(symbols included) and every plan it holds, one per size (blob version 2); deserialize runs the
sizes the blob holds without lowering or compiling (proved in a fresh process whose every build
and compile path raises), builds a size it does not hold on first use, and refuses damaged blobs
with SerializationError. build(sizes=[...]) makes the plans a server needs ahead of time."""
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import dnngraph as dg
from dnngraph import shipping
from helpers import TOLERANCE, rel_err
from test_shipping import NOTHING_BUILT, ROOT, _repacked

RANGE = (1, 40)
AHEAD = 17  # built ahead of time besides the range's ends


def _dynamic_block():
    """Two kernels with a virtual tensor between them: x [tokens, 24] stored column-major (dense
    at every size) times a weight plus a bias, relu, then a softmax and a row sum of exp."""
    tokens = dg.dynamic("tokens", *RANGE)
    g = dg.Graph(name="shipped_dynamic")
    x = g.tensor(name="x", dim=[tokens, 24], stride=[1, RANGE[1]])
    w = g.tensor(name="w", dim=[24, 13])
    b = g.tensor(name="b", dim=[1, 13])
    h = g.relu(g.add(g.matmul(x, w), b))
    g.softmax(h, axis=-1).set_output(True).set_name("y")
    g.reduction(g.exp(h), "sum", [1]).set_output(True).set_name("s")
    return g


def _inputs(tokens: int) -> dict:
    return {"x": torch.randn(24, tokens).t(), "w": torch.randn(24, 13) / 24 ** 0.5, "b": torch.randn(1, 13)}


def _outputs(tokens: int) -> dict:
    return {"y": torch.full((tokens, 13), float("nan")), "s": torch.full((tokens, 1), float("nan"))}


def _executed(g, inputs) -> dict:
    outputs = _outputs(inputs["x"].shape[0])
    g.execute({**inputs, **outputs})
    return outputs


def _check(g, inputs, outputs):
    reference = g.reference(inputs)
    for name, value in outputs.items():
        assert rel_err(value, reference[name]) < TOLERANCE[torch.float32], (name, inputs["x"].shape)


def _document(blob: bytes) -> dict:
    return json.loads(zlib.decompress(blob[len(shipping.MAGIC):].partition(b"\n")[2]))


@pytest.fixture(scope="module")
def built():
    return _dynamic_block().build(sizes=[{"tokens": AHEAD}])


def test_blob_holds_the_graph_and_a_plan_per_size(built):
    document = _document(built.serialize())
    assert document["version"] == shipping.DYNAMIC_BLOB_VERSION
    assert [plan["sizes"] for plan in document["plans"]] == [{"tokens": n} for n in (RANGE[0], AHEAD, RANGE[1])]
    assert json.loads(document["graph"])["symbols"] == {"tokens": list(RANGE)}


def _run_in_fresh_process(tmp_path, blob: bytes, held: dict) -> dict:
    """Per tokens of `held` (tokens -> inputs, on one device), the outputs of the blob's graph in
    a new process where every build and compile path raises (test_shipping.NOTHING_BUILT); under
    "unheld", what executing a size the blob does not hold did there."""
    torch.save({"blob": blob, "inputs": held}, tmp_path / "shipped.pt")
    script = NOTHING_BUILT + textwrap.dedent(f"""
        import torch
        data = torch.load({str(tmp_path / 'shipped.pt')!r})
        g = dg.Graph.deserialize(data["blob"])
        results = {{}}
        for tokens, inputs in data["inputs"].items():
            device = inputs["x"].device
            outputs = {{"y": torch.full((tokens, 13), float("nan"), device=device),
                        "s": torch.full((tokens, 1), float("nan"), device=device)}}
            g.execute({{**inputs, **outputs}})
            results[tokens] = {{name: value.cpu() for name, value in outputs.items()}}
        assert g.plan.builds == 0
        try:
            g.execute({{"x": torch.randn(5, 24, device=device), "w": torch.randn(24, 13, device=device),
                        "b": torch.randn(1, 13, device=device), "y": torch.empty(5, 13, device=device),
                        "s": torch.empty(5, 1, device=device)}})
            results["unheld"] = "ran"
        except AssertionError as error:
            results["unheld"] = str(error)
        torch.save(results, {str(tmp_path / 'outputs.pt')!r})
    """)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                       DNNGRAPH_CACHE_DIR=str(tmp_path / "fresh-cache"))
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(tmp_path / "outputs.pt")


def _check_fresh_process_run(g, tmp_path, device):
    """Every size the blob of `g` holds (the min, an odd size built ahead of time, the max) runs
    from the blob without building, as in `g` (the same kernels on the same inputs); a size it
    does not hold reaches a build there (and so raises), which is how it is made on first use."""
    held = {n: {k: v.to(device) for k, v in _inputs(n).items()} for n in (RANGE[0], AHEAD, RANGE[1])}
    results = _run_in_fresh_process(tmp_path, g.serialize(), held)
    assert "lowered or compiled" in results.pop("unheld")
    for tokens, inputs in held.items():
        here = {name: value.to(device) for name, value in _outputs(tokens).items()}
        g.execute({**inputs, **here})
        for name in here:
            assert torch.equal(here[name].cpu(), results[tokens][name]), (tokens, name)
        _check(g, {k: v.cpu() for k, v in inputs.items()}, results[tokens])


def test_held_sizes_run_in_a_fresh_process_without_lowering_or_compiling(built, tmp_path):
    _check_fresh_process_run(built, tmp_path, "cpu")


@pytest.mark.gpu
def test_gpu_dynamic_blob_runs_its_binaries_in_a_fresh_process_without_compiling(tmp_path):
    g = _dynamic_block().build(sizes=[{"tokens": AHEAD}])
    for tokens in (RANGE[0], AHEAD, RANGE[1]):  # bound (compiled) on the GPU before shipping
        inputs = {k: v.cuda() for k, v in _inputs(tokens).items()}
        g.execute({**inputs, **{k: v.cuda() for k, v in _outputs(tokens).items()}})
    document = _document(g.serialize())
    capability = torch.cuda.get_device_capability()
    assert all(shipping.KernelBinary.from_record(launch["binary"]).arch == capability[0] * 10 + capability[1]
               for plan in document["plans"] for launch in plan["launches"])
    _check_fresh_process_run(g, tmp_path, "cuda")


def test_a_size_the_blob_does_not_hold_is_built_on_first_use(built):
    loaded = dg.Graph.deserialize(built.serialize())
    assert loaded.plan.builds == 0 and sorted(loaded.plan.adopted) == [(RANGE[0],), (AHEAD,), (RANGE[1],)]
    assert "loaded from a serialized blob" in loaded.explain()
    for tokens in (AHEAD, 5, 33, 5):
        inputs = _inputs(tokens)
        _check(loaded, inputs, _executed(loaded, inputs))
    assert loaded.plan.builds == 2  # 5 and 33, each once
    # the loaded graph ships what it holds now, the sizes it built included
    again = dg.Graph.deserialize(loaded.serialize())
    assert (5,) in again.plan.adopted and (33,) in again.plan.adopted
    inputs = _inputs(33)
    _check(again, inputs, _executed(again, inputs))
    assert again.plan.builds == 0


def test_sizes_outside_the_range_or_disagreeing_write_nothing(built):
    loaded = dg.Graph.deserialize(built.serialize())
    for tokens in (RANGE[1] + 1,):
        outputs = _outputs(tokens)
        with pytest.raises(dg.ExecutionError, match="outside the declared range"):
            loaded.execute({**_inputs(tokens), **outputs})
        assert all(torch.isnan(value).all() for value in outputs.values())
    outputs = _outputs(6)
    with pytest.raises(dg.ExecutionError, match="agree"):  # x has 7 tokens, the outputs 6
        loaded.execute({**_inputs(7), **outputs})
    assert all(torch.isnan(value).all() for value in outputs.values())
    assert loaded.plan.builds == 0


def test_ahead_of_time_sizes_are_checked_and_a_failed_build_changes_nothing():
    g = _dynamic_block()
    for bad in ([{"tokens": RANGE[1] + 1}], [{"tokens": 3, "other": 2}], [{}], [{"tokens": 2.5}], {"tokens": 3},
                [{"tokens": True}]):
        with pytest.raises(dg.ValidationError):
            g.build(sizes=bad)
        assert g.plan is None
    static = dg.Graph(name="static")
    static.relu(static.tensor(name="x", dim=[3, 4])).set_output(True)
    with pytest.raises(dg.ValidationError, match="dynamic"):
        static.build(sizes=[{"tokens": 3}])
    g.build(sizes=[{"tokens": 2}, {"tokens": 2}, {"tokens": 39}])
    assert sorted(g.plan.sizes_built) == [(1,), (2,), (39,), (40,)]


def test_damaged_blobs_are_refused(built):
    blob = built.serialize()
    damaged = bytearray(blob)
    damaged[-20] ^= 0xFF
    for bad in (bytes(damaged), blob[:-9]):
        with pytest.raises(dg.SerializationError):
            dg.Graph.deserialize(bad)

    def plans(change):
        return lambda document: change(document["plans"])

    def edited_kernel(held):  # a kernel whose text is not the one its name hashes
        held[0]["launches"][0]["text"] = held[0]["launches"][0]["text"].replace("tl.program_id(0)",
                                                                              "tl.program_id(1)", 1)

    def static_graph(document):
        g = dg.Graph(name="static")
        g.relu(g.tensor(name="x", dim=[3, 4])).set_output(True)
        document["graph"] = g.to_json()

    def no_outputs(document):  # a graph that reads as JSON but does not validate
        graph = json.loads(document["graph"])
        for tensor in graph["tensors"]:
            tensor["is_output"] = False
        document["graph"] = json.dumps(graph)

    broken = [
        (lambda d: d.pop("plans"), "malformed"), (plans(lambda p: p.clear()), "list of plans"),
        (lambda d: d.__setitem__("plans", {"tokens": 1}), "list of plans"),
        (plans(lambda p: p[0].__setitem__("sizes", {"tokens": RANGE[1] + 1})), "sizes"),
        (plans(lambda p: p[0].__setitem__("sizes", {"rows": 3})), "sizes"),
        (plans(lambda p: p[0].__setitem__("sizes", [1])), "sizes"),
        (plans(lambda p: p[1].__setitem__("sizes", dict(p[0]["sizes"]))), "two plans"),
        (plans(lambda p: p[0]["groups"][0][1].append("an op of another partition")), "groups"),
        (plans(lambda p: p[0].pop("launches")), "malformed"),
        (plans(edited_kernel), "hash"), (static_graph, "no dynamic extents"),
        (plans(lambda p: p.pop(0)), "range's min"), (plans(lambda p: p.pop()), "range's max"),
        (no_outputs, "does not build"),
        (lambda d: d.__setitem__("version", shipping.DYNAMIC_BLOB_VERSION + 1), "version"),
    ]
    for change, message in broken:
        with pytest.raises(dg.SerializationError, match=message):
            dg.Graph.deserialize(_repacked(blob, change))


def test_blob_of_another_dnngraph_is_refused_or_rebuilt(built):
    blob = _repacked(built.serialize(), lambda document: document.__setitem__("dnngraph", "0" * 64))
    with pytest.raises(dg.SerializationError, match="another dnngraph"):
        dg.Graph.deserialize(blob)
    rebuilt = dg.Graph.deserialize(blob, rebuild=True)
    assert rebuilt.is_dynamic and rebuilt.plan.adopted == ()
    inputs = _inputs(11)
    _check(rebuilt, inputs, _executed(rebuilt, inputs))


def test_two_symbols_ship_with_their_sizes_by_name():
    """Sizes are keyed by symbol name, whatever order the symbols were declared in: a blob of a
    graph over (seq, batch) runs each held pair as loaded, and a pair it does not hold is built."""
    seq, batch = dg.dynamic("seq", 2, 9), dg.dynamic("batch", 1, 3)
    g = dg.Graph(name="pairs")
    x = g.tensor(name="x", dim=[seq, batch, 5])
    g.softmax(g.exp(x), axis=-1).set_output(True).set_name("y")
    g.build(sizes=[{"seq": 7, "batch": 2}])
    loaded = dg.Graph.deserialize(g.serialize())
    assert sorted(loaded.plan.adopted) == [(1, 2), (2, 7), (3, 9)]  # (batch, seq)
    for s, b in ((7, 2), (2, 1), (9, 3), (4, 3)):
        inputs = {"x": torch.randn(s, b, 5)}
        outputs = {"y": torch.full((s, b, 5), float("nan"))}
        loaded.execute({**inputs, **outputs})
        assert rel_err(outputs["y"], loaded.reference(inputs)["y"]) < TOLERANCE[torch.float32], (s, b)
    assert loaded.plan.builds == 1  # (4, 3) only
