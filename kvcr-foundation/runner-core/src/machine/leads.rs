//! First layers: a device deliver's pages copied layer 0 first, and the
//! deliver reported ready to start on it before the rest has landed.
//!
//! Two routes say a page's leading spans landed: a copy job into device
//! memory (the driver, [`Core::handle_copy_lead_landed`]) and a one-hop
//! write (its source, `write_lead_landed`). A deliver is reported once every
//! entry before its first failed one has either succeeded or waits on a
//! copy or write whose lead landed, and at least one waits so (else the
//! deliver's own completion says it all). A report is progress, never
//! proof: it commits nothing and ends nothing; the deliver's result alone
//! says which pages landed.

use super::*;
use crate::types::EntryStatus;

impl Core {
    /// Leading spans of a page that make up its first layer (a layer-first
    /// layout's K and V of layer 0: 2). Device delivers' copy jobs and
    /// one-hop writes then report them landed ahead of the rest. 0 (the
    /// default): never.
    pub fn set_lead_elements(&mut self, elements: u16) {
        self.lead_elements = elements;
    }

    /// The first-layer span count ([`Core::set_lead_elements`]).
    pub fn lead_elements(&self) -> u16 {
        self.lead_elements
    }

    /// The lead a copy job asks its driver to report: only a deliver's
    /// into device memory, at most every key's span count.
    pub(in crate::machine) fn copy_lead(
        &self,
        memory: RegionMemory,
        keys: &[JobKey],
        spans: &[Vec<CopySpan>],
    ) -> u16 {
        let delivers = keys.iter().all(|k| matches!(k, JobKey::Deliver { .. }));
        if memory != RegionMemory::Device || !delivers || keys.is_empty() {
            return 0;
        }
        self.lead_within(spans.iter().map(Vec::len))
    }

    /// The first-layer span count, at most every page's span count (`pages`
    /// a job's or a write's keys, each its count of spans or elements).
    pub(in crate::machine) fn lead_within(&self, pages: impl Iterator<Item = usize>) -> u16 {
        let fewest = pages.min().unwrap_or(0);
        self.lead_elements
            .min(u16::try_from(fewest).unwrap_or(u16::MAX))
    }

    /// The driver's report that copy job `job` has its lead spans in place
    /// for every key it is copying (the rest may still be copying). Heard
    /// once per live job that asked; anything else is ignored. The job's
    /// deliver is then reported if it has become ready to start.
    pub fn handle_copy_lead_landed(&mut self, job: JobId) {
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        if j.lead_landed {
            return;
        }
        j.lead_landed = true;
        let op = j.op;
        self.note_lead(op);
    }

    /// Reports device deliver `deliver` if it is ready to start on its
    /// first layer ([`Self::lead_ready`]).
    pub(in crate::machine) fn note_lead(&mut self, deliver: OpHandle) {
        if let Some(pages) = self.lead_ready(deliver) {
            self.leads_landed.push((deliver, pages));
        }
    }

    /// How many leading entries of `deliver` have their first layer in
    /// place, when every entry before its first failure has succeeded or
    /// waits on a copy job or one-hop write whose lead landed, and at least
    /// one waits so.
    ///
    /// Called on every lead report, so a restore of n pages in n/k writes
    /// scanned ~n²/2k entries, each a lookup of its write: ~400,000 on the
    /// first layer's path for the seed's 1812 pages in 4-page writes. The
    /// entries found in place last time are only checked for a failure since.
    fn lead_ready(&mut self, deliver: OpHandle) -> Option<u32> {
        let o = self.ops.get(&deliver)?;
        let known = o.lead_prefix as usize;
        let mut pages = 0u32;
        let mut waiting = false;
        // An entry neither ended nor with its lead in place: not ready.
        let mut unlanded = false;
        for (i, e) in o.entries.iter().enumerate() {
            if i < known {
                match &e.result {
                    Some(r) if r.status != EntryStatus::Success => break,
                    Some(_) => {}
                    None => waiting = true,
                }
                pages += 1;
                continue;
            }
            let landed = match (&e.result, e.wait) {
                (Some(r), _) if r.status == EntryStatus::Success => false,
                (Some(_), _) => break,
                (None, Wait::Copy(job, _)) => self.jobs.get(&job).is_some_and(|j| j.lead_landed),
                (None, Wait::OneHop(op)) => self.one_hop_lead_landed(op),
                (None, _) => false,
            };
            if e.result.is_none() && !landed {
                unlanded = true;
                break;
            }
            waiting |= landed;
            pages += 1;
        }
        if let Some(o) = self.ops.get_mut(&deliver) {
            o.lead_prefix = o.lead_prefix.max(pages);
        }
        (waiting && !unlanded).then_some(pages)
    }

    /// Device delivers ready to start on their first layer, each with how
    /// many leading pages that covers, in the order they became so. A
    /// progress report only: the deliver's completion says which pages
    /// landed (byte-checked); a page reported here may still fail.
    pub fn drain_leads_landed(&mut self) -> Vec<(OpHandle, u32)> {
        std::mem::take(&mut self.leads_landed)
    }
}
