//! Admission: the places an accepted connection holds, in two stages.
//!
//! A connection waits in a [`WaitingPlace`] from `accept` until its
//! handshake is done (a data stream: until the peer thread has checked the
//! proof in its hello, [`StreamPlace`]): those places
//! are capped in total and per remote address
//! ([`ControlLimits::max_handshakes`]), apart from members' sessions. When
//! they are full, a new connection takes the place of the oldest waiting one
//! of the address holding the most (its own address's oldest when that
//! address is at its cap); the one displaced is closed and counted
//! (`evicted_handshakes`).
//!
//! Why displace rather than refuse: a silent connection costs its opener
//! nothing per second, so under "refuse the newcomer" whoever holds the
//! places first keeps every member out for as long as it likes (16
//! addresses × 16 connections stopped every honest restore). Displacing the
//! oldest makes holding worthless: an opener must make new connections
//! faster than a member's handshake completes (one round trip) to keep one
//! out, and since the victim comes from the fullest address, a member
//! alone on its address is never displaced while any other address holds
//! two.
//!
//! Once the handshake is done the connection holds an [`AdmissionGuard`]
//! instead: sessions (and data streams) in total and per address
//! ([`ControlLimits::max_sessions`]); past those it is refused and counted
//! (`refused_connections`). Only a process holding the cluster secret gets
//! there with a session, and only the holder of a session key with a data
//! stream. A data stream whose place was taken while the peer thread held
//! it unchecked (waiting for its route) is dropped with the next sweep of
//! those (at most 64, `MAX_PARKED_STREAMS`).
//!
//! [`ControlLimits::max_handshakes`]: super::ControlLimits::max_handshakes
//! [`ControlLimits::max_sessions`]: super::ControlLimits::max_sessions

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::channel::Shared;
use super::limits::SocketGuard;

/// How a waiting connection learns that a newer one took its place.
#[derive(Default)]
struct Displaced {
    notify: Notify,
    flag: AtomicBool,
}

/// The connections waiting for their handshake, by remote address, oldest
/// first.
#[derive(Default)]
pub(super) struct Waiting {
    by_address: HashMap<IpAddr, VecDeque<(u64, Arc<Displaced>)>>,
    total: usize,
    next: u64,
}

impl Waiting {
    /// The address whose oldest waiting connection makes room: `address`
    /// itself when it is at its cap, else (when all places are taken) the
    /// address holding the most, the oldest among equals.
    fn victim(&self, address: IpAddr, per_address: usize, total: usize) -> Option<IpAddr> {
        let here = self.by_address.get(&address).map_or(0, VecDeque::len);
        if here >= per_address {
            return Some(address);
        }
        if self.total < total {
            return None;
        }
        self.by_address
            .iter()
            .filter_map(|(a, queue)| Some((*a, queue.len(), queue.front()?.0)))
            .max_by_key(|(_, len, oldest)| (*len, std::cmp::Reverse(*oldest)))
            .map(|(a, _, _)| a)
    }

    fn evict_oldest(&mut self, address: IpAddr) {
        let Some(queue) = self.by_address.get_mut(&address) else {
            return;
        };
        if let Some((_, displaced)) = queue.pop_front() {
            self.total -= 1;
            displaced.flag.store(true, Ordering::Relaxed);
            displaced.notify.notify_one();
        }
        if queue.is_empty() {
            self.by_address.remove(&address);
        }
    }

    fn remove(&mut self, address: IpAddr, id: u64) -> bool {
        let Some(queue) = self.by_address.get_mut(&address) else {
            return false;
        };
        let before = queue.len();
        queue.retain(|(waiting, _)| *waiting != id);
        let removed = queue.len() < before;
        if removed {
            self.total -= 1;
        }
        if queue.is_empty() {
            self.by_address.remove(&address);
        }
        removed
    }
}

/// One accepted connection's place while its handshake runs.
pub(super) struct WaitingPlace {
    shared: Arc<Shared>,
    address: IpAddr,
    id: u64,
    displaced: Arc<Displaced>,
}

impl WaitingPlace {
    /// Takes a place for a connection from `address`, displacing the oldest
    /// waiting one when the caps are reached. Always succeeds.
    pub(super) fn take(shared: &Arc<Shared>, address: IpAddr) -> Self {
        let limits = &shared.limits;
        let mut waiting = lock(&shared.waiting);
        if let Some(victim) = waiting.victim(
            address,
            limits.max_handshakes_per_address,
            limits.max_handshakes,
        ) {
            waiting.evict_oldest(victim);
            let stats = &shared.stats;
            stats.evicted_handshakes.fetch_add(1, Ordering::Relaxed);
            stats.handshakes_waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let id = waiting.next;
        waiting.next += 1;
        let displaced = Arc::new(Displaced::default());
        waiting
            .by_address
            .entry(address)
            .or_default()
            .push_back((id, Arc::clone(&displaced)));
        waiting.total += 1;
        shared
            .stats
            .handshakes_waiting
            .fetch_add(1, Ordering::Relaxed);
        Self {
            shared: Arc::clone(shared),
            address,
            id,
            displaced,
        }
    }

    /// The remote address.
    pub(super) fn address(&self) -> IpAddr {
        self.address
    }

    /// Completes when a newer connection took this place.
    pub(super) async fn displaced(&self) {
        self.displaced.notify.notified().await;
    }

    /// Whether a newer connection took this place.
    fn was_displaced(&self) -> bool {
        self.displaced.flag.load(Ordering::Relaxed)
    }
}

impl Drop for WaitingPlace {
    fn drop(&mut self) {
        // Not there any more if it was displaced (counted then).
        if lock(&self.shared.waiting).remove(self.address, self.id) {
            self.shared
                .stats
                .handshakes_waiting
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Holds one session's (or data stream's) place under the caps, once its
/// handshake is done.
pub(super) struct AdmissionGuard {
    shared: Arc<Shared>,
    address: IpAddr,
}

impl AdmissionGuard {
    /// A place for a session from `address`; `None` over the caps.
    pub(super) fn admit(shared: &Arc<Shared>, address: IpAddr) -> Option<Self> {
        let mut per_address = lock(&shared.per_address);
        let here = per_address.entry(address).or_insert(0);
        let total = shared.accepted.load(Ordering::Relaxed);
        if *here >= shared.limits.max_sessions_per_address || total >= shared.limits.max_sessions {
            if *here == 0 {
                per_address.remove(&address);
            }
            return None;
        }
        *here += 1;
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        Some(Self {
            shared: Arc::clone(shared),
            address,
        })
    }
}

impl Drop for AdmissionGuard {
    fn drop(&mut self) {
        let mut per_address = lock(&self.shared.per_address);
        if let Some(here) = per_address.get_mut(&self.address) {
            *here -= 1;
            if *here == 0 {
                per_address.remove(&self.address);
            }
        }
        self.shared.accepted.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted data stream's places: a waiting one until the peer thread
/// checked the proof in its hello, then a session's.
pub(crate) struct StreamPlace {
    waiting: Option<WaitingPlace>,
    admitted: Option<AdmissionGuard>,
    _socket: SocketGuard,
}

impl StreamPlace {
    pub(super) fn new(waiting: WaitingPlace, socket: SocketGuard) -> Self {
        Self {
            waiting: Some(waiting),
            admitted: None,
            _socket: socket,
        }
    }

    /// The stream's proof verified: it takes a session's place (and gives
    /// its waiting one back). `false`: its waiting place was taken
    /// meanwhile, or the caps on sessions are reached (counted in
    /// `refused_connections`); the stream is to be dropped.
    pub(crate) fn admit(&mut self) -> bool {
        let Some(waiting) = self.waiting.as_ref() else {
            return self.admitted.is_some();
        };
        if waiting.was_displaced() {
            return false;
        }
        let admitted = AdmissionGuard::admit(&waiting.shared, waiting.address);
        if admitted.is_none() {
            waiting
                .shared
                .stats
                .refused_connections
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.admitted = admitted;
        self.waiting = None;
        true
    }

    /// Whether a newer connection took its waiting place before it was
    /// admitted.
    pub(crate) fn displaced(&self) -> bool {
        self.waiting
            .as_ref()
            .is_some_and(WaitingPlace::was_displaced)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
