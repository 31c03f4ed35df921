"""UCX streams of the native data plane: finding and loading libucp for ``_core``.

``_core`` is built against the libucx wheel's headers when the ``ucx`` extra is installed at
build time, but it does not link libucp: :func:`load` finds the library the wheel ships
(``libucx.load_library()`` loads it and its dependencies; the path goes to ``_core.ucx_load``,
which opens it and makes the process's UCP context). So the extension imports and serves TCP
streams where UCX is absent, and says why UCX streams are not available where they are not
(docs/transports.md, "UCX in the native data plane").
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading

log = logging.getLogger("byteps_like.native")

#: UCX settings the data plane's UCX context uses unless the environment sets them (UCX_<name>):
#: UCX's TCP transport moves a stream's bytes in segments of TCP_*_SEG_SIZE (8-64 KiB by
#: default), one receive call and one copy out of it each; 1 MiB segments cut that per-segment
#: work (docs/performance.md, "UCX in the native data plane").
SETTINGS = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}

_lock = threading.Lock()
_why: str | None = None   # the answer of the first load(): "" usable, else why not


def libucp_path() -> str | None:
    """The libucp the libucx wheel ships, or None when the wheel is not installed."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, "lib", "libucp.so")
        if os.path.isfile(path):
            return path
    return None


def load(loopback: bool = False) -> str:
    """Make the data plane's UCX streams usable in this process: "" when they are, else the
    reason they are not (the first answer holds for the process). The UCX_* environment
    (UCX_TLS, UCX_NET_DEVICES, ...) is read by UCX now. ``loopback`` (a job on loopback,
    native.loopback_job): UCX uses the loopback device only unless UCX_NET_DEVICES says
    otherwise, so its transports listen on no other interface (without it, UCX's TCP
    transport listens on every interface's address, once per UCP worker: issue 41)."""
    global _why
    with _lock:
        if _why == "":   # loaded: still usable, unless this is a child forked since
            from .. import _core
            return _core.ucx_unavailable()
        if _why is not None:
            return _why
        from .. import _core
        if not _core.ucx_built():
            _why = _core.ucx_unavailable()
            return _why
        path = libucp_path()
        if path is None:
            _why = ("the libucx wheel is not installed (pip install 'byteps_like[ucx]' brings "
                    "it)")
            return _why
        try:
            import libucx
            libucx.load_library()   # libucs/libuct/libucp with RTLD_LOCAL: their dependencies
        except (ImportError, OSError) as exc:
            _why = f"libucx could not load its libraries: {exc}"
            return _why
        from ..config import ucx_environment
        env = ucx_environment()
        settings = {**SETTINGS, **({"NET_DEVICES": "lo"} if loopback else {})}
        _why = _core.ucx_load(path, {k: v for k, v in settings.items() if "UCX_" + k not in env})
        if _why:
            log.warning("native data plane: UCX streams unavailable: %s", _why)
        return _why
