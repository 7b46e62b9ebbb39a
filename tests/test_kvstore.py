"""``wait_keys``: the agents' waits on the rendezvous store."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import TCPStore

from ckptrun.store.kvstore import wait_keys


@pytest.fixture
def stores():
    host = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    yield host, TCPStore("127.0.0.1", host.port, 1, False)


def test_a_key_set_later_is_seen_and_nothing_is_logged(stores, capfd):
    """The wait sees a key another client sets 0.3 s later, and leaves stderr clean: the
    timed-out ``store.wait`` slices it used before wrote two C++ warnings each (fd 2)."""
    host, other = stores
    threading.Timer(0.3, lambda: other.set("late", "1")).start()
    assert wait_keys(host, ["late"], 30, slice_s=0.05)
    assert "waitForInput" not in capfd.readouterr().err


def test_stop_ends_the_wait(stores):
    host, _ = stores
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    assert wait_keys(host, ["never"], 30, stop=stop) is False


def test_check_can_abandon_the_wait(stores):
    host, _ = stores
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise LookupError("a machine of the round is lost")
    with pytest.raises(LookupError):
        wait_keys(host, ["never"], 30, check=check)


def test_a_wait_times_out(stores):
    host, other = stores
    other.set("here", "1")
    assert wait_keys(host, ["here"], 0.0)  # present: no timeout even with none left
    with pytest.raises(TimeoutError):
        wait_keys(host, ["here", "never"], 0.2, slice_s=0.02)
