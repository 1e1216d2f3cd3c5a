//! Pod volumes, materialised under `STATE/pods/<pod>/volumes/<name>` and bind-mounted by the
//! exec helper: Secret, ConfigMap, downwardAPI, projected (serviceAccountToken via the
//! TokenRequest API, configMap, secret, downwardAPI), emptyDir (tmpfs when `sizeLimit` or
//! `medium: Memory`) and hostPath.
//!
//! Files are written atomically (temp file + rename in the same directory), so a reader of a
//! bind-mounted volume directory sees either the old or the new content. Re-syncing rewrites
//! only changed files and removes files whose keys disappeared.

mod token;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, DownwardAPIVolumeFile, EmptyDirVolumeSource, HostPathVolumeSource,
    KeyToPath, Pod, ProjectedVolumeSource, Secret, Volume, VolumeMount,
};
use kube::{Api, Client};

use crate::downward::{self, PodFacts, Use};
use crate::env::{config_map_entries, expand, EnvList};
use crate::quantity;
use crate::state::PodDir;
use token::Tokens;

const DEFAULT_MODE: u32 = 0o644;

/// A file to materialise inside a volume directory.
#[derive(Debug, Clone, PartialEq)]
pub struct FileSpec {
    pub path: String,
    pub content: Vec<u8>,
    pub mode: u32,
    pub uid: Option<u32>,
}

fn mode_of(m: Option<i32>, default: u32) -> u32 {
    m.map(|m| (m as u32) & 0o7777).unwrap_or(default)
}

fn uid_of(u: Option<i64>) -> Option<u32> {
    u.and_then(|u| u32::try_from(u).ok())
}

/// A relative path without `..`, as key-to-path items must be.
pub fn validate_rel_path(p: &str) -> Result<(), String> {
    let path = Path::new(p);
    if p.is_empty() || path.is_absolute() {
        return Err(format!("path {p:?} must be relative and non-empty"));
    }
    if path
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(format!("path {p:?} must not contain '..' or '.'"));
    }
    Ok(())
}

/// What a Secret/ConfigMap source looks like, independent of which it is.
pub struct KeySource<'a> {
    pub kind: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// `None`: the object does not exist.
    pub entries: Option<BTreeMap<String, Vec<u8>>>,
    pub items: Option<&'a [KeyToPath]>,
    pub optional: bool,
    pub default_mode: u32,
    pub default_user: Option<u32>,
}

/// Turns a Secret/ConfigMap (with optional `items`) into files.
pub fn project_keys(src: &KeySource<'_>) -> Result<Vec<FileSpec>, String> {
    let Some(entries) = &src.entries else {
        if src.optional {
            return Ok(Vec::new());
        }
        return Err(format!(
            "{} \"{}\" not found",
            src.kind.to_lowercase(),
            src.name
        ));
    };
    let mut out = Vec::new();
    match src.items {
        Some(items) if !items.is_empty() => {
            for it in items {
                validate_rel_path(&it.path)?;
                match entries.get(&it.key) {
                    Some(v) => out.push(FileSpec {
                        path: it.path.clone(),
                        content: v.clone(),
                        mode: mode_of(it.mode, src.default_mode),
                        uid: uid_of(it.user).or(src.default_user),
                    }),
                    None if src.optional => {}
                    None => {
                        return Err(format!(
                            "couldn't find key {} in {} {}/{}",
                            it.key, src.kind, src.namespace, src.name
                        ))
                    }
                }
            }
        }
        _ => {
            for (k, v) in entries {
                validate_rel_path(k)?;
                out.push(FileSpec {
                    path: k.clone(),
                    content: v.clone(),
                    mode: src.default_mode,
                    uid: src.default_user,
                });
            }
        }
    }
    Ok(out)
}

/// Downward API files (`fieldRef` / `resourceFieldRef`).
pub fn downward_files(
    facts: &PodFacts<'_>,
    containers: &[Container],
    items: &[DownwardAPIVolumeFile],
    default_mode: u32,
    default_user: Option<u32>,
) -> Result<Vec<FileSpec>, String> {
    let mut out = Vec::new();
    for it in items {
        validate_rel_path(&it.path)?;
        let value = if let Some(f) = &it.field_ref {
            downward::field_value(facts, &f.field_path, Use::Volume)?
        } else if let Some(r) = &it.resource_field_ref {
            let name = r.container_name.as_deref().unwrap_or_default();
            let c = containers
                .iter()
                .find(|c| c.name == name)
                .ok_or_else(|| format!("resourceFieldRef names unknown container {name:?}"))?;
            downward::resource_value(facts, c, r)?
        } else {
            return Err(format!(
                "downwardAPI item {:?} has neither fieldRef nor resourceFieldRef",
                it.path
            ));
        };
        out.push(FileSpec {
            path: it.path.clone(),
            content: value.into_bytes(),
            mode: mode_of(it.mode, default_mode),
            uid: uid_of(it.user).or(default_user),
        });
    }
    Ok(out)
}

/// Whether the volume is only readable inside containers (as the kubelet mounts them).
fn is_read_only_kind(v: &Volume) -> bool {
    v.secret.is_some()
        || v.config_map.is_some()
        || v.downward_api.is_some()
        || v.projected.is_some()
}

/// emptyDir volumes that need a tmpfs: `(path, size in bytes)`.
pub fn tmpfs_volumes(pod: &Pod, dir: &PodDir) -> Vec<(PathBuf, Option<u64>)> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| {
            let ed = v.empty_dir.as_ref()?;
            let size = ed
                .size_limit
                .as_ref()
                .and_then(|q| quantity::parse_bytes(&q.0));
            let memory = ed.medium.as_deref() == Some("Memory");
            (memory || size.is_some()).then(|| (dir.volume(&v.name), size))
        })
        .collect()
}

/// Per-pod volume state across syncs.
#[derive(Default)]
pub struct Volumes {
    written: BTreeMap<String, BTreeSet<String>>,
    tokens: Tokens,
    host_paths: BTreeMap<String, PathBuf>,
    read_only: BTreeSet<String>,
    mounted_tmpfs: BTreeSet<PathBuf>,
}

/// Inputs of one sync.
pub struct SyncCtx<'a> {
    pub client: &'a Client,
    pub facts: PodFacts<'a>,
    pub dir: &'a PodDir,
    pub owner: (u32, u32),
}

impl Volumes {
    /// Earliest time a cached token should be renewed.
    pub fn next_token_refresh(&self) -> Option<Instant> {
        self.tokens.next_refresh()
    }

    /// Creates or refreshes every volume of the pod. Errors name the volume and are meant
    /// for `CreateContainerConfigError` messages.
    pub async fn sync(&mut self, ctx: &SyncCtx<'_>) -> Result<(), String> {
        let pod = ctx.facts.pod;
        let Some(spec) = pod.spec.as_ref() else {
            return Ok(());
        };
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        std::fs::create_dir_all(ctx.dir.volumes())
            .map_err(|e| format!("creating {}: {e}", ctx.dir.volumes().display()))?;
        let _ = std::fs::set_permissions(ctx.dir.volumes(), std::fs::Permissions::from_mode(0o750));
        for v in spec.volumes.iter().flatten() {
            self.sync_volume(ctx, ns, &spec.containers, v)
                .await
                .map_err(|e| format!("volume {:?}: {e}", v.name))?;
        }
        Ok(())
    }

    async fn sync_volume(
        &mut self,
        ctx: &SyncCtx<'_>,
        ns: &str,
        containers: &[Container],
        v: &Volume,
    ) -> Result<(), String> {
        let path = ctx.dir.volume(&v.name);
        if is_read_only_kind(v) {
            self.read_only.insert(v.name.clone());
        }
        if let Some(ed) = &v.empty_dir {
            self.make_empty_dir(ctx, ed, &path)?;
            self.host_paths.insert(v.name.clone(), path);
            return Ok(());
        }
        if let Some(hp) = &v.host_path {
            let p = prepare_host_path(hp)?;
            self.host_paths.insert(v.name.clone(), p);
            return Ok(());
        }

        let files = self.volume_files(ctx, ns, containers, v).await?;
        let previous = self.written.remove(&v.name).unwrap_or_default();
        let written = write_files(&path, &files, &previous, ctx.owner)?;
        self.written.insert(v.name.clone(), written);
        self.host_paths.insert(v.name.clone(), path);
        Ok(())
    }

    /// Makes an emptyDir volume's directory at `path` (a tmpfs, mounted once, when it has
    /// a `sizeLimit` or `medium: Memory`) with the volume's mode.
    fn make_empty_dir(
        &mut self,
        ctx: &SyncCtx<'_>,
        ed: &EmptyDirVolumeSource,
        path: &Path,
    ) -> Result<(), String> {
        std::fs::create_dir_all(path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        let tmpfs = tmpfs_volumes(ctx.facts.pod, ctx.dir)
            .into_iter()
            .find(|(p, _)| *p == path);
        if let Some((p, size)) = tmpfs {
            if !self.mounted_tmpfs.contains(&p) {
                mount_tmpfs(&p, size)?;
                self.mounted_tmpfs.insert(p);
            }
        }
        let mode = mode_of(ed.mode, 0o777);
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod {}: {e}", path.display()))
    }

    /// The files of a Secret, ConfigMap, downwardAPI or projected volume.
    async fn volume_files(
        &mut self,
        ctx: &SyncCtx<'_>,
        ns: &str,
        containers: &[Container],
        v: &Volume,
    ) -> Result<Vec<FileSpec>, String> {
        if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let entries = fetch_secret(ctx.client, ns, &name).await?;
            project_keys(&KeySource {
                kind: "Secret",
                namespace: ns,
                name: &name,
                entries,
                items: s.items.as_deref(),
                optional: s.optional == Some(true),
                default_mode: mode_of(s.default_mode, DEFAULT_MODE),
                default_user: uid_of(s.default_user),
            })
        } else if let Some(c) = &v.config_map {
            let entries = fetch_config_map(ctx.client, ns, &c.name).await?;
            project_keys(&KeySource {
                kind: "ConfigMap",
                namespace: ns,
                name: &c.name,
                entries,
                items: c.items.as_deref(),
                optional: c.optional == Some(true),
                default_mode: mode_of(c.default_mode, DEFAULT_MODE),
                default_user: uid_of(c.default_user),
            })
        } else if let Some(d) = &v.downward_api {
            downward_files(
                &ctx.facts,
                containers,
                d.items.as_deref().unwrap_or_default(),
                mode_of(d.default_mode, DEFAULT_MODE),
                uid_of(d.default_user),
            )
        } else if let Some(p) = &v.projected {
            self.projected_files(ctx, ns, containers, &v.name, p).await
        } else {
            Err(
                "volume type not supported by cli-mcp-kubelet (supported: secret, configMap, downwardAPI, projected, emptyDir, hostPath)"
                    .to_string(),
            )
        }
    }

    /// The files of a projected volume named `volume`: each source's, in order.
    async fn projected_files(
        &mut self,
        ctx: &SyncCtx<'_>,
        ns: &str,
        containers: &[Container],
        volume: &str,
        p: &ProjectedVolumeSource,
    ) -> Result<Vec<FileSpec>, String> {
        let default_mode = mode_of(p.default_mode, DEFAULT_MODE);
        let default_user = uid_of(p.default_user);
        let mut files = Vec::new();
        for src in p.sources.iter().flatten() {
            if let Some(s) = &src.secret {
                let entries = fetch_secret(ctx.client, ns, &s.name).await?;
                files.extend(project_keys(&KeySource {
                    kind: "Secret",
                    namespace: ns,
                    name: &s.name,
                    entries,
                    items: s.items.as_deref(),
                    optional: s.optional == Some(true),
                    default_mode,
                    default_user,
                })?);
            } else if let Some(c) = &src.config_map {
                let entries = fetch_config_map(ctx.client, ns, &c.name).await?;
                files.extend(project_keys(&KeySource {
                    kind: "ConfigMap",
                    namespace: ns,
                    name: &c.name,
                    entries,
                    items: c.items.as_deref(),
                    optional: c.optional == Some(true),
                    default_mode,
                    default_user,
                })?);
            } else if let Some(d) = &src.downward_api {
                files.extend(downward_files(
                    &ctx.facts,
                    containers,
                    d.items.as_deref().unwrap_or_default(),
                    default_mode,
                    default_user,
                )?);
            } else if let Some(t) = &src.service_account_token {
                validate_rel_path(&t.path)?;
                let token = self.tokens.get(ctx, volume, t).await?;
                files.push(FileSpec {
                    path: t.path.clone(),
                    content: token.into_bytes(),
                    mode: default_mode,
                    uid: uid_of(t.user).or(default_user),
                });
            } else {
                return Err(
                    "projected source type not supported by cli-mcp-kubelet (supported: secret, configMap, downwardAPI, serviceAccountToken)"
                        .to_string(),
                );
            }
        }
        Ok(files)
    }

    /// The host directory (or file) backing a volume, once synced.
    pub fn host_path(&self, volume: &str) -> Option<&Path> {
        self.host_paths.get(volume).map(PathBuf::as_path)
    }

    /// Builds the bind mounts of one container. `env` expands `subPathExpr`.
    pub fn mounts_for(
        &self,
        mounts: &[VolumeMount],
        env: &EnvList,
    ) -> Result<Vec<crate::exec_helper::BindMount>, String> {
        let mut out = Vec::new();
        for m in mounts {
            let base = self
                .host_path(&m.name)
                .ok_or_else(|| format!("volumeMount {:?} refers to an unknown volume", m.name))?;
            let sub = match (&m.sub_path, &m.sub_path_expr) {
                (Some(s), _) if !s.is_empty() => Some(s.clone()),
                (_, Some(e)) if !e.is_empty() => {
                    Some(expand(e, |n| env.get(n).map(str::to_string)))
                }
                _ => None,
            };
            let source = match sub {
                Some(s) => {
                    validate_rel_path(&s)?;
                    let p = base.join(&s);
                    if !p.exists() {
                        // The kubelet creates missing subPath directories.
                        std::fs::create_dir_all(&p)
                            .map_err(|e| format!("creating subPath {}: {e}", p.display()))?;
                    }
                    p
                }
                None => base.to_path_buf(),
            };
            if !m.mount_path.starts_with('/') {
                return Err(format!("mountPath {:?} must be absolute", m.mount_path));
            }
            out.push(crate::exec_helper::BindMount {
                source,
                target: PathBuf::from(&m.mount_path),
                read_only: m.read_only == Some(true) || self.read_only.contains(&m.name),
            });
        }
        Ok(out)
    }
}

/// A hostPath volume's path, made first if its type asks for that (`DirectoryOrCreate`,
/// `FileOrCreate`); one of another type must exist.
fn prepare_host_path(hp: &HostPathVolumeSource) -> Result<PathBuf, String> {
    let p = PathBuf::from(&hp.path);
    match hp.type_.as_deref().unwrap_or("") {
        "DirectoryOrCreate" => std::fs::create_dir_all(&p)
            .map_err(|e| format!("creating hostPath {}: {e}", p.display()))?,
        "FileOrCreate" if !p.exists() => {
            if let Some(parent) = p.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            std::fs::File::create(&p)
                .map_err(|e| format!("creating hostPath {}: {e}", p.display()))?;
        }
        "" | "FileOrCreate" => {}
        _ if !p.exists() => return Err(format!("hostPath {} does not exist", p.display())),
        _ => {}
    }
    Ok(p)
}

async fn fetch_secret(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<Option<BTreeMap<String, Vec<u8>>>, String> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let s = api
        .get_opt(name)
        .await
        .map_err(|e| format!("reading secret {ns}/{name}: {e}"))?;
    Ok(s.map(|s| {
        s.data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect()
    }))
}

async fn fetch_config_map(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<Option<BTreeMap<String, Vec<u8>>>, String> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = api
        .get_opt(name)
        .await
        .map_err(|e| format!("reading configmap {ns}/{name}: {e}"))?;
    Ok(cm.map(|cm| {
        let mut m: BTreeMap<String, Vec<u8>> = config_map_entries(&cm)
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .collect();
        for (k, v) in cm.binary_data.iter().flatten() {
            m.insert(k.clone(), v.0.clone());
        }
        m
    }))
}

fn mount_tmpfs(path: &Path, size: Option<u64>) -> Result<(), String> {
    let mut opts = String::from("mode=0777");
    if let Some(s) = size {
        opts.push_str(&format!(",size={s}"));
    }
    nix::mount::mount(
        Some("tmpfs"),
        path,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(|e| format!("mounting tmpfs ({opts}) at {}: {e}", path.display()))
}

/// Writes `files` below `dir` (only what changed), removes files of `previous` that are no
/// longer wanted, and returns the new set of written paths.
pub fn write_files(
    dir: &Path,
    files: &[FileSpec],
    previous: &BTreeSet<String>,
    owner: (u32, u32),
) -> Result<BTreeSet<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    let mut written = BTreeSet::new();
    for f in files {
        let target = dir.join(&f.path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        let uid = f.uid.unwrap_or(owner.0);
        let unchanged = std::fs::symlink_metadata(&target).is_ok_and(|m| {
            m.is_file() && m.mode() & 0o7777 == f.mode && m.uid() == uid && m.gid() == owner.1
        }) && std::fs::read(&target).is_ok_and(|c| c == f.content);
        if !unchanged {
            let name = target
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let tmp = target.with_file_name(format!(".{name}.tmp"));
            std::fs::write(&tmp, &f.content)
                .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(f.mode))
                .map_err(|e| format!("chmod {}: {e}", tmp.display()))?;
            std::os::unix::fs::chown(&tmp, Some(uid), Some(owner.1))
                .map_err(|e| format!("chown {}: {e}", tmp.display()))?;
            std::fs::rename(&tmp, &target)
                .map_err(|e| format!("renaming to {}: {e}", target.display()))?;
        }
        written.insert(f.path.clone());
    }
    for stale in previous.difference(&written) {
        let _ = std::fs::remove_file(dir.join(stale));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, ObjectFieldSelector, PodSpec};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn entries() -> Option<BTreeMap<String, Vec<u8>>> {
        Some(BTreeMap::from([
            ("a".to_string(), b"1".to_vec()),
            ("b".to_string(), b"2".to_vec()),
        ]))
    }

    fn src<'a>(items: Option<&'a [KeyToPath]>, optional: bool) -> KeySource<'a> {
        KeySource {
            kind: "Secret",
            namespace: "ns",
            name: "s",
            entries: entries(),
            items,
            optional,
            default_mode: 0o644,
            default_user: None,
        }
    }

    #[test]
    fn all_keys_without_items() {
        let files = project_keys(&src(None, false)).expect("ok");
        let paths: Vec<_> = files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, vec!["a", "b"]);
        assert!(files.iter().all(|f| f.mode == 0o644));
    }

    #[test]
    fn items_select_rename_and_set_mode() {
        let items = [KeyToPath {
            key: "b".into(),
            path: "dir/bee".into(),
            mode: Some(0o400),
            user: None,
        }];
        let files = project_keys(&src(Some(&items), false)).expect("ok");
        assert_eq!(
            files,
            vec![FileSpec {
                path: "dir/bee".into(),
                content: b"2".to_vec(),
                mode: 0o400,
                uid: None
            }]
        );
        let missing = [KeyToPath {
            key: "zz".into(),
            path: "z".into(),
            mode: None,
            user: None,
        }];
        assert_eq!(
            project_keys(&src(Some(&missing), false)),
            Err("couldn't find key zz in Secret ns/s".to_string())
        );
        assert_eq!(project_keys(&src(Some(&missing), true)), Ok(vec![]));
        let evil = [KeyToPath {
            key: "a".into(),
            path: "../x".into(),
            mode: None,
            user: None,
        }];
        assert!(project_keys(&src(Some(&evil), false)).is_err());
    }

    #[test]
    fn missing_object() {
        let mut s = src(None, false);
        s.entries = None;
        assert_eq!(project_keys(&s), Err("secret \"s\" not found".to_string()));
        s.optional = true;
        assert_eq!(project_keys(&s), Ok(vec![]));
    }

    #[test]
    fn downward_label_and_annotation_files() {
        let pod = Pod {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                annotations: Some(BTreeMap::from([(
                    "cli-mcp.dev/assignment".to_string(),
                    "s-1".to_string(),
                )])),
                ..Default::default()
            },
            ..Default::default()
        };
        let facts = PodFacts {
            pod: &pod,
            pod_ip: None,
            host_ip: "10.0.0.1",
            node_name: "n",
            node_cpu: 1.0,
            node_memory: 1.0,
        };
        let item = |path: &str, field: &str| DownwardAPIVolumeFile {
            path: path.into(),
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: field.into(),
            }),
            ..Default::default()
        };
        let files = downward_files(
            &facts,
            &[],
            &[
                item("annotations", "metadata.annotations"),
                item("namespace", "metadata.namespace"),
            ],
            0o644,
            None,
        )
        .expect("ok");
        assert_eq!(files[0].content, b"cli-mcp.dev/assignment=\"s-1\"".to_vec());
        assert_eq!(files[1].content, b"ns".to_vec());
    }

    #[test]
    fn writes_atomically_and_removes_stale_files() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let f = |p: &str, c: &str| FileSpec {
            path: p.into(),
            content: c.as_bytes().to_vec(),
            mode: 0o640,
            uid: None,
        };
        let first = write_files(
            tmp.path(),
            &[f("a", "1"), f("d/b", "2")],
            &BTreeSet::new(),
            me,
        )
        .expect("write");
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("d/b"))
                .ok()
                .as_deref(),
            Some("2")
        );
        let mode = std::fs::metadata(tmp.path().join("a")).map(|m| m.mode() & 0o777);
        assert_eq!(mode.ok(), Some(0o640));
        let second = write_files(tmp.path(), &[f("a", "3")], &first, me).expect("rewrite");
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("a"))
                .ok()
                .as_deref(),
            Some("3")
        );
        assert!(!tmp.path().join("d/b").exists());
        assert_eq!(second, BTreeSet::from(["a".to_string()]));
    }

    #[test]
    fn tmpfs_only_for_size_limit_or_memory() {
        let dir = PodDir {
            root: PathBuf::from("/s/pods/p"),
        };
        let ed = |medium: Option<&str>, size: Option<&str>| Volume {
            name: format!("{medium:?}{size:?}"),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: medium.map(Into::into),
                size_limit: size.map(|s| Quantity(s.into())),
                ..Default::default()
            }),
            ..Default::default()
        };
        let pod = Pod {
            spec: Some(PodSpec {
                volumes: Some(vec![
                    ed(None, None),
                    ed(None, Some("16Mi")),
                    ed(Some("Memory"), None),
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let t = tmpfs_volumes(&pod, &dir);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].1, Some(16 * 1024 * 1024));
        assert_eq!(t[1].1, None);
    }

    #[test]
    fn rel_paths() {
        assert!(validate_rel_path("a/b").is_ok());
        assert!(validate_rel_path("/a").is_err());
        assert!(validate_rel_path("a/../b").is_err());
        assert!(validate_rel_path("./a").is_err());
        assert!(validate_rel_path("").is_err());
    }
}
