"""Only the source a plan generated and hashed ever runs, in any process. A kernel's cache file
changed after the build (a shared or writable DNNGRAPH_CACHE_DIR) is never run: not by Triton's
interpreter in this process (which reads a kernel's source when it first runs it), not by the
interpreter process for CPU tensors on a GPU machine (sent the generated text, never the file),
not by another process building the same graph over the changed folder (the file is written
again from its source). Each tampered file leaves a marker when any of its code runs."""
import linecache
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dnngraph as dg
from dnngraph.runtime import interpreter as runtime
from dnngraph.runtime.kernel_files import named_source, source_digest
from dnngraph.runtime import plan_cache as plan_cache
from dnngraph.runtime import interpreter_worker
from helpers import poisoned, rel_err

REPO = Path(__file__).resolve().parents[2]


def _graph(factor: float):
    """y = exp(x * factor) + x, its own kernel source for each factor (a literal in it)."""
    g = dg.Graph(name="integrity")
    x = g.tensor(name="x", dim=[5, 9])
    g.add(g.exp(g.scale(x, factor)), x).set_output(True).set_name("y")
    return g


def _tamper(path: Path, marker: Path) -> str:
    """Change the file at `path` so that its module-level code and its kernel's body each create
    `marker` when they run (line numbers kept: inspect finds the changed body where the
    original's was); returns the original text."""
    original = path.read_text()
    lines = original.splitlines(keepends=True)
    mark = f"open({str(marker)!r}, 'w').close()"
    lines[0] = mark + "\n"  # the docstring line
    signature_end = next(i for i, line in enumerate(lines)
                         if line.rstrip() == "):" and any(l.startswith("def ") for l in lines[:i]))
    body = lines[signature_end + 1]
    indent = body[:len(body) - len(body.lstrip())]
    lines[signature_end + 1] = f"{indent}{mark}; {body.lstrip()}"
    path.write_text("".join(lines))
    return original


def _run_and_check(g):
    x = g.tensor_by_name("x")
    y = g.tensor_by_name("y")
    xt = torch.randn(5, 9)
    out = poisoned(y)
    g.execute({x: xt, y: out})
    assert rel_err(out, g.reference({x: xt})["y"]) < 2e-5


@pytest.fixture(params=["in_this_process", "in_the_interpreter_process"])
def where(request):
    runtime.force_interpreter_worker(request.param == "in_the_interpreter_process")
    yield request.param
    runtime.force_interpreter_worker(False)


@pytest.mark.parametrize("linecache_cleared", [False, True])
def test_a_cache_file_changed_after_build_never_runs(where, linecache_cleared, tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    factor = 1.25 + 0.125 * linecache_cleared + 0.5 * (where == "in_the_interpreter_process")
    g = _graph(factor).build()
    marker = tmp_path / "tampered_code_ran"
    originals = {launch.source_path: _tamper(launch.source_path, marker) for launch in g.plan.launches}
    if linecache_cleared:  # what a debugger or doctest may do: no cached text to fall back on
        linecache.clearcache()
    _run_and_check(g)
    assert not marker.exists()
    # a build that loads the kernels again writes the files back from their sources
    plan_cache.clear()
    g2 = _graph(factor).build()
    assert {launch.source_path: launch.source_path.read_text() for launch in g2.plan.launches} == originals
    _run_and_check(g2)
    assert not marker.exists()


def test_another_process_building_over_a_changed_cache_folder_runs_the_generated_source(tmp_path,
                                                                                         monkeypatch):
    """Built here (files written), changed, then a second process builds the same graph over the
    same folder: it runs its own generated source, and the files hold it again."""
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    g = _graph(2.75).build()
    marker = tmp_path / "tampered_code_ran"
    originals = {launch.source_path: _tamper(launch.source_path, marker) for launch in g.plan.launches}
    script = textwrap.dedent('''\
        import sys, torch
        sys.path[:0] = ["tests", "tests/backends"]
        import dnngraph as dg
        from helpers import poisoned, rel_err
        from test_kernel_source_integrity import _graph, _run_and_check
        _run_and_check(_graph(2.75).build())
        print("ran")
        ''')
    env = dict(os.environ, DNNGRAPH_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
    assert not marker.exists()
    assert {path: path.read_text() for path in originals} == originals


def test_the_interpreter_process_runs_a_source_only_under_the_hash_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    rendered = "import triton\n\n\n@triton.jit\ndef some_kernel(x_ptr):\n    pass\n"
    name, text = named_source(rendered, "some_kernel")
    assert name == f"some_kernel_{source_digest(rendered)}" and f"def {name}(" in text
    key = str(tmp_path / f"{name}.py")
    assert interpreter_worker._loaded(key, name, text).__name__ == name
    changed_name, changed = named_source(rendered.replace("pass", "return"), "some_kernel")
    refused = [(key, name, changed),  # another body under the name
               (key, name, text.replace("pass", "return")),
               (key, changed_name, changed),  # a name the key does not hold
               (key, name, rendered),  # the source as rendered, not as named
               (key, name, text.replace("import triton", f"# def {name}(\nimport triton"))]
    for request in refused:
        with pytest.raises(RuntimeError, match="not the one its name hashes"):
            interpreter_worker._loaded(*request)


@pytest.mark.parametrize("suffix", ["#generated", ".generated", "_generated", "generated"])
def test_a_file_planted_beside_the_cache_file_never_runs(where, suffix, tmp_path, monkeypatch):
    """A kernel's code is named inside its cache file (a path no file can have): a planted
    sibling, under any name the code's could be guessed as, is never read as its source, even
    with linecache cleared before the first launch."""
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    factor = 3.25 + 0.5 * (where == "in_the_interpreter_process") + 0.0625 * len(suffix)
    g = _graph(factor).build()
    marker = tmp_path / "tampered_code_ran"
    for launch in g.plan.launches:
        planted = Path(str(launch.source_path) + suffix)
        planted.write_text(launch.source_path.read_text())
        _tamper(planted, marker)
        with pytest.raises(OSError):  # nothing can be planted at the name the code carries
            Path(str(launch.source_path) + "/generated").write_text("x = 1\n")
    linecache.clearcache()
    _run_and_check(g)
    assert not marker.exists()
