"""SGLang's HiCache storage contract, loaded from SGLang's own files.

The sglang 0.5.23 wheel cannot be installed here (its dependency set is
CUDA-only), so `setup.sh` extracts three files from it verbatim:
``srt/environ.py``, ``srt/mem_cache/hicache_storage.py`` and
``srt/mem_cache/storage/backend_factory.py``. This module executes them
unmodified under their real module names. The engine's package ``__init__``
files would import the whole engine, so empty package modules stand in for
``sglang``, ``sglang.srt``, ``sglang.srt.mem_cache`` and its ``storage``
package; nothing else is replaced. ``hicache_storage.py`` imports torch, so the
venv's real torch is used.

After :func:`load`, ``import sglang.srt.mem_cache.hicache_storage`` resolves to
SGLang's file, exactly as it does inside the engine, which is what
``kvcr_hicache.sglang`` imports.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

ENV_VAR = "KVCR_SGLANG_SRC"
HICACHE_STORAGE = "sglang.srt.mem_cache.hicache_storage"
BACKEND_FACTORY = "sglang.srt.mem_cache.storage.backend_factory"

_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.storage")
_FILES = (
    ("sglang.srt.environ", "sglang/srt/environ.py"),
    (HICACHE_STORAGE, "sglang/srt/mem_cache/hicache_storage.py"),
    (BACKEND_FACTORY, "sglang/srt/mem_cache/storage/backend_factory.py"),
)


def source_root() -> Path:
    """Where setup.sh put the extracted files."""
    default = Path(__file__).resolve().parents[3] / "target" / "py-sglang"
    root = Path(os.environ.get(ENV_VAR, default))
    missing = [rel for _, rel in _FILES if not (root / rel).is_file()]
    if missing:
        raise FileNotFoundError(
            f"SGLang's files are missing under {root}: {missing}; "
            "run kvcr-hicache-storage/python/setup.sh (cargo xtask test does)"
        )
    return root


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """Executes SGLang's files; returns (hicache_storage, backend_factory)."""
    if BACKEND_FACTORY in sys.modules:
        return sys.modules[HICACHE_STORAGE], sys.modules[BACKEND_FACTORY]
    root = source_root()
    for name in _PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
    loaded = {}
    for name, rel in _FILES:
        spec = importlib.util.spec_from_file_location(name, root / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)
        loaded[name] = module
    return loaded[HICACHE_STORAGE], loaded[BACKEND_FACTORY]
