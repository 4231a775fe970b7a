"""Handlers for forkvm's tests and benchmarks (``python3 -m forkvm forkvm_examples:NAME``)."""

import json
import os
import random
import time

import forkvm

# Handler calls in this process (a prime request, in a primed warm clone, is no call).
_calls = 0


def noop(event):
    """The benchmarks' no-op: an empty reply."""
    return b""


def echo(event):
    """The request, back."""
    return event


def info(event):
    """The tests' handler: its input, its clone, its process's handler calls so far, fresh
    randomness; or, by the input's first word: ``raise TEXT``, ``exit N`` (os._exit),
    ``sleep S``, ``big N`` (a reply of N bytes)."""
    global _calls
    _calls += 1
    word, _, arg = event.decode("utf-8", "replace").partition(" ")
    if word == "raise":
        raise RuntimeError(arg)
    if word == "exit":
        os._exit(int(arg))
    if word == "sleep":
        time.sleep(float(arg))
        return b"slept"
    if word == "big":
        return b"x" * int(arg)
    return json.dumps({
        "input": event.decode("utf-8", "replace"),
        "clone": forkvm.clone_seq(),
        "calls": _calls,
        "prime_pages": forkvm.prime_pages(),
        "urandom": os.urandom(32).hex(),
        "random": random.random(),
    })


def numpy_sum(event):
    """numpy, imported in the template: the sum of the request's bytes."""
    import numpy

    return str(int(numpy.frombuffer(event, dtype=numpy.uint8).sum()))
