"""A local S3 for tests: moto's threaded server on 127.0.0.1 and s3fs pointed at it.

Usage in a test module (the ``tests`` folder is on ``sys.path`` under pytest)::

    from s3util import s3_bucket  # noqa: F401  (pytest fixture)

    def test_x(s3_bucket):           # "s3://<bucket>" with a fresh, empty bucket
        ...

Subprocesses inherit the configuration through the environment (``s3_env``): fsspec reads
``FSSPEC_S3_<KWARG>`` variables when it is imported.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import Dict, Iterator

import pytest

_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "NO_PROXY": "127.0.0.1,localhost",
}


def s3_env(endpoint: str) -> Dict[str, str]:
    """Environment that makes s3fs (in this or a child process) talk to ``endpoint``."""
    return {**_CREDS, "FSSPEC_S3_ENDPOINT_URL": endpoint, "FSSPEC_S3_KEY": "testing",
            "FSSPEC_S3_SECRET": "testing"}


@contextmanager
def moto_s3() -> Iterator[str]:
    """Start moto on 127.0.0.1 (free port), configure s3fs for it, yield the endpoint URL."""
    import fsspec.config
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = s3_env(endpoint)
    saved_env = {k: os.environ.get(k) for k in env}
    saved_conf = fsspec.config.conf.get("s3")
    os.environ.update(env)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    _clear_s3fs_cache()
    try:
        yield endpoint
    finally:
        _clear_s3fs_cache()
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _clear_s3fs_cache() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """One moto server per test module."""
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """``s3://<fresh bucket>`` on the module's moto server."""
    import fsspec

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3")
    fs.mkdir(name)
    return f"s3://{name}"
