"""The exception tree of byteps_like.

Every error a user can meet derives from :class:`BytePSError`. Messages name what failed,
where (role, rank, host, tensor name) and what to do about it.
"""
from __future__ import annotations

#: The exit status of a process that stops only because another process of the job failed or
#: was lost (a ``PeerLostError``: the scheduler's abort notice, a lost peer): the scheduler and
#: servers then, and a worker whose script dies of an uncaught ``PeerLostError``. bpslaunch
#: blames the process that failed on its own, not these (docs/launcher.md). 75 is sysexits'
#: EX_TEMPFAIL: nothing is wrong with this process; restart the job.
EXIT_PEER_FAILED = 75


class BytePSError(RuntimeError):
    """Base class of every byteps_like error."""


class ConfigError(BytePSError, ValueError):
    """A setting is missing or has a bad value; the message names the variable, value and source."""


class NotInitializedError(BytePSError):
    """An API call that needs ``init()`` came before it (or after ``shutdown()``)."""


class CommunicationError(BytePSError):
    """Talking to another node of the job failed."""


class _FromNode(Exception):
    """An error about one node of the job: its ``role``, ``rank``, ``host`` and process id
    ``pid`` (None where not known) besides the message."""

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None,
                 host: str | None = None, pid: int | None = None):
        super().__init__(message)
        self.role, self.rank, self.host, self.pid = role, rank, host, pid


class PeerLostError(_FromNode, CommunicationError):
    """A node of the job stopped answering (crashed, killed, hung or partitioned away)."""


class PeerLeftError(PeerLostError):
    """A worker rank finished (its script returned or called ``sys.exit``) without calling
    ``join()`` while other ranks still push_pull: a round that needs it can never complete.
    ``rank`` is the rank that left; ``last_round`` the last round of the tensor it completed."""

    def __init__(self, message: str, *, rank: int | None = None, last_round: int | None = None,
                 host: str | None = None):
        super().__init__(message, role="worker", rank=rank, host=host)
        self.last_round = last_round


class FellBehindError(_FromNode, CommunicationError):
    """Backup workers (BYTEPS_BACKUP_WORKERS): this worker fell further behind the others than
    the servers keep completed rounds for (BYTEPS_BACKUP_MAX_LAG), so it cannot apply the sums
    they applied. ``rank`` and ``host`` name it, ``behind`` is how many rounds behind it was."""

    def __init__(self, message: str, *, rank: int | None = None, host: str | None = None,
                 behind: int | None = None):
        super().__init__(message, role="worker", rank=rank, host=host)
        self.behind = behind


class MembershipChangedError(CommunicationError):
    """Elastic jobs only (docs/elastic.md): the set of workers changed while this call ran or
    waited, so the collectives of the current step are void. ``epoch`` is the membership epoch
    that replaces the one the call belonged to; ``lost`` names the workers that left or were lost
    (e.g. ``"rank 2 on 10.0.0.3 (heartbeat lost)"``); ``added`` counts the workers waiting to
    join. ``byteps_like.elastic.run`` catches it: restore the last commit when workers were lost,
    rejoin the new epoch, re-sync from rank 0 and resume."""

    def __init__(self, message: str, *, epoch: int, lost: tuple[str, ...] = (), added: int = 0):
        super().__init__(message)
        self.epoch, self.lost, self.added = epoch, tuple(lost), added


class TooFewWorkersError(BytePSError):
    """Elastic jobs only: fewer than ``--min-workers`` workers stayed in the job for longer than
    the allowed time; the message names the workers lost."""

    def __init__(self, message: str, *, lost: tuple[str, ...] = (), min_workers: int = 0):
        super().__init__(message)
        self.lost, self.min_workers = tuple(lost), min_workers


class CommTimeoutError(CommunicationError, TimeoutError):
    """A blocking operation did not complete within its timeout."""


class ProtocolError(CommunicationError):
    """A malformed, truncated, oversized or unexpected message arrived and was rejected."""


class MismatchError(BytePSError):
    """Workers disagree about a tensor (name, shape, dtype or declaration order)."""


class RemoteError(_FromNode, BytePSError):
    """Another node reported an error; carries its role, rank, host and text."""


__all__ = [
    "BytePSError", "ConfigError", "NotInitializedError", "CommunicationError", "PeerLostError",
    "PeerLeftError", "FellBehindError", "MembershipChangedError", "TooFewWorkersError",
    "CommTimeoutError", "ProtocolError", "MismatchError", "RemoteError", "EXIT_PEER_FAILED",
]
