//! A loopback TCP proxy in front of one etcd member that can go *silent*:
//! connections stay open and new ones are accepted, but nothing is
//! forwarded either way, as when packets to a member are lost on a dead
//! link (not refused, as when the process is gone). What was sent while
//! silent is held, not dropped, and delivered when the proxy speaks again,
//! as TCP's retransmissions would deliver it after the link came back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How often a silent direction looks whether it may forward again.
const SILENT_POLL: Duration = Duration::from_millis(5);

/// A proxy listening on a free loopback port; dropping it closes the
/// listener and every connection.
pub struct SilentProxy {
    addr: SocketAddr,
    silent: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl SilentProxy {
    /// Proxies a free loopback port to `target` (an etcd client URL such as
    /// `http://127.0.0.1:2379`, or `host:port`).
    pub async fn start(target: &str) -> Self {
        let target = target
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let silent = Arc::new(AtomicBool::new(false));
        let flag = silent.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                conns.spawn(forward(client, target.clone(), flag.clone()));
            }
        });
        Self { addr, silent, task }
    }

    /// The URL to give a router instead of the member's.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops (true) or resumes (false) forwarding, on every connection.
    pub fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::SeqCst);
    }
}

impl Drop for SilentProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(client: TcpStream, target: String, silent: Arc<AtomicBool>) {
    wait_while(&silent).await;
    let Ok(server) = TcpStream::connect(&target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Both directions in this task, so dropping the proxy ends them all.
    tokio::select! {
        _ = copy(cr, sw, silent.clone()) => {}
        _ = copy(sr, cw, silent) => {}
    }
}

async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    silent: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        wait_while(&silent).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

async fn wait_while(silent: &AtomicBool) {
    while silent.load(Ordering::SeqCst) {
        tokio::time::sleep(SILENT_POLL).await;
    }
}
