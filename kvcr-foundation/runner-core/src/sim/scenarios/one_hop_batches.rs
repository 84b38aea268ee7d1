//! How many pages a device deliver asks of its source per write: one-hop
//! writes by [`PeerConfig::one_hop_write_batch_bytes`] (else the two-hop
//! size), two-hop writes always by [`PeerConfig::write_batch_bytes`].

use super::one_hop::deliver_now;
use super::*;
use crate::sim::device::DeviceWorld;

/// A deliver of three one-element pages: the keys of each `start_write`
/// it sends, in order, per configured size and route.
#[rstest::rstest]
#[case::one_hop_inherits_the_two_hop_size(BLOCK, None, true, &[1, 1, 1])]
#[case::one_hop_takes_its_own(BLOCK, Some(2 * BLOCK), true, &[2, 1])]
#[case::one_hop_smaller_than_two_hop(3 * BLOCK, Some(BLOCK), true, &[1, 1, 1])]
#[case::one_hop_zero_is_one_write(BLOCK, Some(0), true, &[3])]
#[case::two_hops_keep_theirs(BLOCK, Some(3 * BLOCK), false, &[1, 1, 1])]
fn a_device_deliver_sizes_its_writes_by_route(
    #[case] write_batch_bytes: u64,
    #[case] one_hop_write_batch_bytes: Option<u64>,
    #[case] one_hop: bool,
    #[case] keys_per_write: &[usize],
) {
    let mut world = DeviceWorld::new_with(7, |c| {
        c.write_batch_bytes = write_batch_bytes;
        c.one_hop_write_batch_bytes = one_hop_write_batch_bytes;
        c.one_hop = one_hop;
    });
    world.quiet();
    world.request(vec![7]);
    world.settle().unwrap();
    let _ = sent(&mut world.target);
    deliver_now(&mut world, "sized", &[4, 5, 6], 4001);
    let writes: Vec<(usize, u16)> = sent(&mut world.target)
        .into_iter()
        .filter_map(|(_, body)| match body {
            Body::StartWrite {
                keys,
                lead_elements,
                ..
            } => Some((keys.len(), lead_elements)),
            _ => None,
        })
        .collect();
    let sizes: Vec<usize> = writes.iter().map(|w| w.0).collect();
    assert_eq!(sizes, keys_per_write, "keys per write: {writes:?}");
    // Only a one-hop write asks for its lead (the two-hop route's copy
    // into the GPU reports it instead).
    assert!(
        writes.iter().all(|w| (w.1 != 0) == one_hop),
        "lead asked on the one-hop route only: {writes:?}"
    );
}
