"""``guard_socket`` through SGLang's loader: an engine process backs pages up
into KVCR DRAM that a ``kvcr-guard`` owns and is SIGKILLed; a new engine
process on the same rank finds every page held before it backs anything up,
and restores each byte-exact (nothing copied in again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
PAGES, SEED = 8, 4242


def guard_binary():
    path = os.environ.get("KVCR_GUARD_BIN")
    if not path or not os.path.exists(path):
        pytest.fail("KVCR_GUARD_BIN must name the kvcr-guard binary (cargo xtask python sets it)")
    return path


def run_engine(socket, port, mode):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "guard_engine.py"), str(socket), str(port), mode,
         str(SEED), str(PAGES)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE,
    )


def test_a_killed_engine_comes_back_warm(tmp_path):
    socket = tmp_path / "guard.sock"
    guard = subprocess.Popen([guard_binary(), "--socket", str(socket), "--no-serve"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert guard.poll() is None, guard.stderr.read()
            assert time.monotonic() < deadline, "the guard never made its socket"
            time.sleep(0.02)
        port = free_port()
        first = run_engine(socket, port, "backup")
        line = first.stdout.readline()
        assert line, f"the first engine exited early with {first.wait(timeout=30)}"
        assert json.loads(line) == {"stored": PAGES}
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)

        second = run_engine(socket, port, "restore")
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0, out
        assert json.loads(out.strip().splitlines()[-1]) == {
            "held": PAGES, "fetched": PAGES, "equal": PAGES}
    finally:
        guard.kill()
        guard.wait(timeout=30)
