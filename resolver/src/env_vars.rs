//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.

/// Overall deadline of one index request, retries included, in seconds; also a download's time for its answer's
/// head and its grace period (default 300).
pub const HVD_HTTP_TIMEOUT: &str = "HVD_HTTP_TIMEOUT";
/// Lowest average speed of a download after its grace period, in bytes per second (default 32768).
pub const HVD_DOWNLOAD_MIN_RATE: &str = "HVD_DOWNLOAD_MIN_RATE";
/// The cache of index pages and metadata (default `<user cache dir>/hvd`).
pub const HVD_CACHE_DIR: &str = "HVD_CACHE_DIR";
/// The index to lock against, before pip's configuration files (pip's own variable).
pub const PIP_INDEX_URL: &str = "PIP_INDEX_URL";
/// A pip configuration file read after the global, user and site ones (`os.devnull`: none).
pub const PIP_CONFIG_FILE: &str = "PIP_CONFIG_FILE";
/// The active virtualenv: its `pip.conf` is pip's site configuration.
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// Extra CA certificates (PEM) for the index, before pip.conf's `cert`.
pub const PIP_CERT: &str = "PIP_CERT";
/// Extra CA certificates, after `PIP_CERT` and pip.conf's `cert`.
pub const SSL_CERT_FILE: &str = "SSL_CERT_FILE";
/// Extra CA certificates, after `SSL_CERT_FILE`.
pub const REQUESTS_CA_BUNDLE: &str = "REQUESTS_CA_BUNDLE";
/// Searched for `python3`, asked for pip's built-in default index when nothing else names one.
pub const PATH: &str = "PATH";

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
pub const ALL: &[(&str, &str, &str)] = &[
    (
        HVD_HTTP_TIMEOUT,
        "300",
        "overall deadline of one index request (and a download's head and grace period), in seconds",
    ),
    (
        HVD_DOWNLOAD_MIN_RATE,
        "32768",
        "lowest average speed of a download after its grace period, in bytes per second",
    ),
    (
        HVD_CACHE_DIR,
        "<user cache dir>/hvd",
        "the cache of index pages and metadata",
    ),
    (
        PIP_INDEX_URL,
        "",
        "the index to lock against, before pip's configuration files",
    ),
    (
        PIP_CONFIG_FILE,
        "",
        "a pip configuration file read after the global, user and site ones (`os.devnull`: none)",
    ),
    (
        VIRTUAL_ENV,
        "",
        "the active virtualenv, whose `pip.conf` is pip's site configuration",
    ),
    (
        PIP_CERT,
        "",
        "extra CA certificates (PEM) for the index, before pip.conf's `cert`",
    ),
    (
        SSL_CERT_FILE,
        "",
        "extra CA certificates, after `PIP_CERT` and pip.conf's `cert`",
    ),
    (
        REQUESTS_CA_BUNDLE,
        "",
        "extra CA certificates, after `SSL_CERT_FILE`",
    ),
    (
        PATH,
        "",
        "searched for `python3`, asked for pip's default index when nothing else names one",
    ),
];
