//! `spec.sandbox.warmPool`: a warm pool the operator sizes by demand, between bounds, instead
//! of the fixed `spec.sandbox.warmPoolSize`. What the bounds mean as values is
//! [`WarmPoolSizing`]; how the operator picks a size within them is its `demand::autoscale`.

use std::time::Duration;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::values::parse_duration;
use super::{CrdError, SandboxSpec, MAX_WARM_POOL};

/// Bounds of a warm pool sized by demand.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.min <= self.max").message(
    "spec.sandbox.warmPool.min must not exceed warmPool.max"
))]
pub struct WarmPoolBounds {
    /// Fewest warm sandboxes, kept through a quiet hour too (0..200).
    #[schemars(range(min = 0, max = 200))]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 200").message(
        "spec.sandbox.warmPool.min must be between 0 and 200"
    ))]
    pub min: i32,

    /// Most warm sandboxes, however many sessions arrive (1..200); each is a running pod.
    #[schemars(range(min = 1, max = 200))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 200").message(
        "spec.sandbox.warmPool.max must be between 1 and 200; each warm sandbox is a running pod"
    ))]
    pub max: i32,

    /// How long demand must stay lower before the pool shrinks towards it (a Go-style
    /// duration between 30s and 24h, default 5m). The pool grows at once; shrinking only
    /// after a calm this long keeps a steady rate of sessions from churning pods.
    #[serde(default = "default_scale_down_delay")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new(
        "self.matches('^([0-9]+(s|m|h))+$') && duration(self) >= duration('30s') && duration(self) <= duration('24h')"
    ).message(
        "spec.sandbox.warmPool.scaleDownDelay must be a duration such as 5m or 90s between 30s and 24h"
    ))]
    pub scale_down_delay: String,
}

const MIN_SCALE_DOWN_DELAY: Duration = Duration::from_secs(30);
const MAX_SCALE_DOWN_DELAY: Duration = Duration::from_secs(24 * 3600);

fn default_scale_down_delay() -> String {
    "5m".into()
}

/// How an instance's warm pool is sized: a fixed number (`warmPoolSize`) or by demand within
/// bounds (`warmPool`). Admission lets only one of the two through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmPoolSizing {
    Fixed(i32),
    ByDemand(DemandBounds),
}

/// `spec.sandbox.warmPool` as values: `min <= max`, both within `0..=MAX_WARM_POOL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemandBounds {
    pub min: i32,
    pub max: i32,
    pub scale_down_delay: Duration,
}

impl DemandBounds {
    /// `size` within the bounds.
    pub fn clamp(&self, size: i32) -> i32 {
        size.clamp(self.min, self.max)
    }
}

impl SandboxSpec {
    /// How the warm pool is sized. Fails only for objects that bypassed admission.
    pub fn warm_pool_sizing(&self) -> Result<WarmPoolSizing, CrdError> {
        let Some(b) = &self.warm_pool else {
            return Ok(WarmPoolSizing::Fixed(
                self.warm_pool_size.clamp(0, MAX_WARM_POOL),
            ));
        };
        let bad = |value: String| CrdError::WarmPool(value);
        if self.warm_pool_size != 0 {
            return Err(bad(format!(
                "warmPoolSize is {} as well; set one of warmPoolSize and warmPool",
                self.warm_pool_size
            )));
        }
        if !(0..=MAX_WARM_POOL).contains(&b.min) || !(1..=MAX_WARM_POOL).contains(&b.max) {
            return Err(bad(format!(
                "min {} and max {} must be within 0..={MAX_WARM_POOL} (max at least 1)",
                b.min, b.max
            )));
        }
        if b.min > b.max {
            return Err(bad(format!("min {} exceeds max {}", b.min, b.max)));
        }
        // Admission's range: without it a delay of 0 would take away the hold.
        let scale_down_delay = parse_duration(&b.scale_down_delay)
            .filter(|d| (MIN_SCALE_DOWN_DELAY..=MAX_SCALE_DOWN_DELAY).contains(d))
            .ok_or_else(|| CrdError::Duration {
                field: "spec.sandbox.warmPool.scaleDownDelay",
                value: b.scale_down_delay.clone(),
            })?;
        Ok(WarmPoolSizing::ByDemand(DemandBounds {
            min: b.min,
            max: b.max,
            scale_down_delay,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(size: i32, bounds: Option<(i32, i32, &str)>) -> SandboxSpec {
        SandboxSpec {
            warm_pool_size: size,
            warm_pool: bounds.map(|(min, max, delay)| WarmPoolBounds {
                min,
                max,
                scale_down_delay: delay.into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_fixed_size_or_bounds_each_mean_one_sizing() {
        assert_eq!(
            spec(7, None).warm_pool_sizing(),
            Ok(WarmPoolSizing::Fixed(7))
        );
        assert_eq!(
            spec(0, Some((2, 40, "90s"))).warm_pool_sizing(),
            Ok(WarmPoolSizing::ByDemand(DemandBounds {
                min: 2,
                max: 40,
                scale_down_delay: Duration::from_secs(90),
            }))
        );
    }

    #[test]
    fn bounds_that_bypassed_admission_are_refused_with_what_to_fix() {
        for (s, says) in [
            (
                spec(3, Some((0, 10, "5m"))),
                "set one of warmPoolSize and warmPool",
            ),
            (spec(0, Some((5, 2, "5m"))), "min 5 exceeds max 2"),
            (spec(0, Some((0, 0, "5m"))), "max at least 1"),
            (spec(0, Some((0, 201, "5m"))), "within 0..=200"),
            (spec(0, Some((0, 2, "soon"))), "scaleDownDelay"),
            (spec(0, Some((0, 2, "0s"))), "scaleDownDelay"),
            (spec(0, Some((0, 2, "25h"))), "scaleDownDelay"),
        ] {
            let e = s.warm_pool_sizing().expect_err(says).to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn the_bounds_clamp_a_size() {
        let b = DemandBounds {
            min: 2,
            max: 9,
            scale_down_delay: Duration::from_secs(60),
        };
        assert_eq!((b.clamp(0), b.clamp(5), b.clamp(50)), (2, 5, 9));
    }
}
