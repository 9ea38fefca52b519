"""The tuning cache as one JSON file: `python -m dnngraph tuning export|import FILE`.

Export writes the cache's valid records (one GPU model's with --device) atomically; import checks
every record of the file before touching the cache, refuses the whole file (typed error, cache
unchanged) when one is bad, and merges the rest under the writer lock: new keys added, equal ones
left, a differing local record kept unless --overwrite. Records are keyed by GPU model and
Triton version, so one imported for another model is never used here."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import dnngraph as dg  # before triton: it sets TRITON_INTERPRET on a CPU-only machine
import triton
from dnngraph import __version__
from dnngraph.__main__ import main
from dnngraph.runtime.autotune import Tuner
from dnngraph.backends.triton.heuristics.depthwise import DepthwiseConfig
from dnngraph.backends.triton.heuristics.matmul import MatmulConfig
from dnngraph.backends.triton.heuristics.rows import RowConfig
from dnngraph.runtime.tuning_cache import TuningCache, parse_tuning_key, tuning_key, tuning_cache_path
from dnngraph.backends.triton.heuristics.tuning_transfer import check_entry, export_tuning, import_tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _target(name: str) -> dg.Target:
    """An H100's target under the device name `name` (tuning keys hold the name)."""
    return dataclasses.replace(dg.target.H100, name=name)


def _key(device=H100, family="matmul", signature="M=128,N=256,K=64,bf16", triton_version=None,
         dnngraph_version=None):
    return tuning_key(device, triton_version or triton.__version__, family, signature,
                      dnngraph_version or __version__)


def _matmul_record(block_m=64, ms=0.0123):
    config = MatmulConfig("tiled", block_m, 128, 64, 4, 3)
    return {"config": config.to_record(), "timings": [[config.text, 0, ms], ["other", 2, ms * 2]]}


ROW_RECORD = {"config": RowConfig("looped", 1, 2048, 8, 1, 0.0).to_record(), "timings": [["looped", 0, 0.5]]}
DEPTHWISE_RECORD = {"config": DepthwiseConfig("gather", 64, 32, 4, 1, 1, False).to_record()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return TuningCache(tuning_cache_path())


def _fill(cache):
    records = {_key(H100): _matmul_record(), _key(H200): _matmul_record(block_m=128),
               _key(H100, "rows", "softmax R=4096"): ROW_RECORD,
               _key(H200, "depthwise", "fprop 3x3"): DEPTHWISE_RECORD}
    for key, record in records.items():
        cache.store(key, record)
    return records


def _document(path):
    data = json.loads(path.read_text())
    assert data["format"] == "dnngraph-tuning" and data["version"] == 1
    return data["entries"]


def _write_document(path, entries, **envelope):
    path.write_text(json.dumps({"format": "dnngraph-tuning", "version": 1, "entries": entries, **envelope}))


# --- keys ----------------------------------------------------------------------------------------
def test_keys_name_the_gpu_model_and_the_triton_version():
    key = tuning_key("GPU|with\\bars", "3.6.0", "matmul", "M=1|N=2", "0.1.0")
    parts = parse_tuning_key(key)
    assert parts.device == "GPU|with\\bars" and parts.triton_version == "3.6.0"
    assert parts.family == "matmul" and parts.signature == "M=1|N=2" and parts.dnngraph_version == "0.1.0"
    assert tuning_key(*parts[:4], parts.dnngraph_version) == key
    assert parse_tuning_key(tuning_key("d", "1", "f", "s")).dnngraph_version is None
    for bad in ("only|three|parts", "d|3.6|matmul|s", "d|triton 3|x|matmul|s", "a\\b|triton 1|f|s"):
        with pytest.raises(ValueError):
            parse_tuning_key(bad)


def test_records_of_another_gpu_model_are_never_used(tmp_path):
    cache = TuningCache(tmp_path / "tuning.json")
    ranked = [RowConfig("looped", 1, 2048, 8, 1, 1.0), RowConfig("one_pass", 1, 4096, 8, 1, 2.0)]
    timed = []

    def choose(device_name):
        tuner = Tuner(_target(device_name), cache, progress=False)
        return tuner.choose("rows", "sig", ranked, RowConfig.to_record, RowConfig.from_record,
                            lambda c: c.text, lambda c: timed.append(c) or 3.0 - len(timed))

    assert choose(H100)[1].source == "tuned" and len(timed) == 2  # the one_pass config wins
    key = _key(H100, "rows", "sig")
    assert set(_document(cache.path)) == {key}
    assert parse_tuning_key(key).device == H100 and parse_tuning_key(key).triton_version == triton.__version__
    config, how = choose(H200)  # same problem, other GPU model: a miss, timed again
    assert how.source == "tuned" and len(timed) == 4
    assert set(_document(cache.path)) == {key, _key(H200, "rows", "sig")}
    assert choose(H100)[1].source == "cache" and len(timed) == 4


def test_an_imported_record_is_used_only_on_its_gpu_model(tmp_path, cache):
    shipped = tmp_path / "shipped.json"
    one_pass = RowConfig("one_pass", 1, 4096, 8, 1, 0)
    _write_document(shipped, {_key(H100, "rows", "sig"): {"config": one_pass.to_record()}})
    assert import_tuning(shipped, cache=cache).merged.added == (_key(H100, "rows", "sig"),)
    ranked = [RowConfig("looped", 1, 2048, 8, 1, 1.0), RowConfig("one_pass", 1, 4096, 8, 1, 2.0)]

    def choose(device_name):
        tuner = Tuner(_target(device_name), cache, progress=False)
        return tuner.choose("rows", "sig", ranked, RowConfig.to_record, RowConfig.from_record,
                            lambda c: c.text, lambda c: 1.0)

    config, how = choose(H100)
    assert how.source == "cache" and config == ranked[1]
    config, how = choose(H200)
    assert how.source == "tuned" and config == ranked[0]


# --- export --------------------------------------------------------------------------------------
def test_export_writes_every_valid_record(tmp_path, cache):
    records = _fill(cache)
    cache.store(tuning_key(H100, "3.6.0", "matmul", "no dnngraph version"), _matmul_record())
    cache.store(_key(H100, "sdpa", "not a tuned family"), _matmul_record())
    destination = tmp_path / "out" / "tuning-export.json"
    destination.parent.mkdir()
    report = export_tuning(destination, cache=cache)
    assert report.exported == 4 and len(report.skipped) == 2
    assert report.devices == (H100, H200)
    assert _document(destination) == records
    assert os.listdir(destination.parent) == ["tuning-export.json"], "no temp file left behind"


def test_export_filters_by_device(tmp_path, cache):
    records = _fill(cache)
    destination = tmp_path / "h200.json"
    report = export_tuning(destination, device=H200, cache=cache)
    assert report.exported == 2
    assert _document(destination) == {k: v for k, v in records.items() if parse_tuning_key(k).device == H200}
    assert export_tuning(destination, device="NVIDIA A100", cache=cache).exported == 0
    assert _document(destination) == {}


def test_export_of_a_real_tuner_record_imports_back(tmp_path, cache):
    tuner = Tuner(_target(H100), cache, progress=False)
    ranked = [MatmulConfig("tiled", 64, 64, 32, 4, 3), MatmulConfig("tiled", 128, 64, 32, 8, 3)]
    tuner.choose("matmul", "sig", ranked, MatmulConfig.to_record, MatmulConfig.from_record, lambda c: c.text,
                 lambda c: 0.1 * c.block_m)
    destination = tmp_path / "one.json"
    assert export_tuning(destination, cache=cache).exported == 1
    for key, record in _document(destination).items():
        check_entry(key, record)
    (tmp_path / "empty").mkdir()
    assert len(import_tuning(destination, cache=TuningCache(tmp_path / "empty" / "tuning.json")).merged.added) == 1


def test_export_refuses_a_corrupt_cache_and_writes_nothing(tmp_path, cache):
    cache.path.write_bytes(b"{not json")
    destination = tmp_path / "out.json"
    with pytest.raises(dg.SerializationError, match="not valid JSON.*nothing was exported"):
        export_tuning(destination, cache=cache)
    assert not destination.exists()


# --- import --------------------------------------------------------------------------------------
def test_import_into_an_empty_cache(tmp_path, cache):
    source = TuningCache(tmp_path / "elsewhere" / "tuning.json")
    (tmp_path / "elsewhere").mkdir()
    records = _fill(source)
    shipped = tmp_path / "shipped.json"
    export_tuning(shipped, cache=source)
    assert not cache.path.exists()
    report = import_tuning(shipped, cache=cache)
    assert report.merged.added == tuple(sorted(records))
    assert not (report.merged.identical or report.merged.replaced or report.merged.kept)
    assert report.cache_path == cache.path and report.other_versions == 0
    assert _document(cache.path) == records
    assert TuningCache(cache.path).lookup(_key(H100)) == records[_key(H100)]


def test_import_merges_and_keeps_the_local_record_on_a_conflict(tmp_path, cache):
    same, differs, new, local_only = _key(H100), _key(H200), _key(H100, "rows", "r"), _key(H200, "rows", "r")
    cache.store(same, _matmul_record())
    cache.store(differs, _matmul_record(ms=0.5))
    cache.store(local_only, ROW_RECORD)
    shipped = tmp_path / "shipped.json"
    incoming = {same: _matmul_record(), differs: _matmul_record(block_m=128, ms=0.25), new: ROW_RECORD}
    _write_document(shipped, incoming)
    merged = import_tuning(shipped, cache=cache).merged
    assert (merged.added, merged.identical, merged.kept, merged.replaced) == ((new,), (same,), (differs,), ())
    assert _document(cache.path) == {same: _matmul_record(), differs: _matmul_record(ms=0.5), new: ROW_RECORD,
                                     local_only: ROW_RECORD}
    merged = import_tuning(shipped, overwrite=True, cache=cache).merged
    assert (merged.added, merged.identical, merged.kept, merged.replaced) == ((), (same, new), (), (differs,))
    assert _document(cache.path) == {**incoming, local_only: ROW_RECORD}


def test_import_keeps_what_another_process_stored_meanwhile(tmp_path, cache):
    assert cache.lookup(_key(H100)) is None  # this object has read (and memoised) the cache
    TuningCache(cache.path).store(_key(H100), _matmul_record())  # another writer
    shipped = tmp_path / "shipped.json"
    _write_document(shipped, {_key(H200): _matmul_record()})
    import_tuning(shipped, cache=cache)
    assert set(_document(cache.path)) == {_key(H100), _key(H200)}


def test_import_counts_records_of_other_versions(tmp_path, cache):
    shipped = tmp_path / "shipped.json"
    _write_document(shipped, {_key(triton_version="0.0.1"): _matmul_record(),
                              _key(dnngraph_version="9.9.9"): _matmul_record(), _key(): _matmul_record()})
    report = import_tuning(shipped, cache=cache)
    assert len(report.merged.added) == 3 and report.other_versions == 2


def _with_record(record):
    return {"format": "dnngraph-tuning", "version": 1, "entries": {_key(): record}}


def _config(**changes):
    return {**_matmul_record(), "config": {**_matmul_record()["config"], **changes}}


BAD_FILES = {
    "not JSON": (b"{\"format\": ", "not valid JSON"),
    "a JSON list": ([], "holds a JSON list"),
    "foreign format": ({"format": "someone-else", "version": 1, "entries": {}}, "someone-else"),
    "newer version": ({"format": "dnngraph-tuning", "version": 2, "entries": {}}, "version 2"),
    "entries a list": ({"format": "dnngraph-tuning", "version": 1, "entries": []}, "'entries' is a JSON list"),
    "record a list": (_with_record([1, 2]), "not an object"),
    "no config": (_with_record({"timings": []}), "must hold 'config'"),
    "extra field": (_with_record({**_matmul_record(), "kernel_source": "import os"}), "must hold 'config'"),
    "unknown variant": (_with_record(_config(variant="turbo")), "variant"),
    "block not a power of two": (_with_record(_config(block_m=48)), "block_m"),
    "block as a string": (_with_record(_config(block_n="128")), "block_n"),
    "block as a float": (_with_record(_config(block_k=64.0)), "block_k"),
    "bool as an int": (_with_record(_config(flatten=1)), "flatten"),
    "extra config field": (_with_record(_config(source="x")), "is not what MatmulConfig writes"),
    "missing config field": (_with_record({"config": {k: v for k, v in _matmul_record()["config"].items()
                                                      if k != "split_k"}}), "is not what MatmulConfig writes"),
    "timings not a list": (_with_record({**_matmul_record(), "timings": "fast"}), "timings is a str"),
    "timing rank a bool": (_with_record({**_matmul_record(), "timings": [["t", True, 1.0]]}), "rank"),
    "timing ms infinite": (_with_record({**_matmul_record(), "timings": [["t", 0, float("inf")]]}), "finite"),
    "timing ms negative": (_with_record({**_matmul_record(), "timings": [["t", 0, -1.0]]}), "finite"),
}
BAD_KEYS = {
    "unknown family": (_key(family="sdpa"), "family 'sdpa'"),
    "no dnngraph version": (tuning_key(H100, "3.6.0", "matmul", "sig"), "no dnngraph version"),
    "not a tuning key": ("hello", "1 parts"),
    "empty device": (_key(device=""), "empty"),
}


def _bad_file(tmp_path, content):
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(json.dumps(content))
    return path


def _refused(cache, path, problem):
    before = (cache.path.read_bytes(), os.stat(cache.path).st_ino, os.stat(cache.path).st_mtime_ns)
    with pytest.raises(dg.SerializationError, match=problem) as caught:
        import_tuning(path, cache=cache)
    assert "nothing was imported" in str(caught.value)
    assert str(path) in str(caught.value)
    assert (cache.path.read_bytes(), os.stat(cache.path).st_ino, os.stat(cache.path).st_mtime_ns) == before
    assert [name for name in os.listdir(cache.path.parent) if name.endswith(".tmp")] == []


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_import_refuses_a_bad_file_and_changes_nothing(tmp_path, cache, kind):
    _fill(cache)
    content, problem = BAD_FILES[kind]
    _refused(cache, _bad_file(tmp_path, content), problem)


@pytest.mark.parametrize("kind", list(BAD_KEYS))
def test_import_refuses_a_bad_key_and_changes_nothing(tmp_path, cache, kind):
    _fill(cache)
    key, problem = BAD_KEYS[kind]
    entries = {_key(H200, "rows", "fine"): ROW_RECORD, key: _matmul_record()}
    _refused(cache, _bad_file(tmp_path, {"format": "dnngraph-tuning", "version": 1, "entries": entries}), problem)


def test_import_names_the_bad_records_and_how_many(tmp_path, cache):
    _fill(cache)
    entries = {_key(signature=f"s{index}"): _config(block_m=3) for index in range(8)}
    with pytest.raises(dg.SerializationError, match=r"8 of 8 records .*\(and 3 more\)"):
        import_tuning(_bad_file(tmp_path, {"format": "dnngraph-tuning", "version": 1, "entries": entries}),
                      cache=cache)


def test_import_of_a_missing_file_is_refused(tmp_path, cache):
    with pytest.raises(dg.SerializationError, match="cannot read"):
        import_tuning(tmp_path / "absent.json", cache=cache)
    assert not cache.path.exists()


# --- the command line ----------------------------------------------------------------------------
def test_cli_export_and_import(tmp_path, cache, capsys):
    records = _fill(cache)
    shipped = tmp_path / "shipped.json"
    assert main(["tuning", "export", str(shipped), "--device", H100]) == 0
    out = capsys.readouterr().out
    assert f"exported 2 tuning records to {shipped}" in out
    assert set(_document(shipped)) == {k for k in records if parse_tuning_key(k).device == H100}
    assert main(["tuning", "export", str(tmp_path / "none.json"), "--device", "NVIDIA A100"]) == 0
    assert f"the cache holds records for: {H100}, {H200}" in capsys.readouterr().out

    cache.store(_key(H100), _matmul_record(ms=0.9))  # now differs from the shipped record
    cache.store(_key(H100, "rows", "softmax R=4096"), ROW_RECORD)
    assert main(["tuning", "import", str(shipped)]) == 0
    out = capsys.readouterr().out
    assert "imported 2 tuning records" in out and "0 added, 1 already present, 0 replaced, 1 kept" in out
    assert "--overwrite" in out and repr(_key(H100)) in out
    assert main(["tuning", "import", str(shipped), "--overwrite"]) == 0
    assert "1 replaced, 0 kept" in capsys.readouterr().out
    assert _document(cache.path)[_key(H100)] == records[_key(H100)]


def test_cli_refusals_exit_1_with_the_reason_on_stderr(tmp_path, cache, capsys):
    _fill(cache)
    before = cache.path.read_bytes()
    bad = _bad_file(tmp_path, _with_record(_config(block_m=3)))
    assert main(["tuning", "import", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("python -m dnngraph tuning import: error: ")
    assert "block_m 3" in captured.err and "nothing was imported" in captured.err
    assert cache.path.read_bytes() == before
    assert main(["tuning", "export", str(tmp_path / "no" / "such" / "folder.json")]) == 1
    assert "tuning export: error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["tuning"], ["tuning", "import"], ["tuning", "send", "x.json"],
                                  ["tuning", "export", "x.json", "--overwrite"]])
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path, cache):
    cache.store(_key(), _matmul_record())
    env = {**os.environ, "DNNGRAPH_CACHE_DIR": str(cache.path.parent),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    shipped = tmp_path / "shipped.json"
    run = lambda *args: subprocess.run([sys.executable, "-m", "dnngraph", "tuning", *args], env=env, cwd=tmp_path,
                                       capture_output=True, text=True, timeout=300)
    exported = run("export", str(shipped))
    assert exported.returncode == 0 and "exported 1 tuning records" in exported.stdout, exported.stderr
    shipped.write_text("[]")
    refused = run("import", str(shipped))
    assert refused.returncode == 1 and "is not a dnngraph tuning file" in refused.stderr
