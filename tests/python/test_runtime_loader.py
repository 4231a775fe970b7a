"""The Python runtime's loader (guest/python/forkvm.py), run on the host: no mailbox is
needed to load a handler and warm it up. Run by tests/tests/python_runtime.rs."""

import json
import os
import sys
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
        self.assertEqual(json.loads(reply), {"imported": [], "handler": "handler", "warmed": 3})
        module = sys.modules["forkvm_function"]
        self.assertEqual(module.seen, [b"a", b"\x00\xff", b""])
        self.assertEqual(handler(b"x"), b"X")

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

    def test_unknown_keys_are_refused(self):
        with self.assertRaises(ValueError) as e:
            load({"source": SOURCE, "warm": ["a"]})
        self.assertIn("unknown keys in the load request: warm", str(e.exception))


class Heap(unittest.TestCase):
    def test_the_heap_size_comes_from_the_environment_and_bad_ones_say_why(self):
        old = os.environ.pop("FORKVM_HEAP_MIB", None)
        try:
            self.assertEqual(forkvm._heap_mib(), 32)
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


if __name__ == "__main__":
    unittest.main()
