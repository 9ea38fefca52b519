"""Runs tests/models/model_worker.py in fresh processes, a group of families per process
(startup is paid once per group), and shares each group's results between pytest-xdist workers
through files, so every group runs once per session whichever worker asks first.

A worker asking for a group that another is running runs a group nobody has started meanwhile,
then waits: with `-n 2` both processes stay busy and no group runs twice.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from model_worker import RESULT_PREFIX  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    """One worker process: these families in these modes."""

    families: tuple
    modes: tuple = ("inference", "training")
    size: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    timeout_s: int = 600
    import_dnngraph_first: bool = False  # not what a user writes: for comparison only

    def key(self) -> str:
        return hashlib.sha1(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]

    def command(self) -> list:
        return [sys.executable, os.path.join(HERE, "model_worker.py"), "--families", ",".join(self.families),
                "--modes", ",".join(self.modes), "--size", self.size, "--device", self.device,
                "--dtype", self.dtype] + (["--import-dnngraph-first"] if self.import_dnngraph_first else [])


def environment() -> dict:
    """A user's environment: this checkout's dnngraph first on the path (an installed one
    elsewhere is not what we test), and no TRITON_INTERPRET: dnngraph sets it in the process
    that imports it (this pytest process, on a CPU machine), and a worker inheriting it would
    have Triton in interpreter mode before torch imports it, which no user's process has."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    return env


def _parse(run: Run, stdout: str, why_missing: str) -> dict:
    """{"family/mode": result} of a worker's output; cases it never reached carry why."""
    results = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            results[f"{result['family']}/{result['mode']}"] = result
    for family in run.families:
        for mode in run.modes:
            results.setdefault(f"{family}/{mode}", {"family": family, "mode": mode,
                                                    "failure": {"type": "WorkerDied", "cause": why_missing,
                                                                "message": why_missing, "frames": []}})
    return results


def execute(run: Run) -> dict:
    """Run the worker process of `run`; its results by "family/mode"."""
    try:
        done = subprocess.run(run.command(), env=environment(), cwd=ROOT, capture_output=True, text=True,
                              timeout=run.timeout_s)
        stdout, why = done.stdout, f"worker exited {done.returncode}: {done.stderr[-2000:]}"
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        why = f"worker timed out after {run.timeout_s} s"
    return _parse(run, stdout, why)


class SharedRuns:
    """Each Run's results computed once per session in `directory` (shared by xdist workers)."""

    def __init__(self, directory: str, runs: list):
        self.directory, self.runs = directory, list(runs)
        os.makedirs(directory, exist_ok=True)

    def _path(self, run: Run, suffix: str) -> str:
        return os.path.join(self.directory, f"{run.key()}.{suffix}")

    def _load(self, run: Run):
        path = self._path(run, "json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)["results"]
        return None

    def _compute_locked(self, run: Run, blocking: bool) -> bool:
        """Run it under its lock unless done (False: another process holds the lock)."""
        with open(self._path(run, "lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            if self._load(run) is None:
                results = execute(run)
                partial = self._path(run, "partial")
                with open(partial, "w") as f:
                    json.dump({"run": dataclasses.asdict(run), "results": results}, f)
                os.replace(partial, self._path(run, "json"))  # readers never see half a file
        return True

    def results(self, run: Run) -> dict:
        """The results of `run`; while another process runs it, this one runs another group."""
        while self._load(run) is None:
            if self._compute_locked(run, blocking=False):
                break
            idle = next((r for r in self.runs if r != run and self._load(r) is None
                         and self._compute_locked(r, blocking=False)), None)
            if idle is None:
                self._compute_locked(run, blocking=True)  # nothing else to do: wait for its holder
        return self._load(run)


def shared_directory(tmp_path_factory) -> str:
    """A folder every xdist worker of this session sees (the session's base temporary folder)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return str(root / "model-results")


def shared_runs_for(request, tmp_path_factory, test, runs: dict) -> SharedRuns:
    """The SharedRuns of a session fixture: the runs of `runs` that the session's selected items
    of `test` need, their results shared between xdist workers."""
    from model_results import selected_runs

    return SharedRuns(shared_directory(tmp_path_factory), selected_runs(request.session.items, test, runs))
