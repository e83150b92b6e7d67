//! Opening the notebook in a browser without the token in any argv: the
//! browser is given a 0600 HTML file that redirects to the URL, as Jupyter
//! itself does.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The redirect file; removed on drop.
pub struct RedirectFile(PathBuf);

impl RedirectFile {
    pub fn create(dir: &Path, name: &str, url: &str) -> std::io::Result<Self> {
        let path = dir.join(format!("{name}-open.html"));
        let _ = std::fs::remove_file(&path);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let url = html_escape(url);
        write!(
            f,
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"refresh\" content=\"0;url={url}\">\
             <title>Opening Jupyter</title></head>\n\
             <body><p>Opening Jupyter. If nothing happens, <a href=\"{url}\">click here</a>.</p></body></html>\n"
        )?;
        Ok(RedirectFile(path))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RedirectFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Ask the desktop to open `file`; failure is not fatal (the URL is printed).
pub fn open(file: &Path) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    match tokio::process::Command::new(opener)
        .arg(file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(mut child) => {
            tokio::spawn(async move {
                match child.wait().await {
                    Ok(s) if !s.success() => {
                        tracing::warn!(
                            "{opener} could not open a browser ({s}); open the URL yourself"
                        )
                    }
                    Err(e) => tracing::debug!("{opener}: {e}"),
                    _ => {}
                }
            });
        }
        Err(e) => tracing::warn!("cannot run {opener} ({e}); open the URL yourself"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn redirect_file_is_private_escaped_and_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path;
        {
            let f = RedirectFile::create(dir.path(), "h", "http://127.0.0.1:1/lab?token=t&x=\"")
                .expect("create");
            path = f.path().to_path_buf();
            let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            let text = std::fs::read_to_string(&path).expect("read");
            assert!(text.contains("url=http://127.0.0.1:1/lab?token=t&amp;x=&quot;"));
        }
        assert!(!path.exists());
    }
}
