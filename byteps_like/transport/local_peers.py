"""Which connections of a local root's socket are this machine's local ranks (issue 19).

The local root (several worker processes per machine) listens on a port published in the node
table, so anyone who can reach the port can connect to it. The local ranks prove that they are
on this machine, run as this user and belong to this job by a token the root writes at start,
before it registers, into a file only this user can read (next to the shared-memory segments
of the local reduction); each local rank connects with a routing id built from it, and the root
takes local-reduction messages only from the connection whose routing id is that rank's. An
outsider's connection gets a routing id ZeroMQ makes up, so its messages match no rank.
"""
from __future__ import annotations

import os
import secrets

from ..errors import BytePSError
from ..local import hold, segment_prefix

PEERS = "peers"


def token_path(cluster) -> str:
    """The token file of this machine (``cluster``: the ClusterConfig); the local root's
    sweep of leftovers at start removes an old one with the segments."""
    return os.path.join(cluster.shm_dir, segment_prefix(cluster.job_id, cluster.root_port)
                        + f"m{cluster.worker_id}-{PEERS}")


def create_token(path: str) -> bytes:
    """Write a fresh token that only this user can read (the local root), in the job's files
    of this machine, which the local root holds from now on (local.hold)."""
    shm_dir, name = os.path.split(path)
    hold(name[:-len(PEERS)], shm_dir)
    token = secrets.token_hex(16).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise BytePSError(f"local root: cannot create {path} ({exc.strerror}); another user's "
                          "file of that name, or no writable BYTEPS_SHM_DIR") from None
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    return token


def read_token(path: str) -> bytes:
    """The token of this machine's local root (a local rank), checked to be this user's."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise BytePSError(f"local rank: cannot read the local root's token {path} "
                          f"({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise BytePSError(f"local rank: {path} is not the local root's (owner "
                              f"{st.st_uid}, mode {st.st_mode & 0o777:o})")
        token = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(token) != 32:
        raise BytePSError(f"local rank: {path} holds no token")
    return token


def routing_id(token: bytes, local_rank: int) -> bytes:
    """The routing id of local rank ``local_rank``'s connection to its root."""
    return b"L%d." % local_rank + token


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
