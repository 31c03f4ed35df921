"""The operations the Keras plugin runs on its backend: :mod:`byteps_like.tensorflow.ops` on the
TensorFlow backend, an :class:`~._eager_ops.EagerOps` over ``keras.ops`` on the others. One object
per process, shared by the package (``byteps_like.keras``), its callbacks and its elastic module,
which import it from here (not from the package, which imports them)."""
from __future__ import annotations

from typing import Any

import keras


def _make_ops() -> Any:
    if keras.backend.backend() == "tensorflow":
        from ..tensorflow import ops
        return ops
    from ._eager_ops import EagerOps
    return EagerOps(keras)


ops: Any = _make_ops()
