//! kvcr-publisher: kvcr's inventory on the vLLM/Dynamo KV-event wire.
//!
//! The runner hands every committed [`InventoryEvent`] to a [`PublisherSink`]
//! (an [`InventorySink`]) on its own thread. The sink never blocks and never
//! fails: it puts the event on a bounded queue, and a full queue drops the event
//! and counts it. One driver thread per [`Publisher`] turns the queue into KV
//! event batches and speaks ZMQ:
//!
//! * a **PUB** socket sending `[topic, seq (u64 big-endian, from 0, +1 per
//!   batch), msgpack KVEventBatch]` ([`wire`] has the exact layout);
//! * an optional **replay ROUTER** serving buffered batches from any requested
//!   sequence, ending with the end marker ([`replay`]).
//!
//! Everything with rules in it is sans-I/O: [`core::PublisherCore`] (barriers,
//! one-removed-per-stored ledger, validation, batching, sequencing),
//! [`wire::encode_batch`] and [`replay::ReplayBuffer`]. The driver only moves
//! bytes and reads the clock once per round.
//!
//! Endpoints are explicit: [`PubSocket::Bind`] binds and [`PubSocket::Connect`]
//! connects, whatever the address looks like (vLLM and SGLang guess from the
//! address, and `tcp://127.0.0.1:P` silently connects there).
//!
//! Both sockets answer anyone who can reach them, so they are bounded against
//! peers that ask and never read ([`ReplayLimits`], [`PublisherConfig::pub_hwm`]):
//! they bind loopback addresses only unless [`BindScope::AnyAddress`] says
//! otherwise; a replay reply is streamed, ZMQ holding at most two of its
//! batches per peer, under a byte cap for all peers and a cap on replies in
//! progress; what a peer that left was charged is released.
//!
//! Losing events upstream (a full queue) is never silent on the wire: the next
//! event the driver sees is preceded by an `AllBlocksCleared` barrier for every
//! owner opened, so a consumer under-advertises (safe) rather than keeps pages
//! that are gone.

pub mod core;
#[cfg(feature = "decode")]
pub mod decode;
mod driver;
pub mod error;
pub mod replay;
mod serve;
pub mod wire;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::Echo;
pub use crate::error::{Error, PublisherReason, Result};
use kvcr_contracts::endpoint::{BindAddress, ControlEndpoint};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::tier::{InventoryEvent, InventorySink};

pub use self::wire::OwnershipWire;

pub use self::core::{BatchLimits, CoreStats, PublisherCore, Sequenced, TopicParts, Transmit};

/// How the PUB socket attaches: always said explicitly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PubSocket {
    /// Bind (consumers connect to us); port 0 picks a free port.
    Bind(BindAddress),
    /// Connect to a consumer or proxy that binds.
    Connect(ControlEndpoint),
}

/// Which addresses the PUB and replay sockets may bind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BindScope {
    /// Loopback addresses only (`127.0.0.0/8`, `::1`): the default. A
    /// wildcard or any other address is refused at start.
    #[default]
    Loopback,
    /// Any address the configuration names, wildcards included: consumers on
    /// other hosts subscribe and replay directly. Chosen explicitly.
    AnyAddress,
}

impl BindScope {
    fn allows(self, addr: &BindAddress) -> bool {
        match self {
            Self::AnyAddress => true,
            Self::Loopback => addr.host.is_some_and(|ip| ip.is_loopback()),
        }
    }
}

/// Bounds of the replay ROUTER against peers that ask and never read. A reply
/// is streamed: ZMQ holds at most the last two messages accepted for a peer
/// (its send high-water mark is one message and a full peer is skipped, not
/// queued for), and those two are what the peer is charged until it reads on
/// or leaves. So one 8-byte request costs the publisher two batches while its
/// peer does not read, and sends at most the buffer (`replay_bytes`) in all.
/// A reply is never cut short for its size: the format's end marker would
/// end it, and Dynamo's indexer then moves its watermark past the rest of
/// its gap without asking again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayLimits {
    /// Replies in progress at once (1..=65,536; default 64). A request from
    /// another peer while this many are takes the place of the reply whose
    /// peer has gone longest without reading (`replay_displaced`; that peer
    /// is sent the end marker once it reads); when every peer reads, it gets
    /// an empty replay (the end marker alone, `replay_refused`). Either way
    /// the peer that lost its reply misses that gap, as when the buffer has
    /// rolled past it, but is not left waiting.
    pub max_replies: usize,
    /// Reply bytes ZMQ may hold for all replay peers together (64 KiB..=1 TiB;
    /// default 64 MiB). A batch that would pass it waits until other peers
    /// read or leave; one batch larger than the cap goes only when nothing
    /// else is held (the bound is then two such batches).
    pub queued_bytes: usize,
    /// Requests ZMQ queues per peer before the publisher reads them (1..=1024;
    /// default 16). A request replaces the peer's earlier reply, so more
    /// would only be memory.
    pub request_hwm: u32,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        Self {
            max_replies: 64,
            queued_bytes: 64 << 20,
            request_hwm: 16,
        }
    }
}

/// Publisher configuration. [`PublisherConfig::new`] gives vLLM's defaults,
/// bounded: the sockets bind loopback only, a subscriber that never reads
/// holds at most `pub_hwm` batches, and replies obey [`ReplayLimits`].
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Worker id and DP rank (topic and payload `data_parallel_rank`).
    pub parts: TopicParts,
    /// Whether kvcr-owned events carry `ownership: "kvcr"` (the default) or
    /// leave ownership to the stream (for worker-domain-only consumers such as
    /// Dynamo 1.6.1's standalone indexer).
    pub ownership: OwnershipWire,
    /// The incarnation the publisher starts in.
    pub incarnation: Incarnation,
    /// The PUB socket.
    pub pub_socket: PubSocket,
    /// The replay ROUTER's bind address; `None` disables replay.
    pub replay: Option<BindAddress>,
    /// Which addresses the PUB (when it binds) and replay sockets may bind
    /// (default [`BindScope::Loopback`]).
    pub bind_scope: BindScope,
    /// Bounds of the replay ROUTER.
    pub replay_limits: ReplayLimits,
    /// Events queued between the sink and the driver (1..=16 Mi).
    pub queue_capacity: usize,
    /// PUB send high-water mark, in batches per subscriber (1..=10 M; default
    /// 10,000, the replay buffer's length: a batch a slow subscriber misses
    /// is still there to replay). A subscriber that never reads holds this
    /// many batches (their payloads are shared between subscribers).
    pub pub_hwm: u32,
    /// Batches kept for replay (0..=1 M).
    pub replay_batches: usize,
    /// Payload bytes kept for replay (at least 1 KiB).
    pub replay_bytes: usize,
    /// Bounds of one batch.
    pub limits: BatchLimits,
    /// Residencies tracked for one-removed-per-stored (1..=256 Mi).
    pub max_live_blocks: usize,
    /// Events the driver takes off the queue per round (1..=1 Mi).
    pub max_drain: usize,
    /// How long the idle driver waits before looking at the replay socket
    /// (1 ms..=1 s): the worst-case replay latency.
    pub idle_tick: Duration,
    /// Sends an empty batch (the next sequence number, no events) when the
    /// stream has been quiet this long, so a subscriber that registered late
    /// notices the gap and replays within about this interval (`None`: off;
    /// 10 ms..=60 s).
    pub heartbeat: Option<Duration>,
    /// How long closing waits for queued messages to reach subscribers
    /// (0..=60 s).
    pub close_linger: Duration,
}

impl PublisherConfig {
    /// vLLM-like defaults (10,000 replay batches), bounded: PUB HWM 10,000
    /// (vLLM's 100,000 lets one silent subscriber hold ten times more),
    /// loopback binds, [`ReplayLimits::default`].
    pub fn new(parts: TopicParts, incarnation: Incarnation, pub_socket: PubSocket) -> Self {
        Self {
            parts,
            ownership: OwnershipWire::Field,
            incarnation,
            pub_socket,
            replay: None,
            bind_scope: BindScope::Loopback,
            replay_limits: ReplayLimits::default(),
            queue_capacity: 1 << 16,
            pub_hwm: 10_000,
            replay_batches: 10_000,
            replay_bytes: 256 << 20,
            limits: BatchLimits::default(),
            max_live_blocks: 1 << 22,
            max_drain: 4096,
            idle_tick: Duration::from_millis(5),
            heartbeat: None,
            close_linger: Duration::from_millis(500),
        }
    }

    /// Sets the replay ROUTER's bind address.
    pub fn with_replay(mut self, replay: BindAddress) -> Self {
        self.replay = Some(replay);
        self
    }

    fn validate(&self) -> Result<()> {
        let check = |field: &'static str, value: u64, min: u64, max: u64| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(Error::Publisher {
                    reason: PublisherReason::Config {
                        field,
                        value,
                        min,
                        max,
                    },
                })
            }
        };
        let n = |v: usize| v as u64;
        check("queue_capacity", n(self.queue_capacity), 1, 1 << 24)?;
        check("pub_hwm", u64::from(self.pub_hwm), 1, 10_000_000)?;
        check("replay_batches", n(self.replay_batches), 0, 1_000_000)?;
        check("replay_bytes", n(self.replay_bytes), 1024, 1 << 40)?;
        check("limits.max_events", n(self.limits.max_events), 1, 1 << 16)?;
        check("limits.max_blocks", n(self.limits.max_blocks), 1, 1 << 20)?;
        check("limits.max_tokens", n(self.limits.max_tokens), 1, 1 << 26)?;
        check("max_live_blocks", n(self.max_live_blocks), 1, 1 << 28)?;
        check("max_drain", n(self.max_drain), 1, 1 << 20)?;
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        check("idle_tick_ms", ms(self.idle_tick), 1, 1000)?;
        if let Some(every) = self.heartbeat {
            check("heartbeat_ms", ms(every), 10, 60_000)?;
        }
        check("close_linger_ms", ms(self.close_linger), 0, 60_000)?;
        let limits = &self.replay_limits;
        check(
            "replay_limits.max_replies",
            n(limits.max_replies),
            1,
            1 << 16,
        )?;
        check(
            "replay_limits.queued_bytes",
            n(limits.queued_bytes),
            64 << 10,
            1 << 40,
        )?;
        check(
            "replay_limits.request_hwm",
            u64::from(limits.request_hwm),
            1,
            1024,
        )?;
        let binds = match &self.pub_socket {
            PubSocket::Bind(a) => Some(a),
            PubSocket::Connect(_) => None,
        };
        if let Some(addr) = binds
            .into_iter()
            .chain(self.replay.as_ref())
            .find(|a| !self.bind_scope.allows(a))
        {
            return Err(Error::Publisher {
                reason: PublisherReason::NotLoopback(Echo::new(&addr.to_string())),
            });
        }
        if let (PubSocket::Bind(a), Some(b)) = (&self.pub_socket, &self.replay)
            && a.port != 0
            && a == b
        {
            return Err(Error::Publisher {
                reason: PublisherReason::SameEndpoint(Echo::new(&a.to_string())),
            });
        }
        Ok(())
    }
}

/// Everything the publisher counted. Drops are never silent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// What the core did (events in, blocks stored/removed, clears, batches,
    /// suppressed repeats, rejected events, resyncs).
    pub core: CoreStats,
    /// Events dropped by the sink because the queue was full.
    pub queue_dropped: u64,
    /// PUB sends that failed (the batch stays available for replay).
    pub pub_send_errors: u64,
    /// Well-formed replay requests served.
    pub replay_requests: u64,
    /// Batches sent in replies.
    pub replay_batches: u64,
    /// Requests for a sequence older than the oldest buffered one, or replies
    /// overtaken by the buffer's eviction while they waited (answered from
    /// the oldest).
    pub replay_truncated: u64,
    /// Replies dropped because the requester left before their end.
    pub replay_aborted: u64,
    /// Requests answered with the end marker alone: `max_replies` replies
    /// were in progress and every one of their peers was reading.
    pub replay_refused: u64,
    /// Replies given up for a new request while `max_replies` were in
    /// progress: the one whose peer had gone longest without reading (it
    /// gets the end marker when it reads).
    pub replay_displaced: u64,
    /// Replies in progress now.
    pub replay_open: u64,
    /// Replies in progress now whose peer was not reading at their last turn.
    pub replay_stalled: u64,
    /// Reply bytes ZMQ may hold now for all replay peers (an upper bound:
    /// each peer's last two accepted messages, until it reads on or leaves).
    pub replay_queued_bytes: u64,
    /// The largest `replay_queued_bytes` so far.
    pub replay_queued_peak: u64,
    /// Malformed replay requests (ignored).
    pub replay_bad_requests: u64,
}

/// What the sink and the driver share.
#[derive(Debug, Default)]
struct Shared {
    /// Events the sinks dropped (queue full), cumulative.
    lost: AtomicU64,
    closing: AtomicBool,
    /// Driver-side counters, published once per round.
    stats: Mutex<PublisherStats>,
}

impl Shared {
    fn snapshot(&self) -> PublisherStats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.queue_dropped = self.lost.load(Ordering::Acquire);
        s
    }
}

/// One queued event and the sinks' loss count when it was queued: the driver
/// places a resynchronisation barrier exactly where events went missing.
#[derive(Debug)]
struct Queued {
    lost_before: u64,
    event: InventoryEvent,
}

/// The endpoints the publisher actually bound (port 0 resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundEndpoints {
    /// The PUB socket's bound address, when it binds.
    pub pub_bound: Option<BindAddress>,
    /// The replay ROUTER's bound address, when replay is on.
    pub replay_bound: Option<BindAddress>,
}

/// A running publisher: its sockets and driver thread. Dropping it closes it
/// (as [`Publisher::close`]).
#[derive(Debug)]
pub struct Publisher {
    shared: Arc<Shared>,
    tx: SyncSender<Queued>,
    thread: Option<JoinHandle<()>>,
    bound: BoundEndpoints,
}

impl Publisher {
    /// Validates `config`, creates and binds/connects the sockets on the
    /// calling thread (so errors come back here), and starts the driver.
    /// The attach barrier (`AllBlocksCleared` for kvcr) is sequence 0.
    pub fn start(config: PublisherConfig) -> Result<Self> {
        config.validate()?;
        let sockets = driver::Sockets::open(&config)?;
        let bound = sockets.bound()?;
        let (tx, rx) = std::sync::mpsc::sync_channel(config.queue_capacity);
        let shared = Arc::new(Shared::default());
        let driver = driver::Driver::new(config, sockets, rx, Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("kvcr-publisher".into())
            .spawn(move || driver.run())
            .map_err(|_| Error::Publisher {
                reason: PublisherReason::Spawn,
            })?;
        Ok(Self {
            shared,
            tx,
            thread: Some(thread),
            bound,
        })
    }

    /// A sink for the runner (any number; each is cheap).
    pub fn sink(&self) -> PublisherSink {
        PublisherSink {
            tx: self.tx.clone(),
            shared: Arc::clone(&self.shared),
        }
    }

    /// The endpoints bound.
    pub fn bound(&self) -> &BoundEndpoints {
        &self.bound
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PublisherStats {
        self.shared.snapshot()
    }

    /// Detach: publishes what is queued, then the closing `AllBlocksCleared`
    /// barriers, waits up to `close_linger` for them to leave, and closes the
    /// sockets. Returns the final counters.
    pub fn close(mut self) -> Result<PublisherStats> {
        self.shutdown()?;
        Ok(self.shared.snapshot())
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.shared.closing.store(true, Ordering::Release);
        thread.join().map_err(|_| Error::Publisher {
            reason: PublisherReason::DriverPanicked,
        })
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // A panicked driver already stopped publishing; nothing more to do.
        let _ = self.shutdown();
    }
}

/// The runner's handle: an [`InventorySink`] that never blocks.
#[derive(Debug, Clone)]
pub struct PublisherSink {
    tx: SyncSender<Queued>,
    shared: Arc<Shared>,
}

impl PublisherSink {
    /// Queues `event`; returns whether it was queued (a full queue or a closed
    /// publisher drops it, and a full queue counts it in `queue_dropped`).
    pub fn try_publish(&self, event: InventoryEvent) -> bool {
        let lost_before = self.shared.lost.load(Ordering::Acquire);
        match self.tx.try_send(Queued { lost_before, event }) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.shared.lost.fetch_add(1, Ordering::AcqRel);
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}

impl InventorySink for PublisherSink {
    fn publish(&mut self, event: &InventoryEvent) {
        self.try_publish(event.clone());
    }
}
