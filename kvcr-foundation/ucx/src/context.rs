//! The UCP context: library initialisation, the process-local context id, and
//! the record of errors that happened in `Drop`.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::ptr;
use std::rc::{Rc, Weak};

use super::worker::WorkerInner;
use super::{UcxReason, result, sys};

use crate::error::{Error, Result};

/// How many drop-time errors a context keeps (the rest are only counted).
const DROP_ERRORS_KEPT: usize = 64;

/// Options for [`Context::with_config`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ContextConfig {
    /// Request `UCP_FEATURE_WAKEUP`, so workers have an event fd and
    /// [`Worker::wait`](super::Worker::wait) can sleep in `poll(2)` instead of
    /// spinning. On by default.
    pub wakeup: bool,
    /// UCX configuration overrides applied with `ucp_config_modify` on top of
    /// the `UCX_*` environment, as `(name, value)` without the `UCX_` prefix:
    /// e.g. `("TLS", "tcp,self")`, `("NET_DEVICES", "lo")`. Per context, so
    /// two contexts in one process can use different transports without
    /// touching the (process-global) environment.
    pub overrides: Vec<(String, String)>,
    /// Error handling of the endpoints this context's workers create.
    pub error_mode: ErrorMode,
}

/// Endpoint error handling (`ucp_err_handling_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ErrorMode {
    /// `UCP_ERR_HANDLING_MODE_NONE`: works with every transport. A dead peer
    /// is noticed by the protocol's deadlines, not by UCX; endpoints are
    /// always closed in flush mode.
    #[default]
    None,
    /// `UCP_ERR_HANDLING_MODE_PEER`: UCX reports a dead peer (error handler,
    /// failed operations) and endpoints can be force-closed. UCX 1.13's
    /// shared-memory transports (`posix`, `sysv`, `self`) have no peer-failure
    /// support, so with them `connect` fails with
    /// [`UcsStatus::Unreachable`](crate::UcsStatus::Unreachable); use it with
    /// network transports (tcp, IB).
    Peer,
}

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            wakeup: true,
            overrides: Vec::new(),
            error_mode: ErrorMode::None,
        }
    }
}

impl ContextConfig {
    /// The default: RMA and active messages, with wakeup.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`ContextConfig::wakeup`].
    pub fn wakeup(mut self, on: bool) -> Self {
        self.wakeup = on;
        self
    }

    /// Sets [`ContextConfig::error_mode`].
    pub fn error_mode(mut self, mode: ErrorMode) -> Self {
        self.error_mode = mode;
        self
    }

    /// Adds a UCX configuration override (see [`ContextConfig::overrides`]).
    pub fn set(mut self, name: &str, value: &str) -> Self {
        self.overrides.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The TCP segment sizes (see [`TCP_SEGMENT_SIZES`]) on top of what is
    /// set, each unless `UCX_TCP_<name>` is in the environment (an operator's
    /// explicit setting wins).
    pub fn tuned_tcp_segments(mut self) -> Self {
        for (name, value) in TCP_SEGMENT_SIZES {
            if std::env::var_os(format!("UCX_TCP_{name}")).is_none() {
                self = self.set(name, value);
            }
        }
        self
    }

    /// Shorthand for `set("TLS", tls)` (and `NET_DEVICES=lo` when the list
    /// names tcp, so tests and single-host runs stay on loopback).
    pub fn loopback_tls(self, tls: &str) -> Self {
        let tcp = tls.split(',').any(|t| t == "tcp");
        let this = self.set("TLS", tls);
        if tcp {
            this.set("NET_DEVICES", "lo")
        } else {
            this
        }
    }
}

/// TCP segment sizes kvcr runs UCX's tcp transport with: 64 KiB out,
/// 256 KiB in. UCX's 8 KiB defaults cost a syscall and a completion per
/// 8 KiB; these moved 16 MiB over loopback at 2.4–3.2 GB/s against 0.8–1.2.
/// Set through `ucp_config_modify` by their bare names (UCX applies a bare
/// transport setting to every transport that has the field; only tcp has
/// these two). Never the shared-memory `SEG_SIZE`: above 65535 it corrupts
/// data silently.
pub const TCP_SEGMENT_SIZES: [(&str, &str); 2] = [("TX_SEG_SIZE", "64k"), ("RX_SEG_SIZE", "256k")];

/// Shared state of a context. Everything created from a context (workers,
/// registrations) holds an `Rc` to it, so `ucp_cleanup` runs only after the
/// last of them is gone.
pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
    pub(crate) id: u64,
    pub(crate) wakeup: bool,
    pub(crate) error_mode: ErrorMode,
    /// Live workers, so a registration's teardown can progress them until its
    /// in-flight operations have completed.
    pub(crate) workers: RefCell<Vec<Weak<WorkerInner>>>,
    drop_errors: RefCell<Vec<Error>>,
    drop_errors_dropped: Cell<u64>,
}

impl ContextInner {
    /// Records an error that happened where it cannot be returned (a `Drop`).
    /// Never panics: a re-entrant record while the log is borrowed is counted.
    pub(crate) fn record(&self, err: Error) {
        match self.drop_errors.try_borrow_mut() {
            Ok(mut log) if log.len() < DROP_ERRORS_KEPT => log.push(err),
            _ => self
                .drop_errors_dropped
                .set(self.drop_errors_dropped.get().saturating_add(1)),
        }
    }

    /// Live workers of this context (pruning dead entries).
    pub(crate) fn live_workers(&self) -> Vec<Rc<WorkerInner>> {
        match self.workers.try_borrow_mut() {
            Ok(mut list) => {
                list.retain(|w| w.strong_count() > 0);
                list.iter().filter_map(Weak::upgrade).collect()
            }
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // Runs last: every worker, endpoint, rkey and registration holds an
        // `Rc<ContextInner>`, so all of them are already destroyed/unmapped.
        // SAFETY: `handle` came from a successful `ucp_init_version` and is
        // cleaned up exactly once, here; nothing refers to it any more.
        unsafe { result::context::cleanup(self.handle) };
    }
}

/// A UCP context (`ucp_context_h`) with the RMA and AM features: the root of
/// every UCX object. Cheap to clone (reference counted); `!Send` and `!Sync`, like
/// everything in this module — a context, its workers and endpoints live on
/// the one thread that drives UCX.
///
/// UCX reads its `UCX_*` environment variables (`UCX_TLS`,
/// `UCX_NET_DEVICES`, …) when the context is created.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Rc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &format_args!("{:#018x}", self.inner.id))
            .field("wakeup", &self.inner.wakeup)
            .finish()
    }
}

/// The runtime libucp version `(major, minor, release)`.
pub fn library_version() -> (u32, u32, u32) {
    result::context::get_version()
}

fn random_id() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No OS randomness: fall back to something unique within the host.
        let addr = ptr::from_ref(&b) as usize as u64;
        return u64::from(std::process::id()).rotate_left(32) ^ addr;
    }
    u64::from_le_bytes(b) | 1
}

pub(crate) fn new_id() -> u64 {
    random_id()
}

impl Context {
    /// A context with the default [`ContextConfig`] (RMA, AM and wakeup).
    pub fn new() -> Result<Self> {
        Self::with_config(&ContextConfig::default())
    }

    /// A context with explicit options. Fails with
    /// [`UcxReason::LibraryVersion`] when the runtime libucp is older than the
    /// 1.13 headers the bindings were generated from.
    pub fn with_config(config: &ContextConfig) -> Result<Self> {
        let (major, minor, _) = library_version();
        if (major, minor) < (sys::UCP_API_MAJOR, sys::UCP_API_MINOR) {
            return Err(Error::Refused {
                op: "ucp_init",
                reason: UcxReason::LibraryVersion {
                    found_major: major,
                    found_minor: minor,
                },
            });
        }
        // Released below, on every path.
        let ucp_config = result::context::config_read()?;
        for (name, value) in &config.overrides {
            let modified = match (CString::new(name.as_str()), CString::new(value.as_str())) {
                // SAFETY: live config from `ucp_config_read`, released only
                // below.
                (Ok(n), Ok(v)) => unsafe { result::context::config_modify(ucp_config, &n, &v) },
                // A NUL inside a name or value: what UCX says of a bad one.
                _ => result::check("ucp_config_modify", sys::UCS_ERR_INVALID_PARAM),
            };
            if let Err(e) = modified {
                // SAFETY: releases the config read above, exactly once.
                unsafe { result::context::config_release(ucp_config) };
                return Err(e);
            }
        }
        // RMA for the puts; AM for the small control messages
        // (`Endpoint::send_message`, `Worker::accept_messages`).
        let mut features = u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM);
        if config.wakeup {
            features |= u64::from(sys::UCP_FEATURE_WAKEUP);
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features,
            ..Default::default()
        };
        // SAFETY: `params` is a fully initialised `ucp_params_t` whose
        // field_mask names only `features`; `ucp_config` is the live config
        // read above.
        let created = unsafe { result::context::init(&params, ucp_config) };
        // SAFETY: the config came from `ucp_config_read` and is released
        // exactly once; `ucp_init_version` copied what it needed.
        unsafe { result::context::config_release(ucp_config) };
        let handle = created?;
        Ok(Self {
            inner: Rc::new(ContextInner {
                handle,
                id: random_id(),
                wakeup: config.wakeup,
                error_mode: config.error_mode,
                workers: RefCell::new(Vec::new()),
                drop_errors: RefCell::new(Vec::new()),
                drop_errors_dropped: Cell::new(0),
            }),
        })
    }

    /// The context's process-local random id (it travels inside worker
    /// addresses and rkeys, so an rkey is never unpacked for another peer).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Whether workers of this context have an event fd.
    pub fn has_wakeup(&self) -> bool {
        self.inner.wakeup
    }

    /// Takes the errors recorded by `Drop` implementations so far (an endpoint
    /// close that failed or timed out, an rkey whose flush failed, an unmap
    /// that failed), plus how many more were only counted. `Drop` never
    /// panics and never discards an error silently; this is where they go.
    pub fn take_drop_errors(&self) -> (Vec<Error>, u64) {
        let errors = self
            .inner
            .drop_errors
            .try_borrow_mut()
            .map(|mut log| std::mem::take(&mut *log))
            .unwrap_or_default();
        let dropped = self.inner.drop_errors_dropped.replace(0);
        (errors, dropped)
    }
}
