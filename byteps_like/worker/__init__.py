"""The worker side: what only a training process runs.

The runtime (rendezvous, the tensor registry, the pipeline's stage executors and message
dispatch), handles, the gradient synchronizer the plugins share, broadcast and the numpy API.
Servers, the scheduler and the launcher never import this package (tests/unit/test_layering.py);
what every role shares (config, errors, wire, transport, compression, topology) sits one level up.
"""
