//! The checked-in CRD copies must equal what the Rust types generate.
//! Fix a failure with `hack/crdgen.sh` (or `UPDATE_CRDS=1 cargo test --test crd_sync`).

use std::path::Path;

use cli_mcp_operator::crdgen::{crd_yaml, CHECKED_IN};

#[test]
fn checked_in_crd_yaml_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
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
