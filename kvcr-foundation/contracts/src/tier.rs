//! Owners, tiers, wire medium names and inventory events.
//!
//! Inventory is always reported with its owner: framework-owned pages (GPU, the
//! engine's own host pool) are reported by the engine; pages in KVCR-owned DRAM
//! (and below) are reported by kvcr with `ownership: "kvcr"`. Events of different
//! owners, namespaces or incarnations are never merged ([`InventoryEvent::can_merge`]).

use serde::{Deserialize, Serialize};

use crate::incarnation::Incarnation;
use crate::key::{BlockKey, NamespaceId};

/// Who owns the memory a page lives in, and so who reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Owner {
    /// The inference engine (GPU pools, its host page pool).
    Framework,
    /// kvcr's own DRAM (and tiers below it).
    Kvcr,
}

impl Owner {
    /// The KV-event `ownership` field: absent for the framework, `"kvcr"` for kvcr.
    pub fn wire_ownership(self) -> Option<&'static str> {
        match self {
            Self::Framework => None,
            Self::Kvcr => Some("kvcr"),
        }
    }
}

/// Where a page's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tier {
    /// Engine GPU memory.
    Gpu,
    /// The engine's pinned host pool.
    HostPinned,
    /// KVCR-owned host DRAM.
    KvcrDram,
    /// Local disk or NVMe.
    Disk,
    /// An external store (object store, remote service).
    External,
}

impl Tier {
    /// The medium this tier is published under on the KV-event wire.
    ///
    /// KVCR DRAM is published as `CPU_PINNED` when the engine's host tier is
    /// absent (direct linker) and as `EXTERNAL` when kvcr is the L3 behind an
    /// engine host pool; callers pick with [`Medium`] directly in that case.
    pub fn default_medium(self) -> Medium {
        match self {
            Self::Gpu => Medium::Gpu,
            Self::HostPinned | Self::KvcrDram => Medium::CpuPinned,
            Self::Disk => Medium::Disk,
            Self::External => Medium::External,
        }
    }
}

/// The `medium` string of a KV event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Medium {
    /// `"GPU"`.
    #[serde(rename = "GPU")]
    Gpu,
    /// `"CPU"`: pageable host memory (vLLM's `MEDIUM_CPU`).
    #[serde(rename = "CPU")]
    Cpu,
    /// `"CPU_PINNED"`: page-locked host memory.
    #[serde(rename = "CPU_PINNED")]
    CpuPinned,
    /// `"DISK"`.
    #[serde(rename = "DISK")]
    Disk,
    /// `"EXTERNAL"`.
    #[serde(rename = "EXTERNAL")]
    External,
}

impl Medium {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "GPU",
            Self::Cpu => "CPU",
            Self::CpuPinned => "CPU_PINNED",
            Self::Disk => "DISK",
            Self::External => "EXTERNAL",
        }
    }

    /// Parses a consumer-side medium string the way Dynamo maps them; unknown
    /// strings give `None` (the caller decides; Dynamo treats them as device).
    pub fn from_wire(s: &str) -> Option<Self> {
        match s {
            "GPU" | "DEVICE" => Some(Self::Gpu),
            "CPU" => Some(Self::Cpu),
            "CPU_PINNED" | "CPU_TIER1" => Some(Self::CpuPinned),
            "CPU_TIER2" | "DISK" | "NVME" => Some(Self::Disk),
            "EXTERNAL" | "NETWORK" | "REMOTE" | "SHARED" => Some(Self::External),
            _ => None,
        }
    }
}

/// Who reported an inventory event: events from different scopes never merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InventoryScope {
    /// Owner of the memory.
    pub owner: Owner,
    /// Namespace of the pages.
    pub namespace: NamespaceId,
    /// Medium published.
    pub medium: Medium,
}

/// One inventory change, produced by the runner and turned into KV events by the
/// publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InventoryEvent {
    /// Pages whose bytes are committed (and, with several ranks, agreed).
    Stored {
        /// Owner, namespace, medium.
        scope: InventoryScope,
        /// Keys in chain order.
        keys: Vec<BlockKey>,
        /// The key of the page before `keys[0]`, if any.
        parent: Option<BlockKey>,
        /// The real tokens of the pages, `keys.len() * block_size` of them.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: u32,
        /// The LoRA adapter name, when not the base model.
        lora_name: Option<String>,
        /// The LoRA adapter's numeric id (`lora_id`), where the engine has one.
        lora_id: Option<u64>,
        /// The tenant's cache salt (`cache_salt`): a router indexes salted
        /// pages apart from unsalted ones and from other salts.
        cache_salt: Option<String>,
    },
    /// Pages removed; exactly once per stored residency.
    Removed {
        /// Owner, namespace, medium.
        scope: InventoryScope,
        /// Keys removed.
        keys: Vec<BlockKey>,
    },
    /// Everything this owner published in this incarnation is gone (a reset
    /// barrier, also sent before the first `Stored` of an incarnation).
    AllCleared {
        /// The owner whose inventory is cleared.
        owner: Owner,
        /// The incarnation the barrier opens or closes.
        incarnation: Incarnation,
    },
}

impl InventoryEvent {
    /// Whether `next` may be appended to `self` as one event (same kind, same
    /// scope, and for stores a continuing chain). Owners, namespaces, media and
    /// incarnations never merge.
    pub fn can_merge(&self, next: &Self) -> bool {
        match (self, next) {
            (
                Self::Stored {
                    scope: a,
                    keys,
                    block_size: bs_a,
                    lora_name: lora_a,
                    lora_id: id_a,
                    cache_salt: salt_a,
                    ..
                },
                Self::Stored {
                    scope: b,
                    parent,
                    block_size: bs_b,
                    lora_name: lora_b,
                    lora_id: id_b,
                    cache_salt: salt_b,
                    ..
                },
            ) => {
                a == b
                    && bs_a == bs_b
                    && lora_a == lora_b
                    && id_a == id_b
                    && salt_a == salt_b
                    && *parent == keys.last().copied()
            }
            (Self::Removed { scope: a, .. }, Self::Removed { scope: b, .. }) => a == b,
            _ => false,
        }
    }
}

/// Where the runner sends its inventory events: called on the runner's own
/// thread, in commit order, after the bytes are committed. An implementation
/// must not block (a publisher buffers and drops to its own bounds); it cannot
/// fail the runner.
pub trait InventorySink: Send {
    /// One event, in order.
    fn publish(&mut self, event: &InventoryEvent);
}

/// A sink that keeps every event in memory (for tests and simple embedders).
#[derive(Debug, Default, Clone)]
pub struct VecSink(pub Vec<InventoryEvent>);

impl InventorySink for VecSink {
    fn publish(&mut self, event: &InventoryEvent) {
        self.0.push(event.clone());
    }
}
