//! The worker environment contract (docs/running.md): the variables every worker gets, and the worker layout they
//! describe. This module builds the variables every worker gets ([`worker_env`], [`rank_env`]); the few that only
//! some engines set are named next to their use: `HVD_RUN_STEP` ([`STEP_MARKER_VAR`]), the shim's
//! inputs (`engines/shim.rs`: `HVD_GPUS_PER_WORKER`, `HVD_RENDEZVOUS_SERVE`, `HVD_RENDEZVOUS_WAIT`,
//! `HVD_POD_IP`) and the spark engine's `HVD_SPARK_*`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

/// Set for every worker (`<run id>/<step>`); finds the processes a step started after they left its process groups.
pub const STEP_MARKER_VAR: &str = crate::env_vars::HVD_RUN_STEP;

/// Where one rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub rank: u32,
    pub size: u32,
    pub host: String,
    pub local_rank: u32,
    pub local_size: u32,
    pub cross_rank: u32,
    pub cross_size: u32,
}

/// All ranks of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLayout {
    pub slots: Vec<Slot>,
}

impl WorkerLayout {
    /// `n` ranks on one host.
    pub fn local(host: &str, n: u32) -> Self {
        let slots = (0..n)
            .map(|rank| Slot {
                rank,
                size: n,
                host: host.to_owned(),
                local_rank: rank,
                local_size: n,
                cross_rank: 0,
                cross_size: 1,
            })
            .collect();
        WorkerLayout { slots }
    }

    /// `n` ranks over `hosts` (`(host, slots)`), filling each host's slots in order (round-robin over the hosts
    /// again when there are more ranks than slots).
    pub fn spread(hosts: &[(String, u32)], n: u32) -> Self {
        let mut owners: Vec<usize> = Vec::new();
        while (owners.len() as u32) < n && !hosts.is_empty() {
            for (i, (_, slots)) in hosts.iter().enumerate() {
                for _ in 0..(*slots).max(1) {
                    if (owners.len() as u32) < n {
                        owners.push(i);
                    }
                }
            }
        }
        let used: Vec<usize> = {
            let mut u = owners.clone();
            u.dedup();
            u.sort_unstable();
            u.dedup();
            u
        };
        let slots = owners
            .iter()
            .enumerate()
            .map(|(rank, &h)| {
                let local_rank = owners[..rank].iter().filter(|&&o| o == h).count() as u32;
                let local_size = owners.iter().filter(|&&o| o == h).count() as u32;
                Slot {
                    rank: rank as u32,
                    size: n,
                    host: hosts[h].0.clone(),
                    local_rank,
                    local_size,
                    cross_rank: used.iter().position(|&u| u == h).unwrap_or(0) as u32,
                    cross_size: used.len() as u32,
                }
            })
            .collect();
        WorkerLayout { slots }
    }

    /// Hosts and how many ranks each has, in rank order of first appearance.
    pub fn hosts(&self) -> Vec<(String, u32)> {
        let mut hosts: Vec<(String, u32)> = Vec::new();
        for slot in &self.slots {
            match hosts.iter_mut().find(|(h, _)| *h == slot.host) {
                Some((_, n)) => *n += 1,
                None => hosts.push((slot.host.clone(), 1)),
            }
        }
        hosts
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`), `localhost` if unreadable.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or_else(|| "localhost".to_owned())
}

/// `CUDA_VISIBLE_DEVICES` for a worker: `gpus` consecutive devices starting at `local_rank * gpus`.
pub fn visible_devices(gpus: u32, local_rank: u32) -> Option<String> {
    if gpus == 0 {
        return None;
    }
    let first = local_rank * gpus;
    Some(
        (first..first + gpus)
            .map(|g| g.to_string())
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// The rendezvous a distributed worker is pointed at.
#[derive(Debug, Clone)]
pub struct RendezvousInfo {
    pub addr: SocketAddr,
    pub token: String,
}

/// Variables for one worker, to be applied on top of the inherited environment (later entries win; the contract
/// variables come last so a step cannot break them by accident).
pub fn worker_env(
    step_env: &BTreeMap<String, String>,
    slot: &Slot,
    rendezvous: Option<&RendezvousInfo>,
    gpus_per_worker: u32,
    env_dir: Option<&Path>,
) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = Vec::new();
    let inherited = |name: &str| std::env::var_os(name).is_some() || step_env.contains_key(name);
    vars.push(("PYTHONUNBUFFERED".into(), "1".into()));
    if !inherited("OMP_NUM_THREADS") {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        vars.push((
            "OMP_NUM_THREADS".into(),
            (cpus / slot.local_size.max(1)).max(1).to_string(),
        ));
    }
    if let Some(dir) = env_dir {
        let path = std::env::var("PATH").unwrap_or_default();
        let bin = dir.join("bin");
        vars.push((
            "PATH".into(),
            if path.is_empty() {
                bin.display().to_string()
            } else {
                format!("{}:{path}", bin.display())
            },
        ));
        vars.push(("VIRTUAL_ENV".into(), dir.display().to_string()));
    }
    vars.extend(step_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    if let Some(devices) = visible_devices(gpus_per_worker, slot.local_rank) {
        vars.push(("CUDA_VISIBLE_DEVICES".into(), devices));
    }
    let Some(rdv) = rendezvous else {
        return vars;
    };
    let ip = rdv.addr.ip().to_string();
    let port = rdv.addr.port().to_string();
    vars.extend(rank_env(slot));
    vars.extend([
        ("HVD_RENDEZVOUS".into(), rdv.addr.to_string()),
        ("HVD_JOB_TOKEN".into(), rdv.token.clone()),
        // Horovod's gloo controller (what horovodrun's gloo mode sets), so a real Horovod build runs unchanged.
        ("HOROVOD_GLOO_RENDEZVOUS_ADDR".into(), ip.clone()),
        ("HOROVOD_GLOO_RENDEZVOUS_PORT".into(), port),
        ("HOROVOD_CONTROLLER".into(), "gloo".into()),
        ("HOROVOD_CPU_OPERATIONS".into(), "gloo".into()),
        // torch.distributed's env:// init. MASTER_PORT must differ from the rendezvous port: rank 0 listens there.
        ("MASTER_ADDR".into(), ip),
    ]);
    // A rendezvous on loopback has every rank on this machine. Any other is reached over a network the ranks may
    // share with other hosts: `lo` would keep them apart, so the interface is left to the libraries (hvd's own
    // collective takes the address that routes to the rendezvous) or to the engine (ssh: its wrapper's route).
    if rdv.addr.ip().is_loopback() {
        vars.extend([
            ("HOROVOD_GLOO_IFACE".into(), "lo".into()),
            ("NCCL_SOCKET_IFNAME".into(), "lo".into()),
        ]);
    }
    vars
}

/// The rank variables of a worker: `HVD_*`, Horovod's `HOROVOD_*` and torch's `RANK WORLD_SIZE LOCAL_RANK
/// LOCAL_WORLD_SIZE` (the rendezvous-independent part of [`worker_env`]; the shim sets these alone when there is no
/// rendezvous).
pub fn rank_env(slot: &Slot) -> Vec<(String, String)> {
    let num = |n: u32| n.to_string();
    vec![
        ("HVD_RANK".into(), num(slot.rank)),
        ("HVD_SIZE".into(), num(slot.size)),
        ("HVD_LOCAL_RANK".into(), num(slot.local_rank)),
        ("HVD_LOCAL_SIZE".into(), num(slot.local_size)),
        ("HVD_CROSS_RANK".into(), num(slot.cross_rank)),
        ("HVD_CROSS_SIZE".into(), num(slot.cross_size)),
        ("HVD_HOSTNAME".into(), slot.host.clone()),
        ("HOROVOD_RANK".into(), num(slot.rank)),
        ("HOROVOD_SIZE".into(), num(slot.size)),
        ("HOROVOD_LOCAL_RANK".into(), num(slot.local_rank)),
        ("HOROVOD_LOCAL_SIZE".into(), num(slot.local_size)),
        ("HOROVOD_CROSS_RANK".into(), num(slot.cross_rank)),
        ("HOROVOD_CROSS_SIZE".into(), num(slot.cross_size)),
        ("HOROVOD_HOSTNAME".into(), slot.host.clone()),
        ("RANK".into(), num(slot.rank)),
        ("WORLD_SIZE".into(), num(slot.size)),
        ("LOCAL_RANK".into(), num(slot.local_rank)),
        ("LOCAL_WORLD_SIZE".into(), num(slot.local_size)),
    ]
}

/// torch's `MASTER_PORT`: a port free on this machine, drawn below the kernel's ephemeral port range.
///
/// Rank 0 binds it on its own host, which for the ssh and slurm engines is not this one. A port from the ephemeral
/// range (what binding port 0 gives) may be held there by any outgoing connection, srun's and slurmstepd's among
/// them, and rank 0 then fails with "address already in use"; below that range only a listening server can hold it.
/// There is still a window in which another process could take it, the same as with torchrun's own choice.
pub fn master_port() -> u16 {
    let (low, high) = master_port_range(ephemeral_start());
    for _ in 0..64 {
        let port = low + (crate::discovery::os_random() % u64::from(high - low)) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    29500
}

/// The ports [`master_port`] draws from: 20000 up to the ephemeral range's start (32768 by default on Linux), or
/// 20000-29999 when that start is unknown or too low to leave a thousand.
fn master_port_range(ephemeral_start: Option<u16>) -> (u16, u16) {
    const LOW: u16 = 20000;
    match ephemeral_start {
        Some(start) if start >= LOW + 1000 => (LOW, start),
        _ => (LOW, 30000),
    }
}

/// The first port of this machine's ephemeral range (`net.ipv4.ip_local_port_range`), when it can be read.
fn ephemeral_start() -> Option<u16> {
    fs_err::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_ports_are_drawn_below_the_ephemeral_range_and_free_here() {
        assert_eq!(master_port_range(Some(32768)), (20000, 32768));
        assert_eq!(master_port_range(Some(40000)), (20000, 40000));
        assert_eq!(master_port_range(Some(1024)), (20000, 30000));
        assert_eq!(master_port_range(None), (20000, 30000));
        let (low, high) = master_port_range(ephemeral_start());
        let ports: std::collections::BTreeSet<u16> = (0..20).map(|_| master_port()).collect();
        for &port in &ports {
            assert!((low..high).contains(&port), "{port} not in {low}..{high}");
            // Free here: it can be listened on.
            std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
        }
        // Drawn, not fixed: 20 draws from thousands of ports are not all one.
        assert!(ports.len() > 1, "{ports:?}");
    }

    #[test]
    fn gpus_are_split_by_local_rank() {
        assert_eq!(visible_devices(0, 3), None);
        assert_eq!(visible_devices(1, 3).as_deref(), Some("3"));
        assert_eq!(visible_devices(4, 1).as_deref(), Some("4,5,6,7"));
    }

    #[test]
    fn contract_variables_win_over_step_variables() {
        let layout = WorkerLayout::local("h", 2);
        assert_eq!(layout.hosts(), [("h".to_string(), 2)]);
        let step_env = BTreeMap::from([
            ("HVD_RANK".to_string(), "99".to_string()),
            ("X".to_string(), "1".to_string()),
        ]);
        let rdv = RendezvousInfo {
            addr: "127.0.0.1:5000".parse().unwrap(),
            token: "t".into(),
        };
        let vars = worker_env(&step_env, &layout.slots[1], Some(&rdv), 0, None);
        let last = |name: &str| {
            vars.iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(last("HVD_RANK"), Some("1"));
        assert_eq!(last("X"), Some("1"));
        assert_eq!(last("HOROVOD_GLOO_RENDEZVOUS_PORT"), Some("5000"));
        assert_eq!(last("CUDA_VISIBLE_DEVICES"), None);
        assert_eq!(last("NCCL_SOCKET_IFNAME"), Some("lo"));
        // A rendezvous other hosts reach: no `lo` for the libraries.
        let remote = RendezvousInfo {
            addr: "10.0.0.1:5000".parse().unwrap(),
            token: "t".into(),
        };
        let vars = worker_env(&step_env, &layout.slots[1], Some(&remote), 0, None);
        for name in ["NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"] {
            assert!(vars.iter().all(|(k, _)| k != name), "{name}: {vars:?}");
        }
        let once = worker_env(&step_env, &layout.slots[0], None, 1, None);
        assert!(once.iter().all(|(k, _)| k != "HVD_RENDEZVOUS"));
        assert!(
            once.iter()
                .any(|(k, v)| k == "CUDA_VISIBLE_DEVICES" && v == "0")
        );
    }
}
