"""DNNGRAPH_POISON_WORKSPACE (runtime/launch.py): plan workspaces start as NaN bytes, so a kernel
reading workspace bytes no launch wrote shows in CPU runs as it may on a GPU."""
import os
import subprocess
import sys

import torch

import dnngraph as dg
from dnngraph.runtime import launch, plan_cache
from helpers import poisoned


def test_the_variable_turns_poisoning_on():
    code = "from dnngraph.runtime import launch; print(launch.POISON_WORKSPACE)"
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, DNNGRAPH_POISON_WORKSPACE=value)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == expected, done.stderr[-2000:]


def test_poisoned_workspace_is_nan_bytes(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)
    buffer = launch.persistent_buffer(37, torch.device("cpu"))
    assert buffer.numel() == 37 and bool((buffer == 0xFF).all())
    assert torch.isnan(buffer[:4].view(torch.float32)).all() and torch.isnan(buffer[:1].view(torch.float8_e4m3fn)).all()


def test_a_plan_with_a_workspace_runs_on_it_poisoned(monkeypatch):
    """fp8 attention keeps v keys-minor in its workspace, padded past Skv: under poisoning the
    padding is NaN and the output still matches the reference (the kernel masks it)."""
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)
    plan_cache.clear()
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 1, 9, 16, generator=gen) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(1, 1, 11, 16, generator=gen) * 2).to(torch.float8_e4m3fn)
    g = dg.Graph(name="poisoned workspace")
    tq, tk = g.tensor_like(q, "q"), g.tensor_like(k, "k")
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scales = [g.tensor(name=name, dim=[1, 1, 1, 1], data_type=dg.float32) for name in names]
    o = g.sdpa_fp8(tq, tk, tk, *scales)[0].set_output(True).set_data_type(dg.float32)
    g.build()
    assert g.plan.workspace_size() > 0
    bindings = {"q": q, "k": k, **{name: torch.full((1, 1, 1, 1), 1.0) for name in names}}
    out = poisoned(o, "cpu")
    g.execute({**bindings, o: out})
    ref = g.reference(bindings)[o.name]
    assert not torch.isnan(out).any()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    plan_cache.clear()


def test_the_each_mode_turns_per_execute_poisoning_on():
    code = "from dnngraph.runtime import launch; print(launch.POISON_WORKSPACE, launch.POISON_EACH_EXECUTE)"
    for value, expected in (("each", "True True"), ("1", "True False"), ("0", "False False")):
        env = dict(os.environ, DNNGRAPH_POISON_WORKSPACE=value)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == expected, done.stderr[-2000:]


def _split_k_graph():
    """A matmul forced to split K: partials in the workspace, then a combine kernel."""
    from dnngraph.backends.triton.heuristics import matmul as mm
    g = dg.Graph(name="split k poisoned each execute")
    a, b = g.tensor(name="a", dim=[20, 200]), g.tensor(name="b", dim=[200, 24])
    c = g.matmul(a, b).set_output(True).set_name("c")
    g.build(options=dg.BuildOptions(matmul_config=mm.MatmulConfig("split_k", 32, 16, 16, 4, 2, split_k=3)))
    assert g.plan.workspace_size() > 0
    return g, c


def _workspace_seen_at_launch(monkeypatch) -> list:
    """Every execute's workspace bytes as its first launch finds them (plan.run_launches wrapped)."""
    from dnngraph.runtime import plan as plan_module
    seen, run = [], plan_module.run_launches

    def recording(launches, tensors, *rest):
        workspace = [t for uid, t in tensors.items() if uid not in bound_uids]
        seen.append(torch.cat([t.reshape(-1).view(torch.uint8) for t in workspace]).clone())
        return run(launches, tensors, *rest)

    bound_uids = set()
    monkeypatch.setattr(plan_module, "run_launches", recording)
    return seen, bound_uids


def test_each_execute_finds_its_workspace_poisoned_whatever_the_last_left(monkeypatch):
    """=each: a second execute's launches find the workspace as poison bytes again, not the
    partials the first one left (a kernel relying on those would be caught)."""
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)
    monkeypatch.setattr(launch, "POISON_EACH_EXECUTE", True)
    plan_cache.clear()
    g, c = _split_k_graph()
    seen, bound_uids = _workspace_seen_at_launch(monkeypatch)
    bound_uids.update(g.plan.key_to_uid[key] for key in ("a", "b", "c"))
    inputs = {"a": torch.randn(20, 200), "b": torch.randn(200, 24)}
    outputs = []
    for _ in range(2):
        out = poisoned(c, "cpu")
        g.execute({**inputs, c: out})
        outputs.append(out)
    assert len(seen) == 2 and all(bool((bytes_ == 0xFF).all()) for bytes_ in seen), "workspace not re-poisoned"
    assert torch.equal(outputs[0], outputs[1])
    ref = g.reference(inputs)["c"]
    assert (outputs[1].double() - ref).norm() / ref.norm() < 1e-5
    plan_cache.clear()


def test_each_execute_poisons_a_caller_workspace_too(monkeypatch):
    monkeypatch.setattr(launch, "POISON_EACH_EXECUTE", True)
    plan_cache.clear()
    g, c = _split_k_graph()
    workspace = torch.zeros(g.plan.workspace_size(), dtype=torch.uint8)
    inputs = {"a": torch.randn(20, 200), "b": torch.randn(200, 24)}
    seen, bound_uids = _workspace_seen_at_launch(monkeypatch)
    bound_uids.update(g.plan.key_to_uid[key] for key in ("a", "b", "c"))
    out = poisoned(c, "cpu")
    g.execute({**inputs, c: out}, workspace=workspace)
    assert len(seen) == 1 and bool((seen[0] == 0xFF).all())
    ref = g.reference(inputs)["c"]
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    plan_cache.clear()
