"""``bench pushpull --shapes``: ResNet-50's gradient shapes as written out in bench/shapes.py
(no torchvision), and the flat/shapes summary."""
from __future__ import annotations

import math

import pytest

from byteps_like.bench.shapes import MODELS, resnet50_shapes, summarize_shapes


def test_resnet50_has_torchvisions_161_parameters():
    shapes = resnet50_shapes()
    assert len(shapes) == 161 and len({n for n, _ in shapes}) == 161
    assert sum(math.prod(s) for _, s in shapes) == 25_557_032   # torchvision's resnet50()
    assert shapes[0] == ("conv1.weight", (64, 3, 7, 7))
    assert shapes[-2:] == [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    assert ("layer4.0.downsample.0.weight", (2048, 1024, 1, 1)) in shapes
    assert ("layer3.5.conv2.weight", (256, 256, 3, 3)) in shapes
    assert MODELS["resnet50"] is resnet50_shapes


def test_summary_is_the_slowest_worker_per_repetition_then_the_median():
    workers = [{"shapes": [0.2, 0.4, 0.3], "flat": [0.1, 0.1, 0.2], "tensors": 161, "nbytes": 8},
               {"shapes": [0.3, 0.1, 0.3], "flat": [0.2, 0.1, 0.1], "tensors": 161, "nbytes": 8}]
    r = summarize_shapes(workers)
    assert r["shapes"] == pytest.approx(0.3) and r["flat"] == pytest.approx(0.2)
    assert r["ratio"] == pytest.approx(0.2 / 0.3) and (r["tensors"], r["nbytes"]) == (161, 8)
