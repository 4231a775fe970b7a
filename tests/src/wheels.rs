//! Wheels the package-set tests build themselves (no index is reached): `pip wheel` of
//! small projects written here, with the host's Debian Python 3.11 (the guest's).

use std::path::Path;
use std::process::Command;

/// `pip wheel` of a project with `files` (in `root/name`) into `wheels`.
pub fn wheel(root: &Path, name: &str, files: &[(&str, &str)], wheels: &Path) {
    let src = root.join(name);
    std::fs::create_dir_all(&src).unwrap();
    for (file, text) in files {
        std::fs::write(src.join(file), text).unwrap();
    }
    let out = Command::new(forkvm::DEFAULT_PYTHON)
        .args([
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
        ])
        .args(["--disable-pip-version-check", "--no-index", "-w"])
        .arg(wheels)
        .arg(&src)
        .output()
        .expect("python3 -m pip");
    assert!(
        out.status.success(),
        "pip wheel {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `fkvm-pure` `version`: a module `fkvm_pure` whose `VERSION` is `version`.
pub fn pure(root: &Path, version: &str, wheels: &Path) {
    let setup = format!(
        "from setuptools import setup\nsetup(name='fkvm-pure', version='{version}', py_modules=['fkvm_pure'])\n"
    );
    let module = format!("VERSION = '{version}'\n");
    let files = [
        ("setup.py", setup.as_str()),
        ("fkvm_pure.py", module.as_str()),
    ];
    wheel(root, &format!("pure-{version}"), &files, wheels);
}

/// `fkvm-c` 1.0: a C extension module `fkvm_c` whose `answer()` returns 42.
pub fn c_extension(root: &Path, wheels: &Path) {
    let setup = "from setuptools import setup, Extension\nsetup(name='fkvm-c', version='1.0', ext_modules=[Extension('fkvm_c', ['fkvm_c.c'])])\n";
    let source = r#"#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "fkvm_c", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fkvm_c(void) { return PyModule_Create(&m); }
"#;
    wheel(
        root,
        "c",
        &[("setup.py", setup), ("fkvm_c.c", source)],
        wheels,
    );
}
