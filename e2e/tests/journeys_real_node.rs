//! The admin, session, warm-pool and teardown journeys (`cli_mcp_e2e::journey::journeys`,
//! the code `journeys.rs` runs on the process kubelet) on real containers: a private
//! real-node cluster (kubelet + kube-proxy on containerd/runc) with the project's images,
//! built from this run's debug binaries by `hack/build-images.sh` (cached by its inputs
//! outside the repo) and imported under the names the manifests use. The operator is
//! installed from config/default, and its server and sandbox pods run those images under
//! the restricted securityContext the operator gives them.
//!
//! Beside them, the design's client journey with the official Go MCP SDK
//! (`cli_mcp_e2e::go_sdk`): a Go service's `X-Session-ID` and bearer token on every request,
//! `kubectl` and shell state across calls, failures as tool results, `DELETE
//! /sessions/{id}` and the sandbox pod gone. Its client (`e2e/tools/go-journey`, cached)
//! builds while the cluster starts.
//!
//! And a session's life under each sandbox runtime, runc and gVisor
//! (`cli_mcp_e2e::journey::runtime_session`: the runtime proven, timeout, cancel, progress,
//! spill and workspace resources, `DELETE`), with the session journey above run once more
//! with its sandboxes under gVisor.
//!
//! Skipped, saying so, when not root or when the host cannot run the real node
//! (`node::preflight`: containerd, runc, iptables, ...; hack/prereqs.sh installs them).

use std::time::Instant;

use cli_mcp_e2e::cluster::ClusterConfig;
use cli_mcp_e2e::go_sdk;
use cli_mcp_e2e::journey::{journeys, runtime_session, Env};
use cli_mcp_e2e::node::{self, NodeKind};
use cli_mcp_e2e::project_images;
use cli_mcp_e2e::runtime::SandboxRuntime;
use cli_mcp_e2e::testing::{self, workspace_root};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;

/// The operator's pod of `env` runs the imported image in a containerd container.
async fn assert_operator_is_a_container(env: &Env) {
    let pods = env
        .api::<Pod>()
        .list(&ListParams::default().labels("app.kubernetes.io/name=cli-mcp-operator"))
        .await
        .expect("list operator pods");
    let status = pods
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref()?.first())
        .find(|c| c.ready)
        .unwrap_or_else(|| panic!("no ready operator container in {}", env.ns.name))
        .clone();
    assert!(
        status
            .container_id
            .as_deref()
            .is_some_and(|id| id.starts_with("containerd://")),
        "{status:?}"
    );
    // The pod names `cli-mcp-operator:e2e`; containerd may report the image under any of the
    // names it was imported with (`:e2e` or the version tag: the same image ID).
    assert!(
        status
            .image
            .starts_with("docker.io/library/cli-mcp-operator:"),
        "the operator runs the project's image: {status:?}"
    );
    assert!(status.image_id.contains("sha256:"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_session_warm_pool_and_teardown_journeys_on_real_containers() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP journeys_real_node: needs root (containerd, cgroups, network namespaces)");
        return;
    }
    let bin_dir = testing::binaries_dir().expect("binaries dir");
    let run_dir = workspace_root().join(".run/e2e-journeys-real-node");
    let mut cfg = ClusterConfig::local(&bin_dir, run_dir).expect("cluster config");
    if let Err(e) = node::preflight(&cfg.control_plane_bin) {
        eprintln!("SKIP journeys_real_node: {e}");
        return;
    }
    cfg.node = NodeKind::Real;
    cfg.images.clear();

    // The images and the Go SDK client build (seconds when cached) while the cluster starts.
    let t = Instant::now();
    let go_client = tokio::spawn(go_sdk::client_binary());
    let build = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        project_images::build(&bin_dir).map(|i| (i, t.elapsed()))
    });
    let pc = testing::private_cluster_with(cfg)
        .await
        .expect("a private real-node cluster");
    let (images, build_took) = build
        .await
        .expect("image build task")
        .expect("hack/build-images.sh");
    let t_import = Instant::now();
    let names = pc
        .cluster
        .import_project_images(&images)
        .expect("import the project images");
    eprintln!(
        "journeys_real_node: cluster Ready in {:.1}s, images built in {:.1}s (in parallel), \
         imported in {:.1}s: {}",
        pc.cluster.ready_after().as_secs_f64(),
        build_took.as_secs_f64(),
        t_import.elapsed().as_secs_f64(),
        names.join(", ")
    );
    let setup = t.elapsed();

    let t = Instant::now();
    let c = pc.test.clone();
    let admin = async {
        let env = Env::install_on(c.clone(), "r-admin").await;
        assert_operator_is_a_container(&env).await;
        journeys::admin_installs_and_investigates_read_only(env).await;
    };
    let session = async {
        journeys::agent_session_keeps_state_and_ends_cleanly(
            Env::install_on(c.clone(), "r-session").await,
        )
        .await;
    };
    let warm = async {
        journeys::warm_pool_serves_a_burst_and_refills(Env::install_on(c.clone(), "r-warm").await)
            .await;
    };
    let teardown = async {
        journeys::deleting_the_cr_with_live_sessions_removes_everything(
            Env::install_on(c.clone(), "r-teardown").await,
        )
        .await;
    };
    let go = async {
        // A cold build (~40 s) goes on while the operator installs.
        let (env, client) = tokio::join!(Env::install_on(c.clone(), "r-go"), go_client);
        let client = client
            .expect("Go client build task")
            .unwrap_or_else(|e| panic!("the Go SDK client: {e}"));
        go_sdk::design_client_journey(env, client).await;
    };
    let runtimes = async {
        let life = |rt: SandboxRuntime| {
            let c = c.clone();
            async move {
                let env = Env::install_on(c, &format!("r-life-{}", rt.name())).await;
                runtime_session::a_session_lives_under_its_runtime(env.under(rt)).await;
            }
        };
        let gvisor_session = async {
            let env = Env::install_on(c.clone(), "r-session-gvisor").await;
            journeys::agent_session_keeps_state_and_ends_cleanly(env.under(SandboxRuntime::Gvisor))
                .await;
        };
        tokio::join!(
            life(SandboxRuntime::Runc),
            life(SandboxRuntime::Gvisor),
            gvisor_session
        );
    };
    tokio::join!(admin, session, warm, teardown, go, runtimes);
    eprintln!(
        "journeys_real_node: setup {:.1}s, eight journeys {:.1}s",
        setup.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    drop(pc);
    eprintln!(
        "journeys_real_node: teardown {:.1}s",
        t.elapsed().as_secs_f64()
    );
}
