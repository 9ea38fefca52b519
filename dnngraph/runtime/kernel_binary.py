"""Compiled kernels as a shipped plan carries them: Triton's metadata, the PTX and the cubin of
each launch, and the signature its launcher is made for.

A plan built on a GPU keeps each launch's CompiledKernel (launch.py); a plan built ahead of
time for a named GPU model on a machine without one compiles its launches here, in a process of
its own (`compile_for`: Triton decides between the interpreter and the compiler when a kernel
is decorated, so a process that interprets cannot compile). Loading (`KernelBinary.load`)
writes the stored files into a folder of the kernel cache and makes Triton's CompiledKernel of
them: Triton's compiler never runs, only its C launcher (a small module Triton caches by its
text) is made on first use.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SerializationError, UnsupportedError

# The levels of a compiled kernel a shipped plan keeps: the binary the driver loads and the PTX
# it came from (which names the architecture; a reader can check it). Triton's other IRs are
# for debugging only.
KEPT_LEVELS = ("cubin", "ptx")
BINARY_LEVELS = ("cubin",)
# Pointer types of Triton signatures by the torch dtype a tensor argument has.
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                 torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8", torch.int8: "*i8",
                 torch.int16: "*i16", torch.float64: "*fp64", torch.float8_e4m3fn: "*fp8e4nv",
                 torch.float8_e5m2: "*fp8e5"}


def plain_value(value):
    """`value` (a constexpr or constant of a signature) as JSON data that plain_of reads back
    exactly: floats by their repr (nan, inf and -0.0 survive), tuples tagged."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [plain_value(v) for v in value]}
    raise UnsupportedError(f"a kernel constant of type {type(value).__name__} ({value!r}) cannot be shipped")


def plain_of(value):
    """The value plain_value wrote."""
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(plain_of(v) for v in value["tuple"])
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise SerializationError(f"unreadable kernel constant {value!r}")


@dataclass(frozen=True)
class KernelBinary:
    """One compiled kernel: its name and hash (Triton's), the metadata file's text, the kept
    levels (text, or bytes for the binary), and what its launcher reads of the source: the
    signature (argument name -> type), the constants (argument index path -> value) and
    the attributes Triton specialized on."""

    name: str
    hash: str
    metadata: str
    asm: dict
    signature: dict
    constants: tuple  # ((index path, value), ...)
    attrs: tuple  # ((index path, [[attribute, value], ...]), ...)

    @property
    def arch(self) -> int:
        """The compute capability it was compiled for, as Triton writes it (90 for sm_90a)."""
        return int(json.loads(self.metadata)["target"]["arch"])

    def to_record(self) -> dict:
        """JSON data (binaries in base64)."""
        asm = {level: ({"base64": base64.b64encode(data).decode()} if isinstance(data, bytes) else data)
               for level, data in self.asm.items()}
        return {"name": self.name, "hash": self.hash, "metadata": self.metadata, "asm": asm,
                # argument order is the launcher's: a list, never an object a writer may sort
                "signature": [[name, kind] for name, kind in self.signature.items()],
                "constants": [[list(path), plain_value(value)] for path, value in self.constants],
                "attrs": [[list(path), [list(pair) for pair in specs]] for path, specs in self.attrs]}

    @classmethod
    def from_record(cls, record) -> "KernelBinary":
        """The KernelBinary to_record wrote; SerializationError for anything else."""
        try:
            asm = {str(level): (base64.b64decode(data["base64"]) if isinstance(data, dict) else str(data))
                   for level, data in record["asm"].items()}
            binary = cls(str(record["name"]), str(record["hash"]), str(record["metadata"]), asm,
                         {str(name): str(kind) for name, kind in record["signature"]},
                         tuple((tuple(int(i) for i in path), plain_of(value)) for path, value in record["constants"]),
                         tuple((tuple(int(i) for i in path), [list(pair) for pair in specs])
                               for path, specs in record["attrs"]))
            binary.arch  # the metadata must name its target
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise SerializationError(f"malformed kernel binary record: {type(error).__name__}: {error}") from None
        if set(asm) != set(KEPT_LEVELS) or not _safe_name(binary.name) or not _safe_name(binary.hash):
            raise SerializationError(f"malformed kernel binary record for {binary.name!r}")
        return binary

    def load(self, kernel):
        """Triton's CompiledKernel of this binary for `kernel` (the JITFunction of the source it
        was compiled from), without compiling: the files are written to the kernel cache and
        read back by CompiledKernel. Its handles are made by the caller, on its device."""
        from triton.compiler import CompiledKernel

        folder = _binary_dir() / self.hash
        folder.mkdir(parents=True, exist_ok=True)
        group = {f"{self.name}.json": _written(folder / f"{self.name}.json", self.metadata)}
        for level, data in self.asm.items():
            group[f"{self.name}.{level}"] = _written(folder / f"{self.name}.{level}", data)
        source = source_of(kernel, dict(self.signature), dict(self.constants), dict(self.attrs))
        return CompiledKernel(source, group, self.hash)


def source_of(kernel, signature: dict, constants: dict, attrs: dict):
    """Triton's compile source of `kernel` specialized as given: a GluonASTSource for a Gluon
    kernel (its language is not triton.language: an ASTSource fails to parse it), else an
    ASTSource. Compiling and loading a shipped binary both make theirs here."""
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    kind = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    return kind(kernel, signature, constants, attrs)


def _safe_name(text: str) -> bool:
    """A name usable as a file name in the cache (Triton's kernel names and hashes are)."""
    return bool(text) and all(c.isalnum() or c == "_" for c in text)


def _binary_dir() -> Path:
    from .kernel_files import cache_dir

    path = cache_dir().parent / "binaries"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _written(path: Path, data) -> str:
    """Write `data` (text or bytes) to `path` atomically; the path as text."""
    temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    if isinstance(data, bytes):
        temp.write_bytes(data)
    else:
        temp.write_text(data)
    os.replace(temp, path)
    return str(path)


def of_compiled(compiled) -> KernelBinary:
    """The KernelBinary of Triton's CompiledKernel `compiled` (from a JIT warmup or triton.compile)."""
    metadata_path = next(p for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    source = compiled.src
    missing = [level for level in KEPT_LEVELS if level not in compiled.asm]
    if missing:
        raise UnsupportedError(f"kernel {compiled.name}: compiled without {missing}; only CUDA binaries ship")
    return KernelBinary(compiled.name, compiled.hash, Path(metadata_path).read_text(),
                        {level: compiled.asm[level] for level in KEPT_LEVELS}, dict(source.signature),
                        tuple(sorted(source.constants.items())),
                        tuple(sorted((path, [list(pair) for pair in specs]) for path, specs in source.attrs.items())))


# --- ahead of time: compile for a GPU model this machine may not have ----------------------------

def launch_signature(arguments, dtypes: dict) -> tuple:
    """(signature, constants, attrs) of a launch's `arguments` (KernelArgument list) as Triton's
    launcher specializes them at run time: pointers (tensors; assumed 16-byte aligned, as bound
    launches are) and integers divisible by 16 carry that divisibility, integers equal to 1
    become constants. `dtypes`: uid -> torch dtype of each tensor argument."""
    signature, constants, attrs = {}, {}, {}
    for index, argument in enumerate(arguments):
        if argument.kind == "tensor":
            signature[argument.name] = POINTER_TYPES[dtypes[argument.value]]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif argument.kind == "int" and not isinstance(argument.value, bool) and argument.value == 1:
            signature[argument.name] = "constexpr"
            constants[(index,)] = 1
        elif argument.kind == "int" and not isinstance(argument.value, bool):
            signature[argument.name] = "i64" if abs(argument.value) >= 2**31 else "i32"
            if argument.value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[argument.name] = "constexpr"
            constants[(index,)] = argument.value
    return signature, constants, attrs


def compile_request(launch, dtypes: dict) -> dict:
    """What the compile process needs of one launch (JSON data): its named source, signature and
    compile options."""
    from .kernel_files import kernel_source

    signature, constants, attrs = launch_signature(launch.arguments, dtypes)
    options = launch.compile_options()
    return {"name": launch.source_path.stem, "text": kernel_source(launch.kernel),
            "signature": [[name, kind] for name, kind in signature.items()],
            "constants": [[list(path), plain_value(value)] for path, value in constants.items()],
            "attrs": [[list(path), specs] for path, specs in attrs.items()], "options": options}


def compile_for(requests: list, capability: tuple) -> list:
    """KernelBinary of each compile_request in `requests`, compiled for CUDA compute
    capability `capability` (major, minor) by Triton's compiler (and the ptxas in its wheel) in
    a process that compiles (TRITON_INTERPRET=0), on any machine. UnsupportedError with the
    compiler's message when a kernel does not compile."""
    if capability[0] < 7:
        raise UnsupportedError(f"compute capability {capability}: dnngraph ships binaries for sm_70 and newer")
    payload = json.dumps({"arch": capability[0] * 10 + capability[1], "requests": requests})
    # the compile process imports this dnngraph (the one whose sources the kernels call), first
    package_root = str(Path(__file__).resolve().parents[2])
    search_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    environment = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=search_path)
    done = subprocess.run([sys.executable, "-m", "dnngraph.runtime.kernel_binary"], input=payload,
                          capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise UnsupportedError(f"compiling for sm_{capability[0]}{capability[1]} failed: {done.stderr[-3000:]}")
    return [KernelBinary.from_record(record) for record in json.loads(done.stdout.splitlines()[-1])]


def _compile_one(request: dict, arch: int) -> dict:
    """In the compile process: the request's kernel loaded from its checked source, compiled."""
    import triton
    from triton.backends.compiler import GPUTarget

    from .kernel_files import load_kernel, rendered_source, stem_of

    source = rendered_source(request["text"], request["name"])
    if source is None:
        raise SerializationError(f"kernel {request['name']!r}: its text does not hash to its name")
    kernel, _ = load_kernel(source, stem_of(request["name"]))
    constants = {tuple(path): plain_of(value) for path, value in request["constants"]}
    attrs = {tuple(path): specs for path, specs in request["attrs"]}
    signature = {name: kind for name, kind in request["signature"]}
    compiled = triton.compile(source_of(kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", arch, 32), options=request["options"])
    return of_compiled(compiled).to_record()


def _serve() -> None:
    request = json.loads(sys.stdin.read())
    records = [_compile_one(one, request["arch"]) for one in request["requests"]]
    print(json.dumps(records))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("the compile process must run with TRITON_INTERPRET=0")
    _serve()
