//! pip's configuration as hvd reads it: its files in pip's order, the `index-url` and `cert` keys, and the CA
//! bundle pip would use.

use std::path::{Path, PathBuf};

/// pip's configuration files in pip's order (later wins): global, user, site, then `PIP_CONFIG_FILE`.
fn pip_config_files() -> Vec<PathBuf> {
    let mut files = vec![
        PathBuf::from("/etc/xdg/pip/pip.conf"),
        PathBuf::from("/etc/pip.conf"),
    ];
    if let Some(home) = dirs::home_dir() {
        files.push(home.join(".pip/pip.conf"));
    }
    if let Some(config) = dirs::config_dir() {
        files.push(config.join("pip/pip.conf"));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        files.push(Path::new(&venv).join("pip.conf"));
    }
    if let Some(file) =
        std::env::var_os("PIP_CONFIG_FILE").filter(|f| !f.is_empty() && f != "os.devnull")
    {
        files.push(PathBuf::from(file));
    }
    files
}

/// The `index-url` of pip's configuration files (the last file that sets it wins).
pub(crate) fn index_url() -> Option<String> {
    let mut found = None;
    for file in pip_config_files() {
        if let Ok(text) = fs_err::read_to_string(&file)
            && let Some(url) = ini_value(&text, "index-url")
        {
            found = Some(url);
        }
    }
    found
}

/// Extra CA certificates the way pip finds them: PIP_CERT, pip.conf `cert`, then SSL_CERT_FILE and
/// REQUESTS_CA_BUNDLE. Needed behind TLS-inspecting proxies, whose CA is not among the built-in roots.
pub fn discover_ca_bundle() -> Option<PathBuf> {
    let from_env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut found = from_env("PIP_CERT");
    if found.is_none() {
        for file in pip_config_files() {
            if let Ok(text) = fs_err::read_to_string(&file)
                && let Some(cert) = ini_value(&text, "cert")
            {
                found = Some(PathBuf::from(cert));
            }
        }
    }
    found
        .or_else(|| from_env("SSL_CERT_FILE"))
        .or_else(|| from_env("REQUESTS_CA_BUNDLE"))
        .filter(|p| p.is_file())
}

/// A key of the `[global]` or `[install]` section of a pip.conf (`[install]` wins; `_` and `-` alike).
fn ini_value(text: &str, wanted: &str) -> Option<String> {
    let mut section = String::new();
    let mut global = None;
    let mut install = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with(['#', ';']) || line.is_empty() {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.trim().to_ascii_lowercase();
            continue;
        }
        let Some((key, value)) = line.split_once(['=', ':']) else {
            continue;
        };
        let key = key.trim().to_ascii_lowercase().replace('_', "-");
        if key == wanted {
            let value = Some(value.trim().to_string());
            match section.as_str() {
                "global" => global = value,
                "install" => install = value,
                _ => {}
            }
        }
    }
    install.or(global)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pip_conf() {
        let text = "[global]\nindex-url = http://127.0.0.1:1/a/simple\n[install]\nindex_url=http://127.0.0.1:1/b/simple\n";
        assert_eq!(
            ini_value(text, "index-url").as_deref(),
            Some("http://127.0.0.1:1/b/simple")
        );
        assert_eq!(ini_value("[global]\ntimeout = 3\n", "index-url"), None);
    }
}
