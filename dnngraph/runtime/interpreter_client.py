"""CPU tensors' kernels in a process that compiles for the GPU: they run in an interpreter process.

Why a process and not the interpreter here. Triton chooses at decoration time: with
TRITON_INTERPRET unset, `@triton.jit` makes JITFunctions, triton.language's own jitted helpers
(the combine functions of tl.sum and tl.max, tl.sigmoid, tl.cdiv...) included, and calling one of
those from an interpreted kernel fails. Worse, the interpreter runs a kernel by patching
triton.language itself (tl.range becomes Python's range, tl.dtype.to_ir and the builtins are
swapped) for the whole process while the kernel runs, so a GPU compile in another thread at that
moment, ours or any other library's, would read the patched module. Re-decorating every helper
and serializing every Triton compile in the process with the interpreter would not make that
sound. A process of its own is: it imports Triton with TRITON_INTERPRET=1 (and no GPU visible),
so it interprets exactly as a CPU-only machine does, and this process keeps compiling for the GPU.

The process (interpreter_worker.py) is started with subprocess, not multiprocessing: a spawned or
forkserver child imports the user's __main__ again, which a script without a main guard would
not survive, and a forked one would inherit CUDA. It starts on the first CPU execute, serves
every graph of this process one request at a time (the interpreter is single-threaded in any
case), and ends when this process does. A request carries the kernels' sources (once each: the
generated text, never the cache file, and the process runs a text only under the kernel name
that hashes it), the tensors through a shared arena (copied in; the tensors the kernels write
copied back), and the launches. A kernel that fails, or a process that dies, raises ExecutionError and writes nothing
to the caller's tensors; the next execute starts a fresh process.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

from .kernel_files import kernel_source
from ..errors import ExecutionError
from ..log import logger
from .interpreter_worker import KernelCall, Request
from .shared_arena import arena_size, copy_in, copy_out, create_arena, lay_out
from ..tensor import blend_factor_uids

_BOOT = "from dnngraph.runtime.interpreter_worker import main; main()"
_STOP_SECONDS = 5


def _child_environment() -> dict:
    """This process's environment, interpreting, with no GPU visible and this dnngraph first
    on the path."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("DNNGRAPH_INTERPRETER_WORKER", None)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _kernel_name(source_path: Path) -> str:
    return source_path.stem  # load_kernel names files <kernel name>.py, the name ending in the source's digest


class InterpreterProcess:
    """One interpreter process and its arena; used under the module lock."""

    def __init__(self):
        ours, theirs = multiprocessing.Pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                            env=_child_environment(), pass_fds=(theirs.fileno(),),
                                            stdin=subprocess.DEVNULL)
        except OSError as error:
            ours.close()
            raise ExecutionError(f"could not start the interpreter process for CPU tensors: {error}") from error
        finally:
            theirs.close()
        self.connection, self.owner = ours, os.getpid()
        self.loaded: set = set()  # source keys the process has loaded
        self.arena_path, self.arena = None, None
        status, pid = self._receive("starting")
        if status != "ready":
            self.close()
            raise ExecutionError(f"the interpreter process for CPU tensors answered {status!r} at start")
        logger.info("interpreter process %d started for CPU tensors", pid)

    def _receive(self, doing: str):
        try:
            return pickle.loads(self.connection.recv_bytes())
        except (EOFError, OSError) as error:
            self.close()
            raise ExecutionError(f"the interpreter process for CPU tensors exited (code {self.process.poll()}) "
                                 f"while {doing}; its error is on stderr") from error

    def close(self) -> None:
        """End the process (it exits when its socket closes) and remove an arena file it never
        mapped."""
        self.connection.close()
        if self.arena_path is not None and os.path.exists(self.arena_path):
            os.unlink(self.arena_path)
        try:
            self.process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def alive(self) -> bool:
        return not self.connection.closed and self.process.poll() is None

    def _reserve(self, needed: int) -> None:
        current = 0 if self.arena is None else self.arena.numel()
        if needed <= current:
            return
        if self.arena_path is not None and os.path.exists(self.arena_path):
            os.unlink(self.arena_path)  # never mapped over there
        try:
            self.arena_path, self.arena = create_arena(arena_size(needed, current))
        except OSError as error:
            raise ExecutionError(f"CPU tensors: {error}") from error

    def _sources(self, launches) -> dict:
        """key -> (kernel name, text) of the kernels the process has not loaded: the text each
        kernel was made from in this process (the one its plan generated and hashed), never the
        cache file, which may have changed since the build."""
        sources = {}
        for launch in launches:
            key = str(launch.source_path)
            if key in self.loaded or key in sources:
                continue
            try:
                sources[key] = (_kernel_name(launch.source_path), kernel_source(launch.kernel))
            except ValueError as error:
                raise ExecutionError(f"kernel {launch.source_path.name}: {error}") from error
        return sources

    def run(self, launches, tensors: dict) -> None:
        """Run `launches` in order on `tensors` (uid -> CPU tensor) in the process; the tensors
        the kernels write are copied back only when every kernel succeeded."""
        uids = list(dict.fromkeys(uid for launch in launches for _, uid in launch.slots))
        index = {uid: i for i, uid in enumerate(uids)}
        shipped = [tensors[uid] for uid in uids]
        places, needed = lay_out(shipped)
        self._reserve(needed)
        copy_in(self.arena, shipped, places)
        sources = self._sources(launches)
        calls = [KernelCall(str(launch.source_path), launch.grid, tuple(launch.template),
                            tuple((position, index[uid]) for position, uid in launch.slots))
                 for launch in launches]
        request = Request(sources, self.arena_path, self.arena.numel(), places, calls)
        try:
            self.connection.send_bytes(pickle.dumps(request))
            status, text = self._receive(f"running {', '.join(_kernel_name(l.source_path) for l in launches)}")
        except BaseException:  # interrupted: the process would answer the next request with this one's reply
            if self.alive:
                self.process.kill()
                self.close()
            raise
        if status != "ok":
            raise ExecutionError(f"CPU tensors: the interpreter failed ({text}); no output was written")
        self.loaded.update(sources)
        # inputs, and the one-element tensors blended stores read their factors from (no node's input)
        read = {t.uid for launch in launches for t in launch.group.inputs}
        read |= {uid for launch in launches for uid in blend_factor_uids(launch.group.outputs)}
        read_only = read - {t.uid for launch in launches for t in launch.group.outputs}
        for uid in uids:
            if uid not in read_only:
                copy_out(self.arena, tensors[uid], places[index[uid]])


_lock = threading.Lock()
_process = None


def run_in_interpreter_process(launches, tensors: dict) -> None:
    """Run `launches` on CPU tensors in the interpreter process (started on first use, again
    after one dies); one run at a time, threads take turns."""
    global _process
    with _lock:
        if _process is None or not _process.alive:
            _process = InterpreterProcess()
        _process.run(launches, tensors)


def _stop() -> None:
    global _process
    with _lock:
        if _process is not None and _process.owner == os.getpid():
            _process.close()
        _process = None


def _forget_after_fork() -> None:
    """A forked child starts its own process if it needs one: the parent's socket is closed here
    (not shut down, so the parent keeps it)."""
    global _process, _lock
    _lock = threading.Lock()
    if _process is not None:
        _process.connection.close()
    _process = None


atexit.register(_stop)
os.register_at_fork(after_in_child=_forget_after_fork)
