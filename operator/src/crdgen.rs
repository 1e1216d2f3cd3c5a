//! The CRD as YAML, generated from the Rust types (`cli-mcp-operator crdgen`,
//! `hack/crdgen.sh`). The checked-in copies are compared with this by a test.

use kube::CustomResourceExt;
use serde_json::Value;

use cli_mcp_api::crd::CliMcpInstance;

/// Paths of the checked-in copies, relative to the workspace root.
pub const CHECKED_IN: &[&str] = &[
    "config/crd/bases/cli-mcp.redhat.com_climcpinstances.yaml",
    "charts/cli-mcp-operator/crds/cli-mcp.redhat.com_climcpinstances.yaml",
];

/// Doc comments are wrapped at 100 columns; `kubectl explain` wraps again, so join the
/// wrapped lines of a paragraph. Paragraph breaks and list items stay.
pub fn unwrap_description(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    for (i, c) in chars.iter().enumerate() {
        if *c == '\n' {
            let prev_nl = i > 0 && chars[i - 1] == '\n';
            let next = chars.get(i + 1).copied();
            let keeps = prev_nl || matches!(next, None | Some('\n' | '-' | '*' | ' '));
            out.push(if keeps { '\n' } else { ' ' });
        } else {
            out.push(*c);
        }
    }
    out
}

fn unwrap_all(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                match child {
                    Value::String(s) if k == "description" => *s = unwrap_description(s),
                    _ => unwrap_all(child),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(unwrap_all),
        _ => {}
    }
}

pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    let mut crd = serde_json::to_value(CliMcpInstance::crd())
        .map_err(<serde_yaml::Error as serde::ser::Error>::custom)?;
    unwrap_all(&mut crd);
    let body = serde_yaml::to_string(&crd)?;
    Ok(format!(
        "# Generated from api/src/crd.rs by hack/crdgen.sh (cli-mcp-operator crdgen). Do not edit.\n{body}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_lines_are_joined_but_paragraphs_and_lists_kept() {
        assert_eq!(
            unwrap_description("a\nb\n\nc\n- d\n- e"),
            "a b\n\nc\n- d\n- e"
        );
        assert!(crd_yaml().expect("yaml").contains("cli-mcp.redhat.com"));
    }
}
