"""Where two greedy decodes that should compute the same bits part.

A run's *trace* holds, per forward (0: the prefill chunk, i: decode step i),
per layer, the SHA-256 of the K and V that forward appended to the cache, and
the SHA-256 of every module's output in the order the modules finished.
``compare`` takes two runs' logits ([steps, vocab], float32) and traces and
says which steps are bit-equal, and at the first step that is not: the largest
logit difference, each run's top-1/top-2 ids and margin (a margin within the
difference is a near tie that a one-ulp change flips), the first step whose ids
differ, the first (forward, layer) whose appended K or V differ, and the
first module (a projection's GEMM, the attention, a norm) whose output
differs: where the two computations part.

Also ``environment`` (the versions and switches that choose the kernels) and
``Nondeterminism``, which records the ops torch warned have no deterministic
implementation (``use_deterministic_algorithms(True, warn_only=True)`` runs
them anyway).
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch


def tensor_digest(t):
    """SHA-256 of a tensor's bytes (any dtype, any strides)."""
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def record_forward(trace, cache, layer_kv, layers, start, ops=None):
    """Appends to ``trace`` one forward's record: the digests of what it
    added to ``cache`` (positions ``start`` on) in each layer, and ``ops``
    (an ``OpTrace``'s (module, digest) list, in the order modules finished)."""
    if trace is None:
        return
    kv = []
    for layer in range(layers):
        k, v = layer_kv(cache, layer)
        kv.append((tensor_digest(k[:, :, start:]), tensor_digest(v[:, :, start:])))
    trace.append({"kv": kv, "ops": ops})


class OpTrace:
    """Forward hooks on every submodule of a model; while ``active`` is a
    list, each submodule's output digest goes into it as (name, digest), in
    the order the modules finish: the first entry two runs disagree on names
    the op whose output parted first."""

    def __init__(self, model):
        self.active = None
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(self._hook(name))
            if name.endswith("self_attn.o_proj"):
                # Its input is the attention's output: SDPA apart from the GEMM.
                module.register_forward_pre_hook(self._attention(name.removesuffix(".o_proj")))

    def _attention(self, name):
        def hook(_module, inputs):
            if self.active is not None:
                self.active.append((f"{name} (attention)", tensor_digest(inputs[0])))
        return hook

    def _hook(self, name):
        def hook(_module, _inputs, output):
            if self.active is None:
                return
            first = output[0] if isinstance(output, tuple) and output else output
            if isinstance(first, torch.Tensor):
                self.active.append((name, tensor_digest(first)))
        return hook

def top2(row):
    """(top-1 id, top-2 id, top-1 minus top-2) of one logits row."""
    values, ids = torch.topk(row.float(), 2)
    return int(ids[0]), int(ids[1]), float(values[0] - values[1])


def compare(a_logits, b_logits, a_trace=None, b_trace=None):
    """How two runs' per-step logits (and traces) compare; a plain dict."""
    steps = min(len(a_logits), len(b_logits))
    equal = [bool(torch.equal(a_logits[i], b_logits[i])) for i in range(steps)]
    out = {"steps": "".join("=" if e else "x" for e in equal), "first": None}
    a_ids = [int(torch.argmax(r)) for r in a_logits[:steps]]
    b_ids = [int(torch.argmax(r)) for r in b_logits[:steps]]
    out["first_ids"] = next((i for i in range(steps) if a_ids[i] != b_ids[i]), None)
    if False in equal:
        i = equal.index(False)
        diff = (a_logits[i].float() - b_logits[i].float()).abs()
        out["first"] = i
        out["max_diff"] = float(torch.nan_to_num(diff, nan=float("inf")).max())
        out["a_top2"] = top2(a_logits[i])
        out["b_top2"] = top2(b_logits[i])
    if a_trace is not None and b_trace is not None:
        out["kv_first"] = None
        out["op_first"] = None
        for f, (sa, sb) in enumerate(zip(a_trace, b_trace)):
            layer = next((n for n, (x, y) in enumerate(zip(sa["kv"], sb["kv"])) if x != y),
                         None)
            if layer is not None and out["kv_first"] is None:
                which = "K" if sa["kv"][layer][0] != sb["kv"][layer][0] else "V"
                out["kv_first"] = [f, layer, which]
            if out["op_first"] is None and sa["ops"] is not None and sb["ops"] is not None:
                op = next((x[0] if x[0] == y[0] else f"{x[0]} / {y[0]}"
                           for x, y in zip(sa["ops"], sb["ops"]) if x != y), None)
                if op is not None:
                    out["op_first"] = [f, op]
        out["kv_forwards"] = min(len(a_trace), len(b_trace))
    return out


def describe(d):
    """One line for a ``compare`` result."""
    text = f"steps {d['steps']}"
    if d["first"] is None:
        text += ": every step's logits bit-equal"
    else:
        a, b = d["a_top2"], d["b_top2"]
        tie = d["max_diff"] >= min(a[2], b[2])
        text += (f"; first differing step {d['first']}: max diff {d['max_diff']:g}, "
                 f"top-1/top-2 {a[0]}/{a[1]} margin {a[2]:g} vs {b[0]}/{b[1]} margin {b[2]:g}"
                 f" ({'a near tie' if tie else 'not a near tie'})")
    text += f"; ids first differ at {d['first_ids']}"
    if "kv_first" in d:
        kv = d["kv_first"]
        text += ("; appended KV bit-equal in every layer of every forward" if kv is None else
                 f"; appended KV first differs at forward {kv[0]} (0 = prefill) layer {kv[1]} "
                 f"({kv[2]})")
    if "op_first" in d:
        op = d["op_first"]
        text += ("; every module's output bit-equal" if op is None else
                 f"; first module whose output differs: forward {op[0]} {op[1]}")
    return text


class Nondeterminism:
    """Collects torch's "no deterministic implementation" warnings raised
    inside ``with recorder:`` blocks (the messages, each once)."""

    def __init__(self):
        self.seen = []
        self._catch = None

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self._log = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        log = self._log
        self._catch.__exit__(*exc)
        for w in log:
            text = str(w.message)
            if "determinis" in text and text not in self.seen:
                self.seen.append(text)
        return False


def environment(device):
    """The versions and switches that decide which kernels run."""
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda,
           "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "deterministic": torch.are_deterministic_algorithms_enabled(),
           "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
           "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
           "bf16_reduced_precision_reduction":
               torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}
    if torch.device(device).type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device),
                   sms=torch.cuda.get_device_properties(device).multi_processor_count)
        for name in ("flash", "mem_efficient", "math", "cudnn"):
            enabled = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
            env[f"sdpa_{name}"] = enabled() if enabled is not None else None
    return env
