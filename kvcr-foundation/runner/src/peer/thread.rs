//! The peer thread's loop: progress the UCX worker, take what arrived
//! (write messages, doorbells, mailbox requests, data stream frames),
//! issue puts, drain the queues, and pace itself: spin while a transfer
//! moves, nap between progress rounds when it stalls, linger after activity,
//! and sleep on its events when idle. Ticks the core's deadlines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use kvcr_contracts::incarnation::Incarnation;

use super::streams::streams_ready;
use super::waits::{ACTIVE_SPIN, LINGER, SPIN_BEFORE_NAP, peek_waits, wait_on_transfer};
use super::{Adopted, PeerCmd, PeerSetup, State};
use crate::config::PeerOptions;
use crate::contention;
use crate::error::{Error, Result, RunnerReason};
use crate::net::ControlStats;
use crate::net::stream::OutStream;
use crate::shared::Shared;
use kvcr_sys::placement::PoolMemory;

pub(super) type SetupResult = Result<(PeerSetup, Arc<ControlStats>)>;

/// Pool sizes, whether to pre-fault, how to back them, and what a guard
/// handed over instead.
pub(super) type PoolSpec = (
    Vec<u64>,
    bool,
    PoolMemory,
    Option<Adopted>,
    Arc<kvcr_sys::MemoryRegistry>,
);

/// The thread: builds its state, reports it up, serves until stopped.
pub(super) fn run(
    options: PeerOptions,
    incarnation: Incarnation,
    (pool_bytes, prefault, pool_memory, adopted, memory): PoolSpec,
    rx: mpsc::UnboundedReceiver<PeerCmd>,
    setup_tx: std::sync::mpsc::Sender<SetupResult>,
    shared_rx: oneshot::Receiver<Arc<Shared>>,
) {
    kvcr_sys::thread::precise_timer_slack();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(_) => {
            let _ = setup_tx.send(Err(Error::runner(RunnerReason::Config {
                field: "peer",
                why: "could not start the peer runtime",
            })));
            return;
        }
    };
    runtime.block_on(async move {
        let mut state = match State::setup(
            &options,
            incarnation,
            &pool_bytes,
            prefault,
            &pool_memory,
            adopted,
            memory,
        )
        .await
        {
            Ok((state, setup)) => {
                let stats = Arc::clone(&state.control.stats);
                let _ = setup_tx.send(Ok((setup, stats)));
                state
            }
            Err(e) => {
                let _ = setup_tx.send(Err(e));
                return;
            }
        };
        let Ok(shared) = shared_rx.await else {
            return; // startup failed later; dropping `state` releases everything
        };
        let leak = state.serve(&shared, rx).await;
        if leak {
            // A remote write may still land in our pools: keep every UCX
            // object (and so the mapping) alive until the process exits.
            std::mem::forget(state);
        } else {
            state.drain_worker();
        }
    });
}

/// What a tick found of a stall this process is recovering from.
struct StallTurn {
    /// A new stall's length (ns), reported once.
    new_gap_ns: Option<u64>,
    /// Its waiting requests have had their time: close their sessions.
    drained: bool,
}

/// Rounds of [`State::drain_queued`] in one turn at most.
const DRAIN_ROUNDS: usize = 4;

/// Commands a drain handles between flushes of what they sent (after the
/// first, which leaves at once).
const FLUSH_EVERY_COMMANDS: usize = 16;

/// Why [`State::sleep_on_events`] returned.
enum Woken {
    /// A UCX event, events already pending, or nothing to note: go round
    /// and progress.
    Event,
    /// A command, control message or lane report was handled.
    Activity,
    /// The nap ended: the core's deadline may be due.
    Deadline,
    /// A command or a closed channel stops the thread (`leak`).
    Stop(bool),
}

impl State {
    /// The main loop; returns whether the memory must be leaked.
    // The driver reads the clock (activity, ticks); the core never does.
    #[allow(clippy::disallowed_methods)]
    async fn serve(
        &mut self,
        shared: &Arc<Shared>,
        mut rx: mpsc::UnboundedReceiver<PeerCmd>,
    ) -> bool {
        const TICK: Duration = Duration::from_millis(1);
        #[allow(clippy::disallowed_methods)]
        let mut last_tick = Instant::now();
        let mut last_progress = last_tick;
        let mut last_activity = last_tick;
        let mut deadline_due = false;
        let linger = LINGER;
        // (writes into us may be under way, a reply to us is awaited)
        let mut waits = (false, false);
        loop {
            // Progress whenever a UCX transfer may be moving in either
            // direction: our own puts, or puts into us from a source that
            // did not map our pools (UCX 1.13 does not finish a large put
            // into private memory over shared memory, nor wire up a new
            // endpoint, unless our worker progresses too, and it does not
            // reliably signal the event fd for it). One-copy writes into us
            // need nothing from us; our own run on the lanes.
            let peeked = peek_waits(shared, &mut waits);
            let (into_us, awaiting_reply) = waits;
            let busy = !self.pending.is_empty()
                || into_us
                || self.out_streams.values().any(OutStream::wants_write);
            let mut progressed = self.progress_worker(shared);
            #[allow(clippy::disallowed_methods)]
            if progressed || !busy {
                last_progress = Instant::now();
            }
            if !self.pending.is_empty() {
                self.issue_and_reap(shared);
            }
            if self.pump_streams(shared) {
                progressed = true;
                last_progress = Instant::now();
            }
            // A source may have rung for a write into us: a look at the
            // watched slots costs a load each, and a record taken here
            // saves waiting for its `write_done` to come through the socket.
            if self.doorbell.awaiting() {
                self.take_doorbells(shared);
            }
            // A target whose doorbell file we map may have posted a request
            // to our mailbox: taken here, it skips the socket, the
            // session task and the hop from it to this loop (~12 µs of a
            // one-block restore's fixed path on the H200 host, traced).
            if self.take_requests(shared) {
                progressed = true;
                #[allow(clippy::disallowed_methods)]
                {
                    last_progress = Instant::now();
                }
                // Its write starts now, not a turn later.
                if let Err(leak) = self.drain_queued(&mut rx, shared) {
                    return leak;
                }
            }
            if busy {
                // A transfer is moving: take whatever is queued without
                // waiting, let the socket tasks run, and come straight back
                // to progress the worker (a timer would cost a millisecond
                // per turn).
                // The linger counts from the end of a transfer, not from the
                // request that started it: a 1 MiB put over tcp (~330 µs
                // here, traced) outlasts the 200 µs linger, so the source went
                // to sleep the moment its put ended, and a next request
                // within the linger paid a wake-up (a `start_write` reached a
                // sleeping source in 50–70 µs, an awake one in 11 µs).
                let drained = match self.drain_queued(&mut rx, shared) {
                    Ok(drained) => drained,
                    Err(leak) => return leak,
                };
                // The turn's work is done (issuing a 1 MiB put over tcp
                // writes to the socket for a few hundred µs): what follows
                // is waiting, and only that is timed for `contention`.
                #[allow(clippy::disallowed_methods)]
                let wait_began = Instant::now();
                last_activity = wait_began;
                wait_on_transfer(wait_began, last_progress, progressed, drained).await;
            } else if !peeked
                || (last_activity.elapsed() < if awaiting_reply { ACTIVE_SPIN } else { linger }
                    && !contention::contended())
            {
                // Our request is out and its reply is due within a round
                // trip, or we just served one and the next is likely close
                // behind (engines restore in bursts); waking a sleeping
                // thread costs 20–40 µs per hop on a virtual machine's idle
                // vCPU (traced: 3 of a one-block fetch's 190 µs were such
                // wake-ups). Stay awake for a bounded moment, yielding to
                // the socket tasks and to other threads (on a small machine
                // the engine's own thread may need this CPU). Not while the
                // host's CPUs are contended: there a yield gives another
                // process a whole time slice, and a thread sleeping on its
                // events is woken ahead of it (see `contention`).
                match self.drain_queued(&mut rx, shared) {
                    Ok(true) => last_activity = Instant::now(),
                    Ok(false) => {}
                    Err(leak) => return leak,
                }
                contention::yield_cpu();
                tokio::task::yield_now().await;
            } else {
                // Idle as far as UCX goes: sleep until a command, a control
                // message, a lane's report, a UCX event (the armed worker
                // fd: e.g. TCP writes into us) or the core's next deadline.
                match self
                    .sleep_on_events(&mut rx, shared, MAX_IDLE_NAP, progressed)
                    .await
                {
                    Woken::Event => {}
                    Woken::Activity => {
                        last_activity = Instant::now();
                        // What queued behind the command that woke us goes
                        // in this turn too: a turn per command cost a
                        // contended host ~130 µs each, and a restore's 453
                        // `start_write`s left over 57 ms (traced, 2 vCPUs).
                        if let Err(leak) = self.drain_queued(&mut rx, shared) {
                            return leak;
                        }
                    }
                    Woken::Deadline => deadline_due = true,
                    Woken::Stop(leak) => return leak,
                }
            }
            // Whatever this turn sent leaves now, one write per peer,
            // rather than after a hop through each session's task; its
            // one-hop writes go to their thread together.
            self.control.flush();
            self.one_hop.flush();
            // At most every millisecond while busy; at once when a sleep
            // ended at the core's deadline (so a due deadline never spins).
            // Taken only if the core's lock is free (see `tick`); a tick
            // that finds it held is due again next turn.
            if (deadline_due || last_tick.elapsed() >= TICK) && self.tick(shared) {
                deadline_due = false;
                last_tick = Instant::now();
            }
        }
    }

    /// Progresses the worker until it finds nothing, taking the write
    /// messages after every call (a write's parts can outnumber what the
    /// worker holds at once). `true`: it progressed.
    fn progress_worker(&mut self, shared: &Arc<Shared>) -> bool {
        let mut progressed = false;
        while self.worker.progress() > 0 {
            progressed = true;
            let (nonces, writes) = self
                .worker
                .take_messages()
                .into_iter()
                .partition::<Vec<_>, _>(super::proofs::is_nonce);
            for nonce in &nonces {
                self.answer_nonce(nonce);
            }
            self.take_write_messages(shared, writes);
        }
        progressed
    }

    /// The core's tick (deadlines); our doorbell forgets the operations
    /// that ended without a reply; a stall of this process is recovered
    /// from. Only if the core's lock is free now (`false` otherwise): the
    /// thread holding it hands us work, which a turn blocked here would
    /// leave unsent (see [`Shared::try_with_core_now`]).
    fn tick(&mut self, shared: &Arc<Shared>) -> bool {
        self.expire_unproven(shared);
        let doorbell = &mut self.doorbell;
        let ticked = shared.try_with_core_now(|core, now| {
            core.handle_tick(now);
            // Operations that ended without a reply (deadlines).
            doorbell.retain(|op| core.peer_awaits_reply(op));
            core.peer_stalled().then(|| StallTurn {
                new_gap_ns: core.take_peer_stall(),
                drained: core.peer_stall_drained(now),
            })
        });
        let Some(stall) = ticked else {
            return false;
        };
        if let Some(stall) = stall {
            self.recover_from_stall(shared, stall);
        }
        true
    }

    /// After a stall of this process past an operation timeout (stopped,
    /// starved), the core refuses every `start_write`: one that waited in a
    /// socket meanwhile must not be served with a fresh deadline. Once what
    /// waited has been read and refused (`drained`), the accepted sessions
    /// open at the stall are closed, and once each has ended (so nothing
    /// it brought is still to be handled) the core serves again: a target
    /// re-dials, and its requests on the new session were sent after the
    /// stall. Said once on stderr and counted (`PeerCounters::stalls`).
    fn recover_from_stall(&mut self, shared: &Arc<Shared>, stall: StallTurn) {
        if let Some(gap_ns) = stall.new_gap_ns {
            eprintln!(
                "kvcr: this runner had no peer turn for {} ms (past its operation timeout): \
                 refusing the writes asked meanwhile, closing the sessions they came on, \
                 then serving again",
                gap_ns / 1_000_000
            );
            self.control.note_stall();
        }
        if stall.drained {
            self.control.retire_stalled();
        }
        if self.control.retired() {
            shared.with_core_now(|core, _| core.end_peer_stall());
        }
    }

    /// Sleeps until a command, a control message, a lane's report, a UCX
    /// event (the armed worker fd) or the core's next deadline, at most
    /// `cap`; returns at once if UCX has events pending (the caller goes
    /// round and progresses), unless it has said so for [`SPIN_BEFORE_NAP`]
    /// while `progressed` (this turn's progress) found nothing: then it naps
    /// [`UNARMABLE_NAP`] on the rest.
    async fn sleep_on_events(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PeerCmd>,
        shared: &Arc<Shared>,
        mut cap: Duration,
        progressed: bool,
    ) -> Woken {
        if progressed {
            self.unarmable_since = None;
        }
        let armed = match self.worker.arm() {
            Ok(true) => {
                self.unarmable_since = None;
                true
            }
            // Events are pending: progress them before sleeping. UCX 1.13
            // also says so, for good, while it holds sends it cannot make
            // (wire-up to a same-host peer whose queue is full and never
            // drains: a member that advertised a worker it never
            // progresses); progress then finds nothing, and going straight
            // round spun this thread at a whole core and never took the
            // stop command (the runner's drop hung). So after a short
            // spin, nap on everything else and retry UCX after it.
            Ok(false) if self.efd.is_some() => {
                #[allow(clippy::disallowed_methods)]
                let since = *self.unarmable_since.get_or_insert_with(Instant::now);
                if progressed || since.elapsed() < SPIN_BEFORE_NAP {
                    return Woken::Event;
                }
                cap = cap.min(UNARMABLE_NAP);
                false
            }
            // No event fd (or arming failed): sleep on the rest.
            Ok(false) | Err(_) => false,
        };
        let efd = self.efd.as_ref().filter(|_| armed);
        // Never blocked on the core's lock: a caller holding it is about to
        // hand us work (its actions wake us), and a nap of a tick covers
        // the deadline we could not read.
        let nap = shared
            .try_with_core_now(|core, now| {
                core.peer_wake_at()
                    .map_or(cap, |at| Duration::from_nanos(at.saturating_sub(now)))
            })
            .unwrap_or(BUSY_CORE_NAP)
            .min(cap);
        tokio::select! {
            biased;
            ready = async {
                match efd {
                    Some(fd) => fd.readable().await.map(|mut g| g.clear_ready()),
                    None => std::future::pending().await,
                }
            }, if armed => {
                let _ = ready;
                Woken::Event
            }
            cmd = rx.recv() => match cmd {
                Some(cmd) => match self.command(cmd, shared) {
                    Some(leak) => Woken::Stop(leak),
                    None => Woken::Activity,
                },
                None => Woken::Stop(false),
            },
            // Before the writes' ends: a write's lead report goes out
            // ahead of its `write_done`.
            lead = self.leads_landed.recv() => match lead {
                Some(write) => {
                    shared.with_core_now(|core, _| core.handle_put_lead_landed(write));
                    Woken::Activity
                }
                None => Woken::Event,
            },
            // Before the control messages, as the writes' ends are.
            found = self.device_checked.recv() => match found {
                Some(found) => {
                    self.hand_device_checks(shared, found);
                    Woken::Activity
                }
                None => Woken::Event,
            },
            // Before the control messages: a flood of them must not
            // starve a finished write (the select is biased).
            done = self.lane_done.recv() => match done {
                Some(done) => {
                    self.copied(shared, done);
                    Woken::Activity
                }
                None => Woken::Event,
            },
            item = self.inbound.recv() => match item {
                Some(item) => {
                    self.on_inbound(item, shared);
                    self.submit_device_landings();
                    Woken::Activity
                }
                None => Woken::Event,
            },
            Some(dialed) = self.streams_dialed.recv() => {
                self.stream_dialed(dialed);
                Woken::Activity
            },
            // Bytes on a data stream, or room for a frame that waits.
            () = std::future::poll_fn(|cx| streams_ready(&self.in_streams, &self.out_streams, cx)) => {
                Woken::Event
            },
            () = tokio::time::sleep(nap) => Woken::Deadline,
        }
    }

    /// Progresses the worker until it has been quiet for [`DRAIN_QUIET`]
    /// (at most [`DRAIN_MAX`]) before it is destroyed: UCX 1.13 asserts in
    /// `ucp_worker_destroy` when a wire-up reply to a peer that connected
    /// just before the stop is still queued (seen once in CI), and
    /// progressing sends it.
    pub(super) fn drain_worker(&self) {
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        let mut quiet_since = start;
        while start.elapsed() < DRAIN_MAX {
            if self.worker.progress() > 0 {
                #[allow(clippy::disallowed_methods)]
                {
                    quiet_since = Instant::now();
                }
            } else if quiet_since.elapsed() >= DRAIN_QUIET {
                return;
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Takes whatever is queued (commands, control messages, lane reports)
    /// without waiting, until nothing is: what handling one queues (a
    /// control message's actions come back as commands) runs in this turn,
    /// not the next. `Ok(any)`, or `Err(leak)` to stop.
    fn drain_queued(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PeerCmd>,
        shared: &Arc<Shared>,
    ) -> std::result::Result<bool, bool> {
        let mut any = false;
        // Bounded: a flood of control messages must not keep this turn
        // from progressing the worker (the inbound budget paces them).
        let mut commands = 0usize;
        for _ in 0..DRAIN_ROUNDS {
            let mut more = self.run_commands(rx, shared, &mut commands)?;
            while let Ok(write) = self.leads_landed.try_recv() {
                more = true;
                crate::timeline::mark("lead_to_core", write);
                shared.with_core_now(|core, _| core.handle_put_lead_landed(write));
            }
            while let Ok(done) = self.lane_done.try_recv() {
                more = true;
                self.copied(shared, done);
            }
            while let Ok(found) = self.device_checked.try_recv() {
                more = true;
                self.hand_device_checks(shared, found);
            }
            // Each message's actions run before the next message is
            // handled: a backlog of a restore's `start_write`s (115 read
            // at once, ~20 µs each on the H100 host's source) had every
            // write wait for the whole backlog's checks before its copy
            // was planned, 2.5 ms at the end of the restore (traced).
            while let Ok(item) = self.inbound.try_recv() {
                more = true;
                self.on_inbound(item, shared);
                self.run_commands(rx, shared, &mut commands)?;
            }
            // The one-hop completions that came together are hashed
            // together (a page takes one warp ~8 ms; a batch, about as long).
            self.submit_device_landings();
            while let Ok(dialed) = self.streams_dialed.try_recv() {
                more = true;
                self.stream_dialed(dialed);
            }
            any |= more;
            if !more {
                break;
            }
        }
        // Before this turn yields: what it sent leaves now, and the
        // one-hop writes it queued go to their thread together.
        self.control.flush();
        self.one_hop.flush();
        Ok(any)
    }

    /// Runs the queued commands (engine requests, the core's actions)
    /// without waiting, until none is left; `commands` counts them across
    /// the drain. `Ok(any ran)`, or `Err(leak)` to stop.
    fn run_commands(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PeerCmd>,
        shared: &Arc<Shared>,
        commands: &mut usize,
    ) -> std::result::Result<bool, bool> {
        let mut any = false;
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    any = true;
                    if let Some(leak) = self.command(cmd, shared) {
                        return Err(leak);
                    }
                    // A long queue (a restore's hundreds of `start_write`s)
                    // leaves as it is sealed, not all at its end: the first
                    // at once, then every `FLUSH_EVERY_COMMANDS`, so the
                    // peer starts on them while the rest are sealed (453
                    // took 1.9–3.4 ms to seal on the H100 hosts, traced).
                    *commands += 1;
                    if *commands == 1 || commands.is_multiple_of(FLUSH_EVERY_COMMANDS) {
                        self.control.flush();
                    }
                }
                Err(mpsc::error::TryRecvError::Empty) => return Ok(any),
                Err(mpsc::error::TryRecvError::Disconnected) => return Err(false),
            }
        }
    }
}

/// A stopping worker is destroyed once it made no progress for this long.
const DRAIN_QUIET: Duration = Duration::from_millis(2);
/// The most a stop waits for a busy worker to go quiet.
const DRAIN_MAX: Duration = Duration::from_millis(100);

/// The longest idle sleep: a backstop only (the core's wake time is always
/// sooner while anything is pending).
const MAX_IDLE_NAP: Duration = Duration::from_secs(1);

/// How long the idle peer thread naps between retries while its worker
/// cannot be armed and progress finds nothing (see `sleep_on_events`).
const UNARMABLE_NAP: Duration = Duration::from_millis(1);

/// The nap when the core's lock was held as the thread went to sleep (its
/// next deadline unread): a tick, after which it looks again.
const BUSY_CORE_NAP: Duration = Duration::from_millis(1);
