//! kvcr-guard: the guard, a process that owns each rank's pool memory and
//! control listener, so they outlive the engine that uses them; and the
//! `kvcr-guard` binary that runs one.
//!
//! A rank's runner claims its *group* from the guard over a Unix socket and
//! gets the group's memory as descriptors: a journal memfd, one memfd per
//! pool and the bound TCP control listener. When the engine dies, the guard
//! still holds all of it, and the restarted engine claims the group back
//! and finds its pages warm. The runner's side (the lease client, the
//! checks of a grant, the wire and the lease's rules) is
//! [`kvcr_runner::guard`]; this crate is the other end of that socket.
//!
//! | module | what |
//! |---|---|
//! | `service` | the socket, the accept loop, a connection's claim and its lease ([`GuardService`], [`GuardHandle`]) |
//! | `registry` | the groups and every decision about them, under one lock |
//! | `backup` | the backup runner of an orphaned group ([`BackupServing`]) |
//!
//! # Limits
//! At most [`GuardConfig::max_groups`] groups (64) of at most
//! [`GuardConfig::max_pools`] pools (16) and [`GuardConfig::max_group_bytes`]
//! (1 TiB); at most [`GuardConfig::max_pending`] connections (16) that have
//! not been granted yet (more are accepted and closed at once), each closed
//! if its claim has not arrived within [`GuardConfig::claim_timeout`] (5 s);
//! frames of at most [`protocol::MAX_FRAME`](kvcr_runner::guard::protocol::MAX_FRAME)
//! bytes. Granted connections are bounded by the groups (one lease each).
//! Only processes of the guard's own uid (or root) are served; the socket
//! file is mode 0600, in a directory no other user owns or may write. The
//! guard never reads or writes the pools.
//!
//! No unsafe here: the system calls (`SCM_RIGHTS`, peer credentials,
//! pidfds, memfds) are `kvcr_sys`'s.

#![forbid(unsafe_code)]

mod backup;
mod registry;
mod service;
#[cfg(test)]
mod tests;

use std::io;
use std::sync::mpsc::Sender;
use std::time::Duration;

use kvcr_runner::PeerOptions;
pub use kvcr_runner::guard::{GuardError, Layout, PoolSpec, Refusal};

pub use self::service::{GuardHandle, GuardService};

/// Where the guard's log lines go.
#[derive(Debug, Clone, Default)]
pub enum GuardLog {
    /// Standard error, prefixed `kvcr-guard: ` (the default).
    #[default]
    Stderr,
    /// Nowhere.
    Discard,
    /// One `String` per line, unprefixed (tests).
    Channel(Sender<String>),
}

impl GuardLog {
    pub(crate) fn line(&self, text: String) {
        match self {
            Self::Stderr => eprintln!("kvcr-guard: {text}"),
            Self::Discard => {}
            Self::Channel(tx) => {
                let _ = tx.send(text);
            }
        }
    }
}

/// The guard's limits and log.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Most groups the guard keeps (64).
    pub max_groups: usize,
    /// Most pools in one group (16).
    pub max_pools: usize,
    /// Most bytes of one group, journal and pools together (1 TiB).
    pub max_group_bytes: u64,
    /// Most connections not granted yet (16); more are accepted and closed.
    pub max_pending: usize,
    /// How long a connection may take to send its claim (5 s).
    pub claim_timeout: Duration,
    /// Dead incarnations remembered per group, the latest (64).
    pub dead_kept: usize,
    /// Where log lines go.
    pub log: GuardLog,
    /// Serve an orphaned group's pages to peers on its control address until
    /// a new primary claims it (`None`, the default: hold the memory only).
    pub serve: Option<BackupServing>,
}

/// How a guard serves the pages of a group whose primary died: a backup
/// runner over the group's pools and listener, seated from the journal
/// (read only), answering peers as the primary did (authenticated with the
/// same cluster secret) and reporting the dead incarnations in its probe
/// replies, so destinations free the slots they held for it. It stops when
/// a new primary claims the group.
#[derive(Debug, Clone)]
pub struct BackupServing {
    /// The backup runners' peer options: the cluster secret, UCX transports,
    /// control limits. `bind` and `guard` are not used (a backup accepts on
    /// its group's listener); `advertise_host` is, when the group's control
    /// address is a wildcard (otherwise that address is advertised).
    pub peer: PeerOptions,
    /// A backup's operation timeout.
    pub operation_timeout: Duration,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            max_groups: 64,
            max_pools: 16,
            max_group_bytes: 1 << 40,
            max_pending: 16,
            claim_timeout: Duration::from_secs(5),
            dead_kept: 64,
            log: GuardLog::Stderr,
            serve: None,
        }
    }
}

/// [`GuardError::Os`] of a failed `call`.
fn os_error(call: &'static str) -> impl Fn(io::Error) -> GuardError {
    move |e| GuardError::Os {
        call,
        errno: e.raw_os_error().unwrap_or(0),
    }
}

/// [`GuardError::Protocol`], saying `why`.
fn protocol_error(why: impl Into<String>) -> GuardError {
    GuardError::Protocol { why: why.into() }
}
