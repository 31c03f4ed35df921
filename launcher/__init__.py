"""bpslaunch: start and supervise the processes of a byteps_like job (docs/launcher.md).

Imports only the standard library, byteps_like.config, byteps_like.errors and the
standard-library-only byteps_like.topology.
"""
