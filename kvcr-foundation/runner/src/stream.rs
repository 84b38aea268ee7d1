//! The data stream's old path (compat shim: removed once the split lands);
//! the code is in [`crate::net::stream`].

pub(crate) use crate::net::stream::*;
