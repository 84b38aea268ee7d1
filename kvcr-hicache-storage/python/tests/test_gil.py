"""The extension releases the GIL while a call waits: another Python thread
runs while a restore waits on a peer that never answers."""

from __future__ import annotations

import json
import socket
import sys
import threading

import engine
from engine import attach, fetch_hint, free_port, prompt_keys
from host_pool import MhaHostPool


def test_other_threads_run_while_a_restore_waits():
    # A peer that accepts connections and never answers: the restore waits for
    # its operation budget (a second), then misses.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    backend = attach(
        engine.peer_extra_config(free_port(), "tcp,self", operation_timeout_ms=1000, get_timeout_s=3),
        pool,
    )
    keys = prompt_keys(2, salt=40)
    endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    # Arguments are prepared up front: torch releases the GIL inside some of
    # its own calls, which would let the main thread run before the call.
    extra = json.dumps({"kvcr_router_hint": fetch_hint(endpoint, keys), "request_id": "gil"})
    indices = pool.token_indices([0, 1]).tolist()
    native = backend._backend
    entered, finished, results = threading.Event(), threading.Event(), []

    def restore():
        entered.set()
        results.append(native.batch_get_v1(keys, indices, extra))
        finished.set()

    # No preemption between Python threads: the main thread can run only when
    # the worker releases the GIL itself (inside the extension) or exits.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=restore)
        worker.start()
        entered.wait()
        ran_during_call = not finished.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
        silent.close()
    assert ran_during_call, "the main thread could not run until the restore returned"
    assert results == [[False, False]]
