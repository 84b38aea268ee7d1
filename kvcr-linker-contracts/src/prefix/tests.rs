//! Unit tests of `prefix` internals.

use super::*;

#[test]
fn shifting_drops_lengths_the_device_now_covers() {
    let lengths = RestorableLengths::new([1, 2, 4]);
    assert_eq!(lengths.shifted(2).iter().collect::<Vec<_>>(), vec![2]);
    assert!(lengths.shifted(4).is_empty());
}

#[test]
fn capping_keeps_lengths_up_to_the_limit() {
    let lengths = RestorableLengths::new([1, 3, 5]);
    assert_eq!(lengths.capped(3).iter().collect::<Vec<_>>(), vec![1, 3]);
    assert!(lengths.capped(0).is_empty());
}
