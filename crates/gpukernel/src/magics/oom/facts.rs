//! What `probe.py` reports from the Python kernel, typed, and what the OOM message says.
//!
//! The exception's type decides whether it is an OOM (in the probe); the message is only read
//! for the numbers PyTorch puts in it (the request, the device, what was reserved but unused).

use serde::{Deserialize, Serialize};

/// The probe's answer: `{"ok": facts}` or `{"failed": why}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeReply<T> {
    Ok(Box<T>),
    Failed(String),
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct ProbeFacts {
    pub torch_imported: bool,
    pub torch_version: Option<String>,
    pub exception: Option<ExceptionFacts>,
    pub is_oom: bool,
    pub cuda_initialized: bool,
    #[serde(default)]
    pub devices: Vec<AllocatorFacts>,
    #[serde(default)]
    pub tensors: Vec<LiveTensor>,
    #[serde(default)]
    pub tensor_bytes_total: u64,
    #[serde(default)]
    pub traceback_bytes: u64,
    #[serde(default)]
    pub traceback_tensors: u64,
    pub model_name: Option<String>,
    pub input_batch: Option<u64>,
    pub batch_variable: Option<String>,
    pub batch_value: Option<u64>,
    pub alloc_conf: Option<String>,
    pub current_device: Option<u32>,
    /// Bytes of the tensors reachable from the notebook's names, per device ("cuda:0").
    #[serde(default)]
    pub named_bytes_by_device: std::collections::BTreeMap<String, u64>,
    /// IPython still holds the failed cell's traceback (and with it every frame's tensors).
    #[serde(default)]
    pub has_traceback: bool,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ExceptionFacts {
    /// Module-qualified type name, e.g. `torch.OutOfMemoryError`.
    #[serde(rename = "type")]
    pub type_name: String,
    pub name: String,
    pub message: String,
    /// The stored exception has the type the cell's execute_reply named (it is this cell's).
    pub matches_reply: bool,
    /// The OOM's own message when the exception wraps one.
    pub oom_message: Option<String>,
}

/// One CUDA device's caching allocator in the Python kernel (torch's CUDA ordinal).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct AllocatorFacts {
    pub index: u32,
    pub uuid: Option<String>,
    pub allocated: u64,
    pub reserved: u64,
    pub peak_allocated: u64,
    /// Free bytes inside partly used segments (torch's `inactive_split_bytes`).
    pub inactive_split: u64,
    pub num_ooms: u64,
    pub num_alloc_retries: u64,
    /// The largest free block inside the reserved segments.
    pub largest_free_block: u64,
    /// Bytes in segments with nothing allocated: what `empty_cache` gives back to the driver.
    pub releasable: u64,
    pub segments: u64,
    pub total_memory: Option<u64>,
    /// `torch.cuda.set_per_process_memory_fraction`'s cap (1.0: none).
    pub memory_fraction: Option<f64>,
}

impl AllocatorFacts {
    /// Reserved but not allocated: cached by the allocator, reusable by this process.
    pub fn reclaimable(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// The byte cap `set_per_process_memory_fraction` puts on this process, if any.
    pub fn cap(&self) -> Option<u64> {
        match (self.memory_fraction, self.total_memory) {
            (Some(f), Some(total)) if f < 1.0 => Some((f * total as f64) as u64),
            _ => None,
        }
    }
}

/// `%oom --release`'s answer: the allocator before and after, per device.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Released {
    pub had_traceback: bool,
    pub devices: Vec<ReleasedDevice>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ReleasedDevice {
    pub index: u32,
    pub allocated_before: u64,
    pub reserved_before: u64,
    pub allocated_after: u64,
    pub reserved_after: u64,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct LiveTensor {
    pub name: String,
    /// `tensor`, `parameters`, `gradients`, `buffers`, `optimizer state`, `held by the traceback`.
    pub kind: String,
    /// The shape of a tensor; for a group (a module's parameters), `[count]`.
    pub shape: Vec<u64>,
    pub dtype: String,
    pub device: String,
    pub bytes: u64,
}

/// The figures PyTorch's OOM message states (CUDA caching allocator wording since 1.x):
/// "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ... of which 1.5 GiB is free.
/// ... and 3.1 GiB is reserved by PyTorch but unallocated."
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MessageFigures {
    pub requested: Option<u64>,
    pub device: Option<u32>,
    pub free_at_oom: Option<u64>,
    pub reserved_unallocated_at_oom: Option<u64>,
    /// What `set_per_process_memory_fraction` allowed ("... 24.00 GiB allowed; ...").
    pub allowed_at_oom: Option<u64>,
    /// "Of the allocated memory 76.50 GiB is allocated by PyTorch".
    pub allocated_at_oom: Option<u64>,
}

/// Reads the numbers in an OOM message; what it cannot find stays `None`.
pub fn parse_message(message: &str) -> MessageFigures {
    MessageFigures {
        requested: size_after(message, "Tried to allocate "),
        device: number_after(message, "GPU ").or_else(|| number_after(message, "device ")),
        free_at_oom: size_after(message, "of which "),
        reserved_unallocated_at_oom: size_before(
            message,
            " is reserved by PyTorch but unallocated",
        ),
        allowed_at_oom: size_before(message, " allowed"),
        allocated_at_oom: size_after(message, "Of the allocated memory "),
    }
}

fn number_after(text: &str, marker: &str) -> Option<u32> {
    let start = text.find(marker)? + marker.len();
    let digits: String = text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn size_after(text: &str, marker: &str) -> Option<u64> {
    let start = text.find(marker)? + marker.len();
    parse_size(&text[start..])
}

fn size_before(text: &str, marker: &str) -> Option<u64> {
    let end = text.find(marker)?;
    let head = &text[..end];
    // "... and 3.10 GiB": the last two words.
    let mut words = head.rsplitn(3, ' ');
    let unit = words.next()?;
    let number = words.next()?;
    parse_size(&format!("{number} {unit}"))
}

/// "2.00 GiB", "512.00 MiB", "20 bytes", "1.5 KiB" at the start of `text`.
pub fn parse_size(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    let unit = words
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_alphabetic());
    let scale: f64 = match unit {
        "B" | "bytes" | "byte" => 1.0,
        "KiB" | "KB" => 1024.0,
        "MiB" | "MB" => 1024.0 * 1024.0,
        "GiB" | "GB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "TB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    (number.is_finite() && number >= 0.0).then(|| (number * scale).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TORCH_211: &str = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
        capacity of 139.81 GiB of which 1.25 GiB is free. Including non-PyTorch memory, this \
        process has 138.55 GiB memory in use. Of the allocated memory 130.10 GiB is allocated by \
        PyTorch, and 7.93 GiB is reserved by PyTorch but unallocated. If reserved but \
        unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        to avoid fragmentation.";

    #[test]
    fn reads_the_figures_of_torch_2_11s_message() {
        let f = parse_message(TORCH_211);
        assert_eq!(f.requested, Some(2 << 30));
        assert_eq!(f.device, Some(0));
        assert_eq!(f.free_at_oom, Some((1.25 * (1u64 << 30) as f64) as u64));
        assert_eq!(
            f.reserved_unallocated_at_oom,
            Some((7.93f64 * (1u64 << 30) as f64).round() as u64)
        );
        assert_eq!(
            f.allocated_at_oom,
            Some((130.10f64 * (1u64 << 30) as f64).round() as u64)
        );
        assert_eq!(f.allowed_at_oom, None);
        let capped = parse_message(
            "Tried to allocate 1.00 GiB. GPU 0 has a total capacity of \
            139.81 GiB of which 100.00 GiB is free. 24.00 GiB allowed; 23.50 GiB in use.",
        );
        assert_eq!(capped.allowed_at_oom, Some(24 << 30));
    }

    #[test]
    fn partial_and_foreign_messages_give_what_they_have() {
        let f = parse_message("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; ...)");
        assert_eq!(f.requested, Some(20 << 20));
        assert_eq!(f.device, Some(3));
        assert_eq!(parse_message("something else"), MessageFigures::default());
        assert_eq!(parse_size("12 bytes"), Some(12));
        assert_eq!(parse_size("x GiB"), None);
        assert_eq!(parse_size("1.0 parsecs"), None);
    }

    #[test]
    fn probe_reply_shapes() {
        let ok: ProbeReply<ProbeFacts> = serde_json::from_str(
            r#"{"ok": {"torch_imported": true, "torch_version": "2.11.0", "exception": null,
                "is_oom": false, "cuda_initialized": false, "model_name": null,
                "input_batch": null, "batch_variable": null, "batch_value": null,
                "alloc_conf": null, "current_device": null}}"#,
        )
        .unwrap();
        assert!(matches!(ok, ProbeReply::Ok(f) if f.torch_imported && !f.is_oom));
        let failed: ProbeReply<ProbeFacts> =
            serde_json::from_str(r#"{"failed": "ValueError: x"}"#).unwrap();
        assert!(matches!(failed, ProbeReply::Failed(w) if w.contains("ValueError")));
    }
}
