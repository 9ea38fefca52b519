"""The interpreter process: runs generated kernels through Triton's interpreter on behalf of a
process that compiles for the GPU (interpreter_client.py starts it with TRITON_INTERPRET=1).

It serves one request at a time over a socket: the sources of kernels it has not loaded yet, the
shared arena (shared_arena.py) and each tensor's place in it, and the launches in order. It
answers ("ok", None) or ("error", text) and exits when the socket closes.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path


@dataclass(frozen=True)
class KernelCall:
    """One launch: the kernel's source key, its grid, its argument template and the tensor
    arguments as (position in the template, index into the request's places)."""

    source_key: str
    grid: tuple
    template: tuple
    tensor_slots: tuple


@dataclass(frozen=True)
class Request:
    """Everything one run needs: new sources (key -> (kernel name, text)), the arena (path and
    bytes), the tensors' places in it and the calls in launch order."""

    sources: dict
    arena_path: str
    arena_bytes: int
    places: list
    calls: list


def _mapped_arena(current: tuple, request: Request) -> tuple:
    """(path, tensor) of the request's arena, mapped on first sight; its file is then removed
    (both processes hold it mapped, and nothing is left behind if either dies)."""
    from .shared_arena import map_arena

    if current[0] == request.arena_path:
        return current
    arena = map_arena(request.arena_path, request.arena_bytes)
    try:
        os.unlink(request.arena_path)
    except OSError:
        pass
    return request.arena_path, arena


def _loaded(key: str, name: str, text: str):
    """The kernel of `text`, which must be the source its key (a cache file <name>.py) names:
    the kernel `name` of a generated source whose digest that name ends in."""
    from .kernel_files import load_kernel, rendered_source, stem_of

    source = rendered_source(text, name)
    if Path(key).name != f"{name}.py" or source is None:
        raise RuntimeError(f"kernel {Path(key).name}: the source sent is not the one its name hashes")
    return load_kernel(source, stem_of(name))[0]


def _run(request: Request, kernels: dict, arena) -> None:
    from .interpreter import run_interpreted

    for key, (name, text) in request.sources.items():
        kernels[key] = _loaded(key, name, text)
    tensors = [place.view(arena) for place in request.places]
    for call in request.calls:
        args = list(call.template)
        for position, index in call.tensor_slots:
            args[position] = tensors[index]
        try:
            run_interpreted(kernels[call.source_key], call.grid, args)
        except Exception as error:
            raise RuntimeError(f"kernel {Path(call.source_key).name}: {type(error).__name__}: {error}") from error


def serve(connection: Connection) -> None:
    """Answer requests until the connection closes."""
    from .interpreter import interpreting

    if not interpreting():
        raise SystemExit("dnngraph interpreter process: TRITON_INTERPRET must be set")
    kernels, arena = {}, (None, None)
    connection.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            request = pickle.loads(connection.recv_bytes())
        except EOFError:
            return
        try:
            arena = _mapped_arena(arena, request)
            _run(request, kernels, arena[1])
            reply = ("ok", None)
        except Exception as error:  # the client raises it as an ExecutionError
            reply = ("error", f"{type(error).__name__}: {error}")
        connection.send_bytes(pickle.dumps(reply))


def main() -> None:
    """Entry point: the socket's file descriptor is the first argument."""
    # Ctrl-C reaches the whole process group: the client decides (an interrupted request kills
    # this process; the client's exit closes the socket)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))
