"""What the framework tests share: which frameworks import here, and TensorFlow's settings."""
from __future__ import annotations

import importlib.util
import warnings

# TensorFlow can hold the GIL for seconds (imports, tracing) and imports slowly on a busy
# machine: a tolerant heartbeat and registration, so neither reads as a lost peer
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
          "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "15", "BYTEPS_REGISTER_TIMEOUT_SECONDS": "120"}


def importable(module: str) -> str | None:
    """None if ``module`` imports in this environment, else why not."""
    if module == "mxnet":   # MXNet 1.9.1 is present but broken under numpy >= 1.24
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import mxnet  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - absent or broken
            return (f"mxnet is not importable here ({type(exc).__name__}); it runs in "
                    ".venv-mxnet: bash scripts/setup_mxnet.sh, then .venv-mxnet/bin/python -m "
                    "pytest tests/frameworks")
        return None
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed in this environment"
    return None
