//! A real NFS server for the shared-storage tests (docs/shared-storage.md): nfs-ganesha
//! with its VFS backend, serving one host directory over NFSv3/TCP inside a test's
//! network namespace.
//!
//! ganesha will not start unless it can register with rpcbind, and rpcbind's socket
//! (`/run/rpcbind.sock`) is a path, not a network address, so each server gets an
//! rpcbind of its own: both run in a mount namespace with a private `/run` and
//! `/var/lib/nfs`, and in a PID namespace whose first process is ganesha, so ending
//! ganesha ends rpcbind with it. Several tests can each run one at once.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Netns;

/// The server's NFS port (and `port=` of the guests' mount options).
pub const NFS_PORT: u16 = 2049;
/// The server's MOUNT protocol port (`mountport=`).
pub const MOUNT_PORT: u16 = 20048;

/// An nfs-ganesha serving `export` read-write (root not squashed) in a namespace;
/// stopped, with its rpcbind, on drop.
pub struct NfsServer {
    ns: String,
    work: PathBuf,
    export: PathBuf,
    child: Option<Child>,
}

impl NfsServer {
    /// Starts the server in `ns` (listening on every address there), with its
    /// configuration and log in `work`, and waits until it serves.
    pub fn start(ns: &Netns, export: &Path, work: &Path) -> Self {
        assert!(
            Path::new("/usr/bin/ganesha.nfsd").exists(),
            "nfs-ganesha is missing: apt-get install nfs-ganesha nfs-ganesha-vfs rpcbind"
        );
        std::fs::create_dir_all(export).expect("export dir");
        std::fs::create_dir_all(work).expect("server dir");
        let mut server = Self {
            ns: ns.0.clone(),
            work: work.to_path_buf(),
            export: export.to_path_buf(),
            child: None,
        };
        server.start_again();
        server
    }

    /// The path a guest mounts (`ADDR:PATH`): NFSv3 names the host directory itself.
    pub fn export(&self) -> &Path {
        &self.export
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.work.join("ganesha.log")).unwrap_or_default()
    }

    /// Starts the server (again, after `stop`) and waits until it serves.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the NFS server runs already");
        let conf = self.work.join("ganesha.conf");
        std::fs::write(&conf, config(&self.export)).expect("ganesha.conf");
        let log = self.work.join("ganesha.log");
        let _ = std::fs::remove_file(&log);
        let script = format!(
            "mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /var/lib/nfs || exit 1\n\
             rpcbind -f &\n\
             i=0; while [ ! -S /run/rpcbind.sock ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n\
             exec ganesha.nfsd -F -L {log} -f {conf} -p /run/ganesha.pid -N NIV_EVENT\n",
            log = log.display(),
            conf = conf.display(),
        );
        let child = Command::new("ip")
            .args([
                "netns", "exec", &self.ns, "unshare", "--mount", "--pid", "--fork",
            ])
            .args(["--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.work.join("server.stderr")).expect("stderr"))
            .spawn()
            .expect("ip netns exec unshare");
        self.child = Some(child);
        let start = Instant::now();
        while !self.log().contains("NFS SERVER INITIALIZED") {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "the NFS server exited ({status}): {}\n{}",
                    std::fs::read_to_string(self.work.join("server.stderr")).unwrap_or_default(),
                    self.log()
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the NFS server did not start in 60 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server and its rpcbind (SIGKILL to ganesha, the first process of their
    /// PID namespace, which ends the namespace), and waits for them.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // `unshare --fork` waits for its child, the namespace's first process.
        let children = format!("/proc/{0}/task/{0}/children", child.id());
        for pid in std::fs::read_to_string(children)
            .unwrap_or_default()
            .split_whitespace()
        {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: kill(2) on a process this test started (the child of the
                // `unshare` it spawned); no memory is involved.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let start = Instant::now();
        while child.try_wait().ok().flatten().is_none() {
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Established TCP connections to the NFS port, by the client's address.
    pub fn clients(&self) -> Vec<String> {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                "ss",
                "-Htn",
                "state",
                "established",
            ])
            .arg(format!("( sport = :{NFS_PORT} )"))
            .output()
            .expect("ss");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .filter_map(|peer| peer.rsplit_once(':'))
            .map(|(a, _)| {
                // ganesha listens on IPv6 too, so IPv4 peers read [::ffff:10.79.0.11].
                let a = a.trim_start_matches('[').trim_end_matches(']');
                a.trim_start_matches("::ffff:").to_string()
            })
            .collect()
    }
}

impl Drop for NfsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// ganesha's configuration: NFSv3 over TCP only, no NLM (clients mount with `nolock`),
/// no grace period, one export of `export`.
fn config(export: &Path) -> String {
    format!(
        "NFS_CORE_PARAM {{\n\
         \x20   Protocols = 3;\n\
         \x20   NFS_Port = {NFS_PORT};\n\
         \x20   MNT_Port = {MOUNT_PORT};\n\
         \x20   Enable_NLM = false;\n\
         \x20   Enable_RQUOTA = false;\n\
         \x20   Enable_UDP = false;\n\
         }}\n\
         NFSV4 {{ Graceless = true; }}\n\
         EXPORT {{\n\
         \x20   Export_Id = 1;\n\
         \x20   Path = {path};\n\
         \x20   Pseudo = /export;\n\
         \x20   Access_Type = RW;\n\
         \x20   Squash = No_Root_Squash;\n\
         \x20   Protocols = 3;\n\
         \x20   Transports = TCP;\n\
         \x20   SecType = sys;\n\
         \x20   FSAL {{ Name = VFS; }}\n\
         }}\n",
        path = export.display()
    )
}
