"""Built plans that ship: Graph.serialize() / Graph.deserialize(blob) in another process without
lowering or compiling, ahead-of-time blobs for a named GPU model, and the blobs refused."""
import hashlib
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
from dnngraph.target import H100, H200, target_of
from helpers import TOLERANCE, poisoned, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in the loading process before it loads a blob: every way to lower, rank or compile a
# kernel raises, so a load that needed one fails.
NOTHING_BUILT = textwrap.dedent("""
    import triton, triton.compiler, triton.compiler.compiler
    from triton.runtime.jit import JITFunction
    import dnngraph as dg
    from dnngraph import build, shipping
    from dnngraph.backends import registry

    def refused(*args, **kwargs):
        raise AssertionError("a shipped plan was lowered or compiled while loading or running")

    build.build_launches = build._build_new = build.lower_ranked = shipping.build_launches = refused
    registry.ranked = registry.supporting = registry.choices = refused
    for backend in registry.BACKENDS.values():
        backend.lower = refused
    triton.compile = triton.compiler.compile = triton.compiler.compiler.compile = refused
    JITFunction.warmup = JITFunction.run = refused
""")


def _declared_block(x_shape=(2, 19, 23), n=13):
    """Two kernels with a virtual tensor between them in the workspace: a matmul with a
    transposed weight and a broadcast bias in its epilogue, then a softmax and a row sum of it."""
    g = dg.Graph(name="shipped")
    x = g.tensor(name="x", dim=list(x_shape))
    w = g.tensor(name="w", dim=[x_shape[0], x_shape[2], n], stride=[x_shape[2] * n, 1, x_shape[2]])
    b = g.tensor(name="b", dim=[1, 1, n])
    h = g.relu(g.add(g.matmul(x, w), b))
    y = g.softmax(h, axis=-1)
    y.set_output(True).set_name("y")
    s = g.reduction(g.exp(h), "sum", [2])
    s.set_output(True).set_name("s")
    return g


def _inputs(g) -> dict:
    x, w, b = (g.tensor_by_name(name) for name in ("x", "w", "b"))
    # scaled as layers initialise, so h stays O(1): exp(h) turns h's absolute rounding error
    # into relative error, and at |h| ~ 50 no float32 kernel meets the float32 tolerance on s
    weight = torch.randn(w.dim[0], w.dim[2], w.dim[1]).transpose(1, 2) / w.dim[1] ** 0.5  # the declared strides
    assert weight.stride() == tuple(w.stride)
    return {"x": torch.randn(x.dim), "w": weight, "b": torch.randn(b.dim)}


def _executed(g, inputs) -> dict:
    device = next(iter(inputs.values())).device
    outputs = {t.name: poisoned(t, device) for t in g.outputs()}
    g.execute({**inputs, **outputs})
    return outputs


def _in_fresh_process(tmp_path, blob: bytes, inputs: dict, prelude: str = NOTHING_BUILT, loads="", fails=False):
    """Outputs of the blob's graph executed on `inputs` in a new Python process (`python -c`)
    after `prelude`; `loads`: extra keyword arguments of deserialize, as source text. With
    `fails`, the process must fail: its stderr is returned."""
    torch.save({"blob": blob, "inputs": inputs}, tmp_path / "shipped.pt")
    script = prelude + textwrap.dedent(f"""
        import torch
        from helpers import poisoned
        data = torch.load({str(tmp_path / 'shipped.pt')!r})
        g = dg.Graph.deserialize(data["blob"]{loads})
        device = next(iter(data["inputs"].values())).device
        outputs = {{t.name: poisoned(t, device) for t in g.outputs()}}
        g.execute({{**data["inputs"], **outputs}})
        torch.save(outputs, {str(tmp_path / 'outputs.pt')!r})
    """)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                       DNNGRAPH_CACHE_DIR=str(tmp_path / "fresh-cache"))
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=600)
    if fails:
        assert done.returncode != 0
        return done.stderr
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(tmp_path / "outputs.pt")


def _check_against_reference(g, inputs, outputs):
    reference = g.reference(inputs)
    for name, value in outputs.items():
        assert rel_err(value, reference[name]) < TOLERANCE[torch.float32], name


def test_blob_runs_in_a_fresh_process_without_lowering_or_compiling(tmp_path):
    g = _declared_block().build()
    assert g.plan.workspace_bytes > 0 and len(g.plan.launches) >= 2
    inputs = _inputs(g)
    here = _executed(g, inputs)
    there = _in_fresh_process(tmp_path, g.serialize(), inputs)
    for name in here:
        assert torch.equal(here[name], there[name]), name  # the same kernels on the same inputs
    _check_against_reference(g, inputs, there)


def test_fresh_process_check_catches_a_build(tmp_path):
    """The check above can fail: a blob that must be rebuilt (another dnngraph wrote it) does
    lower in the loading process, and the prelude stops it."""
    g = _declared_block().build()
    blob = _repacked(g.serialize(), lambda document: document.__setitem__("dnngraph", "0" * 64))
    stderr = _in_fresh_process(tmp_path, blob, _inputs(g), loads=", rebuild=True", fails=True)
    assert "lowered or compiled" in stderr


def test_loaded_graph_answers_as_the_built_one():
    g = _declared_block().build()
    loaded = dg.Graph.deserialize(g.serialize())
    assert loaded.to_json() == g.to_json()
    assert [launch.source_path.name for launch in loaded.plan.launches] == \
           [launch.source_path.name for launch in g.plan.launches]
    assert [launch.config_text for launch in loaded.plan.launches] == [launch.config_text for launch in g.plan.launches]
    assert loaded.plan.workspace_bytes == g.plan.workspace_bytes
    assert "loaded from a serialized plan" in loaded.explain() and "loaded" not in g.explain()
    inputs = _inputs(g)
    _check_against_reference(loaded, inputs, _executed(loaded, inputs))
    # a second load in one process reuses the loaded kernels, and binds its own handles
    again = dg.Graph.deserialize(g.serialize())
    assert again.plan.launches[0].kernel is loaded.plan.launches[0].kernel
    with pytest.raises(dg.ExecutionError, match="missing binding"):
        again.execute({"x": inputs["x"]})


def _repacked(blob: bytes, change) -> bytes:
    """The blob with change(document) applied and its digest made right again (a blob another
    machine or version would have written)."""
    document = json.loads(zlib.decompress(blob[len(shipping.MAGIC):].partition(b"\n")[2]))
    change(document)
    payload = json.dumps(document, sort_keys=True).encode()
    return shipping.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + zlib.compress(payload)


@pytest.mark.parametrize("field,value", [("dnngraph", "0" * 64), ("triton", "3.6.1"), ("version", 3)])
def test_blob_of_another_dnngraph_or_triton_is_refused_or_rebuilt(field, value):
    g = _declared_block().build()
    blob = _repacked(g.serialize(), lambda document: document.__setitem__(field, value))
    with pytest.raises(dg.SerializationError):
        dg.Graph.deserialize(blob)
    rebuilt = dg.Graph.deserialize(blob, rebuild=True)
    inputs = _inputs(rebuilt)
    _check_against_reference(rebuilt, inputs, _executed(rebuilt, inputs))


def test_blob_for_another_target_is_refused_or_rebuilt():
    """A blob whose plan is for one target, loaded where the build plans for another (here: its
    options name the H200, its launches are the interpreter's), is refused; rebuild builds for
    the machine's."""
    g = _declared_block().build()

    def for_h200(document):
        document["options"]["target"] = shipping._encoded(H200)

    blob = _repacked(g.serialize(), for_h200)
    with pytest.raises(dg.SerializationError, match="NVIDIA H200"):
        dg.Graph.deserialize(blob)
    rebuilt = dg.Graph.deserialize(blob, rebuild=True)
    assert rebuilt.plan.target == H200
    inputs = _inputs(rebuilt)
    _check_against_reference(rebuilt, inputs, _executed(rebuilt, inputs))


def test_damaged_or_foreign_blobs_are_refused():
    g = _declared_block().build()
    blob = g.serialize()
    damaged = bytearray(blob)
    damaged[-20] ^= 0xFF
    for bad in (bytes(damaged), blob[:-9], b"not a plan", b""):
        with pytest.raises(dg.SerializationError):
            dg.Graph.deserialize(bad)
    with pytest.raises(dg.SerializationError, match="bytes"):
        dg.Graph.deserialize("a text")

    def edited_kernel(document):  # a kernel whose text is not the one its name hashes
        document["launches"][0]["text"] = document["launches"][0]["text"].replace("tl.program_id(0)",
                                                                                "tl.program_id(1)", 1)

    with pytest.raises(dg.SerializationError, match="hash"):
        dg.Graph.deserialize(_repacked(blob, edited_kernel))

    def other_groups(document):
        document["groups"][0][1].append("an op of another partition")

    with pytest.raises(dg.SerializationError, match="groups"):
        dg.Graph.deserialize(_repacked(blob, other_groups))
    for broken in (lambda d: d["launches"][0].pop("grid"), lambda d: d["launches"][-1].__setitem__("group", 99),
                   lambda d: d["launches"][0]["scratch"].append([-1, [4], "no_dtype"]),
                   lambda d: d["options"].__setitem__("target", {"type": "os.system", "fields": {}}),
                   lambda d: d["options"].__setitem__("autotune_top", -3), lambda d: d.pop("launches")):
        with pytest.raises(dg.SerializationError):
            dg.Graph.deserialize(_repacked(blob, broken))
    with pytest.raises(dg.ValidationError):
        dg.Graph.deserialize(blob, rebuild="yes")


def test_layout_views_and_copies_round_trip():
    """A partition with views and copies (transpose, concatenate, reshape): the loaded plan's
    groups, workspace and results are the built one's."""
    g = dg.Graph(name="views")
    x, z = g.tensor(name="x", dim=[3, 6, 5]), g.tensor(name="z", dim=[3, 5, 7])
    joined = g.concatenate([g.transpose(g.exp(x), [0, 2, 1]), g.relu(z)], axis=2)
    g.reduction(g.reshape(joined, [3, 65]), "max", [1]).set_output(True).set_name("y")
    g.sigmoid(joined).set_output(True).set_name("c")
    g.build()
    loaded = dg.Graph.deserialize(g.serialize())
    assert loaded.plan.workspace_tensors == g.plan.workspace_tensors
    inputs = {"x": torch.randn(3, 6, 5), "z": torch.randn(3, 5, 7)}
    here, there = _executed(g, inputs), _executed(loaded, inputs)
    assert all(torch.equal(here[name], there[name]) for name in here)
    _check_against_reference(g, inputs, there)


def test_host_checks_are_remade_on_load():
    """A launch that checks bound input values on the host (MoE expert offsets) keeps its
    check when loaded: bad offsets raise ExecutionError naming the node and write nothing."""
    g = dg.Graph(name="experts")
    token, weight = torch.randn(21, 9), torch.randn(3, 9, 5)
    tok, w = g.tensor_like(token, name="tok"), g.tensor_like(weight, name="w")
    off = g.tensor(name="off", dim=[3], data_type=dg.int32)
    g.moe_grouped_matmul(tok, w, off).set_output(True).set_name("y")
    g.build()
    assert any(launch.host_checks for launch in g.plan.launches)
    loaded = dg.Graph.deserialize(g.serialize())
    assert [bool(l.host_checks) for l in loaded.plan.launches] == [bool(l.host_checks) for l in g.plan.launches]
    good = {"tok": token, "w": weight, "off": torch.tensor([0, 12, 12], dtype=torch.int32)}
    _check_against_reference(loaded, good, _executed(loaded, good))
    output = poisoned(loaded.tensor_by_name("y"))
    with pytest.raises(dg.ExecutionError, match="moe_grouped_matmul"):
        loaded.execute({**good, "off": torch.tensor([0, 15, 12], dtype=torch.int32), "y": output})
    assert torch.isnan(output).all()


def test_ctc_length_checks_are_remade_on_load():
    g = dg.Graph(name="ctc")
    log_probs = torch.randn(6, 3, 5).log_softmax(-1)
    targets = torch.tensor([[1, 2], [3, 3], [4, 1]])
    lengths, target_lengths = torch.tensor([6, 4, 5]), torch.tensor([2, 2, 1])
    handles = [g.tensor_like(v, name=n) for v, n in ((log_probs, "x"), (targets, "t"), (lengths, "a"),
                                                     (target_lengths, "b"))]
    g.ctc_loss(*handles, reduction="sum").set_output(True).set_name("loss")
    loaded = dg.Graph.deserialize(g.build().serialize())
    good = {"x": log_probs, "t": targets, "a": lengths, "b": target_lengths}
    _check_against_reference(loaded, good, _executed(loaded, good))
    output = poisoned(loaded.tensor_by_name("loss"))
    with pytest.raises(dg.ExecutionError, match="ctc_loss"):
        loaded.execute({**good, "a": torch.tensor([6, 9, 5]), "loss": output})  # a length past T
    assert torch.isnan(output).all()


def test_unbuilt_graph_does_not_serialize():
    with pytest.raises(dg.ExecutionError, match="not built"):
        _declared_block().serialize()


def test_ahead_of_time_blob_for_h100_holds_sm90_binaries(tmp_path, monkeypatch):
    """Built for the H100 on a machine without one: the blob holds, for every launch, a cubin
    and PTX for sm_90a compiled by Triton in a process of its own; loaded here it runs its
    sources through the interpreter, planned as for the H100."""
    g = _declared_block().build(options=dg.BuildOptions(target=H100))
    assert g.plan.target == H100
    blob = g.serialize()
    document = json.loads(zlib.decompress(blob[len(shipping.MAGIC):].partition(b"\n")[2]))
    assert document["target"]["fields"]["name"] == H100.name
    assert len(document["launches"]) == len(g.plan.launches)
    for record in document["launches"]:
        binary = shipping.KernelBinary.from_record(record["binary"])
        assert binary.arch == 90 and json.loads(binary.metadata)["target"]["backend"] == "cuda"
        assert ".target sm_90a" in binary.asm["ptx"]
        assert binary.asm["cubin"][:4] == b"\x7fELF"
        assert binary.name == record["name"]
    inputs = _inputs(g)
    there = _in_fresh_process(tmp_path, blob, inputs)
    _check_against_reference(g, inputs, there)
    # what a GPU would launch: Triton's CompiledKernel of each stored binary, its launcher's
    # signature in the kernel's argument order (the launcher passes arguments by position)
    loaded = dg.Graph.deserialize(blob)
    for launch in loaded.plan.launches:
        compiled = launch.binary.load(launch.kernel)
        assert list(compiled.src.signature) == [argument.name for argument in launch.arguments]
        assert compiled.metadata.target.arch == 90 and compiled.metadata.num_warps == launch.num_warps
        assert compiled.asm["cubin"] == launch.binary.asm["cubin"]
    # a loaded plan serializes its binaries as they came, compiling nothing
    monkeypatch.setattr(shipping, "compile_for", None)
    assert dg.Graph.deserialize(loaded.serialize()).plan.launches[0].binary == loaded.plan.launches[0].binary


def test_options_and_targets_round_trip():
    from dnngraph.backends.triton.heuristics.sdpa import AttentionConfig

    options = dg.BuildOptions(target=H200, sdpa_config=AttentionConfig(32, 64, 4, 2), workspace_limit=0,
                              plan=(1, 0), backends=("triton",))
    assert shipping.options_of(json.loads(json.dumps(shipping.options_record(options)))) == options


# --- GPU: compiled binaries ship ----------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_blob_loads_in_a_fresh_process_without_compiling(tmp_path):
    g = _declared_block(x_shape=(3, 129, 200), n=77).build()
    inputs = {k: v.cuda() for k, v in _inputs(g).items()}
    here = _executed(g, inputs)
    blob = g.serialize()
    document = json.loads(zlib.decompress(blob[len(shipping.MAGIC):].partition(b"\n")[2]))
    capability = torch.cuda.get_device_capability()
    assert all(shipping.KernelBinary.from_record(r["binary"]).arch == capability[0] * 10 + capability[1]
               for r in document["launches"])
    there = _in_fresh_process(tmp_path, blob, inputs)
    for name in here:
        assert torch.equal(here[name].cpu(), there[name].cpu()), name
    _check_against_reference(g, {k: v.cpu() for k, v in inputs.items()}, {k: v.cpu() for k, v in there.items()})


@pytest.mark.gpu
def test_ahead_of_time_blob_built_without_the_gpu_runs_on_it(tmp_path):
    """Built and serialized in a process that sees no GPU (the interpreter's), for this GPU's
    model by name; loaded here, it runs its shipped binaries without compiling."""
    here_target = target_of(torch.device("cuda", 0))
    if here_target not in (H100, H200):
        pytest.skip(f"{here_target.name} is not a named target")
    name = "H100" if here_target == H100 else "H200"
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests', 'api')!r}, {os.path.join(ROOT, 'tests')!r}]
        import dnngraph as dg
        from dnngraph.target import {name}
        from test_shipping import _declared_block
        g = _declared_block(x_shape=(3, 129, 200), n=77).build(options=dg.BuildOptions(target={name}))
        open({str(tmp_path / 'aot.blob')!r}, "wb").write(g.serialize())
    """)
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="", DNNGRAPH_CACHE_DIR=str(tmp_path / "aot-cache"))
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    blob = (tmp_path / "aot.blob").read_bytes()
    g = _declared_block(x_shape=(3, 129, 200), n=77)
    inputs = {k: v.cuda() for k, v in _inputs(g).items()}
    there = _in_fresh_process(tmp_path, blob, inputs)
    _check_against_reference(g, {k: v.cpu() for k, v in inputs.items()}, {k: v.cpu() for k, v in there.items()})


@pytest.mark.gpu
def test_gpu_blob_for_another_model_is_refused():
    g = _declared_block().build()
    other = H200 if target_of(torch.device("cuda", 0)) != H200 else H100

    def for_other(document):
        document["target"] = shipping._encoded(other)

    with pytest.raises(dg.SerializationError, match=other.name):
        dg.Graph.deserialize(_repacked(g.serialize(), for_other))
