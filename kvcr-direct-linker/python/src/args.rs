//! Scalar and list arguments from Python, read without PyO3's own conversion
//! (which raises `TypeError`/`OverflowError`): a value of the wrong type or
//! out of range becomes [`Error::Argument`] (`kvcr_direct.ArgumentError`),
//! a hint that does not parse [`Error::Hint`].

use std::time::Duration;

use kvcr_foundation::{BlockKey, FetchHint, NamespaceId};
use kvcr_linker_contracts::DeviceSlot;
use pyo3::prelude::*;

use crate::error::{Error, Result};

fn wrong(what: &str, obj: &Bound<'_, PyAny>) -> Error {
    let shown = obj
        .repr()
        .map_or_else(|_| "?".to_owned(), |r| r.to_string());
    let shown: String = shown.chars().take(80).collect();
    Error::Argument(format!("{what}: {shown} is not valid"))
}

/// The items of a list, tuple or other sequence (a `str` or `bytes` is not
/// one).
fn items<'py>(obj: &Bound<'py, PyAny>, what: &str) -> Result<Vec<Bound<'py, PyAny>>> {
    obj.extract::<Vec<Bound<'py, PyAny>>>()
        .map_err(|_| wrong(&format!("{what} must be a sequence"), obj))
}

/// An integer (a `bool` is refused: `True` as a slot is a bug).
fn int(obj: &Bound<'_, PyAny>, what: &str) -> Result<i128> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(wrong(what, obj));
    }
    obj.extract::<i128>().map_err(|_| wrong(what, obj))
}

/// An integer in `0..=max`.
pub(crate) fn bounded(obj: &Bound<'_, PyAny>, what: &str, max: u64) -> Result<u64> {
    let value = int(obj, what)?;
    u64::try_from(value)
        .ok()
        .filter(|v| *v <= max)
        .ok_or_else(|| wrong(&format!("{what} must be in 0..={max}"), obj))
}

/// A `u32`.
pub(crate) fn u32_arg(obj: &Bound<'_, PyAny>, what: &str) -> Result<u32> {
    bounded(obj, what, u64::from(u32::MAX)).map(|v| v as u32)
}

/// A page key: an integer in `[-2^63, 2^64)` (the signed and the unsigned
/// wire forms).
pub(crate) fn key(obj: &Bound<'_, PyAny>) -> Result<BlockKey> {
    let raw = int(obj, "a page key")?;
    BlockKey::from_wire_int(raw).map_err(|_| wrong("a page key must be in [-2^63, 2^64)", obj))
}

/// A sequence of page keys.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> Result<Vec<BlockKey>> {
    items(obj, "keys")?.iter().map(key).collect()
}

/// A namespace id (an unsigned 64-bit integer).
pub(crate) fn namespace(obj: &Bound<'_, PyAny>) -> Result<NamespaceId> {
    bounded(obj, "namespace", u64::MAX).map(NamespaceId)
}

/// A sequence of device page slots.
pub(crate) fn slots(obj: &Bound<'_, PyAny>) -> Result<Vec<DeviceSlot>> {
    items(obj, "slots")?
        .iter()
        .map(|s| u32_arg(s, "a device slot").map(DeviceSlot))
        .collect()
}

/// Offload pages: a sequence of `(key, slot)` pairs.
pub(crate) fn offload_pages(obj: &Bound<'_, PyAny>) -> Result<Vec<(BlockKey, DeviceSlot)>> {
    items(obj, "pages")?
        .iter()
        .map(|pair| match items(pair, "a page")?.as_slice() {
            [k, s] => Ok((key(k)?, DeviceSlot(u32_arg(s, "a device slot")?))),
            _ => Err(wrong("a page must be a (key, slot) pair", pair)),
        })
        .collect()
}

/// A timeout in seconds (finite, not negative, at most a day).
pub(crate) fn seconds(obj: &Bound<'_, PyAny>, what: &str) -> Result<Duration> {
    let value: f64 = if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(wrong(what, obj));
    } else {
        obj.extract().map_err(|_| wrong(what, obj))?
    };
    if !(0.0..=86_400.0).contains(&value) {
        return Err(wrong(&format!("{what} must be in 0..=86400 seconds"), obj));
    }
    Ok(Duration::from_secs_f64(value))
}

/// Router hints: a sequence of JSON texts, each a `kv.fetch@1.0` envelope
/// (an object with `actions`) or the compact form
/// `{"source_control_endpoint": .., "block_hashes": [..]}`.
pub(crate) fn hints(obj: &Bound<'_, PyAny>) -> Result<Vec<FetchHint>> {
    items(obj, "hints")?
        .iter()
        .enumerate()
        .map(|(index, item)| {
            let text: String = item
                .extract()
                .map_err(|_| wrong(&format!("hint {index} must be a JSON str"), item))?;
            let envelope = text.contains("\"actions\"");
            let parsed = if envelope {
                FetchHint::from_json(&text)
            } else {
                FetchHint::from_legacy_json(&text)
            };
            parsed.map_err(|error| Error::Hint { index, error })
        })
        .collect()
}
