"""The job secret: what the machines of one job share and nobody else has.

The rendezvous store has no access control (torch's ``TCPStore`` answers anyone who can reach
its port), so the secret never goes through it.  The user gives it to every machine the way
they give it credentials: ``CKPTRUN_SECRET`` or ``--secret-file PATH`` (a file only they can
read -- a file in the home directory under Slurm, a mounted Secret in Kubernetes).  One
machine alone needs nothing: its agent makes one up.

What the agents use is never the secret itself but a key derived from it and the job's id
(:func:`job_key`): one secret kept in a home directory serves every job of its owner, and a
message of one job means nothing to another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import Dict, Mapping, Optional

ENV_SECRET = "CKPTRUN_SECRET"
ENV_SECRET_FILE = "CKPTRUN_SECRET_FILE"
MIN_BYTES = 16  # 128 bits: shorter is a password, not a key
MAX_FILE_BYTES = 1 << 16


class SecretError(ValueError):
    """The secret given cannot be used, said in one line."""


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace dropped).

    The file must be the user's alone: owned by them with mode 0600 or 0400.  Owned by root
    it may grant its group read access -- a Kubernetes Secret mounted with ``fsGroup`` -- but
    never anything to others.  A symlink is followed only when it belongs to the user or to
    root (Kubernetes mounts every Secret key as one), so nobody else can swap its target."""
    me = os.geteuid()
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        raise SecretError(f"--secret-file {path} does not exist") from None
    except OSError as e:
        raise SecretError(f"--secret-file {path} cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise SecretError(f"--secret-file {path} is a symlink of another user")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SecretError(f"--secret-file {path} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)  # of what was opened, not of a name that could change meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"--secret-file {path} is not a regular file")
        if st.st_uid not in (me, 0):
            raise SecretError(f"--secret-file {path} belongs to another user")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o007 or mode & 0o020 or (mode & 0o070 and st.st_uid != 0):
            raise SecretError(f"--secret-file {path} can be read or written by others (mode "
                              f"{mode:04o}); chmod 600 it")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise SecretError(f"--secret-file {path} is larger than {MAX_FILE_BYTES} bytes")
    return _long_enough(data.strip(), f"--secret-file {path}")


def job_secret(secret_file: Optional[str], env: Mapping[str, str]) -> Optional[bytes]:
    """The secret the user gave (``--secret-file`` first, then ``CKPTRUN_SECRET``), or None."""
    if secret_file:
        return read_secret_file(secret_file)
    value = env.get(ENV_SECRET)
    if value is None or value == "":
        return None
    return _long_enough(value.strip().encode(), ENV_SECRET)


def without_secret(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` less the job secret's variables: what a process the agent starts -- a
    worker, the reaper, py-spy -- is given (the secret is the agent's alone)."""
    return {k: v for k, v in env.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}


def local_secret() -> bytes:
    """A fresh secret for a job that runs on this machine alone."""
    return secrets.token_bytes(32)


def user_local_secret(home: Optional[str] = None) -> bytes:
    """The secret this user's agents share when every machine of a job is this one (a
    ``--nnodes 1:2`` job whose rendezvous endpoint is loopback): made once, kept in
    ``~/.cache/ckptrun/local-secret`` (mode 0600, in a 0700 directory) and read back with
    the same checks as ``--secret-file``.  Two agents starting at once agree: the file
    appears whole (written aside, then linked into place) or not at all."""
    base = os.path.join(home or os.path.expanduser("~"), ".cache", "ckptrun")
    os.makedirs(base, mode=0o700, exist_ok=True)
    path = os.path.join(base, "local-secret")
    if not os.path.lexists(path):
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another agent's is there already: that one is used
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return read_secret_file(path)


def job_key(secret: bytes, job_id: str) -> bytes:
    """The key the agents of job ``job_id`` authenticate with: HMAC-SHA256 of the id under
    the secret, so that the same secret gives every job its own key."""
    return hmac.new(secret, b"ckptrun job key|" + job_id.encode(), hashlib.sha256).digest()


def _long_enough(data: bytes, what: str) -> bytes:
    if len(data) < MIN_BYTES:
        raise SecretError(f"{what} holds {len(data)} bytes; a job secret needs at least "
                          f"{MIN_BYTES} (e.g. openssl rand -hex 32)")
    return data
