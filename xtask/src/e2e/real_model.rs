//! `real-model`: two reference engines running a real transformer
//! (`transformers`' Qwen3 with random weights from a fixed seed, a small
//! geometry on the CPU) with kvcr as their HiCache L3 backend, at TP=1 and
//! TP=2, Dynamo's indexer giving the router hint; then the same model over
//! `kvcr_direct` (mode B) on a host pool: fillers evict two prompts from the
//! engine's pool, the replays restore from KVCR DRAM, a peer process restores
//! one on a hint. All real processes.
//!
//! The scenario is the Python harness `xtask/harness/real_model.py` (its
//! docstring lists the checks: ids equal cold inference, restored bytes equal
//! the source's, logits equal a control's and cold inference's bit for bit,
//! the control repeating to the bit, zeroed and shuffled pages failing that
//! check; `DIAG` lines say where two runs part). It runs the way
//! `hicache-dynamo` runs its
//! orchestrator ([`super::hicache_dynamo::orchestrate`]): the Python face's
//! venv (with `transformers`, pinned in the face's `setup.sh`), a fresh wheel,
//! a network namespace holding only loopback for the indexer.
//!
//! The harness sits in xtask, above both modes: the GPU host's mode B harness
//! shares its model code (`reference_model.py`), and neither slice may depend
//! on the other.

use std::ffi::OsString;

use anyhow::Result;

use super::{Ctx, Outcome};

/// The harness, relative to the workspace root.
const SCRIPT: &str = "xtask/harness/real_model.py";

pub(super) fn run(ctx: &Ctx) -> Result<Outcome> {
    let root = crate::workspace_root();
    let args = [
        OsString::from("--indexer-python"),
        root.join(super::hicache_dynamo::INDEXER_PYTHON)
            .into_os_string(),
        OsString::from("--log-dir"),
        ctx.logs.clone().into_os_string(),
        // Then mode B on a host pool (`kvcr_direct`'s `host=True`).
        OsString::from("--mode-b"),
    ];
    super::hicache_dynamo::orchestrate(ctx, "real-model", SCRIPT, &args)
}
