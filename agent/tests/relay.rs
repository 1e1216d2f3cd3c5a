//! The proxy relay, in-process on loopback, against an "upstream" the test controls: it
//! records what it receives, answers every CONNECT with 200 and echoes the bytes after it.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cli_mcp_agent::relay::{self, Relay, RelayLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Every await of a test is bounded by this: a relay that hangs fails the test.
const STUCK: Duration = Duration::from_secs(10);
const ESTABLISHED: &str = "HTTP/1.1 200 Connection established\r\n\r\n";

async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STUCK, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no progress within {STUCK:?}"))
}

/// What one upstream connection received, in order.
type Received = Arc<Mutex<Vec<u8>>>;

/// The test's proxy: each connection's bytes, in order, as they arrived.
struct Upstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Upstream {
    async fn start() -> Self {
        Self::start_at("127.0.0.1:0".parse().expect("addr")).await
    }

    async fn start_at(at: SocketAddr) -> Self {
        let listener = TcpListener::bind(at).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let received: Arc<Mutex<Vec<Received>>> = Arc::default();
        let (count, log) = (accepted.clone(), received.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let bytes = Arc::new(Mutex::new(Vec::new()));
                log.lock().expect("log").push(bytes.clone());
                tokio::spawn(answer_and_echo(stream, bytes));
            }
        });
        Self {
            addr,
            accepted,
            received,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// What connection `i` has received so far.
    fn received(&self, i: usize) -> Vec<u8> {
        let conns = self.received.lock().expect("log");
        let conn = conns.get(i).expect("no such upstream connection");
        let bytes = conn.lock().expect("bytes").clone();
        bytes
    }

    /// The head connection `i` received (up to its empty line), once it has all of it.
    async fn head(&self, i: usize) -> String {
        within("the upstream receiving a head", async {
            loop {
                if self.received.lock().expect("log").len() > i {
                    let bytes = self.received(i);
                    if let Some(end) = find(&bytes, b"\r\n\r\n") {
                        return String::from_utf8(bytes[..end + 4].to_vec()).expect("utf-8");
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
    }
}

/// Reads the head, answers 200, then echoes what follows it, recording everything.
async fn answer_and_echo(mut stream: TcpStream, log: Received) {
    let mut buf = [0u8; 8192];
    let mut answered = false;
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let echo = {
            let mut all = log.lock().expect("log");
            all.extend_from_slice(&buf[..n]);
            match (answered, find(&all, b"\r\n\r\n")) {
                (true, _) => buf[..n].to_vec(),
                (false, Some(end)) => {
                    answered = true;
                    let mut out = ESTABLISHED.as_bytes().to_vec();
                    out.extend_from_slice(&all[end + 4..]);
                    out
                }
                (false, None) => continue,
            }
        };
        if stream.write_all(&echo).await.is_err() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A relay on loopback; it stops when the sender is dropped.
struct Running {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

async fn start_relay(upstream: SocketAddr, token_file: &Path, limits: RelayLimits) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = watch::channel(false);
    let relay = Relay {
        upstream: upstream.to_string(),
        token_file: token_file.to_path_buf(),
        limits,
    };
    let task = tokio::spawn(relay::serve(listener, relay, stopped));
    Running { addr, stop, task }
}

fn token_file(dir: &Path, token: &str) -> PathBuf {
    let path = dir.join("token");
    std::fs::write(&path, token).expect("write token");
    path
}

const CONNECT: &str = "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";

/// Sends `head` (and whatever follows it) in one write and reads the answer's head.
async fn open(relay: SocketAddr, head: &[u8]) -> (TcpStream, String) {
    let mut client = within("connect", TcpStream::connect(relay))
        .await
        .expect("connect to the relay");
    within("send", client.write_all(head)).await.expect("send");
    let answer = within("the answer's head", read_head(&mut client)).await;
    (client, answer)
}

async fn read_head(client: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match client.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Everything the relay says until it closes: its own answers end the connection.
async fn answer_to_end(relay: SocketAddr, sent: &[u8]) -> String {
    let mut client = within("connect", TcpStream::connect(relay))
        .await
        .expect("connect to the relay");
    // The relay may answer (and stop reading) before all of a large head is written.
    let _ = within("send", client.write_all(sent)).await;
    let mut answer = Vec::new();
    let _ = within("the answer", client.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

async fn echoes(client: &mut TcpStream, bytes: &[u8]) {
    within("send", client.write_all(bytes)).await.expect("send");
    let mut back = vec![0u8; bytes.len()];
    within("the echo", client.read_exact(&mut back))
        .await
        .expect("echo");
    assert_eq!(back, bytes);
}

#[tokio::test]
async fn connect_carries_the_pods_token_instead_of_the_clients() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let token = token_file(dir.path(), "tok-1\n");
    let relay = start_relay(upstream.addr, &token, RelayLimits::default()).await;
    let sent = "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\
                proxy-authorization: Basic c2VjcmV0\r\nUser-Agent: test/1\r\n\
                PROXY-AUTHORIZATION: Bearer client-token\r\nX-Odd:  spaced value \r\n\r\n";
    let (mut client, answer) = open(relay.addr, sent.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    assert_eq!(
        upstream.head(0).await,
        "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nUser-Agent: test/1\r\n\
         X-Odd:  spaced value \r\nProxy-Authorization: Bearer tok-1\r\n\r\n"
    );
    echoes(&mut client, b"ping").await;
    echoes(&mut client, &[7u8; 100_000]).await;
    drop(relay.stop);
}

#[tokio::test]
async fn a_rotated_token_is_used_by_the_next_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    // The kubelet's layout: the file is a link through `..data`, itself a link to a
    // timestamped directory; an update writes a new directory and renames a new link over
    // `..data`.
    let volume = dir.path();
    let write_version = |name: &str, token: &str| {
        std::fs::create_dir(volume.join(name)).expect("version dir");
        std::fs::write(volume.join(name).join("token"), token).expect("token");
        std::os::unix::fs::symlink(name, volume.join("..data_tmp")).expect("link");
        std::fs::rename(volume.join("..data_tmp"), volume.join("..data")).expect("swap");
    };
    write_version("..2026_01_01_00_00_00.1", "tok-old");
    std::os::unix::fs::symlink("..data/token", volume.join("token")).expect("link");
    let relay = start_relay(upstream.addr, &volume.join("token"), RelayLimits::default()).await;
    let (_first, answer) = open(relay.addr, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    assert!(upstream
        .head(0)
        .await
        .contains("\r\nProxy-Authorization: Bearer tok-old\r\n"));
    write_version("..2026_01_01_00_08_00.2", "tok-new\n");
    let (_second, answer) = open(relay.addr, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    let head = upstream.head(1).await;
    assert!(
        head.contains("\r\nProxy-Authorization: Bearer tok-new\r\n"),
        "{head}"
    );
    drop(relay.stop);
}

#[tokio::test]
async fn no_token_means_502_naming_the_file_and_no_upstream_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let missing = dir.path().join("gone").join("token");
    let relay = start_relay(upstream.addr, &missing, RelayLimits::default()).await;
    let answer = answer_to_end(relay.addr, CONNECT.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert!(
        answer.contains(&missing.display().to_string()) && answer.contains("No such file"),
        "{answer}"
    );
    let empty = token_file(dir.path(), " \n");
    let relay = start_relay(upstream.addr, &empty, RelayLimits::default()).await;
    let answer = answer_to_end(relay.addr, CONNECT.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert!(answer.contains("is empty"), "{answer}");
    assert_eq!(upstream.accepted(), 0);
}

#[tokio::test]
async fn an_unreachable_proxy_is_a_502() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A port nobody listens on: bound, then closed.
    let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = gone.local_addr().expect("addr");
    drop(gone);
    let relay = start_relay(addr, &token_file(dir.path(), "t"), RelayLimits::default()).await;
    let answer = answer_to_end(relay.addr, CONNECT.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert!(
        answer.contains(&format!("cannot connect to the proxy at {addr}")),
        "{answer}"
    );
}

/// A proxy that refuses for a moment (a Service routed to replicas just replaced, or not
/// yet to the new ones) is reached once it listens: the relay tries again.
#[tokio::test]
async fn a_proxy_that_refuses_for_a_moment_is_tried_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = gone.local_addr().expect("addr");
    drop(gone);
    let relay = start_relay(addr, &token_file(dir.path(), "t"), RelayLimits::default()).await;
    let relay_addr = relay.addr;
    let client = tokio::spawn(async move { open(relay_addr, CONNECT.as_bytes()).await });
    // The proxy comes up a moment after the relay's first attempt was refused.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let upstream = Upstream::start_at(addr).await;
    let (mut stream, head) = within("the CONNECT's answer", client).await.expect("join");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    echoes(&mut stream, b"ping").await;
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test]
async fn oversized_stalled_and_garbage_heads_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let limits = RelayLimits {
        head_timeout: Duration::from_millis(300),
        ..RelayLimits::default()
    };
    let relay = start_relay(upstream.addr, &token_file(dir.path(), "t"), limits).await;

    let mut huge = b"CONNECT example.com:443 HTTP/1.1\r\n".to_vec();
    while huge.len() < 40 * 1024 {
        huge.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let answer = answer_to_end(relay.addr, &huge).await;
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");

    let started = std::time::Instant::now();
    let answer = answer_to_end(relay.addr, b"CONNECT example.com:443 HTTP/1.1\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(300));

    for garbage in [
        &b"hello there\r\n\r\n"[..],
        b"CONNECT example.com:443 HTTP/1.1\r\nno colon here\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\n Proxy-Authorization: x\r\n\r\n",
    ] {
        let answer = answer_to_end(relay.addr, garbage).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    }
    // A TLS ClientHello where a request was due (an `https://` proxy URL): it has no line
    // end, so it is refused once the head time is up.
    let answer = answer_to_end(relay.addr, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03").await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert_eq!(upstream.accepted(), 0);
}

#[tokio::test]
async fn connections_beyond_the_cap_get_503_while_the_others_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let limits = RelayLimits {
        max_connections: 2,
        ..RelayLimits::default()
    };
    let relay = start_relay(upstream.addr, &token_file(dir.path(), "t"), limits).await;
    let (mut one, answer) = open(relay.addr, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    let (mut two, answer) = open(relay.addr, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    let answer = answer_to_end(relay.addr, CONNECT.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("--proxy-relay-max-connections"), "{answer}");
    echoes(&mut one, b"one").await;
    echoes(&mut two, b"two").await;
    assert_eq!(upstream.accepted(), 2);
    // A closed connection frees its place.
    drop(one);
    let reopened = within("a freed place", async {
        loop {
            let (client, answer) = open(relay.addr, CONNECT.as_bytes()).await;
            if answer == ESTABLISHED {
                return client;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    drop(reopened);
    drop(relay.stop);
}

#[tokio::test]
async fn bytes_sent_with_the_head_follow_the_rewritten_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let relay = start_relay(
        upstream.addr,
        &token_file(dir.path(), "tok"),
        RelayLimits::default(),
    )
    .await;
    let hello = b"\x16\x03\x01\x00\x05HELLO";
    let mut sent = CONNECT.as_bytes().to_vec();
    sent.extend_from_slice(hello);
    let (mut client, answer) = open(relay.addr, &sent).await;
    assert_eq!(answer, ESTABLISHED);
    let mut back = [0u8; 10];
    within("the echo", client.read_exact(&mut back))
        .await
        .expect("echo");
    assert_eq!(&back, hello);
    let expected_head = "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\
                         Proxy-Authorization: Bearer tok\r\n\r\n";
    let mut expected = expected_head.as_bytes().to_vec();
    expected.extend_from_slice(hello);
    assert_eq!(upstream.received(0), expected);
    drop(relay.stop);
}

#[tokio::test]
async fn stopping_closes_the_listener_and_the_tunnels() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let relay = start_relay(
        upstream.addr,
        &token_file(dir.path(), "t"),
        RelayLimits::default(),
    )
    .await;
    let (mut client, answer) = open(relay.addr, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    relay.stop.send_replace(true);
    within("the relay to stop", relay.task)
        .await
        .expect("serve ended");
    let mut rest = Vec::new();
    let _ = within("the tunnel to close", client.read_to_end(&mut rest)).await;
    assert!(TcpStream::connect(relay.addr).await.is_err());
}

/// The agent binary runs the relay from its flags.
#[tokio::test]
async fn the_agent_serves_the_relay_from_its_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = Upstream::start().await;
    let token = token_file(dir.path(), "tok-agent");
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        probe.local_addr().expect("addr").port()
    };
    let listen = format!("127.0.0.1:{port}");
    let (upstream_addr, token_path) = (upstream.addr.to_string(), token.display().to_string());
    let agent = tokio::task::spawn_blocking(move || {
        support::Agent::start_with(support::Opts {
            env: &[
                ("CLI_MCP_AGENT_PROXY_RELAY_LISTEN", listen.as_str()),
                ("CLI_MCP_AGENT_PROXY_UPSTREAM", upstream_addr.as_str()),
                ("CLI_MCP_AGENT_PROXY_TOKEN_FILE", token_path.as_str()),
            ],
            ..Default::default()
        })
    })
    .await
    .expect("agent started");
    let relay: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let (_client, answer) = open(relay, CONNECT.as_bytes()).await;
    assert_eq!(answer, ESTABLISHED);
    assert!(upstream
        .head(0)
        .await
        .ends_with("\r\nProxy-Authorization: Bearer tok-agent\r\n\r\n"));
    tokio::task::spawn_blocking(move || drop(agent))
        .await
        .expect("agent stopped");
}

/// Some relay flags but not all: the agent does not start, and says what is missing.
#[test]
fn the_agent_refuses_an_incomplete_relay_set_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = support::agent_command(dir.path())
        .args(["--listen", "127.0.0.1:0"])
        .env("CLI_MCP_AGENT_PROXY_UPSTREAM", "proxy.ns.svc:8080")
        .env_remove("CLI_MCP_AGENT_PROXY_RELAY_LISTEN")
        .env_remove("CLI_MCP_AGENT_PROXY_TOKEN_FILE")
        .env("TOKEN_SHA256", "0".repeat(64))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the agent");
    let deadline = std::time::Instant::now() + STUCK;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the agent started with an incomplete relay set-up");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .expect("stderr");
    assert!(!status.success());
    assert!(
        stderr.contains("--proxy-relay-listen (CLI_MCP_AGENT_PROXY_RELAY_LISTEN)")
            && stderr.contains("--proxy-token-file (CLI_MCP_AGENT_PROXY_TOKEN_FILE)"),
        "{stderr}"
    );
}
