"""An engine rank under a ``kvcr-guard``, in its own process (the guard test
starts it twice: once to back pages up and be SIGKILLed, once to restore).

    python guard_engine.py SOCKET PORT backup|restore SEED PAGES

``backup`` fills host pages with reproducible bytes, backs them up through
``batch_set_v1``, prints one JSON line and waits to be killed. ``restore``
attaches on the same group with its host pool zeroed, asks how many pages
kvcr holds (before backing anything up), prefetches them and prints whether
every byte equals what the first process backed up.
"""

from __future__ import annotations

import json
import sys

import torch

import engine
from host_pool import MhaHostPool

SALT = 70


def main(argv):
    socket, port, mode, seed, pages = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    pool = MhaHostPool(pages=2 * pages, **engine.GEOMETRY)
    extra = engine.peer_extra_config(port, "tcp,self", guard_socket=socket,
                                     guard_journal_bytes=1 << 20)
    backend = engine.attach(extra, pool)
    ctl = engine.Controller(backend, pool, interface_v1=True)
    keys = engine.prompt_keys(pages, SALT)
    if mode == "backup":
        pool.fill_pages(range(pages), seed=seed)
        stored = ctl.backup(keys, pool.token_indices(range(pages)))
        print(json.dumps({"stored": stored}), flush=True)
        sys.stdin.readline()  # killed before this returns
        return 0
    # The bytes the first process backed up, from the same generator.
    expected = MhaHostPool(pages=pages, **engine.GEOMETRY)
    expected.fill_pages(range(pages), seed=seed)
    held = ctl.hit_query(keys)
    fetched = ctl.prefetch(keys, pool.token_indices(range(pages, 2 * pages)))
    equal = [torch.equal(pool.page_bytes_of(pages + p), expected.page_bytes_of(p))
             for p in range(pages)]
    print(json.dumps({"held": held, "fetched": fetched, "equal": sum(equal)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
