//! Unit tests of the publisher core, wire encoder and replay buffer.
