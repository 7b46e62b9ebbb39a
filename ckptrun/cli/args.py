"""``ckptrun [TORCHRUN OPTIONS] [CKPTRUN OPTIONS] SCRIPT [ARGS...]`` -> :class:`AgentConfig`.

Built on torch's public ``torch.distributed.run.get_args_parser()`` so every torchrun flag,
both spellings and argparse's unique prefixes keep working, with ckptrun's options added.
Everything is checked *before* anything starts: a bad command line raises :class:`UsageError`
with a one-line message, which the CLI turns into ``ckptrun: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Set, Tuple

from ckptrun import __version__
from ckptrun.cli.slurm import FROM_SLURM, SlurmError, current_step
from ckptrun.cli.usage import FALSE, TRUE, URL_RE, UsageError
from ckptrun.config import AgentConfig

# (option, metavar, help) of ckptrun's own options; each also reads CKPTRUN_<NAME>.
_OWN_OPTIONS = [
    ("--run-dir", "PATH", "logs, status.json, events.jsonl (default: ckptrun-runs/<run-id>)"),
    ("--persist-to", "URL", "durable tier, any fsspec URL (default: <run-dir>/checkpoints)"),
    ("--persist-every", "N|DURATION", "persist every N steps, or every 30s/10m/1h (default: 10m)"),
    ("--keep", "N", "persisted checkpoints kept (default: 3)"),
    ("--replicas", "M", "copies of each node's snapshot in CPU memory, own included (default: 2)"),
    ("--hang-timeout", "SECONDS|auto", "no heartbeat for this long = hang (default: auto)"),
    ("--resume-from", "URL", "restore from this persisted checkpoint at first start"),
    ("--replication-rate", "MB/s", "cap on each agent's peer-replication traffic, MB/s; 0 = "
     "unpaced (default: 0)"),
    ("--replication-budget", "PCT|off", "replication may slow training by at most this much, "
     "measured from the workers' heartbeats; off = rounds back to back (default: 5%%)"),
    ("--secret-file", "PATH", "the job secret of a multi-machine job, a file only you can read "
     "(or CKPTRUN_SECRET); never sent through the rendezvous store"),
    ("--snapshot-every", "N|auto", "memory snapshot every N steps, or auto: every step while "
     "it costs <= 3%% of training time (CKPTRUN_SNAPSHOT_OVERHEAD), else every k-th (default: 1)"),
    ("--metrics-port", "PORT", "serve Prometheus metrics of this machine's agent on PORT "
     "(0: any free port, written to status.json; default: off)"),
    ("--metrics-addr", "ADDR", "address the metrics are served on (default: 127.0.0.1)"),
]
_OWN_DEFAULTS = {"persist_every": "10m", "keep": "3", "replicas": "2", "hang_timeout": "auto",
                 "replication_rate": "0", "replication_budget": "5%",
                 "metrics_addr": "127.0.0.1"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NO_SCRIPT = "no training script given (usage: ckptrun [OPTIONS] SCRIPT [ARGS...])"


def _torch_run():
    """torch's launcher module, or a clear error on a torch without its public parser."""
    try:
        import torch.distributed.run as trun

        trun.get_args_parser, trun.determine_local_world_size, trun.parse_min_max_nnodes  # noqa: B018
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"ckptrun needs torch>=2.7 with torch.distributed.run ({exc})") from exc
    return trun


@contextmanager
def _without_pet_env() -> Iterator[None]:
    """Hide ``PET_*`` while torch builds its parser.

    torch reads them in the actions' constructors and crashes on ``PET_STANDALONE=""``
    (``int("")``); we apply them ourselves afterwards with lenient boolean parsing.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith("PET_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _raise_usage(message: str) -> None:
    raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus ckptrun's options, with env defaults applied and errors raised."""
    trun = _torch_run()
    with _without_pet_env():
        parser = trun.get_args_parser()
    _add_later_torchrun_flags(parser)
    parser.prog = "ckptrun"
    parser.description = (
        "Run a PyTorch training job like torchrun, with per-iteration in-memory checkpoints "
        "and fast recovery from crashes and hangs. Subcommands: 'ckptrun status', "
        "'ckptrun restore', 'ckptrun run' (when the script is named status/restore/run)."
    )
    parser.error = _raise_usage  # one line, no usage dump, no SystemExit from deep inside
    parser.set_defaults(max_restarts=10)  # a launcher for recovery recovers unless told not to
    group = parser.add_argument_group("ckptrun options (also CKPTRUN_<NAME> environment variables)")
    for opt, metavar, text in _OWN_OPTIONS:
        dest = opt[2:].replace("-", "_")
        default = os.environ.get("CKPTRUN_" + dest.upper()) or _OWN_DEFAULTS.get(dest)
        spellings = dict.fromkeys([opt, "--" + dest])  # --run-dir and --run_dir
        group.add_argument(*spellings, dest=dest, metavar=metavar, default=default, help=text)
    group.add_argument("--insecure", action="store_true",
                       default=os.environ.get("CKPTRUN_INSECURE", "").strip().lower() in TRUE,
                       help="run a multi-machine job without a job secret: anyone who can reach "
                       "the rendezvous store can then read and rewrite its checkpoints")
    group.add_argument("--hot-spares", action="store_true",
                       default=os.environ.get("CKPTRUN_HOT_SPARES", "").strip().lower() in TRUE,
                       help="with @ckptrun.resilient: each spare runs the script up to that "
                       "function and waits there, so a replacement skips the script's start-up "
                       "(the code before the function runs twice: keep side effects inside it)")
    group.add_argument("--standby", action="store_true",
                       default=os.environ.get("CKPTRUN_STANDBY", "").strip().lower() in TRUE,
                       help="join a multi-machine job as a standby machine: no ranks, warm "
                       "workers; takes a lost machine's ranks as soon as the loss is seen")
    # torchrun's unique prefixes of --standalone stay its own though --standby shares them
    parser.add_argument("--stan", "--stand", dest="standalone", action="store_true",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"ckptrun {__version__}")
    step = _slurm_step()
    if step is not None:  # under srun: the allocation gives the rendezvous (flags still win)
        parser.set_defaults(**step.defaults())
    _apply_pet_env(parser)
    return parser


def _slurm_step():
    try:
        return current_step()
    except SlurmError as exc:
        raise UsageError(str(exc)) from None


def _apply_pet_env(parser: argparse.ArgumentParser) -> None:
    """``PET_<DEST>`` defaults for torch's options; an empty value counts as unset."""
    defaults = vars(parser.parse_known_args(["x"])[0])
    for dest, default in defaults.items():
        if dest in ("training_script", "training_script_args") or dest in _OWN_DEFAULTS:
            continue
        value = os.environ.get("PET_" + dest.upper())
        if value is None or (value == "" and not isinstance(default, bool)):
            continue
        if isinstance(default, bool):
            low = value.strip().lower()
            if low not in FALSE | TRUE:
                raise UsageError(f"PET_{dest.upper()}={value!r} is not a boolean (use 1 or 0)")
            parser.set_defaults(**{dest: low in TRUE})
        else:
            parser.set_defaults(**{dest: value})  # argparse applies the option's type later


def _parse_namespace(parser: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    """Parse, resolving "ambiguous" prefixes whose matches are spellings of one option.

    argparse treats ``--nproc`` as ambiguous between ``--nproc-per-node`` and
    ``--nproc_per_node`` although both name the same option; torchrun rejects it too.
    """
    argv = list(argv)
    for _ in range(len(argv) + 1):
        try:
            return parser.parse_args(argv)
        except UsageError as exc:
            m = re.match(r"ambiguous option: (\S+?)(?:=\S*)? could match (.+)$", str(exc))
            matches = m and {s.strip().replace("_", "-") for s in m.group(2).split(",")}
            if not m or len(matches) != 1:
                raise
            prefix, full = m.group(1), matches.pop()
            for i, tok in enumerate(argv):
                if tok == prefix or tok.startswith(prefix + "="):
                    argv[i] = full + tok[len(prefix):]
                    break
            else:
                raise
    raise UsageError("could not parse the command line")


def parse(argv: List[str]) -> AgentConfig:
    """Parse and validate a ``ckptrun`` command line (without the program name)."""
    return parse_with(argv)[0]


def parse_with(argv: List[str], add_options=None) -> Tuple[AgentConfig, argparse.Namespace]:
    """:func:`parse`, with more options added to the parser by ``add_options(parser)`` (a
    subcommand's own, e.g. ``ckptrun check``'s); returns the namespace too."""
    trun = _torch_run()
    parser = build_parser()
    if add_options is not None:
        add_options(parser)
    if not argv:
        raise UsageError(_NO_SCRIPT)
    try:
        ns = _parse_namespace(parser, argv)
    except UsageError as exc:
        if "required: training_script" in str(exc):
            raise UsageError(_NO_SCRIPT) from None
        raise
    slurm_step = _slurm_step()
    if slurm_step is not None and ns.standalone:
        # --standalone under srun: a job of this machine alone, whatever the step's size
        for dest, value in slurm_step.defaults().items():
            if getattr(ns, dest) == value:
                setattr(ns, dest, {"nnodes": "1:1", "rdzv_backend": "static"}.get(dest))
    run_id = ns.rdzv_id if ns.rdzv_id and ns.rdzv_id != "none" else new_run_id()
    min_nodes, max_nodes = _nnodes(trun, ns.nnodes)
    nproc = _nproc(trun, ns.nproc_per_node)
    _check_script(ns)
    _refuse_unsupported(ns, nproc)
    if ns.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {ns.max_restarts}")

    backend, endpoint, rdzv_id = ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id
    slurm = slurm_step if endpoint == FROM_SLURM else None
    if slurm is not None:  # the allocation's rendezvous is used
        try:
            endpoint = ns.rdzv_endpoint = slurm.endpoint()
        except SlurmError as exc:
            raise UsageError(str(exc)) from None
    if slurm is not None and slurm.ntasks != slurm.nnodes:
        raise UsageError(f"this Slurm step runs {slurm.ntasks} tasks on {slurm.nnodes} nodes: "
                         "ckptrun starts the workers itself, run one per node (srun "
                         "--ntasks-per-node=1 ckptrun --nproc-per-node N ...)")
    if ns.standalone and (endpoint or backend not in ("static", "c10d")):
        given = ([f"--rdzv-backend {backend}"] if backend not in ("static", "c10d") else []) + \
            ([f"--rdzv-endpoint {endpoint}"] if endpoint else [])
        _warn(f"--standalone runs its own store on this machine: {' '.join(given)} is not used")
    if ns.standalone:
        backend, endpoint, rdzv_id = "c10d", "localhost:0", run_id
    elif backend == "static" and not endpoint and ns.master_port is None and max_nodes == 1:
        backend, endpoint, rdzv_id = "c10d", "localhost:0", run_id  # as torchrun's run()
    master_port = 29500 if ns.master_port is None else ns.master_port
    rdzv_configs: Dict[str, object] = dict(_rdzv_conf(ns.rdzv_conf))
    if backend == "static":
        if not 0 <= ns.node_rank < max_nodes:
            raise UsageError(f"--node-rank {ns.node_rank} is outside 0..{max_nodes - 1}")
        rdzv_configs["rank"] = ns.node_rank
        if not endpoint:
            endpoint = f"{ns.master_addr}:{master_port}"
    if backend == "c10d" and not endpoint:
        raise UsageError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (or --standalone)")

    default_run_dir = slurm.run_dir() if slurm else os.path.join("ckptrun-runs", job_id(ns))
    run_dir = os.path.abspath(os.path.expanduser(ns.run_dir or default_run_dir))
    # under srun every machine has a run dir of its own, and the job's checkpoints one place
    # they share (the submit directory, as a rule)
    default_persist = os.path.abspath(slurm.persist_to()) if slurm and not ns.run_dir \
        else os.path.join(run_dir, "checkpoints")
    persist_to = _absolute_url(ns.persist_to or default_persist)
    every_steps, every_seconds = parse_persist_every(ns.persist_every)
    cfg = AgentConfig(
        # --run-path runs the script as a Python file whatever -m/--no-python say (torchrun)
        script=ns.training_script, script_args=list(ns.training_script_args),
        module=ns.module and not ns.run_path, no_python=ns.no_python and not ns.run_path,
        run_path=ns.run_path, nproc_per_node=nproc,
        min_nodes=min_nodes, max_nodes=max_nodes, rdzv_backend=backend, rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id, rdzv_configs=rdzv_configs, standalone=ns.standalone,
        node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=master_port,
        local_addr=ns.local_addr, role=ns.role, max_restarts=ns.max_restarts,
        monitor_interval=float(_positive(ns.monitor_interval, "--monitor-interval")),
        start_method=ns.start_method, shutdown_timeout=_shutdown_timeout(ns.shutdown_timeout),
        signals_to_handle=ns.signals_to_handle, log_dir=ns.log_dir,
        redirects=_std(ns.redirects, "--redirects"), tee=_std(ns.tee, "--tee"),
        local_ranks_filter=_ranks_filter(ns.local_ranks_filter), run_dir=run_dir,
        duplicate_stdout_filters=list(ns.duplicate_stdout_filters or []),
        duplicate_stderr_filters=list(ns.duplicate_stderr_filters or []),
        event_log_handler=_event_log_handler(ns.event_log_handler),
        virtual_local_rank=bool(ns.virtual_local_rank),
        numa_binding=getattr(ns, "numa_binding", None) or None,
        persist_to=persist_to, persist_every_steps=every_steps,
        persist_every_seconds=every_seconds, keep=_count(ns.keep, "--keep"),
        replicas=_count(ns.replicas, "--replicas"), hot_spares=bool(ns.hot_spares),
        standby=bool(ns.standby), hang_timeout=parse_hang_timeout(ns.hang_timeout),
        resume_from=_absolute_url(ns.resume_from) if ns.resume_from else None,
        replication_rate=parse_replication_rate(ns.replication_rate),
        replication_budget=_replication_budget(ns.replication_budget),
        snapshot_every=_snapshot_every(ns.snapshot_every),
        secret=_secret(ns, max_nodes, endpoint), insecure=bool(ns.insecure),
        metrics_port=_metrics_port(ns.metrics_port), metrics_addr=ns.metrics_addr,
    )
    if max_nodes == 1 and cfg.replicas and ns.replicas not in (None, _OWN_DEFAULTS["replicas"]):
        _warn(f"--replicas {cfg.replicas}: this job runs on one machine, so there is no other "
              "machine to hold copies (memory and storage only)")
    elif max_nodes > 1 and cfg.replicas > max_nodes:  # --replicas counts the own copy
        _warn(f"--replicas {cfg.replicas}: with at most {max_nodes} machines each snapshot has "
              f"at most {max_nodes} copies in memory, its own included")
    if cfg.standby:
        _check_standby(cfg)
    from ckptrun.cli.preflight import check_environment

    check_environment(cfg)
    return cfg, ns


def _check_standby(cfg: AgentConfig) -> None:
    """A standby waits in torch's dynamic rendezvous for a machine of a running job to go."""
    if cfg.standalone or cfg.max_nodes == 1:
        raise UsageError("--standby joins a job of several machines (--nnodes N with N > 1 and "
                         "the job's --rdzv-endpoint); this one runs on one machine")
    if cfg.rdzv_backend not in ("c10d", "etcd-v2"):
        raise UsageError(f"--standby needs --rdzv-backend c10d or etcd-v2 (a standby waits in "
                         f"torch's dynamic rendezvous), not {cfg.rdzv_backend}")


def _secret(ns: argparse.Namespace, max_nodes: int, endpoint: str) -> Optional[bytes]:
    """The job secret (``--secret-file``, ``CKPTRUN_SECRET``); several machines need one."""
    from ckptrun.protocol.job_secret import SecretError, job_secret, user_local_secret

    try:
        secret = job_secret(ns.secret_file, os.environ)
    except SecretError as e:
        raise UsageError(str(e)) from None
    if secret is None and max_nodes > 1 and not ns.insecure and _loopback(endpoint):
        # every agent of this job runs on this machine, as this user: they share a secret
        # of the user's own without being told (torchrun's `--nnodes 1:2` on localhost)
        try:
            return user_local_secret()
        except (SecretError, OSError) as e:
            raise UsageError(f"a job of several agents on this machine needs a secret: {e}; "
                             "set CKPTRUN_SECRET or --secret-file PATH") from None
    if secret is None and max_nodes > 1:
        if not ns.insecure:
            raise UsageError(
                "a job on several machines needs a secret only its machines know (the "
                "rendezvous store answers anyone): set CKPTRUN_SECRET or --secret-file PATH "
                "(mode 0600) on every machine, or --insecure to run without one")
        _warn("--insecure: no job secret, so anyone who can reach the rendezvous store can "
              "read this job's checkpoints from the other machines and push forged ones")
    return secret


def _loopback(endpoint: Optional[str]) -> bool:
    """Whether the job's resolved rendezvous endpoint (``--rdzv-endpoint``, or the static
    backend's ``--master-addr:--master-port``) is this machine's loopback (``localhost``,
    127.x, ::1): then every agent that reaches it runs here."""
    import ipaddress

    host = (endpoint or "").strip()
    if host.startswith("["):  # [::1]:29400
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warn(text: str) -> None:
    print(f"ckptrun: warning: {text}", file=sys.stderr)


def _metrics_port(text: Optional[str]) -> Optional[int]:
    if text is None or str(text).strip().lower() in ("", "off"):
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise UsageError(f"--metrics-port takes a port 0..65535 (0: any free one), got {text!r}")
    from ckptrun.agent.metrics import available

    if not available():
        raise UsageError("--metrics-port needs prometheus_client (pip install prometheus_client)")
    return port


def _refuse_unsupported(ns: argparse.Namespace, nproc: int) -> None:
    """torchrun options that cannot apply to ckptrun's agent: refused, never ignored."""
    if getattr(ns, "logs_specs", None):
        raise UsageError(f"--logs-specs {ns.logs_specs}: ckptrun writes the worker logs itself "
                         "(--log-dir, --redirects, --tee, --local-ranks-filter, "
                         "--duplicate-*-filters work as in torchrun); a custom LogsSpecs "
                         "class cannot be plugged in")
    if getattr(ns, "numa_binding", None):
        from ckptrun.agent import numa

        try:
            numa.check(ns.numa_binding, nproc)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def _event_log_handler(name: Optional[str]) -> str:
    """A registered ``torch.distributed.elastic.events`` handler name ("null": none)."""
    name = name or "null"
    if name != "null":
        from torch.distributed.elastic.events.handlers import get_logging_handler

        try:
            get_logging_handler(name)
        except KeyError:
            raise UsageError(f"--event-log-handler {name!r} is not a registered handler "
                             "(torch.distributed.elastic.events: console, null, ...)") from None
    return name


def _snapshot_every(text: Optional[str]) -> str:
    from ckptrun.worker.interval import parse_every

    try:
        return parse_every(text or 1)[1]
    except ValueError:
        raise UsageError(f"--snapshot-every takes N steps or 'auto'; got {text!r}") from None


def _replication_budget(text: Optional[str]) -> Optional[float]:
    from ckptrun.tiers.peer.pacing import parse_budget

    try:
        return parse_budget(text)
    except ValueError:
        raise UsageError(f"--replication-budget takes a share like 5% or 0.05, or 'off'; "
                         f"got {text!r}") from None


def job_id(ns: argparse.Namespace) -> str:
    """The name of the default run directory: the same for the same job, so that running
    the same command again (after a preemption, a requeue) resumes from its checkpoints.

    ``--rdzv-id`` when given; else the job id of the scheduler that started us
    (``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``); else the script and its arguments: the script's
    name and a hash of its absolute path, its arguments and how it is run (``-m``,
    ``--no-python``)."""
    if ns.rdzv_id and ns.rdzv_id != "none":
        return _safe(ns.rdzv_id)
    for var, prefix in (("SLURM_JOB_ID", "slurm-"), ("TORCHELASTIC_RUN_ID", "")):
        value = os.environ.get(var, "").strip()
        if value and value != "none":
            return prefix + _safe(value)
    script = ns.training_script
    target = script if ns.module or ns.no_python else os.path.abspath(script)
    digest = hashlib.sha256(json.dumps([target, list(ns.training_script_args), bool(ns.module),
                                        bool(ns.no_python)]).encode()).hexdigest()[:10]
    stem = os.path.splitext(os.path.basename(script))[0] or "job"
    return f"{_safe(stem)}-{digest}"


def _safe(text: str) -> str:
    """``text`` as one path component."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:80] or "job"


def new_run_id() -> str:
    """A readable, unique-enough run id such as ``20261129-153012-ab12``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def parse_duration(text: str) -> Optional[float]:
    """``30s``/``10m``/``1.5h``/``1d`` -> seconds; ``None`` if ``text`` has no unit."""
    m = _DURATION.match(text)
    return float(m.group(1)) * _UNIT_S[m.group(2).lower()] if m else None


def parse_persist_every(text: str) -> Tuple[Optional[int], Optional[float]]:
    """``N`` (steps) or a duration -> ``(steps, None)`` or ``(None, seconds)``."""
    text = str(text).strip()
    seconds = parse_duration(text)
    if seconds is None and not re.match(r"^\d+$", text):
        raise UsageError(f"--persist-every takes N steps or a duration like 30s, 10m, 1h; got {text!r}")
    _positive(float(text) if seconds is None else seconds, "--persist-every")
    return (None, seconds) if seconds is not None else (int(text), None)


def parse_replication_rate(text: str) -> Optional[float]:
    """``MB/s`` (decimal megabytes) -> bytes/s; ``0``/``off``/``unlimited`` -> None (unpaced)."""
    text = str(text).strip().lower()
    if text in ("", "0", "off", "none", "unlimited"):
        return None
    try:
        mb_s = float(text.removesuffix("mb/s"))
    except ValueError:
        raise UsageError(f"--replication-rate takes MB/s (0 = unpaced), got {text!r}") from None
    if not mb_s > 0 or mb_s == float("inf"):
        raise UsageError(f"--replication-rate must be a positive number of MB/s or 0, got {text!r}")
    return mb_s * 1e6


def parse_hang_timeout(text: str) -> Optional[float]:
    """``auto`` -> ``None``; ``SECONDS`` or a duration -> positive seconds."""
    text = str(text).strip()
    if text.lower() == "auto":
        return None
    try:
        seconds = parse_duration(text) or float(text)
    except ValueError:
        raise UsageError(f"--hang-timeout takes SECONDS or 'auto', got {text!r}") from None
    return _positive(seconds, "--hang-timeout")


def _nnodes(trun, text: str) -> Tuple[int, int]:
    try:
        lo, hi = trun.parse_min_max_nnodes(str(text))
    except (ValueError, RuntimeError):
        raise UsageError(f"--nnodes takes N or MIN:MAX, got {text!r}") from None
    if not 0 < lo <= hi:
        raise UsageError(f"--nnodes needs 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def _nproc(trun, text: str) -> int:
    import logging

    # determine_local_world_size logs at INFO through torch's logger; keep the CLI quiet.
    logging.getLogger("torch.distributed.run").setLevel(logging.WARNING)
    try:
        n = trun.determine_local_world_size(str(text))
    except ValueError as exc:
        raise UsageError(f"--nproc-per-node {text}: {exc}") from None
    if n <= 0:
        raise UsageError(f"--nproc-per-node must be >= 1, got {text!r}")
    return n


def _check_script(ns: argparse.Namespace) -> None:
    script = ns.training_script
    if ns.module and ns.no_python and not ns.run_path:
        raise UsageError("--no-python and -m/--module cannot be used together")
    if ns.module and not ns.run_path:
        return  # a module name: Python resolves it in the worker
    if ns.no_python and not ns.run_path:
        if not (shutil.which(script) or os.path.isfile(script)):
            raise UsageError(f"program not found: {script} (not a file, not on PATH)")
        return
    if not os.path.isfile(script):
        raise UsageError(f"training script not found: {script}")


def _rdzv_conf(text: str) -> Dict[str, str]:
    conf: Dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not key.strip() or not sep or not value.strip():
            raise UsageError(f"--rdzv-conf takes KEY=VALUE,... ; bad item {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _absolute_url(url: str) -> str:
    """Plain paths become absolute; URLs with a scheme (``file://``, ``s3://``) stay as given."""
    return url if URL_RE.match(url) else os.path.abspath(os.path.expanduser(url))


def _count(text: str, flag: str) -> int:
    try:
        n = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{flag} takes a whole number, got {text!r}") from None
    return _positive(n, flag)


def _comma_list(text: str) -> List[str]:
    return [x for x in text.split(",") if x]


# torchrun options of newer torch (2.13's parser is the reference) that an older torch's
# parser lacks -- torch 2.11 has no --shutdown-timeout, and ckptrun's own code reads every
# one of these: each is added with torchrun's spellings and default where missing, so a
# ckptrun command line means the same under every torch >= 2.7.  ckptrun implements them
# itself (shutdown, signals, log files, LOCAL_RANK); --numa-binding needs torch's own code,
# so where torch has none it is known only to be refused in one line naming the torch that
# has it (ckptrun.agent.numa.check).
_LATER_TORCHRUN_FLAGS: List[Tuple[str, Dict[str, object]]] = [
    ("shutdown_timeout", dict(type=int, default=None, help="seconds to wait for workers to "
                              "exit after SIGTERM before SIGKILL")),
    ("signals_to_handle", dict(default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                               help="signals forwarded to the workers")),
    ("duplicate_stdout_filters", dict(type=_comma_list, default=[],
                                      help="ranks whose stdout is also written to one file")),
    ("duplicate_stderr_filters", dict(type=_comma_list, default=[],
                                      help="ranks whose stderr is also written to one file")),
    ("virtual_local_rank", dict(action="store_true", default=False,
                                help="LOCAL_RANK 0 in every worker")),
    ("local_ranks_filter", dict(default="", help="only show these local ranks' logs")),
    ("event_log_handler", dict(default="null", help="torch elastic event log handler")),
    ("logs_specs", dict(default=None, help=argparse.SUPPRESS)),  # refused if given anyway
    ("numa_binding", dict(default=None, help=argparse.SUPPRESS)),  # refused (torch < 2.9)
]


def _add_later_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    have = {a.dest for a in parser._actions}
    for dest, spec in _LATER_TORCHRUN_FLAGS:
        if dest not in have:
            flag = "--" + dest.replace("_", "-")
            parser.add_argument(flag, "--" + dest, dest=dest, **spec)  # type: ignore[arg-type]


def _positive(value, flag: str):
    if not 0 < value < float("inf"):
        raise UsageError(f"{flag} must be positive, got {value}")
    return value


def _shutdown_timeout(value: Optional[int]) -> float:
    """torchrun's order: the flag, then ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, then our default."""
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    try:
        value = value if value is not None else float(env) if env else AgentConfig.shutdown_timeout
    except ValueError:
        raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env!r} is not a number") from None
    if value < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {value}")
    return float(value)


def _std(text: str, flag: str) -> str:
    from torch.distributed.elastic.multiprocessing import Std

    try:
        Std.from_str(str(text))
    except (ValueError, KeyError):
        raise UsageError(f"{flag} takes 0-3 or LOCAL_RANK:N,... (e.g. 3 or 0:1,1:2); "
                         f"got {text!r}") from None
    return str(text)


def _ranks_filter(text: str) -> Optional[Set[int]]:
    if not text:
        return None
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise UsageError(f"--local-ranks-filter takes a comma-separated list of integers, "
                         f"got {text!r}") from None
