//! The guard's groups and every decision about them, made under one lock
//! and without I/O but the making of a group's memory and listener.
//!
//! A group goes `Fresh` (made, never handed out) → `Leased` →
//! `Released` (clean) or `Orphaned` (its holder died) → `Leased` → ...
//! An `Orphaned` group is served by a backup runner when the guard is
//! configured to ([`GuardConfig::serve`]), stopped before the next claim of
//! the group is granted.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use kvcr_runner::guard::protocol::{self, ClaimMsg, GrantedMsg, Layout, Refusal, VERSION};
use kvcr_runner::{Runner, StaticKey};
use kvcr_sys::{fd_passing, memfd};

use crate::backup::start_backup;
use crate::{BackupServing, GuardConfig, GuardLog};

/// Where a group's lease stands.
#[derive(Debug)]
pub(crate) enum GroupState {
    /// Made, never handed out: nobody has had the memory.
    Fresh,
    /// A live process holds it.
    Leased(Lease),
    /// Its last holder released it.
    Released {
        /// That holder's incarnation.
        incarnation: u128,
    },
    /// Its last holder died holding it.
    Orphaned {
        /// That holder's incarnation.
        dead: u128,
    },
}

#[derive(Debug)]
pub(crate) struct Lease {
    id: u64,
    pid: u32,
    incarnation: u128,
    pidfd: Arc<OwnedFd>,
}

/// One group: what its first claim fixed, its memory and its listener.
#[derive(Debug)]
pub(crate) struct Group {
    compat_digest: u64,
    pub(crate) layout: Layout,
    /// The first claim's control string.
    control_asked: String,
    /// Where the listener is bound.
    pub(crate) control: SocketAddr,
    pub(crate) journal: File,
    pub(crate) pools: Vec<(File, [u8; 16])>,
    pub(crate) listener: TcpListener,
    state: GroupState,
    /// Incarnations that died holding it, oldest first.
    pub(crate) dead: VecDeque<u128>,
    /// While orphaned: the runner serving its recovered pages to peers.
    backup: Option<Runner>,
    /// The group's member key: every holder and backup proves it, so the
    /// group's endpoint names one key across restarts.
    pub(crate) member_key: StaticKey,
}

impl Group {
    /// Makes the memory and binds the listener of a group's first claim.
    fn create(claim: &ClaimMsg, control: SocketAddr) -> Result<Self, Refusal> {
        let failed = |what: &str, e: &dyn std::fmt::Display| Refusal::Failed {
            why: format!("{what}: {e}"),
        };
        let journal = memfd::create_journal_file(claim.layout.journal_bytes)
            .map_err(|e| failed("journal memfd", &e))?;
        let mut pools = Vec::with_capacity(claim.layout.pools.len());
        for (i, spec) in claim.layout.pools.iter().enumerate() {
            let bytes = spec.bytes().unwrap_or(0);
            let pool = memfd::create_pool_file(bytes)
                .map_err(|e| failed(&format!("pool {i} memfd"), &e))?;
            pools.push(pool);
        }
        let listener = TcpListener::bind(control)
            .map_err(|e| failed(&format!("bind control {control}"), &e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| failed("control address", &e))?;
        let member_key = StaticKey::generate().map_err(|e| failed("member key", &e))?;
        Ok(Self {
            compat_digest: claim.compat_digest,
            layout: claim.layout.clone(),
            control_asked: claim.control.clone(),
            control: bound,
            journal,
            pools,
            listener,
            state: GroupState::Fresh,
            dead: VecDeque::new(),
            backup: None,
            member_key,
        })
    }

    /// The first field in which `claim` differs from the group.
    fn difference(&self, claim: &ClaimMsg, control: SocketAddr) -> Option<String> {
        if claim.compat_digest != self.compat_digest {
            return Some("compat_digest".into());
        }
        if let Some(field) = self.layout.first_difference(&claim.layout) {
            return Some(field);
        }
        if claim.control != self.control_asked && control != self.control {
            return Some("control".into());
        }
        None
    }

    /// Copies of the descriptors to send: journal, pools, listener.
    fn descriptors(&self) -> io::Result<Vec<OwnedFd>> {
        let mut fds = Vec::with_capacity(self.pools.len() + 2);
        fds.push(OwnedFd::from(self.journal.try_clone()?));
        for (pool, _) in &self.pools {
            fds.push(OwnedFd::from(pool.try_clone()?));
        }
        fds.push(OwnedFd::from(self.listener.try_clone()?));
        Ok(fds)
    }
}

/// A claim granted but not yet delivered.
pub(crate) struct Grant {
    pub(crate) reply: GrantedMsg,
    pub(crate) fds: Vec<OwnedFd>,
    pub(crate) group: u32,
    pub(crate) lease: u64,
    /// The group's state before, restored if the grant is not delivered.
    pub(crate) prior: GroupState,
}

/// Every group, and every decision about them.
pub(crate) struct Registry {
    groups: BTreeMap<u32, Group>,
    next_lease: u64,
    max_groups: usize,
    max_pools: usize,
    max_group_bytes: u64,
    dead_kept: usize,
    serve: Option<BackupServing>,
}

impl Registry {
    pub(crate) fn new(config: &GuardConfig) -> Self {
        Self {
            groups: BTreeMap::new(),
            next_lease: 1,
            max_groups: config.max_groups,
            max_pools: config.max_pools,
            max_group_bytes: config.max_group_bytes,
            dead_kept: config.dead_kept,
            serve: config.serve.clone(),
        }
    }

    /// Decides a claim by `pid` (whose pidfd is `pidfd`); on a grant, the
    /// group is leased to it at once.
    pub(crate) fn claim(
        &mut self,
        claim: &ClaimMsg,
        pid: u32,
        pidfd: &Arc<OwnedFd>,
        log: &GuardLog,
    ) -> Result<Grant, Refusal> {
        if claim.version != VERSION {
            return Err(Refusal::Version { got: claim.version });
        }
        let invalid = |why: String| Refusal::Invalid { why };
        let incarnation = protocol::parse_hex128(&claim.incarnation)
            .filter(|i| *i != 0)
            .ok_or_else(|| invalid("incarnation is not 32 hex digits, not all 0".into()))?;
        let control: SocketAddr = claim
            .control
            .parse()
            .map_err(|_| invalid(format!("control {:?} is not ip:port", claim.control)))?;
        claim
            .layout
            .check(self.max_pools, self.max_group_bytes)
            .map_err(invalid)?;

        let group = match self.groups.get_mut(&claim.group) {
            Some(group) => {
                if let Some(field) = group.difference(claim, control) {
                    return Err(Refusal::Mismatch {
                        group: claim.group,
                        field,
                    });
                }
                group
            }
            None => {
                if self.groups.len() >= self.max_groups {
                    return Err(Refusal::TooManyGroups {
                        limit: u32::try_from(self.max_groups).unwrap_or(u32::MAX),
                    });
                }
                let group = Group::create(claim, control)?;
                log.line(format!(
                    "group {} made: {} pools, journal {} bytes, control {}",
                    claim.group,
                    group.pools.len(),
                    group.layout.journal_bytes,
                    group.control
                ));
                self.groups.entry(claim.group).or_insert(group)
            }
        };
        // A holder that has exited, though its task has not seen it yet.
        if let GroupState::Leased(lease) = &group.state
            && fd_passing::has_exited(lease.pidfd.as_fd()).unwrap_or(false)
        {
            let lease_id = lease.id;
            Self::end_by_death(claim.group, group, lease_id, self.dead_kept, log);
        }
        if let GroupState::Leased(lease) = &group.state {
            return Err(Refusal::Held {
                group: claim.group,
                pid: lease.pid,
            });
        }
        // The new primary takes over from the backup: it stops first (its
        // sessions close; destinations redial the same address).
        if let Some(backup) = group.backup.take() {
            let incarnation = backup.incarnation();
            drop(backup);
            log.line(format!(
                "group {}: backup {incarnation} stopped for the claim",
                claim.group
            ));
        }
        let fds = group.descriptors().map_err(|e| Refusal::Failed {
            why: format!("dup: {e}"),
        })?;
        let (warm, previous) = match group.state {
            GroupState::Fresh => (false, None),
            GroupState::Released { incarnation } | GroupState::Orphaned { dead: incarnation } => {
                (true, Some(incarnation))
            }
            GroupState::Leased(_) => (true, None),
        };
        let lease = self.next_lease;
        self.next_lease += 1;
        let prior = std::mem::replace(
            &mut group.state,
            GroupState::Leased(Lease {
                id: lease,
                pid,
                incarnation,
                pidfd: Arc::clone(pidfd),
            }),
        );
        let reply = GrantedMsg {
            version: VERSION,
            group: claim.group,
            layout: group.layout.clone(),
            pool_tokens: group
                .pools
                .iter()
                .map(|(_, token)| protocol::token_hex(token))
                .collect(),
            control: group.control.to_string(),
            warm,
            previous_incarnation: previous.map(protocol::hex128),
            dead_incarnations: group.dead.iter().copied().map(protocol::hex128).collect(),
            member_key: protocol::member_key_hex(&group.member_key),
        };
        log.line(format!(
            "group {} granted to pid {pid} (incarnation {}){}",
            claim.group,
            protocol::hex128(incarnation),
            if warm { ", warm" } else { ", fresh" }
        ));
        Ok(Grant {
            reply,
            fds,
            group: claim.group,
            lease,
            prior,
        })
    }

    /// The lease's holder exited: the group is orphaned, its incarnation
    /// dead.
    fn end_by_death(id: u32, group: &mut Group, lease: u64, dead_kept: usize, log: &GuardLog) {
        let GroupState::Leased(held) = &group.state else {
            return;
        };
        if held.id != lease {
            return;
        }
        let (pid, dead) = (held.pid, held.incarnation);
        group.state = GroupState::Orphaned { dead };
        group.dead.push_back(dead);
        while group.dead.len() > dead_kept {
            group.dead.pop_front();
        }
        log.line(format!(
            "primary pid {pid} (incarnation {}) of group {id} died",
            protocol::hex128(dead)
        ));
    }

    /// The holder of lease `lease` on `group` exited: with serving
    /// configured, a backup serves the group's pages until the next claim.
    pub(crate) fn died(&mut self, group: u32, lease: u64, log: &GuardLog) {
        let dead_kept = self.dead_kept;
        let Some(entry) = self.groups.get_mut(&group) else {
            return;
        };
        Self::end_by_death(group, entry, lease, dead_kept, log);
        if let (Some(serving), GroupState::Orphaned { .. }, None) =
            (&self.serve, &entry.state, &entry.backup)
        {
            entry.backup = start_backup(group, entry, serving, log);
        }
    }

    /// The holder of lease `lease` on `group` released it; false when that
    /// lease has ended already.
    pub(crate) fn release(&mut self, group: u32, lease: u64, log: &GuardLog) -> bool {
        let Some(entry) = self.groups.get_mut(&group) else {
            return false;
        };
        let GroupState::Leased(held) = &entry.state else {
            return false;
        };
        if held.id != lease {
            return false;
        }
        let (pid, incarnation) = (held.pid, held.incarnation);
        entry.state = GroupState::Released { incarnation };
        log.line(format!(
            "group {group} released by pid {pid} (incarnation {})",
            protocol::hex128(incarnation)
        ));
        true
    }

    /// A grant that was never delivered: the group goes back to `prior`.
    pub(crate) fn rollback(&mut self, group: u32, lease: u64, prior: GroupState) {
        if let Some(entry) = self.groups.get_mut(&group)
            && matches!(&entry.state, GroupState::Leased(held) if held.id == lease)
        {
            entry.state = prior;
        }
    }
}
