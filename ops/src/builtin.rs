//! glm5's own backends: the registry of every op folder's entries (the op folders depend on `registry.rs`,
//! this file on them).

use crate::registry::Registry;

impl Registry {
    /// glm5's own backends, as each op folder declares them (`<op>/entries.rs`).
    pub fn builtin() -> Self {
        let mut registry = Self::empty();
        for entry in crate::sparse_mla::registry_entries()
            .into_iter()
            .chain(crate::dsa_indexer::registry_entries())
        {
            registry
                .register(entry)
                .expect("the built-in backends have distinct names");
        }
        registry
    }
}
