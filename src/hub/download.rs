//! glm5's own transfers into the HF cache: a `HEAD` read as hf-hub 1.0 reads it (relative redirects
//! followed, an absolute one, to a CDN, taken with its own headers), every server-supplied name checked
//! ([`names`]), then a `GET` at the commit the `HEAD` resolved to, continued with `Range: bytes=<len>-` when
//! an interrupted run left `blobs/<etag>.incomplete`, never longer than the size the `HEAD` announced, and
//! the cache layout written around it.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Write;

use indicatif::HumanBytes;
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_RANGE, LOCATION, RANGE};
use reqwest::{redirect, StatusCode, Url};

use super::*;

/// How long a run waits for another process that holds the lock on a blob.
const LOCK_WAIT: Duration = Duration::from_secs(600);

/// A file in the snapshot, and the size the Hub announced for it (`None`: taken from the cache unasked).
pub(super) struct Fetched {
    pub path: PathBuf,
    pub size: Option<u64>,
}

/// What the Hub's `HEAD` says about a file, every name checked.
struct Head {
    /// Blob name: `X-Linked-Etag`, else `ETag`, without `W/` and quotes.
    etag: String,
    /// `X-Repo-Commit`: the snapshot folder.
    commit: String,
    /// `X-Linked-Size`, else `Content-Length`.
    size: u64,
}

/// A connection or timeout failure: the Hub is unreachable, the cache may serve.
pub(super) fn is_unreachable(err: &HubError) -> bool {
    matches!(err, HubError::Network { source: HFError::Request { source, .. }, .. }
        if source.is_connect() || source.is_timeout())
}

impl Fetcher<'_> {
    /// Downloads `file` at the current revision into the cache (or finds its blob there) and links it into
    /// the snapshot; `None` when the Hub says it does not exist.
    ///
    /// # Errors
    ///
    /// [`HubError::BadResponse`] for a name that may not become a path or a missing or oversized size;
    /// [`HubError::Network`] when the transfer fails or stops short (what arrived stays in
    /// `blobs/<etag>.incomplete` for the next run); [`HubError::Corrupt`] when more bytes arrive than were
    /// announced; the HTTP status errors.
    pub(super) fn fetch_file(&self, file: &str) -> Result<Option<Fetched>, HubError> {
        names::check_relative("file", file).map_err(|reason| self.bad_response(file, reason))?;
        if names::is_commit_hash(&self.revision) {
            // Pinned to a commit: a file already in its snapshot is used without asking the Hub (as hf-hub).
            let path = self.snapshot_dir(&self.revision).join(file);
            if path.is_file() {
                return Ok(Some(Fetched { path, size: None }));
            }
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
                        .block_on(self.fetch_async(file))
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    async fn fetch_async(&self, file: &str) -> Result<Option<Fetched>, HubError> {
        let Some(head) = self.head(file).await? else {
            return Ok(None);
        };
        let blob = self.blobs_dir().join(&head.etag);
        if !blob.is_file() {
            let _lock = self.lock_blob(file, &head.etag).await?;
            if !blob.is_file() {
                self.get(file, &head, &blob).await?;
            }
        }
        let path = self.link(file, &head)?;
        Ok(Some(Fetched {
            path,
            size: Some(head.size),
        }))
    }

    fn client(&self, file: &str, policy: redirect::Policy) -> Result<reqwest::Client, HubError> {
        reqwest::Client::builder()
            .user_agent(concat!("glm5/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(STALL_TIMEOUT)
            .redirect(policy)
            .build()
            .map_err(|e| self.network(file, e))
    }

    /// `HEAD` of `file` at the current revision; `None` on 404 (recorded in `.no_exist` as hf-hub does).
    async fn head(&self, file: &str) -> Result<Option<Head>, HubError> {
        let client = self.client(file, redirect::Policy::none())?;
        let mut url = self.resolve_url(&self.revision, file)?;
        let mut hops = 0;
        let response = loop {
            let response = self
                .send(file, || client.head(url.clone()).headers(self.auth()))
                .await?;
            let location = text(response.headers(), LOCATION.as_str());
            match location.filter(|l| response.status().is_redirection() && is_relative(l)) {
                Some(location) if hops < MAX_REDIRECTS => {
                    hops += 1;
                    url = url.join(location).map_err(|e| {
                        self.bad_response(file, format!("redirect to {location:?}: {e}"))
                    })?;
                }
                Some(_) => {
                    return Err(
                        self.bad_response(file, format!("more than {MAX_REDIRECTS} redirects"))
                    )
                }
                None => break response,
            }
        };
        let (status, headers) = (response.status(), response.headers());
        if status == StatusCode::NOT_FOUND {
            if let Some(commit) =
                text(headers, "x-repo-commit").filter(|c| names::is_commit_hash(c))
            {
                self.mark_absent(commit, file);
            }
            return Ok(None);
        }
        if !status.is_success() && !status.is_redirection() {
            return Err(self.status_error(file, status, headers));
        }
        let bad = |reason: String| self.bad_response(file, reason);
        let etag = text(headers, "x-linked-etag")
            .or_else(|| text(headers, "etag"))
            .ok_or_else(|| bad("no ETag".into()))?;
        let etag = etag.strip_prefix("W/").unwrap_or(etag).trim_matches('"');
        names::check_etag(etag).map_err(bad)?;
        let commit =
            text(headers, "x-repo-commit").ok_or_else(|| bad("no X-Repo-Commit".into()))?;
        names::check_commit(commit).map_err(bad)?;
        if names::is_commit_hash(&self.revision) && !commit.eq_ignore_ascii_case(&self.revision) {
            return Err(bad(format!(
                "X-Repo-Commit {commit} answers a request pinned to commit {}",
                self.revision
            )));
        }
        let size = text(headers, "x-linked-size")
            .or_else(|| text(headers, "content-length"))
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| bad("no size (X-Linked-Size or Content-Length)".into()))?;
        if !file.ends_with(".safetensors") && size > MAX_TEXT_FILE {
            return Err(bad(format!(
                "it announces {size} bytes, more than the limit of {MAX_TEXT_FILE} for a file other than weights"
            )));
        }
        Ok(Some(Head {
            etag: etag.to_string(),
            commit: commit.to_ascii_lowercase(),
            size,
        }))
    }

    /// Fetches `file` into `blob` through `<blob>.incomplete`, continuing what an interrupted run left there.
    async fn get(&self, file: &str, head: &Head, blob: &Path) -> Result<(), HubError> {
        let client = self.client(file, redirect::Policy::limited(MAX_REDIRECTS))?;
        let mut partial = OsString::from(blob);
        partial.push(INCOMPLETE);
        let partial = PathBuf::from(partial);
        let io = |source| HubError::Io {
            path: partial.clone(),
            source,
        };
        let left = std::fs::symlink_metadata(&partial)
            .ok()
            .filter(|m| m.is_file() && m.len() <= head.size)
            .map_or(0, |m| m.len());
        // Only a partial blob found when this run started is continued (not one another run is writing).
        let resumable = left > 0 && self.partials.lock().is_ok_and(|mut p| p.remove(&head.etag));
        let url = self.resolve_url(&head.commit, file)?;
        let request = |from: u64| {
            let request = client.get(url.clone()).headers(self.auth());
            if from > 0 {
                request.header(RANGE, format!("bytes={from}-"))
            } else {
                request
            }
        };
        if resumable {
            tracing::info!(repo = %self.repo_id, file, "resuming an interrupted download at byte {left} of {}", head.size);
        }
        let mut response = self
            .send(file, || request(if resumable { left } else { 0 }))
            .await?;
        let mut start = 0;
        match response.status() {
            StatusCode::OK => {}
            StatusCode::PARTIAL_CONTENT
                if resumable && range_fits(response.headers(), left, head.size) =>
            {
                start = left
            }
            status
                if resumable
                    && (status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE) =>
            {
                tracing::warn!(repo = %self.repo_id, file, "cannot resume (HTTP {status}): downloading it again");
                response = self.send(file, || request(0)).await?;
                if response.status() != StatusCode::OK {
                    return Err(self.status_error(file, response.status(), response.headers()));
                }
            }
            status => return Err(self.status_error(file, status, response.headers())),
        }
        if let Some(blobs) = blob.parent() {
            std::fs::create_dir_all(blobs).map_err(io)?;
        }
        let mut out = if start > 0 {
            OpenOptions::new().append(true).open(&partial)
        } else {
            File::create(&partial)
        }
        .map_err(io)?;
        let tracker = Tracker::new(file, self.bars.clone());
        let bar = tracker.bar(head.size);
        let mut done = start;
        loop {
            let chunk = match response.chunk().await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => break,
                Err(e) => {
                    tracker.abandon();
                    return Err(self.network(file, e));
                }
            };
            // Never more than announced: an endless or padded body is cut off here, not on a full disk.
            if done + chunk.len() as u64 > head.size {
                drop(out);
                tracker.abandon();
                let _ = std::fs::remove_file(&partial);
                return Err(self.corrupt(
                    file,
                    &partial,
                    &format!(
                        "the server sent more than the {} bytes it announced; the partial file was removed",
                        head.size
                    ),
                ));
            }
            out.write_all(&chunk).map_err(io)?;
            done += chunk.len() as u64;
            if let Some(bar) = bar {
                bar.set_position(done);
            }
        }
        out.flush().map_err(io)?;
        drop(out);
        if done < head.size {
            tracker.abandon();
            return Err(HubError::Network {
                repo: self.repo_id.clone(),
                file: file.to_string(),
                source: HFError::Other(format!(
                    "the connection closed after {done} of {} bytes",
                    head.size
                )),
            });
        }
        let from = (start > 0).then(|| format!(", resumed at {}", HumanBytes(start)));
        tracker.done(done, from.as_deref());
        std::fs::rename(&partial, blob).map_err(io)
    }

    /// Links `snapshots/<commit>/<file>` to `blobs/<etag>` (relative, as hf-hub) and records `refs/<revision>`.
    fn link(&self, file: &str, head: &Head) -> Result<PathBuf, HubError> {
        let pointer = self.snapshot_dir(&head.commit).join(file);
        let io = |source| HubError::Io {
            path: pointer.clone(),
            source,
        };
        if let Some(parent) = pointer.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        // From `snapshots/<commit>/<dirs of file>` up to the repo folder: one `..` per folder.
        let up = file.split('/').count() + 1;
        let target = (0..up)
            .fold(PathBuf::new(), |p, _| p.join(".."))
            .join("blobs")
            .join(&head.etag);
        let _ = std::fs::remove_file(&pointer);
        #[cfg(unix)]
        std::os::unix::fs::symlink(&target, &pointer).map_err(io)?;
        #[cfg(not(unix))]
        std::fs::copy(self.blobs_dir().join(&head.etag), &pointer).map_err(io)?;
        if !names::is_commit_hash(&self.revision) {
            self.write_ref(&head.commit)?;
        }
        Ok(pointer)
    }

    /// `refs/<revision>` ← `commit` (the revision was checked in `Fetcher::new`, the commit by `head`).
    fn write_ref(&self, commit: &str) -> Result<(), HubError> {
        let path = self
            .cache_dir
            .join(&self.repo_folder)
            .join("refs")
            .join(&self.revision);
        let io = |source| HubError::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        std::fs::write(&path, commit).map_err(io)
    }

    /// hf-hub's "does not exist at this commit" marker, so that offline runs skip the file as well.
    fn mark_absent(&self, commit: &str, file: &str) {
        let marker = self
            .cache_dir
            .join(&self.repo_folder)
            .join(".no_exist")
            .join(commit)
            .join(file);
        if let Some(parent) = marker.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&marker, b"");
        if !names::is_commit_hash(&self.revision) {
            let _ = self.write_ref(commit);
        }
    }

    fn blobs_dir(&self) -> PathBuf {
        self.cache_dir.join(&self.repo_folder).join("blobs")
    }

    fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.cache_dir
            .join(&self.repo_folder)
            .join("snapshots")
            .join(commit)
    }

    /// hf-hub's lock on a blob (`<cache>/.locks/models--owner--name/<etag>.lock`), so that no other run
    /// writes the same blob meanwhile; waits up to [`LOCK_WAIT`] for another process that holds it.
    async fn lock_blob(&self, file: &str, etag: &str) -> Result<File, HubError> {
        let dir = self.cache_dir.join(".locks").join(&self.repo_folder);
        let path = dir.join(format!("{etag}.lock"));
        let io = |source| HubError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let lock = File::create(&path).map_err(io)?;
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            match lock.try_lock() {
                Ok(()) => return Ok(lock),
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(HubError::Hub {
                        repo: self.repo_id.clone(),
                        file: Some(file.to_string()),
                        source: HFError::Other(format!(
                            "another process has held the cache lock {} for {} s",
                            path.display(),
                            LOCK_WAIT.as_secs()
                        )),
                    })
                }
                Err(std::fs::TryLockError::Error(source)) => return Err(io(source)),
            }
        }
    }

    /// Sends a request, again after a transient failure (connection, timeout, 5xx, 429) up to
    /// [`HubOptions::retries`] times with a doubling pause.
    async fn send(
        &self,
        file: &str,
        request: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, HubError> {
        let retries = self.options.retries.unwrap_or(DEFAULT_RETRIES);
        let mut attempt = 0;
        loop {
            let result = request().send().await;
            let transient = match &result {
                Ok(r) => {
                    r.status().is_server_error() || r.status() == StatusCode::TOO_MANY_REQUESTS
                }
                Err(e) => e.is_connect() || e.is_timeout(),
            };
            if !transient || attempt >= retries {
                return result.map_err(|e| self.network(file, e));
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(250 << attempt.min(5))).await;
        }
    }

    /// `{endpoint}/{owner}/{name}/resolve/{revision}/{file}`, segments percent-encoded.
    fn resolve_url(&self, revision: &str, file: &str) -> Result<Url, HubError> {
        let mut url =
            Url::parse(&format!("{}/{}/resolve", self.endpoint, self.repo_id)).map_err(|e| {
                HubError::Hub {
                    repo: self.repo_id.clone(),
                    file: Some(file.to_string()),
                    source: HFError::Other(format!("invalid endpoint {:?}: {e}", self.endpoint)),
                }
            })?;
        url.path_segments_mut()
            .map_err(|()| HubError::Hub {
                repo: self.repo_id.clone(),
                file: Some(file.to_string()),
                source: HFError::Other(format!("invalid endpoint {:?}", self.endpoint)),
            })?
            .push(revision)
            .extend(file.split('/'));
        Ok(url)
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

    fn network(&self, file: &str, e: reqwest::Error) -> HubError {
        HubError::Network {
            repo: self.repo_id.clone(),
            file: file.to_string(),
            source: e.into(),
        }
    }

    pub(super) fn bad_response(&self, file: &str, reason: String) -> HubError {
        HubError::BadResponse {
            repo: self.repo_id.clone(),
            file: file.to_string(),
            reason,
        }
    }

    /// An error status: the Hub's own message (`X-Error-Message`) kept, gated and unknown repos told apart.
    pub(super) fn status_error(
        &self,
        file: &str,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> HubError {
        let (repo, file, status) = (self.repo_id.clone(), file.to_string(), status.as_u16());
        let message = text(headers, "x-error-message").map(str::to_string);
        let code = text(headers, "x-error-code");
        match status {
            401 | 403 | 404 if code == Some("RepoNotFound") => HubError::RepoNotFound {
                repo,
                status: Some(status),
            },
            401 | 403 => HubError::Gated {
                repo,
                file,
                status,
                message,
            },
            _ => HubError::Http {
                repo,
                file,
                status,
                message,
            },
        }
    }
}

fn text<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `Content-Range: bytes <start>-<last>/<size>` (or `/*`) for the given start and size.
fn range_fits(headers: &HeaderMap, start: u64, size: u64) -> bool {
    let Some((span, total)) = text(headers, CONTENT_RANGE.as_str())
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

/// As hf-hub: a `Location` without scheme and host.
fn is_relative(location: &str) -> bool {
    Url::parse(location).is_err() && !location.starts_with("//")
}
