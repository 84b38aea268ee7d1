//! Which processes a peer's worker address reaches through this host's
//! shared-memory transports, from its bytes and this host's [`Limits`]: a
//! transport that writes into a process by a name of its own (cma: a pid)
//! must name the process the address's posix fifo belongs to, the one its
//! active messages reach; and whether an endpoint to it would attach this
//! host's shared memory at all. No unsafe code here.

use crate::packed::{
    AddressProblem, IfaceView, Limits, Step, TL_POSIX, address_error, posix_mode,
    validate_worker_address, walk_address,
};
use crate::status::UcxReason;

/// `ucs_crc16_string("cma")`.
const TL_CMA: u16 = 0x8b47;
/// `ucs_crc16_string("sysv")`.
const TL_SYSV: u16 = 0x538d;
/// `ucs_crc16_string("knem")` and `("xpmem")`: rkeys alone name memory.
const TL_BY_RKEY: [u16; 2] = [0x1377, 0x83dd];
/// The procfs flag of a posix segment id (bit 63), as [`posix_mode`] shifts it.
const POSIX_PROCFS: u8 = 0b1000;
/// The pid bits of a procfs posix segment id (the owner's pid, low 30 bits).
const POSIX_PID_MASK: u64 = (1 << 30) - 1;
/// The pid bits of a cma iface address (bit 31 flags a pid namespace).
const CMA_PID_MASK: u32 = 0x7fff_ffff;

/// Validates `bytes` as [`validate_worker_address`] does, and then that
/// every transport of this host's (`limits`) that reaches memory by a name
/// of its own reaches only the process the address's fifo belongs to: a cma
/// iface names the posix fifo's pid, with no sysv fifo beside it, and no
/// knem or xpmem iface is listed ([`AddressProblem::ForeignProcess`]). So
/// the puts of an endpoint to this address reach the process its active
/// messages reach. With [`Limits::new`] (no local transports) nothing more
/// is checked.
pub fn validate_process_binding(bytes: &[u8], limits: &Limits) -> Result<(), UcxReason> {
    validate_worker_address(bytes, limits)?;
    let mut owners = Owners::default();
    walk_address(bytes, limits, &mut |iface| {
        owners.note(limits, iface);
        Ok(())
    })
    .and_then(|_| owners.check())
    .map_err(|e| address_error(bytes.len(), e))
}

/// Whether an endpoint to the worker at `bytes` attaches this host's shared
/// memory: it lists a posix, sysv or cma iface that this host has, on this
/// host's own device for it (the system id UCX reaches such an iface on
/// only here). UCX 1.13 keeps what it attaches until the worker goes, so a
/// caller may budget these; an address that does not walk counts as one.
/// With [`Limits::new`] (no local transports) nothing attaches.
pub fn attaches_shared_memory(bytes: &[u8], limits: &Limits) -> bool {
    let mut attaches = false;
    let walked = walk_address(bytes, limits, &mut |iface| {
        attaches |= [TL_POSIX, TL_SYSV, TL_CMA].contains(&iface.csum)
            && limits
                .transports
                .iter()
                .any(|t| t.csum == iface.csum && t.device == iface.device);
        Ok(())
    });
    attaches || walked.is_err()
}

/// The processes an address's same-host transports name (only those this
/// host has: UCX never selects another).
#[derive(Default)]
struct Owners {
    /// The pid of a posix fifo in procfs mode (the last seen).
    posix: Option<u32>,
    /// Whether a sysv fifo is listed (its segment names no process).
    sysv: bool,
    /// Each cma iface's pid, with its offset.
    cma: Vec<(usize, u32)>,
    /// A knem or xpmem iface, with its offset.
    by_rkey: Option<(usize, u16)>,
}

impl Owners {
    fn note(&mut self, limits: &Limits, iface: &IfaceView<'_>) {
        if !limits.transports.iter().any(|t| t.csum == iface.csum) {
            return;
        }
        match iface.csum {
            TL_POSIX => {
                let segment = iface
                    .addr
                    .first_chunk::<8>()
                    .map(|id| u64::from_le_bytes(*id));
                if let Some(id) = segment
                    && posix_mode(iface.addr).is_some_and(|m| m & POSIX_PROCFS != 0)
                {
                    self.posix = u32::try_from(id & POSIX_PID_MASK).ok();
                }
            }
            TL_SYSV => self.sysv = true,
            TL_CMA => {
                // The length was checked against this host's (4 bytes, or
                // more in a pid namespace).
                if let Some(pid) = iface.addr.first_chunk::<4>() {
                    let pid = u32::from_le_bytes(*pid) & CMA_PID_MASK;
                    self.cma.push((iface.addr_offset, pid));
                }
            }
            csum if TL_BY_RKEY.contains(&csum) => {
                self.by_rkey = Some((iface.addr_offset, csum));
            }
            _ => {}
        }
    }

    /// A cma iface must name the posix fifo's process, with no sysv fifo
    /// beside it (a route's nonce could then reach another process than
    /// its puts); knem and xpmem are never bound to the worker.
    fn check(&self) -> Step<()> {
        if let Some((offset, csum)) = self.by_rkey {
            return Err((
                offset,
                AddressProblem::ForeignProcess {
                    csum,
                    pid: None,
                    owner: self.posix,
                },
            ));
        }
        match self
            .cma
            .iter()
            .find(|(_, pid)| self.sysv || self.posix != Some(*pid))
        {
            Some((offset, pid)) => Err((
                *offset,
                AddressProblem::ForeignProcess {
                    csum: TL_CMA,
                    pid: Some(*pid),
                    owner: self.posix,
                },
            )),
            None => Ok(()),
        }
    }
}
