//! The thin socket driver: one thread, one ZMQ context, a PUB and an optional
//! replay ROUTER. It moves bytes; the rules are in [`PublisherCore`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use crate::core::PublisherCore;
use crate::error::{Echo, Error, PublisherReason, Result};
use crate::replay::{END_SEQ, ReplayBuffer, parse_request};
use crate::serve::{Admission, Outgoing, PEER_SEND_HWM, ReplayPeers, Sent};
use crate::{BoundEndpoints, PubSocket, PublisherConfig, PublisherStats, Queued, Shared};
use kvcr_contracts::endpoint::BindAddress;

fn zmq_err(op: &'static str) -> impl Fn(zmq::Error) -> Error {
    move |e| Error::Publisher {
        reason: PublisherReason::Zmq {
            op,
            errno: e.to_raw(),
            message: e.message(),
        },
    }
}

fn endpoint_err(op: &'static str, endpoint: &str) -> impl Fn(zmq::Error) -> Error {
    let endpoint = Echo::new(endpoint);
    move |e| Error::Publisher {
        reason: PublisherReason::Endpoint {
            op,
            endpoint: endpoint.clone(),
            errno: e.to_raw(),
            message: e.message(),
        },
    }
}

/// The first wait of a round while replies wait on their peers: about a
/// thread hand-off, so a reader that keeps pace is not held to `idle_tick`.
const FIRST_REPLAY_WAIT: Duration = Duration::from_micros(20);

/// Messages a peer may have queued towards either socket.
const INBOUND_HWM: i32 = 16;

/// The largest message a peer may send (a replay request is 8 bytes, a
/// subscription a byte and a topic prefix).
const MAX_INBOUND_MESSAGE: i64 = 256;

/// Where the replay ROUTER reports its connections (the publisher's own
/// context, so the name is private to it).
const MONITOR_ENDPOINT: &str = "inproc://kvcr-publisher-replay-monitor";

/// The replay ROUTER, bounded ([`crate::ReplayLimits`]), and its monitor.
fn open_replay(
    context: &zmq::Context,
    config: &PublisherConfig,
    addr: &BindAddress,
) -> Result<(zmq::Socket, zmq::Socket)> {
    let router = context
        .socket(zmq::ROUTER)
        .map_err(zmq_err("socket(ROUTER)"))?;
    // One message per peer in ZMQ's pipe, and a send to a full or departed
    // peer fails instead of queueing: the reply is streamed (serve.rs).
    router
        .set_sndhwm(PEER_SEND_HWM)
        .map_err(zmq_err("setsockopt(SNDHWM)"))?;
    router
        .set_router_mandatory(true)
        .map_err(zmq_err("setsockopt(ROUTER_MANDATORY)"))?;
    let request_hwm = i32::try_from(config.replay_limits.request_hwm).unwrap_or(i32::MAX);
    router
        .set_rcvhwm(request_hwm)
        .map_err(zmq_err("setsockopt(RCVHWM)"))?;
    // Requests are 8-byte frames; refuse anything large.
    router
        .set_maxmsgsize(MAX_INBOUND_MESSAGE)
        .map_err(zmq_err("setsockopt(MAXMSGSIZE)"))?;
    // What is queued at close (replies finished in `finish_replies`) gets
    // `close_linger` to leave; ZMQ holds no more than the caps meanwhile.
    router
        .set_linger(millis(config.close_linger))
        .map_err(zmq_err("setsockopt(LINGER)"))?;
    if matches!(addr.host, Some(std::net::IpAddr::V6(_))) {
        router.set_ipv6(true).map_err(zmq_err("setsockopt(IPV6)"))?;
    }
    let events = zmq::SocketEvent::ACCEPTED as i32 | zmq::SocketEvent::DISCONNECTED as i32;
    router
        .monitor(MONITOR_ENDPOINT, events)
        .map_err(zmq_err("socket_monitor"))?;
    let monitor = context.socket(zmq::PAIR).map_err(zmq_err("socket(PAIR)"))?;
    monitor
        .set_linger(0)
        .map_err(zmq_err("setsockopt(LINGER)"))?;
    monitor
        .connect(MONITOR_ENDPOINT)
        .map_err(zmq_err("connect(monitor)"))?;
    let ep = addr.to_string();
    router.bind(&ep).map_err(endpoint_err("bind", &ep))?;
    Ok((router, monitor))
}

fn millis(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// The publisher's sockets. Field order is load-bearing: sockets drop before
/// the context (each also holds a context reference, so termination waits for
/// them regardless).
pub(super) struct Sockets {
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    /// The replay ROUTER's connection events (accepted, disconnected).
    monitor: Option<zmq::Socket>,
    /// Whether the PUB socket binds (its LAST_ENDPOINT is then ours).
    bind_mode: bool,
    _context: zmq::Context,
}

impl Sockets {
    /// Creates the sockets and binds/connects them, on the calling thread.
    pub(super) fn open(config: &PublisherConfig) -> Result<Self> {
        let context = zmq::Context::new();
        let publisher = context.socket(zmq::PUB).map_err(zmq_err("socket(PUB)"))?;
        let hwm = i32::try_from(config.pub_hwm).unwrap_or(i32::MAX);
        publisher
            .set_sndhwm(hwm)
            .map_err(zmq_err("setsockopt(SNDHWM)"))?;
        publisher
            .set_linger(millis(config.close_linger))
            .map_err(zmq_err("setsockopt(LINGER)"))?;
        // Subscribers send only subscriptions (a flag byte and a topic
        // prefix): keep few, and none large.
        publisher
            .set_rcvhwm(INBOUND_HWM)
            .map_err(zmq_err("setsockopt(RCVHWM)"))?;
        publisher
            .set_maxmsgsize(MAX_INBOUND_MESSAGE)
            .map_err(zmq_err("setsockopt(MAXMSGSIZE)"))?;
        match &config.pub_socket {
            PubSocket::Bind(addr) => {
                let ep = addr.to_string();
                if matches!(addr.host, Some(std::net::IpAddr::V6(_))) {
                    publisher
                        .set_ipv6(true)
                        .map_err(zmq_err("setsockopt(IPV6)"))?;
                }
                publisher.bind(&ep).map_err(endpoint_err("bind", &ep))?;
            }
            PubSocket::Connect(ep) => {
                let ep_s = ep.to_string();
                if matches!(
                    ep.host(),
                    kvcr_contracts::endpoint::Host::Ip(std::net::IpAddr::V6(_))
                ) {
                    publisher
                        .set_ipv6(true)
                        .map_err(zmq_err("setsockopt(IPV6)"))?;
                }
                publisher
                    .connect(&ep_s)
                    .map_err(endpoint_err("connect", &ep_s))?;
            }
        }
        let (replay, monitor) = match &config.replay {
            None => (None, None),
            Some(addr) => {
                let (router, monitor) = open_replay(&context, config, addr)?;
                (Some(router), Some(monitor))
            }
        };
        Ok(Self {
            bind_mode: matches!(config.pub_socket, PubSocket::Bind(_)),
            publisher,
            replay,
            monitor,
            _context: context,
        })
    }

    pub(super) fn bound(&self) -> Result<BoundEndpoints> {
        let last = |s: &zmq::Socket| -> Result<Option<BindAddress>> {
            match s
                .get_last_endpoint()
                .map_err(zmq_err("getsockopt(LAST_ENDPOINT)"))?
            {
                Ok(ep) if !ep.is_empty() => Ok(Some(BindAddress::parse(&ep)?)),
                _ => Ok(None),
            }
        };
        let pub_bound = if self.bind_mode {
            last(&self.publisher)?
        } else {
            None
        };
        let replay_bound = match &self.replay {
            Some(r) => last(r)?,
            None => None,
        };
        Ok(BoundEndpoints {
            pub_bound,
            replay_bound,
        })
    }
}

/// The driver loop's state.
pub(super) struct Driver {
    core: PublisherCore,
    replay_buf: ReplayBuffer,
    peers: ReplayPeers,
    /// How long the next round waits for events: nothing while replies are
    /// being read, a short wait doubling up to `idle_tick` while replies
    /// wait on their peers, `idle_tick` when none is open.
    replay_wait: Duration,
    sockets: Sockets,
    rx: Receiver<Queued>,
    shared: Arc<Shared>,
    config: PublisherConfig,
    seen_lost: u64,
    stats: PublisherStats,
    /// When a batch last left (for the heartbeat).
    last_sent: Instant,
}

/// The driver's monotonic clock, read once per idle round for the heartbeat.
#[allow(clippy::disallowed_methods)]
fn monotonic_now() -> Instant {
    Instant::now()
}

/// The one place the publisher reads the wall clock: the batch `ts`.
#[allow(clippy::disallowed_methods)]
fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Driver {
    pub(super) fn new(
        config: PublisherConfig,
        sockets: Sockets,
        rx: Receiver<Queued>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            core: PublisherCore::new(
                config.parts,
                config.incarnation,
                config.limits,
                config.max_live_blocks,
            )
            .with_ownership(config.ownership),
            replay_buf: ReplayBuffer::new(config.replay_batches, config.replay_bytes),
            peers: ReplayPeers::new(
                config.replay_limits.max_replies,
                config.replay_limits.queued_bytes,
            ),
            replay_wait: config.idle_tick,
            sockets,
            rx,
            shared,
            config,
            seen_lost: 0,
            stats: PublisherStats::default(),
            last_sent: monotonic_now(),
        }
    }

    pub(super) fn run(mut self) {
        // The attach barrier goes out first.
        self.transmit();
        loop {
            let closing = self.shared.closing.load(Ordering::Acquire);
            if closing {
                self.drain_all();
                self.core.close();
                self.transmit();
                self.finish_replies();
                self.publish_stats();
                break;
            }
            match self.rx.recv_timeout(self.replay_wait) {
                Ok(q) => {
                    self.handle(q);
                    for _ in 1..self.config.max_drain {
                        match self.rx.try_recv() {
                            Ok(q) => self.handle(q),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.trailing_loss();
                    if self.config.heartbeat.is_some_and(|every| {
                        monotonic_now().duration_since(self.last_sent) >= every
                    }) {
                        self.core.heartbeat();
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Only the Publisher's own sender can be left; it is gone.
                    self.shared.closing.store(true, Ordering::Release);
                }
            }
            self.transmit();
            self.serve_replay();
            self.publish_stats();
        }
        // Sockets close (with linger) and the context terminates here.
        drop(self.sockets);
    }

    fn handle(&mut self, q: Queued) {
        if q.lost_before > self.seen_lost {
            self.seen_lost = q.lost_before;
            self.core.lost();
        }
        self.core.handle(&q.event);
    }

    /// Losses after the last queued event: once the queue is seen empty
    /// *after* reading the loss count, every event queued before those losses
    /// has been handled, so the barrier goes after all of them.
    fn trailing_loss(&mut self) {
        let lost = self.shared.lost.load(Ordering::Acquire);
        if lost > self.seen_lost {
            match self.rx.try_recv() {
                Ok(q) => self.handle(q),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                    self.seen_lost = lost;
                    self.core.lost();
                }
            }
        }
    }

    fn drain_all(&mut self) {
        while let Ok(q) = self.rx.try_recv() {
            self.handle(q);
        }
        self.trailing_loss();
    }

    fn transmit(&mut self) {
        let ts = now_ts();
        while let Some(t) = self.core.poll_transmit(ts) {
            self.last_sent = monotonic_now();
            let frames: [&[u8]; 3] = [&t.topic, &t.seq.to_be_bytes(), &t.payload];
            if self
                .sockets
                .publisher
                .send_multipart(frames, zmq::DONTWAIT)
                .is_err()
            {
                self.stats.pub_send_errors += 1;
            }
            self.replay_buf.push(t);
        }
    }

    fn serve_replay(&mut self) {
        let (Some(router), Some(monitor)) = (&self.sockets.replay, &self.sockets.monitor) else {
            return;
        };
        while let Ok(event) = monitor.recv_multipart(zmq::DONTWAIT) {
            match event.first().and_then(|f| f.get(..2)) {
                Some(&[lo, hi]) => {
                    let code = u16::from_le_bytes([lo, hi]);
                    if code == zmq::SocketEvent::ACCEPTED as u16 {
                        self.peers.connection(true);
                    } else if code == zmq::SocketEvent::DISCONNECTED as u16 {
                        self.peers.connection(false);
                    }
                }
                _ => continue,
            }
        }
        self.peers.reclaim();
        // Bounded work per round.
        for _ in 0..1024 {
            let frames = match router.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(_) => break,
            };
            let Some(req) = parse_request(frames) else {
                self.stats.replay_bad_requests += 1;
                continue;
            };
            self.stats.replay_requests += 1;
            match self
                .peers
                .request(req.identity, req.start_seq, &self.replay_buf)
            {
                Admission::Answering => {}
                Admission::Displaced => self.stats.replay_displaced += 1,
                Admission::Refused => self.stats.replay_refused += 1,
            }
        }
        let pumped = self.peers.pump(&self.replay_buf, |identity, outgoing| {
            send_replay(router, identity, outgoing)
        });
        self.replay_wait = if pumped.accepted > 0 {
            Duration::ZERO
        } else if self.peers.open_replies() > 0 || self.peers.owes_ends() {
            (self.replay_wait * 2).clamp(FIRST_REPLAY_WAIT, self.config.idle_tick)
        } else {
            self.config.idle_tick
        };
        self.stats.replay_batches += pumped.batches;
        self.stats.replay_aborted += pumped.abandoned;
        self.stats.replay_truncated += pumped.truncated;
        self.stats.replay_open = self.peers.open_replies() as u64;
        self.stats.replay_stalled = self.peers.stalled_replies() as u64;
        self.stats.replay_queued_bytes = self.peers.queued_bytes() as u64;
        self.stats.replay_queued_peak = self.peers.peak_bytes() as u64;
    }

    /// At close, replies in progress get up to `close_linger` to be read to
    /// their end marker (a consumer waiting on one would otherwise wait
    /// forever); what is still open then is dropped with the socket.
    fn finish_replies(&mut self) {
        let deadline = monotonic_now() + self.config.close_linger;
        loop {
            self.serve_replay();
            if self.peers.open_replies() == 0 && !self.peers.owes_ends()
                || monotonic_now() >= deadline
            {
                break;
            }
            // The core is closed: whatever still arrives is only waited on.
            let _ = self.rx.recv_timeout(self.replay_wait);
        }
    }

    fn publish_stats(&mut self) {
        self.stats.core = self.core.stats();
        let mut shared = self.shared.stats.lock().unwrap_or_else(|e| e.into_inner());
        *shared = self.stats;
    }
}

/// One send of a reply; a full peer gets one more try after ZMQ has taken
/// in what its I/O thread reported (the pipe may have drained meanwhile).
fn send_replay(router: &zmq::Socket, identity: &[u8], outgoing: Outgoing<'_>) -> Sent {
    let attempt = || match outgoing {
        Outgoing::Batch(t) => {
            let frames: [&[u8]; 5] = [identity, b"", &t.topic, &t.seq.to_be_bytes(), &t.payload];
            router.send_multipart(frames, zmq::DONTWAIT)
        }
        Outgoing::End => {
            let frames: [&[u8]; 5] = [identity, b"", b"", &END_SEQ, b""];
            router.send_multipart(frames, zmq::DONTWAIT)
        }
    };
    // `ROUTER_MANDATORY`: a departed peer is EHOSTUNREACH, a full one EAGAIN;
    // anything else is tried again on a later turn.
    let outcome = |r: zmq::Result<()>| match r {
        Ok(()) => Some(Sent::Accepted),
        Err(zmq::Error::EHOSTUNREACH) => Some(Sent::Gone),
        Err(_) => None,
    };
    if let Some(sent) = outcome(attempt()) {
        return sent;
    }
    // Reading ZMQ_EVENTS processes the socket's pending commands, among
    // them the pipe's "read up to here" from the I/O thread.
    let _ = router.get_events();
    outcome(attempt()).unwrap_or(Sent::Full)
}
