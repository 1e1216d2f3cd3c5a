//! Runs each request exactly once: the protocol between the replay journal and the shell.
//!
//! A request without a `request_id` just runs. One with an id is looked up first: a
//! finished one is answered again, one that was running when a previous agent process died
//! is answered "effects unknown" without running, and an id reused for another command is
//! refused rather than answered with an unrelated result. Otherwise it is recorded before
//! it reaches bash and its result after, so a retry (also one after an agent crash) never
//! runs the command a second time.
//!
//! `run_once` takes `&mut self`: one command at a time. The HTTP layer keeps the runner
//! behind a lock, so a retry that arrives while its first attempt still runs waits for that
//! lock and then finds the finished record instead of running alongside it.

use std::future::Future;
use std::time::{Duration, SystemTime};

use cli_mcp_api::wire::ExecResponse;

use crate::replay::{sha256_hex, Journal, Lookup};
use crate::shell::{Shell, ShellError, StopReason};

/// One command to run, as the caller asked for it.
#[derive(Debug, Clone)]
pub struct Job {
    pub command: String,
    pub request_id: Option<String>,
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Answering with the other command's result would be a wrong answer, not a replay.
    #[error("request_id was already used for a different command; use a new request_id")]
    RequestIdReused,
    #[error(transparent)]
    Shell(#[from] ShellError),
}

/// The shell plus the journal of the last requests.
pub struct Runner {
    shell: Shell,
    journal: Journal,
}

impl Runner {
    /// Loads what a previous agent process left in the shell's state dir.
    pub fn new(shell: Shell) -> Self {
        let journal = Journal::open(&shell.options().state_dir, shell.options().output_budget);
        Self { shell, journal }
    }

    /// Answers `job`, running it only if no earlier attempt with its `request_id` may have
    /// run. `abort` resolves when the command must stop early (caller gone, shutdown).
    pub async fn run_once(
        &mut self,
        job: &Job,
        abort: impl Future<Output = StopReason>,
    ) -> Result<ExecResponse, RunError> {
        let command_sha256 = sha256_hex(&job.command);
        if let Some(id) = job.request_id.as_deref() {
            if let Some(answer) = self.answer_from_journal(id, &command_sha256)? {
                return Ok(answer);
            }
        }
        // On disk before the command runs: if this process dies meanwhile, a retry on the
        // restarted agent learns that the command was interrupted instead of running it again.
        let slot = job
            .request_id
            .as_deref()
            .map(|id| self.journal.begin(id, &command_sha256));
        let result = self.shell.run(&job.command, job.timeout, abort).await;
        if let Some(slot) = slot {
            self.record(slot, &result);
        }
        if let Ok(resp) = &result {
            log_exec(&command_sha256, resp);
        }
        Ok(result?)
    }

    /// Kills the shell and everything it started (agent shutdown).
    pub async fn kill_shell(&mut self) {
        self.shell.kill().await;
    }

    /// The answer an earlier attempt left, if any; `None`: run the command.
    fn answer_from_journal(
        &mut self,
        request_id: &str,
        command_sha256: &str,
    ) -> Result<Option<ExecResponse>, RunError> {
        match self.journal.lookup(request_id, command_sha256) {
            Lookup::Unknown => Ok(None),
            Lookup::OtherCommand => Err(RunError::RequestIdReused),
            Lookup::Done(resp) => Ok(Some(resp.clone())),
            Lookup::Interrupted { slot, started } => {
                Ok(Some(self.answer_interrupted(slot, started, command_sha256)))
            }
        }
    }

    /// The command was running when a previous agent process died: whether it finished is
    /// unknown, so it is not run again, and every retry gets this same answer.
    fn answer_interrupted(
        &mut self,
        slot: usize,
        started: SystemTime,
        command_sha256: &str,
    ) -> ExecResponse {
        let resp = self.shell.interrupted_by_restart(started);
        self.journal.settle(slot, &resp);
        tracing::warn!(
            command_sha256 = %audit_hash(command_sha256),
            "retry of a command interrupted by an agent restart; not run again"
        );
        resp
    }

    fn record(&mut self, slot: usize, result: &Result<ExecResponse, ShellError>) {
        match result {
            Ok(resp) => self.journal.finish(slot, resp),
            // Sent to bash, then the result was lost: it may have run, so a retry is
            // answered "effects unknown" (also after an agent restart), never run again.
            Err(e) if e.command_may_have_run() => {
                let lost = self.shell.lost_after_send(e);
                self.journal.finish(slot, &lost);
            }
            // Certainly never reached bash: a retry may run it.
            Err(_) => self.journal.forget(slot),
        }
    }
}

/// Enough of the command's hash to correlate audit lines without logging what may be a
/// secret.
fn audit_hash(command_sha256: &str) -> &str {
    command_sha256.get(..16).unwrap_or(command_sha256)
}

fn log_exec(command_sha256: &str, resp: &ExecResponse) {
    tracing::info!(
        command_sha256 = %audit_hash(command_sha256),
        exit_code = resp.exit_code,
        duration_ms = resp.duration_ms,
        bytes = resp.total_bytes,
        timed_out = resp.timed_out,
        shell_restarted = resp.shell_restarted,
        "exec"
    );
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::reaper::Reaper;
    use crate::shell::ShellOptions;

    /// A state dir and a work dir that outlive the runners started on them, as the pod's
    /// `/tmp` emptyDir outlives an agent container.
    struct Pod {
        state: tempfile::TempDir,
        work: tempfile::TempDir,
        reaper: Reaper,
    }

    impl Pod {
        fn new() -> Self {
            Self {
                state: tempfile::tempdir().expect("state dir"),
                work: tempfile::tempdir().expect("work dir"),
                reaper: Reaper::start().expect("reaper"),
            }
        }

        /// A runner as a freshly started agent process would have it.
        fn runner(&self) -> Runner {
            self.runner_with_shell("bash".into())
        }

        fn runner_with_shell(&self, shell: PathBuf) -> Runner {
            let shell = Shell::new(
                ShellOptions {
                    shell,
                    workdir: self.work.path().to_path_buf(),
                    state_dir: self.state.path().to_path_buf(),
                    env: ShellOptions::inherit_env(),
                    output_budget: 64 * 1024,
                    spill_max_bytes: 64 << 20,
                    spill_total_bytes: 128 << 20,
                    reserve_bytes: 1 << 20,
                    // Generous: two loaded cores can make a healthy shell slow to answer.
                    kill_grace: Duration::from_secs(3),
                    max_processes: Some(4096),
                    nproc_rlimit: true,
                },
                self.reaper.clone(),
            )
            .expect("shell");
            Runner::new(shell)
        }

        /// A file that a command appends a line to on every run.
        fn marker(&self) -> PathBuf {
            self.work.path().join("runs")
        }

        fn runs(&self) -> usize {
            std::fs::read_to_string(self.marker()).map_or(0, |t| t.lines().count())
        }

        fn counted(&self, rest: &str) -> String {
            format!("echo x >> '{}'; {rest}", self.marker().display())
        }

        fn journal_files(&self) -> Vec<PathBuf> {
            std::fs::read_dir(self.state.path().join("replay"))
                .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
                .unwrap_or_default()
        }
    }

    fn job(command: &str, request_id: Option<&str>) -> Job {
        Job {
            command: command.to_owned(),
            request_id: request_id.map(str::to_owned),
            timeout: Duration::from_secs(20),
        }
    }

    async fn run(runner: &mut Runner, job: &Job) -> Result<ExecResponse, RunError> {
        runner
            .run_once(job, std::future::pending::<StopReason>())
            .await
    }

    async fn ok(runner: &mut Runner, job: &Job) -> ExecResponse {
        match run(runner, job).await {
            Ok(resp) => resp,
            Err(e) => panic!("{:?} failed: {e}", job.command),
        }
    }

    /// Resolves once `path` exists: the command got that far.
    async fn reached(path: PathBuf) -> StopReason {
        // A whole line, not just the file: `>>` creates the file before it writes, and a stop
        // between the two left a run uncounted (seen once under a parallel test run).
        while !std::fs::read_to_string(&path).is_ok_and(|t| t.ends_with('\n')) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        StopReason::CallerGone
    }

    #[tokio::test]
    async fn a_repeated_request_id_is_answered_without_running_again() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut r = pod.runner();
        let j = job(&pod.counted("wc -l < runs"), Some("r-1"));
        let first = ok(&mut r, &j).await;
        assert_eq!((first.stdout.as_str(), first.exit_code), ("1\n", 0));
        assert_eq!(ok(&mut r, &j).await, first);
        assert_eq!(pod.runs(), 1);
        let other = ok(&mut r, &job(&pod.counted("wc -l < runs"), Some("r-2"))).await;
        assert_eq!(other.stdout, "2\n");
        r.kill_shell().await;
    }

    #[tokio::test]
    async fn without_a_request_id_every_call_runs_and_nothing_is_journaled() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut r = pod.runner();
        let j = job(&pod.counted("true"), None);
        ok(&mut r, &j).await;
        ok(&mut r, &j).await;
        assert_eq!(pod.runs(), 2);
        assert_eq!(pod.journal_files(), Vec::<PathBuf>::new());
        r.kill_shell().await;
    }

    #[tokio::test]
    async fn a_request_id_reused_for_another_command_is_refused_and_nothing_runs() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut r = pod.runner();
        let one = job(&pod.counted("echo one"), Some("r"));
        let first = ok(&mut r, &one).await;
        let two = job(&pod.counted("echo two"), Some("r"));
        assert!(matches!(
            run(&mut r, &two).await,
            Err(RunError::RequestIdReused)
        ));
        assert_eq!(pod.runs(), 1);
        // The record is untouched by the refusal.
        assert_eq!(ok(&mut r, &one).await, first);
        r.kill_shell().await;
    }

    #[tokio::test]
    async fn a_finished_command_is_replayed_by_the_next_agent_process() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut a = pod.runner();
        let j = job(
            &pod.counted("export K=kept; echo err >&2; exit 3"),
            Some("d"),
        );
        let first = ok(&mut a, &j).await;
        assert_eq!(first.exit_code, 3);
        a.kill_shell().await;
        drop(a);

        let mut b = pod.runner();
        assert_eq!(ok(&mut b, &j).await, first);
        assert_eq!(pod.runs(), 1);
        // The replay describes the old shell; the first new command reports the reset.
        let next = ok(&mut b, &job("echo ${K:-gone}", None)).await;
        assert_eq!(next.stdout, "gone\n");
        assert!(next.shell_restarted);
        b.kill_shell().await;
    }

    #[tokio::test]
    async fn a_command_running_when_the_agent_died_is_not_run_by_the_next_process() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut a = pod.runner();
        ok(&mut a, &job("true", None)).await; // the shell was used: its state matters
        let j = job(&pod.counted("true"), Some("r-1"));
        // Recorded as sent to bash, then the process "died" before the result was recorded.
        a.journal.begin("r-1", &sha256_hex(&j.command));
        a.kill_shell().await;
        drop(a);

        let mut b = pod.runner();
        let v = ok(&mut b, &j).await;
        assert_eq!(pod.runs(), 0, "the retry ran the command: {v:?}");
        assert_eq!((v.exit_code, v.shell_restarted), (137, true));
        assert!(
            v.stderr
                .contains("restarted while this command was running")
                && v.stderr.contains("unknown"),
            "{v:?}"
        );
        assert_eq!(ok(&mut b, &j).await, v, "asked again: the same answer");
        assert_eq!(pod.runs(), 0);
        // The reset went out with that answer, not again with the next command.
        let next = ok(&mut b, &job("echo hi", None)).await;
        assert!(!next.shell_restarted, "{next:?}");
        b.kill_shell().await;
    }

    #[tokio::test]
    async fn an_interrupted_command_is_replayed_as_interrupted() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut r = pod.runner();
        let j = job(&pod.counted("sleep 30"), Some("r-1"));
        let v = r
            .run_once(&j, reached(pod.marker()))
            .await
            .expect("answered");
        assert_eq!(v.exit_code, crate::shell::EXIT_INTERRUPTED, "{v:?}");
        assert!(v.stderr.contains("the caller went away"), "{v:?}");
        assert_eq!(ok(&mut r, &j).await, v);
        assert_eq!(pod.runs(), 1);
        r.kill_shell().await;
    }

    /// A launcher for bash that a command can remove, so that the shell it exits cannot be
    /// replaced.
    fn launcher(pod: &Pod) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = pod.work.path().join("bash-launcher");
        std::fs::write(&p, "#!/bin/sh\nexec bash \"$@\"\n").expect("write launcher");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }

    #[tokio::test]
    async fn a_result_lost_after_the_command_was_sent_is_never_run_again() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let shell = launcher(&pod);
        let mut a = pod.runner_with_shell(shell.clone());
        // The command removes the shell's launcher and exits: no shell can be started to
        // report its end, after it ran.
        let j = job(
            &pod.counted(&format!("rm '{}'; exit 0", shell.display())),
            Some("lost"),
        );
        match run(&mut a, &j).await {
            Err(RunError::Shell(e)) => assert!(e.command_may_have_run(), "{e}"),
            other => panic!("expected a lost result, got {other:?}"),
        }
        let retry = ok(&mut a, &j).await;
        assert_eq!(retry.exit_code, crate::shell::EXIT_INTERRUPTED, "{retry:?}");
        assert!(retry.stderr.contains("result was lost"), "{retry:?}");
        launcher(&pod);
        assert_eq!(ok(&mut a, &job("echo ok", None)).await.stdout, "ok\n");
        a.kill_shell().await;
        drop(a);

        let mut b = pod.runner_with_shell(shell);
        assert_eq!(ok(&mut b, &j).await, retry, "the next process gives it too");
        assert_eq!(pod.runs(), 1);
        b.kill_shell().await;
    }

    #[tokio::test]
    async fn a_command_that_never_reached_bash_is_forgotten_so_a_retry_runs_it() {
        let _serial = crate::test_support::PROCESSES.lock().await;
        let pod = Pod::new();
        let mut a = pod.runner_with_shell("/nonexistent/bash".into());
        let j = job(&pod.counted("true"), Some("r-1"));
        match run(&mut a, &j).await {
            Err(RunError::Shell(e)) => assert!(!e.command_may_have_run(), "{e}"),
            other => panic!("expected a spawn failure, got {other:?}"),
        }
        assert_eq!(pod.journal_files(), Vec::<PathBuf>::new());
        drop(a);

        let mut b = pod.runner();
        assert_eq!(ok(&mut b, &j).await.exit_code, 0);
        assert_eq!(pod.runs(), 1);
        b.kill_shell().await;
    }
}
