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
