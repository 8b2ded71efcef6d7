//! Which names may become paths in the HF cache.
//!
//! The cache layout is `<cache>/models--owner--name/{blobs/<etag>, snapshots/<commit>/<file>, refs/<revision>,
//! .no_exist/<commit>/<file>}` and `<cache>/.locks/models--owner--name/<etag>.lock`. Three of those names come
//! from the server (`ETag`/`X-Linked-Etag`, `X-Repo-Commit`) or from a file it served (the shard names of
//! `model.safetensors.index.json`), one from the user (`--revision`). A name that is not one plain path
//! component (or, for files and revisions, a path of plain components) would let the answer of an untrusted
//! endpoint write anywhere the user can write, so each is checked here before anything is named after it.

use std::path::{Component, Path};

/// Longest ETag accepted: the Hub's are 40 (git blob sha1) or 64 (LFS sha256) hex digits.
pub const MAX_ETAG_LEN: usize = 128;
/// Longest revision or repo file path accepted (bytes).
pub const MAX_PATH_LEN: usize = 1024;

/// An ETag as a blob name: 1 to [`MAX_ETAG_LEN`] ASCII letters, digits, `-` or `_` (hex digests, and the
/// `<hex>-<n>` forms of S3-style mirrors). No `.`, `/`, `\`, NUL or anything else a path could use.
pub fn check_etag(etag: &str) -> Result<(), String> {
    if etag.is_empty() || etag.len() > MAX_ETAG_LEN {
        return Err(format!(
            "ETag {etag:?} must have 1 to {MAX_ETAG_LEN} characters"
        ));
    }
    if !etag
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "ETag {:?} may hold only letters, digits, '-' and '_'",
            truncate(etag)
        ));
    }
    Ok(())
}

/// A commit hash as a snapshot folder: exactly 40 hex digits (as hf-hub's `is_commit_hash`).
pub fn is_commit_hash(text: &str) -> bool {
    text.len() == 40 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `X-Repo-Commit` as a snapshot folder name.
pub fn check_commit(commit: &str) -> Result<(), String> {
    if is_commit_hash(commit) {
        Ok(())
    } else {
        Err(format!(
            "X-Repo-Commit {:?} is not a 40-hex-digit commit hash",
            truncate(commit)
        ))
    }
}

/// A repo-relative path (a file in the repo, a revision such as `refs/pr/1`): non-empty, at most
/// [`MAX_PATH_LEN`] bytes, `/`-separated plain components: no `..`, `.`, empty component, leading `/`,
/// backslash, drive prefix or control character.
pub fn check_relative(what: &str, path: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("{what} {:?} {why}", truncate(path)));
    if path.is_empty() || path.len() > MAX_PATH_LEN {
        return bad(&format!("must have 1 to {MAX_PATH_LEN} bytes"));
    }
    if path
        .chars()
        .any(|c| c.is_control() || c == '\\' || c == ':')
    {
        return bad("holds a control character, '\\' or ':'");
    }
    let plain = path
        .split('/')
        .all(|part| !part.is_empty() && part != "." && part != "..")
        && Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return bad(
            "is not a relative path of plain components (no '..', '.', '//' or leading '/')",
        );
    }
    Ok(())
}

/// The first 80 characters of a hostile value, for an error message.
fn truncate(text: &str) -> String {
    let mut end = text.len().min(80);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end < text.len() {
        format!("{}...", &text[..end])
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags() {
        for good in [
            "0123456789abcdef0123456789abcdef01234567",
            "d41d8cd98f00b204e9800998ecf8427e-12",
        ] {
            assert!(check_etag(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "..",
            "../../x/y",
            "/etc/passwd",
            "a/b",
            "a\\b",
            "a.b",
            "a\0b",
            "a b",
        ] {
            assert!(check_etag(bad).is_err(), "{bad:?}");
        }
        assert!(check_etag(&"a".repeat(MAX_ETAG_LEN + 1)).is_err());
    }

    #[test]
    fn commits_and_paths() {
        assert!(check_commit("0123456789abcdef0123456789abcdef01234567").is_ok());
        for bad in [
            "",
            "main",
            "../../../x",
            "0123456789abcdef0123456789abcdef0123456/",
        ] {
            assert!(check_commit(bad).is_err(), "{bad:?}");
        }
        for good in [
            "main",
            "refs/pr/1",
            "model-00001-of-00002.safetensors",
            "sub/a.bin",
        ] {
            assert!(check_relative("file", good).is_ok(), "{good}");
        }
        for bad in [
            "", "..", "../x", "a/../b", "/abs", "a//b", "./a", "a/", "C:x", "a\\..\\b", "a\nb",
        ] {
            assert!(check_relative("file", bad).is_err(), "{bad:?}");
        }
    }
}
