//! `gpukernel install` / `uninstall`: writing kernel.json (+ logos) under `kernels/<name>`.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};

const MAGICS_TEMPLATE: &str = include_str!("../../../kernelspec/gpu-magics/kernel.json");
const PYTHON_TEMPLATE: &str = include_str!("../../../kernelspec/gpu-python/kernel.json");
const LOGOS: [(&str, &[u8]); 3] = [
    (
        "logo-32x32.png",
        include_bytes!("../../../kernelspec/logo-32x32.png"),
    ),
    (
        "logo-64x64.png",
        include_bytes!("../../../kernelspec/logo-64x64.png"),
    ),
    (
        "logo-svg.svg",
        include_bytes!("../../../kernelspec/logo-svg.svg"),
    ),
];

pub const MAGICS_NAME: &str = "gpu-magics";
pub const PYTHON_NAME: &str = "gpu-python";

/// Where kernelspecs go, as `jupyter kernelspec install` names it.
#[derive(Debug, Clone)]
pub enum Location {
    /// `$JUPYTER_DATA_DIR` or `~/.local/share/jupyter`.
    User,
    /// The active Python environment (`$VIRTUAL_ENV`, `$CONDA_PREFIX`, else python3's prefix).
    SysPrefix,
    Prefix(PathBuf),
}

impl Location {
    /// The `kernels` directory for this location.
    pub fn kernels_dir(&self) -> Result<PathBuf> {
        let data_dir = match self {
            Location::User => match std::env::var_os("JUPYTER_DATA_DIR") {
                Some(dir) => PathBuf::from(dir),
                None => {
                    let home = std::env::var_os("HOME")
                        .context("HOME is not set; pass --prefix DIR instead")?;
                    PathBuf::from(home).join(".local/share/jupyter")
                }
            },
            Location::SysPrefix => python_prefix()?.join("share/jupyter"),
            Location::Prefix(dir) => dir.join("share/jupyter"),
        };
        Ok(data_dir.join("kernels"))
    }
}

fn python_prefix() -> Result<PathBuf> {
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(dir) = std::env::var_os(var).filter(|d| !d.is_empty()) {
            return Ok(PathBuf::from(dir));
        }
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix needs python3 on PATH (or VIRTUAL_ENV / CONDA_PREFIX set)")?;
    if !out.status.success() {
        bail!("python3 could not report sys.prefix");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Which kernel the spec starts.
pub enum Kind {
    /// `gpu-magics`: magics only.
    MagicsOnly,
    /// `gpu-python`: a proxy in front of ipykernel run by this Python interpreter.
    Python { python: PathBuf },
}

/// What to install.
pub struct Spec {
    pub name: String,
    pub display_name: Option<String>,
    pub kind: Kind,
}

/// The Python that `gpu-python` runs ipykernel with: `$VIRTUAL_ENV`/`$CONDA_PREFIX`'s, else the
/// first python3 on PATH, as an absolute path so the spec does not depend on PATH later.
pub fn default_python() -> Result<PathBuf> {
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(dir) = std::env::var_os(var).filter(|d| !d.is_empty()) {
            let python = PathBuf::from(dir).join("bin/python3");
            if python.exists() {
                return Ok(python);
            }
        }
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("no python3 on PATH: pass --python PATH")?;
    if !out.status.success() {
        bail!("python3 could not report its path: pass --python PATH");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Builds kernel.json from the template, pointing argv at `binary` (and the Python).
pub fn render(binary: &Path, kind: &Kind, display_name: Option<&str>) -> Result<Value> {
    let template = match kind {
        Kind::MagicsOnly => MAGICS_TEMPLATE,
        Kind::Python { .. } => PYTHON_TEMPLATE,
    };
    let mut spec: Value = serde_json::from_str(template).context("kernelspec template")?;
    let binary = binary
        .to_str()
        .context("the gpukernel path is not valid UTF-8")?;
    let python = match kind {
        Kind::Python { python } => Some(
            python
                .to_str()
                .context("the Python path is not valid UTF-8")?,
        ),
        Kind::MagicsOnly => None,
    };
    if let Some(argv) = spec.get_mut("argv").and_then(Value::as_array_mut) {
        for arg in argv.iter_mut() {
            if arg == "{gpukernel}" {
                *arg = Value::String(binary.to_string());
            } else if let (true, Some(python)) = (arg == "{python}", python) {
                *arg = Value::String(python.to_string());
            }
        }
    }
    if let Some(name) = display_name {
        spec["display_name"] = Value::String(name.to_string());
    }
    Ok(spec)
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if !ok {
        bail!("kernel name {name:?} is not valid: use letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

/// Who a kernelspec directory belongs to.
#[derive(Debug, PartialEq, Eq)]
enum Owner {
    /// Nothing there (or an empty directory).
    Nobody,
    /// A kernel.json whose argv starts with a gpukernel binary.
    Us,
    /// Anything else: another kernel's spec, or files that are no kernelspec.
    Someone,
}

fn owner(dir: &Path) -> Owner {
    let Ok(mut entries) = fs::read_dir(dir) else {
        return Owner::Nobody;
    };
    if entries.next().is_none() {
        return Owner::Nobody;
    }
    let Ok(text) = fs::read_to_string(dir.join("kernel.json")) else {
        return Owner::Someone;
    };
    let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let ours = json["argv"]
        .get(0)
        .and_then(Value::as_str)
        .and_then(|bin| Path::new(bin).file_name()?.to_str())
        .is_some_and(|file| file.starts_with("gpukernel"));
    if ours {
        Owner::Us
    } else {
        Owner::Someone
    }
}

/// Writes `kernels/<name>/kernel.json` and the logos; returns the directory. A directory
/// there that gpukernel did not write (another kernel named the same) is left alone unless
/// `force`.
pub fn install(location: &Location, spec: &Spec, force: bool) -> Result<PathBuf> {
    check_name(&spec.name)?;
    let binary = std::env::current_exe()
        .and_then(fs::canonicalize)
        .context("cannot find the gpukernel binary's own path")?;
    let dir = location.kernels_dir()?.join(&spec.name);
    if owner(&dir) == Owner::Someone && !force {
        bail!(
            "{} holds a kernelspec gpukernel did not write; pick another --name, or pass \
             --force to replace it",
            dir.display()
        );
    }
    if let Kind::Python { python } = &spec.kind {
        let ok = std::process::Command::new(python)
            .args(["-c", "import ipykernel"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            bail!(
                "{} cannot import ipykernel: install it there (pip install ipykernel) or pass \
                 --python PATH of a Python that has it",
                python.display()
            );
        }
    }
    let json = render(&binary, &spec.kind, spec.display_name.as_deref())?;
    let text = serde_json::to_string_pretty(&json)? + "\n";
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    fs::write(dir.join("kernel.json"), text)
        .with_context(|| format!("cannot write {}", dir.join("kernel.json").display()))?;
    for (file, bytes) in LOGOS {
        fs::write(dir.join(file), bytes)
            .with_context(|| format!("cannot write {}", dir.join(file).display()))?;
    }
    Ok(dir)
}

/// Removes `kernels/<name>`; an error if it is not there or is not ours.
pub fn uninstall(location: &Location, name: &str) -> Result<PathBuf> {
    check_name(name)?;
    let dir = location.kernels_dir()?.join(name);
    match owner(&dir) {
        Owner::Nobody => bail!("no kernelspec {name:?} at {}", dir.display()),
        Owner::Us => {}
        Owner::Someone => bail!(
            "{} is not a gpukernel kernelspec; remove it with `jupyter kernelspec remove {name}`",
            dir.display()
        ),
    }
    fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_then_uninstall_in_a_prefix() {
        let tmp = tempfile::tempdir().unwrap();
        let location = Location::Prefix(tmp.path().to_path_buf());
        let spec = Spec {
            name: MAGICS_NAME.into(),
            display_name: Some("My GPUs".into()),
            kind: Kind::MagicsOnly,
        };
        let dir = install(&location, &spec, false).unwrap();
        // Installing again over our own spec is an update.
        install(&location, &spec, false).unwrap();
        assert_eq!(dir, tmp.path().join("share/jupyter/kernels/gpu-magics"));
        let json: Value =
            serde_json::from_str(&fs::read_to_string(dir.join("kernel.json")).unwrap()).unwrap();
        assert_eq!(json["display_name"], "My GPUs");
        assert_eq!(json["argv"][1], "run");
        assert_eq!(json["argv"][2], "--magics-only");
        assert_eq!(json["argv"][4], "{connection_file}");
        assert!(dir.join("logo-64x64.png").exists());
        uninstall(&location, "gpu-magics").unwrap();
        assert!(!dir.exists());
        assert!(uninstall(&location, "gpu-magics").is_err());
    }

    #[test]
    fn another_kernels_spec_is_replaced_only_with_force() {
        let tmp = tempfile::tempdir().unwrap();
        let location = Location::Prefix(tmp.path().to_path_buf());
        let dir = location.kernels_dir().unwrap().join("python3");
        fs::create_dir_all(&dir).unwrap();
        let theirs =
            r#"{"argv": ["python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"]}"#;
        fs::write(dir.join("kernel.json"), theirs).unwrap();
        let spec = Spec {
            name: "python3".into(),
            display_name: None,
            kind: Kind::MagicsOnly,
        };
        let error = install(&location, &spec, false).unwrap_err().to_string();
        assert!(
            error.contains("did not write") && error.contains("--force"),
            "{error}"
        );
        assert_eq!(fs::read_to_string(dir.join("kernel.json")).unwrap(), theirs);
        assert!(uninstall(&location, "python3").is_err());
        install(&location, &spec, true).unwrap();
        assert_eq!(owner(&dir), Owner::Us);
        // A directory of other files (no kernel.json) is not ours either.
        let other = location.kernels_dir().unwrap().join("notes");
        fs::create_dir_all(&other).unwrap();
        fs::write(other.join("README"), "mine").unwrap();
        let spec = Spec {
            name: "notes".into(),
            display_name: None,
            kind: Kind::MagicsOnly,
        };
        assert!(install(&location, &spec, false).is_err());
    }

    #[test]
    fn python_spec_runs_ipykernel_behind_the_proxy() {
        let kind = Kind::Python {
            python: PathBuf::from("/env/bin/python3"),
        };
        let json = render(Path::new("/bin/gpukernel"), &kind, None).unwrap();
        let argv: Vec<&str> = json["argv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            argv,
            [
                "/bin/gpukernel",
                "run",
                "-f",
                "{connection_file}",
                "--",
                "/env/bin/python3",
                "-m",
                "ipykernel_launcher",
                "-f",
                "{child_connection_file}"
            ]
        );
        assert_eq!(json["display_name"], "Python 3 (GPU magics)");
        assert_eq!(json["language"], "python");
    }

    #[test]
    fn refuses_bad_names_and_foreign_specs() {
        let tmp = tempfile::tempdir().unwrap();
        let location = Location::Prefix(tmp.path().to_path_buf());
        let bad = Spec {
            name: "../x".into(),
            display_name: None,
            kind: Kind::MagicsOnly,
        };
        assert!(install(&location, &bad, false).is_err());
        let foreign = tmp.path().join("share/jupyter/kernels/python3");
        fs::create_dir_all(&foreign).unwrap();
        fs::write(
            foreign.join("kernel.json"),
            r#"{"argv":["python","-m","ipykernel"]}"#,
        )
        .unwrap();
        assert!(uninstall(&location, "python3").is_err());
        assert!(foreign.exists());
    }
}
