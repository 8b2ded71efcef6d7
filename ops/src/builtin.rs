//! glm5's own backends: the registry of every op folder's entries, and the dispatch the ops' public
//! functions go through (the model dispatches once per layer instead, when its graph is built).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::DeviceLocation;

use crate::error::{OpError, Result};
use crate::registry::{Kernel, OpSpec, Registry};
use crate::DeviceDesc;

impl Registry {
    /// glm5's own backends, as each op folder declares them (`<op>/entries.rs`).
    pub fn builtin() -> Self {
        let mut registry = Self::empty();
        for entry in crate::sparse_mla::registry_entries()
            .into_iter()
            .chain(crate::dsa_indexer::registry_entries())
        {
            // The built-in names are distinct (tested).
            registry
                .register(entry)
                .expect("the built-in backends have distinct names");
        }
        registry
    }
}

/// The built-in registry, built once.
fn builtin() -> &'static Registry {
    static BUILTIN: OnceLock<Registry> = OnceLock::new();
    BUILTIN.get_or_init(Registry::builtin)
}

/// The built-in backend the dispatch rule picks for `spec` on `device`: its name and function (an error
/// naming every candidate's reasons when none serves it). Remembered per device and spec, so that a call
/// pays for the device query and the dispatch once (nothing dispatch reads changes while a process runs).
pub(crate) fn choose(
    spec: &OpSpec,
    device: &candle_core::Device,
) -> Result<(&'static str, Kernel)> {
    type Chosen = HashMap<(DeviceLocation, OpSpec), (&'static str, Kernel)>;
    static CHOSEN: OnceLock<Mutex<Chosen>> = OnceLock::new();
    let chosen = CHOSEN.get_or_init(Default::default);
    let key = (device.location(), spec.clone());
    if let Some(hit) = chosen.lock().ok().and_then(|c| c.get(&key).copied()) {
        return Ok(hit);
    }
    let description = DeviceDesc::of(device).map_err(|e| OpError::Unsupported(e.to_string()))?;
    let entry = builtin()
        .dispatch(spec, &description, None)
        .map_err(|e| OpError::Unsupported(e.to_string()))?
        .entry;
    let pick = (entry.name, entry.kernel);
    if let Ok(mut chosen) = chosen.lock() {
        chosen.insert(key, pick);
    }
    Ok(pick)
}
