"""The comparison helper itself: its error must be relative to the whole reference."""
import pytest
import torch

import helpers


class _Fixed:
    """A stand-in graph whose reference and outputs are given."""

    def __init__(self, refs):
        self.refs, self.plan = refs, object()

    def reference(self, inputs):
        return self.refs


def _check(monkeypatch, out, ref, tolerance=2e-3):
    monkeypatch.setattr(helpers, "run", lambda graph, inputs, device, options: {"y": out})
    return helpers.check(_Fixed({"y": ref}), {}, tolerance=tolerance)


def test_one_ulp_on_a_tiny_value_among_exact_ones_passes(monkeypatch):
    """Exact entries leave the numerator, not the denominator: an fp16 subnormal one ulp off
    among 2309 exact values is a 4e-10 error, not 2e-3 (seen as a flaky matmul test)."""
    ref = torch.randn(2310, dtype=torch.float64).half().double()
    ref[7] = 2.8253e-05
    out = ref.half()
    out[7] = 2.8312e-05
    _check(monkeypatch, out, ref)


def test_wrong_values_nan_and_inf_mismatches_fail(monkeypatch):
    ref = torch.randn(500, dtype=torch.float64)
    ref[3] = float("inf")
    for index, value in [(0, ref[0] + 1.0), (1, float("nan")), (3, 1.0), (4, float("inf"))]:
        out = ref.clone()
        out[index] = value
        with pytest.raises(AssertionError):
            _check(monkeypatch, out, ref)
    _check(monkeypatch, ref.clone(), ref)
