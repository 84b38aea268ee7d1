//! The rules an advertised region set obeys, applied alike by the encoder
//! (before writing) and the decoder (after reading), so both accept the same
//! frames.

use super::{
    MAX_DEVICE_EXPORT, MAX_DEVICE_REGIONS, MAX_LABEL, MAX_REGIONS, MAX_RKEY, bound, frame,
};
use crate::error::{Echo, FrameReason, Result};
use crate::protocol::{DeviceRegionAdvert, DoorbellAdvert, RegionAdvert, SegmentAdvert};

/// The rules every advertised region set obeys (shared by encode and decode).
pub(super) fn check_regions(regions: &[RegionAdvert]) -> Result<()> {
    bound("regions", regions.len(), MAX_REGIONS)?;
    let mut ids: Vec<u32> = regions.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    regions.iter().try_for_each(check_region)
}

/// Each segment names an advertised region, and no region twice.
pub(super) fn check_segments(regions: &[RegionAdvert], segments: &[SegmentAdvert]) -> Result<()> {
    bound("segments", segments.len(), regions.len())?;
    let mut ids: Vec<u32> = segments.iter().map(|s| s.region.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    match segments
        .iter()
        .find(|s| !regions.iter().any(|r| r.id == s.region))
    {
        Some(stray) => Err(frame(FrameReason::UnknownSegmentRegion(stray.region.0))),
        None => Ok(()),
    }
}

/// The doorbell names an advertised region.
pub(super) fn check_doorbell(regions: &[RegionAdvert], doorbell: &DoorbellAdvert) -> Result<()> {
    if regions.iter().any(|r| r.id == doorbell.region) {
        Ok(())
    } else {
        Err(frame(FrameReason::UnknownDoorbellRegion(doorbell.region.0)))
    }
}

/// Device regions: bounded, ids unique among themselves and apart from the
/// regions' (an element names one region), extents that fit, a named export.
pub(super) fn check_device_regions(
    regions: &[RegionAdvert],
    devices: &[DeviceRegionAdvert],
) -> Result<()> {
    bound("device regions", devices.len(), MAX_DEVICE_REGIONS)?;
    let mut ids: Vec<u32> = devices.iter().map(|d| d.id.0).collect();
    ids.extend(regions.iter().map(|r| r.id.0));
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    for device in devices {
        if device.element_size == 0 {
            return Err(frame(FrameReason::Zero("device element_size")));
        }
        if device.count == 0 {
            return Err(frame(FrameReason::Zero("device count")));
        }
        if device.export.is_empty() {
            return Err(frame(FrameReason::Empty("device export")));
        }
        bound("device export", device.export.len(), MAX_DEVICE_EXPORT)?;
        let overlapping = device.count > 1 && device.stride < device.element_size;
        let end = device
            .extent()
            .and_then(|extent| device.base.checked_add(extent));
        if overlapping || end.is_none() {
            return Err(frame(FrameReason::DeviceRegionExtent(device.id.0)));
        }
    }
    Ok(())
}

fn check_region(region: &RegionAdvert) -> Result<()> {
    let label_ok = !region.label.is_empty()
        && region.label.len() <= MAX_LABEL
        && region
            .label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-'));
    if !label_ok {
        return Err(frame(FrameReason::Label(Echo::new(&region.label))));
    }
    if region.element_size == 0 {
        return Err(frame(FrameReason::Zero("region element_size")));
    }
    if region.count == 0 {
        return Err(frame(FrameReason::Zero("region count")));
    }
    if region.rkey.is_empty() {
        return Err(frame(FrameReason::Empty("rkey")));
    }
    bound("rkey", region.rkey.len(), MAX_RKEY)?;
    let overlapping = region.count > 1 && region.stride < region.element_size;
    let end = region
        .stride
        .checked_mul(region.count - 1)
        .and_then(|last| last.checked_add(region.element_size))
        .and_then(|extent| region.base.checked_add(extent));
    if overlapping || end.is_none() {
        return Err(frame(FrameReason::RegionExtent(Echo::new(&region.label))));
    }
    Ok(())
}
