//! Coalesced transfer plans for fixed layouts, pinned by snapshots.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use kvcr_hicache_perf::coalesce::{CoalesceOptions, plan};
use kvcr_hicache_perf::layout::{PageFirstPage, PageGeometry, page_first_restore};
use rstest::rstest;

const HOST: u32 = 9;
const K_POOL: u32 = 0;
const V_POOL: u32 = 1;

/// Pages `host[i]` restored from slots `slots[i]` of separate K and V pools.
fn two_pools(host: &[u64], slots: &[u64]) -> Vec<PageFirstPage> {
    host.iter()
        .zip(slots)
        .map(|(&h, &s)| PageFirstPage {
            host_page: h,
            k_slot: (K_POOL, s),
            v_slot: (V_POOL, s),
        })
        .collect()
}

/// K and V of each page in neighbouring slots of one pool.
fn one_pool_interleaved(host: &[u64]) -> Vec<PageFirstPage> {
    host.iter()
        .enumerate()
        .map(|(i, &h)| PageFirstPage {
            host_page: h,
            k_slot: (K_POOL, 2 * i as u64),
            v_slot: (K_POOL, 2 * i as u64 + 1),
        })
        .collect()
}

#[rstest]
#[case::contiguous_pages_two_pools("contiguous_pages_two_pools", two_pools(&[4, 5, 6, 7], &[0, 1, 2, 3]), 0)]
#[case::scattered_host_pages("scattered_host_pages", two_pools(&[7, 2, 3, 9], &[0, 1, 2, 3]), 0)]
#[case::out_of_order_slots("out_of_order_slots", two_pools(&[0, 1, 2, 3], &[3, 2, 1, 0]), 0)]
#[case::interleaved_kv_in_one_pool("interleaved_kv_in_one_pool", one_pool_interleaved(&[0, 1, 2, 3]), 0)]
#[case::capped_at_two_pages("capped_at_two_pages", two_pools(&[0, 1, 2, 3, 4], &[0, 1, 2, 3, 4]), 2 * 3_670_016)]
fn page_first_restore_plans(
    #[case] name: &str,
    #[case] pages: Vec<PageFirstPage>,
    #[case] cap: u64,
) {
    let descriptors = page_first_restore(PageGeometry::QWEN3_0_6B, HOST, 16, &pages);
    let base = plan(&descriptors, CoalesceOptions::default());
    let merged = plan(
        &descriptors,
        CoalesceOptions {
            enabled: true,
            max_transfer_bytes: cap,
        },
    );
    assert_eq!(base.bytes(), merged.bytes());
    insta::assert_snapshot!(
        name,
        format!(
            "ops without {} / with {}\n{}",
            base.ops(),
            merged.ops(),
            merged.render()
        )
    );
}
