//! gpukernel: a Jupyter kernel with GPU-memory magics.
//!
//! Layout (data flows one way): `wire` (frames, signing) -> `server` (sockets) -> `kernel`
//! (what each request means) -> `magics` (parse args -> gpuprobe -> outputs) -> back out
//! through `shell::exec`, the only module that knows both magics and messages.

mod kernel;
mod kernelspec;
mod magics;
mod proxy;
mod server;
mod shell;
#[cfg(test)]
mod testing;
#[cfg(feature = "torch")]
mod torch_plugin;
mod wire;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "gpukernel",
    version,
    about = "A Jupyter kernel with GPU-memory magics (%gpumem, %gpuhelp), answered in-process.",
    long_about = "A Jupyter kernel with GPU-memory magics (%gpumem, %gpuhelp), answered in-process \
                  through NVML.\n\nInstall the kernelspec once with `gpukernel install`, then pick \
                  \"GPU magics\" in Jupyter. `gpukernel info` shows what this build sees."
)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the kernel (Jupyter starts this from kernel.json).
    Run {
        /// The connection file written by the Jupyter client.
        #[arg(short = 'f', long = "connection-file", value_name = "FILE")]
        connection_file: PathBuf,
        /// Answer magics only, with no Python kernel behind (the `gpu-magics` kernelspec).
        #[arg(long, conflicts_with = "child")]
        magics_only: bool,
        /// The child kernel's command line (default: python3 -m ipykernel_launcher -f
        /// {child_connection_file}).
        #[arg(last = true, value_name = "CHILD_ARGV")]
        child: Vec<String>,
    },
    /// Install the kernelspec so Jupyter lists this kernel.
    Install {
        #[command(flatten)]
        location: LocationArgs,
        /// Kernelspec name (directory under kernels/).
        #[arg(long)]
        name: Option<String>,
        /// Name shown in Jupyter's launcher.
        #[arg(long)]
        display_name: Option<String>,
        /// Install the magics-only kernel (`gpu-magics`) instead of `gpu-python`.
        #[arg(long)]
        magics_only: bool,
        /// The Python whose ipykernel `gpu-python` runs (default: the active env's python3).
        #[arg(long, value_name = "PATH", conflicts_with = "magics_only")]
        python: Option<PathBuf>,
        /// Replace a kernelspec of that name that gpukernel did not write.
        #[arg(long)]
        force: bool,
    },
    /// Remove a kernelspec installed by `gpukernel install`.
    Uninstall {
        #[command(flatten)]
        location: LocationArgs,
        /// Kernelspec name to remove.
        #[arg(long, default_value = kernelspec::PYTHON_NAME)]
        name: String,
    },
    /// Show what this build sees: GPUs through NVML and, in torch builds, libtorch and CUDA.
    Info {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
#[group(multiple = false)]
struct LocationArgs {
    /// Under the user's Jupyter data dir (the default).
    #[arg(long)]
    user: bool,
    /// Under the active Python environment's prefix.
    #[arg(long)]
    sys_prefix: bool,
    /// Under DIR/share/jupyter/kernels.
    #[arg(long, value_name = "DIR")]
    prefix: Option<PathBuf>,
}

impl LocationArgs {
    fn location(&self) -> kernelspec::Location {
        match (&self.prefix, self.sys_prefix) {
            (Some(dir), _) => kernelspec::Location::Prefix(dir.clone()),
            (None, true) => kernelspec::Location::SysPrefix,
            (None, false) => kernelspec::Location::User,
        }
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match cli.command {
        Command::Run {
            connection_file,
            magics_only,
            child,
        } => {
            let info = server::read_connection_file(&connection_file)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            if magics_only {
                runtime.block_on(kernel::run(info))?;
            } else {
                let child = if child.is_empty() {
                    [
                        "python3",
                        "-m",
                        "ipykernel_launcher",
                        "-f",
                        "{child_connection_file}",
                    ]
                    .map(String::from)
                    .to_vec()
                } else {
                    child
                };
                if let Err(e) = runtime.block_on(proxy::run(info, child, &connection_file)) {
                    eprintln!("gpukernel: {e:#}");
                    std::process::exit(1);
                }
            }
            // Magics may still be blocked in C on worker threads; do not wait for them.
            std::process::exit(0);
        }
        Command::Install {
            location,
            name,
            display_name,
            magics_only,
            python,
            force,
        } => {
            let (kind, default_name) = if magics_only {
                (kernelspec::Kind::MagicsOnly, kernelspec::MAGICS_NAME)
            } else {
                let python = match python {
                    Some(p) => p,
                    None => kernelspec::default_python()?,
                };
                (kernelspec::Kind::Python { python }, kernelspec::PYTHON_NAME)
            };
            let spec = kernelspec::Spec {
                name: name.unwrap_or_else(|| default_name.to_string()),
                display_name,
                kind,
            };
            let dir = kernelspec::install(&location.location(), &spec, force)?;
            println!("Installed kernelspec {} in {}", spec.name, dir.display());
        }
        Command::Uninstall { location, name } => {
            let dir = kernelspec::uninstall(&location.location(), &name)?;
            println!("Removed kernelspec {name} from {}", dir.display());
        }
        Command::Info { json } => info(json),
    }
    Ok(())
}

/// What libtorch reports through the plugin (torch builds), loading it now.
#[cfg(feature = "torch")]
fn libtorch_report() -> serde_json::Value {
    use gpuprobe::plugin_api::{DeviceSpec, Request};
    let report = torch_plugin::plugin().and_then(|plugin| {
        let info = plugin.request(&Request::Info)?;
        let smoke = plugin.request(&Request::Smoke {
            device: DeviceSpec::Cpu,
        })?;
        Ok(serde_json::json!({
            "plugin": plugin.path.display().to_string(),
            "info": info,
            "cpu_smoke_test": smoke,
        }))
    });
    report.unwrap_or_else(|e| serde_json::json!({"error": e.to_string()}))
}

#[cfg(not(feature = "torch"))]
fn libtorch_report() -> serde_json::Value {
    serde_json::json!({"error": "this build has no libtorch support (build with --features torch)"})
}

/// `gpukernel info`: the build's features and what it sees on this machine.
fn info(json: bool) {
    let gpus = magics::GpuState::new().snapshot();
    let torch = libtorch_report();
    if json {
        let value = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "torch_feature": cfg!(feature = "torch"),
            "nvml": match &gpus {
                Ok(s) => serde_json::to_value(s).unwrap_or_default(),
                Err(e) => serde_json::json!({"error": e.to_string()}),
            },
            "libtorch": torch,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
        return;
    }
    println!("gpukernel {}", env!("CARGO_PKG_VERSION"));
    match &gpus {
        Ok(s) => {
            println!("NVML: driver {}, {} GPU(s)", s.driver_version, s.gpus.len());
            for g in &s.gpus {
                println!(
                    "  GPU {}: {} ({} total)",
                    g.index,
                    g.name,
                    gpuprobe::units::human_bytes(g.memory_total)
                );
            }
        }
        Err(e) => println!("NVML: {e}"),
    }
    match torch.get("error").and_then(serde_json::Value::as_str) {
        Some(error) => println!("libtorch: {error}"),
        None => println!(
            "libtorch: {} (CUDA available: {}, CUDA devices: {}, cuDNN: {}, CPU smoke test: {})",
            torch["plugin"].as_str().unwrap_or("?"),
            torch["info"]["cuda_available"],
            torch["info"]["cuda_device_count"],
            torch["info"]["cudnn_available"],
            torch["cpu_smoke_test"]
        ),
    }
}
