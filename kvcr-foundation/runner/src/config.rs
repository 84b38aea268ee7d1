//! The runner's configuration: [`RunnerConfig`] (pools, timeouts, G3) and
//! the peer protocol's options ([`PeerOptions`], [`GuardOptions`],
//! [`PutSplit`], [`DataStream`]), with their defaults and checks.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use kvcr_contracts::endpoint::{AdvertisePolicy, BindAddress, ControlEndpoint, Host};
use kvcr_contracts::key::NamespaceId;
use kvcr_contracts::tier::Medium;
use kvcr_runner_core::{
    CoreConfig, G3Config, KVCR_REGION_PREFIX, MAX_REGION_ELEMENTS, MAX_REGION_LABEL, PoolConfig,
    PutSpan, RouteBudget,
};

use crate::error::{Error, Result, RunnerReason};
use crate::g3::{G3Options, G3Store};
use crate::net::ControlLimits;
use crate::net::member::{KeylessSources, StaticKey};
use kvcr_sys::placement::PoolMemory;

/// Runner configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerConfig {
    /// The pools, in layout order.
    pub pools: Vec<PoolConfig>,
    /// Budget of one operation, measured from its start (default 1 s).
    pub operation_timeout: Duration,
    /// Percent of a pool's slots below which reclaimable space raises
    /// `capacity_needed` (0 disables it, the default).
    pub capacity_low_watermark_percent: u8,
    /// The medium KVCR DRAM is published under (default `CPU_PINNED`).
    pub medium: Medium,
    /// Touch every pool page at startup so the first copies run at full speed.
    pub prefault: bool,
    /// How pools are backed (default: the original allocation; see
    /// [`PoolMemory`] for process-owned anonymous memory with huge pages and
    /// NUMA placement).
    pub pool_memory: PoolMemory,
    /// A file tier under KVCR DRAM (G3): evicted pages move there and are
    /// filled back on demand. Needs exactly one pool, whose block size is the
    /// G3 slot size (a multiple of the files' direct-I/O alignment). The
    /// default policy then moves victims to G3 (`g3-lru`).
    pub g3: Option<G3Options>,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            pools: Vec::new(),
            operation_timeout: Duration::from_secs(1),
            capacity_low_watermark_percent: 0,
            medium: Medium::CpuPinned,
            prefault: true,
            pool_memory: PoolMemory::Default,
            g3: None,
        }
    }
}

/// Largest single pool (bytes).
pub const MAX_POOL_BYTES: u64 = 1 << 46;

impl RunnerConfig {
    /// A one-pool configuration.
    pub fn single_pool(name: &str, block_size: u64, blocks: u32) -> Self {
        Self {
            pools: vec![PoolConfig {
                name: name.to_owned(),
                block_size,
                blocks,
            }],
            ..Self::default()
        }
    }

    /// Each pool's name, block size and block count, in layout order.
    pub(crate) fn pool_specs(&self) -> Vec<(String, u64, u32)> {
        self.pools
            .iter()
            .map(|p| (p.name.clone(), p.block_size, p.blocks))
            .collect()
    }

    /// The core's configuration: these pools at `pool_bases`, G3 as `g3`
    /// opened it (spilling ahead).
    pub(crate) fn core_config(
        &self,
        pool_bases: Vec<u64>,
        timeout_ns: u64,
        g3: Option<&G3Store>,
    ) -> CoreConfig {
        CoreConfig {
            pools: self.pool_specs(),
            pool_bases,
            operation_timeout_ns: timeout_ns,
            watermark_percent: self.capacity_low_watermark_percent,
            medium: self.medium,
            g3: g3.map(|store| G3Config {
                slots: u32::try_from(store.slots()).unwrap_or(u32::MAX),
                slot_bytes: store.slot_bytes(),
                alignment: store.alignment(),
                spill_ahead: true,
            }),
        }
    }

    /// Checks every bound.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, why| Err(Error::runner(RunnerReason::Config { field, why }));
        if self.pools.is_empty() {
            return bad("pools", "at least one pool is required");
        }
        if self.pools.len() > usize::from(u16::MAX) {
            return bad("pools", "too many pools");
        }
        for (i, pool) in self.pools.iter().enumerate() {
            if pool.block_size == 0 {
                return bad("pools.block_size", "must be at least 1 byte");
            }
            if pool.blocks == 0 || u64::from(pool.blocks) > MAX_REGION_ELEMENTS {
                return bad("pools.blocks", "must be in 1..=2^31");
            }
            if pool
                .block_size
                .checked_mul(u64::from(pool.blocks))
                .is_none_or(|b| b > MAX_POOL_BYTES)
            {
                return bad("pools", "block_size * blocks exceeds 64 TiB");
            }
            let name_ok = !pool.name.is_empty()
                && pool.name.len() <= MAX_REGION_LABEL - KVCR_REGION_PREFIX.len()
                && pool
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !name_ok {
                return bad("pools.name", "must be 1..=54 of [A-Za-z0-9_.-]");
            }
            if self.pools.iter().take(i).any(|p| p.name == pool.name) {
                return Err(Error::runner(RunnerReason::DuplicatePool(
                    kvcr_runner_core::Echo::new(&pool.name),
                )));
            }
        }
        if self.operation_timeout.is_zero() {
            return bad("operation_timeout", "must be positive");
        }
        if self.capacity_low_watermark_percent > 100 {
            return bad("capacity_low_watermark_percent", "must be in 0..=100");
        }
        if self.g3.is_some() && self.pools.len() != 1 {
            return bad(
                "g3",
                "G3 serves exactly one pool (its block size is the slot size)",
            );
        }
        Ok(())
    }
}

/// How a runner takes part in the peer protocol.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerOptions {
    /// Where the control channel listens (`tcp://*:0` picks a port).
    pub bind: BindAddress,
    /// The host other runners dial (with the bound port).
    pub advertise_host: Host,
    /// Whether a loopback advertise host is allowed (single-host clusters).
    pub advertise_policy: AdvertisePolicy,
    /// The cluster secret (at least [`PeerOptions::MIN_SECRET_LEN`] bytes):
    /// every control session is authenticated and encrypted under it, and a
    /// process without it cannot talk to this runner. Without one the runner
    /// serves loopback only: it binds `127.0.0.1` (or `::1`) whatever `bind`
    /// says, says so on stderr, and refuses a non-loopback advertise host.
    pub secret: Option<Vec<u8>>,
    /// Limits of the control channel (sessions, deadlines, frame and queue
    /// sizes).
    pub limits: ControlLimits,
    /// When non-empty, the only peers this runner talks to: hints naming
    /// another source are ignored and sessions from other endpoints refused
    /// (both counted as refused).
    pub allowed_peers: Vec<ControlEndpoint>,
    /// Namespaces only the listed target endpoints may fetch from this
    /// runner; others' requests for them are refused and counted.
    pub private_namespaces: Vec<(NamespaceId, Vec<ControlEndpoint>)>,
    /// UCX transports (`UCX_TLS`), e.g. `posix,cma,self` or `tcp,self`;
    /// `None` honours the `UCX_TLS` environment variable, and without it
    /// lets UCX choose among all but cma, knem and xpmem (which write into
    /// a process they name themselves; same-host writes map the target's
    /// pools instead). A peer address whose cma iface names another process
    /// than its posix fifo (or sits beside a sysv fifo), or that lists knem
    /// or xpmem, is refused when this host has them (`sm` names sysv, posix
    /// and cma together: its same-host UCX routes are refused).
    pub ucx_tls: Option<String>,
    /// Abandonment budget from op start (default 5 × the operation timeout).
    pub abandon_timeout: Option<Duration>,
    /// Cap on puts in flight, all writes together, when puts are not split;
    /// 0 picks per transport: when the transports include tcp, puts are
    /// split as [`PutSplit::TCP_DEFAULT`] unless `put_split` says otherwise
    /// (an unbounded number of large puts collapses TCP loopback to ~50 MB/s
    /// here), 64 whole puts otherwise. A value here with no split set keeps
    /// puts whole over tcp too.
    pub max_puts_in_flight: usize,
    /// Split sizing for large puts (default: off, except over tcp when
    /// `max_puts_in_flight` is not set either, see [`PutSplit::TCP_DEFAULT`]).
    pub put_split: PutSplit,
    /// Pools are sealed memfds a same-host source maps and writes itself,
    /// with one copy and nothing needed from this process (on by default;
    /// off: private memory, written through UCX only).
    pub same_host_mapping: bool,
    /// Copy lanes for writes into mapped same-host targets; 0 picks one per
    /// core, at most 8.
    pub lanes: usize,
    /// Bytes of pages a hinted fetch asks of its source per write (default
    /// [`PeerOptions::DEFAULT_WRITE_BATCH_BYTES`]): a larger fetch goes out
    /// as several writes that the source runs concurrently and that land one
    /// by one, so a hinted deliver moves the first pages on (to the GPU)
    /// while later ones are still crossing. 0: one write per source.
    pub write_batch_bytes: u64,
    /// Bytes of pages a device deliver grants a same-host source in one
    /// one-hop write (its pages straight into the GPU); `None` (the
    /// default): as [`Self::write_batch_bytes`]. Each write costs both ends
    /// a fixed share (its message and checks, its lead report and
    /// completion) beside its pages', and the first layer waits on the
    /// last write's lead. `Some(0)`: one write per source.
    pub one_hop_write_batch_bytes: Option<u64>,
    /// Writes through UCX of at most this many bytes (default
    /// [`PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES`]) leave as a write
    /// message, UCX active messages that carry the bytes and the write's
    /// completion together, when the target advertised a record key (see
    /// `doorbell`): no put acknowledgement round trip, no separate
    /// `write_done`. 0: always puts.
    pub write_message_max_bytes: u64,
    /// The largest part of a write message (default
    /// [`PeerOptions::DEFAULT_WRITE_MESSAGE_PART_BYTES`], at most
    /// [`PeerOptions::WRITE_MESSAGE_LIMIT`]): a larger write message is
    /// cut into equal parts, each its own active message with its own
    /// sealed header, which the target copies into place as each lands. A
    /// write that would need more than 256 parts goes as puts. 0: the
    /// default.
    pub write_message_part_bytes: u64,
    /// A guard that keeps this runner's pools, journal and control listener
    /// across its restarts ([`crate::guard`]); `None` (the default): the
    /// runner makes its own, and they die with it.
    pub guard: Option<GuardOptions>,
    /// How often one member (the key its sessions prove; a keyless session
    /// by its name) may make this runner, as its source, build it a new
    /// route (default [`RouteBudget::default`]: 4 at once, then one a
    /// second).
    pub route_budget: RouteBudget,
    /// Routes through UCX that attach this host's shared memory are refused
    /// (the target is answered that it has none, and its writes fail at
    /// once) while this process holds this many memory mappings or more:
    /// UCX 1.13 keeps the mappings of every distinct shared-memory segment
    /// a route unpacked until the runner stops, and a process past
    /// `vm.max_map_count` fails every `mmap`, the engine's too. 0 (the
    /// default): half of `vm.max_map_count` (65,530 by default), leaving
    /// the rest to the engine. Routes to other hosts (which attach nothing)
    /// and routes that map a same-host target's pools themselves are not
    /// limited.
    pub ucx_route_mapping_limit: usize,
    /// How often all targets together may make this source build routes
    /// (one [`RouteBudget`] over every member and name).
    /// Default [`RouteBudget::TOTAL`].
    pub route_budget_total: RouteBudget,
    /// Whether sources that reach this runner through UCX write into it
    /// over a data stream instead (see [`DataStream`]).
    pub data_stream: DataStream,
    /// Whether data streams carry AEAD records (see [`StreamSealing`];
    /// default: sealed when a cluster secret is set).
    pub stream_sealing: StreamSealing,
    /// Whether pages a same-host source checked as it copied them are read
    /// again on landing (see [`crate::LandingCheck`]; default: not).
    pub landing_check: crate::LandingCheck,
    /// As a target, also post each small `start_write` to a same-host
    /// source's mailbox in this runner's doorbell file (on by default): a
    /// source that maps the file and is awake takes it from there without
    /// waiting for the control socket (the socket copy still goes, and is
    /// dropped on arrival). Off: requests go by the control session alone.
    pub request_mailbox: bool,
    /// Offer and use the one-hop route (default on): a same-host source
    /// with a device copier writes a device deliver's pages from its KVCR
    /// DRAM straight into this runner's device regions, which the device
    /// copier exports ([`crate::DeviceCopier::export_device`]). Off, or
    /// where either side cannot: two hops through KVCR DRAM.
    pub one_hop: bool,
    // Member identity (see `crate::net::member`).
    /// This runner's static key pair: every session it opens or answers
    /// proves it, and its advertised endpoint names its public half
    /// (`?key=`). `None` (the default): a fresh pair at each start, or with
    /// a guard the group's key, which the guard keeps across restarts (a
    /// key here together with a guard is refused).
    pub static_key: Option<StaticKey>,
    /// Whether a hint whose source endpoint names no key is followed
    /// (default: not when a cluster secret is set).
    pub keyless_sources: KeylessSources,
}

/// Whether a target has its sources' writes come over a data stream: a
/// TCP connection of kvcr's own that it dials to a source whose route to
/// it is not one-copy, on which the source sends each write's bytes from
/// its pool with the write's sealed header, and which the target reads
/// straight into the write's granted elements (`crate::net::stream`). Over tcp
/// it saves the copy out of UCX's receive buffer, a put's acknowledgement
/// round trip and its `write_done`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataStream {
    /// On when the UCX transports are tcp alone (`ucx_tls`, or without it
    /// the `UCX_TLS` environment variable, names tcp and nothing but tcp
    /// and self): then UCX would carry the bytes over tcp too. Off when UCX
    /// chooses (it may find RDMA) or shared memory is named.
    #[default]
    Auto,
    /// Always, for every route that is not one-copy.
    On,
    /// Never: writes go through UCX (messages and puts).
    Off,
}

impl DataStream {
    /// Whether a target with these transports dials data streams.
    pub(crate) fn enabled(self, ucx_tls: Option<&str>) -> bool {
        match self {
            Self::On => true,
            Self::Off => false,
            Self::Auto => ucx_tls.is_some_and(|tls| {
                let names: Vec<&str> = tls.split(',').map(str::trim).collect();
                names.contains(&"tcp") && names.iter().all(|n| matches!(*n, "tcp" | "self"))
            }),
        }
    }
}

/// Whether a data stream's payloads are sealed: every frame's prefix and
/// every record of its payload AES-256-GCM under a key of the stream's
/// own, derived from the control session it proved (see
/// `crate::net::stream`). Sealed, an observer or relay on the path between
/// two members reads no page byte, and an altered, replayed, reordered or
/// truncated record ends the stream and fails the write it carried, at
/// once. It costs the source a copy of each page into a send buffer and a
/// pass to seal it, and the target a pass to open it in place.
///
/// A target asks for what its option says when it dials; a source whose
/// option says sealed refuses a stream that asks for plain records (the
/// target's writes then go through UCX), and serves sealed records to any
/// target that asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamSealing {
    /// Sealed when a cluster secret is set; plain without one, where the
    /// control listener, and so every data stream, is on loopback only.
    #[default]
    Auto,
    /// Always sealed.
    On,
    /// Plain: the payloads go in the clear, as UCX's tcp puts do, from the
    /// pool with no copy. What this gives up: anyone who can read the
    /// network path between two members reads the KV pages they restore,
    /// and bytes altered on the way are caught only by the page digests
    /// (which fail the altered keys, `FailReason::DigestMismatch`), not
    /// refused at the record. Only for networks where that is acceptable.
    Off,
}

impl StreamSealing {
    /// Whether records are sealed, with or without a cluster secret.
    pub(crate) fn sealed(self, with_secret: bool) -> bool {
        match self {
            Self::On => true,
            Self::Off => false,
            Self::Auto => with_secret,
        }
    }
}

/// Where a runner's pool memory and control listener outlive it: a
/// `kvcr-guard` process ([`crate::guard`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardOptions {
    /// The guard's Unix socket.
    pub socket: std::path::PathBuf,
    /// The group this runner claims: one per rank (a TP rank's global
    /// offset, say). A group's first claim fixes its layout.
    pub group: u32,
    /// The engine's compatibility digest (model, dtype, page and layout); a
    /// claim with another digest is refused.
    pub compat_digest: u64,
    /// Bytes of the residency journal (default
    /// [`GuardOptions::DEFAULT_JOURNAL_BYTES`]). Half of it must hold a
    /// snapshot of every page at once (about 60 bytes a page plus 4 a
    /// token), or warm recovery is disabled when it overflows.
    pub journal_bytes: u64,
    /// How long the claim may take (the guard answers at once; 5 s).
    pub claim_timeout: Duration,
}

impl GuardOptions {
    /// 64 MiB: two halves of 32 MiB, a snapshot of ~100,000 pages of 64
    /// tokens.
    pub const DEFAULT_JOURNAL_BYTES: u64 = 64 << 20;

    /// The guard at `socket`, group `group`, with the defaults.
    pub fn new(socket: impl Into<std::path::PathBuf>, group: u32, compat_digest: u64) -> Self {
        Self {
            socket: socket.into(),
            group,
            compat_digest,
            journal_bytes: Self::DEFAULT_JOURNAL_BYTES,
            claim_timeout: Duration::from_secs(5),
        }
    }
}

impl std::fmt::Debug for PeerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret never reaches a log.
        f.debug_struct("PeerOptions")
            .field("bind", &self.bind)
            .field("advertise_host", &self.advertise_host)
            .field("advertise_policy", &self.advertise_policy)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("limits", &self.limits)
            .field("allowed_peers", &self.allowed_peers)
            .field("private_namespaces", &self.private_namespaces)
            .field("ucx_tls", &self.ucx_tls)
            .field("abandon_timeout", &self.abandon_timeout)
            .field("max_puts_in_flight", &self.max_puts_in_flight)
            .field("put_split", &self.put_split)
            .field("same_host_mapping", &self.same_host_mapping)
            .field("lanes", &self.lanes)
            .field("write_batch_bytes", &self.write_batch_bytes)
            .field("one_hop_write_batch_bytes", &self.one_hop_write_batch_bytes)
            .field("write_message_max_bytes", &self.write_message_max_bytes)
            .field("write_message_part_bytes", &self.write_message_part_bytes)
            .field("guard", &self.guard)
            .field("route_budget", &self.route_budget)
            .field("ucx_route_mapping_limit", &self.ucx_route_mapping_limit)
            .field("route_budget_total", &self.route_budget_total)
            .field("data_stream", &self.data_stream)
            .field("stream_sealing", &self.stream_sealing)
            .field("landing_check", &self.landing_check)
            .field("request_mailbox", &self.request_mailbox)
            .field("one_hop", &self.one_hop)
            .field("static_key", &self.static_key)
            .field("keyless_sources", &self.keyless_sources)
            .finish()
    }
}

/// Split sizing: a put larger than `chunk_bytes` is issued as chunks of that
/// size, at most `max_chunks_in_flight` at once over all writes (a write is
/// flushed and reported once, after its last chunk, exactly as unsplit).
/// Over tcp, puts are split as [`PutSplit::TCP_DEFAULT`] unless configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PutSplit {
    /// Chunk size in bytes; 0: not configured (off, except over tcp with
    /// no `max_puts_in_flight` either: [`PutSplit::TCP_DEFAULT`]).
    pub chunk_bytes: u64,
    /// Cap on chunks in flight, all writes together, while splitting; 0 picks per
    /// transport ([`PutSplit::TCP_IN_FLIGHT`] when the transports include
    /// tcp, [`PutSplit::SHM_IN_FLIGHT`] otherwise).
    pub max_chunks_in_flight: usize,
}

impl PutSplit {
    /// Chunks in flight on tcp when not configured: one (two or more
    /// outstanding large puts cut TCP loopback throughput here, see
    /// `reference/dependencies-and-machine-anchors.md` §3).
    pub const TCP_IN_FLIGHT: usize = 1;
    /// Chunks in flight on shared memory when not configured.
    pub const SHM_IN_FLIGHT: usize = 8;

    /// How puts over tcp are split when nothing is configured: 1 MiB
    /// chunks, 8 in flight. UCX's tcp receiver reads a put's header with up
    /// to a receive segment (256 KiB) of its payload into its own buffer and
    /// copies that part out; the rest lands straight from the socket, so the
    /// larger the chunk, the less is copied twice. On the 16-core H200 host,
    /// one 16 MiB request against the same request over a plain TCP socket
    /// in the same blocks (`--request-blocks`, eight blocks per run, five
    /// alternating runs): 1.08–1.38 × the socket's time with 1 MiB × 8,
    /// 1.21–1.56 × with 128 KiB × 8 (the default before), 1 MiB requests
    /// level (1.31–1.52 against 1.20–1.48); `peer.fetch_16mib_tcp`
    /// 2.88–3.56 GB/s against 2.51–2.73. On the 2-vCPU VM the sizes were
    /// level (`peer --bench --tcp-bulk`, 4 × 16 MiB per fetch: 128 KiB × 8
    /// 2.88–3.17 GB/s, 1 MiB × 2 2.53–3.42; whole puts, 2 in flight,
    /// 1.84–2.87; 4 MiB × 2 2.12–2.56).
    pub const TCP_DEFAULT: PutSplit = PutSplit {
        chunk_bytes: 1 << 20,
        max_chunks_in_flight: 8,
    };

    /// Splitting on, with `chunk_bytes` chunks and the per-transport cap.
    pub fn chunks_of(chunk_bytes: u64) -> Self {
        Self {
            chunk_bytes,
            max_chunks_in_flight: 0,
        }
    }

    /// Cuts `spans` into chunks of at most `chunk_bytes` (unchanged when off).
    pub(crate) fn split(&self, spans: Vec<PutSpan>) -> VecDeque<PutSpan> {
        if self.chunk_bytes == 0 || spans.iter().all(|s| s.len <= self.chunk_bytes) {
            return spans.into();
        }
        let mut out = VecDeque::with_capacity(spans.len());
        for span in spans {
            let mut done = 0;
            while done < span.len {
                let len = (span.len - done).min(self.chunk_bytes);
                out.push_back(PutSpan {
                    local: span.local + done,
                    remote: span.remote + done,
                    len,
                    region: span.region,
                });
                done += len;
            }
        }
        out
    }
}

impl PeerOptions {
    /// The shortest cluster secret accepted.
    pub const MIN_SECRET_LEN: usize = 16;
    /// Default bytes per write of a hinted fetch: 64 MiB is 8 lane pieces of
    /// 8 MiB on the source and a few engine pages, so the destination's next
    /// hop starts after a fraction of a large restore while a one-block or a
    /// 16 MiB fetch stays a single write (one control round trip). Measured
    /// on the H200 host (TP=2, 8 MiB pages, pipelined into the GPU): 8 MiB
    /// batches halve the restore (each batch is a GPU job with a fixed
    /// cost); 32 and 128 MiB both reach 0.76–0.90 of the slower hop.
    pub const DEFAULT_WRITE_BATCH_BYTES: u64 = 64 << 20;
    /// Default largest write sent as a message (see
    /// [`PeerOptions::write_message_max_bytes`]). One-key requests over tcp,
    /// p50s of alternating runs as a message against as a put and its flush:
    /// on the 2-vCPU VM 64 KiB 39–49 against 56–70 µs, 128 KiB 63–68 against
    /// 80–85, 256 KiB 110–113 against 110–120; on the H200 host 64 KiB 71–78
    /// against 106–111 µs, 256 KiB 185–190 against 198–205. A 1 MiB write
    /// as one message was no faster than puts (418–805 against 408–561 µs:
    /// UCX reassembles the whole message before the target copies it once
    /// more); cut into 64 KiB parts, each copied as it lands, it is
    /// (2-vCPU VM, 100 requests per run, four alternating runs: 414–452 µs
    /// in three against 529–566 as puts). A 16 MiB write in parts was
    /// slower than puts (0.9–2.2 against 2.1–2.3 GB/s: the target's one
    /// thread copies every byte), so larger writes stay puts.
    pub const DEFAULT_WRITE_MESSAGE_BYTES: u64 = 1 << 20;
    /// Default largest part of a write message (see
    /// [`PeerOptions::write_message_part_bytes`]): one tcp segment's worth
    /// (`kvcr_ucx::TCP_SEGMENT_SIZES`). 1 MiB requests, 2-vCPU VM: 16 KiB
    /// parts 684 µs, 32 KiB 486, 64 KiB 405–452, 128 KiB 354–908 (and
    /// 256 KiB 472–591), puts 529–566.
    pub const DEFAULT_WRITE_MESSAGE_PART_BYTES: u64 = 64 << 10;
    /// The largest write message part a target accepts: larger ones are
    /// dropped unread (their operation then ends by deadline), so a source
    /// never sends one.
    pub const WRITE_MESSAGE_LIMIT: u64 = 256 << 10;

    /// The same options with a cluster secret.
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// A single-host configuration on loopback with an ephemeral port, UCX
    /// on shared memory.
    pub fn loopback() -> Self {
        Self {
            bind: BindAddress {
                host: Some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
                port: 0,
            },
            advertise_host: Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
            advertise_policy: AdvertisePolicy::SingleHost,
            secret: None,
            limits: ControlLimits::default(),
            allowed_peers: Vec::new(),
            private_namespaces: Vec::new(),
            ucx_tls: Some("posix,cma,self".to_owned()),
            abandon_timeout: None,
            max_puts_in_flight: 0,
            put_split: PutSplit::default(),
            same_host_mapping: true,
            write_batch_bytes: Self::DEFAULT_WRITE_BATCH_BYTES,
            one_hop_write_batch_bytes: None,
            write_message_max_bytes: Self::DEFAULT_WRITE_MESSAGE_BYTES,
            write_message_part_bytes: Self::DEFAULT_WRITE_MESSAGE_PART_BYTES,
            lanes: 0,
            guard: None,
            route_budget: RouteBudget::default(),
            ucx_route_mapping_limit: 0,
            route_budget_total: RouteBudget::TOTAL,
            data_stream: DataStream::Auto,
            stream_sealing: StreamSealing::Auto,
            landing_check: crate::LandingCheck::TrustCopyCheck,
            request_mailbox: true,
            one_hop: true,
            static_key: None,
            keyless_sources: KeylessSources::default(),
        }
    }
}

/// Where the control listener binds. Without a cluster secret only loopback
/// is served, whatever `bind` says (and a non-loopback advertise host is
/// refused: no other host could talk to this runner).
pub(crate) fn control_bind_address(options: &PeerOptions) -> Result<SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let config = |field, why| Error::runner(RunnerReason::Config { field, why });
    let requested = options
        .bind
        .host
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    options
        .limits
        .check()
        .map_err(|why| config("peer.limits", why))?;
    let Some(secret) = options.secret.as_deref() else {
        if !options.advertise_host.is_loopback() {
            return Err(config(
                "peer.secret",
                "no cluster secret: a runner without one serves loopback only; set a secret to advertise a non-loopback host",
            ));
        }
        let loopback = match requested {
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        };
        if requested.is_loopback() {
            return Ok(SocketAddr::new(requested, options.bind.port));
        }
        eprintln!(
            "kvcr: no cluster secret set: the peer control channel listens on {loopback} only (set a secret to serve other hosts)"
        );
        return Ok(SocketAddr::new(loopback, options.bind.port));
    };
    if secret.len() < PeerOptions::MIN_SECRET_LEN {
        return Err(config(
            "peer.secret",
            "the cluster secret must be at least 16 bytes",
        ));
    }
    Ok(SocketAddr::new(requested, options.bind.port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcr_contracts::protocol::RegionId;

    fn span(local: u64, remote: u64, len: u64) -> PutSpan {
        PutSpan {
            local,
            remote,
            len,
            region: RegionId(3),
        }
    }

    /// The tcp default cuts a 16 MiB page into 16 chunks that tile it.
    #[test]
    fn the_tcp_default_cuts_a_large_page_into_small_chunks() {
        let chunks = PutSplit::TCP_DEFAULT.split(vec![span(0, 1 << 30, 16 << 20)]);
        assert_eq!(chunks.len(), 16);
        assert!(chunks.iter().all(|c| c.len == 1 << 20));
        assert_eq!(
            chunks.back().map(|c| c.remote + c.len),
            Some((1 << 30) + (16 << 20))
        );
    }

    #[rstest::rstest]
    #[case::tcp_alone(DataStream::Auto, Some("tcp,self"), true)]
    #[case::tcp_spaced(DataStream::Auto, Some(" tcp "), true)]
    #[case::tcp_beside_shared_memory(DataStream::Auto, Some("sm,tcp,self"), false)]
    #[case::rdma(DataStream::Auto, Some("rc,tcp"), false)]
    #[case::shared_memory(DataStream::Auto, Some("posix,cma,self"), false)]
    #[case::ucx_chooses(DataStream::Auto, None, false)]
    #[case::on(DataStream::On, Some("sm,self"), true)]
    #[case::off(DataStream::Off, Some("tcp,self"), false)]
    fn data_streams_follow_the_option_and_the_transports(
        #[case] mode: DataStream,
        #[case] tls: Option<&str>,
        #[case] enabled: bool,
    ) {
        assert_eq!(mode.enabled(tls), enabled);
    }

    #[test]
    fn splitting_off_keeps_every_span_whole() {
        let spans = vec![span(0, 1000, 40 << 20), span(64, 9, 5)];
        let out: Vec<_> = PutSplit::default().split(spans.clone()).into();
        assert_eq!(out, spans);
    }

    #[test]
    fn split_chunks_tile_each_span_exactly_and_never_cross_spans() {
        let spans = vec![span(4096, 1 << 30, 10 << 20), span(0, 77, 3)];
        let out: Vec<_> = PutSplit::chunks_of(4 << 20).split(spans).into();
        assert_eq!(
            out,
            vec![
                span(4096, 1 << 30, 4 << 20),
                span(4096 + (4 << 20), (1 << 30) + (4 << 20), 4 << 20),
                span(4096 + (8 << 20), (1 << 30) + (8 << 20), 2 << 20),
                span(0, 77, 3),
            ]
        );
    }
}
