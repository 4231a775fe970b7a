/*
 * forkvm-oci.h: forkvm-oci's work as one function, oci_main(), for the tool
 * (forkvm-oci.c) and for forkvm-agent, which runs it in the process it forked for a
 * streamed command whose first word is forkvm-oci, without executing the tool (an exec
 * costs a few hundred milliseconds in the PVM host's emulated guest kernel).
 *
 * forkvm-oci: runs a container's process in this VM, on a root file system in a disk
 * slot (the in-guest half of running OCI containers in clones; docs/guest-abi.md).
 *
 *   forkvm-oci [--slot N] [--readonly] [--timeout-s S] [--hostname NAME] [--cwd DIR]
 *              [--user UID:GID] [--env NAME=VALUE]... -- PROGRAM [ARG]...
 *
 * Waits up to S seconds (default 30) for disk slot N's medium (default slot 0; the
 * device whose serial is forkvm-slotN) to show its capacity, mounts its ext4 file
 * system at /run/forkvm/rootfs<N> (noatime; already mounted, by an earlier forkvm-oci of
 * the same container or in the image's template, it is used as it is, and the slot is
 * not looked at), and in it proc,
 * sysfs (read-only) and the guest's /dev (a bind mount); sets the hostname; changes
 * root into it; drops to UID:GID (default 0:0) with no supplementary groups; replaces
 * the environment with the --env values (PATH, unless given, the OCI default); changes
 * to DIR (default /); and executes PROGRAM, looked up on that PATH. Its exit status is
 * forkvm-oci's. A failure before the exec prints "forkvm-oci: WHAT: WHY" and exits 125;
 * a PROGRAM that is not found exits 127, one that cannot be executed 126 (as a shell).
 * With --prepare it stops after the mounts: it makes the mount points --tmpfs and
 * --mqueue name that the root file system lacks (printing "made DIR" for each) and
 * mounts those file systems there ("mounted tmpfs DIR", "mounted mqueue DIR"), reads
 * PROGRAM (found on PATH in the root file system) and its interpreter into the page
 * cache, writes what it changed to the disk, and exits 0, so that a snapshot of this
 * VM has the root file system mounted, with the container's mounts, and the program
 * warm for its clones (each clone's tmpfs is its own copy, empty). For a container of
 * that image whose mounts differ, --umount DIR (repeated) unmounts such a mount and
 * --rmdir DIR (repeated) removes such a directory again, if it is empty, before the
 * mounts.
 *
 * --tmpfs DIR (repeated) mounts a tmpfs at DIR in the root file system, and --file
 * PATH=HEX (repeated) writes the bytes HEX encodes to PATH in it, its directories made:
 * the OCI spec's tmpfs mounts and the host files it binds in (the CRI's hosts,
 * hostname and resolv.conf), for a container's first process.
 *
 * --unpack reads an archive from its input, after changing root and before dropping
 * to UID:GID, and makes what it lists in the root file system: the host directories
 * and larger files the spec binds in (volumes), copied. Each entry is a 16-byte head
 * (a kind byte, 3 zero bytes, then the mode, the path's length and the data's length
 * as little-endian 32-bit numbers), the path (absolute, in the container) and the
 * data: kind 'D' a directory (its parents made), 'F' a file of the data's bytes, 'L' a
 * symbolic link to the data, 'E' the end. Symbolic links in the paths resolve inside
 * the container. The input is read exactly to the end entry: what follows it is
 * PROGRAM's input.
 *
 * --cgroup FILE=VALUE (repeated) puts the container in a cgroup of its own, the guest's
 * cgroup v2 group forkvm-slot<N> (cgroup2 mounted at /sys/fs/cgroup if it is not, the
 * controller FILE names enabled for the root's children), and writes VALUE to its
 * FILE: the spec's limits inside the guest, as pids.max=N. A later forkvm-oci of the
 * same slot (an exec'd process) joins that group when it exists, so the limits count
 * it too. A guest kernel without the controller fails the start with the reason.
 * --mqueue DIR mounts the guest's POSIX message queue file system at DIR (the spec's
 * mqueue mount, /dev/mqueue).
 *
 * --ro PATH and --rw PATH (repeated; paths in the container, after the unpacking) make
 * PATH a mount of its own (bound onto itself), read-only or writable: the spec's mount
 * options for what was copied in. --readonly then makes the root file system's mount
 * read-only (the spec's root.readonly): the mounts above keep their own flags, and the
 * medium itself stays writable for the container's other mounts of it.
 *
 *   forkvm-oci [--slot N] --release
 *
 * Kills what is left in slot N's cgroup (if it has one) and removes the group, and
 * unmounts slot N's root file system and everything under it (lazily: what a process
 * still holds goes when it lets go), so that the slot's medium can be ejected and
 * another inserted (a pod's container that ended). Nothing mounted is no error.
 */
#ifndef FORKVM_OCI_H
#define FORKVM_OCI_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <elf.h>
#include <fcntl.h>
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "forkvm-file.h"

#define OCI_MAX_MOUNTS 32
#define OCI_DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define OCI_MAX_ENV 256
#define OCI_MAX_CGROUP 8
#define OCI_CGROUP_FS "/sys/fs/cgroup"
#define OCI_CGROUP2_MAGIC 0x63677270

static void oci_fail(const char *what, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "forkvm-oci: %s: ", what);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(125);
}

static void oci_usage(void)
{
    fprintf(stderr, "usage: forkvm-oci [--slot N] [--readonly] [--prepare] [--timeout-s S] "
                    "[--hostname NAME] [--cwd DIR] [--user UID:GID] [--env NAME=VALUE]... "
                    "[--tmpfs DIR]... [--file PATH=HEX]... [--unpack] [--ro PATH]... "
                    "[--rw PATH]... [--cgroup FILE=VALUE]... [--mqueue DIR] [--umount DIR]... "
                    "[--rmdir DIR]... "
                    "-- PROGRAM [ARG]...\n"
                    "       forkvm-oci [--slot N] --release\n");
    exit(125);
}

/* The first line of file `path` into `buf` (newline removed); -1 if unreadable. */
static int oci_read_line(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    char *got = fgets(buf, (int)len, f);
    fclose(f);
    if (!got)
        return -1;
    buf[strcspn(buf, "\n")] = 0;
    return 0;
}

/* Where the block device of disk slot N is recorded: /run/forkvm/slot<N>. */
#define OCI_SLOT_MAP "/run/forkvm/slot%d"

/* Reads every block device's serial and records the device of each disk slot (its
 * serial forkvm-slot<N>) in /run/forkvm/slot<N>. Reading a serial is a request to the
 * device, tens of milliseconds each in an emulated guest kernel; the devices do not
 * change after boot, so the agent does this once as it starts, and every clone of the
 * VM finds the map made. Returns how many slots it found. */
static inline int oci_map_slots(void)
{
    char path[PATH_MAX], serial[64];
    DIR *d = opendir("/sys/block");
    if (!d)
        return 0;
    if (mkdir("/run/forkvm", 0755) != 0 && errno != EEXIST) {
        closedir(d);
        return 0;
    }
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)) != NULL) {
        int slot;
        char end;
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
        if (oci_read_line(path, serial, sizeof serial) != 0 ||
            sscanf(serial, "forkvm-slot%d%c", &slot, &end) != 1 || slot < 0 || slot > 7)
            continue;
        snprintf(path, sizeof path, OCI_SLOT_MAP, slot);
        FILE *f = fopen(path, "we");
        if (f) {
            fprintf(f, "%s\n", e->d_name);
            found += fclose(f) == 0;
        }
    }
    closedir(d);
    return found;
}

/* The block device (name in /sys/block) whose serial is forkvm-slot<slot>: from the
 * map the agent made, else found by reading the devices' serials. */
static int oci_find_slot(int slot, char *dev, size_t len)
{
    char want[32], path[PATH_MAX], serial[64];
    snprintf(path, sizeof path, OCI_SLOT_MAP, slot);
    if (oci_read_line(path, serial, sizeof serial) == 0 && serial[0] && !strchr(serial, '/')) {
        snprintf(dev, len, "%s", serial);
        return 0;
    }
    snprintf(want, sizeof want, "forkvm-slot%d", slot);
    DIR *d = opendir("/sys/block");
    if (!d)
        oci_fail("/sys/block", "%s", strerror(errno));
    struct dirent *e;
    int found = -1;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
        if (oci_read_line(path, serial, sizeof serial) == 0 && strcmp(serial, want) == 0) {
            snprintf(dev, len, "%s", e->d_name);
            found = 0;
            break;
        }
    }
    closedir(d);
    return found;
}

/* Mounts `source` on `target` (options `data`, may be NULL) unless that is done
 * already (EBUSY). */
static void oci_mount_once(const char *source, const char *target, const char *type,
                           unsigned long flags, const char *data)
{
    if (mkdir(target, 0755) != 0 && errno != EEXIST)
        oci_fail(target, "cannot make the mount point: %s", strerror(errno));
    if (mount(source, target, type, flags, data) != 0 && errno != EBUSY)
        oci_fail(target, "cannot mount %s: %s", source, strerror(errno));
}

/* Reads file `path` to its end (into the page cache); returns its first bytes in
 * `head` (len bytes at most) and how many, or -1 if unreadable. */
static ssize_t oci_read_all(const char *path, char *head, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    static char buf[1 << 16];
    ssize_t first = -1, n;
    while ((n = read(fd, buf, sizeof buf)) > 0) {
        if (first < 0) {
            first = n < (ssize_t)len ? n : (ssize_t)len;
            for (ssize_t k = 0; k < first; k++)
                head[k] = buf[k];
        }
    }
    close(fd);
    return first < 0 ? 0 : first;
}

/* The file program `prog` is, as the root file system at `root` ("" once changed
 * into) would run it, into `file`: `prog` itself if it has a slash, else the first
 * regular file with an execute bit that `prog` names in a directory of PATH (from
 * `env`, the OCI default without). Returns 0, or -1 (ENOENT) if none. A stat per
 * directory, where an exec tried in each (execvp) would make and free a process's
 * address space for every miss: milliseconds each in an emulated guest kernel. */
static int oci_lookup(const char *root, const char *prog, char **env, char *file, size_t len)
{
    const char *path = OCI_DEFAULT_PATH;
    for (int k = 0; env[k]; k++)
        if (strncmp(env[k], "PATH=", 5) == 0)
            path = env[k] + 5;
    if (strchr(prog, '/')) {
        snprintf(file, len, "%s%s%s", root, prog[0] == '/' || !root[0] ? "" : "/", prog);
        return 0;
    }
    for (const char *p = path; *p;) {
        size_t n = strcspn(p, ":");
        struct stat st;
        /* An empty entry is the working directory, as execvp reads it. */
        snprintf(file, len, "%s%.*s/%s", root, (int)n, n ? p : ".", prog);
        if (stat(file, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0111))
            return 0;
        p += n + (p[n] == ':');
    }
    errno = ENOENT;
    return -1;
}

/* Warms the guest's page cache with program `prog` as the root file system at `root`
 * would run it: the file PATH (from `env`) finds, and its interpreter (an ELF's
 * PT_INTERP, a script's #! line), so that a clone of this VM runs it without reading
 * its disk. Nothing found is no error. */
static void oci_warm(const char *root, const char *prog, char **env)
{
    char file[PATH_MAX];
    char head[4096];
    ssize_t got = -1;
    if (oci_lookup(root, prog, env, file, sizeof file) == 0)
        got = oci_read_all(file, head, sizeof head);
    char interp[PATH_MAX] = "";
    if (got > 2 && head[0] == '#' && head[1] == '!') {
        size_t k = 2, o = 0;
        while (k < (size_t)got && head[k] == ' ')
            k++;
        while (k < (size_t)got && o + 1 < sizeof interp && head[k] != ' ' && head[k] != '\n')
            interp[o++] = head[k++];
        interp[o] = 0;
    } else if (got >= (ssize_t)sizeof(Elf64_Ehdr) && memcmp(head, ELFMAG, SELFMAG) == 0) {
        Elf64_Ehdr eh;
        memcpy(&eh, head, sizeof eh);
        for (int k = 0; k < eh.e_phnum; k++) {
            size_t at = eh.e_phoff + (size_t)k * eh.e_phentsize;
            if (at + sizeof(Elf64_Phdr) > (size_t)got)
                break;
            Elf64_Phdr ph;
            memcpy(&ph, head + at, sizeof ph);
            if (ph.p_type != PT_INTERP || ph.p_offset + ph.p_filesz > (size_t)got ||
                ph.p_filesz >= sizeof interp)
                continue;
            memcpy(interp, head + ph.p_offset, ph.p_filesz);
            interp[ph.p_filesz] = 0;
        }
    }
    if (interp[0] == '/') {
        snprintf(file, sizeof file, "%s%s", root, interp);
        oci_read_all(file, head, sizeof head);
    }
}

/* Whether `path` is absolute with no ".." component. */
static int oci_path_ok(const char *path, size_t len)
{
    if (len == 0 || path[0] != '/')
        return 0;
    for (size_t k = 0; k + 1 < len; k++)
        if (path[k] == '/' && path[k + 1] == '.' && (k + 2 >= len || path[k + 2] == '.') &&
            (k + 3 >= len || path[k + 3] == '/'))
            return 0;
    return 1;
}

/* Makes directory `path` and its parents; ones that exist are fine. The parents only
 * when the directory itself cannot be made for want of them. */
static void oci_mkdirs(char *path)
{
    if (mkdir(path, 0755) == 0 || errno != ENOENT)
        return;
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        mkdir(path, 0755);
        *p = '/';
    }
    mkdir(path, 0755);
}

/* A container's tmpfs mounted at `path`: 0, or -1 (errno). */
static int oci_tmpfs(const char *path)
{
    return mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
}

/* The guest's POSIX message queues mounted at `path`: 0, or -1 (errno). */
static int oci_mqueue(const char *path)
{
    return mount("mqueue", path, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

static int oci_hex(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Writes all `len` bytes of `buf` to `fd`, the file `path` (for option `what`'s error). */
static void oci_write_all(int fd, const char *buf, size_t len, const char *what, const char *path)
{
    for (size_t done = 0; done < len;) {
        ssize_t n = write(fd, buf + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            oci_fail(what, "%s: %s", path, strerror(errno));
        done += (size_t)n;
    }
}

/* Writes --file PATH=HEX under `root`. */
static void oci_put_file(const char *root, const char *arg)
{
    const char *eq = strchr(arg, '=');
    if (!eq || !oci_path_ok(arg, (size_t)(eq - arg)) || strlen(eq + 1) % 2)
        oci_fail("--file", "%.64s is not /PATH=HEX", arg);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s%.*s", root, (int)(eq - arg), arg);
    char *slash = strrchr(path, '/');
    *slash = 0;
    oci_mkdirs(path);
    *slash = '/';
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        oci_fail("--file", "%s: %s", path, strerror(errno));
    static char buf[4096];
    size_t k = 0;
    for (const char *h = eq + 1; *h; h += 2) {
        int hi = oci_hex(h[0]), lo = oci_hex(h[1]);
        if (hi < 0 || lo < 0)
            oci_fail("--file", "%s: the content is not lower-case hex", path);
        buf[k++] = (char)(hi << 4 | lo);
        if (k == sizeof buf || !h[2]) {
            oci_write_all(fd, buf, k, "--file", path);
            k = 0;
        }
    }
    close(fd);
}

/* Reads exactly `len` bytes of the input into `buf`. */
static void oci_read_input(void *buf, size_t len)
{
    for (size_t done = 0; done < len;) {
        ssize_t n = read(0, (char *)buf + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            oci_fail("--unpack", "the archive ended early: %s", n < 0 ? strerror(errno) : "EOF");
        done += (size_t)n;
    }
}

/* --unpack: the archive on the input, made in the (already changed) root. */
static void oci_unpack(void)
{
    static char buf[65536];
    for (;;) {
        unsigned char head[16];
        oci_read_input(head, sizeof head);
        unsigned int v[3];
        for (int k = 0; k < 3; k++)
            v[k] = (unsigned)head[4 + 4 * k] | (unsigned)head[5 + 4 * k] << 8 |
                   (unsigned)head[6 + 4 * k] << 16 | (unsigned)head[7 + 4 * k] << 24;
        unsigned int mode = v[0] & 07777, plen = v[1], dlen = v[2];
        char kind = (char)head[0];
        if (kind == 'E')
            return;
        char path[PATH_MAX];
        if (plen == 0 || plen >= sizeof path)
            oci_fail("--unpack", "an entry's path of %u bytes", plen);
        oci_read_input(path, plen);
        path[plen] = 0;
        if (!oci_path_ok(path, plen) || strlen(path) != plen)
            oci_fail("--unpack", "%.64s is no absolute path", path);
        char *slash = strrchr(path, '/');
        if (slash != path) {
            *slash = 0;
            oci_mkdirs(path);
            *slash = '/';
        }
        if (kind == 'D') {
            if (dlen)
                oci_fail("--unpack", "%s: a directory with data", path);
            if ((mkdir(path, mode) != 0 && errno != EEXIST) || chmod(path, mode) != 0)
                oci_fail("--unpack", "%s: %s", path, strerror(errno));
        } else if (kind == 'L') {
            char target[PATH_MAX];
            if (dlen == 0 || dlen >= sizeof target)
                oci_fail("--unpack", "%s: a link target of %u bytes", path, dlen);
            oci_read_input(target, dlen);
            target[dlen] = 0;
            unlink(path);
            if (symlink(target, path) != 0)
                oci_fail("--unpack", "%s: %s", path, strerror(errno));
        } else if (kind == 'F') {
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
            if (fd < 0 || fchmod(fd, mode) != 0)
                oci_fail("--unpack", "%s: %s", path, strerror(errno));
            for (unsigned int left = dlen; left > 0;) {
                size_t n = left < sizeof buf ? left : sizeof buf;
                oci_read_input(buf, n);
                oci_write_all(fd, buf, n, "--unpack", path);
                left -= (unsigned int)n;
            }
            close(fd);
        } else {
            oci_fail("--unpack", "an entry of kind %d", head[0]);
        }
    }
}

/* Makes `path` (in the root file system, which is the process's root now) a mount of its
 * own, read-only if `ro`. */
static void oci_bind(const char *path, int ro)
{
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0)
        oci_fail(ro ? "--ro" : "--rw", "%s: %s", path, strerror(errno));
    if (ro && mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) != 0)
        oci_fail("--ro", "%s: %s", path, strerror(errno));
}

/* Slot `slot`'s cgroup directory into `dir`; whether cgroup v2 is mounted there. */
static int oci_cgroup_dir(int slot, char *dir, size_t len)
{
    struct statfs fs;
    snprintf(dir, len, OCI_CGROUP_FS "/forkvm-slot%d", slot);
    return statfs(OCI_CGROUP_FS, &fs) == 0 && fs.f_type == OCI_CGROUP2_MAGIC;
}

/* Whether slot `slot` has a cgroup (its directory into `dir`). */
static int oci_cgroup_found(int slot, char *dir, size_t len)
{
    return oci_cgroup_dir(slot, dir, len) && access(dir, F_OK) == 0;
}

/* This process into the cgroup at `dir` (`what`: the step an error names). */
static void oci_cgroup_enter(const char *dir, const char *what)
{
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/cgroup.procs", dir);
    if (forkvm_write_file(path, "0") != 0)
        oci_fail(what, "%s: %s", path, strerror(errno));
}

/* --cgroup: slot `slot`'s cgroup made with `n` FILE=VALUE settings, and this process in
 * it. */
static void oci_cgroup_make(int slot, const char **set, int n)
{
    char dir[PATH_MAX], path[PATH_MAX + 64], ctl[32];
    if (!oci_cgroup_dir(slot, dir, sizeof dir) &&
        mount("cgroup2", OCI_CGROUP_FS, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        oci_fail("--cgroup", "cannot mount cgroup2 at " OCI_CGROUP_FS " (a guest kernel "
                 "without CONFIG_CGROUPS?): %s", strerror(errno));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        oci_fail("--cgroup", "%s: %s", dir, strerror(errno));
    for (int k = 0; k < n; k++) {
        const char *eq = strchr(set[k], '=');
        size_t dot = strcspn(set[k], ".");
        snprintf(ctl, sizeof ctl, "+%.*s", (int)(dot < sizeof ctl - 2 ? dot : sizeof ctl - 2),
                 set[k]);
        if (forkvm_write_file(OCI_CGROUP_FS "/cgroup.subtree_control", ctl) != 0)
            oci_fail("--cgroup", "%s: the guest kernel has no %s controller: %s", set[k],
                     ctl + 1, strerror(errno));
        snprintf(path, sizeof path, "%s/%.*s", dir, (int)(eq - set[k]), set[k]);
        if (forkvm_write_file(path, eq + 1) != 0)
            oci_fail("--cgroup", "%s: %s", set[k], strerror(errno));
    }
    oci_cgroup_enter(dir, "--cgroup");
}

/* An exec'd process of slot `slot`: into the slot's cgroup, if the container has one. */
static void oci_cgroup_join(int slot)
{
    char dir[PATH_MAX];
    if (oci_cgroup_found(slot, dir, sizeof dir))
        oci_cgroup_enter(dir, "cgroup");
}

/* --release: what is left in slot `slot`'s cgroup killed, and the group removed (once
 * its processes have exited: up to a second). */
static void oci_cgroup_remove(int slot)
{
    char dir[PATH_MAX], path[PATH_MAX + 64];
    if (!oci_cgroup_found(slot, dir, sizeof dir))
        return;
    snprintf(path, sizeof path, "%s/cgroup.kill", dir);
    if (forkvm_write_file(path, "1") != 0)
        oci_fail("release", "%s: %s", path, strerror(errno));
    for (int waited_ms = 0; rmdir(dir) != 0; waited_ms += 10) {
        if (errno != EBUSY || waited_ms >= 1000)
            oci_fail("release", "%s: %s", dir, strerror(errno));
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static int oci_main(int argc, char **argv)
{
    int slot = 0, readonly = 0, prepare = 0, release = 0, unpack = 0, timeout_s = 30, nenv = 0;
    int have_path = 0;
    const char *hostname = NULL, *cwd = "/", *mqueue = NULL;
    const char *cgroup[OCI_MAX_CGROUP];
    int ncgroup = 0;
    unsigned long uid = 0, gid = 0;
    char *env[OCI_MAX_ENV + 2];
    const char *tmpfs[OCI_MAX_MOUNTS], *files[OCI_MAX_MOUNTS], *binds[2 * OCI_MAX_MOUNTS];
    int ntmpfs = 0, nfiles = 0, nbinds = 0, bind_ro[2 * OCI_MAX_MOUNTS];
    const char *rmdirs[OCI_MAX_MOUNTS], *umounts[OCI_MAX_MOUNTS];
    int nrmdir = 0, numount = 0;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strcmp(a, "--readonly") == 0) {
            readonly = 1;
            continue;
        } else if (strcmp(a, "--prepare") == 0) {
            prepare = 1;
            continue;
        } else if (strcmp(a, "--release") == 0) {
            release = 1;
            continue;
        } else if (strcmp(a, "--unpack") == 0) {
            unpack = 1;
            continue;
        }
        if (!v)
            oci_usage();
        i++;
        char *end;
        if (strcmp(a, "--slot") == 0) {
            slot = (int)strtol(v, &end, 10);
            if (*end || slot < 0 || slot > 7)
                oci_fail("--slot", "%s is no disk slot (0 to 7)", v);
        } else if (strcmp(a, "--timeout-s") == 0) {
            timeout_s = (int)strtol(v, &end, 10);
            if (*end || timeout_s < 0)
                oci_fail("--timeout-s", "%s is no number of seconds", v);
        } else if (strcmp(a, "--hostname") == 0) {
            hostname = v;
        } else if (strcmp(a, "--cwd") == 0) {
            cwd = v;
        } else if (strcmp(a, "--user") == 0) {
            uid = strtoul(v, &end, 10);
            if (*end != ':' || end == v)
                oci_fail("--user", "%s is not UID:GID", v);
            const char *g = end + 1;
            gid = strtoul(g, &end, 10);
            if (*end || end == g)
                oci_fail("--user", "%s is not UID:GID", v);
        } else if (strcmp(a, "--tmpfs") == 0) {
            if (!oci_path_ok(v, strlen(v)) || ntmpfs == OCI_MAX_MOUNTS)
                oci_fail("--tmpfs", "%s is no absolute path, or one too many", v);
            tmpfs[ntmpfs++] = v;
        } else if (strcmp(a, "--umount") == 0) {
            if (!oci_path_ok(v, strlen(v)) || numount == OCI_MAX_MOUNTS)
                oci_fail("--umount", "%s is no absolute path, or one too many", v);
            umounts[numount++] = v;
        } else if (strcmp(a, "--rmdir") == 0) {
            if (!oci_path_ok(v, strlen(v)) || nrmdir == OCI_MAX_MOUNTS)
                oci_fail("--rmdir", "%s is no absolute path, or one too many", v);
            rmdirs[nrmdir++] = v;
        } else if (strcmp(a, "--ro") == 0 || strcmp(a, "--rw") == 0) {
            if (!oci_path_ok(v, strlen(v)) || nbinds == 2 * OCI_MAX_MOUNTS)
                oci_fail(a, "%s is no absolute path, or one too many", v);
            bind_ro[nbinds] = a[3] == 'o';
            binds[nbinds++] = v;
        } else if (strcmp(a, "--cgroup") == 0) {
            const char *eq = strchr(v, '=');
            size_t name = eq ? (size_t)(eq - v) : 0;
            if (!eq || name == 0 || name > 64 || memchr(v, '/', name) || v[0] == '.' ||
                !memchr(v, '.', name))
                oci_fail("--cgroup", "%s is not FILE=VALUE (as pids.max=64)", v);
            if (ncgroup == OCI_MAX_CGROUP)
                oci_fail("--cgroup", "more than %d settings", OCI_MAX_CGROUP);
            cgroup[ncgroup++] = v;
        } else if (strcmp(a, "--mqueue") == 0) {
            if (!oci_path_ok(v, strlen(v)))
                oci_fail("--mqueue", "%s is no absolute path", v);
            mqueue = v;
        } else if (strcmp(a, "--file") == 0) {
            if (nfiles == OCI_MAX_MOUNTS)
                oci_fail("--file", "more than %d files", OCI_MAX_MOUNTS);
            files[nfiles++] = v;
        } else if (strcmp(a, "--env") == 0) {
            if (!strchr(v, '=') || v[0] == '=')
                oci_fail("--env", "%s is not NAME=VALUE", v);
            if (nenv == OCI_MAX_ENV)
                oci_fail("--env", "more than %d variables", OCI_MAX_ENV);
            have_path |= strncmp(v, "PATH=", 5) == 0;
            env[nenv++] = (char *)v;
        } else {
            oci_usage();
        }
    }
    if (release) {
        oci_cgroup_remove(slot);
        char root[64];
        snprintf(root, sizeof root, "/run/forkvm/rootfs%d", slot);
        /* Detaching the root detaches its proc, sysfs and /dev mounts with it. */
        if (umount2(root, MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
            oci_fail("release", "%s: %s", root, strerror(errno));
        return 0;
    }
    if (i >= argc)
        oci_usage();
    if (!have_path)
        env[nenv++] = "PATH=" OCI_DEFAULT_PATH;
    env[nenv] = NULL;

    /* Mounted already (by an earlier forkvm-oci of this container, or in the image's
     * template): used as it is, with no look at the slot, its device or the mounts, each
     * a system call or a few in an emulated guest kernel. */
    char root[64], sub[PATH_MAX];
    snprintf(root, sizeof root, "/run/forkvm/rootfs%d", slot);
    snprintf(sub, sizeof sub, "%s/proc/self", root);
    if (access(sub, F_OK) != 0) {
        /* The slot's device, once the guest's driver has read the medium's capacity. */
        char dev[NAME_MAX + 1], path[PATH_MAX], size[32], device[NAME_MAX + 8];
        if (oci_find_slot(slot, dev, sizeof dev) != 0)
            oci_fail("disk slot", "the VM has no disk slot %d (vmm run --disk-slots)", slot);
        snprintf(path, sizeof path, "/sys/block/%s/size", dev);
        for (int waited_ms = 0;; waited_ms += 10) {
            if (oci_read_line(path, size, sizeof size) == 0 && strtoull(size, NULL, 10) > 0)
                break;
            if (waited_ms >= timeout_s * 1000)
                oci_fail("disk slot", "slot %d is empty after %d s (insert the root file "
                                      "system with the clone request: media)", slot, timeout_s);
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (mkdir("/run/forkvm", 0755) != 0 && errno != EEXIST)
            oci_fail("/run/forkvm", "%s", strerror(errno));
        snprintf(device, sizeof device, "/dev/%s", dev);
        /* No block bitmaps read ahead in the background: in an image's template that
         * work was left to every clone (ext4's lazy-init thread, tens of thousands of
         * emulated instructions each); a bitmap is read when a block is allocated. */
        oci_mount_once(device, root, "ext4", MS_NOATIME, "no_prefetch_block_bitmaps");
        snprintf(sub, sizeof sub, "%s/proc", root);
        oci_mount_once("proc", sub, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
        snprintf(sub, sizeof sub, "%s/sys", root);
        oci_mount_once("sysfs", sub, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       NULL);
        snprintf(sub, sizeof sub, "%s/dev", root);
        oci_mount_once("/dev", sub, NULL, MS_BIND | MS_REC, NULL);
    }
    if (prepare) {
        /* The mount points the container will need, made here once for every clone
         * (a directory made on ext4 is tens of thousands of emulated instructions);
         * each one made is printed, so the host can have it removed again for a
         * container that does not mount there (--rmdir). */
        for (int k = 0; k < ntmpfs + (mqueue != NULL); k++) {
            const char *dir = k < ntmpfs ? tmpfs[k] : mqueue;
            snprintf(sub, sizeof sub, "%s%s", root, dir);
            struct stat st;
            if (lstat(sub, &st) != 0) {
                oci_mkdirs(sub);
                if (lstat(sub, &st) == 0 && S_ISDIR(st.st_mode))
                    printf("made %s\n", dir);
            }
            /* Mounted too: each clone has its own copy of what a file system of the
             * guest's memory holds, empty here, so it is the container's own (a mount
             * is tens of thousands of emulated instructions). Printed, so that the
             * host can leave it out of a container that mounts it too, and have it
             * unmounted (--umount) for one that does not. */
            int done = k < ntmpfs ? oci_tmpfs(sub) : oci_mqueue(sub);
            if (done == 0)
                printf("mounted %s %s\n", k < ntmpfs ? "tmpfs" : "mqueue", dir);
        }
        oci_warm(root, argv[i], env);
        /* What mounting and making wrote reaches the disk now, not in each clone. */
        int fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0 || syncfs(fd) != 0)
            oci_fail("--prepare", "syncing %s: %s", root, strerror(errno));
        close(fd);
        fflush(stdout);
        return 0;
    }
    /* What the image's template mounted and made that this container does not mount
     * (empty directories the image does not have): unmounted and removed. */
    for (int k = 0; k < numount; k++) {
        snprintf(sub, sizeof sub, "%s%s", root, umounts[k]);
        if (umount2(sub, MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
            oci_fail("--umount", "%s: %s", sub, strerror(errno));
    }
    for (int k = 0; k < nrmdir; k++) {
        snprintf(sub, sizeof sub, "%s%s", root, rmdirs[k]);
        if (rmdir(sub) != 0 && errno != ENOENT && errno != ENOTEMPTY && errno != EEXIST)
            oci_fail("--rmdir", "%s: %s", sub, strerror(errno));
    }
    if (ncgroup)
        oci_cgroup_make(slot, cgroup, ncgroup);
    else
        oci_cgroup_join(slot);
    for (int k = 0; k < ntmpfs; k++) {
        snprintf(sub, sizeof sub, "%s%s", root, tmpfs[k]);
        oci_mkdirs(sub);
        if (oci_tmpfs(sub) != 0)
            oci_fail("--tmpfs", "%s: %s", sub, strerror(errno));
    }
    for (int k = 0; k < nfiles; k++)
        oci_put_file(root, files[k]);
    if (mqueue) {
        snprintf(sub, sizeof sub, "%s%s", root, mqueue);
        oci_mkdirs(sub);
        if (oci_mqueue(sub) != 0)
            oci_fail("--mqueue", "%s: %s (a guest kernel without CONFIG_POSIX_MQUEUE?)", sub,
                     strerror(errno));
    }
    if (hostname && sethostname(hostname, strlen(hostname)) != 0)
        oci_fail("hostname", "%s", strerror(errno));
    if (chdir(root) != 0 || chroot(".") != 0 || chdir("/") != 0)
        oci_fail("chroot", "%s: %s", root, strerror(errno));
    if (unpack)
        oci_unpack();
    for (int k = 0; k < nbinds; k++)
        oci_bind(binds[k], bind_ro[k]);
    /* Per mount: the medium's other mounts (a pod's later processes) are not affected. */
    if (readonly && mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) != 0)
        oci_fail("--readonly", "%s", strerror(errno));
    if (setgroups(0, NULL) != 0 || setgid((gid_t)gid) != 0 || setuid((uid_t)uid) != 0)
        oci_fail("user", "%lu:%lu: %s", uid, gid, strerror(errno));
    if (chdir(cwd) != 0)
        oci_fail("cwd", "%s: %s", cwd, strerror(errno));
    if (clearenv() != 0)
        oci_fail("env", "cannot clear the environment");
    for (int k = 0; env[k]; k++)
        if (putenv(env[k]) != 0)
            oci_fail("env", "%s: %s", env[k], strerror(errno));
    char file[PATH_MAX];
    if (oci_lookup("", argv[i], env, file, sizeof file) == 0) {
        execv(file, &argv[i]);
        /* What execvp would do further: a file with no #! line run by the shell, or
         * a later directory of PATH tried. */
        if (errno == ENOEXEC || errno == EACCES)
            execvp(argv[i], &argv[i]);
    }
    int e = errno;
    fprintf(stderr, "forkvm-oci: %s: %s\n", argv[i], strerror(e));
    return e == ENOENT ? 127 : 126;
}

#endif
