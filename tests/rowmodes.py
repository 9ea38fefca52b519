"""Force a row-kernel mode on small shapes (the model would pick one-pass for all of them)."""
import pytest

import dnngraph as dg

MODES = ("one_pass", "looped", "split")


@pytest.fixture(params=MODES)
def row_mode(request):
    """Run the test once per row-kernel mode (build with row_options(row_mode))."""
    return request.param


def row_options(mode, **others) -> dg.BuildOptions:
    """Options forcing row-kernel `mode`, with tiles small enough to loop and split small shapes."""
    return dg.BuildOptions(row_mode=mode, row_loop_tile=16, row_split_min_reduced=8, **others)


def modes_used(graph) -> set:
    """The row modes the built plan runs."""
    found = set()
    for launch in graph.plan.launches:
        for mode in MODES:
            if f"({mode})" in launch.config_text:
                found.add(mode)
    return found
