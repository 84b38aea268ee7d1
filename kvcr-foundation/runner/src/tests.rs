//! Unit tests of the runner driver: the all-or-nothing startup.

use super::*;

/// Startup is all or nothing: a failure at any stage names the stage and
/// releases what earlier stages took (the pools are freed; no thread leaks).
#[test]
fn startup_failure_at_every_stage_releases_everything() {
    for stage in [
        StartupStage::Validate,
        StartupStage::AllocatePools,
        StartupStage::BuildCore,
        StartupStage::StartCopyEngine,
    ] {
        let config = RunnerConfig::single_pool("kv", 4096, 1024);
        let err = Runner::start_staged(config, None, Some(stage)).unwrap_err();
        match &err {
            Error::Startup {
                stage: name,
                retained,
                ..
            } => {
                assert_eq!(*name, stage.name());
                assert!(!retained, "nothing can touch memory at startup yet");
            }
            other => panic!("{stage:?}: {other:?}"),
        }
        assert_eq!(
            kvcr_sys::mapping::live_pool_bytes(),
            0,
            "pools leaked after a failure at {stage:?}"
        );
    }
    let runner = Runner::start(RunnerConfig::single_pool("kv", 4096, 16), None).unwrap();
    assert_eq!(kvcr_sys::mapping::live_pool_bytes(), 4096 * 16);
    runner.close().map_err(|(_, e)| e).unwrap();
    assert_eq!(kvcr_sys::mapping::live_pool_bytes(), 0);
}
