"""What the Gluon matmul's epilogues compile to on sm_90a, on a machine without a GPU.

    TRITON_INTERPRET=0 PYTHONPATH=.:tests:tests/backends python dbg_gelu_facts.py [--json OUT]

For bias, bias+relu, bias+gelu_tanh and bias+gelu (erf) at 4096^3 bf16 under the forced
configs 128x256 (4 stages, 2 consumers) and 128x128 (6 stages, 2 consumers): ptxas's registers
and spill bytes, and the SASS opcode counts of the whole kernel (cuobjdump), the MUFU ones
(ex2, rcp, tanh) and the float math ones (FFMA, FMUL, FADD, FSETP, FSEL) named apart.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import dnngraph as dg
import dnngraph.backends.gluon.backend as gluon_backend
from dnngraph.backends.gluon.backend import GluonConfig

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "backends"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")]
from gluon_cases import lowered  # noqa: E402
from sm90_compile import compile_launch  # noqa: E402

SIZE = 4096
CONFIGS = {"128x256s4c2": GluonConfig(128, 256, 64, 4, 2), "128x128s6c2": GluonConfig(128, 128, 64, 6, 2)}
EPILOGUES = {"bias": None, "relu": "relu", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
NAMED = ("MUFU.EX2", "MUFU.RCP", "MUFU.TANH", "FFMA", "FMUL", "FADD", "FSETP", "FSEL", "FMNMX", "STL", "LDL")


def graph(activation):
    g = dg.Graph(name="facts", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[SIZE, SIZE])
    b = g.tensor(name="b", dim=[SIZE, SIZE])
    out = g.add(g.matmul(a, b), g.tensor(name="bias", dim=[1, SIZE]))
    if activation:
        out = getattr(g, activation)(out)
    out.set_output(True)
    return g


def ptxas_facts(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.ptx")
        open(path, "w").write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                              capture_output=True, text=True)
        text = done.stdout + done.stderr
        sass = subprocess.run([os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump"), "-sass", path + ".o"],
                              capture_output=True, text=True).stdout
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", text)]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", text))
    opcodes = collections.Counter()
    for line in sass.splitlines():
        found = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if found:
            opcodes[found.group(1)] += 1
    named = {name: sum(c for op, c in opcodes.items() if op == name or op.startswith(name + ".")) for name in NAMED}
    return {"registers": max(registers) if registers else None, "spill_store_bytes": spills,
            "sass_total": sum(opcodes.values()), **named}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS = 1 << 20  # force the wide tile under gelu too
    rows = []
    for config_name, config in CONFIGS.items():
        for epilogue_name, activation in EPILOGUES.items():
            g = graph(activation)
            (launch,) = lowered(g, config)
            dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
            compiled = compile_launch(launch, dtypes)
            ptx = compiled.asm["ptx"]
            row = {"config": config_name, "epilogue": epilogue_name, "n_regs_meta": getattr(compiled, "n_regs", None),
                   "ptx_ex2": ptx.count("ex2.approx"), "ptx_rcp": ptx.count("rcp."),
                   "ptx_div_full": ptx.count("div.full") + ptx.count("div.rn"), "ptx_tanh": ptx.count("tanh.approx"),
                   "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 (\d+)", ptx))),
                   **ptxas_facts(ptx)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
