"""forkvm's Python runtime: serve a handler from a template, one request per clone.

    import forkvm
    forkvm.serve(lambda event: event.upper())

or, from the command line (the image's init runs this with ``forkvm.run=``):

    python3 -m forkvm MODULE:FUNCTION
    python3 -m forkvm              # a zygote: no handler until one is loaded

``serve`` grows the C heap by ``FORKVM_HEAP_MIB`` MiB (default 64, at most a quarter of
the guest's memory; 0: none), touches it and keeps it (no trimming, no allocation mapped on its own), so that a request's
allocations in a clone take no guest page fault; ``python3 -m forkvm`` also runs Python
on that heap (``PYTHONMALLOC=malloc``, unless set). It maps every page of the code and
read-only data its modules brought into its page tables (``_premap``; again after each
load), imports nothing more and maps the mailbox (libforkvm, through ctypes), then
waits on the invoke port: in a template the VM pauses there, and each invocation wakes
a fresh clone with the request already in its memory. The handler gets the payload as
``bytes`` and returns ``bytes`` or ``str`` (sent UTF-8). Before each call, Python's
``random`` is reseeded from the request's fresh host entropy, and ``os.urandom`` is
served from it in user space, with no system call (``_RequestRandom``; the kernel's RNG,
which the VMM rekeys in every clone, serves the rest of the guest, a child the handler
forks, and a function whose ``env`` sets ``FORKVM_URANDOM=kernel``). A template's warm clones
run the loop once ahead of their request without calling the handler (a prime request,
docs/invoke.md). An exception becomes a 500
with its traceback; a reply larger than the mailbox becomes a 500 that says so. A clone
given an address of its own (``POST /invocations?ipv4=...``) has taken it before the
handler is called: libforkvm's ``forkvm_wait`` applies it (docs/shared-storage.md).

A **load request** (a template derived from this one, docs/invoke.md) carries a JSON
object: ``imports``, module names to import; ``source``, Python source run as the
module ``forkvm_function``; ``handler``, the name in it (or ``MODULE:FUNCTION``) that
serves from then on; ``warmup``, events (a string, sent UTF-8, or ``{"base64": ...}``)
the handler is called with once each before the template pauses, so that what a
request touches is already in the memory every clone starts from; ``env``, variables
set in ``os.environ`` before anything else runs (strings; the function's configuration
and secrets); ``logs``, true to capture what each invocation prints; ``disks``, disk
slots (numbers) whose images came with the request (``media``): each one's ext4 file
system is mounted read-only at ``/run/forkvm/slot<N>`` and put first on ``sys.path``
before the imports (packages of the function's own); ``lazy_imports``, true to leave
the imports inside the functions of ``source`` (of a ``MODULE:FUNCTION`` handler: inside
that function) to their calls (by default the loader runs them in the template,
``_preimport``, so that a clone finds those modules loaded; ``python3 -m forkvm
MODULE:FUNCTION`` does the same unless ``FORKVM_LAZY_IMPORTS=1``).
Each is optional. The reply is a JSON object: the modules that were newly imported, the
handler now served, the warm-up events run, the modules pre-imported and ``touched``: the
pages the warm-up wrote (and the mailbox's its events and replies take), which each warm
clone's prime maps so that its request finds them mapped (``forkvm_pages``; off with
``FORKVM_TOUCH_MIB=0`` in ``env``). A failure is a 500 with its traceback, and the
clone is then no template.

**With logs** (``"logs": true``), what the handler writes to ``sys.stdout`` and
``sys.stderr`` (``print``, and ``logging``, whose handlers write there) during an
invocation is kept, its last ``LOG_LIMIT`` characters, and every invocation is answered
with an **envelope** (the VMM's 200) that the caller unpacks: ``ENVELOPE_MAGIC``, a
4-byte little-endian length, that many bytes of a JSON header ``{"status": "ok" |
"error" | "timeout", "body": N, "logs": M, "logs_dropped": D}``, then N bytes of body
(the reply, or for an error the traceback) and M bytes of logs (UTF-8). An invocation
still running shortly before its time limit (``timeout_ms`` less a tenth, at least
50 ms) is interrupted (SIGALRM, raised between Python instructions, so not inside a
long C call) and answered with ``"timeout"`` and its logs; one that does not return
even then meets the VMM's own time limit (504, no logs).

The soft limit's timer costs an invocation no system call when it can: the runtime
arms ``ITIMER_REAL`` before it waits (``ALARM_AHEAD``), so a template pauses with an
expiry about to come, and a clone of it, whose clock has moved on, has it overdue. Its
SIGALRM then comes with the clone's first timer interrupt, which the VMM defers past
the handler's first milliseconds (``--tick-defer-ms``): a short handler ends before it,
and a longer one gets it and re-arms the timer for the rest of its time. The timer is
never disarmed: an expiry between invocations does nothing, and one during an
invocation before its limit re-arms. An invocation arms it itself only when no expiry
is due before its limit.
"""

import _thread
import ctypes
import gc
import importlib
import io
import os
import random
import signal
import sys
import time
import traceback
import types

import forkvm_pages

try:
    from _sha3 import shake_256
except ImportError:  # a Python whose SHA-3 is OpenSSL's only
    from hashlib import shake_256

__all__ = ["serve", "Request"]


class Request(ctypes.Structure):
    """``struct forkvm_request`` (guest/lib/forkvm.h)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sequence", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint32),
        ("entropy", ctypes.c_uint8 * 32),
        ("kind", ctypes.c_uint16),
    ]


# Request kinds, and the features that let the VMM send prime and load requests.
KIND_PRIME = 2
KIND_LOAD = 3
FEATURE_PRIME = 1
FEATURE_LOAD = 2


def _library():
    lib = ctypes.CDLL("libforkvm.so.1")
    lib.forkvm_open.restype = ctypes.c_int
    lib.forkvm_wait.argtypes = [ctypes.POINTER(Request)]
    lib.forkvm_reply.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.forkvm_fail.argtypes = [ctypes.c_char_p]
    lib.forkvm_enable.argtypes = [ctypes.c_uint32]
    lib.forkvm_reply_buffer.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    lib.forkvm_reply_buffer.restype = ctypes.c_void_p
    lib.forkvm_strerror.restype = ctypes.c_char_p
    lib.forkvm_clone_seq.restype = ctypes.c_uint32
    lib.forkvm_generation.restype = ctypes.c_uint64
    return lib


_lib = None


# An envelope's first bytes (with logs, above).
ENVELOPE_MAGIC = b"FKVMENV1"
# Characters of one invocation's output kept with logs: its last ones.
LOG_LIMIT = 64 << 10
# A function's options from its load request: whether invocations are answered with
# their logs in an envelope.
_options = {"logs": False}
# The running invocation's log, when it has one.
_current_log = None
# The live log (docs/invoke.md, "The live log"): the running invocation's output so far, kept
# at the mailbox's end as it is printed, so that the VMM can answer with it when the
# invocation ends without a reply (past the VMM's own time limit, the guest stopped).
# Its header: magic, text length (u32), the request's sequence (u64), bytes dropped
# before the text (u64).
LIVE_MAGIC = b"FKLG"
LIVE_REGION = 64 << 10
LIVE_HEADER = 24


class _Live:
    """The live log of request ``sequence`` in the ``LIVE_REGION`` bytes at address
    ``base``: the header, then the output's last bytes."""

    def __init__(self, base, sequence):
        self.base = base
        self.used = 0
        self.dropped = 0
        head = LIVE_MAGIC + bytes(4) + sequence.to_bytes(8, "little") + bytes(8)
        ctypes.memmove(base, head, LIVE_HEADER)

    def write(self, data):
        room = LIVE_REGION - LIVE_HEADER
        text = self.base + LIVE_HEADER
        if len(data) >= room:
            self.dropped += self.used + len(data) - room
            data = data[len(data) - room:]
            self.used = 0
        elif self.used + len(data) > room:
            keep = room - len(data)
            ctypes.memmove(text, text + self.used - keep, keep)
            self.dropped += self.used - keep
            self.used = keep
        ctypes.memmove(text + self.used, data, len(data))
        self.used += len(data)
        ctypes.c_uint64.from_address(self.base + 16).value = self.dropped
        ctypes.c_uint32.from_address(self.base + 4).value = self.used


class _Log:
    """One invocation's output: its last ``LOG_LIMIT`` characters, and how many more
    were dropped before them; with ``live_at`` (an address and the request's sequence),
    also its live log there, begun at the first write."""

    def __init__(self, live_at=None):
        self.parts = []
        self.size = 0
        self.dropped = 0
        self.live_at = live_at
        self.live = None

    def write(self, text):
        if self.live_at is not None:
            if self.live is None:
                self.live = _Live(*self.live_at)
            self.live.write(text.encode("utf-8", "replace"))
        self.parts.append(text)
        self.size += len(text)
        while self.size > LOG_LIMIT:
            over = self.size - LOG_LIMIT
            first = self.parts[0]
            if len(first) <= over:
                self.parts.pop(0)
                cut = len(first)
            else:
                self.parts[0] = first[over:]
                cut = over
            self.size -= cut
            self.dropped += cut

    def text(self):
        return "".join(self.parts)


class _Stream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a function with logs: text written while an
    invocation runs goes to its log, and to the original stream otherwise (the
    template's own output, before it pauses)."""

    def __init__(self, original):
        super().__init__()
        self.original = original

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        log = _current_log
        if log is None:
            return self.original.write(text)
        log.write(text)
        return len(text)

    def flush(self):
        if _current_log is None:
            self.original.flush()

    def writable(self):
        return True

    @property
    def encoding(self):
        return getattr(self.original, "encoding", "utf-8")


class _Timeout(BaseException):
    """Raised in the handler shortly before its invocation's time limit (with logs).
    Not an ``Exception``, so that a handler's ``except Exception`` does not take it."""


# How far ahead the runtime arms the soft limit's timer before it waits: past the
# moment a template pauses there, so that its clones find the expiry overdue.
ALARM_AHEAD = 0.05
# The soft limit's timer: when its expiry is due (``time.monotonic()``), None when it
# is not armed; and the running invocation's soft limit, None between invocations.
_alarm = {"due": None, "limit": None}


def _arm(seconds):
    """Arms the soft limit's timer ``seconds`` from now (a system call)."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    _alarm["due"] = time.monotonic() + seconds


def _on_alarm(signum, frame):
    _alarm["due"] = None
    limit = _alarm["limit"]
    if limit is None:
        return
    left = limit - time.monotonic()
    if left <= 0:
        raise _Timeout()
    _arm(left)


def _arm_ahead():
    """Before a wait, with logs: arms the timer ``ALARM_AHEAD`` on unless it is armed."""
    if _options["logs"] and _alarm["due"] is None:
        _arm(ALARM_AHEAD)


def _capture_logs():
    """Turns logs on for this runtime: standard output and error become ``_Stream``s
    (before the function's source runs, so a ``logging`` handler it makes writes to
    them) and SIGALRM interrupts a handler near its time limit."""
    if not isinstance(sys.stdout, _Stream):
        sys.stdout = _Stream(sys.stdout)
    if not isinstance(sys.stderr, _Stream):
        sys.stderr = _Stream(sys.stderr)
    signal.signal(signal.SIGALRM, _on_alarm)
    _options["logs"] = True


def _soft_limit_s(timeout_ms):
    """When a handler with logs is interrupted: a tenth (at least 50 ms) before
    ``timeout_ms``; None when there is no limit or no room for it."""
    if timeout_ms <= 0:
        return None
    at = timeout_ms - max(50, timeout_ms // 10)
    return at / 1000.0 if at > 0 else None


def envelope(status, body, log, capacity):
    """An invocation's answer with its logs (the module's docstring), in at most
    ``capacity`` bytes: the logs' first characters are dropped to fit, and a body that
    does not fit even alone becomes an error that says so."""
    import json

    def pack(status, body, logs, dropped):
        head = json.dumps({"status": status, "body": len(body), "logs": len(logs),
                           "logs_dropped": dropped}).encode()
        # One join, one copy of the body (a chain of + made two: a 1 MiB reply's 256
        # pages written twice more in the clone).
        return b"".join((ENVELOPE_MAGIC, len(head).to_bytes(4, "little"), head, body, logs))

    text = log.text()
    dropped = log.dropped
    out = pack(status, body, text.encode("utf-8", "replace"), dropped)
    if len(out) <= capacity:
        return out
    if len(pack(status, body, b"", dropped + len(text))) > capacity - 64:
        status, body = "error", (
            "forkvm: a reply of %d bytes does not fit the mailbox (%d bytes fit)"
            % (len(body), capacity)).encode()
    while len(out) > capacity and text:
        cut = max(len(out) - capacity, len(text) // 8, 1)
        text = text[cut:]
        dropped += cut
        out = pack(status, body, text.encode("utf-8", "replace"), dropped)
    return out


def call_with_logs(handler, event, timeout_ms, capacity, live_at=None):
    """Calls ``handler(event)`` with its output captured and a soft time limit; returns
    the envelope of its reply, its traceback, or its timeout, with its logs, in at
    most ``capacity`` bytes. With ``live_at`` (an address and the request's sequence),
    the output is also kept there as it is printed (``_Live``)."""
    global _current_log
    log = _Log(live_at)
    limit = _soft_limit_s(timeout_ms)
    _current_log = log
    try:
        if limit is not None:
            at = time.monotonic() + limit
            _alarm["limit"] = at
            # An expiry due by the limit (the one armed ahead, overdue in a clone)
            # comes soon enough: the alarm re-arms for the rest.
            if _alarm["due"] is None or _alarm["due"] > at:
                _arm(limit)
        try:
            out = _reply_bytes(handler(event))
        finally:
            _alarm["limit"] = None
        return envelope("ok", out, log, capacity)
    except _Timeout:
        text = "forkvm: the handler was still running %d ms into its %d ms limit\n" % (
            limit * 1000, timeout_ms)
        return envelope("timeout", text.encode(), log, capacity)
    except Exception:
        tb = traceback.format_exc().encode("utf-8", "replace")
        return envelope("error", tb, log, capacity)
    finally:
        _current_log = None


def clone_seq():
    """This VM's clone sequence number (0: not a clone)."""
    return _lib.forkvm_clone_seq() if _lib else 0


# How many pages the VMM named in this clone's prime (forkvm_pages.from_prime).
_prime_pages = 0


def prime_pages():
    """How many pages of this process the VMM named in this clone's prime, which the
    prime read so that the request finds them mapped: those of its template's learned
    working set (0: not primed, or nothing learned yet)."""
    return _prime_pages


def _fail(lib, text):
    lib.forkvm_fail(text.encode("utf-8", "replace"))


def _no_handler(event):
    raise RuntimeError("forkvm: this zygote serves no handler yet: derive a template "
                       "with a load request that names one")


# What a prime reads: the pages the last warm-up wrote and the mailbox's that its
# events and replies would take (forkvm_pages), or None.
_touch = None
# The request's and reply's place in the mailbox, (address, capacity), once served.
_mailbox = None


def load(spec, handler):
    """Carry out a load request ``spec`` (a JSON object, bytes); return the handler to
    serve from now on and the reply."""
    # Imported here, not by the zygote: a zygote has imported nothing a function did
    # not ask for (docs/library.md).
    import json

    spec = json.loads(spec or b"{}")
    if not isinstance(spec, dict):
        raise ValueError("a load request is a JSON object")
    if "requirements" in spec:
        raise ValueError("requirements are resolved on the host (forkvm.ZygoteCache with a "
                         "package cache): the loader takes their image as disks")
    unknown = set(spec) - {"imports", "source", "handler", "warmup", "env", "logs", "disks",
                           "lazy_imports"}
    if unknown:
        raise ValueError("unknown keys in the load request: %s" % ", ".join(sorted(unknown)))
    events = [_warmup_event(i, e) for i, e in enumerate(_list(spec, "warmup"))]
    env = _env(spec.get("env"))
    logs = spec.get("logs", False)
    if not isinstance(logs, bool):
        raise ValueError("logs is true or false")
    lazy = spec.get("lazy_imports", False)
    if not isinstance(lazy, bool):
        raise ValueError("lazy_imports is true or false")
    os.environ.update(env)
    _random.configure(os.environ)
    if logs:
        _capture_logs()
    for slot in _list(spec, "disks"):
        _mount_slot(slot)
    before = set(sys.modules)
    for name in spec.get("imports") or []:
        importlib.import_module(name)
    name = spec.get("handler")
    source = spec.get("source")
    if source is not None:
        module = types.ModuleType("forkvm_function")
        sys.modules["forkvm_function"] = module
        exec(compile(source, "<forkvm_function>", "exec"), module.__dict__)
        if name is None:
            name = "handler"
    preimported = []
    if name is not None:
        modname, _, attr = name.rpartition(":")
        module = importlib.import_module(modname or "forkvm_function")
        handler = getattr(module, attr)
        if not callable(handler):
            raise TypeError("%s is not callable" % name)
        if not lazy:
            preimported = _preimport(module, None if modname else source, attr)
    if events and handler is _no_handler:
        raise ValueError("warm-up events need a handler to call")
    global _touch
    recorder = forkvm_pages.Recorder(os.environ) if events else None
    if recorder is not None:
        recorder.start()
    for i, event in enumerate(events):
        try:
            reply = _reply_bytes(handler(event))
        except Exception as e:
            raise RuntimeError("warm-up event %d failed: %s" % (i, e)) from e
        if recorder is not None:
            recorder.note(event, reply)
    if recorder is not None:
        _touch = recorder.finish(_mailbox)
    reply = {"imported": sorted(set(sys.modules) - before), "handler": name,
             "warmed": len(events), "preimported": preimported,
             "touched": 0 if _touch is None or not events else _touch.pages}
    _settle()
    return handler, json.dumps(reply).encode()


def _nested_imports(source, package=None, only=None):
    """The modules that ``import`` statements inside the functions of ``source`` (or of
    its top-level function ``only`` alone) name, in order, without repeats: what those
    functions would import when called, each as ``(name, maybe)``. For ``from X import
    a``, ``(X, False)`` and then ``(X.a, True)``: a submodule if X is a package with one,
    else a name in X. Relative names are resolved in ``package`` (left out without one).
    Module-level imports ran when the source did, so they are not listed."""
    import ast
    import importlib.util

    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    names = {}  # name -> maybe, in the order first met

    def resolve(node):
        if not node.level:
            return node.module
        if not package:
            return None
        try:
            return importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        except ImportError:
            return None

    def visit(node, inside):
        # Each node once: an import counts inside a function at any depth.
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import):
                for alias in child.names:
                    names.setdefault(alias.name, False)
            elif inside and isinstance(child, ast.ImportFrom):
                base = resolve(child)
                if base is not None:
                    names.setdefault(base, False)
                    for alias in child.names:
                        if alias.name != "*":
                            names.setdefault(base + "." + alias.name, True)
            visit(child, inside or isinstance(child, functions))

    tree = ast.parse(source)
    if only is None:
        visit(tree, False)
    else:
        for top in tree.body:
            if isinstance(top, functions[:2]) and top.name == only:
                visit(top, True)
    return list(names.items())


def _preimport(module, source=None, function=None):
    """Imports what the functions of the handler's ``module`` import when called, so
    that an import at call time finds its module loaded in every clone (a dictionary
    lookup) instead of reading and running it there: in a fresh clone that is the guest
    kernel's file work and the module's own code on every request. ``source`` is the
    module's source when it was given with the load (the function's own: all its
    functions count); otherwise the module is an installed one, whose file is read, and
    only the handler, its top-level function ``function``, counts (a module without
    source: nothing is imported). A name that is no module (``from X import
    function``), or whose import fails, is left for the call to meet as it would have;
    the module's import side effects happen once, in the template. Returns the names
    newly imported."""
    import importlib.util

    if source is None:
        try:
            source = importlib.util.find_spec(module.__name__).loader.get_source(module.__name__)
        except Exception:
            return []
        if source is None:
            return []
    else:
        function = None
    try:
        names = _nested_imports(source, getattr(module, "__package__", None), function)
    except SyntaxError:
        return []
    done = []
    for name, maybe in names:
        if name in sys.modules:
            continue
        if maybe and not hasattr(sys.modules.get(name.rpartition(".")[0]), "__path__"):
            continue  # ``from X import a`` where X is no package: a is a name in X
        try:
            importlib.import_module(name)
        except Exception:
            continue
        done.append(name)
    return done


# How long the loader waits for an inserted disk slot's capacity to show.
SLOT_WAIT_S = 30.0
MS_RDONLY = 1


def _mount_slot(slot, wait_s=SLOT_WAIT_S, sys_block="/sys/block", mount=None, base="/run/forkvm"):
    """A load request's ``disks``: mounts disk slot ``slot``'s file system (ext4,
    read-only) at ``/run/forkvm/slot<N>`` and puts it first on ``sys.path``. The image
    came with the request (``media``): the slot's capacity shows once the guest's
    driver took the configuration change, so it is waited for."""
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 8:
        raise ValueError("disks: %r is no disk slot (0 to 7)" % (slot,))
    serial = "forkvm-slot%d" % slot
    dev = None
    for name in sorted(os.listdir(sys_block)):
        try:
            with open(os.path.join(sys_block, name, "serial")) as f:
                if f.read().strip() == serial:
                    dev = name
        except OSError:
            pass
    if dev is None:
        raise ValueError("disks: the VM has no disk slot %d (vmm run --disk-slots)" % slot)
    deadline = time.monotonic() + wait_s
    while True:
        with open(os.path.join(sys_block, dev, "size")) as f:
            if int(f.read()) > 0:
                break
        if time.monotonic() > deadline:
            raise ValueError("disks: disk slot %d is empty (give its image with the "
                             "request: media=%d:PATH)" % (slot, slot))
        time.sleep(0.01)
    target = os.path.join(base, "slot%d" % slot)
    os.makedirs(target, exist_ok=True)
    (mount or _mount)("/dev/" + dev, target)
    sys.path.insert(0, target)
    return target


def _mount(device, target):
    """mount(2) of ext4 ``device`` at ``target``, read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(device.encode(), target.encode(), b"ext4", MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mounting %s at %s: %s" % (device, target, os.strerror(err)))


def _env(env):
    """A load request's ``env``: an object of strings, names without ``=`` or NUL."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError("env is an object of strings")
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError("env: %r is no variable name" % name)
        if not isinstance(value, str) or "\0" in value:
            raise ValueError("env: %s is not a string without NUL" % name)
    return env


def _list(spec, key):
    value = spec.get(key) or []
    if not isinstance(value, list):
        raise ValueError("%s is a list" % key)
    return value


def _warmup_event(i, e):
    """Warm-up event ``i`` as bytes: a string (UTF-8) or ``{"base64": "..."}``."""
    if isinstance(e, str):
        return e.encode("utf-8")
    if isinstance(e, dict) and set(e) == {"base64"} and isinstance(e["base64"], str):
        import base64
        import binascii

        try:
            return base64.b64decode(e["base64"], validate=True)
        except binascii.Error as err:
            raise ValueError("warm-up event %d: bad base64: %s" % (i, err)) from None
    raise ValueError('warm-up event %d is neither a string nor {"base64": "..."}' % i)


def _reply_bytes(out):
    """A handler's result as the bytes of its reply (``str`` is sent UTF-8)."""
    if isinstance(out, str):
        return out.encode()
    if isinstance(out, int):
        # bytes(5) would be five zero bytes, not what a handler returning 5 meant.
        raise TypeError("a handler returns bytes or str, not int")
    return bytes(out)


class _RequestRandom:
    """``os.urandom`` (and ``random.SystemRandom``, ``secrets``, ``uuid.uuid4``, which
    call it) served in the guest's user space from the request's fresh host entropy,
    not by a ``getrandom`` system call each: kernel work, emulated on a PVM host (nine
    calls, 10 ms of a handler here; docs/invoke.md, "Randomness").

    Keyed at every request with 32 bytes derived from the entropy the VMM wrote into
    the request header (``getrandom`` on the host, fresh per request, so never the
    template's nor another clone's). Each call draws ``32 + n`` bytes of SHAKE256 from
    the key, keeps the first 32 as the next key and returns the rest (fast key erasure:
    a key is never used twice and what was drawn cannot be computed from the key
    after). Unkeyed (before the first request, in a process forked by the handler, for
    lengths from ``KERNEL_FROM`` up, and with ``FORKVM_URANDOM=kernel`` in the
    function's environment) it is the kernel's ``os.urandom``."""

    # Lengths from here up go to the kernel (SHAKE256's digest length stops at 2**29).
    KERNEL_FROM = 1 << 28
    MODES = ("request", "kernel")

    def __init__(self, kernel):
        self._kernel = kernel
        self._key = None
        self._lock = _thread.allocate_lock()
        self.enabled = True
        self._installed = False

    def rekey(self, key):
        with self._lock:
            self._key = key if self.enabled else None

    def drop(self):
        """Forget the key (a forked child: it would draw what its parent draws)."""
        self._key = None

    def urandom(self, n):
        if type(n) is not int or not 0 <= n < self.KERNEL_FROM:
            return self._kernel(n)
        with self._lock:
            key = self._key
            if key is None:
                return self._kernel(n)
            out = shake_256(key).digest(32 + n)
            self._key = out[:32]
        return out[32:]

    def install(self):
        """Serve ``os.urandom`` and ``random``'s own reference to it, once; a child the
        handler forks goes back to the kernel's."""
        if self._installed:
            return
        self._installed = True
        os.urandom = self.urandom
        random._urandom = self.urandom
        os.register_at_fork(after_in_child=self.drop)

    def configure(self, environ):
        """``FORKVM_URANDOM`` from ``environ``: ``request`` (the default) or ``kernel``."""
        mode = environ.get("FORKVM_URANDOM", "request")
        if mode not in self.MODES:
            raise ValueError("FORKVM_URANDOM is request or kernel, not %r" % mode)
        self.enabled = mode == "request"
        if not self.enabled:
            self.drop()


_random = _RequestRandom(os.urandom)


def _reseed(entropy):
    """A request's 32 bytes of host entropy: ``random``'s seed and ``os.urandom``'s key,
    each derived apart (``random``'s Mersenne Twister state can be worked back from its
    output, so it must not hold the key)."""
    derived = shake_256(b"forkvm request entropy" + entropy).digest(64)
    random.seed(derived[:32])
    _random.rekey(derived[32:])


# glibc's mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


# The pre-faulted heap's default size, in MiB, and the share of the guest's memory it
# takes at most.
_HEAP_MIB = 64
_HEAP_SHARE = 4


def _heap_mib(meminfo="/proc/meminfo"):
    """The pre-faulted heap's size, ``FORKVM_HEAP_MIB`` (0: none); by default 64 MiB, or a
    quarter of the guest's memory where that is less (a 32 MiB allocation then fits in a
    256 MiB guest with what the interpreter holds already)."""
    mib = forkvm_pages.env_mib(os.environ, "FORKVM_HEAP_MIB")
    if mib is None:
        return min(_HEAP_MIB, _mem_total_mib(meminfo) // _HEAP_SHARE)
    return mib


def _mem_total_mib(meminfo):
    """The memory the kernel manages (``MemTotal``), in MiB; the default heap's when
    the file cannot tell."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return _HEAP_MIB * _HEAP_SHARE


def _prefault_heap(mib):
    """Grows the C heap by ``mib`` MiB, touches every page of it and keeps it: trimming
    off, and no allocation served by a mapping of its own. In the template, so that in
    a clone the memory a request allocates is already mapped and written: no guest page
    fault on its way (each one is kernel work, emulated on a PVM host)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, 0x7FFFFFFF)
    if mib == 0:
        return
    n = mib << 20
    p = libc.malloc(n)
    if not p:
        raise MemoryError("forkvm: cannot grow the heap by %d MiB (FORKVM_HEAP_MIB)" % mib)
    ctypes.memset(p, 1, n)
    libc.free(p)


# madvise(2)'s MADV_POPULATE_READ (Linux 5.14).
_MADV_POPULATE_READ = 22


def _premap(maps="/proc/self/maps", madvise=None):
    """Maps every page of the process's read-only file mappings (the interpreter's and
    the libraries' code and constants, extension modules) into its page tables, read
    from the disk where not cached yet; returns the bytes mapped. In the template, so
    that a clone running code for the first time (a handler with no warm-up) takes no
    guest page fault for it: each one is kernel work (``filemap_map_pages``, a disk read
    at worst), emulated on a PVM host. Off with ``FORKVM_PREMAP=0``."""
    if os.environ.get("FORKVM_PREMAP", "1") == "0":
        return 0
    if madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

        def madvise(start, length):
            return libc.madvise(start, length, _MADV_POPULATE_READ)

    mapped = 0
    with open(maps) as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 6:
                continue
            perms, path = fields[1], fields[5].rstrip("\n")
            # Writable ones are the process's own data; devices (the mailbox) and
            # deleted files are not the page cache's.
            if not perms.startswith("r") or "w" in perms or not path.startswith("/") \
                    or path.startswith("/dev/") or path.endswith(" (deleted)"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start) == 0:
                mapped += end - start
    return mapped


def _settle():
    """Before a template pauses: collects the garbage its loading and warm-up left and
    freezes what remains (``gc.freeze``: the objects move to a generation no collection
    visits). A clone's request then starts with the collector's counts at zero, and a
    collection it sets off walks only the request's own objects, not the template's:
    each object a collection visits has its header written, a page copied in the
    clone and mapped anew (a 100 KiB JSON handler warmed up took 27.8 ms a request
    without this, 13.8 ms with the collection alone, docs/invoke.md). First it maps
    the code the template's modules bring (``_premap``); returns its bytes."""
    mapped = _premap()
    gc.collect()
    gc.freeze()
    return mapped


def serve(handler=None):
    """Serve ``handler(event: bytes) -> bytes | str`` forever (None: a zygote, which
    serves once a load request gave it a handler)."""
    if handler is None:
        handler = _no_handler
    global _lib, _prime_pages
    lib = _library()
    err = lib.forkvm_open()
    if err != 0:
        raise OSError(-err, "forkvm: " + lib.forkvm_strerror(err).decode())
    _lib = lib
    capacity = ctypes.c_size_t()
    lib.forkvm_reply_buffer(ctypes.byref(capacity))
    capacity = capacity.value
    global _mailbox
    _mailbox = (lib.forkvm_reply_buffer(None), capacity)
    # The live log's place: the mailbox's last LIVE_REGION bytes, in a mailbox of at
    # least twice that (the header's 64 bytes come before the reply buffer).
    live_base = None
    if capacity + 64 >= 2 * LIVE_REGION:
        live_base = lib.forkvm_reply_buffer(None) + capacity - LIVE_REGION
    req = Request()
    # Touch the serving path once in the template (not the handler): a clone then
    # finds it in memory, with no guest page fault on the way to the handler.
    _random.configure(os.environ)
    _random.install()
    _reseed(bytes(32))
    _random.rekey(None)
    _prefault_heap(_heap_mib())
    ctypes.string_at(lib.forkvm_reply_buffer(None), 0)
    mapped = _settle()
    print("forkvm.serve: ready (%d bytes fit the mailbox, %d MiB of code mapped)"
          % (capacity, mapped >> 20), file=sys.stderr, flush=True)
    # A template's warm clones run this loop once before their request (a prime request:
    # all of it but the handler), so the request finds its path in the clone's page tables.
    lib.forkvm_enable(FEATURE_PRIME | FEATURE_LOAD)
    while True:
        _arm_ahead()
        err = lib.forkvm_wait(ctypes.byref(req))
        if err != 0:
            _fail(lib, "forkvm: " + lib.forkvm_strerror(err).decode())
            continue
        event = ctypes.string_at(req.data, req.len)
        _reseed(bytes(req.entropy))
        try:
            if req.kind == KIND_LOAD:
                handler, out = load(event, handler)
            elif req.kind == KIND_PRIME:
                out = b""
                if _touch is not None:
                    # The pages the warm-up wrote, mapped in this clone's VM before
                    # its request writes them (forkvm_pages).
                    _touch()
                # The pages the VMM names: those of the learned working set.
                named = forkvm_pages.from_prime(event)
                if named is not None:
                    named()
                    _prime_pages = named.pages
                if _options["logs"]:
                    # Its path, touched: the envelope, and a live log written with the
                    # prime's sequence (0: the VMM reads one only for its request's), so
                    # that a request's first print finds the code, and the mailbox's
                    # pages, already in this clone (3-13 ms a request here otherwise).
                    log = _Log(None if live_base is None else (live_base, 0))
                    log.write("forkvm: prime\n")
                    envelope("ok", out, log, capacity)
            elif _options["logs"]:
                # A live log, unless the request's payload reaches into its place.
                live_at = None
                if live_base is not None and req.len <= capacity - LIVE_REGION:
                    live_at = (live_base, req.sequence)
                out = call_with_logs(handler, event, req.timeout_ms, capacity, live_at)
            else:
                out = handler(event)
            out = _reply_bytes(out)
        except Exception:
            _fail(lib, traceback.format_exc())
            continue
        if len(out) > capacity:
            _fail(lib, "forkvm: a reply of %d bytes does not fit the mailbox (%d bytes fit)"
                  % (len(out), capacity))
            continue
        lib.forkvm_reply(out, len(out))


def main(argv):
    # Python's own allocator takes its arenas straight from mmap and gives empty ones
    # back, so a clone would fault them in anew: run on the C heap, which serve()
    # pre-faults. Set before the interpreter starts, hence the exec (a PYTHONMALLOC the
    # caller chose is kept).
    if "PYTHONMALLOC" not in os.environ:
        os.environ["PYTHONMALLOC"] = "malloc"
        os.execv(sys.executable, [sys.executable, "-m", "forkvm"] + argv[1:])
    if len(argv) == 1:
        serve(None)
        return 0
    if len(argv) != 2 or ":" not in argv[1]:
        print("usage: python3 -m forkvm [MODULE:FUNCTION]", file=sys.stderr)
        return 2
    module, function = argv[1].split(":", 1)
    module = importlib.import_module(module)
    if os.environ.get("FORKVM_LAZY_IMPORTS") != "1":
        _preimport(module, function=function)
    serve(getattr(module, function))
    return 0


if __name__ == "__main__":
    # Serve from the importable module, not from __main__, so that handlers that
    # `import forkvm` see the library this loop opened.
    import forkvm

    sys.exit(forkvm.main(sys.argv))
