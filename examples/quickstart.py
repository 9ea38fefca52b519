"""Quickstart: build a fused graph, run it, check it against the reference, explain it.

Runs on a GPU when torch sees one, else on CPU through Triton's interpreter (nothing to set).
"""
import torch

import dnngraph as dg

device = "cuda" if torch.cuda.is_available() else "cpu"
g = dg.Graph(name="bias_gelu_residual", io_data_type=dg.float32)
x = g.tensor(name="x", dim=[64, 96])
bias = g.tensor(name="bias", dim=[1, 96])
residual = g.tensor(name="residual", dim=[64, 96])
pre = g.add(x, bias).set_output(True).set_name("pre")        # kept for a backward pass
y = g.add(g.gelu(pre), residual).set_output(True).set_name("y")
g.build()

inputs = {x: torch.randn(64, 96, device=device), "bias": torch.randn(1, 96, device=device),
          "residual": torch.randn(64, 96, device=device)}
outputs = {"pre": torch.empty(64, 96, device=device), y: torch.empty(64, 96, device=device)}
g.execute({**inputs, **outputs})

reference = g.reference({k: v.cpu() for k, v in inputs.items()})
for name, value in (("pre", outputs["pre"]), ("y", outputs[y])):
    error = (value.double().cpu() - reference[name]).norm() / reference[name].norm()
    print(f"{name}: relative error vs float64 reference = {error:.2e}")
    assert error < 1e-5
print(g.explain())
text = g.to_json()
assert dg.Graph.from_json(text).to_json() == text
print("ok: one fused kernel, matches the reference, round-trips through JSON")
