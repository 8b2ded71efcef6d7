//! Model resolution: a local directory, or a Hugging Face Hub repo downloaded into the standard HF cache.
//!
//! [`resolve_model`] fetches only what glm5 needs (config, tokenizer, chat template, safetensors weights),
//! pins every file to the commit `config.json` resolved to, and validates each file it returns.
//!
//! The transfers are glm5's own (`download`), not hf-hub's: hf-hub 1.0 names the blob it writes after the
//! server's `ETag` and the snapshot folder after its `X-Repo-Commit` without checking either, so an untrusted
//! endpoint answering `ETag: "../../x"` could write anywhere; it stores an error page as the file (it does not
//! check the status of the body `GET`); and it does not resume an interrupted transfer. glm5 writes the same
//! cache layout (`blobs/<etag>`, `snapshots/<commit>/<file>` → `../../blobs/<etag>`, `refs/<revision>`,
//! `.no_exist/<commit>/<file>`, hf-hub's lock files), so hf-hub and the Python tools share it, but only after
//! every server-supplied name passed [`names`]. hf-hub still answers what writes nothing: the offline
//! cache lookup and the "does the repo / revision exist" API calls behind a missing `config.json`.
//!
//! Layout: `error` (what can fail), [`names`] (what may become a path), `download` (HEAD, ranged and
//! resumed GET, cache layout), `validate` (size and format checks), `progress` (the bars).

mod download;
mod error;
pub mod names;
mod progress;
pub mod validate;

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use hf_hub::repository::RepoTypeModel;
use hf_hub::{HFClient, HFClientSync, HFError, HFRepositorySync};
use indicatif::MultiProgress;

pub use error::HubError;
use progress::Tracker;

/// Files glm5 reads besides the weights: `(name, required)`, in download order.
const MODEL_FILES: [(&str, bool); 5] = [
    ("config.json", true),
    ("generation_config.json", false),
    ("tokenizer.json", true),
    ("tokenizer_config.json", false),
    ("chat_template.jinja", false),
];
const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
const DEFAULT_REVISION: &str = "main";
/// Upper bound for a safetensors JSON header (the format's own limit is 100 MB).
const MAX_SAFETENSORS_HEADER: u64 = 100 << 20;
/// Upper bound for every file that is not a safetensors shard (config, tokenizer, template, index): GLM-5's
/// largest, `tokenizer.json`, has about 20 MB.
pub const MAX_TEXT_FILE: u64 = 256 << 20;
/// Upper bound for the number of distinct shards an index may name (GLM-5 has 282).
pub const MAX_SHARDS: usize = 100_000;
/// Suffix of a blob while it is being written (hf-hub's).
const INCOMPLETE: &str = ".incomplete";
/// A transfer gives up when connecting takes this long ...
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// ... or when the connection stays silent this long; what arrived so far stays for the next run.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Redirects a `GET` follows (the Hub sends one, to its CDN); a `HEAD` follows only relative ones.
const MAX_REDIRECTS: usize = 10;
/// Retries after a transient failure when [`HubOptions::retries`] is `None` (hf-hub's default).
const DEFAULT_RETRIES: usize = 5;

/// Where and how [`resolve_model`] fetches a model.
#[derive(Clone, Default)]
pub struct HubOptions {
    /// Branch, tag or commit to fetch; `None` means `main`.
    pub revision: Option<String>,
    /// Serve everything from the local cache and never touch the network.
    pub offline: bool,
    /// Hub base URL (e.g. a mirror); `None` means hf-hub's default (`HF_ENDPOINT`, else huggingface.co).
    pub endpoint: Option<String>,
    /// Hub cache directory; `None` means hf-hub's default (`HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`).
    pub cache_dir: Option<PathBuf>,
    /// Access token; `None` lets hf-hub look up `HF_TOKEN`, `HF_TOKEN_PATH`, then `$HF_HOME/token`.
    pub token: Option<String>,
    /// Show one progress bar per downloaded file on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Retries after a transient HTTP failure (5xx, 429, connect error); `None` means hf-hub's default (5).
    pub retries: Option<usize>,
}

impl fmt::Debug for HubOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubOptions")
            .field("revision", &self.revision)
            .field("offline", &self.offline)
            .field("endpoint", &self.endpoint)
            .field("cache_dir", &self.cache_dir)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("progress", &self.progress)
            .field("retries", &self.retries)
            .finish()
    }
}

impl HubOptions {
    /// Options from the process environment; see [`HubOptions::from_vars`].
    #[must_use]
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Options from the Hugging Face environment variables, read through `var`:
    /// `HF_ENDPOINT` (mirror), `HF_HUB_OFFLINE` (`1`/`true`/`yes`/`on`), `HF_HUB_CACHE`, else `HF_HOME/hub`,
    /// and `HF_HUB_DISABLE_PROGRESS_BARS`. Empty values count as unset. The token is left to hf-hub,
    /// which reads `HF_TOKEN`, `HF_TOKEN_PATH` and the token file and honours `HF_HUB_DISABLE_IMPLICIT_TOKEN`.
    #[must_use]
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let truthy = |name: &str| {
            get(name).is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            })
        };
        let cache_dir = get("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| get("HF_HOME").map(|home| PathBuf::from(home).join("hub")));
        Self {
            revision: None,
            offline: truthy("HF_HUB_OFFLINE"),
            endpoint: get("HF_ENDPOINT"),
            cache_dir,
            token: None,
            progress: !truthy("HF_HUB_DISABLE_PROGRESS_BARS"),
            retries: None,
        }
    }
}

/// Resolves `id_or_dir` to a directory holding the model's files.
///
/// An existing directory is returned as is (it must contain `config.json`). Anything else is taken as a Hub
/// repo id `owner/name`: `config.json`, `tokenizer.json` (required), `generation_config.json`,
/// `tokenizer_config.json`, `chat_template.jinja` (optional, skipped when absent) and the weights
/// (`model.safetensors.index.json` plus every shard it names, else `model.safetensors`) are fetched into the
/// HF cache, all at the commit `config.json` resolved to, and the snapshot directory
/// `<cache>/models--owner--name/snapshots/<commit>/` is returned. Every file is validated (JSON parses,
/// safetensors header and size, size announced by the Hub).
///
/// # Errors
///
/// A [`HubError`] naming the repo, the file and the HTTP status where there is one: unknown or gated repo,
/// missing required file, network failure, file not cached in offline mode, or a corrupt file.
pub fn resolve_model(id_or_dir: &str, options: &HubOptions) -> Result<PathBuf, HubError> {
    let dir = Path::new(id_or_dir);
    if dir.is_dir() {
        if !dir.join("config.json").is_file() {
            return Err(HubError::NotAModelDir {
                path: dir.to_path_buf(),
            });
        }
        return Ok(dir.to_path_buf());
    }
    let (owner, name) = parse_repo_id(id_or_dir)?;
    Fetcher::new(owner, name, options)?.fetch()
}

/// The `config.json` of a local directory or a Hub repo id, fetching nothing else (what `glm5 plan` needs);
/// a path to a file is taken as the config itself.
///
/// # Errors
///
/// As [`resolve_model`], for `config.json` alone.
pub fn resolve_config(id_or_dir: &str, options: &HubOptions) -> Result<PathBuf, HubError> {
    let dir = Path::new(id_or_dir);
    if dir.is_file() {
        return Ok(dir.to_path_buf());
    }
    if dir.is_dir() {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(HubError::NotAModelDir {
                path: dir.to_path_buf(),
            });
        }
        return Ok(config);
    }
    let (owner, name) = parse_repo_id(id_or_dir)?;
    let fetcher = Fetcher::new(owner, name, options)?;
    let (file, _) = MODEL_FILES[0];
    fetcher
        .download(file, true)?
        .ok_or_else(|| fetcher.missing_config())
}

/// Splits and checks a Hub repo id (`owner/name`, letters, digits, `-`, `_`, `.`).
fn parse_repo_id(id: &str) -> Result<(&str, &str), HubError> {
    let invalid = |reason: &str| HubError::InvalidRepoId {
        id: id.to_string(),
        reason: reason.to_string(),
    };
    let (owner, name) = id
        .split_once('/')
        .ok_or_else(|| invalid("expected owner/name"))?;
    for part in [owner, name] {
        if part.is_empty() || part.len() > 96 {
            return Err(invalid("each part must have 1 to 96 characters"));
        }
        if !part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(invalid(
                "only letters, digits, '-', '_' and '.' are allowed, with one '/'",
            ));
        }
        if part.starts_with(['-', '.'])
            || part.ends_with(['-', '.'])
            || part.contains("--")
            || part.contains("..")
        {
            return Err(invalid(
                "no leading/trailing '-' or '.', and no '--' or '..'",
            ));
        }
    }
    Ok((owner, name))
}

/// One `resolve_model` run against one repo.
struct Fetcher<'a> {
    repo: HFRepositorySync<RepoTypeModel>,
    repo_id: String,
    options: &'a HubOptions,
    cache_dir: PathBuf,
    /// The revision asked for, then the commit `config.json` resolved to.
    revision: String,
    bars: Option<MultiProgress>,
    /// Hub base URL and token, as hf-hub uses them.
    endpoint: String,
    token: Option<String>,
    /// `models--owner--name`, the repo's folder in the cache.
    repo_folder: String,
    /// ETags of the interrupted downloads (`blobs/<etag>.incomplete`) found when the run started.
    partials: Mutex<BTreeSet<String>>,
}

impl<'a> Fetcher<'a> {
    fn new(owner: &str, name: &str, options: &'a HubOptions) -> Result<Self, HubError> {
        let repo_id = format!("{owner}/{name}");
        let revision = options
            .revision
            .clone()
            .unwrap_or_else(|| DEFAULT_REVISION.to_string());
        // `refs/<revision>` is a path in the cache: the user's revision is held to the same rule as a file.
        names::check_relative("revision", &revision).map_err(|reason| {
            HubError::InvalidRevision {
                revision: revision.clone(),
                reason,
            }
        })?;
        let hub_err = |source| HubError::Hub {
            repo: repo_id.clone(),
            file: None,
            source,
        };
        let mut builder = HFClient::builder();
        if let Some(endpoint) = &options.endpoint {
            builder = builder.endpoint(endpoint.as_str());
        }
        if let Some(dir) = &options.cache_dir {
            builder = builder.cache_dir(dir);
        }
        // Resolved here, not left to hf-hub, so that glm5's own transfers send the same token.
        let token = options.token.clone().or_else(implicit_token);
        if let Some(token) = &token {
            builder = builder.token(token.as_str());
        }
        if let Some(retries) = options.retries {
            builder = builder.retry_max_attempts(retries);
        }
        let client = builder.build().map_err(hub_err)?;
        let cache_dir = client.cache_dir().to_path_buf();
        let endpoint = client.endpoint().trim_end_matches('/').to_string();
        let repo_folder = format!("models--{owner}--{name}");
        let partials = std::fs::read_dir(cache_dir.join(&repo_folder).join("blobs"))
            .into_iter()
            .flatten()
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(INCOMPLETE).map(str::to_string)
            })
            .collect();
        let client = HFClientSync::from_inner(client).map_err(hub_err)?;
        Ok(Self {
            repo: client.model(owner, name),
            repo_id,
            options,
            cache_dir,
            revision,
            bars: options.progress.then(MultiProgress::new),
            endpoint,
            token,
            repo_folder,
            partials: Mutex::new(partials),
        })
    }

    fn fetch(mut self) -> Result<PathBuf, HubError> {
        let mut snapshot = None;
        for (file, required) in MODEL_FILES {
            let Some(path) = self.download(file, required)? else {
                continue;
            };
            if snapshot.is_none() {
                // config.json: pin every later file to the commit it resolved to.
                let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
                if let Some(commit) = dir.file_name().and_then(|c| c.to_str()) {
                    self.revision = commit.to_string();
                }
                snapshot = Some(dir);
            }
        }
        let snapshot = snapshot.unwrap_or_default();
        match self.download(INDEX_FILE, false)? {
            Some(index) => {
                for shard in self.shard_names(&index)? {
                    self.download(&shard, true)?;
                }
            }
            None => {
                self.download(SINGLE_WEIGHTS_FILE, true)?;
            }
        }
        Ok(snapshot)
    }

    /// Fetches (or finds in the cache) one file and validates it; `Ok(None)` for an absent optional file.
    fn download(&self, file: &str, required: bool) -> Result<Option<PathBuf>, HubError> {
        tracing::debug!(repo = %self.repo_id, file, revision = %self.revision, "resolving");
        if self.options.offline {
            return self.cached(file, required);
        }
        match self.fetch_file(file) {
            Ok(Some(fetched)) => {
                self.validate(file, &fetched.path, fetched.size)?;
                Ok(Some(fetched.path))
            }
            Ok(None) if !required => Ok(None),
            Ok(None) if file == MODEL_FILES[0].0 => Err(self.missing_config()),
            Ok(None) => Err(HubError::FileNotFound {
                repo: self.repo_id.clone(),
                file: file.to_string(),
                revision: self.revision.clone(),
                status: Some(404),
            }),
            // The Hub is unreachable: what the cache holds for this revision is used, as hf-hub does.
            Err(err @ HubError::Network { .. }) if download::is_unreachable(&err) => {
                match self.cached(file, required) {
                    Ok(found @ Some(_)) => Ok(found),
                    Ok(None) => {
                        tracing::warn!(repo = %self.repo_id, file, "Hub unreachable, skipping optional file: {err}");
                        Ok(None)
                    }
                    Err(_) => Err(err),
                }
            }
            Err(err) => Err(err),
        }
    }

    /// One file from the local cache alone (hf-hub's lookup: `refs/<revision>`, the snapshot link, the
    /// `.no_exist` marker), validated without a size to compare with.
    fn cached(&self, file: &str, required: bool) -> Result<Option<PathBuf>, HubError> {
        let result = self
            .repo
            .download_file()
            .filename(file)
            .revision(self.revision.clone())
            .local_files_only(true)
            .send();
        match result {
            Ok(path) => {
                self.validate(file, &path, None)?;
                Ok(Some(path))
            }
            // An optional file that is not cached is skipped: snapshots made by other tools carry no
            // "does not exist" markers.
            Err(HFError::EntryNotFound { .. } | HFError::LocalEntryNotFound { .. })
                if !required =>
            {
                Ok(None)
            }
            Err(err) => Err(self.classify(err, file)),
        }
    }
}

/// The token hf-hub 1.0 finds by itself: `HF_TOKEN`, else the file named by `HF_TOKEN_PATH`, else
/// `$HF_HOME/token`; none when `HF_HUB_DISABLE_IMPLICIT_TOKEN` is set.
fn implicit_token() -> Option<String> {
    let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
    let read = |path: PathBuf| {
        std::fs::read_to_string(path)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    };
    if var("HF_HUB_DISABLE_IMPLICIT_TOKEN").is_some() {
        return None;
    }
    var("HF_TOKEN")
        .or_else(|| var("HF_TOKEN_PATH").and_then(|p| read(p.into())))
        .or_else(|| read(hf_hub::hf_home().join("token")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        assert!(parse_repo_id("zai-org/GLM-5").is_ok());
        for bad in [
            "glm5", "a/b/c", "/abs", "a/", "a/b c", "a/..", "-a/b", "a--b/c",
        ] {
            assert!(
                matches!(parse_repo_id(bad), Err(HubError::InvalidRepoId { .. })),
                "{bad}"
            );
        }
    }
}
