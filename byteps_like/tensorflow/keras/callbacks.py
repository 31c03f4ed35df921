"""tf.keras callbacks (byteps.tensorflow.keras.callbacks): :mod:`byteps_like.keras.callbacks`,
re-exported (tf.keras is Keras 3)."""
from __future__ import annotations

from ...keras.callbacks import *  # noqa: F403 - this module is a re-export
from ...keras.callbacks import __all__  # noqa: F401
