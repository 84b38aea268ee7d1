//! The control channel's old path (compat shim: removed once the split
//! lands); the code is in [`crate::net`].

pub(crate) use crate::net::{
    AcceptedStream, ChannelEvent, ControlChannel, ControlLimits, ControlStats, Inbound,
    PeerIdentity,
};
