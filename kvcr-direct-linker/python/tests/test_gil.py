"""The GIL is released while the linker waits: another Python thread runs
while `settle` waits on a hinted restore from a peer that never answers."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

import kvcr_direct as kd
from pools import DEVICES, NAMESPACE, Pool, hint


@pytest.mark.parametrize("device", DEVICES)
def test_other_threads_run_while_settle_waits(device):
    pool = Pool(device)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    linker = pool.linker(peer=True, operation_timeout_s=1.0)
    endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    context = linker.begin(
        "gil", namespace=NAMESPACE, device_prefix_pages=0, tail=[1, 2],
        hints=[hint(endpoint, [1, 2])],
    )
    ticket = linker.restore_hinted(context, [0, 1])
    entered, finished, results = threading.Event(), threading.Event(), []

    def wait():
        entered.set()
        results.append(linker.settle(30))
        finished.set()

    # No preemption between Python threads: the main thread runs again only
    # when the worker releases the GIL itself (inside the extension) or ends.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=wait)
        worker.start()
        entered.wait()
        ran_during_call = not finished.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
        silent.close()
    assert ran_during_call, "the main thread could not run until settle returned"
    assert results == [[kd.RestoreDone(context.attempt, ticket, 0, 2)]]
    assert pool.page(0) == bytes(len(pool.page(0)))
