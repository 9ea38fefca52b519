"""A few torchvision and timm models (random weights, 64x64 images, batch 2) through
`torch.compile(model, backend="dnngraph")` on CPU, as test_transformers_models.py runs the
transformers families: inference and a training step (batch-norm statistics included), judged
against float64 by eager fp32's own error. They skip where the library cannot be imported (no
torchvision wheel for this torch, or a broken one that raises RuntimeError at import).
The whole lists run on the GPU in bf16: test_models_bf16_gpu.py.
"""
import pytest

from model_results import check, skip_unless_installed
from model_runs import Run, SharedRuns, shared_directory

# small ones only: each step runs every kernel in Triton's interpreter
RUNS = {"torchvision": Run(("torchvision_resnet18", "torchvision_mobilenet_v3_small")),
        "timm": Run(("timm_resnet18", "timm_convnext_atto"))}
CASES = [(library, family) for library, run in RUNS.items() for family in run.families]


@pytest.fixture(scope="session")
def vision_runs(tmp_path_factory):
    return SharedRuns(shared_directory(tmp_path_factory), list(RUNS.values()))


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("library, family", CASES, ids=[family for _, family in CASES])
def test_vision_model_matches_float64_as_closely_as_eager(vision_runs, library, family, mode):
    skip_unless_installed(library)
    check(vision_runs.results(RUNS[library])[f"{family}/{mode}"])
