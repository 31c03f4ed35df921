"""Compression that picks itself (``Compression.auto``, ``BYTEPS_COMPRESSOR=auto``): the model.

This module is the pure half of auto compression, with no sockets and no runtime: what the
candidates are, how fast each one codes (:func:`measure_speeds`, once per process, through the
same entry points the data path uses), and which one to take for a tensor of a size at a
bandwidth (:func:`choose`, a pure function of its arguments). The worker's half, which measures
the bandwidth, lets rank 0 decide and tells the other ranks (every rank switches at the same
round), is :mod:`byteps_like.worker.autocompress`.

The prediction for a tensor of ``S`` float32 bytes with a candidate of wire ratio ``r`` (wire
bytes / float32 bytes), encode speed ``E`` and decode speed ``D`` (float32 bytes per second) is a
pipeline of its ``P`` partitions through these stages:

    wire      2 r S / B                 push and pull over the measured bandwidth B
    encode    S / E                     the worker encodes its push
    decode    S / D                     ... and decodes the sum
    server    (W S / D + S / E) / N     a codec's servers: decode W pushes, encode the sum

    T = sum(stages) / P + (P - 1) / P * max(stages)

where ``B`` is the worker's measured bytes on the wire (pushed plus pulled) per second, ``W``
the workers and ``N`` the servers (the keys spread over them). A cast (fp16, bf16) is summed by
the servers in its own dtype: it has no server stage. ``none`` has ``r = 1`` and only the wire,
and is always a candidate, so a choice is never predicted slower than it. Each stage is costed
on one thread (the codec speeds are measured on one): the prediction leans towards the cheaper
candidate.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .compression import (
    AUTO_CANDIDATES as CANDIDATES,
)
from .compression import (
    AutoCompression,
    Compressor,
    _CastCompressor,
    auto_candidate,
    compiled_codec,
    parse_auto_allow,
)

__all__ = ["AutoCompression", "CodecSpeed", "Choice", "choose", "predict", "size_class",
           "class_bounds", "measure_speeds", "speed_sample_bytes", "last_level_cache_bytes",
           "SpeedsStopped",
           "candidate", "parse_allow", "CANDIDATES", "NUM_CLASSES"]

candidate = auto_candidate
parse_allow = parse_auto_allow

#: size classes: class 0 holds tensors below 256 KiB, class i >= 1 those of [64 KiB * 4**i,
#: 64 KiB * 4**(i+1)), the last class everything larger (16 classes: up to 64 TiB)
NUM_CLASSES = 16
_CLASS_BASE = 64 << 10


def size_class(nbytes: int) -> int:
    """The size class of a tensor of ``nbytes`` float32 bytes (0 .. NUM_CLASSES-1)."""
    if nbytes < _CLASS_BASE * 4:
        return 0
    return min(NUM_CLASSES - 1, int(math.log(nbytes / _CLASS_BASE, 4)))


def class_bounds(cls: int) -> tuple[int, int]:
    """``[low, high)`` bytes of a size class (high 0: no bound)."""
    low = 0 if cls == 0 else _CLASS_BASE * 4 ** cls
    high = 0 if cls == NUM_CLASSES - 1 else _CLASS_BASE * 4 ** (cls + 1)
    return low, high


def class_size(cls: int) -> int:
    """The size a class is predicted at: the geometric middle of its bounds."""
    low, high = class_bounds(cls)
    low = max(low, _CLASS_BASE)
    return int(low * 2) if high else low * 2


@dataclass(frozen=True)
class CodecSpeed:
    """What the prediction knows of one candidate: its wire ratio (wire bytes per float32
    byte), its encode and decode speeds (float32 bytes per second; ``inf`` for none) and
    whether the servers decode and re-encode it (a codec) or sum it as it travels (a cast)."""
    name: str
    ratio: float
    encode_bps: float = math.inf
    decode_bps: float = math.inf
    server_codec: bool = False

    def __post_init__(self) -> None:
        for what, v in (("ratio", self.ratio), ("encode_bps", self.encode_bps),
                        ("decode_bps", self.decode_bps)):
            if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"CodecSpeed {self.name!r}: {what} must be > 0, got {v!r}")


NONE_SPEED = CodecSpeed("none", 1.0)


def predict(nbytes: int, bandwidth: float, speed: CodecSpeed, *, workers: int = 1,
            servers: int = 1, partition_bytes: int = 0) -> float:
    """Predicted seconds of one push_pull round of ``nbytes`` float32 bytes with ``speed``'s
    candidate at ``bandwidth`` bytes/s (pushed plus pulled per second), its partitions
    (``partition_bytes``; 0: one) going through the stages as a pipeline. Pure."""
    if bandwidth <= 0:
        raise ValueError(f"predict: bandwidth must be > 0, got {bandwidth!r}")
    stages = [2.0 * speed.ratio * nbytes / bandwidth]       # the wire, both ways
    if math.isfinite(speed.encode_bps):
        stages.append(nbytes / speed.encode_bps)             # the workers encode
    if math.isfinite(speed.decode_bps):
        stages.append(nbytes / speed.decode_bps)             # ... and decode the sum
    if speed.server_codec:                                   # the servers decode W, encode 1
        stages.append((max(1, workers) * nbytes / speed.decode_bps
                       + nbytes / speed.encode_bps) / max(1, servers))
    parts = max(1, math.ceil(nbytes / partition_bytes)) if partition_bytes > 0 else 1
    # P partitions through k stages: each stage's share per partition, the slowest stage
    # paced P - 1 times after the first partition went through all
    return sum(stages) / parts + (parts - 1) / parts * max(stages)


@dataclass(frozen=True)
class Choice:
    """The candidate :func:`choose` took, and every candidate's predicted seconds (the why)."""
    name: str
    predicted: dict[str, float]
    kept: bool = False   # the current choice stayed within the hysteresis margin of the best

    def why(self) -> str:
        order = sorted(self.predicted.items(), key=lambda kv: kv[1])
        return ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in order)


def choose(nbytes: int, bandwidth: float, speeds: Sequence[CodecSpeed], *,
           workers: int = 1, servers: int = 1, partition_bytes: int = 0,
           current: str | None = None, margin: float = 0.1) -> Choice:
    """The candidate of ``speeds`` (``none`` is added when absent) with the least predicted
    round time for ``nbytes`` at ``bandwidth``; ``current`` stays when its prediction is within
    ``margin`` (a fraction) of the best, so that a choice does not flap between two candidates
    that predict alike. Ties go to the earlier candidate (``none`` first). Pure."""
    if margin < 0:
        raise ValueError(f"choose: margin must be >= 0, got {margin!r}")
    cands = list(speeds)
    if not any(s.name == "none" for s in cands):
        cands.insert(0, NONE_SPEED)
    predicted = {s.name: predict(nbytes, bandwidth, s, workers=workers, servers=servers,
                                 partition_bytes=partition_bytes) for s in cands}
    best = min(predicted, key=lambda n: (predicted[n], n != "none"))
    if (current is not None and current != best and current in predicted
            and predicted[current] <= predicted[best] * (1 + margin)):
        return Choice(current, predicted, kept=True)
    return Choice(best, predicted)


class SpeedsStopped(Exception):
    """:func:`measure_speeds` was told to stop (its process is shutting down)."""


def _best_of(fn: Any, repeats: int, stop: Callable[[], bool] | None = None) -> float:
    best = math.inf
    for _ in range(repeats):
        if stop is not None and stop():
            raise SpeedsStopped
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_speed(name: str, comp: Compressor, sample: np.ndarray, *,
                  repeats: int = 3, stop: Callable[[], bool] | None = None,
                  threads: int = 1) -> CodecSpeed:
    """Encode and decode ``sample`` (float32) with ``comp`` through the entry points the data
    path uses (a cast's ``narrow_into``/``widen_into``, a built-in codec's compiled
    ``encode``/``decode``, else its Python codec) and time the best of ``repeats``. With
    ``threads`` > 1 the sample is cut into that many parts coded at once, each by its own
    codec, as the native client's codec pool codes a tensor's partitions (the compiled calls
    release the GIL): a speed of the pool, not of one thread."""
    nbytes = sample.nbytes
    if comp.kind == "none":
        return NONE_SPEED
    parts = np.array_split(sample, max(1, min(threads, sample.size // 1024)))
    with ThreadPoolExecutor(len(parts), thread_name_prefix="bpsl-speed") as pool:
        def at_once(fns: list[Callable[[], Any]]) -> None:
            for f in [pool.submit(fn) for fn in fns]:
                f.result()

        if isinstance(comp, _CastCompressor):
            wires: list[np.ndarray] = [np.empty(p.shape, comp.wire_np) for p in parts]
            backs = [np.empty_like(p) for p in parts]
            enc = _best_of(lambda: at_once([partial(comp.narrow_into, w, p, "float32")
                                            for w, p in zip(wires, parts)]), repeats, stop)
            dec = _best_of(lambda: at_once([partial(comp.widen_into, b, w, "float32")
                                            for b, w in zip(backs, wires)]), repeats, stop)
            return CodecSpeed(name, sum(w.nbytes for w in wires) / nbytes, nbytes / enc,
                              nbytes / dec)
        codecs = [compiled_codec(comp, p.size, i)
                  or comp.make_codec(p.size, role="worker", key=i) for i, p in enumerate(parts)]
        outs = [np.empty_like(p) for p in parts]
        payloads = [c.encode(p, 0) for c, p in zip(codecs, parts)]
        size = sum(len(np.frombuffer(x, np.uint8)) for x in payloads)
        step = iter(range(1, 1 << 30))

        def encode() -> None:
            rnd = next(step)

            def one(i: int) -> None:
                payloads[i] = codecs[i].encode(parts[i], rnd)
            at_once([partial(one, i) for i in range(len(parts))])

        enc = _best_of(encode, repeats, stop)
        saved = [bytes(np.frombuffer(x, np.uint8)) for x in payloads]
        dec = _best_of(lambda: at_once([partial(c.decode, x, o)
                                        for c, x, o in zip(codecs, saved, outs)]), repeats, stop)
    return CodecSpeed(name, size / nbytes, nbytes / enc, nbytes / dec, server_codec=True)


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of this CPU's last-level cache (Linux sysfs), 0 where it cannot be read."""
    best = (0, 0)
    try:
        for entry in os.listdir(root):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = int(text.rstrip("KMG")) * unit
            best = max(best, (level, size))
    except (OSError, ValueError):
        return 0
    return best[1]


def speed_sample_bytes(partition_bytes: int, cache_bytes: int) -> int:
    """How large a sample the codec speeds are measured on: twice the last-level cache, and
    64 MiB at least, so that it is out of cache as a model's gradients are (a 16 MiB sample sat
    in the device's cache: fp16 measured several times faster than it converts 256 MiB of
    gradients); at most 256 MiB, and never less than a partition. Pure."""
    return max(partition_bytes, min(256 << 20, max(64 << 20, 2 * cache_bytes)))


def measure_speeds(comps: dict[str, Compressor], sample_bytes: int = 4 << 20, *,
                   repeats: int = 3, seed: int = 1, stop: Callable[[], bool] | None = None,
                   threads: int = 1) -> list[CodecSpeed]:
    """:func:`measure_speed` of every candidate on one float32 sample of ``sample_bytes`` (a
    partition's size by default): a random standard-normal block of at most 4 MiB, repeated
    (drawing 256 MiB of normals took a second of the CPU the job needs); ``none`` first.
    ``stop`` is asked before every timed call: SpeedsStopped once it says True; ``threads``:
    :func:`measure_speed`'s."""
    rng = np.random.default_rng(seed)
    count = max(1024, sample_bytes // 4)
    sample = np.resize(rng.standard_normal(min(count, 1 << 20), dtype=np.float32), count)
    out = [NONE_SPEED]
    for name, comp in comps.items():
        if name != "none":
            out.append(measure_speed(name, comp, sample, repeats=repeats, stop=stop,
                                     threads=threads))
    return out
