"""Shared test helpers: poisoned outputs, float64 comparison, graph execution, sm_90 compiles."""
import os
import subprocess
import sys

import torch

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any() or torch.isnan(ref).any(), "NaN in output (unwritten?)"
    denom = ref.norm().item() or 1.0
    return (out - ref).norm().item() / denom


def poisoned(tensor_handle, device="cpu") -> torch.Tensor:
    """An output buffer with the handle's dims, strides and dtype, filled with poison."""
    t = torch.empty_strided(tensor_handle.dim, tensor_handle.stride,
                            dtype=tensor_handle.data_type.torch_dtype, device=device)
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.copy_(torch.randint(0, 2, t.shape, device=device).bool())
    else:
        t.fill_({torch.int8: -77, torch.uint8: 177}.get(t.dtype, -12345))  # 8-bit types: a value that fits
    return t


def run(graph, inputs: dict, device="cpu", options=None) -> dict:
    """Build (if needed, or always with `options`, a BuildOptions) and execute with poisoned
    outputs; returns name -> output tensor."""
    if options is not None or graph.plan is None:
        graph.build(options=options)
    outputs = {t.name: poisoned(t, device) for t in graph.outputs()}
    graph.execute({**inputs, **outputs})
    return outputs


def check(graph, inputs: dict, dtype=torch.float32, device="cpu", tolerance=None, options=None,
          reference_device="cpu"):
    """Execute (built with `options` where given) and compare every output with the float64
    reference, computed on `reference_device` ("cuda" for a GPU test at a size whose float64
    reference would take the CPU minutes, shared with other test workers)."""
    outputs = run(graph, inputs, device, options)
    refs = graph.reference({k: v.to(reference_device) for k, v in inputs.items()})
    limit = tolerance or TOLERANCE[dtype]
    for name, out in outputs.items():
        ref = refs[name].cpu()
        if ref.dtype == torch.bool:
            assert torch.equal(out.cpu().bool(), ref), name
            continue
        out_d = out.double().cpu()
        # equal values (infinities included) and NaN where the reference is NaN count as exact
        same = (torch.isnan(out_d) & torch.isnan(ref)) | (out_d == ref)
        assert not torch.isnan(out_d[~same]).any(), f"{name}: NaN in output (unwritten?)"
        # equal entries leave the numerator only: the whole finite reference scales the error,
        # so one differing ulp among exact values is not a large relative error
        scale = torch.where(torch.isfinite(ref), ref, 0.0).norm().item() or 1.0
        err = (out_d[~same] - ref[~same]).norm().item() / scale
        assert err < limit, f"{name}: relative error {err:.3g} >= {limit}"
    return outputs


def compiled_for_sm90(spec: str, timeout: int = 600, env=None) -> str:
    """Run tests/sm90_compile.py on `spec` ("module:function", the module in tests/ or in a layer's
    folder below it) in a process without the interpreter (and with `env`'s variables); its output
    (it printed "compiled N kernels for sm_90") or the failure."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="0", **(env or {}),
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, os.path.join(here, "sm90_compile.py"), spec],
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# The opening of every script clean_under_consan runs: the test folders on the path (its
# {paths!r} is formatted in) and the allocator consan's instrumentation takes its scratch from.
CONSAN_HEAD = """
import dataclasses, sys
import torch, triton
sys.path[:0] = {paths!r}
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
"""


def clean_under_consan(script_template: str, test_file: str, cache_dir) -> None:
    """Run `script_template` (formatted with paths=[the test's folder, tests/]) in a fresh process
    under Triton's concurrency sanitizer (TRITON_INSTRUMENTATION_MODE=consan, a kernel cache of its
    own in `cache_dir`) and assert it ends by printing "consan clean": a race or a barrier misuse in
    a warp-specialized kernel aborts it."""
    here = os.path.dirname(os.path.abspath(test_file))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INSTRUMENTATION_MODE="consan", DNNGRAPH_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    script = script_template.format(paths=[here, tests])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "consan clean" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
