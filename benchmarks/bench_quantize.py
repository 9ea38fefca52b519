"""Block-scale quantization (MXFP8, NVFP4) against a device copy measured in the same process and
a torch eager implementation of the same rules, in TB/s over the minimal bytes (x read once, the
quantized elements and scales written once). Goal: >= 85% of copy. A second table times the
block-scaled matmul (dequantized in the operand loader) against cuBLAS on the bf16 operands.

    python benchmarks/bench_quantize.py            # GPU tables
    python benchmarks/bench_quantize.py --cpu      # a small CPU check through Triton's interpreter
    python benchmarks/bench_quantize.py --sweep    # every candidate config of the quantize kernel timed
                                                   # (heuristics/block_scale.py), its bytes checked
                                                   # against the eager rules (a mismatch printed:
                                                   # count, first byte, the reference's byte)
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dnngraph as dg  # noqa: E402
from dnngraph import dtypes  # noqa: E402
from dnngraph.backends.triton.heuristics.block_scale import candidates  # noqa: E402
from dnngraph.ops.block_scale import BlockScaleQuantizeAttrs, float32_quotient, pack_fp4, quantize_reference  # noqa: E402
from common import copy_ceiling_tbs, median_ms, print_table  # noqa: E402

# name -> (element type, scale type, block size)
FORMATS = {"mxfp8": (dg.float8_e4m3, dg.float8_e8m0, 32), "nvfp4": (dg.float4_e2m1, dg.float8_e4m3, 16)}
SHAPES = [("llama-hidden", (16384, 4096)), ("llama-mlp", (8192, 14336)), ("square", (8192, 8192))]
MATMUL_SHAPES = [("4096^3", (4096, 4096, 4096)), ("tokens x mlp", (8192, 14336, 4096))]
FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SWEEP_SHAPE = ("llama-mlp", (8192, 14336))


def quantize_graph(x: torch.Tensor, fmt: str, config=None):
    """The quantize graph of `x` into `fmt`, built (under `config`, a BlockScaleConfig, where given)."""
    y_type, scale_type, block = FORMATS[fmt]
    g = dg.Graph(name=f"quantize_{fmt}", io_data_type=dtypes.from_torch(x.dtype))
    gx = g.tensor_like(x, "x")
    y, scale = g.block_scale_quantize(gx, block_size=block)
    y.set_name("y").set_output(True).set_data_type(y_type)
    scale.set_name("scale").set_output(True).set_data_type(scale_type)
    g.build(options=dg.BuildOptions(block_scale_config=config))
    return g


def storage(g, name: str, device) -> torch.Tensor:
    tensor = g.tensor_by_name(name)
    shape, strides = dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)
    return torch.empty_strided(shape, strides, dtype=tensor.data_type.torch_dtype, device=device)


def torch_quantize(x: torch.Tensor, fmt: str):
    """The same rules in torch eager ops (float32 math, correctly rounded on every device):
    (elements, scales) as stored."""
    y_type, scale_type, block = FORMATS[fmt]
    blocks = x.float().view(*x.shape[:-1], x.shape[-1] // block, block)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(-1, keepdim=True)
    if scale_type is dg.float8_e8m0:
        mantissa, exponent = torch.frexp(amax)
        k = (exponent - 9 + (mantissa > 0.875).int()).clamp(-127, 127)  # 448 = 0.875 * 2^9
        k = torch.where(amax > 0, k, -127)
        scaled = torch.where(finite, blocks * torch.exp2(-k.float()), 0.0)
        elements = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        scales = torch.where(finite, k + 127, 255).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        fp32_scale = float32_quotient(amax, 6.0)  # not amax / 6.0: on CUDA, amax * fl(1 / 6)
        normal = fp32_scale >= 2.0 ** -126
        scaled = blocks * torch.where(normal, 1.0 / torch.where(normal, fp32_scale, 1.0), 0.0)
        scaled = torch.where(finite, scaled, 0.0)
        magnitude = scaled.abs().clamp(max=6.0)
        code = torch.zeros_like(magnitude, dtype=torch.uint8)
        for index, midpoint in enumerate(FP4_MIDPOINTS):  # ties to even: up at the odd midpoints
            code += (magnitude >= midpoint if index % 2 else magnitude > midpoint).to(torch.uint8)
        code += torch.signbit(scaled).to(torch.uint8) * 8
        elements = (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.float4_e2m1fn_x2)
        scales = torch.where(finite, fp32_scale, math.nan).to(torch.float8_e4m3fn)
    return elements, scales.squeeze(-1)


def minimal_bytes(x: torch.Tensor, fmt: str) -> int:
    y_type, _, block = FORMATS[fmt]
    out = x.numel() // y_type.elements_per_item + x.numel() // block
    return x.numel() * x.element_size() + out


def check(g, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor):
    ref = g.reference({"x": x.cpu()})
    scale_type = g.tensor_by_name("scale").data_type
    assert torch.equal(scale.cpu().view(torch.uint8), ref["scale"].to(scale_type.torch_dtype).view(torch.uint8))
    if y.dtype == torch.float4_e2m1fn_x2:
        assert torch.equal(y.cpu().view(torch.uint8), pack_fp4(ref["y"]).view(torch.uint8))
    else:
        assert torch.equal(y.cpu().view(torch.uint8), ref["y"].to(y.dtype).view(torch.uint8))


def run_case(name, shape, fmt, dtype, device, ceiling=None):
    x = torch.randn(shape, device=device).to(dtype)
    g = quantize_graph(x, fmt)
    y, scale = storage(g, "y", device), storage(g, "scale", device)
    quantize = lambda: g.execute({"x": x, "y": y, "scale": scale})
    quantize()
    if device == "cpu" or math.prod(shape) <= 1 << 20:
        check(g, x, y, scale)
    if device == "cpu":
        return [name, fmt, str(dtype).split(".")[-1], "bit-exact"]
    nbytes = minimal_bytes(x, fmt)
    ms, eager_ms = median_ms(quantize), median_ms(lambda: torch_quantize(x, fmt))
    tbs = nbytes / ms / 1e9
    return [name, fmt, str(dtype).split(".")[-1], f"{tbs:.2f}", f"{tbs / ceiling:.0%}", f"{eager_ms / ms:.2f}x",
            g.plan.launches[0].config_text]


def matmul_row(name, m, n, k, fmt, device="cuda"):
    """The block-scaled GEMM (both operands quantized, dequantized in the loader) in TFLOP/s,
    against torch.matmul of the dequantized bf16 operands (cuBLAS); on the CPU, its error
    against the float64 reference."""
    y_type, scale_type, block = FORMATS[fmt]
    a_x, b_x = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    quantized = []
    for value in (a_x, b_x):
        g = quantize_graph(value, fmt)
        y, scale = storage(g, "y", device), storage(g, "scale", device)
        g.execute({"x": value, "y": y, "scale": scale})
        quantized.append((y, scale))
    (a_q, a_s), (b_q, b_s) = quantized
    g = dg.Graph(name=f"matmul_{fmt}")
    logical = lambda t: [s if s == 1 else s * y_type.elements_per_item for s in t.stride()]
    a = g.tensor(name="a", dim=[m, k], stride=logical(a_q), data_type=y_type)
    b = g.tensor(name="b", dim=[k, n], stride=logical(b_q.t()), data_type=y_type)
    sa, sb = g.tensor_like(a_s, "sa"), g.tensor_like(b_s.t(), "sb")
    c = g.matmul(g.block_scale_dequantize(a, sa, block_size=[1, block]),
                 g.block_scale_dequantize(b, sb, block_size=[block, 1]))
    c.set_name("c").set_output(True).set_data_type(dg.float32 if device == "cpu" else dg.bfloat16)
    g.build()
    out = torch.empty(m, n, device=device, dtype=c.data_type.torch_dtype)
    inputs = {"a": a_q, "b": b_q.t(), "sa": a_s, "sb": b_s.t()}
    run = lambda: g.execute({**inputs, "c": out})
    run()
    if device == "cpu":
        ref = g.reference({key: value.cpu() for key, value in inputs.items()})["c"]
        return [name, fmt, f"{((out.double() - ref).norm() / ref.norm()).item():.1e}"]
    a_bf, b_bf = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms, cublas_ms = median_ms(run), median_ms(lambda: torch.matmul(a_bf, b_bf))
    flops = 2 * m * n * k
    return [name, fmt, f"{flops / ms / 1e9:.0f}", f"{flops / cublas_ms / 1e9:.0f}", f"{cublas_ms / ms:.2f}x",
            g.plan.launches[0].config_text]


def reference_bytes(fmt: str, x: torch.Tensor):
    """(elements, scales) as the float64 reference stores them for `x` (blocks along the last
    axis), on the CPU: for the rows where the kernel and the eager rules disagree."""
    y_type, scale_type, block = FORMATS[fmt]
    attrs = BlockScaleQuantizeAttrs(block_size=block, axis=x.dim() - 1)
    elements, scales = quantize_reference(x.cpu(), attrs, y_type, scale_type)
    packed = pack_fp4(elements) if y_type is dg.float4_e2m1 else elements.to(y_type.torch_dtype)
    return packed.view(torch.uint8), scales.to(scale_type.torch_dtype).view(torch.uint8)


def first_difference(name: str, got: torch.Tensor, want: torch.Tensor, referee) -> str:
    """'' where the byte tensors [rows, ...] are equal, else how many bytes differ and the first:
    its index, both bytes, and the float64 reference's byte there (`referee(row)`: its bytes of
    that row, this tensor's)."""
    differ = got != want
    count = int(differ.sum())
    if not count:
        return ""
    flat = int(differ.flatten().nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)]
    refereed = int(referee(index[0])[tuple(index[1:])])
    return (f"{name}: {count} of {got.numel()} bytes differ, first at {index}: kernel 0x{int(got.flatten()[flat]):02x}, "
            f"eager 0x{int(want.flatten()[flat]):02x}, float64 reference 0x{refereed:02x}")


def byte_mismatches(fmt: str, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> list:
    """What differs between the kernel's (y, scale) of 2-D `x` and the bytes the torch eager rules
    store (the anchor a CPU test holds bit-exact with the float64 reference): a check at any size,
    on the device. One line per tensor that differs (elements, scales), each naming the first
    differing byte and which side the float64 reference takes there; empty where none."""
    eager_y, eager_scale = torch_quantize(x, fmt)
    referee = lambda part: lambda row: reference_bytes(fmt, x[row:row + 1])[part][0]
    found = [first_difference("elements", y.view(torch.uint8), eager_y.reshape(y.shape).view(torch.uint8), referee(0)),
             first_difference("scales", scale.view(torch.uint8), eager_scale.view(torch.uint8), referee(1))]
    return [line for line in found if line]


def sweep_rows(shape, device="cuda", ceiling=None, x_dtypes=(torch.bfloat16, torch.float32)):
    """A row per (x dtype, format, candidate config at `shape`): each config's bytes checked
    against the eager rules, then (on the GPU) timed; the model's pick marked."""
    rows = []
    for dtype in x_dtypes:
        x = (torch.randn(shape, device=device) * 30).to(dtype)
        for fmt, (_, _, block) in FORMATS.items():
            model = quantize_graph(x, fmt).plan.launches[0].config_text
            for config in candidates(x.numel() // block, block):
                g = quantize_graph(x, fmt, config)
                text = g.plan.launches[0].config_text
                y, scale = storage(g, "y", device), storage(g, "scale", device)
                quantize = lambda: g.execute({"x": x, "y": y, "scale": scale})
                quantize()
                mismatches = byte_mismatches(fmt, x, y, scale)
                for line in mismatches:
                    print(f"MISMATCH {fmt} {str(dtype).split('.')[-1]} {text}: {line}", flush=True)
                row = [fmt, str(dtype).split(".")[-1], text, "model" if text == model else "",
                       "MISMATCH" if mismatches else "bit-exact"]
                if device != "cpu":
                    ms = median_ms(quantize)
                    tbs = minimal_bytes(x, fmt) / ms / 1e9
                    row += [f"{ms * 1e3:.1f}", f"{tbs:.2f}", f"{tbs / ceiling(dtype):.0%}"]
                    print(" | ".join(row), flush=True)
                rows.append(row)
    return rows


def cases(quick: bool):
    shapes = [("small", (6, 64)), ("rows", (33, 96))] if quick else SHAPES
    for name, shape in shapes:
        for fmt in FORMATS:
            yield name, shape, fmt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="check small cases on the CPU (interpreter) only")
    parser.add_argument("--sweep", action="store_true",
                        help=f"time every candidate config of the quantize kernel at {SWEEP_SHAPE[1]} (GPU)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="x dtypes the sweep times (comma-separated)")
    args = parser.parse_args(argv)
    if args.sweep and torch.cuda.is_available() and not args.cpu:
        name, shape = SWEEP_SHAPE
        ceilings = {dtype: copy_ceiling_tbs(math.prod(shape), dtype) for dtype in (torch.bfloat16, torch.float32)}
        wanted = tuple(getattr(torch, name) for name in args.dtypes.split(","))
        rows = sweep_rows(shape, "cuda", ceilings.get, wanted)
        print(f"device: {torch.cuda.get_device_name()}")
        print_table(f"Block-scale quantize config sweep, {name} {shape} (us; TB/s over minimal bytes; % of a "
                    "device copy of x)", ["format", "x dtype", "config", "model", "check", "us", "TB/s", "% copy"],
                    rows)
        return
    if args.cpu or not torch.cuda.is_available():
        rows = [run_case(name, shape, fmt, torch.float32, "cpu") for name, shape, fmt in cases(True)]
        print_table("Block-scale quantize, CPU check (vs the float64 reference)", ["case", "format", "dtype", "check"],
                    rows)
        rows = [matmul_row("small", 9, 5, 64, fmt, "cpu") for fmt in FORMATS]
        print_table("Block-scaled matmul, CPU check", ["case", "format", "rel. error"], rows)
        return
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, shape, fmt in cases(False):
            ceiling = copy_ceiling_tbs(math.prod(shape), dtype)
            rows.append(run_case(name, shape, fmt, dtype, "cuda", ceiling))
    print(f"device: {torch.cuda.get_device_name()}")
    print_table("Block-scale quantize (TB/s over minimal bytes; % of a device copy of x; torch eager time / "
                "dnngraph time)", ["case", "format", "x dtype", "TB/s", "% copy", "vs eager", "config"], rows)
    rows = [matmul_row(name, m, n, k, fmt) for name, (m, n, k) in MATMUL_SHAPES for fmt in FORMATS]
    print_table("Block-scaled matmul, dequantized in the loader (TFLOP/s; cuBLAS bf16 on bf16 operands)",
                ["case", "format", "dnngraph TFLOP/s", "cuBLAS bf16 TFLOP/s", "vs cuBLAS bf16", "config"], rows)


if __name__ == "__main__":
    main()
