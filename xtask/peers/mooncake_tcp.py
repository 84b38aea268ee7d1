"""kvcr's driver for Mooncake's transfer engine (mooncake-transfer-engine-non-cuda
0.3.13.post1), TCP transport, two processes on loopback.

`cargo xtask bench --peers` runs it in its own venv. The server process
registers a host buffer and prints its RPC port and the buffer's address; this
process (the client) then, for each size of 64 KiB, 1 MiB and 16 MiB, times
synchronous one-request writes into the server's buffer and reads back out of
it, checks that the bytes read back equal the bytes written, and prints

    BENCH peers.mooncake.<write|read>_<size>_tcp value=<GB/s> unit=GB/s ...

where GB/s is the transfer size over the median per-request time (the same
definition as kvcr's `peer.request_<size>_tcp`).

With `--blocks`, it runs the same transfers in blocks on command instead, so
that `cargo xtask bench --peers` can alternate them with kvcr's: after the
warm-up it prints `READY`, then for each line `<label> <count>` on stdin it
runs `count` write-then-read pairs of that size (bytes checked) and prints

    SAMPLES <label> write=<us>,<us>,... read=<us>,<us>,...

until stdin closes.
"""

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np
from mooncake.engine import TransferEngine

SIZES = [("64kib", 64 << 10), ("1mib", 1 << 20), ("16mib", 16 << 20)]
SPAN = 16 << 20


def engine():
    te = TransferEngine()
    # P2P handshake: no metadata server; peers are named host:rpc_port.
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize failed: {rc}")
    return te


def register(te, buf):
    rc = te.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"register_memory failed: {rc}")


def server():
    te = engine()
    buf = np.zeros(SPAN, dtype=np.uint8)
    register(te, buf)
    print(f"SERVER {te.get_rpc_port()} {buf.ctypes.data}", flush=True)
    sys.stdin.readline()  # serve until the client closes stdin



def write_then_read(te, target, remote, out, back, size):
    """One synchronous write of `size` bytes into the server's buffer and
    one read of them back, the read checked; returns both times (seconds)."""
    start = time.perf_counter()
    if te.transfer_sync_write(target, out.ctypes.data, remote, size) < 0:
        raise RuntimeError(f"transfer_sync_write {size} failed")
    w = time.perf_counter() - start
    back[:size] = 0
    start = time.perf_counter()
    if te.transfer_sync_read(target, back.ctypes.data, remote, size) < 0:
        raise RuntimeError(f"transfer_sync_read {size} failed")
    r = time.perf_counter() - start
    if not np.array_equal(back[:size], out[:size]):
        raise RuntimeError(f"{size} bytes read back differ from those written")
    return w, r


def serve_blocks(te, target, remote, out, back):
    sizes = dict(SIZES)
    for size in sizes.values():  # two pairs per size warm the connection up
        for _ in range(2):
            write_then_read(te, target, remote, out, back, size)
    print("READY", flush=True)
    for line in sys.stdin:
        label, count = line.split()
        size = sizes[label]
        writes, reads = [], []
        for _ in range(int(count)):
            w, r = write_then_read(te, target, remote, out, back, size)
            writes.append(f"{w * 1e6:.1f}")
            reads.append(f"{r * 1e6:.1f}")
        print(f"SAMPLES {label} write={','.join(writes)} read={','.join(reads)}", flush=True)


def client(quick, blocks):
    child = subprocess.Popen(
        [sys.executable, __file__, "--server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:
            if line.startswith("SERVER "):
                break
        else:
            raise RuntimeError("the server exited before printing its address")
        _, port, remote = line.split()
        target, remote = f"127.0.0.1:{port}", int(remote)
        te = engine()
        out = np.random.default_rng(3).integers(0, 256, size=SPAN, dtype=np.uint8)
        back = np.zeros(SPAN, dtype=np.uint8)
        register(te, out)
        register(te, back)
        if blocks:
            serve_blocks(te, target, remote, out, back)
            return
        for label, size in SIZES:
            iters = {"64kib": 300, "1mib": 100, "16mib": 12}[label]
            if not quick:
                iters *= 3
            writes, reads = [], []
            for i in range(iters + 2):  # the first two warm the connection up
                w, r = write_then_read(te, target, remote, out, back, size)
                if i >= 2:
                    writes.append(w)
                    reads.append(r)
            for name, samples in (("write", writes), ("read", reads)):
                med = statistics.median(samples)
                print(
                    f"BENCH peers.mooncake.{name}_{label}_tcp value={size / med / 1e9:.3f} "
                    f"unit=GB/s median_us={med * 1e6:.1f} "
                    f"min={size / max(samples) / 1e9:.3f} max={size / min(samples) / 1e9:.3f} "
                    f"runs={len(samples)}",
                    flush=True,
                )
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--server", action="store_true")
    parser.add_argument("--blocks", action="store_true")
    args = parser.parse_args()
    if args.server:
        server()
    else:
        client(args.quick, args.blocks)


if __name__ == "__main__":
    main()
