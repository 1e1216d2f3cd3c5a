//! Installing a release as an admin would, on the real node, from the node's registry only
//! (docs/install.md):
//!
//! 1. `hack/publish.sh` (`make publish`) pushes this run's four images, the chart and the
//!    bundle image to `<registry>/release` and writes the digests into a copy of the
//!    manifests; every image they name carries that registry and the digest the registry
//!    holds;
//! 2. the admin mirrors the release into `<registry>/mirror` (`crane copy`, as into their own
//!    registry) and runs `kubectl apply -k` of an overlay of the published `config/default`
//!    that sets only the registry: the operator and the images it hands on come from the
//!    mirror, by digest; the sample instance becomes Ready and a `tools/call` runs
//!    `kubectl get ns` in a sandbox; then everything is deleted;
//! 3. `helm install oci://<registry>/release/charts/cli-mcp-operator --version <v>`: the same
//!    instance and call;
//! 4. `helm upgrade` to a second release whose sandbox image differs: a live session keeps
//!    its shell (its variable, its directory, its pod), and the warm pool rolls to the new
//!    image.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cli_mcp_api::names::label;
use cli_mcp_e2e::journey::{hack_bin_dir, sandbox_selector, stdout, tools, Env};
use cli_mcp_e2e::real_node_rig::RealNodeRig;
use cli_mcp_e2e::registry::RegistryInfo;
use cli_mcp_e2e::testing::{wait_deployment_ready, workspace_root, TestCluster, TIMEOUT};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde_json::Value;

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Where the admin installs the operator (config/default's namespace, the chart's here).
const SYSTEM: &str = "cli-mcp-system";
/// The Helm release; named like the chart, so its objects are named `cli-mcp-operator`.
const RELEASE: &str = "cli-mcp-operator";
const IMAGES: [&str; 4] = ["operator", "server", "proxy", "sandbox"];

/// Runs `cmd`, panicking with its stderr when it fails; its stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `hack/publish.sh` to `registry` of the archives in `images`, the manifests written to
/// `out`; its JSON summary.
fn publish(reg: &RegistryInfo, registry: &str, version: &str, images: &Path, out: &Path) -> Value {
    let stdout = run(Command::new(workspace_root().join("hack/publish.sh"))
        .env("REGISTRY", registry)
        .env("VERSION", version)
        .env("REGISTRY_CA", &reg.ca)
        .env("CLI_MCP_IMAGES_DIR", images)
        .env("PUBLISH_OUT", out));
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("publish's summary {last:?}: {e}"))
}

/// Every image reference in `yaml`'s Deployments: container images and `RELATED_IMAGE_*`.
fn images_of(yaml: &str) -> Vec<String> {
    let mut found = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let v: Value = serde::Deserialize::deserialize(doc).expect("a YAML document");
        if v["kind"] != "Deployment" {
            continue;
        }
        for c in v["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            found.extend(c["image"].as_str().map(str::to_owned));
            for e in c["env"].as_array().into_iter().flatten() {
                if e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("RELATED_IMAGE_"))
                {
                    found.extend(e["value"].as_str().map(str::to_owned));
                }
            }
        }
    }
    found
}

/// The images of the OLM bundle's CSV under `root`: its Deployment's (as [`images_of`]) and
/// `relatedImages`.
fn csv_images(root: &Path) -> (Vec<String>, Vec<String>) {
    let path = root.join("bundle/manifests/cli-mcp-operator.clusterserviceversion.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let csv: Value = serde_yaml::from_str(&text).expect("the CSV is YAML");
    let mut deployed = Vec::new();
    for d in csv["spec"]["install"]["spec"]["deployments"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let doc = serde_json::json!({"kind": "Deployment", "spec": d["spec"]});
        deployed.extend(images_of(&doc.to_string()));
    }
    let related = csv["spec"]["relatedImages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["image"].as_str().map(str::to_owned))
        .collect();
    (deployed, related)
}

/// Why `images` (one manifest's) cannot be shipped: an image without a registry host (a
/// runtime reads `cli-mcp-server:1` as `docker.io/library/cli-mcp-server:1`), or digests on
/// some images and not on others (a publish that stopped half way).
fn unshippable(images: &[String]) -> Option<String> {
    for image in images {
        let first = image.split('/').next().unwrap_or_default();
        let host = image.contains('/')
            && (first.contains('.') || first.contains(':') || first == "localhost");
        if !host {
            return Some(format!("{image} names no registry"));
        }
    }
    let pinned = images.iter().filter(|i| i.contains("@sha256:")).count();
    (pinned != 0 && pinned != images.len())
        .then(|| format!("only {pinned} of {images:?} are pinned by digest"))
}

/// The four images `published` names, each `registry/cli-mcp-<name>:<version>@<digest>`.
fn published_image(published: &Value, name: &str) -> String {
    published["images"][name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name} image in {published}"))
        .to_owned()
}

/// What the published manifests install names exactly the pushed images, by digest.
fn assert_manifests_pinned(published: &Value, out: &Path, registry: &str) {
    let want: Vec<String> = IMAGES
        .iter()
        .map(|n| published_image(published, n))
        .collect();
    for image in &want {
        assert!(image.starts_with(&format!("{registry}/")), "{image}");
        assert!(image.contains(&format!(":{VERSION}@sha256:")), "{image}");
    }
    let kustomize = run(Command::new(tools().join("kustomize"))
        .arg("build")
        .arg(out.join("config/default")));
    let helm = run(Command::new(tools().join("helm"))
        .args(["template", RELEASE])
        .arg(out.join("charts/cli-mcp-operator")));
    let mut want = want;
    want.sort();
    let (deployed, related) = csv_images(out);
    for (what, mut got) in [
        ("kustomize", images_of(&kustomize)),
        ("helm", images_of(&helm)),
        ("the bundle's Deployment", deployed),
        ("the bundle's relatedImages", related),
    ] {
        got.sort();
        assert_eq!(
            got, want,
            "{what}: the images the published manifests install"
        );
    }
}

/// The manifests in the repository, as shipped: every image under a registry, and pinned by
/// digest all together or not at all (the release commit `make publish` makes pins them).
#[test]
fn shipped_manifests_name_a_registry_and_pin_all_images_or_none() {
    let root = workspace_root();
    let kustomize = run(Command::new(tools().join("kustomize"))
        .arg("build")
        .arg(root.join("config/default")));
    let helm = run(Command::new(tools().join("helm"))
        .args(["template", RELEASE])
        .arg(root.join("charts/cli-mcp-operator")));
    let (deployed, related) = csv_images(&root);
    let mut kz = images_of(&kustomize);
    kz.sort();
    assert_eq!(kz.len(), 4, "the operator and its three images: {kz:?}");
    for (what, mut images) in [
        ("kustomize", kz.clone()),
        ("helm", images_of(&helm)),
        ("the bundle's Deployment", deployed),
        ("the bundle's relatedImages", related),
    ] {
        images.sort();
        assert_eq!(unshippable(&images), None, "{what}");
        assert_eq!(images, kz, "{what} installs what kustomize installs");
    }
    // The check itself refuses what it must.
    let d = format!("@sha256:{}", "a".repeat(64));
    for (bad, why) in [
        (
            vec!["cli-mcp-operator:0.1.0".to_owned()],
            "names no registry",
        ),
        (
            vec!["cli-mcp/cli-mcp-operator:0.1.0".to_owned()],
            "names no registry",
        ),
        (
            vec![format!("quay.io/x/a:1{d}"), "quay.io/x/b:1".into()],
            "pinned by digest",
        ),
    ] {
        let found = unshippable(&bad).unwrap_or_default();
        assert!(found.contains(why), "{bad:?}: {found:?}");
    }
    assert_eq!(unshippable(&[format!("127.0.0.1:5000/x/a:1{d}")]), None);
}

/// The admin's copy of the release into their own registry path `mirror`.
fn mirror(reg: &RegistryInfo, published: &Value, release: &str, mirror: &str) {
    for n in IMAGES {
        let image = published_image(published, n);
        let (_, digest) = image.rsplit_once('@').expect("a digest");
        let source = format!("{release}/cli-mcp-{n}@{digest}");
        run(Command::new(&reg.crane)
            .env("SSL_CERT_FILE", &reg.ca)
            .args(["copy", &source, &format!("{mirror}/cli-mcp-{n}:{VERSION}")]));
    }
}

/// `kubectl ARGS` with the cluster's admin kubeconfig.
fn kubectl(c: &TestCluster, args: &[&str]) -> String {
    run(Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&c.info.kubeconfig)
        .args(args))
}

/// An overlay as an admin keeps it in their own repository: the release's `config/default`
/// (here the published copy, where a user names the release's tag on GitHub) with only the
/// registry changed.
fn overlay(run_dir: &Path, release: &str, mirror: &str) -> PathBuf {
    let dir = run_dir.join("overlay");
    std::fs::create_dir_all(&dir).expect("overlay dir");
    let mut k = String::from("resources:\n  - ../published/config/default\nimages:\n");
    for n in IMAGES {
        k.push_str(&format!(
            "  - name: {release}/cli-mcp-{n}\n    newName: {mirror}/cli-mcp-{n}\n"
        ));
    }
    std::fs::write(dir.join("kustomization.yaml"), k).expect("kustomization");
    dir
}

/// The operator Deployment `name` in [`SYSTEM`], ready; the images it runs and hands on.
async fn operator_ready(c: &TestCluster, name: &str) -> Vec<String> {
    let api: Api<Deployment> = Api::namespaced(c.client.clone(), SYSTEM);
    wait_deployment_ready(api.clone(), name, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("operator {name} not ready: {e}"));
    let d = api.get(name).await.expect("the operator Deployment");
    images_of(&serde_yaml::to_string(&d).expect("YAML"))
}

/// The live pod of session `sid` of instance `demo`.
async fn session_pod(env: &Env, sid: &str) -> Pod {
    let selector = format!("{},{}={sid}", sandbox_selector("demo"), label::SESSION_ID);
    let mut pods: Vec<Pod> = env.list::<Pod>(&selector).await;
    pods.retain(|p| p.metadata.deletion_timestamp.is_none());
    assert_eq!(pods.len(), 1, "session {sid} has one pod: {pods:?}");
    pods.remove(0)
}

/// The sample instance in a fresh namespace, Ready, answering a `tools/call` of `kubectl get
/// ns` in a sandbox whose pod runs `sandbox` (a reference by digest); the environment, with
/// the instance `demo` in it.
async fn sample_instance_answers(c: &TestCluster, prefix: &str, sandbox: &str) -> Env {
    let ns = c.namespace(prefix).await.expect("namespace");
    let mut env = Env::adopt(c.clone(), ns);
    env.investigation_kubeconfig("demo").await;
    env.apply_cr(&env.cr("demo", 2)).await;
    env.wait_ready("demo").await;
    let mcp = env.client("demo").await;
    let sid = format!("{prefix}-session");
    let out = mcp.bash(&sid, "kubectl get ns -o name").await;
    let text = stdout(&out);
    assert!(
        text.contains(&format!("namespace/{}", env.ns.name)),
        "kubectl get ns in the sandbox: {out}"
    );
    let pod = session_pod(&env, &sid).await;
    let image = pod.spec.as_ref().map(|s| s.containers[0].image.clone());
    assert_eq!(
        image.flatten().as_deref(),
        Some(sandbox),
        "the session's sandbox image"
    );
    let (_, digest) = sandbox.rsplit_once('@').expect("by digest");
    let status = pod
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default();
    assert!(
        status.iter().any(|s| s.image_id.ends_with(digest)),
        "the kubelet pulled {digest}: {status:?}"
    );
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_installs_from_the_registry_with_kustomize_and_helm_and_upgrades() {
    let Some(rig) = RealNodeRig::start("install").await else {
        return;
    };
    let t = Instant::now();
    let reg = rig.info.registry.clone().expect("the real node's registry");
    let c = rig.pc.test.clone();
    let release = format!("{}/release", reg.host);
    let out = rig.run_dir.join("published");
    let published = publish(&reg, &release, VERSION, &rig.images.dir, &out);
    for image in &rig.images.images {
        let pushed = published_image(&published, &image.name);
        assert!(
            pushed.ends_with(&image.digest),
            "{pushed} is not {}",
            image.digest
        );
    }
    assert_manifests_pinned(&published, &out, &release);
    // The bundle image crane made, pulled from the registry and read as OLM reads it.
    let sdk = hack_bin_dir("build-operator-sdk.sh").join("operator-sdk");
    let bundle = published["bundle"].as_str().expect("the bundle image");
    run(Command::new(sdk)
        .args(["bundle", "validate", bundle, "--image-builder", "none"])
        .env("SSL_CERT_FILE", &reg.ca));
    eprintln!("install: published in {:.1?}", t.elapsed());

    let t = Instant::now();
    let mirrored = format!("{}/mirror", reg.host);
    mirror(&reg, &published, &release, &mirrored);
    let overlay = overlay(&rig.run_dir, &release, &mirrored);
    let overlay = overlay.to_str().expect("UTF-8 path");
    kubectl(&c, &["apply", "--server-side", "-k", overlay]);
    for image in operator_ready(&c, "cli-mcp-operator").await {
        assert!(image.starts_with(&format!("{mirrored}/")), "{image}");
        assert!(image.contains("@sha256:"), "{image}");
    }
    let sandbox = published_image(&published, "sandbox").replace(&release, &mirrored);
    let env = sample_instance_answers(&c, "kustomize", &sandbox).await;
    env.finish(Some("demo")).await;
    kubectl(&c, &["delete", "-k", overlay, "--wait", "--timeout=180s"]);
    eprintln!(
        "install: kustomize install, call and removal in {:.1?}",
        t.elapsed()
    );

    let t = Instant::now();
    helm(&reg, &c, "install", &published);
    for image in operator_ready(&c, RELEASE).await {
        assert!(image.starts_with(&format!("{release}/")), "{image}");
    }
    let sandbox = published_image(&published, "sandbox");
    let env = sample_instance_answers(&c, "helm", &sandbox).await;
    registry_out_of_a_sandboxs_reach(&env, &reg, rig.gateway).await;
    a_public_name_is_not_pulled(&env, &published).await;
    eprintln!("install: helm install and call in {:.1?}", t.elapsed());

    let t = Instant::now();
    upgrade_keeps_sessions_and_rolls_the_pool(&rig, &reg, &env, &release).await;
    eprintln!("install: helm upgrade in {:.1?}", t.elapsed());
    env.finish(Some("demo")).await;
}

/// A shell in a sandbox cannot reach the node's registry (to read or overwrite what the node
/// pulls): not at 127.0.0.1 (its own loopback), nor at the node's address on that port
/// (nothing listens there, and its NetworkPolicy lets it reach only DNS and its proxy).
async fn registry_out_of_a_sandboxs_reach(env: &Env, reg: &RegistryInfo, node: std::net::Ipv4Addr) {
    let mcp = env.client("demo").await;
    let port = reg.host.rsplit_once(':').expect("host:port").1;
    for host in ["127.0.0.1".to_owned(), node.to_string()] {
        let url = format!("https://{host}:{port}/v2/");
        let command = format!("curl --noproxy '*' -sk -m 5 -o /dev/null {url}; echo \"rc=$?\"");
        let out = mcp.bash("attacker", &command).await;
        let rc = stdout(&out).trim().to_owned();
        assert!(
            rc.starts_with("rc=") && rc != "rc=0",
            "{url} from a sandbox: {out}"
        );
    }
}

/// A pod naming the release registry (`quay.io/…`, as the manifests in git do) is never
/// served the local copy of the same digest: the node sends other registries to a port that
/// closes the connection, so the pull fails at once, on this host.
async fn a_public_name_is_not_pulled(env: &Env, published: &Value) {
    let local = published_image(published, "sandbox");
    let (_, digest) = local.rsplit_once('@').expect("by digest");
    let public = format!("quay.io/cli-mcp/cli-mcp-sandbox:{VERSION}@{digest}");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "public-name"},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "runAsUser": 1001,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "c", "image": public, "imagePullPolicy": "IfNotPresent",
                "securityContext": {"allowPrivilegeEscalation": false,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }))
    .expect("pod");
    let pods: Api<Pod> = env.api();
    pods.create(&Default::default(), &pod)
        .await
        .expect("create");
    let t = Instant::now();
    let deadline = t + Duration::from_secs(60);
    let reason = loop {
        let p = pods.get("public-name").await.expect("pod");
        let status = p
            .status
            .and_then(|s| s.container_statuses)
            .unwrap_or_default();
        assert!(
            status
                .iter()
                .all(|s| s.state.as_ref().is_none_or(|st| st.running.is_none())),
            "{public} runs: the local copy was served for a public name: {status:?}"
        );
        let waiting = status
            .iter()
            .filter_map(|s| s.state.as_ref()?.waiting.as_ref()?.reason.clone())
            .find(|r| r == "ErrImagePull" || r == "ImagePullBackOff");
        if let Some(r) = waiting {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "{public}: no pull failure within 60 s: {status:?}"
        );
        // The kubelet reports a pull's failure only in the pod's status: read it again.
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    eprintln!(
        "install: {public} refused ({reason}) after {:.1?}",
        t.elapsed()
    );
    let _ = pods.delete("public-name", &Default::default()).await;
}

/// `helm install` (or `upgrade`) of the chart `published` names, from its OCI registry.
fn helm(reg: &RegistryInfo, c: &TestCluster, verb: &str, published: &Value) {
    let chart = published["chart"].as_str().expect("the chart's address");
    let version = published["version"].as_str().expect("the version");
    run(Command::new(tools().join("helm"))
        .args([verb, RELEASE, chart, "--version", version])
        .args(["--namespace", SYSTEM, "--create-namespace", "--ca-file"])
        .arg(&reg.ca)
        .arg("--kubeconfig")
        .arg(&c.info.kubeconfig));
}

/// A session's shell state, a second release with another sandbox image, `helm upgrade`:
/// the session keeps its pod and shell, and every warm pod comes to run the new image.
async fn upgrade_keeps_sessions_and_rolls_the_pool(
    rig: &RealNodeRig,
    reg: &RegistryInfo,
    env: &Env,
    release: &str,
) {
    let mcp = env.client("demo").await;
    let sid = "upgrade-session";
    mcp.bash(sid, "cd /tmp && export KEPT=across-the-upgrade")
        .await;
    let before = session_pod(env, sid).await;

    let second = format!("{VERSION}-second");
    let images = second_build(rig, reg, release, &second);
    let out = rig.run_dir.join("published-second");
    let published = publish(reg, release, &second, &images, &out);
    // The registry has it now; the archive (70 MB) would outlive the test in the run dir.
    std::fs::remove_dir_all(&images).expect("removing the second build's archives");
    let sandbox = published_image(&published, "sandbox");
    helm(reg, &env.c, "upgrade", &published);

    // The pool's pods (no session label yet) all come to run the new image, two of them.
    let pods: Api<Pod> = env.api();
    let warm = format!("{},!{}", sandbox_selector("demo"), label::SESSION_ID);
    let runs_new = |p: &Pod| {
        let image = p
            .spec
            .as_ref()
            .and_then(|s| s.containers[0].image.as_deref());
        p.metadata.deletion_timestamp.is_none() && image == Some(sandbox.as_str())
    };
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let list = pods
            .list(&ListParams::default().labels(&warm))
            .await
            .expect("pods");
        if list.items.len() >= 2 && list.items.iter().all(runs_new) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pool never rolled to {sandbox}: {:?}",
            list.items.iter().map(|p| p.name_any()).collect::<Vec<_>>()
        );
        // Pods of the pool come and go under the operator; a list every half second is
        // enough to see the end of the roll.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let out = mcp.bash(sid, "echo \"$KEPT $(pwd)\"").await;
    assert_eq!(stdout(&out).trim(), "across-the-upgrade /tmp", "{out}");
    let after = session_pod(env, sid).await;
    assert_eq!(before.uid(), after.uid(), "the session kept its pod");
}

/// The second build: this run's operator, server and proxy archives, and a sandbox archive
/// that differs by one label (crane mutate, then `crane pull --format oci`).
fn second_build(rig: &RealNodeRig, reg: &RegistryInfo, release: &str, version: &str) -> PathBuf {
    let dir = rig.run_dir.join("images-second");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("images dir");
    for n in ["operator", "server", "proxy"] {
        let archive = format!("cli-mcp-{n}.tar");
        std::os::unix::fs::symlink(rig.images.dir.join(&archive), dir.join(&archive))
            .expect("symlink");
    }
    let crane = |args: &[&str]| {
        run(Command::new(&reg.crane)
            .env("SSL_CERT_FILE", &reg.ca)
            .args(args))
    };
    let first = format!("{release}/cli-mcp-sandbox:{VERSION}");
    let second = format!("{release}/cli-mcp-sandbox-build:{version}");
    crane(&[
        "mutate",
        &first,
        "--label",
        "io.cli-mcp.build=second",
        "-t",
        &second,
    ]);
    let layout = dir.join("layout");
    crane(&[
        "pull",
        "--format",
        "oci",
        &second,
        layout.to_str().expect("UTF-8"),
    ]);
    run(Command::new("tar")
        .arg("-cf")
        .arg(dir.join("cli-mcp-sandbox.tar"))
        .arg("-C")
        .arg(&layout)
        .arg("."));
    std::fs::remove_dir_all(&layout).expect("remove the layout");
    dir
}

/// `make publish` refuses what it cannot push, saying why, before it builds or pushes
/// anything.
#[test]
fn publish_refuses_a_registry_or_version_it_cannot_use() {
    for (registry, version, why) in [
        ("", "", "REGISTRY is not set"),
        (
            "team",
            "",
            "would be read as a Docker Hub user (docker.io/team)",
        ),
        ("Quay.io/Team", "", "is not host[:port]/path in lower case"),
        ("quay.io/team;rm", "", "is not host[:port]/path"),
        ("quay.io/team", "v1", "VERSION=v1 is not a semantic version"),
        ("quay.io/team", "1.0.0+build", "is not a semantic version"),
    ] {
        let out = Command::new(workspace_root().join("hack/publish.sh"))
            .env("REGISTRY", registry)
            .env("VERSION", version)
            .output()
            .expect("hack/publish.sh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{registry:?} {version:?} accepted");
        assert!(stderr.contains(why), "{registry:?} {version:?}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing published: {out:?}");
    }
}
