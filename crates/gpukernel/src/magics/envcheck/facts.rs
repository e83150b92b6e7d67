//! What `%envcheck` learns: from the probe process (`probe.py`), from the notebook's session
//! (`session.py`, gpu-python only) and from NVML. Plain typed data.

use serde::{Deserialize, Serialize};

/// The probe's stdout after its marker: the facts, or `{"failed": why}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ProbeAnswer {
    Failed { failed: String },
    Facts(Box<ProbeFacts>),
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct ProbeFacts {
    pub python: PythonFacts,
    pub env: EnvFacts,
    #[serde(default)]
    pub torch_dists: Vec<Dist>,
    #[serde(default)]
    pub nvidia_wheels: Vec<Dist>,
    #[serde(default)]
    pub conda_torch: Vec<CondaPackage>,
    pub torch: Option<TorchFacts>,
    #[serde(default, skip_serializing)]
    pub freeze: Option<Freeze>,
    #[serde(default, skip_serializing)]
    pub conda_packages: Option<Vec<CondaPackage>>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct PythonFacts {
    pub executable: String,
    pub version: String,
    pub prefix: String,
    pub base_prefix: String,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct EnvFacts {
    /// `venv`, `conda` or `system`.
    pub kind: String,
    pub name: Option<String>,
    pub prefix: String,
}

/// One installed distribution's metadata directory.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Dist {
    pub name: String,
    pub canonical: String,
    pub version: Option<String>,
    pub location: String,
    pub metadata_dir: String,
    pub installer: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct CondaPackage {
    pub name: String,
    pub version: Option<String>,
    pub build: Option<String>,
    pub channel: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct TorchFacts {
    pub importable: bool,
    pub import_error: Option<String>,
    pub version: Option<String>,
    pub file: Option<String>,
    /// The CUDA torch was built for ("13.0"); `None` for a CPU (or ROCm) build.
    pub cuda: Option<String>,
    pub hip: Option<String>,
    #[serde(default)]
    pub arch_list: Vec<String>,
    pub cudnn: Option<u64>,
    pub nccl: Option<String>,
    #[serde(default)]
    pub cuda_available: bool,
    pub cuda_error: Option<String>,
    #[serde(default)]
    pub devices: Vec<TorchDevice>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct TorchDevice {
    pub index: u32,
    pub name: String,
    pub capability: (u32, u32),
    pub uuid: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct Freeze {
    /// `pip freeze` or `metadata` (no pip in that env).
    pub tool: String,
    pub lines: Vec<String>,
}

/// The notebook's own interpreter, read through the side channel (gpu-python).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct SessionFacts {
    pub executable: String,
    pub prefix: String,
    /// The notebook's working directory (`--export` resolves a relative FILE there).
    #[serde(default)]
    pub cwd: Option<String>,
    pub sys_path: Vec<String>,
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, Option<String>>,
    pub torch_loaded: Option<LoadedTorch>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct LoadedTorch {
    pub version: Option<String>,
    pub file: Option<String>,
    pub cuda: Option<String>,
}

/// The driver, from NVML (or the test override).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DriverFacts {
    pub version: Option<String>,
    /// The highest CUDA the driver runs ("12.2").
    pub cuda: Option<String>,
    /// `NVML`, or the override variable's name.
    pub source: String,
    pub error: Option<String>,
    pub gpus: Vec<GpuBrief>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct GpuBrief {
    pub nvml_index: u32,
    pub name: String,
    pub uuid: String,
}

/// "12.2" -> (12, 2); "13" -> (13, 0).
pub fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().map(str::parse).transpose().ok()?.unwrap_or(0);
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_answers_parse() {
        assert_eq!(major_minor("12.2"), Some((12, 2)));
        assert_eq!(major_minor("13"), Some((13, 0)));
        assert_eq!(major_minor("x"), None);
        let failed: ProbeAnswer = serde_json::from_str(r#"{"failed": "OSError: x"}"#).unwrap();
        assert!(matches!(failed, ProbeAnswer::Failed { .. }));
        let facts: ProbeAnswer = serde_json::from_str(
            r#"{"python": {"executable": "/v/bin/python", "version": "3.11.7", "prefix": "/v",
                "base_prefix": "/usr"}, "env": {"kind": "venv", "name": "v", "prefix": "/v"},
                "torch": null}"#,
        )
        .unwrap();
        assert!(matches!(facts, ProbeAnswer::Facts(f) if f.env.kind == "venv"));
    }
}
