"""Compile a plan's kernels for an sm_90 GPU on a machine without one (Triton's frontend and the
ptxas in Triton's wheel): catches what only the GPU compiler rejects, such as a loop-carried value
whose shape changes, which the interpreter runs without complaint.

Triton reads TRITON_INTERPRET when kernels are defined, so this runs in a process of its own:

    TRITON_INTERPRET=0 python tests/sm90_compile.py MODULE:FUNCTION

FUNCTION() (in tests/MODULE.py, or in a layer's folder: tests/*/MODULE.py) yields (label, built
graph), or (label, launches, dtypes by uid) for launches lowered without a build (a backend whose
kernels cannot be planned on this machine: gluon); every launch is compiled, the seconds each
took printed (`compile_seconds S LABEL: KERNEL`), and the count. Gluon kernels are compiled as
Gluon sources, and a line `facts LABEL {json}` gives what their TTGIR and PTX hold (warp
specialization, setmaxnreg, wgmma, TMA copies, shared memory).
Each Triton kernel also gets a line `shared LABEL KERNEL: BYTES` (the shared memory its layout
conversions and reductions take). With SM90_SPILLS=1 a line `spills LABEL KERNEL: N` gives each
Triton kernel's spill-store bytes. With SM90_LOOP_LOADS=1 a line `loop_loads LABEL KERNEL: N`
gives each Triton kernel's count of tile loads inside a loop that its TTGIR still runs
synchronously (see loop_register_loads). With SM90_MMA_ROWS=1 a line `mma_replicated LABEL KERNEL:
N` gives each Triton kernel's count of mma.sync dots whose warps cover more rows than the dot has (`wgmma_replicated LABEL KERNEL: N` the same of its wgmma dots)
(see replicated_mma_dots), and a line `mma_layout LABEL KERNEL: [rows, cols, warps along M,
warps along N, num_warps]` for each of its mma.sync dots (see mma_layouts). With SM90_SASS=1 a line `sass LABEL KERNEL: {json}` gives each kernel's
SASS size (instructions, bytes of its .text) and registers a thread (sass_facts: cuobjdump from
Triton's wheel). SM90_JOBS (default 2, the CI machine's cores) kernels compile at a time, in
forked workers; the lines come out in the order the launches were yielded.
"""
import contextlib
import importlib
import io
import json
import os
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dnngraph.dtypes import kernel_torch_dtype

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                 torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8", torch.int8: "*i8", torch.float8_e4m3fn: "*fp8e4nv",
                 torch.float8_e5m2: "*fp8e5"}
TARGET = GPUTarget("cuda", 90, 32)


def compile_launch(launch, dtypes: dict):
    """The launch's kernel compiled for TARGET (raises what the compiler raises), specialized as
    Triton's launcher specializes it: integers equal to 1 become constants, integers divisible by
    16 and pointers (assumed 16-byte aligned) carry that divisibility."""
    signature, constexprs, attrs = {}, {}, {}
    for index, argument in enumerate(launch.arguments):
        if argument.kind == "tensor":
            signature[argument.name] = POINTER_TYPES[dtypes[argument.value]]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif argument.kind == "int" and argument.value == 1:
            signature[argument.name] = "constexpr"
            constexprs[argument.name] = 1
        elif argument.kind == "int":
            signature[argument.name] = "i64" if abs(argument.value) >= 2**31 else "i32"
            if argument.value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[argument.name] = "constexpr"
            constexprs[argument.name] = argument.value
    source_type = ASTSource
    if _is_gluon(launch.kernel):
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": launch.num_warps, **({"num_stages": launch.num_stages} if launch.num_stages else {})})


def mma_instructions(ptx: str) -> list:
    """The distinct wgmma / mma instructions of a kernel's PTX."""
    return sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[\w.]*", ptx)))


def _is_gluon(kernel) -> bool:
    return type(kernel).__name__ == "GluonJITFunction"


def spill_bytes(ptx: str) -> int:
    """Bytes of register spill stores ptxas reports for `ptx` (sm_90a, Triton's ptxas)."""
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as handle:
            handle.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {done.stderr[-2000:]}")
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stdout + done.stderr))


def sass_facts(cubin: bytes) -> dict:
    """The kernel's SASS size (instructions, and their bytes: 16 each on sm_90), its MUFU
    instructions (the special-function unit's: ex2, rcp, tanh... an epilogue's transcendentals, so
    their count says how many copies of that code the kernel holds) and the registers a thread
    the cubin declares (cuobjdump -res-usage; a warp-specialized kernel's partitions then move
    registers with setmaxnreg)."""
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/ ", sass, re.M))
    registers = re.search(r"REG:(\d+)", usage)
    return {"instructions": instructions, "bytes": 16 * instructions, "mufu": len(re.findall(r" MUFU\.", sass)),
            "registers": int(registers.group(1)) if registers else None}


def loop_register_loads(ttgir: str) -> int:
    """Tile loads (tt.load of a 2-D tensor of pointers) inside an scf.for of a kernel's TTGIR: the
    software pipeliner turns a loop's loads into cp.async copies to shared memory, and one left
    as tt.load is a load it could not pipeline (a tensor-core operand whose global layout does not
    match the shared layout the dot needs goes through registers, every iteration)."""
    count, loop_indents = 0, []
    for line in ttgir.splitlines():
        stripped = line.strip()
        indent = len(line) - len(stripped)
        if loop_indents and stripped.startswith("}") and indent == loop_indents[-1]:
            loop_indents.pop()
        elif " scf.for " in line and stripped.endswith("{"):
            loop_indents.append(indent)
        elif loop_indents and re.search(r"= tt\.load .*: tensor<\d+x\d+x!tt\.ptr", stripped):
            count += 1
    return count


def replicated_mma_dots(ttgir: str, version: int = 2) -> int:
    """Dots of a kernel's TTGIR on tensor-core layout `version` (nvidia_mma 2: mma.sync, as
    tt.dot; 3: wgmma, as ttng.warp_group_dot) whose warps along M cover more rows than the dot has
    (16 rows per warp, 64 per warpgroup): the tile is then replicated across warps. On mma.sync
    the fp8 attention kernels gave NaN and dropped keys that way on the H200 (a 32-row tile on
    warpsPerCTA [4, 1], 2026-11-29); on wgmma a chain's head dot is computed twice over (a 64-row
    query tile on [8, 1]: work, not a wrong result; the attention backward kernels accept it,
    heuristics/sdpa.py's _backward_warps_filled says why)."""
    warps_along_m = {name: int(warps) for name, warps in re.findall(
        rf"^(#mma\d*) = #ttg\.nvidia_mma<\{{versionMajor = {version}, [^}}]*warpsPerCTA = \[(\d+), \d+\]",
        ttgir, re.M)}
    count = 0
    # float accumulators, and int8 dots' int32 ones
    for rows, layout in re.findall(r"= (?:tt\.dot|ttng\.warp_group_dot) .*-> tensor<(\d+)x\d+x(?:f32|f16|i32), "
                                   r"(#mma\d*)>", ttgir):
        count += layout in warps_along_m and 16 * warps_along_m[layout] > int(rows)
    return count


def mma_layouts(ttgir: str) -> list:
    """(rows, cols, warps along M, warps along N, num_warps) of each dot of a kernel's TTGIR on
    mma.sync, for tests to hold heuristics/mma.py's model of Triton's placement against."""
    placed = {name: (int(m), int(n)) for name, m, n in re.findall(
        r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 2, [^}]*warpsPerCTA = \[(\d+), (\d+)\]", ttgir, re.M)}
    num_warps = int(re.search(r'"ttg\.num-warps" = (\d+)', ttgir).group(1))
    return [(int(rows), int(cols), *placed[layout], num_warps) for rows, cols, layout in re.findall(
        r"= tt\.dot .*-> tensor<(\d+)x(\d+)x(?:f32|f16|i32), (#mma\d*)>", ttgir) if layout in placed]


def facts(compiled, spills=None) -> dict:
    """What a compiled kernel's TTGIR and PTX hold, for tests to assert on (`spills`: its spill-store
    bytes where known, else ptxas is run for them)."""
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    return {"spill_stores": spill_bytes(ptx) if spills is None else spills,"warp_specialize": "ttg.warp_specialize" in ttgir, "setmaxnreg": ptx.count("setmaxnreg"),
            "wgmma": ptx.count("wgmma.mma_async"), "tma_load": ptx.count("cp.async.bulk.tensor"),
            "tensormap": ptx.count("tensormap"), "shared": compiled.metadata.shared,
            "global_scratch": getattr(compiled.metadata, "global_scratch_size", 0)}


def _items(found):
    """(label, launches, dtypes) of each item a FUNCTION yields."""
    for item in found:
        if len(item) == 3:
            yield item
            continue
        label, graph = item
        made = graph.plan.groups.views.made.values()  # copies' views and buffers
        # block-scale types (fp4, e8m0) are bound as their bytes
        dtypes = {t.uid: kernel_torch_dtype(t.data_type) for t in list(graph.tensors) + list(made)}
        yield label, graph.plan.launches, dtypes


def compiled_with_spills(launch, dtypes: dict) -> tuple:
    """(compile_launch's kernel, its spill-store bytes from the compiler's own ptxas run, or None
    where the kernel came from Triton's cache, which runs no ptxas): saves a second ptxas run,
    as long as the kernel's own compile."""
    log = io.StringIO()
    saved, triton.knobs.nvidia.dump_ptxas_log = triton.knobs.nvidia.dump_ptxas_log, True
    try:
        with contextlib.redirect_stdout(log):  # Triton prints ptxas's -v log
            compiled = compile_launch(launch, dtypes)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = saved
    spills = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    return compiled, sum(int(n) for n in spills) if spills else None


def _report(label: str, launch, dtypes: dict) -> str:
    """The lines main prints for one launch: its compile seconds, then what its kernel holds."""
    started = time.perf_counter()
    try:
        compiled, spills = compiled_with_spills(launch, dtypes)
    except Exception as error:
        raise CompileFailure(f"{label}: {launch.kernel.__name__} does not compile for sm_90: {error}") from None
    lines = [f"compile_seconds {time.perf_counter() - started:.2f} {label}: {launch.kernel.__name__}"]
    if _is_gluon(launch.kernel):
        lines.append(f"facts {label} {json.dumps(facts(compiled, spills))}")
    else:  # which tensor-core instructions the kernel's dots became (int8: s32.s8.s8)
        lines.append(f"mma {label}: {' '.join(mma_instructions(compiled.asm['ptx'])) or '-'}")
        lines.append(f"shared {label} {launch.kernel.__name__}: {compiled.metadata.shared}")
    if os.environ.get("SM90_SPILLS") == "1" and not _is_gluon(launch.kernel):  # opt-in: a ptxas run each
        known = spill_bytes(compiled.asm["ptx"]) if spills is None else spills
        lines.append(f"spills {label} {launch.kernel.__name__}: {known}")
    if os.environ.get("SM90_SASS") == "1":
        lines.append(f"sass {label} {launch.kernel.__name__}: {json.dumps(sass_facts(compiled.asm['cubin']))}")
    if os.environ.get("SM90_MMA_ROWS") == "1" and not _is_gluon(launch.kernel):
        lines.append(f"mma_replicated {label} {launch.kernel.__name__}: {replicated_mma_dots(compiled.asm['ttgir'])}")
        lines.append(f"wgmma_replicated {label} {launch.kernel.__name__}: "
                     f"{replicated_mma_dots(compiled.asm['ttgir'], version=3)}")
        for layout in mma_layouts(compiled.asm["ttgir"]):
            lines.append(f"mma_layout {label} {launch.kernel.__name__}: {json.dumps(layout)}")
    if os.environ.get("SM90_LOOP_LOADS") == "1" and not _is_gluon(launch.kernel):
        lines.append(f"loop_loads {label} {launch.kernel.__name__}: {loop_register_loads(compiled.asm['ttgir'])}")
    return "\n".join(lines)


class CompileFailure(Exception):
    """A launch the compiler rejected (the message names the label and kernel)."""


# the (label, launch, dtypes) of every launch, set before the pool forks: its workers take them
# by index (launches hold jitted kernels, which do not pickle)
_LAUNCHES: list = []


def _report_of(index: int) -> tuple:
    """(lines, None) of _LAUNCHES[index], or (None, the failure's message)."""
    try:
        return _report(*_LAUNCHES[index]), None
    except CompileFailure as failure:
        return None, str(failure)


def _reports(jobs: int):
    """(lines, failure) of each of _LAUNCHES in order, compiled `jobs` at a time: the compiler and
    ptxas are single-threaded, so a CPU machine's cores each take a kernel (forked workers: they
    inherit the launches, and this process never compiled, so holds no compiler threads)."""
    if jobs <= 1:
        yield from map(_report_of, range(len(_LAUNCHES)))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))
    try:
        yield from pool.map(_report_of, range(len(_LAUNCHES)))
    finally:  # a failure stops the run: the kernels not started are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def main(spec: str):
    module_name, function = spec.split(":")
    # the helper modules sit in tests/, the test modules in one folder per layer below it (and
    # import each other's across them): all of them on the path, as tests/conftest.py puts them
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here] + sorted(os.path.join(here, name) for name in os.listdir(here)
                                   if name not in ("models", "__pycache__") and os.path.isdir(os.path.join(here, name)))
    graphs = getattr(importlib.import_module(module_name), function)
    for label, launches, dtypes in _items(graphs()):
        for launch in launches:
            dtypes.update({s.uid: s.torch_dtype for s in launch.scratch})
            _LAUNCHES.append((label, launch, dtypes))
    count, reports = 0, _reports(int(os.environ.get("SM90_JOBS", "2")))
    for lines, failure in reports:
        if failure:
            print(failure)
            reports.close()  # the pool's shutdown: no kernel compiles after a failure
            raise SystemExit(1)
        print(lines, flush=True)
        count += 1
    print(f"compiled {count} kernels for sm_90")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("set TRITON_INTERPRET=0: the kernels must be compiled, not interpreted")
    main(sys.argv[1])
