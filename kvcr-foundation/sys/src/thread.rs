//! Knobs of the calling thread: its timer slack and its priority. Best
//! effort both: a refusal leaves the thread as it was.

/// Cuts the calling thread's timer slack to 1 µs (Linux default: 50 µs), so
/// a short sleep lasts about what it says. Best effort: on failure sleeps
/// are just longer.
pub fn precise_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only
    // the calling thread's timer slack; no memory is passed.
    let _ = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
}

/// Lowers the calling thread to the weakest nice level (best effort): it
/// then takes ~1.5 % of a CPU others want, and all of one nobody wants.
/// Not `SCHED_IDLE`: a thread starved in the middle of a step would hold
/// the memory-map lock (see [`crate::segment::PeerSegment`]'s background
/// populator) for as long as the host stays busy.
pub fn lowest_priority() {
    // SAFETY: plain integer arguments; `who` 0 with PRIO_PROCESS is the
    // calling thread on Linux.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
}
