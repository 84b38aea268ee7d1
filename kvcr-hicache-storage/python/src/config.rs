//! The engine's storage configuration as the Python class hands it over: a
//! JSON object with the fields of SGLang's `HiCacheStorageConfig` (the class
//! reads them off the dataclass; JSON keeps this side free of Python object
//! introspection).

use kvcr_hicache_storage::StorageConfig;
use serde_json::Value;

use crate::error::{Error, Result};

/// Parses `{"tp_rank": .., "tp_size": .., "model_name": .., "extra_config": {..}, ..}`.
///
/// Missing counts take SGLang's defaults for a single rank (rank 0 of 1); the
/// extra config is passed through to the backend, which validates it strictly.
pub(crate) fn storage_config(text: &str) -> Result<StorageConfig> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| Error::StorageConfig(format!("not JSON: {e}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| Error::StorageConfig("must be a JSON object".into()))?;
    let count = |key: &str, default: u32| -> Result<u32> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| Error::StorageConfig(format!("`{key}` must be a u32, got {v}"))),
        }
    };
    let flag = |key: &str| -> Result<bool> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Error::StorageConfig(format!(
                "`{key}` must be a boolean, got {v}"
            ))),
        }
    };
    let model_name = match map.get("model_name") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            return Err(Error::StorageConfig(format!(
                "`model_name` must be a string, got {v}"
            )));
        }
    };
    let mut config = StorageConfig::single_rank(&model_name, Value::Null);
    config.tp_rank = count("tp_rank", 0)?;
    config.tp_size = count("tp_size", 1)?;
    config.pp_rank = count("pp_rank", 0)?;
    config.pp_size = count("pp_size", 1)?;
    config.attn_cp_rank = count("attn_cp_rank", 0)?;
    config.attn_cp_size = count("attn_cp_size", 1)?;
    config.dp_rank = count("dp_rank", 0)?;
    config.dp_size = count("dp_size", 1)?;
    config.is_mla_model = flag("is_mla_model")?;
    config.should_split_heads = flag("should_split_heads")?;
    config.extra_config = match map.get("extra_config") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.clone()),
    };
    Ok(config)
}
