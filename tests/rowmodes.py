"""Force a row-kernel mode on small shapes (the model would pick one-pass for all of them)."""
import pytest

from dnngraph.heuristics import rows

MODES = ("one_pass", "looped", "split")


@pytest.fixture(params=MODES)
def row_mode(request, monkeypatch):
    """Run the test once per row-kernel mode, with tiles small enough to loop and split."""
    monkeypatch.setattr(rows, "FORCE_MODE", request.param)
    monkeypatch.setattr(rows, "LOOP_TILE", 16)
    monkeypatch.setattr(rows, "SPLIT_MIN_REDUCED", 8)
    return request.param


def modes_used(graph) -> set:
    """The row modes the built plan runs."""
    found = set()
    for launch in graph.plan.launches:
        for mode in MODES:
            if f"({mode})" in launch.config_text:
                found.add(mode)
    return found
