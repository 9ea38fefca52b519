"""One kernel launch of a plan: source, config, grid and arguments, bound once per device.

On CUDA a launch is compiled at build and run through Triton's compiled launcher with a
pre-built argument list: no JIT dispatch per call (about 25 us of CPU a launch on the H100 here).
On CPU tensors it runs through Triton's interpreter: here when this process interprets (a
CPU-only machine), else in the interpreter process (interpreter_client.py).

Launches are shared by every thread that executes a plan: binding happens once per device under
a lock, and nothing a launch holds is written while it runs (the TMA descriptor scratch lives in
the caller's workspace, one per stream).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dtypes
from ..errors import ExecutionError, UnsupportedError
from .autotune import TuningRecord
from ..log import logger
from .interpreter import cpu_kernels_in_worker, run_interpreted
from .interpreter_client import run_in_interpreter_process
from .kernel_files import load_kernel
from .triton_key import install as install_triton_key


@dataclass(frozen=True)
class Scratch:
    """A kernel-private buffer in the workspace (split partials); negative uid."""

    uid: int
    dim: tuple
    torch_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.dim:
            count *= size
        return count * self.torch_dtype.itemsize


_scratch_ids = itertools.count(-1, -1)


def scratch(dim, torch_dtype=torch.float32) -> Scratch:
    """A new scratch buffer of `dim` (contiguous), for one plan's workspace."""
    return Scratch(next(_scratch_ids), tuple(int(d) for d in dim), torch_dtype)


def created_once(cache: dict, key, lock, make):
    """cache[key], made by make() under `lock` on first use; later reads take no lock."""
    found = cache.get(key)
    if found is None:
        with lock:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
    return found


_ALLOCATION_STREAMS: dict = {}  # CUDA device index -> the stream persistent buffers are allocated on
_ALLOCATION_LOCK = threading.Lock()


def _allocated_on_side_stream(nbytes: int, index: int) -> torch.Tensor:
    side = created_once(_ALLOCATION_STREAMS, index, _ALLOCATION_LOCK, lambda: torch.cuda.Stream(device=index))
    with torch.cuda.stream(side):
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))


def on_own_thread(make):
    """make() run on a short-lived daemon thread of its own (whose allocations no pool routing
    of the calling thread reaches); its result, or its exception raised here."""
    done: dict = {}

    def run():
        try:
            done["value"] = make()
        except BaseException as error:  # handed to the caller
            done["error"] = error

    thread = threading.Thread(target=run, name="dnngraph-alloc", daemon=True)
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]


# DNNGRAPH_POISON_WORKSPACE=1: every plan workspace starts as 0xFF bytes (NaN in every float type,
# fp8 included), so a kernel that reads workspace bytes no launch of the plan wrote gives NaN on
# any device, as uninitialised GPU memory may (on CPU a fresh buffer is often zeros, which hid
# such reads). =each: also before every execute (the plan's own workspace and a caller's), so a
# kernel relying on what an earlier execute left there is caught too. Read once, as the kernels'
# environment is.
_POISON_MODE = os.environ.get("DNNGRAPH_POISON_WORKSPACE", "0")
POISON_WORKSPACE = _POISON_MODE not in ("", "0")
POISON_EACH_EXECUTE = _POISON_MODE == "each"
POISON_BYTE = 0xFF


def persistent_buffer(nbytes: int, device) -> torch.Tensor:
    """persistent_buffer_of (below), filled with 0xFF under DNNGRAPH_POISON_WORKSPACE."""
    buffer = persistent_buffer_of(nbytes, device)
    if POISON_WORKSPACE:
        buffer.fill_(POISON_BYTE)
    return buffer


def persistent_buffer_of(nbytes: int, device) -> torch.Tensor:
    """A uint8 buffer a plan keeps across executes on the current stream of `device`.

    On CUDA it comes from torch's general memory, never from a pool the calling thread's
    allocations are routed to (a cudagraph tree's while it warms a graph up: the tree requires
    every live block of its pool to be an output it tracks): it is allocated by a thread of its
    own, on a stream that runs nothing, and marked as used by the caller's stream, so its memory
    is not reused before that stream's kernels finish. Under a capture on `device` it comes from
    the capture's pool (no other allocation may happen then). Called once per plan and stream."""
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffer = on_own_thread(lambda: _allocated_on_side_stream(nbytes, index))
    current = torch.cuda.current_stream(index)
    current.wait_stream(_ALLOCATION_STREAMS[index])
    buffer.record_stream(current)
    return buffer


# Compiled kernels by what decides their binary: the kernel (one JITFunction per generated text,
# however many groups and graphs share it: kernels are named by content), Triton's warmup
# arguments (pointer dtypes, integer and constexpr values), the compile options, the device and
# Triton's debug state. Triton's own cache would give a second caller the first one's binary,
# but two threads warming one kernel up at once would both compile (its cache is a plain dict
# filled after the compile): here the first compiles and the others wait for its result.
_COMPILED: dict = {}
_COMPILED_LOCK = threading.Lock()


def shared_compile(key, compile_fn):
    """compile_fn()'s result, made once per `key` in this process: the first caller compiles,
    callers of the same key meanwhile wait for it; a failed compile is forgotten (the next caller
    tries again) and raises in each caller that waited for it."""
    with _COMPILED_LOCK:
        future = _COMPILED.get(key)
        owner = future is None
        if owner:
            future = _COMPILED[key] = concurrent.futures.Future()
    if owner:
        try:
            future.set_result(compile_fn())
        except BaseException as error:
            with _COMPILED_LOCK:
                _COMPILED.pop(key, None)
            future.set_exception(error)
            raise
    return future.result()


class _Identity:
    """An object as a key by identity (JITFunction hashes by its cache key, which parses its
    source): the key holds it, so its id is never another object's while the key lives."""

    __slots__ = ("held",)

    def __init__(self, held):
        self.held = held

    def __hash__(self):
        return id(self.held)

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.held is self.held


def _typed(value):
    """`value` as a key that tells apart what Triton's specialization does: each value with its
    type (1, 1.0 and True are equal in Python), floats by their text (-0.0 == 0.0), tuples
    element by element."""
    if isinstance(value, tuple):
        return (tuple, tuple(_typed(v) for v in value))
    return (type(value), repr(value) if isinstance(value, float) else value)


def _triton_debug_state() -> tuple:
    """Triton settings outside the source and options that change a compiled binary (its own
    kernel cache keys on them too): debug asserts and instrumentation."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return ()
    return (getattr(knobs.runtime, "debug", None), getattr(knobs.compilation, "instrumentation_mode", None))


def kernel_name(group) -> str:
    """The stem of a group's kernel name: its family and last op, words for a reader of
    explain() and of profiler traces. load_kernel appends the digest of the source, so the name
    says what the kernel is and never where it came from (explain() names the group)."""
    return f"dnngraph_{group.kind}_{group.nodes[-1].op}"


def _grid3(programs) -> tuple:
    grid = tuple(programs) if isinstance(programs, (tuple, list)) else (programs,)
    return grid + (1,) * (3 - len(grid))


def check_grid(grid: tuple, source_path, target) -> None:
    """UnsupportedError at build, on every machine alike, for a grid past `target`'s launch limits."""
    if not target.grid_fits(grid):
        name = os.path.splitext(os.path.basename(str(source_path or "kernel")))[0]
        raise UnsupportedError(f"{name}: grid {list(grid)} passes the launch limits of {target.name} "
                               f"{list(target.max_grid)} (programs per axis x, y, z)")


def global_scratch_need(compiled, grid) -> tuple:
    """(bytes, alignment) of the global scratch a compiled kernel needs for `grid` ((0, 1): none).

    Device-side TMA descriptors are written there, one slot per program: every launch running
    at the same time needs its own, so the plan places it in the workspace."""
    size = getattr(compiled.metadata, "global_scratch_size", 0)
    if not size:
        return 0, 1
    programs = grid[0] * grid[1] * grid[2] * compiled.metadata.num_ctas
    return programs * size, max(1, getattr(compiled.metadata, "global_scratch_align", 1))


class BoundLaunch:
    """A compiled kernel with its grid and argument template, launched without the JIT."""

    __slots__ = ("run", "launch", "function", "metadata", "grid", "template", "slots", "scratch_uid",
                 "cooperative", "pdl", "direct", "compiled_as")

    def __init__(self, compiled, grid, template, slots, scratch_uid: Optional[int]):
        compiled._init_handles()
        # what was compiled, for the error of a launcher that refuses its arguments
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        self.compiled_as = (getattr(compiled, "name", "?"), "?" if signature is None else len(signature))
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.grid, self.template, self.slots = grid, template, slots
        self.scratch_uid = scratch_uid  # the workspace tensor holding this kernel's global scratch
        # The launcher's C entry point takes the call straight when no profiling scratch is to be
        # allocated per launch (the Python wrapper in front of it costs a few microseconds).
        self.direct = hasattr(self.run, "launch") and not getattr(self.run, "profile_scratch_size", 0)
        if self.direct or scratch_uid is not None:
            self.launch = self.run.launch
            self.cooperative, self.pdl = self.run.launch_cooperative_grid, self.run.launch_pdl

    def call(self, values, stream) -> tuple:
        """(launcher, arguments): calling launcher(*arguments) runs the kernel on `stream` with its
        tensor arguments taken from `values` (uid -> torch tensor or device address)."""
        args = list(self.template)
        for position, uid in self.slots:
            args[position] = values[uid]
        gx, gy, gz = self.grid
        if self.direct or self.scratch_uid is not None:
            scratch = None if self.scratch_uid is None else values[self.scratch_uid]
            return self.launch, (gx, gy, gz, stream, self.function, self.cooperative, self.pdl, scratch, None,
                                 self.metadata, None, None, None, *args)
        return self.run, (gx, gy, gz, stream, self.function, self.metadata, None, None, None, *args)

    def __call__(self, tensors, stream):
        launcher, args = self.call(tensors, stream)
        launcher(*args)


class KernelLaunch:
    """One kernel of the plan: source, config, grid and how to fill its arguments."""

    def __init__(self, group, kernel, source_path, arguments, programs, num_warps, config_text, reason,
                 scratch=(), num_stages: Optional[int] = None, alternative: "KernelLaunch" = None,
                 fp_fusion: bool = True, host_checks=()):
        self.group, self.kernel, self.source_path = group, kernel, source_path
        # checks of bound input values run before any launch where they are on the host (CPU
        # tensors): each takes the tensors by uid and raises ExecutionError (a GPU launch never
        # reads a value back: no sync)
        self.host_checks = tuple(host_checks)
        self.scratch = tuple(scratch)
        self.arguments, self.programs, self.num_warps = arguments, programs, num_warps
        self.grid = _grid3(programs)  # checked against the target's limits by the build
        self.num_stages = num_stages
        self.fp_fusion = fp_fusion  # False: no multiply-add contraction in this kernel
        self.config_text, self.reason = config_text, reason
        self.alternative = alternative  # for pointers below 16-byte alignment (TMA needs it)
        self.backend: Optional[str] = None  # the name of the backend that lowered it (set by the build)
        self.backend_reason = ""  # why that backend, where several supported the group (set by the build)
        self.backend_refusals = ""  # why the build's other backends did not take the group (set by the build)
        self.tuning: Optional[TuningRecord] = None
        self.slots = tuple((i, a.value) for i, a in enumerate(arguments) if a.kind == "tensor")
        self.template = [None if a.kind == "tensor" else a.value for a in arguments]
        # Set by the first bind: the kernel's global scratch (TMA descriptors), a workspace buffer.
        # A launch is bound only on devices of one model, which all compile it alike.
        self.global_scratch: Optional[Scratch] = None
        self.global_scratch_align = 1
        self._bound: dict = {}  # device index -> BoundLaunch; written under _bind_lock
        # The CompiledKernel of the last bind (a plan ships it: runtime/kernel_binary.py), and the
        # KernelBinary a shipped plan loaded, bound in place of compiling
        self.compiled = None
        self.binary = None
        self._bind_lock = threading.Lock()

    def values(self, tensors):
        args = list(self.template)
        for position, uid in self.slots:
            args[position] = tensors[uid]
        return args

    def compile_options(self) -> dict:
        """Triton's compile options of this launch (warps, stages, fp fusion)."""
        return self._options()

    def _options(self) -> dict:
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        if not self.fp_fusion:
            options["enable_fp_fusion"] = False
        return options

    def interpret(self, tensors):
        run_interpreted(self.kernel, self.grid, self.values(tensors))

    def bind(self, device_index: int, dtypes_of) -> BoundLaunch:
        """Compile for a device (pointers assumed 16-byte aligned) and keep the launcher; safe to
        call from any number of threads (one compile per device)."""
        return created_once(self._bound, device_index, self._bind_lock,
                            lambda: self._compile(device_index, dtypes_of))

    def _compile(self, device_index: int, dtypes_of) -> BoundLaunch:
        args = list(self.template)
        for position, uid in self.slots:
            args[position] = dtypes_of[uid]  # Triton's warmup takes dtypes for pointers
        start = time.perf_counter()
        # Triton compiles for the current device and loads the module into the current device's
        # context (BoundLaunch's _init_handles): both must happen with `device_index` current, or
        # a kernel for cuda:1 bound from a thread where cuda:0 is current lives in cuda:0's context.
        with torch.cuda.device(device_index):
            compiled = self._compiled(args, device_index)
            self.compiled = compiled
            nbytes, align = global_scratch_need(compiled, self.grid)
            if nbytes and self.global_scratch is None:
                self.global_scratch, self.global_scratch_align = scratch((nbytes,), torch.uint8), align
            elif nbytes and self.global_scratch.nbytes < nbytes:
                raise ExecutionError(f"{self.source_path}: global scratch of {nbytes} bytes on device {device_index}, "
                                     f"{self.global_scratch.nbytes} on the device it was first bound on")
            uid = self.global_scratch.uid if nbytes else None
            bound = BoundLaunch(compiled, self.grid, self.template, self.slots, uid)
        logger.info("bound %s for cuda:%d in %.0f ms", self.source_path.name, device_index,
                    1e3 * (time.perf_counter() - start))
        return bound

    def _compiled(self, args, device_index: int):
        """The compiled kernel for Triton's warmup `args`, shared with every launch of this
        process that runs the same kernel (shared_compile); with `device_index` current."""
        options = self._options()
        if self.binary is not None:  # a shipped plan's launch: its stored binary, never compiled
            compiled = self.binary.load(self.kernel)
            compiled._init_handles()
            return compiled

        def compile_here():
            install_triton_key()  # Triton's installation key from the cache folder (runtime/triton_key.py)
            compiled = self.kernel.warmup(*args, grid=self.grid, **options)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            compiled._init_handles()  # loaded once, before another launch's thread can share it
            return compiled

        key = (_Identity(self.kernel), _typed(tuple(args)), tuple(sorted(options.items())), device_index,
               _triton_debug_state())
        try:
            hash(key)
        except TypeError:  # an argument Triton takes but no key holds: compiled for this launch alone
            return compile_here()
        return shared_compile(key, compile_here)

    def launch_unaligned(self, tensors):
        """Through the JIT, which specializes on the actual pointer alignment."""
        if self.alternative is not None:
            self.alternative.launch_unaligned(tensors)
            return
        self.kernel[self.grid](*self.values(tensors), **self._options())


def launch_of(group, source, programs, num_warps, config_text, reason, **options) -> KernelLaunch:
    """The launch of one rendered kernel of `group`: `source` (a backend's KernelSource, or any
    object with its `name`, `text` and `arguments`: the stem load_kernel names the kernel by, the
    source rendered under that stem, and the KernelArgument list) loaded by load_kernel, on
    `programs` with `num_warps`; `options` are KernelLaunch's own (scratch, num_stages,
    alternative, fp_fusion, host_checks). The one place a builder's rendered source becomes a launch."""
    kernel, path = load_kernel(source.text, source.name)
    return KernelLaunch(group, kernel, path, source.arguments, programs, num_warps, config_text, reason, **options)


# Triton's interpreter patches triton.language while a kernel runs, so two interpreted kernels
# must not overlap (threads executing plans on CPU take turns, a whole launch list at a time;
# the interpreter process serves one request at a time as well).
INTERPRETER_LOCK = threading.RLock()


class LaunchRefused(Exception):
    """A launcher refused the arguments of call `position` of a prepared list (Triton's
    TypeError: their count or types are not the compiled kernel's)."""

    def __init__(self, position: int, given: int, error: TypeError):
        super().__init__(f"call {position}: {error}")
        self.position, self.given, self.error = position, given, error


def launch_on_device(calls, device_index: int, lock=None) -> None:
    """Run prepared (launcher, arguments) pairs with CUDA device `device_index` current, the
    previous one restored after, holding `lock` while they run when one is given (a stream
    workspace's: one execute's launches stay together on its stream). Triton's launcher runs in
    the current device's context, so kernels for tensors on another GPU than the current one need
    theirs made current; when it already is, the exchange is a no-op. A launcher's TypeError
    becomes LaunchRefused, which says which call it was. The one loop every prepared launch
    passes through: execute's per-call cost is mostly here and in the binding stamp."""
    previous = torch.cuda._exchange_device(device_index)
    try:
        if lock is None:
            for launcher, args in calls:
                launcher(*args)
        else:
            with lock:
                for launcher, args in calls:
                    launcher(*args)
    except TypeError as error:
        position = next(i for i, call in enumerate(calls) if call[1] is args)
        raise LaunchRefused(position, len(args), error) from error
    finally:
        torch.cuda._maybe_exchange_device(previous)


def run_launches(launches, tensors, device, dtypes_of, aligned: bool = True, stream: Optional[int] = None):
    """Launch in order on `device` (CUDA: bound launchers on `stream`, by default the current
    stream of `device`, with `device` made current; CPU: the interpreter, here or in the
    interpreter process)."""
    if device.type != "cuda":
        chosen = [launch.alternative if not aligned and launch.alternative is not None else launch
                  for launch in launches]
        for launch in launches:  # every check before the first launch: a refusal writes nothing
            for check in launch.host_checks:
                check(tensors)
        if cpu_kernels_in_worker():
            run_in_interpreter_process(chosen, tensors)
            return
        with INTERPRETER_LOCK:
            for launch in chosen:
                launch.interpret(tensors)
        return
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    with torch.cuda.device(device.index):
        for launch in launches:
            if aligned:
                launch.bind(device.index, dtypes_of)(tensors, stream)
            else:
                launch.launch_unaligned(tensors)


def time_launches(launches, tensors, device, dtypes_of) -> float:
    """Median milliseconds of running `launches` once (CUDA events; wall clock on CPU)."""
    if device.type == "cuda":
        import triton.testing

        run_launches(launches, tensors, device, dtypes_of)  # compile and warm outside the timing
        # do_bench records its events on the current device's stream: make it the launches' one
        with torch.cuda.device(device.index):
            return float(triton.testing.do_bench(lambda: run_launches(launches, tensors, device, dtypes_of),
                                                 warmup=10, rep=40, return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        run_launches(launches, tensors, device, dtypes_of)
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[1]


def element_span(tensor) -> int:
    """Elements from the first to the last one a tensor's strides reach."""
    return sum((size - 1) * stride for size, stride in zip(tensor.dim, tensor.stride)) + 1


def _random_like(tensor, device) -> torch.Tensor:
    dtype = tensor.data_type.torch_dtype
    if tensor.data_type.elements_per_item > 1 or tensor.data_type.is_block_scale_storage:
        # fp4, e8m0, bit-packed booleans: random bytes, bound as kernels see them
        shape, strides = dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)
        span = sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
        return torch.randint(0, 256, (span,), device=device, dtype=torch.uint8).as_strided(shape, strides)
    if tensor.data_type.is_floating:
        flat = torch.randn(element_span(tensor), device=device).to(dtype)
    elif dtype == torch.bool:
        flat = torch.rand(element_span(tensor), device=device) < 0.5
    else:
        flat = torch.randint(0, 7, (element_span(tensor),), device=device, dtype=dtype)
    return flat.as_strided(tensor.dim, tensor.stride)


def sample_tensors(group, device) -> dict:
    """Random inputs (never zeros) and empty outputs with a group's dims, strides and types."""
    tensors = {t.uid: _random_like(t, device) for t in group.inputs}
    for tensor in group.outputs:
        shape, strides = dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)
        tensors[tensor.uid] = torch.empty_strided(shape, strides, dtype=dtypes.kernel_torch_dtype(tensor.data_type),
                                                  device=device)
    return tensors


def time_candidate(launches, tensors, device) -> float:
    """Milliseconds of one candidate's launches on sample tensors (scratch allocated here)."""
    dtypes_of = {uid: t.dtype for uid, t in tensors.items()}
    for launch in launches:
        for buffer in launch.scratch:
            if buffer.uid not in tensors:
                tensors[buffer.uid] = torch.empty(buffer.dim, dtype=buffer.torch_dtype, device=device)
            dtypes_of[buffer.uid] = buffer.torch_dtype
    if device.type == "cuda":
        for launch in launches:
            launch.bind(device.index, dtypes_of)  # learns the kernel's global scratch
            buffer = launch.global_scratch
            if buffer is not None and buffer.uid not in tensors:
                tensors[buffer.uid] = torch.empty(buffer.dim, dtype=buffer.torch_dtype, device=device)
    return time_launches(launches, tensors, device, dtypes_of)
