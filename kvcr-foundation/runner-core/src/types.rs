//! What goes into the core and comes out of it: pool and claim ids, the
//! entries of a call, per-key results and statistics. The runner re-exports
//! all of these; they live here so the core names its own inputs and outputs.

use kvcr_contracts::key::{BlockKey, ScopedKey};
use kvcr_contracts::protocol::{ElementRef, OpHandle};
use kvcr_contracts::tier::Tier;

use crate::machine::CoreCounters;

/// Index of a configured pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u16);

/// A public claim on a resident page (from `fetch` or a `no_evict` deposit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReleaseHandle(pub u64);

/// One KVCR DRAM pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// The pool's name; framework regions are labelled `name` or `name:part`.
    pub name: String,
    /// Bytes per block (one slot holds one span of one page).
    pub block_size: u64,
    /// Number of blocks.
    pub blocks: u32,
}

/// A deposit entry: a key and the framework elements holding its spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepositEntry {
    /// The page.
    pub key: ScopedKey,
    /// Its spans, in layout order.
    pub spans: Vec<ElementRef>,
    /// What to publish when it is stored (tokens and parent for KV events).
    pub page: Option<PageInfo>,
}

/// What inventory events need to know about a page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageInfo {
    /// The key of the page before it in the request, if any.
    pub parent: Option<BlockKey>,
    /// The page's real tokens.
    pub token_ids: Vec<u32>,
}

/// A deliver entry: a key and the framework elements to copy it into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliverEntry {
    /// The page.
    pub key: ScopedKey,
    /// Destination elements, in layout order.
    pub destinations: Vec<ElementRef>,
}

/// `query`'s answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryStatus {
    /// READY in KVCR DRAM.
    Hit,
    /// Being filled into KVCR DRAM.
    Fetching,
    /// Not here, but a source for it is known (a hinted peer).
    Fetchable(Tier),
    /// Not known.
    Miss,
}

/// Why a key failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailReason {
    /// The stored layout differs from the one asked for.
    LayoutMismatch,
    /// The residency is being discarded.
    Discarding,
    /// No resident copy and no source for one.
    NoSource,
    /// No slots, even after evicting every evictable page.
    CapacityExhausted,
    /// The operation's deadline passed first.
    Timeout,
    /// Aborted by the caller (or its copy was cancelled).
    Aborted,
    /// The device copier failed the copy (a GPU error); no copy touches the
    /// memory any more, but the destination's bytes are unknown.
    CopyFailed,
    /// The bytes that landed are not the page whose digest came with them
    /// (altered between the source's deposit and here): never served.
    DigestMismatch,
}

/// Per-key outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    /// Done.
    Success,
    /// The policy declined to store it.
    Dropped,
    /// Failed, with the reason.
    Failed(FailReason),
}

/// The result for one key of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryResult {
    /// Outcome.
    pub status: EntryStatus,
    /// A claim to release later (fetch, `no_evict` deposit).
    pub release: Option<ReleaseHandle>,
    /// For fetch: the KVCR DRAM elements holding the page (valid while claimed).
    pub slots: Vec<ElementRef>,
}

impl EntryResult {
    /// Success, with the claim and slots a fetch returns.
    pub fn success(release: Option<ReleaseHandle>, slots: Vec<ElementRef>) -> Self {
        Self {
            status: EntryStatus::Success,
            release,
            slots,
        }
    }

    /// Failed for `reason`.
    pub fn failed(reason: FailReason) -> Self {
        Self {
            status: EntryStatus::Failed(reason),
            release: None,
            slots: Vec::new(),
        }
    }

    /// Declined by the policy.
    pub fn dropped() -> Self {
        Self {
            status: EntryStatus::Dropped,
            release: None,
            slots: Vec::new(),
        }
    }

    /// Whether the key succeeded.
    pub fn is_success(&self) -> bool {
        self.status == EntryStatus::Success
    }
}

/// A completed operation: one result per key, in call order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpResult {
    /// The operation.
    pub op: OpHandle,
    /// Key and result, in the order given.
    pub entries: Vec<(ScopedKey, EntryResult)>,
}

/// One pool's occupancy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Pool name.
    pub name: String,
    /// Bytes per block.
    pub block_size: u64,
    /// Slots in all.
    pub total_slots: u32,
    /// Free slots.
    pub free_slots: u32,
    /// Slots of READY unclaimed pages.
    pub evictable_slots: u32,
}

/// A snapshot of the runner's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerStats {
    /// The policy's name.
    pub policy: String,
    /// READY pages.
    pub ready: usize,
    /// FILLING pages.
    pub filling: usize,
    /// DISCARDING pages.
    pub discarding: usize,
    /// Live public claims.
    pub public_claims: usize,
    /// Operations not yet completed.
    pub ops_in_flight: usize,
    /// Copy jobs not yet terminal.
    pub copies_in_flight: usize,
    /// Per pool.
    pub pools: Vec<PoolStats>,
    /// Counters.
    pub counters: CoreCounters,
}

/// One validated copy: `len` bytes from `src` to `dst`.
///
/// The core plans these from bounds-checked region elements; only the
/// runner's copy engines and device copiers turn them into memory accesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySpan {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// One runner pool's host memory, handed to a device copier to pin or map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRange {
    /// Address of the pool's first byte.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One run of bytes out of claimed KVCR DRAM into framework host memory
/// (`Runner::copy_claimed`): `len` bytes from the start of runner element
/// `src` into framework element `dst`. A run may continue through the elements
/// that follow `src` while each is a slot one of the call's claims holds, and
/// through the elements that follow `dst` only in a dense region (stride equal
/// to the element size), so adjacent pages can move as one copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimedCopy {
    /// The first KVCR DRAM slot (as `fetch` returned it).
    pub src: ElementRef,
    /// The first framework host element.
    pub dst: ElementRef,
    /// Bytes.
    pub len: u64,
}
