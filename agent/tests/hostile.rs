//! The agent under hostile load: peers that hold connections open, callers that pile up
//! behind a running command. Each failure message carries the resource figures (connections
//! held, callers waiting) that explain it.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{session_token, sockets, Agent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a probe may take before the test calls the agent stuck. A liveness bound, not a
/// performance figure: a healthy agent answers in well under a millisecond.
const STUCK: Duration = Duration::from_secs(10);

/// `GET /healthz` on a client of its own, so no pooled connection of the test helps it.
async fn probe(a: &Agent) -> Result<u16, String> {
    let http = reqwest::Client::builder()
        .timeout(STUCK)
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| e.to_string())?;
    match http.get(a.url("/healthz")).send().await {
        Ok(r) => Ok(r.status().as_u16()),
        Err(e) => Err(format!("{e:?}")),
    }
}

/// Runs `command` on a fresh connection; the status code and the JSON body.
async fn exec_on_own_connection(
    url: String,
    command: String,
    timeout_ms: u64,
) -> Result<(u16, Value), String> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(timeout_ms) + STUCK)
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| e.to_string())?;
    let res = http
        .post(url)
        .bearer_auth(session_token().expose())
        .json(&json!({"command": command, "timeout_ms": timeout_ms}))
        .send()
        .await
        .map_err(|e| format!("{SENDING}{e:?}"))?;
    let status = res.status().as_u16();
    let body = res
        .json::<Value>()
        .await
        .map_err(|e| format!("reading the body: {e:?}"))?;
    Ok((status, body))
}

/// How an error of [`exec_on_own_connection`] begins when no answer arrived at all.
const SENDING: &str = "before any answer: ";

fn fifo(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    p
}

#[tokio::test]
async fn idle_connections_cannot_hold_off_healthz_or_exec() {
    let a = Agent::start();
    // More than --max-connections (32), none of which ever sends a byte; no token needed.
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(TcpStream::connect(a.addr).await.expect("connect"));
    }
    let health = probe(&a).await;
    assert_eq!(
        health,
        Ok(200),
        "GET /healthz with {} idle connections open (the agent holds {} sockets)",
        idle.len(),
        sockets(a.pid())
    );
    let exec = exec_on_own_connection(a.url("/exec"), "echo through".into(), 5000).await;
    assert!(
        matches!(&exec, Ok((200, v)) if v["stdout"] == "through\n"),
        "POST /exec with {} idle connections open (the agent holds {} sockets): {exec:?}",
        idle.len(),
        sockets(a.pid())
    );
    drop(idle);
}

/// Peers that send requests and never read the answers: once the socket buffers are full the
/// agent can write no answer and reads no further request, so each such connection has an
/// answer in flight and bytes waiting, for good. Holding every place with them must not keep
/// a probe out.
#[tokio::test]
async fn peers_that_never_read_their_answers_cannot_hold_off_healthz() {
    let a = Agent::start_with(support::Opts {
        extra_args: &["--max-connections", "4"],
        ..Default::default()
    });
    let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".repeat(256);
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        // Small buffers on this side: the agent's writes stall sooner.
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        socket.set_send_buffer_size(4096).expect("SO_SNDBUF");
        let conn = socket.connect(a.addr).await.expect("connect");
        // Requests until the agent stops reading them: no room in the socket for a while.
        let mut sent = 0usize;
        loop {
            // Whole requests only: continue where the last write stopped.
            match conn.try_write(&request[sent % request.len()..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let room = tokio::time::timeout(Duration::from_secs(1), conn.writable()).await;
                    if room.is_err() {
                        break;
                    }
                }
                Err(e) => panic!("writing requests: {e} after {sent} bytes"),
            }
            assert!(
                sent < 256 << 20,
                "the agent still reads after {sent} bytes of requests"
            );
        }
        stalled.push(conn);
    }
    let health = probe(&a).await;
    assert_eq!(
        health,
        Ok(200),
        "GET /healthz with every place held by a peer that does not read (the agent holds {} \
         sockets)",
        sockets(a.pid())
    );
    drop(stalled);
}

#[tokio::test]
async fn an_idle_or_half_sent_connection_is_closed_by_the_agent() {
    let a = Agent::start();
    let mut silent = TcpStream::connect(a.addr).await.expect("connect");
    let mut slow = TcpStream::connect(a.addr).await.expect("connect");
    // A request head that never ends (slowloris).
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    // The default header-read timeout is 10 s; a connection still open well after it is
    // held for good.
    let within = Duration::from_secs(40);
    for (name, s) in [("silent", &mut silent), ("half-sent", &mut slow)] {
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(within, s.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the {name} connection was still open after {within:?} ({read:?}; the agent holds {} \
             sockets)",
            sockets(a.pid())
        );
    }
}

#[tokio::test]
async fn healthz_answers_while_forty_callers_queue_behind_a_running_command() {
    let a = Agent::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let started = fifo(dir.path(), "started");
    let release = fifo(dir.path(), "release");
    let running = tokio::spawn(exec_on_own_connection(
        a.url("/exec"),
        format!(
            "echo go > {}; read x < {}; echo released",
            started.display(),
            release.display()
        ),
        120_000,
    ));
    let s = started.clone();
    tokio::task::spawn_blocking(move || std::fs::read_to_string(s).expect("read fifo"))
        .await
        .expect("join");

    let callers: Vec<_> = (0..40)
        .map(|i| {
            tokio::spawn(exec_on_own_connection(
                a.url("/exec"),
                format!("echo queued-{i}"),
                120_000,
            ))
        })
        .collect();
    // Every caller has at least connected once the agent holds that many sockets, or the
    // agent stopped accepting (the failure this test is about): probe either way.
    support::eventually(Duration::from_secs(5), || {
        sockets(a.pid()) > 40 || callers.iter().filter(|c| c.is_finished()).count() >= 30
    })
    .await;
    let health = probe(&a).await;
    let answered = callers.iter().filter(|c| c.is_finished()).count();
    assert_eq!(
        health,
        Ok(200),
        "GET /healthz with one command running and 40 callers sent ({answered} answered so far; \
         the agent holds {} sockets)",
        sockets(a.pid())
    );

    // Callers beyond the queue are refused at once, while the first command still runs.
    let refused_in_time = support::eventually(STUCK, || {
        callers.iter().filter(|c| c.is_finished()).count() >= 40 - 8
    })
    .await;
    let answered = callers.iter().filter(|c| c.is_finished()).count();
    assert!(
        refused_in_time,
        "only {answered} of 40 callers were answered while a command ran (the agent holds {} \
         sockets)",
        sockets(a.pid())
    );
    std::fs::write(&release, "go\n").expect("release the command");
    let first = running.await.expect("join");
    assert!(
        matches!(&first, Ok((200, v)) if v["stdout"] == "released\n"),
        "{first:?}"
    );
    let mut busy = 0;
    let mut ran = 0;
    // Connections beyond `--max-connections` (32) close the oldest one with no request in
    // flight: under load a caller can be accepted before the agent has read its request,
    // and is then closed unanswered. At most the connections over the cap (40 callers, the
    // running command's and the probe's) can be.
    let mut shed = 0;
    for c in callers {
        match c.await.expect("join") {
            Err(e) if closed_unanswered(&e) => shed += 1,
            Ok((409, v)) => {
                assert_eq!(v["code"], "busy", "{v}");
                assert!(
                    v["error"].as_str().unwrap_or_default().contains("waiting"),
                    "{v}"
                );
                busy += 1;
            }
            Ok((200, _)) => ran += 1,
            other => panic!("a queued caller got {other:?}"),
        }
    }
    assert!(
        (1..=8).contains(&ran) && busy + ran + shed == 40 && shed <= 42 - 32,
        "{ran} queued callers ran, {busy} were refused busy and {shed} closed unanswered"
    );
}

/// A connection the agent closed before any answer began (the error of
/// [`exec_on_own_connection`]); one cut in the middle of an answer is not that.
fn closed_unanswered(error: &str) -> bool {
    error.starts_with(SENDING)
        && [
            "IncompleteMessage",
            "ConnectionReset",
            "reset by peer",
            "BrokenPipe",
        ]
        .iter()
        .any(|m| error.contains(m))
}

/// Reads the agent's memory as the shell can (its parent, same uid) and looks for the bearer
/// token the agent was just sent: prints `found` or `not found`, or dies with `denied …`.
const READ_AGENT_MEMORY: &str = r#"
my ($pid, $reversed) = @ARGV;
my $needle = reverse $reversed;
open(my $maps, "<", "/proc/$pid/maps") or die "denied maps: $!\n";
open(my $mem, "<:raw", "/proc/$pid/mem") or die "denied mem: $!\n";
while (my $line = <$maps>) {
    next unless $line =~ /^([0-9a-f]+)-([0-9a-f]+) rw/;
    my ($start, $end) = (hex($1), hex($2));
    next if $end - $start > (1 << 30);
    sysseek($mem, $start, 0) or next;
    my $buf;
    next unless sysread($mem, $buf, $end - $start);
    if (index($buf, $needle) >= 0) { print "found\n"; exit 0 }
}
print "not found\n";
"#;

/// The shell runs as the agent's user, so without protection it can read the agent's memory
/// (and in it the bearer token of every request) and its environment through /proc. The
/// agent makes itself non-dumpable, which leaves its /proc files to root and forbids
/// same-uid access to `mem`, `maps` and `environ`. Root (CAP_SYS_PTRACE) may read them
/// anyway, so when the test runs as root the agent and its shell run as `nobody` (65534):
/// what is checked is exactly what a non-root shell in a pod can do.
#[tokio::test]
async fn the_shell_cannot_read_the_agents_memory_or_environment() {
    let root = nix::unistd::geteuid().is_root();
    let a = Agent::start_with(support::Opts {
        run_as: root.then_some(65534),
        ..Default::default()
    });
    let token = session_token();
    let reversed: String = token.expose().chars().rev().collect();
    let script = format!("'{}'", READ_AGENT_MEMORY.replace('\'', r"'\''"));
    let v = a
        .exec(&format!(
            "id -u; perl -e {script} \"$PPID\" '{reversed}'; tr '\\0' ' ' < /proc/$PPID/environ | head -c 64"
        ))
        .await;
    let (out, err) = (
        v["stdout"].as_str().unwrap_or(""),
        v["stderr"].as_str().unwrap_or(""),
    );
    assert!(
        !out.contains("found") && !out.contains("SHA256"),
        "the shell (uid {}) read the agent's memory or environment: {out:?} {err:?}",
        out.lines().next().unwrap_or("?")
    );
    assert!(
        err.contains("denied maps: Permission denied")
            && err.contains("environ: Permission denied"),
        "{out:?} {err:?}"
    );
}
