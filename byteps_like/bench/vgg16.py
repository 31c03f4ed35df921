"""VGG-16's gradient tensors as the benchmarks push them: the layers' sizes and forward compute,
and a list of tensors of a chosen total size. Shared by the emulated-cluster workers
(:mod:`._cluster_worker`) and the priority-scheduling benchmark (:mod:`.priority`); standard
library only.
"""
from __future__ import annotations

# VGG-16's parameter tensors (weight, bias per layer, in forward order) and each layer's share
# of forward compute (GMACs at 224x224). Largest tensors (fc6, fc7) are the last layers of the
# forward pass, so their gradients are the first ready in backward.
VGG16_LAYERS: list[tuple[str, int, int, float]] = [
    # name, weight elements, bias elements, forward GMACs
    ("conv1_1", 1728, 64, 0.087), ("conv1_2", 36864, 64, 1.85),
    ("conv2_1", 73728, 128, 0.925), ("conv2_2", 147456, 128, 1.85),
    ("conv3_1", 294912, 256, 0.925), ("conv3_2", 589824, 256, 1.85),
    ("conv3_3", 589824, 256, 1.85), ("conv4_1", 1179648, 512, 0.925),
    ("conv4_2", 2359296, 512, 1.85), ("conv4_3", 2359296, 512, 1.85),
    ("conv5_1", 2359296, 512, 0.462), ("conv5_2", 2359296, 512, 0.462),
    ("conv5_3", 2359296, 512, 0.462), ("fc6", 102760448, 4096, 0.103),
    ("fc7", 16777216, 4096, 0.0168), ("fc8", 4096000, 1000, 0.0041),
]


def model_tensors(total_bytes: int) -> list[tuple[str, int, int]]:
    """(name, float32 elements, layer index) of VGG-16's gradient tensors with the weights scaled
    so that the list holds exactly ``total_bytes`` (biases keep their size). Forward order."""
    if total_bytes % 4:
        raise ValueError("total_bytes must be a multiple of 4")
    total = total_bytes // 4
    biases = sum(b for _n, _w, b, _f in VGG16_LAYERS)
    weights = sum(w for _n, w, _b, _f in VGG16_LAYERS)
    if total <= biases + len(VGG16_LAYERS):
        raise ValueError(f"{total_bytes} bytes is too small for the VGG-16 tensor list")
    scale = (total - biases) / weights
    names: list[str] = []
    counts: list[int] = []
    layers: list[int] = []
    for i, (name, w, b, _f) in enumerate(VGG16_LAYERS):
        names += [f"{name}.weight", f"{name}.bias"]
        counts += [max(1, int(w * scale)), b]
        layers += [i, i]
    big = max(range(len(counts)), key=counts.__getitem__)
    counts[big] += total - sum(counts)
    assert sum(counts) == total
    return list(zip(names, counts, layers))
