//! Package sets (`forkvm::PackageCache`) from wheels this test builds itself (a
//! pure-Python one in two versions and one with a C extension, `pip wheel` of sources
//! written here), offline through a `--find-links` directory: the image holds what was
//! installed, the same requirements are one set and resolve from the cache without pip,
//! another version is another set, every error says why and leaves nothing behind, and
//! eviction keeps the cache to its budget without touching a held set. Needs the host's
//! pip, setuptools, Python headers and mkfs.ext4 (`scripts/install-deps.sh test`); no
//! KVM.

use std::path::Path;
use std::process::Command;

use forkvm::{PackageCache, PackageError, PackageSource};
use tests::wheels::{c_extension, pure};

/// The files in the image's root directory (`debugfs`, no mount needed).
fn listing(image: &Path) -> String {
    let out = Command::new("debugfs")
        .args(["-R", "ls -l /"])
        .arg(image)
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn reqs(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// What is left in the cache directory besides images and requirement records.
fn leftovers(dir: &Path) -> Vec<String> {
    (std::fs::read_dir(dir).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".ext4") && !n.starts_with("requirements-"))
        .collect()
}

#[tokio::test]
async fn requirements_become_one_cached_image_per_resolved_set() {
    let scratch = tests::Scratch::new("packages");
    let root = scratch.path("");
    let wheels = root.as_path().join("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    for v in ["1.0", "2.0"] {
        pure(root.as_path(), v, &wheels);
    }
    c_extension(root.as_path(), &wheels);
    // A wheel for another Python: refused by the tags, named in pip's error.
    let other = std::fs::read_dir(&wheels)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("fkvm_pure-1.0"))
        .unwrap()
        .path();
    std::fs::copy(
        &other,
        wheels.join("fkvm_new-1.0-cp312-cp312-linux_x86_64.whl"),
    )
    .unwrap();
    let source = PackageSource::FindLinks(wheels.clone());
    let dir = root.as_path().join("cache");
    let cache = PackageCache::new(&dir, 64 << 20).unwrap();

    let a = cache
        .resolve(&reqs(&["fkvm-pure==1.0", "fkvm-c"]), &source)
        .await
        .unwrap();
    assert!(a.built && !a.took.is_zero());
    assert_eq!(a.resolved, ["fkvm-c==1.0", "fkvm-pure==1.0"]);
    let files = listing(&a.image);
    assert!(files.contains("fkvm_pure.py"), "{files}");
    assert!(
        files.contains("fkvm_c.cpython-311-x86_64-linux-gnu.so"),
        "{files}"
    );
    assert_eq!(std::fs::metadata(&a.image).unwrap().len() % 512, 0);

    // The same requirements, in another order and twice over: the same set, from the
    // cache, without pip (its only source is gone).
    std::fs::rename(&wheels, root.as_path().join("moved")).unwrap();
    let again = cache
        .resolve(&reqs(&["fkvm-c", "fkvm-pure==1.0", "fkvm-c"]), &source)
        .await
        .unwrap();
    assert_eq!((again.key.as_str(), again.built), (a.key.as_str(), false));
    assert!(again.took.is_zero(), "no pip, no image");
    std::fs::rename(root.as_path().join("moved"), &wheels).unwrap();
    // Another version: its own set.
    let b = cache
        .resolve(&reqs(&["fkvm-pure==2.0"]), &source)
        .await
        .unwrap();
    assert_ne!(b.key, a.key);
    assert_eq!(b.resolved, ["fkvm-pure==2.0"]);

    // Errors say why, and leave no scratch directory or image.
    let images = || {
        (std::fs::read_dir(&dir).unwrap().flatten())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".ext4"))
            .count()
    };
    let before = images();
    for (list, says) in [
        (vec!["no-such-package"], "no-such-package"),
        (vec!["fkvm-new"], "fkvm-new"),
        (vec!["fkvm-pure==9.9"], "fkvm-pure==9.9"),
    ] {
        let e = cache.resolve(&reqs(&list), &source).await.unwrap_err();
        assert!(matches!(e, PackageError::Resolve(_)), "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
    for bad in ["-e .", "a b", "", "x\ny"] {
        let e = cache.resolve(&reqs(&[bad]), &source).await.unwrap_err();
        assert!(matches!(e, PackageError::Requirement(_)), "{bad:?}: {e}");
    }
    let tiny = PackageCache::new(root.as_path().join("tiny"), 1 << 20).unwrap();
    let e = tiny
        .resolve(&reqs(&["fkvm-pure==1.0"]), &source)
        .await
        .unwrap_err();
    assert!(matches!(e, PackageError::Budget { .. }), "{e}");
    assert_eq!(images(), before);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    assert!(leftovers(&root.as_path().join("tiny")).is_empty());

    // Eviction: a budget for about two images; the held one stays, the oldest other goes.
    let size = std::fs::metadata(&a.image).unwrap().len();
    let small = PackageCache::new(root.as_path().join("small"), size * 2 + size / 2).unwrap();
    let one = small
        .resolve(&reqs(&["fkvm-pure==1.0"]), &source)
        .await
        .unwrap();
    let _hold = small.hold(&one.key);
    let two = small
        .resolve(&reqs(&["fkvm-pure==2.0"]), &source)
        .await
        .unwrap();
    let three = small.resolve(&reqs(&["fkvm-c"]), &source).await.unwrap();
    assert!(one.image.exists(), "a held set is not evicted");
    assert!(!two.image.exists(), "the least recently used one went");
    assert!(three.image.exists());
}
