"""A few torchvision and timm models (random weights, 64x64 images, batch 2) through
`torch.compile(model, backend="dnngraph")` on CPU, as test_transformers_models.py runs the
transformers families: inference and a training step (batch-norm statistics included), judged
against float64 by eager fp32's own error. They skip where the library cannot be imported (no
torchvision wheel for this torch, or a broken one that raises RuntimeError at import).
The whole lists run on the GPU in bf16: test_models_bf16_gpu.py.
"""
import pytest

from model_results import cases, check, skip_unless_installed
from model_runs import Run, shared_runs_for
from model_zoo import TIMM, TORCHVISION

# small ones only: each step runs every kernel in Triton's interpreter; one process per library
GROUPS = [("torchvision_resnet18", "torchvision_mobilenet_v3_small"), ("timm_resnet18", "timm_convnext_atto")]
RUNS = {family: Run(group) for group in GROUPS for family in group}
LIBRARY = {family.name: family.library for family in TORCHVISION + TIMM}


@pytest.fixture(scope="session")
def vision_runs(tmp_path_factory, request):
    return shared_runs_for(request, tmp_path_factory, test_vision_model_matches_float64_as_closely_as_eager, RUNS)


@pytest.mark.parametrize("family, mode", cases(RUNS, {}))
def test_vision_model_matches_float64_as_closely_as_eager(vision_runs, family, mode):
    skip_unless_installed(LIBRARY[family])
    check(vision_runs.results(RUNS[family])[f"{family}/{mode}"])
