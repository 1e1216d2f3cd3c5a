//! The generate-once Secrets (HMAC key, serving CA and certificate, proxy CA): read from the
//! cache, created when absent — created, never applied, so an existing Secret is never
//! overwritten — and never one of a deleted predecessor of the same name.

use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::crd::CliMcpInstance;

use super::Problem;
use crate::api_call::{delete_exactly, is_status};
use crate::context::{cached, Context};
use crate::error::{Error, Result};

/// Reads a Secret from the managed-Secret cache, falling back to the API.
pub(super) async fn read_secret(ctx: &Context, ns: &str, name: &str) -> Result<Option<Secret>> {
    if let Some(s) = cached(&ctx.stores.secrets, ns, name) {
        return Ok(Some((*s).clone()));
    }
    Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(Error::resolving(format!("Secret {ns}/{name}")))
}

/// Creates `secret` unless it exists; never overwrites. Returns the stored Secret and
/// whether this call created it.
pub(super) async fn create_once(
    ctx: &Context,
    ns: &str,
    secret: &Secret,
) -> Result<(Secret, bool)> {
    let api = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    let name = secret.name_any();
    match api.create(&PostParams::default(), secret).await {
        Ok(s) => {
            ctx.metrics.api_write("Secret", "create");
            Ok((s, true))
        }
        Err(e) if is_status(&e, 409) => {
            let s = api
                .get(&name)
                .await
                .map_err(Error::resolving(format!("Secret {ns}/{name}")))?;
            Ok((s, false))
        }
        Err(e) => Err(Error::resolving(format!("creating Secret {ns}/{name}"))(e)),
    }
}

/// A generate-once Secret as this instance may use it.
pub(super) enum Own {
    Absent,
    Usable(Box<Secret>),
    Blocked(Problem),
}

/// The UID of the instance that controls `s`, when that is not `cr`: a predecessor of the
/// same name whose garbage is not collected yet. A Secret without such an owner (made by an
/// admin, or orphaned on purpose) is not a predecessor's.
fn predecessor(s: &Secret, cr: &CliMcpInstance) -> Option<String> {
    let own = cr.uid()?;
    s.owner_references()
        .iter()
        .find(|r| r.controller == Some(true) && r.kind == CliMcpInstance::kind(&()))
        .filter(|r| r.uid != own)
        .map(|r| r.uid.clone())
}

/// Reads a generate-once Secret, never handing out one of a deleted predecessor of the same
/// name: its HMAC key would let the old instance's session tokens open the new instance's
/// sandboxes (and its certificates and CAs are the old instance's). Such a Secret is
/// deleted (UID precondition, so a new one is never hit) and generated anew; while
/// something holds it (a finalizer) the instance waits, saying so.
pub(super) async fn own_secret(
    ctx: &Context,
    cr: &CliMcpInstance,
    ns: &str,
    name: &str,
) -> Result<Own> {
    let Some(s) = read_secret(ctx, ns, name).await? else {
        return Ok(Own::Absent);
    };
    let Some(old) = predecessor(&s, cr) else {
        return Ok(Own::Usable(Box::new(s)));
    };
    let api = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    if s.metadata.deletion_timestamp.is_none() {
        let dp = delete_exactly(&s, false);
        match api.delete(name, &dp).await {
            Ok(_) => {
                ctx.metrics.api_write("Secret", "delete");
                ctx.publish(
                    cr,
                    EventType::Normal,
                    "PredecessorSecretDeleted",
                    format!("deleted Secret {name} of the deleted instance of the same name (uid {old}); a new one is generated"),
                )
                .await;
            }
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => {}
            // Without `delete` on Secrets the garbage collector still removes it: wait.
            Err(e) if is_status(&e, 403) => tracing::warn!(
                "cannot delete Secret {ns}/{name} of a deleted predecessor: {e}; waiting for garbage collection"
            ),
            Err(e) => return Err(Error::resolving(format!("deleting Secret {ns}/{name}"))(e)),
        }
    }
    let again = api.get_opt(name).await;
    Ok(
        match again.map_err(Error::resolving(format!("Secret {ns}/{name}")))? {
            None => Own::Absent,
            Some(s) if predecessor(&s, cr).is_none() => Own::Usable(Box::new(s)),
            Some(_) => Own::Blocked(Problem::Missing(format!(
                "{name} (still the Secret of the deleted instance of the same name, uid {old}; \
             it is being deleted and a new one is generated once it is gone)"
            ))),
        },
    )
}

/// [`own_secret`], creating the Secret `make` builds when there is none and publishing
/// the Event `(reason, message)` when this call created it. `Err` is why the instance
/// cannot have it yet.
pub(super) async fn own_or_create(
    ctx: &Context,
    cr: &CliMcpInstance,
    ns: &str,
    name: &str,
    make: impl FnOnce() -> Result<Secret>,
    created_event: (&str, String),
) -> Result<std::result::Result<Secret, Problem>> {
    match own_secret(ctx, cr, ns, name).await? {
        Own::Usable(s) => Ok(Ok(*s)),
        Own::Blocked(p) => Ok(Err(p)),
        Own::Absent => {
            let (s, created) = create_once(ctx, ns, &make()?).await?;
            // Lost a race with a Secret the cache did not show yet: judged next time.
            if predecessor(&s, cr).is_some() {
                return Ok(Err(Problem::Missing(format!(
                    "{name} (still the Secret of the deleted instance of the same name)"
                ))));
            }
            if created {
                let (reason, message) = created_event;
                ctx.publish(cr, EventType::Normal, reason, message).await;
            }
            Ok(Ok(s))
        }
    }
}
