//! The linker conformance suite: checks every [`Linker`] must pass, run
//! against a [`LinkerFixture`] made by a factory.
//!
//! A linker crate runs the whole table from its own tests, one test per case
//! so a failure names the contract it broke:
//!
//! ```ignore
//! #[rstest]
//! #[case::round_trip(conformance::round_trip_moves_bytes_exactly)]
//! // … one case per entry of `conformance::cases()` …
//! fn my_linker_conforms(#[case] check: conformance::Check<MyFixture>) {
//!     check(&MyFixture::new);
//! }
//! ```
//!
//! and checks that its table names every entry of [`cases`] (this crate's own
//! integration tests do exactly that for the reference linker).
//!
//! Device pages are filled with a pattern derived from the page key, so every
//! restore is checked byte for byte. Transfers land only when the suite calls
//! [`LinkerFixture::settle`].

// Suite code: a failed expectation is a failed test of the linker under check.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvcr_contracts::{AttemptId, AttemptLedger, BlockKey, Incarnation, NamespaceId, RequestId};

use crate::error::Error;
use crate::hooks::{PrefixQuery, RequestContext, RequestHooks};
use crate::linker::{
    DeviceSlot, Linker, LinkerEvent, OffloadBatch, OffloadOutcome, OffloadTicket, PreparationState,
};
use crate::prefix::RetireReason;
use crate::reference::{ReferenceConfig, ReferenceLinker};

/// Sizes a fixture is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixtureSpec {
    /// Bytes per page.
    pub page_bytes: usize,
    /// Device pool slots.
    pub device_slots: u32,
    /// Pages the linker's store holds at most.
    pub store_pages: usize,
    /// The store's first incarnation.
    pub incarnation: Incarnation,
}

impl FixtureSpec {
    /// The sizes most checks use: 64-byte pages, 16 device slots, 8 store pages.
    pub fn standard() -> Self {
        Self {
            page_bytes: 64,
            device_slots: 16,
            store_pages: 8,
            incarnation: incarnation(1),
        }
    }
}

/// A linker under check plus access to its device pool.
pub trait LinkerFixture {
    /// The linker under check.
    type Linker: Linker;

    /// The linker.
    fn linker(&mut self) -> &mut Self::Linker;

    /// Writes a device page (the engine computing KV).
    fn write_device(&mut self, slot: DeviceSlot, bytes: &[u8]);

    /// Reads a device page back.
    fn read_device(&mut self, slot: DeviceSlot) -> Vec<u8>;

    /// Lands every accepted transfer and returns every event. The default is
    /// one [`Linker::poll`]; an asynchronous linker waits (bounded) until
    /// [`crate::Accounting::transfers_in_flight`] is zero.
    fn settle(&mut self) -> Vec<LinkerEvent> {
        self.linker().poll()
    }
}

/// One conformance check, given a fixture factory.
pub type Check<F> = fn(&dyn Fn(&FixtureSpec) -> F);

/// Every check, by name (from the one list behind [`crate::conformance_suite!`]).
pub fn cases<F: LinkerFixture>() -> Vec<(&'static str, Check<F>)> {
    crate::__conformance_checks!(@cases F)
}

/// The one list of checks. [`cases`] and [`crate::conformance_suite!`] both expand
/// it, so a new check is run by every linker's suite without a second table.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_checks {
    (@cases $fixture:ident [$($name:ident),* $(,)?]) => {
        vec![$((
            stringify!($name),
            $crate::conformance::$name::<$fixture> as $crate::conformance::Check<$fixture>,
        )),*]
    };
    (@tests $fixture:ty, $run:expr, [$($name:ident),* $(,)?]) => {
        $(
            #[test]
            fn $name() {
                let run: fn($crate::conformance::Check<$fixture>) = $run;
                run($crate::conformance::$name::<$fixture>);
            }
        )*
    };
    (@$mode:ident $($args:tt)*) => {
        $crate::__conformance_checks! {@$mode $($args)* [
            round_trip_moves_bytes_exactly,
            never_offloaded_page_is_a_miss,
            second_attempt_supersedes_first,
            late_fetch_of_superseded_attempt_is_released,
            finish_drops_every_claim,
            abort_drops_every_claim,
            ending_never_revokes_accepted_fetch,
            ending_never_revokes_accepted_load,
            device_prefix_growth_shifts_preparation,
            device_prefix_shrink_retires_preparation,
            load_without_claim_is_refused,
            duplicate_load_is_refused,
            reset_refused_while_transfers_in_flight,
            reset_forgets_store_and_reoffload_round_trips,
            stale_and_unknown_attempts_are_typed_errors,
            offload_outcomes_in_submission_order,
            claimed_page_is_never_evicted,
            bad_device_slot_is_refused,
        ]}
    };
}

/// One `#[test]` per conformance check, named after it, for a linker's
/// fixture type: `run` gets each check and calls it with the fixture
/// factories the linker is tested on.
///
/// ```ignore
/// kvcr_linker_contracts::conformance_suite!(ReferenceFixture, |check| {
///     check(&ReferenceFixture::new)
/// });
/// ```
#[macro_export]
macro_rules! conformance_suite {
    ($fixture:ty, $run:expr $(,)?) => {
        $crate::__conformance_checks!(@tests $fixture, $run,);
    };
}

/// The fixture for the reference linker.
#[derive(Debug)]
pub struct ReferenceFixture(pub ReferenceLinker);

impl ReferenceFixture {
    /// A reference linker sized by `spec`.
    pub fn new(spec: &FixtureSpec) -> Self {
        Self(ReferenceLinker::new(ReferenceConfig {
            page_bytes: spec.page_bytes,
            device_slots: spec.device_slots,
            store_pages: spec.store_pages,
            incarnation: spec.incarnation,
        }))
    }
}

impl LinkerFixture for ReferenceFixture {
    type Linker = ReferenceLinker;

    fn linker(&mut self) -> &mut ReferenceLinker {
        &mut self.0
    }

    fn write_device(&mut self, slot: DeviceSlot, bytes: &[u8]) {
        self.0.write_device(slot, bytes).expect("slot in range");
    }

    fn read_device(&mut self, slot: DeviceSlot) -> Vec<u8> {
        self.0.read_device(slot).expect("slot in range")
    }
}

/// An incarnation from a small non-zero number (tests only).
pub fn incarnation(n: u128) -> Incarnation {
    Incarnation::from_raw(n).expect("non-zero incarnation")
}

/// The bytes the suite writes for page `key`: distinct per key and per byte.
pub fn page_pattern(key: BlockKey, len: usize) -> Vec<u8> {
    let seed = key.as_u64().to_le_bytes();
    (0..len)
        .map(|i| seed[i % 8] ^ (i as u8).wrapping_mul(31))
        .collect()
}

const NAMESPACE: NamespaceId = NamespaceId(0x5eed);
/// Loads go to slots from here on, so they never alias offloaded slots.
const LOAD_BASE: u32 = 8;

struct Driver<F> {
    fixture: F,
    attempts: AttemptLedger,
    spec: FixtureSpec,
}

fn keys(range: std::ops::RangeInclusive<u64>) -> Vec<BlockKey> {
    range.map(BlockKey::from_u64).collect()
}

fn slots(from: u32, count: usize) -> Vec<DeviceSlot> {
    (0..count as u32).map(|i| DeviceSlot(from + i)).collect()
}

impl<F: LinkerFixture> Driver<F> {
    fn new(factory: &dyn Fn(&FixtureSpec) -> F, spec: FixtureSpec) -> Self {
        Self {
            fixture: factory(&spec),
            attempts: AttemptLedger::new(),
            spec,
        }
    }

    fn standard(factory: &dyn Fn(&FixtureSpec) -> F) -> Self {
        Self::new(factory, FixtureSpec::standard())
    }

    fn linker(&mut self) -> &mut F::Linker {
        self.fixture.linker()
    }

    /// Writes the pattern of each key into slots 0.. and queues one offload.
    fn queue_offload(&mut self, keys: &[BlockKey]) -> OffloadTicket {
        let mut pages = Vec::new();
        for (slot, key) in slots(0, keys.len()).into_iter().zip(keys) {
            let bytes = page_pattern(*key, self.spec.page_bytes);
            self.fixture.write_device(slot, &bytes);
            pages.push((*key, slot));
        }
        let batch = OffloadBatch {
            namespace: NAMESPACE,
            pages,
        };
        match self.linker().offload(batch).expect("offload accepted") {
            OffloadOutcome::Queued(ticket) => ticket,
            OffloadOutcome::Declined(reason) => panic!("offload declined: {reason:?}"),
        }
    }

    /// Offloads and settles; the offload must succeed.
    fn offload(&mut self, keys: &[BlockKey]) {
        let ticket = self.queue_offload(keys);
        let events = self.fixture.settle();
        assert!(
            events.contains(&LinkerEvent::OffloadDone {
                ticket,
                success: true
            }),
            "offload {ticket:?} did not succeed: {events:?}"
        );
    }

    fn start(&mut self, request: &str, device_prefix: u32, tail: &[BlockKey]) -> AttemptId {
        let query = PrefixQuery {
            namespace: NAMESPACE,
            device_prefix_pages: device_prefix,
            tail: tail.to_vec(),
        };
        let (context, _) = RequestContext::begin(
            &mut self.attempts,
            RequestId(request.to_owned()),
            Vec::new(),
            query,
        );
        self.linker()
            .request_started(&context)
            .expect("request start accepted");
        context.attempt().clone()
    }

    fn longest(&mut self, attempt: &AttemptId, device_prefix: u32, tail: &[BlockKey]) -> u32 {
        self.linker()
            .lookup(attempt, device_prefix, tail)
            .expect("lookup of a live attempt")
            .longest()
    }

    fn claims(&mut self) -> usize {
        self.linker().accounting().claims_held
    }

    fn in_flight(&mut self) -> usize {
        self.linker().accounting().transfers_in_flight
    }

    fn assert_restored(&mut self, keys: &[BlockKey], at: u32) {
        for (slot, key) in slots(at, keys.len()).into_iter().zip(keys) {
            assert_eq!(
                self.fixture.read_device(slot),
                page_pattern(*key, self.spec.page_bytes),
                "page {key:?} restored into {slot:?} differs"
            );
        }
    }

    /// Loads the first `keys.len()` prepared pages into `LOAD_BASE..` and
    /// settles; the load must succeed and the bytes must match.
    fn load_and_check(&mut self, attempt: &AttemptId, keys: &[BlockKey]) {
        let ticket = self
            .linker()
            .load(attempt, &slots(LOAD_BASE, keys.len()))
            .expect("load accepted");
        let events = self.fixture.settle();
        assert!(
            events.contains(&LinkerEvent::LoadDone {
                attempt: attempt.clone(),
                ticket,
                success: true
            }),
            "load {ticket:?} did not succeed: {events:?}"
        );
        self.assert_restored(keys, LOAD_BASE);
    }
}

/// Case 27: offload → prepare → lookup → load restores every byte; claims are
/// held between lookup and load and none remain after the load lands.
pub fn round_trip_moves_bytes_exactly<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=4);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    assert_eq!(
        d.linker().preparation(&attempt).unwrap(),
        PreparationState::Fetching
    );
    let _ = d.fixture.settle();
    assert_eq!(
        d.linker().preparation(&attempt).unwrap(),
        PreparationState::Ready
    );
    assert_eq!(d.longest(&attempt, 0, &pages), 4);
    assert_eq!(d.claims(), 4, "one claim per prepared page");
    d.load_and_check(&attempt, &pages);
    assert_eq!(d.claims(), 0, "claims released once the load landed");
    d.linker().request_finished(&attempt).unwrap();
    assert_eq!(d.linker().accounting(), crate::Accounting::default());
}

/// Case 28: a page never offloaded never hits, and the prefix stops at it.
pub fn never_offloaded_page_is_a_miss<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    d.offload(&keys(1..=2));
    let gap = [keys(1..=2), keys(9..=9), keys(3..=3)].concat();
    let partial = d.start("partial", 0, &gap);
    let cold = d.start("cold", 0, &keys(9..=11));
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&partial, 0, &gap), 2);
    assert_eq!(d.longest(&cold, 0, &keys(9..=11)), 0);
    d.linker().request_finished(&partial).unwrap();
    d.linker().request_finished(&cold).unwrap();
    assert_eq!(d.claims(), 0);
}

/// Case 31: a second attempt of a request id supersedes the first at once
/// (never waits for it), the first's claims are released, and the stale
/// attempt can no longer touch anything.
pub fn second_attempt_supersedes_first<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=3);
    d.offload(&pages);
    let first = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.claims(), 3);
    let second = d.start("r", 0, &pages);
    assert_eq!(
        d.claims(),
        0,
        "the superseded attempt's claims are released"
    );
    assert_eq!(
        d.linker().preparation(&second).unwrap(),
        PreparationState::Fetching
    );
    assert!(matches!(
        d.linker().preparation(&first),
        Err(Error::Superseded { .. })
    ));
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&second, 0, &pages), 3);
    assert!(matches!(
        d.linker().lookup(&first, 0, &pages),
        Err(Error::Superseded { .. })
    ));
    assert!(matches!(
        d.linker().request_finished(&first),
        Err(Error::Superseded { .. })
    ));
    assert_eq!(
        d.claims(),
        3,
        "the stale finish left the new attempt's claims alone"
    );
    assert_eq!(
        d.linker().preparation(&second).unwrap(),
        PreparationState::Ready
    );
    d.linker().request_finished(&second).unwrap();
    assert_eq!(d.claims(), 0);
}

/// Case 41: the first attempt's fetch lands after the second attempt started;
/// what it staged is released at once and never counts for the second.
pub fn late_fetch_of_superseded_attempt_is_released<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=3);
    d.offload(&pages);
    let _first = d.start("r", 0, &pages);
    let second = d.start("r", 0, &pages[..2]);
    let _ = d.fixture.settle();
    assert_eq!(d.in_flight(), 0);
    assert_eq!(
        d.claims(),
        2,
        "only the live attempt's two pages are claimed"
    );
    assert_eq!(d.longest(&second, 0, &pages[..2]), 2);
    d.linker().request_finished(&second).unwrap();
    assert_eq!(d.claims(), 0);
}

fn ending_drops_every_claim<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
    end: fn(&mut F::Linker, &AttemptId) -> crate::Result<()>,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=3);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &pages), 3);
    end(d.linker(), &attempt).unwrap();
    assert_eq!(d.claims(), 0);
    assert!(matches!(
        d.linker().lookup(&attempt, 0, &pages),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert!(matches!(
        end(d.linker(), &attempt),
        Err(Error::NoLiveAttempt { .. })
    ));
    // The request id is free for a new attempt, which hits again.
    let again = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&again, 0, &pages), 3);
}

/// Case 32 (finish): finishing drops every claim; a later lookup is refused.
pub fn finish_drops_every_claim<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    ending_drops_every_claim(factory, |l, a| l.request_finished(a));
}

/// Case 32 (abort): aborting drops every claim; a later lookup is refused.
pub fn abort_drops_every_claim<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    ending_drops_every_claim(factory, |l, a| l.request_aborted(a));
}

/// Hooks: ending a request while its fetch is in flight does not revoke the
/// fetch; it lands and what it staged is released.
pub fn ending_never_revokes_accepted_fetch<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=3);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    d.linker().request_aborted(&attempt).unwrap();
    assert_eq!(d.in_flight(), 1, "the accepted fetch is still in flight");
    let _ = d.fixture.settle();
    assert_eq!(d.in_flight(), 0);
    assert_eq!(d.claims(), 0, "the landed fetch's claims were cleaned up");
}

/// Hooks: ending a request after its load was accepted does not cancel the
/// load; the bytes land and the load's claims are released then.
pub fn ending_never_revokes_accepted_load<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=3);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &pages), 3);
    let ticket = d.linker().load(&attempt, &slots(LOAD_BASE, 3)).unwrap();
    d.linker().request_aborted(&attempt).unwrap();
    assert_eq!(d.claims(), 3, "the load still holds its pages");
    let events = d.fixture.settle();
    assert!(events.contains(&LinkerEvent::LoadDone {
        attempt: attempt.clone(),
        ticket,
        success: true
    }));
    d.assert_restored(&pages, LOAD_BASE);
    assert_eq!(d.claims(), 0);
    assert_eq!(d.in_flight(), 0);
}

/// Case 33: the device prefix grew by two pages while preparing: lookup
/// shifts the lengths and releases the two pages now on the device.
pub fn device_prefix_growth_shifts_preparation<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=4);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.claims(), 4);
    assert_eq!(d.longest(&attempt, 2, &pages[2..]), 2);
    assert_eq!(d.claims(), 2, "pages now on the device are released");
    d.load_and_check(&attempt, &pages[2..]);
    assert_eq!(d.claims(), 0);
}

/// Case 34: the device prefix shrank below the prepared start: lookup
/// reports nothing and retires the preparation (tail shrunk).
pub fn device_prefix_shrink_retires_preparation<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=4);
    d.offload(&pages);
    let attempt = d.start("r", 2, &pages[2..]);
    let _ = d.fixture.settle();
    assert_eq!(d.claims(), 2);
    assert_eq!(d.longest(&attempt, 1, &pages[1..]), 0);
    assert_eq!(
        d.linker().preparation(&attempt).unwrap(),
        PreparationState::Retired(RetireReason::TailShrunk)
    );
    assert_eq!(d.claims(), 0);
    assert_eq!(
        d.longest(&attempt, 2, &pages[2..]),
        0,
        "retired stays retired"
    );
}

/// Case 35: a load naming a page without a held claim is refused with the
/// page, and nothing changes.
pub fn load_without_claim_is_refused<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    d.offload(&keys(1..=2));
    let tail = keys(1..=3);
    let attempt = d.start("r", 0, &tail);
    assert!(
        matches!(
            d.linker().load(&attempt, &slots(LOAD_BASE, 1)),
            Err(Error::LoadWithoutClaim { page: 0, .. })
        ),
        "a load before the preparation is ready has no claims"
    );
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &tail), 2);
    let before = d.linker().accounting();
    assert!(matches!(
        d.linker().load(&attempt, &slots(LOAD_BASE, 3)),
        Err(Error::LoadWithoutClaim { page: 2, .. })
    ));
    assert_eq!(
        d.linker().accounting(),
        before,
        "a refused load changes nothing"
    );
    d.load_and_check(&attempt, &keys(1..=2));
}

/// Case 35: a second load queued while the first is in flight is refused.
pub fn duplicate_load_is_refused<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=2);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &pages), 2);
    d.linker().load(&attempt, &slots(LOAD_BASE, 2)).unwrap();
    let before = d.linker().accounting();
    assert!(matches!(
        d.linker().load(&attempt, &slots(LOAD_BASE, 2)),
        Err(Error::DuplicateLoad { .. })
    ));
    assert_eq!(d.linker().accounting(), before);
    let _ = d.fixture.settle();
    d.assert_restored(&pages, LOAD_BASE);
    assert_eq!(d.claims(), 0);
}

/// Case 39: reset with accepted transfers in flight is refused and keeps
/// everything; after they land, reset succeeds.
pub fn reset_refused_while_transfers_in_flight<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=2);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let before = d.linker().accounting();
    assert!(matches!(
        d.linker().reset(incarnation(2)),
        Err(Error::TransfersInFlight { in_flight: 1 })
    ));
    assert_eq!(d.linker().accounting(), before);
    let _ = d.fixture.settle();
    assert_eq!(
        d.longest(&attempt, 0, &pages),
        2,
        "the refused reset kept the store"
    );
    d.linker().reset(incarnation(2)).unwrap();
    assert_eq!(d.linker().accounting(), crate::Accounting::default());
}

/// Case 40: after a reset an offloaded page is a miss; a re-offload round-trips.
pub fn reset_forgets_store_and_reoffload_round_trips<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let pages = keys(1..=2);
    d.offload(&pages);
    d.linker().reset(incarnation(2)).unwrap();
    let cold = d.start("cold", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&cold, 0, &pages), 0);
    d.linker().request_finished(&cold).unwrap();
    d.offload(&pages);
    let warm = d.start("warm", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&warm, 0, &pages), 2);
    d.load_and_check(&warm, &pages);
}

/// Unknown, ended and out-of-order attempts get typed errors, never panics.
pub fn stale_and_unknown_attempts_are_typed_errors<F: LinkerFixture>(
    factory: &dyn Fn(&FixtureSpec) -> F,
) {
    let mut d = Driver::standard(factory);
    let ghost = AttemptId {
        request: RequestId("ghost".into()),
        generation: 7,
    };
    let l = d.linker();
    assert!(matches!(
        l.preparation(&ghost),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert!(matches!(
        l.lookup(&ghost, 0, &[]),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert!(matches!(
        l.load(&ghost, &slots(LOAD_BASE, 1)),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert!(matches!(
        l.request_finished(&ghost),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert!(matches!(
        l.request_aborted(&ghost),
        Err(Error::NoLiveAttempt { .. })
    ));
    let newer = d.start("r", 0, &keys(1..=1));
    let older = AttemptId {
        request: newer.request.clone(),
        generation: newer.generation - 1,
    };
    let context = RequestContext::new(
        kvcr_contracts::HintSnapshot::new(older, Vec::new()),
        PrefixQuery {
            namespace: NAMESPACE,
            device_prefix_pages: 0,
            tail: keys(1..=1),
        },
    );
    assert!(matches!(
        d.linker().request_started(&context),
        Err(Error::AttemptOutOfOrder { .. })
    ));
    assert_eq!(d.linker().accounting().live_attempts, 1);
}

/// Case 37: offload outcomes come out in submission order.
pub fn offload_outcomes_in_submission_order<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let submitted: Vec<OffloadTicket> = [keys(1..=2), keys(3..=3), keys(4..=6)]
        .iter()
        .map(|batch| d.queue_offload(batch))
        .collect();
    let done: Vec<OffloadTicket> = d
        .fixture
        .settle()
        .into_iter()
        .filter_map(|e| match e {
            LinkerEvent::OffloadDone { ticket, success } => {
                assert!(success);
                Some(ticket)
            }
            _ => None,
        })
        .collect();
    assert_eq!(done, submitted);
}

/// Invariant 1: a claimed page is never evicted; an offload that would need
/// one fails instead. Once released, eviction reports each page once.
pub fn claimed_page_is_never_evicted<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let spec = FixtureSpec {
        store_pages: 2,
        ..FixtureSpec::standard()
    };
    let mut d = Driver::new(factory, spec);
    let held = keys(1..=2);
    d.offload(&held);
    let attempt = d.start("r", 0, &held);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &held), 2);
    let ticket = d.queue_offload(&keys(3..=3));
    let events = d.fixture.settle();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, LinkerEvent::Evicted { .. })),
        "a claimed page was evicted: {events:?}"
    );
    assert!(events.contains(&LinkerEvent::OffloadDone {
        ticket,
        success: false
    }));
    d.load_and_check(&attempt, &held);
    d.linker().request_finished(&attempt).unwrap();
    let ticket = d.queue_offload(&keys(3..=3));
    let events = d.fixture.settle();
    let evicted: Vec<_> = events
        .iter()
        .flat_map(|e| match e {
            LinkerEvent::Evicted { keys, .. } => keys.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(evicted.len(), 1, "exactly one page makes room: {events:?}");
    assert!(held.contains(&evicted[0].key));
    assert!(events.contains(&LinkerEvent::OffloadDone {
        ticket,
        success: true
    }));
}

/// A device slot outside the pool is a typed error and queues nothing.
pub fn bad_device_slot_is_refused<F: LinkerFixture>(factory: &dyn Fn(&FixtureSpec) -> F) {
    let mut d = Driver::standard(factory);
    let slots_in_pool = d.spec.device_slots;
    let batch = OffloadBatch {
        namespace: NAMESPACE,
        pages: vec![(BlockKey::from_u64(1), DeviceSlot(slots_in_pool))],
    };
    assert!(matches!(
        d.linker().offload(batch),
        Err(Error::DeviceSlot { slot, .. }) if slot == DeviceSlot(slots_in_pool)
    ));
    assert_eq!(d.in_flight(), 0);
    let pages = keys(1..=1);
    d.offload(&pages);
    let attempt = d.start("r", 0, &pages);
    let _ = d.fixture.settle();
    assert_eq!(d.longest(&attempt, 0, &pages), 1);
    assert!(matches!(
        d.linker().load(&attempt, &[DeviceSlot(slots_in_pool)]),
        Err(Error::DeviceSlot { .. })
    ));
    assert_eq!(d.claims(), 1, "the refused load kept the claim");
}
