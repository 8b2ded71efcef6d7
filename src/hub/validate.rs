//! What is checked on every file before it is handed out: size, JSON, safetensors header, UTF-8 text, and
//! the shard names of the index.

use std::fs::File;
use std::io::{BufReader, Read};

use super::*;

impl Fetcher<'_> {
    /// The distinct shard files named by the index's `weight_map`, each a plain relative path.
    pub(super) fn shard_names(&self, index: &Path) -> Result<BTreeSet<String>, HubError> {
        let corrupt = |reason: &str| self.corrupt(INDEX_FILE, index, reason);
        let json = read_json(index)?.map_err(|e| corrupt(&format!("not valid JSON ({e})")))?;
        index_shards(&json).map_err(|reason| corrupt(&reason))
    }

    /// Checks a file against the size the Hub announced and the format its extension implies.
    pub(super) fn validate(
        &self,
        file: &str,
        path: &Path,
        expected_size: Option<u64>,
    ) -> Result<(), HubError> {
        let io = |source| HubError::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(self.corrupt(file, path, "not a regular file"));
        }
        let size = meta.len();
        if !file.ends_with(".safetensors") && size > MAX_TEXT_FILE {
            return Err(self.corrupt(
                file,
                path,
                &format!("{size} bytes, more than the limit of {MAX_TEXT_FILE} for a file other than weights"),
            ));
        }
        if let Some(expected) = expected_size.filter(|&e| e != size) {
            return Err(self.corrupt(
                file,
                path,
                &format!("{size} bytes, but the Hub announced {expected}"),
            ));
        }
        let problem = if file.ends_with(".json") {
            match read_json(path)? {
                Err(e) => Some(format!("not valid JSON ({e})")),
                Ok(serde_json::Value::Object(map))
                    if map.len() == 1 && map.contains_key("error") =>
                {
                    Some(format!(
                        "it holds a Hub error response: {}",
                        serde_json::Value::Object(map)
                    ))
                }
                Ok(serde_json::Value::Object(_)) => None,
                Ok(_) => Some("not a JSON object".to_string()),
            }
        } else if file.ends_with(".safetensors") {
            check_safetensors(path, size).map_err(io)?.err()
        } else {
            std::fs::read_to_string(path)
                .err()
                .map(|e| format!("not UTF-8 text ({e})"))
        };
        match problem {
            Some(reason) => Err(self.corrupt(file, path, &reason)),
            None => Ok(()),
        }
    }

    pub(super) fn corrupt(&self, file: &str, path: &Path, reason: &str) -> HubError {
        let blob = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        HubError::Corrupt {
            repo: self.repo_id.clone(),
            file: file.to_string(),
            reason: format!(
                "{reason} (cached at {}, blob {})",
                path.display(),
                blob.display()
            ),
        }
    }
}

/// The distinct shard files a `model.safetensors.index.json` names in its `weight_map`: each a plain relative
/// path ([`names::check_relative`]), at most [`MAX_SHARDS`] of them.
///
/// # Errors
///
/// What is wrong, naming the offending value and the limit.
pub fn index_shards(json: &serde_json::Value) -> Result<BTreeSet<String>, String> {
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("no \"weight_map\" object")?;
    let mut shards = BTreeSet::new();
    for value in map.values() {
        let shard = value
            .as_str()
            .ok_or_else(|| format!("weight_map value {value} is not a string"))?;
        names::check_relative("shard", shard)
            .map_err(|reason| format!("weight_map names an invalid shard path: {reason}"))?;
        shards.insert(shard.to_string());
        if shards.len() > MAX_SHARDS {
            return Err(format!(
                "weight_map names more than the limit of {MAX_SHARDS} shards"
            ));
        }
    }
    if shards.is_empty() {
        return Err("empty weight_map".into());
    }
    Ok(shards)
}

/// Parses a JSON file; the outer error is I/O, the inner one a parse failure.
fn read_json(path: &Path) -> Result<Result<serde_json::Value, serde_json::Error>, HubError> {
    let file = File::open(path).map_err(|source| HubError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(serde_json::from_reader(BufReader::new(file)))
}

/// Checks a safetensors header: an 8-byte little-endian length, a JSON object of tensors whose
/// `data_offsets` are in order, and a data section that ends exactly at the end of the file. Only the header is
/// read: the safetensors crate's own check (`read_metadata`) needs the whole file in memory, shards are GBs.
///
/// # Errors
///
/// The outer error is I/O; the inner one says what is wrong with the header.
pub fn check_safetensors(path: &Path, size: u64) -> std::io::Result<Result<(), String>> {
    let mut file = File::open(path)?;
    let mut len = [0u8; 8];
    if size < 8 {
        return Ok(Err(format!(
            "{size} bytes, too short for a safetensors header"
        )));
    }
    file.read_exact(&mut len)?;
    let header_len = u64::from_le_bytes(len);
    if header_len > MAX_SAFETENSORS_HEADER || header_len > size - 8 {
        return Ok(Err(format!(
            "header length {header_len} does not fit a {size}-byte file (not safetensors)"
        )));
    }
    let mut header = Vec::new();
    file.take(header_len).read_to_end(&mut header)?;
    let Ok(serde_json::Value::Object(tensors)) =
        serde_json::from_slice::<serde_json::Value>(&header)
    else {
        return Ok(Err("safetensors header is not a JSON object".to_string()));
    };
    let mut data_end = 0u64;
    for (name, info) in tensors.iter().filter(|(name, _)| *name != "__metadata__") {
        let offsets = info.get("data_offsets").and_then(|o| o.as_array());
        let range = match offsets
            .map(|o| o.iter().map(serde_json::Value::as_u64).collect::<Vec<_>>())
            .as_deref()
        {
            Some([Some(start), Some(end)]) if start <= end => (*start, *end),
            _ => return Ok(Err(format!("tensor '{name}' has invalid data_offsets"))),
        };
        data_end = data_end.max(range.1);
    }
    let expected = 8 + header_len + data_end;
    if expected != size {
        return Ok(Err(format!(
            "header describes {expected} bytes but the file has {size} (truncated or padded)"
        )));
    }
    Ok(Ok(()))
}
