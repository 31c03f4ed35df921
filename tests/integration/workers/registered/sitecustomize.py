"""Imported by every Python process started with this directory on PYTHONPATH (workers,
servers, the launcher): registers the test's own compressor there, as docs/compression.md tells
users to ("Adding a compressor"): a server rebuilds a registered compressor from its spec.
BPS_TEST_SERVER_PLAIN=1: not in servers (a server that lacks the registration)."""
import os

import bps_test_codecs

if not (os.environ.get("BPS_TEST_SERVER_PLAIN") and os.environ.get("DMLC_ROLE") == "server"):
    bps_test_codecs.register_all()
