"""The pages a handler's warm-up wrote, found in the template and read again in each
warm clone's prime (docs/invoke.md, "The warm-up's pages, mapped in the prime").

A clone's KVM VM is new: each guest page it touches for the first time costs it a fault
that maps the page (a shadow-paging fault here, 4.7 us; an EPT fault on hardware KVM),
even where the host copied the page ahead (the working set). A request of a warmed-up
handler touches nearly the pages its warm-up wrote in the template, so the template
keeps their addresses, and a warm clone's prime reads one byte of each: the request then
finds them mapped.

Found in user space, without the kernel (whose work this host emulates): before the
warm-up, the CRC-32 of every resident page of the process's private writable mappings;
after it, the pages whose CRC changed or that became resident. A page written back to
the same bytes is missed (it is then merely mapped by the request, as before).
"""

import array
import bisect
import ctypes
import mmap
import os
import zlib

PAGE = mmap.PAGESIZE

# The pages kept at most by default, in MiB (the VMM's working set is 64 MiB by default:
# pages it did not copy ahead cost more to map than they save).
DEFAULT_MIB = 64


def env_mib(environ, name):
    """Setting ``name`` in ``environ``: a number of MiB from 0 to 65536, or None when
    unset (the runtime's heap and this module's limit)."""
    text = environ.get(name)
    if text is None:
        return None
    try:
        mib = int(text)
    except ValueError:
        mib = -1
    if not 0 <= mib <= 65536:
        raise ValueError("%s is a number of MiB from 0 to 65536, not %r" % (name, text))
    return mib


def limit_pages(environ=os.environ):
    """``FORKVM_TOUCH_MIB``: the pages kept at most (0: none, off); 64 MiB by default."""
    mib = env_mib(environ, "FORKVM_TOUCH_MIB")
    return ((DEFAULT_MIB if mib is None else mib) << 20) // PAGE


def writable_regions(maps="/proc/self/maps"):
    """``(start, end)`` of the process's private writable mappings (heap, stacks,
    anonymous memory, the data of its files); not devices' (the mailbox) nor the
    kernel's (``[vvar]``)."""
    out = []
    with open(maps) as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 5:
                continue
            perms = fields[1]
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if perms[:2] != "rw" or perms[3:4] != "p" or path.startswith("/dev/") \
                    or path in ("[vvar]", "[vdso]", "[vsyscall]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


class _Resident:
    """``mincore(2)``: which pages of a range are in memory (anonymous ones: mapped),
    so that reading them takes no fault."""

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self._mincore = libc.mincore
        self._mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def __call__(self, start, end):
        n = (end - start) // PAGE
        vec = (ctypes.c_ubyte * n)()
        if self._mincore(start, end - start, vec) != 0:
            return bytes(n)
        return bytes(vec)


class Digests:
    """The CRC-32 of each resident page of some regions, kept compact (8 bytes a page:
    the digests of a 64 MiB heap take 32 pages, not the thousands a dict would write
    during the warm-up's recording)."""

    def __init__(self, regions, resident=None, read=None):
        resident = resident or _Resident()
        read = read or (lambda addr: ctypes.string_at(addr, PAGE))
        self._starts = []
        self._regions = []
        for start, end in sorted(regions):
            # 0: not resident; a digest is stored plus one.
            values = array.array("Q", bytes(8 * ((end - start) // PAGE)))
            for i, present in enumerate(resident(start, end)):
                if present & 1:
                    values[i] = zlib.crc32(read(start + i * PAGE)) + 1
            self._starts.append(start)
            self._regions.append((start, end, values))

    def get(self, addr):
        """The page at ``addr``'s stored value (0: not resident or not in a region)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return 0
        start, end, values = self._regions[i]
        return values[(addr - start) // PAGE] if addr < end else 0

    def pages(self):
        """``(address, value)`` of each resident page, in order."""
        for start, _, values in self._regions:
            for i, v in enumerate(values):
                if v:
                    yield start + i * PAGE, v


def written(before, after):
    """The addresses, in order, of the resident pages of ``after`` that were not
    resident in ``before`` or whose digest changed."""
    return [a for a, v in after.pages() if before.get(a) != v]


def runs(addrs):
    """Sorted page addresses as ``(start, pages)`` runs of consecutive pages."""
    out = []
    for a in addrs:
        if out and out[-1][0] + out[-1][1] * PAGE == a:
            out[-1][1] += 1
        else:
            out.append([a, 1])
    return [tuple(r) for r in out]


class Touch:
    """The pages to map in a prime, as strided views (one byte a page, in C): the
    ``read`` runs are read, the ``write`` runs have that byte written back as it was
    (the VM then maps them writable for a request that writes them: only where nothing
    but the runtime writes during a prime, the mailbox, since a thread of the handler's
    could write a page between the read and the write)."""

    def __init__(self, read, write=()):
        self.pages = sum(n for _, n in read) + sum(n for _, n in write)
        view = lambda a, n: memoryview((ctypes.c_char * ((n - 1) * PAGE + 1))  # noqa: E731
                                       .from_address(a)).cast("B")[::PAGE]
        self._read = [view(a, n) for a, n in read]
        self._write = [view(a, n) for a, n in write]

    def __call__(self):
        for v in self._read:
            v.tobytes()
        for v in self._write:
            v[:] = v.tobytes()


def from_prime(payload):
    """The ``Touch`` of the pages a prime request names (the VMM's: the runtime's pages
    whose frames its template's learned working set holds), runs of (first virtual page
    number, count), little-endian u64 each; only read. None when it names none."""
    if len(payload) < 16:
        return None
    words = memoryview(payload)[:len(payload) // 16 * 16].cast("Q")
    read = [(words[i] * PAGE, words[i + 1]) for i in range(0, len(words), 2) if words[i + 1]]
    return Touch(read) if read else None


def span(start, length):
    """The run of pages that ``length`` bytes from ``start`` lie in."""
    if length <= 0:
        return []
    first = start - start % PAGE
    return [(first, (start + length - first + PAGE - 1) // PAGE)]


class Recorder:
    """Around a warm-up: ``start()`` before it, ``note()`` each event and reply, and
    ``finish()`` after it returns the ``Touch`` of what it wrote, and of the mailbox
    pages its largest event or reply would take (None when off or nothing was
    written). The mailbox is the host's to write (the request) and the runtime's (the
    reply), both in place, so no digest finds it."""

    def __init__(self, environ=os.environ, regions=writable_regions):
        self._limit = limit_pages(environ)
        self._regions = regions
        self._before = None
        self._largest = 0

    def start(self):
        if self._limit:
            self._before = Digests(self._regions())

    def note(self, event, reply):
        self._largest = max(self._largest, len(event), len(reply))

    def finish(self, mailbox=None):
        """``mailbox``: ``(address, capacity)`` of the request and reply, if known."""
        if self._before is None:
            return None
        addrs = written(self._before, Digests(self._regions()))[:self._limit]
        self._before = None
        read = runs(addrs)
        write = [] if mailbox is None else span(mailbox[0], min(self._largest, mailbox[1]))
        return Touch(read, write) if read or write else None
