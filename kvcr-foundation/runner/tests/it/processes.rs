//! What the tests across processes (`one_hop`, `peer_faults`) share: the
//! bound on each of their waits, the bounded waits themselves, and the
//! child: this test binary re-run on one test, which speaks to the parent
//! in tagged lines on stdout (the harness prints its own lines there too)
//! and takes commands on stdin.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvcr_contracts::protocol::OpHandle;
use kvcr_runner::{EntryStatus, OpResult, Runner};

/// Hard bound on any single wait in these tests.
pub(crate) const BOUND: Duration = Duration::from_secs(20);

/// The result of `op`, waited for within [`BOUND`].
pub(crate) fn wait_op(runner: &mut Runner, op: OpHandle) -> OpResult {
    #[allow(clippy::disallowed_methods)] // a bound on the wait, not a threshold
    let start = Instant::now();
    while start.elapsed() < BOUND {
        for result in runner.wait_completed(Duration::from_millis(50)) {
            if result.op == op {
                return result;
            }
        }
    }
    panic!("operation {op:?} did not complete within {BOUND:?}");
}

/// Polls `f` until it returns `Some` (there is no event to wait on for
/// notices and counters), failing after [`BOUND`].
pub(crate) fn poll_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    #[allow(clippy::disallowed_methods)] // a bound on the wait, not a threshold
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < BOUND, "timed out waiting for {what}");
        #[allow(clippy::disallowed_methods)] // polling an observable with no event
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Each entry's status, in order.
pub(crate) fn statuses(result: &OpResult) -> Vec<EntryStatus> {
    result.entries.iter().map(|(_, e)| e.status).collect()
}

/// In the child: prints `line` to the parent after `tag`, at once.
pub(crate) fn say(tag: &str, line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{tag} {line}").unwrap();
    out.flush().unwrap();
}

/// This test binary re-run on `test` alone; killed (and reaped) on drop.
pub(crate) struct TestChild {
    pub(crate) child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl TestChild {
    /// Runs `test` with `env` set to `value`; the lines it prints after
    /// `tag` (the rest of each, trimmed) come to [`TestChild::expect`].
    pub(crate) fn spawn(test: &str, env: &str, value: &str, tag: &'static str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env, value)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may print `test <name> ... ` on the same line.
                if let Some(at) = line.find(tag)
                    && tx.send(line[at + tag.len()..].trim().to_owned()).is_err()
                {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The next line starting with `word` (its rest), within [`BOUND`].
    pub(crate) fn expect(&self, word: &str) -> String {
        #[allow(clippy::disallowed_methods)] // a bound on the wait, not a threshold
        let start = Instant::now();
        loop {
            let left = BOUND.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(word) {
                        return rest.trim().to_owned();
                    }
                }
                Err(e) => panic!("child source: no {word} line ({e:?})"),
            }
        }
    }

    /// Sends `cmd` as one line on the child's stdin.
    pub(crate) fn command(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for TestChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
