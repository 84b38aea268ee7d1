//! An opt-in timeline of the peer path's steps: where a restore's time
//! goes between the processes that serve it, read on the host that runs
//! them (the one-hop route's first layer crosses a destination's deliver,
//! the control channel, a source's write handling, its copy passes and
//! the reports back; no counter says which of them it waited on).
//!
//! Off unless the environment names a folder in `KVCR_TIMELINE` when a
//! runner first asks; then each [`mark`] keeps `(time, what, n)` in a
//! process-wide buffer of at most [`MAX_MARKS`] (marks past it are
//! counted, not kept), and [`write()`] appends them to
//! `<folder>/timeline-<pid>.txt`. Times are wall-clock nanoseconds
//! (the Unix epoch), taken as one reading of the wall clock when the
//! timeline starts plus this process's monotonic clock since: processes
//! on one host line up to the clock's resolution, and a clock step while
//! running shifts nothing. Off, a mark costs one atomic load.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Marks one process keeps between writes; about 1.5 MiB.
pub const MAX_MARKS: usize = 1 << 16;

/// The environment variable naming the folder timelines are written to.
pub const TIMELINE_ENV: &str = "KVCR_TIMELINE";

/// Not yet looked at, off, on.
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static TIMELINE: OnceLock<Timeline> = OnceLock::new();

struct Timeline {
    folder: PathBuf,
    /// The wall clock (ns since the epoch) when `began` was read.
    wall_ns: u64,
    began: Instant,
    marks: Mutex<Marks>,
}

#[derive(Default)]
struct Marks {
    kept: Vec<(u64, &'static str, u64)>,
    dropped: u64,
}

/// Whether marks are kept (the environment named a folder).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => start(),
    }
}

/// Reads the environment once; `true` if the timeline is on.
fn start() -> bool {
    start_in(std::env::var_os(TIMELINE_ENV).map(PathBuf::from))
}

/// Turns the timeline on, writing to `folder`, if that is a folder; off
/// otherwise. `true` if on.
fn start_in(folder: Option<PathBuf>) -> bool {
    let on = folder.is_some_and(|folder| {
        // The clock source of a diagnostic; never a core's time.
        #[allow(clippy::disallowed_methods)]
        let (wall, began) = (SystemTime::now(), Instant::now());
        let wall_ns = wall
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        folder.is_dir() && {
            TIMELINE.get_or_init(|| Timeline {
                folder,
                wall_ns,
                began,
                marks: Mutex::new(Marks::default()),
            });
            true
        }
    });
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
    on
}

/// Keeps `(now, what, n)` if the timeline is on.
pub fn mark(what: &'static str, n: u64) {
    if !enabled() {
        return;
    }
    let Some(timeline) = TIMELINE.get() else {
        return;
    };
    let since = u64::try_from(timeline.began.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let at = timeline.wall_ns.saturating_add(since);
    let mut marks = timeline
        .marks
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if marks.kept.len() < MAX_MARKS {
        marks.kept.push((at, what, n));
    } else {
        marks.dropped += 1;
    }
}

/// Appends the marks kept so far to `<folder>/timeline-<pid>.txt`, one
/// `<ns> <what> <n>` line each (then `dropped <count>` if any were), and
/// forgets them. Nothing when the timeline is off.
///
/// # Errors
/// The file could not be opened or written.
pub fn write() -> std::io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    let Some(timeline) = TIMELINE.get() else {
        return Ok(());
    };
    let taken = std::mem::take(
        &mut *timeline
            .marks
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    let path = timeline
        .folder
        .join(format!("timeline-{}.txt", std::process::id()));
    let mut file = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?,
    );
    for (at, what, n) in &taken.kept {
        writeln!(file, "{at} {what} {n}")?;
    }
    if taken.dropped > 0 {
        writeln!(file, "dropped {}", taken.dropped)?;
    }
    file.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(folder: &std::path::Path) -> String {
        let name = format!("timeline-{}.txt", std::process::id());
        std::fs::read_to_string(folder.join(name)).unwrap_or_default()
    }

    /// The one test that turns the timeline on (its state is the
    /// process's, and other tests of this process may mark meanwhile: only
    /// this test's names are looked at): marks come back in order, stamped
    /// within the wall-clock bounds of the test, and once written are
    /// forgotten.
    #[test]
    fn marks_are_written_in_order_with_wall_clock_times() {
        let folder = std::env::temp_dir().join(format!("kvcr-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let wall = || {
            #[allow(clippy::disallowed_methods)]
            let now = SystemTime::now();
            now.duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
        };
        let before = wall();
        assert!(start_in(Some(folder.clone())));
        assert!(enabled());
        mark("timeline-test-first", 1);
        mark("timeline-test-second", 2);
        write().unwrap();
        let after = wall();
        let text = read(&folder);
        let lines: Vec<(u64, String, u64)> = text
            .lines()
            .map(|l| {
                let mut it = l.split(' ');
                (
                    it.next().unwrap().parse().unwrap(),
                    it.next().unwrap().to_owned(),
                    it.next().unwrap().parse().unwrap(),
                )
            })
            .filter(|l| l.1.starts_with("timeline-test-"))
            .collect();
        let named: Vec<(&str, u64)> = lines.iter().map(|l| (l.1.as_str(), l.2)).collect();
        assert_eq!(
            named,
            [("timeline-test-first", 1), ("timeline-test-second", 2)]
        );
        // A margin of 1 ms for the two clocks' readings.
        let bounds = before - 1_000_000..=after + 1_000_000;
        assert!(lines.iter().all(|l| bounds.contains(&l.0)), "{lines:?}");
        assert!(lines[0].0 <= lines[1].0);
        write().unwrap();
        let again = read(&folder);
        let repeated = again.matches("timeline-test-").count();
        assert_eq!(repeated, 2, "written marks are forgotten: {again}");
        std::fs::remove_dir_all(&folder).unwrap();
    }
}
