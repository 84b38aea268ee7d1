//! The thin socket driver: one thread, one ZMQ context, a PUB and an optional
//! replay ROUTER. It moves bytes; the rules are in [`PublisherCore`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Instant;

use crate::core::{PublisherCore, Transmit};
use crate::error::{Echo, Error, PublisherReason, Result};
use crate::replay::{END_SEQ, ReplayBuffer, parse_request};
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

fn millis(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// The publisher's sockets. Field order is load-bearing: sockets drop before
/// the context (each also holds a context reference, so termination waits for
/// them regardless).
pub(super) struct Sockets {
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
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
        let replay = match &config.replay {
            None => None,
            Some(addr) => {
                let router = context
                    .socket(zmq::ROUTER)
                    .map_err(zmq_err("socket(ROUTER)"))?;
                // A reply larger than the HWM is cut short (and counted), never
                // blocks: vLLM 0.33 sizes it to the whole buffer, so do we.
                let hwm = config
                    .replay_batches
                    .saturating_add(1)
                    .saturating_mul(2)
                    .min(i32::MAX as usize) as i32;
                router
                    .set_sndhwm(hwm)
                    .map_err(zmq_err("setsockopt(SNDHWM)"))?;
                router
                    .set_rcvhwm(1024)
                    .map_err(zmq_err("setsockopt(RCVHWM)"))?;
                // Requests are 8-byte frames; refuse anything large.
                router
                    .set_maxmsgsize(256)
                    .map_err(zmq_err("setsockopt(MAXMSGSIZE)"))?;
                router
                    .set_router_mandatory(true)
                    .map_err(zmq_err("setsockopt(ROUTER_MANDATORY)"))?;
                router
                    .set_linger(millis(config.close_linger))
                    .map_err(zmq_err("setsockopt(LINGER)"))?;
                if matches!(addr.host, Some(std::net::IpAddr::V6(_))) {
                    router.set_ipv6(true).map_err(zmq_err("setsockopt(IPV6)"))?;
                }
                let ep = addr.to_string();
                router.bind(&ep).map_err(endpoint_err("bind", &ep))?;
                Some(router)
            }
        };
        Ok(Self {
            bind_mode: matches!(config.pub_socket, PubSocket::Bind(_)),
            publisher,
            replay,
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
                self.serve_replay();
                self.publish_stats();
                break;
            }
            match self.rx.recv_timeout(self.config.idle_tick) {
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
        let Some(router) = &self.sockets.replay else {
            return;
        };
        // Bounded work per round: at most the ROUTER's receive HWM.
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
            if self
                .replay_buf
                .oldest()
                .is_some_and(|oldest| req.start_seq < oldest)
            {
                self.stats.replay_truncated += 1;
            }
            let mut complete = true;
            for t in self.replay_buf.from_seq(req.start_seq) {
                if send_reply(router, &req.identity, t).is_err() {
                    complete = false;
                    break;
                }
                self.stats.replay_batches += 1;
            }
            let end: [&[u8]; 5] = [&req.identity, b"", b"", &END_SEQ, b""];
            if !complete || router.send_multipart(end, zmq::DONTWAIT).is_err() {
                self.stats.replay_aborted += 1;
            }
        }
    }

    fn publish_stats(&mut self) {
        self.stats.core = self.core.stats();
        let mut shared = self.shared.stats.lock().unwrap_or_else(|e| e.into_inner());
        *shared = self.stats;
    }
}

fn send_reply(router: &zmq::Socket, identity: &[u8], t: &Transmit) -> zmq::Result<()> {
    let frames: [&[u8]; 5] = [identity, b"", &t.topic, &t.seq.to_be_bytes(), &t.payload];
    router.send_multipart(frames, zmq::DONTWAIT)
}
