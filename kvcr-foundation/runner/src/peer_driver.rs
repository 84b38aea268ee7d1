//! The peer thread: owns the UCX context, worker, endpoints and the
//! registered pool memory (UCX objects are `!Send`, so they live and die on
//! this one thread), and runs the control channel on a current-thread tokio
//! runtime. It feeds control messages and put completions into the shared core
//! and executes the core's peer actions (send, connect, put + flush).
//!
//! Writes into a same-host target whose pools this process mapped
//! ([`crate::shared_memory`]) are plain copies on the lanes
//! ([`crate::lanes`]); the thread sleeps until the last lane reports.
//! While UCX puts are in flight (or a source may be putting into us through
//! UCX) the loop progresses the worker continuously (a transfer's
//! duration); otherwise it sleeps on its queues, the worker's event fd and
//! a timer set to the core's next peer deadline (at most a quarter of the
//! operation timeout, for stall detection): an idle runner does not wake.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::Shared;
use super::contention;
use super::control::{
    ChannelEvent, ControlChannel, ControlLimits, ControlStats, Inbound, PeerIdentity,
};
use super::placement::{self, AnonMapping, PlacementOutcome, PoolMemory};
use crate::doorbell::{
    OpenedMessage, Part, PartFit, Polled, REGION_BYTES, RecordKey, RouteDoorbell, RouteMailbox,
    SLOT_BYTES, TargetDoorbell,
};
use crate::error::{Error, Result, RunnerReason};
use crate::lanes::Lanes;
use crate::shared_memory::{HostScope, PeerSegment, SharedPool};
use crate::stream::{InStream, Lander, Landing, OutStream};
use kvcr_contracts::endpoint::{AdvertisePolicy, BindAddress, ControlEndpoint, Host};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::NamespaceId;
use kvcr_contracts::protocol::{Body, Message, RegionId, SharedMemoryAdvert};
use kvcr_runner_core::{Action, ConnectFailure, CopySpan, PutSpan, RouteBudget};
use kvcr_ucx::{
    AnonOptions, CloseMode, Completion, Context, ContextConfig, Endpoint, ErrorMode, MessageLimits,
    Registration, RemoteKey, RkeyBuffer, WorkerAddress,
};

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
    /// UCX transports (`UCX_TLS`), e.g. `sm,self` or `tcp,self`; `None` lets
    /// UCX choose (and honours the `UCX_TLS` environment variable).
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
    /// How often a target may make this runner, as its source, build it a
    /// new route (default [`RouteBudget::default`]: 4 at once, then one a
    /// second).
    pub route_budget: RouteBudget,
    /// Routes through UCX are refused (the target is answered that it has
    /// none, and its writes fail at once) while this process holds this
    /// many memory mappings or more: UCX 1.13 keeps the mappings of every
    /// distinct shared-memory segment a route unpacked until the runner
    /// stops, and a process past `vm.max_map_count` fails every `mmap`,
    /// the engine's too. 0 (the default): half of `vm.max_map_count`
    /// (65,530 by default), leaving the rest to the engine. Routes that map
    /// a same-host target's pools themselves are not limited.
    pub ucx_route_mapping_limit: usize,
    /// Whether sources that reach this runner through UCX write into it
    /// over a data stream instead (see [`DataStream`]).
    pub data_stream: DataStream,
    /// As a target, also post each small `start_write` to a same-host
    /// source's mailbox in this runner's doorbell file (on by default): a
    /// source that maps the file and is awake takes it from there without
    /// waiting for the control socket (the socket copy still goes, and is
    /// dropped on arrival). Off: requests go by the control session alone.
    pub request_mailbox: bool,
}

/// Whether a target has its sources' writes come over a data stream: a
/// TCP connection of kvcr's own that it dials to a source whose route to
/// it is not one-copy, on which the source sends each write's bytes from
/// its pool with the write's sealed header, and which the target reads
/// straight into the write's granted elements (`crate::stream`). Over tcp
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

/// Most write messages (parts) held between a worker progress and their
/// handling (received from anyone; each is dropped unread if it does not
/// verify): with [`PeerOptions::WRITE_MESSAGE_LIMIT`], at most 16 MiB of
/// UCX's receive buffers wait on us. One progress call delivers what one
/// read of the socket held (a 256 KiB receive segment: four 64 KiB parts),
/// and they are taken after each.
const MAX_HELD_MESSAGES: usize = 64;
/// Most data streams held while their routes are built (each also holds
/// its place under the control channel's caps until then).
const MAX_PARKED_STREAMS: usize = 64;

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
            .field("write_message_max_bytes", &self.write_message_max_bytes)
            .field("write_message_part_bytes", &self.write_message_part_bytes)
            .field("guard", &self.guard)
            .field("route_budget", &self.route_budget)
            .field("ucx_route_mapping_limit", &self.ucx_route_mapping_limit)
            .field("data_stream", &self.data_stream)
            .field("request_mailbox", &self.request_mailbox)
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
            write_message_max_bytes: Self::DEFAULT_WRITE_MESSAGE_BYTES,
            write_message_part_bytes: Self::DEFAULT_WRITE_MESSAGE_PART_BYTES,
            lanes: 0,
            guard: None,
            route_budget: RouteBudget::default(),
            ucx_route_mapping_limit: 0,
            data_stream: DataStream::Auto,
            request_mailbox: true,
        }
    }
}

/// What the peer thread hands back once it is up.
pub(crate) struct PeerSetup {
    pub(crate) endpoint: ControlEndpoint,
    pub(crate) bases: Vec<u64>,
    pub(crate) rkeys: Vec<Vec<u8>>,
    pub(crate) worker_address: Vec<u8>,
    /// Per pool: what placing it did (`None` with `PoolMemory::Default`).
    pub(crate) placements: Vec<Option<PlacementOutcome>>,
    /// The pools a same-host source may map (`None`: none can be).
    pub(crate) shared_memory: Option<SharedMemoryAdvert>,
}

/// Commands for the peer thread.
// Actions are most of the traffic (one or more per operation): boxing them
// would allocate for each, to shrink the two rare variants.
#[allow(clippy::large_enum_variant)]
pub(crate) enum PeerCmd {
    /// Execute a core action.
    Action(Action),
    /// Forget a peer: close its control socket and data route.
    Forget(ControlEndpoint),
    /// Stop; with `leak`, keep the registered memory mapped for the life of the
    /// process (a remote write might still land in it).
    Stop { leak: bool },
}

/// Handle to the peer thread.
pub(crate) struct PeerDriver {
    pub(crate) tx: mpsc::UnboundedSender<PeerCmd>,
    pub(crate) stats: Arc<ControlStats>,
    thread: Option<JoinHandle<()>>,
    shared_tx: Option<oneshot::Sender<Arc<Shared>>>,
}

impl PeerDriver {
    /// Starts the thread, which allocates and registers one pool per entry of
    /// `pool_bytes`, binds the control channel and creates the UCX worker.
    pub(crate) fn start(
        options: &PeerOptions,
        incarnation: Incarnation,
        pool_bytes: Vec<u64>,
        prefault: bool,
        pool_memory: &PoolMemory,
        adopted: Option<Adopted>,
    ) -> Result<(Self, PeerSetup)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let pool_memory = pool_memory.clone();
        let (setup_tx, setup_rx) = std::sync::mpsc::channel();
        let (shared_tx, shared_rx) = oneshot::channel();
        let options = options.clone();
        let thread = std::thread::Builder::new()
            .name("kvcr-peer".into())
            .spawn(move || {
                run(
                    options,
                    incarnation,
                    (pool_bytes, prefault, pool_memory, adopted),
                    rx,
                    setup_tx,
                    shared_rx,
                )
            })
            .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))?;
        let outcome = setup_rx.recv_timeout(Duration::from_secs(30));
        let (setup, stats) = match outcome {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                // The thread is stuck in UCX or a bind: it may hold memory we
                // cannot prove quiescent, so it is left running, and the error
                // says the resources were retained.
                return Err(Error::Startup {
                    stage: "start peer",
                    retained: true,
                    cause: Box::new(Error::runner(RunnerReason::Config {
                        field: "peer",
                        why: "peer thread did not start within 30 s",
                    })),
                });
            }
        };
        Ok((
            Self {
                tx,
                stats,
                thread: Some(thread),
                shared_tx: Some(shared_tx),
            },
            setup,
        ))
    }

    /// Hands the shared core to the thread (after the runner is built).
    pub(crate) fn attach(&mut self, shared: Arc<Shared>) {
        if let Some(tx) = self.shared_tx.take() {
            let _ = tx.send(shared);
        }
    }

    /// Stops the thread and joins it.
    pub(crate) fn stop(&mut self, leak: bool) {
        self.shared_tx = None;
        let _ = self.tx.send(PeerCmd::Stop { leak });
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            eprintln!("kvcr: peer thread panicked");
        }
    }
}

type SetupResult = Result<(PeerSetup, Arc<ControlStats>)>;

/// Pool sizes, whether to pre-fault, how to back them, and what a guard
/// handed over instead.
type PoolSpec = (Vec<u64>, bool, PoolMemory, Option<Adopted>);

/// Pool files and the control listener a guard handed over
/// ([`crate::guard`]): the runner maps those files (their bytes kept) and
/// accepts on that listener instead of making its own.
#[derive(Debug)]
pub(crate) struct Adopted {
    /// One pool file and its name token per pool, in order; `None`: the
    /// runner makes its own pools (the guard's could not be recovered).
    pub(crate) pools: Option<Vec<(std::fs::File, [u8; 16])>>,
    pub(crate) listener: std::net::TcpListener,
}

fn run(
    options: PeerOptions,
    incarnation: Incarnation,
    (pool_bytes, prefault, pool_memory, adopted): PoolSpec,
    rx: mpsc::UnboundedReceiver<PeerCmd>,
    setup_tx: std::sync::mpsc::Sender<SetupResult>,
    shared_rx: oneshot::Receiver<Arc<Shared>>,
) {
    precise_naps();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(_) => {
            let _ = setup_tx.send(Err(Error::runner(RunnerReason::Config {
                field: "peer",
                why: "could not start the peer runtime",
            })));
            return;
        }
    };
    runtime.block_on(async move {
        let mut state = match State::setup(
            &options,
            incarnation,
            &pool_bytes,
            prefault,
            &pool_memory,
            adopted,
        )
        .await
        {
            Ok((state, setup)) => {
                let stats = Arc::clone(&state.control.stats);
                let _ = setup_tx.send(Ok((setup, stats)));
                state
            }
            Err(e) => {
                let _ = setup_tx.send(Err(e));
                return;
            }
        };
        let Ok(shared) = shared_rx.await else {
            return; // startup failed later; dropping `state` releases everything
        };
        let leak = state.serve(&shared, rx).await;
        if leak {
            // A remote write may still land in our pools: keep every UCX
            // object (and so the mapping) alive until the process exits.
            std::mem::forget(state);
        } else {
            state.drain_worker();
        }
    });
}

/// A data stream dial's outcome: the source, the session (ours, to it)
/// whose key it proved, and the connection (`None`: it failed).
type DialedStream = (ControlEndpoint, u64, Option<tokio::net::TcpStream>);

/// A target's remote keys and region bases, by region.
type RemoteKeys = HashMap<RegionId, (RemoteKey, u64)>;

struct Route {
    generation: u64,
    /// How writes reach the target: copies into its mapped pools on the
    /// lanes, or UCX puts.
    path: RoutePath,
    /// Where a write's completion is rung ahead of its `write_done` (a
    /// one-copy route to a target that advertised a doorbell).
    doorbell: Option<RouteDoorbell>,
    /// The session's record key, on a UCX route to a target that sent one,
    /// and its bytes: small writes leave as messages sealed with it, and a
    /// data stream the target dials proves it (and is bound to those bytes).
    session_key: Option<(RecordKey, [u8; 32])>,
    /// Our mailbox in the target's doorbell file (a one-copy route), and the
    /// id of the session (the target's, to us) whose metadata sent its key:
    /// requests read there are that session's messages.
    mailbox: Option<(RouteMailbox, u64)>,
}

enum RoutePath {
    /// Every advertised region is mapped here: no UCX endpoint is ever made
    /// (no wire-up, no transport resources, nothing UCX parses).
    OneCopy(HashMap<RegionId, Arc<PeerSegment>>),
    /// The target's UCX endpoint and remote keys.
    Ucx {
        endpoint: Endpoint,
        rkeys: RemoteKeys,
    },
}

impl Route {
    fn one_copy(&self) -> bool {
        matches!(self.path, RoutePath::OneCopy(_))
    }

    fn ucx_endpoint(&self) -> Option<&Endpoint> {
        match &self.path {
            RoutePath::Ucx { endpoint, .. } => Some(endpoint),
            RoutePath::OneCopy(_) => None,
        }
    }
}

/// Hands `taken` (messages read from shared memory: doorbell records or
/// mailbox requests, each with its session's identity) to the core in one
/// lock, and counts them and the `refused` ones in `(taken, refused)`.
/// `true`: there was one.
fn hand_to_core(
    shared: &Arc<Shared>,
    taken: Vec<Message>,
    refused: u64,
    (taken_count, refused_count): (&AtomicU64, &AtomicU64),
) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    refused_count.fetch_add(refused, Relaxed);
    if taken.is_empty() {
        return false;
    }
    taken_count.fetch_add(taken.len() as u64, Relaxed);
    shared.with_core_now(|core, now| {
        for message in taken {
            core.handle_message(now, message);
        }
    });
    true
}

/// Rounds of [`State::drain_queued`] in one turn at most.
const DRAIN_ROUNDS: usize = 4;

/// Why [`State::sleep_on_events`] returned.
enum Woken {
    /// A UCX event, events already pending, or nothing to note: go round
    /// and progress.
    Event,
    /// A command, control message or lane report was handled.
    Activity,
    /// The nap ended: the core's deadline may be due.
    Deadline,
    /// A command or a closed channel stops the thread (`leak`).
    Stop(bool),
}

struct PendingWrite {
    write: u64,
    /// The route the write was accepted on: its puts go through this one
    /// only, even if the target's route is replaced or dropped meanwhile (a
    /// replacement may be another process at the same address).
    route: Rc<Route>,
    spans: VecDeque<PutSpan>,
    in_flight: VecDeque<Completion>,
    flush: Option<Completion>,
    failed: bool,
    /// Sent as one message (its completion inside): ends when the message
    /// has left, with no flush.
    as_message: bool,
}

/// Everything the peer thread owns. Field order is drop order and is
/// load-bearing: pending operations and routes (endpoints, remote keys) go
/// before the pool registrations, which go before the worker and context.
struct State {
    /// The worker's event fd registered with the runtime (dropped before the
    /// worker, which owns the fd).
    efd: Option<tokio::io::unix::AsyncFd<RawFdRef>>,
    pending: Vec<PendingWrite>,
    /// Data streams targets dialed to us (as their source), by target; the
    /// frames they queue read our pools, so they go before them.
    out_streams: HashMap<ControlEndpoint, OutStream>,
    /// Data streams that arrived before the route their proof is checked
    /// against (a target dials one beside the metadata that route is built
    /// from), by claimed target, with when they arrived: checked when that
    /// route is built, dropped at the handshake deadline.
    parked_streams: HashMap<ControlEndpoint, (Instant, crate::control::AcceptedStream)>,
    /// Data streams we dialed to our sources (as their target), by source;
    /// they read into our pools.
    in_streams: HashMap<ControlEndpoint, InStream<OpenedMessage>>,
    /// Sources a data stream is being dialed to.
    dialing: HashSet<ControlEndpoint>,
    streams_dialed_tx: mpsc::UnboundedSender<DialedStream>,
    streams_dialed: mpsc::UnboundedReceiver<DialedStream>,
    /// Whether we dial data streams to our sources ([`DataStream`]).
    data_stream: bool,
    /// Whether we post requests to our sources' mailboxes
    /// ([`PeerOptions::request_mailbox`]).
    request_mailbox: bool,
    /// Our control endpoint (what a data stream we dial claims).
    endpoint: ControlEndpoint,
    /// Per target, the doorbell key its latest metadata carried and the
    /// session that metadata came on (a route built from that metadata reads
    /// its mailbox as that session's).
    advertised_keys: HashMap<ControlEndpoint, ([u8; 32], u64)>,
    /// How long a data stream's dial and proof may take, and how long a
    /// stream may take no bytes while frames wait.
    stream_limits: (Duration, Duration),
    routes: HashMap<ControlEndpoint, Rc<Route>>,
    control: ControlChannel,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    /// Joined (after their queued copies) before the pools they read drop.
    lanes: Lanes,
    lane_done_tx: mpsc::UnboundedSender<(u64, bool)>,
    lane_done: mpsc::UnboundedReceiver<(u64, bool)>,
    /// This process's host and pid namespace (`None`: never maps peers).
    scope: Option<HostScope>,
    /// The name tokens of our own pools (never mapped as a peer's).
    own_tokens: Vec<[u8; 16]>,
    /// Our doorbell as a target: its slots a shared file registered like
    /// our pools when they are shared segments, plain registered memory
    /// otherwise; its per-session keys seal doorbell records and write
    /// messages.
    doorbell: TargetDoorbell,
    /// Records to ring when one-copy writes finish: the target's doorbell
    /// mapping, the record, and its slot's target address, by write.
    rings: HashMap<u64, (Arc<PeerSegment>, [u8; SLOT_BYTES], u64)>,
    pools: Vec<Registration<'static>>,
    worker: kvcr_ucx::Worker,
    _context: Context,
    max_in_flight: usize,
    put_split: PutSplit,
    write_message_max_bytes: u64,
    write_message_part_bytes: u64,
    /// Messages the worker had dropped at its bounds when last looked at.
    messages_dropped: u64,
    /// Since when an idle turn found the worker unarmable (events pending)
    /// and its progress found nothing (see `sleep_on_events`).
    unarmable_since: Option<Instant>,
    /// UCX routes are refused while this process holds this many memory
    /// mappings ([`PeerOptions::ucx_route_mapping_limit`], resolved).
    ucx_route_mapping_limit: usize,
}

impl State {
    async fn setup(
        options: &PeerOptions,
        incarnation: Incarnation,
        pool_bytes: &[u64],
        prefault: bool,
        pool_memory: &PoolMemory,
        adopted: Option<Adopted>,
    ) -> Result<(Self, PeerSetup)> {
        let (mut adopted_pools, adopted_listener) = match adopted {
            Some(a) if a.pools.as_ref().is_none_or(|p| p.len() == pool_bytes.len()) => {
                (a.pools.map(Vec::into_iter), Some(a.listener))
            }
            Some(_) => {
                return Err(Error::runner(RunnerReason::Config {
                    field: "guard grant",
                    why: "the grant's pool count differs from the configuration's",
                }));
            }
            None => (None, None),
        };
        let mut config = ContextConfig::new();
        if let Some(tls) = &options.ucx_tls {
            // A runner that advertises loopback keeps tcp on loopback; one
            // that peers dial over a network must not (it did: every
            // cross-host tcp route failed "Destination is unreachable",
            // found by the between-hosts scenarios). `UCX_NET_DEVICES` in
            // the environment wins either way.
            let on_loopback =
                pins_tcp_to_loopback(options, std::env::var_os("UCX_NET_DEVICES").is_some());
            config = if on_loopback {
                config.loopback_tls(tls)
            } else {
                config.set("TLS", tls)
            };
            // UCX reports dead peers only on network transports; its 1.13
            // shared-memory transports refuse endpoints in that mode.
            if tls.split(',').any(|t| t.trim() == "tcp") {
                config = config.error_mode(ErrorMode::Peer);
            }
        }
        let over_tcp = options
            .ucx_tls
            .as_deref()
            .is_none_or(|t| t.split(',').any(|t| t.trim() == "tcp"));
        if over_tcp {
            config = config.tuned_tcp_segments();
        }
        let context = Context::with_config(&config)?;
        let worker = context.create_worker()?;
        let mut pools = Vec::with_capacity(pool_bytes.len());
        let mut placements = Vec::with_capacity(pool_bytes.len());
        let scope = HostScope::current();
        let mut segments = Vec::new();
        for bytes in pool_bytes {
            let len = usize::try_from(*bytes)
                .map_err(|_| Error::runner(RunnerReason::Allocation { bytes: *bytes }))?;
            if let Some((file, token)) = adopted_pools.as_mut().and_then(Iterator::next) {
                // A guard's file: mapped with its bytes kept; advertised for
                // one-copy writes as our own pools are.
                let pool = SharedPool::adopt(file, token, *bytes, prefault)?;
                if options.same_host_mapping && scope.is_some() {
                    segments.push(pool.advert(RegionId(pools.len() as u32)));
                }
                pools.push(context.register_owned(Box::new(pool))?);
                placements.push(None);
                continue;
            }
            match pool_memory {
                PoolMemory::Default if options.same_host_mapping && scope.is_some() => {
                    let pool = SharedPool::create(*bytes, prefault)?;
                    segments.push(pool.advert(RegionId(pools.len() as u32)));
                    pools.push(context.register_owned(Box::new(pool))?);
                    placements.push(None);
                }
                PoolMemory::Default => {
                    pools.push(context.register_anon(len, AnonOptions::new().prefault(prefault))?);
                    placements.push(None);
                }
                PoolMemory::Anonymous(anon) => {
                    let (mapping, outcome) = AnonMapping::new(*bytes, anon, prefault)?;
                    pools.push(context.register_owned(Box::new(mapping))?);
                    placements.push(Some(outcome));
                }
            }
        }
        let rkeys = pools
            .iter()
            .map(|p| p.pack_rkey().map(|r| r.as_bytes().to_vec()))
            .collect::<kvcr_ucx::Result<Vec<_>>>()?;
        let bound = match adopted_listener {
            // The guard's listener: peers keep dialling the same address.
            Some(listener) => ControlChannel::adopt(listener),
            None => ControlChannel::bind(control_bind_address(options)?).await,
        };
        let (listener, local) = bound.map_err(|_| {
            Error::runner(RunnerReason::Config {
                field: "peer.bind",
                why: "could not bind the control listener",
            })
        })?;
        let endpoint = ControlEndpoint::new(options.advertise_host.clone(), local.port())?;
        endpoint.check_advertisable(options.advertise_policy)?;
        let endpoint_for_streams = endpoint.clone();
        let (control, inbound) = ControlChannel::start(
            listener,
            PeerIdentity {
                endpoint: endpoint.clone(),
                incarnation,
            },
            options.secret.as_deref(),
            options.limits,
        );
        // Pool i is region i; advertised only when every pool is a segment
        // (a source then writes with one copy or not at all through them).
        let shared_memory = match scope {
            Some(scope) if !segments.is_empty() && segments.len() == pools.len() => {
                Some(SharedMemoryAdvert {
                    boot_id: scope.boot_id,
                    pid_namespace: scope.pid_namespace,
                    pid: std::process::id(),
                    segments,
                })
            }
            _ => None,
        };
        let mut own_tokens: Vec<[u8; 16]> = shared_memory
            .as_ref()
            .map(|a| a.segments.iter().map(|s| s.token).collect())
            .unwrap_or_default();
        // The doorbell: a shared file beside shared pools (a same-host
        // source maps it with them); plain registered memory when the pools
        // are not shared (then it is there for its per-session key, which
        // seals write messages).
        let doorbell = match &shared_memory {
            Some(_) => {
                let file = SharedPool::create(REGION_BYTES as u64, true)?;
                let segment = file.advert(crate::doorbell::REGION);
                own_tokens.push(segment.token);
                let slots = context.register_owned(Box::new(file))?;
                let rkey = slots.pack_rkey()?.as_bytes().to_vec();
                TargetDoorbell::new(slots, rkey, Some(segment))
            }
            None => {
                let slots = context.register_vec(vec![0; REGION_BYTES])?;
                let rkey = slots.pack_rkey()?.as_bytes().to_vec();
                TargetDoorbell::new(slots, rkey, None)
            }
        };
        // Write messages, verified with the doorbell's session keys.
        worker.accept_messages(
            crate::doorbell::WRITE_MESSAGE,
            MessageLimits {
                max_header: SLOT_BYTES,
                max_data: usize::try_from(PeerOptions::WRITE_MESSAGE_LIMIT).unwrap_or(usize::MAX),
                max_held: MAX_HELD_MESSAGES,
            },
        )?;
        let setup = PeerSetup {
            endpoint,
            bases: pools.iter().map(|p| p.as_ptr() as usize as u64).collect(),
            rkeys,
            worker_address: worker.address()?.as_bytes().to_vec(),
            placements,
            shared_memory,
        };
        let (put_split, max_in_flight) = put_plan(options, over_tcp);
        let efd = worker
            .event_fd()
            .and_then(|fd| register_efd(std::os::fd::AsRawFd::as_raw_fd(&fd)));
        let lanes = Lanes::start(match options.lanes {
            0 => crate::lanes::default_lanes(),
            n => n,
        })
        .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))?;
        let (lane_done_tx, lane_done) = mpsc::unbounded_channel();
        let (streams_dialed_tx, streams_dialed) = mpsc::unbounded_channel();
        Ok((
            Self {
                efd,
                pending: Vec::new(),
                out_streams: HashMap::new(),
                parked_streams: HashMap::new(),
                in_streams: HashMap::new(),
                dialing: HashSet::new(),
                advertised_keys: HashMap::new(),
                streams_dialed_tx,
                streams_dialed,
                request_mailbox: options.request_mailbox,
                data_stream: options.data_stream.enabled(
                    options
                        .ucx_tls
                        .clone()
                        .or_else(|| std::env::var("UCX_TLS").ok())
                        .as_deref(),
                ),
                endpoint: endpoint_for_streams,
                stream_limits: (
                    options.limits.handshake_timeout,
                    options.limits.frame_deadline,
                ),
                routes: HashMap::new(),
                control,
                inbound,
                lanes,
                lane_done_tx,
                lane_done,
                scope,
                own_tokens,
                doorbell,
                rings: HashMap::new(),
                pools,
                worker,
                _context: context,
                max_in_flight,
                put_split,
                write_message_max_bytes: options.write_message_max_bytes,
                write_message_part_bytes: match options.write_message_part_bytes {
                    0 => PeerOptions::DEFAULT_WRITE_MESSAGE_PART_BYTES,
                    bytes => bytes.min(PeerOptions::WRITE_MESSAGE_LIMIT),
                },
                messages_dropped: 0,
                unarmable_since: None,
                ucx_route_mapping_limit: match options.ucx_route_mapping_limit {
                    // 65,530 is the kernel's default.
                    0 => placement::max_map_count().unwrap_or(65_530) / 2,
                    limit => limit,
                },
            },
            setup,
        ))
    }

    /// The main loop; returns whether the memory must be leaked.
    // The driver reads the clock (activity, ticks); the core never does.
    #[allow(clippy::disallowed_methods)]
    async fn serve(
        &mut self,
        shared: &Arc<Shared>,
        mut rx: mpsc::UnboundedReceiver<PeerCmd>,
    ) -> bool {
        const TICK: Duration = Duration::from_millis(1);
        #[allow(clippy::disallowed_methods)]
        let mut last_tick = Instant::now();
        let mut last_progress = last_tick;
        let mut last_activity = last_tick;
        let mut deadline_due = false;
        let linger = LINGER;
        // (writes into us may be under way, a reply to us is awaited)
        let mut waits = (false, false);
        loop {
            // Progress whenever a UCX transfer may be moving in either
            // direction: our own puts, or puts into us from a source that
            // did not map our pools (UCX 1.13 does not finish a large put
            // into private memory over shared memory, nor wire up a new
            // endpoint, unless our worker progresses too, and it does not
            // reliably signal the event fd for it). One-copy writes into us
            // need nothing from us; our own run on the lanes.
            // A peek, not a wait: while a caller holds the core (planning
            // the very request this thread is about to send), blocking here
            // slept the thread in the kernel and its wake-up cost ~5 µs of
            // a one-block restore (traced); last turn's answer serves, and
            // this turn does not sleep.
            let peeked = match shared.try_lock() {
                Some(inner) => {
                    waits = (
                        inner.core.peer_transport_waits() > 0,
                        inner.core.peer_busy().0 > 0,
                    );
                    true
                }
                None => false,
            };
            let (into_us, awaiting_reply) = waits;
            let busy = !self.pending.is_empty()
                || into_us
                || self.out_streams.values().any(OutStream::wants_write);
            let mut progressed = false;
            // Messages are taken after every progress call: a write's
            // parts can outnumber what the worker holds at once.
            while self.worker.progress() > 0 {
                progressed = true;
                self.take_write_messages(shared);
            }
            #[allow(clippy::disallowed_methods)]
            if progressed || !busy {
                last_progress = Instant::now();
            }
            if !self.pending.is_empty() {
                self.issue_and_reap(shared);
            }
            if self.pump_streams(shared) {
                progressed = true;
                last_progress = Instant::now();
            }
            // A source may have rung for a write into us: a look at the
            // watched slots costs a load each, and a record taken here
            // saves waiting for its `write_done` to come through the socket.
            if self.doorbell.awaiting() {
                self.take_doorbells(shared);
            }
            // A target whose doorbell file we map may have posted a request
            // to our mailbox: taken here, it skips the socket, the
            // session task and the hop from it to this loop (~12 µs of a
            // one-block restore's fixed path on the H200 host, traced).
            if self.take_requests(shared) {
                progressed = true;
                #[allow(clippy::disallowed_methods)]
                {
                    last_progress = Instant::now();
                }
                // Its write starts now, not a turn later.
                if let Err(leak) = self.drain_queued(&mut rx, shared) {
                    return leak;
                }
            }
            if busy {
                // A transfer is moving: take whatever is queued without
                // waiting, let the socket tasks run, and come straight back
                // to progress the worker (a timer would cost a millisecond
                // per turn).
                // The linger counts from the end of a transfer, not from the
                // request that started it: a 1 MiB put over tcp (~330 µs
                // here, traced) outlasts the 200 µs linger, so the source went
                // to sleep the moment its put ended, and a next request
                // within the linger paid a wake-up (a `start_write` reached a
                // sleeping source in 50–70 µs, an awake one in 11 µs).
                let drained = match self.drain_queued(&mut rx, shared) {
                    Ok(drained) => drained,
                    Err(leak) => return leak,
                };
                // The turn's work is done (issuing a 1 MiB put over tcp
                // writes to the socket for a few hundred µs): what follows
                // is waiting, and only that is timed for `contention`.
                #[allow(clippy::disallowed_methods)]
                let wait_began = Instant::now();
                last_activity = wait_began;
                // Nothing moved for a while: leave the core to other threads
                // between rounds. The other side of the transfer may need
                // this very CPU: a write into us moves only while its source
                // runs, and our own put over TCP finishes only once the
                // destination has read it and acknowledged (traced beside
                // one busy process: a source spinning on its unfinished put
                // kept the destination it waited for off their shared CPU
                // for its whole 2.8 ms slice, every 64 KiB request). A short
                // sleep, not a yield: a yielding thread on a crowded machine
                // waits out other processes' whole time slices (4 ms each,
                // measured: shm fetches fell to 0.1 GB/s beside two busy
                // processes), while a sleeper is woken ahead of them when its
                // nap ends (timer slack is cut to 1 µs on this thread).
                // Sooner while the host's CPUs are contended (`contention`).
                let still = wait_began.saturating_duration_since(last_progress);
                let contended = !progressed && contention::contended();
                let napped = !progressed
                    && (still >= SPIN_BEFORE_NAP
                        || (still >= CONTENDED_SPIN_BEFORE_NAP && contended));
                if napped {
                    #[allow(clippy::disallowed_methods)]
                    std::thread::sleep(WAIT_NAP);
                }
                // A turn that found nothing hands its CPU to whoever else
                // is runnable there: on a host with fewer free cores than
                // awake threads that is often the very thread this one
                // waits for (the source's peer thread, sharing the CPU,
                // cannot read our `start_write` while we spin on its reply).
                // Traced hop by hop on the 2-vCPU VM: the slow stretches of
                // 64 KiB requests (250–450 µs, for tens to hundreds of
                // requests in a row) all stalled between our socket write
                // and the source decoding it. Yielding each empty turn:
                // no 50-request median above 200 µs in five runs of 600
                // requests per size, against nine (up to 1.6 ms) without,
                // and the 64 KiB median 2–3 µs higher. Not on a contended
                // host: a yield there gives a busy process a whole time
                // slice, and the nap above serves instead. A plain yield:
                // the wait it is part of is timed below, once.
                if !progressed && !drained && !napped && !contended {
                    std::thread::yield_now();
                }
                tokio::task::yield_now().await;
                // A turn that found nothing to do yet waited long had the
                // CPU taken from it (`contention`).
                if !progressed && !drained {
                    contention::note_wait(wait_began);
                }
            } else if !peeked
                || (last_activity.elapsed() < if awaiting_reply { ACTIVE_SPIN } else { linger }
                    && !contention::contended())
            {
                // Our request is out and its reply is due within a round
                // trip, or we just served one and the next is likely close
                // behind (engines restore in bursts); waking a sleeping
                // thread costs 20–40 µs per hop on a virtual machine's idle
                // vCPU (traced: 3 of a one-block fetch's 190 µs were such
                // wake-ups). Stay awake for a bounded moment, yielding to
                // the socket tasks and to other threads (on a small machine
                // the engine's own thread may need this CPU). Not while the
                // host's CPUs are contended: there a yield gives another
                // process a whole time slice, and a thread sleeping on its
                // events is woken ahead of it (see `contention`).
                match self.drain_queued(&mut rx, shared) {
                    Ok(true) => last_activity = Instant::now(),
                    Ok(false) => {}
                    Err(leak) => return leak,
                }
                contention::yield_cpu();
                tokio::task::yield_now().await;
            } else {
                // Idle as far as UCX goes: sleep until a command, a control
                // message, a lane's report, a UCX event (the armed worker
                // fd: e.g. TCP writes into us) or the core's next deadline.
                match self
                    .sleep_on_events(&mut rx, shared, MAX_IDLE_NAP, progressed)
                    .await
                {
                    Woken::Event => {}
                    Woken::Activity => last_activity = Instant::now(),
                    Woken::Deadline => deadline_due = true,
                    Woken::Stop(leak) => return leak,
                }
            }
            // Whatever this turn sent leaves now, one write per peer,
            // rather than after a hop through each session's task.
            self.control.flush();
            // At most every millisecond while busy; at once when a sleep
            // ended at the core's deadline (so a due deadline never spins).
            if deadline_due || last_tick.elapsed() >= TICK {
                deadline_due = false;
                last_tick = Instant::now();
                let doorbell = &mut self.doorbell;
                shared.with_core_now(|core, now| {
                    core.handle_tick(now);
                    // Operations that ended without a reply (deadlines).
                    doorbell.retain(|op| core.peer_awaits_reply(op));
                });
            }
        }
    }

    /// Sleeps until a command, a control message, a lane's report, a UCX
    /// event (the armed worker fd) or the core's next deadline, at most
    /// `cap`; returns at once if UCX has events pending (the caller goes
    /// round and progresses), unless it has said so for [`SPIN_BEFORE_NAP`]
    /// while `progressed` (this turn's progress) found nothing: then it naps
    /// [`UNARMABLE_NAP`] on the rest.
    async fn sleep_on_events(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PeerCmd>,
        shared: &Arc<Shared>,
        mut cap: Duration,
        progressed: bool,
    ) -> Woken {
        if progressed {
            self.unarmable_since = None;
        }
        let armed = match self.worker.arm() {
            Ok(true) => {
                self.unarmable_since = None;
                true
            }
            // Events are pending: progress them before sleeping. UCX 1.13
            // also says so, for good, while it holds sends it cannot make
            // (wire-up to a same-host peer whose queue is full and never
            // drains: a member that advertised a worker it never
            // progresses); progress then finds nothing, and going straight
            // round spun this thread at a whole core and never took the
            // stop command (the runner's drop hung). So after a short
            // spin, nap on everything else and retry UCX after it.
            Ok(false) if self.efd.is_some() => {
                #[allow(clippy::disallowed_methods)]
                let since = *self.unarmable_since.get_or_insert_with(Instant::now);
                if progressed || since.elapsed() < SPIN_BEFORE_NAP {
                    return Woken::Event;
                }
                cap = cap.min(UNARMABLE_NAP);
                false
            }
            // No event fd (or arming failed): sleep on the rest.
            Ok(false) | Err(_) => false,
        };
        let efd = self.efd.as_ref().filter(|_| armed);
        let nap = shared.with_core_now(|core, now| {
            core.peer_wake_at()
                .map_or(cap, |at| Duration::from_nanos(at.saturating_sub(now)))
                .min(cap)
        });
        tokio::select! {
            biased;
            ready = async {
                match efd {
                    Some(fd) => fd.readable().await.map(|mut g| g.clear_ready()),
                    None => std::future::pending().await,
                }
            }, if armed => {
                let _ = ready;
                Woken::Event
            }
            cmd = rx.recv() => match cmd {
                Some(cmd) => match self.command(cmd, shared) {
                    Some(leak) => Woken::Stop(leak),
                    None => Woken::Activity,
                },
                None => Woken::Stop(false),
            },
            // Before the control messages: a flood of them must not
            // starve a finished write (the select is biased).
            done = self.lane_done.recv() => match done {
                Some(done) => {
                    self.copied(shared, done);
                    Woken::Activity
                }
                None => Woken::Event,
            },
            item = self.inbound.recv() => match item {
                Some(item) => {
                    self.on_inbound(item, shared);
                    Woken::Activity
                }
                None => Woken::Event,
            },
            Some(dialed) = self.streams_dialed.recv() => {
                self.stream_dialed(dialed);
                Woken::Activity
            },
            // Bytes on a data stream, or room for a frame that waits.
            () = std::future::poll_fn(|cx| streams_ready(&self.in_streams, &self.out_streams, cx)) => {
                Woken::Event
            },
            () = tokio::time::sleep(nap) => Woken::Deadline,
        }
    }

    /// Progresses the worker until it has been quiet for [`DRAIN_QUIET`]
    /// (at most [`DRAIN_MAX`]) before it is destroyed: UCX 1.13 asserts in
    /// `ucp_worker_destroy` when a wire-up reply to a peer that connected
    /// just before the stop is still queued (seen once in CI), and
    /// progressing sends it.
    fn drain_worker(&self) {
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        let mut quiet_since = start;
        while start.elapsed() < DRAIN_MAX {
            if self.worker.progress() > 0 {
                #[allow(clippy::disallowed_methods)]
                {
                    quiet_since = Instant::now();
                }
            } else if quiet_since.elapsed() >= DRAIN_QUIET {
                return;
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Takes whatever is queued (commands, control messages, lane reports)
    /// without waiting, until nothing is: what handling one queues (a
    /// control message's actions come back as commands) runs in this turn,
    /// not the next. `Ok(any)`, or `Err(leak)` to stop.
    fn drain_queued(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PeerCmd>,
        shared: &Arc<Shared>,
    ) -> std::result::Result<bool, bool> {
        let mut any = false;
        // Bounded: a flood of control messages must not keep this turn
        // from progressing the worker (the inbound budget paces them).
        for _ in 0..DRAIN_ROUNDS {
            let mut more = false;
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        more = true;
                        if let Some(leak) = self.command(cmd, shared) {
                            return Err(leak);
                        }
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return Err(false),
                }
            }
            while let Ok(done) = self.lane_done.try_recv() {
                more = true;
                self.copied(shared, done);
            }
            while let Ok(item) = self.inbound.try_recv() {
                more = true;
                self.on_inbound(item, shared);
            }
            while let Ok(dialed) = self.streams_dialed.try_recv() {
                more = true;
                self.stream_dialed(dialed);
            }
            any |= more;
            if !more {
                break;
            }
        }
        // Before this turn yields: what it sent leaves now.
        self.control.flush();
        Ok(any)
    }

    /// Handles the requests our targets posted to our mailboxes in their
    /// doorbell files (as their source) ahead of their copies on the control
    /// sessions: a record that verifies under the route's session key,
    /// decodes as a `start_write`, and is that session's next message (see
    /// `crate::doorbell`), as from the identity the session proved. `true`:
    /// one was handled.
    fn take_requests(&mut self, shared: &Arc<Shared>) -> bool {
        let mut taken = Vec::new();
        let mut refused = 0u64;
        for (target, route) in &self.routes {
            let Some((mailbox, session)) = &route.mailbox else {
                continue;
            };
            let (index, frame) = match mailbox.poll() {
                Polled::Quiet => continue,
                Polled::Refused => {
                    refused += 1;
                    continue;
                }
                Polled::Request { index, frame } => (index, frame),
            };
            let Some(mut message) = self
                .control
                .decode(&frame)
                .filter(|m| matches!(m.body, Body::StartWrite { .. }))
            else {
                refused += 1;
                continue;
            };
            // Not the session's next message (one before it is unread, or
            // its copy came first): the session brings it.
            let Some(incarnation) = self.control.take_early(target, *session, index) else {
                continue;
            };
            message.header.sender_endpoint = target.clone();
            message.header.sender = incarnation;
            taken.push(message);
        }
        let stats = &self.control.stats;
        let counters = (
            &stats.mailbox_requests_taken,
            &stats.mailbox_requests_refused,
        );
        hand_to_core(shared, taken, refused, counters)
    }

    /// One item from the control channel: a message for the core, or a
    /// session that ended.
    fn on_inbound(&mut self, item: Inbound, shared: &Arc<Shared>) {
        match self.control.on_inbound(item) {
            Some(ChannelEvent::Message(message, session)) => {
                match &message.body {
                    Body::WriteDone { op_handle, .. } | Body::WriteRefused { op_handle } => {
                        self.doorbell.forget_op(*op_handle);
                    }
                    // Whether the source reads the mailbox we post to.
                    Body::TargetMetadataAck { one_copy, .. } => {
                        self.doorbell
                            .note_mapped(&message.header.sender_endpoint, *one_copy);
                    }
                    // The route this builds reads its mailbox as this
                    // session's.
                    Body::TargetMetadata {
                        doorbell: Some(advert),
                        ..
                    } => {
                        self.advertised_keys.insert(
                            message.header.sender_endpoint.clone(),
                            (advert.key, session),
                        );
                    }
                    _ => {}
                }
                // A metadata acknowledgement says whether the source maps
                // our pools (then no byte comes on a data stream) or writes
                // through UCX (then it should have one).
                let ack = match &message.body {
                    Body::TargetMetadataAck { one_copy, .. } => {
                        Some((message.header.sender_endpoint.clone(), *one_copy))
                    }
                    _ => None,
                };
                shared.with_core_now(|core, now| core.handle_message(now, message));
                match ack {
                    // The source maps our pools: no byte comes on a stream.
                    Some((source, true)) => {
                        self.in_streams.remove(&source);
                    }
                    // Dialed with the metadata; again if that one failed.
                    Some((source, false)) if self.data_stream => self.dial_stream(&source),
                    _ => {}
                }
            }
            Some(ChannelEvent::SourceLost(source)) => {
                self.doorbell.forget_source(&source);
                self.in_streams.remove(&source);
                shared.with_core_now(|core, _| core.peer_connection_lost(&source));
            }
            Some(ChannelEvent::TargetGone(target)) => {
                // Per-peer state goes with the session: the core's route and
                // ours now; writes under way keep their own until they end.
                shared.with_core_now(|core, _| core.peer_target_gone(&target));
                self.advertised_keys.remove(&target);
                retire(self.routes.remove(&target));
                self.drop_out_stream(shared, &target);
                self.refuse_parked(&target);
            }
            Some(ChannelEvent::Stream(accepted)) => self.bind_out_stream(shared, accepted),
            None => {}
        }
    }

    /// Runs one command; `Some(leak)` means stop.
    fn command(&mut self, cmd: PeerCmd, shared: &Arc<Shared>) -> Option<bool> {
        match cmd {
            PeerCmd::Action(action) => self.execute(action, shared),
            PeerCmd::Forget(peer) => {
                self.control.remove_peer(&peer);
                self.doorbell.forget_source(&peer);
                self.in_streams.remove(&peer);
                self.drop_out_stream(shared, &peer);
                self.advertised_keys.remove(&peer);
                retire(self.routes.remove(&peer));
                shared.with_core_now(|core, _| core.peer_connection_lost(&peer));
            }
            PeerCmd::Stop { leak } => return Some(leak),
        }
        None
    }

    fn execute(&mut self, action: Action, shared: &Arc<Shared>) {
        match action {
            Action::Send { to, mut message } => {
                // Dialed beside the metadata, so the stream is bound by the
                // time the first `start_write` reaches the source (it is
                // checked once the route the metadata builds is there).
                let mut dial_stream = false;
                match &message.body {
                    Body::TargetMetadata { .. } => {
                        let session = self.control.dial(&to);
                        self.doorbell.advertise(&to, session, &mut message.body);
                        dial_stream = self.data_stream;
                    }
                    Body::StartWrite { op_handle, .. } => {
                        self.doorbell.await_op(&to, *op_handle);
                    }
                    _ => {}
                }
                let sent = self.control.send(&to, &message);
                // A same-host source that maps us also finds it in its
                // mailbox, the moment it looks (the socket copy still goes).
                let posted = matches!(message.body, Body::StartWrite { .. })
                    && self.request_mailbox
                    && sent.is_some_and(|sent| {
                        self.doorbell
                            .post_request(&to, (sent.session, sent.index), sent.frame)
                    });
                if posted {
                    self.control
                        .stats
                        .mailbox_requests_posted
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if dial_stream {
                    self.dial_stream(&to);
                }
            }
            Action::Connect {
                peer,
                generation,
                worker_address,
                rkeys,
                shared_memory,
                extents,
                doorbell,
            } => match self.route_path(&worker_address, &rkeys, shared_memory.as_ref(), &extents) {
                Ok(path) => {
                    let doorbell_key = doorbell.as_ref().map(|advert| advert.key);
                    let session_key = match (&path, &doorbell) {
                        (RoutePath::Ucx { .. }, Some(advert)) => {
                            Some((RecordKey::new(&advert.key), advert.key))
                        }
                        _ => None,
                    };
                    // Only a route that maps the target rings it (a record
                    // put over UCX saved nothing: see `crate::doorbell`).
                    let advertised = self.advertised_keys.remove(&peer);
                    let doorbell = doorbell
                        .as_ref()
                        .and_then(|advert| RouteDoorbell::new(advert, &rkeys, &extents))
                        .filter(|d| match &path {
                            RoutePath::OneCopy(segments) => segments.contains_key(&d.region),
                            RoutePath::Ucx { .. } => false,
                        });
                    // Read as the session whose metadata carried this key.
                    let mailbox = match (&path, &doorbell, &doorbell_key, advertised) {
                        (
                            RoutePath::OneCopy(segments),
                            Some(ring),
                            Some(key),
                            Some((advertised, session)),
                        ) if *key == advertised => segments
                            .get(&ring.region)
                            .and_then(|slots| ring.mailbox(Arc::clone(slots)))
                            .map(|mailbox| (mailbox, session)),
                        _ => None,
                    };
                    let route = Rc::new(Route {
                        generation,
                        path,
                        doorbell,
                        session_key,
                        mailbox,
                    });
                    let one_copy = route.one_copy();
                    retire(self.routes.insert(peer.clone(), route));
                    shared.with_core_now(|core, _| {
                        core.handle_connected(&peer, generation, one_copy);
                    });
                    // A stream dialed beside this route's metadata is checked
                    // now; a one-copy route needs none (dropped, not refused).
                    if let Some((_, parked)) = self.parked_streams.remove(&peer)
                        && !one_copy
                    {
                        self.bind_out_stream(shared, parked);
                    }
                }
                Err(why) => {
                    // Nothing is kept for metadata UCX refused, or for a UCX
                    // route this process has no mappings to spare for.
                    retire(self.routes.remove(&peer));
                    shared.with_core_now(|core, _| {
                        core.handle_connect_failed(&peer, generation, why);
                    });
                    self.refuse_parked(&peer);
                }
            },
            Action::Put {
                write,
                target,
                generation,
                spans,
            } => {
                let route = self
                    .routes
                    .get(&target)
                    .filter(|r| r.generation == generation)
                    .cloned();
                if let Some(segments) = route.as_ref().and_then(|r| match &r.path {
                    RoutePath::OneCopy(segments) => Some(segments),
                    RoutePath::Ucx { .. } => None,
                }) {
                    let copies = self.one_copy_plan(segments, &spans);
                    match copies {
                        Some(copies) => {
                            if let Some(doorbell) =
                                &route.as_ref().and_then(|r| r.doorbell.as_ref())
                            {
                                let completion = shared.lock().core.peer_write_completion(write);
                                if let (Some((op, keys)), Some(slots)) =
                                    (completion, segments.get(&doorbell.region))
                                {
                                    let (record, remote) = doorbell.ring(op, keys);
                                    self.rings
                                        .insert(write, (Arc::clone(slots), record, remote));
                                }
                            }
                            let segments = segments.values().cloned().collect();
                            // SAFETY: every source range lies inside one of our
                            // pools (checked by `one_copy_plan`), claimed by this
                            // write until it is reported; every destination
                            // lies inside a mapping of `segments` (checked),
                            // granted to this write by its target.
                            #[allow(unsafe_code)]
                            let inline = unsafe {
                                self.lanes
                                    .submit(write, copies, segments, &self.lane_done_tx)
                            };
                            if let Some(ok) = inline {
                                self.copied(shared, (write, ok));
                            }
                        }
                        None => shared
                            .with_core_now(|core, now| core.handle_put_done(now, write, false)),
                    }
                } else if let Some(route) = route {
                    if self.send_on_stream(shared, write, &target, &route, &spans) {
                        self.pump_streams(shared);
                        return;
                    }
                    let (spans, in_flight, failed, as_message) =
                        match self.send_as_message(shared, write, &route, &spans) {
                            Some((sent, whole)) => {
                                self.control.stats.write_messages_sent.fetch_add(
                                    sent.len() as u64,
                                    std::sync::atomic::Ordering::Relaxed,
                                );
                                (VecDeque::new(), sent, !whole, true)
                            }
                            None => (self.put_split.split(spans), VecDeque::new(), false, false),
                        };
                    self.pending.push(PendingWrite {
                        write,
                        route,
                        spans,
                        in_flight,
                        flush: None,
                        failed,
                        as_message,
                    });
                    self.issue_and_reap(shared);
                } else {
                    // The route is gone or was replaced: never write through it.
                    shared.with_core_now(|core, now| core.handle_put_done(now, write, false));
                }
            }
            Action::Copy { .. } | Action::G3 { .. } | Action::Cancel { .. } => {}
        }
    }

    /// Maps the shared segments a target advertised, when it runs on this
    /// host in this pid namespace; a segment that fails any check is left
    /// out (its region is then written through UCX, like every region of
    /// that route).
    fn map_segments(
        &self,
        advert: Option<&SharedMemoryAdvert>,
        rkeys: &[(RegionId, u64, Vec<u8>)],
        extents: &[(RegionId, u64)],
    ) -> HashMap<RegionId, Arc<PeerSegment>> {
        let mut mapped = HashMap::new();
        let Some(advert) = advert.filter(|a| self.scope.is_some_and(|s| s.matches(a))) else {
            return mapped;
        };
        for segment in &advert.segments {
            // Never our own pools: a member that learned our advert (as our
            // source) could otherwise have us overwrite our own pages.
            if self.own_tokens.contains(&segment.token) {
                continue;
            }
            let Some((_, base, _)) = rkeys.iter().find(|(r, _, _)| *r == segment.region) else {
                continue;
            };
            let Some((_, extent)) = extents.iter().find(|(r, _)| *r == segment.region) else {
                continue;
            };
            if let Ok(view) = PeerSegment::open(advert, segment, *base, *extent) {
                mapped.insert(segment.region, Arc::new(view));
            }
        }
        mapped
    }

    /// How writes will reach a target: its pools mapped here when every
    /// advertised region can be (then UCX is never touched), else a UCX
    /// endpoint and its remote keys, unless this process holds
    /// `ucx_route_mapping_limit` mappings or more (UCX keeps mappings of
    /// some routes until the worker goes, see [`RouteBudget`]).
    fn route_path(
        &self,
        worker_address: &[u8],
        rkeys: &[(RegionId, u64, Vec<u8>)],
        shared_memory: Option<&SharedMemoryAdvert>,
        extents: &[(RegionId, u64)],
    ) -> std::result::Result<RoutePath, ConnectFailure> {
        let segments = self.map_segments(shared_memory, rkeys, extents);
        if !rkeys.is_empty() && rkeys.iter().all(|(r, _, _)| segments.contains_key(r)) {
            // First writes into a fresh part of the target's pool then find
            // it populated (it cost a first 256 KiB restore into a fresh
            // 2 MiB 1.2–1.7 ms on the H200 host).
            for segment in segments.values() {
                segment.populate_in_background();
            }
            return Ok(RoutePath::OneCopy(segments));
        }
        // Read once per route built (rate-limited per target by the core);
        // an unreadable map counts as none.
        if placement::mapping_count().unwrap_or(0) >= self.ucx_route_mapping_limit {
            return Err(ConnectFailure::NoMappingsLeft);
        }
        // What UCX refused is dropped here: the core counts it.
        let (endpoint, rkeys) = self
            .connect(worker_address, rkeys)
            .map_err(|_| ConnectFailure::Unusable)?;
        Ok(RoutePath::Ucx { endpoint, rkeys })
    }

    /// The copies of a one-copy write: each span from our pool to the
    /// mapped target segment; `None` if any range is outside either.
    fn one_copy_plan(
        &self,
        segments: &HashMap<RegionId, Arc<PeerSegment>>,
        spans: &[PutSpan],
    ) -> Option<Vec<CopySpan>> {
        spans
            .iter()
            .map(|span| {
                pool_holding(&self.pools, span.local, span.len)?;
                let dst = segments
                    .get(&span.region)?
                    .destination(span.remote, span.len)?;
                Some(CopySpan {
                    src: span.local,
                    dst,
                    len: span.len,
                })
            })
            .collect()
    }

    fn connect(
        &self,
        worker_address: &[u8],
        rkeys: &[(RegionId, u64, Vec<u8>)],
    ) -> Result<(Endpoint, RemoteKeys)> {
        // Every blob is checked before anything is created from it.
        let address = WorkerAddress::from_bytes(worker_address)?;
        let buffers = rkeys
            .iter()
            .map(|(region, base, rkey)| Ok((*region, *base, RkeyBuffer::from_bytes(rkey)?)))
            .collect::<Result<Vec<_>>>()?;
        let endpoint = self.worker.connect(&address)?;
        let mut keys = HashMap::new();
        for (region, base, buffer) in &buffers {
            match endpoint.unpack_rkey(buffer) {
                Ok(key) => {
                    keys.insert(*region, (key, *base));
                }
                Err(e) => {
                    // Nothing was put through it: close without waiting on a
                    // peer that may never progress.
                    endpoint.set_close_mode(CloseMode::Detach);
                    return Err(e.into());
                }
            }
        }
        Ok((endpoint, keys))
    }

    /// A write's copies ended (`ok`: all of them): rings the target's
    /// doorbell first when the write has a record waiting (the moment the
    /// bytes are in place, before the core hears of it and the
    /// `write_done` goes out), then reports to the core.
    fn copied(&mut self, shared: &Arc<Shared>, (write, ok): (u64, bool)) {
        if let Some((slots, record, remote)) = self.rings.remove(&write)
            && ok
            && slots.write_record(remote, &record)
        {
            self.control
                .stats
                .doorbells_rung
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        shared.with_core_now(|core, now| core.handle_put_done(now, write, ok));
    }

    /// Takes the `write_done`s our doorbell's watched slots hold.
    fn take_doorbells(&mut self, shared: &Arc<Shared>) {
        let control = &self.control;
        let (taken, refused) = self.doorbell.take(|source| control.dialed_peer(source));
        let stats = &self.control.stats;
        let counters = (&stats.doorbells_taken, &stats.doorbells_refused);
        hand_to_core(shared, taken, refused, counters);
    }

    /// Issues puts up to the in-flight cap, flushes each write after its last
    /// put, and reports writes whose flush completed.
    fn issue_and_reap(&mut self, shared: &Arc<Shared>) {
        let mut finished = Vec::new();
        let pools = &self.pools;
        for w in &mut self.pending {
            while let Some(done) = w.in_flight.front().and_then(Completion::result) {
                w.failed |= done.is_err();
                w.in_flight.pop_front();
            }
        }
        // The cap is shared by every write (a fetch in batches is several
        // writes at once, and tcp collapses under many large puts); the
        // oldest write issues first, so batches land roughly in order.
        let mut in_flight: usize = self.pending.iter().map(|w| w.in_flight.len()).sum();
        for w in &mut self.pending {
            let route = &w.route;
            while in_flight < self.max_in_flight && !w.failed {
                let Some(span) = w.spans.pop_front() else {
                    break;
                };
                match put(pools, route, &span) {
                    Ok(c) => {
                        w.in_flight.push_back(c);
                        in_flight += 1;
                    }
                    Err(_) => w.failed = true,
                }
            }
            if w.spans.is_empty() && w.flush.is_none() && !w.failed && !w.as_message {
                match route.ucx_endpoint().map(Endpoint::flush) {
                    Some(Ok(c)) => w.flush = Some(c),
                    Some(Err(_)) | None => w.failed = true,
                }
            }
            let puts_done = w.in_flight.iter().all(Completion::is_done);
            let all_ok = || {
                !w.failed
                    && w.in_flight
                        .iter()
                        .all(|c| matches!(c.result(), Some(Ok(()))))
            };
            match (&w.flush, w.failed) {
                _ if w.as_message && puts_done => finished.push((w.write, all_ok(), true)),
                (Some(flush), _) if puts_done => {
                    if let Some(result) = flush.result() {
                        finished.push((w.write, result.is_ok() && all_ok(), false));
                    }
                }
                (None, true) if puts_done => finished.push((w.write, false, false)),
                _ => {}
            }
        }
        if finished.is_empty() {
            return;
        }
        self.pending
            .retain(|w| !finished.iter().any(|(id, _, _)| *id == w.write));
        shared.with_core_now(|core, now| {
            for (write, ok, as_message) in finished {
                if as_message {
                    core.handle_message_sent(now, write, ok);
                } else {
                    core.handle_put_done(now, write, ok);
                }
            }
        });
    }

    /// Sends write `write` as a message, when it may go as one: its route
    /// has the target's record key, it is small enough, and it carries
    /// the first keys asked for (the only completion a record states). Its
    /// bytes leave in parts of at most `write_message_part_bytes`, each
    /// with its own header, so the target copies each part as it lands
    /// (UCX reassembles a message from its segments before anyone sees
    /// it). `None`: nothing left, it goes as puts; otherwise the sends that
    /// left, and whether every part did (a write missing some fails as a
    /// failed put would).
    fn send_as_message(
        &self,
        shared: &Arc<Shared>,
        write: u64,
        route: &Route,
        spans: &[PutSpan],
    ) -> Option<(VecDeque<Completion>, bool)> {
        let (key, _) = route.session_key.as_ref()?;
        let endpoint = route.ucx_endpoint()?;
        let bytes = spans
            .iter()
            .try_fold(0u64, |sum, s| sum.checked_add(s.len))?;
        if bytes > self.write_message_max_bytes {
            return None;
        }
        let count = Part::cut(bytes, self.write_message_part_bytes)?;
        let (op, keys) = shared.lock().core.peer_write_completion(write)?;
        let local: Vec<(u64, u64)> = spans.iter().map(|s| (s.local, s.len)).collect();
        let mut sent = VecDeque::with_capacity(usize::from(count));
        for index in 0..count {
            // Any refusal here is made before this part left (a bounds
            // check), so the parts sent so far say what left.
            let one = Part::new(index, count).and_then(|part| {
                let parts = crate::doorbell::spans_in_range(&local, part.range(bytes)?)
                    .into_iter()
                    .map(|(at, len)| {
                        let (pool, offset) = pool_holding(&self.pools, at, len)?;
                        Some((
                            pool,
                            usize::try_from(offset).ok()?,
                            usize::try_from(len).ok()?,
                        ))
                    })
                    .collect::<Option<Vec<_>>>()?;
                let header = key.seal_message(op, keys, part);
                endpoint
                    .send_message(crate::doorbell::WRITE_MESSAGE, &header, &parts)
                    .ok()
            });
            match one {
                Some(c) => sent.push_back(c),
                None if sent.is_empty() => return None,
                None => return Some((sent, false)),
            }
        }
        Some((sent, true))
    }

    /// Dials a data stream to `source` (beside the metadata we send it, and
    /// again once it acknowledged a route that is not one-copy), proving the
    /// key of our current session to it, unless one for that session is
    /// open or being dialed.
    fn dial_stream(&mut self, source: &ControlEndpoint) {
        let Some((session, key)) = self.doorbell.session_key(source) else {
            return;
        };
        if self.dialing.contains(source)
            || self
                .in_streams
                .get(source)
                .is_some_and(|s| s.session == session)
        {
            return;
        }
        self.dialing.insert(source.clone());
        let (source, claim, tx) = (
            source.clone(),
            self.endpoint.clone(),
            self.streams_dialed_tx.clone(),
        );
        let within = self.stream_limits.0;
        tokio::spawn(async move {
            let socket =
                tokio::time::timeout(within, crate::stream::dial(&source, &claim, &key)).await;
            let _ = tx.send((source, session, socket.ok().flatten()));
        });
    }

    /// A data stream dial ended: kept if it proved the session we still
    /// hold to that source and that source does not map us (an
    /// acknowledgement saying it does may have come while the dial ran).
    fn stream_dialed(&mut self, (source, session, socket): DialedStream) {
        self.dialing.remove(&source);
        let current = self
            .doorbell
            .session_key(&source)
            .is_some_and(|(s, _)| s == session);
        if let (Some(socket), true, false) = (socket, current, self.doorbell.maps_us(&source)) {
            self.in_streams
                .insert(source, InStream::new(session, socket));
            self.control
                .stats
                .streams_opened
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A target dialed us a data stream: bound to it (replacing an older
    /// one) only if its proof verifies under the key of the route we built
    /// from that target's session; dropped otherwise.
    fn bind_out_stream(&mut self, shared: &Arc<Shared>, accepted: crate::control::AcceptedStream) {
        let Some(route) = self.routes.get(&accepted.claim) else {
            // Its route is not built yet (the target dials beside its
            // metadata): held until it is, or until the handshake deadline.
            let claim = accepted.claim.clone();
            if self.parked_streams.len() < MAX_PARKED_STREAMS
                || self.parked_streams.contains_key(&claim)
            {
                #[allow(clippy::disallowed_methods)]
                let now = Instant::now();
                if self.parked_streams.insert(claim, (now, accepted)).is_some() {
                    self.count_refused_streams(1);
                }
            } else {
                self.count_refused_streams(1);
            }
            return;
        };
        let key = route
            .session_key
            .as_ref()
            .filter(|(key, _)| {
                key.verify_stream_proof(&accepted.challenge, &accepted.claim, &accepted.proof)
            })
            .map(|(_, bytes)| *bytes);
        let Some(key) = key else {
            self.count_refused_streams(1);
            return;
        };
        self.control
            .stats
            .streams_opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let target = accepted.claim.clone();
        self.drop_out_stream(shared, &target);
        self.out_streams.insert(
            target,
            OutStream::new(key, accepted.socket, Some(accepted.hold)),
        );
    }

    /// Drops a data stream held for `target`'s route (the route failed, or
    /// its session went).
    fn refuse_parked(&mut self, target: &ControlEndpoint) {
        if self.parked_streams.remove(target).is_some() {
            self.count_refused_streams(1);
        }
    }

    fn count_refused_streams(&self, count: u64) {
        self.control
            .stats
            .streams_refused
            .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
    }

    /// Drops the data stream to `target`; the writes it had not sent whole
    /// fail as a failed put would.
    fn drop_out_stream(&mut self, shared: &Arc<Shared>, target: &ControlEndpoint) {
        let Some(mut out) = self.out_streams.remove(target) else {
            return;
        };
        let failed = out.take_unsent();
        if !failed.is_empty() {
            shared.with_core_now(|core, now| {
                for write in failed {
                    core.handle_message_sent(now, write, false);
                }
            });
        }
    }

    /// Queues write `write` on `target`'s data stream, when it has one bound
    /// to this route's session key and the write is one a frame can carry
    /// (its completion is the first keys asked for, as a message's is).
    /// `false`: it goes through UCX.
    fn send_on_stream(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        target: &ControlEndpoint,
        route: &Route,
        spans: &[PutSpan],
    ) -> bool {
        let Some((key, bytes)) = route.session_key.as_ref() else {
            return false;
        };
        let Some(out) = self
            .out_streams
            .get_mut(target)
            .filter(|o| o.key() == bytes)
        else {
            return false;
        };
        let Some(part) = Part::new(0, 1) else {
            return false;
        };
        let Some((op, keys)) = shared.lock().core.peer_write_completion(write) else {
            return false;
        };
        // Every span is read from our pools only (checked here, once).
        let pieces: Option<Vec<(u64, u64)>> = spans
            .iter()
            .map(|s| pool_holding(&self.pools, s.local, s.len).map(|_| (s.local, s.len)))
            .collect();
        let Some(pieces) = pieces else {
            return false;
        };
        out.push(write, &key.seal_message(op, keys, part), pieces);
        self.control
            .stats
            .stream_writes_sent
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Moves bytes on every data stream: frames out as far as the sockets
    /// take them (reporting each write sent whole, or failed with its
    /// stream), frames in as far as they have arrived. `true`: bytes moved.
    fn pump_streams(&mut self, shared: &Arc<Shared>) -> bool {
        let mut moved = false;
        if !self.parked_streams.is_empty() {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            let within = self.stream_limits.0;
            let held = self.parked_streams.len();
            self.parked_streams
                .retain(|_, (since, _)| now.saturating_duration_since(*since) < within);
            self.count_refused_streams((held - self.parked_streams.len()) as u64);
        }
        if !self.out_streams.is_empty() {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            let (mut sent, mut failed, mut broken) = (Vec::new(), Vec::new(), Vec::new());
            for (target, out) in &mut self.out_streams {
                if !out.wants_write() {
                    continue;
                }
                // SAFETY: every queued span lies in one of our pools
                // (checked by `send_on_stream`), claimed by its write until
                // that write is reported below; the pools outlive the streams
                // (`State`'s field order).
                #[allow(unsafe_code)]
                let pumped = unsafe { out.pump(&mut sent, now, self.stream_limits.1) };
                moved |= pumped.moved;
                if pumped.broken {
                    failed.extend(out.take_unsent());
                    broken.push(target.clone());
                }
            }
            for target in broken {
                self.out_streams.remove(&target);
            }
            if !sent.is_empty() || !failed.is_empty() {
                shared.with_core_now(|core, now| {
                    for write in sent {
                        core.handle_message_sent(now, write, true);
                    }
                    for write in failed {
                        core.handle_message_sent(now, write, false);
                    }
                });
            }
        }
        let mut broken = Vec::new();
        for (source, stream) in &mut self.in_streams {
            let mut lander = FrameLander {
                doorbell: &mut self.doorbell,
                control: &self.control,
                shared,
                source,
                session: stream.session,
            };
            // SAFETY: the lander grants only the elements of an operation
            // that waits for its reply from this stream's source (the core's
            // landing spans, under its lock), and re-checks that it still
            // waits before every read; only a reply frees those slots, and
            // replies are handed to the core on this thread alone (control
            // messages, doorbells, write messages and these frames), never
            // while this read runs.
            #[allow(unsafe_code)]
            let pumped = unsafe { stream.pump(&mut lander) };
            moved |= pumped.moved;
            if pumped.broken {
                broken.push(source.clone());
            }
        }
        for source in broken {
            self.in_streams.remove(&source);
        }
        moved
    }

    /// Takes the write messages the worker received: a part that verifies
    /// as its session's message for an operation we wait on, fits what has
    /// landed of it (a part lands once; all parts agree on the keys and the
    /// cut), and carries exactly its share of that operation's granted
    /// bytes is copied there; the last part is handled as the write's
    /// `write_done`. Anything else is dropped unread.
    fn take_write_messages(&mut self, shared: &Arc<Shared>) {
        let stats = &self.control.stats;
        // Those the worker dropped at its bounds were refused unread too.
        let dropped = self.worker.dropped_messages();
        stats.write_messages_refused.fetch_add(
            dropped.saturating_sub(self.messages_dropped),
            std::sync::atomic::Ordering::Relaxed,
        );
        self.messages_dropped = dropped;
        for message in self.worker.take_messages() {
            let control = &self.control;
            let doorbell = &mut self.doorbell;
            let taken = doorbell
                .open_message(message.header(), |source| control.dialed_peer(source))
                .and_then(|opened| {
                    let fit = doorbell.fit_part(&opened);
                    if fit == PartFit::Refused {
                        return None;
                    }
                    let data = message.data();
                    shared.with_core_now(|core, now| {
                        // Under the core lock: the granted slots are this
                        // operation's while it waits for its reply (a part
                        // arriving after its deadline finds none).
                        let spans = core.peer_landing_spans(opened.op, opened.keys)?;
                        let pieces = opened.part_pieces(&spans, data.len() as u64)?;
                        // The data, cut into this part's pieces of the spans
                        // in order (their lengths sum to its length, checked
                        // above).
                        let mut from = data.as_ptr() as usize as u64;
                        let copies: Vec<CopySpan> = pieces
                            .into_iter()
                            .map(|(dst, len)| {
                                let src = from;
                                from += len;
                                CopySpan { src, dst, len }
                            })
                            .collect();
                        // SAFETY: every destination is a piece of an element
                        // of one of our registered regions (resolved by the
                        // core's region table), granted to operation `op`,
                        // whose FILLING slot nothing else reads or writes
                        // while the operation waits for its reply (checked
                        // just above for this part, under this same lock;
                        // the last part's reply is handled below, still
                        // under it); the sources tile `data` exactly (UCX's
                        // receive buffer, live for this call, never our
                        // memory, so no span overlaps itself).
                        #[allow(unsafe_code)]
                        unsafe {
                            crate::memory::copy_spans(&copies);
                        }
                        doorbell.land_part(&opened);
                        // Counted before the operation completes: whoever
                        // it wakes sees the count.
                        stats
                            .write_messages_taken
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if fit == PartFit::Last {
                            core.handle_message(now, opened.done);
                            doorbell.forget_op(opened.op);
                        }
                        Some(())
                    })
                });
            if taken.is_none() {
                stats
                    .write_messages_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

/// Ready when a data stream has bytes to read, or room for frames that
/// wait; registers every stream for a wake-up otherwise.
fn streams_ready(
    in_streams: &HashMap<ControlEndpoint, InStream<OpenedMessage>>,
    out_streams: &HashMap<ControlEndpoint, OutStream>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<()> {
    let mut ready = false;
    for stream in in_streams.values() {
        ready |= stream.poll_readable(cx).is_ready();
    }
    for stream in out_streams.values() {
        ready |= stream.poll_writable(cx).is_ready();
    }
    if ready {
        std::task::Poll::Ready(())
    } else {
        std::task::Poll::Pending
    }
}

/// Lands frames of a data stream from `source` as write messages are
/// landed: a header that opens under the key of the session it proved (the
/// one we still hold to `source`), for an operation sent to `source` that
/// waits for its reply, a part that fits, a length exactly its share.
struct FrameLander<'a> {
    doorbell: &'a mut TargetDoorbell,
    control: &'a ControlChannel,
    shared: &'a Arc<Shared>,
    source: &'a ControlEndpoint,
    session: u64,
}

impl Lander for FrameLander<'_> {
    type Opened = OpenedMessage;

    fn open(&mut self, len: u64, header: &[u8; SLOT_BYTES]) -> Landing<OpenedMessage> {
        let control = self.control;
        let same_session = self
            .doorbell
            .session_key(self.source)
            .is_some_and(|(s, _)| s == self.session);
        let opened = self
            .doorbell
            .open_message(header, |source| control.dialed_peer(source))
            .filter(|o| same_session && o.done.header.sender_endpoint == *self.source)
            .filter(|o| self.doorbell.fit_part(o) != PartFit::Refused);
        let Some(opened) = opened else {
            return Landing::Discard;
        };
        let spans = self.shared.with_core_now(|core, _| {
            let granted = core.peer_landing_spans(opened.op, opened.keys)?;
            opened.part_pieces(&granted, len)
        });
        match spans {
            Some(spans) => Landing::Into(opened, spans),
            None => Landing::Discard,
        }
    }

    fn still_granted(&mut self, opened: &OpenedMessage) -> bool {
        self.shared
            .with_core_now(|core, _| core.peer_awaits_reply(opened.op))
    }

    fn landed(&mut self, opened: OpenedMessage) {
        let stats = &self.control.stats;
        let doorbell = &mut *self.doorbell;
        let fit = doorbell.fit_part(&opened);
        if fit == PartFit::Refused {
            // Another part landed meanwhile as this one (a source that sent
            // it twice): its bytes were the operation's own; it completes
            // nothing.
            stats
                .stream_writes_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        doorbell.land_part(&opened);
        // Counted before the operation completes: whoever it wakes sees it.
        stats
            .stream_writes_taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if fit == PartFit::Last {
            doorbell.forget_op(opened.op);
            self.shared
                .with_core_now(|core, now| core.handle_message(now, opened.done));
        }
    }

    fn discarded(&mut self) {
        self.control
            .stats
            .stream_writes_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How puts are cut and how many are in flight, from the options and
/// whether the transports include tcp: explicit settings as given; with
/// neither a split nor a cap set, tcp splits into [`PutSplit::TCP_DEFAULT`]
/// and other transports put each span whole, 64 in flight.
fn put_plan(options: &PeerOptions, over_tcp: bool) -> (PutSplit, usize) {
    let split = options.put_split;
    match (split.chunk_bytes, options.max_puts_in_flight) {
        (0, 0) if over_tcp => (
            PutSplit::TCP_DEFAULT,
            PutSplit::TCP_DEFAULT.max_chunks_in_flight,
        ),
        (0, 0) => (split, 64),
        (0, n) => (split, n),
        (_, _) => (
            split,
            match split.max_chunks_in_flight {
                0 if over_tcp => PutSplit::TCP_IN_FLIGHT,
                0 => PutSplit::SHM_IN_FLIGHT,
                n => n,
            },
        ),
    }
}

/// A route leaving the table (replaced, its session gone, forgotten): its
/// endpoint closes without waiting on the peer once the last write using it
/// has ended (each write flushed before it reported), so a target that stops
/// progressing cannot stall this thread for a flush-mode close per route
/// (over shared memory, where UCX 1.13 has no forced close, that was the
/// whole `DROP_WAIT`, a second per route a member churned).
fn retire(route: Option<Rc<Route>>) {
    if let Some(endpoint) = route.as_deref().and_then(Route::ucx_endpoint) {
        endpoint.set_close_mode(CloseMode::Detach);
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

/// How long a destination's peer thread stays awake for a reply after its
/// last activity (a request sent, a message): about a one-block fetch's
/// round trip here. Bounded, so a runner whose source went quiet sleeps.
const ACTIVE_SPIN: Duration = Duration::from_micros(300);

/// How long a peer thread stays awake after its last activity when it
/// awaits nothing: a burst's next request then finds it running. Bounded, so
/// an idle node still sleeps (`peer.idle_cpu`).
///
/// Traced hop by hop on the H200 host, back-to-back one-block restores
/// reach the source 150–200 µs apart, and with 200 µs it had often gone to
/// sleep, noticing the next request 9–23 µs (median) after it was written
/// against 3–4 µs awake (the target's thread likewise, for its caller's next
/// request). On the 2-vCPU VM, where 1 MiB requests come 300 µs or more
/// apart (the caller checks each one's bytes), a source lingering 200 µs
/// was asleep for each and took 56 µs (median) to decode it against 10 µs;
/// 1 MiB requests went from 495–530 µs to 421–430 µs (p50, three
/// alternating runs each), smaller ones level. A lingering turn yields its
/// CPU to whoever else is runnable there, and the linger is skipped while
/// the host is contended (`contention`), so on a small host it takes only
/// a CPU nobody else wanted.
const LINGER: Duration = Duration::from_millis(1);

/// Whether UCX's tcp transport is kept on the loopback device: only for a
/// runner whose peers dial it on loopback, and only when the environment
/// names no devices itself.
fn pins_tcp_to_loopback(options: &PeerOptions, env_names_devices: bool) -> bool {
    options.advertise_host.is_loopback() && !env_names_devices
}

/// A stopping worker is destroyed once it made no progress for this long.
const DRAIN_QUIET: Duration = Duration::from_millis(2);
/// The most a stop waits for a busy worker to go quiet.
const DRAIN_MAX: Duration = Duration::from_millis(100);

/// The longest idle sleep: a backstop only (the core's wake time is always
/// sooner while anything is pending).
const MAX_IDLE_NAP: Duration = Duration::from_secs(1);

/// How long the idle peer thread naps between retries while its worker
/// cannot be armed and progress finds nothing (see `sleep_on_events`).
const UNARMABLE_NAP: Duration = Duration::from_millis(1);

/// How long the peer thread naps between progress rounds while a transfer is
/// under way and nothing moved for `SPIN_BEFORE_NAP` (`CONTENDED_SPIN_BEFORE_NAP`
/// on a contended host).
const WAIT_NAP: Duration = Duration::from_micros(10);

/// How long the peer thread spins without napping after its worker last made
/// progress (or a wait began): a quiet machine's transfers finish inside it.
const SPIN_BEFORE_NAP: Duration = Duration::from_micros(200);

/// The same while the host's CPUs are contended (`contention`): long enough
/// that a transfer whose bytes are moving (a TCP put is many segments, each
/// its own progress turn) keeps going, short enough that a stalled one hands
/// the CPU to the other side of it well inside a time slice.
const CONTENDED_SPIN_BEFORE_NAP: Duration = Duration::from_micros(30);

/// Cuts this thread's timer slack to 1 µs (Linux default: 50 µs), so a
/// `WAIT_NAP` sleep lasts about what it says. Best effort: on failure naps
/// are just longer.
#[allow(unsafe_code)]
fn precise_naps() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only
    // the calling thread's timer slack; no memory is passed.
    let _ = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
}

/// Registers the worker's event fd with the runtime (readable interest).
#[allow(unsafe_code)]
fn register_efd(fd: std::os::fd::RawFd) -> Option<tokio::io::unix::AsyncFd<RawFdRef>> {
    // SAFETY: `fd` is the UCX worker's event fd, open until the worker is
    // destroyed. The `AsyncFd` lives in `State::efd`, declared before
    // `State::worker`, so it is dropped (deregistered) before the worker
    // closes the fd; the leak path forgets both together.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            RawFdRef(fd),
            tokio::io::Interest::READABLE,
        )
    }
    .ok()
}

/// A borrowed file descriptor for `AsyncFd`: the worker owns (and closes) it.
struct RawFdRef(std::os::fd::RawFd);

impl std::os::fd::AsRawFd for RawFdRef {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

/// The pool holding the span's local bytes, and their offset in it.
fn pool_holding<'p>(
    pools: &'p [Registration<'static>],
    local: u64,
    len: u64,
) -> Option<(&'p Registration<'static>, u64)> {
    let end = local.checked_add(len)?;
    pools.iter().find_map(|p| {
        let base = p.as_ptr() as usize as u64;
        (local >= base && end <= base + p.len() as u64).then(|| (p, local - base))
    })
}

fn put(pools: &[Registration<'static>], route: &Route, span: &PutSpan) -> Result<Completion> {
    let (pool, offset) = pool_holding(pools, span.local, span.len)
        .ok_or(Error::runner(RunnerReason::LayoutMismatch))?;
    let RoutePath::Ucx { endpoint, rkeys } = &route.path else {
        return Err(Error::runner(RunnerReason::LayoutMismatch));
    };
    let (rkey, base) = rkeys
        .get(&span.region)
        .ok_or(Error::runner(RunnerReason::UnknownRegion(span.region.0)))?;
    let remote_offset = span
        .remote
        .checked_sub(*base)
        .ok_or(Error::runner(RunnerReason::LayoutMismatch))?;
    let len = usize::try_from(span.len).map_err(|_| Error::runner(RunnerReason::LayoutMismatch))?;
    let offset =
        usize::try_from(offset).map_err(|_| Error::runner(RunnerReason::LayoutMismatch))?;
    Ok(endpoint.put(pool, offset, len, rkey, remote_offset)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(local: u64, remote: u64, len: u64) -> PutSpan {
        PutSpan {
            local,
            remote,
            len,
            region: RegionId(3),
        }
    }

    /// Over tcp, an unconfigured runner splits its puts; any explicit
    /// setting is taken as given, and other transports keep puts whole.
    #[rstest::rstest]
    #[case::tcp_unconfigured(0, 0, 0, true, PutSplit::TCP_DEFAULT, 8)]
    #[case::shm_unconfigured(0, 0, 0, false, PutSplit::default(), 64)]
    #[case::tcp_whole_puts_by_cap(0, 0, 2, true, PutSplit::default(), 2)]
    #[case::shm_whole_puts_by_cap(0, 0, 5, false, PutSplit::default(), 5)]
    #[case::tcp_split_transport_depth(
        4 << 20,
        0,
        0,
        true,
        PutSplit::chunks_of(4 << 20),
        PutSplit::TCP_IN_FLIGHT
    )]
    #[case::shm_split_transport_depth(
        4 << 20,
        0,
        0,
        false,
        PutSplit::chunks_of(4 << 20),
        PutSplit::SHM_IN_FLIGHT
    )]
    #[case::split_and_depth_given(
        1 << 20,
        3,
        7,
        true,
        PutSplit { chunk_bytes: 1 << 20, max_chunks_in_flight: 3 },
        3
    )]
    fn put_plans_follow_the_options_and_the_transport(
        #[case] chunk_bytes: u64,
        #[case] max_chunks_in_flight: usize,
        #[case] max_puts_in_flight: usize,
        #[case] over_tcp: bool,
        #[case] split: PutSplit,
        #[case] in_flight: usize,
    ) {
        let mut options = PeerOptions::loopback();
        options.put_split = PutSplit {
            chunk_bytes,
            max_chunks_in_flight,
        };
        options.max_puts_in_flight = max_puts_in_flight;
        assert_eq!(put_plan(&options, over_tcp), (split, in_flight));
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

    /// A runner that peers dial over a network must not have its tcp
    /// transport pinned to loopback (every cross-host tcp route failed so).
    #[rstest::rstest]
    #[case::loopback(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        false,
        true
    )]
    #[case::loopback_with_env_devices(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        true,
        false
    )]
    #[case::network_host(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 1))),
        false,
        false
    )]
    #[case::dns_name(Host::Name("node-7.cluster".into()), false, false)]
    fn tcp_stays_on_loopback_only_for_loopback_runners(
        #[case] host: Host,
        #[case] env_names_devices: bool,
        #[case] pinned: bool,
    ) {
        let mut options = PeerOptions::loopback();
        options.advertise_host = host;
        assert_eq!(pins_tcp_to_loopback(&options, env_names_devices), pinned);
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
