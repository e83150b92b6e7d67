//! `%gpumem`: memory per GPU and per process, read through NVML (no CUDA context needed).

use super::python::{EvalError, TorchState};
use super::{
    bundle, gauge, html_escape, parse_args, visible, Bundle, Magic, MagicContext, MagicError,
    Output,
};
use clap::{CommandFactory, Parser};
use gpuprobe::units::human_bytes;
use gpuprobe::{GpuInfo, GpuSnapshot, ProbeError};
use serde_json::{json, Value};

/// GPU memory per device and per process (NVML).
#[derive(Parser, Debug)]
#[command(name = "%gpumem", disable_version_flag = true)]
struct Args {
    /// Return the figures as JSON (the cell's value) for scripts.
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Keep a live gauge updating every SECONDS (default 2): in the Python kernel it runs in
    /// the background while later cells run (NVML only); in the magics-only kernel, until
    /// interrupted.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2",
          value_parser = parse_interval)]
    watch: Option<f64>,
    /// With --watch: stop after N updates.
    #[arg(long, value_name = "N", requires = "watch")]
    count: Option<u64>,
    /// Stop the running gauge.
    #[arg(long, conflicts_with_all = ["watch", "json"])]
    stop: bool,
}

fn parse_interval(text: &str) -> Result<f64, String> {
    let seconds: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(0.1..=3600.0).contains(&seconds) {
        return Err(format!("{seconds} s is outside 0.1..3600"));
    }
    Ok(seconds)
}

pub struct GpuMem;

impl Magic for GpuMem {
    fn name(&self) -> &'static str {
        "gpumem"
    }

    fn summary(&self) -> &'static str {
        "GPU memory per device and per process (NVML); --json for scripts, --watch for a live gauge."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        if args.stop {
            ctx.stdout(if ctx.gpu.stop_watch() {
                "Stopped the GPU gauge.\n"
            } else {
                "No GPU gauge is running.\n"
            });
            return Ok(());
        }
        let snapshot = ctx.gpu.snapshot();
        let Some(interval) = args.watch else {
            // Only one-off reads ask the Python kernel: a gauge must not queue work there.
            let python = ctx.python.map(|p| PythonView {
                pid: p.pid(),
                torch: p.torch(),
            });
            let own = ctx.gpu.own_allocator(snapshot.as_ref().ok());
            let mut data = if args.json {
                json_bundle(&snapshot, python.as_ref())
            } else {
                render(&snapshot, python.as_ref())
            };
            if let Some(own) = own {
                append_text(&mut data, &own);
            }
            ctx.out.emit(Output::value_or_display(data, args.json));
            return Ok(());
        };
        if ctx.python.is_some() {
            // Beside a Python kernel the gauge runs on its own thread, so later cells (a
            // training loop) run while it updates.
            ctx.gpu.start_watch(ctx.out.detach(), interval, args.count);
            return Ok(());
        }
        if gauge::run(ctx.gpu, ctx.out, ctx.cancel, interval, args.count) {
            Ok(())
        } else {
            Err(MagicError::interrupted())
        }
    }
}

/// Adds a paragraph to a bundle's text (and HTML, or JSON as `gpukernel_allocator`).
fn append_text(data: &mut Bundle, paragraph: &str) {
    if let Some(Value::String(text)) = data.get_mut("text/plain") {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push('\n');
        text.push_str(paragraph);
    }
    if let Some(Value::String(html)) = data.get_mut("text/html") {
        html.push_str(&format!("<pre>{}</pre>", html_escape(paragraph)));
    }
    if let Some(Value::Object(json)) = data.get_mut("application/json") {
        json.insert(
            "gpukernel_allocator".into(),
            Value::String(paragraph.to_string()),
        );
    }
}

/// The Python kernel behind a proxy kernel, as one read saw it.
pub struct PythonView {
    pub pid: u32,
    pub torch: Result<TorchState, EvalError>,
}

fn python_json(python: Option<&PythonView>) -> Value {
    match python {
        None => Value::Null,
        Some(p) => json!({
            "pid": p.pid,
            "torch": match &p.torch {
                Ok(state) => serde_json::to_value(state).unwrap_or(Value::Null),
                Err(e) => json!({"error": e.to_string()}),
            },
        }),
    }
}

fn python_text(python: &PythonView, gpus: &[GpuInfo]) -> String {
    let pid = python.pid;
    match &python.torch {
        Err(e) => format!("Python kernel (pid {pid}): could not read torch's state: {e}\n"),
        Ok(t) if !t.imported => format!("Python kernel (pid {pid}): torch not imported.\n"),
        Ok(t) if !t.cuda_initialized => format!(
            "Python kernel (pid {pid}): torch {} imported; CUDA not initialised (no GPU memory held).\n",
            t.version.as_deref().unwrap_or("?")
        ),
        Ok(t) => {
            let mut text = format!(
                "Python kernel (pid {pid}): torch {}, caching allocator per device:\n{:>4} {:>3}  {:>10} {:>10} {:>10} {:>12} {:>5}\n",
                t.version.as_deref().unwrap_or("?"),
                "cuda", "GPU", "allocated", "reserved", "peak", "reclaimable", "OOMs"
            );
            for d in &t.devices {
                let nvml = d
                    .uuid
                    .as_deref()
                    .and_then(|u| visible::by_uuid(gpus, u))
                    .map(|g| g.index.to_string())
                    .unwrap_or_else(|| "?".into());
                text.push_str(&format!(
                    "{:>4} {:>3}  {:>10} {:>10} {:>10} {:>12} {:>5}\n",
                    d.index,
                    nvml,
                    human_bytes(d.allocated),
                    human_bytes(d.reserved),
                    human_bytes(d.peak_allocated),
                    human_bytes(d.reserved.saturating_sub(d.allocated)),
                    d.num_ooms
                ));
            }
            text
        }
    }
}

fn json_bundle(snapshot: &Result<GpuSnapshot, ProbeError>, python: Option<&PythonView>) -> Bundle {
    let mut value = match snapshot {
        Ok(s) => {
            let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
            if let Some(map) = v.as_object_mut() {
                map.insert("available".into(), Value::Bool(true));
            }
            v
        }
        Err(e) => json!({"available": false, "reason": e.to_string()}),
    };
    if let Some(map) = value.as_object_mut() {
        map.insert("python_kernel".into(), python_json(python));
    }
    let mut data = bundle(
        serde_json::to_string_pretty(&value).unwrap_or_default(),
        None,
    );
    data.insert("application/json".into(), value);
    data
}

/// What to say when there is nothing to show.
fn unavailable_text(err: &ProbeError) -> String {
    match err {
        ProbeError::NoDriver(why) => format!(
            "No NVIDIA GPU is visible here: {why}.\n\
             %gpumem reads GPU memory through the NVIDIA driver (NVML); run it on a machine \
             with an NVIDIA GPU and driver."
        ),
        other => format!("Could not read GPU memory: {other}."),
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// One row per GPU: NVML's index, the CUDA ordinal this process sees it as, memory and load.
fn gpu_table(snapshot: &GpuSnapshot) -> (String, String) {
    let ordinals = visible::cuda_ordinals(
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
        &snapshot.gpus,
    );
    let cuda = |position: usize| {
        ordinals[position]
            .map(|o| o.to_string())
            .unwrap_or_else(|| "-".into())
    };
    let mut text = format!(
        "{:>3} {:>4}  {:<24} {:>10} {:>10} {:>10} {:>5}\n",
        "GPU", "cuda", "name", "used", "free", "total", "util"
    );
    let mut html = String::from(
        "<table><thead><tr><th>GPU</th><th>cuda</th><th style=\"text-align:left\">name</th><th>used</th>\
         <th style=\"text-align:left\">memory</th><th>free</th><th>total</th><th>util</th></tr>\
         </thead><tbody>",
    );
    for (position, gpu) in snapshot.gpus.iter().enumerate() {
        let util = gpu
            .utilization_gpu
            .map(|u| format!("{u}%"))
            .unwrap_or_else(|| "n/a".into());
        text.push_str(&format!(
            "{:>3} {:>4}  {:<24} {:>10} {:>10} {:>10} {:>5}\n",
            gpu.index,
            cuda(position),
            truncate(&gpu.name, 24),
            human_bytes(gpu.memory_used),
            human_bytes(gpu.memory_free),
            human_bytes(gpu.memory_total),
            util
        ));
        let used_pct = percent(gpu.memory_used, gpu.memory_total);
        html.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td style=\"text-align:left\">{}</td><td>{}</td>\
             <td style=\"text-align:left\"><div style=\"width:12em;background:#ddd;height:0.9em\">\
             <div style=\"width:{used_pct:.1}%;background:{};height:100%\"></div></div></td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            gpu.index,
            cuda(position),
            html_escape(&gpu.name),
            human_bytes(gpu.memory_used),
            if used_pct > 90.0 {
                "#d9534f"
            } else {
                "#5cb85c"
            },
            human_bytes(gpu.memory_free),
            human_bytes(gpu.memory_total),
            util
        ));
    }
    html.push_str("</tbody></table>");
    (text, html)
}

/// One row per process holding GPU memory, this gpukernel and its Python kernel marked.
fn process_table(snapshot: &GpuSnapshot, python: Option<&PythonView>) -> (String, String) {
    let me = std::process::id();
    let (mut text, mut html) = (String::new(), String::new());
    let processes: Vec<_> = snapshot
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(move |p| (g.index, p)))
        .collect();
    if processes.is_empty() {
        text.push_str("\nNo process holds GPU memory.\n");
        html.push_str("<p>No process holds GPU memory.</p>");
    } else {
        text.push_str(&format!(
            "\n{:>3}  {:>8}  {:<10} {:>10}  command\n",
            "GPU", "pid", "user", "memory"
        ));
        html.push_str(
            "<table><thead><tr><th>GPU</th><th>pid</th><th style=\"text-align:left\">user</th>\
             <th>memory</th><th style=\"text-align:left\">command</th></tr></thead><tbody>",
        );
        for (index, p) in processes {
            let memory = p
                .used_memory
                .map(human_bytes)
                .unwrap_or_else(|| "n/a".into());
            let user = p.details.user.as_deref().unwrap_or("?");
            let mut command = p
                .details
                .command
                .clone()
                .unwrap_or_else(|| "(not visible from here)".into());
            if p.pid == me {
                command = format!("(this gpukernel) {command}");
            } else if python.is_some_and(|py| py.pid == p.pid) {
                command = format!("(Python kernel) {command}");
            }
            text.push_str(&format!(
                "{index:>3}  {:>8}  {:<10} {:>10}  {}\n",
                p.pid,
                truncate(user, 10),
                memory,
                truncate(&command, 60)
            ));
            html.push_str(&format!(
                "<tr><td>{index}</td><td>{}</td><td style=\"text-align:left\">{}</td><td>{}</td>\
                 <td style=\"text-align:left\"><code>{}</code></td></tr>",
                p.pid,
                html_escape(user),
                memory,
                html_escape(&truncate(&command, 120))
            ));
        }
        html.push_str("</tbody></table>");
    }
    (text, html)
}

/// Text and HTML tables of a snapshot, and the Python kernel's torch state when known.
pub fn render(snapshot: &Result<GpuSnapshot, ProbeError>, python: Option<&PythonView>) -> Bundle {
    let gpus: &[GpuInfo] = snapshot.as_ref().map(|s| s.gpus.as_slice()).unwrap_or(&[]);
    let python_part = python.map(|p| python_text(p, gpus)).unwrap_or_default();
    let snapshot = match snapshot {
        Ok(s) => s,
        Err(e) => {
            let text = format!("{}\n{python_part}", unavailable_text(e));
            let html = format!("<pre>{}</pre>", html_escape(&text));
            return bundle(text, Some(html));
        }
    };
    if snapshot.gpus.is_empty() {
        let text = format!(
            "The NVIDIA driver ({}) sees no GPU here.",
            snapshot.driver_version
        );
        let html = format!("<pre>{}</pre>", html_escape(&text));
        return bundle(text, Some(html));
    }
    let (mut text, mut html) = gpu_table(snapshot);
    let (proc_text, proc_html) = process_table(snapshot, python);
    text.push_str(&proc_text);
    html.push_str(&proc_html);
    let cuda = snapshot
        .cuda_driver_version
        .as_deref()
        .map(|v| format!(", CUDA {v}"))
        .unwrap_or_default();
    text.push_str(&format!("\ndriver {}{cuda}\n", snapshot.driver_version));
    if !python_part.is_empty() {
        text.push('\n');
        text.push_str(&python_part);
        html.push_str(&format!("<pre>{}</pre>", html_escape(&python_part)));
    }
    html.push_str(&format!(
        "<p style=\"font-size:smaller\">driver {}{}</p>",
        html_escape(&snapshot.driver_version),
        html_escape(&cuda)
    ));
    bundle(text, Some(html))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuprobe::process::ProcessDetails;
    use gpuprobe::GpuProcess;

    fn snapshot() -> GpuSnapshot {
        GpuSnapshot {
            driver_version: "580.1".into(),
            cuda_driver_version: Some("13.0".into()),
            gpus: vec![GpuInfo {
                index: 0,
                name: "NVIDIA H200".into(),
                uuid: "GPU-1".into(),
                pci_bus_id: "00000000:01:00.0".into(),
                memory_used: 10 << 30,
                memory_free: 130 << 30,
                memory_total: 140 << 30,
                utilization_gpu: Some(45),
                processes: vec![GpuProcess {
                    pid: std::process::id(),
                    used_memory: Some(9 << 30),
                    details: ProcessDetails {
                        user: Some("alice".into()),
                        command: Some("python <train>.py".into()),
                    },
                }],
            }],
        }
    }

    #[test]
    fn renders_gpus_and_processes() {
        let data = render(&Ok(snapshot()), None);
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("NVIDIA H200"));
        assert!(text.contains("10.0 GiB"));
        assert!(text.contains("(this gpukernel)"));
        assert!(text.contains("45%"));
        let html = data["text/html"].as_str().unwrap();
        assert!(html.contains("&lt;train&gt;"), "HTML is escaped");
    }

    #[test]
    fn no_driver_is_a_message_not_an_error() {
        let data = render(
            &Err(ProbeError::NoDriver("libnvidia-ml.so.1: not found".into())),
            None,
        );
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.starts_with("No NVIDIA GPU is visible here"));
        let json = json_bundle(&Err(ProbeError::NoDriver("x".into())), None);
        assert_eq!(json["application/json"]["available"], false);
    }

    #[test]
    fn python_kernel_state_is_shown_and_its_process_marked() {
        let mut snap = snapshot();
        snap.gpus[0].processes[0].pid = 4242;
        let python = PythonView {
            pid: 4242,
            torch: Ok(TorchState {
                imported: true,
                version: Some("2.11.0".into()),
                cuda_initialized: true,
                devices: vec![crate::magics::python::DeviceMemory {
                    index: 0,
                    uuid: Some("1".into()),
                    allocated: 1 << 30,
                    reserved: 3 << 30,
                    peak_allocated: 2 << 30,
                    num_ooms: 1,
                }],
            }),
        };
        let data = render(&Ok(snap), Some(&python));
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("(Python kernel) python"), "{text}");
        assert!(text.contains("torch 2.11.0, caching allocator"), "{text}");
        assert!(
            text.contains("2.00 GiB"),
            "reclaimable = reserved - allocated: {text}"
        );
        let not_imported = PythonView {
            pid: 1,
            torch: Ok(TorchState {
                imported: false,
                version: None,
                cuda_initialized: false,
                devices: vec![],
            }),
        };
        let data = render(
            &Err(ProbeError::NoDriver("none".into())),
            Some(&not_imported),
        );
        assert!(data["text/plain"]
            .as_str()
            .unwrap()
            .contains("torch not imported"));
    }

    #[test]
    fn json_carries_the_figures() {
        let json = json_bundle(&Ok(snapshot()), None);
        assert_eq!(
            json["application/json"]["gpus"][0]["memory_total"],
            140u64 << 30
        );
        assert_eq!(json["application/json"]["available"], true);
    }
}
