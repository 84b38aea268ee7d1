//! The lanes' tests: small writes striped or copied alone, large ones on
//! the lanes, every write reported once.

use super::*;
use crate::copy::test_memory::TestBuffer;
use rstest::rstest;

/// A test's source and destination buffers (registered in the lanes'
/// registry) and the copy plan between them: `spans` of (source offset,
/// destination offset, length).
struct Plan {
    src: Vec<u8>,
    source: TestBuffer,
    destination: TestBuffer,
    spans: Vec<(usize, usize, usize)>,
}

impl Plan {
    fn new(lanes: &Lanes, bytes: usize, spans: Vec<(usize, usize, usize)>) -> Self {
        let src: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        Self {
            source: TestBuffer::with(&lanes.memory, bytes, &src),
            destination: TestBuffer::new(&lanes.memory, bytes),
            src,
            spans,
        }
    }

    /// The destination's bytes now.
    fn dst(&self) -> Vec<u8> {
        self.destination.read(self.src.len())
    }

    fn copies(&self) -> Vec<CopySpan> {
        let (src, dst) = (self.source.addr(), self.destination.addr());
        self.spans
            .iter()
            .map(|&(s, d, len)| CopySpan {
                src: src + s as u64,
                dst: dst + d as u64,
                len: len as u64,
            })
            .collect()
    }

    /// `dst` as copying the spans one after another leaves it.
    fn expected(&self) -> Vec<u8> {
        let mut want = vec![0u8; self.src.len()];
        for &(s, d, len) in &self.spans {
            want[d..d + len].copy_from_slice(&self.src[s..s + len]);
        }
        want
    }

    /// The plan's spans as pages of `per_page` spans each, with the digest
    /// of their source bytes (`wrong`: page `wrong`'s is off by one).
    fn pages(&self, per_page: usize, wrong: Option<usize>) -> Vec<CheckedPage> {
        let counts: Vec<(usize, u64)> = self
            .spans
            .chunks(per_page)
            .enumerate()
            .map(|(i, spans)| {
                let bytes: Vec<u8> = spans
                    .iter()
                    .flat_map(|&(s, _, len)| self.src[s..s + len].iter().copied())
                    .collect();
                let digest = kvcr_sys::digest::digest_bytes(&bytes);
                let digest = if wrong == Some(i) { digest ^ 1 } else { digest };
                (spans.len(), digest)
            })
            .collect();
        CheckedPage::group(self.copies(), &counts).unwrap()
    }

    /// Submits the plan (no segment: the destinations are registered
    /// memory of this test) and returns the inline outcome.
    fn submit(&self, lanes: &mut Lanes, tx: &UnboundedSender<(u64, bool)>) -> Option<bool> {
        lanes.submit(1, self.copies(), Vec::new(), tx)
    }
}

#[test]
fn every_write_reports_once_even_across_lanes() {
    let mut lanes = Lanes::start(3, Arc::new(MemoryRegistry::new())).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let len = 8 << 20;
    let src = TestBuffer::with(&lanes.memory, len, &vec![7u8; len]);
    let dst = TestBuffer::new(&lanes.memory, len);
    let copies = vec![CopySpan {
        src: src.addr(),
        dst: dst.addr(),
        len: len as u64,
    }];
    // (No segment: these destinations are registered memory of this test.)
    assert_eq!(lanes.submit(9, copies, Vec::new(), &tx), None);
    assert_eq!(rx.blocking_recv(), Some((9, true)));
    assert!(rx.try_recv().is_err(), "reported once");
    assert!(dst.read(len).iter().all(|b| *b == 7));
    drop(lanes);
}

/// Lanes that stay awake (striping on), so small writes are striped.
fn lingering(count: usize) -> Lanes {
    Lanes::start_tuned(
        count,
        LaneTuning {
            stripe_lanes: count,
            linger: Duration::from_secs(30),
        },
        Arc::new(MemoryRegistry::new()),
    )
    .unwrap()
}

#[rstest]
#[case::one_block(256 << 10, vec![(0, 0, 256 << 10)])]
#[case::odd_length(300_001, vec![(0, 0, 300_001)])]
#[case::scattered_pages(512 << 10, vec![(0, 256 << 10, 64 << 10), (64 << 10, 0, 128 << 10), (300 << 10, 400 << 10, 100 << 10)])]
#[case::below_a_stripe(48 << 10, vec![(0, 0, 48 << 10)])]
#[case::just_under_inline((1 << 20) - 1, vec![(0, 0, (1 << 20) - 1)])]
fn small_writes_are_copied_before_submit_returns(
    #[case] bytes: usize,
    #[case] spans: Vec<(usize, usize, usize)>,
    #[values(1, 3)] lanes: usize,
) {
    let mut lanes = lingering(lanes);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let plan = Plan::new(&lanes, bytes, spans.clone());
        assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
        assert!(plan.dst() == plan.expected(), "every byte, at once");
    }
    assert!(
        rx.try_recv().is_err(),
        "a small write is not reported later"
    );
}

#[test]
fn awake_lanes_take_pieces_of_small_writes() {
    let mut lanes = lingering(1);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    // A spinning lane may be descheduled on a loaded machine; it takes
    // a piece within a few writes once it runs.
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    while lanes.striped_by_lanes.load(Ordering::Relaxed) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no lane ever took a piece of a striped write"
        );
        let plan = Plan::new(&lanes, 1 << 20, vec![(0, 0, (1 << 20) - 4096)]);
        assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
        assert!(plan.dst() == plan.expected());
    }
}

#[test]
fn a_small_write_wakes_parked_striping_lanes() {
    let tuning = LaneTuning {
        stripe_lanes: 2,
        linger: Duration::ZERO,
    };
    let mut lanes = Lanes::start_tuned(3, tuning, Arc::new(MemoryRegistry::new())).unwrap();
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    while !lanes
        .lanes
        .iter()
        .all(|l| l.inbox.parked.load(Ordering::SeqCst))
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "lanes never parked"
        );
        std::thread::yield_now();
    }
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let plan = Plan::new(&lanes, 256 << 10, vec![(0, 0, 256 << 10)]);
    assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
    assert!(plan.dst() == plan.expected());
    // A parked lane left unwoken would hold its stripe forever.
    while !lanes.lanes.iter().all(|l| l.inbox.is_empty()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "a striping lane was not woken"
        );
        std::thread::yield_now();
    }
    assert!(
        lanes.lanes[2].inbox.is_empty(),
        "only the striping lanes are handed pieces"
    );
}

#[test]
fn without_striping_a_small_write_is_copied_alone() {
    let tuning = LaneTuning {
        stripe_lanes: 0,
        linger: Duration::from_secs(30),
    };
    let mut lanes = Lanes::start_tuned(2, tuning, Arc::new(MemoryRegistry::new())).unwrap();
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let plan = Plan::new(&lanes, 256 << 10, vec![(0, 0, 256 << 10)]);
        assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
        assert!(plan.dst() == plan.expected());
    }
    assert_eq!(lanes.striped_by_lanes.load(Ordering::Relaxed), 0);
    assert!(lanes.lanes.iter().all(|l| l.inbox.is_empty()));
}

#[test]
fn a_small_write_naming_one_destination_twice_is_copied_in_order() {
    // A hostile grant may name one slot twice: never striped, so the
    // bytes are those of copying the spans in order.
    let mut lanes = lingering(3);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let plan = Plan::new(
        &lanes,
        512 << 10,
        vec![(0, 0, 256 << 10), (256 << 10, 0, 256 << 10)],
    );
    assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
    assert!(plan.dst() == plan.expected());
    assert_eq!(lanes.striped_by_lanes.load(Ordering::Relaxed), 0);
}

#[test]
fn closing_joins_lanes_after_their_queued_work() {
    let mut lanes =
        Lanes::start_tuned(2, LaneTuning::for_host(), Arc::new(MemoryRegistry::new())).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let plans: Vec<Plan> = (0..4)
        .map(|_| Plan::new(&lanes, 4 << 20, vec![(0, 0, 4 << 20)]))
        .collect();
    for (i, plan) in plans.iter().enumerate() {
        let inline = lanes.submit(i as u64, plan.copies(), Vec::new(), &tx);
        assert_eq!(inline, None);
    }
    drop(lanes);
    let mut reported: Vec<u64> = std::iter::from_fn(|| rx.try_recv().ok())
        .map(|(write, ok)| {
            assert!(ok);
            write
        })
        .collect();
    reported.sort_unstable();
    assert_eq!(
        reported,
        vec![0, 1, 2, 3],
        "every queued write ran and reported"
    );
    assert!(plans.iter().all(|p| p.dst() == p.expected()));
}

/// A write of pages with their deposit digests lands every byte once each
/// page's digest, taken as it is copied, matches; one page whose bytes are
/// not those deposited fails the write (inline or on the lanes, striped or
/// not) and is counted.
#[rstest]
#[case::one_block(256 << 10, 1)]
#[case::small_pages(768 << 10, 3)]
#[case::large_pages(32 << 20, 4)]
#[case::many_large_pages(48 << 20, 12)]
fn checked_pages_land_only_as_deposited(
    #[case] bytes: usize,
    #[case] pages: usize,
    #[values(1, 3)] lanes: usize,
) {
    let mut lanes = lingering(lanes);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let page = bytes / pages;
    // Two spans a page, the second half first (as a layout may order them).
    let spans: Vec<(usize, usize, usize)> = (0..pages)
        .flat_map(|p| {
            let (at, half) = (p * page, page / 2);
            [(at + half, at + half, page - half), (at, at, half)]
        })
        .collect();
    let mut submit = |lanes: &mut Lanes, plan: &Plan, pages: Vec<CheckedPage>| {
        let ok = lanes
            .submit_checked(7, pages, Vec::new(), &tx)
            .unwrap_or_else(|| {
                let (write, ok) = rx.blocking_recv().unwrap();
                assert_eq!(write, 7);
                ok
            });
        if ok {
            assert!(plan.dst() == plan.expected(), "every byte once");
        }
        ok
    };
    let plan = Plan::new(&lanes, bytes, spans.clone());
    assert!(submit(&mut lanes, &plan, plan.pages(2, None)));
    assert_eq!(lanes.checks.checked.load(Ordering::Relaxed), pages as u64);
    let plan = Plan::new(&lanes, bytes, spans);
    assert!(!submit(&mut lanes, &plan, plan.pages(2, Some(pages - 1))));
    assert_eq!(lanes.checks.altered.load(Ordering::Relaxed), 1);
    assert!(rx.try_recv().is_err(), "each write reported once");
}

#[test]
fn pages_that_do_not_add_up_to_the_spans_are_not_grouped() {
    let copy = CopySpan {
        src: 0,
        dst: 0,
        len: 1,
    };
    assert_eq!(CheckedPage::group(vec![copy; 3], &[(2, 0)]), None);
    assert_eq!(CheckedPage::group(vec![copy; 3], &[(2, 0), (2, 0)]), None);
    let grouped = CheckedPage::group(vec![copy; 3], &[(1, 5), (2, 6)]).unwrap();
    assert_eq!(
        grouped.iter().map(|p| p.copies.len()).collect::<Vec<_>>(),
        vec![1, 2]
    );
}
