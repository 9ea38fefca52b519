"""torch.compile(backend="dnngraph") takes the pointwise ops the frontend's API added: tan and
fmod (dnngraph's mod), forward and backward against eager."""
import pytest
import torch

from test_torch_converters import _step_matches


@pytest.mark.parametrize("fn, words", [
    (lambda x: torch.tan(x * 0.5) * 1.5, ["tan"]),
    (lambda x: torch.fmod(x * 3.0, 0.7) + x, ["fmod"]),
    (lambda x: torch.fmod(x * 3.0, x.abs() + 0.5) * 2.0, ["fmod"]),
], ids=["tan", "fmod_scalar", "fmod_tensor"])
def test_tan_and_fmod_convert(fn, words):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5)
    _step_matches(fn, [x], words)
