//! The tests' snapshot cache (`tests::cache`) with the tiny guest: a guest is booted and
//! saved once and restored from then on; a guest whose inputs changed (its kernel's
//! bytes here) gets an entry of its own, booted anew, and the old entry is not used; an
//! entry that no longer restores is made again.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tests::cache::{self, CachedBoot};
use tests::{guest_file, kvm_available, Scratch, Vm};

const BOOT: Duration = Duration::from_secs(60);

/// The state file's inode and modification time: a new file when an entry is made again.
fn identity(entry: &Path) -> (u64, i64, i64) {
    let m = std::fs::metadata(entry.join("state")).unwrap();
    (m.ino(), m.mtime(), m.mtime_nsec())
}

/// Removes what the test put in the cache, also when it fails.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
            let _ = std::fs::remove_file(p.with_extension("lock"));
        }
    }
}

#[test]
fn a_cached_guest_is_booted_once_restored_after_and_booted_again_when_its_inputs_change() {
    if !kvm_available("cache_rebuilds_on_changed_inputs") {
        return;
    }
    let scratch = Scratch::new("cache");
    let name = format!("test-cache-{}", std::process::id());
    // A kernel of this test's own, so that changing it changes nothing else.
    let kernel = scratch.path("tiny.elf");
    std::fs::copy(guest_file("tiny.elf"), &kernel).unwrap();
    let ready = |vm: &mut Vm| {
        vm.wait_console("tiny: beat 1\n", BOOT);
        vm.wait_api(BOOT);
        assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    };
    let args = |image: &str| -> Vec<String> {
        [
            "--kernel",
            image,
            "--mem-mib",
            "64",
            "--ap-boot",
            "direct",
            "--cmdline",
            "beat=20",
        ]
        .map(String::from)
        .to_vec()
    };
    let image_a = cache::image(&kernel);
    let args_a = args(&image_a);
    let args_a: Vec<&str> = args_a.iter().map(String::as_str).collect();
    let boot_a = CachedBoot {
        name: &name,
        run_args: &args_a,
        ready: &ready,
    };
    let entry_a = cache::entry(&boot_a);
    let mut cleanup = Cleanup(vec![entry_a.clone(), PathBuf::from(&image_a)]);
    assert!(
        !entry_a.exists(),
        "{} exists before the test",
        entry_a.display()
    );

    // The first use boots and saves it; the guest runs on from the snapshot.
    let restored_once = |boot: &CachedBoot<'_>, entry: &Path| {
        let s = Scratch::new("cache-use");
        let mut vm = cache::restored(&s, boot, &[], BOOT);
        let log = vm.stderr_text();
        assert!(
            log.contains(&format!("restored {}", entry.display())),
            "not restored from {}: {log}",
            entry.display()
        );
        // It runs on: two beats after the last one shown. Beats are numbered from the
        // guest's boot, not from this console (the guest may beat again between the
        // boot's `ready` and its pause), so the number is read, not counted.
        let text = vm.wait_console_line("tiny: beat ", BOOT);
        let last = (text.lines())
            .filter_map(|l| l.strip_prefix("tiny: beat ")?.parse::<u64>().ok())
            .max()
            .expect("a numbered beat");
        vm.wait_console(&format!("tiny: beat {}\n", last + 2), BOOT);
        vm.shutdown(BOOT);
    };
    restored_once(&boot_a, &entry_a);
    let made = identity(&entry_a);
    // The second is restored from the same entry, not booted again.
    restored_once(&boot_a, &entry_a);
    assert_eq!(identity(&entry_a), made, "the entry was made again");

    // Other kernel bytes (a byte past the end of the ELF file, which the loader never
    // reads): another image copy, another entry, booted anew; the old one is untouched.
    let mut bytes = std::fs::read(&kernel).unwrap();
    bytes.push(0);
    std::fs::write(&kernel, bytes).unwrap();
    let image_b = cache::image(&kernel);
    assert_ne!(image_a, image_b, "a changed file has the same cache copy");
    let args_b = args(&image_b);
    let args_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let boot_b = CachedBoot {
        name: &name,
        run_args: &args_b,
        ready: &ready,
    };
    let entry_b = cache::entry(&boot_b);
    cleanup.0.extend([entry_b.clone(), PathBuf::from(&image_b)]);
    assert_ne!(entry_a, entry_b, "changed inputs, same entry");
    assert!(!entry_b.exists());
    restored_once(&boot_b, &entry_b);
    assert!(entry_b.join("state").exists());
    assert_eq!(identity(&entry_a), made, "the old entry was touched");

    // Other arguments: another entry too.
    let mut args_c = args_b.clone();
    *args_c.last_mut().unwrap() = "beat=21";
    let boot_c = CachedBoot {
        name: &name,
        run_args: &args_c,
        ready: &ready,
    };
    assert_ne!(
        cache::entry(&boot_c),
        entry_b,
        "other arguments, same entry"
    );

    // An entry that no longer restores (its state file cut short) is made again.
    let state = entry_b.join("state");
    let len = std::fs::metadata(&state).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let broken = identity(&entry_b);
    restored_once(&boot_b, &entry_b);
    assert_ne!(
        identity(&entry_b),
        broken,
        "the broken entry was not made again"
    );
    let bytes = std::fs::read(&state).unwrap();
    let whole: Result<serde_json::Value, _> = clone::state_file::decode(&bytes, &state);
    assert!(
        whole.is_ok(),
        "the entry made again is not whole: {whole:?}"
    );
}
