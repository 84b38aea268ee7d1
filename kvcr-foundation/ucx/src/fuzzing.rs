//! Process-level setup for fuzz targets that load UCX (feature `fuzzing`;
//! fuzz targets only): [`fuzz_process_setup!`](crate::fuzz_process_setup)
//! turns UCX's memory hooks off before libucs loads and suppresses UCX's own
//! leaks, so a target needs no `unsafe` of its own.
//!
//! Why: UCX's memory hooks patch `mmap`/`munmap` in place ("bistro" mode)
//! while libucs loads, and the patch does not survive AddressSanitizer's
//! interceptors (a wild jump before `main`). UCX reads the switch
//! (`UCX_MEM_EVENTS`) from the environment in its library constructor, which
//! runs before any code of the binary but one: `.preinit_array`, which the
//! loader calls first, with `(argc, argv, envp)`. libc is not initialised
//! yet there (a `setenv` would be lost), so when the switch is unset the
//! process executes itself again with `UCX_MEM_EVENTS=no` added; nothing has
//! run yet that could notice (its log level goes to `fatal` too, unless set:
//! refused connects are the common case in a fuzz target, and UCX would log
//! each). An explicit `UCX_MEM_EVENTS` in the environment wins.

use std::ffi::{CStr, c_char, c_int};

/// The `.preinit_array` entry [`fuzz_process_setup!`](crate::fuzz_process_setup)
/// installs: re-executes the process with `UCX_MEM_EVENTS=no` (and
/// `UCX_LOG_LEVEL=fatal` unless set) when `UCX_MEM_EVENTS` is unset.
///
/// # Safety
///
/// Called only by the loader, from `.preinit_array`, with the process's
/// NULL-terminated vectors of NUL-terminated argument and environment
/// strings.
pub unsafe extern "C" fn memory_hooks_off_preinit(
    _argc: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) {
    const SWITCH: &[u8] = b"UCX_MEM_EVENTS=";
    let mut env: Vec<*const c_char> = Vec::new();
    let mut at = envp;
    // SAFETY: `envp` is the loader's NULL-terminated vector of NUL-terminated
    // strings, alive for the whole process.
    unsafe {
        while !at.is_null() && !(*at).is_null() {
            if CStr::from_ptr(*at).to_bytes().starts_with(SWITCH) {
                return;
            }
            env.push(*at);
            at = at.add(1);
        }
    }
    env.push(c"UCX_MEM_EVENTS=no".as_ptr());
    if !env.iter().any(|v| {
        // SAFETY: every entry so far is one of `envp`'s strings.
        unsafe { CStr::from_ptr(*v) }
            .to_bytes()
            .starts_with(b"UCX_LOG_LEVEL=")
    }) {
        env.push(c"UCX_LOG_LEVEL=fatal".as_ptr());
    }
    env.push(std::ptr::null());
    // SAFETY: `argv` is the loader's vector; `env` is NULL-terminated and
    // outlives the call. On failure the process simply goes on.
    unsafe { libc::execve(c"/proc/self/exe".as_ptr(), argv, env.as_ptr()) };
}

/// LeakSanitizer's suppressions for UCX: its own allocations that outlive a
/// refused or failed connect (inside libuct/libucp/libucs, freed with the
/// worker or never) are not a fuzz target's findings; anything leaked from
/// Rust code still is.
pub const LSAN_SUPPRESSIONS: &CStr = c"leak:libuct.so\nleak:libucp.so\nleak:libucs.so\n";

/// Installs, in the fuzz target that invokes it (once, at its root), the
/// `.preinit_array` entry [`fuzzing::memory_hooks_off_preinit`](crate::fuzzing::memory_hooks_off_preinit)
/// and the `__lsan_default_suppressions` hook answering
/// [`fuzzing::LSAN_SUPPRESSIONS`](crate::fuzzing::LSAN_SUPPRESSIONS). Both
/// must be items of the binary itself: the loader and LeakSanitizer find
/// them by section and by symbol.
#[macro_export]
macro_rules! fuzz_process_setup {
    () => {
        #[used]
        #[unsafe(link_section = ".preinit_array")]
        static UCX_MEMORY_HOOKS_OFF: unsafe extern "C" fn(
            ::std::ffi::c_int,
            *const *const ::std::ffi::c_char,
            *const *const ::std::ffi::c_char,
        ) = $crate::fuzzing::memory_hooks_off_preinit;

        /// UCX's leaks are not this target's findings (see
        /// `kvcr_ucx::fuzzing::LSAN_SUPPRESSIONS`).
        #[unsafe(no_mangle)]
        pub extern "C" fn __lsan_default_suppressions() -> *const ::std::ffi::c_char {
            $crate::fuzzing::LSAN_SUPPRESSIONS.as_ptr()
        }
    };
}
