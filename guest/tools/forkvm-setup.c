/*
 * forkvm-setup: the guest init's first steps in one process (guest/init/init), where
 * each was a busybox process of its own: on a PVM host a process start is guest kernel
 * work in the instruction emulator, about a second each.
 *
 *   forkvm-setup    mounts /proc, /sys, /dev (devtmpfs), /dev/pts, /tmp and /run
 *                   (tmpfs), names the host "forkvm", sets the wall clock from the
 *                   VMM's host clock port as `forkvm-clone --sync-clock` does (a
 *                   slow-booting kernel comes up with its clock behind), and mounts
 *                   the data disk /dev/vda read-only at /mnt/disk when there is one
 *                   and it is not the root already
 *
 * Running it again is safe (init does, when it died by SIGSEGV: docs/guest-kernel.md,
 * "Known host problems"): the data disk, mounted already, is left as it is (EBUSY), and
 * proc, sysfs and the tmpfs mounts are made again over the first ones, which hold
 * nothing yet at that point. Exit status 0, or 1 when a mount of the basics failed
 * (each failure is printed).
 */
#define _GNU_SOURCE
#include "forkvm-adopt.h" /* sync_clock */

#include <sys/mount.h>
#include <sys/stat.h>

/* mount(2), where a device already mounted there (EBUSY) counts as done. */
static int mount_once(const char *src, const char *target, const char *type,
                      unsigned long flags)
{
    if (mount(src, target, type, flags, NULL) == 0 || errno == EBUSY)
        return 0;
    return -1;
}

/* Whether /proc/mounts has the root on /dev/vda (or /dev/root, as the kernel names a
 * root given by root=/dev/vda). */
static int vda_is_root(void)
{
    FILE *f = fopen("/proc/mounts", "re");
    char line[512];
    int root = 0;
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "/dev/root / ", 12) == 0 || strncmp(line, "/dev/vda / ", 11) == 0)
            root = 1;
    fclose(f);
    return root;
}

int main(void)
{
    static const struct {
        const char *src, *target, *type;
        int quiet; /* devtmpfs and devpts: absent from some kernels, said nothing of */
    } basics[] = {
        {"proc", "/proc", "proc", 0},      {"sysfs", "/sys", "sysfs", 0},
        {"devtmpfs", "/dev", "devtmpfs", 1}, {"devpts", "/dev/pts", "devpts", 1},
        {"tmpfs", "/tmp", "tmpfs", 0},     {"tmpfs", "/run", "tmpfs", 0},
    };
    int status = 0;
    for (size_t i = 0; i < sizeof basics / sizeof basics[0]; i++) {
        if (strcmp(basics[i].target, "/dev/pts") == 0)
            mkdir("/dev/pts", 0755);
        if (mount_once(basics[i].src, basics[i].target, basics[i].type, 0) != 0 &&
            !basics[i].quiet) {
            fprintf(stderr, "forkvm-setup: mounting %s on %s: %s\n", basics[i].type,
                    basics[i].target, strerror(errno));
            status = 1;
        }
    }
    if (sethostname("forkvm", 6) != 0)
        fprintf(stderr, "forkvm-setup: sethostname: %s\n", strerror(errno));
    /* Under another VMM (no forkvm probe port) the clock stays as the kernel set it. */
    int mode = ports_open();
    uint8_t magic[4];
    int64_t off, window;
    if (mode >= 0 && ports_read(mode, PROBE_PORT, magic, 4) == 0 &&
        ((uint32_t)magic[0] | (uint32_t)magic[1] << 8 | (uint32_t)magic[2] << 16 |
         (uint32_t)magic[3] << 24) == PROBE_MAGIC &&
        sync_clock(mode, &off, &window) == 0) {
        int64_t a = off < 0 ? -off : off;
        printf("forkvm-init: clock set from the host (it was %c%lld.%06lld s behind)\n",
               off < 0 ? '-' : '+', (long long)(a / 1000000000),
               (long long)(a % 1000000000 / 1000));
    }
    struct stat st;
    if (stat("/dev/vda", &st) == 0 && S_ISBLK(st.st_mode) && !vda_is_root() &&
        mount_once("/dev/vda", "/mnt/disk", "ext4", MS_RDONLY) != 0)
        printf("forkvm-init: /dev/vda present but not mountable\n");
    return status;
}
