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

use std::collections::HashMap;
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

pub(super) use self::writer::OneHopWriter;

/// One opened device region of a target: where its element 0 is in the
/// target's address space (the export's first byte), and the import.
#[derive(Clone)]
pub(super) struct DeviceRoute {
    base: u64,
    import: Arc<dyn DeviceImport>,
}

/// Per device region id, the opened import.
pub(super) type DeviceRoutes = HashMap<RegionId, DeviceRoute>;

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

/// One copy of a one-hop write: the region it lands in, that region's
/// import, and the span (`src` in our pool, `dst` an offset in the import).
type Copy = (RegionId, Arc<dyn DeviceImport>, CopySpan);

/// A write's copies, page by page, each page's in layout order.
type Copies = Vec<Vec<Copy>>;

/// A one-hop write the writer runs.
struct Job {
    write: u64,
    copies: Copies,
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
            return DeviceRoutes::new();
        }
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let Some(copier) = copier else {
            eprintln!("kvcr: no one-hop route to {peer}: no device copier here");
            return DeviceRoutes::new();
        };
        let mut opened = DeviceRoutes::new();
        for region in regions {
            let Some(extent) = region.extent() else {
                return DeviceRoutes::new();
            };
            match copier.import_device(&region.export, extent) {
                Ok(import) if import.len() >= extent => {
                    let open = Arc::clone(&self.control.stats.device_imports_open);
                    let import: Arc<dyn DeviceImport> = Arc::new(CountedImport::new(import, open));
                    opened.insert(
                        region.id,
                        DeviceRoute {
                            base: region.base,
                            import,
                        },
                    );
                }
                Ok(_) => {
                    eprintln!("kvcr: no one-hop route to {peer}: an import is short");
                    return DeviceRoutes::new();
                }
                Err(e) => {
                    eprintln!("kvcr: no one-hop route to {peer}: {e}");
                    return DeviceRoutes::new();
                }
            }
        }
        opened
    }

    /// A one-hop write the core asked for: each span's destination turned
    /// into an offset in its region's import (the core checked it against
    /// the advert; the import checks it against the export again), copied
    /// on the writer's thread.
    pub(super) fn write_device(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        route: Option<&Route>,
        spans: &[PutSpan],
        lead: usize,
    ) {
        let plan = route.and_then(|route| device_plan(&route.device, spans));
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let queued = match (plan, copier) {
            (Some(copies), Some(copier)) => {
                let job = Job {
                    write,
                    copies,
                    copier,
                    lead,
                };
                self.one_hop
                    .submit(job, &self.lane_done_tx, &self.leads_landed_tx)
            }
            _ => false,
        };
        if !queued {
            shared.with_core_now(|core, now| core.handle_put_done(now, write, false));
        }
    }
}

/// The copies of a one-hop write, page by page: `src` in our pool, `dst`
/// the offset from the region's base. A page ends where a region recurs
/// (a page names each of its elements' regions once, in layout order).
/// `None` if a span names a region this route did not open, or lies
/// before its base.
fn device_plan(opened: &DeviceRoutes, spans: &[PutSpan]) -> Option<Copies> {
    let mut pages: Copies = Vec::new();
    let mut page: Vec<Copy> = Vec::new();
    for span in spans {
        let route = opened.get(&span.region)?;
        let dst = span.remote.checked_sub(route.base)?;
        if page.iter().any(|(r, ..)| *r == span.region) {
            pages.push(std::mem::take(&mut page));
        }
        page.push((
            span.region,
            Arc::clone(&route.import),
            CopySpan {
                src: span.local,
                dst,
                len: span.len,
            },
        ));
    }
    if !page.is_empty() {
        pages.push(page);
    }
    Some(pages)
}
