//! Bounded delivery windows: a sans-I/O core that decides when the next
//! chunk of a batch may be submitted (operations and bytes in flight are
//! capped; the window refills as operations finish), and a small driver that
//! runs it over any submit/complete pair (for example a runner's `deliver`
//! and `Runner::wait`).
//!
//! Failure rule: when a submission is refused, nothing more is submitted,
//! but every operation already accepted is drained to its terminal result
//! before the window reports itself finished — callers release claims and
//! reuse memory only then (the base path's guarantee: memory is held until
//! native completion).

use std::collections::VecDeque;

/// Limits of a window; 0 means unbounded. Off ([`WindowLimits::default`]):
/// every chunk is submitted at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowLimits {
    /// Operations in flight at most.
    pub max_ops: usize,
    /// Bytes in flight at most (a single chunk larger than this still goes,
    /// alone, so a window never stalls).
    pub max_bytes: u64,
}

/// Where a chunk stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkState {
    /// Not submitted yet.
    Waiting,
    /// Accepted, not terminal.
    InFlight,
    /// Terminal with this outcome.
    Done(bool),
    /// Submission refused.
    Refused,
    /// Never submitted because an earlier submission was refused.
    Skipped,
}

/// The window's state for one batch of chunks.
#[derive(Debug, Clone)]
pub struct DeliveryWindow {
    limits: WindowLimits,
    bytes: Vec<u64>,
    states: Vec<ChunkState>,
    waiting: VecDeque<usize>,
    ops_in_flight: usize,
    bytes_in_flight: u64,
    refused: bool,
}

impl DeliveryWindow {
    /// A window over chunks of the given sizes, submitted in order.
    pub fn new(chunk_bytes: Vec<u64>, limits: WindowLimits) -> Self {
        let n = chunk_bytes.len();
        Self {
            limits,
            bytes: chunk_bytes,
            states: vec![ChunkState::Waiting; n],
            waiting: (0..n).collect(),
            ops_in_flight: 0,
            bytes_in_flight: 0,
            refused: false,
        }
    }

    /// The next chunk to submit now, if the window has room (call again
    /// after each [`Self::accepted`] or [`Self::refused`]).
    pub fn next(&self) -> Option<usize> {
        if self.refused {
            return None;
        }
        let &chunk = self.waiting.front()?;
        let bytes = self.bytes.get(chunk).copied().unwrap_or(0);
        let ops_ok = self.limits.max_ops == 0 || self.ops_in_flight < self.limits.max_ops;
        let bytes_ok = self.limits.max_bytes == 0
            || self.ops_in_flight == 0
            || self.bytes_in_flight.saturating_add(bytes) <= self.limits.max_bytes;
        (ops_ok && bytes_ok).then_some(chunk)
    }

    /// `chunk` (from [`Self::next`]) was accepted.
    pub fn accepted(&mut self, chunk: usize) {
        if self.waiting.front() != Some(&chunk) {
            return;
        }
        self.waiting.pop_front();
        if let Some(s) = self.states.get_mut(chunk) {
            *s = ChunkState::InFlight;
        }
        self.ops_in_flight += 1;
        self.bytes_in_flight += self.bytes.get(chunk).copied().unwrap_or(0);
    }

    /// `chunk` (from [`Self::next`]) was refused: submit nothing more, drain
    /// what is in flight.
    pub fn refused(&mut self, chunk: usize) {
        if self.waiting.front() != Some(&chunk) {
            return;
        }
        self.waiting.pop_front();
        if let Some(s) = self.states.get_mut(chunk) {
            *s = ChunkState::Refused;
        }
        self.refused = true;
        for rest in self.waiting.drain(..) {
            if let Some(s) = self.states.get_mut(rest) {
                *s = ChunkState::Skipped;
            }
        }
    }

    /// An accepted chunk reached its terminal result.
    pub fn completed(&mut self, chunk: usize, ok: bool) {
        let Some(state) = self.states.get_mut(chunk) else {
            return;
        };
        if *state != ChunkState::InFlight {
            return;
        }
        *state = ChunkState::Done(ok);
        self.ops_in_flight -= 1;
        self.bytes_in_flight -= self.bytes.get(chunk).copied().unwrap_or(0);
    }

    /// Operations in flight.
    pub fn ops_in_flight(&self) -> usize {
        self.ops_in_flight
    }

    /// Bytes in flight.
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes_in_flight
    }

    /// Every chunk is terminal, refused or skipped: nothing accepted is still
    /// in flight, so claims may be released and memory reused.
    pub fn finished(&self) -> bool {
        self.ops_in_flight == 0 && self.waiting.is_empty()
    }

    /// Per chunk, where it stands.
    pub fn states(&self) -> &[ChunkState] {
        &self.states
    }
}

/// Runs `window`: submits chunks as it allows (`submit(chunk)` returns an
/// operation id or refuses), and feeds `wait()`'s terminal results
/// (`(op, ok)`) back until every accepted operation is terminal. `wait`
/// must block (bounded) and eventually report every accepted operation;
/// if it returns `None` (gave up), the driver stops and returns `false` —
/// the caller must then treat in-flight memory as still in use.
pub fn drive<Op: PartialEq + Copy>(
    window: &mut DeliveryWindow,
    mut submit: impl FnMut(usize) -> Option<Op>,
    mut wait: impl FnMut() -> Option<Vec<(Op, bool)>>,
) -> bool {
    let mut ops: Vec<(Op, usize)> = Vec::new();
    loop {
        while let Some(chunk) = window.next() {
            match submit(chunk) {
                Some(op) => {
                    window.accepted(chunk);
                    ops.push((op, chunk));
                }
                None => window.refused(chunk),
            }
        }
        if window.finished() {
            return true;
        }
        let Some(done) = wait() else {
            return false;
        };
        for (op, ok) in done {
            if let Some(pos) = ops.iter().position(|(o, _)| *o == op) {
                let (_, chunk) = ops.swap_remove(pos);
                window.completed(chunk, ok);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_limits_submit_everything_at_once() {
        let w = DeliveryWindow::new(vec![10; 5], WindowLimits::default());
        let mut w2 = w.clone();
        let mut n = 0;
        while let Some(c) = w2.next() {
            w2.accepted(c);
            n += 1;
        }
        assert_eq!(n, 5);
        assert_eq!(w2.ops_in_flight(), 5);
    }

    #[test]
    fn an_oversized_chunk_goes_alone_and_the_window_refills() {
        let limits = WindowLimits {
            max_ops: 0,
            max_bytes: 100,
        };
        let mut w = DeliveryWindow::new(vec![250, 60, 30, 20], limits);
        assert_eq!(w.next(), Some(0));
        w.accepted(0);
        assert_eq!(w.next(), None, "bytes full");
        w.completed(0, true);
        assert_eq!(w.next(), Some(1));
        w.accepted(1);
        assert_eq!(w.next(), Some(2));
        w.accepted(2);
        assert_eq!(w.next(), None, "60 + 30 + 20 > 100");
        w.completed(2, true);
        assert_eq!(w.next(), Some(3));
    }

    #[test]
    fn a_refusal_on_refill_drains_accepted_ops_before_finishing() {
        let limits = WindowLimits {
            max_ops: 2,
            max_bytes: 0,
        };
        let mut w = DeliveryWindow::new(vec![1; 5], limits);
        w.accepted(0);
        w.accepted(1);
        w.completed(0, true);
        assert_eq!(w.next(), Some(2));
        w.refused(2);
        assert_eq!(w.next(), None);
        assert!(!w.finished(), "chunk 1 is still in flight");
        w.completed(1, false);
        assert!(w.finished());
        assert_eq!(
            w.states(),
            &[
                ChunkState::Done(true),
                ChunkState::Done(false),
                ChunkState::Refused,
                ChunkState::Skipped,
                ChunkState::Skipped
            ]
        );
    }

    proptest! {
        /// Driven by a random completion order and random refusals, the
        /// window never exceeds its limits (but for one lone oversized chunk),
        /// submits nothing after a refusal, and finishes only with nothing in
        /// flight; every accepted chunk ends terminal.
        #[test]
        fn window_invariants(
            sizes in prop::collection::vec(1u64..50, 0..30),
            max_ops in 0usize..4,
            max_bytes in prop::sample::select(vec![0u64, 40, 100]),
            refuse_at in prop::option::of(0usize..30),
            picks in prop::collection::vec(any::<prop::sample::Index>(), 0..200),
        ) {
            let limits = WindowLimits { max_ops, max_bytes };
            let mut w = DeliveryWindow::new(sizes.clone(), limits);
            let mut submitted = 0usize;
            let mut in_flight: Vec<usize> = Vec::new();
            let mut picks = picks.into_iter();
            let mut refused_seen = false;
            loop {
                while let Some(c) = w.next() {
                    prop_assert!(!refused_seen);
                    if Some(submitted) == refuse_at {
                        w.refused(c);
                        refused_seen = true;
                    } else {
                        w.accepted(c);
                        in_flight.push(c);
                    }
                    submitted += 1;
                    if max_ops > 0 { prop_assert!(w.ops_in_flight() <= max_ops); }
                    if max_bytes > 0 && w.ops_in_flight() > 1 {
                        prop_assert!(w.bytes_in_flight() <= max_bytes);
                    }
                }
                if w.finished() {
                    prop_assert!(in_flight.is_empty());
                    break;
                }
                prop_assert!(!in_flight.is_empty(), "stalled with nothing in flight");
                let i = picks.next().map_or(0, |p| p.index(in_flight.len()));
                let c = in_flight.swap_remove(i);
                w.completed(c, !c.is_multiple_of(3));
            }
            for s in w.states() {
                prop_assert!(!matches!(s, ChunkState::InFlight | ChunkState::Waiting));
            }
        }
    }
}

/// What a windowed deliver did.
#[derive(Debug, Clone, Default)]
pub struct WindowedDeliver {
    /// Per chunk: its operation's result (`None`: refused or skipped).
    pub results: Vec<Option<kvcr_foundation::runner::OpResult>>,
    /// Per chunk: where it ended.
    pub states: Vec<ChunkState>,
    /// The refusal, if a submission was refused.
    pub refusal: Option<kvcr_foundation::runner::Error>,
}

/// Delivers `chunks` (each one `deliver` operation of `chunk_bytes[i]`
/// bytes) through a window over `runner`: at most `limits` in flight, refilled
/// as operations complete. A refused submission stops the refill; every
/// accepted operation is still waited for (the runner's operation deadline
/// bounds the wait) before this returns.
pub fn deliver_windowed(
    runner: &kvcr_foundation::runner::Runner,
    chunks: Vec<Vec<kvcr_foundation::runner::DeliverEntry>>,
    chunk_bytes: Vec<u64>,
    limits: WindowLimits,
    request: Option<&kvcr_foundation::hint::RequestId>,
) -> WindowedDeliver {
    let n = chunks.len();
    let mut window = DeliveryWindow::new(chunk_bytes, limits);
    let mut chunks: Vec<Option<_>> = chunks.into_iter().map(Some).collect();
    let mut out = WindowedDeliver {
        results: vec![None; n],
        ..WindowedDeliver::default()
    };
    let by_op = std::cell::RefCell::new(Vec::<(kvcr_foundation::protocol::OpHandle, usize)>::new());
    let results = std::cell::RefCell::new(&mut out.results);
    let mut refusal = None;
    drive(
        &mut window,
        |chunk| {
            let entries = chunks.get_mut(chunk)?.take()?;
            let submitted = match request {
                Some(q) => runner.hints().deliver(q, entries),
                None => runner.deliver(entries),
            };
            match submitted {
                Ok(op) => {
                    by_op.borrow_mut().push((op, chunk));
                    Some(op)
                }
                Err(e) => {
                    refusal = Some(e);
                    None
                }
            }
        },
        || {
            // Block (bounded) on the oldest operation in flight, then take
            // whichever others have finished too; other callers' operations
            // are never touched.
            let in_flight: Vec<_> = by_op.borrow().iter().map(|(op, _)| *op).collect();
            let mut finished = Vec::new();
            for (i, op) in in_flight.into_iter().enumerate() {
                let budget = if i == 0 {
                    std::time::Duration::from_millis(100)
                } else {
                    std::time::Duration::ZERO
                };
                let result = match runner.wait(op, budget) {
                    Ok(Some(result)) => result,
                    Ok(None) => continue,
                    // Taken by someone else: the window cannot account for
                    // it, so it gives up (memory treated as still in use).
                    Err(_) => return None,
                };
                let found = by_op.borrow().iter().position(|(o, _)| *o == op);
                if let Some(pos) = found {
                    let (op, chunk) = by_op.borrow_mut().swap_remove(pos);
                    let ok = result.entries.iter().all(|(_, e)| e.is_success());
                    if let Some(slot) = results.borrow_mut().get_mut(chunk) {
                        *slot = Some(result);
                    }
                    finished.push((op, ok));
                }
            }
            Some(finished)
        },
    );
    out.states = window.states().to_vec();
    out.refusal = refusal;
    out
}
