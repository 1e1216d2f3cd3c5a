//! The checked-in CRD copies must equal what the Rust types generate.
//! Fix a failure with `hack/crdgen.sh` (or `UPDATE_CRDS=1 cargo test --test crd_sync`).

use std::path::PathBuf;

use cli_mcp_operator::crdgen::{crd_yaml, CHECKED_IN};

#[test]
fn checked_in_crd_yaml_is_current() {
    // The checkout the test runs in (cargo sets this at run time too): the compiled-in path
    // is another checkout's when a target dir is shared by two.
    let package = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let root = package.parent().expect("workspace root");
    let generated = crd_yaml().expect("CRD serialises");
    let mut stale = Vec::new();
    for rel in CHECKED_IN {
        let path = root.join(rel);
        if std::env::var_os("UPDATE_CRDS").is_some() {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).expect("create dir");
            }
            std::fs::write(&path, &generated).expect("write CRD");
            continue;
        }
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current != generated {
            stale.push(rel.to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "stale CRD YAML: {stale:?}; regenerate with hack/crdgen.sh (or UPDATE_CRDS=1 cargo test -p cli-mcp-operator --test crd_sync)"
    );
}
