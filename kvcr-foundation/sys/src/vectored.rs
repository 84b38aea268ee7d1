//! Vectored socket I/O between a TCP stream and spans of memory named by
//! address (a data stream's frames: out of a source's pool, into a
//! target's granted slots), without blocking.

use std::io::{IoSlice, IoSliceMut};

use tokio::net::TcpStream;

/// Writes `head` (when given), then the bytes of `pieces` (address,
/// length) in order, to `socket` with one `writev`, without blocking;
/// returns how many bytes the socket took (`WouldBlock` when none).
/// `capacity` sizes the slice list (pieces plus head) up front.
///
/// # Safety
/// Every piece must be valid for reads, and unwritten by anyone, for the
/// call.
pub(crate) unsafe fn try_write_spans(
    socket: &TcpStream,
    head: Option<&[u8]>,
    pieces: impl IntoIterator<Item = (u64, u64)>,
    capacity: usize,
) -> std::io::Result<usize> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(capacity);
    if let Some(head) = head {
        slices.push(IoSlice::new(head));
    }
    for (start, len) in pieces {
        // SAFETY: the piece is readable and not written for the call (this
        // function's contract); the slice does not outlive the call.
        let bytes =
            unsafe { std::slice::from_raw_parts(start as usize as *const u8, len as usize) };
        slices.push(IoSlice::new(bytes));
    }
    socket.try_write_vectored(&slices)
}

/// Reads from `socket` into `pieces` (address, length) in order with one
/// `readv`, without blocking; returns how many bytes landed (0: the peer
/// closed; `WouldBlock` when nothing had arrived).
///
/// # Safety
/// Every piece must be valid for writes, and accessed by nobody else, for
/// the call; pieces must not overlap.
pub(crate) unsafe fn try_read_spans(
    socket: &TcpStream,
    pieces: impl IntoIterator<Item = (u64, u64)>,
) -> std::io::Result<usize> {
    let mut slices: Vec<IoSliceMut<'_>> = Vec::new();
    for (start, len) in pieces {
        // SAFETY: the piece is writable and touched by nothing else for the
        // call, and overlaps no other piece (this function's contract); the
        // slice does not outlive the call.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(start as usize as *mut u8, len as usize) };
        slices.push(IoSliceMut::new(bytes));
    }
    socket.try_read_vectored(&mut slices)
}
