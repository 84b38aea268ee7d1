#!/usr/bin/env bash
# Installs what the Python face's tests need, only if it is missing
# (idempotent; a second run is a few imports and three checksums):
#   * a venv with PyPI torch (sglang 0.5.23 pins 2.14.1; PyPI's Linux wheel pulls
#     the CUDA libraries, ~2.9 GB, but imports and runs on a CPU-only machine),
#     numpy, maturin and pytest, and transformers (its Qwen3 is the real-model
#     e2e's engine; ~15 s, tens of MB with its dependencies);
#   * three files of SGLang 0.5.23, extracted verbatim from its wheel (fetched with
#     `pip download --no-deps` to a temporary folder and deleted; the wheel's own
#     dependency set is CUDA-only): srt/environ.py, srt/mem_cache/hicache_storage.py
#     and srt/mem_cache/storage/backend_factory.py. Tests load them unmodified.
# The venv is $KVCR_PY_VENV (default <workspace>/target/py-venv), the SGLang files
# go to $KVCR_SGLANG_SRC (default <workspace>/target/py-sglang). Needs python3 with
# venv, and PyPI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${KVCR_PY_VENV:-$root/target/py-venv}"
src="${KVCR_SGLANG_SRC:-$root/target/py-sglang}"
py="$venv/bin/python"

# What the tests import, pinned.
packages=(torch==2.14.1 numpy==2.4.6 maturin==1.9.6 pytest==8.4.2 transformers==5.25.0)
# sha256 of the three files inside sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl.
sglang_files=(
    "967ede87488967cf87a95f8c38ccd72a3a0055a03cbdac303b38c2322b987c55  sglang/srt/environ.py"
    "96b044b88f5f8dace5beb5a773caddc57596dedbc086b7b1f1b78264685d67ed  sglang/srt/mem_cache/hicache_storage.py"
    "552eae7bbabaae30e8495994e81662c7ebc0275feb84628930c071e1e41a1811  sglang/srt/mem_cache/storage/backend_factory.py"
)

venv_ready() {
    [ -x "$py" ] && "$py" - "${packages[@]}" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
import torch, maturin, pytest  # noqa: F401  (import, not only metadata)
from transformers import Qwen3ForCausalLM  # noqa: F401
PY
}

sglang_ready() {
    local line
    for line in "${sglang_files[@]}"; do
        (cd "$src" 2>/dev/null && echo "$line" | sha256sum -c --status) || return 1
    done
}

if venv_ready && sglang_ready; then
    echo "py-setup: ready ($venv, $src)"
    exit 0
fi

start=$(date +%s)
if ! venv_ready; then
    [ -x "$py" ] || python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "${packages[@]}"
fi

if ! sglang_ready; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
        sglang==0.5.23 -d "$tmp"
    rm -rf "$src"
    mkdir -p "$src"
    "$py" - "$tmp" "$src" "${sglang_files[@]}" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/sglang-0.5.23-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    for line in sys.argv[3:]:
        member = line.split()[1]
        out = os.path.join(sys.argv[2], member)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(z.read(member))
PY
    sglang_ready || { echo "py-setup: SGLang file checksum mismatch" >&2; exit 1; }
fi

venv_ready || { echo "py-setup: install finished but the venv does not import" >&2; exit 1; }
echo "py-setup: installed in $(( $(date +%s) - start )) s ($venv, $src)"
