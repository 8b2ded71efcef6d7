//! A hostile Hub: the local stand-in Hub answering what an untrusted `HF_ENDPOINT` mirror (or anyone on a
//! plain-HTTP path) could answer. Each case must end in a typed error naming the file and what was refused,
//! and nothing may be written outside the HF cache (a temp dir): the whole temp root is walked afterwards.

#[path = "common/hub_server.rs"]
mod hub_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use glm5::hub::{resolve_model, HubError, HubOptions};
use hub_server::{Fault, HubServer, RepoFixture, ServerConfig};

const REPO: &str = "glm5-test/tiny-dense";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const SHARD: &str = "model-00002-of-00003.safetensors";
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":1,"world":2,"!":3},"unk_token":"<unk>"}}"#;

fn repo() -> RepoFixture {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dense_equiv");
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&fixtures).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".index.json")
        {
            files.insert(name, std::fs::read(&path).unwrap());
        }
    }
    files.insert("tokenizer.json".into(), TOKENIZER.as_bytes().to_vec());
    RepoFixture {
        id: REPO.into(),
        commit: COMMIT.into(),
        files,
    }
}

/// A temp root holding the cache (`root/cache`); nothing may appear anywhere else under it.
struct Sandbox {
    root: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("cache")).unwrap();
        Self { root }
    }

    fn cache(&self) -> PathBuf {
        self.root.path().join("cache")
    }

    /// A place a hostile name points at (absolute), outside the cache.
    fn outside(&self) -> PathBuf {
        self.root.path().join("outside").join("owned")
    }

    fn options(&self, server: &HubServer) -> HubOptions {
        HubOptions {
            endpoint: Some(server.url.clone()),
            cache_dir: Some(self.cache()),
            token: Some("hf_secret_token".into()),
            retries: Some(0),
            ..Default::default()
        }
    }

    /// Every entry under the root is the cache folder or inside it.
    fn assert_nothing_outside_the_cache(&self) {
        let mut stack = vec![self.root.path().to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                assert!(
                    path.starts_with(self.cache()),
                    "written outside the cache: {}",
                    path.display()
                );
                if path.is_dir() && !path.is_symlink() {
                    stack.push(path);
                }
            }
        }
        // Links in the snapshot point at blobs inside the cache, never outside.
        let snapshots = self.cache().join("models--glm5-test--tiny-dense/snapshots");
        if let Ok(commits) = std::fs::read_dir(&snapshots) {
            for commit in commits {
                for link in std::fs::read_dir(commit.unwrap().path()).unwrap() {
                    let link = link.unwrap().path();
                    if let Ok(target) = std::fs::canonicalize(&link) {
                        assert!(target.starts_with(std::fs::canonicalize(self.cache()).unwrap()));
                    }
                }
            }
        }
    }
}

fn serve(faults: Vec<Fault>) -> HubServer {
    HubServer::start(ServerConfig {
        repos: vec![repo()],
        faults,
        ..Default::default()
    })
}

fn header(file: &str, name: &str, value: &str) -> Fault {
    Fault::Header {
        file: file.into(),
        name: name.into(),
        value: value.into(),
    }
}

/// Resolving fails with `BadResponse` for `file`, its reason containing `needle`.
fn expect_refused(sandbox: &Sandbox, server: &HubServer, file: &str, needle: &str) {
    match resolve_model(REPO, &sandbox.options(server)) {
        Err(HubError::BadResponse {
            repo,
            file: got,
            reason,
        }) => {
            assert_eq!((repo.as_str(), got.as_str()), (REPO, file));
            assert!(reason.contains(needle), "{reason}");
        }
        other => panic!("expected BadResponse for {file}, got {other:?}"),
    }
    sandbox.assert_nothing_outside_the_cache();
}

#[test]
fn path_like_etags_are_refused() {
    let sandbox = Sandbox::new();
    let absolute = sandbox.outside().display().to_string();
    for (name, value) in [
        ("ETag", "\"../../../../outside/owned\"".to_string()),
        ("ETag", format!("\"{absolute}\"")),
        ("ETag", "W/\"..\"".to_string()),
        ("ETag", "\"a/b\"".to_string()),
        ("X-Linked-Etag", "\"../../../../outside/owned\"".to_string()),
    ] {
        for file in ["config.json", SHARD] {
            let server = serve(vec![header(file, name, &value)]);
            expect_refused(&sandbox, &server, file, "ETag");
            assert!(!sandbox.outside().exists());
        }
    }
}

#[test]
fn path_like_commits_are_refused() {
    let sandbox = Sandbox::new();
    for value in [
        "../../../../outside",
        "../../../outside/x",
        &sandbox.outside().display().to_string(),
        "main",
        "",
    ] {
        let server = serve(vec![header("config.json", "X-Repo-Commit", value)]);
        expect_refused(&sandbox, &server, "config.json", "X-Repo-Commit");
    }
    // Files after config.json are pinned to its commit: another valid commit is refused too.
    let other = "fedcba9876543210fedcba9876543210fedcba98";
    let server = serve(vec![header("tokenizer.json", "X-Repo-Commit", other)]);
    expect_refused(&sandbox, &server, "tokenizer.json", "pinned");
}

#[test]
fn a_path_like_commit_on_a_404_writes_no_marker() {
    // hf-hub writes `.no_exist/<X-Repo-Commit>/<file>` for a 404: the optional tokenizer_config.json is
    // absent here, and its 404 names a hostile commit. The run succeeds, and no marker escapes.
    let sandbox = Sandbox::new();
    let server = serve(vec![header(
        "tokenizer_config.json",
        "X-Repo-Commit",
        "../../../../outside",
    )]);
    let dir = resolve_model(REPO, &sandbox.options(&server)).unwrap();
    assert!(dir.join("config.json").is_file());
    sandbox.assert_nothing_outside_the_cache();
}

#[test]
fn wrong_and_missing_sizes_are_refused() {
    let sandbox = Sandbox::new();
    // A config.json announced at 10 GB is refused before a byte is fetched.
    let server = serve(vec![header("config.json", "X-Linked-Size", "10000000000")]);
    expect_refused(&sandbox, &server, "config.json", "limit");
    assert!(server.requests().iter().all(|r| r.method == "HEAD"));
    // A body longer than announced: cut off at the announced size, the partial blob removed.
    let sandbox = Sandbox::new();
    let server = serve(vec![Fault::Longer {
        file: SHARD.into(),
        extra: 1 << 20,
    }]);
    match resolve_model(REPO, &sandbox.options(&server)).unwrap_err() {
        HubError::Corrupt { file, reason, .. } => {
            assert_eq!(file, SHARD);
            assert!(reason.contains("more than"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let blobs = sandbox.cache().join("models--glm5-test--tiny-dense/blobs");
    assert!(std::fs::read_dir(&blobs).unwrap().all(|e| !e
        .unwrap()
        .path()
        .to_string_lossy()
        .ends_with(".incomplete")));
    sandbox.assert_nothing_outside_the_cache();

    // A HEAD announcing less than the file: the GET is cut off at the announced size too.
    let sandbox = Sandbox::new();
    let server = serve(vec![header(SHARD, "X-Linked-Size", "1000")]);
    assert!(matches!(
        resolve_model(REPO, &sandbox.options(&server)),
        Err(HubError::Corrupt { .. })
    ));
    sandbox.assert_nothing_outside_the_cache();
}

#[test]
fn an_endless_body_is_cut_off_at_the_announced_size() {
    let sandbox = Sandbox::new();
    let server = serve(vec![Fault::Endless { file: SHARD.into() }]);
    let started = Instant::now();
    match resolve_model(REPO, &sandbox.options(&server)).unwrap_err() {
        HubError::Corrupt { file, .. } => assert_eq!(file, SHARD),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    let size = repo().files[SHARD].len() as u64;
    let blobs = sandbox.cache().join("models--glm5-test--tiny-dense/blobs");
    let written: u64 = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(written <= 2 * size + (1 << 20), "{written} bytes in blobs");
    sandbox.assert_nothing_outside_the_cache();
}

#[test]
fn redirects_to_other_hosts_get_no_token_and_are_checked_like_any_body() {
    // The real Hub redirects shard GETs to its CDN, another host: allowed, but the token stays home.
    let cdn = HubServer::start(ServerConfig {
        repos: vec![repo()],
        ..Default::default()
    });
    let location = format!("{}/{REPO}/resolve/{COMMIT}/{SHARD}", cdn.url);
    let sandbox = Sandbox::new();
    let server = serve(vec![Fault::Redirect {
        file: SHARD.into(),
        location: location.clone(),
    }]);
    let dir = resolve_model(REPO, &sandbox.options(&server)).unwrap();
    assert_eq!(std::fs::read(dir.join(SHARD)).unwrap(), repo().files[SHARD]);
    let at_cdn = cdn.requests();
    assert!(at_cdn.iter().any(|r| r.path.ends_with(SHARD)));
    assert!(at_cdn.iter().all(|r| r.header("Authorization").is_none()));
    sandbox.assert_nothing_outside_the_cache();

    // The other host answers an endless body: cut off like any other.
    let endless = HubServer::start(ServerConfig {
        repos: vec![repo()],
        faults: vec![Fault::Endless { file: SHARD.into() }],
        ..Default::default()
    });
    let sandbox = Sandbox::new();
    let server = serve(vec![Fault::Redirect {
        file: SHARD.into(),
        location: format!("{}/{REPO}/resolve/{COMMIT}/{SHARD}", endless.url),
    }]);
    assert!(matches!(
        resolve_model(REPO, &sandbox.options(&server)),
        Err(HubError::Corrupt { .. })
    ));
    sandbox.assert_nothing_outside_the_cache();

    // A redirect to a file: URL or to itself is an error, never a read of a local file.
    for location in [
        "file:///etc/passwd".to_string(),
        format!("/{REPO}/resolve/{COMMIT}/{SHARD}"),
    ] {
        let sandbox = Sandbox::new();
        let server = serve(vec![Fault::Redirect {
            file: SHARD.into(),
            location,
        }]);
        // Not followed (reqwest hands the 302 back: an HTTP error naming it) or given up (a network error).
        match resolve_model(REPO, &sandbox.options(&server)) {
            Err(HubError::Network { file, .. }) => assert_eq!(file, SHARD),
            Err(HubError::Http { file, status, .. }) => {
                assert_eq!((file.as_str(), status), (SHARD, 302))
            }
            other => panic!("expected Network or Http, got {other:?}"),
        }
        sandbox.assert_nothing_outside_the_cache();
    }
}

#[test]
fn hostile_shard_names_in_the_index_are_refused() {
    for shard in ["../../../../outside/owned", "/etc/passwd", "a/../../b", ""] {
        let mut repo = repo();
        let index =
            serde_json::json!({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}});
        repo.files.insert(
            "model.safetensors.index.json".into(),
            serde_json::to_vec(&index).unwrap(),
        );
        let server = HubServer::start(ServerConfig {
            repos: vec![repo],
            ..Default::default()
        });
        let sandbox = Sandbox::new();
        match resolve_model(REPO, &sandbox.options(&server)).unwrap_err() {
            HubError::Corrupt { file, reason, .. } => {
                assert_eq!(file, "model.safetensors.index.json");
                assert!(reason.contains("shard"), "{reason}");
            }
            other => panic!("expected Corrupt for {shard:?}, got {other:?}"),
        }
        sandbox.assert_nothing_outside_the_cache();
    }
}

#[test]
fn a_path_like_revision_is_refused_before_any_request() {
    let sandbox = Sandbox::new();
    let server = serve(vec![]);
    for revision in ["../../../outside", "/abs", "a/../../b", ""] {
        let options = HubOptions {
            revision: Some(revision.into()),
            ..sandbox.options(&server)
        };
        assert!(
            matches!(
                resolve_model(REPO, &options),
                Err(HubError::InvalidRevision { .. })
            ),
            "{revision:?}"
        );
    }
    assert!(server.requests().is_empty());
    sandbox.assert_nothing_outside_the_cache();
}
