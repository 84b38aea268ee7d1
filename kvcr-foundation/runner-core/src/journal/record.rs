//! What a journal holds: the records the runner appends and the state
//! [`recover`](fn@super::recover) reads back.

/// One journal entry, as the runner appends it.
///
/// Plain integers (namespace ids are `NamespaceId.0`, keys `BlockKey` as `u64`)
/// so the format stands on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalRecord {
    /// A namespace the runner registered.
    Namespace {
        /// The namespace's id (`NamespaceId.0`).
        id: u64,
        /// Its compatibility digest.
        compat: u64,
        /// Its LoRA adapter (at most [`MAX_STRING`](super::MAX_STRING) bytes).
        lora_name: Option<String>,
        /// Its cache salt (at most [`MAX_STRING`](super::MAX_STRING) bytes).
        cache_salt: Option<String>,
    },
    /// A page became READY with all its bytes (only then is it journaled).
    Ready {
        /// Its namespace (registered earlier).
        namespace: u64,
        /// Its key (`BlockKey` as `u64`).
        key: u64,
        /// The runner's layout code (opaque here).
        layout: u16,
        /// Its DRAM slots, 1..=[`MAX_SLOTS`](super::MAX_SLOTS), distinct, owned by no live page
        /// and not held.
        slots: Vec<u32>,
        /// The key of its parent page, if any.
        parent: Option<u64>,
        /// Its token ids (at most [`MAX_TOKEN_IDS`](super::MAX_TOKEN_IDS)).
        token_ids: Vec<u32>,
    },
    /// The page's residency ended. Journaled before its slots can be written
    /// again.
    Removed {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// Slots granted to a peer's remote write: a source may write them at any
    /// time until proof, so they are never reused after a recovery unless
    /// freed. 1..=[`MAX_SLOTS`](super::MAX_SLOTS) distinct slots, none owned or held.
    Held {
        /// The slots.
        slots: Vec<u32>,
    },
    /// Slots of an earlier Held, freed with proof (1..=[`MAX_SLOTS`](super::MAX_SLOTS), all held).
    Freed {
        /// The slots.
        slots: Vec<u32>,
    },
}

/// A namespace a journal holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecoveredNamespace {
    /// The namespace's id (`NamespaceId.0`).
    pub id: u64,
    /// Its compatibility digest.
    pub compat: u64,
    /// Its LoRA adapter.
    pub lora_name: Option<String>,
    /// Its cache salt.
    pub cache_salt: Option<String>,
}

/// A page a journal holds READY.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecoveredPage {
    /// Its namespace.
    pub namespace: u64,
    /// Its key.
    pub key: u64,
    /// The runner's layout code.
    pub layout: u16,
    /// Its DRAM slots.
    pub slots: Vec<u32>,
    /// Its parent's key.
    pub parent: Option<u64>,
    /// Its token ids.
    pub token_ids: Vec<u32>,
}

/// What [`recover`](fn@super::recover) found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovered {
    /// Registered namespaces, in registration order.
    pub namespaces: Vec<RecoveredNamespace>,
    /// Live READY pages, in journal order (oldest first).
    pub pages: Vec<RecoveredPage>,
    /// Slots held for peers' writes and not freed: never reuse them (sorted,
    /// distinct).
    pub held: Vec<u32>,
    /// The half ended in a record cut short (the one being written when the
    /// writer died); it was left out.
    pub torn_tail: bool,
    /// Complete records read from the active half.
    pub records: u64,
}
