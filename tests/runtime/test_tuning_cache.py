"""The persistent autotuning cache: round trip, keys, persistence, bad files, concurrency."""
import json
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from dnngraph.runtime import tuning_cache as tc
from dnngraph.runtime.tuning_cache import (TuningCache, TuningCacheWarning, default_cache,
                                              tuning_cache_path, tuning_key)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = os.path.join(ROOT, "dnngraph", "runtime", "tuning_cache.py")
KEY = tuning_key("NVIDIA H100 80GB HBM3", "3.6.0", "matmul", "M=128,N=256,K=64,f16")
RECORD = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "ms": 0.0123}

# Child processes load the module straight from its file: importing the dnngraph package pulls
# in torch (seconds per process), and the cache itself needs only the standard library.
LOAD_MODULE = textwrap.dedent(f"""
    import importlib.util, json, os, sys, time, warnings
    spec = importlib.util.spec_from_file_location("tuning_cache", {MODULE!r})
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
""")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(folder))
    return folder


def read_document(path):
    document = json.loads(path.read_text())
    assert document["format"] == "dnngraph-tuning"
    assert document["version"] == 1
    return document["entries"]


def test_round_trip(cache_dir):
    cache = TuningCache()
    assert cache.path == cache_dir / "tuning.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing file is the normal first run: no warning
        assert cache.lookup(KEY) is None
    cache.store(KEY, RECORD)
    assert cache.lookup(KEY) == RECORD
    assert cache.lookup(KEY + "x") is None
    # A second store merges; replacing a key keeps the other one.
    cache.store("other", {"BLOCK": 1024})
    cache.store(KEY, {**RECORD, "num_warps": 8})
    assert read_document(cache.path) == {KEY: {**RECORD, "num_warps": 8}, "other": {"BLOCK": 1024}}
    # A fresh object (no memo) reads the same, and results are copies the caller may edit.
    fresh = TuningCache(cache.path)
    got = fresh.lookup("other")
    assert got == {"BLOCK": 1024}
    got["BLOCK"] = 1
    assert fresh.lookup("other") == {"BLOCK": 1024}


def test_path_and_default_cache_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path / "a" / "b"))
    assert tuning_cache_path() == tmp_path / "a" / "b" / "tuning.json"
    assert (tmp_path / "a" / "b").is_dir()
    first = default_cache()
    assert first.path == tmp_path / "a" / "b" / "tuning.json"
    assert default_cache() is first
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache().path == tmp_path / "c" / "tuning.json"
    monkeypatch.delenv("DNNGRAPH_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning_cache_path() == tmp_path / "home" / ".cache" / "dnngraph" / "tuning.json"


def test_key_holds_all_four_parts():
    base = ("NVIDIA H100 80GB HBM3", "3.6.0", "matmul", "M=128,N=256,K=64,f16")
    key = tuning_key(*base)
    assert key == "NVIDIA H100 80GB HBM3|triton 3.6.0|matmul|M=128,N=256,K=64,f16"
    variants = {tuning_key(*base)}
    for index, other in enumerate(("NVIDIA H200", "3.5.1", "softmax", "M=128,N=256,K=64,f32")):
        parts = list(base)
        parts[index] = other
        variants.add(tuning_key(*parts))
    assert len(variants) == 5
    # The separator inside a part cannot make two different tuples collide.
    assert tuning_key("a|b", "1", "c", "d") != tuning_key("a", "b|1", "c", "d")
    assert tuning_key("a", "1", "c|d", "e") != tuning_key("a", "1", "c", "d|e")


def test_a_new_process_sees_stored_records(cache_dir):
    default_cache().store(KEY, RECORD)
    # The real import path and default_cache(), as a second build in a new process would use.
    code = ("import json; from dnngraph.runtime.tuning_cache import default_cache;"
            f"print(json.dumps(default_cache().lookup({KEY!r})))")
    env = {**os.environ, "DNNGRAPH_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == RECORD


def _valid_bytes(path):
    cache = TuningCache(path)
    for index in range(8):
        cache.store(f"key{index}", {"BLOCK": 2 ** index, "note": "x" * 40})
    data = path.read_bytes()
    path.unlink()
    return data


BAD_FILES = {
    "random bytes": (lambda path: random.Random(0).randbytes(512), "not valid JSON"),
    "truncated": (lambda path: (lambda data: data[:len(data) // 2])(_valid_bytes(path)),
                  "not valid JSON"),
    "empty": (lambda path: b"", "not valid JSON"),
    "JSON list": (lambda path: b'[{"format": "dnngraph-tuning"}]', "JSON list"),
    "other format": (lambda path: json.dumps({"format": "someone-else", "version": 1,
                                              "entries": {}}).encode(), "someone-else"),
    "newer version": (lambda path: json.dumps({"format": "dnngraph-tuning", "version": 99,
                                               "entries": {KEY: RECORD}}).encode(), "version 99"),
    "entries a list": (lambda path: json.dumps({"format": "dnngraph-tuning", "version": 1,
                                                "entries": [KEY, RECORD]}).encode(),
                       "'entries' is a JSON list"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_file_warns_and_is_rewritten(cache_dir, kind):
    path = tuning_cache_path()
    make, problem = BAD_FILES[kind]
    path.write_bytes(make(path))
    cache = TuningCache()
    with pytest.warns(TuningCacheWarning, match=problem) as caught:
        assert cache.lookup(KEY) is None
    assert str(path) in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Once per bad file state: neither a repeat lookup nor another object warns again.
        assert TuningCache().lookup(KEY) is None
        assert cache.lookup(KEY) is None
        cache.store("new", {"BLOCK": 256})
    assert read_document(path) == {"new": {"BLOCK": 256}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningCache().lookup("new") == {"BLOCK": 256}


def test_store_alone_rewrites_a_bad_file(cache_dir):
    path = tuning_cache_path()
    path.write_bytes(b"\x00\xff{garbage")
    with pytest.warns(TuningCacheWarning, match="not valid JSON"):
        TuningCache().store(KEY, RECORD)
    assert read_document(path) == {KEY: RECORD}


def test_records_that_are_not_objects_are_dropped(cache_dir):
    path = tuning_cache_path()
    path.write_text(json.dumps({"format": "dnngraph-tuning", "version": 1,
                                "entries": {KEY: RECORD, "bad1": 3, "bad2": [1, 2]}}))
    cache = TuningCache()
    with pytest.warns(TuningCacheWarning, match="dropping 2 entries"):
        assert cache.lookup("bad1") is None
    assert cache.lookup(KEY) == RECORD
    assert cache.lookup("bad2") is None
    cache.store("new", {"BLOCK": 8})
    assert read_document(path) == {KEY: RECORD, "new": {"BLOCK": 8}}


def test_store_rejects_records_that_are_not_json_dicts(cache_dir):
    cache = TuningCache()
    with pytest.raises(TypeError):
        cache.store(KEY, [1, 2])
    with pytest.raises(TypeError):
        cache.store(KEY, {"f": object()})
    assert not cache.path.exists()


WRITER = LOAD_MODULE + textwrap.dedent("""
    path, index, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    warnings.simplefilter("error")
    open(os.path.join(sync, f"ready{index}"), "w").close()
    while not os.path.exists(os.path.join(sync, "go")):
        time.sleep(0.001)
    cache = tc.TuningCache(path)  # one long-lived object, so its memo is exercised too
    for j in range(25):
        cache.store(f"w{index}-{j}", {"writer": index, "j": j, "BLOCK": [16 * (j + 1), 64]})
""")

READER = LOAD_MODULE + textwrap.dedent("""
    path, sync = sys.argv[1], sys.argv[2]
    warnings.simplefilter("error")  # any TuningCacheWarning (a partial file seen) fails the run
    keys = [f"w{i}-{j}" for i in range(4) for j in range(25)]
    open(os.path.join(sync, "ready-reader"), "w").close()
    while not os.path.exists(os.path.join(sync, "go")):
        time.sleep(0.001)
    cache = tc.TuningCache(path)
    seen, reads, states = set(), 0, set()
    while not os.path.exists(os.path.join(sync, "stop")):
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            continue
        document = json.loads(raw)  # raises on a partial file
        assert document["format"] == "dnngraph-tuning" and document["version"] == 1
        present = set(document["entries"])
        assert seen <= present, f"entries vanished: {sorted(seen - present)}"  # no lost update
        seen = present
        states.add(len(present))
        # lookup() reads the file again, later, so it must find at least what was just read.
        found = {key for key in keys if cache.lookup(key) is not None}
        assert seen <= found, f"lookup missed {sorted(seen - found)}"
        reads += 1
    print(json.dumps({"reads": reads, "states": len(states)}))
""")


def test_concurrent_writers_and_a_reader(tmp_path):
    path = tmp_path / "tuning.json"
    sync = tmp_path / "sync"
    sync.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(index), str(sync)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for index in range(4)]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), str(sync)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Release everyone at once so the 100 stores interleave rather than run in sequence.
        deadline = time.monotonic() + 60
        while len(list(sync.iterdir())) < 5:
            assert time.monotonic() < deadline, "child processes did not start"
            time.sleep(0.005)
        (sync / "go").touch()
        for writer in writers:
            _, err = writer.communicate(timeout=60)
            assert writer.returncode == 0, err
    finally:
        (sync / "stop").touch()
        out, err = reader.communicate(timeout=60)
        for process in writers:
            if process.poll() is None:
                process.kill()
    assert reader.returncode == 0, err
    report = json.loads(out)
    assert report["reads"] > 0
    assert report["states"] > 1, f"the reader never overlapped the writers: {report}"
    entries = read_document(path)
    expected = {f"w{i}-{j}": {"writer": i, "j": j, "BLOCK": [16 * (j + 1), 64]}
                for i in range(4) for j in range(25)}
    assert entries == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = TuningCache(path)
        assert all(cache.lookup(key) == record for key, record in expected.items())
    # Only the cache and its lock file remain: no temp file leaked.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sync", "tuning.json",
                                                          "tuning.json.lock"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_unwritable_folder_warns_and_does_not_raise(cache_dir):
    cache = TuningCache()
    cache.store("before", {"BLOCK": 1})
    os.chmod(cache_dir, 0o500)
    try:
        with pytest.warns(TuningCacheWarning, match="could not store"):
            cache.store(KEY, RECORD)
        assert cache.lookup("before") == {"BLOCK": 1}
        assert cache.lookup(KEY) is None
    finally:
        os.chmod(cache_dir, 0o700)


def test_folder_that_cannot_exist_warns_and_does_not_raise(tmp_path, monkeypatch):
    # A plain file where the folder should be: fails even for root, unlike permissions.
    (tmp_path / "blocker").write_text("")
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path / "blocker" / "cache"))
    cache = default_cache()
    with pytest.warns(TuningCacheWarning, match="could not store"):
        cache.store(KEY, RECORD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # store already said so; a lookup just misses
        assert cache.lookup(KEY) is None


def test_module_uses_only_the_standard_library():
    code = LOAD_MODULE + "print([m for m in ('torch', 'triton', 'dnngraph') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert tc.FORMAT == "dnngraph-tuning" and tc.VERSION == 1


# --- records: validated before use, keyed by the dnngraph version ----------------------------------
def _matmul_record(**changes):
    from dnngraph.backends.triton.heuristics.matmul import MatmulConfig
    return {**MatmulConfig("tiled", 64, 64, 32, 4, 3).to_record(), **changes}


def _row_record(**changes):
    from dnngraph.backends.triton.heuristics.rows import RowConfig
    return {**RowConfig("looped", 1, 2048, 8, 1, 0.0).to_record(), **changes}


@pytest.mark.parametrize("changes", [{"variant": "fastest"}, {"block_m": 3}, {"block_n": 10**9},
                                     {"block_k": 1e9}, {"block_m": "64"}, {"num_warps": 3},
                                     {"num_stages": 0}, {"split_k": -2}, {"flatten": "yes"},
                                     {"block_m": True}, {"variant": None}])
def test_matmul_record_rejects_illegal_values(changes):
    from dnngraph.backends.triton.heuristics.matmul import MatmulConfig
    assert MatmulConfig.from_record(_matmul_record()).block_m == 64
    with pytest.raises(ValueError):
        MatmulConfig.from_record(_matmul_record(**changes))


@pytest.mark.parametrize("changes", [{"mode": "turbo"}, {"block_r": 3}, {"block_k": 1e9},
                                     {"block_r": "2048"}, {"num_warps": 32}, {"splits": 0}])
def test_row_record_rejects_illegal_values(changes):
    from dnngraph.backends.triton.heuristics.rows import RowConfig
    assert RowConfig.from_record(_row_record()).block_r == 2048
    with pytest.raises(ValueError):
        RowConfig.from_record(_row_record(**changes))


def _tuner_setup(tmp_path):
    from dnngraph.runtime.autotune import Tuner
    from dnngraph.backends.triton.heuristics.rows import RowConfig
    from dnngraph.target import target_of
    ranked = [RowConfig("looped", 1, 2048, 8, 1, 1.0), RowConfig("one_pass", 1, 4096, 8, 1, 2.0)]
    tuner = Tuner(target_of(), TuningCache(tmp_path / "tuning.json"), progress=False)
    timed = []

    def choose():
        return tuner.choose("rows", "sig", ranked, RowConfig.to_record, RowConfig.from_record,
                            lambda c: c.text, lambda c: timed.append(c) or 1.0 + len(timed))
    return tuner, ranked, timed, choose


@pytest.mark.parametrize("record", [{"config": _row_record(mode="unknown")},
                                    {"config": _row_record(block_r=3)},
                                    {"config": _row_record(block_k=10**9)},
                                    {"config": _row_record(block_r="big")},
                                    {"config": _row_record(block_r=1024)},  # legal, not a candidate
                                    {"config": "looped"}])
def test_tuner_ignores_a_bad_record_with_a_warning(tmp_path, record):
    import triton
    from dnngraph import __version__
    tuner, ranked, timed, choose = _tuner_setup(tmp_path)
    key = tuning_key(tuner.target.name, triton.__version__, "rows", "sig", __version__)
    tuner.cache.store(key, record)
    with pytest.warns(TuningCacheWarning, match="ignoring the record"):
        config, how = choose()
    assert how.source == "tuned" and timed and config == ranked[0]
    with warnings.catch_warnings():  # the tuned winner replaced the bad record
        warnings.simplefilter("error")
        assert choose()[1].source == "cache"


def test_records_of_another_dnngraph_version_are_not_used(tmp_path):
    import triton
    from dnngraph import __version__
    tuner, ranked, timed, choose = _tuner_setup(tmp_path)
    other = tuning_key(tuner.target.name, triton.__version__, "rows", "sig", "0.0.0-other")
    tuner.cache.store(other, {"config": ranked[1].to_record()})
    config, how = choose()
    assert how.source == "tuned" and timed
    ours = tuning_key(tuner.target.name, triton.__version__, "rows", "sig", __version__)
    assert ours != other and "dnngraph " + __version__ in ours
    assert set(read_document(tuner.cache.path)) == {other, ours}
    config, how = choose()
    assert how.source == "cache" and config == ranked[0]
