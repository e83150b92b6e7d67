//! Typed views of the request contents we act on. Fields a client may leave out get the
//! defaults the messaging spec gives them.

use serde::Deserialize;
use serde_json::{Map, Value};

fn yes() -> bool {
    true
}

/// An execute_request's content.
#[derive(Debug, Clone, Deserialize)]
pub struct ExecuteRequest {
    pub code: String,
    #[serde(default)]
    pub silent: bool,
    #[serde(default = "yes")]
    store_history: bool,
    /// Whether the frontend answers input_request (ipykernel's default when absent: no).
    #[serde(default)]
    pub allow_stdin: bool,
    /// Expressions to evaluate after the cell (`null` is taken as none).
    #[serde(default, deserialize_with = "map_or_null")]
    pub user_expressions: Map<String, Value>,
}

impl ExecuteRequest {
    pub fn parse(content: &Value) -> Result<Self, serde_json::Error> {
        Self::deserialize(content)
    }

    /// Whether the cell takes an execution count and goes into history: never when silent,
    /// as the spec says.
    pub fn stores_history(&self) -> bool {
        !self.silent && self.store_history
    }
}

fn map_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Map<String, Value>, D::Error> {
    Ok(Option::<Map<String, Value>>::deserialize(d)?.unwrap_or_default())
}

/// The code and cursor of complete_request, inspect_request and is_complete_request.
#[derive(Debug, Clone, Deserialize)]
pub struct CodeAt {
    pub code: String,
    /// In characters (unicode scalar values); the end of the code when absent.
    cursor_pos: Option<usize>,
}

impl CodeAt {
    pub fn parse(content: &Value) -> Result<Self, serde_json::Error> {
        Self::deserialize(content)
    }

    pub fn cursor(&self) -> usize {
        self.cursor_pos.unwrap_or_else(|| self.code.chars().count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_the_spec() {
        let r = ExecuteRequest::parse(&json!({"code": "1"})).unwrap();
        assert!(!r.silent && r.stores_history() && !r.allow_stdin);
        assert!(r.user_expressions.is_empty());
        let r = ExecuteRequest::parse(&json!({"code": "", "silent": true, "store_history": true,
                                               "user_expressions": null}))
        .unwrap();
        assert!(!r.stores_history(), "silent never stores history");
        assert!(ExecuteRequest::parse(&json!({"code": 3})).is_err());
        assert!(ExecuteRequest::parse(&json!({})).is_err());
    }

    #[test]
    fn the_cursor_defaults_to_the_end_in_characters() {
        let at = CodeAt::parse(&json!({"code": "%gpumém"})).unwrap();
        assert_eq!(at.cursor(), 7);
        let at = CodeAt::parse(&json!({"code": "%gpumem", "cursor_pos": 3})).unwrap();
        assert_eq!(at.cursor(), 3);
    }
}
