//! Image → local binary map ("image pull" of the process kubelet).
//!
//! The map file is a JSON object `{"<pattern>": "<absolute path>"}`. A pattern is matched
//! against the image's last repository path segment plus its tag and/or digest:
//!
//! * `name:*` (or a bare `name`) matches every tag and every digest of `name`;
//! * `name:tag` matches exactly that tag; `*` may be used as a glob inside the tag (`name:1.*`);
//! * `name@sha256:...` matches exactly that digest;
//! * `*` alone matches every image (a catch-all).
//!
//! When several patterns match, the most specific wins: an exact pattern (no `*`) beats a glob,
//! and among globs the one with more literal characters wins.
//!
//! The file is re-read for every container start, so editing it takes effect without a restart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A parsed image reference, reduced to what matching needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// Last repository path segment (`cli-mcp-agent` for `quay.io/x/cli-mcp-agent:1.2`).
    pub name: String,
    /// Tag; `None` when the reference has neither tag nor digest's tag (then `latest` applies).
    pub tag: Option<String>,
    /// Digest including algorithm (`sha256:abc…`).
    pub digest: Option<String>,
}

impl ImageRef {
    /// Parses `[registry[:port]/]path/name[:tag][@digest]`.
    pub fn parse(image: &str) -> Option<ImageRef> {
        let image = image.trim();
        if image.is_empty() {
            return None;
        }
        let (rest, digest) = match image.split_once('@') {
            Some((r, d)) if !d.is_empty() => (r, Some(d.to_string())),
            Some(_) => return None,
            None => (image, None),
        };
        let last = rest.rsplit('/').next().unwrap_or(rest);
        let (name, tag) = match last.split_once(':') {
            Some((n, t)) if !t.is_empty() => (n, Some(t.to_string())),
            Some(_) => return None,
            None => (last, None),
        };
        if name.is_empty() {
            return None;
        }
        Some(ImageRef {
            name: name.to_string(),
            tag,
            digest,
        })
    }

    /// The tag used for matching: the explicit tag, or `latest` when there is no digest.
    fn effective_tag(&self) -> Option<&str> {
        match (&self.tag, &self.digest) {
            (Some(t), _) => Some(t),
            (None, None) => Some("latest"),
            (None, Some(_)) => None,
        }
    }
}

/// Simple glob: `*` matches any (possibly empty) run of characters.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// How specifically a pattern matched; higher wins.
fn match_score(pattern: &str, image: &ImageRef) -> Option<(u8, usize)> {
    let literal = pattern.chars().filter(|c| *c != '*').count();
    if pattern == "*" {
        return Some((0, 0));
    }
    let exact = !pattern.contains('*');
    let score = |ok: bool| ok.then_some((if exact { 2 } else { 1 }, literal));
    if let Some((name, digest)) = pattern.split_once('@') {
        return score(
            glob_match(name, &image.name)
                && image
                    .digest
                    .as_deref()
                    .is_some_and(|d| glob_match(digest, d)),
        );
    }
    match pattern.split_once(':') {
        None => {
            // Bare name: every tag and digest of that name.
            glob_match(pattern, &image.name).then_some((1, literal))
        }
        Some((name, "*")) => glob_match(name, &image.name).then_some((1, literal)),
        Some((name, tag)) => score(
            glob_match(name, &image.name)
                && image.effective_tag().is_some_and(|t| glob_match(tag, t)),
        ),
    }
}

/// Why an image could not be resolved to a binary. Messages name the image and the map file.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ResolveError {
    #[error("cannot read image map {path}: {reason}; fix the --image-map file")]
    Unreadable { path: PathBuf, reason: String },
    #[error(
        "image {image:?} is not a valid image reference; use [registry/]path/name[:tag][@digest]"
    )]
    BadReference { image: String },
    #[error(
        "image {image:?} has no mapping in image map {path} (patterns: {patterns}); add an entry like {{\"{name}:*\": \"/absolute/path/to/binary\"}}"
    )]
    NoMapping {
        image: String,
        name: String,
        path: PathBuf,
        patterns: String,
    },
    #[error(
        "image {image:?} maps to {binary} (pattern {pattern:?} in {path}), which is not an executable file; build it or fix the map"
    )]
    MissingBinary {
        image: String,
        pattern: String,
        binary: PathBuf,
        path: PathBuf,
    },
}

/// The parsed map: pattern → binary path.
#[derive(Debug, Clone, Default)]
pub struct ImageMap {
    pub entries: BTreeMap<String, PathBuf>,
}

impl ImageMap {
    pub fn parse(json: &str) -> Result<ImageMap, String> {
        let raw: BTreeMap<String, String> = serde_json::from_str(json).map_err(|e| {
            format!("expected a JSON object {{\"pattern\": \"/absolute/binary\"}}: {e}")
        })?;
        let mut entries = BTreeMap::new();
        for (pattern, bin) in raw {
            let bin = PathBuf::from(bin);
            if !bin.is_absolute() {
                return Err(format!(
                    "pattern {pattern:?} maps to {}, which is not an absolute path",
                    bin.display()
                ));
            }
            entries.insert(pattern, bin);
        }
        Ok(ImageMap { entries })
    }

    pub fn load(path: &Path) -> Result<ImageMap, ResolveError> {
        let unreadable = |reason: String| ResolveError::Unreadable {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
        ImageMap::parse(&text).map_err(unreadable)
    }

    /// Returns `(pattern, binary)` of the most specific matching entry.
    pub fn lookup(&self, image: &ImageRef) -> Option<(&str, &Path)> {
        self.entries
            .iter()
            .filter_map(|(p, b)| match_score(p, image).map(|s| (s, p, b)))
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
            .map(|(_, p, b)| (p.as_str(), b.as_path()))
    }
}

/// Resolves `image` through the map file at `map_path` to an existing executable.
pub fn resolve(map_path: &Path, image: &str) -> Result<PathBuf, ResolveError> {
    let map = ImageMap::load(map_path)?;
    resolve_in(&map, map_path, image, is_executable)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

pub fn resolve_in(
    map: &ImageMap,
    map_path: &Path,
    image: &str,
    exists: impl Fn(&Path) -> bool,
) -> Result<PathBuf, ResolveError> {
    let parsed = ImageRef::parse(image).ok_or_else(|| ResolveError::BadReference {
        image: image.to_string(),
    })?;
    let Some((pattern, binary)) = map.lookup(&parsed) else {
        let patterns = if map.entries.is_empty() {
            "none".to_string()
        } else {
            map.entries.keys().cloned().collect::<Vec<_>>().join(", ")
        };
        return Err(ResolveError::NoMapping {
            image: image.to_string(),
            name: parsed.name,
            path: map_path.to_path_buf(),
            patterns,
        });
    };
    if !exists(binary) {
        return Err(ResolveError::MissingBinary {
            image: image.to_string(),
            pattern: pattern.to_string(),
            binary: binary.to_path_buf(),
            path: map_path.to_path_buf(),
        });
    }
    Ok(binary.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> ImageMap {
        ImageMap {
            entries: pairs
                .iter()
                .map(|(p, b)| (p.to_string(), PathBuf::from(b)))
                .collect(),
        }
    }

    fn lookup<'a>(m: &'a ImageMap, image: &str) -> Option<&'a str> {
        let r = ImageRef::parse(image).expect("valid image");
        m.lookup(&r).and_then(|(_, b)| b.to_str())
    }

    #[test]
    fn parses_references() {
        let r = ImageRef::parse("quay.io/x/cli-mcp-agent:1.2").expect("parse");
        assert_eq!(r.name, "cli-mcp-agent");
        assert_eq!(r.tag.as_deref(), Some("1.2"));
        assert_eq!(r.digest, None);
        let r = ImageRef::parse("localhost:5000/agent").expect("parse");
        assert_eq!(r.name, "agent");
        assert_eq!(r.tag, None);
        let r = ImageRef::parse("agent:v1@sha256:abcd").expect("parse");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.digest.as_deref(), Some("sha256:abcd"));
        assert!(ImageRef::parse("").is_none());
        assert!(ImageRef::parse("agent:").is_none());
        assert!(ImageRef::parse("agent@").is_none());
    }

    #[test]
    fn wildcard_tag_matches_tags_and_digests() {
        let m = map(&[("cli-mcp-agent:*", "/bin/agent")]);
        assert_eq!(
            lookup(&m, "quay.io/x/cli-mcp-agent:1.2"),
            Some("/bin/agent")
        );
        assert_eq!(lookup(&m, "cli-mcp-agent@sha256:0123"), Some("/bin/agent"));
        assert_eq!(lookup(&m, "cli-mcp-agent"), Some("/bin/agent"));
        assert_eq!(lookup(&m, "cli-mcp-server:1.2"), None);
        assert_eq!(lookup(&m, "x/cli-mcp-agent-2:1"), None);
    }

    #[test]
    fn exact_tag_matches_only_that_tag() {
        let m = map(&[("busybox:1.36", "/bin/busybox")]);
        assert_eq!(
            lookup(&m, "docker.io/library/busybox:1.36"),
            Some("/bin/busybox")
        );
        assert_eq!(lookup(&m, "busybox:1.37"), None);
        assert_eq!(lookup(&m, "busybox@sha256:aa"), None);
        let m = map(&[("app:latest", "/bin/app")]);
        assert_eq!(lookup(&m, "app"), Some("/bin/app"));
    }

    #[test]
    fn most_specific_pattern_wins() {
        let m = map(&[
            ("*", "/bin/any"),
            ("agent:*", "/bin/agent-any"),
            ("agent:1.*", "/bin/agent-1"),
            ("agent:1.2", "/bin/agent-12"),
            ("agent@sha256:ff", "/bin/agent-digest"),
        ]);
        assert_eq!(lookup(&m, "agent:1.2"), Some("/bin/agent-12"));
        assert_eq!(lookup(&m, "agent:1.3"), Some("/bin/agent-1"));
        assert_eq!(lookup(&m, "agent:2"), Some("/bin/agent-any"));
        assert_eq!(lookup(&m, "agent@sha256:ff"), Some("/bin/agent-digest"));
        assert_eq!(lookup(&m, "other:1"), Some("/bin/any"));
    }

    #[test]
    fn glob() {
        assert!(glob_match("a*c", "abbbc"));
        assert!(glob_match("*", ""));
        assert!(glob_match("1.*", "1.2.3"));
        assert!(!glob_match("1.*", "2.1"));
        assert!(glob_match("a*b*c", "aXbYc"));
        assert!(!glob_match("abc", "abcd"));
    }

    #[test]
    fn map_file_errors_are_actionable() {
        assert!(ImageMap::parse("[1,2]").is_err());
        assert!(ImageMap::parse(r#"{"a:*": "relative/bin"}"#).is_err());
        let m = ImageMap::parse(r#"{"a:*": "/bin/a"}"#).expect("valid map");
        let err =
            resolve_in(&m, Path::new("/etc/map.json"), "reg/b:1", |_| true).expect_err("unmapped");
        let msg = err.to_string();
        assert!(msg.contains("\"reg/b:1\""), "{msg}");
        assert!(msg.contains("/etc/map.json"), "{msg}");
        let err = resolve_in(&m, Path::new("/m.json"), "a:1", |_| false).expect_err("missing");
        assert!(matches!(err, ResolveError::MissingBinary { .. }));
        assert_eq!(
            resolve_in(&m, Path::new("/m.json"), "a:1", |_| true),
            Ok(PathBuf::from("/bin/a"))
        );
    }
}
