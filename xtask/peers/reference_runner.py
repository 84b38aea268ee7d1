"""kvcr's driver for the reference Python KV Cache Runner (kvcr 0.1.1 on PyPI).

`cargo xtask bench --peers` runs it in its own venv. It measures the
reference runner on the same workloads as kvcr's benches and prints one
`BENCH peers.reference.<figure> value=<median> unit=<unit>` line per figure:

* local deposit / deliver of 512 x 256 KiB blocks (GB/s; delivered bytes
  checked against the deposited ones);
* one-block (256 KiB) deposit -> completion latency (us);
* peer fetch: a second process holds the blocks; this one submits a router
  hint, fetches 256 x 256 KiB into its own pool, then delivers them locally
  and checks every byte (GB/s);
* one-block peer fetch latency, hint -> fetch -> completion (us);

the two peer figures twice: with UCX's default transports (`_default`: shared
memory between the two processes when the host allows it) and with
`UCX_TLS=tcp,self` (`_tcp`).

Loopback only: the control channel binds 127.0.0.1, and the caller pins UCX to
the `lo` device. The main thread polls with a short sleep, as an engine's
scheduler loop would (the runner's progress thread needs the GIL).
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import MemoryRef, RegionDescriptor

BLOCK = 256 << 10
POOL = "kv"


class IntKeys:
    """Keys are 8-byte little-endian integers; the router hash is the integer."""

    def encode(self, framework_key):
        return int(framework_key).to_bytes(8, "little")

    def decode(self, key):
        return int.from_bytes(key, "little")


def key(i):
    return int(i).to_bytes(8, "little")


def free_ports(n):
    """`n` distinct free loopback ports: all bound at once, so the kernel
    cannot hand the same one out twice (one port given to both the control
    channel and NIXL's listener failed a bench run: address in use)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_instance(name, slots, elements, peer, attempts=3):
    """An `Instance`, tried again on fresh ports when one was taken between
    choosing it and binding it (another process may take a free port)."""
    for attempt in range(attempts):
        try:
            return Instance(name, slots, elements, peer)
        except Exception as exc:  # KVCRStartupError, or the channel's OSError
            if "Address already in use" not in str(exc) or attempt + 1 == attempts:
                raise


class Instance:
    """One reference runner with a KVCR pool of `slots` blocks and one framework
    region of `elements` blocks (numpy buffers it owns for its lifetime)."""

    def __init__(self, name, slots, elements, peer):
        self.name = name
        self.pool = np.zeros(slots * BLOCK, dtype=np.uint8)
        self.host = np.zeros(elements * BLOCK, dtype=np.uint8)
        self.channel = None
        channel_port, nixl_port = free_ports(2)
        if peer:
            self.channel = ZmqPeerControlChannel("127.0.0.1", channel_port, "127.0.0.1")
        bindings = KVCRBindings(
            # No framework-held (FW_G2) blocks here: every block a peer asks
            # for is in the runner's own DRAM, so pins are never needed.
            request_pin=lambda keys: 0,
            poll_pin_results=lambda: [],
            release_pin=lambda handle: True,
            framework_control=self.channel,
            key_adapter=IntKeys(),
        )
        config = KVCRConfig(
            nixl_agent_name=name,
            pool_layouts=[(POOL, BLOCK)],
            operation_timeout_ms=60_000,
            abandon_timeout_ms=120_000,
            nixl_listen_port=nixl_port,
        )
        backends = KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(
                    addr=self.host.ctypes.data, size=BLOCK, count=elements, label=POOL
                )
            ],
            local_dram=LocalDramOptions(pools=[(POOL, self.pool.ctypes.data, self.pool.nbytes)]),
        )
        self.kvcr = KVCR(config, bindings, backends)
        self.done = {}

    @property
    def endpoint(self):
        return self.channel.endpoint

    def ref(self, element):
        return [MemoryRef(end_point_name=self.name, label=POOL, element_index=element)]

    def wait(self, op):
        while op not in self.done:
            for handle, entries in self.kvcr.poll_completed():
                self.done[handle] = entries
            if op not in self.done:
                time.sleep(20e-6)
        entries = self.done.pop(op)
        failed = [k for k, e in entries.items() if not e.success]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(entries)} entries failed")
        return entries

    def close(self):
        self.kvcr.close()


def fill(buf, seed):
    rng = np.random.default_rng(seed)
    buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)


def gbps(nbytes, secs):
    return nbytes / secs / 1e9


def bench(name, values, unit):
    print(f"BENCH peers.reference.{name} value={statistics.median(values):.3f} unit={unit} "
          f"min={min(values):.3f} max={max(values):.3f} runs={len(values)}", flush=True)


def dist(name, samples):
    """The distribution for the report's latency plot, in kvcr's format:
    `DIST <name> unit=us p0=.. p5=.. ... p100=..` (nearest rank)."""
    ordered = sorted(samples)
    points = " ".join(
        f"p{p}={ordered[round((len(ordered) - 1) * p / 100)]:.2f}" for p in range(0, 101, 5)
    )
    print(f"DIST peers.reference.{name} unit=us {points}", flush=True)


def local(quick):
    n = 512
    reps = 5 if quick else 9
    inst = start_instance("ref-local", n, 2 * n, peer=False)
    try:
        fill(inst.host[: n * BLOCK], 1)
        deposit, deliver = [], []
        for rep in range(reps):
            base = rep * n
            start = time.perf_counter()
            op = inst.kvcr.deposit({key(base + i): inst.ref(i) for i in range(n)})
            inst.wait(op)
            deposit.append(gbps(n * BLOCK, time.perf_counter() - start))
            inst.host[n * BLOCK :] = 0
            start = time.perf_counter()
            op = inst.kvcr.deliver({key(base + i): inst.ref(n + i) for i in range(n)})
            inst.wait(op)
            deliver.append(gbps(n * BLOCK, time.perf_counter() - start))
            if not np.array_equal(inst.host[: n * BLOCK], inst.host[n * BLOCK :]):
                raise RuntimeError("local deliver: bytes differ from the deposited ones")
        bench("deposit_256kib", deposit, "GB/s")
        bench("deliver_256kib", deliver, "GB/s")
        lat = []
        for i in range(50 if quick else 200):
            start = time.perf_counter()
            inst.wait(inst.kvcr.deposit({key(10**9 + i): inst.ref(i % n)}))
            lat.append((time.perf_counter() - start) * 1e6)
        bench("one_block_deposit_p50", lat, "us")
        dist("one_block_deposit", lat)
    finally:
        inst.close()


def source(blocks):
    """Holds `blocks` blocks (pattern seeded by the key range) until stdin closes."""
    inst = start_instance(f"ref-source-{os.getpid()}", blocks, blocks, peer=True)
    try:
        fill(inst.host, 2)
        inst.wait(inst.kvcr.deposit({key(i): inst.ref(i) for i in range(blocks)}))
        print(f"ENDPOINT {inst.endpoint}", flush=True)
        # Serve: the progress thread answers peers; completions need polling.
        import select

        while True:
            ready, _, _ = select.select([sys.stdin], [], [], 0.001)
            if ready and not sys.stdin.readline():
                break
            inst.kvcr.poll_completed()
    finally:
        inst.close()


def hint(endpoint, keys):
    return {
        "protocol_version": "0.1",
        "actions": [
            {
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": endpoint,
                    "block_hashes": [int.from_bytes(k, "little") for k in keys],
                    "mode": "copy",
                },
            }
        ],
    }


def peer(quick, tls, suffix):
    """Peer fetch with UCX's transports `tls` (None: UCX's own choice, which
    includes shared memory between two processes on one host)."""
    if tls is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = tls  # read when NIXL creates its UCX context
    n = 256
    reps = 3 if quick else 7
    singles = 30 if quick else 100
    total = n * (reps + 1) + singles + 1
    expected = np.zeros(total * BLOCK, dtype=np.uint8)
    fill(expected, 2)
    child = subprocess.Popen(
        [sys.executable, __file__, "--source", str(total)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    target = None
    try:
        # NIXL logs to stdout too: skip to the endpoint line.
        for line in child.stdout:
            if line.startswith("ENDPOINT "):
                break
        else:
            raise RuntimeError("the source exited before printing its endpoint")
        endpoint = line.split()[1]
        # Keep draining the source's stdout (NIXL logs there) so it never
        # blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in child.stdout], daemon=True).start()
        target = start_instance(f"ref-target-{suffix}", n, n, peer=True)
        request = 0

        def fetch(first, count, check):
            nonlocal request
            request += 1
            rid = f"r{request}"
            keys = [key(first + i) for i in range(count)]
            target.kvcr.submit_hint(hint(endpoint, keys), request_id=rid)
            start = time.perf_counter()
            entries = target.wait(target.kvcr.fetch(keys, request_id=rid, expected_layout=[POOL]))
            secs = time.perf_counter() - start
            if check:
                target.host[:] = 0
                target.wait(target.kvcr.deliver({k: target.ref(i) for i, k in enumerate(keys)}))
                want = expected[first * BLOCK : (first + count) * BLOCK]
                if not np.array_equal(target.host[: count * BLOCK], want):
                    raise RuntimeError("peer fetch: bytes differ from the source's")
            target.kvcr.release([e.release_handle for e in entries.values()])
            target.kvcr.discard_hint(rid)
            return secs

        fetch(0, n, True)  # warm-up: NIXL metadata exchange, not counted
        fetched = [gbps(n * BLOCK, fetch(n * (r + 1), n, True)) for r in range(reps)]
        bench(f"peer_fetch_256kib_{suffix}", fetched, "GB/s")
        first = n * (reps + 1)
        lat = [fetch(first + i, 1, False) * 1e6 for i in range(singles)]
        bench(f"peer_one_block_{suffix}_p50", lat, "us")
        dist(f"peer_one_block_{suffix}", lat)
    finally:
        if target is not None:
            target.close()
        child.stdin.close()
        child.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--source", type=int)
    args = parser.parse_args()
    if args.source is not None:
        source(args.source)
    else:
        local(args.quick)
        peer(args.quick, None, "default")
        peer(args.quick, "tcp,self", "tcp")
    # Every runner is closed by now. Skip the interpreter's teardown: with
    # kvcr 0.1.1 / NIXL 1.5.0 here it segfaults in native code after
    # everything above finished (seen in a network namespace holding only lo).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
