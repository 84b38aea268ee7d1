//! Property: for any interleaving of offload, rank report, store eviction,
//! framework change, reset and attempt events, stored and removed balance per
//! (owner, namespace, key), no event crosses owners, and a stale attempt's
//! landing never reaches the live attempt.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;

use kvcr_contracts::{
    AttemptId, AttemptLedger, InventoryEvent, Medium, Namespace, NamespaceId, Owner, RequestId,
    ScopedKey, Tier,
};
use kvcr_linker_contracts::{
    AttemptTable, ClaimId, FrameworkChange, InventoryLedger, OffloadId, TransferId,
};
use proptest::prelude::*;

use crate::{base, dram_opted_in, incarnation, key, lora, offload};

const TIERS: [Tier; 2] = [Tier::KvcrDram, Tier::External];

#[derive(Debug, Clone)]
enum Op {
    Begin {
        tier: usize,
        ns: usize,
        first: u64,
        len: u64,
    },
    Report {
        pending: usize,
        rank: u32,
        ok: bool,
    },
    Evict {
        tier: usize,
        ns: usize,
        key: u64,
        stale: bool,
    },
    DeviceEvict {
        ns: usize,
        key: u64,
    },
    EngineClear,
    Reset,
    AttemptBegin {
        request: u8,
    },
    AttemptFetch {
        request: u8,
    },
    AttemptLand {
        transfer: usize,
        claims: u8,
    },
    AttemptEnd {
        request: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..2usize, 1..5u64, 1..4u64)
            .prop_map(|(tier, ns, first, len)| Op::Begin { tier, ns, first, len }),
        5 => (0..4usize, 0..2u32, prop::bool::weighted(0.85))
            .prop_map(|(pending, rank, ok)| Op::Report { pending, rank, ok }),
        3 => (0..2usize, 0..2usize, 1..7u64, prop::bool::weighted(0.1))
            .prop_map(|(tier, ns, key, stale)| Op::Evict { tier, ns, key, stale }),
        1 => (0..2usize, 1..7u64).prop_map(|(ns, key)| Op::DeviceEvict { ns, key }),
        1 => Just(Op::EngineClear),
        1 => Just(Op::Reset),
        2 => (0..2u8).prop_map(|request| Op::AttemptBegin { request }),
        2 => (0..2u8).prop_map(|request| Op::AttemptFetch { request }),
        2 => (0..4usize, 0..3u8).prop_map(|(transfer, claims)| Op::AttemptLand { transfer, claims }),
        1 => (0..2u8).prop_map(|request| Op::AttemptEnd { request }),
    ]
}

fn namespaces() -> [Namespace; 2] {
    [base(), lora("a")]
}

struct PendingModel {
    id: OffloadId,
    tier: Tier,
    namespace: NamespaceId,
    keys: Vec<u64>,
    reported: [Option<bool>; 2],
    evicted_since_begin: BTreeSet<u64>,
}

type Residency = (Owner, NamespaceId, Medium, u64);

struct Harness {
    ledger: InventoryLedger,
    incarnation: u128,
    pending: Vec<PendingModel>,
    balance: BTreeMap<Residency, i64>,
    /// (tier, namespace, key) ever offered to the ledger.
    offered: BTreeSet<(Tier, NamespaceId, u64)>,
    kvcr_barrier: Option<u128>,
    // Attempts.
    minted: AttemptLedger,
    table: AttemptTable,
    live: BTreeMap<u8, AttemptId>,
    transfers: Vec<(TransferId, AttemptId)>,
    held: BTreeMap<ClaimId, AttemptId>,
    released: BTreeSet<ClaimId>,
    next_claim: u64,
}

impl Harness {
    fn new() -> Self {
        Self {
            ledger: InventoryLedger::new(
                dram_opted_in(),
                NonZeroU32::new(2).unwrap(),
                incarnation(1),
            ),
            incarnation: 1,
            pending: Vec::new(),
            balance: BTreeMap::new(),
            offered: BTreeSet::new(),
            kvcr_barrier: None,
            minted: AttemptLedger::new(),
            table: AttemptTable::new(),
            live: BTreeMap::new(),
            transfers: Vec::new(),
            held: BTreeMap::new(),
            released: BTreeSet::new(),
            next_claim: 0,
        }
    }

    fn tier_of(medium: Medium) -> Tier {
        match medium {
            Medium::CpuPinned => Tier::KvcrDram,
            Medium::External => Tier::External,
            other => panic!("unexpected medium {other:?}"),
        }
    }

    /// Checks every event's ownership and updates the balance.
    fn account(&mut self, events: &[InventoryEvent]) -> Result<(), TestCaseError> {
        for event in events {
            match event {
                InventoryEvent::Stored { scope, keys, .. }
                | InventoryEvent::Removed { scope, keys } => {
                    let tier = Self::tier_of(scope.medium);
                    prop_assert_eq!(
                        dram_opted_in().owner_of(tier).unwrap(),
                        scope.owner,
                        "event crossed owners: {:?}",
                        event
                    );
                    let delta = if matches!(event, InventoryEvent::Stored { .. }) {
                        1
                    } else {
                        -1
                    };
                    if delta == 1 && scope.owner == Owner::Kvcr {
                        prop_assert_eq!(
                            self.kvcr_barrier,
                            Some(self.incarnation),
                            "kvcr stored before its barrier"
                        );
                    }
                    for k in keys {
                        prop_assert!(
                            self.offered.contains(&(tier, scope.namespace, k.as_u64())),
                            "event names a page never offered under its scope: {:?}",
                            event
                        );
                        let count = self
                            .balance
                            .entry((scope.owner, scope.namespace, scope.medium, k.as_u64()))
                            .or_default();
                        *count += delta;
                        prop_assert!((0..=1).contains(count), "unbalanced {:?}: {}", k, count);
                    }
                }
                InventoryEvent::AllCleared {
                    owner,
                    incarnation: i,
                } => {
                    prop_assert_eq!(*owner, Owner::Kvcr, "kvcr cleared framework inventory");
                    prop_assert_eq!(*i, incarnation(self.incarnation));
                    prop_assert_eq!(self.kvcr_barrier, None, "two barriers in one incarnation");
                    self.kvcr_barrier = Some(self.incarnation);
                }
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let residencies_before: Vec<_> = self.ledger.residencies().collect();
        let claims_before = self.table.claims_held();
        match *op {
            Op::Begin {
                tier,
                ns,
                first,
                len,
            } => {
                let namespace = &namespaces()[ns];
                let keys: Vec<u64> = (first..first + len).collect();
                let id = self
                    .ledger
                    .begin_offload(offload(namespace, TIERS[tier], &keys, None))
                    .unwrap();
                for k in &keys {
                    self.offered.insert((TIERS[tier], namespace.id(), *k));
                }
                self.pending.push(PendingModel {
                    id,
                    tier: TIERS[tier],
                    namespace: namespace.id(),
                    keys,
                    reported: [None, None],
                    evicted_since_begin: BTreeSet::new(),
                });
            }
            Op::Report { pending, rank, ok } => {
                if self.pending.is_empty() {
                    return Ok(());
                }
                let index = pending % self.pending.len();
                let slot = usize::try_from(rank).unwrap();
                let model = &mut self.pending[index];
                let result = self.ledger.rank_result(model.id, rank, ok);
                if model.reported[slot].is_some() {
                    prop_assert!(result.is_err(), "a second report was accepted");
                    return Ok(());
                }
                let events = result.unwrap();
                model.reported[slot] = Some(ok);
                let decided = model.reported.iter().all(Option::is_some);
                let all_ok = model.reported.iter().all(|r| *r == Some(true));
                let stored: Vec<u64> = events
                    .iter()
                    .flat_map(|e| match e {
                        InventoryEvent::Stored { keys, .. } => {
                            keys.iter().map(|k| k.as_u64()).collect()
                        }
                        _ => Vec::new(),
                    })
                    .collect();
                prop_assert!(
                    stored.is_empty() || (decided && all_ok),
                    "stored without every rank's success"
                );
                for k in &stored {
                    prop_assert!(model.keys.contains(k));
                    prop_assert!(
                        !model.evicted_since_begin.contains(k),
                        "stored a page evicted while pending"
                    );
                }
                let (tier, namespace) = (model.tier, model.namespace);
                if decided {
                    self.pending.remove(index);
                }
                for k in &stored {
                    let page = ScopedKey {
                        namespace,
                        key: key(*k),
                    };
                    prop_assert!(
                        self.ledger.is_resident(tier, page),
                        "stored but not resident"
                    );
                }
                self.account(&events)?;
            }
            Op::Evict {
                tier,
                ns,
                key: k,
                stale,
            } => {
                let namespace = namespaces()[ns].id();
                let at = if stale {
                    incarnation(self.incarnation + 1000)
                } else {
                    incarnation(self.incarnation)
                };
                let scoped = ScopedKey {
                    namespace,
                    key: key(k),
                };
                let events = self
                    .ledger
                    .store_evicted(at, TIERS[tier], &[scoped])
                    .unwrap();
                if stale {
                    prop_assert!(
                        events.is_empty(),
                        "a stale incarnation's eviction published"
                    );
                } else {
                    for model in &mut self.pending {
                        if model.tier == TIERS[tier] && model.namespace == namespace {
                            // Everything from the evicted page on is cut.
                            if let Some(pos) = model.keys.iter().position(|x| *x == k) {
                                model
                                    .evicted_since_begin
                                    .extend(model.keys[pos..].iter().copied());
                            }
                        }
                    }
                }
                let resident_before = residencies_before.iter().any(|r| {
                    r.tier == TIERS[tier] && r.namespace.id() == namespace && r.key == key(k)
                });
                let resident_now = self.ledger.is_resident(TIERS[tier], scoped);
                prop_assert_eq!(
                    resident_now,
                    stale && resident_before,
                    "eviction and residency disagree"
                );
                self.account(&events)?;
            }
            Op::DeviceEvict { ns, key: k } => {
                let scoped = ScopedKey {
                    namespace: namespaces()[ns].id(),
                    key: key(k),
                };
                self.ledger
                    .framework_changed(&FrameworkChange::DeviceEvicted(vec![scoped]));
                prop_assert_eq!(
                    self.ledger.residencies().collect::<Vec<_>>(),
                    residencies_before
                );
            }
            Op::EngineClear => {
                self.ledger
                    .framework_changed(&FrameworkChange::EngineCleared);
                prop_assert_eq!(
                    self.ledger.residencies().collect::<Vec<_>>(),
                    residencies_before
                );
            }
            Op::Reset => {
                self.reset()?;
            }
            Op::AttemptBegin { request } => {
                let (attempt, _) = self.minted.begin(RequestId(format!("r{request}")));
                let superseded = self.table.begin(&attempt).unwrap();
                let old = self.live.insert(request, attempt.clone());
                prop_assert_eq!(superseded.as_ref().map(|s| &s.attempt), old.as_ref());
                if let (Some(s), Some(old)) = (superseded, old) {
                    self.give_back(&old, &s.released)?;
                }
            }
            Op::AttemptFetch { request } => {
                if let Some(attempt) = self.live.get(&request).cloned() {
                    let transfer = self.table.accept(&attempt, vec![]).unwrap();
                    self.transfers.push((transfer, attempt));
                }
            }
            Op::AttemptLand { transfer, claims } => {
                if self.transfers.is_empty() {
                    return Ok(());
                }
                let (id, attempt) = self.transfers.remove(transfer % self.transfers.len());
                let produced: Vec<ClaimId> = (0..claims)
                    .map(|_| {
                        self.next_claim += 1;
                        ClaimId(self.next_claim)
                    })
                    .collect();
                let landing = self.table.land(id, produced.clone()).unwrap();
                let live = self.live.values().any(|a| *a == attempt);
                if live {
                    prop_assert_eq!(&landing.kept, &produced);
                    prop_assert!(landing.release.is_empty());
                    for c in produced {
                        self.held.insert(c, attempt.clone());
                    }
                } else {
                    prop_assert!(
                        landing.kept.is_empty(),
                        "a stale landing reached a live attempt"
                    );
                    prop_assert_eq!(&landing.release, &produced);
                    for c in produced {
                        prop_assert!(self.released.insert(c));
                    }
                }
            }
            Op::AttemptEnd { request } => {
                if let Some(attempt) = self.live.remove(&request) {
                    let returned = self.table.end(&attempt).unwrap();
                    self.give_back(&attempt, &returned)?;
                }
            }
        }
        if !matches!(
            op,
            Op::AttemptBegin { .. }
                | Op::AttemptFetch { .. }
                | Op::AttemptLand { .. }
                | Op::AttemptEnd { .. }
        ) {
            prop_assert_eq!(
                self.table.claims_held(),
                claims_before,
                "inventory ops touched claims"
            );
        }
        prop_assert_eq!(self.table.claims_held(), self.held.len());
        for (claim, owner) in &self.held {
            prop_assert!(
                self.table.holds(owner, *claim),
                "claim {:?} lost by {:?}",
                claim,
                owner
            );
        }
        Ok(())
    }

    /// The claims an attempt gave up must be exactly the ones the model says
    /// it held, each released once.
    fn give_back(&mut self, attempt: &AttemptId, claims: &[ClaimId]) -> Result<(), TestCaseError> {
        let expected: Vec<ClaimId> = self
            .held
            .iter()
            .filter(|(_, a)| *a == attempt)
            .map(|(c, _)| *c)
            .collect();
        let mut got = claims.to_vec();
        got.sort_unstable();
        prop_assert_eq!(got, expected);
        for c in claims {
            self.held.remove(c);
            prop_assert!(self.released.insert(*c), "claim {:?} released twice", c);
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), TestCaseError> {
        self.incarnation += 1;
        let events = self.ledger.reset(incarnation(self.incarnation)).unwrap();
        let only_removals = events
            .iter()
            .all(|e| matches!(e, InventoryEvent::Removed { .. }));
        prop_assert!(only_removals, "a reset publishes removals only");
        self.account(&events)?;
        prop_assert!(
            self.balance.values().all(|c| *c == 0),
            "a residency survived the reset"
        );
        self.pending.clear();
        self.kvcr_barrier = None;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Stored and removed balance per (owner, namespace, key) and no event
    /// crosses owners, for any interleaving; a final reset settles every
    /// residency to zero.
    #[test]
    fn inventory_balances_per_owner_namespace_key(ops in prop::collection::vec(op(), 1..60)) {
        let mut harness = Harness::new();
        for op in &ops {
            harness.apply(op)?;
        }
        harness.reset()?;
        let mut per_owner_namespace_key: BTreeMap<(Owner, NamespaceId, u64), i64> = BTreeMap::new();
        for ((owner, namespace, _, k), count) in &harness.balance {
            *per_owner_namespace_key.entry((*owner, *namespace, *k)).or_default() += count;
        }
        prop_assert!(per_owner_namespace_key.values().all(|c| *c == 0));
    }
}
