//! The one-hop route, source side: a same-host target's device regions,
//! opened with our device copier ([`DeviceCopier::import_device`]), and the
//! writes into them, copied from our KVCR DRAM by the copier
//! ([`DeviceImport::copy_into`]) on a thread of their own (never the peer
//! thread, see [`writer`]), then reported like any put.
//!
//! Drop order: a route holds its imports (`Arc`), and so does every write
//! queued or copying through one; an import closes when the route is gone
//! and the writer has finished every write through it. The writer is a
//! field of the peer thread's state beside the lanes, joined (after its
//! queued writes) before the pools its copies read are unmapped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{DeviceRegionAdvert, RegionId};
use kvcr_runner_core::{CopySpan, PutSpan};

use super::State;
use super::routes::Route;
use crate::copy::device::{DeviceCopier, DeviceImport};
use crate::shared::Shared;

mod writer;

pub(crate) use writer::PassCounters;

pub(super) use self::writer::OneHopWriter;

/// One opened device region of a target: where its element 0 is in the
/// target's address space (the export's first byte), and the import.
pub(super) struct DeviceRoute {
    base: u64,
    import: Arc<dyn DeviceImport>,
    /// Bytes of the import's extent, asked once.
    len: u64,
    /// Where the extent begins in our device address space, when the
    /// import can be addressed so ([`DeviceImport::resolve`]): a write's
    /// copies are then planned as addresses and join the writer's passes.
    address: Option<u64>,
}

impl DeviceRoute {
    fn new(base: u64, import: Arc<dyn DeviceImport>) -> Self {
        let len = import.len();
        let address = import.resolve(0, len);
        Self {
            base,
            import,
            len,
            address,
        }
    }
}

/// A target's opened device regions, sorted by id; a write's copies name
/// them by position. The route shares them (`Arc`) with every write
/// through it, so each import stays open until the last of those is gone.
/// Drop order: the imports close before the copier's reference goes
/// (fields drop in declaration order).
#[derive(Default)]
pub(super) struct DeviceRoutes {
    regions: Vec<(RegionId, DeviceRoute)>,
    /// The copier that opened them: every write through them copies with
    /// it (not whatever copier the runner holds when the write comes).
    copier: Option<Arc<dyn DeviceCopier>>,
}

impl DeviceRoutes {
    /// The regions `copier` opened, whatever order they come in; `None` if
    /// an id repeats.
    fn new(
        mut regions: Vec<(RegionId, DeviceRoute)>,
        copier: Arc<dyn DeviceCopier>,
    ) -> Option<Self> {
        regions.sort_unstable_by_key(|(id, _)| *id);
        let repeated = regions
            .windows(2)
            .any(|w| w.first().map(|r| r.0) == w.last().map(|r| r.0));
        (!repeated).then_some(Self {
            regions,
            copier: Some(copier),
        })
    }

    /// Whether no region was opened (no one-hop route).
    pub(super) fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Where `region` is among the opened regions, tried first after
    /// `last` ([`kvcr_runner_core::position_after`]).
    fn position_after(&self, region: RegionId, last: Option<usize>) -> Option<usize> {
        kvcr_runner_core::position_after(&self.regions, region, last, |(id, _)| *id)
    }

    /// The opened region at `position`.
    fn at(&self, position: usize) -> Option<&DeviceRoute> {
        self.regions.get(position).map(|(_, route)| route)
    }
}

/// An import counted in the runner's `device_imports_open` gauge from its
/// opening until its last holder (the route, or a write through it) drops
/// it. Drop order: the import closes first (fields drop in declaration
/// order), then the count falls, so a gauge at zero means closed.
struct CountedImport {
    import: Box<dyn DeviceImport>,
    _counted: OpenImport,
}

impl CountedImport {
    fn new(import: Box<dyn DeviceImport>, open: Arc<AtomicU64>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self {
            import,
            _counted: OpenImport(open),
        }
    }
}

/// One unit of the `device_imports_open` gauge, given back on drop.
struct OpenImport(Arc<AtomicU64>);

impl Drop for OpenImport {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DeviceImport for CountedImport {
    fn len(&self) -> u64 {
        self.import.len()
    }

    fn copy_into(&self, keys: &[&[CopySpan]]) -> crate::error::Result<()> {
        self.import.copy_into(keys)
    }

    fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        self.import.resolve(offset, len)
    }
}

/// One copy of a one-hop write: the position of the region it lands in
/// among its route's [`DeviceRoutes`], and the span (`src` in our pool,
/// `dst` an offset in that region's import).
type Copy = (usize, CopySpan);

/// A write's copies, page by page, each page's in layout order.
type Copies = Vec<Vec<Copy>>;

/// A one-hop write's copies, page by page, each page's in layout order.
enum Pages {
    /// Every destination an address in our device address space (each
    /// import addressed its extent): the writer's passes take them as they
    /// are.
    Addressed(Vec<Vec<CopySpan>>),
    /// Destinations as offsets into the regions at their positions: run
    /// import by import ([`DeviceImport::copy_into`]).
    ByRegion(Copies),
}

/// A one-hop write the writer runs.
struct Job {
    write: u64,
    /// The regions `pages` name, held open until the write is done.
    routes: Arc<DeviceRoutes>,
    pages: Pages,
    /// The copier that opened the copies' imports.
    copier: Arc<dyn DeviceCopier>,
    /// Leading spans per page whose landing the core hears of ahead of the
    /// rest (`Core::handle_put_lead_landed`); 0: none.
    lead: usize,
}

impl State {
    /// Opens every device region `peer` advertised, over a route that maps
    /// its pools (same host, proven its own). All or nothing: any refusal
    /// (no copier, another GPU, a driver error) leaves the route without
    /// the one-hop route, said once here; a restore then takes two hops.
    pub(super) fn open_device_regions(
        &self,
        shared: &Arc<Shared>,
        peer: &ControlEndpoint,
        regions: &[DeviceRegionAdvert],
    ) -> DeviceRoutes {
        if regions.is_empty() {
            return DeviceRoutes::default();
        }
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let Some(copier) = copier else {
            eprintln!("kvcr: no one-hop route to {peer}: no device copier here");
            return DeviceRoutes::default();
        };
        let mut opened = Vec::with_capacity(regions.len());
        for region in regions {
            let Some(extent) = region.extent() else {
                return DeviceRoutes::default();
            };
            match copier.import_device(&region.export, extent) {
                Ok(import) if import.len() >= extent => {
                    let open = Arc::clone(&self.control.stats.device_imports_open);
                    let import: Arc<dyn DeviceImport> = Arc::new(CountedImport::new(import, open));
                    opened.push((region.id, DeviceRoute::new(region.base, import)));
                }
                Ok(_) => {
                    eprintln!("kvcr: no one-hop route to {peer}: an import is short");
                    return DeviceRoutes::default();
                }
                Err(e) => {
                    eprintln!("kvcr: no one-hop route to {peer}: {e}");
                    return DeviceRoutes::default();
                }
            }
        }
        DeviceRoutes::new(opened, copier).unwrap_or_else(|| {
            eprintln!("kvcr: no one-hop route to {peer}: a device region advertised twice");
            DeviceRoutes::default()
        })
    }

    /// A one-hop write the core asked for: each span's destination turned
    /// into an address in its region's import (the core checked it against
    /// the advert; the plan checks it against the import's extent, and the
    /// copier against every open import again), copied on the writer's
    /// thread.
    pub(super) fn write_device(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        route: Option<&Route>,
        (spans, page_spans): (&[PutSpan], &[u32]),
        lead: usize,
    ) {
        // The copier comes with the route (no lock of the core's state per
        // write, on the path every one-hop write takes).
        let plan = route.and_then(|route| {
            let copier = Arc::clone(route.device.copier.as_ref()?);
            let pages = device_plan(&route.device, spans, page_spans)?;
            Some((Arc::clone(&route.device), pages, copier))
        });
        let queued = match plan {
            Some((routes, pages, copier)) => {
                let job = Job {
                    write,
                    routes,
                    pages,
                    copier,
                    lead,
                };
                self.one_hop
                    .submit(job, &self.lane_done_tx, &self.leads_landed_tx)
            }
            None => false,
        };
        if !queued {
            shared.with_core_now(|core, now| core.handle_put_done(now, write, false));
        }
        crate::timeline::mark("write_planned", write);
    }
}

/// The copies of a one-hop write, page by page (`page_spans`: how many of
/// `spans` each page is, as the core cut them): `src` in our pool, `dst`
/// an address where every region of the route was addressed, else the
/// offset from the region's base. `None` if the pages do not cut `spans`
/// exactly, or a span names a region this route did not open or lies
/// outside its region's import.
fn device_plan(opened: &DeviceRoutes, spans: &[PutSpan], page_spans: &[u32]) -> Option<Pages> {
    if opened
        .regions
        .iter()
        .all(|(_, route)| route.address.is_some())
    {
        let pages = cut_pages(opened, spans, page_spans, |_, route, offset, span| {
            Some(CopySpan {
                src: span.local,
                dst: route.address?.checked_add(offset)?,
                len: span.len,
            })
        })?;
        return Some(Pages::Addressed(pages));
    }
    let pages = cut_pages(opened, spans, page_spans, |position, _, offset, span| {
        Some((
            position,
            CopySpan {
                src: span.local,
                dst: offset,
                len: span.len,
            },
        ))
    })?;
    Some(Pages::ByRegion(pages))
}

/// `spans` cut into pages of `page_spans` spans each, each span made a
/// copy by `copy` (given its region's position and route, and its offset
/// into the region, checked to lie inside the import's extent); see
/// [`device_plan`].
fn cut_pages<T>(
    opened: &DeviceRoutes,
    spans: &[PutSpan],
    page_spans: &[u32],
    copy: impl Fn(usize, &DeviceRoute, u64, &PutSpan) -> Option<T>,
) -> Option<Vec<Vec<T>>> {
    let mut pages: Vec<Vec<T>> = Vec::with_capacity(page_spans.len());
    let mut rest = spans;
    let mut last = None;
    for count in page_spans {
        let (in_page, after) = rest.split_at_checked(usize::try_from(*count).ok()?)?;
        rest = after;
        let mut page = Vec::with_capacity(in_page.len());
        for span in in_page {
            let position = opened.position_after(span.region, last)?;
            last = Some(position);
            let route = opened.at(position)?;
            let offset = span.remote.checked_sub(route.base)?;
            if offset.checked_add(span.len)? > route.len {
                return None;
            }
            page.push(copy(position, route, offset, span)?);
        }
        pages.push(page);
    }
    rest.is_empty().then_some(pages)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An import of `len` bytes, addressed at `at` if it is `Some`.
    struct Extent {
        len: u64,
        at: Option<u64>,
    }

    impl DeviceImport for Extent {
        fn len(&self) -> u64 {
            self.len
        }
        fn copy_into(&self, _: &[&[CopySpan]]) -> crate::error::Result<()> {
            Ok(())
        }
        fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
            (offset.checked_add(len)? <= self.len).then_some(self.at? + offset)
        }
    }

    /// A copier the plan never calls.
    struct Idle;

    impl DeviceCopier for Idle {
        fn attach(&self, _: &[kvcr_runner_core::PoolRange]) -> crate::error::Result<()> {
            Ok(())
        }
        fn copy(&self, _: &[&[CopySpan]]) -> crate::error::Result<()> {
            Ok(())
        }
        fn detach(&self, _: &[kvcr_runner_core::PoolRange]) {}
    }

    /// Regions 7, 3 and 5 (opened in that order), region `r` based at
    /// `r << 20`, its import 1 MiB long (at address `r << 40` if
    /// `addressed`).
    fn routes_of(addressed: bool) -> DeviceRoutes {
        let region = |id: u32| {
            let import = Extent {
                len: 1 << 20,
                at: addressed.then_some(u64::from(id) << 40),
            };
            let route = DeviceRoute::new(u64::from(id) << 20, Arc::new(import));
            (RegionId(id), route)
        };
        DeviceRoutes::new(vec![region(7), region(3), region(5)], Arc::new(Idle)).unwrap()
    }

    /// [`routes_of`], not addressed.
    fn routes() -> DeviceRoutes {
        routes_of(false)
    }

    /// A plan's pages, by region: each copy's position and offset.
    fn by_region(pages: Pages) -> Vec<Vec<(usize, u64)>> {
        let Pages::ByRegion(pages) = pages else {
            panic!("the imports were not addressed: a plan by region");
        };
        pages
            .iter()
            .map(|p| p.iter().map(|(at, s)| (*at, s.dst)).collect())
            .collect()
    }

    fn span(region: u32, offset: u64) -> PutSpan {
        PutSpan {
            local: 0x1000 + offset,
            remote: (u64::from(region) << 20) + offset,
            len: 16,
            region: RegionId(region),
        }
    }

    /// Pages are cut as the core counted them, whatever the regions'
    /// order; each copy names its region by position and lands at its
    /// offset.
    #[test]
    fn a_plan_cuts_pages_as_counted() {
        let spans = [
            span(3, 0),
            span(7, 0),
            span(5, 0),
            span(3, 16),
            span(7, 16),
            span(5, 16),
            span(3, 32),
        ];
        let shape = by_region(device_plan(&routes(), &spans, &[3, 3, 1]).unwrap());
        // Sorted by id, regions 3, 5 and 7 are positions 0, 1 and 2.
        assert_eq!(
            shape,
            [
                vec![(0, 0), (2, 0), (1, 0)],
                vec![(0, 16), (2, 16), (1, 16)],
                vec![(0, 32)]
            ]
        );
        // A page may name a region twice (slots cut unlike the elements).
        let shape = by_region(device_plan(&routes(), &spans, &[4, 3]).unwrap());
        assert_eq!(shape[0], [(0, 0), (2, 0), (1, 0), (0, 16)]);
    }

    /// Counts that do not cut the spans exactly make no plan.
    #[rstest::rstest]
    #[case::too_few(&[1, 1])]
    #[case::too_many(&[2, 2])]
    #[case::none(&[])]
    fn a_plan_refuses_counts_that_do_not_cut_the_spans(#[case] page_spans: &[u32]) {
        let spans = [span(3, 0), span(7, 0), span(5, 0)];
        assert!(device_plan(&routes(), &spans, page_spans).is_none());
        assert!(device_plan(&routes(), &spans, &[1, 2]).is_some());
    }

    /// A span in a region the route did not open, or below its region's
    /// base, makes no plan; nor does a route whose regions repeat an id.
    #[test]
    fn a_plan_refuses_what_the_route_did_not_open() {
        assert!(device_plan(&routes(), &[span(3, 0), span(4, 0)], &[2]).is_none());
        let mut below = span(5, 0);
        below.remote = (5 << 20) - 16;
        assert!(device_plan(&routes(), &[below], &[1]).is_none());
        let twice = |id: u32| {
            let import = Extent { len: 16, at: None };
            (RegionId(id), DeviceRoute::new(0, Arc::new(import)))
        };
        let regions = vec![twice(1), twice(2), twice(1)];
        assert!(DeviceRoutes::new(regions, Arc::new(Idle)).is_none());
    }

    /// Where every import is addressed, each copy lands at its import's
    /// address plus its offset, pages cut as by region.
    #[test]
    fn an_addressed_plan_names_addresses() {
        let spans = [span(3, 0), span(7, 16), span(3, 32)];
        let Some(Pages::Addressed(pages)) = device_plan(&routes_of(true), &spans, &[2, 1]) else {
            panic!("every import was addressed");
        };
        let dsts: Vec<Vec<u64>> = pages
            .iter()
            .map(|p| p.iter().map(|s| s.dst).collect())
            .collect();
        assert_eq!(dsts, [vec![3 << 40, (7 << 40) + 16], vec![(3 << 40) + 32]]);
    }

    /// A span reaching past its region's import makes no plan, addressed
    /// or not: the write fails before anything is queued.
    #[rstest::rstest]
    fn a_span_past_the_import_makes_no_plan(#[values(false, true)] addressed: bool) {
        let mut past = span(5, (1 << 20) - 16);
        assert!(device_plan(&routes_of(addressed), &[past], &[1]).is_some());
        past.len = 32;
        assert!(device_plan(&routes_of(addressed), &[past], &[1]).is_none());
    }
}
