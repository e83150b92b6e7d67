//! `%envcheck [--json] [--export FILE]`: is this Python environment able to run CUDA work, and
//! if not, what fixes it.
//!
//! The checks run in a fresh process of the Python being checked (`probe.py` through
//! `PYTHON -c`), so importing torch costs the notebook nothing: in the gpu-python kernel that
//! Python is the notebook's own (`sys.executable`, with its sys.path and CUDA variables read
//! through the silent side channel, `session.py`); in the magics-only kernel it is the env's
//! python found from `VIRTUAL_ENV`, `CONDA_PREFIX` or PATH. The driver comes from NVML.
//!
//! Tests fake the driver with `GPUKERNEL_TEST_DRIVER_CUDA` (e.g. `12.2`, the highest CUDA the
//! "driver" supports) and optionally `GPUKERNEL_TEST_DRIVER_VERSION`; both are for tests only.

mod checks;
mod export;
mod facts;

use super::python::{module_call_expression, EvalError};
use super::{bundle, html_escape, parse_args, Bundle, Magic, MagicContext, MagicError, Output};
use checks::{Finding, Level, VisibleMap};
use clap::{CommandFactory, Parser};
use facts::{DriverFacts, GpuBrief, ProbeAnswer, ProbeFacts, SessionFacts};
use serde::Serialize;
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const PROBE: &str = include_str!("probe.py");
const SESSION: &str = include_str!("session.py");
const SESSION_KEY: &str = "_gpukernel_envcheck";
const MARKER: &str = "@@GPUKERNEL_ENVCHECK@@";
/// `import torch` on a network home can take a while; a probe past this is killed.
const PROBE_LIMIT: Duration = Duration::from_secs(180);
/// Test-only overrides of the driver NVML reports (documented in the README).
pub const DRIVER_CUDA_VAR: &str = "GPUKERNEL_TEST_DRIVER_CUDA";
pub const DRIVER_VERSION_VAR: &str = "GPUKERNEL_TEST_DRIVER_VERSION";
/// The notebook's variables the probe process gets as the notebook has them.
const PASSED_VARIABLES: [&str; 6] = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LD_LIBRARY_PATH",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "VIRTUAL_ENV",
];

/// Check the Python environment for CUDA work: torch and its CUDA vs the driver, the GPU's
/// architecture vs torch's, duplicate torch installs, conda/pip mixes, mismatched nvidia-*
/// wheels, CUDA_VISIBLE_DEVICES. Each problem comes with its fix.
#[derive(Parser, Debug)]
#[command(name = "%envcheck", disable_version_flag = true)]
struct Args {
    /// Return the report as JSON (the cell's value) for scripts.
    #[arg(long)]
    json: bool,
    /// Also write the environment to FILE: a pinned requirements file (venv; `.txt`) or an
    /// environment.yml (conda; `.yml`), to recreate it elsewhere.
    #[arg(long, value_name = "FILE")]
    export: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Report {
    kernel: &'static str,
    /// Which Python was checked, and how it was chosen.
    checked: String,
    probe_error: Option<String>,
    #[serde(flatten)]
    probe: Option<ProbeFacts>,
    session: Option<SessionFacts>,
    driver: DriverFacts,
    cuda_visible_devices: VisibleMap,
    findings: Vec<Finding>,
    export: Option<String>,
}

pub struct EnvCheck;

/// Why the notebook's own Python could not be read (PATH's python is checked instead).
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Eval(#[from] EvalError),
    /// The answer is not JSON.
    #[error("unreadable answer ({0})")]
    Unreadable(serde_json::Error),
    /// session.py caught an exception: its own words.
    #[error("{0}")]
    Failed(String),
    /// JSON, but not the facts session.py sends.
    #[error(transparent)]
    Facts(serde_json::Error),
}

/// Why the probe process gave no facts (the report's `probe_error` and first finding).
#[derive(Debug, thiserror::Error)]
enum ProbeRunError {
    #[error("could not run {}: {source}", python.display())]
    Spawn {
        python: PathBuf,
        source: std::io::Error,
    },
    #[error("no stdout")]
    NoStdout,
    #[error("no stderr")]
    NoStderr,
    /// Waiting for the process failed.
    #[error(transparent)]
    Wait(std::io::Error),
    #[error("interrupted")]
    Interrupted,
    #[error("{} did not finish within {:?}", python.display(), PROBE_LIMIT)]
    TimedOut { python: PathBuf },
    /// It exited without the marker; `stderr_tail` is its last line of stderr.
    #[error("{} exited ({status}) without an answer: {stderr_tail}", python.display())]
    NoAnswer {
        python: PathBuf,
        status: ExitStatus,
        stderr_tail: String,
    },
    /// probe.py caught an exception: its own words.
    #[error("{0}")]
    Failed(String),
    #[error("unreadable probe answer ({0})")]
    Unreadable(serde_json::Error),
}

fn session_facts(ctx: &MagicContext) -> Option<Result<SessionFacts, SessionError>> {
    let python = ctx.python?;
    let expression = module_call_expression(SESSION_KEY, SESSION, "read", &json!({}));
    let text = match python.evaluate_within(&expression, Duration::from_secs(15)) {
        Ok(text) => text,
        Err(e) => return Some(Err(e.into())),
    };
    let value: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => return Some(Err(SessionError::Unreadable(e))),
    };
    if let Some(why) = value.get("failed").and_then(Value::as_str) {
        return Some(Err(SessionError::Failed(why.to_string())));
    }
    Some(serde_json::from_value(value).map_err(SessionError::Facts))
}

/// The env's python as a shell would pick it: the active venv/conda env first, then PATH.
fn python_on_path() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var) {
            candidates.push(Path::new(&prefix).join("bin/python3"));
            candidates.push(Path::new(&prefix).join("bin/python"));
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            candidates.push(dir.join("python3"));
            candidates.push(dir.join("python"));
        }
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn run_probe(
    python: &Path,
    session: Option<&SessionFacts>,
    freeze: bool,
    ctx: &MagicContext,
) -> Result<ProbeFacts, ProbeRunError> {
    let args = json!({
        "sys_path": session.map(|s| s.sys_path.clone()),
        "freeze": freeze,
    });
    let mut command = Command::new(python);
    command
        .arg("-c")
        .arg(PROBE)
        .arg(args.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(session) = session {
        for var in PASSED_VARIABLES {
            match session.env.get(var).cloned().flatten() {
                Some(value) => command.env(var, value),
                None => command.env_remove(var),
            };
        }
    }
    let mut child = command.spawn().map_err(|source| ProbeRunError::Spawn {
        python: python.to_path_buf(),
        source,
    })?;
    let mut stdout = child.stdout.take().ok_or(ProbeRunError::NoStdout)?;
    let mut stderr = child.stderr.take().ok_or(ProbeRunError::NoStderr)?;
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => return Err(ProbeRunError::Wait(e)),
        }
        if ctx.cancel.is_cancelled() || started.elapsed() > PROBE_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(if ctx.cancel.is_cancelled() {
                ProbeRunError::Interrupted
            } else {
                ProbeRunError::TimedOut {
                    python: python.to_path_buf(),
                }
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let Some((_, answer)) = stdout.rsplit_once(MARKER) else {
        return Err(ProbeRunError::NoAnswer {
            python: python.to_path_buf(),
            status,
            stderr_tail: stderr.trim().lines().last().unwrap_or("").to_string(),
        });
    };
    match serde_json::from_str::<ProbeAnswer>(answer.trim()) {
        Ok(ProbeAnswer::Facts(facts)) => Ok(*facts),
        Ok(ProbeAnswer::Failed { failed }) => Err(ProbeRunError::Failed(failed)),
        Err(e) => Err(ProbeRunError::Unreadable(e)),
    }
}

fn driver_facts(ctx: &MagicContext) -> DriverFacts {
    let mut facts = match ctx.gpu.snapshot() {
        Ok(s) => DriverFacts {
            version: Some(s.driver_version.clone()),
            cuda: s.cuda_driver_version.clone(),
            source: "NVML".into(),
            error: None,
            gpus: s
                .gpus
                .iter()
                .map(|g| GpuBrief {
                    nvml_index: g.index,
                    name: g.name.clone(),
                    uuid: g.uuid.clone(),
                })
                .collect(),
        },
        Err(e) => DriverFacts {
            source: "NVML".into(),
            error: Some(e.to_string()),
            ..Default::default()
        },
    };
    if let Ok(cuda) = std::env::var(DRIVER_CUDA_VAR) {
        facts.cuda = Some(cuda);
        facts.version = std::env::var(DRIVER_VERSION_VAR).ok();
        facts.source = format!("{DRIVER_CUDA_VAR} (test override)");
    }
    facts
}

/// The Python to check, what the report calls it, and the python on PATH when that is
/// another one (the notebook's own is checked first; the magics-only kernel has only PATH's).
fn which_python(
    session: Option<&Result<SessionFacts, SessionError>>,
) -> (Option<PathBuf>, String, Option<String>) {
    let on_path = python_on_path();
    match session {
        Some(Ok(s)) => (
            Some(PathBuf::from(&s.executable)),
            format!("the notebook's own Python, {}", s.executable),
            on_path.as_ref().map(|p| p.display().to_string()),
        ),
        Some(Err(e)) => (
            on_path,
            format!("the env's python on PATH (the notebook's could not be read: {e})"),
            None,
        ),
        None => {
            let checked = match &on_path {
                Some(p) => format!(
                    "the env's python on PATH, {} (magics-only kernel)",
                    p.display()
                ),
                None => "no python on PATH (magics-only kernel)".into(),
            };
            (on_path, checked, None)
        }
    }
}

/// `--export FILE`: the env as pinned requirements or a conda environment.yml. Returns what
/// was written, or the message of the error the cell ends with.
fn write_export(
    file: Option<&Path>,
    session: Option<&SessionFacts>,
    probe: Option<&ProbeFacts>,
) -> Result<Option<String>, MagicError> {
    let Some(file) = file else {
        return Ok(None);
    };
    // A relative FILE is the notebook's: its working directory, not gpukernel's.
    let file = match session.and_then(|s| s.cwd.as_deref()) {
        Some(cwd) if file.is_relative() => Path::new(cwd).join(file),
        _ => file.to_path_buf(),
    };
    let failed = |why: export::ExportError| {
        MagicError::new(
            "EnvCheckError",
            format!("%envcheck --export {}: {why}", file.display()),
        )
    };
    let Some(p) = probe else {
        return Err(failed(export::ExportError::NoEnvironment));
    };
    let format = export::Format::for_file(&file, &p.env.kind);
    let text = export::render(format, p).map_err(failed)?;
    std::fs::write(&file, text).map_err(|e| failed(e.into()))?;
    Ok(Some(format!(
        "wrote {} ({}, {} packages)",
        file.display(),
        match format {
            export::Format::Requirements => "pinned requirements",
            export::Format::CondaYaml => "conda environment.yml",
        },
        p.freeze.as_ref().map(|f| f.lines.len()).unwrap_or(0)
    )))
}

impl Magic for EnvCheck {
    fn name(&self) -> &'static str {
        "envcheck"
    }

    fn summary(&self) -> &'static str {
        "Check the Python env for CUDA work (torch vs driver, GPU arch, duplicate torch, conda/pip, nvidia wheels); --export FILE to recreate it."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        let session = session_facts(ctx);
        let (python, checked, path_python) = which_python(session.as_ref());
        let session = session.and_then(Result::ok);
        let probe = python
            .as_deref()
            .map(|p| run_probe(p, session.as_ref(), args.export.is_some(), ctx));
        if ctx.cancel.is_cancelled() {
            return Err(MagicError::interrupted());
        }
        let (probe, probe_error) = match probe {
            Some(Ok(p)) => (Some(p), None),
            // The report keeps the text: it is what `--json` readers get.
            Some(Err(e)) => (None, Some(e.to_string())),
            None => (None, None),
        };
        let driver = driver_facts(ctx);
        let visible = match &session {
            Some(s) => s.env.get("CUDA_VISIBLE_DEVICES").cloned().flatten(),
            None => std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        };
        let mut findings = checks::run(&checks::Inputs {
            probe: probe.as_ref(),
            session: session.as_ref(),
            driver: &driver,
            visible: visible.as_deref(),
            path_python: path_python.as_deref(),
        });
        if let Some(e) = &probe_error {
            findings.insert(
                0,
                Finding {
                    level: Level::Problem,
                    check: "python",
                    summary: format!("the Python could not be checked: {e}"),
                    fix: None,
                },
            );
        }
        let (export, export_error) =
            match write_export(args.export.as_deref(), session.as_ref(), probe.as_ref()) {
                Ok(written) => (written, None),
                Err(e) => (None, Some(e)),
            };
        let report = Report {
            kernel: if ctx.python.is_some() {
                "gpu-python"
            } else {
                "gpu-magics"
            },
            checked,
            probe_error,
            probe,
            session,
            cuda_visible_devices: checks::visible_map(visible.as_deref(), &driver),
            driver,
            findings,
            export,
        };
        let mut data = render(&report);
        data.insert(
            "application/json".into(),
            serde_json::to_value(&report).unwrap_or(Value::Null),
        );
        if args.json {
            data.remove("text/html");
        }
        ctx.out.emit(Output::value_or_display(data, args.json));
        export_error.map_or(Ok(()), Err)
    }
}

fn mark(level: Level) -> &'static str {
    match level {
        Level::Problem => "PROBLEM",
        Level::Warning => "warning",
        Level::Ok => "ok",
    }
}

fn render(r: &Report) -> Bundle {
    let mut t = format!("%envcheck: checked {}\n", r.checked);
    if let Some(p) = &r.probe {
        t.push_str(&format!(
            "  Python {} ({} env{} at {})\n",
            p.python.version,
            p.env.kind,
            p.env
                .name
                .as_deref()
                .map(|n| format!(" {n}"))
                .unwrap_or_default(),
            p.env.prefix
        ));
        match &p.torch {
            Some(torch) if torch.importable => t.push_str(&format!(
                "  torch {} (CUDA {}), {}\n",
                torch.version.as_deref().unwrap_or("?"),
                torch.cuda.as_deref().unwrap_or("none: CPU build"),
                torch.file.as_deref().unwrap_or("?")
            )),
            Some(_) => t.push_str("  torch: installed but does not import\n"),
            None => t.push_str("  torch: not installed\n"),
        }
    }
    match (&r.driver.cuda, &r.driver.error) {
        (None, Some(e)) => t.push_str(&format!("  driver: unavailable ({e})\n")),
        _ => t.push_str(&format!(
            "  driver: {} (CUDA {} at most; from {})\n",
            r.driver.version.as_deref().unwrap_or("?"),
            r.driver.cuda.as_deref().unwrap_or("?"),
            r.driver.source
        )),
    }
    let visible = &r.cuda_visible_devices;
    t.push_str(&format!(
        "  CUDA_VISIBLE_DEVICES: {}{}\n",
        visible.value.as_deref().unwrap_or("(unset: all GPUs)"),
        visible
            .devices
            .iter()
            .map(|(cuda, nvml, name)| format!("; cuda:{cuda} = GPU {nvml} ({name})"))
            .collect::<String>()
    ));
    for f in &r.findings {
        t.push_str(&format!(
            "  [{}] {}: {}\n",
            mark(f.level),
            f.check,
            f.summary
        ));
        if let Some(fix) = &f.fix {
            t.push_str(&format!("      fix: {fix}\n"));
        }
    }
    if let Some(e) = &r.export {
        t.push_str(&format!("  export: {e}\n"));
    }
    let mut h = format!(
        "<div class=\"gpukernel-envcheck\"><pre>{}</pre>",
        html_escape(t.lines().take(5).collect::<Vec<_>>().join("\n").as_str())
    );
    h.push_str("<table><tr><th></th><th>check</th><th>finding</th><th>fix</th></tr>");
    for f in &r.findings {
        let color = match f.level {
            Level::Problem => "#d9534f",
            Level::Warning => "#f0ad4e",
            Level::Ok => "#5cb85c",
        };
        h.push_str(&format!(
            "<tr><td style=\"color:{color}\"><b>{}</b></td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
            mark(f.level),
            f.check,
            html_escape(&f.summary),
            html_escape(f.fix.as_deref().unwrap_or(""))
        ));
    }
    h.push_str("</table></div>");
    bundle(t, Some(h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use facts::Freeze;

    #[test]
    fn export_errors_name_the_file_and_why() {
        let evalue = |file: &str, probe: Option<&ProbeFacts>| {
            write_export(Some(Path::new(file)), None, probe)
                .expect_err("nothing written")
                .evalue
        };
        assert_eq!(
            evalue("/tmp/x.txt", None),
            "%envcheck --export /tmp/x.txt: no Python environment could be read"
        );
        let unlisted = ProbeFacts::default();
        assert_eq!(
            evalue("/tmp/x.txt", Some(&unlisted)),
            "%envcheck --export /tmp/x.txt: the package list could not be read from that Python"
        );
        let listed = ProbeFacts {
            freeze: Some(Freeze {
                tool: "pip freeze".into(),
                lines: vec!["six==1.17.0".into()],
            }),
            ..Default::default()
        };
        assert_eq!(
            evalue("/nonexistent/dir/req.txt", Some(&listed)),
            "%envcheck --export /nonexistent/dir/req.txt: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn probe_errors_read_as_before() {
        let python = PathBuf::from("/env/bin/python");
        let timed_out = ProbeRunError::TimedOut {
            python: python.clone(),
        };
        assert_eq!(
            timed_out.to_string(),
            "/env/bin/python did not finish within 180s"
        );
        let spawn = ProbeRunError::Spawn {
            python,
            source: std::io::Error::from_raw_os_error(2),
        };
        assert_eq!(
            spawn.to_string(),
            "could not run /env/bin/python: No such file or directory (os error 2)"
        );
    }
}
