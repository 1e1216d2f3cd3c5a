//! Tool schemas keep to the formats JSON Schema itself defines. schemars annotates Rust
//! integers with `format: "uint64"`, `"int32"` and the like, which no JSON Schema validator
//! knows: the TypeScript SDK's (Ajv) prints `unknown format "uint64" ignored` on every call.
//! The integer's range already says what such a format would.

use serde_json::{Map, Value};

/// The `format` values of JSON Schema 2020-12 (Validation, section 7.3).
pub const STANDARD_FORMATS: &[&str] = &[
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// A schemars transform (`#[schemars(transform = standard_formats_only)]`): removes every
/// `format` outside [`STANDARD_FORMATS`], in the schema and all its subschemas.
pub fn standard_formats_only(schema: &mut schemars::Schema) {
    if let Some(object) = schema.as_object_mut() {
        strip_object(object);
    }
}

fn strip_object(object: &mut Map<String, Value>) {
    let nonstandard = object
        .get("format")
        .and_then(Value::as_str)
        .is_some_and(|f| !STANDARD_FORMATS.contains(&f));
    if nonstandard {
        object.remove("format");
    }
    for child in object.values_mut() {
        strip_value(child);
    }
}

fn strip_value(value: &mut Value) {
    match value {
        Value::Object(object) => strip_object(object),
        Value::Array(items) => items.iter_mut().for_each(strip_value),
        _ => {}
    }
}

/// Every `format` string in `schema` and its subschemas, with its JSON pointer.
pub fn formats(schema: &Value) -> Vec<(String, String)> {
    fn walk(value: &Value, path: &str, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(object) => {
                if let Some(Value::String(f)) = object.get("format") {
                    out.push((path.to_owned(), f.clone()));
                }
                for (k, v) in object {
                    walk(v, &format!("{path}/{k}"), out);
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &format!("{path}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(schema, "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_nonstandard_formats_go() {
        let mut schema = schemars::Schema::try_from(json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer", "format": "uint64", "minimum": 0},
                "when": {"type": "string", "format": "date-time"},
                "format": {"type": "string"},
                "any": {"anyOf": [{"type": "integer", "format": "int32"}, {"type": "null"}]}
            }
        }))
        .expect("an object schema");
        standard_formats_only(&mut schema);
        let v = schema.as_value();
        assert_eq!(
            formats(v),
            vec![("/properties/when".to_owned(), "date-time".to_owned())]
        );
        assert_eq!(v["properties"]["n"]["minimum"], 0, "the range stays");
        assert_eq!(
            v["properties"]["format"]["type"], "string",
            "a property named format stays"
        );
    }
}
