//! The peer thread: owns the UCX context, worker, endpoints and the
//! registered pool memory (UCX objects are `!Send`, so they live and die on
//! this one thread), and runs the control channel on a current-thread tokio
//! runtime. It feeds control messages and put completions into the shared core
//! and executes the core's peer actions (send, connect, put + flush).
//!
//! Writes into a same-host target whose pools this process mapped
//! ([`kvcr_sys::segment`]) are plain copies on the lanes
//! ([`crate::copy::lanes`]); the thread sleeps until the last lane reports.
//! While UCX puts are in flight (or a source may be putting into us through
//! UCX) the loop progresses the worker continuously (a transfer's
//! duration); otherwise it sleeps on its queues, the worker's event fd and
//! a timer set to the core's next peer deadline (at most a quarter of the
//! operation timeout, for stall detection): an idle runner does not wake.
//!
//! This module holds the thread's handle, its commands and its [`State`],
//! and dispatches the core's actions and the control channel's events;
//! the rest is by concern: [`thread`] (the loop and its naps), [`setup`],
//! [`routes`], [`writes`] (one-copy writes and the choice among the UCX
//! ways), [`puts`], [`messages`] (write messages), [`streams`] (data
//! streams), [`doorbells`] (records and mailbox requests read from shared
//! memory) and [`proofs`] (a UCX route's worker proving it is its target's).

mod device_check;
mod doorbells;
pub(crate) mod landing;
mod messages;
mod one_hop;
mod proofs;
mod puts;
mod routes;
mod setup;
mod streams;
mod thread;
mod waits;
mod writes;

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{Body, Message, SharedMemoryAdvert};
use kvcr_runner_core::Action;
use kvcr_ucx::{Context, Registration};

pub(crate) use self::one_hop::PassCounters;

use self::puts::PendingWrite;
use self::routes::{Route, retire};
use self::streams::DialedStream;
use crate::config::{PeerOptions, PutSplit};
use crate::copy::lanes::Lanes;
use crate::error::{Error, Result, RunnerReason};
use crate::net::doorbell::TargetDoorbell;
use crate::net::stream::{InStream, OutStream};
use crate::net::{ChannelEvent, ControlChannel, ControlStats, Inbound};
use crate::shared::Shared;
use crate::wire::doorbell::OpenedMessage;
use crate::wire::record::SLOT_BYTES;
use kvcr_sys::memfd::HostScope;
use kvcr_sys::placement::{PlacementOutcome, PoolMemory};
use kvcr_sys::segment::PeerSegment;

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
        memory: Arc<kvcr_sys::MemoryRegistry>,
    ) -> Result<(Self, PeerSetup)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let pool_memory = pool_memory.clone();
        let (setup_tx, setup_rx) = std::sync::mpsc::channel();
        let (shared_tx, shared_rx) = oneshot::channel();
        let options = options.clone();
        let thread = std::thread::Builder::new()
            .name("kvcr-peer".into())
            .spawn(move || {
                thread::run(
                    options,
                    incarnation,
                    (pool_bytes, prefault, pool_memory, adopted, memory),
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

/// Pool files and the control listener a guard handed over
/// ([`crate::guard`]): the runner maps those files (their bytes kept) and
/// accepts on that listener instead of making its own.
#[derive(Debug)]
pub(crate) struct Adopted {
    /// One pool file and its name token per pool, in order; `None`: the
    /// runner makes its own pools (the guard's could not be recovered).
    pub(crate) pools: Option<Vec<(std::fs::File, [u8; 16])>>,
    pub(crate) listener: std::net::TcpListener,
    /// The group's member key, kept by the guard (proven on the listener's
    /// sessions, named in the endpoint).
    pub(crate) member_key: crate::net::StaticKey,
}

/// Everything the peer thread owns. Field order is drop order and is
/// load-bearing: pending operations and routes (endpoints, remote keys) go
/// before the pool registrations, which go before the worker and context.
struct State {
    /// The worker's event fd registered with the runtime (dropped before the
    /// worker, which owns the fd).
    efd: Option<tokio::io::unix::AsyncFd<kvcr_ucx::WorkerEvents>>,
    pending: Vec<PendingWrite>,
    /// Data streams targets dialed to us (as their source), by target; the
    /// frames they queue read our pools, so they go before them.
    out_streams: HashMap<ControlEndpoint, OutStream>,
    /// Data streams that arrived before the route their proof is checked
    /// against (a target dials one beside the metadata that route is built
    /// from), by claimed target, with when they arrived: checked when that
    /// route is built, dropped at the handshake deadline.
    parked_streams: HashMap<ControlEndpoint, (Instant, crate::net::AcceptedStream)>,
    /// Data streams we dialed to our sources (as their target), by source;
    /// they read into our pools.
    in_streams: HashMap<ControlEndpoint, InStream<OpenedMessage>>,
    /// Sources a data stream is being dialed to.
    dialing: HashSet<ControlEndpoint>,
    streams_dialed_tx: mpsc::UnboundedSender<DialedStream>,
    streams_dialed: mpsc::UnboundedReceiver<DialedStream>,
    /// Whether we dial data streams to our sources ([`DataStream`]).
    data_stream: bool,
    /// Whether the data streams we dial ask for sealed records, and those
    /// dialed to us must ([`crate::StreamSealing`]).
    seal_streams: bool,
    /// Whether pages a same-host source checked in its copy are read again.
    landing_check: landing::LandingCheck,
    /// One-copy writes on the lanes whose pages are checked as they are
    /// copied (their `write_done` says so when they end well).
    checked_in_copy: HashSet<u64>,
    /// One-hop completions taken from the control channel this turn, handed
    /// to the device check's thread together at its end
    /// ([`State::submit_device_landings`]).
    device_landings: Vec<device_check::DeviceLanding>,
    /// Hashes one-hop landings on the device, off this thread; joined on
    /// drop after its launch under way.
    device_check: device_check::DeviceChecker,
    /// What the device check found, to hand to the core.
    device_checked: mpsc::UnboundedReceiver<device_check::CheckedLandings>,
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
    /// UCX routes built but not yet used: their worker has not yet handed
    /// our nonce back on the advert's session ([`proofs`]).
    unproven: HashMap<ControlEndpoint, proofs::UnprovenRoute>,
    /// Nonces our worker received for a session we dialed whose handshake
    /// this thread has not heard of yet (at most `proofs::MAX_HELD_NONCES`).
    held_nonces: Vec<proofs::HeldNonce>,
    /// Per target, the session its latest metadata came on (its route's
    /// proof counts only there).
    advert_sessions: HashMap<ControlEndpoint, u64>,
    /// Our incarnation (named in the nonces we send).
    incarnation: kvcr_contracts::incarnation::Incarnation,
    control: ControlChannel,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    /// Joined (after their queued copies) before the pools they read drop.
    lanes: Lanes,
    /// One-hop writes' thread, joined like the lanes (see `one_hop`).
    one_hop: one_hop::OneHopWriter,
    lane_done_tx: mpsc::UnboundedSender<(u64, bool)>,
    lane_done: mpsc::UnboundedReceiver<(u64, bool)>,
    /// One-hop writes whose lead landed, from the writer's thread (which
    /// holds the copier's locks then, so it never takes the core's).
    leads_landed_tx: mpsc::UnboundedSender<u64>,
    leads_landed: mpsc::UnboundedReceiver<u64>,
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
    /// The pools as the copy registry holds them (the registry, and so the
    /// pools, stay until these go; forgotten with the rest on a leak).
    _held_pools: Vec<kvcr_sys::RegisteredMemory>,
    /// What every copy into or out of the pools goes through.
    memory: Arc<kvcr_sys::MemoryRegistry>,
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
    /// Whether a completion from `source` may be taken as checked in its
    /// copy: [`landing::LandingCheck`] allows it, and `source` maps our
    /// pools (its one-copy writes are its own CPU's stores into them).
    fn trusts_copy_check(&self, source: &ControlEndpoint) -> bool {
        self.landing_check == landing::LandingCheck::TrustCopyCheck && self.doorbell.maps_us(source)
    }

    /// One item from the control channel: a message for the core, or a
    /// session that ended.
    fn on_inbound(&mut self, item: Inbound, shared: &Arc<Shared>) {
        let event = self.control.on_inbound(item);
        // A dialed session's handshake may be what a held nonce waited for.
        if !self.held_nonces.is_empty() {
            self.answer_held_nonces();
        }
        if let Some(ChannelEvent::Message(message, _)) = &event {
            timeline_inbound(&message.body);
        }
        self.on_channel_event(event, shared);
        crate::timeline::mark("inbound_handled", 0);
    }

    /// What [`Self::on_inbound`] does with the channel's event.
    fn on_channel_event(&mut self, event: Option<ChannelEvent>, shared: &Arc<Shared>) {
        // An operation that ended, held below or not, is no longer watched
        // for a doorbell record.
        if let Some(ChannelEvent::Message(message, _)) = &event
            && let Body::WriteDone { op_handle, .. } | Body::WriteRefused { op_handle } =
                &message.body
        {
            self.doorbell.forget_op(*op_handle);
        }
        let event = match event {
            Some(ChannelEvent::Message(message, session)) => {
                match device_check::device_landing(shared, message) {
                    Ok(held) => {
                        self.device_landings.push(held);
                        return;
                    }
                    Err(message) => Some(ChannelEvent::Message(*message, session)),
                }
            }
            other => other,
        };
        match event {
            Some(ChannelEvent::Message(message, session)) => {
                match &message.body {
                    // Whether the source reads the mailbox we post to.
                    Body::TargetMetadataAck { one_copy, .. } => {
                        self.doorbell
                            .note_mapped(&message.header.sender_endpoint, *one_copy);
                    }
                    // The route this builds reads its mailbox as this
                    // session's, and is proven on it.
                    Body::TargetMetadata { doorbell, .. } => {
                        let target = &message.header.sender_endpoint;
                        self.advert_sessions.insert(target.clone(), session);
                        if let Some(advert) = doorbell {
                            self.advertised_keys
                                .insert(target.clone(), (advert.key, session));
                        }
                    }
                    // Ours to check; the core never sees it.
                    Body::RouteProof { nonce } => {
                        let from = message.header.sender_endpoint.clone();
                        self.on_route_proof(shared, &from, session, nonce);
                        return;
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
                // Landed bytes are hashed outside the core's lock, unless
                // a source that maps our pools checked them in its copy (not
                // a one-hop completion: `device_landing` held those).
                let trust_copy_check = self.trusts_copy_check(&message.header.sender_endpoint);
                let checked = landing::check_in_memory(
                    shared,
                    message,
                    landing::Sent::PerKey { trust_copy_check },
                );
                if checked.trusted_copy_check() {
                    self.control
                        .stats
                        .landings_checked_in_copy
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                // Marked apart: the lock's wait, the core's handling, and
                // the pump of its actions (a one-hop write's plan) after.
                crate::timeline::mark("inbound_core_call", 0);
                shared.with_core_now(|core, now| {
                    crate::timeline::mark("inbound_locked", 0);
                    checked.hand(core, now);
                    crate::timeline::mark("inbound_core_done", 0);
                });
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
                self.advert_sessions.remove(&target);
                self.forget_unproven(&target);
                retire(self.routes.remove(&target));
                self.drop_out_stream(shared, &target);
                self.refuse_parked(&target);
            }
            Some(ChannelEvent::Stream(accepted)) => self.bind_out_stream(shared, accepted),
            None => {}
        }
    }

    /// Hands the one-hop completions held this turn to the device check's
    /// thread, together (they share a launch unless one is under way).
    fn submit_device_landings(&mut self) {
        self.device_check
            .submit(std::mem::take(&mut self.device_landings));
    }

    /// Gives the core one-hop completions the device check has hashed, in
    /// the order they came.
    fn hand_device_checks(&self, shared: &Shared, found: device_check::CheckedLandings) {
        self.control
            .stats
            .device_check_launches
            .fetch_add(found.launches, std::sync::atomic::Ordering::Relaxed);
        shared.with_core_now(|core, now| {
            for checked in found.checked {
                checked.hand(core, now);
            }
        });
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
                self.advert_sessions.remove(&peer);
                self.forget_unproven(&peer);
                retire(self.routes.remove(&peer));
                shared.with_core_now(|core, _| core.peer_connection_lost(&peer));
            }
            PeerCmd::Stop { leak } => return Some(leak),
        }
        None
    }
    /// Executes one of the core's peer actions.
    fn execute(&mut self, action: Action, shared: &Arc<Shared>) {
        match action {
            Action::Send { to, message } => self.send(&to, message),
            Action::Connect {
                peer,
                generation,
                worker_address,
                rkeys,
                shared_memory,
                extents,
                doorbell,
                device_regions,
            } => match self.route_path(
                &worker_address,
                &rkeys,
                shared_memory.as_ref(),
                &extents,
                doorbell.as_ref(),
            ) {
                Ok(path) => {
                    // Only a route that maps the target's pools (same host,
                    // proven its own) opens its device regions.
                    let device = match &path {
                        routes::RoutePath::OneCopy(_) => {
                            self.open_device_regions(shared, &peer, &device_regions)
                        }
                        routes::RoutePath::Ucx { .. } => one_hop::DeviceRoutes::default(),
                    };
                    let route = self.new_route(
                        &peer,
                        generation,
                        path,
                        doorbell.as_ref(),
                        &rkeys,
                        &extents,
                        device,
                    );
                    // A UCX route waits for its worker's proof; a one-copy
                    // route's pools were opened as the target's own.
                    if route.one_copy() {
                        self.route_built(shared, peer, generation, route);
                    } else {
                        self.prove_route(shared, peer, generation, route);
                    }
                }
                Err(why) => self.route_failed(shared, &peer, generation, why),
            },
            Action::Put {
                write,
                target,
                generation,
                spans,
                page_spans,
                device,
                lead_elements,
            } => {
                if device {
                    let route = self.accepted_route(&target, generation);
                    let lead = usize::from(lead_elements);
                    let copies = (spans.as_slice(), page_spans.as_slice());
                    self.write_device(shared, write, route.as_deref(), copies, lead);
                } else {
                    self.write(shared, write, &target, generation, spans);
                }
            }
            Action::Copy { .. } | Action::G3 { .. } | Action::Cancel { .. } => {}
        }
    }

    /// Sends a control message to `to`: metadata advertises our doorbell
    /// key on the session it dials (a data stream is dialed beside it); a
    /// `start_write` is awaited at our doorbell, and also posted to the
    /// source's mailbox when it maps us.
    fn send(&mut self, to: &ControlEndpoint, mut message: Message) {
        // Dialed beside the metadata, so the stream is bound by the
        // time the first `start_write` reaches the source (it is
        // checked once the route the metadata builds is there).
        let mut dial_stream = false;
        match &message.body {
            Body::TargetMetadata { .. } => {
                let session = self.control.dial(to);
                self.doorbell.advertise(to, session, &mut message.body);
                dial_stream = self.data_stream;
            }
            Body::StartWrite { op_handle, .. } => {
                self.doorbell.await_op(to, *op_handle);
            }
            _ => {}
        }
        let sent = self.control.send(to, &message);
        // A same-host source that maps us also finds it in its
        // mailbox, the moment it looks (the socket copy still goes).
        let posted = matches!(message.body, Body::StartWrite { .. })
            && self.request_mailbox
            && sent.is_some_and(|sent| {
                self.doorbell
                    .post_request(to, (sent.session, sent.index), sent.frame)
            });
        if posted {
            self.control
                .stats
                .mailbox_requests_posted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if dial_stream {
            self.dial_stream(to);
        }
    }
}

/// Marks the one-hop path's messages on the timeline (when it is on).
fn timeline_inbound(body: &Body) {
    if !crate::timeline::enabled() {
        return;
    }
    match body {
        Body::StartWrite { keys, .. } => {
            crate::timeline::mark("recv_start_write", keys.len() as u64)
        }
        Body::WriteLeadLanded { .. } => crate::timeline::mark("recv_lead_landed", 0),
        Body::WriteDone { .. } => crate::timeline::mark("recv_write_done", 0),
        _ => {}
    }
}
