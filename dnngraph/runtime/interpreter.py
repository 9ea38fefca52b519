"""Where kernels run: CUDA tensors on their GPU, CPU tensors through Triton's interpreter.

Triton reads TRITON_INTERPRET when a function is decorated, and its interpreter patches
triton.language process-wide while a kernel runs, so a process either compiles for the GPU or
interprets, not both. On a CPU-only machine this module sets TRITON_INTERPRET at import (nothing
for the user to set) and kernels run through the interpreter in this process. On a machine with
CUDA nothing is set: CUDA tensors run on their GPU here, and CPU tensors' kernels run in an
interpreter process of their own (runtime/interpreter_client.py).

Triton chooses interpreted or compiled when a function is decorated (`triton.jit` reads
TRITON_INTERPRET then), and `torch.compile` imports triton before it loads the "dnngraph" backend
through its entry point: triton.language's own jitted helpers (tl.sum, tl.max, tl.cdiv...) and any
other function decorated before this module ran are then compiled-mode JITFunctions, which refuse
to be called outside a compiled kernel. So the interpreter is chosen per launch instead
(`run_interpreted`): the kernel and every jitted function it calls run interpreted whatever the
decoration made of them, in any import order.

DNNGRAPH_INTERPRETER_WORKER=1 (read once, at import; for tests) makes a CPU-only machine behave
as a GPU machine does for CPU tensors: TRITON_INTERPRET is left unset and CPU tensors' kernels
run in the interpreter process.
"""
from __future__ import annotations

import contextlib
import os

import torch

_WORKER_REQUESTED = os.environ.get("DNNGRAPH_INTERPRETER_WORKER", "0") not in ("", "0")

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and not _WORKER_REQUESTED:
    os.environ["TRITON_INTERPRET"] = "1"


# Triton reads the variable when kernels are decorated: its value at import is the one that counts
# (and execute() need not read the environment on every call)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_forced_worker = False  # force_interpreter_worker() sets it (tests)


def interpreting() -> bool:
    """True when generated kernels run through Triton's interpreter in this process."""
    return _INTERPRETING


def cpu_kernels_in_worker() -> bool:
    """True when CPU tensors' kernels run in the interpreter process (this process compiles for
    the GPU, or a test forced it), False when they run through the interpreter here."""
    return _forced_worker or not _INTERPRETING


def force_interpreter_worker(enabled: bool) -> None:
    """Internal, for tests: send CPU tensors' kernels to the interpreter process even though this
    process interprets (as a GPU machine does); False returns to the default."""
    global _forced_worker
    _forced_worker = bool(enabled)


_INTERPRETED: dict = {}  # a jitted function's Python function -> its InterpretedFunction


def _interpreted(function):
    """`function` (a JITFunction or an InterpretedFunction) as an InterpretedFunction."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(function, InterpretedFunction):
        return function
    found = _INTERPRETED.get(function.fn)
    if found is None:
        found = _INTERPRETED[function.fn] = InterpretedFunction(function.fn)
    return found


def _call_interpreted(function, *args, **kwargs):
    """A compiled-mode JITFunction called from an interpreted kernel: run as the interpreter's."""
    return _interpreted(function)(*args, **kwargs)


@contextlib.contextmanager
def _jitted_calls_interpreted():
    """While it lasts, a JITFunction called from Python (only an interpreted kernel calls one:
    Triton's compiler never does) runs through the interpreter instead of refusing."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original


def run_interpreted(kernel, grid, args) -> None:
    """kernel[grid](*args) through Triton's interpreter, with the kernel and the jitted functions
    it calls interpreted however and whenever they were decorated. The caller makes sure no
    other interpreted kernel runs meanwhile (the interpreter patches triton.language)."""
    with _jitted_calls_interpreted():
        _interpreted(kernel)[grid](*args)


def _widen_bfloat16_dots():
    """Triton 3.6's interpreter keeps bf16 values as their uint16 bit patterns and its tl.dot
    multiplies those integers (o came out near 1e9). bf16 widens to float32 exactly (the bits
    shifted up by 16), so the interpreter's dot gets float32 operands instead; kernels on a GPU
    are untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "dnngraph_widens_bf16", False):
        return
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot.dnngraph_widens_bf16 = True
    builder.create_dot = create_dot


def _index_from_one_element():
    """Triton 3.6's interpreter takes a tensor's __index__ as int() of its numpy data, a
    one-element array of rank >= 1 that numpy 2.4 no longer converts (TypeError: only
    0-dimensional arrays can be converted to Python scalars); .item() reads the one element on
    every numpy."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "dnngraph_item_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.dnngraph_item_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _no_dead_overflow_checks():
    """Triton 3.6's interpreter builds with sanitize_overflow on and debug off: every integer add,
    sub and mul a kernel makes is redone in int64 and compared with its type's range, and then the
    assert that reads the comparison is dropped (device_assert does nothing without debug). That
    dead work took half of an interpreted pooling kernel's time; it is turned off while debug is
    off, as a GPU compile without debug checks nothing either."""
    import dataclasses

    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    if options.sanitize_overflow and not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if interpreting():
    from .interpreter_casts import install as _install_exact_conversions

    _install_exact_conversions()
    _widen_bfloat16_dots()
    _index_from_one_element()
    _no_dead_overflow_checks()
