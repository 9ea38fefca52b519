"""pytest plugin for runs under DNNGRAPH_POISON_WORKSPACE=1 (runtime/launch.py): each test starts
with an empty plan cache, so its plans make their workspaces afresh, poisoned, and a test that
made none fails, so a case listed to cover a multi-kernel plan cannot silently stop covering it.
Used by tests/runtime/test_poison_families.py as `-p poison_plugin`."""
import pytest

from dnngraph.runtime import launch, plan_cache


@pytest.fixture(autouse=True)
def _poisoned_workspaces_made(monkeypatch):
    assert launch.POISON_WORKSPACE, "run with DNNGRAPH_POISON_WORKSPACE=1"
    plan_cache.clear()  # a plan cached by an earlier test holds a workspace no longer poisoned
    made = []
    make = launch.persistent_buffer_of

    def counted(nbytes, device):
        made.append(nbytes)
        return make(nbytes, device)

    # persistent_buffer (the workspace maker) looks persistent_buffer_of up in launch's globals
    monkeypatch.setattr(launch, "persistent_buffer_of", counted)
    yield
    plan_cache.clear()
    assert any(made), "the test made no workspace: it does not exercise a multi-kernel plan"
