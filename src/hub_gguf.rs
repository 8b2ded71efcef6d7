//! One quantisation of a GGUF repo on the Hugging Face Hub: `--model unsloth/GLM-5-GGUF --quant UD-Q2_K_XL`
//! (or llama.cpp's `unsloth/GLM-5-GGUF:UD-Q2_K_XL`) lists the repo and downloads only that quantisation's
//! files (every split part) into the Hugging Face cache.
//!
//! Which files belong to a quantisation: its `.gguf` files in a folder named after it (`UD-Q2_K_XL/...`, how
//! large models are published), or files whose name, split suffix (`-00001-of-00007`) removed, ends in
//! `-QUANT` (`GLM-5-Q4_K_M.gguf`). `Q4_K_M` does not select `UD-Q4_K_M` files. Every downloaded part's header
//! is read back, so an error page stored as a file is caught.

use std::path::{Path, PathBuf};

use hf_hub::HFClient;

use crate::error::{Error, Result};
use crate::hub::HubOptions;

/// Splits llama.cpp's `owner/name:QUANT` form; `None` for a plain repo id or a path.
pub fn split_quant(id: &str) -> Option<(&str, &str)> {
    if Path::new(id).exists() {
        return None;
    }
    let (repo, quant) = id.rsplit_once(':')?;
    (repo.contains('/') && !quant.is_empty() && !quant.contains('/')).then_some((repo, quant))
}

/// The label a file gives its quantisation: its folder, and its name without `.gguf` and split suffix.
fn file_quant_matches(path: &str, quant: &str) -> bool {
    let Some(file) = path.strip_suffix(".gguf") else {
        return false;
    };
    let (folder, name) = match file.rsplit_once('/') {
        Some((folder, name)) => (folder.rsplit('/').next(), name),
        None => (None, file),
    };
    if folder.is_some_and(|f| f.eq_ignore_ascii_case(quant)) {
        return true;
    }
    let stem = match glm5_models::weights::gguf::split_part_name(Path::new(&format!("{name}.gguf")))
    {
        Some((prefix, _, _)) => prefix,
        None => name.to_string(),
    };
    let (stem, quant) = (stem.to_ascii_uppercase(), quant.to_ascii_uppercase());
    stem.ends_with(&format!("-{quant}"))
        && (quant.starts_with("UD-") || !stem.ends_with(&format!("UD-{quant}")))
}

/// The files of `quant` among a repo's `files`, sorted (first part first).
pub fn quant_files(files: &[String], quant: &str) -> Vec<String> {
    let mut chosen: Vec<String> = files
        .iter()
        .filter(|f| file_quant_matches(f, quant))
        .cloned()
        .collect();
    chosen.sort();
    chosen
}

/// Downloads (or finds in the cache) quantisation `quant` of GGUF repo `repo_id`; returns the path of its
/// first file, from which the other parts are found.
pub fn fetch_quant(repo_id: &str, quant: &str, options: &HubOptions) -> Result<PathBuf> {
    let hub_err = |what: String| Error::ModelFile {
        path: PathBuf::from(repo_id),
        reason: what,
    };
    let (owner, name) = repo_id
        .split_once('/')
        .ok_or_else(|| Error::InvalidOption(format!("{repo_id:?} is not an owner/name repo id")))?;
    let mut builder = HFClient::builder();
    if let Some(endpoint) = &options.endpoint {
        builder = builder.endpoint(endpoint.as_str());
    }
    if let Some(dir) = &options.cache_dir {
        builder = builder.cache_dir(dir);
    }
    if let Some(token) = &options.token {
        builder = builder.token(token.as_str());
    }
    if let Some(retries) = options.retries {
        builder = builder.retry_max_attempts(retries);
    }
    let client = builder.build_sync().map_err(|e| hub_err(e.to_string()))?;
    let repo = client.model(owner, name);
    let files: Vec<String> = if options.offline {
        Vec::new()
    } else {
        repo.list_tree()
            .maybe_revision(options.revision.clone())
            .recursive(true)
            .send()
            .map_err(|e| hub_err(format!("cannot list the repo: {e}")))?
            .into_iter()
            .filter_map(|entry| match entry {
                hf_hub::repository::RepoTreeEntry::File { path, .. } => Some(path),
                _ => None,
            })
            .collect()
    };
    if options.offline {
        return Err(hub_err(
            "--offline: give the downloaded .gguf file (or its folder) as --model instead".into(),
        ));
    }
    let chosen = quant_files(&files, quant);
    if chosen.is_empty() {
        let mut available: Vec<&str> = files
            .iter()
            .filter(|f| f.ends_with(".gguf"))
            .map(String::as_str)
            .collect();
        available.truncate(20);
        return Err(hub_err(format!(
            "no .gguf files of quantisation {quant:?}; the repo has: {}",
            available.join(", ")
        )));
    }
    let mut first = None;
    for file in &chosen {
        let path = repo
            .download_file()
            .filename(file.as_str())
            .maybe_revision(options.revision.clone())
            .send()
            .map_err(|e| hub_err(format!("cannot download {file}: {e}")))?;
        // An error page stored as the file fails here, naming it.
        glm5_models::weights::gguf::GgufHeader::read(&path).map_err(|e| {
            hub_err(format!(
                "{file} is not a readable GGUF file ({e}); delete it from the cache and retry"
            ))
        })?;
        first.get_or_insert(path);
    }
    first.ok_or_else(|| hub_err("nothing downloaded".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantisation_selects_its_own_files_only() {
        let files: Vec<String> = [
            "README.md",
            "UD-Q2_K_XL/GLM-5-UD-Q2_K_XL-00001-of-00002.gguf",
            "UD-Q2_K_XL/GLM-5-UD-Q2_K_XL-00002-of-00002.gguf",
            "Q4_K_M/GLM-5-Q4_K_M-00001-of-00002.gguf",
            "Q4_K_M/GLM-5-Q4_K_M-00002-of-00002.gguf",
            "UD-Q4_K_M/GLM-5-UD-Q4_K_M-00001-of-00001.gguf",
            "GLM-5-Q8_0.gguf",
            "GLM-5-UD-Q8_0.gguf",
            "UD-IQ2_XXS/GLM-5-UD-IQ2_XXS-00001-of-00002.gguf",
            "UD-IQ2_XXS/GLM-5-UD-IQ2_XXS-00002-of-00002.gguf",
            "IQ4_XS/GLM-5-IQ4_XS-00001-of-00001.gguf",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            quant_files(&files, "UD-Q2_K_XL"),
            [
                "UD-Q2_K_XL/GLM-5-UD-Q2_K_XL-00001-of-00002.gguf",
                "UD-Q2_K_XL/GLM-5-UD-Q2_K_XL-00002-of-00002.gguf"
            ]
        );
        assert_eq!(
            quant_files(&files, "q4_k_m"),
            [
                "Q4_K_M/GLM-5-Q4_K_M-00001-of-00002.gguf",
                "Q4_K_M/GLM-5-Q4_K_M-00002-of-00002.gguf"
            ]
        );
        assert_eq!(quant_files(&files, "Q8_0"), ["GLM-5-Q8_0.gguf"]);
        assert!(quant_files(&files, "Q2_K").is_empty());
        // i-quant names: the UD- variant only when asked for, and no partial name matches.
        assert_eq!(
            quant_files(&files, "UD-IQ2_XXS"),
            [
                "UD-IQ2_XXS/GLM-5-UD-IQ2_XXS-00001-of-00002.gguf",
                "UD-IQ2_XXS/GLM-5-UD-IQ2_XXS-00002-of-00002.gguf"
            ]
        );
        assert!(quant_files(&files, "IQ2_XXS").is_empty());
        assert!(quant_files(&files, "XXS").is_empty());
        assert_eq!(
            quant_files(&files, "iq4_xs"),
            ["IQ4_XS/GLM-5-IQ4_XS-00001-of-00001.gguf"]
        );
        assert_eq!(
            split_quant("unsloth/GLM-5-GGUF:UD-Q2_K_XL"),
            Some(("unsloth/GLM-5-GGUF", "UD-Q2_K_XL"))
        );
        assert_eq!(split_quant("unsloth/GLM-5-GGUF"), None);
    }
}
