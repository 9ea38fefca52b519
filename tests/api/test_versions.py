"""The Triton versions dnngraph supports: declared once in pyproject.toml (both README commands
and .ci/run install through it), checked at `import dnngraph` with an ImportError naming the
installed and the supported versions."""
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from dnngraph import versions
from dnngraph.versions import TRITON_REQUIREMENT, UnsupportedTritonError, check_triton_version

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("installed", ["3.6.0", "3.6.1", "3.6.0+git1a2b3c4", "3.6.12", " 3.6.2"])
def test_supported_versions_pass(installed):
    check_triton_version(installed)


@pytest.mark.parametrize("installed", ["3.9.0", "3.7.0", "3.7.0.dev20260101", "3.5.1", "3.5", "2.3.1", "4.0.0",
                                       "30.6.0", "3.60.0"])
def test_other_versions_fail_naming_both(installed):
    with pytest.raises(ImportError, match=re.escape(installed.strip())) as error:
        check_triton_version(installed)
    assert isinstance(error.value, UnsupportedTritonError)
    assert TRITON_REQUIREMENT in str(error.value)


@pytest.mark.parametrize("installed", ["", "unknown", "v3.6.0", None])
def test_unreadable_versions_fail(installed):
    with pytest.raises(UnsupportedTritonError, match="cannot read"):
        check_triton_version(installed)


def test_no_triton_distribution_fails(monkeypatch):
    def missing(name):
        raise versions.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", missing)
    with pytest.raises(UnsupportedTritonError, match="no triton distribution"):
        versions.check_installed_triton()


def test_pyproject_declares_the_checked_range_and_the_install_commands_take_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [d for d in project["dependencies"] if re.match(r"triton\b", d)]
    assert declared == [TRITON_REQUIREMENT]
    # the README's commands and CI install triton only through the declared dependency
    for path in (REPO / "README.md", REPO / ".ci" / "run"):
        installs = [line for line in path.read_text().splitlines() if "pip install" in line]
        assert installs, path
        assert not [line for line in installs if re.search(r"\btriton\b", line)], path


def test_import_fails_with_an_unsupported_triton_installed():
    """A process whose triton metadata says 3.9.0 (the newest triton on a CPU-only machine the day
    this was written) cannot import dnngraph; the error names both versions."""
    script = textwrap.dedent('''\
        import importlib.metadata
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: "3.9.0" if name == "triton" else real(name)
        try:
            import dnngraph
        except ImportError as error:
            print(type(error).__name__, error)
        else:
            print("imported")
        ''')
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "UnsupportedTritonError" in done.stdout and "3.9.0" in done.stdout, done.stdout
    assert TRITON_REQUIREMENT in done.stdout


def test_package_version_is_pyprojects():
    """dnngraph.__version__ (held in versions.py, below every layer that keys on it) is the
    version pyproject.toml declares."""
    import dnngraph

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert dnngraph.__version__ == versions.__version__ == declared
