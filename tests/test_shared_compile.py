"""Kernels that differ only in their names (a ResNet's repeated blocks) compile once per process:
the key is the source's syntax tree without the kernel's name and comments, Triton's warmup
arguments with their types, the options and the device."""
import threading
import time

import pytest

import dnngraph as dg
from dnngraph.codegen.cache import kernel_source
from dnngraph.plan import launch as launch_module
from dnngraph.plan.launch import name_free_digest, shared_compile


def _plan_launches(second="relu"):
    """Launches of relu(a @ w1), second(b @ w2) and relu(b @ w1): the first and last differ in
    their names and comments alone."""
    g = dg.Graph(name="blocks", io_data_type=dg.float32)
    a, b = g.tensor(name="a", dim=[8, 16]), g.tensor(name="b", dim=[8, 16])
    w1, w2 = g.tensor(name="w1", dim=[16, 8]), g.tensor(name="w2", dim=[16, 8])
    g.relu(g.matmul(a, w1)).set_output(True).set_name("y1")
    getattr(g, second)(g.matmul(b, w2)).set_output(True).set_name("y2")
    g.relu(g.matmul(b, w1)).set_output(True).set_name("y3")
    g.build()
    return g.plan.launches


def _digest(launch):
    return name_free_digest(kernel_source(launch.kernel, launch.source_path), launch.kernel.__name__)


def test_kernels_differing_in_names_alone_digest_alike():
    first, other, last = _plan_launches("sigmoid")
    assert first.kernel.__name__ != last.kernel.__name__
    assert kernel_source(first.kernel, first.source_path) != kernel_source(last.kernel, last.source_path)
    assert _digest(first) == _digest(last)
    assert _digest(other) != _digest(first)


def test_the_digest_keeps_everything_but_the_name_comments_and_docstring():
    source = '"""Generated. reads x"""\nimport triton\n\n@triton.jit\ndef k_1(x_ptr, N):  # k_1\n    k_12 = N\n'
    renamed = source.replace("k_1(", "k_2(").replace("reads x", "reads y").replace("# k_1", "# other")
    assert name_free_digest(source, "k_1") == name_free_digest(renamed, "k_2")
    # an identifier that merely starts with the name is another variable, kept as written
    assert name_free_digest(source, "k_1") != name_free_digest(source.replace("k_12", "k_22"), "k_1")
    assert name_free_digest(source, "k_1") != name_free_digest(source.replace("N\n", "N + 1\n"), "k_1")


def test_shared_compile_runs_once_per_key_across_threads(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    calls, results = [], []

    def slow():
        calls.append(1)
        time.sleep(0.05)
        return object()
    threads = [threading.Thread(target=lambda: results.append(shared_compile("k", slow))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 6 and all(r is results[0] for r in results)
    assert shared_compile("other", object) is not results[0]


def test_a_failed_compile_raises_and_is_tried_again(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})

    def broken():
        raise RuntimeError("ptxas said no")
    with pytest.raises(RuntimeError, match="ptxas"):
        shared_compile("k", broken)
    made = object()
    assert shared_compile("k", lambda: made) is made


class _FakeKernel:
    """Stands in for a JITFunction: counts warmups, returns a compiled stand-in."""

    def __init__(self, name, warmups):
        self.__name__, self.warmups = name, warmups

    def warmup(self, *args, grid, **options):
        self.warmups.append((self.__name__, args, options))
        return type("Compiled", (), {"_init_handles": lambda self: None})()


def test_launches_share_a_compile_only_where_code_arguments_and_options_agree(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    first, other, last = _plan_launches("sigmoid")
    warmups = []
    for launch in (first, other, last):
        monkeypatch.setattr(launch, "kernel", _FakeKernel(launch.kernel.__name__, warmups))
    args = list(first.template)
    assert first._compiled(args, 0) is last._compiled(args, 0)
    assert len(warmups) == 1
    other._compiled(args, 0)
    assert len(warmups) == 2
    for changed in (1, True, 1.0):  # equal in Python, not to Triton's specialization
        last._compiled(args[:-1] + [changed], 0)
    last._compiled(args, 1)  # another device
    assert len(warmups) == 6
    monkeypatch.setattr(last, "num_warps", last.num_warps * 2)
    last._compiled(args, 0)
    assert len(warmups) == 7
