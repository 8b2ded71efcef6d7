//! The default model built into the binary: a tiny GLM-5-architecture model with random weights and a small
//! byte-level BPE tokenizer (`assets/tiny-glm5`, written by `examples/make_tiny_model.rs`), so that
//! `glm5 generate` works offline on a fresh machine. Its output is noise; it exercises the whole runtime.
//!
//! [`materialize`] writes the files into a cache directory once, so the ordinary model-directory loading
//! path (config.json, model.safetensors, tokenizer.json, chat template) is used for it too.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Display name of the embedded model.
pub const NAME: &str = "glm5-tiny (embedded, random weights: output is noise)";

/// The embedded model's `config.json`.
pub const CONFIG_JSON: &str = include_str!("../assets/tiny-glm5/config.json");

/// The embedded files: `(file name, contents)`.
pub const FILES: [(&str, &[u8]); 6] = [
    (
        "config.json",
        include_bytes!("../assets/tiny-glm5/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../assets/tiny-glm5/generation_config.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../assets/tiny-glm5/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../assets/tiny-glm5/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../assets/tiny-glm5/chat_template.jinja"),
    ),
    (
        "model.safetensors",
        include_bytes!("../assets/tiny-glm5/model.safetensors"),
    ),
];

/// FNV-1a 64 over every file name and content: names the cache directory, so a changed model gets a new one.
fn content_hash() -> u64 {
    FILES
        .iter()
        .flat_map(|(name, bytes)| {
            name.as_bytes()
                .iter()
                .chain([0u8].iter())
                .chain(bytes.iter())
        })
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// Candidate parent directories: `$XDG_CACHE_HOME/glm5`, `~/.cache/glm5`, then the OS temp dir.
fn parents() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(cache) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(cache).join("glm5"));
    } else if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(home).join(".cache").join("glm5"));
    }
    dirs.push(std::env::temp_dir().join("glm5"));
    dirs
}

/// Writes the embedded model into `<cache>/glm5/tiny-glm5-<hash>` (falling back to the temp dir when the
/// cache is not writable) and returns that directory. Files already there with the right content are left
/// alone; missing or different ones are (re)written atomically, so concurrent callers are safe.
pub fn materialize() -> io::Result<PathBuf> {
    let name = format!("tiny-glm5-{:012x}", content_hash() >> 16);
    let mut last_error = None;
    for parent in parents() {
        let dir = parent.join(&name);
        match write_files(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) => {
                last_error = Some(io::Error::new(e.kind(), format!("{}: {e}", dir.display())))
            }
        }
    }
    Err(last_error
        .unwrap_or_else(|| io::Error::other("no directory to write the embedded model to")))
}

fn write_files(dir: &Path) -> io::Result<()> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|existing| existing == bytes) {
            continue;
        }
        let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{unique}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
    }
    Ok(())
}
