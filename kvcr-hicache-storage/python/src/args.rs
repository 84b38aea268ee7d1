//! Data-path arguments as Python passed them, read without raising.
//!
//! SGLang's I/O threads catch little, so a data-path call (`batch_exists`,
//! `batch_get_v1`, `batch_set_v1`, `batch_get_flat`, `batch_set_flat`) must
//! answer a miss, never raise, whatever it is given. PyO3's own argument
//! conversion raises (`TypeError`, `OverflowError` for a negative index), so
//! these calls take their arguments as plain objects and read them here: a
//! value of the wrong type or out of range becomes `None`, which the caller
//! serves as a miss of the right shape and counts (`faults_argument`).
//!
//! Flat pages are torch tensors, and their memory is read from the tensor
//! itself, never from a caller-supplied `(address, length)`: an address and a
//! length from Python are two integers nothing ties to live memory, so one
//! off by a byte made the copy write past the tensor. A tensor is accepted
//! only when its type is exactly `torch.Tensor` (a subclass could override
//! the methods read below), it lives on the CPU with the strided layout and is
//! contiguous, and `data_ptr() .. data_ptr() + numel() * element_size()` lies
//! inside its own storage (`untyped_storage()`). What remains the caller's
//! promise (stated on the calls): the tensor is neither freed nor resized by
//! another thread while the call runs (the GIL is released during the copy).

use kvcr_foundation::BlockKey;
use pyo3::prelude::*;

use crate::raw_memory::FlatPage;

/// The items of a list, tuple or other sequence (a `str` is not one); `None`
/// for anything else.
fn items<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    obj.extract::<Vec<Bound<'py, PyAny>>>().ok()
}

/// Page keys: each item that is a 64-hex digest (as SGLang names pages)
/// parsed, every other item `None`. `None` when `obj` is not a sequence.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> Option<Vec<Option<BlockKey>>> {
    let items = items(obj)?;
    Some(
        items
            .iter()
            .map(|k| {
                k.extract::<String>()
                    .ok()
                    .and_then(|k| BlockKey::from_hex_digest(&k).ok())
            })
            .collect(),
    )
}

/// Token slot indices (SGLang's `host_indices`): `None` unless `obj` is a
/// sequence of integers in `0..2^63` (a negative index, a float, a string or
/// `None` among them makes the whole list unusable).
pub(crate) fn token_indices(obj: &Bound<'_, PyAny>) -> Option<Vec<u64>> {
    let signed: Vec<i64> = obj.extract().ok()?;
    signed.into_iter().map(|i| u64::try_from(i).ok()).collect()
}

/// The `extra_info` JSON text: `Ok(None)` when absent (`None`), `Ok(text)`
/// for a `str`, `Err(())` for anything else (served without a hint).
pub(crate) fn extra_info_text(obj: Option<&Bound<'_, PyAny>>) -> Result<Option<String>, ()> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => o.extract::<String>().map(Some).map_err(drop),
    }
}

/// torch's `Tensor` type and its `strided` layout, looked up once per call.
struct Torch<'py> {
    tensor: Bound<'py, PyAny>,
    strided: Bound<'py, PyAny>,
}

impl<'py> Torch<'py> {
    fn load(py: Python<'py>) -> Option<Self> {
        let torch = py.import("torch").ok()?;
        Some(Self {
            tensor: torch.getattr("Tensor").ok()?,
            strided: torch.getattr("strided").ok()?,
        })
    }

    fn call_u64(obj: &Bound<'py, PyAny>, method: &str) -> Option<u64> {
        obj.call_method0(method).ok()?.extract().ok()
    }

    /// The bytes `obj` covers, if it is a tensor whose memory this extension
    /// may copy into or out of (see the module docs).
    fn extent(&self, obj: &Bound<'py, PyAny>) -> Option<FlatPage> {
        if !obj.get_type().is(&self.tensor) {
            return None;
        }
        let device: String = obj
            .getattr("device")
            .ok()?
            .getattr("type")
            .ok()?
            .extract()
            .ok()?;
        if device != "cpu" || !obj.getattr("layout").ok()?.is(&self.strided) {
            return None;
        }
        let contiguous: bool = obj.call_method0("is_contiguous").ok()?.extract().ok()?;
        if !contiguous {
            return None;
        }
        let addr = Self::call_u64(obj, "data_ptr")?;
        let len =
            Self::call_u64(obj, "numel")?.checked_mul(Self::call_u64(obj, "element_size")?)?;
        let storage = obj.call_method0("untyped_storage").ok()?;
        let storage_addr = Self::call_u64(&storage, "data_ptr")?;
        let storage_end = storage_addr.checked_add(Self::call_u64(&storage, "nbytes")?)?;
        let end = addr.checked_add(len)?;
        let inside = addr >= storage_addr && end <= storage_end;
        (addr != 0 && len != 0 && inside).then_some(FlatPage { addr, len })
    }
}

/// Flat pages: each item that is a usable tensor (see the module docs) as
/// the memory it covers, every other item `None`. `None` when `obj` is not a
/// sequence.
pub(crate) fn flat_pages(obj: &Bound<'_, PyAny>) -> Option<Vec<Option<FlatPage>>> {
    let items = items(obj)?;
    let torch = Torch::load(obj.py());
    Some(
        items
            .iter()
            .map(|t| torch.as_ref().and_then(|torch| torch.extent(t)))
            .collect(),
    )
}

/// Whether two of the flat pages share a byte (one call copying twice into
/// one tensor would keep only one copy and report both done).
pub(crate) fn overlapping(pages: &[Option<FlatPage>]) -> bool {
    let mut ranges: Vec<(u64, u64)> = pages
        .iter()
        .flatten()
        .map(|p| (p.addr, p.addr.saturating_add(p.len)))
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).any(|w| matches!(w, [a, b] if a.1 > b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(addr: u64, len: u64) -> Option<FlatPage> {
        Some(FlatPage { addr, len })
    }

    #[test]
    fn overlap_is_any_shared_byte() {
        assert!(!overlapping(&[page(0x1000, 16), page(0x1010, 16), None]));
        assert!(overlapping(&[page(0x1010, 16), page(0x1000, 17)]));
        assert!(overlapping(&[page(0x1000, 16), None, page(0x1000, 16)]));
        assert!(!overlapping(&[None, None]));
    }
}
