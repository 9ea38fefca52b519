"""No compile-time cliffs: the kernels of worst-case-but-legal graphs of every family whose
generated code repeats over a user-sized extent compile for sm_90 in seconds, not minutes
(tests/compile_cliffs.py holds the graphs; its full sweep runs by hand)."""
from compile_cliffs import compile_seconds

# Seconds one kernel may take to compile for sm_90 on a slow, shared CPU. Every kernel of the
# representative set takes under 10 s here; the 3x3x3 max-pool backward that unrolled 324 tile
# loads took 77 s (and 339 s in a GPU run), so a cliff fails and ordinary load does not.
KERNEL_SECONDS_MAX = 60.0


def test_worst_case_kernels_of_each_family_compile_in_seconds():
    timed = compile_seconds("compile_cliffs:representative")
    assert timed, "nothing was compiled"
    slow = [f"{what}: {seconds:.0f} s" for seconds, what in timed if seconds > KERNEL_SECONDS_MAX]
    assert not slow, "compile-time cliffs: " + "; ".join(slow)
