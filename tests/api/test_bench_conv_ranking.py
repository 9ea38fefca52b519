"""benchmarks/conv_ranking.py (the convolutions' ranking against measurements) runs without a
GPU: the confusion of MEASURED_LAYERS per direction, and a bench_conv.py JSON turned into
MEASURED_LAYERS lines."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import conv_ranking as bench  # noqa: E402


def test_the_measured_layers_confusion(capsys):
    assert bench.main([]) == 0
    text = capsys.readouterr().out
    # each direction's header and layers
    assert sum(line.startswith("| layer") for line in text.splitlines()) == 3 + 22 + 19 + 22
    assert "| layer1.1.conv1 | 32.5 | 36.2 | triton | triton | 0.0 |" in text
    assert ("agree on 20 of 22; mis-ranked: layer1.0.conv1 (0.5 us), layer4.0.conv1 (0.3 us); 0.8 us in all"
            in text)
    assert "agree on 17 of 19; mis-ranked: layer1.0.conv3 (1.1 us), layer4.1.conv1 (0.6 us); 1.7 us in all" in text
    assert "| layer1.0.conv1 | 47.6 | 55.0 | triton | gluon | 7.4 |" in text  # the wgrad's


def _row(label, shape, triton_ms, gluon_ms):
    return {"label": label, "shape": shape, "dg": {"ms": triton_ms}, "dg_gluon": {"ms": gluon_ms}}


def test_a_bench_conv_run_gives_its_layer_lines(tmp_path, capsys):
    rows = [_row("stem", "N32 C3 K64 224x224 7x7/2 p3", 0.169, 0.1694),  # no TMA box: not Gluon's
            _row("wide", "N32 C128 K128 28x28 3x3/1 p1", 0.0251, 0.0301),  # Gluon measured slower here
            _row("narrow", "N32 C256 K64 56x56 1x1/1 p0", 0.0325, 0.0362),
            {"label": "failed", "shape": "N32 C64 K64 56x56 1x1/1 p0", "dg": {"status": "error"}, "dg_gluon": {}},
            dict(_row("ranked to triton", "N32 C64 K64 56x56 1x1/1 p0", 0.0221, 0.0221),
                 dg_gluon={"ms": 0.0221, "plan": {"backends": ["triton"]}})]
    path = tmp_path / "conv.json"
    gradient = [_row("wgrad 3x3", "N32 C64 K64 56x56 3x3/1 p1", 0.150, 0.0629)]
    path.write_text(json.dumps({"results": {"fprop": rows, "wgrad": gradient}}))
    layers = bench.measured_layers(str(path))
    assert [layer.label for layer in layers] == ["wide", "narrow", "wgrad 3x3"]
    assert [layer.direction for layer in layers] == ["fprop", "fprop", "wgrad"]
    assert "ranked to triton: left out, its columns ran [] and ['triton']" in capsys.readouterr().out
    assert layers[0].us == {"triton": 25.1, "gluon": 30.1}
    assert bench.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert '    _layer("wide", 32, 128, 128, 28, 3, 1, 1, 25.1, 30.1),' in text
    assert "| wide | 25.1 | 30.1 | triton | gluon | 5.0 |" in text
    assert "agree on 1 of 2; mis-ranked: wide (5.0 us); 5.0 us in all" in text
    assert '    _wgrad("wgrad 3x3", 32, 64, 64, 56, 3, 1, 1, 150.0, 62.9),' in text
    assert "| wgrad 3x3 | 150.0 | 62.9 | gluon | gluon | 0.0 |" in text
