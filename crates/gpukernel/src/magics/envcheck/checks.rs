//! The checks: each problem found in the facts, with the fix that solves it. Pure functions.

use super::facts::{major_minor, DriverFacts, ProbeFacts, SessionFacts, TorchFacts};
use crate::magics::visible;
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Breaks CUDA work (or will): fix it.
    Problem,
    /// Works, with a catch worth knowing.
    Warning,
    /// Checked and fine, or nothing to check.
    Ok,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub level: Level,
    /// A stable name for scripts: `two_torch`, `cuda_driver`, ...
    pub check: &'static str,
    pub summary: String,
    pub fix: Option<String>,
}

fn finding(level: Level, check: &'static str, summary: String, fix: Option<String>) -> Finding {
    Finding {
        level,
        check,
        summary,
        fix,
    }
}

/// Which CUDA ordinal maps to which NVML GPU under `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VisibleMap {
    pub value: Option<String>,
    pub devices: Vec<(usize, u32, String)>,
}

pub struct Inputs<'a> {
    pub probe: Option<&'a ProbeFacts>,
    pub session: Option<&'a SessionFacts>,
    pub driver: &'a DriverFacts,
    pub visible: Option<&'a str>,
    /// `python3` on PATH, when it is not the one checked (gpu-python).
    pub path_python: Option<&'a str>,
}

/// The wheel index of PyTorch builds a driver of CUDA `driver` runs (minor-version
/// compatibility: any 12.x build on a 12.0+ driver).
pub fn wheel_index_for(driver: (u32, u32)) -> Option<&'static str> {
    match driver {
        (13, _) => Some("cu130"),
        (12, m) if m >= 8 => Some("cu128"),
        (12, _) => Some("cu126"),
        (11, m) if m >= 8 => Some("cu118"),
        _ => None,
    }
}

fn torch_base_version(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

pub fn visible_map(visible: Option<&str>, driver: &DriverFacts) -> VisibleMap {
    let gpus: Vec<gpuprobe::GpuInfo> = driver
        .gpus
        .iter()
        .map(|g| gpuprobe::GpuInfo {
            index: g.nvml_index,
            name: g.name.clone(),
            uuid: g.uuid.clone(),
            pci_bus_id: String::new(),
            memory_used: 0,
            memory_free: 0,
            memory_total: 0,
            utilization_gpu: None,
            processes: Vec::new(),
        })
        .collect();
    let ordinals = visible::cuda_ordinals(visible, &gpus);
    let mut devices: Vec<(usize, u32, String)> = ordinals
        .iter()
        .zip(&gpus)
        .filter_map(|(o, g)| o.map(|o| (o, g.index, g.name.clone())))
        .collect();
    devices.sort();
    VisibleMap {
        value: visible.map(str::to_owned),
        devices,
    }
}

/// Every check, problems first.
pub fn run(inputs: &Inputs) -> Vec<Finding> {
    let mut out = Vec::new();
    match inputs.probe {
        Some(probe) => {
            two_torch(probe, &mut out);
            conda_and_pip(probe, &mut out);
            torch_build(probe, inputs.driver, &mut out);
            nvidia_wheels(probe, &mut out);
            if let Some(session) = inputs.session {
                session_torch(probe, session, &mut out);
            }
            if let Some(path_python) = inputs.path_python {
                other_python(probe, path_python, &mut out);
            }
        }
        None => out.push(finding(
            Level::Problem,
            "python",
            "no Python to check was found".into(),
            Some("activate the env (or put its bin/ first on PATH) before starting Jupyter".into()),
        )),
    }
    visible_devices(inputs.visible, inputs.driver, &mut out);
    out.sort_by_key(|f| match f.level {
        Level::Problem => 0,
        Level::Warning => 1,
        Level::Ok => 2,
    });
    out
}

fn two_torch(probe: &ProbeFacts, out: &mut Vec<Finding>) {
    let mut seen = BTreeSet::new();
    let copies: Vec<_> = probe
        .torch_dists
        .iter()
        .filter(|d| seen.insert((d.location.clone(), d.metadata_dir.clone())))
        .collect();
    if copies.len() < 2 {
        return;
    }
    let imported = probe
        .torch
        .as_ref()
        .and_then(|t| t.file.as_deref())
        .and_then(|f| {
            Path::new(f)
                .parent()?
                .parent()
                .map(|p| p.display().to_string())
        });
    let list: Vec<String> = copies
        .iter()
        .map(|d| {
            format!(
                "torch {} in {} ({}{})",
                d.version.as_deref().unwrap_or("?"),
                d.location,
                d.installer.as_deref().unwrap_or("unknown installer"),
                if imported.as_deref() == Some(d.location.as_str()) {
                    ", the one imported"
                } else {
                    ""
                }
            )
        })
        .collect();
    let remove: Vec<String> = copies
        .iter()
        .filter(|d| imported.as_deref() != Some(d.location.as_str()))
        .map(|d| {
            let package = Path::new(&d.location).join("torch");
            let meta = Path::new(&d.location).join(&d.metadata_dir);
            if package.exists() {
                format!("rm -rf {} {}", package.display(), meta.display())
            } else {
                format!("rm -rf {}", meta.display())
            }
        })
        .collect();
    out.push(finding(
        Level::Problem,
        "two_torch",
        format!(
            "{} torch installations are visible on sys.path: {}. Which one `import torch` gets \
             depends on the path order, and pip's and conda's view of the env disagree.",
            copies.len(),
            list.join("; ")
        ),
        Some(format!(
            "keep one: remove the others ({}), then `python -m pip check`",
            remove.join("; ")
        )),
    ));
}

fn conda_and_pip(probe: &ProbeFacts, out: &mut Vec<Finding>) {
    let Some(conda) = probe.conda_torch.first() else {
        return;
    };
    let Some(pip) = probe
        .torch_dists
        .iter()
        .find(|d| d.installer.as_deref() == Some("pip"))
    else {
        return;
    };
    out.push(finding(
        Level::Problem,
        "conda_pip_torch",
        format!(
            "conda installed {} {} in {}, and pip installed torch {} over it ({}): two package \
             managers own one package; conda's next update breaks it.",
            conda.name,
            conda.version.as_deref().unwrap_or("?"),
            probe.env.prefix,
            pip.version.as_deref().unwrap_or("?"),
            pip.location
        ),
        Some(format!(
            "let one own it: `python -m pip uninstall torch` then `conda install --force-reinstall {}` \
             (or `conda remove --force {}` and keep pip's)",
            conda.name, conda.name
        )),
    ));
}

fn torch_build(probe: &ProbeFacts, driver: &DriverFacts, out: &mut Vec<Finding>) {
    let Some(torch) = &probe.torch else {
        out.push(finding(
            Level::Ok,
            "torch",
            "torch is not installed in this env".into(),
            None,
        ));
        return;
    };
    if !torch.importable {
        out.push(finding(
            Level::Problem,
            "torch_import",
            format!(
                "`import torch` fails: {}",
                torch.import_error.as_deref().unwrap_or("?")
            ),
            Some(
                "reinstall it: `python -m pip install --force-reinstall torch` (with the index \
                  of your CUDA, see below)"
                    .into(),
            ),
        ));
        return;
    }
    let version = torch.version.clone().unwrap_or_else(|| "?".into());
    if let Some(f) = cuda_vs_driver(torch, &version, driver) {
        out.push(f);
    }
    for device in &torch.devices {
        arch(torch.arch_list.as_slice(), device, &version, out);
    }
    if torch.cuda.is_some() {
        out.push(finding(
            Level::Ok,
            "libraries",
            format!(
                "cuDNN {}, NCCL {}",
                torch
                    .cudnn
                    .map(cudnn_version)
                    .unwrap_or_else(|| "not available".into()),
                torch.nccl.as_deref().unwrap_or("not available")
            ),
            None,
        ));
    }
}

/// torch's CUDA build against what the driver supports: a CPU-only build on a GPU machine, a
/// driver too old for the build (major, then minor), or the two compatible.
fn cuda_vs_driver(torch: &TorchFacts, version: &str, driver: &DriverFacts) -> Option<Finding> {
    let driver_cuda = driver.cuda.as_deref().and_then(major_minor);
    let built = torch.cuda.as_deref().and_then(major_minor);
    match (built, driver_cuda) {
        (None, _) if !driver.gpus.is_empty() => Some(finding(
            Level::Problem,
            "cuda_build",
            format!("torch {version} is a CPU-only build, and this machine has {} GPU(s)", driver.gpus.len()),
            driver_cuda.and_then(wheel_index_for).map(|index| {
                format!(
                    "python -m pip install --force-reinstall torch=={} --index-url https://download.pytorch.org/whl/{index}",
                    torch_base_version(version)
                )
            }),
        )),
        (None, _) => None,
        (Some(b), None) => Some(finding(
            Level::Warning,
            "cuda_driver",
            format!(
                "torch {version} is built for CUDA {}.{}, and no NVIDIA driver answers here ({}): CUDA cannot run on this machine",
                b.0,
                b.1,
                driver.error.as_deref().unwrap_or("NVML unavailable")
            ),
            None,
        )),
        (Some(b), Some(d)) if d.0 < b.0 => {
            let fix = match wheel_index_for(d) {
                Some(index) => format!(
                    "install a torch built for the driver's CUDA: `python -m pip install --force-reinstall torch=={} --index-url https://download.pytorch.org/whl/{index}`; or update the NVIDIA driver to one that supports CUDA {}.{}",
                    torch_base_version(version), b.0, b.1
                ),
                None => format!("update the NVIDIA driver to one that supports CUDA {}.{}", b.0, b.1),
            };
            Some(finding(
                Level::Problem,
                "cuda_driver",
                format!(
                    "torch {version} is built for CUDA {}.{}, but the driver{} supports CUDA {}.{} at most: CUDA calls will fail",
                    b.0,
                    b.1,
                    driver.version.as_deref().map(|v| format!(" {v}")).unwrap_or_default(),
                    d.0,
                    d.1
                ),
                Some(fix),
            ))
        }
        (Some(b), Some(d)) if d < b => Some(finding(
            Level::Warning,
            "cuda_driver",
            format!(
                "torch {version} is built for CUDA {}.{}, the driver supports {}.{}: it runs by minor-version compatibility, but kernels compiled on the fly (PTX) fail",
                b.0, b.1, d.0, d.1
            ),
            Some(format!("update the NVIDIA driver to one that supports CUDA {}.{}", b.0, b.1)),
        )),
        (Some(b), Some(d)) => Some(finding(
            Level::Ok,
            "cuda_driver",
            format!(
                "torch {version} (CUDA {}.{}) and the driver (CUDA {}.{}) are compatible",
                b.0, b.1, d.0, d.1
            ),
            None,
        )),
    }
}

/// cuDNN's version number as torch reports it: 91900 -> 9.19.0 (cuDNN 9), 8902 -> 8.9.2.
fn cudnn_version(v: u64) -> String {
    if v >= 90000 {
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
    }
}

fn arch(
    arch_list: &[String],
    device: &super::facts::TorchDevice,
    version: &str,
    out: &mut Vec<Finding>,
) {
    let (major, minor) = device.capability;
    let parse = |s: &str, prefix: &str| -> Option<(u32, u32)> {
        let digits: String = s
            .strip_prefix(prefix)?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let n: u32 = digits.parse().ok()?;
        Some((n / 10, n % 10))
    };
    let binary = arch_list
        .iter()
        .filter_map(|a| parse(a, "sm_"))
        .any(|(m, n)| m == major && n <= minor);
    let ptx = arch_list
        .iter()
        .filter_map(|a| parse(a, "compute_"))
        .any(|c| c <= (major, minor));
    let what = format!(
        "cuda:{} ({}) has compute capability {major}.{minor}",
        device.index, device.name
    );
    let (level, summary, fix) = if binary {
        (
            Level::Ok,
            format!("{what}; torch {version} has code for it"),
            None,
        )
    } else if ptx {
        (
            Level::Warning,
            format!("{what}; torch {version} has no binary code for sm_{major}{minor}, only PTX: the first use of each kernel compiles it (slow start)"),
            Some("install a torch build whose arch list includes it (a newer torch or CUDA index)".into()),
        )
    } else {
        (
            Level::Problem,
            format!(
                "{what}, which torch {version} was not compiled for (arch list: {}): kernels fail with 'no kernel image is available'",
                arch_list.join(" ")
            ),
            Some("install a torch build that supports this GPU (a newer torch and CUDA index, e.g. cu128 or later for sm_100/sm_120)".into()),
        )
    };
    out.push(finding(level, "gpu_arch", summary, fix));
}

fn cuda_major_of(d: &super::facts::Dist) -> Option<u32> {
    if let Some((_, suffix)) = d.canonical.rsplit_once("-cu") {
        if let Ok(major) = suffix.parse() {
            return Some(major);
        }
    }
    if d.canonical == "nvidia-cuda-runtime" {
        return d.version.as_deref().and_then(major_minor).map(|v| v.0);
    }
    None
}

fn nvidia_wheels(probe: &ProbeFacts, out: &mut Vec<Finding>) {
    let majors: BTreeSet<u32> = probe
        .nvidia_wheels
        .iter()
        .filter_map(cuda_major_of)
        .collect();
    let built = probe
        .torch
        .as_ref()
        .and_then(|t| t.cuda.as_deref())
        .and_then(major_minor)
        .map(|v| v.0);
    if majors.len() > 1 {
        let list: Vec<String> = probe
            .nvidia_wheels
            .iter()
            .filter(|d| cuda_major_of(d).is_some())
            .map(|d| format!("{} {}", d.name, d.version.as_deref().unwrap_or("?")))
            .collect();
        out.push(finding(
            Level::Problem,
            "nvidia_wheels",
            format!(
                "nvidia-* CUDA wheels of {} CUDA versions are installed together ({}): torch may load the wrong libraries",
                majors.len(),
                list.join(", ")
            ),
            Some(match built {
                Some(b) => format!(
                    "uninstall the wheels not for CUDA {b} (`python -m pip uninstall NAME`), then `python -m pip install --force-reinstall torch` from its CUDA index"
                ),
                None => "uninstall the wheels of the CUDA version torch does not use".into(),
            }),
        ));
    } else if let (Some(b), Some(&m)) = (built, majors.iter().next()) {
        if b != m {
            out.push(finding(
                Level::Problem,
                "nvidia_wheels",
                format!("torch is built for CUDA {b} but the nvidia-* wheels are for CUDA {m}"),
                Some("reinstall torch with its own wheels: `python -m pip install --force-reinstall torch` from the index of its CUDA".into()),
            ));
        }
    }
}

fn session_torch(probe: &ProbeFacts, session: &SessionFacts, out: &mut Vec<Finding>) {
    let (Some(loaded), Some(fresh)) = (&session.torch_loaded, &probe.torch) else {
        return;
    };
    if loaded.file.is_some() && fresh.file.is_some() && loaded.file != fresh.file
        || loaded.version != fresh.version && fresh.version.is_some()
    {
        out.push(finding(
            Level::Warning,
            "session_torch",
            format!(
                "the notebook has torch {} from {} loaded; a fresh start of the same Python would import torch {} from {}",
                loaded.version.as_deref().unwrap_or("?"),
                loaded.file.as_deref().unwrap_or("?"),
                fresh.version.as_deref().unwrap_or("?"),
                fresh.file.as_deref().unwrap_or("?")
            ),
            Some("restart the kernel to use the installed one".into()),
        ));
    }
}

fn other_python(probe: &ProbeFacts, path_python: &str, out: &mut Vec<Finding>) {
    let real = |p: &str| {
        std::fs::canonicalize(p)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| p.to_string())
    };
    let prefix_of = |p: &str| {
        Path::new(p)
            .parent()
            .and_then(Path::parent)
            .map(|p| p.display().to_string())
    };
    if real(path_python) == real(&probe.python.executable)
        || prefix_of(path_python).as_deref() == Some(probe.python.prefix.as_str())
    {
        return;
    }
    out.push(finding(
        Level::Warning,
        "other_python",
        format!(
            "the notebook runs {} (env {}), but `python3` on Jupyter's PATH is {}: `pip install` in a terminal goes to the other env",
            probe.python.executable, probe.env.prefix, path_python
        ),
        Some(format!("install from the notebook with `%pip install ...`, or run `{} -m pip install ...`", probe.python.executable)),
    ));
}

fn visible_devices(visible: Option<&str>, driver: &DriverFacts, out: &mut Vec<Finding>) {
    let map = visible_map(visible, driver);
    let Some(value) = visible else {
        return;
    };
    if driver.gpus.is_empty() {
        return;
    }
    let entries = value.split(',').filter(|e| !e.trim().is_empty()).count();
    if map.devices.is_empty() {
        out.push(finding(
            Level::Problem,
            "cuda_visible_devices",
            format!("CUDA_VISIBLE_DEVICES={value:?} hides every GPU ({} on this machine): torch sees none", driver.gpus.len()),
            Some(format!(
                "unset it, or name GPUs by index (0..{}) or UUID",
                driver.gpus.len().saturating_sub(1)
            )),
        ));
    } else if map.devices.len() < entries {
        out.push(finding(
            Level::Warning,
            "cuda_visible_devices",
            format!(
                "CUDA_VISIBLE_DEVICES={value:?} names {entries} GPUs but only {} exist as written (CUDA stops at the first invalid entry)",
                map.devices.len()
            ),
            Some("fix the list: indices 0..N-1 or UUIDs, comma-separated".into()),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::super::facts::{Dist, EnvFacts, GpuBrief, TorchDevice, TorchFacts};
    use super::*;

    fn torch(version: &str, cuda: Option<&str>) -> TorchFacts {
        TorchFacts {
            importable: true,
            version: Some(version.into()),
            cuda: cuda.map(str::to_owned),
            arch_list: vec!["sm_80".into(), "sm_90".into(), "compute_90".into()],
            ..Default::default()
        }
    }

    fn driver(cuda: &str, gpus: usize) -> DriverFacts {
        DriverFacts {
            version: Some("535.104.05".into()),
            cuda: Some(cuda.into()),
            source: "NVML".into(),
            error: None,
            gpus: (0..gpus)
                .map(|i| GpuBrief {
                    nvml_index: i as u32,
                    name: "H100".into(),
                    uuid: format!("GPU-{i}"),
                })
                .collect(),
        }
    }

    fn checks(probe: &ProbeFacts, driver: &DriverFacts, visible: Option<&str>) -> Vec<Finding> {
        run(&Inputs {
            probe: Some(probe),
            session: None,
            driver,
            visible,
            path_python: None,
        })
    }

    #[test]
    fn torch_newer_than_the_driver_is_a_problem_with_the_right_index() {
        let probe = ProbeFacts {
            torch: Some(torch("2.11.0+cu130", Some("13.0"))),
            env: EnvFacts::default(),
            ..Default::default()
        };
        let f = checks(&probe, &driver("12.2", 1), None);
        assert_eq!(f[0].check, "cuda_driver");
        assert_eq!(f[0].level, Level::Problem);
        assert!(f[0]
            .fix
            .as_deref()
            .unwrap()
            .contains("torch==2.11.0 --index-url https://download.pytorch.org/whl/cu126"));
        let f = checks(&probe, &driver("13.1", 1), None);
        assert!(f
            .iter()
            .any(|x| x.check == "cuda_driver" && x.level == Level::Ok));
        let f = checks(&probe, &driver("13.0", 0), None);
        assert!(f.iter().all(|x| x.level != Level::Problem));
    }

    #[test]
    fn two_torch_copies_name_the_one_to_remove() {
        let dist = |loc: &str, v: &str| Dist {
            name: "torch".into(),
            canonical: "torch".into(),
            version: Some(v.into()),
            location: loc.into(),
            metadata_dir: format!("torch-{v}.dist-info"),
            installer: Some("pip".into()),
        };
        let mut t = torch("2.11.0", Some("13.0"));
        t.file = Some("/env/site-packages/torch/__init__.py".into());
        let probe = ProbeFacts {
            torch: Some(t),
            torch_dists: vec![
                dist("/env/site-packages", "2.11.0"),
                dist("/extra", "2.5.1"),
            ],
            ..Default::default()
        };
        let f = checks(&probe, &driver("13.0", 1), None);
        assert_eq!(f[0].check, "two_torch");
        assert!(
            f[0].summary
                .contains("/env/site-packages (pip, the one imported)"),
            "{}",
            f[0].summary
        );
        assert!(f[0]
            .fix
            .as_deref()
            .unwrap()
            .contains("rm -rf /extra/torch-2.5.1.dist-info"));
    }

    #[test]
    fn arch_cuda_wheels_and_visible_devices() {
        let mut t = torch("2.11.0", Some("13.0"));
        // A V100 (7.0) under a build from sm_80 up: no code at all. A B200 (10.0): PTX only.
        t.devices = vec![
            TorchDevice {
                index: 0,
                name: "V100".into(),
                capability: (7, 0),
                uuid: None,
            },
            TorchDevice {
                index: 1,
                name: "B200".into(),
                capability: (10, 0),
                uuid: None,
            },
        ];
        let wheel = |name: &str, v: &str| Dist {
            name: name.into(),
            canonical: name.into(),
            version: Some(v.into()),
            ..Default::default()
        };
        let probe = ProbeFacts {
            torch: Some(t),
            nvidia_wheels: vec![
                wheel("nvidia-cuda-runtime", "13.0.96"),
                wheel("nvidia-cublas-cu12", "12.4.5"),
            ],
            ..Default::default()
        };
        let f = checks(&probe, &driver("13.0", 2), Some("5"));
        let names: Vec<_> = f
            .iter()
            .filter(|x| x.level == Level::Problem)
            .map(|x| x.check)
            .collect();
        assert!(names.contains(&"gpu_arch"), "{names:?}");
        let ptx = f
            .iter()
            .find(|x| x.check == "gpu_arch" && x.level == Level::Warning);
        assert!(ptx.unwrap().summary.contains("cuda:1 (B200)"));
        assert!(names.contains(&"nvidia_wheels"), "{names:?}");
        assert!(names.contains(&"cuda_visible_devices"), "{names:?}");
        assert_eq!(
            visible_map(Some("1"), &driver("13.0", 2)).devices,
            vec![(0, 1, "H100".into())]
        );
    }
}
