//! Snapshots of the event streams of the standard scenarios: a reference
//! linker (rank 0) and the inventory ledger of a two-rank group, driven step
//! by step, with every step's events written down.

use std::num::NonZeroU32;

use kvcr_contracts::{
    AttemptLedger, BlockKey, InventoryEvent, Namespace, PageHashChain, RequestId, Tier,
};
use kvcr_linker_contracts::conformance::{self, FixtureSpec, ReferenceFixture};
use kvcr_linker_contracts::{
    DeviceSlot, FrameworkChange, InventoryLedger, Linker, LinkerEvent, OffloadBatch,
    OffloadOutcome, PrefixQuery, RequestContext, RequestHooks, RestorableLengths,
    agree_restorable_prefix,
};

use crate::{BLOCK_SIZE, base, dram_opted_in, incarnation, lora, offload, render};

/// Rank 0 is the reference linker; rank 1 is simulated and always agrees.
struct Scenario {
    linker: ReferenceFixture,
    ledger: InventoryLedger,
    attempts: AttemptLedger,
    trace: Vec<String>,
}

impl Scenario {
    fn new(store_pages: usize) -> Self {
        let spec = FixtureSpec {
            store_pages,
            incarnation: incarnation(1),
            ..FixtureSpec::standard()
        };
        Self {
            linker: ReferenceFixture::new(&spec),
            ledger: InventoryLedger::new(
                dram_opted_in(),
                NonZeroU32::new(2).unwrap(),
                incarnation(1),
            ),
            attempts: AttemptLedger::new(),
            trace: Vec::new(),
        }
    }

    fn step(&mut self, what: &str) {
        self.trace.push(format!("# {what}"));
    }

    fn note(&mut self, line: String) {
        self.trace.push(format!("  {line}"));
    }

    fn publish(&mut self, events: Vec<InventoryEvent>) {
        for event in &events {
            self.note(format!("event {}", render(event)));
        }
    }

    fn accounting(&mut self) {
        let a = self.linker.0.accounting();
        self.note(format!(
            "claims_held={} in_flight={} live_attempts={}",
            a.claims_held, a.transfers_in_flight, a.live_attempts
        ));
    }

    /// Feeds the linker's events to the ledger (store evictions, rank 0's
    /// offload outcome, then rank 1's agreement).
    fn settle(&mut self, offload_id: Option<kvcr_linker_contracts::OffloadId>) {
        for event in self.linker.0.poll() {
            match event {
                LinkerEvent::Evicted {
                    incarnation,
                    tier,
                    keys,
                } => {
                    self.note(format!("store evicted {} page(s)", keys.len()));
                    let events = self.ledger.store_evicted(incarnation, tier, &keys).unwrap();
                    self.publish(events);
                }
                LinkerEvent::OffloadDone { success, .. } => {
                    self.note(format!("offload landed on rank 0: success={success}"));
                    let id = offload_id.expect("an offload was queued");
                    let mut events = self.ledger.rank_result(id, 0, success).unwrap();
                    events.extend(self.ledger.rank_result(id, 1, true).unwrap());
                    self.publish(events);
                }
                LinkerEvent::LoadDone { success, .. } => {
                    self.note(format!("load landed: success={success}"));
                }
                LinkerEvent::RestoreDone {
                    restored, pages, ..
                } => {
                    self.note(format!("restore landed: {restored}/{pages} pages"));
                }
                LinkerEvent::FirstLayerLanded { pages, .. } => {
                    self.note(format!("restore's first layer landed: {pages} pages"));
                }
            }
        }
    }

    fn offload(&mut self, namespace: &Namespace, keys: &[BlockKey], parent: Option<BlockKey>) {
        let numbers: Vec<u64> = keys.iter().map(|k| k.as_u64()).collect();
        let mut request = offload(namespace, Tier::KvcrDram, &numbers, None);
        request.parent = parent;
        self.offload_request(request);
    }

    /// Registers `request` with the ledger, then offloads its pages from
    /// device slots 0.. through the linker and settles.
    fn offload_request(&mut self, request: kvcr_linker_contracts::Offload) {
        let namespace = request.namespace.id();
        let keys: Vec<BlockKey> = request.pages.iter().map(|p| p.key).collect();
        let id = self.ledger.begin_offload(request).unwrap();
        let mut pages = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let slot = DeviceSlot(i as u32);
            self.linker
                .0
                .write_device(slot, &conformance::page_pattern(*k, 64))
                .unwrap();
            pages.push((*k, slot));
        }
        let outcome = self
            .linker
            .0
            .offload(OffloadBatch { namespace, pages })
            .unwrap();
        assert!(matches!(outcome, OffloadOutcome::Queued(_)));
        self.settle(Some(id));
    }

    fn text(&self) -> String {
        self.trace.join("\n")
    }
}

fn keys(range: std::ops::RangeInclusive<u64>) -> Vec<BlockKey> {
    range.map(BlockKey::from_u64).collect()
}

/// offload → GPU evict → store evict → engine clear → reset → re-offload.
#[test]
fn scenario_offload_evict_reset_reoffload() {
    let mut s = Scenario::new(3);
    s.step("offload pages 1..=3, both ranks succeed");
    s.offload(&base(), &keys(1..=3), None);
    s.step("engine evicts pages 1..=3 from its GPU pool (framework-owned: no event)");
    let gpu: Vec<_> = keys(1..=3)
        .into_iter()
        .map(|key| kvcr_contracts::ScopedKey {
            namespace: base().id(),
            key,
        })
        .collect();
    s.ledger
        .framework_changed(&FrameworkChange::DeviceEvicted(gpu));
    s.step("offload page 4; the full store evicts its oldest page");
    s.offload(&base(), &keys(4..=4), Some(BlockKey::from_u64(3)));
    s.step("engine clears its cache (framework-owned: no event)");
    s.ledger.framework_changed(&FrameworkChange::EngineCleared);
    s.step("linker reset to incarnation 2: every residency removed once");
    s.linker.0.reset(incarnation(2)).unwrap();
    let events = s.ledger.reset(incarnation(2)).unwrap();
    s.publish(events);
    s.step("re-offload pages 1..=2 in the new incarnation");
    s.offload(&base(), &keys(1..=2), None);
    insta::assert_snapshot!("scenario_offload_evict_reset_reoffload", s.text());
}

/// Two attempts of one request: the first is superseded before its fetch
/// lands; only the second's claims remain, inventory is untouched.
#[test]
fn scenario_two_attempts_of_one_request() {
    let mut s = Scenario::new(8);
    s.step("offload pages 1..=3");
    s.offload(&base(), &keys(1..=3), None);
    let query = PrefixQuery {
        namespace: base().id(),
        device_prefix_pages: 0,
        tail: keys(1..=3),
    };
    s.step("attempt 1 of request r starts (fetch in flight)");
    let (first, _) = RequestContext::begin(
        &mut s.attempts,
        RequestId("r".into()),
        vec![],
        query.clone(),
    );
    s.linker.0.request_started(&first).unwrap();
    s.accounting();
    s.step("attempt 2 of request r starts and supersedes attempt 1");
    let (second, superseded) =
        RequestContext::begin(&mut s.attempts, RequestId("r".into()), vec![], query);
    s.note(format!(
        "superseded generation {:?}",
        superseded.map(|a| a.generation)
    ));
    s.linker.0.request_started(&second).unwrap();
    s.accounting();
    s.step("both fetches land; attempt 1's is released at once");
    s.settle(None);
    s.accounting();
    s.step("lookup on rank 0; rank 1 reports {2}; ranks agree");
    let mine = s
        .linker
        .0
        .lookup(second.attempt(), 0, &keys(1..=3))
        .unwrap();
    let agreed = agree_restorable_prefix(&[mine.clone(), RestorableLengths::new([2])], 2).unwrap();
    s.note(format!(
        "rank 0 lengths={:?} agreed={agreed}",
        mine.iter().collect::<Vec<_>>()
    ));
    s.step("stale attempt 1 tries to finish");
    let stale = s.linker.0.request_finished(first.attempt()).unwrap_err();
    s.note(format!("refused: {stale}"));
    s.step("attempt 2 loads the agreed prefix and finishes");
    let slots: Vec<DeviceSlot> = (0..agreed).map(|i| DeviceSlot(8 + i)).collect();
    s.linker.0.load(second.attempt(), &slots).unwrap();
    s.settle(None);
    s.linker.0.request_finished(second.attempt()).unwrap();
    s.accounting();
    insta::assert_snapshot!("scenario_two_attempts_of_one_request", s.text());
}

/// Two LoRA adapters over the same tokens: different page keys (the
/// namespace seeds the hash chain), separate residencies, names preserved.
#[test]
fn scenario_two_lora_adapters_same_tokens() {
    let mut s = Scenario::new(8);
    let tokens: Vec<u32> = (0..2 * BLOCK_SIZE).collect();
    let chains: Vec<(Namespace, Vec<BlockKey>)> = [lora("a"), lora("b")]
        .into_iter()
        .map(|ns| {
            let keys = PageHashChain::new(&ns)
                .pages(&tokens, BLOCK_SIZE as usize)
                .iter()
                .map(|d| d.block_key())
                .collect();
            (ns, keys)
        })
        .collect();
    assert_ne!(
        chains[0].1, chains[1].1,
        "same tokens, different adapters, different keys"
    );
    for (ns, keys) in &chains {
        s.step(&format!(
            "offload 2 pages of adapter {}",
            ns.lora_name.as_deref().unwrap_or("-")
        ));
        s.offload_request(kvcr_linker_contracts::Offload {
            namespace: ns.clone(),
            tier: Tier::KvcrDram,
            parent: None,
            block_size: BLOCK_SIZE,
            pages: keys
                .iter()
                .zip(tokens.chunks(BLOCK_SIZE as usize))
                .map(|(key, page)| kvcr_linker_contracts::OffloadPage {
                    key: *key,
                    token_ids: page.to_vec(),
                })
                .collect(),
        });
    }
    s.step("store evicts adapter a's second page");
    let (ns_a, keys_a) = &chains[0];
    let evicted = [kvcr_contracts::ScopedKey {
        namespace: ns_a.id(),
        key: keys_a[1],
    }];
    let events = s
        .ledger
        .store_evicted(incarnation(1), Tier::KvcrDram, &evicted)
        .unwrap();
    s.publish(events);
    s.step("linker reset");
    let events = s.ledger.reset(incarnation(2)).unwrap();
    s.publish(events);
    insta::assert_snapshot!("scenario_two_lora_adapters_same_tokens", s.text());
}
