//! Model resolution: a local directory, or a Hugging Face Hub repo downloaded into the standard HF cache.
//!
//! [`resolve_model`] fetches only what glm5 needs (config, tokenizer, chat template, safetensors weights)
//! through hf-hub's blocking client, pins every file to the commit `config.json` resolved to, and validates
//! each file it returns: hf-hub 1.0 does not check the status of the body `GET`, so an error page can be
//! stored in the cache as if it were the file ([`HubError::Corrupt`]).
//!
//! hf-hub 1.0 does not resume either: an interrupted transfer leaves `blobs/<etag>.incomplete`, and the next
//! run truncates it and starts over. So before handing a file to hf-hub, [`resolve_model`] continues such a
//! partial blob itself with a ranged `GET` (see `Fetcher::resume`) and renames it to `blobs/<etag>`, where
//! hf-hub then finds it and links it into the snapshot as if it had downloaded it.

use std::collections::BTreeSet;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use hf_hub::progress::{DownloadEvent, FileStatus, ProgressEvent, ProgressHandler};
use hf_hub::repository::RepoTypeModel;
use hf_hub::{HFClient, HFClientSync, HFError, HFRepositorySync};
use indicatif::{HumanBytes, MultiProgress, ProgressBar, ProgressStyle};
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_RANGE, LOCATION, RANGE};
use reqwest::{redirect, StatusCode, Url};

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
/// Suffix hf-hub gives a blob while it is being written.
const INCOMPLETE: &str = ".incomplete";
/// A resumed transfer gives up when connecting takes this long ...
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// ... or when the connection stays silent this long; what arrived so far stays for the next run.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

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

/// Why a model could not be resolved. Every Hub variant names the repo, and the file where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The argument is neither an existing directory nor an `owner/name` repo id.
    #[error("'{id}' is neither an existing local directory nor a valid Hub repo id (owner/name): {reason}")]
    InvalidRepoId {
        /// The argument as given.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A local directory was given but it holds no `config.json`.
    #[error("local model directory {} has no config.json", path.display())]
    NotAModelDir {
        /// The directory.
        path: PathBuf,
    },
    /// The repo does not exist (or is private and not visible with the current token).
    #[error("repository {repo} not found on the Hub{}: check the id, or set HF_TOKEN if it is private", http(*status))]
    RepoNotFound {
        /// Repo id.
        repo: String,
        /// HTTP status, when the Hub answered one.
        status: Option<u16>,
    },
    /// The requested revision does not exist in the repo.
    #[error("revision '{revision}' not found in {repo}")]
    RevisionNotFound {
        /// Repo id.
        repo: String,
        /// The revision asked for.
        revision: String,
    },
    /// Access was refused: a gated repo whose terms are not accepted, or a missing or invalid token.
    #[error(
        "access to {file} in {repo} refused (HTTP {status}{}): the repo is gated or private; accept its terms on \
         the Hub and set HF_TOKEN to a token that may read it",
        message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
    )]
    Gated {
        /// Repo id.
        repo: String,
        /// File being fetched.
        file: String,
        /// HTTP status (401 or 403).
        status: u16,
        /// The Hub's own message, if it sent one.
        message: Option<String>,
    },
    /// A required file does not exist in the repo at this revision.
    #[error("{file} not found in {repo} (revision {revision}){}", http(*status))]
    FileNotFound {
        /// Repo id.
        repo: String,
        /// Missing file.
        file: String,
        /// Revision (or the commit it resolved to).
        revision: String,
        /// HTTP status; `None` when known from a cached "does not exist" marker.
        status: Option<u16>,
    },
    /// Any other HTTP error status.
    #[error(
        "HTTP {status} fetching {file} from {repo}{}",
        message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
    )]
    Http {
        /// Repo id.
        repo: String,
        /// File being fetched.
        file: String,
        /// HTTP status.
        status: u16,
        /// The Hub's own message, if it sent one.
        message: Option<String>,
    },
    /// The transfer failed below HTTP (connection refused or dropped, timeout, TLS).
    #[error("network error fetching {file} from {repo}: {source}; run again to retry, or use offline mode if the model is cached")]
    Network {
        /// Repo id.
        repo: String,
        /// File being fetched.
        file: String,
        /// hf-hub's error.
        #[source]
        source: HFError,
    },
    /// Offline mode is on and the file is not in the local cache.
    #[error(
        "{file} of {repo} (revision {revision}) is not in the local cache {} and offline mode is on \
         (HF_HUB_OFFLINE / --offline): run once with network access to download it",
        cache_dir.display()
    )]
    NotCached {
        /// Repo id.
        repo: String,
        /// File looked up.
        file: String,
        /// Revision looked up.
        revision: String,
        /// The cache directory searched.
        cache_dir: PathBuf,
    },
    /// A cached or downloaded file is not what it should be (e.g. an error page stored as the file).
    #[error(
        "{file} from {repo} is corrupt: {reason}. Delete the cached file (and its blob) and run again to \
         re-download it"
    )]
    Corrupt {
        /// Repo id.
        repo: String,
        /// The faulty file.
        file: String,
        /// What is wrong, including the cached path.
        reason: String,
    },
    /// Reading a cached file failed.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Any other hf-hub failure (client setup, cache lock, malformed Hub response).
    #[error("Hub error for {repo}{}: {source}", file.as_deref().map(|f| format!(" ({f})")).unwrap_or_default())]
    Hub {
        /// Repo id.
        repo: String,
        /// File being fetched, if any.
        file: Option<String>,
        /// hf-hub's error.
        #[source]
        source: HFError,
    },
}

fn http(status: Option<u16>) -> String {
    status.map(|s| format!(" (HTTP {s})")).unwrap_or_default()
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
    /// Hub base URL and token, as hf-hub uses them (for [`Fetcher::resume`]).
    endpoint: String,
    token: Option<String>,
    /// `models--owner--name`, the repo's folder in the cache.
    repo_folder: String,
    /// ETags of the interrupted downloads (`blobs/<etag>.incomplete`) not resumed yet.
    partials: Mutex<BTreeSet<String>>,
}

impl<'a> Fetcher<'a> {
    fn new(owner: &str, name: &str, options: &'a HubOptions) -> Result<Self, HubError> {
        let repo_id = format!("{owner}/{name}");
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
        // Resolved here, not left to hf-hub, so that a resumed transfer sends the same token.
        let token = options.token.clone().or_else(implicit_token);
        if let Some(token) = &token {
            builder = builder.token(token.as_str());
        }
        if let Some(retries) = options.retries {
            builder = builder.retry_max_attempts(retries);
        }
        let client = builder.build().map_err(hub_err)?;
        let cache_dir = client.cache_dir().to_path_buf();
        let endpoint = client.endpoint().to_string();
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
            revision: options
                .revision
                .clone()
                .unwrap_or_else(|| DEFAULT_REVISION.to_string()),
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
        self.resume(file)?;
        let tracker = Arc::new(Tracker::new(file, self.bars.clone()));
        let result = self
            .repo
            .download_file()
            .filename(file)
            .revision(self.revision.clone())
            .local_files_only(self.options.offline)
            .progress(Arc::clone(&tracker))
            .send();
        let expected_size = tracker.finish();
        let err = match result {
            Ok(path) => {
                self.validate(file, &path, expected_size)?;
                return Ok(Some(path));
            }
            Err(err) => err,
        };
        match err {
            // Offline, an optional file that is not cached is skipped too: snapshots made by other tools carry
            // no "does not exist" markers.
            HFError::EntryNotFound { .. } | HFError::LocalEntryNotFound { .. } if !required => {
                Ok(None)
            }
            // Hub unreachable and nothing cached: hf-hub already tried the cache; go on without it.
            HFError::Request { ref source, .. }
                if !required && (source.is_connect() || source.is_timeout()) =>
            {
                tracing::warn!(repo = %self.repo_id, file, "Hub unreachable, skipping optional file: {err}");
                Ok(None)
            }
            HFError::EntryNotFound { .. } if file == MODEL_FILES[0].0 && !self.options.offline => {
                Err(self.missing_config())
            }
            err => Err(self.classify(err, file)),
        }
    }

    /// `config.json` is missing: tell a missing repo or revision apart from a missing file.
    fn missing_config(&self) -> HubError {
        let file = MODEL_FILES[0].0;
        match self.repo.exists().send() {
            Ok(false) => {
                return HubError::RepoNotFound {
                    repo: self.repo_id.clone(),
                    status: Some(404),
                }
            }
            Err(err) => return self.classify(err, file),
            Ok(true) => {}
        }
        if let Ok(false) = self.repo.revision_exists().revision(&self.revision).send() {
            return HubError::RevisionNotFound {
                repo: self.repo_id.clone(),
                revision: self.revision.clone(),
            };
        }
        HubError::FileNotFound {
            repo: self.repo_id.clone(),
            file: file.to_string(),
            revision: self.revision.clone(),
            status: Some(404),
        }
    }

    fn classify(&self, err: HFError, file: &str) -> HubError {
        let repo = self.repo_id.clone();
        let file = file.to_string();
        match err {
            HFError::RepoNotFound { context, .. } => HubError::RepoNotFound {
                repo,
                status: context.map(|c| c.status.as_u16()),
            },
            HFError::RevisionNotFound { .. } => HubError::RevisionNotFound {
                repo,
                revision: self.revision.clone(),
            },
            HFError::EntryNotFound { context, .. } => HubError::FileNotFound {
                repo,
                file,
                revision: self.revision.clone(),
                status: context
                    .map(|c| c.status.as_u16())
                    .or((!self.options.offline).then_some(404)),
            },
            HFError::AuthRequired { context } | HFError::Forbidden { context } => {
                let status = context.status.as_u16();
                if context.error_code.as_deref() == Some("RepoNotFound") {
                    HubError::RepoNotFound {
                        repo,
                        status: Some(status),
                    }
                } else {
                    HubError::Gated {
                        repo,
                        file,
                        status,
                        message: context.server_message,
                    }
                }
            }
            HFError::Http { context }
            | HFError::RateLimited { context, .. }
            | HFError::Conflict { context } => HubError::Http {
                repo,
                file,
                status: context.status.as_u16(),
                message: context.server_message,
            },
            HFError::LocalEntryNotFound { .. } => HubError::NotCached {
                repo,
                file,
                revision: self.revision.clone(),
                cache_dir: self.cache_dir.clone(),
            },
            err @ HFError::Request { .. } => HubError::Network {
                repo,
                file,
                source: err,
            },
            err => HubError::Hub {
                repo,
                file: Some(file),
                source: err,
            },
        }
    }

    /// The distinct shard files named by the index's `weight_map`, each a plain relative path.
    fn shard_names(&self, index: &Path) -> Result<BTreeSet<String>, HubError> {
        let corrupt = |reason: &str| self.corrupt(INDEX_FILE, index, reason);
        let json = read_json(index)?.map_err(|e| corrupt(&format!("not valid JSON ({e})")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| corrupt("no \"weight_map\" object"))?;
        let mut shards = BTreeSet::new();
        for value in map.values() {
            let shard = value
                .as_str()
                .ok_or_else(|| corrupt(&format!("weight_map value {value} is not a string")))?;
            let plain = Path::new(shard)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
            if shard.is_empty() || !plain {
                return Err(corrupt(&format!(
                    "weight_map names an invalid shard path '{shard}'"
                )));
            }
            shards.insert(shard.to_string());
        }
        if shards.is_empty() {
            return Err(corrupt("empty weight_map"));
        }
        Ok(shards)
    }

    /// Checks a file against the size the Hub announced and the format its extension implies.
    fn validate(
        &self,
        file: &str,
        path: &Path,
        expected_size: Option<u64>,
    ) -> Result<(), HubError> {
        let io = |source| HubError::Io {
            path: path.to_path_buf(),
            source,
        };
        let size = std::fs::metadata(path).map_err(io)?.len();
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

    fn corrupt(&self, file: &str, path: &Path, reason: &str) -> HubError {
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

/// What the Hub's `HEAD` says about a file.
struct Head {
    /// Blob name: `X-Linked-Etag`, else `ETag`, without `W/` and quotes.
    etag: String,
    /// `X-Repo-Commit`.
    commit: String,
    /// `X-Linked-Size`, else `Content-Length`.
    size: u64,
    /// `X-Xet-Hash` present: hf-hub fetches the file through Xet, not into `.incomplete`.
    xet: bool,
}

/// Resuming what an interrupted hf-hub download left in `blobs/<etag>.incomplete`.
impl Fetcher<'_> {
    /// Continues an interrupted download of `file`, if there is one, so that hf-hub then finds the blob.
    ///
    /// Runs only online and while some `.incomplete` blob is left. A `HEAD` read as hf-hub 1.0 reads it
    /// names the blob; if its `.incomplete` is shorter than the file, the rest is fetched (at the commit the
    /// `HEAD` resolved to) with `Range: bytes=<len>-` and appended, or, if the server answers `200` instead
    /// of `206`, written from the start; then the size is checked and the file renamed to `blobs/<etag>`,
    /// all under hf-hub's lock for that blob. hf-hub's `download_file` then sees the blob and links it into
    /// the snapshot (and writes `refs/<revision>`) as if it had downloaded it. What this cannot continue
    /// (failed `HEAD`, Xet-backed file, unknown size, lock held elsewhere, `416`, a `Content-Range` that does
    /// not fit) is left to hf-hub, which starts over.
    ///
    /// # Errors
    ///
    /// The ranged `GET` failed ([`HubError::Network`], also when the connection stalls for
    /// [`STALL_TIMEOUT`], [`HubError::Http`], [`HubError::Gated`]): the `.incomplete` file keeps what
    /// arrived, for the next run. [`HubError::Corrupt`] when more bytes arrived than the Hub announced.
    fn resume(&self, file: &str) -> Result<(), HubError> {
        if self.options.offline || self.partials.lock().map_or(true, |p| p.is_empty()) {
            return Ok(());
        }
        // A runtime of our own, on its own thread: this works even when the caller runs inside tokio.
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| HubError::Hub {
                            repo: self.repo_id.clone(),
                            file: Some(file.to_string()),
                            source: HFError::Other(format!("cannot start a tokio runtime: {e}")),
                        })?
                        .block_on(self.resume_async(file))
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    async fn resume_async(&self, file: &str) -> Result<(), HubError> {
        let client = |policy| {
            reqwest::Client::builder()
                .user_agent(concat!("glm5/", env!("CARGO_PKG_VERSION")))
                .connect_timeout(CONNECT_TIMEOUT)
                .read_timeout(STALL_TIMEOUT)
                .redirect(policy)
                .build()
        };
        let (Ok(head_client), Ok(get_client)) = (
            client(redirect::Policy::none()),
            client(redirect::Policy::default()),
        ) else {
            return Ok(());
        };
        let Some(head) = self.head(&head_client, file).await else {
            return Ok(());
        };
        let ours = self
            .partials
            .lock()
            .is_ok_and(|mut partials| partials.remove(&head.etag));
        if !ours || head.xet || head.size == 0 {
            return Ok(());
        }
        let blobs = self.cache_dir.join(&self.repo_folder).join("blobs");
        let blob = blobs.join(&head.etag);
        let partial = blobs.join(format!("{}{INCOMPLETE}", head.etag));
        let Some(_lock) = self.lock_blob(&head.etag) else {
            return Ok(());
        };
        let have = match std::fs::metadata(&partial) {
            Ok(meta) if !blob.exists() && (1..=head.size).contains(&meta.len()) => meta.len(),
            _ => return Ok(()),
        };
        if have < head.size {
            let tracker = Tracker::new(file, self.bars.clone());
            let fetched = self
                .fetch_rest(&get_client, file, &head, &partial, have, &tracker)
                .await;
            tracker.finish();
            if !fetched? {
                return Ok(());
            }
        }
        std::fs::rename(&partial, &blob).map_err(|source| HubError::Io {
            path: partial,
            source,
        })
    }

    /// `HEAD` of `file` at the current revision, read as hf-hub 1.0 reads it: relative redirects followed, an
    /// absolute one (to a CDN) taken with its own headers. `None` on any failure: hf-hub will report it.
    async fn head(&self, client: &reqwest::Client, file: &str) -> Option<Head> {
        let mut url = self.resolve_url(&self.revision, file)?;
        for _ in 0..=10 {
            let Ok(response) = client.head(url.clone()).headers(self.auth()).send().await else {
                // The Hub is unreachable: do not wait for it again for every later file of this run.
                self.partials.lock().map(|mut p| p.clear()).ok();
                return None;
            };
            let headers = response.headers();
            let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
            if response.status().is_redirection() {
                if let Some(location) = text(LOCATION.as_str()).filter(|l| is_relative_location(l))
                {
                    url = url.join(location).ok()?;
                    continue;
                }
            } else if !response.status().is_success() {
                return None;
            }
            let etag = text("x-linked-etag").or_else(|| text("etag"))?;
            return Some(Head {
                etag: etag
                    .strip_prefix("W/")
                    .unwrap_or(etag)
                    .trim_matches('"')
                    .to_string(),
                commit: text("x-repo-commit")?.to_string(),
                size: text("x-linked-size")
                    .or_else(|| text("content-length"))?
                    .parse()
                    .ok()?,
                xet: headers.contains_key("x-xet-hash"),
            });
        }
        None
    }

    /// Fetches `file` from byte `have` on into `partial`. `Ok(false)`: the server cannot continue it (the
    /// partial file is left to hf-hub, which starts over).
    async fn fetch_rest(
        &self,
        client: &reqwest::Client,
        file: &str,
        head: &Head,
        partial: &Path,
        have: u64,
        tracker: &Tracker,
    ) -> Result<bool, HubError> {
        let net = |e: reqwest::Error| HubError::Network {
            repo: self.repo_id.clone(),
            file: file.to_string(),
            source: e.into(),
        };
        let io = |source| HubError::Io {
            path: partial.to_path_buf(),
            source,
        };
        let Some(url) = self.resolve_url(&head.commit, file) else {
            return Ok(false);
        };
        tracing::info!(repo = %self.repo_id, file, "resuming an interrupted download at byte {have} of {}", head.size);
        let mut response = client
            .get(url)
            .headers(self.auth())
            .header(RANGE, format!("bytes={have}-"))
            .send()
            .await
            .map_err(net)?;
        let append = match response.status() {
            StatusCode::OK => false,
            StatusCode::PARTIAL_CONTENT if range_fits(response.headers(), have, head.size) => true,
            status if status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE => {
                tracing::warn!(repo = %self.repo_id, file, "cannot resume (HTTP {status}): downloading it again");
                return Ok(false);
            }
            status => return Err(self.status_error(file, status, response.headers())),
        };
        let mut out = if append {
            OpenOptions::new().append(true).open(partial)
        } else {
            File::create(partial)
        }
        .map_err(io)?;
        let mut done = if append { have } else { 0 };
        let bar = tracker.bar(head.size);
        while let Some(chunk) = response.chunk().await.map_err(net)? {
            out.write_all(&chunk).map_err(io)?;
            done += chunk.len() as u64;
            if let Some(bar) = bar {
                bar.set_position(done);
            }
        }
        if done < head.size {
            return Err(HubError::Network {
                repo: self.repo_id.clone(),
                file: file.to_string(),
                source: HFError::Other(format!(
                    "the connection closed after {done} of {} bytes",
                    head.size
                )),
            });
        }
        if done > head.size {
            let _ = std::fs::remove_file(partial);
            return Err(self.corrupt(
                file,
                partial,
                &format!("the resumed download gave {done} bytes, but the Hub announced {}; the partial file was removed", head.size),
            ));
        }
        if let (Some(bar), Some(bars)) = (bar, &self.bars) {
            bar.finish_and_clear();
            let from = if append {
                format!(", resumed at {}", HumanBytes(have))
            } else {
                String::new()
            };
            let _ = bars.println(format!("{file} ({}{from})", HumanBytes(done)));
        }
        Ok(true)
    }

    /// `{endpoint}/{owner}/{name}/resolve/{revision}/{file}`, segments percent-encoded.
    fn resolve_url(&self, revision: &str, file: &str) -> Option<Url> {
        let mut url = Url::parse(&format!("{}/{}/resolve", self.endpoint, self.repo_id)).ok()?;
        url.path_segments_mut()
            .ok()?
            .push(revision)
            .extend(file.split('/').filter(|s| !s.is_empty()));
        Some(url)
    }

    fn auth(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = self
            .token
            .as_ref()
            .and_then(|t| format!("Bearer {t}").parse().ok())
        {
            headers.insert(AUTHORIZATION, value);
        }
        headers
    }

    /// hf-hub's lock on a blob (`<cache>/.locks/models--owner--name/<etag>.lock`), so that no hf-hub
    /// download of the same blob runs meanwhile; `None` while another process holds it (or locking fails).
    fn lock_blob(&self, etag: &str) -> Option<File> {
        let dir = self.cache_dir.join(".locks").join(&self.repo_folder);
        std::fs::create_dir_all(&dir).ok()?;
        let lock = File::create(dir.join(format!("{etag}.lock"))).ok()?;
        lock.try_lock().ok()?;
        Some(lock)
    }

    /// The ranged `GET` answered an error status.
    fn status_error(&self, file: &str, status: StatusCode, headers: &HeaderMap) -> HubError {
        let (repo, file, status) = (self.repo_id.clone(), file.to_string(), status.as_u16());
        let message = headers
            .get("x-error-message")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if matches!(status, 401 | 403) {
            HubError::Gated {
                repo,
                file,
                status,
                message,
            }
        } else {
            HubError::Http {
                repo,
                file,
                status,
                message,
            }
        }
    }
}

/// `Content-Range: bytes <start>-<last>/<size>` (or `/*`) for the given start and size.
fn range_fits(headers: &HeaderMap, start: u64, size: u64) -> bool {
    let Some((span, total)) = headers
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes "))
        .and_then(|v| v.split_once('/'))
    else {
        return false;
    };
    let first = span
        .split_once('-')
        .and_then(|(a, _)| a.trim().parse().ok());
    first == Some(start) && (total.trim() == "*" || total.trim().parse() == Ok(size))
}

/// As hf-hub: a `Location` without scheme and host (one that is not a URL at all fails to join later).
fn is_relative_location(location: &str) -> bool {
    Url::parse(location).is_err() && !location.starts_with("//")
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
fn check_safetensors(path: &Path, size: u64) -> std::io::Result<Result<(), String>> {
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

/// Drives one progress bar for one file and records the size the Hub's `HEAD` announced.
struct Tracker {
    file: String,
    /// Size from the `HEAD` (0 = unknown).
    expected: AtomicU64,
    bars: Option<MultiProgress>,
    bar: OnceLock<ProgressBar>,
}

impl Tracker {
    fn new(file: &str, bars: Option<MultiProgress>) -> Self {
        Self {
            file: file.to_string(),
            expected: AtomicU64::new(0),
            bars,
            bar: OnceLock::new(),
        }
    }

    fn bar(&self, total: u64) -> Option<&ProgressBar> {
        let bars = self.bars.as_ref()?;
        Some(self.bar.get_or_init(|| {
            let style = ProgressStyle::with_template(
                "{msg:32!} [{bar:30}] {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {eta:>4}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            let bar = bars.add(ProgressBar::new(total).with_style(style));
            bar.set_message(self.file.clone());
            bar
        }))
    }

    /// Ends the bar (abandoned if the transfer did not complete) and returns the announced size.
    fn finish(&self) -> Option<u64> {
        if let Some(bar) = self.bar.get().filter(|b| !b.is_finished()) {
            bar.abandon();
        }
        Some(self.expected.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }
}

impl ProgressHandler for Tracker {
    fn on_progress(&self, event: &ProgressEvent) {
        let ProgressEvent::Download(event) = event else {
            return;
        };
        match event {
            DownloadEvent::Start {
                total_files: 1,
                total_bytes,
            } => self.expected.store(*total_bytes, Ordering::Relaxed),
            DownloadEvent::Progress { files } => {
                for f in files.iter().filter(|f| f.filename == self.file) {
                    if f.total_bytes > 0 {
                        self.expected.store(f.total_bytes, Ordering::Relaxed);
                    }
                    match f.status {
                        // Xet transfers may skip `Started`: any in-flight event creates the bar.
                        FileStatus::Started | FileStatus::InProgress => {
                            if let Some(bar) = self.bar(f.total_bytes) {
                                bar.set_position(f.bytes_completed);
                            }
                        }
                        FileStatus::Complete => {
                            // A finished bar leaves one line behind, so hundreds of shards do not pile up bars.
                            if let (Some(bar), Some(bars)) = (self.bar.get(), &self.bars) {
                                bar.finish_and_clear();
                                let _ = bars.println(format!(
                                    "{} ({})",
                                    self.file,
                                    HumanBytes(f.bytes_completed)
                                ));
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
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
