"""Does this device compute one greedy decode twice to the same bits, and if
not, which kernel switch makes it? No kvcr: the reference model alone.

For each setting (the harness's defaults, which switch cuDNN's attention off;
torch's own backend choice; SDPA pinned to one backend at a time;
cuBLAS, then cuBLASLt, as the preferred BLAS library; no reduced-precision bf16
reductions) the same
prompt's last token is run on a copy of one prefix cache and ``--steps``
tokens decoded, twice; a ``DIAG`` line per setting says which steps' logits are
bit-equal and, at the first that is not, the margins and the first module
whose output differs (``divergence.compare``). A setting the device cannot
run prints why. Diagnostics only: exits 0 unless the probe could not run.

    python determinism_probe.py --geometry qwen3-0.6b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback

import torch

import divergence
import reference_model as rm


@contextlib.contextmanager
def setting(name):
    """Enters one kernel-choosing setting, restoring the defaults after."""
    cuda = torch.backends.cuda
    if name.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa-math": SDPBackend.MATH, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[name]
        with sdpa_kernel([backend]):
            yield
    elif name in ("cublas", "cublaslt"):
        before = cuda.preferred_blas_library()
        cuda.preferred_blas_library(name)
        try:
            yield
        finally:
            cuda.preferred_blas_library(before)
    elif name == "no-reduced-precision":
        before = cuda.matmul.allow_bf16_reduced_precision_reduction
        cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            yield
        finally:
            cuda.matmul.allow_bf16_reduced_precision_reduction = before
    elif name == "torch-defaults":
        # The harness switched cuDNN's attention off
        # (reference_model.repeatable_attention): torch's own choice again.
        cuda.enable_cudnn_sdp(True)
        try:
            yield
        finally:
            rm.repeatable_attention()
    else:
        yield


SETTINGS = ["defaults", "torch-defaults", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "cublas",
            "cublaslt", "no-reduced-precision"]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="qwen3-0.6b", choices=sorted(rm.GEOMETRIES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(rm.DTYPES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--prefix-tokens", type=int,
                   help="the cached prefix (default: all but the last token, so every "
                   "forward has one query and no mask, which every SDPA backend takes)")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--settings", default=",".join(SETTINGS))
    args = p.parse_args(argv)
    if args.prefix_tokens is None:
        args.prefix_tokens = args.prompt_tokens - 1
    model = rm.ReferenceModel(args.geometry, args.seed, args.device, args.dtype)
    tokens = rm.prompt(args.seed * 1000 + 7, args.prompt_tokens,
                       rm.GEOMETRIES[args.geometry]["vocab_size"])
    _, _, cache = model.generate(tokens[:args.prefix_tokens], None, 0)
    own = model.kv_of(cache, args.prefix_tokens)
    del cache
    print(f"DIAG probe environment: {json.dumps(divergence.environment(model.device))}",
          flush=True)
    for name in args.settings.split(","):
        try:
            runs = []
            with setting(name):
                for _ in range(2):
                    trace = []
                    _, logits, _ = model.generate(tokens[args.prefix_tokens:],
                                                  model.cache_from(*own), args.steps, trace)
                    runs.append((logits, trace))
            d = divergence.compare(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
            print(f"DIAG probe {name}: the same decode twice: {divergence.describe(d)}",
                  flush=True)
        except Exception as e:  # noqa: BLE001  (a backend this device lacks: say so)
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"DIAG probe {name}: could not run ({type(e).__name__}: {first})", flush=True)
    ops = model.nondeterminism.seen
    print(f"DIAG probe ops torch ran without a deterministic implementation: "
          f"{json.dumps(ops) if ops else 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # noqa: BLE001  (could not run: report)
        traceback.print_exc()
        sys.exit(2)
