//! Two simulated hosts: network namespaces joined by a veth pair, with a
//! shaped link between them, for `cargo xtask e2e`'s between-hosts
//! scenarios and `cargo xtask bench --link`.
//!
//! This kernel has no netem (nor fq), so each property is made with what it
//! has (checked by [`features`] before anything is shaped; what is missing is
//! said, never silently skipped):
//! * rate: a token bucket (`tc qdisc … tbf`) on each end's egress;
//! * loss: an iptables `statistic` drop rule on each end's input;
//! * partitions: iptables drop rules added and removed mid-transfer;
//! * delay, jitter and reordering: our own delayer ([`run_delayer`], `cargo
//!   xtask link-delayer`) behind an NFQUEUE rule in namespace A: every packet
//!   in either direction is held for the one-way delay (± jitter) and then
//!   released; it reports how long it really held them, and the harness
//!   measures the round trip across the link ([`Link::measure_rtt`]).
//!
//! Everything is torn down on drop (the namespaces, and with them the veth
//! pair, the qdiscs and the rules; the delayer is killed first). Needs root.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The link's device name in both namespaces.
pub(crate) const DEVICE: &str = "kvcr0";
/// The two hosts' addresses (inside their own namespaces only).
const ADDRESSES: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)];
/// The NFQUEUE number the delayer serves.
const QUEUE: &str = "7";

/// How the link behaves. Delay is one-way (the round trip is twice it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Shape {
    /// Rate of each direction, Mbit/s (`None`: the veth's own).
    pub(crate) rate_mbit: Option<u64>,
    /// One-way delay, µs.
    pub(crate) delay_us: u64,
    /// Uniform jitter around the delay, ± µs.
    pub(crate) jitter_us: u64,
    /// Whether jittered packets may overtake each other (else each is held
    /// at least until the one before it is released).
    pub(crate) reorder: bool,
    /// Random loss of each direction, per million packets.
    pub(crate) loss_ppm: u32,
}

/// What this kernel can shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Features {
    pub(crate) rate: bool,
    pub(crate) loss: bool,
    pub(crate) queue: bool,
}

impl Features {
    /// What cannot be shaped, in words (empty when everything can).
    pub(crate) fn missing(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if !self.rate {
            out.push("rate (tc tbf)");
        }
        if !self.loss {
            out.push("loss and partitions (iptables statistic / DROP)");
        }
        if !self.queue {
            out.push("delay, jitter and reordering (iptables NFQUEUE)");
        }
        out
    }
}

fn quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    quiet(Command::new("ip").args(args))
}

fn in_ns(ns: &str, program: &str, args: &[&str]) -> Result<()> {
    quiet(
        Command::new("ip")
            .args(["netns", "exec", ns, program])
            .args(args),
    )
}

/// Probes, in a throwaway namespace, which shaping tools work here.
pub(crate) fn features() -> Result<Features> {
    let ns = format!("kvcr-probe-{}", std::process::id());
    ip(&["netns", "add", &ns]).context("creating a network namespace (needs root)")?;
    let probe = || -> Features {
        let _ = in_ns(&ns, "ip", &["link", "set", "lo", "up"]);
        Features {
            rate: in_ns(
                &ns,
                "tc",
                &[
                    "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "64kb",
                    "latency", "10ms",
                ],
            )
            .is_ok(),
            loss: in_ns(
                &ns,
                "iptables",
                &[
                    "-A",
                    "INPUT",
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    "0.5",
                    "-j",
                    "DROP",
                ],
            )
            .is_ok(),
            queue: in_ns(
                &ns,
                "iptables",
                &["-A", "OUTPUT", "-j", "NFQUEUE", "--queue-num", "1"],
            )
            .is_ok(),
        }
    };
    let found = probe();
    ip(&["netns", "del", &ns])?;
    Ok(found)
}

/// The iptables rules (after `-A`/`-D`) that hand every packet on the link,
/// both ways, to the delayer's queue.
fn queue_rules() -> [Vec<&'static str>; 2] {
    [
        vec![
            "OUTPUT",
            "-o",
            DEVICE,
            "-j",
            "NFQUEUE",
            "--queue-num",
            QUEUE,
        ],
        vec!["INPUT", "-i", DEVICE, "-j", "NFQUEUE", "--queue-num", QUEUE],
    ]
}

/// Two namespaces joined by a shaped veth pair (see the module docs).
pub(crate) struct Link {
    /// The namespaces, A and B.
    pub(crate) ns: [String; 2],
    delayer: Option<Child>,
    partitioned: bool,
}

impl Link {
    /// Creates namespaces `kvcr-<tag>-<pid>-{a,b}` joined by [`DEVICE`]
    /// with [`ADDRESSES`], unshaped.
    pub(crate) fn up(tag: &str) -> Result<Self> {
        let base = format!("kvcr-{tag}-{}", std::process::id());
        let ns = [format!("{base}-a"), format!("{base}-b")];
        for n in &ns {
            // A namespace left by a crashed run of the same pid is stale.
            let _ = ip(&["netns", "del", n]);
            ip(&["netns", "add", n]).context("creating a network namespace (needs root)")?;
        }
        let link = Self {
            ns,
            delayer: None,
            partitioned: false,
        };
        ip(&[
            "link",
            "add",
            "name",
            DEVICE,
            "netns",
            &link.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            DEVICE,
            "netns",
            &link.ns[1],
        ])?;
        for (n, address) in link.ns.iter().zip(ADDRESSES) {
            // IPv4 only: nothing of the link is in duplicate detection.
            for scope in ["all", "default", DEVICE] {
                in_ns(
                    n,
                    "sysctl",
                    &["-qw", &format!("net.ipv6.conf.{scope}.disable_ipv6=1")],
                )?;
            }
            in_ns(n, "ip", &["link", "set", "lo", "up"])?;
            in_ns(
                n,
                "ip",
                &["addr", "add", &format!("{address}/24"), "dev", DEVICE],
            )?;
            in_ns(n, "ip", &["link", "set", DEVICE, "up"])?;
        }
        // The kernel reports a device running (its operational state) only
        // once its link watcher ran, up to a second after both ends are up;
        // UCX's tcp transport skips a device that is not running yet (a node
        // started too early found the link "not available", 1 start in 3).
        let start = Instant::now();
        for n in &link.ns {
            loop {
                let state = Command::new("ip")
                    .args(["netns", "exec", n, "cat"])
                    .arg(format!("/sys/class/net/{DEVICE}/operstate"))
                    .output()?;
                if String::from_utf8_lossy(&state.stdout).trim() == "up" {
                    break;
                }
                if start.elapsed() > Duration::from_secs(10) {
                    bail!("the link in {n} never came up");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(link)
    }

    /// Host `side`'s address (0: A, 1: B).
    pub(crate) fn address(&self, side: usize) -> IpAddr {
        let [a, b] = ADDRESSES;
        IpAddr::V4(if side.is_multiple_of(2) { a } else { b })
    }

    /// Applies `shape` (replacing the previous one).
    pub(crate) fn shape(&mut self, shape: Shape) -> Result<()> {
        self.set_rate(shape.rate_mbit)?;
        for n in &self.ns {
            let _ = in_ns(n, "iptables", &["-F", "INPUT"]);
            let _ = in_ns(n, "iptables", &["-F", "OUTPUT"]);
            if shape.loss_ppm > 0 {
                let p = format!("{:.6}", f64::from(shape.loss_ppm) / 1e6);
                in_ns(
                    n,
                    "iptables",
                    &[
                        "-A",
                        "INPUT",
                        "-i",
                        DEVICE,
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &p,
                        "-j",
                        "DROP",
                    ],
                )?;
            }
        }
        self.stop_delayer();
        if shape.delay_us > 0 || shape.jitter_us > 0 {
            // The delayer itself costs a pass through user space each way
            // (~100 µs on a VM whose vCPU naps); measured here, with the
            // rate and loss already in place, and taken off the delay asked
            // of it, so the round trip is what was asked where it can be.
            let base = median(self.measure_rtt(30)?);
            self.start_delayer(&Shape {
                delay_us: 0,
                jitter_us: 0,
                ..shape
            })?;
            let with_delayer = median(self.measure_rtt(30)?);
            let per_pass = ((with_delayer - base) / 2.0).max(0.0) as u64;
            self.stop_delayer();
            self.start_delayer(&Shape {
                delay_us: shape.delay_us.saturating_sub(per_pass),
                ..shape
            })?;
        }
        self.partitioned = false;
        Ok(())
    }

    /// Changes the rate of both directions (`None`: unlimited), e.g.
    /// mid-transfer.
    pub(crate) fn set_rate(&self, rate_mbit: Option<u64>) -> Result<()> {
        for n in &self.ns {
            let _ = in_ns(n, "tc", &["qdisc", "del", "dev", DEVICE, "root"]);
            if let Some(mbit) = rate_mbit {
                // A burst of at least one GSO segment (64 KiB), else ~1 ms of
                // the rate: tbf drops a packet larger than its bucket.
                let burst = (mbit * 1_000_000 / 8 / 1000).max(128 << 10);
                in_ns(
                    n,
                    "tc",
                    &[
                        "qdisc",
                        "add",
                        "dev",
                        DEVICE,
                        "root",
                        "tbf",
                        "rate",
                        &format!("{mbit}mbit"),
                        "burst",
                        &burst.to_string(),
                        "latency",
                        "50ms",
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Cuts (or heals) the link both ways: every packet on it is dropped.
    pub(crate) fn partition(&mut self, cut: bool) -> Result<()> {
        if cut == self.partitioned {
            return Ok(());
        }
        let action = if cut { "-I" } else { "-D" };
        for n in &self.ns {
            in_ns(
                n,
                "iptables",
                &[action, "INPUT", "-i", DEVICE, "-j", "DROP"],
            )?;
            in_ns(
                n,
                "iptables",
                &[action, "OUTPUT", "-o", DEVICE, "-j", "DROP"],
            )?;
        }
        self.partitioned = cut;
        Ok(())
    }

    /// Stops the delayer and removes its rules (only those: loss rules
    /// stay).
    fn stop_delayer(&mut self) {
        if let Some(mut old) = self.delayer.take() {
            if let Some(ns) = self.ns.first() {
                for rule in queue_rules() {
                    let mut args = vec!["-D"];
                    args.extend(rule);
                    let _ = in_ns(ns, "iptables", &args);
                }
            }
            let _ = old.kill();
            let _ = old.wait();
        }
    }

    fn start_delayer(&mut self, shape: &Shape) -> Result<()> {
        let exe = std::env::current_exe().context("the xtask binary")?;
        let ns = &self.ns[0];
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(exe)
            .args([
                "link-delayer",
                "--queue",
                QUEUE,
                "--delay-us",
                &shape.delay_us.to_string(),
                "--jitter-us",
                &shape.jitter_us.to_string(),
            ])
            .args(shape.reorder.then_some("--reorder"))
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the delayer")?;
        // It says READY once bound to its queue; only then is traffic sent
        // to it (an unbound queue drops every packet).
        let mut line = String::new();
        let stdout = child.stdout.take().context("delayer stdout")?;
        let mut reader = BufReader::new(stdout);
        reader.read_line(&mut line)?;
        if line.trim() != "READY" {
            let _ = child.kill();
            bail!("the delayer did not start: {line:?}");
        }
        // Keep draining its stdout (its final report) so it never blocks.
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = reader.read_to_string(&mut rest);
            if !rest.trim().is_empty() {
                eprintln!("link: {}", rest.trim());
            }
        });
        for rule in queue_rules() {
            let mut args = vec!["-A"];
            args.extend(rule);
            in_ns(ns, "iptables", &args)?;
        }
        self.delayer = Some(child);
        Ok(())
    }

    /// The link's own rate A → B (MB/s): `mib` MiB over one TCP connection.
    pub(crate) fn measure_rate(&self, mib: usize) -> Result<f64> {
        let out = self.with_echo(&["link-blast", &mib.to_string()])?;
        Ok(out.trim().parse()?)
    }

    /// Runs `cargo xtask <args…> ADDR-of-B's-echo …` in namespace A beside an
    /// echo server in B, and returns its stdout.
    fn with_echo(&self, args: &[&str]) -> Result<String> {
        let exe = std::env::current_exe().context("the xtask binary")?;
        let port = 7_707;
        let target = format!("{}:{port}", self.address(1));
        let mut echo = Command::new("ip")
            .args(["netns", "exec", &self.ns[1]])
            .arg(&exe)
            .args(["link-echo", &target])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the echo server")?;
        let mut ready = String::new();
        BufReader::new(echo.stdout.take().context("echo stdout")?).read_line(&mut ready)?;
        let (command, rest) = args.split_first().context("a command")?;
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns[0]])
            .arg(&exe)
            .arg(command)
            .arg(&target)
            .args(rest)
            .output()
            .with_context(|| format!("running {command}"));
        let _ = echo.kill();
        let _ = echo.wait();
        let out = out?;
        if !out.status.success() {
            bail!(
                "{command} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Round trips (µs, sorted) of `count` small TCP messages across the
    /// link, A → B → A: what the link really does, delayer included.
    pub(crate) fn measure_rtt(&self, count: usize) -> Result<Vec<f64>> {
        let out = self.with_echo(&["link-rtt", &count.to_string()])?;
        let mut samples: Vec<f64> = out
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        samples.sort_by(f64::total_cmp);
        Ok(samples)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(mut delayer) = self.delayer.take() {
            let _ = delayer.kill();
            let _ = delayer.wait();
        }
        for n in &self.ns {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// `cargo xtask link-echo ADDR`: on each connection, echoes every byte of a
/// 64-byte exchange; a connection that opens with `B` is a bulk one: it is
/// read to its end and answered with one byte (prints READY once listening).
pub(crate) fn run_echo(rest: &[String]) -> Result<()> {
    let addr: SocketAddr = rest.first().context("link-echo ADDR")?.parse()?;
    let listener = TcpListener::bind(addr)?;
    println!("READY");
    std::io::stdout().flush()?;
    for stream in listener.incoming() {
        let mut stream = stream?;
        stream.set_nodelay(true)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut first = true;
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) if first && buf.first() == Some(&b'B') => {
                    let _ = n;
                    while !matches!(stream.read(&mut buf), Ok(0) | Err(_)) {}
                    stream.write_all(b"k")?;
                    break;
                }
                Ok(n) => stream.write_all(buf.get(..n).unwrap_or_default())?,
            }
            first = false;
        }
    }
    Ok(())
}

/// `cargo xtask link-blast ADDR MIB`: sends MIB MiB to an echo server's bulk
/// mode and prints the rate (MB/s) once it confirmed the last byte.
pub(crate) fn run_blast(rest: &[String]) -> Result<()> {
    let addr: SocketAddr = rest.first().context("link-blast ADDR MIB")?.parse()?;
    let mib: usize = rest.get(1).context("link-blast ADDR MIB")?.parse()?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    let mut chunk = vec![0x5au8; 1 << 20];
    if let Some(first) = chunk.first_mut() {
        *first = b'B';
    }
    let start = Instant::now();
    for _ in 0..mib {
        stream.write_all(&chunk)?;
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack)?;
    println!(
        "{:.1}",
        (mib << 20) as f64 / start.elapsed().as_secs_f64() / 1e6
    );
    Ok(())
}

/// `cargo xtask link-rtt ADDR COUNT`: prints COUNT round trips (µs) of a
/// 64-byte message to an echo server.
pub(crate) fn run_rtt(rest: &[String]) -> Result<()> {
    let addr: SocketAddr = rest.first().context("link-rtt ADDR COUNT")?.parse()?;
    let count: usize = rest.get(1).context("link-rtt ADDR COUNT")?.parse()?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    let msg = [7u8; 64];
    let mut back = [0u8; 64];
    let mut out = String::new();
    for i in 0..count + 5 {
        let start = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
        // The first few warm the path (ARP, slow start).
        if i >= 5 {
            out.push_str(&format!("{:.1} ", start.elapsed().as_secs_f64() * 1e6));
        }
    }
    println!("{out}");
    Ok(())
}

/// `cargo xtask link-delayer --queue N --delay-us D --jitter-us J
/// [--reorder]`: holds every packet NFQUEUE `N` hands it for `D ± J` µs,
/// then accepts it; without `--reorder` a packet is never released before
/// the one queued ahead of it. Prints READY once bound, and on SIGTERM or
/// SIGKILL simply stops (the namespace goes with it). Reports how long it
/// really held packets on stderr every 10 000 packets.
pub(crate) fn run_delayer(rest: &[String]) -> Result<()> {
    let flag = |name: &str| -> Option<u64> {
        rest.iter()
            .position(|a| a == name)
            .and_then(|i| rest.get(i + 1))
            .and_then(|v| v.parse().ok())
    };
    let queue_num = u16::try_from(flag("--queue").context("--queue")?)?;
    let delay = flag("--delay-us").unwrap_or(0);
    let jitter = flag("--jitter-us").unwrap_or(0).min(delay);
    let reorder = rest.iter().any(|a| a == "--reorder");
    let mut queue = nfq::Queue::open().context("opening NFQUEUE (needs root)")?;
    queue.bind(queue_num)?;
    // Metadata only: the verdict carries no payload back.
    queue.set_copy_range(queue_num, 0)?;
    queue.set_recv_gso(queue_num, true)?;
    queue.set_queue_max_len(queue_num, 1 << 16)?;
    queue.set_nonblocking(true);
    // Naps of a few µs must be a few µs, not the default 50 µs of slack.
    nix::sys::prctl::set_timerslack(1)?;
    println!("READY");
    std::io::stdout().flush()?;
    let mut held: BTreeMap<(Instant, u64), (Instant, nfq::Message)> = BTreeMap::new();
    let mut seq = 0u64;
    let mut last_due = Instant::now();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut holds: Vec<f64> = Vec::new();
    loop {
        let now = Instant::now();
        loop {
            match queue.recv() {
                Ok(mut msg) => {
                    msg.set_verdict(nfq::Verdict::Accept);
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let spread = if jitter > 0 {
                        state % (2 * jitter + 1)
                    } else {
                        jitter
                    };
                    let us = delay - jitter + spread;
                    let mut due = now + Duration::from_micros(us);
                    if !reorder && due < last_due {
                        due = last_due;
                    }
                    last_due = due;
                    seq += 1;
                    held.insert((due, seq), (now, msg));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        let now = Instant::now();
        while let Some(entry) = held.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (arrived, msg) = entry.remove();
            holds.push(now.duration_since(arrived).as_secs_f64() * 1e6);
            queue.verdict(msg)?;
        }
        if holds.len() >= 10_000 {
            holds.sort_by(f64::total_cmp);
            eprintln!(
                "link-delayer: asked {delay} ± {jitter} µs; held p5 {:.0} p50 {:.0} p95 {:.0} µs",
                percentile(&holds, 0.05),
                percentile(&holds, 0.5),
                percentile(&holds, 0.95)
            );
            holds.clear();
        }
        // Sleep until the next release, at most a moment (packets arrive
        // meanwhile). Never spin: on a small machine a spinning delayer takes
        // a CPU from the runners it sits between (measured: one-block
        // restores 2–4× slower beside it); its per-pass cost is measured
        // and taken off the delay instead (`Link::shape`).
        let nap = held
            .first_key_value()
            .map_or(Duration::from_micros(50), |((due, _), _)| {
                due.saturating_duration_since(Instant::now())
            })
            .min(Duration::from_micros(50));
        if !nap.is_zero() {
            std::thread::sleep(nap);
        }
    }
}

/// The `p` quantile (0..=1) of `sorted` (NaN when empty).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// `cargo xtask link-check`: what this kernel can shape, and what a shaped
/// link really does (round trips measured across it, beside what was asked).
pub(crate) fn run_check() -> Result<()> {
    let found = features()?;
    let missing = found.missing();
    if missing.is_empty() {
        println!("link: this kernel shapes rate, loss, partitions, delay, jitter and reordering");
    } else {
        println!("link: cannot shape here: {}", missing.join(", "));
    }
    let mut link = Link::up("check")?;
    let shapes = [
        ("unshaped", Shape::default()),
        (
            "100 µs one way",
            Shape {
                delay_us: 100,
                ..Shape::default()
            },
        ),
        (
            "100 ± 25 µs one way, reordering",
            Shape {
                delay_us: 100,
                jitter_us: 25,
                reorder: true,
                ..Shape::default()
            },
        ),
        (
            "500 µs one way",
            Shape {
                delay_us: 500,
                ..Shape::default()
            },
        ),
    ];
    link.shape(Shape::default())?;
    println!("link: unshaped rate {:.0} MB/s", link.measure_rate(256)?);
    link.shape(Shape {
        rate_mbit: Some(1_000),
        ..Shape::default()
    })?;
    println!(
        "link: 1 Gbit/s (125 MB/s) asked: {:.0} MB/s",
        link.measure_rate(64)?
    );
    for (what, shape) in shapes {
        link.shape(shape)?;
        let rtt = link.measure_rtt(200)?;
        println!(
            "link: {what}: asked RTT {} µs; measured p5 {:.0} p50 {:.0} p95 {:.0} µs",
            2 * shape.delay_us,
            percentile(&rtt, 0.05),
            percentile(&rtt, 0.5),
            percentile(&rtt, 0.95)
        );
    }
    Ok(())
}

/// `ucx_perftest -t ucp_put_bw` from A to B over the link (GB/s, the overall
/// column), with the tcp segment sizes kvcr runs with: the bulk anchor, the
/// same route and settings in the same round. `None` when it cannot run.
fn perftest_put_bw(link: &Link, size: usize, iters: usize) -> Option<f64> {
    let row = perftest_final(link, "ucp_put_bw", size, iters)?;
    let overall_mbs: f64 = row.get(6)?.parse().ok()?;
    Some(overall_mbs / 1e3)
}

/// `ucx_perftest -t ucp_put_lat` over the link: UCX's own one-way latency of
/// a put of `size` bytes (µs, the typical column).
fn perftest_put_lat(link: &Link, size: usize, iters: usize) -> Option<f64> {
    perftest_final(link, "ucp_put_lat", size, iters)?
        .get(2)?
        .parse()
        .ok()
}

/// Runs one `ucx_perftest` test from A to B; the client's `Final:` row.
fn perftest_final(link: &Link, test: &str, size: usize, iters: usize) -> Option<Vec<String>> {
    // A port per call: a server that lingers must not take the next one's.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let call = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let port = (16_000 + std::process::id() % 2000 + call).to_string();
    let env = [
        ("UCX_TLS", "tcp,self"),
        ("UCX_NET_DEVICES", DEVICE),
        ("UCX_TCP_TX_SEG_SIZE", "64k"),
        ("UCX_TCP_RX_SEG_SIZE", "256k"),
    ];
    let mut server = Command::new("ip")
        .args(["netns", "exec", &link.ns[1], "ucx_perftest", "-p", &port])
        .envs(env)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // ucx_perftest prints nothing when it listens; give it time to bind.
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &link.ns[0],
            "timeout",
            "120",
            "ucx_perftest",
        ])
        .arg(link.address(1).to_string())
        .args(["-p", &port, "-t", test])
        .args(["-s", &size.to_string(), "-n", &iters.to_string()])
        .args(["-w", &(iters / 10).max(2).to_string()])
        .envs(env)
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.ok()?.stdout).into_owned();
    Some(
        text.lines()
            .find(|l| l.starts_with("Final:"))?
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// One round of `cargo xtask bench --link`: a source node in A and a
/// destination in B over a 1 Gbit/s link at round trips of 50 µs, 200 µs
/// and 1 ms, and a 4 Gbit/s one at 200 µs, each figure beside an anchor
/// measured over the same link in the same round. Prints its BENCH lines as it goes (prefixed `label`) and
/// returns them.
// `serde_json::Value` indexing returns `Null` for a missing key, and a side
// is taken modulo the two namespaces: neither panics.
#[allow(clippy::indexing_slicing)]
pub(crate) fn bench_round(
    node_binary: &std::path::Path,
    quick: bool,
    label: &str,
) -> Result<Vec<String>> {
    use crate::node::{Node, NodeSpec};
    use serde_json::{Value, json};
    const RATE_MBIT: u64 = 1_000;
    const BLOCK: u64 = 256 << 10;
    let bulk_pages: u64 = if quick { 128 } else { 256 };
    let one_block_iters: u64 = if quick { 15 } else { 40 };
    // (round trip asked, rate): three round trips at 1 Gbit/s, and the
    // middle one at 4 Gbit/s (as much as this VM moves through the link).
    let links = [
        (50u64, RATE_MBIT),
        (200, RATE_MBIT),
        (1_000, RATE_MBIT),
        (200, 4 * RATE_MBIT),
    ];
    let per_rtt = bulk_pages + one_block_iters + 1;
    let total = per_rtt * links.len() as u64;
    let found = features()?;
    if !found.missing().is_empty() {
        bail!("cannot shape a link here: {}", found.missing().join(", "));
    }
    let mut link = Link::up("bench")?;
    link.shape(Shape {
        rate_mbit: Some(RATE_MBIT),
        ..Shape::default()
    })?;
    let spec = |side: usize| NodeSpec {
        tls: Some("tcp,self".into()),
        netns: Some((link.ns[side % 2].clone(), link.address(side))),
        timeout_ms: Some(60_000),
        ..NodeSpec::new(total, BLOCK)
    };
    let mut source = Node::spawn(node_binary, "link source", &spec(0))?;
    let offloaded = source.call(
        &json!({"cmd": "offload", "pages": total, "shards": 1, "seed": 71, "hash_seed": 7100}),
        "OFFLOADED",
    )?;
    let hashes: Vec<u64> = offloaded["hashes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let mut dest = Node::spawn(node_binary, "link dest", &spec(1))?;
    let mut restore = |request: String, first: u64, count: u64| -> Result<Value> {
        let range = hashes
            .get(first as usize..(first + count) as usize)
            .context("page range")?;
        let answer = dest.call(
            &json!({
                "cmd": "restore", "request": request, "source": source.endpoint,
                "hashes": range, "first_page": first, "shards": [0], "seed": 71,
            }),
            "RESTORED",
        )?;
        if answer["mismatched"].as_u64() != Some(0) || answer["ok"].as_u64() != Some(count) {
            bail!("a restore across the link failed or corrupted bytes: {answer}");
        }
        Ok(answer)
    };
    let mut lines = Vec::new();
    let mut say = |line: String| {
        eprintln!("{label}: {line}");
        lines.push(line);
    };
    for (i, (rtt_us, rate_mbit)) in links.into_iter().enumerate() {
        link.shape(Shape {
            rate_mbit: Some(rate_mbit),
            delay_us: rtt_us / 2,
            ..Shape::default()
        })?;
        let rtt = median(link.measure_rtt(40)?);
        let rate_gbs = link.measure_rate(if quick { 32 } else { 64 })? / 1e3;
        let first = i as u64 * per_rtt;
        // Warm the route (session, metadata, UCX wire-up) on one page.
        restore(format!("warm-{rtt_us}"), first, 1)?;
        let bulk = restore(format!("bulk-{rtt_us}"), first + 1, bulk_pages)?;
        let bulk_gbs =
            (bulk_pages * BLOCK) as f64 / bulk["secs"].as_f64().unwrap_or(f64::NAN) / 1e9;
        let mut one_block = Vec::new();
        for k in 0..one_block_iters {
            let page = first + 1 + bulk_pages + k;
            let answer = restore(format!("one-{rtt_us}-{k}"), page, 1)?;
            one_block.push(answer["secs"].as_f64().unwrap_or(f64::NAN) * 1e6);
        }
        let one_block_p50 = median(one_block);
        let serialisation_us = BLOCK as f64 / (rate_gbs * 1e3);
        let bound = 2.0 * rtt + serialisation_us;
        let anchor = perftest_put_bw(&link, BLOCK as usize, if quick { 200 } else { 400 });
        let ucx_lat = perftest_put_lat(&link, BLOCK as usize, if quick { 30 } else { 100 });
        let tag = if rate_mbit == RATE_MBIT {
            format!("rtt{rtt_us}us")
        } else {
            format!("rtt{rtt_us}us_{}gbit", rate_mbit / 1000)
        };
        // The bytes that must be in flight to fill this link (its
        // bandwidth-delay product, as measured).
        say(format!(
            "BENCH link.bytes_to_fill_{tag} value={:.0} unit=bytes",
            rate_gbs * 1e3 * rtt
        ));
        say(format!(
            "BENCH link.rate_{tag} value={rate_gbs:.3} unit=GB/s"
        ));
        say(format!("BENCH link.rtt_{tag} value={rtt:.1} unit=us"));
        let bulk_line = |name: &str| match anchor {
            Some(a) => format!(
                "BENCH {name} value={bulk_gbs:.3} unit=GB/s anchor={a:.3} ratio={:.3}",
                bulk_gbs / a
            ),
            None => format!("BENCH {name} value={bulk_gbs:.3} unit=GB/s"),
        };
        let block_line = |name: &str| {
            format!(
                "BENCH {name} value={one_block_p50:.1} unit=us anchor={bound:.1} ratio={:.3}",
                one_block_p50 / bound
            )
        };
        say(bulk_line(&format!("link.fetch_bulk_{tag}")));
        say(block_line(&format!("link.one_block_p50_{tag}")));
        // Beside UCX's own latency of one such put over the same link: what
        // the transport costs before any of kvcr's round trips.
        if let Some(lat) = ucx_lat {
            say(format!(
                "BENCH link.one_block_vs_ucx_{tag} value={one_block_p50:.1} unit=us anchor={lat:.1} ratio={:.3}",
                one_block_p50 / lat
            ));
        }
        // Round trips a one-block restore costs beyond the page's own
        // serialisation, as measured.
        say(format!(
            "BENCH link.round_trips_per_block_{tag} value={:.2} unit=rtt",
            (one_block_p50 - serialisation_us).max(0.0) / rtt
        ));
        if rtt_us == 200 && rate_mbit == RATE_MBIT {
            say(bulk_line("link.fetch_bulk"));
            say(block_line("link.one_block_p50"));
        }
    }
    Ok(lines)
}
