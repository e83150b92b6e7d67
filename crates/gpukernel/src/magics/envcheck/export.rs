//! `%envcheck --export FILE`: the environment as a pinned requirements file (venv) or an
//! `environment.yml` (conda), so it can be recreated on another machine.

use super::facts::{CondaPackage, Freeze, ProbeFacts};
use std::collections::BTreeSet;
use std::path::Path;

/// Why `--export FILE` wrote nothing; the cell's error says it after the file's name.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("no Python environment could be read")]
    NoEnvironment,
    /// The probe ran but could not list the packages (no pip, say).
    #[error("the package list could not be read from that Python")]
    NoPackageList,
    #[error(transparent)]
    Write(#[from] std::io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Requirements,
    CondaYaml,
}

impl Format {
    /// `.yml`/`.yaml` ask for a conda file, `.txt` for requirements; otherwise the env decides.
    pub fn for_file(file: &Path, env_kind: &str) -> Self {
        match file.extension().and_then(|e| e.to_str()) {
            Some("yml" | "yaml") => Format::CondaYaml,
            Some("txt") => Format::Requirements,
            _ if env_kind == "conda" => Format::CondaYaml,
            _ => Format::Requirements,
        }
    }
}

/// The distribution name a requirement line pins (`Name==1.0`, `name @ url`, `-e ...` none).
fn requirement_name(line: &str) -> Option<String> {
    if line.starts_with('-') {
        return None;
    }
    let end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'))
        .unwrap_or(line.len());
    let name = &line[..end];
    (!name.is_empty()).then(|| name.to_lowercase().replace(['_', '.'], "-"))
}

/// "https://conda.anaconda.org/conda-forge/linux-64" -> "conda-forge"; ".../pkgs/main/..." ->
/// "defaults"; "conda-forge" stays.
fn channel_name(channel: &str) -> Option<String> {
    let mut parts: Vec<&str> = channel.split('/').filter(|s| !s.is_empty()).collect();
    let is_subdir = |p: &str| {
        p == "noarch"
            || ["linux-", "osx-", "win-"]
                .iter()
                .any(|os| p.starts_with(os))
    };
    if parts.last().is_some_and(|p| is_subdir(p)) {
        parts.pop();
    }
    if parts.len() >= 2 && parts[parts.len() - 2] == "pkgs" {
        return Some("defaults".into());
    }
    parts
        .last()
        .filter(|c| **c != "pypi" && !c.contains(':'))
        .map(|c| c.to_string())
}

/// `--extra-index-url` for local-version CUDA builds (`torch==2.11.0+cu130`): PyPI has no such
/// version, PyTorch's index does.
fn extra_indexes(lines: &[String]) -> Vec<String> {
    let mut out = BTreeSet::new();
    for line in lines {
        if let Some((_, local)) = line.split_once('+') {
            let tag: String = local
                .chars()
                .take_while(char::is_ascii_alphanumeric)
                .collect();
            if tag.starts_with("cu") || tag.starts_with("rocm") || tag == "cpu" {
                out.insert(format!(
                    "--extra-index-url https://download.pytorch.org/whl/{tag}"
                ));
            }
        }
    }
    out.into_iter().collect()
}

fn header(probe: &ProbeFacts, tool: &str) -> String {
    format!(
        "# Written by gpukernel %envcheck --export on {} from {} (Python {}, {} env {}), \
         packages from {tool}.\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        probe.python.executable,
        probe.python.version,
        probe.env.kind,
        probe.env.prefix
    )
}

/// The file's text; `Err` when the probe listed no packages.
pub fn render(format: Format, probe: &ProbeFacts) -> Result<String, ExportError> {
    let freeze = probe.freeze.as_ref().ok_or(ExportError::NoPackageList)?;
    let python_mm: String = probe
        .python
        .version
        .split('.')
        .take(2)
        .collect::<Vec<_>>()
        .join(".");
    Ok(match format {
        Format::Requirements => requirements(probe, freeze, &python_mm),
        Format::CondaYaml => conda_yaml(probe, freeze, &python_mm),
    })
}

/// pip's pinned requirements, with the extra indexes the torch wheels came from.
fn requirements(probe: &ProbeFacts, freeze: &Freeze, python_mm: &str) -> String {
    let mut text = header(probe, &freeze.tool);
    text.push_str(&format!(
        "# Recreate: python{python_mm} -m venv ENV && ENV/bin/python -m pip install -r THIS_FILE\n"
    ));
    for index in extra_indexes(&freeze.lines) {
        text.push_str(&index);
        text.push('\n');
    }
    for line in &freeze.lines {
        text.push_str(line);
        text.push('\n');
    }
    text
}

/// A conda environment.yml: the conda packages with their channels, and what pip installed
/// on top under `pip:`.
fn conda_yaml(probe: &ProbeFacts, freeze: &Freeze, python_mm: &str) -> String {
    let conda: &[CondaPackage] = probe.conda_packages.as_deref().unwrap_or(&[]);
    let conda_names: BTreeSet<String> = conda.iter().map(|p| p.name.to_lowercase()).collect();
    let mut channels: Vec<String> = Vec::new();
    for p in conda {
        if let Some(c) = p.channel.as_deref().and_then(channel_name) {
            if !channels.contains(&c) {
                channels.push(c);
            }
        }
    }
    if channels.is_empty() {
        channels.push("conda-forge".into());
    }
    let name = probe
        .env
        .name
        .clone()
        .unwrap_or_else(|| "exported-env".into());
    let mut text = header(probe, &freeze.tool);
    text.push_str("# Recreate: conda env create -f THIS_FILE\n");
    text.push_str(&format!("name: {name}\nchannels:\n"));
    for c in &channels {
        text.push_str(&format!("  - {c}\n"));
    }
    text.push_str("dependencies:\n");
    if !conda_names.contains("python") {
        text.push_str(&format!("  - python={python_mm}\n"));
    }
    for p in conda {
        match &p.version {
            Some(v) => text.push_str(&format!("  - {}={v}\n", p.name)),
            None => text.push_str(&format!("  - {}\n", p.name)),
        }
    }
    let pip: Vec<&String> = freeze
        .lines
        .iter()
        .filter(|l| {
            requirement_name(l)
                .map(|n| !conda_names.contains(&n))
                .unwrap_or(true)
        })
        .collect();
    if !pip.is_empty() {
        if !conda_names.contains("pip") {
            text.push_str("  - pip\n");
        }
        text.push_str("  - pip:\n");
        for index in extra_indexes(&freeze.lines) {
            text.push_str(&format!("    - {index}\n"));
        }
        for line in pip {
            text.push_str(&format!("    - {line}\n"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::super::facts::{EnvFacts, Freeze, PythonFacts};
    use super::*;

    fn probe(kind: &str) -> ProbeFacts {
        ProbeFacts {
            python: PythonFacts {
                executable: "/e/bin/python".into(),
                version: "3.11.7".into(),
                prefix: "/e".into(),
                base_prefix: "/usr".into(),
            },
            env: EnvFacts {
                kind: kind.into(),
                name: Some("e".into()),
                prefix: "/e".into(),
            },
            freeze: Some(Freeze {
                tool: "pip freeze".into(),
                lines: vec!["six==1.17.0".into(), "torch==2.11.0+cu130".into()],
            }),
            ..Default::default()
        }
    }

    #[test]
    fn requirements_pin_and_point_at_pytorchs_index() {
        let text = render(Format::Requirements, &probe("venv")).unwrap();
        assert!(text.contains("\n--extra-index-url https://download.pytorch.org/whl/cu130\n"));
        assert!(
            text.ends_with("six==1.17.0\ntorch==2.11.0+cu130\n"),
            "{text}"
        );
    }

    #[test]
    fn no_package_list_is_said_so() {
        let mut p = probe("venv");
        p.freeze = None;
        let err = render(Format::Requirements, &p).expect_err("nothing to pin");
        assert_eq!(
            err.to_string(),
            "the package list could not be read from that Python"
        );
    }

    #[test]
    fn conda_yaml_splits_conda_and_pip_packages() {
        let mut p = probe("conda");
        p.conda_packages = Some(vec![
            CondaPackage {
                name: "python".into(),
                version: Some("3.11.7".into()),
                build: None,
                channel: Some("https://conda.anaconda.org/conda-forge/linux-64".into()),
            },
            CondaPackage {
                name: "six".into(),
                version: Some("1.17.0".into()),
                build: None,
                channel: Some("conda-forge".into()),
            },
        ]);
        let text = render(Format::CondaYaml, &p).unwrap();
        assert!(
            text.contains("channels:\n  - conda-forge\ndependencies:\n"),
            "{text}"
        );
        assert_eq!(
            channel_name("https://repo.anaconda.com/pkgs/main/linux-64").as_deref(),
            Some("defaults")
        );
        assert!(text.contains("  - six=1.17.0\n"));
        assert!(text.contains("  - pip:\n    - --extra-index-url https://download.pytorch.org/whl/cu130\n    - torch==2.11.0+cu130\n"), "{text}");
        assert!(!text.contains("    - six"));
        assert_eq!(
            Format::for_file(Path::new("x.yml"), "venv"),
            Format::CondaYaml
        );
        assert_eq!(Format::for_file(Path::new("x"), "conda"), Format::CondaYaml);
        assert_eq!(
            Format::for_file(Path::new("r.txt"), "conda"),
            Format::Requirements
        );
    }
}
