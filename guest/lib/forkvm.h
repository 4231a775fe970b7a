/*
 * libforkvm: a guest runtime's side of forkvm invocations (docs/invoke.md).
 *
 * A runtime opens the library once (port access and the mailbox mapped), then loops:
 * forkvm_wait() parks its vCPU until a request is in the mailbox, the handler runs,
 * forkvm_reply() or forkvm_fail() hands the answer back. In a template's clone the
 * request arrives as the clone wakes, with no guest kernel code on the way: the wait is
 * one port read, the request is already in memory the runtime mapped before the
 * template paused, the reply is one port write.
 *
 * Not thread-safe: one thread of one process serves (port access is per thread, and
 * inherited by threads created after forkvm_open). Needs root (ioperm, /dev/mem).
 * Errors are negative errno values; forkvm_strerror() says what went wrong.
 */
#ifndef FORKVM_H
#define FORKVM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Request flag: the caller asked to keep this VM for further requests (keep-alive). */
#define FORKVM_KEEP_ALIVE 1u
/* Request flag: this clone was given a network identity of its own (an address). The
 * library has applied it (forkvm_net_apply) before forkvm_wait returned the request; a
 * request whose identity could not be applied was failed with the reason, and the wait
 * went on. */
#define FORKVM_ADOPT_NET 2u
/* Bytes of fresh host entropy in each request, for the runtime's own PRNGs. */
#define FORKVM_ENTROPY_LEN 32

struct forkvm_request {
    const uint8_t *data;                      /* the payload, in the mailbox */
    uint32_t len;                             /* its length */
    uint32_t flags;                           /* FORKVM_KEEP_ALIVE */
    uint64_t sequence;                        /* this VM's invocation number (1, 2, ...) */
    uint32_t timeout_ms;                      /* how long the caller waits */
    uint8_t entropy[FORKVM_ENTROPY_LEN];      /* fresh from the host, per request */
    uint16_t kind;                            /* FORKVM_KIND_INVOKE, _PRIME or _LOAD */
};

/* Request kinds. A prime request comes only to a runtime that enabled FORKVM_PRIME: it
 * is a dry run, before any real request, in a warm clone of a template (docs/invoke.md,
 * "Primed warm clones"). Run the serving path without the handler and reply (anything:
 * the reply is dropped). Its payload (possibly empty) names pages of the runtime's address
 * space it may read to map them ahead: runs of (first virtual page number, count), two
 * little-endian u64s each; a runtime may ignore it. */
#define FORKVM_KIND_INVOKE 1
#define FORKVM_KIND_PRIME 2
/* A load request comes only to a runtime that enabled FORKVM_LOAD: its payload is for
 * the runtime's loader, not the handler; once the runtime replied ok and waits again,
 * its VM is a template of its own (a derived template, docs/invoke.md). */
#define FORKVM_KIND_LOAD 3

/* Features a runtime enables with forkvm_enable(). */
#define FORKVM_PRIME 1u
#define FORKVM_LOAD 2u

/* Port access and the mailbox mapped (idempotent). 0, or -ENODEV (not forkvm, or no
 * mailbox: the VM needs --mailbox-mib), -EPROTO (unknown mailbox layout), -errno. */
int forkvm_open(void);

/* Tells the VMM, from the next forkvm_wait() on, which FORKVM_* features this runtime
 * handles (forkvm_wait writes them into the mailbox before it parks). */
void forkvm_enable(uint32_t features);

/* Parks until a request is in the mailbox and fills `req`. 0, or -EPROTO (the header
 * is not a request), -errno from forkvm_open. */
int forkvm_wait(struct forkvm_request *req);

/* Where a reply can be built in place (forkvm_reply then copies nothing), and how
 * many bytes fit. NULL before forkvm_open succeeded. */
uint8_t *forkvm_reply_buffer(size_t *capacity);

/* The handler's reply: `len` bytes from `data` (which may be the reply buffer).
 * Returns once the VMM took it (in a VM kept for more requests; otherwise the VM ends
 * there). -EMSGSIZE when it does not fit the mailbox (nothing is sent: answer with
 * forkvm_fail instead). */
int forkvm_reply(const void *data, size_t len);

/* The handler failed: the caller gets a 500 with `msg` (cut to the mailbox's size). */
int forkvm_fail(const char *msg);

/* This VM's clone sequence number (0: not a clone) and its generation (different in
 * every VM process, so in every clone). 0 before forkvm_open succeeded. */
uint32_t forkvm_clone_seq(void);
uint64_t forkvm_generation(void);

/* The identity block's length (docs/guest-abi.md). */
#define FORKVM_IDENTITY_BLOCK_LEN 32

/* This VM's identity block, read from the ports (after forkvm_open). 0, or -errno. */
int forkvm_identity_block(uint8_t block[FORKVM_IDENTITY_BLOCK_LEN]);

/* A VM's network identity as an identity block gives it, and what applying it did. */
struct forkvm_net {
    char ifname[16];     /* the first Ethernet interface, given the identity */
    uint8_t mac[6];      /* all zero: the VM has no network card (nothing was done) */
    uint8_t addr[4];     /* the address, when prefix is not 0 */
    uint8_t prefix;      /* 0: the block has no address (only the MAC was set) */
    uint8_t gateway[4];  /* 0.0.0.0: none (the routes were left as they are) */
    uint8_t old_addr[4]; /* the address it replaced (0.0.0.0: none) */
    int aborted;         /* TCP connections from old_addr aborted */
};

/* Applies identity block `block` (docs/clone-network.md) to the first Ethernet
 * interface: its MAC, then its address and netmask (replacing the primary one), then the
 * default route (replacing any other), then aborts the TCP connections from the address
 * it replaced (sock_diag SOCK_DESTROY): a clone's copies of its template's connections
 * can send nothing from the new address, and a kernel user such as an NFS mount connects
 * again at once. Needs CAP_NET_ADMIN. 0 (also with no card), or -1 with the reason in
 * `why` (`why_len` bytes at most, NUL included). */
int forkvm_net_apply(const uint8_t *block, struct forkvm_net *net, char *why, size_t why_len);

/* A message for a negative value returned here. */
const char *forkvm_strerror(int err);

#ifdef __cplusplus
}
#endif

#endif
