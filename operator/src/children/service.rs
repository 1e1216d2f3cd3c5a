//! The MCP Service. On OpenShift it asks the service CA for the server's certificate.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use cli_mcp_api::crd::AuthMode;
use cli_mcp_api::names::label;

use super::{secrets, Inputs, HEALTH_PORT};

pub fn service(inp: &Inputs) -> Service {
    let mcp_name = match inp.spec.auth {
        AuthMode::Kubernetes => "https",
        AuthMode::None => "http",
    };
    let mut metadata = inp
        .spec
        .meta(inp.spec.name.server(), label::COMPONENT_SERVER);
    if inp.spec.service_ca {
        metadata.annotations = Some(std::collections::BTreeMap::from([(
            secrets::SERVING_CERT_ANNOTATION.to_owned(),
            inp.spec.tls_secret.clone(),
        )]));
    }
    Service {
        metadata,
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(inp.spec.selector(label::COMPONENT_SERVER)),
            ports: Some(vec![
                ServicePort {
                    name: Some(mcp_name.into()),
                    port: inp.spec.mcp_port(),
                    target_port: Some(IntOrString::String(mcp_name.into())),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                },
                ServicePort {
                    name: Some("metrics".into()),
                    port: HEALTH_PORT,
                    target_port: Some(IntOrString::String("health".into())),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    #[test]
    fn service_selects_server_pods_on_the_mcp_port() {
        let s = service(&inputs(serde_json::json!({})));
        let spec = s.spec.expect("spec");
        let sel = spec.selector.expect("selector");
        assert_eq!(sel[label::COMPONENT], "server");
        assert_eq!(sel[label::INSTANCE], "demo");
        let ports = spec.ports.expect("ports");
        assert_eq!(ports[0].port, 8443);
        assert_eq!(ports[0].name.as_deref(), Some("https"));
        assert_eq!(s.metadata.annotations, None, "no service CA off OpenShift");
    }

    #[test]
    fn on_openshift_the_service_asks_the_service_ca_for_the_certificate() {
        let mut inp = inputs(serde_json::json!({}));
        inp.spec.use_service_ca();
        let s = service(&inp);
        let ann = s.metadata.annotations.expect("annotations");
        assert_eq!(
            ann[secrets::SERVING_CERT_ANNOTATION],
            "cli-mcp-demo-service-tls"
        );

        // The admin's certificate always wins; plain HTTP needs none.
        for spec in [
            serde_json::json!({"server": {"tlsSecretName": "mine"}}),
            serde_json::json!({"server": {"auth": "None"}}),
        ] {
            let mut inp = inputs(spec);
            inp.spec.use_service_ca();
            assert!(!inp.spec.service_ca);
            assert_eq!(service(&inp).metadata.annotations, None);
        }
    }
}
