//! Reply contents both kernel modes send for the requests they answer themselves.

use crate::magics::{Bundle, MagicError, Registry};
use serde_json::{json, Map, Value};

/// The execute_reply of a cell: `ok` with its pager payload, or the error that stopped it.
pub fn execute_reply(
    execution_count: u64,
    outcome: Result<Vec<Value>, MagicError>,
    user_expressions: Map<String, Value>,
) -> Value {
    match outcome {
        Ok(payload) => json!({
            "status": "ok",
            "execution_count": execution_count,
            "user_expressions": user_expressions,
            "payload": payload,
        }),
        Err(e) => json!({
            "status": "error",
            "execution_count": execution_count,
            "ename": e.ename,
            "evalue": e.evalue,
            "traceback": e.traceback,
            "user_expressions": user_expressions,
            "payload": [],
        }),
    }
}

/// Pager bundles (help text) as execute_reply payload entries.
pub fn pages(bundles: Vec<Bundle>) -> impl Iterator<Item = Value> {
    bundles
        .into_iter()
        .map(|data| json!({"source": "page", "data": data, "start": 0}))
}

pub fn complete(registry: &Registry, code: &str, cursor: usize) -> Value {
    match registry.complete(code, cursor) {
        Some(c) => json!({
            "status": "ok",
            "matches": c.matches,
            "cursor_start": c.cursor_start,
            "cursor_end": c.cursor_end,
            "metadata": {},
        }),
        None => json!({
            "status": "ok", "matches": [], "cursor_start": cursor, "cursor_end": cursor, "metadata": {},
        }),
    }
}

pub fn inspect(registry: &Registry, code: &str, cursor: usize) -> Value {
    match registry.inspect(code, cursor) {
        Some(text) => {
            json!({"status": "ok", "found": true, "data": {"text/plain": text}, "metadata": {}})
        }
        None => json!({"status": "ok", "found": false, "data": {}, "metadata": {}}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_reply_carries_the_error_and_no_payload() {
        let ok = execute_reply(3, Ok(vec![json!({"source": "page"})]), Map::new());
        assert_eq!(ok["status"], "ok");
        assert_eq!(ok["execution_count"], 3);
        assert_eq!(ok["payload"].as_array().map(Vec::len), Some(1));
        let err = execute_reply(4, Err(MagicError::new("UsageError", "bad")), Map::new());
        assert_eq!(err["status"], "error");
        assert_eq!(err["ename"], "UsageError");
        assert_eq!(err["payload"], json!([]));
    }
}
