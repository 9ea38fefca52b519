"""Every global name a function or class body reads is defined in its module or a builtin.

GPU tests, Gluon kernels' host code and benchmarks never run in CPU CI: a name left undefined by a
refactor there (a helper that stopped returning `g`, a renamed import) reaches the GPU as a
NameError. This reads every module's symbol tables, as a compiler would, without running it."""
import builtins
import pathlib
import symtable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ("dnngraph", "tests", "benchmarks", "examples")
MODULE_ATTRIBUTES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__",
                     "__builtins__", "__path__", "__annotations__", "__dict__"}


def _sources() -> list[pathlib.Path]:
    return sorted(path for folder in CHECKED if (ROOT / folder).is_dir()
                  for path in (ROOT / folder).rglob("*.py"))


def _module_names(module: symtable.SymbolTable) -> set[str]:
    """Names bound at module level, including those a function binds with `global`."""
    bound = {symbol.get_name() for symbol in module.get_symbols()
             if symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()}
    pending = list(module.get_children())
    while pending:
        table = pending.pop()
        pending.extend(table.get_children())
        bound |= {symbol.get_name() for symbol in table.get_symbols()
                  if symbol.is_declared_global() and symbol.is_assigned()}
    return bound


def _unbound_reads(module: symtable.SymbolTable) -> list[str]:
    known = _module_names(module) | set(dir(builtins)) | MODULE_ATTRIBUTES
    missing, pending = [], list(module.get_children())
    while pending:
        table = pending.pop()
        pending.extend(table.get_children())
        for symbol in table.get_symbols():
            global_read = not (symbol.is_local() or symbol.is_free() or symbol.is_parameter())
            if symbol.is_referenced() and global_read and symbol.get_name() not in known:
                missing.append(f"{table.get_name()} (line {table.get_lineno()}): {symbol.get_name()}")
    return sorted(set(missing))


@pytest.mark.parametrize("path", _sources(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_global_name_read_is_defined(path):
    module = symtable.symtable(path.read_text(), str(path), "exec")
    assert _unbound_reads(module) == []


def test_the_check_finds_a_name_no_one_defines():
    source = "import os\n\ndef f():\n    g = 1\n    return os.sep, g\n\ndef h():\n    return g.plan\n"
    assert _unbound_reads(symtable.symtable(source, "<case>", "exec")) == ["h (line 7): g"]
