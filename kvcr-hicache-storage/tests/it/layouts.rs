//! Host layouts → span plans.

use std::collections::BTreeSet;

use kvcr_foundation::runner::MAX_SPANS_PER_KEY;
use kvcr_hicache_storage::{
    Error, HostLayout, HostPoolDesc, KvGeometry, SpanPlan, pages_from_token_indices,
};
use rstest::rstest;

fn desc(layout: HostLayout, geometry: KvGeometry, pages: u64) -> HostPoolDesc {
    HostPoolDesc {
        layout,
        base: 0x1000_0000,
        len: HostPoolDesc::required_len(&geometry, pages).unwrap(),
        pages,
        geometry,
    }
}

/// Byte offset of element `(kv, token, layer, head, dim)` in a pool of
/// `pages` pages, straight from each layout's dimension order.
fn element_offset(
    layout: HostLayout,
    g: &KvGeometry,
    pages: u64,
    (kv, token, layer, head, dim): (u64, u64, u64, u64, u64),
) -> u64 {
    let (l, h, d, p) = (
        u64::from(g.layers),
        u64::from(g.kv_heads),
        u64::from(g.head_dim),
        u64::from(g.page_size),
    );
    let t = pages * p;
    let (page, slot) = (token / p, token % p);
    let index = match layout {
        // (2, L, T, H, D)
        HostLayout::LayerFirst => (((kv * l + layer) * t + token) * h + head) * d + dim,
        // (2, T, L, H, D)
        HostLayout::PageFirst => (((kv * t + token) * l + layer) * h + head) * d + dim,
        // (2, N, L, P, H, D)
        HostLayout::PageFirstDirect => {
            ((((kv * pages + page) * l + layer) * p + slot) * h + head) * d + dim
        }
        // (2, N, H, P, L, D)
        HostLayout::PageHead => {
            ((((kv * pages + page) * h + head) * p + slot) * l + layer) * d + dim
        }
    };
    index * u64::from(g.dtype_bytes)
}

/// Every layout: the bytes of page `p`'s spans are exactly the bytes of the
/// elements of page `p`'s tokens (no byte missed, none of another page).
#[rstest]
fn spans_cover_exactly_the_page(
    #[values(
        HostLayout::LayerFirst,
        HostLayout::PageFirst,
        HostLayout::PageFirstDirect,
        HostLayout::PageHead
    )]
    layout: HostLayout,
) {
    let g = KvGeometry {
        layers: 3,
        kv_heads: 2,
        head_dim: 4,
        dtype_bytes: 2,
        page_size: 4,
    };
    let pages = 5;
    let plan = SpanPlan::new(&desc(layout, g, pages)).unwrap();
    for page in 0..pages {
        let mut from_spans = BTreeSet::new();
        for (off, len) in plan.page_spans(page) {
            assert!(off + len <= HostPoolDesc::required_len(&g, pages).unwrap());
            for b in off..off + len {
                assert!(from_spans.insert(b), "byte {b} in two spans");
            }
        }
        let mut from_dims = BTreeSet::new();
        for kv in 0..2 {
            for token in page * 4..(page + 1) * 4 {
                for layer in 0..3 {
                    for head in 0..2 {
                        for dim in 0..4 {
                            let at =
                                element_offset(layout, &g, pages, (kv, token, layer, head, dim));
                            from_dims.insert(at);
                            from_dims.insert(at + 1);
                        }
                    }
                }
            }
        }
        assert_eq!(from_spans, from_dims, "{layout} page {page}");
    }
}

/// The plans for Qwen3-0.6B at TP=2 (one rank's 4 heads), 64-token pages.
#[test]
fn qwen3_plans() {
    let g = KvGeometry::qwen3_0_6b(2);
    assert_eq!(g.page_bytes(), 7_340_032 / 2);
    let summary: Vec<String> = HostLayout::ALL
        .iter()
        .map(|layout| {
            let plan = SpanPlan::new(&desc(*layout, g, 8)).unwrap();
            format!(
                "{layout}: {} spans of {} bytes per page, {} segment(s), regions {}..{}",
                plan.spans_per_page(),
                plan.span_bytes,
                plan.segments.len(),
                plan.kinds.first().unwrap().label,
                plan.kinds.last().unwrap().label,
            )
        })
        .collect();
    insta::assert_yaml_snapshot!(summary);
}

/// A layer-first page with more spans than one key may carry is split into
/// segments of at most `MAX_SPANS_PER_KEY` spans; a 2-span layout never is.
#[test]
fn many_layers_split_into_segments() {
    let max = MAX_SPANS_PER_KEY;
    let g = KvGeometry {
        layers: max as u32 / 2 + 1,
        ..KvGeometry::qwen3_0_6b(8)
    };
    let plan = SpanPlan::new(&desc(HostLayout::LayerFirst, g, 2)).unwrap();
    assert_eq!(plan.spans_per_page(), max + 2);
    assert_eq!(plan.segments, vec![0..max, max..max + 2]);
    let g = KvGeometry::qwen3_32b(1);
    let plan = SpanPlan::new(&desc(HostLayout::LayerFirst, g, 2)).unwrap();
    assert_eq!(plan.spans_per_page(), 128);
    assert_eq!(plan.segments.len(), 128usize.div_ceil(max));
    let plan = SpanPlan::new(&desc(HostLayout::PageFirst, g, 2)).unwrap();
    assert_eq!(plan.segments, vec![0..2]);
    assert_eq!(plan.span_bytes, 8 << 20);
}

#[rstest]
#[case::wrong_len(|d: &mut HostPoolDesc| d.len -= 1)]
#[case::null_base(|d: &mut HostPoolDesc| d.base = 0)]
#[case::no_pages(|d: &mut HostPoolDesc| { d.pages = 0; d.len = 0; })]
#[case::no_layers(|d: &mut HostPoolDesc| d.geometry.layers = 0)]
#[case::no_page_size(|d: &mut HostPoolDesc| d.geometry.page_size = 0)]
#[case::wraps(|d: &mut HostPoolDesc| d.base = u64::MAX - 10)]
fn bad_pools_are_typed_errors(#[case] change: fn(&mut HostPoolDesc)) {
    let mut d = desc(HostLayout::PageFirst, KvGeometry::qwen3_0_6b(1), 4);
    change(&mut d);
    assert!(matches!(SpanPlan::new(&d), Err(Error::HostPool(_))));
}

#[test]
fn layout_names_round_trip() {
    for layout in HostLayout::ALL {
        assert_eq!(layout.as_str().parse::<HostLayout>().unwrap(), layout);
    }
    assert!("page_last".parse::<HostLayout>().is_err());
}

/// SGLang's token-slot indices → page indices (page i at indices[i * page_size]).
#[rstest]
#[case::two_pages(vec![8, 9, 10, 11, 0, 1, 2, 3], 4, Ok(vec![2, 0]))]
#[case::unaligned(vec![1, 2, 3, 4], 4, Err(()))]
#[case::partial(vec![0, 1, 2], 4, Err(()))]
#[case::zero_page(vec![0], 0, Err(()))]
#[case::empty(vec![], 4, Ok(vec![]))]
fn token_indices(
    #[case] indices: Vec<u64>,
    #[case] page: u32,
    #[case] expected: Result<Vec<u64>, ()>,
) {
    assert_eq!(
        pages_from_token_indices(&indices, page).map_err(drop),
        expected
    );
}

/// Before any copy, the host pages of a call are checked against the
/// registered pool: in range, every span inside the registered buffer, none
/// named twice.
#[rstest]
#[case::fine(&[0, 3, 7], 0, None)]
#[case::empty(&[], 0, None)]
#[case::last_page(&[7], 0, None)]
#[case::past_the_pool(&[8], 0, Some("outside the pool's 8 pages"))]
#[case::far_past(&[u64::MAX], 0, Some("outside"))]
#[case::buffer_shorter_than_the_plan(&[7], 1, Some("runs past the registered buffer"))]
#[case::twice(&[2, 5, 2], 0, Some("host page 2 is named more than once"))]
#[case::twice_adjacent(&[4, 4], 0, Some("host page 4 is named more than once"))]
fn host_pages_are_checked_against_the_pool(
    #[values(
        HostLayout::LayerFirst,
        HostLayout::PageFirst,
        HostLayout::PageFirstDirect,
        HostLayout::PageHead
    )]
    layout: HostLayout,
    #[case] pages: &[u64],
    #[case] short_by: u64,
    #[case] refused: Option<&str>,
) {
    let d = desc(layout, KvGeometry::qwen3_0_6b(2), 8);
    let plan = SpanPlan::new(&d).unwrap();
    match (plan.check_host_pages(d.len - short_by, pages), refused) {
        (Ok(()), None) => {}
        (Err(e @ (Error::Batch(_) | Error::DuplicateHostPage(_))), Some(why)) => {
            assert!(e.to_string().contains(why), "{e}");
        }
        (other, _) => panic!("{pages:?}: {other:?}"),
    }
}
