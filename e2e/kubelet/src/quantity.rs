//! Minimal Kubernetes resource quantity parsing (`128Mi`, `500m`, `1.5`, `2e3`).

/// Parses a quantity into a floating-point number of base units (bytes, cores).
pub fn parse(q: &str) -> Option<f64> {
    let q = q.trim();
    if q.is_empty() {
        return None;
    }
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let value: f64 = num.parse().ok()?;
    let mult = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        s if s.starts_with(['e', 'E']) => 10f64.powi(s[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    Some(value * mult)
}

/// Parses a quantity that must be a whole number of bytes (rounded up).
pub fn parse_bytes(q: &str) -> Option<u64> {
    let v = parse(q)?;
    (v >= 0.0).then(|| v.ceil() as u64)
}

/// Divides `value` by `divisor` and rounds up, as the downward API does for resource fields.
pub fn divide_ceil(value: f64, divisor: f64) -> Option<i64> {
    if divisor <= 0.0 {
        return None;
    }
    let r = value / divisor;
    // Guard against float noise such as 0.5/0.001 = 500.00000000000006.
    let rounded = r.round();
    if (r - rounded).abs() < 1e-9 {
        Some(rounded as i64)
    } else {
        Some(r.ceil() as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse_bytes("128Mi"), Some(128 * 1024 * 1024));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("1500"), Some(1500));
        assert_eq!(parse_bytes("1.5Ki"), Some(1536));
        assert_eq!(parse("500m"), Some(0.5));
        assert_eq!(parse("2e3"), Some(2000.0));
        assert_eq!(parse("abc"), None);
        assert_eq!(parse("5Xi"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn divides_up() {
        let half = parse("500m").expect("valid");
        assert_eq!(divide_ceil(half, 1.0), Some(1));
        assert_eq!(divide_ceil(half, 0.001), Some(500));
        assert_eq!(
            divide_ceil(64.0 * 1024.0 * 1024.0, 1024.0 * 1024.0),
            Some(64)
        );
        assert_eq!(divide_ceil(1.0, 0.0), None);
    }
}
