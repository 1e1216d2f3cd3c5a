//! The HMAC key that signs every session and assignment token of the instance.

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::label;
use cli_mcp_api::token::HmacKey;

use super::owned::own_or_create;
use super::Problem;
use crate::children::{secrets, Spec};
use crate::context::Context;
use crate::error::Result;

/// The instance's HMAC key (`cli-mcp-<n>-hmac`), generated once: the key when it is usable,
/// the hash of the Secret's value, and what is wrong with it otherwise.
pub(super) async fn ensure_hmac(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<(Option<HmacKey>, String, Option<Problem>)> {
    let name = spec.name.hmac_secret();
    let event = (
        "HmacKeyGenerated",
        format!(
            "generated a new HMAC key in Secret {name}; the server rolls and warm sandboxes \
             are replaced"
        ),
    );
    let made = own_or_create(
        ctx,
        cr,
        &spec.namespace,
        &name,
        || {
            let meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
            Ok(secrets::hmac_secret(meta, &secrets::generate_hmac_key()))
        },
        event,
    )
    .await?;
    let secret = match made {
        Ok(s) => s,
        Err(problem) => return Ok((None, secrets::version_of(&[]), Some(problem))),
    };
    let raw = secrets::secret_value(&secret, secrets::HMAC_KEY);
    let version = secrets::version_of(&[raw.unwrap_or_default()]);
    let parsed = raw
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .map(|t| HmacKey::from_hex(&t));
    Ok(match parsed {
        Some(Ok(key)) => (Some(key), version, None),
        Some(Err(e)) => (
            None,
            version,
            Some(Problem::Invalid(format!(
                "Secret {name} key '{}': {e}; delete the Secret and the operator generates a new one",
                secrets::HMAC_KEY
            ))),
        ),
        None => (
            None,
            version,
            Some(Problem::Invalid(format!(
                "Secret {name} has no key '{}'; delete the Secret and the operator generates a new one",
                secrets::HMAC_KEY
            ))),
        ),
    })
}
