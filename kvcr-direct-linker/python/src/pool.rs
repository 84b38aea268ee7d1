//! The engine's KV pool as torch tensors, read and checked here (the Python
//! package checks the same first; this layer does not trust it).
//!
//! Every number is read from the tensor itself, never from caller-supplied
//! addresses: a tensor is accepted only when its type is exactly
//! `torch.Tensor` (a subclass could override what is read below) with the
//! strided layout. The checks, per buffer and across them:
//!
//! * placement: every buffer on the CPU (a host-resident pool) or every one on
//!   the same CUDA device (then the driver also confirms each is device memory
//!   of that device, mapped throughout: `Device::check_allocation`);
//! * one dtype, of 1, 2 or 4 bytes per element;
//! * one shape `(*token_dims, kv_heads, head_dim)`, every dimension positive,
//!   the tokens a whole number of pages;
//! * contiguous (strides, as torch's `is_contiguous` reads them: a dimension
//!   of size one has no stride that matters);
//! * inside the tensor's own storage, and no two buffers sharing a byte.
//!
//! What stays the engine's promise: the tensors are neither freed nor resized
//! while the linker lives (the linker keeps a reference to each, so only an
//! explicit `resize_`/`set_` could break it), and a slot named by an accepted
//! offload or restore is untouched until its event is reported.

use kvcr_direct_linker::KvLayout;
use pyo3::prelude::*;

use crate::error::{Error, Result};

/// Most layers a pool may have (a page is `2 × layers` spans, at most 256).
pub(crate) const MAX_LAYERS: usize = 128;

/// One K or V buffer as read from its tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Buffer {
    /// `data_ptr()`.
    pub(crate) addr: u64,
    /// `shape`.
    pub(crate) shape: Vec<i64>,
    /// `stride()`, in elements.
    pub(crate) strides: Vec<i64>,
    /// `str(dtype)`.
    pub(crate) dtype: String,
    /// `element_size()`.
    pub(crate) element_size: u64,
    /// `device.type`.
    pub(crate) device_type: String,
    /// `device.index` (`None` for the CPU).
    pub(crate) device_index: Option<i64>,
    /// The storage's `data_ptr()` and `nbytes()`.
    pub(crate) storage: (u64, u64),
}

/// Where the pool must live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Host memory (a CPU engine, or tests without a GPU).
    Host,
    /// This CUDA device.
    Cuda(u32),
}

/// The pool's geometry, as the buffers give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pool {
    /// The linker's layout (`tp_rank`/`tp_size` filled in by the caller).
    pub(crate) layout: KvLayout,
    /// Bytes of each buffer.
    pub(crate) buffer_bytes: u64,
}

fn bad(what: impl Into<String>) -> Error {
    Error::Layout(what.into())
}

fn attr<'py>(obj: &Bound<'py, PyAny>, name: &str) -> Result<Bound<'py, PyAny>> {
    obj.getattr(name)
        .map_err(|_| bad(format!("a buffer has no `{name}`")))
}

fn call<'py>(obj: &Bound<'py, PyAny>, name: &str) -> Result<Bound<'py, PyAny>> {
    obj.call_method0(name)
        .map_err(|_| bad(format!("a buffer's `{name}()` failed")))
}

fn extract<'py, T: for<'a> FromPyObject<'a, 'py>>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> Result<T> {
    obj.extract::<T>()
        .map_err(|_| bad(format!("a buffer's {what} is not what torch returns")))
}

/// Reads one buffer; refuses anything but a strided `torch.Tensor`.
pub(crate) fn read(obj: &Bound<'_, PyAny>) -> Result<Buffer> {
    let torch = obj
        .py()
        .import("torch")
        .map_err(|_| bad("torch does not import"))?;
    let tensor_type = attr(&torch, "Tensor")?;
    if !obj.get_type().is(&tensor_type) {
        return Err(bad(format!(
            "every buffer must be a torch.Tensor (not a subclass), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
        )));
    }
    if !attr(obj, "layout")?.is(&attr(&torch, "strided")?) {
        return Err(bad("every buffer must have the strided layout"));
    }
    let device = attr(obj, "device")?;
    let storage = call(obj, "untyped_storage")?;
    Ok(Buffer {
        addr: extract(&call(obj, "data_ptr")?, "data_ptr()")?,
        shape: extract(&attr(obj, "shape")?, "shape")?,
        strides: extract(&call(obj, "stride")?, "stride()")?,
        dtype: attr(obj, "dtype")?
            .str()
            .map_err(|_| bad("a buffer's dtype has no name"))?
            .to_string(),
        element_size: extract(&call(obj, "element_size")?, "element_size()")?,
        device_type: extract(&attr(&device, "type")?, "device type")?,
        device_index: extract(&attr(&device, "index")?, "device index")?,
        storage: (
            extract(&call(&storage, "data_ptr")?, "storage data_ptr()")?,
            extract(&call(&storage, "nbytes")?, "storage nbytes()")?,
        ),
    })
}

/// Whether `strides` are the row-major strides of `shape` (dimensions of size
/// one are skipped, as torch's `is_contiguous` does).
fn contiguous(shape: &[i64], strides: &[i64]) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    let mut expected: i64 = 1;
    for (size, stride) in shape.iter().zip(strides).rev() {
        if *size != 1 && *stride != expected {
            return false;
        }
        match expected.checked_mul(*size) {
            Some(next) => expected = next,
            None => return false,
        }
    }
    true
}

fn positive_u32(value: i64, what: &str) -> Result<u32> {
    u32::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| bad(format!("{what} must be in 1..2^32, got {value}")))
}

fn check_placement(buffer: &Buffer, placement: Placement, name: &str) -> Result<()> {
    let ok = match placement {
        Placement::Host => buffer.device_type == "cpu",
        Placement::Cuda(ordinal) => {
            buffer.device_type == "cuda" && buffer.device_index == Some(i64::from(ordinal))
        }
    };
    if ok {
        return Ok(());
    }
    let want = match placement {
        Placement::Host => "cpu".to_owned(),
        Placement::Cuda(ordinal) => format!("cuda:{ordinal}"),
    };
    let got = match buffer.device_index {
        Some(index) => format!("{}:{index}", buffer.device_type),
        None => buffer.device_type.clone(),
    };
    Err(bad(format!(
        "{name} is on {got}; the pool must be on {want}"
    )))
}

/// Checks the buffers (see the module docs) and returns the pool they make:
/// `k[l]` and `v[l]` are layer `l`'s K and V buffers.
pub(crate) fn check(
    k: &[Buffer],
    v: &[Buffer],
    page_tokens: u32,
    placement: Placement,
) -> Result<Pool> {
    if k.is_empty() || k.len() > MAX_LAYERS || k.len() != v.len() {
        return Err(bad(format!(
            "need one K and one V buffer per layer, 1..={MAX_LAYERS} layers; got {} K and {} V",
            k.len(),
            v.len()
        )));
    }
    if page_tokens == 0 {
        return Err(bad("page_tokens must be positive"));
    }
    let named = k
        .iter()
        .enumerate()
        .map(|(l, b)| (format!("k_buffers[{l}]"), b))
        .chain(
            v.iter()
                .enumerate()
                .map(|(l, b)| (format!("v_buffers[{l}]"), b)),
        );
    let first = k.first().ok_or_else(|| bad("no buffers"))?;
    let mut extents = Vec::with_capacity(2 * k.len());
    let mut buffer_bytes = 0;
    for (name, buffer) in named {
        check_placement(buffer, placement, &name)?;
        if buffer.dtype != first.dtype || buffer.shape != first.shape {
            return Err(bad(format!(
                "{name} is {} {:?}, k_buffers[0] is {} {:?}: every buffer must match",
                buffer.dtype, buffer.shape, first.dtype, first.shape
            )));
        }
        if !contiguous(&buffer.shape, &buffer.strides) {
            return Err(bad(format!(
                "{name} is not contiguous (shape {:?}, strides {:?})",
                buffer.shape, buffer.strides
            )));
        }
        let elements = buffer.shape.iter().try_fold(1u64, |n, d| {
            u64::try_from(*d).ok().and_then(|d| n.checked_mul(d))
        });
        let bytes = elements
            .and_then(|n| n.checked_mul(buffer.element_size))
            .filter(|b| *b > 0)
            .ok_or_else(|| bad(format!("{name} has no bytes or overflows")))?;
        let end = buffer
            .addr
            .checked_add(bytes)
            .ok_or_else(|| bad(format!("{name} overflows the address space")))?;
        let (storage, storage_bytes) = buffer.storage;
        let storage_end = storage.saturating_add(storage_bytes);
        if buffer.addr < storage || end > storage_end {
            return Err(bad(format!("{name} reaches outside its own storage")));
        }
        extents.push((buffer.addr, end, name));
        buffer_bytes = bytes;
    }
    extents.sort_unstable();
    if let Some(pair) = extents
        .windows(2)
        .find(|w| matches!(w, [a, b] if a.1 > b.0))
        && let [a, b] = pair
    {
        return Err(bad(format!("{} and {} share memory", a.2, b.2)));
    }
    let (token_dims, geometry) = match first.shape.as_slice() {
        [tokens @ .., heads, dim] if !tokens.is_empty() => (tokens, (*heads, *dim)),
        other => {
            return Err(bad(format!(
                "a buffer must be shaped (*token_dims, kv_heads, head_dim), got {other:?}"
            )));
        }
    };
    let tokens = token_dims
        .iter()
        .try_fold(1u64, |n, d| {
            u64::try_from(*d).ok().and_then(|d| n.checked_mul(d))
        })
        .filter(|t| *t > 0)
        .ok_or_else(|| bad("the token dimensions must be positive"))?;
    if !tokens.is_multiple_of(u64::from(page_tokens)) {
        return Err(bad(format!(
            "{tokens} tokens per buffer are not a whole number of {page_tokens}-token pages"
        )));
    }
    let device_pages = u32::try_from(tokens / u64::from(page_tokens))
        .map_err(|_| bad("more than 2^32 page slots"))?;
    let dtype_bytes = u32::try_from(first.element_size)
        .ok()
        .filter(|b| matches!(b, 1 | 2 | 4))
        .ok_or_else(|| bad(format!("dtype {} is not of 1, 2 or 4 bytes", first.dtype)))?;
    let layout = KvLayout {
        layers: u32::try_from(k.len()).map_err(|_| bad("too many layers"))?,
        page_tokens,
        kv_heads: positive_u32(geometry.0, "kv_heads")?,
        head_dim: positive_u32(geometry.1, "head_dim")?,
        dtype_bytes,
        device_pages,
        tp_rank: 0,
        tp_size: 1,
        k_bases: k.iter().map(|b| b.addr).collect(),
        v_bases: v.iter().map(|b| b.addr).collect(),
    };
    layout.validate()?;
    Ok(Pool {
        layout,
        buffer_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(addr: u64, shape: &[i64]) -> Buffer {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        Buffer {
            addr,
            shape: shape.to_vec(),
            strides,
            dtype: "torch.bfloat16".to_owned(),
            element_size: 2,
            device_type: "cpu".to_owned(),
            device_index: None,
            storage: (addr, 1 << 20),
        }
    }

    #[test]
    fn a_layer_first_pool_gives_its_layout() {
        let k = [buffer(0x10000, &[8, 2, 16])];
        let v = [buffer(0x20000, &[8, 2, 16])];
        let pool = check(&k, &v, 4, Placement::Host).unwrap();
        assert_eq!(pool.layout.device_pages, 2);
        assert_eq!(pool.layout.span_bytes(), 4 * 2 * 16 * 2);
        assert_eq!(pool.buffer_bytes, 8 * 2 * 16 * 2);
    }

    #[test]
    fn refusals() {
        let ok = buffer(0x10000, &[8, 2, 16]);
        let mut transposed = buffer(0x20000, &[8, 2, 16]);
        transposed.strides = vec![32, 1, 2];
        let cases: Vec<(Vec<Buffer>, Vec<Buffer>, &str)> = vec![
            (vec![ok.clone()], vec![transposed], "not contiguous"),
            (
                vec![ok.clone()],
                vec![buffer(0x10020, &[8, 2, 16])],
                "share memory",
            ),
            (
                vec![ok.clone()],
                vec![buffer(0x20000, &[8, 2, 8])],
                "must match",
            ),
            (vec![ok.clone()], vec![], "one K and one V"),
            (
                vec![buffer(0x10000, &[6, 2, 16])],
                vec![buffer(0x20000, &[6, 2, 16])],
                "whole",
            ),
        ];
        for (k, v, why) in cases {
            let err = check(&k, &v, 4, Placement::Host).unwrap_err().to_string();
            assert!(err.contains(why), "{err} lacks {why}");
        }
        let err = check(
            std::slice::from_ref(&ok),
            &[buffer(0x20000, &[8, 2, 16])],
            4,
            Placement::Cuda(0),
        )
        .unwrap_err();
        assert!(err.to_string().contains("must be on cuda:0"), "{err}");
    }
}
