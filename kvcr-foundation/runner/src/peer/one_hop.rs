//! The one-hop route, source side: a same-host target's device regions,
//! opened with our device copier ([`DeviceCopier::import_device`]), and the
//! writes into them, copied from our KVCR DRAM by the copier
//! ([`DeviceImport::copy_into`]) on a thread of their own (never the peer
//! thread), then reported like any put.
//!
//! Drop order: a route holds its imports (`Arc`), and so does every write
//! queued or copying through one; an import closes when the route is gone
//! and the writer has finished every write through it. The writer is a
//! field of the peer thread's state beside the lanes, joined (after its
//! queued writes) before the pools its copies read are unmapped.

use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{DeviceRegionAdvert, RegionId};
use kvcr_runner_core::{CopySpan, PutSpan};
use tokio::sync::mpsc::UnboundedSender;

use super::State;
use super::routes::Route;
use crate::copy::device::{DeviceCopier, DeviceImport};
use crate::shared::Shared;

/// One opened device region of a target: where its element 0 is in the
/// target's address space (the export's first byte), and the import.
#[derive(Clone)]
pub(super) struct DeviceRoute {
    base: u64,
    import: Arc<dyn DeviceImport>,
}

/// Per device region id, the opened import.
pub(super) type DeviceRoutes = HashMap<RegionId, DeviceRoute>;

/// One copy of a one-hop write: the region it lands in, that region's
/// import, and the span (`src` in our pool, `dst` an offset in the import).
type Copy = (RegionId, Arc<dyn DeviceImport>, CopySpan);

/// A write's copies, page by page, each page's in layout order.
type Copies = Vec<Vec<Copy>>;

/// A write (its id), its copies, and the copier that opened their imports.
type Job = (u64, Copies, Arc<dyn DeviceCopier>);

/// The thread that runs one-hop writes, one after the other (the copier
/// spreads each over its own streams).
#[derive(Default)]
pub(super) struct OneHopWriter {
    worker: Option<(mpsc::Sender<Job>, JoinHandle<()>)>,
}

impl OneHopWriter {
    /// Queues a write's copies; `done` hears `(write, ok)` once no copy of
    /// it can touch memory any more. `false` if the thread cannot be
    /// started (the write then fails at once).
    fn submit(&mut self, job: Job, done: &UnboundedSender<(u64, bool)>) -> bool {
        if self.worker.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let done = done.clone();
            let spawned = std::thread::Builder::new()
                .name("kvcr-one-hop".into())
                .spawn(move || {
                    for (write, copies, copier) in rx {
                        let ok = copy_write(&copies, copier.as_ref());
                        let _ = done.send((write, ok));
                    }
                });
            match spawned {
                Ok(thread) => self.worker = Some((tx, thread)),
                Err(_) => return false,
            }
        }
        self.worker
            .as_ref()
            .is_some_and(|(tx, _)| tx.send(job).is_ok())
    }
}

/// Runs one write's copies; whether all of them landed. One pass when
/// every import resolves its spans: the copier gets the write page by page
/// and issues span index i of every page together (a layer-first page's
/// first spans are layer 0's K and V, which so land first), as it does a
/// job. Otherwise import by import (one synchronisation per region). The
/// imports in `copies` stay open until this returns.
fn copy_write(copies: &Copies, copier: &dyn DeviceCopier) -> bool {
    let resolved: Option<Vec<Vec<CopySpan>>> = copies
        .iter()
        .map(|page| {
            page.iter()
                .map(|(_, import, s)| {
                    import.resolve(s.dst, s.len).map(|dst| CopySpan {
                        src: s.src,
                        dst,
                        len: s.len,
                    })
                })
                .collect()
        })
        .collect();
    if let Some(pages) = resolved {
        let keys: Vec<&[CopySpan]> = pages.iter().map(Vec::as_slice).collect();
        return copier.copy_to_imports(&keys).is_ok();
    }
    let mut by_region: Vec<(RegionId, &Arc<dyn DeviceImport>, Vec<CopySpan>)> = Vec::new();
    for (region, import, span) in copies.iter().flatten() {
        match by_region.iter_mut().find(|(r, ..)| r == region) {
            Some((_, _, spans)) => spans.push(*span),
            None => by_region.push((*region, import, vec![*span])),
        }
    }
    by_region
        .iter()
        .all(|(_, import, spans)| import.copy_into(&[spans.as_slice()]).is_ok())
}

impl Drop for OneHopWriter {
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.worker.take() {
            drop(tx);
            if thread.join().is_err() {
                eprintln!("kvcr: one-hop writer panicked");
            }
        }
    }
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
                    let import: Arc<dyn DeviceImport> = Arc::from(import);
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
    ) {
        let plan = route.and_then(|route| device_plan(&route.device, spans));
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let queued = match (plan, copier) {
            (Some(copies), Some(copier)) => self
                .one_hop
                .submit((write, copies, copier), &self.lane_done_tx),
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
