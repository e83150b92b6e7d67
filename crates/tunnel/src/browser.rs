//! Opening the notebook in a browser without the token in any argv: the
//! browser is given a private HTML file (0600; on Windows an owner-only ACL)
//! that redirects to the URL, as Jupyter itself does.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::platform;

/// The redirect file; removed on drop.
pub struct RedirectFile(PathBuf);

impl RedirectFile {
    pub fn create(dir: &Path, name: &str, url: &str) -> std::io::Result<Self> {
        let path = dir.join(format!("{name}-open.html"));
        let _ = std::fs::remove_file(&path);
        let mut f = platform::create_private_file(&path)?;
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

/// Ask the desktop to open `file` (`xdg-open`, `open`, or the Windows
/// shell); failure is not fatal (the URL is printed).
pub fn open(file: &Path) {
    platform::open_browser(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_file_is_private_escaped_and_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path;
        {
            let f = RedirectFile::create(dir.path(), "h", "http://127.0.0.1:1/lab?token=t&x=\"")
                .expect("create");
            path = f.path().to_path_buf();
            platform::assert_private(&path);
            let text = std::fs::read_to_string(&path).expect("read");
            assert!(text.contains("url=http://127.0.0.1:1/lab?token=t&amp;x=&quot;"));
        }
        assert!(!path.exists());
    }
}
