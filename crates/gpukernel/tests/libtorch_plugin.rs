//! The torch build of gpukernel loads libtorch through libgpuprobe_torch.so and computes.
//! Needs the plugin built (`cargo build --release -p gpuprobe-torch`; scripts/test does it)
//! and found through GPUKERNEL_TORCH_PLUGIN or next to the binary.
#![cfg(feature = "torch")]

use std::path::PathBuf;
use std::process::Command;

fn plugin() -> PathBuf {
    let path = std::env::var_os("GPUKERNEL_TORCH_PLUGIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_BIN_EXE_gpukernel")).with_file_name("libgpuprobe_torch.so")
        });
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --release -p gpuprobe-torch`",
        path.display()
    );
    path
}

#[test]
fn info_loads_libtorch_and_runs_a_cpu_computation() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpukernel"))
        .args(["info", "--json"])
        .env("GPUKERNEL_TORCH_PLUGIN", plugin())
        .output()
        .expect("gpukernel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["torch_feature"], true);
    let torch = &report["libtorch"];
    assert!(torch.get("error").is_none(), "{torch}");
    // trace(A @ A^T) for A = arange(9).reshape(3, 3) is the sum of squares 0..8.
    assert_eq!(torch["cpu_smoke_test"], 204.0);
    assert!(torch["info"]["cuda_available"].is_boolean());
}

#[test]
fn a_missing_plugin_is_reported_not_fatal() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpukernel"))
        .args(["info", "--json"])
        .env(
            "GPUKERNEL_TORCH_PLUGIN",
            "/nonexistent/libgpuprobe_torch.so",
        )
        .output()
        .expect("gpukernel runs");
    assert!(out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let error = report["libtorch"]["error"]
        .as_str()
        .expect("an error message");
    assert!(error.contains("not installed"), "{error}");
    assert!(error.contains("gpuprobe-torch"), "{error}");
}
