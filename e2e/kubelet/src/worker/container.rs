//! One container slot of a pod: starting it (image, env, mounts, helper), its exit and
//! restart back-off, probes and kills.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, ContainerStateTerminated};
use k8s_openapi::jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::task::JoinHandle;

use super::{Event, SlotId, Timing, Worker};
use crate::backoff::Backoff;
use crate::downward::PodFacts;
use crate::probes::{self, Kind};
use crate::state::ProcRecord;
use crate::status::{ContainerView, State, Terminated};
use crate::{env, identity, imagemap, launch, netns, process};

pub(super) struct Running {
    pub(super) pid: i32,
    pub(super) run: u64,
    pub(super) since: Instant,
    pub(super) probes: Vec<JoinHandle<()>>,
    pub(super) killer: Option<JoinHandle<()>>,
    pub(super) kill_message: Option<String>,
}

impl Running {
    pub(super) fn stop_tasks(&mut self) {
        for p in self.probes.drain(..) {
            p.abort();
        }
        if let Some(k) = self.killer.take() {
            k.abort();
        }
    }
}

pub(super) struct Slot {
    pub(super) spec: Container,
    pub(super) sidecar: bool,
    pub(super) view: ContainerView,
    pub(super) running: Option<Running>,
    pub(super) next_attempt: Instant,
    pub(super) done: bool,
    pub(super) pulled_once: bool,
    pub(super) crash: Backoff,
    pub(super) pull: Backoff,
    pub(super) config: Backoff,
}

impl Slot {
    pub(super) fn new(
        spec: &Container,
        sidecar: bool,
        t: &Timing,
        prev: Option<&k8s_openapi::api::core::v1::ContainerStatus>,
    ) -> Slot {
        let mut view = ContainerView {
            name: spec.name.clone(),
            image: spec.image.clone().unwrap_or_default(),
            image_id: String::new(),
            container_id: None,
            state: State::waiting("ContainerCreating", None),
            last_terminated: None,
            restart_count: 0,
            ready: false,
            started: false,
            sidecar,
        };
        if let Some(p) = prev {
            view.restart_count = p.restart_count;
            view.last_terminated = p
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .map(terminated_from_api);
            if p.state.as_ref().and_then(|s| s.running.as_ref()).is_some() {
                // It was running under a previous kubelet run and was stopped at startup.
                view.restart_count += 1;
            }
        }
        Slot {
            spec: spec.clone(),
            sidecar,
            view,
            running: None,
            next_attempt: Instant::now(),
            done: false,
            pulled_once: false,
            crash: Backoff::new(t.crash_initial, t.crash_max),
            pull: Backoff::new(t.retry_initial, t.retry_max),
            config: Backoff::new(t.retry_initial, t.retry_max),
        }
    }
}

pub(super) fn terminated_from_api(t: &ContainerStateTerminated) -> Terminated {
    Terminated {
        exit_code: t.exit_code,
        signal: t.signal,
        reason: t.reason.clone().unwrap_or_else(|| "Error".into()),
        message: t.message.clone(),
        started_at: t.started_at.as_ref().map(|t| t.0),
        finished_at: t
            .finished_at
            .as_ref()
            .map(|t| t.0)
            .unwrap_or_else(Timestamp::now),
        container_id: t.container_id.clone(),
    }
}

/// Whether a container that exited with `exit_code` is started again: sidecars always,
/// init containers until they succeed (unless the pod's policy is `Never`), regular
/// containers per the pod's `restartPolicy`.
pub(super) fn restart_wanted(policy: &str, init: bool, sidecar: bool, exit_code: i32) -> bool {
    if sidecar {
        return true;
    }
    if init {
        return exit_code != 0 && policy != "Never";
    }
    match policy {
        "Never" => false,
        "OnFailure" => exit_code != 0,
        _ => true,
    }
}

/// `terminationMessagePolicy: FallbackToLogsOnError`: the last 80 lines of the log, at most
/// 2048 bytes, like the kubelet.
pub(super) fn termination_message_from_log(log: &[u8]) -> String {
    let tail = crate::logserver::tail(log, 80);
    let tail = &tail[tail.len().saturating_sub(2048)..];
    String::from_utf8_lossy(tail).into_owned()
}

impl Worker {
    pub(super) fn on_exit(&mut self, id: SlotId, run: u64, exit: ExitStatus) {
        let s = self.slot_mut(id);
        let Some(mut r) = s.running.take().filter(|r| r.run == run) else {
            return;
        };
        r.stop_tasks();
        // The container is over: nothing of its process group may outlive it.
        process::signal_group(r.pid, Signal::SIGKILL);
        let (exit_code, signal, reason) = process::describe_exit(&exit);
        let started_at = match &s.view.state {
            State::Running { started_at } => Some(*started_at),
            _ => None,
        };
        let mut t = Terminated {
            exit_code,
            signal,
            reason: reason.to_string(),
            message: r.kill_message.clone(),
            started_at,
            finished_at: Timestamp::now(),
            container_id: s.view.container_id.clone(),
        };
        let name = s.spec.name.clone();
        let fallback =
            s.spec.termination_message_policy.as_deref() == Some("FallbackToLogsOnError");
        if t.message.is_none() && fallback && exit_code != 0 {
            let log = std::fs::read(self.dir.log(&name)).unwrap_or_default();
            t.message = Some(termination_message_from_log(&log)).filter(|m| !m.is_empty());
        }
        tracing::info!(pod = %self.pod_key(), container = %name, exit_code, "container exited");
        self.record.processes.remove(&name);
        let _ = self.record.save(&self.dir);
        self.finish_run(id, t, r.since.elapsed());
    }

    /// Records a finished run and decides between `Terminated` for good and a (delayed)
    /// restart with `CrashLoopBackOff`.
    pub(super) fn finish_run(&mut self, id: SlotId, t: Terminated, ran_for: Duration) {
        // `done` was set before the signal when the kubelet itself is stopping the container.
        let stopping = self.slot(id).done;
        let restart = !self.deleting() && !stopping && self.should_restart(id, t.exit_code);
        let (ns, pod_name, uid) = (self.ns.clone(), self.name.clone(), self.uid.clone());
        let s = self.slot_mut(id);
        s.view.ready = false;
        s.view.started = false;
        if !restart {
            s.view.state = State::Terminated(t);
            s.done = true;
            return;
        }
        let delay = s.crash.after_exit(ran_for);
        s.view.last_terminated = Some(t);
        s.view.restart_count += 1;
        s.next_attempt = Instant::now() + delay;
        s.view.state = if delay.is_zero() {
            State::waiting("ContainerCreating", None)
        } else {
            State::waiting(
                "CrashLoopBackOff",
                Some(format!(
                    "back-off {}s restarting failed container={} pod={}_{}({})",
                    delay.as_secs(),
                    s.spec.name,
                    pod_name,
                    ns,
                    uid
                )),
            )
        };
    }

    pub(super) fn on_probe(&mut self, id: SlotId, run: u64, kind: Kind, ok: bool, message: String) {
        let current = self.slot(id).running.as_ref().is_some_and(|r| r.run == run);
        if !current {
            return;
        }
        let name = self.slot(id).spec.name.clone();
        match (kind, ok) {
            (Kind::Readiness, ok) => {
                tracing::info!(pod = %self.pod_key(), container = %name, ready = ok, "readiness changed");
                self.slot_mut(id).view.ready = ok;
            }
            (Kind::Startup, true) => {
                tracing::info!(pod = %self.pod_key(), container = %name, "startup probe succeeded");
                self.slot_mut(id).view.started = true;
                self.start_probes(id, false);
            }
            (Kind::Liveness, true) => {}
            (Kind::Startup | Kind::Liveness, false) => {
                tracing::info!(pod = %self.pod_key(), container = %name, "{message}; killing container");
                let probe = if kind == Kind::Startup {
                    self.slot(id).spec.startup_probe.clone()
                } else {
                    self.slot(id).spec.liveness_probe.clone()
                };
                let grace = probe
                    .and_then(|p| p.termination_grace_period_seconds)
                    .map(|s| Duration::from_secs(s.max(0) as u64))
                    .unwrap_or_else(|| self.grace_period());
                self.kill(id, grace, Some(message));
            }
        }
    }

    /// SIGTERM now, SIGKILL after `grace`, unless the container exits first.
    pub(super) fn kill(&mut self, id: SlotId, grace: Duration, message: Option<String>) {
        let Some(r) = self.slot_mut(id).running.as_mut() else {
            return;
        };
        if r.killer.is_some() {
            return;
        }
        r.kill_message = message;
        let pid = r.pid;
        process::signal_group(pid, Signal::SIGTERM);
        r.killer = Some(tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            process::signal_group(pid, Signal::SIGKILL);
        }));
    }

    pub(super) fn set_waiting_retry(
        &mut self,
        id: SlotId,
        reason: &str,
        message: String,
        pull: bool,
    ) {
        let s = self.slot_mut(id);
        let delay = if pull {
            s.pull.after_failure()
        } else {
            s.config.after_failure()
        };
        s.next_attempt = Instant::now() + delay;
        s.view.state = State::waiting(reason, Some(message));
    }

    /// Starts the container once the pod has its address: its image, then its exec spec,
    /// then its process. A step that fails leaves the container waiting, with the reason,
    /// for a retry.
    pub(super) async fn try_start(&mut self, id: SlotId) {
        let Some(ip) = self.net.ip else { return };
        let spec = self.slot(id).spec.clone();
        let Some(binary) = self.pull(id, &spec) else {
            return;
        };
        let spec_path = match self.write_exec_spec(&spec, &binary, ip).await {
            Ok(Some(path)) => path,
            Ok(None) => return,
            Err(e) => {
                self.set_waiting_retry(id, "CreateContainerConfigError", e, false);
                return;
            }
        };
        self.slot_mut(id).config.reset();
        self.start_process(id, &spec.name, &spec_path).await;
    }

    /// The container's image as a local binary ("pull"); `None` when the image map has
    /// none for it: the container then waits in `ErrImagePull`, later `ImagePullBackOff`,
    /// and is retried with back-off.
    fn pull(&mut self, id: SlotId, spec: &Container) -> Option<PathBuf> {
        let image = spec.image.clone().unwrap_or_default();
        let map = self.ctx.image_map.clone();
        let binary = match imagemap::resolve(&map, &image) {
            Ok(b) => b,
            Err(e) => {
                let first = !self.slot(id).pulled_once;
                let msg = e.to_string();
                tracing::warn!(pod = %self.pod_key(), container = %spec.name, "{msg}");
                let (reason, message) = if first {
                    ("ErrImagePull", msg)
                } else {
                    (
                        "ImagePullBackOff",
                        format!("Back-off pulling image {image:?}: {msg}"),
                    )
                };
                self.slot_mut(id).pulled_once = true;
                self.set_waiting_retry(id, reason, message, true);
                return None;
            }
        };
        let s = self.slot_mut(id);
        s.pull.reset();
        s.pulled_once = false;
        s.view.image_id = format!("cli-mcp://{}", binary.display());
        Some(binary)
    }

    /// Writes the exec helper's spec for the container (its environment, mounts, command
    /// line and identity in the pod's network namespace at `ip`) and returns its path;
    /// `Ok(None)` if the pod has no spec. `Err` is the message of a
    /// `CreateContainerConfigError`.
    async fn write_exec_spec(
        &self,
        spec: &Container,
        binary: &Path,
        ip: Ipv4Addr,
    ) -> Result<Option<PathBuf>, String> {
        let objects = self.fetch_objects(spec).await?;
        let Some(pod_spec) = self.pod.spec.clone() else {
            return Ok(None);
        };
        let ident = identity::for_container(&pod_spec, spec);
        let ip_s = ip.to_string();
        let host_ip = self.ctx.node.internal_ip.to_string();
        let facts = PodFacts {
            pod_ip: Some(&ip_s),
            host_ip: &host_ip,
            ..self.facts()
        };
        let env = env::resolve(&facts, spec, &objects, &self.ctx.service_env, ident.uid)
            .inspect_err(
                |e| tracing::warn!(pod = %self.pod_key(), container = %spec.name, "{e}"),
            )?;
        let etc =
            launch::write_etc_files(&self.dir.root.join("etc"), &self.pod, &ip_s, &self.ctx.dns);
        let mounts = etc.and_then(|mut etc| {
            let volumes = self
                .volumes
                .mounts_for(spec.volume_mounts.as_deref().unwrap_or_default(), &env)?;
            etc.extend(volumes);
            Ok(etc)
        })?;
        let argv = launch::command_line(binary, spec, &env, |p| p.exists());
        let exec = launch::exec_spec(
            &self.pod,
            spec,
            netns::path(&self.record.netns),
            argv,
            &env,
            &ident,
            mounts,
        );
        let spec_path = self.dir.exec_spec(&spec.name);
        process::write_spec(&spec_path, &exec)?;
        Ok(Some(spec_path))
    }

    /// Starts the container `name`'s process from its exec spec at `spec_path`, with a
    /// fresh log; a start that fails counts as a run that ended at once.
    async fn start_process(&mut self, id: SlotId, name: &str, spec_path: &Path) {
        self.dir.rotate_log(name);
        let started = process::start_container(spec_path, &self.dir.log(name)).await;
        self.run_seq += 1;
        let run = self.run_seq;
        match started {
            Ok(p) => self.on_started(id, run, p),
            Err(e) => {
                tracing::warn!(pod = %self.pod_key(), container = %name, "start failed: {e}");
                // Like a process that exited at once: restart policy and back-off apply.
                let now = Timestamp::now();
                let t = Terminated {
                    exit_code: crate::exec_helper::SETUP_FAILED,
                    signal: None,
                    reason: "StartError".into(),
                    message: Some(e),
                    started_at: Some(now),
                    finished_at: now,
                    container_id: None,
                };
                self.finish_run(id, t, Duration::ZERO);
            }
        }
    }

    pub(super) fn on_started(&mut self, id: SlotId, run: u64, started: process::Started) {
        let process::Started { pid, mut child } = started;
        let name = self.slot(id).spec.name.clone();
        tracing::info!(pod = %self.pod_key(), container = %name, pid, "container started");
        self.record.processes.insert(
            name,
            ProcRecord {
                pid,
                start_ticks: process::start_ticks(pid),
            },
        );
        if let Err(e) = self.record.save(&self.dir) {
            tracing::warn!(pod = %self.pod_key(), "{e}");
        }
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("waiting for container pid {pid}: {e}");
                    use std::os::unix::process::ExitStatusExt;
                    ExitStatus::from_raw(255 << 8)
                }
            };
            let _ = tx.send(Event::Exited {
                slot: id,
                run,
                status,
            });
        });
        let s = self.slot_mut(id);
        s.view.state = State::Running {
            started_at: Timestamp::now(),
        };
        s.view.container_id = Some(format!("cli-mcp://{pid}"));
        s.view.ready = false;
        s.view.started = false;
        s.running = Some(Running {
            pid,
            run,
            since: Instant::now(),
            probes: Vec::new(),
            killer: None,
            kill_message: None,
        });
        let has_startup = s.spec.startup_probe.is_some();
        if has_startup {
            self.start_probes(id, true);
        } else {
            self.slot_mut(id).view.started = true;
            self.start_probes(id, false);
        }
    }

    /// Starts the startup probe (`startup`), or the liveness and readiness probes.
    pub(super) fn start_probes(&mut self, id: SlotId, startup: bool) {
        let Some(ip) = self.net.ip else { return };
        let spec_path = self.dir.exec_spec(&self.slot(id).spec.name);
        let s = self.slot(id);
        let Some(r) = s.running.as_ref() else { return };
        let target = probes::Target {
            pod_ip: ip,
            pod_cidr: self.ctx.cni.cidr,
            pid: r.pid,
            spec_path,
            ports: s.spec.ports.clone().unwrap_or_default(),
        };
        let run = r.run;
        let list: Vec<(Kind, Option<k8s_openapi::api::core::v1::Probe>)> = if startup {
            vec![(Kind::Startup, s.spec.startup_probe.clone())]
        } else {
            vec![
                (Kind::Liveness, s.spec.liveness_probe.clone()),
                (Kind::Readiness, s.spec.readiness_probe.clone()),
            ]
        };
        let no_readiness = !startup && s.spec.readiness_probe.is_none();
        let mut handles = Vec::new();
        for (kind, probe) in list {
            let Some(probe) = probe else { continue };
            let tx = self.tx.clone();
            let http = self.ctx.http.clone();
            let target = target.clone();
            handles.push(tokio::spawn(probes::run(
                kind,
                probe,
                target,
                http,
                move |ok, message| {
                    let _ = tx.send(Event::Probe {
                        slot: id,
                        run,
                        kind,
                        ok,
                        message,
                    });
                },
            )));
        }
        let s = self.slot_mut(id);
        if no_readiness {
            s.view.ready = true;
        }
        if let Some(r) = s.running.as_mut() {
            r.probes.extend(handles);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{restart_wanted, termination_message_from_log};

    #[test]
    fn termination_message_is_the_log_tail() {
        let log: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let msg = termination_message_from_log(log.as_bytes());
        assert!(msg.starts_with("line 20\n"));
        assert!(msg.ends_with("line 99\n"));
        let long = "x".repeat(5000);
        assert_eq!(termination_message_from_log(long.as_bytes()).len(), 2048);
        assert_eq!(termination_message_from_log(b""), "");
    }

    #[test]
    fn restart_policies() {
        assert!(restart_wanted("Always", false, false, 0));
        assert!(restart_wanted("Always", false, false, 1));
        assert!(!restart_wanted("OnFailure", false, false, 0));
        assert!(restart_wanted("OnFailure", false, false, 2));
        assert!(!restart_wanted("Never", false, false, 2));
        assert!(!restart_wanted("Always", true, false, 0));
        assert!(restart_wanted("Always", true, false, 1));
        assert!(!restart_wanted("Never", true, false, 1));
        assert!(restart_wanted("Never", true, true, 0));
    }
}
