"""The scheduler role: rendezvous, ranks, barriers, liveness, elastic membership epochs
(``python -m byteps_like.scheduler``)."""
from .core import Scheduler, assign_ranks, run

__all__ = ["Scheduler", "assign_ranks", "run"]
