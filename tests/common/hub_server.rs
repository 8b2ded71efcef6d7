//! A tiny Hugging Face Hub stand-in for tests: HTTP/1.1 on 127.0.0.1 (free port), std only, one request per
//! connection (`Connection: close`). It answers the routes hf-hub 1.0 calls:
//! `HEAD|GET /{owner}/{name}/resolve/{rev}/{path}` (ETag, X-Repo-Commit, Content-Length, ranges, 304, 404 with
//! X-Repo-Commit), `GET /api/models/{owner}/{name}[/revision/{rev}]` and `.../tree/{rev}`.
//! The accept loop stops on drop, after a deadline, or after a bounded number of connections.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAX_CONNECTIONS: usize = 1000;
const LIFETIME: Duration = Duration::from_secs(60);

/// A repo the server hosts.
#[derive(Clone, Debug)]
pub struct RepoFixture {
    /// `owner/name`.
    pub id: String,
    /// 40-hex commit of `main`.
    pub commit: String,
    /// Path in repo → bytes.
    pub files: BTreeMap<String, Vec<u8>>,
}

impl RepoFixture {
    /// The ETag the server gives `file` (also the blob name in the HF cache).
    pub fn etag(&self, file: &str) -> Option<String> {
        self.files.get(file).map(|b| etag(b))
    }
}

/// Misbehaviour injected into `GET` of one file.
#[derive(Clone, Debug)]
pub enum Fault {
    /// The next `GET` of `file` (whole or ranged) announces its full `Content-Length` but sends only `after`
    /// body bytes, then closes. Each such fault fires once, in order.
    TruncateOnce { file: String, after: usize },
    /// `GET` of `file` ignores `Range` and answers `200` with the whole file.
    IgnoreRange { file: String },
    /// Every `GET` of `file` answers `status` with an HTML error page (its `HEAD` still says 200).
    ErrorBody { file: String, status: u16 },
    /// Every answer for `file` (`HEAD` and `GET`, found or 404) carries `name: value` in place of the
    /// server's own header of that name: a hostile `ETag`, `X-Repo-Commit`, `X-Linked-Size`, ...
    Header {
        file: String,
        name: String,
        value: String,
    },
    /// Every `GET` of `file` answers `302` with `Location: location`.
    Redirect { file: String, location: String },
    /// Every `GET` of `file` sends `extra` bytes more than the file (and says so in its `Content-Length`).
    Longer { file: String, extra: usize },
    /// Every `GET` of `file` answers `200` without `Content-Length` and sends bytes until the client hangs
    /// up (or 4 GiB, or 30 s, went by).
    Endless { file: String },
}

/// What the server hosts and how it fails.
#[derive(Clone, Debug, Default)]
pub struct ServerConfig {
    pub repos: Vec<RepoFixture>,
    /// Repo ids whose files answer 403 `GatedRepo` (their `/api/models` info is public).
    pub gated: Vec<String>,
    /// Status for unknown repos: 401 like the real Hub without a token (default), or 404.
    pub unknown_repo_status: Option<u16>,
    pub faults: Vec<Fault>,
}

/// One request as the server saw it, with the status it answered and the body bytes it sent.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub status: u16,
    pub body_sent: usize,
}

impl Request {
    /// A header's value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct Shared {
    config: ServerConfig,
    log: Mutex<Vec<Request>>,
    /// Faults already fired (for the `*Once` kinds).
    fired: Mutex<Vec<usize>>,
}

/// The running server; stops on drop.
pub struct HubServer {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HubServer {
    /// Binds a free port and serves `config` on a background thread.
    pub fn start(config: ServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let shared = Arc::new(Shared {
            config,
            log: Mutex::new(Vec::new()),
            fired: Mutex::new(Vec::new()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop));
            std::thread::spawn(move || accept_loop(listener, shared, stop))
        };
        Self {
            url,
            shared,
            stop,
            thread: Some(thread),
        }
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Request> {
        self.shared
            .log
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default()
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A URL nothing listens on (a port bound then released).
pub fn dead_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    format!("http://{addr}")
}

/// Deterministic 32-hex ETag (FNV-1a of the bytes, plus their length).
pub fn etag(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}{:016x}", bytes.len())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let deadline = Instant::now() + LIFETIME;
    let mut served = 0;
    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline && served < MAX_CONNECTIONS {
        match listener.accept() {
            Ok((stream, _)) => {
                served += 1;
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || {
                    let _ = handle(stream, &shared);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(_) => break,
        }
    }
}

fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        if buf.len() > 64 * 1024 {
            return Ok(None);
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let (Some(method), Some(path)) = (first.next(), first.next()) else {
        return Ok(None);
    };
    let headers = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(Some(Request {
        method: method.to_string(),
        path: path.to_string(),
        headers,
        status: 0,
        body_sent: 0,
    }))
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    /// Send bytes without end (no `Content-Length`) instead of `body`.
    endless: bool,
    body: Vec<u8>,
    /// Send only this many body bytes, then close (the announced length stays `body.len()`).
    truncate: Option<usize>,
}

impl Response {
    fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            endless: false,
            body: Vec::new(),
            truncate: None,
        }
    }
    fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }
    /// Replaces every header called `name` (case-insensitive).
    fn replace_header(mut self, name: &str, value: &str) -> Self {
        self.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        self.header(name, value)
    }
    fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }
    fn json(self, value: &str) -> Self {
        self.header("Content-Type", "application/json")
            .body(value.as_bytes())
    }
    fn error(status: u16, code: &str, message: &str) -> Self {
        Self::new(status)
            .header("X-Error-Code", code)
            .header("X-Error-Message", message)
            .json(&format!("{{\"error\":\"{message}\"}}"))
    }
}

fn handle(mut stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let Some(mut request) = read_request(&mut stream)? else {
        return Ok(());
    };
    let head = request.method == "HEAD";
    let response = route(&request, shared);
    let sent = if head || response.status == 304 {
        0
    } else {
        response
            .truncate
            .unwrap_or(response.body.len())
            .min(response.body.len())
    };
    request.status = response.status;
    request.body_sent = sent;
    if let Ok(mut log) = shared.log.lock() {
        log.push(request);
    }
    let reason = match response.status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        304 => "Not Modified",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        500 => "Internal Server Error",
        _ => "Other",
    };
    let mut out = format!("HTTP/1.1 {} {reason}\r\n", response.status);
    for (k, v) in &response.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if response.endless {
        out.push_str("Connection: close\r\n\r\n");
        stream.write_all(out.as_bytes())?;
        let chunk = vec![b'x'; 64 * 1024];
        let started = Instant::now();
        let mut sent = 0u64;
        while sent < 4 << 30 && started.elapsed() < Duration::from_secs(30) {
            if stream.write_all(&chunk).is_err() {
                break;
            }
            sent += chunk.len() as u64;
        }
        let _ = stream.shutdown(Shutdown::Both);
        return Ok(());
    }
    if !response
        .headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("Content-Length"))
    {
        out.push_str(&format!("Content-Length: {}\r\n", response.body.len()));
    }
    out.push_str("Connection: close\r\n\r\n");
    stream.write_all(out.as_bytes())?;
    stream.write_all(&response.body[..sent])?;
    stream.flush()?;
    let _ = stream.shutdown(Shutdown::Write);
    // Drain what the client may still send so that closing does not reset the connection.
    let mut sink = [0u8; 1024];
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    Ok(())
}

fn route(request: &Request, shared: &Shared) -> Response {
    let response = answer(request, shared);
    let path = request.path.split('?').next().unwrap_or_default();
    let mut response = response;
    for fault in &shared.config.faults {
        if let Fault::Header { file, name, value } = fault {
            if path.ends_with(&format!("/{file}")) {
                response = response.replace_header(name, value);
            }
        }
    }
    response
}

fn answer(request: &Request, shared: &Shared) -> Response {
    let config = &shared.config;
    let path = request.path.split('?').next().unwrap_or_default();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (api, parts) = match parts.as_slice() {
        ["api", "models", rest @ ..] => (true, rest),
        rest => (false, rest),
    };
    let [owner, name, rest @ ..] = parts else {
        return Response::error(404, "NotFound", "Not found");
    };
    let id = format!("{owner}/{name}");
    let Some(repo) = config.repos.iter().find(|r| r.id == id) else {
        let status = config.unknown_repo_status.unwrap_or(401);
        return Response::error(status, "RepoNotFound", "Repository not found");
    };
    let info = || format!("{{\"id\":\"{id}\",\"sha\":\"{}\"}}", repo.commit);
    let rev_ok = |rev: &str| rev == "main" || rev == repo.commit;
    let bad_rev = || Response::error(404, "RevisionNotFound", "Invalid rev id");
    if api {
        return match rest {
            [] => Response::new(200).json(&info()),
            ["revision", rev] if rev_ok(rev) => Response::new(200).json(&info()),
            ["tree", rev, ..] if rev_ok(rev) => {
                let entries: Vec<String> = repo
                    .files
                    .iter()
                    .map(|(p, b)| {
                        format!(
                            "{{\"type\":\"file\",\"oid\":\"{}\",\"size\":{},\"path\":\"{p}\"}}",
                            etag(b),
                            b.len()
                        )
                    })
                    .collect();
                Response::new(200).json(&format!("[{}]", entries.join(",")))
            }
            ["revision", _] | ["tree", ..] => bad_rev(),
            _ => Response::error(404, "NotFound", "Not found"),
        };
    }
    let ["resolve", rev, file @ ..] = rest else {
        return Response::error(404, "NotFound", "Not found");
    };
    if !rev_ok(rev) {
        return bad_rev();
    }
    if config.gated.contains(&id) {
        return Response::error(
            403,
            "GatedRepo",
            "Access to this model is restricted; you must accept its terms",
        );
    }
    let file = file.join("/");
    let Some(bytes) = repo.files.get(&file) else {
        return Response::error(404, "EntryNotFound", "Entry not found")
            .header("X-Repo-Commit", repo.commit.clone());
    };
    let tag = format!("\"{}\"", etag(bytes));
    let ok = |status| {
        Response::new(status)
            .header("ETag", tag.clone())
            .header("X-Repo-Commit", repo.commit.clone())
            .header("Accept-Ranges", "bytes")
    };
    if request.method == "HEAD" {
        if request.header("If-None-Match") == Some(tag.as_str()) {
            return ok(304);
        }
        return ok(200).body(bytes.clone());
    }
    let ignore_range = shared
        .config
        .faults
        .iter()
        .any(|f| matches!(f, Fault::IgnoreRange { file: f } if *f == file));
    let response = match request
        .header("Range")
        .filter(|_| !ignore_range)
        .and_then(|r| parse_range(r, bytes.len()))
    {
        Some(Ok((start, end))) => ok(206)
            .header(
                "Content-Range",
                format!("bytes {start}-{end}/{}", bytes.len()),
            )
            .body(&bytes[start..=end]),
        Some(Err(())) => {
            Response::new(416).header("Content-Range", format!("bytes */{}", bytes.len()))
        }
        None => ok(200).body(bytes.clone()),
    };
    fault(shared, &file, response)
}

/// Applies the first matching fault to the answer to a `GET` of `file`.
fn fault(shared: &Shared, file: &str, response: Response) -> Response {
    for (i, fault) in shared.config.faults.iter().enumerate() {
        match fault {
            Fault::TruncateOnce { file: f, after } if f == file => {
                let Ok(mut fired) = shared.fired.lock() else {
                    break;
                };
                if !fired.contains(&i) {
                    fired.push(i);
                    return Response {
                        truncate: Some(*after),
                        ..response
                    };
                }
            }
            Fault::Redirect { file: f, location } if f == file => {
                return Response::new(302).header("Location", location.clone());
            }
            Fault::Longer { file: f, extra } if f == file => {
                let mut body = response.body;
                body.extend(std::iter::repeat_n(b'x', *extra));
                return Response { body, ..response };
            }
            Fault::Endless { file: f } if f == file => {
                return Response {
                    endless: true,
                    ..Response::new(200)
                };
            }
            Fault::ErrorBody { file: f, status } if f == file => {
                let page = format!(
                    "<!DOCTYPE html><html><body><h1>{status} - Internal Error</h1></body></html>\n"
                );
                return Response::new(*status)
                    .header("Content-Type", "text/html")
                    .body(page);
            }
            _ => {}
        }
    }
    response
}

/// `bytes=a-b` / `bytes=a-` / `bytes=-n` → inclusive range; `Err` when unsatisfiable.
fn parse_range(header: &str, len: usize) -> Option<Result<(usize, usize), ()>> {
    let spec = header.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let last = len.checked_sub(1);
    let range = match (a.trim(), b.trim()) {
        ("", n) => n
            .parse::<usize>()
            .ok()
            .and_then(|n| last.map(|l| (len.saturating_sub(n), l))),
        (a, "") => a.parse::<usize>().ok().zip(last),
        (a, b) => a
            .parse::<usize>()
            .ok()
            .zip(b.parse::<usize>().ok().zip(last).map(|(b, l)| b.min(l))),
    };
    Some(range.filter(|(s, e)| s <= e).ok_or(()))
}
