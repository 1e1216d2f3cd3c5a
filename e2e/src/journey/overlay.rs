//! The kustomize overlay the journeys install the operator with: `config/default` as shipped,
//! scoped to the test's namespace and running the tests' images.

use crate::instance::{PROXY_IMAGE, SANDBOX_IMAGE, SERVER_IMAGE};

/// The kustomization of an overlay of `config/default` (in `.run/<dir>/`) that installs
/// the operator into `namespace`, watching only it, with the test images. `journey` adds
/// what parallel journeys need: a name prefix for its cluster-wide RBAC, one replica, a 10m
/// CPU request.
pub fn operator_overlay(namespace: &str, journey: bool) -> String {
    let n = namespace;
    let (prefix, trim) = if journey {
        (
            format!("namePrefix: {n}-\n"),
            "      - op: replace
        path: /spec/replicas
        value: 1
      - op: replace
        path: /spec/template/spec/containers/0/resources/requests/cpu
        value: 10m
",
        )
    } else {
        (String::new(), "")
    };
    format!(
        r#"resources:
  - ../../config/default
namespace: {n}
{prefix}patches:
  - target: {{kind: Deployment, name: cli-mcp-operator}}
    patch: |-
{trim}      - op: replace
        path: /spec/template/spec/containers/0/image
        value: cli-mcp-operator:e2e
      - op: replace
        path: /spec/template/spec/containers/0/env/0/value
        value: {SERVER_IMAGE}
      - op: replace
        path: /spec/template/spec/containers/0/env/1/value
        value: {SANDBOX_IMAGE}
      - op: replace
        path: /spec/template/spec/containers/0/env/2/value
        value: {n}
      - op: test
        path: /spec/template/spec/containers/0/env/3/name
        value: RELATED_IMAGE_PROXY
      - op: replace
        path: /spec/template/spec/containers/0/env/3/value
        value: {PROXY_IMAGE}
"#
    )
}
