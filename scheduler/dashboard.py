"""The live job page (``BYTEPS_DASHBOARD_PORT``; ``bpslaunch --dashboard``): the scheduler serves
a small web page and its data as JSON (``/api/state``), from the nodes' reports
(reports.py). Standard library only; every asset is a file of this package (scheduler/web/):
no CDN, no request leaves the page's own origin (its Content-Security-Policy says so).

Security: bound to loopback by default. On any other address it requires the job's secret
(BYTEPS_AUTH_SECRET) as a token, ``?token=...`` on the page's address (the page passes it on) or
``Authorization: Bearer ...``; without a secret it refuses to start. The Host header must name
the bound address or ``localhost`` (a page of another site cannot reach it through DNS
rebinding; when the page is exposed, the token guards it instead). Read only: it changes
nothing in the job.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..errors import ConfigError

log = logging.getLogger("byteps_like.scheduler")

#: path -> (file of scheduler/web/, content type)
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
#: nothing but this origin: scripts, styles, fetches and images
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _asset(name: str) -> bytes:
    return (resources.files(__package__) / "web" / name).read_bytes()


class Dashboard:
    """An HTTP server on its own daemon thread; :meth:`close` stops it."""

    def __init__(self, state: Callable[[], dict], host: str, port: int, token: str = ""):
        if not is_loopback(host) and not token:
            raise ConfigError(
                f"BYTEPS_DASHBOARD_HOST={host!r} exposes the live page beyond this machine, "
                "which needs the job's secret as its token: set BYTEPS_AUTH_SECRET (or "
                "BYTEPS_AUTH_SECRET_FILE), or bind it to 127.0.0.1 and reach it through an SSH "
                "tunnel")
        self.state, self.token = state, token if not is_loopback(host) else ""
        self.assets = {path: (_asset(name), kind) for path, (name, kind) in ASSETS.items()}
        handler = type("Handler", (_Handler,), {"dashboard": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"the live page cannot listen on {host}:{port} "
                              f"(BYTEPS_DASHBOARD_PORT, BYTEPS_DASHBOARD_HOST): {exc}") from None
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.allowed_hosts = {host, "localhost", "127.0.0.1", "[::1]"}
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="bpsl-dashboard",
                                        daemon=True)
        self._thread.start()
        where = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}/"
        self.url = where
        log.info("scheduler: live job page on %s%s", where,
                 " (append ?token=<the job's secret>)" if self.token else "")

    @classmethod
    def for_scheduler(cls, sched: Any) -> Dashboard:
        m = sched.cfg.metrics
        return cls(sched.reports.state, m.dashboard_host, m.dashboard_port,
                   sched.cfg.auth.secret)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)


def serve_dashboard(sched: Any) -> Dashboard | None:
    """The scheduler's live page if BYTEPS_DASHBOARD_PORT is set (else None)."""
    return Dashboard.for_scheduler(sched) if sched.cfg.metrics.dashboard_port else None


class _Handler(BaseHTTPRequestHandler):
    dashboard: Dashboard
    server_version = "byteps_like"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("dashboard: " + format, *args)

    def _send(self, code: int, body: bytes, kind: str, *, no_store: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store" if no_store else "max-age=60")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, text: str) -> None:
        self._send(code, json.dumps({"error": text}).encode(), "application/json",
                   no_store=True)

    def _authorised(self, query: dict) -> bool:
        token = self.dashboard.token
        if not token:
            return True
        given = (query.get("token") or [""])[0]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:]
        return hmac.compare_digest(given.encode(), token.encode())

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        url = urlsplit(self.path)
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
        if not self.dashboard.token and host not in self.dashboard.allowed_hosts:
            self._error(403, f"Host {host!r} is not this page's address")
            return
        query = parse_qs(url.query)
        if url.path in ("/page.js", "/page.css"):  # no data in them: no token needed
            body, kind = self.dashboard.assets[url.path]
            self._send(200, body, kind)
            return
        if not self._authorised(query):
            self._error(401, "this page needs the job's secret: ?token=<BYTEPS_AUTH_SECRET>")
            return
        if url.path in ASSETS:
            body, kind = self.dashboard.assets[url.path]
            self._send(200, body, kind, no_store=True)
        elif url.path == "/api/state":
            try:
                state = self.dashboard.state()
            except Exception as exc:  # noqa: BLE001 - the page reports it; the job goes on
                log.warning("dashboard: state failed: %r", exc)
                self._error(500, f"state failed: {exc!r}")
                return
            self._send(200, json.dumps(state).encode(), "application/json", no_store=True)
        else:
            self._error(404, f"no page {url.path!r}: try / or /api/state")

    do_HEAD = do_GET
