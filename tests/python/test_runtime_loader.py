"""The Python runtime's loader (guest/python/forkvm.py), run on the host: no mailbox is
needed to load a handler and warm it up. Run by tests/tests/python_runtime.rs."""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "guest", "python"))

import forkvm  # noqa: E402


SOURCE = """
seen = []

def handler(event):
    seen.append(event)
    if event == b"boom":
        raise ValueError("no boom here")
    if event == b"int":
        return 5
    return event.upper()
"""


def load(spec, handler=forkvm._no_handler):
    return forkvm.load(json.dumps(spec).encode(), handler)


class Loader(unittest.TestCase):
    def test_warmup_events_run_in_order_before_the_reply(self):
        handler, reply = load({"source": SOURCE, "warmup": ["a", {"base64": "AP8="}, ""]})
        reply = json.loads(reply)
        self.assertGreater(reply.pop("touched"), 0)
        self.assertEqual(reply, {"imported": [], "handler": "handler", "warmed": 3,
                                 "preimported": []})
        module = sys.modules["forkvm_function"]
        self.assertEqual(module.seen, [b"a", b"\x00\xff", b""])
        self.assertEqual(handler(b"x"), b"X")

    def test_a_load_leaves_the_collector_nothing_of_the_template_to_walk(self):
        import gc
        gc.unfreeze()
        # Garbage the warm-up makes (a cycle per event) and objects it keeps.
        source = SOURCE + "\nkept = []\n_h = handler\ndef handler(event):\n" \
            "    a = []; a.append(a); kept.append([event])\n    return _h(event)\n"
        load({"source": source, "warmup": ["a", "b"]})
        # Collected (no cycle left for a clone's first collection to find), and what is
        # left frozen: a collection visits none of it, nor writes its headers.
        self.assertEqual(gc.collect(), 0)
        self.assertGreater(gc.get_freeze_count(), 0)
        self.assertFalse(any(o is sys.modules["forkvm_function"].kept for o in gc.get_objects()))
        gc.unfreeze()

    def test_no_warmup_warms_nothing(self):
        _, reply = load({"source": SOURCE})
        self.assertEqual(json.loads(reply)["warmed"], 0)
        self.assertEqual(sys.modules["forkvm_function"].seen, [])

    def test_a_failing_warmup_event_fails_the_load_and_names_the_event(self):
        with self.assertRaises(RuntimeError) as e:
            load({"source": SOURCE, "warmup": ["ok", "boom"]})
        self.assertIn("warm-up event 1 failed: no boom here", str(e.exception))
        self.assertIsInstance(e.exception.__cause__, ValueError)

    def test_a_reply_that_is_no_bytes_fails_the_warmup_as_it_would_a_request(self):
        with self.assertRaises(RuntimeError) as e:
            load({"source": SOURCE, "warmup": ["int"]})
        self.assertIn("returns bytes or str, not int", str(e.exception))

    def test_bad_events_are_refused_with_their_index(self):
        for bad, says in [
            (["ok", 3], "warm-up event 1 is neither"),
            ([{"base64": "!!"}], "warm-up event 0: bad base64"),
            ([{"base64": "AA==", "x": "y"}], "warm-up event 0 is neither"),
            ("abc", "warmup is a list"),
        ]:
            with self.assertRaises(ValueError, msg=bad) as e:
                load({"source": SOURCE, "warmup": bad})
            self.assertIn(says, str(e.exception))

    def test_warmup_needs_a_handler(self):
        with self.assertRaises(ValueError) as e:
            load({"imports": ["json"], "warmup": ["a"]})
        self.assertIn("need a handler", str(e.exception))

    def test_a_loaded_handler_keeps_serving_a_warmup_of_a_later_load(self):
        handler, _ = load({"source": SOURCE})
        _, reply = load({"imports": ["json"], "warmup": ["b"]}, handler)
        self.assertEqual(json.loads(reply)["warmed"], 1)

    def test_a_disk_slot_is_found_by_its_serial_waited_for_and_mounted_first_on_the_path(self):
        import os
        import tempfile
        import threading

        with tempfile.TemporaryDirectory() as sysblock:
            for dev, serial, size in [("vda", "forkvm-disk0", "8"), ("vdb", "forkvm-slot1", "0")]:
                os.makedirs(os.path.join(sysblock, dev))
                with open(os.path.join(sysblock, dev, "serial"), "w") as f:
                    f.write(serial + "\n")
                with open(os.path.join(sysblock, dev, "size"), "w") as f:
                    f.write(size + "\n")
            mounted = []

            def grow():
                with open(os.path.join(sysblock, "vdb", "size"), "w") as f:
                    f.write("16\n")

            # The capacity shows a moment later, as the guest driver takes the change.
            threading.Timer(0.1, grow).start()
            path = list(sys.path)
            try:
                run = os.path.join(sysblock, "run")
                target = forkvm._mount_slot(1, wait_s=5, sys_block=sysblock, base=run,
                                            mount=lambda d, t: mounted.append((d, t)))
                want = os.path.join(run, "slot1")
                self.assertEqual(mounted, [("/dev/vdb", want)])
                self.assertEqual((target, sys.path[0]), (want, want))
            finally:
                sys.path[:] = path
            with self.assertRaisesRegex(ValueError, "no disk slot 2"):
                forkvm._mount_slot(2, sys_block=sysblock, mount=mounted.append)
            with open(os.path.join(sysblock, "vdb", "size"), "w") as f:
                f.write("0\n")
            with self.assertRaisesRegex(ValueError, "disk slot 1 is empty"):
                forkvm._mount_slot(1, wait_s=0.05, sys_block=sysblock, mount=mounted.append)
            for bad in [8, -1, "0", True]:
                with self.assertRaisesRegex(ValueError, "no disk slot"):
                    forkvm._mount_slot(bad, sys_block=sysblock, mount=mounted.append)
            self.assertEqual(len(mounted), 1)

    def test_unknown_keys_are_refused(self):
        with self.assertRaises(ValueError) as e:
            load({"source": SOURCE, "warm": ["a"]})
        self.assertIn("unknown keys in the load request: warm", str(e.exception))

    def test_requirements_are_the_hosts_to_resolve(self):
        with self.assertRaisesRegex(ValueError, "resolved on the host"):
            load({"source": SOURCE, "requirements": ["pyyaml"]})


class Preimport(unittest.TestCase):
    """Imports inside the handler module's functions are run by the loader, in the
    template, unless the load says ``lazy_imports``."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tag = "fkpre%d_%d" % (os.getpid(), id(self))
        files = {
            "mod.py": "LOADED = True\n",
            "pkg/__init__.py": "",
            "pkg/sub.py": "",
            "plain.py": "def f():\n    return 1\n",
            "meth.py": "",
            "raises.py": "raise RuntimeError('not importable')\n",
            "rel/__init__.py": "",
            "rel/dep.py": "",
            "rel/h.py": "def handler(e):\n    from . import dep\n    return b'r'\n"
                        "def other(e):\n    from . import other\n",
            "rel/other.py": "",
        }
        for name, text in files.items():
            path = os.path.join(self.dir.name, self.tag, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        with open(os.path.join(self.dir.name, self.tag, "__init__.py"), "w"):
            pass
        sys.path.insert(0, self.dir.name)

    def tearDown(self):
        sys.path.remove(self.dir.name)
        for name in [m for m in sys.modules if m.startswith(self.tag)]:
            del sys.modules[name]
        self.dir.cleanup()

    def source(self):
        t = self.tag
        return (
            "import json\n"
            "def handler(event):\n"
            "    import %s.mod\n"
            "    from %s.pkg import sub\n"
            "    from %s.plain import f\n"
            "    if event == b'missing':\n"
            "        import %s.missing\n"
            "    if event == b'raises':\n"
            "        import %s.raises\n"
            "    return b'ok'\n"
            "class C:\n"
            "    def m(self):\n"
            "        import %s.meth\n" % ((t,) * 6))

    def test_imports_inside_functions_are_imported_at_load(self):
        t = self.tag
        handler, reply = load({"source": self.source()})
        reply = json.loads(reply)
        for name in ("mod", "pkg", "pkg.sub", "plain", "meth"):
            self.assertIn("%s.%s" % (t, name), sys.modules)
        self.assertEqual(reply["preimported"], [t + ".mod", t + ".pkg", t + ".pkg.sub",
                                                t + ".plain", t + ".meth"])
        self.assertTrue(sys.modules[t + ".mod"].LOADED)
        # A name that is no module, one that does not exist and one whose import fails
        # are left to the call, which meets them as it would have.
        self.assertNotIn(t + ".plain.f", sys.modules)
        self.assertNotIn(t + ".missing", sys.modules)
        self.assertNotIn(t + ".raises", sys.modules)
        self.assertEqual(handler(b"x"), b"ok")
        with self.assertRaises(ModuleNotFoundError):
            handler(b"missing")
        with self.assertRaisesRegex(RuntimeError, "not importable"):
            handler(b"raises")

    def test_lazy_imports_leaves_them_to_the_call(self):
        handler, reply = load({"source": self.source(), "lazy_imports": True})
        self.assertEqual(json.loads(reply)["preimported"], [])
        self.assertNotIn(self.tag + ".mod", sys.modules)
        self.assertEqual(handler(b"x"), b"ok")
        self.assertIn(self.tag + ".mod", sys.modules)
        with self.assertRaisesRegex(ValueError, "lazy_imports is true or false"):
            load({"source": self.source(), "lazy_imports": "yes"})

    def test_a_named_module_is_read_from_its_file_relative_names_in_its_package(self):
        t = self.tag
        _, reply = load({"handler": t + ".rel.h:handler"})
        # Of an installed module, the handler's own imports only.
        self.assertEqual(json.loads(reply)["preimported"], [t + ".rel.dep"])
        self.assertIn(t + ".rel.dep", sys.modules)
        self.assertNotIn(t + ".rel.other", sys.modules)

    def test_relative_imports_of_source_without_a_package_are_left_out(self):
        self.assertEqual(forkvm._nested_imports("def h():\n    from . import x\n    import a.b\n"),
                         [("a.b", False)])
        self.assertEqual(forkvm._nested_imports("import top\nh = lambda: __import__('x')\n"), [])


class Heap(unittest.TestCase):
    def test_the_heap_size_comes_from_the_environment_and_bad_ones_say_why(self):
        old = os.environ.pop("FORKVM_HEAP_MIB", None)
        try:
            # 64 MiB, or a quarter of the guest's memory where that is less; a
            # meminfo that cannot be read gives the default.
            with tempfile.TemporaryDirectory() as d:
                meminfo = os.path.join(d, "meminfo")
                for kib, mib in [(262144 - 6000, 62), (1 << 20, 64), (131072, 32)]:
                    with open(meminfo, "w") as f:
                        f.write("MemTotal:       %d kB\nMemFree: 1 kB\n" % kib)
                    self.assertEqual(forkvm._heap_mib(meminfo), mib)
                self.assertEqual(forkvm._heap_mib(os.path.join(d, "none")), 64)
                with open(meminfo, "w") as f:
                    f.write("MemTotal: lots\n")
                self.assertEqual(forkvm._heap_mib(meminfo), 64)
            for text, mib in [("0", 0), ("128", 128)]:
                os.environ["FORKVM_HEAP_MIB"] = text
                self.assertEqual(forkvm._heap_mib(), mib)
            for bad in ["", "x", "-1", "65537"]:
                os.environ["FORKVM_HEAP_MIB"] = bad
                with self.assertRaises(ValueError) as e:
                    forkvm._heap_mib()
                self.assertIn("FORKVM_HEAP_MIB is a number of MiB", str(e.exception))
        finally:
            os.environ.pop("FORKVM_HEAP_MIB", None)
            if old is not None:
                os.environ["FORKVM_HEAP_MIB"] = old


LOGGING_SOURCE = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
log = logging.getLogger("fn")
GREETING = os.environ.get("GREETING", "none")

def handler(event):
    print("got", event)
    log.warning("careful")
    if event == b"boom":
        raise ValueError("no boom here")
    if event == b"loop":
        print("looping")
        while True:
            pass
    if event == b"chatty":
        for i in range(8000):
            print("line %05d" % i)
    if event == b"big":
        return b"x" * 5000
    print("done", file=sys.stderr)
    return GREETING + " " + os.environ.get("TOKEN", "")
"""


def unpack(answer):
    """An envelope as (header, body, logs)."""
    magic = forkvm.ENVELOPE_MAGIC
    assert answer.startswith(magic), answer[:40]
    n = int.from_bytes(answer[len(magic):len(magic) + 4], "little")
    rest = answer[len(magic) + 4:]
    head = json.loads(rest[:n])
    body = rest[n:n + head["body"]]
    logs = rest[n + head["body"]:]
    assert len(logs) == head["logs"], (len(logs), head)
    return head, body, logs.decode()


class EnvAndLogs(unittest.TestCase):
    def setUp(self):
        self.streams = (sys.stdout, sys.stderr)
        self.env = dict(os.environ)

    def tearDown(self):
        sys.stdout, sys.stderr = self.streams
        forkvm._options["logs"] = False
        os.environ.clear()
        os.environ.update(self.env)
        import logging
        import signal

        for h in list(logging.root.handlers):
            logging.root.removeHandler(h)
        # The runtime never disarms the soft limit's timer: this process does.
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGALRM])
        forkvm._alarm.update(due=None, limit=None)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    def load(self, **extra):
        spec = {"source": LOGGING_SOURCE, "logs": True,
                "env": {"GREETING": "hi", "TOKEN": "s3cret"}}
        spec.update(extra)
        handler, _ = load(spec)
        return handler

    def call(self, handler, event, timeout_ms=30000, capacity=1 << 22):
        return unpack(forkvm.call_with_logs(handler, event, timeout_ms, capacity))

    def test_env_reaches_the_source_and_the_handler(self):
        handler = self.load()
        self.assertEqual(sys.modules["forkvm_function"].GREETING, "hi")
        head, body, _ = self.call(handler, b"x")
        self.assertEqual((head["status"], body), ("ok", b"hi s3cret"))

    def test_bad_env_and_logs_are_refused(self):
        for env, says in [([], "env is an object"), ({"A=B": "x"}, "no variable name"),
                          ({"": "x"}, "no variable name"), ({"A": 1}, "A is not a string"),
                          ({"A": "x\0y"}, "A is not a string")]:
            with self.assertRaises(ValueError, msg=env) as e:
                load({"source": SOURCE, "env": env})
            self.assertIn(says, str(e.exception))
        with self.assertRaises(ValueError) as e:
            load({"source": SOURCE, "logs": "yes"})
        self.assertIn("logs is true or false", str(e.exception))

    def test_an_ok_invocation_answers_with_what_it_printed_and_logged_in_order(self):
        handler = self.load()
        head, body, logs = self.call(handler, b"x")
        self.assertEqual(head["status"], "ok")
        self.assertEqual(logs, "got b'x'\nWARNING careful\ndone\n")
        self.assertEqual(head["logs_dropped"], 0)
        # The next invocation's log starts empty.
        _, _, logs = self.call(handler, b"y")
        self.assertTrue(logs.startswith("got b'y'\n"), logs)

    def test_a_raising_invocation_answers_with_its_traceback_and_its_logs(self):
        handler = self.load()
        head, body, logs = self.call(handler, b"boom")
        self.assertEqual(head["status"], "error")
        self.assertIn(b"ValueError: no boom here", body)
        self.assertEqual(logs, "got b'boom'\nWARNING careful\n")

    def test_an_invocation_near_its_time_limit_is_interrupted_with_its_logs(self):
        import time

        handler = self.load()
        t0 = time.monotonic()
        head, body, logs = self.call(handler, b"loop", timeout_ms=400)
        took = time.monotonic() - t0
        self.assertEqual(head["status"], "timeout")
        self.assertIn(b"still running 350 ms into its 400 ms limit", body)
        self.assertIn("looping\n", logs)
        self.assertLess(took, 0.4)
        # The alarm is spent: a later invocation runs to its end.
        self.assertEqual(self.call(handler, b"x", timeout_ms=400)[0]["status"], "ok")

    def arms(self):
        """Counts the runtime's calls of setitimer until the test ends."""
        import signal

        calls = []
        real = signal.setitimer

        def counted(which, seconds, interval=0.0):
            calls.append(seconds)
            return real(which, seconds, interval)

        signal.setitimer = counted
        self.addCleanup(setattr, signal, "setitimer", real)
        return calls

    def test_an_invocation_arms_no_timer_when_an_expiry_is_due_before_its_limit(self):
        import time

        handler = self.load()
        calls = self.arms()
        # The first arms the timer for its soft limit, and leaves it armed.
        self.assertEqual(self.call(handler, b"x")[0]["status"], "ok")
        self.assertEqual(calls, [27.0])
        # Then none does while that expiry comes first.
        self.assertEqual(self.call(handler, b"y")[0]["status"], "ok")
        self.assertEqual(calls, [27.0])
        # One with a nearer limit arms its own.
        self.assertEqual(self.call(handler, b"x", timeout_ms=400)[0]["status"], "ok")
        self.assertEqual(calls, [27.0, 0.35])
        # None does in a clone whose template armed the timer ahead: the expiry is
        # overdue there (due in the past).
        forkvm._alarm["due"] = time.monotonic() - 5
        self.assertEqual(self.call(handler, b"z", timeout_ms=400)[0]["status"], "ok")
        self.assertEqual(calls, [27.0, 0.35])

    def test_an_overdue_expiry_taken_during_an_invocation_rearms_for_the_rest(self):
        import signal
        import time

        forkvm._capture_logs()
        calls = self.arms()
        # A clone's: the expiry armed ahead falls due while the signal cannot come (in
        # a clone: its timer interrupt deferred), then comes inside the handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        forkvm._arm_ahead()
        time.sleep(forkvm.ALARM_AHEAD * 2)
        self.assertEqual(len(calls), 1)

        def handler(event):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGALRM])
            print("spinning")
            while True:
                pass

        t0 = time.monotonic()
        head, body, logs = self.call(handler, b"", timeout_ms=400)
        took = time.monotonic() - t0
        self.assertEqual(head["status"], "timeout", body)
        self.assertEqual(logs, "spinning\n")
        self.assertTrue(0.34 < took < 0.4, took)
        # The invocation armed nothing itself; the overdue expiry re-armed for the rest.
        self.assertEqual(len(calls), 2)
        self.assertTrue(0.3 < calls[1] <= 0.35, calls)
        # Before the next wait, it is armed ahead again.
        forkvm._arm_ahead()
        self.assertEqual(calls[2:], [forkvm.ALARM_AHEAD])

    def test_logs_are_bounded_to_their_last_characters(self):
        handler = self.load()
        head, _, logs = self.call(handler, b"chatty")
        self.assertEqual(len(logs), forkvm.LOG_LIMIT)
        self.assertTrue(logs.endswith("line 07999\ndone\n"), logs[-40:])
        printed = len("got b'chatty'\n") + len("WARNING careful\n") + 11 * 8000 + len("done\n")
        self.assertEqual(head["logs_dropped"], printed - forkvm.LOG_LIMIT)

    def test_an_envelope_fits_the_mailbox_logs_cut_first(self):
        handler = self.load()
        answer = forkvm.call_with_logs(handler, b"chatty", 30000, 4096)
        self.assertLessEqual(len(answer), 4096)
        head, body, logs = unpack(answer)
        self.assertEqual(head["status"], "ok")
        self.assertTrue(logs.endswith("done\n"))
        self.assertGreater(head["logs_dropped"], 50000)
        head, body, _ = unpack(forkvm.call_with_logs(handler, b"big", 30000, 4096))
        self.assertEqual(head["status"], "error")
        self.assertIn(b"a reply of 5000 bytes does not fit the mailbox", body)

    def live(self, handler, event, sequence=7):
        """Calls ``handler`` with a live log in a region of its own; returns the
        envelope's logs and the region's header and text."""
        import ctypes

        region = ctypes.create_string_buffer(forkvm.LIVE_REGION)
        base = ctypes.addressof(region)
        _, _, logs = unpack(forkvm.call_with_logs(handler, event, 30000, 1 << 22,
                                                  (base, sequence)))
        raw = region.raw
        head = (raw[0:4], int.from_bytes(raw[4:8], "little"),
                int.from_bytes(raw[8:16], "little"), int.from_bytes(raw[16:24], "little"))
        text = raw[forkvm.LIVE_HEADER:forkvm.LIVE_HEADER + head[1]].decode()
        return logs, head, text

    def test_the_live_log_holds_what_was_printed_as_it_was_printed(self):
        handler = self.load()
        logs, head, text = self.live(handler, b"x")
        self.assertEqual(head[0], b"FKLG")
        self.assertEqual(head[2], 7, "the request's sequence")
        self.assertEqual(head[3], 0, "nothing dropped")
        self.assertEqual(text, logs)
        self.assertEqual(text, "got b'x'\nWARNING careful\ndone\n")

    def test_the_live_log_keeps_the_last_bytes_and_counts_the_rest(self):
        handler = self.load()
        logs, head, text = self.live(handler, b"chatty", sequence=9)
        room = forkvm.LIVE_REGION - forkvm.LIVE_HEADER
        printed = len("got b'chatty'\n") + len("WARNING careful\n") + 11 * 8000 + len("done\n")
        self.assertEqual((head[1], head[2]), (room, 9))
        self.assertEqual(head[3], printed - room)
        self.assertTrue(text.endswith("line 07999\ndone\n"), text[-40:])
        self.assertTrue(logs.endswith(text), "the envelope's logs end as the live log")

    def test_no_live_log_is_begun_by_a_handler_that_prints_nothing(self):
        import ctypes

        handler, _ = load({"source": "def handler(e):\n    return e\n", "logs": True})
        region = ctypes.create_string_buffer(forkvm.LIVE_REGION)
        forkvm.call_with_logs(handler, b"quiet", 30000, 1 << 22,
                              (ctypes.addressof(region), 3))
        self.assertEqual(region.raw[:forkvm.LIVE_HEADER], bytes(forkvm.LIVE_HEADER),
                         "the mailbox is not written (no copy-on-write in a clone)")

    def test_output_outside_an_invocation_goes_to_the_original_stream(self):
        import io

        self.load()
        original = io.StringIO()
        sys.stdout.original = original
        print("template talking")
        self.assertEqual(original.getvalue(), "template talking\n")


class WarmupPages(unittest.TestCase):
    """forkvm_pages: the pages a warm-up wrote, kept for the primes."""

    def test_what_a_warmup_writes_is_kept_and_read_again_in_a_prime(self):
        import ctypes
        import forkvm_pages

        # A warm-up that fills 1 MiB it keeps: those 256 pages, at least, were written.
        source = "kept = []\ndef handler(event):\n    kept.append(bytearray(b'x') * (1 << 20))\n" \
            "    return b''\n"
        _, reply = load({"source": source, "warmup": ["a"], "env": {"FORKVM_TOUCH_MIB": "64"}})
        del os.environ["FORKVM_TOUCH_MIB"]
        touched = json.loads(reply)["touched"]
        self.assertGreaterEqual(touched, 256)
        self.assertEqual(forkvm._touch.pages, touched)
        buf = sys.modules["forkvm_function"].kept[0]
        start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        pages = set()
        for view in forkvm._touch._read:
            # Each view reads one byte of each page of its run.
            base = ctypes.addressof(view.obj)
            pages.update(base + i * forkvm_pages.PAGE for i in range(len(view)))
        first = -(-start // forkvm_pages.PAGE) * forkvm_pages.PAGE
        inside = range(first, start + len(buf) - forkvm_pages.PAGE, forkvm_pages.PAGE)
        self.assertTrue(set(inside) <= pages)
        forkvm._touch()

    def test_no_pages_are_kept_when_turned_off_or_without_a_warmup(self):
        os.environ["FORKVM_TOUCH_MIB"] = "0"
        try:
            _, reply = load({"source": SOURCE, "warmup": ["a"]})
        finally:
            del os.environ["FORKVM_TOUCH_MIB"]
        self.assertEqual(json.loads(reply)["touched"], 0)
        os.environ["FORKVM_TOUCH_MIB"] = "64"
        try:
            _, reply = load({"source": SOURCE})
        finally:
            del os.environ["FORKVM_TOUCH_MIB"]
        self.assertEqual(json.loads(reply)["touched"], 0)

    def test_the_pages_a_prime_request_names_are_read_and_left_as_they_were(self):
        import ctypes
        import struct
        import forkvm_pages

        P = forkvm_pages.PAGE
        self.assertIsNone(forkvm_pages.from_prime(b""))
        self.assertIsNone(forkvm_pages.from_prime(b"\0" * 15))
        box = ctypes.create_string_buffer(9 * P)
        first = (ctypes.addressof(box) + P - 1) // P
        ctypes.memmove(box, bytes(range(256)) * (9 * P // 256), 9 * P)
        payload = struct.pack("<4Q", first, 3, first + 5, 2)
        # A trailing partial run and empty runs are ignored.
        touch = forkvm_pages.from_prime(payload + struct.pack("<2Q", first + 7, 0) + b"x")
        self.assertEqual(touch.pages, 5)
        touch()
        self.assertEqual(box.raw, bytes(range(256)) * (9 * P // 256))
        self.assertIsNone(forkvm_pages.from_prime(struct.pack("<2Q", first, 0)))

    def test_the_mailbox_pages_the_largest_event_or_reply_takes_are_read_too(self):
        import ctypes
        import forkvm_pages

        P = forkvm_pages.PAGE
        self.assertEqual(forkvm_pages.span(P + 64, 0), [])
        self.assertEqual(forkvm_pages.span(P + 64, 1), [(P, 1)])
        self.assertEqual(forkvm_pages.span(P + 64, P), [(P, 2)])
        self.assertEqual(forkvm_pages.span(P, 3 * P), [(P, 3)])
        box = ctypes.create_string_buffer(8 * P)
        mailbox = (ctypes.addressof(box) + 64, 8 * P - 64)
        on = {"FORKVM_TOUCH_MIB": "64"}
        self.assertIsNone(forkvm_pages.Recorder({}, regions=lambda: []).finish(mailbox))
        nothing = forkvm_pages.Recorder(on, regions=lambda: [])
        nothing.start()
        self.assertIsNone(nothing.finish(mailbox))
        rec = forkvm_pages.Recorder(on, regions=lambda: [])
        rec.start()
        rec.note(b"e" * (2 * P), b"r")
        rec.note(b"e", b"r" * (3 * P))
        touch = rec.finish(mailbox)
        self.assertEqual(touch.pages, len(range(mailbox[0] // P, (mailbox[0] + 3 * P - 1) // P + 1)))
        # Its pages are written back as they were.
        ctypes.memmove(box, bytes(range(256)) * (8 * P // 256), 8 * P)
        touch()
        self.assertEqual(box.raw, bytes(range(256)) * (8 * P // 256))
        # Never past the mailbox's end, whatever the replies' sizes.
        rec = forkvm_pages.Recorder(on, regions=lambda: [])
        rec.start()
        rec.note(b"", b"r" * (100 * P))
        self.assertLessEqual(rec.finish(mailbox).pages, 9)

    def test_a_bad_limit_is_refused(self):
        import forkvm_pages

        for bad in ("x", "-1", "65537"):
            with self.assertRaises(ValueError):
                forkvm_pages.limit_pages({"FORKVM_TOUCH_MIB": bad})
        self.assertEqual(forkvm_pages.limit_pages({"FORKVM_TOUCH_MIB": "1"}),
                         (1 << 20) // forkvm_pages.PAGE)

    def test_written_pages_are_the_changed_and_the_new_in_runs(self):
        import forkvm_pages

        P = forkvm_pages.PAGE

        def digests(regions, pages):
            # pages: {address: content}; absent ones are not resident.
            return forkvm_pages.Digests(
                regions,
                resident=lambda s, e: bytes(int(a in pages) for a in range(s, e, P)),
                read=lambda a: pages[a])

        # The second region grew downwards (a stack) and up; a third one is new.
        before = digests([(0, 3 * P), (5 * P, 7 * P)],
                         {0: b"a", P: b"b", 5 * P: b"c", 6 * P: b"d"})
        after = digests([(0, 3 * P), (4 * P, 8 * P), (9 * P, 10 * P)],
                        {0: b"a", P: b"B", 2 * P: b"new", 4 * P: b"e", 5 * P: b"c",
                         6 * P: b"D", 7 * P: b"f", 9 * P: b"g"})
        import zlib
        self.assertEqual(before.get(5 * P), zlib.crc32(b"c") + 1)
        self.assertEqual(before.get(3 * P), 0)
        self.assertEqual(before.get(-1), 0)
        addrs = forkvm_pages.written(before, after)
        self.assertEqual(addrs, [P, 2 * P, 4 * P, 6 * P, 7 * P, 9 * P])
        self.assertEqual(forkvm_pages.runs(addrs), [(P, 2), (4 * P, 1), (6 * P, 2), (9 * P, 1)])

    def test_only_private_writable_mappings_not_devices_are_read(self):
        import forkvm_pages

        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("1000-3000 rw-p 00000000 00:00 0 \n"
                    "3000-4000 r--p 00000000 08:01 5 /usr/lib/x.so\n"
                    "4000-5000 rw-s 00000000 00:05 6 /dev/mem\n"
                    "5000-6000 rw-p 00000000 00:05 6 /dev/zero\n"
                    "6000-7000 rw-p 00001000 08:01 5 /usr/bin/python3\n"
                    "7000-9000 rw-p 00000000 00:00 0 [heap]\n"
                    "9000-a000 r--p 00000000 00:00 0 [vvar]\n")
        try:
            self.assertEqual(forkvm_pages.writable_regions(f.name),
                             [(0x1000, 0x3000), (0x6000, 0x7000), (0x7000, 0x9000)])
        finally:
            os.unlink(f.name)


class Premap(unittest.TestCase):
    MAPS = """\
55d0c0000000-55d0c0100000 r--p 00000000 fe:00 1234   /usr/bin/python3.11
55d0c0100000-55d0c0400000 r-xp 00100000 fe:00 1234   /usr/bin/python3.11
55d0c0400000-55d0c0401000 rw-p 00400000 fe:00 1234   /usr/bin/python3.11
55d0c0500000-55d0c0600000 rw-p 00000000 00:00 0      [heap]
7f0000000000-7f0000001000 ---p 00000000 fe:00 99     /usr/lib/x86_64-linux-gnu/libm.so.6
7f0000001000-7f0000003000 r-xp 00001000 fe:00 99     /usr/lib/x86_64-linux-gnu/libm.so.6
7f0000010000-7f0000011000 rw-s 1ff00000 00:05 7      /dev/mem
7f0000020000-7f0000021000 r--s 00000000 00:05 8      /dev/zero
7f0000030000-7f0000031000 r--p 00000000 fe:00 77     /tmp/gone (deleted)
7f0000040000-7f0000041000 r-xp 00000000 00:00 0
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0      [vdso]
"""

    def premap(self, results=None):
        import tempfile

        calls = []

        def madvise(start, length):
            calls.append((start, length))
            return (results or {}).get(start, 0)

        with tempfile.NamedTemporaryFile("w", suffix=".maps") as f:
            f.write(self.MAPS)
            f.flush()
            return forkvm._premap(f.name, madvise), calls

    def test_only_read_only_file_mappings_are_mapped(self):
        mapped, calls = self.premap()
        self.assertEqual(calls, [(0x55d0c0000000, 0x100000), (0x55d0c0100000, 0x300000),
                                 (0x7f0000001000, 0x2000)])
        self.assertEqual(mapped, 0x402000)

    def test_a_refused_mapping_is_not_counted(self):
        mapped, calls = self.premap({0x55d0c0100000: -1})
        self.assertEqual(len(calls), 3)
        self.assertEqual(mapped, 0x102000)

    def test_premap_0_maps_nothing(self):
        os.environ["FORKVM_PREMAP"] = "0"
        try:
            self.assertEqual(self.premap(), (0, []))
        finally:
            del os.environ["FORKVM_PREMAP"]

    def test_the_real_process_maps_its_code(self):
        # This process's own mappings: the interpreter's code at least.
        self.assertGreater(forkvm._premap(), 1 << 20)


class RequestRandom(unittest.TestCase):
    """os.urandom from the request's entropy (forkvm._RequestRandom)."""

    def setUp(self):
        self.kernel_calls = []

        def kernel(n):
            self.kernel_calls.append(n)
            return os.urandom(n)

        self.r = forkvm._RequestRandom(kernel)

    def test_unkeyed_it_is_the_kernels(self):
        self.assertEqual(len(self.r.urandom(5)), 5)
        self.assertEqual(self.kernel_calls, [5])

    def test_keyed_it_draws_no_bytes_twice_and_never_calls_the_kernel(self):
        self.r.rekey(b"k" * 32)
        drawn = [self.r.urandom(n) for n in [0, 1, 16, 32, 4096, 16]]
        self.assertEqual([len(d) for d in drawn], [0, 1, 16, 32, 4096, 16])
        self.assertNotEqual(drawn[2], drawn[5])
        self.assertEqual(self.kernel_calls, [])
        # The key moved on: the same key again draws the first bytes again, and only then.
        again = forkvm._RequestRandom(None)
        again.rekey(b"k" * 32)
        self.assertEqual([again.urandom(n) for n in [0, 1, 16]], drawn[:3])

    def test_each_request_key_gives_other_bytes(self):
        seen = set()
        for k in range(50):
            self.r.rekey(bytes([k]) * 32)
            seen.add(self.r.urandom(16))
        self.assertEqual(len(seen), 50)

    def test_what_it_cannot_serve_goes_to_the_kernel_with_its_errors(self):
        self.r.rekey(b"k" * 32)
        with self.assertRaises(ValueError):
            self.r.urandom(-1)
        with self.assertRaises(TypeError):
            self.r.urandom("3")
        self.assertEqual(self.kernel_calls, [-1, "3"])

    def test_kernel_mode_and_a_forked_child_use_the_kernel(self):
        self.r.configure({"FORKVM_URANDOM": "kernel"})
        self.r.rekey(b"k" * 32)
        self.r.urandom(4)
        self.assertEqual(self.kernel_calls, [4])
        self.r.configure({})
        self.r.rekey(b"k" * 32)
        self.r.drop()
        self.r.urandom(3)
        self.assertEqual(self.kernel_calls, [4, 3])
        with self.assertRaisesRegex(ValueError, "FORKVM_URANDOM is request or kernel"):
            self.r.configure({"FORKVM_URANDOM": "yes"})

    def test_a_load_with_kernel_in_its_env_turns_it_off(self):
        try:
            load({"source": SOURCE, "env": {"FORKVM_URANDOM": "kernel"}})
            self.assertFalse(forkvm._random.enabled)
            with self.assertRaisesRegex(ValueError, "FORKVM_URANDOM"):
                load({"source": SOURCE, "env": {"FORKVM_URANDOM": "maybe"}})
        finally:
            os.environ.pop("FORKVM_URANDOM", None)
            forkvm._random.configure(os.environ)

    def test_installed_the_request_reseeds_random_and_urandom_apart_and_a_child_forgets(self):
        import random
        import uuid

        kernel_urandom, random_urandom = os.urandom, random._urandom
        try:
            forkvm._random.install()
            forkvm._random.install()
            self.assertEqual(os.urandom, forkvm._random.urandom)
            self.assertEqual(random._urandom, forkvm._random.urandom)
            forkvm._reseed(b"e" * 32)
            first = (os.urandom(16), random.random(), uuid.uuid4())
            forkvm._reseed(b"e" * 32)
            self.assertEqual((os.urandom(16), random.random(), uuid.uuid4()), first)
            forkvm._reseed(b"f" * 32)
            self.assertNotEqual(os.urandom(16), first[0])
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, os.urandom(16))
                os._exit(0)
            os.waitpid(pid, 0)
            child = os.read(r, 16)
            os.close(r)
            os.close(w)
            self.assertEqual(len(child), 16)
            self.assertNotEqual(child, os.urandom(16))
            self.assertIsNotNone(forkvm._random._key)
        finally:
            os.urandom, random._urandom = kernel_urandom, random_urandom
            forkvm._random._installed = False
            forkvm._random.rekey(None)


if __name__ == "__main__":
    unittest.main()
