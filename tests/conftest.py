"""Fixtures shared by every test directory. Keep this file small: fixtures used by one
directory only belong in that directory's own conftest.py."""
from __future__ import annotations

import threading

import pytest


@pytest.fixture
def zmq_context():
    """A private ZeroMQ context, terminated after the test.

    ``term()`` blocks while any socket of the context is still open, so a test that leaks a
    socket fails here, after 10 s, naming the leak, instead of passing silently."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    yield ctx
    t = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    t.start()
    t.join(10.0)
    if t.is_alive():
        pytest.fail("zmq Context.term() still blocked after 10 s: a socket was left open")
