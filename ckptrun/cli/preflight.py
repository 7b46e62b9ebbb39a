"""Checks of the machine before anything starts: shm, ports, rendezvous endpoint, storage.

Apart from ``ckptrun.cli.args`` (which parses): ``args.parse`` calls
:func:`check_environment` last, and every failure is a one-line :class:`UsageError`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Dict, Optional

from ckptrun.cli.usage import FALSE, TRUE, URL_RE, UsageError, first_line
from ckptrun.config import AgentConfig
from ckptrun.protocol import SHM_DIR

# Seconds a non-host node keeps trying to reach a c10d rendezvous endpoint before giving
# up: nodes start at slightly different times, so the host may not be listening yet.
RDZV_CHECK_TIMEOUT_ENV = "CKPTRUN_RDZV_CHECK_TIMEOUT"
RDZV_CHECK_TIMEOUT_DEFAULT = 10.0


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (so this node would host a store there)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "::1", "0.0.0.0", "::",
                socket.gethostname().lower(), socket.getfqdn().lower()) or host.startswith("127."):
        return True
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {"127.0.0.1", "::1"}
    try:
        import psutil

        local |= {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic}
    except Exception:
        pass  # without psutil only loopback counts as local
    return bool(addrs & local)


def check_environment(cfg: AgentConfig) -> None:
    """The checks that look at the machine: shm, ports, endpoint, storage, resume source."""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        raise UsageError(f"{SHM_DIR} is missing or not writable (the memory tier lives there)")
    if cfg.rdzv_backend == "static" and cfg.node_rank == 0 and not _port_free(cfg.master_port):
        raise UsageError(f"--master-port {cfg.master_port} is already in use on this machine")
    if cfg.rdzv_backend == "c10d":
        _check_c10d_endpoint(cfg.rdzv_endpoint, cfg.rdzv_configs)
    _check_writable(cfg.run_dir, "--run-dir")
    if cfg.resume_from:
        _check_exists(cfg.resume_from)
        _check_is_checkpoint(cfg.resume_from)
    _check_shm_room(cfg)
    _check_persist_to(cfg.persist_to)  # last: storage's probe creates the directory


def _check_is_checkpoint(url: str) -> None:
    from ckptrun.tiers.durable import storage

    try:
        storage.resolve(url)
    except storage.StorageError as e:  # none there, or a damaged one: say which
        raise UsageError(f"--resume-from {url} is not a ckptrun checkpoint: {e}") from None


def _check_shm_room(cfg: AgentConfig) -> None:
    """When the state's size is known before the start (``--resume-from``, or a durable step
    of this run), refuse a /dev/shm too small for this node's snapshot slots: Docker's 64 MB
    default otherwise kills workers with SIGBUS mid-run (DLRover's failure)."""
    from ckptrun.tiers.durable import storage  # light: DCP is imported only to write a step

    try:
        url, _ = storage.resolve(cfg.resume_from or cfg.persist_to)
        index = storage.read_index(url, None)
    except Exception:  # noqa: BLE001 -- nothing durable yet: the first save checks instead
        return
    if not index:
        return
    per_rank = max((sum(int(e.get("length") or 0) for e in r["tensors"])
                    for r in index["ranks"].values()), default=0)
    need = per_rank * cfg.nproc_per_node * cfg.num_slots
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise UsageError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free but this job's snapshots need about "
            f"{need / 2**20:.0f} MiB ({cfg.nproc_per_node} ranks x {cfg.num_slots} slots x "
            f"{per_rank / 2**20:.0f} MiB, from {url}); enlarge it (docker run --shm-size, or a "
            "Kubernetes emptyDir with medium: Memory)")


def _port_free(port: int) -> bool:
    """Whether a server could bind ``port`` on all interfaces (as the TCPStore does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _can_connect(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _check_c10d_endpoint(endpoint: str, conf: Dict[str, object]) -> None:
    """Host: nothing to reach. Otherwise the endpoint must accept a TCP connection.

    A host whose port is taken is fine when something accepts connections there: torch's
    c10d handler then joins that store as a client (several agents on one machine).
    """
    try:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError as exc:
        raise UsageError(f"--rdzv-endpoint: {exc}") from None
    is_host = str(conf.get("is_host", "")).strip().lower()  # torch's explicit override
    if is_host in TRUE or ((not is_host or is_host not in FALSE) and is_local_host(host)):
        if port and not _port_free(port) and (is_host in TRUE or not _can_connect(host, port, 1.0)):
            raise UsageError(f"--rdzv-endpoint port {port} is in use on this machine")
        return
    try:
        socket.getaddrinfo(host, port)
    except OSError:
        raise UsageError(f"--rdzv-endpoint {endpoint}: cannot resolve host {host!r}") from None
    if port == 0:
        raise UsageError(f"--rdzv-endpoint {endpoint}: port 0 only works on the host node")
    try:
        window = float(os.environ.get(RDZV_CHECK_TIMEOUT_ENV) or RDZV_CHECK_TIMEOUT_DEFAULT)
    except ValueError:
        window = RDZV_CHECK_TIMEOUT_DEFAULT
    deadline = time.monotonic() + window
    while True:
        left = deadline - time.monotonic()
        if _can_connect(host, port, max(0.1, min(2.0, left))):
            return
        if time.monotonic() >= deadline:
            raise UsageError(f"--rdzv-endpoint {endpoint} is unreachable "
                             f"(no TCP connection within {window:g}s)")
        time.sleep(0.2)


def _local_path(url: str) -> Optional[str]:
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if URL_RE.match(url) else url


def _check_writable(path: str, flag: str) -> None:
    """The nearest existing ancestor must be a writable directory (nothing is created)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} is not writable ({probe} is not a writable directory)")


def _check_persist_to(url: str) -> None:
    try:
        from ckptrun.tiers.durable.storage import check_writable
    except ImportError:
        check_writable = None
    if check_writable is not None:
        try:
            check_writable(url)
        except Exception as exc:
            raise UsageError(f"--persist-to: {first_line(exc)}") from None
        return
    path = _local_path(url)
    if path is not None:
        _check_writable(path, "--persist-to")


def _check_exists(url: str) -> None:
    path = _local_path(url)
    if path is not None:
        if not os.path.exists(path):
            raise UsageError(f"--resume-from {url} does not exist")
        return
    try:
        import fsspec

        fs, fs_path = fsspec.core.url_to_fs(url)
        found = fs.exists(fs_path)
    except Exception as exc:
        raise UsageError(f"--resume-from {url}: {first_line(exc)}") from None
    if not found:
        raise UsageError(f"--resume-from {url} does not exist")
