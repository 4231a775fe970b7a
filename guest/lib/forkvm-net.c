/*
 * libforkvm: a VM's network identity from the identity block applied to the guest
 * (docs/clone-network.md): forkvm-clone --net uses it, and forkvm_wait() for a request
 * that carries FORKVM_ADOPT_NET.
 */
#define _GNU_SOURCE
#include "forkvm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <net/route.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

/* The reason of a failure, into the caller's buffer. */
struct why {
    char *buf;
    size_t len;
};

static int failed(struct why *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (w->buf && w->len)
        vsnprintf(w->buf, w->len, fmt, ap);
    va_end(ap);
    return -1;
}

static int ifreq_ioctl(int sock, unsigned long req, struct ifreq *ifr, const char *what,
                       struct why *w)
{
    if (ioctl(sock, req, ifr) == 0)
        return 0;
    return failed(w, "%s on %s: %s", what, ifr->ifr_name, strerror(errno));
}

static void set_sin(struct sockaddr *sa, const uint8_t *addr)
{
    struct sockaddr_in *sin = (struct sockaddr_in *)sa;
    memset(sin, 0, sizeof(*sin));
    sin->sin_family = AF_INET;
    memcpy(&sin->sin_addr, addr, 4);
}

/* Whether interface index `index` is an Ethernet one (1: its name and hardware
 * address then in `ifr`), another (0) or none (-1). */
static int is_ethernet(int sock, int index, struct ifreq *ifr)
{
    memset(ifr, 0, sizeof(*ifr));
    ifr->ifr_ifindex = index;
    if (ioctl(sock, SIOCGIFNAME, ifr) != 0)
        return -1;
    return ioctl(sock, SIOCGIFHWADDR, ifr) == 0 && ifr->ifr_hwaddr.sa_family == ARPHRD_ETHER;
}

/* How many indexes in a row with no interface end the search. */
#define MAX_INDEX_GAP 16

/*
 * The first Ethernet interface's name (and hardware address) in ifr; 0, or -1 if there
 * is none. By index, two ioctls each (lo and eth0: four), not a netlink dump
 * (if_nameindex), which cost about 60,000 emulated guest kernel instructions in each
 * clone on the PVM host.
 */
static int first_ethernet(int sock, struct ifreq *ifr)
{
    for (int i = 1, gap = 0; gap < MAX_INDEX_GAP; i++) {
        int r = is_ethernet(sock, i, ifr);
        if (r == 1)
            return 0;
        gap = r < 0 ? gap + 1 : 0;
    }
    return -1;
}

#define MAX_ABORTS 1024

/* One sock_diag request: a TCP/IPv4 dump (NLM_F_DUMP) or SOCK_DESTROY of one socket. */
struct diag_req {
    struct nlmsghdr h;
    struct inet_diag_req_v2 r;
};

/* A TCP/IPv4 sock_diag request of `type` with `flags`, over the sockets in `states`. */
static struct diag_req diag_request(uint16_t type, uint16_t flags, uint32_t states)
{
    struct diag_req req;
    memset(&req, 0, sizeof(req));
    req.h.nlmsg_len = sizeof(req);
    req.h.nlmsg_type = type;
    req.h.nlmsg_flags = NLM_F_REQUEST | flags;
    req.r.sdiag_family = AF_INET;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = states;
    return req;
}

/* Aborts every TCP socket whose local IPv4 address is `old` (SOCK_DESTROY through
 * sock_diag, CONFIG_INET_DIAG_DESTROY): a clone that took its own address still holds
 * its template's connections from the old one, which can send nothing any more and
 * would only hang until their timeouts (an NFS mount's for minutes, as the kernel closes
 * it gracefully and waits for a FIN that cannot leave). Aborted, a kernel user such as
 * the NFS client connects again at once, from the new address. The number aborted, or
 * -1. */
static int abort_tcp_from(const uint8_t *old, struct why *w)
{
    int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0)
        return failed(w, "sock_diag socket: %s", strerror(errno));
    /* Every state but LISTEN (a listener bound to the old address serves nobody either,
     * but closing it is its owner's business) and TIME_WAIT (nothing to abort). */
    struct diag_req req = diag_request(SOCK_DIAG_BY_FAMILY, NLM_F_DUMP,
                                       ~((1u << TCP_LISTEN) | (1u << TCP_TIME_WAIT)));
    static struct inet_diag_sockid ids[MAX_ABORTS];
    int n = 0, done = 0, err = 0;
    if (send(nl, &req, sizeof(req), 0) != (ssize_t)sizeof(req))
        err = 1;
    static char buf[32768];
    while (!err && !done) {
        ssize_t len = recv(nl, buf, sizeof(buf), 0);
        if (len < 0 && errno == EINTR)
            continue;
        if (len <= 0) {
            err = 1;
            break;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)len);
             h = NLMSG_NEXT(h, len)) {
            if (h->nlmsg_type == NLMSG_DONE) {
                done = 1;
                break;
            }
            if (h->nlmsg_type == NLMSG_ERROR) {
                err = 1;
                break;
            }
            struct inet_diag_msg *m = NLMSG_DATA(h);
            if (memcmp(m->id.idiag_src, old, 4) == 0 && n < MAX_ABORTS)
                ids[n++] = m->id;
        }
    }
    int aborted = 0;
    for (int i = 0; !err && i < n; i++) {
        req = diag_request(SOCK_DESTROY, NLM_F_ACK, ~0u);
        req.r.id = ids[i];
        if (send(nl, &req, sizeof(req), 0) != (ssize_t)sizeof(req)) {
            err = 1;
            break;
        }
        ssize_t len = recv(nl, buf, sizeof(buf), 0);
        struct nlmsghdr *h = (struct nlmsghdr *)buf;
        if (len < (ssize_t)NLMSG_LENGTH(sizeof(struct nlmsgerr)) ||
            h->nlmsg_type != NLMSG_ERROR) {
            err = 1;
            break;
        }
        int e = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
        if (e == 0) {
            aborted++;
        } else if (e != -ENOENT) { /* ENOENT: it closed meanwhile */
            close(nl);
            return failed(w, "aborting a connection from the old address: %s", strerror(-e));
        }
    }
    close(nl);
    if (err)
        return failed(w, "cannot abort the connections from %u.%u.%u.%u (a kernel without "
                         "CONFIG_INET_DIAG_DESTROY?)", old[0], old[1], old[2], old[3]);
    return aborted;
}

/* Sets the MAC of the interface in `ifr` (which holds its current one). */
static int set_mac(int sock, struct ifreq *ifr, const uint8_t *mac, struct why *w)
{
    if (memcmp(ifr->ifr_hwaddr.sa_data, mac, 6) == 0)
        return 0;
    ifr->ifr_hwaddr.sa_family = ARPHRD_ETHER;
    memcpy(ifr->ifr_hwaddr.sa_data, mac, 6);
    if (ioctl(sock, SIOCSIFHWADDR, ifr) == 0)
        return 0;
    if (errno != EBUSY)
        return failed(w, "setting the MAC on %s: %s", ifr->ifr_name, strerror(errno));
    /* A driver without live address change: down, change, up again. */
    struct ifreq f = *ifr;
    if (ifreq_ioctl(sock, SIOCGIFFLAGS, &f, "reading flags", w) != 0)
        return -1;
    short flags = f.ifr_flags;
    f.ifr_flags = flags & ~IFF_UP;
    if (ifreq_ioctl(sock, SIOCSIFFLAGS, &f, "taking down", w) != 0 ||
        ifreq_ioctl(sock, SIOCSIFHWADDR, ifr, "setting the MAC", w) != 0)
        return -1;
    f.ifr_flags = flags;
    return ifreq_ioctl(sock, SIOCSIFFLAGS, &f, "bringing up", w);
}

/* Gives the interface in `ifr` address `addr`/`prefix` (replacing its primary one, which
 * goes to `old`) and brings it up. */
static int set_addr(int sock, struct ifreq *ifr, const uint8_t *addr, unsigned prefix,
                    uint8_t *old, struct why *w)
{
    struct ifreq cur = *ifr;
    if (ioctl(sock, SIOCGIFADDR, &cur) == 0) /* EADDRNOTAVAIL: none yet */
        memcpy(old, &((struct sockaddr_in *)&cur.ifr_addr)->sin_addr, 4);
    set_sin(&ifr->ifr_addr, addr);
    if (ifreq_ioctl(sock, SIOCSIFADDR, ifr, "setting the address", w) != 0)
        return -1;
    uint32_t mask = htonl(prefix == 32 ? 0xffffffffu : ~(0xffffffffu >> prefix));
    set_sin(&ifr->ifr_netmask, (const uint8_t *)&mask);
    if (ifreq_ioctl(sock, SIOCSIFNETMASK, ifr, "setting the netmask", w) != 0 ||
        ifreq_ioctl(sock, SIOCGIFFLAGS, ifr, "reading flags", w) != 0)
        return -1;
    ifr->ifr_flags |= IFF_UP;
    return ifreq_ioctl(sock, SIOCSIFFLAGS, ifr, "bringing up", w);
}

/* Makes `gw` the only default route, through interface `dev`. */
static int set_gateway(int sock, char *dev, const uint8_t *gw, struct why *w)
{
    static const uint8_t zero[4];
    struct rtentry rt;
    memset(&rt, 0, sizeof(rt));
    set_sin(&rt.rt_dst, zero);
    set_sin(&rt.rt_genmask, zero);
    set_sin(&rt.rt_gateway, gw);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    rt.rt_dev = dev;
    /* Replace the template's default routes, whatever their gateway. */
    struct rtentry old = rt;
    memset(&old.rt_gateway, 0, sizeof(old.rt_gateway));
    old.rt_flags = RTF_UP;
    old.rt_dev = NULL;
    for (int i = 0; i < 16 && ioctl(sock, SIOCDELRT, &old) == 0; i++)
        ;
    if (ioctl(sock, SIOCADDRT, &rt) != 0)
        return failed(w, "adding the default route: %s", strerror(errno));
    return 0;
}

int forkvm_net_apply(const uint8_t *blk, struct forkvm_net *net, char *why, size_t why_len)
{
    struct why w = {why, why_len};
    static const uint8_t zero[6];
    memset(net, 0, sizeof(*net));
    memcpy(net->mac, blk + 8, 6);
    if (memcmp(net->mac, zero, 6) == 0)
        return 0; /* no network card */
    unsigned prefix = blk[14];
    if (prefix > 0 && prefix <= 32) {
        net->prefix = (uint8_t)prefix;
        memcpy(net->addr, blk + 16, 4);
        memcpy(net->gateway, blk + 20, 4);
    }
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return failed(&w, "socket: %s", strerror(errno));
    struct ifreq ifr;
    int rc = first_ethernet(sock, &ifr) == 0 ? 0 : failed(&w, "no Ethernet interface");
    if (rc == 0) {
        snprintf(net->ifname, sizeof net->ifname, "%s", ifr.ifr_name);
        rc = set_mac(sock, &ifr, net->mac, &w);
    }
    if (rc == 0 && net->prefix)
        rc = set_addr(sock, &ifr, net->addr, net->prefix, net->old_addr, &w);
    if (rc == 0 && net->prefix && memcmp(net->gateway, zero, 4) != 0)
        rc = set_gateway(sock, net->ifname, net->gateway, &w);
    close(sock);
    if (rc == 0 && memcmp(net->old_addr, zero, 4) != 0 &&
        memcmp(net->old_addr, net->addr, 4) != 0) {
        net->aborted = abort_tcp_from(net->old_addr, &w);
        if (net->aborted < 0)
            rc = -1;
    }
    return rc;
}
