#!/usr/bin/env bash
# Installs the real third-party KV-event clients the publisher tests run against,
# only if they are missing (idempotent; a second run is a few imports):
#   * Dynamo's standalone KV indexer: ai-dynamo-runtime 1.6.1 (`python -m dynamo.indexer`);
#   * vLLM 0.33.0's own vllm/distributed/kv_events.py, extracted verbatim from the
#     wheel (the wheel is downloaded to a temporary folder and deleted), loaded by
#     vllm_kv_events_shim.py with only msgspec and pyzmq.
# Everything lands in $KVCR_REALCLIENTS_DIR (default: <workspace>/target/realclients).
# Needs python3 (with venv) and access to PyPI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
dir="${KVCR_REALCLIENTS_DIR:-$root/target/realclients}"
venv="$dir/venv"
kv_events="$dir/vllm/kv_events.py"
# sha256 of vllm-0.33.0's vllm/distributed/kv_events.py (20,229 bytes).
kv_events_sha256="82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee"
py="$venv/bin/python"

ready() {
    [ -x "$py" ] \
        && "$py" -c 'import dynamo.llm, msgspec, zmq' >/dev/null 2>&1 \
        && [ -f "$kv_events" ] \
        && echo "$kv_events_sha256  $kv_events" | sha256sum -c --status
}

if ready; then
    echo "realclients: ready in $dir"
    exit 0
fi

mkdir -p "$dir"
if [ ! -x "$py" ]; then
    python3 -m venv "$venv"
fi
"$py" -m pip install -q --disable-pip-version-check \
    ai-dynamo-runtime==1.6.1 msgspec==0.22.0 pyzmq==27.3.0

if [ ! -f "$kv_events" ] || ! echo "$kv_events_sha256  $kv_events" | sha256sum -c --status; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
        vllm==0.33.0 -d "$tmp"
    mkdir -p "$dir/vllm"
    "$py" - "$tmp" "$kv_events" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/vllm-0.33.0-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("vllm/distributed/kv_events.py"))
PY
    echo "$kv_events_sha256  $kv_events" | sha256sum -c --status \
        || { echo "realclients: kv_events.py checksum mismatch" >&2; exit 1; }
fi

ready || { echo "realclients: install finished but the clients do not import" >&2; exit 1; }
echo "realclients: installed in $dir"
