//! GPU tests (see the crate's test docs). Without `KVCR_TEST_GPU=1` only the
//! no-driver path runs here; with it, a missing GPU fails every test.
