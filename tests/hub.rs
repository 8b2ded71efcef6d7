//! Hub download layer against a local stand-in Hub (no internet): cache layout, offline reuse, typed errors,
//! interrupted downloads resumed, and error pages stored as files.

#[path = "common/hub_server.rs"]
mod hub_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glm5::hub::{resolve_model, HubError, HubOptions};
use hub_server::{dead_endpoint, Fault, HubServer, RepoFixture, ServerConfig};

const REPO: &str = "glm5-test/tiny-dense";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const SHARDS: [&str; 3] = [
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
];
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":1,"world":2,"!":3},"unk_token":"<unk>"}}"#;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dense_equiv")
}

/// The dense fixture checkpoint as a Hub repo: no `tokenizer_config.json` (optional, absent), plus a README
/// that glm5 must not download.
fn repo() -> RepoFixture {
    let mut files = BTreeMap::new();
    for name in ["config.json", "model.safetensors.index.json"]
        .into_iter()
        .chain(SHARDS)
    {
        files.insert(
            name.to_string(),
            std::fs::read(fixture_dir().join(name)).expect("fixture file"),
        );
    }
    files.insert("tokenizer.json".into(), TOKENIZER.as_bytes().to_vec());
    files.insert(
        "generation_config.json".into(),
        br#"{"eos_token_id":[2,3],"temperature":0.6}"#.to_vec(),
    );
    files.insert(
        "chat_template.jinja".into(),
        b"{% for m in messages %}{{ m.content }}{% endfor %}".to_vec(),
    );
    files.insert("README.md".into(), b"# tiny\n".to_vec());
    RepoFixture {
        id: REPO.into(),
        commit: COMMIT.into(),
        files,
    }
}

fn serve(repo: RepoFixture, faults: Vec<Fault>) -> HubServer {
    HubServer::start(ServerConfig {
        repos: vec![repo],
        faults,
        ..Default::default()
    })
}

fn options(endpoint: &str, cache: &Path) -> HubOptions {
    HubOptions {
        endpoint: Some(endpoint.to_string()),
        cache_dir: Some(cache.to_path_buf()),
        token: Some("hf_test_token".into()),
        retries: Some(0),
        ..Default::default()
    }
}

const DOWNLOADED: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];

fn assert_model_files(dir: &Path, repo: &RepoFixture) {
    for name in DOWNLOADED.into_iter().chain(SHARDS) {
        let bytes = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            bytes == repo.files[name],
            "{name} differs from the served bytes"
        );
    }
}

#[test]
fn download_lays_out_the_hf_cache() {
    let repo = repo();
    let server = serve(repo.clone(), vec![]);
    let cache = tempfile::tempdir().unwrap();
    let opts = HubOptions {
        progress: true,
        ..options(&server.url, cache.path())
    };

    let dir = resolve_model(REPO, &opts).unwrap();
    let root = cache.path().join("models--glm5-test--tiny-dense");
    assert_eq!(dir, root.join("snapshots").join(COMMIT));
    assert_eq!(
        std::fs::read_to_string(root.join("refs/main"))
            .unwrap()
            .trim(),
        COMMIT
    );
    assert_model_files(&dir, &repo);
    for name in DOWNLOADED.into_iter().chain(SHARDS) {
        let link = std::fs::read_link(dir.join(name)).unwrap();
        let etag = repo.etag(name).unwrap();
        assert_eq!(link, Path::new("../../blobs").join(&etag), "{name}");
        assert!(root.join("blobs").join(&etag).is_file());
    }
    // Only what glm5 needs; the absent optional file is remembered as absent.
    assert!(!dir.join("README.md").exists());
    assert!(!dir.join("tokenizer_config.json").exists());
    assert!(root
        .join(".no_exist")
        .join(COMMIT)
        .join("tokenizer_config.json")
        .exists());
    let blobs = std::fs::read_dir(root.join("blobs")).unwrap().count();
    assert_eq!(blobs, DOWNLOADED.len() + SHARDS.len());

    // Files after config.json are fetched at the commit config.json resolved to.
    let requests = server.requests();
    assert!(requests
        .iter()
        .any(|r| r.path.ends_with("/resolve/main/config.json")));
    assert!(requests.iter().any(|r| r
        .path
        .ends_with(&format!("/resolve/{COMMIT}/tokenizer.json"))));

    // A second online run downloads nothing: pinned-commit files come straight from the snapshot.
    let before = requests.iter().filter(|r| r.method == "GET").count();
    assert_eq!(resolve_model(REPO, &opts).unwrap(), dir);
    let after = server
        .requests()
        .iter()
        .filter(|r| r.method == "GET")
        .count();
    assert_eq!(before, after);
}

#[test]
fn single_file_weights_without_index() {
    let mut repo = repo();
    repo.files.remove("model.safetensors.index.json");
    let shard = repo.files.remove(SHARDS[0]).unwrap();
    repo.files.insert("model.safetensors".into(), shard.clone());
    let server = serve(repo, vec![]);
    let cache = tempfile::tempdir().unwrap();
    let dir = resolve_model(REPO, &options(&server.url, cache.path())).unwrap();
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), shard);
    assert!(!dir.join("model.safetensors.index.json").exists());
}

#[test]
fn offline_reuses_the_cache_without_a_server() {
    let repo = repo();
    let cache = tempfile::tempdir().unwrap();
    let online = {
        let server = serve(repo.clone(), vec![]);
        resolve_model(REPO, &options(&server.url, cache.path())).unwrap()
    }; // server stopped here

    let offline = HubOptions {
        offline: true,
        ..options(&dead_endpoint(), cache.path())
    };
    let dir = resolve_model(REPO, &offline).unwrap();
    assert_eq!(dir, online);
    assert_model_files(&dir, &repo);

    // Online but the Hub is unreachable: hf-hub falls back to the cache as well.
    let unreachable = options(&dead_endpoint(), cache.path());
    assert_eq!(resolve_model(REPO, &unreachable).unwrap(), online);
}

#[test]
fn offline_with_an_empty_cache_is_not_cached() {
    let cache = tempfile::tempdir().unwrap();
    let opts = HubOptions {
        offline: true,
        ..options(&dead_endpoint(), cache.path())
    };
    let err = resolve_model(REPO, &opts).unwrap_err();
    match &err {
        HubError::NotCached {
            repo,
            file,
            cache_dir,
            ..
        } => {
            assert_eq!((repo.as_str(), file.as_str()), (REPO, "config.json"));
            assert_eq!(cache_dir, cache.path());
        }
        other => panic!("expected NotCached, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("not in the local cache") && msg.contains("offline"),
        "{msg}"
    );
}

#[test]
fn unknown_repo_is_repo_not_found() {
    for status in [401, 404] {
        let server = HubServer::start(ServerConfig {
            repos: vec![repo()],
            unknown_repo_status: Some(status),
            ..Default::default()
        });
        let cache = tempfile::tempdir().unwrap();
        let err = resolve_model(
            "glm5-test/no-such-model",
            &options(&server.url, cache.path()),
        )
        .unwrap_err();
        match &err {
            HubError::RepoNotFound { repo, status: got } => {
                assert_eq!(repo, "glm5-test/no-such-model");
                assert_eq!(*got, Some(status));
            }
            other => panic!("expected RepoNotFound, got {other:?}"),
        }
        assert!(err.to_string().contains("glm5-test/no-such-model"));
    }
}

#[test]
fn unknown_revision_is_revision_not_found() {
    let server = serve(repo(), vec![]);
    let cache = tempfile::tempdir().unwrap();
    let opts = HubOptions {
        revision: Some("v9".into()),
        ..options(&server.url, cache.path())
    };
    match resolve_model(REPO, &opts).unwrap_err() {
        HubError::RevisionNotFound { repo, revision } => {
            assert_eq!((repo.as_str(), revision.as_str()), (REPO, "v9"))
        }
        other => panic!("expected RevisionNotFound, got {other:?}"),
    }
}

#[test]
fn missing_required_file_is_file_not_found() {
    let mut repo = repo();
    repo.files.remove("tokenizer.json");
    let server = serve(repo, vec![]);
    let cache = tempfile::tempdir().unwrap();
    let err = resolve_model(REPO, &options(&server.url, cache.path())).unwrap_err();
    match &err {
        HubError::FileNotFound {
            repo, file, status, ..
        } => {
            assert_eq!(
                (repo.as_str(), file.as_str(), *status),
                (REPO, "tokenizer.json", Some(404))
            );
        }
        other => panic!("expected FileNotFound, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains(REPO) && msg.contains("404"),
        "{msg}"
    );
}

#[test]
fn gated_repo_is_gated() {
    let server = HubServer::start(ServerConfig {
        repos: vec![repo()],
        gated: vec![REPO.into()],
        ..Default::default()
    });
    let cache = tempfile::tempdir().unwrap();
    match resolve_model(REPO, &options(&server.url, cache.path())).unwrap_err() {
        HubError::Gated {
            repo,
            file,
            status,
            message,
        } => {
            assert_eq!(
                (repo.as_str(), file.as_str(), status),
                (REPO, "config.json", 403)
            );
            assert!(message.unwrap_or_default().contains("restricted"));
        }
        other => panic!("expected Gated, got {other:?}"),
    }
}

/// The `GET`s of `file` the server answered: `(Range header, status, body bytes sent)`.
fn gets(server: &HubServer, file: &str) -> Vec<(Option<String>, u16, usize)> {
    server
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(&format!("/{file}")))
        .map(|r| (r.header("Range").map(str::to_string), r.status, r.body_sent))
        .collect()
}

/// Resolving fails with `Network` naming `shard` and leaves `<blob>.incomplete` of `len` bytes (its path).
fn expect_interrupted(opts: &HubOptions, repo: &RepoFixture, shard: &str, len: usize) -> PathBuf {
    match resolve_model(REPO, opts).unwrap_err() {
        HubError::Network { repo, file, .. } => {
            assert_eq!((repo.as_str(), file.as_str()), (REPO, shard))
        }
        other => panic!("expected Network, got {other:?}"),
    }
    let incomplete = opts
        .cache_dir
        .as_ref()
        .unwrap()
        .join("models--glm5-test--tiny-dense/blobs")
        .join(format!("{}.incomplete", repo.etag(shard).unwrap()));
    assert_eq!(std::fs::metadata(&incomplete).unwrap().len(), len as u64);
    incomplete
}

#[test]
fn interrupted_download_is_resumed() {
    let repo = repo();
    let shard = SHARDS[1];
    let (size, after) = (repo.files[shard].len(), 100_000);
    let server = serve(
        repo.clone(),
        vec![Fault::TruncateOnce {
            file: shard.into(),
            after,
        }],
    );
    let cache = tempfile::tempdir().unwrap();
    let opts = HubOptions {
        progress: true,
        ..options(&server.url, cache.path())
    };
    let incomplete = expect_interrupted(&opts, &repo, shard, after);

    // The next run asks only for the rest, gets 206, appends it, and hf-hub links the finished blob.
    let dir = resolve_model(REPO, &opts).unwrap();
    assert_model_files(&dir, &repo);
    assert!(!incomplete.exists());
    let etag = repo.etag(shard).unwrap();
    assert_eq!(
        std::fs::read_link(dir.join(shard)).unwrap(),
        Path::new("../../blobs").join(&etag)
    );
    let sent = gets(&server, shard);
    assert_eq!(
        sent,
        [
            (None, 200, after),
            (Some(format!("bytes={after}-")), 206, size - after)
        ]
    );
    assert_eq!(sent.iter().map(|g| g.2).sum::<usize>(), size);
    let ranged = server
        .requests()
        .into_iter()
        .find(|r| r.header("Range").is_some())
        .unwrap();
    assert_eq!(ranged.header("Authorization"), Some("Bearer hf_test_token"));
    assert!(ranged.path.contains(COMMIT), "{}", ranged.path);

    // Nothing is left to resume: a third run fetches nothing.
    assert_eq!(resolve_model(REPO, &opts).unwrap(), dir);
    assert_eq!(gets(&server, shard).len(), 2);
}

#[test]
fn resume_starts_over_when_the_server_ignores_range() {
    let repo = repo();
    let shard = SHARDS[1];
    let (size, after) = (repo.files[shard].len(), 100_000);
    let server = serve(
        repo.clone(),
        vec![
            Fault::TruncateOnce {
                file: shard.into(),
                after,
            },
            Fault::IgnoreRange { file: shard.into() },
        ],
    );
    let cache = tempfile::tempdir().unwrap();
    let opts = options(&server.url, cache.path());
    let incomplete = expect_interrupted(&opts, &repo, shard, after);

    // A 200 to the ranged GET carries the whole file: it replaces the partial one instead of being appended.
    let dir = resolve_model(REPO, &opts).unwrap();
    assert_model_files(&dir, &repo);
    assert!(!incomplete.exists());
    assert_eq!(
        gets(&server, shard),
        [
            (None, 200, after),
            (Some(format!("bytes={after}-")), 200, size)
        ]
    );
}

#[test]
fn resume_interrupted_again_keeps_what_arrived() {
    let repo = repo();
    let shard = SHARDS[1];
    let size = repo.files[shard].len();
    let truncate = |after| Fault::TruncateOnce {
        file: shard.into(),
        after,
    };
    let server = serve(repo.clone(), vec![truncate(100_000), truncate(50_000)]);
    let cache = tempfile::tempdir().unwrap();
    let opts = options(&server.url, cache.path());
    expect_interrupted(&opts, &repo, shard, 100_000);
    // The resumed transfer drops too: the partial file grows, and the run fails the same way.
    let incomplete = expect_interrupted(&opts, &repo, shard, 150_000);

    let dir = resolve_model(REPO, &opts).unwrap();
    assert_model_files(&dir, &repo);
    assert!(!incomplete.exists());
    let sent = gets(&server, shard);
    assert_eq!(
        sent,
        [
            (None, 200, 100_000),
            (Some("bytes=100000-".into()), 206, 50_000),
            (Some("bytes=150000-".into()), 206, size - 150_000)
        ]
    );
    assert_eq!(sent.iter().map(|g| g.2).sum::<usize>(), size);
}

#[test]
fn error_pages_are_never_stored_and_a_corrupt_cache_is_reported() {
    let repo = repo();
    let cache = tempfile::tempdir().unwrap();
    let snapshot = cache
        .path()
        .join("models--glm5-test--tiny-dense/snapshots")
        .join(COMMIT);
    for file in ["tokenizer.json", SHARDS[2]] {
        let server = serve(
            repo.clone(),
            vec![Fault::ErrorBody {
                file: file.into(),
                status: 500,
            }],
        );
        match resolve_model(REPO, &options(&server.url, cache.path())).unwrap_err() {
            HubError::Http {
                repo,
                file: got,
                status,
                ..
            } => assert_eq!((repo.as_str(), got.as_str(), status), (REPO, file, 500)),
            other => panic!("expected Http for {file}, got {other:?}"),
        }
        // The error page is not in the cache as if it were the file.
        assert!(!snapshot.join(file).exists());
    }

    // A blob damaged in the cache (by another tool, a disk error) is reported online and offline.
    let server = serve(repo.clone(), vec![]);
    let dir = resolve_model(REPO, &options(&server.url, cache.path())).unwrap();
    for file in ["tokenizer.json", SHARDS[2]] {
        let link = dir.join(file);
        let blob = std::fs::canonicalize(&link).unwrap();
        std::fs::write(&blob, "<!DOCTYPE html><h1>500</h1>").unwrap();
        let offline = HubOptions {
            offline: true,
            ..options(&dead_endpoint(), cache.path())
        };
        for opts in [options(&server.url, cache.path()), offline] {
            let err = resolve_model(REPO, &opts).unwrap_err();
            match &err {
                HubError::Corrupt {
                    repo, file: got, ..
                } => {
                    assert_eq!((repo.as_str(), got.as_str()), (REPO, file))
                }
                other => panic!("expected Corrupt for {file}, got {other:?}"),
            }
            assert!(err.to_string().contains("re-download"));
        }
        // Following the advice (delete the cached file and its blob) and retrying heals it.
        std::fs::remove_file(&blob).unwrap();
        std::fs::remove_file(&link).unwrap();
        let healed = resolve_model(REPO, &options(&server.url, cache.path())).unwrap();
        assert_model_files(&healed, &repo);
    }
}

#[test]
fn local_directory_and_invalid_ids() {
    let opts = HubOptions {
        offline: true,
        ..Default::default()
    };
    assert_eq!(
        resolve_model(fixture_dir().to_str().unwrap(), &opts).unwrap(),
        fixture_dir()
    );
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        resolve_model(empty.path().to_str().unwrap(), &opts),
        Err(HubError::NotAModelDir { .. })
    ));
    for bad in ["no-slash", "a/b/c", "./missing/dir", "owner/na me"] {
        assert!(
            matches!(
                resolve_model(bad, &opts),
                Err(HubError::InvalidRepoId { .. })
            ),
            "{bad}"
        );
    }
}

#[test]
fn options_from_environment_variables() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        HubOptions::from_vars(move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    };
    let none = env(&[]);
    assert!(!none.offline && none.progress);
    assert_eq!(
        (none.endpoint, none.cache_dir, none.token, none.revision),
        (None, None, None, None)
    );

    let all = env(&[
        ("HF_ENDPOINT", "https://hf-mirror.example"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HOME", "/data/hf"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "true"),
    ]);
    assert_eq!(all.endpoint.as_deref(), Some("https://hf-mirror.example"));
    assert!(all.offline && !all.progress);
    assert_eq!(all.cache_dir, Some(PathBuf::from("/data/hf/hub")));

    let cache = env(&[
        ("HF_HUB_CACHE", "/fast/hub"),
        ("HF_HOME", "/data/hf"),
        ("HF_HUB_OFFLINE", "0"),
    ]);
    assert_eq!(cache.cache_dir, Some(PathBuf::from("/fast/hub")));
    assert!(!cache.offline);
    assert!(env(&[("HF_HUB_OFFLINE", "YES")]).offline);
    assert_eq!(env(&[("HF_ENDPOINT", "")]).endpoint, None);

    // The debug output never shows the token.
    let secret = HubOptions {
        token: Some("hf_secret".into()),
        ..Default::default()
    };
    assert!(!format!("{secret:?}").contains("hf_secret"));
}
