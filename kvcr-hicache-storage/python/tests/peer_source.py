"""A source engine rank in its own process (the two-process test starts it).

It attaches kvcr through SGLang's loader in peer mode, fills host pages with
reproducible bytes, backs them up through ``batch_set_v1`` like SGLang's
controller, prints one JSON line (its control endpoint and what it stored),
then serves peers until its stdin closes or says ``quit``.

    python peer_source.py PORT TLS SEED PROMPT:PAGES[:STORED] ...
"""

from __future__ import annotations

import json
import sys

import engine
from host_pool import MhaHostPool


def main(argv):
    port, tls, seed = int(argv[0]), argv[1], int(argv[2])
    prompts = []
    for spec in argv[3:]:
        salt, pages, *stored = (int(x) for x in spec.split(":"))
        prompts.append((salt, pages, stored[0] if stored else pages))
    total = sum(stored for _, _, stored in prompts)
    pool = MhaHostPool(pages=max(total, 1), **engine.GEOMETRY)
    backend = engine.attach(engine.peer_extra_config(port, tls), pool)
    ctl = engine.Controller(backend, pool, interface_v1=True)
    report = {"endpoint": backend.endpoint, "stored": {}}
    first = 0
    for salt, pages, stored in prompts:
        keys = engine.prompt_keys(pages, salt)[:stored]
        host = list(range(first, first + stored))
        pool.fill_pages(host, seed=seed + salt)
        report["stored"][str(salt)] = ctl.backup(keys, pool.token_indices(host))
        first += stored
    print(json.dumps(report), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
