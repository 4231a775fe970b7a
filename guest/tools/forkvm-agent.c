/*
 * forkvm-agent: runs commands the host sends over virtio-vsock (docs/guest-abi.md).
 *
 *   forkvm-agent [--background] [--no-adopt] [PORT]
 *                           listen on vsock port PORT (default 1024), one process per
 *                           connection, forked before the connection comes (a spare
 *                           waiting in accept, the next one forked at the lowest
 *                           priority once it took one); prints "forkvm-agent:
 *                           listening on port PORT".
 *                           With --background it returns once listening and serves from
 *                           a child (init uses it: see docs/guest-kernel.md on why the
 *                           guest's command must not start while the agent starts).
 *
 * In a new clone (the identity block's generation changed since the agent last looked),
 * the agent adopts the clone's identity in the connection's process before serving the
 * connection (once per clone: the generation adopted is kept in memory its processes
 * share), as `forkvm-clone --adopt` would (forkvm-adopt.h): reseed the RNG, drain
 * /dev/hwrng, sync the clock, take the clone's network identity. --no-adopt leaves that
 * to the host.
 *
 * Protocol, per connection (what `vmm exec` speaks):
 *   host:  "<cmdlen> <stdinlen>\n", then cmdlen bytes of command, stdinlen bytes of input
 *   agent: runs `sh -c <command>` with that input on stdin, stdout and stderr together,
 *          then sends "<status> <outlen>\n" and outlen bytes of output, and closes.
 *          status is the exit code, 128+N when killed by signal N, 255 if it could not
 *          run. Output beyond 16 MiB is cut.
 * Streaming, when the head is "<cmdlen> <stdinlen> stream\n" (what the containerd shim
 * speaks): the command is a program's argv, its words each ended by a NUL byte, run
 * with no shell (its first word looked up on PATH; forkvm-oci runs in the agent's own
 * forked process, forkvm-oci.h, with no exec of the tool), in a process group of its
 * own, and the agent sends its
 * output as it comes, "out <len>\n" or "err <len>\n" and len bytes, then
 * "exit <status>\n" once the command has ended, and closes. What the command left
 * running in its group is killed then. Meanwhile the host may send "sig <N>\n": the
 * agent sends signal N to the command's group. The host closing the connection kills
 * the group.
 * With " stdin" after "stream" (the head's stdinlen then 0), the command's stdin is a
 * pipe the host feeds: "in <len>\n" and len bytes (at most 65536) are written to it,
 * "eof\n" closes it. With " tty" (alone or after " stdin"), the command runs on a new
 * pseudo-terminal as its controlling terminal (a session of its own): its output, both
 * streams, comes as "out" frames; "in" frames are typed on it, "eof" types the
 * terminal's end-of-file character, and "winch <rows> <cols>\n" sets its size. Input
 * the command does not take yet waits in the agent, which reads nothing more from the
 * host meanwhile (output keeps flowing).
 * The connections a clone inherits from its parent are reset at the clone point; the
 * listening socket keeps working, so every clone answers on its own vsock socket.
 */
#include "forkvm-adopt.h"
#include "forkvm-ahead.h"

#include <fcntl.h>
#include <poll.h>
#include <termios.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/futex.h>
#include <linux/vm_sockets.h>

/* What the agent's processes share (a page mapped shared before they are forked): the
 * identity block generation the last adoption took, a lock so that one process adopts
 * at a time, and how many spare connection processes wait in accept (a futex: a spare
 * wakes those waiting for one as it starts to wait). */
struct shared {
    uint64_t generation;
    int lock;
    int ready;
};
static struct shared *shared;

static void futex_wait(int *word, int value, int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    syscall(SYS_futex, word, FUTEX_WAIT, value, &ts, NULL, 0);
}

static void futex_wake(int *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* In a spare connection process, the main process's end of the pipe on which it says
 * it needs the guest's CPU no more than a running command does (-1 once said). */
static int release_fd = -1;

/* Tells the main process that this connection's start is over (its command's first
 * output or its end, or a second passed), so it may fork the next spare now: forked
 * sooner, at whatever priority, it takes the guest's one CPU in the waits of the
 * start (the host's answers) and holds it past them (a guest kernel path is not
 * preempted). */
static void release(void)
{
    if (release_fd < 0)
        return;
    ssize_t told = write(release_fd, "r", 1);
    (void)told;
    close(release_fd);
    release_fd = -1;
}

/* How long a stream's start holds back the next spare at most, ms. */
#define START_MS 1000

/* How long a connection's process waits, at its end, for the next spare, ms. */
#define SPARE_WAIT_MS 1000

/* Milliseconds since `t` (CLOCK_MONOTONIC). */
static long ms_since(const struct timespec *t)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t->tv_sec) * 1000 + (now.tv_nsec - t->tv_nsec) / 1000000;
}

/* Runs argv `cmd` in a group of its own with input `infd` (or input the host feeds,
 * or on a terminal, as `flags` say), its stdout and stderr sent as they come, then its
 * exit status (the streaming protocol above). */
static void serve_stream(int conn, char *cmd, unsigned long cmdlen, int infd, int flags)
{
    static struct input in;
    in.fd = -1;
    in.tty = (flags & STREAM_TTY) != 0;
    in.len = in.off = 0;
    int out[2] = {-1, -1}, err[2] = {-1, -1}, feed_pipe[2] = {-1, -1}, master = -1;
    char *slave = NULL;
    int ok;
    if (in.tty) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        ok = master >= 0 && grantpt(master) == 0 && unlockpt(master) == 0 &&
             (slave = ptsname(master)) != NULL;
    } else {
        ok = pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0 &&
             (!(flags & STREAM_STDIN) || pipe2(feed_pipe, O_CLOEXEC) == 0);
    }
    if (!ok) {
        send_full(conn, "exit 255\n", 9);
        return;
    }
    int fds[3] = {feed_pipe[0] >= 0 ? feed_pipe[0] : infd, out[1], err[1]}, nfds = 3;
    if (in.tty) {
        fds[0] = open(slave, O_RDWR | O_NOCTTY | O_CLOEXEC);
        nfds = 1;
        if (fds[0] < 0) {
            send_full(conn, "exit 255\n", 9);
            return;
        }
    }
    /* The process forked ahead takes it, or one is forked now. */
    pid_t pid = command_to_ahead(cmd, cmdlen, flags, fds, nfds);
    if (pid < 0) {
        pid = fork();
        if (pid == 0)
            become_command(cmd, cmdlen, in.tty, fds);
    }
    if (in.tty) {
        close(fds[0]);
        /* The terminal's output is the command's stdout and stderr both. */
        out[0] = master;
        in.fd = dup(master);
    } else {
        close(out[1]);
        close(err[1]);
        if (feed_pipe[0] >= 0) {
            close(feed_pipe[0]);
            in.fd = feed_pipe[1];
        }
    }
    if (pid < 0) {
        send_full(conn, "exit 255\n", 9);
        return;
    }
    /* Its own group (a terminal's command leads a session of its own instead: made a
     * group leader first, its setsid would fail). */
    if (!in.tty)
        setpgid(pid, pid);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    if (err[0] >= 0)
        fcntl(err[0], F_SETFL, O_NONBLOCK);
    if (in.fd >= 0)
        fcntl(in.fd, F_SETFL, O_NONBLOCK);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int gone = 0, out_open = 1, err_open = err[0] >= 0, running = 1, status = 255;
    struct timespec begun;
    clock_gettime(CLOCK_MONOTONIC, &begun);
    while (running || (pidfd < 0 && (out_open || err_open))) {
        /* Input the command has not taken: nothing more is read from the host until
         * it has. */
        int waiting = in.fd >= 0 && in.len > in.off;
        struct pollfd p[5] = {
            {.fd = out_open ? out[0] : -1, .events = POLLIN},
            {.fd = err_open ? err[0] : -1, .events = POLLIN},
            {.fd = gone || waiting ? -1 : conn, .events = POLLIN},
            {.fd = pidfd, .events = POLLIN},
            {.fd = waiting ? in.fd : -1, .events = POLLOUT},
        };
        int timeout = -1;
        if (release_fd >= 0) {
            long ms = ms_since(&begun);
            timeout = ms >= START_MS ? 0 : (int)(START_MS - ms);
            if (timeout == 0)
                release();
        }
        int ready = poll(p, 5, release_fd >= 0 ? timeout : -1);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        /* A terminal whose last user has gone reads EIO: its end. */
        if (p[0].revents && forward(out[0], "out", conn, &gone) != 0)
            out_open = 0;
        if (p[1].revents && forward(err[0], "err", conn, &gone) != 0)
            err_open = 0;
        /* Its first output on its way to the host (or its end): the start is over. */
        if (p[0].revents || p[1].revents || p[3].revents)
            release();
        if (p[2].revents && control(conn, pid, &in) != 0)
            gone = 1;
        if (p[4].revents)
            feed(&in);
        if (gone)
            kill(-pid, SIGKILL);
        if (pidfd < 0 ? !out_open && !err_open : p[3].revents != 0)
            running = 0;
    }
    int st;
    if (waitpid(pid, &st, 0) == pid)
        status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    /* What it wrote before it ended, then what it left behind goes. */
    if (out_open)
        forward(out[0], "out", conn, &gone);
    if (err_open)
        forward(err[0], "err", conn, &gone);
    kill(-pid, SIGKILL);
    if (in.fd >= 0)
        close(in.fd);
    char head[32];
    int h = snprintf(head, sizeof(head), "exit %d\n", status);
    if (!gone)
        send_full(conn, head, (size_t)h);
}

static void serve(int conn)
{
    unsigned long cmdlen, inlen;
    int stream;
    if (read_request_line(conn, &cmdlen, &inlen, &stream) != 0)
        return;
    char *cmd = malloc(cmdlen + 1);
    char *in = malloc(inlen + 1);
    if (!cmd || !in || read_full(conn, cmd, cmdlen) != 0 || read_full(conn, in, inlen) != 0)
        return;
    cmd[cmdlen] = 0;

    /* The input goes through a file so that writing it cannot block on reading output;
     * no input is /dev/null (a file made, written and removed is a dozen thousand
     * emulated guest kernel instructions more). */
    int infd;
    if (inlen == 0) {
        infd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    } else {
        char path[] = "/tmp/forkvm-agent-XXXXXX";
        infd = mkstemp(path);
        if (infd >= 0 && (write_full(infd, in, inlen) != 0 || lseek(infd, 0, SEEK_SET) != 0)) {
            close(infd);
            infd = -1;
        }
        if (infd >= 0)
            unlink(path);
    }
    if (!stream)
        release();
    if (stream) {
        if (infd < 0)
            send_full(conn, "exit 255\n", 9);
        else
            serve_stream(conn, cmd, cmdlen, infd, stream);
        return;
    }
    int pipefd[2];
    int status = 255;
    size_t outlen = 0;
    char *out = malloc(MAX_OUT);
    if (out && infd >= 0 && pipe(pipefd) == 0) {
        pid_t pid = fork();
        if (pid == 0) {
            dup2(infd, 0);
            close(infd);
            dup2(pipefd[1], 1);
            dup2(pipefd[1], 2);
            close(pipefd[0]);
            close(pipefd[1]);
            close(conn);
            execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
            _exit(255);
        }
        close(pipefd[1]);
        /* Read straight into the reply, with no copy in user space: on the PVM host a
         * large memcpy here came out with 16-byte runs of zeros (the vector registers
         * glibc's memcpy keeps its first and last 16 bytes in were lost across the guest
         * kernel's entries; docs/guest-kernel.md, "Known host problems"). Beyond MAX_OUT
         * the output is read and dropped, so the command never blocks on a full pipe. */
        for (;;) {
            char sink[4096];
            int full = outlen == MAX_OUT;
            ssize_t n = full ? read(pipefd[0], sink, sizeof(sink))
                             : read(pipefd[0], out + outlen, MAX_OUT - outlen);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            if (!full)
                outlen += (size_t)n;
        }
        close(pipefd[0]);
        int st;
        if (pid > 0 && waitpid(pid, &st, 0) == pid)
            status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    char head[64];
    int h = snprintf(head, sizeof(head), "%d %zu\n", status, outlen);
    if (write_full(conn, head, (size_t)h) == 0)
        write_full(conn, out, outlen);
}

/* Takes the new clone's identity in this process (forkvm-adopt.h: what `forkvm-clone
 * --adopt` does, without a process of its own). Only failures are printed (on the
 * console: a line written there costs about 12,000 emulated guest kernel instructions
 * on the PVM host, in every clone). */
static void adopt_here(int ports)
{
    int rc = adopt(ports, NULL);
    if (rc != 0)
        fprintf(stderr, "forkvm-agent: adopting the clone's identity failed (status %d)\n", rc);
}

/* Adopts the clone's identity (adopt_here) unless one of the agent's processes did in
 * this clone already; returns once it is adopted. */
static void adopt_once(int ports)
{
    struct shared *sh = shared;
    uint64_t now = ports_generation(ports);
    if (__atomic_load_n(&sh->generation, __ATOMIC_ACQUIRE) == now)
        return;
    /* One at a time; a holder that died is waited for 2 s at most. */
    for (int waited_ms = 0; __atomic_exchange_n(&sh->lock, 1, __ATOMIC_ACQUIRE) &&
                            waited_ms < 2000;
         waited_ms++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&sh->generation, __ATOMIC_ACQUIRE) != now) {
        adopt_here(ports);
        __atomic_store_n(&sh->generation, now, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&sh->lock, 0, __ATOMIC_RELEASE);
}

/* A connection's process, forked before its connection comes: it says so on `notify`
 * ('w') as it starts to wait in accept, takes the next connection on `s` itself, adopts
 * a new clone's identity if no process of the agent has yet, serves the connection,
 * says when its start is over ('r', release) so that the main process forks the next
 * spare, and keeps the connection open until that one waits in accept (a second at
 * most), so that a VM paused or snapshotted once its last command's connection closed
 * holds a spare. Then the first request in each clone of it is served with no fork
 * (tens of thousands of emulated guest kernel instructions on the PVM host). */
static void spare(int s, int notify, int ports)
{
    signal(SIGCHLD, SIG_DFL);
    /* Its command's process forked ahead too. */
    fork_command_ahead(s, notify);
    /* Made at the main process's lowest priority; a connection is served at the
     * normal one. */
    setpriority(PRIO_PROCESS, 0, 0);
    __atomic_add_fetch(&shared->ready, 1, __ATOMIC_RELEASE);
    futex_wake(&shared->ready);
    ssize_t told = write(notify, "w", 1);
    (void)told;
    int c;
    while ((c = accept4(s, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        if (errno == EINTR || errno == ECONNRESET || errno == ECONNABORTED)
            continue;
        perror("forkvm-agent: accept");
        sleep(1);
    }
    __atomic_sub_fetch(&shared->ready, 1, __ATOMIC_RELEASE);
    close(s);
    release_fd = notify;
    if (ports >= 0)
        adopt_once(ports);
    serve(c);
    release();
    /* A command's process forked ahead and not used: ended and reaped here. */
    if (ahead_pid > 0) {
        close(ahead_chan);
        waitpid(ahead_pid, NULL, 0);
    }
    struct timespec begun;
    clock_gettime(CLOCK_MONOTONIC, &begun);
    for (;;) {
        int ready = __atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE);
        long ms = ms_since(&begun);
        if (ready > 0 || ms >= SPARE_WAIT_MS)
            break;
        futex_wait(&shared->ready, ready, (int)(SPARE_WAIT_MS - ms));
    }
    /* The connection closes as this process exits, after its memory is gone: a host
     * that waits for the close before it pauses or snapshots the VM leaves no exit
     * half done in it. */
    _exit(0);
}

int main(int argc, char **argv)
{
    int background = 0, do_adopt = 1;
    while (argc > 1 && argv[1][0] == '-') {
        if (strcmp(argv[1], "--background") == 0)
            background = 1;
        else if (strcmp(argv[1], "--no-adopt") == 0)
            do_adopt = 0;
        else
            break;
        argc--;
        argv++;
    }
    int ports = do_adopt ? ports_open() : -1;
    shared = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        perror("forkvm-agent: mmap");
        return 1;
    }
    shared->generation = ports >= 0 ? ports_generation(ports) : 0;
    unsigned port = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : 1024;
    /* The disk slots' devices, recorded once for forkvm-oci (forkvm-oci.h). */
    oci_map_slots();
    int s = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_vm addr = {
        .svm_family = AF_VSOCK,
        .svm_port = port,
        .svm_cid = VMADDR_CID_ANY,
    };
    int notify[2];
    if (s < 0 || bind(s, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(s, 64) != 0 ||
        pipe2(notify, O_CLOEXEC) != 0) {
        perror("forkvm-agent");
        return 1;
    }
    /* Reap connection handlers automatically. */
    signal(SIGCHLD, SIG_IGN);
    printf("forkvm-agent: listening on port %u\n", port);
    fflush(stdout);
    if (background) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("forkvm-agent: fork");
            return 1;
        }
        if (pid > 0)
            _exit(0);
    }
    /* A spare connection process waiting in accept: the first forked now, each next
     * one once the last one's start is over (at the lowest priority: 'r'), or at once
     * (at the normal one) when a connection waits and no spare does. One is forked at
     * a time: the next not before this one said it waits ('w') or ended. */
    int need = 1, nice = 0, pidfd = -1;
    for (;;) {
        if (need && pidfd < 0 && __atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE) <= 0) {
            setpriority(PRIO_PROCESS, 0, nice);
            pid_t pid = fork();
            if (pid == 0) {
                close(notify[0]);
                spare(s, notify[1], ports);
            }
            if (pid < 0) {
                perror("forkvm-agent: fork");
                sleep(1);
                continue;
            }
            need = 0;
            pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
            if (pidfd < 0) {
                perror("forkvm-agent: pidfd_open");
                pidfd = -1;
            }
        }
        struct pollfd p[3] = {
            {.fd = notify[0], .events = POLLIN},
            {.fd = pidfd, .events = POLLIN},
            {.fd = s, .events = POLLIN},
        };
        if (poll(p, 3, -1) < 0) {
            if (errno != EINTR) {
                perror("forkvm-agent: poll");
                sleep(1);
            }
            continue;
        }
        if (p[0].revents) {
            char said[64];
            ssize_t n = read(notify[0], said, sizeof said);
            for (ssize_t k = 0; k < n; k++) {
                if (said[k] == 'r') {
                    need = 1;
                    nice = 19;
                } else if (said[k] == 'w' && pidfd >= 0) {
                    close(pidfd);
                    pidfd = -1;
                }
            }
        }
        if (pidfd >= 0 && p[1].revents) {
            /* It ended before it waited: another is forked. */
            close(pidfd);
            pidfd = -1;
            need = 1;
        }
        if (p[2].revents) {
            /* Woken with the spare that takes the connection: only a connection still
             * waiting once no spare is left needs one forked now. */
            struct pollfd again = {.fd = s, .events = POLLIN};
            if (__atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE) <= 0 && pidfd < 0) {
                if (poll(&again, 1, 0) == 1) {
                    need = 1;
                    nice = 0;
                }
            } else {
                /* A spare is taking it, or about to wait. */
                struct timespec ts = {0, 1000 * 1000};
                nanosleep(&ts, NULL);
            }
        }
    }
}
