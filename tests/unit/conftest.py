"""Fixtures of the unit tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def cleanup():
    """A list the test appends native servers and clients to: closed after it, last first."""
    objs = []
    yield objs
    for o in reversed(objs):
        o.close()
