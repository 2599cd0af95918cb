"""Runs one untrusted program inside the sandbox (started by the supervisor as the jailed process).

argv: PROGRAM KIND FN_NAME BLOCK_NETWORK.  KIND "stdin": the program runs as ``__main__`` reading the
test input on stdin.  KIND "call": stdin holds a JSON list of arguments; the program is loaded as a
module and ``Solution().FN_NAME(*args)`` (LeetCode-style starter code) or ``FN_NAME(*args)`` is called;
the JSON of the return value is written to the original stdout, anything the program prints is
discarded.  Standard library only: this file is executed by the sandboxed interpreter in isolated mode.

This is not a security boundary by itself (the program runs in this same process): containment comes
from the supervisor's namespaces and limits.  BLOCK_NETWORK=1 (no network namespace available) replaces
the socket constructors, which stops ordinary code but not a determined program (e.g. via ctypes).
"""

import json
import os
import sys

# Names the APPS call-based starter code uses without importing them (``List[int]`` annotations) and
# modules its reference solutions take for granted; loaded before the program, as the APPS harness does.
CALL_PRELUDE = (
    "from typing import *\n"
    "import collections, functools, heapq, itertools, math, bisect, string, re, sys\n"
    "from collections import Counter, defaultdict, deque, OrderedDict\n"
    "from functools import lru_cache, reduce\n"
    "from heapq import heappush, heappop, heapify\n"
    "from math import inf, gcd, sqrt, ceil, floor, log\n"
)


def block_network():
    import _socket
    import socket

    def refused(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in ("socket", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo"):
            if hasattr(module, name):
                setattr(module, name, refused)


def main():
    path, kind, fn_name, net = sys.argv[1:5]
    if net == "1":
        block_network()
    with open(path, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "program.py", "exec")
    sys.argv = ["program.py"]
    if kind == "stdin":
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "program.py"})
        return
    args = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # prints of the program go nowhere; the return value goes to result_fd
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(CALL_PRELUDE, namespace)
    exec(code, namespace)
    holder = namespace.get("Solution")
    if isinstance(holder, type) and hasattr(holder, fn_name):
        fn = getattr(holder(), fn_name)
    elif callable(namespace.get(fn_name)):
        fn = namespace[fn_name]
    else:
        raise NameError(f"the program defines neither Solution.{fn_name} nor a function {fn_name}")
    result = fn(*args)
    sys.stdout.flush()
    try:
        text = json.dumps(result)
    except (TypeError, ValueError):  # not JSON data (a set, an object): never equal to an expected value
        text = json.dumps({"__unserializable__": repr(result)[:1000]})
    data = (text + "\n").encode()
    while data:
        data = data[os.write(result_fd, data):]


if __name__ == "__main__":
    main()
