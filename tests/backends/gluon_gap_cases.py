"""Gluon matmul epilogues of the ops the cuDNN frontend's API added (relu with its clips), lowered
for the H100 without a GPU: sm90_compile.py compiles them, tests/ops/test_pointwise_gaps.py asks."""
import dnngraph as dg
from gluon_cases import lowered, matmul_group
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.target import H100

# (negative_slope, lower_clip, upper_clip): a sloped line below a lower clip, a zero slope (the
# constant clip) with an upper clip, an upper clip alone (its default lower clip 0)
CLIPS = [(0.05, -0.5, 2.0), (None, 0.25, 6.0), (None, None, 1.5)]


def clipped_relu_graph(clips, m: int = 200, n: int = 136, k: int = 72):
    negative_slope, lower_clip, upper_clip = clips
    g = dg.Graph(name="gluon_relu_clips", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
    y = g.relu(g.matmul(a, b, name="mm"), negative_slope=negative_slope, lower_clip=lower_clip, upper_clip=upper_clip)
    y.set_output(True)
    return g


def clipped_relu_cases():
    """(label, launches, dtypes) of each clip setting, lowered with the first Gluon config."""
    for index, clips in enumerate(CLIPS):
        g = clipped_relu_graph(clips)
        _, problem = matmul_group(g)
        config = next(iter(GLUON.candidates(problem, H100))).config
        yield f"relu_clips{index}", lowered(g, config), {t.uid: t.data_type.torch_dtype for t in g.tensors}
