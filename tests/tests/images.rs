//! Images of directory trees (`forkvm::ImageCache`), what a clone gets in a disk slot:
//! built once per key with the tree's files, found again without building, refused
//! with the reason (a key that names no file, a tree larger than the budget, a tree
//! that is not there) leaving nothing behind, and kept to the budget by evicting the
//! least recently used image that nothing holds. Needs mkfs.ext4 and debugfs; no KVM.

use std::path::Path;
use std::process::Command;

use forkvm::{ImageCache, ImageError};

/// What `debugfs` shows of `path` in `image` (`cat`), or its listing for a directory.
fn debugfs(image: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", request])
        .arg(image)
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A tree of `kib` KiB of data in `dir`: a file, a subdirectory with one, a symlink.
fn tree(dir: &Path, kib: usize) {
    std::fs::create_dir_all(dir.join("etc")).unwrap();
    std::fs::write(dir.join("etc/hostname"), "forkvm\n").unwrap();
    std::fs::write(dir.join("data"), vec![b'x'; kib << 10]).unwrap();
    std::os::unix::fs::symlink("etc/hostname", dir.join("link")).unwrap();
}

/// Names in `dir` other than images.
fn leftovers(dir: &Path) -> Vec<String> {
    (std::fs::read_dir(dir).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".ext4"))
        .collect()
}

#[tokio::test]
async fn trees_become_cached_images_kept_to_a_budget() {
    let scratch = tests::Scratch::new("images");
    let (a, b, c) = (scratch.path("a"), scratch.path("b"), scratch.path("c"));
    for t in [&a, &b, &c] {
        tree(t, 64);
    }
    let dir = scratch.path("cache");
    // Room for one 9 MiB image (the file system's structures included), not two.
    let cache = ImageCache::new(&dir, 12 << 20).unwrap();

    let (image, built) = cache.build("sha256-aaaa", &a).await.unwrap();
    assert!(built);
    assert_eq!(image, dir.join("sha256-aaaa.ext4"));
    assert_eq!(debugfs(&image, "cat /etc/hostname"), "forkvm\n");
    assert!(debugfs(&image, "stat /link").contains("Type: symlink"));
    let listing = debugfs(&image, "ls -l /");
    assert!(
        listing.contains("data") && listing.contains(" 0      0 "),
        "{listing}"
    );
    // Found again, not built; `get` finds it too.
    let (again, built) = cache.build("sha256-aaaa", &b).await.unwrap();
    assert_eq!((again.as_path(), built), (image.as_path(), false));
    assert_eq!(cache.get("sha256-aaaa"), Some(image.clone()));
    assert_eq!(cache.get("sha256-none"), None);

    // Refusals, each leaving nothing behind.
    for bad in ["", ".hidden", "a/b", "../x", "a b"] {
        let e = cache.build(bad, &b).await.unwrap_err();
        assert!(matches!(e, ImageError::Key(_)), "{bad:?}: {e}");
    }
    let big = scratch.path("big");
    tree(&big, 16 << 10);
    let e = cache.build("big", &big).await.unwrap_err();
    assert!(matches!(e, ImageError::Budget { .. }), "{e}");
    let e = cache
        .build("gone", &scratch.path("nothing"))
        .await
        .unwrap_err();
    assert!(matches!(e, ImageError::Io { .. }), "{e}");
    assert!(e.to_string().contains("nothing"), "{e}");
    assert_eq!(leftovers(&dir), Vec::<String>::new());

    // Over the budget: a held image stays, one nothing holds goes (the least
    // recently used first), never the one just built.
    let hold = cache.hold("sha256-aaaa");
    cache.build("sha256-bbbb", &b).await.unwrap();
    assert!(
        cache.get("sha256-aaaa").is_some(),
        "held: kept over the budget"
    );
    drop(hold);
    cache.build("sha256-cccc", &c).await.unwrap();
    let mut left: Vec<String> = (std::fs::read_dir(&dir).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["sha256-cccc.ext4"]);
}
