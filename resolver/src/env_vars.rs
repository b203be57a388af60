//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.

hvd_env_vars::env_vars! {
    /// Overall deadline of one index request, retries included, in seconds; also a download's time for its answer's
    /// head and its grace period.
    HVD_HTTP_TIMEOUT default "300";
    /// Lowest average speed of a download after its grace period, in bytes per second.
    HVD_DOWNLOAD_MIN_RATE default "32768";
    /// The cache of index pages and metadata.
    HVD_CACHE_DIR default "<user cache dir>/hvd";
    /// The Debian archive (base URL, the folder holding `dists/` and `pool/`) a gcc the host lacks is pinned from;
    /// default: the `deb` sources with component `main` of the machine's apt configuration.
    HVD_DEBIAN_ARCHIVE;
    /// Comma-separated Debian suites searched for `gcc-N`, in order; default: the machine's apt suite, then the
    /// older Debian releases, then the newer ones.
    HVD_DEBIAN_SUITES;
    /// The keyring (`.gpg`) the `InRelease` of `HVD_DEBIAN_ARCHIVE` must be signed by when gpgv is on PATH;
    /// default: /usr/share/keyrings/debian-archive-keyring.gpg.
    HVD_DEBIAN_KEYRING;
    /// The index to lock against, before pip's configuration files (pip's own variable).
    PIP_INDEX_URL;
    /// A pip configuration file read after the global, user and site ones (`os.devnull`: none).
    PIP_CONFIG_FILE;
    /// The active virtualenv: its `pip.conf` is pip's site configuration.
    VIRTUAL_ENV;
    /// Extra CA certificates (PEM) for the index, before pip.conf's `cert`.
    PIP_CERT;
    /// Extra CA certificates, after `PIP_CERT` and pip.conf's `cert`.
    SSL_CERT_FILE;
    /// Extra CA certificates, after `SSL_CERT_FILE`.
    REQUESTS_CA_BUNDLE;
    /// Searched for `python3`, asked for pip's built-in default index when nothing else names one.
    PATH;
}
