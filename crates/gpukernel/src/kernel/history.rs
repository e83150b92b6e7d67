//! In-memory input history for history_request (tail, range, search).

use serde_json::{json, Value};

/// The session number we report: history lives only as long as this process.
pub const SESSION: u64 = 1;

#[derive(Default)]
pub struct History {
    /// (execution count, source, text output) of each stored cell.
    entries: Vec<(u64, String, String)>,
}

impl History {
    pub fn record(&mut self, count: u64, source: &str, output: String) {
        self.entries.push((count, source.to_string(), output));
    }

    /// Builds the `history` list of a history_reply for `request` (its content).
    pub fn query(&self, request: &Value) -> Vec<Value> {
        let output = request
            .get("output")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let n = request.get("n").and_then(Value::as_u64);
        let selected: Vec<&(u64, String, String)> =
            match request.get("hist_access_type").and_then(Value::as_str) {
                Some("tail") => {
                    let n = n.unwrap_or(10) as usize;
                    self.entries.iter().rev().take(n).rev().collect()
                }
                Some("range") => {
                    let session = request.get("session").and_then(Value::as_i64).unwrap_or(0);
                    if session != 0 && session != SESSION as i64 {
                        return Vec::new();
                    }
                    let start = request.get("start").and_then(Value::as_u64).unwrap_or(0);
                    let stop = request.get("stop").and_then(Value::as_u64);
                    self.entries
                        .iter()
                        .filter(|(c, _, _)| *c >= start && stop.is_none_or(|s| *c < s))
                        .collect()
                }
                Some("search") => {
                    let pattern = request
                        .get("pattern")
                        .and_then(Value::as_str)
                        .unwrap_or("*");
                    let unique = request
                        .get("unique")
                        .and_then(Value::as_bool)
                        .unwrap_or(false);
                    let mut hits: Vec<&(u64, String, String)> = self
                        .entries
                        .iter()
                        .filter(|(_, source, _)| glob_match(pattern, source))
                        .collect();
                    if unique {
                        let mut seen = std::collections::HashSet::new();
                        let mut kept: Vec<_> = hits
                            .into_iter()
                            .rev()
                            .filter(|(_, s, _)| seen.insert(s.clone()))
                            .collect();
                        kept.reverse();
                        hits = kept;
                    }
                    if let Some(n) = n {
                        let skip = hits.len().saturating_sub(n as usize);
                        hits.drain(..skip);
                    }
                    hits
                }
                _ => Vec::new(),
            };
        selected
            .into_iter()
            .map(|(count, source, out)| {
                if output {
                    json!([SESSION, count, [source, out]])
                } else {
                    json!([SESSION, count, source])
                }
            })
            .collect()
    }
}

/// Shell-style glob (`*`, `?`) over the whole text, as IPython's history search does.
fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history() -> History {
        let mut h = History::default();
        for (i, code) in ["%gpumem", "%echo a", "%gpumem --json", "%echo a"]
            .iter()
            .enumerate()
        {
            h.record(i as u64 + 1, code, format!("out{i}"));
        }
        h
    }

    #[test]
    fn tail_range_and_search() {
        let h = history();
        let tail = h.query(&json!({"hist_access_type": "tail", "n": 2}));
        assert_eq!(
            tail,
            vec![json!([1, 3, "%gpumem --json"]), json!([1, 4, "%echo a"])]
        );
        let range =
            h.query(&json!({"hist_access_type": "range", "session": 0, "start": 2, "stop": 3}));
        assert_eq!(range, vec![json!([1, 2, "%echo a"])]);
        let search = h.query(&json!({"hist_access_type": "search", "pattern": "%gpu*"}));
        assert_eq!(search.len(), 2);
        let unique =
            h.query(&json!({"hist_access_type": "search", "pattern": "%echo*", "unique": true}));
        assert_eq!(unique, vec![json!([1, 4, "%echo a"])]);
        let with_output = h.query(&json!({"hist_access_type": "tail", "n": 1, "output": true}));
        assert_eq!(with_output, vec![json!([1, 4, ["%echo a", "out3"]])]);
    }

    #[test]
    fn glob() {
        assert!(glob_match("*", "anything"));
        assert!(glob_match("%gpu?em*", "%gpumem --json"));
        assert!(!glob_match("%gpu", "%gpumem"));
    }
}
