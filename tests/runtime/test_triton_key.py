"""Triton's installation key cached per installation (runtime/triton_key.py)."""
import os

import pytest
import triton
from triton.runtime import cache

from dnngraph.runtime import triton_key as tk


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DNNGRAPH_TRITON_KEY_CACHE", raising=False)
    tk.uninstall()
    yield tmp_path
    tk.uninstall()


def test_cached_key_is_tritons_and_read_back(fresh, monkeypatch):
    own = cache.triton_key
    assert tk.install()
    assert cache.triton_key is tk.cached_triton_key
    key = cache.triton_key()
    assert key == own()  # the very string Triton computes
    assert tk.key_path(tk.installation_stamp()).read_text() == key
    tk.uninstall()  # a new process: nothing in memory
    assert cache.triton_key is own
    monkeypatch.setattr(tk, "_computed", lambda: pytest.fail("computed although the key file holds it"))
    assert tk.cached_triton_key() == key


def test_malformed_key_file_is_recomputed(fresh, monkeypatch):
    path = tk.key_path(tk.installation_stamp())
    path.parent.mkdir(parents=True)
    path.write_text("3.6.0planted")
    monkeypatch.setattr(tk, "_computed", lambda: triton.__version__ + "ab" * 32)
    assert tk.cached_triton_key() == triton.__version__ + "ab" * 32
    assert path.read_text() == triton.__version__ + "ab" * 32


def test_opt_out_leaves_triton_alone(fresh, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_TRITON_KEY_CACHE", "0")
    own = cache.triton_key
    assert not tk.install()
    assert cache.triton_key is own


def test_stamp_follows_every_file_triton_key_reads(tmp_path, monkeypatch):
    root = tmp_path / "triton"
    for folder in ("compiler", "backends/nvidia", "language", "_C", "runtime"):
        (root / folder).mkdir(parents=True)
    files = [root / "compiler/compiler.py", root / "backends/nvidia/driver.py", root / "language/core.py",
             root / "_C/libtriton.so", root / "runtime/cache.py"]
    for file in files:
        file.write_text("x")
    monkeypatch.setattr(tk, "_triton_root", lambda: str(root))
    seen = {tk.installation_stamp()}
    assert tk.installation_stamp() in seen  # stable while nothing changes
    for file in files:
        file.write_text("xy")  # rewritten (size)
        seen.add(tk.installation_stamp())
        os.utime(file, ns=(1, 1))  # same size, another mtime
        seen.add(tk.installation_stamp())
    (root / "language/extra.py").write_text("")  # a file added
    seen.add(tk.installation_stamp())
    (root / "language/extra.py").unlink()
    (root / "compiler/compiler.py").unlink()  # a file removed
    seen.add(tk.installation_stamp())
    assert len(seen) == 2 * len(files) + 3
    (root / "language/__pycache__").mkdir()  # bytecode triton_key does not read
    (root / "language/__pycache__/core.pyc").write_text("")
    assert tk.installation_stamp() in seen
