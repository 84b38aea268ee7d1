//! Memory registration (`ucp_mem_map`) that owns or borrows its region, and
//! packing its rkey.
//!
//! A [`Registration`] either **owns** its memory (an anonymous mapping made
//! here, or a `Vec<u8>` handed over) or **borrows** it for a lifetime, inside
//! a [`Context::scope`] — the same shape as `std::thread::scope`, and for the
//! same reason: a plain `Registration<'a>` over `&'a mut [u8]` could be
//! `mem::forget`-ed, ending the borrow while UCX still reads the memory. The
//! scope tears down every registration made in it before the borrow ends,
//! forgotten or not.
//!
//! Teardown (on drop, or at the end of the scope) first waits until no put
//! *from* the region is in flight (progressing the context's workers), then
//! `ucp_mem_unmap`s it, then frees owned memory: unmap before free.
//!
//! ## Memory shared with peers
//!
//! The safe layer never hands out Rust references into registered memory:
//! bytes go in and out through [`Registration::write`] / [`Registration::read`]
//! (bounds-checked copies through raw pointers), because UCX — and a peer
//! holding the region's rkey — may access it at any time. Which ranges a peer
//! may write, and when the owner may read them, is the protocol's contract
//! (grants, `write_done`, quarantine), not something a type can enforce for a
//! one-sided remote write.

use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr;
use std::rc::Rc;
use std::time::Duration;

use super::context::{Context, ContextInner};
use super::endpoint::DROP_WAIT;
use super::wire::RkeyBuffer;
use super::worker::WaitPolicy;
use super::{UcxReason, result, sys};
use crate::error::{Error, Result};

fn input(op: &'static str, reason: UcxReason) -> Error {
    Error::Refused { op, reason }
}

/// Options for an anonymous (process-owned) registration.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct AnonOptions {
    /// `madvise(MADV_HUGEPAGE)` (THP is `madvise` mode on these hosts; +15–20 %
    /// copy bandwidth measured).
    pub huge_pages: bool,
    /// Touch every page once now (first touch runs at ~1.4 GB/s here; do it
    /// at allocation, not on the data path).
    pub prefault: bool,
}

impl AnonOptions {
    /// No huge pages, no prefault.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`AnonOptions::huge_pages`].
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Sets [`AnonOptions::prefault`].
    pub fn prefault(mut self, on: bool) -> Self {
        self.prefault = on;
        self
    }
}

/// The shared core of a registration: the `memh`, the region, and how many
/// puts and message sends from it are in flight. In-flight operations hold
/// an `Rc` to it.
///
/// Field order: `teardown` (run by `Registration`'s drop, the scope, or this
/// struct's drop, whichever is first) unmaps `memh`; `ctx` is released last,
/// so the context is cleaned up after the unmap.
pub(crate) struct RegCore {
    memh: Cell<sys::ucp_mem_h>,
    ptr: *mut u8,
    len: usize,
    pub(crate) inflight: Cell<usize>,
    ctx: Rc<ContextInner>,
}

impl RegCore {
    /// Waits until no put from the region is in flight, then unmaps it.
    /// Idempotent; never panics; failures are recorded on the context.
    ///
    /// With `may_leak` (memory the registration owns), gives up after
    /// [`DROP_WAIT`] and returns `false`: the region then stays mapped and
    /// allocated forever (a leak, recorded), because freeing memory a put may
    /// still read would be a use-after-free. Borrowed memory cannot be leaked
    /// — the borrow ends when the scope does — so without `may_leak` the wait
    /// goes on, sleeping on the workers' event fds, until UCX completes or
    /// fails the puts (a force-closed or failed endpoint completes them).
    fn teardown(&self, may_leak: bool) -> bool {
        let memh = self.memh.get();
        if memh.is_null() {
            return true;
        }
        let policy = WaitPolicy::default();
        let mut waited = Duration::ZERO;
        let mut recorded = false;
        while self.inflight.get() > 0 {
            // Each in-flight put holds its worker, so at least one is live.
            let workers = self.ctx.live_workers();
            if workers.is_empty() {
                break;
            }
            let slice = Duration::from_millis(2);
            for w in &workers {
                // A timeout here only means "not yet"; keep waiting.
                let _ = w.wait_until(slice, &policy, || self.inflight.get() == 0);
            }
            waited = waited.saturating_add(slice);
            if waited >= DROP_WAIT && !recorded {
                recorded = true;
                self.ctx.record(input(
                    "registration teardown",
                    UcxReason::WaitTimeout {
                        waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                    },
                ));
                if may_leak {
                    return false;
                }
            }
        }
        // SAFETY: `memh` came from `ucp_mem_map` on `ctx` (alive: this struct
        // holds it) and is unmapped exactly once (the handle is nulled right
        // after); no put from the region is in flight (waited above).
        let unmapped = unsafe { result::memory::mem_unmap(self.ctx.handle, memh) };
        self.memh.set(ptr::null_mut());
        if let Err(e) = unmapped {
            self.ctx.record(e);
        }
        true
    }
}

impl Drop for RegCore {
    fn drop(&mut self) {
        // Normally already torn down by `Registration::drop` or the scope
        // (in-flight puts hold this core, so none is in flight here).
        self.teardown(true);
    }
}

/// Memory a registration can take ownership of (and drop after the UCX
/// unmap), e.g. a placed anonymous mapping.
///
/// # Safety
///
/// `as_mut_ptr()..as_mut_ptr()+byte_len()` must be valid, writable host memory,
/// the same on every call, owned by the value until it is dropped, and not
/// moved when the value is moved; `byte_len() > 0`.
pub unsafe trait OwnedMemory: 'static {
    /// First byte.
    fn as_mut_ptr(&self) -> *mut u8;
    /// Bytes.
    fn byte_len(&self) -> usize;
}

/// Owned memory behind a registration, freed after the unmap.
enum Backing {
    /// Handed over by [`Context::register_owned`]; dropped after the unmap,
    /// or never (leaked) when the unmap could not happen.
    Owned(std::mem::ManuallyDrop<Box<dyn OwnedMemory>>),
    /// Borrowed from the caller for the registration's lifetime.
    Borrowed,
    /// `mmap(MAP_ANONYMOUS)` of `len` bytes at the core's `ptr`.
    Anon,
    /// A `Box<[u8]>` turned into a raw pointer (`Box::into_raw`), so moving
    /// the registration never retags it while UCX holds the address.
    Boxed,
}

/// A memory region registered with UCX (`ucp_mem_map`): what a put reads
/// from, and what a peer's put writes into (through the rkey packed with
/// [`Registration::pack_rkey`]). `!Send`.
///
/// `'a` ties a borrowed registration to its memory (see [`Context::scope`]);
/// owned registrations are `Registration<'static>`.
pub struct Registration<'a> {
    core: Rc<RegCore>,
    backing: Backing,
    _mem: PhantomData<&'a mut [u8]>,
}

impl std::fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("base", &format_args!("{:p}", self.core.ptr))
            .field("len", &self.core.len)
            .field("in_flight", &self.core.inflight.get())
            .finish()
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        // 1. wait for in-flight puts from the region, unmap it (owned memory
        //    that stays in use past the bounded wait is leaked, not freed);
        let owned = !matches!(self.backing, Backing::Borrowed);
        if !self.core.teardown(owned) {
            return;
        }
        // 2. then free owned memory (the core may outlive this struct inside
        //    completed operation states, but it no longer points at memory
        //    anyone uses: it is unmapped, and never dereferenced again).
        match &mut self.backing {
            Backing::Borrowed => {}
            Backing::Owned(memory) => {
                // SAFETY: taken exactly once, here, after the UCX unmap above;
                // the field is never touched again.
                drop(unsafe { std::mem::ManuallyDrop::take(memory) });
            }
            Backing::Anon => {
                // SAFETY: `ptr`/`len` are exactly the mapping made in
                // `register_anon`, unmapped from UCX above, unmapped from the
                // process exactly once, here; no reference into it exists.
                let rc = unsafe { libc::munmap(self.core.ptr.cast::<c_void>(), self.core.len) };
                if rc != 0 {
                    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                    self.core.ctx.record(input(
                        "registration drop",
                        UcxReason::Os {
                            call: "munmap",
                            errno,
                        },
                    ));
                }
            }
            Backing::Boxed => {
                let slice = ptr::slice_from_raw_parts_mut(self.core.ptr, self.core.len);
                // SAFETY: `slice` is exactly the pointer `Box::into_raw` gave
                // in `register_vec`; reconstituted and freed exactly once,
                // after the UCX unmap above.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}

impl Registration<'_> {
    /// Maps `len` bytes at `ptr` with UCX.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be valid, writable host memory that stays allocated
    /// and is accessed by nobody else for as long as the returned registration
    /// (or the scope that tears it down) lives, and `len > 0`.
    unsafe fn map(ctx: &Context, ptr: *mut u8, len: usize, backing: Backing) -> Result<Self> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            ),
            address: ptr.cast::<c_void>(),
            length: len,
            memory_type: sys::UCS_MEMORY_TYPE_HOST,
            ..Default::default()
        };
        // SAFETY: live context; `params` names a host region that the caller
        // guarantees valid for the registration's life (which ends with the
        // unmap in `RegCore::teardown`).
        let memh = unsafe { result::memory::mem_map(ctx.inner.handle, &params) }?;
        Ok(Self {
            core: Rc::new(RegCore {
                memh: Cell::new(memh),
                ptr,
                len,
                inflight: Cell::new(0),
                ctx: Rc::clone(&ctx.inner),
            }),
            backing,
            _mem: PhantomData,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.core.len
    }

    /// Always false: empty regions are refused at registration.
    pub fn is_empty(&self) -> bool {
        self.core.len == 0
    }

    /// The region's base address (for diagnostics and NUMA audits; never
    /// dereference it — use [`Registration::read`] / [`Registration::write`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.core.ptr.cast_const()
    }

    /// Puts and message sends from this region still in flight.
    pub fn in_flight(&self) -> usize {
        self.core.inflight.get()
    }

    /// The raw pointer to `offset..offset+len`, after a bounds check.
    pub(crate) fn range_ptr(
        &self,
        offset: usize,
        len: usize,
    ) -> std::result::Result<*mut u8, UcxReason> {
        let size = self.core.len;
        match offset.checked_add(len) {
            // `wrapping_add` cannot wrap here: `offset <= size` and the region
            // is one allocation.
            Some(end) if end <= size => Ok(self.core.ptr.wrapping_add(offset)),
            _ => Err(UcxReason::LocalRange { offset, len, size }),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self
            .range_ptr(offset, src.len())
            .map_err(|r| input("registration write", r))?;
        // SAFETY: `dst..dst+src.len()` is inside the live region (checked);
        // the region is never referenced by Rust references (only through raw
        // pointers), and `src` is a Rust slice, so they cannot overlap.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies the region's bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self
            .range_ptr(offset, dst.len())
            .map_err(|r| input("registration read", r))?;
        // SAFETY: `src..src+dst.len()` is inside the live region (checked);
        // `dst` is a distinct Rust slice (the region is never lent out as one).
        unsafe { ptr::copy_nonoverlapping(src.cast_const(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        let dst = self
            .range_ptr(offset, len)
            .map_err(|r| input("registration fill", r))?;
        // SAFETY: `dst..dst+len` is inside the live region (checked).
        unsafe { ptr::write_bytes(dst, byte, len) };
        Ok(())
    }

    /// Packs the region's rkey (`ucp_rkey_pack`) into its travelling form, for
    /// a peer to [`unpack`](super::Endpoint::unpack_rkey) and put into. It
    /// grants access to the whole registration; what a peer may actually
    /// write is the protocol's grant.
    pub fn pack_rkey(&self) -> Result<RkeyBuffer> {
        let memh = self.memh();
        // SAFETY: live context and a live `memh` of it (this registration is
        // not torn down while `&self` exists).
        let (buf, size) = unsafe { result::memory::rkey_pack(self.core.ctx.handle, memh) }?;
        let bytes = if buf.is_null() {
            Vec::new()
        } else {
            // SAFETY: on success UCX returned `buf` holding `size` initialised
            // bytes, valid until released below.
            unsafe { std::slice::from_raw_parts(buf.cast_const().cast::<u8>(), size) }.to_vec()
        };
        if !buf.is_null() {
            // SAFETY: `buf` came from `ucp_rkey_pack`, released exactly once;
            // `bytes` is an owned copy.
            unsafe { result::memory::rkey_buffer_release(buf) };
        }
        RkeyBuffer::seal(
            self.core.ctx.id,
            self.core.ptr as u64,
            self.core.len as u64,
            &bytes,
        )
    }

    pub(crate) fn memh(&self) -> sys::ucp_mem_h {
        self.core.memh.get()
    }

    pub(crate) fn core(&self) -> &Rc<RegCore> {
        &self.core
    }

    pub(crate) fn context_inner(&self) -> &Rc<ContextInner> {
        &self.core.ctx
    }
}

impl Context {
    /// Registers a fresh anonymous mapping of `len` bytes (zeroed), owned by
    /// the registration and unmapped after the UCX unmap.
    pub fn register_anon(&self, len: usize, options: AnonOptions) -> Result<Registration<'static>> {
        let op = "register_anon";
        if len == 0 {
            return Err(input(op, UcxReason::EmptyRegion));
        }
        // SAFETY: a private anonymous mapping at an address the kernel picks;
        // no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(input(
                op,
                UcxReason::Os {
                    call: "mmap",
                    errno,
                },
            ));
        }
        let ptr = p.cast::<u8>();
        if options.huge_pages {
            // Advisory: a kernel without THP refuses, and that is fine.
            // SAFETY: `p..p+len` is the mapping just made.
            let _ = unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        }
        if options.prefault {
            // SAFETY: the whole mapping is ours, writable, and unaliased.
            unsafe { ptr::write_bytes(ptr, 0, len) };
        }
        // SAFETY: `ptr..ptr+len` is a fresh mapping owned by the registration
        // (`Backing::Anon`), unmapped only after the UCX unmap; `len > 0`.
        let mapped = unsafe { Registration::map(self, ptr, len, Backing::Anon) };
        if mapped.is_err() {
            // SAFETY: the mapping made above, not registered, freed once.
            unsafe { libc::munmap(p, len) };
        }
        mapped
    }

    /// Registers memory handed over by its owner (for example a placed
    /// anonymous mapping); the registration drops it after the UCX unmap.
    pub fn register_owned(&self, memory: Box<dyn OwnedMemory>) -> Result<Registration<'static>> {
        let (ptr, len) = (memory.as_mut_ptr(), memory.byte_len());
        if len == 0 {
            return Err(input("register_owned", UcxReason::EmptyRegion));
        }
        let backing = Backing::Owned(std::mem::ManuallyDrop::new(memory));
        // SAFETY: `OwnedMemory`'s contract: `ptr..ptr+len` is valid writable
        // memory owned by `backing`, which the registration keeps and drops
        // only after the UCX unmap; `len > 0`. On error `backing` is dropped
        // by `map`'s caller below (nothing was registered).
        match unsafe { Registration::map(self, ptr, len, Backing::Borrowed) } {
            Ok(mut registration) => {
                registration.backing = backing;
                Ok(registration)
            }
            Err(e) => {
                if let Backing::Owned(memory) = backing {
                    drop(std::mem::ManuallyDrop::into_inner(memory));
                }
                Err(e)
            }
        }
    }

    /// Registers memory handed over as a `Vec<u8>` (its length is the region;
    /// the registration owns and frees it).
    pub fn register_vec(&self, buf: Vec<u8>) -> Result<Registration<'static>> {
        if buf.is_empty() {
            return Err(input("register_vec", UcxReason::EmptyRegion));
        }
        let raw = Box::into_raw(buf.into_boxed_slice());
        let len = raw.len();
        let ptr = raw.cast::<u8>();
        // SAFETY: `ptr..ptr+len` is the leaked box, owned by the registration
        // (`Backing::Boxed`) and freed only after the UCX unmap; `len > 0`.
        let mapped = unsafe { Registration::map(self, ptr, len, Backing::Boxed) };
        if mapped.is_err() {
            // SAFETY: reconstitutes the box leaked above (not registered).
            drop(unsafe { Box::from_raw(raw) });
        }
        mapped
    }

    /// Runs `f` with a [`Scope`] in which caller-owned memory can be
    /// registered for the duration of the scope. When `f` returns (or
    /// unwinds), every registration made in the scope — including any that
    /// were leaked with `mem::forget` — waits for its in-flight puts and is
    /// unmapped, before the borrowed memory is handed back.
    pub fn scope<'env, T>(
        &self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
    ) -> T {
        let cores = Rc::new(Cell::new(Vec::new()));
        // Declared before `scope`, so dropped after it — also on unwind.
        let _teardown = ScopeTeardown(Rc::clone(&cores));
        let scope = Scope {
            ctx: self.clone(),
            cores,
            _scope: PhantomData,
            _env: PhantomData,
        };
        f(&scope)
    }
}

/// A scope for borrowed registrations; see [`Context::scope`].
pub struct Scope<'scope, 'env: 'scope> {
    ctx: Context,
    cores: Rc<Cell<Vec<Rc<RegCore>>>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cores = self.cores.take();
        let n = cores.len();
        self.cores.set(cores);
        f.debug_struct("Scope").field("registrations", &n).finish()
    }
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Registers caller-owned memory until the end of the scope (or until the
    /// returned registration is dropped, whichever is first).
    pub fn register(&'scope self, mem: &'env mut [u8]) -> Result<Registration<'scope>> {
        if mem.is_empty() {
            return Err(input("scope register", UcxReason::EmptyRegion));
        }
        let len = mem.len();
        let ptr = mem.as_mut_ptr();
        // SAFETY: `mem` is exclusively borrowed for `'env`, which outlives
        // the scope; the scope tears the registration down (waiting for its
        // puts, then unmapping) before `'env` can end, even if the handle is
        // leaked; nobody else touches the memory meanwhile (exclusive borrow);
        // `len > 0`.
        let reg = unsafe { Registration::map(&self.ctx, ptr, len, Backing::Borrowed) }?;
        let mut cores = self.cores.take();
        cores.push(Rc::clone(&reg.core));
        self.cores.set(cores);
        Ok(reg)
    }
}

/// Tears down every registration made in a scope when the scope ends.
struct ScopeTeardown(Rc<Cell<Vec<Rc<RegCore>>>>);

impl Drop for ScopeTeardown {
    fn drop(&mut self) {
        for core in self.0.take() {
            core.teardown(false);
        }
    }
}
