//! The publisher's sans-I/O core: inventory events in, sequenced encoded
//! batches out. No sockets, no clock (the batch timestamp is an argument).
//!
//! Rules it enforces, in order:
//!
//! * **Barriers.** An `AllBlocksCleared` opens kvcr's inventory when the core is
//!   created (attach), precedes the first `Stored` of any owner in an
//!   incarnation, closes every opened owner on [`PublisherCore::close`] and on an
//!   incarnation switch, and resynchronises consumers after events were lost
//!   before reaching the core ([`PublisherCore::lost`]).
//! * **One removed per stored.** A ledger of published residencies
//!   `(owner, namespace, medium, key)`: a `Stored` block already live is not
//!   sent again, a `Removed` block that is not live is not sent, so every
//!   `BlockRemoved` on the wire answers exactly one earlier `BlockStored`. The
//!   ledger is bounded; past the bound, new blocks are not advertised
//!   (under-advertising is safe, a router only loses a hint).
//! * **Validation.** A `Stored` whose hashes repeat (parent included), whose
//!   token count is not `keys × block_size`, or whose fields are out of bounds is
//!   not sent (Dynamo would drop it, or worse, mis-index it).
//! * **Batching.** Events of different owners or incarnations never share a
//!   batch; adjacent events merge only under [`InventoryEvent::can_merge`]'s
//!   rule (same scope, continuing chain). Batches are bounded in events, blocks
//!   and tokens (Dynamo rejects envelopes over 128 events or 8192 blocks).
//! * **Sequence.** Every batch gets the next sequence number, from 0, +1 per
//!   batch, and the topic of its incarnation.

use std::collections::{HashSet, VecDeque};

use bytes::Bytes;

use crate::wire::{OwnershipWire, WireBatch, WireEvent, encode_batch};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::{BlockKey, NamespaceId};
use kvcr_contracts::tier::{InventoryEvent, InventoryScope, Medium, Owner};

/// Longest `lora_name` (and `cache_salt`) published, in bytes.
pub const MAX_LORA_NAME: usize = 1024;

/// Bounds of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Events per batch (Dynamo's envelope limit is 128).
    pub max_events: usize,
    /// Block hashes per batch (Dynamo's envelope limit is 8192).
    pub max_blocks: usize,
    /// Token ids per batch (keeps a payload well under Dynamo's 8 MiB cap).
    pub max_tokens: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            max_events: 128,
            max_blocks: 8192,
            max_tokens: 1 << 20,
        }
    }
}

/// Who the publisher speaks for: the topic is derived from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TopicParts {
    /// The worker (engine instance) id the router knows this rank by.
    pub worker_id: u64,
    /// The data-parallel rank (also the payload's `data_parallel_rank`).
    pub dp_rank: u32,
}

impl TopicParts {
    /// `kvcr.w{worker}.dp{dp}.{incarnation}`: different across workers, DP
    /// ranks, restarts and resets.
    pub fn topic(&self, incarnation: Incarnation) -> String {
        format!("kvcr.w{}.dp{}.{incarnation}", self.worker_id, self.dp_rank)
    }
}

/// Counters of what the core did with its input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Inventory events handed to the core.
    pub events_in: u64,
    /// `BlockStored` block hashes put on the wire.
    pub stored_blocks: u64,
    /// `BlockRemoved` block hashes put on the wire.
    pub removed_blocks: u64,
    /// `AllBlocksCleared` barriers put on the wire.
    pub clears: u64,
    /// Batches sequenced.
    pub batches: u64,
    /// Stored blocks not sent because they were already live (a repeat).
    pub stored_repeats: u64,
    /// Stored blocks not sent because the ledger was full.
    pub stored_over_capacity: u64,
    /// Stored events refused whole (repeating hashes, bad token count, bounds).
    pub stored_rejected: u64,
    /// Removed blocks not sent because they were not live.
    pub removed_unknown: u64,
    /// Resynchronisation barriers sent after events were lost upstream.
    pub resyncs: u64,
    /// Empty heartbeat batches sequenced on a quiet stream.
    pub heartbeats: u64,
}

/// One sequenced batch, before encoding.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequenced {
    /// Topic frame.
    pub topic: Bytes,
    /// Sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: WireBatch,
}

/// One sequenced, encoded batch, ready for the PUB socket and the replay buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Transmit {
    /// Topic frame.
    pub topic: Bytes,
    /// Sequence number (sent as 8 bytes big-endian).
    pub seq: u64,
    /// The msgpack `KVEventBatch`.
    pub payload: Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct LiveKey {
    owner: Owner,
    namespace: NamespaceId,
    medium: Medium,
    key: BlockKey,
}

/// What a stored event says about its namespace besides the scope (events
/// that differ in any of it never merge).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Tags {
    lora_name: Option<String>,
    lora_id: Option<u64>,
    cache_salt: Option<String>,
}

/// Scope of an event under construction (for merging decisions).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Meta {
    Stored {
        scope: InventoryScope,
        block_size: u32,
        tags: Tags,
    },
    Removed {
        scope: InventoryScope,
    },
    Cleared,
}

#[derive(Debug)]
struct OpenBatch {
    owner: Owner,
    incarnation: Incarnation,
    events: Vec<WireEvent>,
    metas: Vec<Meta>,
    blocks: usize,
    tokens: usize,
}

#[derive(Debug)]
struct Sealed {
    incarnation: Incarnation,
    events: Vec<WireEvent>,
}

/// The sans-I/O publisher: feed it [`InventoryEvent`]s, drain [`Transmit`]s.
#[derive(Debug)]
pub struct PublisherCore {
    parts: TopicParts,
    limits: BatchLimits,
    max_live_blocks: usize,
    ownership: OwnershipWire,
    incarnation: Incarnation,
    topic: Bytes,
    opened: Opened,
    ledger: HashSet<LiveKey>,
    open: Option<OpenBatch>,
    sealed: VecDeque<Sealed>,
    next_seq: u64,
    closed: bool,
    stats: CoreStats,
}

/// Owners with a barrier sent in the current incarnation.
#[derive(Debug, Clone, Copy, Default)]
struct Opened {
    framework: bool,
    kvcr: bool,
}

impl Opened {
    fn get(self, owner: Owner) -> bool {
        match owner {
            Owner::Framework => self.framework,
            Owner::Kvcr => self.kvcr,
        }
    }

    fn set(&mut self, owner: Owner, value: bool) {
        match owner {
            Owner::Framework => self.framework = value,
            Owner::Kvcr => self.kvcr = value,
        }
    }
}

const OWNERS: [Owner; 2] = [Owner::Framework, Owner::Kvcr];

impl PublisherCore {
    /// A core for one attach of one rank. It starts with the attach barrier
    /// (`AllBlocksCleared` for kvcr's inventory) queued as sequence 0.
    ///
    /// `limits` fields of zero are raised to 1; `max_live_blocks` bounds the
    /// ledger.
    pub fn new(
        parts: TopicParts,
        incarnation: Incarnation,
        limits: BatchLimits,
        max_live_blocks: usize,
    ) -> Self {
        let limits = BatchLimits {
            max_events: limits.max_events.max(1),
            max_blocks: limits.max_blocks.max(1),
            max_tokens: limits.max_tokens.max(1),
        };
        let mut core = Self {
            parts,
            limits,
            max_live_blocks,
            ownership: OwnershipWire::Field,
            incarnation,
            topic: Bytes::from(parts.topic(incarnation)),
            opened: Opened::default(),
            ledger: HashSet::new(),
            open: None,
            sealed: VecDeque::new(),
            next_seq: 0,
            closed: false,
            stats: CoreStats::default(),
        };
        core.barrier(Owner::Kvcr);
        core
    }

    /// Sets how kvcr's ownership goes on the wire (default
    /// [`OwnershipWire::Field`]).
    pub fn with_ownership(mut self, ownership: OwnershipWire) -> Self {
        self.ownership = ownership;
        self
    }

    /// The current incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The topic of the current incarnation.
    pub fn topic(&self) -> &Bytes {
        &self.topic
    }

    /// Counters so far.
    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// Residencies currently advertised.
    pub fn live_blocks(&self) -> usize {
        self.ledger.len()
    }

    /// Whether [`Self::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Handles one inventory event (by reference; clones what it keeps).
    pub fn handle(&mut self, event: &InventoryEvent) {
        if self.closed {
            return;
        }
        self.stats.events_in += 1;
        match event {
            InventoryEvent::Stored {
                scope,
                keys,
                parent,
                token_ids,
                block_size,
                lora_name,
                lora_id,
                cache_salt,
            } => {
                let tags = Tags {
                    lora_name: lora_name.clone(),
                    lora_id: *lora_id,
                    cache_salt: cache_salt.clone(),
                };
                self.stored(*scope, keys, *parent, token_ids, *block_size, &tags)
            }
            InventoryEvent::Removed { scope, keys } => self.removed(*scope, keys),
            InventoryEvent::AllCleared { owner, incarnation } => {
                self.all_cleared(*owner, *incarnation)
            }
        }
    }

    /// Some events never reached the core (the queue in front of it was full):
    /// consumers can no longer trust what was advertised, so every opened
    /// owner is cleared and the ledger forgotten. Consumers then under-advertise
    /// until pages are stored again, which is safe.
    pub fn lost(&mut self) {
        if self.closed {
            return;
        }
        let mut any = false;
        for owner in OWNERS {
            if self.opened.get(owner) {
                self.barrier(owner);
                any = true;
            }
        }
        if any {
            self.stats.resyncs += 1;
        }
    }

    /// Detach: `AllBlocksCleared` for every owner opened in this incarnation;
    /// later events are ignored.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        for owner in OWNERS {
            if self.opened.get(owner) {
                self.barrier(owner);
                self.opened.set(owner, false);
            }
        }
        self.closed = true;
    }

    /// Seals what is pending and returns the next batch to send, sequenced,
    /// with timestamp `ts`; `None` when nothing is pending.
    ///
    /// Call after handing the core a run of events, until it returns `None`.
    #[must_use]
    pub fn poll_batch(&mut self, ts: f64) -> Option<Sequenced> {
        if self.sealed.is_empty() {
            self.seal();
        }
        let sealed = self.sealed.pop_front()?;
        let topic = if sealed.incarnation == self.incarnation {
            self.topic.clone()
        } else {
            Bytes::from(self.parts.topic(sealed.incarnation))
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stats.batches += 1;
        Some(Sequenced {
            topic,
            seq,
            batch: WireBatch {
                ts,
                events: sealed.events,
                dp_rank: Some(self.parts.dp_rank),
                ownership: self.ownership,
            },
        })
    }

    /// [`Self::poll_batch`], encoded.
    #[must_use]
    pub fn poll_transmit(&mut self, ts: f64) -> Option<Transmit> {
        let s = self.poll_batch(ts)?;
        let mut payload = Vec::with_capacity(64 + s.batch.events.len() * 96);
        encode_batch(&s.batch, &mut payload);
        Some(Transmit {
            topic: s.topic,
            seq: s.seq,
            payload: Bytes::from(payload),
        })
    }

    // ----- event handling -----

    fn all_cleared(&mut self, owner: Owner, incarnation: Incarnation) {
        if incarnation != self.incarnation {
            // Close the old incarnation for every owner it opened, then switch.
            for o in OWNERS {
                if self.opened.get(o) {
                    self.barrier(o);
                }
            }
            self.seal();
            self.incarnation = incarnation;
            self.topic = Bytes::from(self.parts.topic(incarnation));
            self.opened = Opened::default();
            self.ledger.clear();
        }
        self.barrier(owner);
    }

    /// Emits `AllBlocksCleared` for `owner` in the current incarnation and
    /// forgets its ledger entries.
    fn barrier(&mut self, owner: Owner) {
        self.ledger.retain(|k| k.owner != owner);
        self.opened.set(owner, true);
        self.push_event(owner, WireEvent::Cleared { owner }, Meta::Cleared, 0, 0);
        self.stats.clears += 1;
    }

    fn stored(
        &mut self,
        scope: InventoryScope,
        keys: &[BlockKey],
        parent: Option<BlockKey>,
        token_ids: &[u32],
        block_size: u32,
        tags: &Tags,
    ) {
        if !self.valid_store(keys, parent, token_ids, block_size, tags) {
            self.stats.stored_rejected += 1;
            return;
        }
        if !self.opened.get(scope.owner) {
            self.barrier(scope.owner);
        }
        let bs = block_size as usize;
        // Maximal runs of blocks not yet live; each becomes one chained event.
        let mut run_start: Option<usize> = None;
        let mut end = keys.len();
        for (i, &key) in keys.iter().enumerate() {
            let live = LiveKey {
                owner: scope.owner,
                namespace: scope.namespace,
                medium: scope.medium,
                key,
            };
            let fresh = if self.ledger.contains(&live) {
                self.stats.stored_repeats += 1;
                false
            } else if self.ledger.len() >= self.max_live_blocks {
                // Stop here: later blocks would chain to one the consumer lacks.
                self.stats.stored_over_capacity += (keys.len() - i) as u64;
                end = i;
                break;
            } else {
                self.ledger.insert(live);
                true
            };
            match (fresh, run_start) {
                (true, None) => run_start = Some(i),
                (false, Some(s)) => {
                    self.store_run(scope, keys, parent, token_ids, bs, tags, s, i);
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            self.store_run(scope, keys, parent, token_ids, bs, tags, s, end);
        }
    }

    fn valid_store(
        &self,
        keys: &[BlockKey],
        parent: Option<BlockKey>,
        token_ids: &[u32],
        block_size: u32,
        tags: &Tags,
    ) -> bool {
        if keys.is_empty() || block_size == 0 || block_size as usize > self.limits.max_tokens {
            return false;
        }
        if keys.len().checked_mul(block_size as usize) != Some(token_ids.len()) {
            return false;
        }
        let too_long = |s: &Option<String>| s.as_ref().is_some_and(|s| s.len() > MAX_LORA_NAME);
        if too_long(&tags.lora_name) || too_long(&tags.cache_salt) {
            return false;
        }
        let mut seen: HashSet<BlockKey> = HashSet::with_capacity(keys.len() + 1);
        parent
            .into_iter()
            .chain(keys.iter().copied())
            .all(|k| seen.insert(k))
    }

    /// Publishes `keys[start..end]` (all fresh) as chained stored events, split
    /// to the batch limits.
    #[allow(clippy::too_many_arguments)]
    fn store_run(
        &mut self,
        scope: InventoryScope,
        keys: &[BlockKey],
        parent: Option<BlockKey>,
        token_ids: &[u32],
        bs: usize,
        tags: &Tags,
        start: usize,
        end: usize,
    ) {
        let mut i = start;
        while i < end {
            let (blocks_used, tokens_used) = self.open_usage(scope.owner);
            let room_blocks = self.limits.max_blocks.saturating_sub(blocks_used);
            let room_tokens = self.limits.max_tokens.saturating_sub(tokens_used) / bs;
            let take = (end - i).min(room_blocks).min(room_tokens);
            if take == 0 {
                self.seal();
                continue;
            }
            let chunk_parent = if i == 0 {
                parent
            } else {
                keys.get(i - 1).copied()
            };
            let hashes: Vec<u64> = keys
                .get(i..i + take)
                .unwrap_or_default()
                .iter()
                .map(|k| k.as_u64())
                .collect();
            let tokens = token_ids.get(i * bs..(i + take) * bs).unwrap_or_default();
            self.stats.stored_blocks += take as u64;
            let meta = Meta::Stored {
                scope,
                block_size: bs as u32,
                tags: tags.clone(),
            };
            if !self.merge_stored(&meta, chunk_parent, &hashes, tokens) {
                let event = WireEvent::Stored {
                    hashes,
                    parent: chunk_parent.map(BlockKey::as_u64),
                    token_ids: tokens.to_vec(),
                    block_size: bs as u32,
                    lora_name: tags.lora_name.clone(),
                    lora_id: tags.lora_id,
                    cache_salt: tags.cache_salt.clone(),
                    medium: scope.medium,
                    owner: scope.owner,
                };
                self.push_event(scope.owner, event, meta, take, take * bs);
            }
            i += take;
        }
    }

    /// Appends to the open batch's last event when it is a stored event of the
    /// same scope whose chain this continues. Room was checked by the caller
    /// (blocks and tokens); merging never adds an event.
    fn merge_stored(
        &mut self,
        meta: &Meta,
        parent: Option<BlockKey>,
        hashes: &[u64],
        tokens: &[u32],
    ) -> bool {
        let incarnation = self.incarnation;
        let Some(open) = self.open.as_mut() else {
            return false;
        };
        if open.incarnation != incarnation || open.metas.last() != Some(meta) {
            return false;
        }
        let Some(WireEvent::Stored {
            hashes: last_hashes,
            token_ids,
            ..
        }) = open.events.last_mut()
        else {
            return false;
        };
        if parent.map(BlockKey::as_u64) != last_hashes.last().copied() {
            return false;
        }
        // A merged event must not repeat a hash (Dynamo drops such events).
        // The ledger guarantees fresh hashes are not live, and a live hash
        // stays in the ledger until removed, so no repeat is possible unless a
        // removal of one of `last_hashes` sits between: that is another event.
        last_hashes.extend_from_slice(hashes);
        token_ids.extend_from_slice(tokens);
        open.blocks += hashes.len();
        open.tokens += tokens.len();
        true
    }

    fn removed(&mut self, scope: InventoryScope, keys: &[BlockKey]) {
        let mut gone = Vec::with_capacity(keys.len());
        for &key in keys {
            let live = LiveKey {
                owner: scope.owner,
                namespace: scope.namespace,
                medium: scope.medium,
                key,
            };
            if self.ledger.remove(&live) {
                gone.push(key.as_u64());
            } else {
                self.stats.removed_unknown += 1;
            }
        }
        let mut rest: &[u64] = &gone;
        while !rest.is_empty() {
            let (blocks_used, _) = self.open_usage(scope.owner);
            let room = self.limits.max_blocks.saturating_sub(blocks_used);
            if room == 0 {
                self.seal();
                continue;
            }
            let (chunk, tail) = rest.split_at(room.min(rest.len()));
            rest = tail;
            self.stats.removed_blocks += chunk.len() as u64;
            let meta = Meta::Removed { scope };
            let incarnation = self.incarnation;
            if let Some(open) = self.open.as_mut()
                && open.incarnation == incarnation
                && open.metas.last() == Some(&meta)
                && let Some(WireEvent::Removed { hashes, .. }) = open.events.last_mut()
            {
                hashes.extend_from_slice(chunk);
                open.blocks += chunk.len();
                continue;
            }
            let event = WireEvent::Removed {
                hashes: chunk.to_vec(),
                medium: scope.medium,
                owner: scope.owner,
            };
            self.push_event(scope.owner, event, meta, chunk.len(), 0);
        }
    }

    // ----- batch assembly -----

    /// (blocks, tokens) used by the open batch if `owner`'s next event would
    /// join it; (0, 0) when it would start a new one.
    fn open_usage(&self, owner: Owner) -> (usize, usize) {
        match &self.open {
            Some(o) if o.owner == owner && o.incarnation == self.incarnation => {
                (o.blocks, o.tokens)
            }
            _ => (0, 0),
        }
    }

    fn push_event(
        &mut self,
        owner: Owner,
        event: WireEvent,
        meta: Meta,
        blocks: usize,
        tokens: usize,
    ) {
        let fits = self.open.as_ref().is_some_and(|o| {
            o.owner == owner
                && o.incarnation == self.incarnation
                && o.events.len() < self.limits.max_events
                && o.blocks + blocks <= self.limits.max_blocks
                && o.tokens + tokens <= self.limits.max_tokens
        });
        if !fits {
            self.seal();
            self.open = Some(OpenBatch {
                owner,
                incarnation: self.incarnation,
                events: Vec::new(),
                metas: Vec::new(),
                blocks: 0,
                tokens: 0,
            });
        }
        if let Some(open) = self.open.as_mut() {
            open.events.push(event);
            open.metas.push(meta);
            open.blocks += blocks;
            open.tokens += tokens;
        }
    }

    /// Queues an empty batch (a heartbeat) when nothing else is pending and
    /// the core is open: on a quiet stream it carries the next sequence
    /// number, so a subscriber that joined late sees a gap and replays what
    /// it missed instead of waiting for the next change.
    pub fn heartbeat(&mut self) {
        if self.closed || !self.sealed.is_empty() || self.open.is_some() {
            return;
        }
        self.sealed.push_back(Sealed {
            incarnation: self.incarnation,
            events: Vec::new(),
        });
        self.stats.heartbeats += 1;
    }

    fn seal(&mut self) {
        if let Some(open) = self.open.take()
            && !open.events.is_empty()
        {
            self.sealed.push_back(Sealed {
                incarnation: open.incarnation,
                events: open.events,
            });
        }
    }
}
