//! A guard's backup of an orphaned group: the one way into the runner's
//! start-up that the guard (the `kvcr-guard` crate) needs.
//!
//! When a group's primary dies, a guard configured to serve starts a runner
//! over duplicates of the group's pool files and listener, seated from the
//! journal the dead primary left, read only: it changes no residency, so the
//! next primary recovers from the journal as the dead one left it. The
//! start-up is the runner's peer path (`startup::with_peers`) with the
//! group's memory adopted instead of claimed; what the guard decides (when
//! to start one, its options, when to stop it) stays in the guard.

use std::fs::File;
use std::net::TcpListener;

use crate::config::{PeerOptions, RunnerConfig};
use crate::error::Result;
use crate::net::StaticKey;
use crate::{Runner, startup, warm};

/// An orphaned group as the guard holds it, handed to
/// [`Runner::start_backup`].
#[derive(Debug)]
pub struct OrphanedGroup<'a> {
    /// The group.
    pub group: u32,
    /// Its pool files and their name tokens, in layout order (duplicates of
    /// the guard's: the backup maps them with their bytes kept).
    pub pools: Vec<(File, [u8; 16])>,
    /// Its control listener (a duplicate of the guard's).
    pub listener: TcpListener,
    /// Its member key (the guard's for the group): the backup answers as
    /// the group's member, as its primaries did.
    pub member_key: StaticKey,
    /// Its journal, read and never written.
    pub journal: &'a File,
    /// The group's incarnations that died holding it, oldest first.
    pub dead_incarnations: &'a [u128],
}

impl Runner {
    /// A guard's backup of an orphaned group: a runner over the group's
    /// pools and listener serving the pages its journal recovered, on the
    /// dead primary's control address, never writing the journal. Refused
    /// when the journal cannot be served from (disabled or unreadable).
    pub fn start_backup(
        config: RunnerConfig,
        peer: &PeerOptions,
        orphan: OrphanedGroup<'_>,
    ) -> Result<Self> {
        let OrphanedGroup {
            group,
            pools,
            listener,
            member_key,
            journal,
            dead_incarnations,
        } = orphan;
        let claimed = warm::backup(
            group,
            pools,
            (listener, member_key),
            journal,
            dead_incarnations,
        )?;
        startup::with_peers(config, None, peer, Some(claimed)).map(Self::from_started)
    }
}
