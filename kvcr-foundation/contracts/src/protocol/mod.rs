//! The peer control protocol: destination-initiated writes.
//!
//! A destination (target) that wants pages a source holds sends the source its
//! UCX worker address and registered regions ([`Body::TargetMetadata`]), then a
//! [`Body::StartWrite`] naming keys and, per key, the destination region
//! elements it grants. The source puts the bytes straight into those elements
//! and reports which keys landed ([`Body::WriteDone`]). Probes let a target whose
//! deadline passed find out whether the source can still touch its memory.
//!
//! Every message carries a [`Header`]: the sender's incarnation (so a restarted
//! peer is never mistaken for its predecessor), the route generation (bumped
//! when a peer's registration changes), and the sender's control endpoint as the
//! recipient names it.
//!
//! Memory is addressed by **region id + element index**, never by raw pointers:
//! a source can only write into elements of regions the target advertised, and
//! every index is bounds-checked against that registration before any put.
//!
//! The byte encoding lives in [`codec`].

pub mod codec;
mod elements;

pub use elements::{ElementRun, ElementRuns, Elements};

use crate::endpoint::ControlEndpoint;
use crate::incarnation::Incarnation;
use crate::key::{BlockKey, NamespaceId};

/// A target-chosen operation handle, unique per target incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpHandle(pub u64);

/// Bumped each time a peer's route (metadata, regions) is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RouteGeneration(pub u64);

/// Id of a registered region, unique within one advertisement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

/// One element of one advertised region: what a target grants a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ElementRef {
    /// The region.
    pub region: RegionId,
    /// The element index inside it (`0..count`).
    pub index: u64,
}

/// How a source on the same host may write a target's regions itself: the
/// regions are shared-memory files (`memfd`) the source maps and copies into
/// with one `memcpy` per span, without UCX and without the target running.
///
/// Everything here is a claim by the target; the source acts on it only
/// when the host and pid namespace are its own, and only after checking
/// each file it opens (a sealed memfd of the advertised name and at least
/// the region's size). Otherwise it writes through UCX as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMemoryAdvert {
    /// The kernel boot the target runs under (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: [u8; 16],
    /// The target's pid namespace (inode of `/proc/self/ns/pid`).
    pub pid_namespace: u64,
    /// The target's process id in that namespace.
    pub pid: u32,
    /// The regions that are shared segments (a subset of the advertised ones).
    pub segments: Vec<SegmentAdvert>,
}

/// One advertised region backed by a shared-memory file of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentAdvert {
    /// The advertised region it backs (its first byte is the region's base).
    pub region: RegionId,
    /// The file descriptor in the target process (`/proc/<pid>/fd/<fd>`).
    pub fd: u32,
    /// Random per segment; part of the file's name, so a source opens only
    /// the file the target meant.
    pub token: [u8; 16],
}

/// A target's doorbell: a region of fixed-size slots into which a source
/// writes a sealed completion record for a write the moment its bytes have
/// landed (same host: after its copies; over UCX: fenced behind its puts),
/// so the target need not wait for the `write_done` message, which the
/// source still sends.
///
/// The key is the target's, fresh per session and sent only inside that
/// session's encrypted frames: a record sealed with it is believed only for
/// that session's operations, and a record that does not verify is ignored
/// (the control reply still comes). Its `Debug` form never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct DoorbellAdvert {
    /// The advertised region holding the slots (one slot per element).
    pub region: RegionId,
    /// The session's record key.
    pub key: [u8; 32],
}

impl std::fmt::Debug for DoorbellAdvert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DoorbellAdvert")
            .field("region", &self.region)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// A strided region the target registered and advertises to sources.
///
/// Element `i` occupies `[base + i * stride, base + i * stride + element_size)`
/// in the target's address space; `element_size <= stride` unless `count == 1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionAdvert {
    /// Id used by [`ElementRef`].
    pub id: RegionId,
    /// A human label (`kv`, `kvcr-dram/0`, ...): `[A-Za-z0-9_./-]{1,64}`.
    pub label: String,
    /// Remote virtual address of element 0.
    pub base: u64,
    /// Bytes per element.
    pub element_size: u64,
    /// Bytes between consecutive elements.
    pub stride: u64,
    /// Number of elements.
    pub count: u64,
    /// The packed remote key (UCX `rkey`) for this region.
    pub rkey: Vec<u8>,
}

/// A region of the target's device (GPU) memory a same-host source may open
/// and write straight from its KVCR DRAM: the one-hop route.
///
/// Laid out like a [`RegionAdvert`] (element `i` at `base + i * stride`),
/// its id shares the id space of the advertised regions (an [`ElementRef`]
/// names exactly one region of either kind). `export` is the target's
/// opaque name of the memory `[base, base + extent)`; like every advert it
/// is a claim, acted on only over a same-host route and only after the
/// source's device copier opened it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRegionAdvert {
    /// Id used by [`ElementRef`] (distinct from every advertised region's).
    pub id: RegionId,
    /// The target's device address of element 0 (the export's first byte).
    pub base: u64,
    /// Bytes per element.
    pub element_size: u64,
    /// Bytes between consecutive elements.
    pub stride: u64,
    /// Number of elements.
    pub count: u64,
    /// The exported name of the extent (at most
    /// [`codec::MAX_DEVICE_EXPORT`] bytes).
    pub export: Vec<u8>,
}

impl DeviceRegionAdvert {
    /// Bytes from `base` to the end of the last element (`None` on overflow).
    pub fn extent(&self) -> Option<u64> {
        self.stride
            .checked_mul(self.count.checked_sub(1)?)?
            .checked_add(self.element_size)
    }
}

/// Indices into a `StartWrite`'s key list that landed, strictly ascending,
/// with the source's page digest of each (all or none: a source that keeps
/// no digests sends none).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CompletedIndices {
    indices: Vec<u32>,
    /// Empty, or one per index, in the same order.
    digests: Vec<u64>,
    /// The source hashed each page in the pass that copied it into the
    /// target's mapped pools and found it as deposited (only with digests).
    checked_in_copy: bool,
}

impl CompletedIndices {
    /// From any list: sorted and de-duplicated, without digests.
    pub fn new(mut indices: Vec<u32>) -> Self {
        indices.sort_unstable();
        indices.dedup();
        Self {
            indices,
            digests: Vec::new(),
            checked_in_copy: false,
        }
    }

    /// From `(index, digest)` pairs: sorted by index, the first of a
    /// repeated index kept.
    pub fn with_digests(mut pairs: Vec<(u32, u64)>) -> Self {
        pairs.sort_by_key(|(index, _)| *index);
        pairs.dedup_by_key(|(index, _)| *index);
        let (indices, digests) = pairs.into_iter().unzip();
        Self {
            indices,
            digests,
            checked_in_copy: false,
        }
    }

    /// The same, saying the source hashed each page in the pass that copied
    /// it into the target's mapped pools and found it as deposited; only
    /// where every index has its digest (else unchanged).
    #[must_use]
    pub fn checked_in_copy(mut self) -> Self {
        self.checked_in_copy = self.digests().is_some();
        self
    }

    /// Whether the source says it checked each page in its copy (see
    /// [`CompletedIndices::checked_in_copy`]).
    pub fn is_checked_in_copy(&self) -> bool {
        self.checked_in_copy
    }

    /// The indices, strictly ascending.
    pub fn as_slice(&self) -> &[u32] {
        &self.indices
    }

    /// The source's digest of each index's page, in the same order, if it
    /// sent them.
    pub fn digests(&self) -> Option<&[u64]> {
        (!self.digests.is_empty() && self.digests.len() == self.indices.len())
            .then_some(self.digests.as_slice())
    }

    /// Length of the leading run `0, 1, 2, ...`: the longest valid prefix.
    pub fn leading_prefix(&self) -> usize {
        self.indices
            .iter()
            .enumerate()
            .take_while(|(i, idx)| usize::try_from(**idx).ok() == Some(*i))
            .count()
    }

    pub(crate) fn from_ascending(indices: Vec<u32>, digests: Vec<u64>, checked: bool) -> Self {
        Self {
            indices,
            digests,
            checked_in_copy: checked,
        }
    }
}

/// How a write ended, from the source's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The put and flush completed; these keys' bytes are in place.
    Completed(CompletedIndices),
    /// The write failed. `terminal` says the source will not touch the target's
    /// memory again; a non-terminal failure means "cancelled, but a put may
    /// still be in flight": the target must keep the memory quarantined.
    Failed {
        /// Whether the source is done with the target's memory.
        terminal: bool,
    },
}

/// Fields carried by every control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The sender's incarnation.
    pub sender: Incarnation,
    /// The sender's route generation for the recipient.
    pub route_generation: RouteGeneration,
    /// The sender's control endpoint, spelled as the recipient names it
    /// (replies reflect the name the requester used).
    pub sender_endpoint: ControlEndpoint,
}

/// A control message: header plus body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Common fields.
    pub header: Header,
    /// What the message says.
    pub body: Body,
}

/// The message kinds of the peer protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Target → source: how to reach the target (UCX worker address) and which
    /// regions it can receive into.
    TargetMetadata {
        /// Packed UCX worker address.
        worker_address: Vec<u8>,
        /// Regions the target advertises.
        regions: Vec<RegionAdvert>,
        /// Regions a same-host source may map and write itself.
        shared_memory: Option<SharedMemoryAdvert>,
        /// Where a source may ring this session's completions.
        doorbell: Option<DoorbellAdvert>,
        /// Device regions a same-host source may open and write in one hop.
        device_regions: Vec<DeviceRegionAdvert>,
    },
    /// Source → target: metadata loaded; optionally names the write that
    /// triggered it.
    TargetMetadataAck {
        /// The write whose start carried the metadata, if any.
        op_handle: Option<OpHandle>,
        /// The source mapped every advertised shared segment: its writes
        /// land with one copy and need nothing from the target's UCX worker
        /// (which may then sleep while the write runs).
        one_copy: bool,
        /// The source opened every advertised device region: grants of
        /// their elements (one-hop writes) are welcome.
        device: bool,
    },
    /// Target → source: put these keys into these granted elements.
    StartWrite {
        /// The operation.
        op_handle: OpHandle,
        /// The target's time left; the source uses the smaller of this and its own.
        remaining_timeout_ms: u32,
        /// The source incarnation the target expects (`None`: not yet known).
        source_incarnation: Option<Incarnation>,
        /// The namespace of every key.
        namespace: NamespaceId,
        /// Keys in request order.
        keys: Vec<BlockKey>,
        /// Per key, the destination elements (one per span of the page
        /// layout), as the wire's runs.
        destinations: Vec<ElementRuns>,
        /// Leading destination elements of every key (a layer-first page's
        /// first layer) the target wants reported as soon as they have
        /// landed ([`Body::WriteLeadLanded`]), ahead of the rest; 0: no
        /// such report. At most the fewest elements of a key.
        lead_elements: u16,
    },
    /// Source → target: the first `elements` destination elements of every
    /// key of the write have landed (the rest may still be copying). A
    /// progress report only: nothing is checked or committed until
    /// `write_done`.
    WriteLeadLanded {
        /// The operation.
        op_handle: OpHandle,
        /// The write's `lead_elements`.
        elements: u16,
    },
    /// Source → target: no route to the target; the operation failed terminally.
    WriteRefused {
        /// The operation.
        op_handle: OpHandle,
    },
    /// Source → target: the write ended.
    WriteDone {
        /// The operation.
        op_handle: OpHandle,
        /// How.
        outcome: WriteOutcome,
    },
    /// Target → source: "may you still touch my memory for this op?"
    WriteProbe {
        /// The operation.
        op_handle: OpHandle,
        /// The incarnation the target sent the write to.
        source_incarnation: Option<Incarnation>,
    },
    /// Source → target: the answer to a probe.
    WriteProbeAck {
        /// The operation.
        op_handle: OpHandle,
        /// True when the source proves it will never touch the memory.
        terminal: bool,
        /// Set when the probed incarnation is confirmed dead.
        dead_incarnation: Option<Incarnation>,
    },
    /// Target → source: the nonce a source sent to the UCX worker this
    /// target advertised, handed back on the session the target dialed to
    /// that source (proves the worker is the target's own).
    RouteProof {
        /// The source's nonce, as the worker received it.
        nonce: [u8; 32],
    },
}

impl Body {
    /// The kind's name, for logs.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::TargetMetadata { .. } => "target_metadata",
            Self::TargetMetadataAck { .. } => "target_metadata_ack",
            Self::StartWrite { .. } => "start_write",
            Self::WriteRefused { .. } => "write_refused",
            Self::WriteDone { .. } => "write_done",
            Self::WriteProbe { .. } => "write_probe",
            Self::WriteProbeAck { .. } => "write_probe_ack",
            Self::RouteProof { .. } => "route_proof",
            Self::WriteLeadLanded { .. } => "write_lead_landed",
        }
    }
}
