//! Sparse shared-prefix residency and cross-rank agreement.

use kvcr_linker_contracts::{
    Advance, ClaimId, Error, PoolKind, PoolPresence, Preparation, RestorableLengths, RetireReason,
    agree_restorable_prefix,
};
use rstest::rstest;

use crate::key;

fn present(bits: &[u8]) -> Vec<bool> {
    bits.iter().map(|&b| b == 1).collect()
}

fn lengths(ls: &[u32]) -> RestorableLengths {
    RestorableLengths::new(ls.iter().copied())
}

/// Case 29: a full KV pool with every page and a sliding-window pool present
/// at pages 1 and 3: window 1 restores at 2 and 4; window 2 at nothing.
#[rstest]
#[case::swa_window_1(&[1, 1, 1, 1, 1], &[0, 1, 0, 1, 0], 1, &[2, 4])]
#[case::swa_window_2(&[1, 1, 1, 1, 1], &[0, 1, 0, 1, 0], 2, &[])]
#[case::swa_window_2_dense_tail(&[1, 1, 1, 1, 1], &[0, 0, 1, 1, 1], 2, &[4, 5])]
#[case::window_longer_than_prefix(&[1, 1, 1], &[1, 1, 0], 5, &[1, 2])]
#[case::full_pool_gap_caps(&[1, 1, 0, 1, 1], &[1, 1, 1, 1, 1], 1, &[1, 2])]
fn sparse_pools_give_sparse_lengths(
    #[case] full: &[u8],
    #[case] swa: &[u8],
    #[case] window_pages: u32,
    #[case] expected: &[u32],
) {
    let pools = [
        PoolPresence {
            kind: PoolKind::Full,
            present: present(full),
        },
        PoolPresence {
            kind: PoolKind::SlidingWindow { window_pages },
            present: present(swa),
        },
    ];
    let got = RestorableLengths::from_pools(&pools).unwrap();
    assert_eq!(got.iter().collect::<Vec<_>>(), expected);
}

/// Malformed residency queries are typed errors.
#[rstest]
#[case::no_pools(vec![], "NoPools")]
#[case::length_mismatch(vec![(PoolKind::Full, vec![true; 3]), (PoolKind::Full, vec![true; 2])], "PoolLength")]
#[case::zero_window(vec![(PoolKind::Full, vec![true]), (PoolKind::SlidingWindow { window_pages: 0 }, vec![true])], "ZeroWindow")]
fn malformed_residency_queries_are_refused(
    #[case] pools: Vec<(PoolKind, Vec<bool>)>,
    #[case] expected: &str,
) {
    let pools: Vec<PoolPresence> = pools
        .into_iter()
        .map(|(kind, present)| PoolPresence { kind, present })
        .collect();
    let error = RestorableLengths::from_pools(&pools).unwrap_err();
    let matched = match expected {
        "NoPools" => matches!(error, Error::NoPools),
        "PoolLength" => matches!(
            error,
            Error::PoolLength {
                pool: 1,
                expected: 3,
                got: 2
            }
        ),
        _ => matches!(error, Error::ZeroWindow { pool: 1 }),
    };
    assert!(matched, "unexpected {error:?}");
}

/// Case 30: the agreed length is the largest length in every rank's set,
/// never the minimum of the ranks' maxima.
#[rstest]
#[case::common_four(vec![vec![2, 4], vec![4]], 4)]
#[case::disjoint_is_zero_not_two(vec![vec![2], vec![4]], 0)]
#[case::one_rank(vec![vec![1, 3]], 3)]
#[case::three_ranks(vec![vec![1, 2, 3], vec![2, 3], vec![1, 2]], 2)]
#[case::one_rank_has_nothing(vec![vec![1, 2], vec![]], 0)]
fn ranks_agree_on_the_intersection(#[case] reports: Vec<Vec<u32>>, #[case] agreed: u32) {
    let reports: Vec<RestorableLengths> = reports.iter().map(|r| lengths(r)).collect();
    assert_eq!(
        agree_restorable_prefix(&reports, reports.len()).unwrap(),
        agreed
    );
}

/// Agreement needs exactly one report per rank.
#[rstest]
#[case::missing_rank(1, 2)]
#[case::extra_report(3, 2)]
#[case::no_ranks(0, 0)]
fn agreement_needs_one_report_per_rank(#[case] given: usize, #[case] ranks: usize) {
    let reports = vec![lengths(&[1]); given];
    assert!(matches!(
        agree_restorable_prefix(&reports, ranks),
        Err(Error::RankCount { expected, got }) if expected == ranks && got == given
    ));
}

/// A preparation of pages 10..=13 made against a device prefix of 2 pages.
fn prepared() -> Preparation {
    let pages = (0..4)
        .map(|i| (key(10 + i), Some(ClaimId(100 + i))))
        .collect();
    Preparation::new(2, pages, lengths(&[2, 4]))
}

/// Cases 33 and 34: a lookup follows the engine's device prefix.
#[rstest]
#[case::unchanged(2, &[10, 11, 12, 13], Ok((vec![2, 4], 0, vec![])))]
#[case::grew_by_one(3, &[11, 12, 13], Ok((vec![1, 3], 1, vec![100])))]
#[case::grew_by_two(4, &[12, 13], Ok((vec![2], 2, vec![100, 101])))]
#[case::shorter_tail_caps(2, &[10, 11, 12], Ok((vec![2], 0, vec![])))]
#[case::shrank(1, &[9, 10, 11, 12, 13], Err(RetireReason::TailShrunk))]
#[case::passed(6, &[], Err(RetireReason::DevicePassed))]
#[case::other_tail(2, &[77, 11], Err(RetireReason::TailMismatch))]
fn lookup_follows_the_device_prefix(
    #[case] device_prefix: u32,
    #[case] tail: &[u64],
    #[case] expected: Result<(Vec<u32>, u32, Vec<u64>), RetireReason>,
) {
    let mut preparation = prepared();
    let tail: Vec<_> = tail.iter().copied().map(key).collect();
    match (preparation.lookup(device_prefix, &tail), expected) {
        (
            Advance::Current {
                lengths,
                shifted_by,
                released,
            },
            Ok((want_lengths, want_shift, want_released)),
        ) => {
            assert_eq!(lengths.iter().collect::<Vec<_>>(), want_lengths);
            assert_eq!(shifted_by, want_shift);
            assert_eq!(
                released,
                want_released.into_iter().map(ClaimId).collect::<Vec<_>>()
            );
            assert_eq!(preparation.start(), device_prefix);
            assert_eq!(preparation.claims().len(), 4 - want_shift as usize);
        }
        (Advance::Retired { reason, released }, Err(want)) => {
            assert_eq!(reason, want);
            assert_eq!(released.len(), 4, "retiring releases every claim");
            assert!(preparation.claims().is_empty());
        }
        (got, want) => panic!("got {got:?}, want {want:?}"),
    }
}

/// A length is reported only if every page below it is claimed.
#[test]
fn unclaimed_page_caps_the_lengths() {
    let pages = vec![
        (key(1), Some(ClaimId(1))),
        (key(2), None),
        (key(3), Some(ClaimId(3))),
    ];
    let preparation = Preparation::new(0, pages, lengths(&[1, 3]));
    assert_eq!(preparation.lengths().iter().collect::<Vec<_>>(), vec![1]);
}
