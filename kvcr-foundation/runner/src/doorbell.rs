//! The doorbell's old path (compat shim: removed once the split lands);
//! the code is in [`crate::wire`] (records, parts, the region, mailboxes,
//! the bookkeeping) and [`crate::net::doorbell`] (its memory).

pub(crate) use crate::net::doorbell::{RouteMailbox, TargetDoorbell};
pub(crate) use crate::wire::doorbell::{OpenedMessage, RouteDoorbell};
pub(crate) use crate::wire::mailbox::Polled;
pub(crate) use crate::wire::part::{Part, PartFit, spans_in_range};
pub use crate::wire::record::WRITE_MESSAGE;
pub(crate) use crate::wire::record::{RecordKey, SLOT_BYTES};
pub(crate) use crate::wire::region::{REGION, REGION_BYTES};
