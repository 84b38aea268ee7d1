//! The publisher's one error type.

pub use kvcr_contracts::error::Echo;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong configuring, starting or stopping a publisher.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A contract value (an endpoint) was refused.
    #[error(transparent)]
    Contract(#[from] kvcr_contracts::Error),
    /// The inventory publisher could not be configured, started or stopped.
    #[error("inventory publisher: {reason}")]
    Publisher {
        /// Why.
        reason: PublisherReason,
    },
}

impl Error {
    /// The publisher reason, when this is a publisher error.
    pub fn publisher_reason(&self) -> Option<&PublisherReason> {
        match self {
            Self::Publisher { reason } => Some(reason),
            Self::Contract(_) => None,
        }
    }
}

/// Why the inventory publisher refused to start or failed to stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublisherReason {
    /// A configuration bound is out of range.
    #[error("{field} must be in {min}..={max}, got {value}")]
    Config {
        /// The configuration field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// Smallest allowed value.
        min: u64,
        /// Largest allowed value.
        max: u64,
    },
    /// A socket would bind beyond loopback while `bind_scope` is loopback.
    #[error("{0} is not a loopback address; binding it needs bind_scope AnyAddress")]
    NotLoopback(Echo),
    /// The PUB and replay endpoints are the same address.
    #[error("the PUB and replay endpoints must differ, both are {0}")]
    SameEndpoint(Echo),
    /// A ZMQ call failed (the errno is kept raw; the text is libzmq's).
    #[error("zmq {op} failed: {message} (errno {errno})")]
    Zmq {
        /// Which call.
        op: &'static str,
        /// The raw errno.
        errno: i32,
        /// libzmq's description of it.
        message: &'static str,
    },
    /// Binding or connecting an endpoint failed.
    #[error("cannot {op} {endpoint}: {message} (errno {errno})")]
    Endpoint {
        /// `bind` or `connect`.
        op: &'static str,
        /// The endpoint.
        endpoint: Echo,
        /// The raw errno.
        errno: i32,
        /// libzmq's description of it.
        message: &'static str,
    },
    /// The driver thread could not be spawned.
    #[error("cannot spawn the publisher thread")]
    Spawn,
    /// The driver thread panicked (a bug); the publisher stopped publishing.
    #[error("the publisher thread panicked")]
    DriverPanicked,
}
