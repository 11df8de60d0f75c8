"""The grading harness of the code environment: runs inside the sandbox as its main script.

Two processes, so that nothing the answer does can reach the verdict:

- the **grader** (`python main.py`, this file's `grade`) reads the tests from `grading.json`, deletes
  the file, makes itself undumpable (the answer's process, same uid, can then read neither its memory
  nor its file descriptors through /proc), and runs the tests in its own interpreter. It never runs a
  line of the answer's code;
- the **answer** (`python main.py --answer`, `serve_answer`) is a fresh interpreter (not a fork: it
  holds no copy of the tests) that executes `solution.py` and then only answers requests: call this,
  get that attribute, iterate, len, str... Its stdin/stdout are the request pipes; its own prints go
  to /dev/null.

Values cross as plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
frozenset) that the grader decodes itself; anything else stays in the answer's process and the tests
see a handle that forwards calls, attributes, iteration, len, indexing, `in`, bool, str and repr, but
refuses comparisons and arithmetic (an object with an `__eq__` that always says yes cannot pass an
`assert f(x) == y`). The tests, the comparisons, the builtins and the stdlib modules the tests use are
the grader's own. Each test gets `timeout_s` of the answer's time (starting the answer's interpreter and its
import-time code get `load_s`, not counted in it); an answer that overruns it is
killed and the next test starts a fresh one.

The grader writes one line per event, tagged with the run's nonce (read from stdin), to its stdout.
"""

import builtins
import json
import os
import select
import subprocess
import sys
import time
import traceback

ERROR_CHARS = 300
MAX_REPLY_BYTES = 16 * 1024 * 1024  # a larger value from the answer fails the test instead of filling memory
MAX_DEPTH = 200  # nesting of one value
GRADING_FILE = "grading.json"
SOLUTION_FILE = "solution.py"
GUARD_FILE = "_sandbox_guard.py"  # rollgym.sandbox's socket guard, present outside the namespaces mode
PLAIN_SCALARS = (type(None), bool, int, float, str)


# --- plain data on the wire (both processes) --------------------------------------------------------
def encode(value, ref, depth=0):
    """A JSON-ready form of value: scalars as they are, containers tagged, anything else `ref(value)`."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, complex, list, tuple, dict, set, frozenset)):
        if isinstance(value, bytes):
            return {"t": "bytes", "v": bytes(value).hex()}
        if isinstance(value, complex):
            return {"t": "complex", "v": [value.real, value.imag]}
        if isinstance(value, dict):
            return {"t": "dict", "v": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)] for k, v in dict.items(value)]}
        tag = "list" if isinstance(value, list) else "tuple" if isinstance(value, tuple) else \
            "set" if isinstance(value, set) else "frozenset"
        return {"t": tag, "v": [encode(item, ref, depth + 1) for item in value]}
    return ref(value)


def decode(data, resolve, depth=0):
    """The value of `encode`'s output; `resolve(n)` turns a reference into an object. ValueError on
    anything `encode` does not make."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if type(data) in PLAIN_SCALARS:
        return data
    if type(data) is not dict or set(data) != {"t", "v"}:
        raise ValueError(f"not a value: {type(data).__name__}")
    tag, body = data["t"], data["v"]
    if tag == "ref" and type(body) is int:
        return resolve(body)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    if type(body) is not list:
        raise ValueError(f"bad {tag!r} value")
    items = [decode(item, resolve, depth + 1) for item in body] if tag != "dict" else None
    if tag == "list":
        return items
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in body):
            raise ValueError("bad dict value")
        return {decode(k, resolve, depth + 1): decode(v, resolve, depth + 1) for k, v in body}
    raise ValueError(f"unknown tag {tag!r}")


def describe(exc):
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


# --- the answer's process ---------------------------------------------------------------------------
def serve_answer():
    """Execute solution.py, report its names, then answer requests until stdin closes."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    sink = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(sink, fd)
    objects, ids = [], {}

    def ref(value):
        if id(value) not in ids:
            ids[id(value)] = len(objects)
            objects.append(value)
        return {"t": "ref", "v": ids[id(value)]}

    def reply(message):
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    def answer(fn):
        try:
            value = fn()
        except BaseException as exc:  # the test sees it as its nearest builtin class (ValueError, StopIteration...)
            kind = next((c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c), "Exception")
            return {"raise": [kind, describe(exc)]}
        try:
            return {"ok": encode(value, ref)}
        except BaseException as exc:
            return {"raise": ["TypeError", "the answer's value cannot be sent: " + describe(exc)]}

    with open(SOLUTION_FILE, encoding="utf-8") as handle:
        source = handle.read()
    namespace = {"__name__": "solution", "__builtins__": builtins}
    loaded = {"error": None}
    try:
        code = compile(source, "solution.py", "exec")
    except BaseException as exc:
        reply({"compile_error": describe(exc)})
        return
    try:
        exec(code, namespace)
    except BaseException as exc:  # what it defined before failing may still pass tests
        loaded["error"] = describe(exc)
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") or type(value).__name__ == "module":
            continue
        try:
            names[name] = encode(value, ref)
        except BaseException:
            continue
    loaded["names"] = names
    reply({"loaded": loaded})
    operations = {
        "call": lambda obj, m: obj(*m["args"], **m["kwargs"]),
        "getattr": lambda obj, m: getattr(obj, m["name"]),
        "iter": lambda obj, m: iter(obj),
        "next": lambda obj, m: next(obj),
        "len": lambda obj, m: len(obj),
        "getitem": lambda obj, m: obj[m["args"][0]],
        "contains": lambda obj, m: m["args"][0] in obj,
        "bool": lambda obj, m: bool(obj),
        "str": lambda obj, m: str(obj),
        "repr": lambda obj, m: repr(obj),
    }
    for line in requests:
        message = json.loads(line)
        resolve = objects.__getitem__
        obj = objects[message["id"]]
        message["args"] = [decode(a, resolve) for a in message.get("args", [])]
        message["kwargs"] = {k: decode(v, resolve) for k, v in message.get("kwargs", {}).items()}
        reply(answer(lambda: operations[message["op"]](obj, message)))


# --- the grader's process ---------------------------------------------------------------------------
class TestTimeout(BaseException):
    """The answer overran the test's time (a BaseException: a test's `except Exception` cannot swallow it)."""


class AnswerGone(Exception):
    """The answer's process is not there to answer (it exited, was killed, or broke the protocol)."""


class AnswerError(Exception):
    """The answer raised an exception of its own class (builtin exception classes are raised as such)."""


class Unsendable(Exception):
    """A test passed the answer something that is not plain data: the task's fault, not the answer's."""


class Answer:
    """The answer's process, started on demand: a test that kills it leaves the next one a fresh one."""

    def __init__(self, python, load_s):
        self.python = python
        self.load_s = load_s  # time to start an interpreter and run the answer's import-time code
        self.deadline = time.monotonic() + load_s  # of the current test (monotonic seconds)
        self.process = None
        self.generation = 0
        self.names = None
        self.stall = False  # it once failed to load in time: no more starts

    def argv(self):
        guard = [GUARD_FILE] if os.path.exists(GUARD_FILE) else []
        return [self.python, "-I", "-S", "-B", *guard, sys.argv[0], "--answer"]

    def begin_test(self, limit):
        """The next `limit` seconds are the current test's."""
        self.deadline = time.monotonic() + limit

    def start(self):
        """A fresh answer process; returns its loaded message. Loading has its own time (`load_s`), which
        the current test's deadline is moved by: a slow interpreter start is not the answer's fault."""
        if self.stall:
            raise AnswerGone("the answer did not load in time before")
        self.stop()
        self.generation += 1
        self.buffer = b""
        test_deadline, started = self.deadline, time.monotonic()
        self.deadline = started + self.load_s
        self.process = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, close_fds=True)
        try:
            message = self.read()
        except TestTimeout:
            self.stall = True
            raise
        finally:
            self.deadline = test_deadline + (time.monotonic() - started)
        return message

    def stop(self):
        if self.process is not None:
            try:
                self.process.kill()
            except OSError:
                pass
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.process = None

    def read(self):
        """One reply line, or TestTimeout / AnswerGone."""
        fd = self.process.stdout.fileno()
        chunks, size = [self.buffer], len(self.buffer)
        while b"\n" not in chunks[-1]:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise TestTimeout("the answer exceeded the test's time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                status = self.process.wait()
                self.stop()
                raise AnswerGone(f"the answer's process exited (status {status})")
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                self.stop()
                raise AnswerGone(f"the answer sent a value larger than {MAX_REPLY_BYTES} bytes")
        line, self.buffer = b"".join(chunks).split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self.stop()
            raise AnswerGone("the answer's process broke the protocol") from None

    def write(self, data):
        """Send one request within the test's time (an answer that stops reading cannot block the grader)."""
        fd = self.process.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise TestTimeout("the answer exceeded the test's time")
            select.select([], [fd], [], left)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError:
                self.stop()
                raise AnswerGone("the answer's process is gone") from None

    def request(self, handle, op, args=(), kwargs=None, name=None):
        """The answer's reply to one operation on the object `handle` refers to, decoded."""
        if handle.generation is not None and handle.generation != self.generation:
            raise AnswerGone("this value belonged to an answer process that has been stopped")
        if self.process is None:
            self.load()
        message = {"op": op, "id": handle.index, "name": name,
                   "args": [self.send(a) for a in args], "kwargs": {k: self.send(v) for k, v in (kwargs or {}).items()}}
        self.write(json.dumps(message).encode() + b"\n")
        reply = self.read()
        if type(reply) is dict and "ok" in reply:
            try:
                return self.receive(reply["ok"])
            except (ValueError, TypeError, RecursionError) as exc:
                self.stop()
                raise AnswerGone(f"the answer sent a malformed value: {exc}") from None
        if type(reply) is dict and type(reply.get("raise")) is list and len(reply["raise"]) == 2:
            kind, text = (str(part) for part in reply["raise"])
            cls = getattr(builtins, kind, None)
            message = text.split(": ", 1)[1] if ": " in text else text
            error = None
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    error = cls(message)
                except Exception:
                    error = None
            raise error if error is not None else AnswerError(text)
        self.stop()
        raise AnswerGone("the answer's process broke the protocol")

    def load(self):
        """Start a fresh answer process and check it exposes the same names."""
        message = self.start()
        if "loaded" not in message:
            raise AnswerGone("the answer's process broke the protocol")
        return message

    def send(self, value):
        def ref(obj):
            if isinstance(obj, Remote) and obj._answer is self and obj._generation in (None, self.generation):
                return {"t": "ref", "v": obj._index}
            raise Unsendable(f"a test passed the answer a {type(obj).__name__}: only plain data and the answer's own objects can be sent")
        return encode(value, ref)

    def receive(self, data):
        return decode(data, lambda index: Remote(self, index, self.generation))


class Handle:
    def __init__(self, index, generation):
        self.index, self.generation = index, generation


def _refuse(name):
    def refuse(self, *args):
        raise TypeError(f"the answer returned a {self._kind()}, which the tests do not compare or compute with "
                        f"({name}): tests compare plain values")
    return refuse


class Remote:
    """An object that lives in the answer's process. Top-level names (generation None) survive a restart."""

    __slots__ = ("_answer", "_index", "_generation")

    def __init__(self, answer, index, generation):
        object.__setattr__(self, "_answer", answer)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_generation", generation)

    def _ask(self, op, args=(), kwargs=None, name=None):
        return self._answer.request(Handle(self._index, self._generation), op, args, kwargs, name)

    def _kind(self):
        return "value that is not plain data"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __call__(self, *args, **kwargs):
        return self._ask("call", args, kwargs)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self):
        return self._ask("len")

    def __getitem__(self, key):
        return self._ask("getitem", (key,))

    def __contains__(self, item):
        return self._ask("contains", (item,))

    def __bool__(self):
        return self._ask("bool")

    def __str__(self):
        return self._ask("str")

    def __repr__(self):
        return self._ask("repr")

    def __setattr__(self, name, value):
        raise TypeError("the tests do not set attributes on the answer's objects")

    __hash__ = None
    __eq__ = _refuse("==")
    __ne__ = _refuse("!=")
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")
    __add__ = __radd__ = _refuse("+")
    __sub__ = __rsub__ = _refuse("-")
    __mul__ = __rmul__ = _refuse("*")
    __truediv__ = __rtruediv__ = _refuse("/")
    __floordiv__ = __rfloordiv__ = _refuse("//")
    __mod__ = __rmod__ = _refuse("%")
    __abs__ = _refuse("abs")
    __neg__ = _refuse("-")
    __index__ = _refuse("index")
    __int__ = _refuse("int")
    __float__ = _refuse("float")


def make_undumpable():
    """PR_SET_DUMPABLE 0: a process of the same uid can no longer open /proc/<grader>/{mem,fd,environ}."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def grade():
    nonce = sys.stdin.readline().strip()
    make_undumpable()
    with open(GRADING_FILE, encoding="utf-8") as handle:
        payload = json.load(handle)
    os.unlink(GRADING_FILE)  # the answer's process starts only after this: it cannot read the tests
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")

    def emit(**event):
        report.write(nonce + " " + json.dumps(event) + "\n")
        report.flush()

    limit = payload["timeout_s"]
    answer = Answer(sys.executable, payload["load_s"])
    namespace = {"__name__": "tests", "__builtins__": builtins}
    try:
        loaded = answer.start()
    except TestTimeout:
        loaded = {"timeout": True}
    except (AnswerGone, OSError) as exc:  # OSError: the answer's process could not even start
        loaded = {"gone": str(exc)}
    if "compile_error" in loaded:
        emit(stage="compile", ok=False, error=loaded["compile_error"])
        emit(done=True)
        return
    if "loaded" in loaded:
        info = loaded["loaded"]
        emit(stage="candidate", ok=info.get("error") is None, error=info.get("error"))
        names = info.get("names") if type(info.get("names")) is dict else {}
        for name, data in names.items():
            # The tests keep the real builtins and stdlib modules: an answer's `sorted` or `math` is not theirs.
            if type(name) is not str or not name.isidentifier() or (name != payload["entry_point"] and (
                    hasattr(builtins, name) or name in sys.stdlib_module_names)):
                continue
            try:
                namespace[name] = decode(data, lambda index: Remote(answer, index, None))
            except (ValueError, TypeError, RecursionError):
                continue
        entry = namespace.get(payload["entry_point"])
        emit(stage="entry_point", ok=isinstance(entry, Remote))
    else:
        timed_out = "timeout" in loaded
        emit(stage="candidate", ok=False, timeout=timed_out, crashed=not timed_out,
             error=f"the answer did not load within {payload['load_s']:g} s" if timed_out else loaded.get("gone"))
    if payload["setup"].strip():
        answer.begin_test(limit)
        try:
            exec(compile(payload["setup"], "setup", "exec"), namespace)
            emit(stage="setup", ok=True)
        except BaseException as exc:
            emit(stage="setup", ok=False, error=describe(exc))
    for index, test in enumerate(payload["tests"]):
        answer.begin_test(limit)
        try:
            exec(compile(test, f"test_{index}", "exec"), namespace)
            emit(test=index, ok=True)
        except Unsendable as exc:
            emit(test=index, ok=False, unsendable=True, error=describe(exc))
        except TestTimeout as exc:
            emit(test=index, ok=False, timeout=True, error=describe(exc))
        except BaseException as exc:
            emit(test=index, ok=False, error=describe(exc))
    answer.stop()
    emit(done=True)


if __name__ == "__main__":
    # Integers of any size cross as JSON (factorial(2000) has 5736 digits); the reply size and the
    # test's time bound what that costs.
    sys.set_int_max_str_digits(0)
    if sys.argv[1:] == ["--answer"]:
        serve_answer()
    else:
        grade()
