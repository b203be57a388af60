//! Hosts as network namespaces for the ssh engine's tests (tests/engine_ssh*.rs): two hosts (10.77.0.2 and
//! 10.77.0.3, each running its own sshd on port 2222 with a key made here) and the launcher's machine (10.77.0.1, a
//! bridge to both), removed with everything running in them when the test ends.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{HVD, text};

pub const HOSTS: [&str; 2] = ["10.77.0.2", "10.77.0.3"];
pub const LAUNCHER_ADDR: &str = "10.77.0.1";
pub const SSH_PORT: &str = "2222";

/// `unshare` of a private mount namespace running `/bin/sh -c` (the script and its arguments follow), so that what
/// the script mounts stays inside the command it then execs.
pub const PRIVATE_MOUNTS_SH: [&str; 6] = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "/bin/sh",
    "-c",
];

unsafe extern "C" {
    #[link_name = "geteuid"]
    pub fn libc_geteuid() -> u32;
}

/// Panics, saying what is missing, unless this is root with iproute2 and OpenSSH.
pub fn require_tools() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc_geteuid() } == 0;
    let missing: Vec<&str> = ["ip", "sshd", "ssh", "ssh-keygen", "setsid"]
        .into_iter()
        .filter(|p| find_program(p).is_none())
        .collect();
    assert!(
        root && missing.is_empty(),
        "the ssh engine tests need root (network namespaces) and iproute2 + OpenSSH; root: {root}, missing: {missing:?} \
         (run scripts/install-deps as root)"
    );
}

pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `name` as found by [`find_program`] (`ip` and `sshd` live in sbin directories that a CI PATH may lack).
pub fn tool(name: &str) -> PathBuf {
    find_program(name).unwrap_or_else(|| name.into())
}

pub fn run_ok(program: &str, args: &[&str]) {
    let out = Command::new(tool(program)).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "`{program} {}` failed: {}",
        args.join(" "),
        text(&out).1
    );
}

/// Two hosts and a launcher machine, as network namespaces, with an sshd per host. Dropping it kills everything
/// that runs in its namespaces and deletes them.
pub struct Hosts {
    pub dir: tempfile::TempDir,
    /// The launcher's namespace, then one per host.
    pub namespaces: Vec<String>,
    pub sshds: Vec<(Child, u32)>,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for (child, _) in &mut self.sshds {
            let _ = child.kill();
            let _ = child.wait();
        }
        remove_namespaces(&self.namespaces);
    }
}

/// Kills whatever still runs in `namespaces` (a failed test's leftovers, by pid) and deletes them.
pub fn remove_namespaces(namespaces: &[String]) {
    for ns in namespaces {
        signal_all(&netns_pids(ns), 9);
        let _ = Command::new(tool("ip")).args(["netns", "del", ns]).output();
    }
}

/// Adds the namespaces `PREFIX-l` (the launcher's machine, [`LAUNCHER_ADDR`] on a bridge), `PREFIX-h1` and
/// `PREFIX-h2` (the hosts, [`HOSTS`], each a veth pair to the bridge) to `namespaces` as it creates them, so that
/// their owner removes what exists if a later one fails.
pub fn add_namespaces(prefix: &str, namespaces: &mut Vec<String>) {
    let launcher = format!("{prefix}-l");
    for ns in [
        launcher.clone(),
        format!("{prefix}-h1"),
        format!("{prefix}-h2"),
    ] {
        // A namespace left by a killed earlier run of this process id would make `add` fail.
        let _ = Command::new(tool("ip"))
            .args(["netns", "del", &ns])
            .output();
        run_ok("ip", &["netns", "add", &ns]);
        namespaces.push(ns.clone());
        run_ok("ip", &["-n", &ns, "link", "set", "lo", "up"]);
    }
    run_ok(
        "ip",
        &["-n", &launcher, "link", "add", "hvd0", "type", "bridge"],
    );
    run_ok(
        "ip",
        &[
            "-n",
            &launcher,
            "addr",
            "add",
            &format!("{LAUNCHER_ADDR}/24"),
            "dev",
            "hvd0",
        ],
    );
    run_ok("ip", &["-n", &launcher, "link", "set", "hvd0", "up"]);
    for (i, addr) in HOSTS.iter().enumerate() {
        let ns = namespaces[i + 1].clone();
        let port = format!("v{}", i + 1);
        run_ok(
            "ip",
            &[
                "link", "add", &port, "netns", &launcher, "type", "veth", "peer", "name", "hvd0",
                "netns", &ns,
            ],
        );
        run_ok(
            "ip",
            &[
                "-n", &launcher, "link", "set", &port, "master", "hvd0", "up",
            ],
        );
        run_ok(
            "ip",
            &[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "hvd0",
            ],
        );
        run_ok("ip", &["-n", &ns, "link", "set", "hvd0", "up"]);
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    pub fn libc_kill(pid: i32, signal: i32) -> i32;
}

pub fn netns_pids(ns: &str) -> Vec<u32> {
    Command::new(tool("ip"))
        .args(["netns", "pids", ns])
        .output()
        .map(|o| {
            text(&o)
                .0
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The processes of ranks in namespace `ns`: those with `HVD_RANK` in their environment (`Some(slot)`: that slot's
/// only).
pub fn rank_pids(ns: &str, slot: Option<u32>) -> Vec<u32> {
    let wanted = slot.map(|slot| format!("HVD_RANK={slot}"));
    netns_pids(ns)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|b| *b == 0).any(|v| match &wanted {
                    Some(w) => v == w.as_bytes(),
                    None => v.starts_with(b"HVD_RANK="),
                })
            })
        })
        .collect()
}

/// Sends `signal` to each of `pids`.
pub fn signal_all(pids: &[u32], signal: i32) {
    for pid in pids {
        // SAFETY: kill with integer arguments; these processes run in this test's namespaces.
        unsafe { libc_kill(*pid as i32, signal) };
    }
}

pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

impl Hosts {
    /// Sets up the namespaces `hvd<tag><pid>-{l,h1,h2}` and starts the sshds.
    pub fn start(tag: &str) -> Hosts {
        Self::start_with(tag, None)
    }

    /// As [`Hosts::start`]; with `compromised`, the second host's sshd runs that command for every login instead of
    /// the one asked for (`ForceCommand`; the asked one is in `SSH_ORIGINAL_COMMAND`): a host that answers as it likes.
    pub fn start_with(tag: &str, compromised: Option<&str>) -> Hosts {
        Self::start_inner(tag, compromised, None, "")
    }

    /// As [`Hosts::start`], but each host's sshd closes a command's session once no data went either way for
    /// `seconds` (`ChannelTimeout session:command=`), as a kubelet closes an idle `kubectl exec` stream and a load
    /// balancer or a NAT table an idle connection.
    pub fn start_idle_timeout(tag: &str, seconds: u32) -> Hosts {
        let config = format!("ChannelTimeout session:command={seconds}\n");
        Self::start_inner(tag, None, None, &config)
    }

    /// As [`Hosts::start`], but each host's sshd (and so every login there) runs in a mount namespace of its own with
    /// an empty tmpfs over `private`: what the launcher keeps under it (the store, the project) is not on the hosts,
    /// and what a host writes there (its own store, its cache home `XDG_CACHE_HOME=private/home-cache`) is its own.
    pub fn start_private(tag: &str, private: &Path) -> Hosts {
        Self::start_inner(tag, None, Some(private), "")
    }

    /// `sshd_config`: lines added to each host's sshd configuration.
    fn start_inner(
        tag: &str,
        compromised: Option<&str>,
        private: Option<&Path>,
        sshd_config: &str,
    ) -> Hosts {
        require_tools();
        let prefix = format!("hvd{tag}{}", std::process::id());
        let mut hosts = Hosts {
            dir: tempfile::tempdir().unwrap(),
            namespaces: Vec::new(),
            sshds: Vec::new(),
        };
        add_namespaces(&prefix, &mut hosts.namespaces);
        let d = hosts.dir.path().to_path_buf();
        for key in ["hostkey", "id"] {
            let file = d.join(key);
            let file = file.to_str().unwrap();
            run_ok("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-f", file]);
        }
        std::fs::copy(d.join("id.pub"), d.join("authorized_keys")).unwrap();
        std::fs::write(
            d.join("ssh_config"),
            "Host h1\n  HostName 10.77.0.2\nHost h2\n  HostName 10.77.0.3\nHost *\n  User root\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  \
             IdentitiesOnly yes\n",
        )
        .unwrap();
        // sshd's privilege separation directory.
        std::fs::create_dir_all("/run/sshd").unwrap();
        let sshd = find_program("sshd").unwrap();
        for (i, addr) in HOSTS.iter().enumerate() {
            let conf = d.join(format!("sshd_config.{i}"));
            let mut config = format!(
                "Port {SSH_PORT}\nListenAddress {addr}\nHostKey {d}/hostkey\nAuthorizedKeysFile {d}/authorized_keys\n\
                 StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nPidFile none\nPrintMotd no\nMaxStartups 100\nLogLevel INFO\n",
                d = d.display()
            );
            config.push_str(sshd_config);
            if let (1, Some(command)) = (i, compromised) {
                config.push_str(&format!("ForceCommand {command}\n"));
            }
            if let Some(private) = private {
                config.push_str(&format!(
                    "SetEnv XDG_CACHE_HOME={}/home-cache\n",
                    private.display()
                ));
            }
            std::fs::write(&conf, config).unwrap();
            let log = d.join(format!("sshd.{i}.log"));
            let mut command = Command::new(tool("ip"));
            command.args(["netns", "exec", &hosts.namespaces[i + 1]]);
            if let Some(private) = private {
                // unshare and sh exec, so the listener keeps the pid of the child started here.
                command
                    .args(PRIVATE_MOUNTS_SH)
                    .arg("mount -t tmpfs hvd-host \"$0\" && exec \"$@\"")
                    .arg(private);
            }
            let child = command
                .arg(&sshd)
                .args(["-D", "-e", "-f"])
                .arg(&conf)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            let pid = child.id();
            hosts.sshds.push((child, pid));
            let deadline = Instant::now() + Duration::from_secs(15);
            while !std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("Server listening")
            {
                assert!(
                    Instant::now() < deadline,
                    "sshd in {} did not start: {}",
                    hosts.namespaces[i + 1],
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        hosts
    }

    /// `hvd run FILE --engine ssh --hosts 10.77.0.2:2,10.77.0.3:2 --ssh-port ... ARGS` in the launcher's namespace,
    /// with this test's ssh config and key (`--hosts` left out when `args` has `--hostfile`).
    pub fn hvd_command(&self, project: &Path, args: &[&str]) -> Command {
        let d = self.dir.path();
        let hosts = format!("{}:2,{}:2", HOSTS[0], HOSTS[1]);
        let hosts: &[&str] = if args.contains(&"--hostfile") {
            &[]
        } else {
            &["--hosts", &hosts]
        };
        let mut command = Command::new(tool("ip"));
        command
            .args(["netns", "exec", &self.namespaces[0], HVD, "run"])
            .arg(project.join("train.hvd"))
            .args(["--engine", "ssh", "--ssh-port", SSH_PORT])
            .args(hosts)
            .arg("--ssh-config")
            .arg(d.join("ssh_config"))
            .arg("--ssh-identity")
            .arg(d.join("id"))
            .args(args)
            .env("NO_COLOR", "1");
        command
    }

    /// [`Hosts::hvd_command`] with `--no-build --grace 2` and `extra`, run to its end.
    pub fn hvd_run(&self, project: &Path, extra: &[&str]) -> Output {
        let mut args = vec!["--no-build", "--grace", "2"];
        args.extend(extra);
        self.hvd_command(project, &args).output().unwrap()
    }

    /// Host `i` (0 or 1) is lost: everything running in its namespace, its sshd and every session and rank there,
    /// is killed at once (SIGKILL), and the leftovers check no longer expects its sshd.
    pub fn lose(&mut self, i: usize) {
        signal_all(&netns_pids(&self.namespaces[i + 1]), 9);
        let (child, _) = &mut self.sshds[i];
        let _ = child.wait();
    }

    /// Processes in the hosts' namespaces besides their sshd listeners.
    pub fn leftovers(&self) -> Vec<String> {
        let sshds: Vec<u32> = self.sshds.iter().map(|(_, pid)| *pid).collect();
        let mut left = Vec::new();
        for ns in &self.namespaces[1..] {
            for pid in netns_pids(ns) {
                // `ip netns exec` execs sshd, so the listener has the pid of the child started here.
                if !sshds.contains(&pid) {
                    left.push(format!("{ns}: {pid} {}", cmdline(pid)));
                }
            }
        }
        left
    }

    /// Waits (bounded) until nothing but the sshd listeners runs on the hosts; returns what is still there.
    pub fn wait_clean(&self) -> Vec<String> {
        super::wait_until_empty(Duration::from_secs(10), Duration::from_millis(50), || {
            self.leftovers()
        })
    }
}
