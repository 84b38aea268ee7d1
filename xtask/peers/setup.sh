#!/usr/bin/env bash
# Installs the peer systems `cargo xtask bench --peers` measures beside kvcr,
# only if they are missing (idempotent; a second run is two imports):
#   * the reference Python KV Cache Runner, kvcr 0.1.1 (it brings NIXL with a
#     bundled UCX, and torch as a dependency: about 6 GB, a few minutes once);
#   * Mooncake's transfer engine without CUDA, 0.3.13.post1 (a few MB).
# Each gets its own venv under $1 (default: <workspace>/target/peers-venv), so
# their pins never meet. Needs python3 (with venv) and access to PyPI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${1:-$root/target/peers-venv}"
mkdir -p "$dir"

install() { # venv-name import-check package...
    local venv="$dir/$1" check="$2"
    shift 2
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
        echo "peers: $(basename "$venv") ready"
        return
    fi
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    echo "peers: installing $* into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
    "$venv/bin/python" -c "$check" \
        || { echo "peers: $* installed but does not import" >&2; exit 1; }
}

install reference 'import kvcr, numpy' kvcr==0.1.1 numpy==2.4.6
install mooncake 'from mooncake.engine import TransferEngine; import numpy' \
    mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy==2.4.6
