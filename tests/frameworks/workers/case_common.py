"""What the framework workers (conformance.py with its fw_<name>.py adapters, keras_cases.py)
share; imported by name, as the adapters are (this folder is the scripts' first path entry)."""
from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import numpy as np


def run_reported(label: str, case: str, rank: int, call: Callable[[], object], *,
                 missing_ok: bool = False) -> None:
    """Run one case and print ``CASE <label> <case> OK rank <r>``; a failure prints
    ``... FAIL rank <r>: <error>`` with its traceback and ends the process (bpslaunch then stops
    the job, so later cases read as not reached). With ``missing_ok``, NotImplementedError (a
    feature the framework lacks) prints ``... MISSING rank <r>: <why>`` and the run goes on."""
    try:
        call()
    except NotImplementedError as exc:
        if not missing_ok:
            _fail(label, case, rank, exc)
        print(f"CASE {label} {case} MISSING rank {rank}: {exc}", flush=True)
        return
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        _fail(label, case, rank, exc)
    print(f"CASE {label} {case} OK rank {rank}", flush=True)


def _fail(label: str, case: str, rank: int, exc: BaseException) -> None:
    print(f"CASE {label} {case} FAIL rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


class AdapterBase:
    """What every fw_<name>.Adapter declares alike. ``EXTRAS``: the adapter's own cases, the
    functions of its module named in ``EXTRA_CASES``."""
    default_average = True
    in_place = False
    EXTRA_CASES: tuple[str, ...] = ()

    def __init__(self):
        module = sys.modules[type(self).__module__]
        self.EXTRAS = {name: getattr(module, name) for name in self.EXTRA_CASES}


class NumpyTensors(AdapterBase):
    """An adapter whose tensors are numpy arrays (the numpy API, Keras's collectives)."""

    def tensor(self, values, dtype: str):
        return np.asarray(values).astype(dtype)

    def numpy(self, t) -> np.ndarray:
        return np.asarray(t, dtype=np.float64)

    def dtype_name(self, t) -> str:
        return np.asarray(t).dtype.name
