//! Network namespaces for partition tests. Each etcd member of a
//! [`Network`] runs in a namespace of its own, with two links into a hub
//! namespace: one to the *peer* bridge (raft traffic between members) and
//! one to the *client* bridge, which this process's namespace joins through
//! one more link. Routers (in-process or child processes of the test) stay
//! where they are and reach the members at their client addresses.
//!
//! A cut detaches links from their bridge: packets sent on them are lost,
//! not refused, as on a dead switch port. Cuts are
//! - [`cut_clients`](Network::cut_clients): every router from the shard;
//! - [`cut_peers`](Network::cut_peers): one member from the others' raft
//!   traffic while clients still reach it (a minority leader, if it led);
//! - [`isolate`](Network::isolate): one member from everything;
//!
//! and each has its heal. Addresses are in 10.231.k.0/24 (clients) and
//! 10.232.k.0/24 (peers) for a `k` that no route of this namespace uses;
//! nothing else is ever a target. Dropping the network deletes its
//! namespaces and links; namespaces left by a killed test process are
//! deleted by the next one.
//!
//! Needs root and iproute2's `ip` with network namespace support; without
//! them [`Network::new`] is an [`Error`] saying so.

use std::net::Ipv4Addr;
use std::process::Command;

use crate::Error;

/// Namespaces of this kit are named `lockrouter-<pid>-<k>-<role>`.
const PREFIX: &str = "lockrouter-";
/// Port every member's client URL uses (each member has its own address).
pub const CLIENT_PORT: u16 = 2379;
/// Port every member's peer URL uses.
pub const PEER_PORT: u16 = 2380;

pub struct Network {
    /// `lockrouter-<pid>-<k>`: the stem of every namespace name.
    stem: String,
    /// Third octet of both subnets.
    k: u8,
    /// Member count.
    size: usize,
    /// This namespace's end of the client link.
    root_link: String,
}

impl Network {
    /// The namespaces, bridges and links for `size` members.
    pub fn new(size: usize) -> Result<Self, Error> {
        remove_stale();
        let k = free_subnet()?;
        let stem = format!("{PREFIX}{}-{k}", std::process::id());
        let net = Network {
            root_link: format!("lrc{}r{k}", std::process::id() % 10_000),
            stem,
            k,
            size,
        };
        net.build().inspect_err(|_| net.remove())?;
        Ok(net)
    }

    fn build(&self) -> Result<(), Error> {
        let hub = self.hub();
        ip(&["netns", "add", &hub])?;
        for bridge in ["brc", "brp"] {
            ip(&["-n", &hub, "link", "add", bridge, "type", "bridge"])?;
            ip(&["-n", &hub, "link", "set", bridge, "up"])?;
        }
        for i in 0..self.size {
            let ns = self.member(i);
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            for (kind, bridge, addr) in [
                ("c", "brc", self.client_addr(i)),
                ("p", "brp", self.peer_addr(i)),
            ] {
                let (inner, outer) = (format!("{kind}{i}"), format!("{kind}{i}h"));
                ip(&[
                    "-n", &hub, "link", "add", &outer, "type", "veth", "peer", "name", &inner,
                    "netns", &ns,
                ])?;
                ip(&["-n", &hub, "link", "set", &outer, "master", bridge, "up"])?;
                ip(&[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{addr}/24"),
                    "dev",
                    &inner,
                ])?;
                ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            }
        }
        ip(&[
            "link",
            "add",
            &self.root_link,
            "type",
            "veth",
            "peer",
            "name",
            "root",
            "netns",
            &hub,
        ])?;
        ip(&["-n", &hub, "link", "set", "root", "master", "brc", "up"])?;
        let root_addr = Ipv4Addr::new(10, 231, self.k, 254);
        ip(&[
            "addr",
            "add",
            &format!("{root_addr}/24"),
            "dev",
            &self.root_link,
        ])?;
        ip(&["link", "set", &self.root_link, "up"])?;
        Ok(())
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.stem)
    }

    /// The namespace member `i` runs in.
    pub fn member(&self, i: usize) -> String {
        format!("{}-m{i}", self.stem)
    }

    /// Member `i`'s address on the client bridge.
    pub fn client_addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.k, i as u8 + 1)
    }

    /// Member `i`'s address on the peer bridge.
    pub fn peer_addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 232, self.k, i as u8 + 1)
    }

    /// Cuts every router of this process from every member.
    pub fn cut_clients(&self) {
        self.attach("root", None);
    }

    /// Undoes [`cut_clients`](Self::cut_clients).
    pub fn heal_clients(&self) {
        self.attach("root", Some("brc"));
    }

    /// Cuts member `i` from the other members' raft traffic; clients still
    /// reach it.
    pub fn cut_peers(&self, i: usize) {
        self.attach(&format!("p{i}h"), None);
    }

    /// Undoes [`cut_peers`](Self::cut_peers).
    pub fn heal_peers(&self, i: usize) {
        self.attach(&format!("p{i}h"), Some("brp"));
    }

    /// Undoes [`cut_peers`](Self::cut_peers) and resets member `i`'s raft
    /// connections, as a middlebox that lost their state would: the
    /// members dial each other again at once. Without the reset, their
    /// connections carry traffic again only at TCP's next retransmission,
    /// whose interval doubles while the cut lasts (200 ms, 400, 800, …): a
    /// cut of 1.5 s may keep the members apart for 1.6 s after the heal,
    /// longer than a test that heals to let a write through within one
    /// deadline can wait. Returns how many connections were reset.
    pub fn heal_peers_resetting(&self, i: usize) -> usize {
        self.heal_peers(i);
        let src = self.peer_addr(i).to_string();
        let ns = self.member(i);
        let args = [
            "netns",
            "exec",
            &ns,
            "ss",
            "--kill",
            "--tcp",
            "--no-header",
            "src",
            &src,
        ];
        let out = Command::new("ip")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("ip {}: {e}", args.join(" ")));
        assert!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        String::from_utf8_lossy(&out.stdout).lines().count()
    }

    /// Cuts member `i` from the other members and from every client.
    pub fn isolate(&self, i: usize) {
        self.cut_peers(i);
        self.attach(&format!("c{i}h"), None);
    }

    /// Undoes [`isolate`](Self::isolate).
    pub fn heal(&self, i: usize) {
        self.heal_peers(i);
        self.attach(&format!("c{i}h"), Some("brc"));
    }

    /// Puts the hub's end of a link on `bridge`, or takes it off any.
    fn attach(&self, link: &str, bridge: Option<&str>) {
        let hub = self.hub();
        let args: Vec<&str> = match bridge {
            Some(b) => vec!["-n", &hub, "link", "set", link, "master", b],
            None => vec!["-n", &hub, "link", "set", link, "nomaster"],
        };
        ip(&args).unwrap_or_else(|e| panic!("{e}"));
    }

    fn remove(&self) {
        let _ = ip(&["link", "del", &self.root_link]);
        for i in 0..self.size {
            let _ = ip(&["netns", "del", &self.member(i)]);
        }
        let _ = ip(&["netns", "del", &self.hub()]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Runs `ip args`; its stderr is the error.
fn ip(args: &[&str]) -> Result<(), Error> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| Error::Network {
            command: format!("ip {}", args.join(" ")),
            why: format!("{e} (network namespace tests need iproute2's `ip`, run `make prereqs`)"),
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Network {
        command: format!("ip {}", args.join(" ")),
        why: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// A third octet whose subnets no route of this namespace covers, picked
/// from the process id so that concurrent test processes differ.
fn free_subnet() -> Result<u8, Error> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let routes = Command::new("ip")
        .args(["-4", "route", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    for _ in 0..250 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let k = ((std::process::id() + n) % 250) as u8;
        let taken = [231, 232]
            .iter()
            .any(|b| routes.contains(&format!("10.{b}.{k}.")));
        if !taken {
            return Ok(k);
        }
    }
    Err(Error::Network {
        command: "ip -4 route show".into(),
        why: "every 10.231.k.0/24 subnet is in use".into(),
    })
}

/// Deletes namespaces of this kit whose process is gone (a test killed
/// before its networks were dropped), with their links.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            let _ = ip(&["netns", "del", name]);
        }
    }
}
