//! The diagnosis as a display: text/plain, text/html and application/json.

use super::diagnosis::Diagnosis;
use super::procs::Role;
use crate::magics::{bundle, html_escape, Bundle};
use gpuprobe::units::human_bytes;

fn bytes(b: Option<u64>) -> String {
    b.map(human_bytes).unwrap_or_else(|| "?".into())
}

fn role(r: Role) -> &'static str {
    match r {
        Role::ThisKernel => "this notebook's Python kernel",
        Role::ThisGpukernel => "this gpukernel",
        Role::YourKernel => "another kernel of yours",
        Role::YourProcess => "yours",
        Role::Other => "",
    }
}

/// The text version (also what `%oom` prints in a terminal frontend).
pub fn text(d: &Diagnosis) -> String {
    let dev = &d.device;
    let mut t = format!(
        "gpukernel: CUDA out of memory ({}{}).\n",
        d.exception_type,
        match d.allocator_confirms {
            Some(true) => ", counted by the allocator",
            Some(false) => ", but the allocator counted no new OOM",
            None => ", raised without CUDA initialised in this kernel",
        }
    );
    t.push_str(&format!(
        "  asked for {} on cuda:{}{}\n",
        bytes(d.requested_bytes),
        dev.cuda_index
            .map(|i| i.to_string())
            .unwrap_or_else(|| "?".into()),
        match (&dev.name, dev.nvml_index) {
            (Some(name), Some(i)) => format!(" (GPU {i}, {name})"),
            _ => String::new(),
        }
    ));
    match &d.nvml_error {
        Some(e) => t.push_str(&format!("  GPU free (NVML): unavailable ({e})\n")),
        None => t.push_str(&format!(
            "  GPU free (NVML): {} of {}\n",
            bytes(dev.nvml_free_bytes),
            bytes(dev.total_bytes)
        )),
    }
    if d.at_oom.free_at_oom.is_some() || d.at_oom.reserved_unallocated_at_oom.is_some() {
        t.push_str(&format!(
            "  at the OOM (PyTorch's message): {} free, {} reserved but unallocated\n",
            bytes(d.at_oom.free_at_oom),
            bytes(d.at_oom.reserved_unallocated_at_oom)
        ));
    }
    if dev.allocated_bytes.is_some() {
        t.push_str(&format!(
            "  Python kernel now: allocated {}, reserved {}, reclaimable {}, largest free block {}, fragmentation {}\n",
            bytes(dev.allocated_bytes),
            bytes(dev.reserved_bytes),
            bytes(dev.reclaimable_bytes),
            bytes(dev.largest_free_block_bytes),
            dev.fragmentation
                .map(|f| format!("{:.0}%", f * 100.0))
                .unwrap_or_else(|| "-".into())
        ));
    }
    t.push_str(&process_lines(d));
    t.push_str(&tensor_lines(d));
    if let Some(b) = &d.batch {
        t.push_str(&format!("  batch: {} ({})\n", b.size, b.source));
    }
    t.push_str("  next steps:\n");
    for (i, s) in d.suggestions.iter().enumerate() {
        t.push_str(&format!("    {}. {}\n", i + 1, s.text));
    }
    t.push_str("  (%oom shows this again; %oom --json for scripts)\n");
    t
}

/// The processes on the failed GPU, the user's stale ones marked.
fn process_lines(d: &Diagnosis) -> String {
    let mut t = String::new();
    if d.processes.is_empty() {
        return t;
    }
    t.push_str("  processes on this GPU:\n");
    for p in &d.processes {
        let mut mark = role(p.role).to_string();
        if let Some(stale) = &p.stale {
            mark = format!("STALE, {stale}");
        }
        t.push_str(&format!(
            "    pid {:>7} {:>10}  {:<10} {}{}\n",
            p.pid,
            bytes(p.used_memory),
            p.user.as_deref().unwrap_or("?"),
            p.command.as_deref().unwrap_or("?"),
            if mark.is_empty() {
                String::new()
            } else {
                format!("  [{mark}]")
            }
        ));
    }
    t
}

/// The notebook's biggest live tensors, with the total they are part of.
fn tensor_lines(d: &Diagnosis) -> String {
    let mut t = String::new();
    if d.tensors.is_empty() {
        return t;
    }
    t.push_str(&format!(
        "  biggest live tensors in the notebook ({} in all):\n",
        human_bytes(d.tensor_bytes_total)
    ));
    for x in &d.tensors {
        t.push_str(&format!(
            "    {:<28} {:>10}  {:<18} {:<9} {} {}\n",
            x.name,
            human_bytes(x.bytes),
            shape(&x.shape, &x.kind),
            x.dtype,
            x.device,
            if x.kind == "tensor" { "" } else { &x.kind }
        ));
    }
    t
}

fn shape(shape: &[u64], kind: &str) -> String {
    if kind != "tensor" && kind != "held by the traceback" {
        return format!("{} tensors", shape.first().copied().unwrap_or(0));
    }
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("({})", dims.join(", "))
}

fn html(d: &Diagnosis) -> String {
    let dev = &d.device;
    let mut h = String::from(
        "<div class=\"gpukernel-oom\" style=\"border-left:4px solid #d9534f;padding:4px 10px\">",
    );
    h.push_str(&format!(
        "<b>gpukernel: CUDA out of memory</b> &mdash; asked for <b>{}</b> on cuda:{}",
        html_escape(&bytes(d.requested_bytes)),
        dev.cuda_index
            .map(|i| i.to_string())
            .unwrap_or_else(|| "?".into())
    ));
    let fragmentation = dev
        .fragmentation
        .map(|f| format!("{:.0}%", f * 100.0))
        .unwrap_or_else(|| "-".into());
    let figures = [
        ("GPU free (NVML)", bytes(dev.nvml_free_bytes)),
        ("allocated", bytes(dev.allocated_bytes)),
        ("reserved", bytes(dev.reserved_bytes)),
        ("reclaimable", bytes(dev.reclaimable_bytes)),
        ("largest free block", bytes(dev.largest_free_block_bytes)),
        ("fragmentation", fragmentation),
    ];
    h.push_str("<table><tr>");
    for (k, _) in &figures {
        h.push_str(&format!("<th>{k}</th>"));
    }
    h.push_str("</tr><tr>");
    for (_, v) in &figures {
        h.push_str(&format!("<td>{}</td>", html_escape(v)));
    }
    h.push_str("</tr></table>");
    if !d.processes.is_empty() {
        h.push_str(
            "<table><tr><th>pid</th><th>memory</th><th>user</th><th>command</th><th></th></tr>",
        );
        for p in &d.processes {
            let mark = p
                .stale
                .clone()
                .map(|s| format!("STALE: {s}"))
                .unwrap_or_else(|| role(p.role).into());
            h.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td></tr>",
                p.pid,
                html_escape(&bytes(p.used_memory)),
                html_escape(p.user.as_deref().unwrap_or("?")),
                html_escape(p.command.as_deref().unwrap_or("?")),
                html_escape(&mark)
            ));
        }
        h.push_str("</table>");
    }
    if !d.tensors.is_empty() {
        h.push_str("<table><tr><th>live tensor</th><th>size</th><th>shape</th><th>dtype</th><th>device</th></tr>");
        for x in &d.tensors {
            h.push_str(&format!(
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                html_escape(&x.name),
                html_escape(&human_bytes(x.bytes)),
                html_escape(&shape(&x.shape, &x.kind)),
                html_escape(&x.dtype),
                html_escape(&x.device)
            ));
        }
        h.push_str("</table>");
    }
    h.push_str("<b>Next steps</b><ol>");
    for s in &d.suggestions {
        h.push_str(&format!("<li>{}</li>", html_escape(&s.text)));
    }
    h.push_str("</ol></div>");
    h
}

/// All three representations.
pub fn bundle_of(d: &Diagnosis) -> Bundle {
    let mut data = bundle(text(d), Some(html(d)));
    data.insert(
        "application/json".into(),
        serde_json::to_value(d).unwrap_or(serde_json::Value::Null),
    );
    data
}
