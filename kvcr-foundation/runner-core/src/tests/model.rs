//! Model-based property tests: random steps run against the core and a
//! plain model of what it must hold, with and without a G3, and the cases
//! they once found, kept as fixed runs.

use super::*;

#[derive(Debug, Clone)]
enum Step {
    Deposit { keys: Vec<u8>, no_evict: bool },
    Fetch { keys: Vec<u8> },
    Deliver { keys: Vec<u8> },
    Release { claim: usize, bogus: bool },
    Abort { op: usize, partial: bool },
    Complete { job: usize, outcome: u8 },
    Advance { ns: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    let keys = proptest::collection::vec(0u8..12, 1..5);
    prop_oneof![
        3 => (keys.clone(), any::<bool>()).prop_map(|(keys, no_evict)| Step::Deposit { keys, no_evict }),
        2 => keys.clone().prop_map(|keys| Step::Fetch { keys }),
        2 => keys.prop_map(|keys| Step::Deliver { keys }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(claim, bogus)| Step::Release { claim, bogus }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(op, partial)| Step::Abort { op, partial }),
        5 => (any::<usize>(), 0u8..10).prop_map(|(job, outcome)| Step::Complete { job, outcome }),
        2 => (0u64..600).prop_map(|ns| Step::Advance { ns }),
    ]
}

#[derive(Default)]
struct Model {
    now: u64,
    /// Jobs in flight: id, keys, whether it is a G3 job (which may fail).
    jobs: Vec<(JobId, usize, bool)>,
    cancelled: HashSet<(JobId, u32)>,
    ops: Vec<OpHandle>,
    completed: HashSet<OpHandle>,
    claims: Vec<(ReleaseHandle, ScopedKey)>,
    released: HashSet<ReleaseHandle>,
    /// Entries (op, position in the op) that were aborted while pending.
    failed_entries: HashSet<(OpHandle, usize)>,
    /// Per medium (DRAM or DISK) and key: stored events minus removed ones.
    stored_minus_removed: HashMap<(Medium, ScopedKey), i64>,
}

impl Model {
    fn drain(&mut self, core: &mut Core) -> Result<(), TestCaseError> {
        while let Some(action) = core.poll_action() {
            match action {
                Action::Copy { job, keys, .. } => self.jobs.push((job, keys.len(), false)),
                Action::G3 { job, transfers, .. } => {
                    self.jobs.push((job, transfers.len(), true));
                }
                Action::Cancel { job, key } => {
                    self.cancelled.insert((job, key));
                }
                Action::Send { .. } | Action::Connect { .. } | Action::Put { .. } => {
                    return Err(TestCaseError::fail("peer action without peers"));
                }
            }
        }
        for event in core.drain_events().collect::<Vec<_>>() {
            match event {
                InventoryEvent::Stored { keys, scope, .. } => {
                    for k in keys {
                        let key = ScopedKey {
                            namespace: scope.namespace,
                            key: k,
                        };
                        *self
                            .stored_minus_removed
                            .entry((scope.medium, key))
                            .or_default() += 1;
                    }
                }
                InventoryEvent::Removed { keys, scope } => {
                    for k in keys {
                        let key = ScopedKey {
                            namespace: scope.namespace,
                            key: k,
                        };
                        *self
                            .stored_minus_removed
                            .entry((scope.medium, key))
                            .or_default() -= 1;
                    }
                }
                InventoryEvent::AllCleared { .. } => {}
            }
        }
        let mut done = Vec::new();
        core.drain_completed(&mut done);
        for result in done {
            prop_assert!(
                self.completed.insert(result.op),
                "op {:?} completed twice",
                result.op
            );
            for (position, (key, entry)) in result.entries.iter().enumerate() {
                if self.failed_entries.contains(&(result.op, position)) {
                    prop_assert!(
                        !entry.is_success(),
                        "an aborted/expired key of {:?} became a success",
                        result.op
                    );
                }
                if let Some(release) = entry.release {
                    prop_assert!(entry.is_success());
                    self.claims.push((release, *key));
                }
            }
        }
        Ok(())
    }

    fn check(&self, core: &Core) -> Result<(), TestCaseError> {
        core.check_invariants().map_err(TestCaseError::fail)?;
        // A live claim pins its page READY.
        for (handle, key) in &self.claims {
            if !self.released.contains(handle) {
                prop_assert_eq!(
                    core.query(key),
                    QueryStatus::Hit,
                    "claimed {:?} not resident",
                    key
                );
            }
        }
        // Stored and removed balance, per tier: at most one stored
        // residency per key, and it is stored exactly when the key is READY
        // there (KVCR DRAM: a query hit; G3: its bytes are in the file).
        for ((medium, key), balance) in &self.stored_minus_removed {
            prop_assert!(
                (0..=1).contains(balance),
                "{:?} {:?}: stored - removed = {}",
                medium,
                key,
                balance
            );
            let ready = if *medium == Medium::Disk {
                core.g3_ready(key)
            } else {
                core.query(key) == QueryStatus::Hit
            };
            prop_assert_eq!(
                *balance == 1,
                ready,
                "{:?}: balance {} but query {:?}",
                key,
                balance,
                core.query(key)
            );
        }
        Ok(())
    }
}

fn run_steps(steps: Vec<Step>, lru: bool) -> Result<(), TestCaseError> {
    run_steps_with(steps, lru, None, 1, false).map(drop)
}

/// Runs `steps` against a core (with a G3 of `g3` slots) and the model;
/// returns G3's counters at the end.
fn run_steps_with(
    steps: Vec<Step>,
    lru: bool,
    g3: Option<u32>,
    spans_per_key: u8,
    ahead: bool,
) -> Result<Option<crate::machine::G3Counters>, TestCaseError> {
    let (mut core, ns, region) = core_with_g3_ahead(6, lru, 1_000, g3, ahead);
    let mut m = Model::default();
    let mut journal = Journal::new(&mut core);
    // A page of `spans_per_key` spans (K and V, say), elements 30 apart.
    let spans = |k: u8| {
        (0..spans_per_key)
            .map(|s| ElementRef {
                region,
                index: u64::from(k) + 30 * u64::from(s),
            })
            .collect::<Vec<_>>()
    };
    let layout = vec![PoolId(0); usize::from(spans_per_key)];
    for step in steps {
        match step {
            Step::Deposit { keys, no_evict } => {
                let entries = keys
                    .iter()
                    .map(|k| DepositEntry {
                        key: key(ns, *k),
                        spans: spans(*k),
                        page: None,
                    })
                    .collect();
                m.ops.push(
                    core.deposit(m.now, entries, no_evict)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?,
                );
            }
            Step::Fetch { keys } => {
                let keys: Vec<ScopedKey> = keys.iter().map(|k| key(ns, *k)).collect();
                m.ops.push(
                    core.fetch(m.now, &keys, &layout, None)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?,
                );
            }
            Step::Deliver { keys } => {
                let entries = keys
                    .iter()
                    .map(|k| DeliverEntry {
                        key: key(ns, *k),
                        destinations: spans(*k + 20),
                    })
                    .collect();
                m.ops.push(
                    core.deliver(m.now, entries, None)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?,
                );
            }
            Step::Release { claim, bogus } => {
                if bogus || m.claims.is_empty() {
                    let out = core.release(&[ReleaseHandle(u64::MAX - claim as u64 % 7)]);
                    prop_assert_eq!(out, vec![false]);
                } else {
                    let (handle, _) = m.claims[claim % m.claims.len()];
                    let out = core.release(&[handle]);
                    prop_assert_eq!(
                        out,
                        vec![!m.released.contains(&handle)],
                        "release twice must be false"
                    );
                    m.released.insert(handle);
                }
            }
            Step::Abort { op, partial } => {
                if !m.ops.is_empty() {
                    let handle = m.ops[op % m.ops.len()];
                    let k = [key(ns, (op % 12) as u8)];
                    let keys = partial.then_some(&k[..]);
                    let pending = core.pending_entries(handle);
                    if core.abort(handle, keys) {
                        for (position, _) in pending
                            .into_iter()
                            .filter(|(_, p)| keys.is_none_or(|ks| ks.contains(p)))
                        {
                            m.failed_entries.insert((handle, position));
                        }
                    }
                }
            }
            Step::Complete { job, outcome } => {
                if !m.jobs.is_empty() {
                    let (id, n, is_g3) = m.jobs.remove(job % m.jobs.len());
                    // The simulated copy engine honours cancellation, as the
                    // real one does for keys that have not started; a G3
                    // transfer can also fail (a full disk, a read error).
                    let outcomes: Vec<CopyOutcome> = (0..n as u32)
                        .map(|i| {
                            if m.cancelled.contains(&(id, i)) {
                                CopyOutcome::Cancelled
                            } else if outcome == 0 {
                                CopyOutcome::DeadlinePassed
                            } else if outcome == 1 && is_g3 {
                                CopyOutcome::Failed
                            } else {
                                CopyOutcome::Copied
                            }
                        })
                        .collect();
                    core.handle_copy_done(m.now, id, &outcomes);
                }
            }
            Step::Advance { ns: dt } => {
                m.now += dt;
                core.handle_timeout(m.now);
            }
        }
        m.drain(&mut core)?;
        m.check(&core)?;
        journal.check(&mut core)?;
    }
    // Drain: finish every copy, then every op must complete.
    while let Some((id, n, _)) = m.jobs.pop() {
        core.handle_copy_done(m.now, id, &vec![CopyOutcome::Copied; n]);
        m.drain(&mut core)?;
    }
    m.now += 10_000;
    core.handle_timeout(m.now);
    m.drain(&mut core)?;
    m.check(&core)?;
    for op in &m.ops {
        prop_assert!(m.completed.contains(op), "op {:?} never completed", op);
    }
    prop_assert_eq!(core.jobs_in_flight(), 0);
    journal.check(&mut core)?;
    // A fresh core seats exactly those pages, on the same slots.
    let (mut fresh, _, _) = core_with_g3_ahead(6, lru, 1_000, g3, ahead);
    let recovered = crate::journal::recover(&journal.region)
        .map_err(|e| TestCaseError::fail(format!("recover: {e}")))?;
    let (report, seated) = fresh.recover(m.now, &recovered);
    prop_assert_eq!(report.skipped, 0, "{:?}", report.refusals);
    prop_assert_eq!(seated.pages.len(), recovered.pages.len());
    prop_assert_eq!(fresh.ready_pages(), core.ready_pages());
    fresh.check_invariants().map_err(TestCaseError::fail)?;
    Ok(core.g3_counters())
}

/// The runner's journal, fed after every step as the runner's pump does
/// (before any action is executed): recovering it at any step gives exactly
/// the READY pages and their slots.
struct Journal {
    region: Vec<u8>,
    writer: crate::journal::JournalWriter,
}

impl Journal {
    fn new(core: &mut Core) -> Self {
        core.enable_journal();
        let mut region = vec![0u8; 16 << 10];
        let writer = crate::journal::JournalWriter::format(&mut region).unwrap();
        Self { region, writer }
    }

    fn check(&mut self, core: &mut Core) -> Result<(), TestCaseError> {
        for record in core.take_journal() {
            self.writer
                .append(&mut self.region, &record)
                .map_err(|e| TestCaseError::fail(format!("append {record:?}: {e}")))?;
        }
        let recovered = crate::journal::recover(&self.region)
            .map_err(|e| TestCaseError::fail(format!("recover: {e}")))?;
        let journaled: BTreeMap<ScopedKey, Vec<u32>> = recovered
            .pages
            .iter()
            .map(|p| {
                (
                    ScopedKey {
                        namespace: NamespaceId(p.namespace),
                        key: BlockKey::from_u64(p.key),
                    },
                    p.slots.clone(),
                )
            })
            .collect();
        prop_assert_eq!(journaled, core.ready_pages());
        prop_assert!(recovered.held.is_empty(), "held without peers");
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn core_matches_model_lru(steps in proptest::collection::vec(step(), 1..60)) {
        run_steps(steps, true)?;
    }

    #[test]
    fn core_matches_model_fifo(steps in proptest::collection::vec(step(), 1..60)) {
        run_steps(steps, false)?;
    }
}

/// With a G3 of 4 slots under 6 DRAM slots, pages of one or two spans:
/// spills, fills from G3, direct delivers, failed writes and reads, capacity
/// waiters and G3 evictions, checked against the model after every step;
/// the run fails if any of them never happened.
#[test]
fn core_with_g3_matches_model() {
    use proptest::test_runner::{Config, TestRunner};
    let seen = std::cell::RefCell::new(crate::machine::G3Counters::default());
    let covered = |s: &crate::machine::G3Counters| {
        s.spills_committed > 0
            && s.spills_failed > 0
            && s.fills > 0
            && s.fills_failed > 0
            && s.capacity_waits > 0
            && s.evictions > 0
            && s.moves_already_stored > 0
            && s.spills_ahead > 0
    };
    // 400 fresh cases, then more (up to 4000) until every path was taken:
    // the rarest (a page filled back from G3, then chosen again) needs a
    // few hundred.
    for _ in 0..10 {
        let mut runner = TestRunner::new(Config::with_cases(400));
        runner
            .run(
                &(
                    proptest::collection::vec(step(), 1..60),
                    any::<bool>(),
                    1u8..=2,
                    any::<bool>(),
                ),
                |(steps, lru, spans, ahead)| {
                    let c = run_steps_with(steps, lru, Some(4), spans, ahead)?.unwrap_or_default();
                    let mut s = seen.borrow_mut();
                    s.spills_committed += c.spills_committed;
                    s.spills_failed += c.spills_failed;
                    s.fills += c.fills;
                    s.fills_failed += c.fills_failed;
                    s.capacity_waits += c.capacity_waits;
                    s.evictions += c.evictions;
                    s.moves_already_stored += c.moves_already_stored;
                    s.spills_ahead += c.spills_ahead;
                    Ok(())
                },
            )
            .unwrap();
        if covered(&seen.borrow()) {
            return;
        }
    }
    panic!(
        "the G3 model test never reached part of G3: {:?}",
        seen.into_inner()
    );
}

/// A case `core_with_g3_matches_model` once found with a fresh seed, kept so
/// it runs every time. Deposit [6, 4, 6] waits on G3 for room; the first 6
/// lands, then an abort fails the other two entries. The result holds key 6
/// twice, one success and one abort: the model must tell entries apart by
/// position (it once keyed them by key and called the success an aborted
/// key that came back).
#[test]
fn an_abort_fails_only_the_pending_entry_of_a_repeated_key() {
    use Step::*;
    let steps = vec![
        Fetch { keys: vec![0] },
        Deposit {
            keys: vec![0],
            no_evict: false,
        },
        Deposit {
            keys: vec![11, 2],
            no_evict: false,
        },
        Deposit {
            keys: vec![8, 1, 3],
            no_evict: false,
        },
        Deposit {
            keys: vec![0],
            no_evict: false,
        },
        Complete {
            job: 3117447769586176059,
            outcome: 1,
        },
        Deposit {
            keys: vec![0],
            no_evict: false,
        },
        Release {
            claim: 0,
            bogus: false,
        },
        Complete { job: 0, outcome: 1 },
        Complete { job: 0, outcome: 1 },
        Fetch { keys: vec![0] },
        Fetch { keys: vec![0] },
        Fetch { keys: vec![0] },
        Release {
            claim: 0,
            bogus: false,
        },
        Deposit {
            keys: vec![6, 4, 6],
            no_evict: false,
        },
        Complete {
            job: 804843105528172554,
            outcome: 2,
        },
        Fetch { keys: vec![0] },
        Complete {
            job: 11836266170090769296,
            outcome: 1,
        },
        Deposit {
            keys: vec![0],
            no_evict: false,
        },
        Abort {
            op: 1280219470238980965,
            partial: false,
        },
    ];
    run_steps_with(steps, false, Some(4), 1, false).unwrap();
}
