//! A runner under a guard: its claim at start, the residency journal it
//! keeps while it serves, and the warm recovery of what an earlier
//! incarnation left in the guard's pools.
//!
//! Start, in order:
//! 1. claim the group ([`crate::guard::claim`]): the pools' memfds, the
//!    journal's memfd and the control listener, bound where the group's
//!    first claim asked (peers keep dialling the same address);
//! 2. on a warm grant, read the journal ([`journal::recover`]). A journal
//!    that is disabled (it overflowed) or corrupt disables warm recovery for
//!    the group: this incarnation runs on pool memory of its own (the
//!    guard's pools may still be written by a dead incarnation's peers, and
//!    only a healthy journal says where) and keeps no journal, and says so;
//! 3. the core seats the recovered pages ([`Core::recover`]) and the journal
//!    is resumed with exactly what was seated ([`JournalWriter::resume`]: a
//!    crash meanwhile leaves the old journal readable);
//! 4. from then on the runner appends the core's residency changes before
//!    it executes any action ([`RunnerJournal::append_from`], called first
//!    thing in every pump), so a `Removed` or `Held` is in the journal
//!    before the copy or the grant that could write those slots starts.

use std::time::Duration;

use kvcr_runner_core::Core;
use kvcr_runner_core::RecoveryReport;
use kvcr_runner_core::journal::{self, DisabledReason, JournalError, JournalWriter, Recovered};

use crate::config::{GuardOptions, PeerOptions};
use crate::error::Result;
use crate::guard::{self, GuardClaim, GuardLease, Layout, PoolSpec};
use crate::peer::Adopted;
use kvcr_sys::memfd::JournalMap;

/// How a runner under a guard started (see [`crate::Recovery::warm_start`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmStart {
    /// The group held.
    pub group: u32,
    /// Whether an earlier incarnation held the group (its memory is reused).
    pub warm: bool,
    /// That incarnation, when there was one.
    pub previous_incarnation: Option<u128>,
    /// The group's incarnations the guard saw die holding it.
    pub dead_incarnations: Vec<u128>,
    /// What the recovery seated (warm grants with a healthy journal).
    pub recovery: Option<RecoveryReport>,
    /// Why warm recovery is off for this incarnation, when it is: the
    /// journal was disabled (it overflowed) or corrupt. The runner then
    /// serves on pool memory of its own and keeps no journal.
    pub disabled: Option<String>,
}

/// What [`claim`] (or a guard starting its backup) hands to the runner's
/// start.
pub(crate) struct Claimed {
    /// The lease (a guard's own backup holds none).
    pub(crate) lease: Option<GuardLease>,
    pub(crate) adopted: Adopted,
    pub(crate) journal: JournalPlan,
    pub(crate) start: WarmStart,
}

/// What the runner does with the group's journal.
pub(crate) enum JournalPlan {
    /// Recovery disabled: no journal.
    None,
    /// Seat what it recovered (on a warm grant) and keep it from then on.
    Keep(JournalMap, Option<Recovered>),
    /// Seat these pages and never write the journal: a guard's backup
    /// serving a dead primary's pages changes no residency, and the next
    /// primary recovers from the journal as the dead one left it.
    ReadOnly(Recovered),
}

/// Claims the runner's group from its guard and reads what the journal
/// recovered (step 1 and 2 of the module doc).
pub(crate) fn claim(
    options: &GuardOptions,
    peer: &PeerOptions,
    pools: &[(String, u64, u32)],
    incarnation: u128,
) -> Result<Claimed> {
    let layout = Layout {
        pools: pools
            .iter()
            .map(|(name, block_bytes, blocks)| PoolSpec {
                name: name.clone(),
                block_bytes: *block_bytes,
                blocks: *blocks,
            })
            .collect(),
        journal_bytes: options.journal_bytes,
    };
    let control = crate::config::control_bind_address(peer)?.to_string();
    let claim = GuardClaim {
        group: options.group,
        compat_digest: options.compat_digest,
        layout,
        control,
        incarnation,
    };
    // A predecessor still exiting holds the group until its pidfd says it
    // is gone: retry that refusal (only that one) within the claim's time.
    #[allow(clippy::disallowed_methods)] // a driver reads the clock
    let deadline = std::time::Instant::now() + options.claim_timeout;
    let (lease, grant) = loop {
        #[allow(clippy::disallowed_methods)]
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match guard::claim(&options.socket, &claim, left.max(Duration::from_millis(1))) {
            Err(guard::GuardError::Refused(guard::Refusal::Held { .. })) if !left.is_zero() => {
                // Nothing here can wait on the predecessor's exit (the
                // guard watches it): a short bounded backoff.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(Duration::from_millis(20).min(left));
            }
            other => break other?,
        }
    };
    // Released if anything below fails.
    let lease = StartingLease::new(Some(lease));
    let map = JournalMap::new(&grant.journal, options.journal_bytes)?;
    // The runner keeps the mapping; the descriptor can go.
    drop(grant.journal);
    let recovered = if grant.warm {
        journal::recover(map.bytes()).map(Some)
    } else {
        Ok(None)
    };
    let mut start = WarmStart {
        group: options.group,
        warm: grant.warm,
        previous_incarnation: grant.previous_incarnation,
        dead_incarnations: grant.dead_incarnations,
        recovery: None,
        disabled: None,
    };
    let (pools, journal) = match recovered {
        Ok(recovered) => (Some(grant.pools), JournalPlan::Keep(map, recovered)),
        Err(e) => {
            let why = disabled_why(&e);
            eprintln!(
                "kvcr: KVCR pool recovery disabled for guard group {}: {why}; this incarnation serves on pool memory of its own and keeps no journal",
                options.group
            );
            start.disabled = Some(why);
            (None, JournalPlan::None)
        }
    };
    Ok(Claimed {
        lease: lease.started(),
        adopted: Adopted {
            pools,
            listener: grant.listener,
            member_key: grant.member_key,
        },
        journal,
        start,
    })
}

/// A guard's backup of the orphaned group `group`: its pool files and
/// listener (duplicates of the guard's), the recovered journal, read only.
/// `Err` says why the journal cannot be served from.
pub(crate) fn backup(
    group: u32,
    pools: Vec<(std::fs::File, [u8; 16])>,
    (listener, member_key): (std::net::TcpListener, crate::net::StaticKey),
    journal: &std::fs::File,
    dead: &[u128],
) -> Result<Claimed> {
    let len = journal
        .metadata()
        .map_err(|_| {
            crate::error::Error::runner(crate::error::RunnerReason::Config {
                field: "guard journal",
                why: "the journal file cannot be inspected",
            })
        })?
        .len();
    let map = JournalMap::new(journal, len)?;
    let recovered = journal::recover(map.bytes()).map_err(|e| {
        crate::error::Error::runner(crate::error::RunnerReason::Config {
            field: "guard journal",
            why: match e {
                JournalError::Disabled(_) => "the journal is disabled (it overflowed)",
                _ => "the journal is unreadable",
            },
        })
    })?;
    Ok(Claimed {
        lease: None,
        adopted: Adopted {
            pools: Some(pools),
            listener,
            member_key,
        },
        journal: JournalPlan::ReadOnly(recovered),
        start: WarmStart {
            group,
            warm: true,
            previous_incarnation: dead.last().copied(),
            dead_incarnations: dead.to_vec(),
            recovery: None,
            disabled: None,
        },
    })
}

/// A lease held while its runner starts: released if the start fails (the
/// group can then be claimed again, by a retry in this process too), kept
/// when a stage retained resources that may still touch the group's memory
/// ([`StartingLease::keep`]: the lease then ends with the process).
pub(crate) struct StartingLease {
    lease: Option<GuardLease>,
    release_on_drop: bool,
}

impl StartingLease {
    pub(crate) fn new(lease: Option<GuardLease>) -> Self {
        Self {
            lease,
            release_on_drop: true,
        }
    }

    /// The start failed with resources retained: never hand the memory on.
    pub(crate) fn keep(&mut self) {
        self.release_on_drop = false;
    }

    /// The runner started: it holds the lease now.
    pub(crate) fn started(mut self) -> Option<GuardLease> {
        self.lease.take()
    }
}

impl Drop for StartingLease {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            if self.release_on_drop {
                if let Err(e) = lease.release() {
                    eprintln!("kvcr: releasing the guard's group after a failed start: {e}");
                }
            } else {
                // Not released: the process's exit ends it.
                drop(lease);
            }
        }
    }
}

fn disabled_why(e: &JournalError) -> String {
    match e {
        JournalError::Disabled(DisabledReason::Overflow) => {
            "the journal overflowed (more pages than half of it holds)".to_owned()
        }
        JournalError::Disabled(reason) => format!("the journal was disabled ({reason:?})"),
        other => format!("the journal is unreadable: {other}"),
    }
}

/// The journal a runner under a guard keeps (under the runner's lock).
#[derive(Debug)]
pub(crate) struct RunnerJournal {
    map: JournalMap,
    /// `None` once the journal stopped (said once on stderr): it overflowed,
    /// or the core and the journal disagreed.
    writer: Option<JournalWriter>,
}

impl RunnerJournal {
    /// Seats what `recovered` holds in `core` (whose journal tap is turned
    /// on here) and starts the journal with exactly that (step 3).
    pub(crate) fn start(
        core: &mut Core,
        mut map: JournalMap,
        recovered: Option<Recovered>,
        start: &mut WarmStart,
    ) -> Self {
        core.enable_journal();
        let writer = match recovered {
            Some(recovered) => {
                let (report, seated) = core.recover(0, &recovered);
                if report.skipped > 0 {
                    eprintln!(
                        "kvcr: guard group {}: {} recovered pages skipped (first: {:?})",
                        start.group, report.skipped, report.refusals
                    );
                }
                start.recovery = Some(report);
                JournalWriter::resume(map.bytes_mut(), &seated)
            }
            None => JournalWriter::format(map.bytes_mut()),
        };
        let writer = match writer {
            Ok(w) => Some(w),
            Err(e) => {
                // The pages are seated; only the next recovery is lost.
                eprintln!(
                    "kvcr: guard group {}: the journal could not start ({e}); the runner serves without warm recovery for this group",
                    start.group
                );
                if let Ok(mut w) = JournalWriter::format(map.bytes_mut()) {
                    w.disable(map.bytes_mut(), DisabledReason::Requested);
                }
                None
            }
        };
        Self { map, writer }
    }

    /// Appends the core's residency changes since the last call (step 4).
    pub(crate) fn append_from(&mut self, core: &mut Core) {
        let records = core.take_journal();
        let Some(writer) = self.writer.as_mut() else {
            return;
        };
        for record in records {
            let Err(e) = writer.append_owned(self.map.bytes_mut(), record) else {
                continue;
            };
            if !matches!(e, JournalError::Disabled(_)) {
                // The core and the journal disagree: stop it, so a recovery
                // never trusts it.
                writer.disable(self.map.bytes_mut(), DisabledReason::Requested);
            }
            eprintln!(
                "kvcr: the residency journal stopped ({e}); the runner keeps serving, without warm recovery for this group"
            );
            self.writer = None;
            return;
        }
    }

    /// The journal's counters; `None` once it stopped.
    pub(crate) fn stats(&self) -> Option<journal::JournalStats> {
        self.writer.as_ref().map(JournalWriter::stats)
    }
}
