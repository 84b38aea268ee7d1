//! Placement of the runner's pools and UCX split sizing: option builders
//! over the runner's off-by-default hooks, and the audit of a running
//! runner.
//!
//! The memory itself is mapped, advised, bound and pre-faulted inside the
//! runner (`kvcr_foundation::runner::PoolMemory`), because a NUMA policy must
//! be set before the first touch and the first touch is the runner's
//! pre-fault. This crate decides *what* to ask for and checks what was given.

use kvcr_foundation::runner::Runner;
pub use kvcr_foundation::runner::{
    AnonymousMemory, HugePages, NumaBinding, NumaMode, PlacementDowngrade, PlacementOutcome,
    PoolMemory, PutSplit, online_nodes, transparent_huge_page_mode,
};

use crate::audit::{PoolAudit, audit};
use crate::error::Result;

/// Process-owned anonymous memory with `huge_pages`, unbound.
pub fn anonymous(huge_pages: HugePages) -> PoolMemory {
    PoolMemory::Anonymous(AnonymousMemory {
        huge_pages,
        numa: None,
    })
}

/// Process-owned anonymous memory with `huge_pages`, bound to `node`.
pub fn anonymous_on_node(huge_pages: HugePages, node: u16) -> PoolMemory {
    PoolMemory::Anonymous(AnonymousMemory {
        huge_pages,
        numa: Some(NumaBinding {
            mode: NumaMode::Bind,
            nodes: vec![node],
        }),
    })
}

/// Audits every pool of `runner` (at most `max_samples` pages each).
pub fn audit_runner(runner: &Runner, max_samples: u64) -> Result<Vec<PoolAudit>> {
    runner
        .pools()
        .memory()
        .iter()
        .map(|info| audit(info, max_samples))
        .collect()
}

/// Chunk size for split puts when the transports include tcp: the runner's
/// own tcp default ([`PutSplit::TCP_DEFAULT`], 128 KiB; 4 MiB chunks moved
/// 2.1–2.6 GB/s where 128 KiB ones moved 2.9–3.2).
pub const TCP_CHUNK_BYTES: u64 = PutSplit::TCP_DEFAULT.chunk_bytes;
/// Chunk size for split puts over shared memory.
pub const SHM_CHUNK_BYTES: u64 = 4 << 20;

/// Split sizing for the transports in `ucx_tls` (`None`: UCX chooses, which
/// may be tcp, so the tcp values apply).
pub fn split_for(ucx_tls: Option<&str>) -> PutSplit {
    let tcp = ucx_tls.is_none_or(|t| t.split(',').any(|t| t.trim() == "tcp"));
    if tcp {
        PutSplit {
            chunk_bytes: TCP_CHUNK_BYTES,
            max_chunks_in_flight: PutSplit::TCP_DEFAULT.max_chunks_in_flight,
        }
    } else {
        PutSplit {
            chunk_bytes: SHM_CHUNK_BYTES,
            max_chunks_in_flight: PutSplit::SHM_IN_FLIGHT,
        }
    }
}
