//! Why a model could not be resolved, and how hf-hub's and HTTP's failures map onto it.

use super::*;

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
    /// The Hub's answer cannot be used: a server-supplied name that may not become a path (an `ETag` or
    /// `X-Repo-Commit` with `/`, `..` or other characters), a missing header, a size above the limit.
    #[error("refusing the Hub's answer for {file} in {repo}: {reason}")]
    BadResponse {
        /// Repo id.
        repo: String,
        /// The file asked for.
        file: String,
        /// What is wrong with the answer, and the limit where there is one.
        reason: String,
    },
    /// The revision cannot name a folder of the cache (`..`, a leading `/`, ...).
    #[error("invalid revision {revision:?}: {reason}")]
    InvalidRevision {
        /// The revision as given.
        revision: String,
        /// What is wrong with it.
        reason: String,
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

impl Fetcher<'_> {
    /// `config.json` is missing: tell a missing repo or revision apart from a missing file.
    pub(super) fn missing_config(&self) -> HubError {
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

    /// An hf-hub error (from the cache lookup or the existence checks) as a [`HubError`].
    pub(super) fn classify(&self, err: HFError, file: &str) -> HubError {
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
}
