"""The sandbox launcher: started by `programs.py` (as the server's user), it confines one program.

Run as `python3 -I -S -B launcher.py CONFIG_JSON`; standard library only, nothing from the project.
It writes one JSON line per event to the status fd named in the config (never to stdout or stderr,
which belong to the confined program) and exits 0 unless it could not set the sandbox up.

Modes (docs/sandbox.md says what each contains):

- "namespaces" (root with CAP_SYS_ADMIN): unshare the mount, network, PID, IPC and UTS namespaces,
  then fork the namespace's init (PID 1), which builds a new root in a private tmpfs (the system
  directories and the interpreter bound read-only, a generated /etc, a few device nodes, a fresh
  /proc, a private size-limited /tmp with the work directory /tmp/sandbox, and the `binds`: host
  directories mounted read-write, a session's workspace, or read-only), chroots into it and
  forks the program as an unprivileged uid. When the program exits, init exits and the kernel kills
  every process left in the namespace; `waitpid(init)` returns only once they are all gone.
- "basic" (root, namespaces refused): the program runs as the unprivileged uid in the host's
  filesystem and network; on exit or timeout every process of that uid is killed, then (the
  launcher being a child subreaper) every remaining descendant.
- "minimal" (not root): rlimits only, as the server's own user; leftovers are killed through the
  process group and the subreaper.

The wall-time limit is enforced here (SIGKILL to init, or to the uid's processes); SIGTERM from the
server (output overflow) does the same at once.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

SANDBOX_DIR = "/tmp/sandbox"  # the program's working directory inside the mount namespace
DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_libc.sethostname.argtypes = (ctypes.c_char_p, ctypes.c_size_t)


class SetupError(Exception):
    pass


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option, arg):
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


class Status:
    def __init__(self, fd):
        self.fd = fd

    def write(self, **event):
        data = (json.dumps(event) + "\n").encode()
        try:
            os.write(self.fd, data)
        except OSError:
            pass


# --- the confined program ----------------------------------------------------------------------
def set_limits(limits):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL 1 s later
    resource.setrlimit(resource.RLIMIT_AS, (limits["as_bytes"], limits["as_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize_bytes"], limits["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
    if limits.get("nproc") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))


def exec_program(cfg, status, workdir):
    """In the forked child: drop to the sandbox uid, apply the limits, exec. Never returns."""
    try:
        os.set_inheritable(status.fd, False)  # the program must not write status lines
        os.umask(0o077)
        set_limits(cfg["limits"])  # RLIMIT_NPROC before setuid: the kernel checks it at setuid/exec
        uid, gid = cfg.get("uid"), cfg.get("gid")
        if uid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # from root: clears every capability
        prctl(PR_SET_NO_NEW_PRIVS, 1)  # set-uid binaries cannot give anything back
        os.chdir(workdir)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as exc:  # noqa: BLE001 - report whatever stops the exec
        status.write(error=f"exec failed: {type(exc).__name__}: {exc}")
    os._exit(127)


def describe(wait_status):
    if os.WIFSIGNALED(wait_status):
        return {"exit_code": None, "signal": os.WTERMSIG(wait_status)}
    return {"exit_code": os.WEXITSTATUS(wait_status), "signal": None}


# --- namespaces mode ---------------------------------------------------------------------------
NEW_ROOT = "/tmp"  # where the program's root is built, inside the private mount namespace only


def write_file(path, data, mode=0o644):
    with open(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)


def make_mount_point(target, is_dir):
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.exists(target):
            write_file(target, b"")


def bind(source, target, is_dir, readonly=True, dev=False):
    make_mount_point(target, is_dir)
    mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (MS_RDONLY if readonly else 0) | (0 if dev else MS_NODEV)
    mount(None, target, None, flags)


def build_root(cfg):
    """Build the program's filesystem in a fresh tmpfs and chroot into it (init, as root).

    The new root holds only: the `expose` paths (system directories and the interpreter) bound
    read-only, a generated /etc, a few device nodes and a private /dev/shm, a fresh /proc of this
    PID namespace, and /tmp: a private size-limited tmpfs with the work directory /tmp/sandbox.
    """
    uid, gid = cfg["uid"], cfg["gid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    inputs = {}  # read from the host before NEW_ROOT (the host's /tmp) is covered
    for name in os.listdir(cfg["host_dir"]) if cfg.get("host_dir") else ():
        with open(os.path.join(cfg["host_dir"], name), "rb") as handle:
            inputs[name] = handle.read()
    # A workspace: a host directory mounted inside, read-write unless its third field says read-only
    # (opened now: it may live under /tmp).
    binds = [(os.open(bound[0], os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY), bound[1], len(bound) > 2 and bool(bound[2]))
             for bound in cfg.get("binds", ())]
    # A session's own /tmp (a host directory on the session's disk), instead of a tmpfs per command. Its
    # programs own it: nothing may be mounted below it (making the mount point would follow their links).
    tmp_fd = None
    if cfg.get("tmp_bind"):
        below = [path for path in [*cfg["expose"], *(bound[1] for bound in cfg.get("binds", ()))] if under(path, "/tmp")]
        if below:
            raise SetupError(f"{below[0]} cannot be mounted below a session's own /tmp")
        tmp_fd = os.open(cfg["tmp_bind"], os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
    input_dir = cfg.get("input_dir") or SANDBOX_DIR
    etc = {}
    try:
        with open("/etc/ld.so.cache", "rb") as handle:
            etc["ld.so.cache"] = handle.read()
    except OSError:
        pass
    localtime = os.readlink("/etc/localtime") if os.path.islink("/etc/localtime") else None

    exposed = []  # (path, symlink target or None, O_PATH fd, is_dir): opened before NEW_ROOT covers anything
    for path in sorted(set(cfg["expose"])):
        if any(under(path, parent[0]) for parent in exposed) or not os.path.lexists(path):
            continue
        if os.path.islink(path) and os.path.dirname(path) == "/":
            exposed.append((path, os.readlink(path), -1, False))  # /bin -> usr/bin on a merged-/usr system
        else:
            exposed.append((path, None, os.open(path, os.O_PATH | os.O_CLOEXEC), os.path.isdir(path)))

    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    root = lambda path: NEW_ROOT + path  # noqa: E731

    def expose(entries):
        for path, link, fd, is_dir in entries:
            if link is not None:
                os.symlink(link, root(path))
            else:
                bind(f"/proc/self/fd/{fd}", root(path), is_dir)
                os.close(fd)

    # A path exposed below /tmp (a checkout or venv there) is bound once the private /tmp is mounted.
    expose([entry for entry in exposed if not under(entry[0], "/tmp")])

    os.mkdir(root("/etc"), 0o755)
    name = cfg["user_name"]
    write_file(root("/etc/passwd"), f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                    f"{name}:x:{uid}:{gid}:{name}:{SANDBOX_DIR}:/usr/sbin/nologin\n")
    write_file(root("/etc/group"), f"root:x:0:\n{name}:x:{gid}:\n")
    write_file(root("/etc/hosts"), "127.0.0.1 localhost\n::1 localhost\n")
    write_file(root("/etc/hostname"), "sandbox\n")
    write_file(root("/etc/nsswitch.conf"), "passwd: files\ngroup: files\nhosts: files\n")
    for file_name, data in etc.items():
        write_file(root(f"/etc/{file_name}"), data)
    if localtime:
        os.symlink(localtime, root("/etc/localtime"))

    os.mkdir(root("/dev"), 0o755)
    for device in DEVICES:
        if os.path.exists(f"/dev/{device}"):
            bind(f"/dev/{device}", root(f"/dev/{device}"), False, readonly=False, dev=True)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root(f"/dev/{link}"))
    os.mkdir(root("/dev/shm"), 0o755)
    mount("tmpfs", root("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={cfg['shm_bytes']},nr_inodes=1024,mode=1777")

    os.mkdir(root("/tmp"), 0o755)
    if tmp_fd is not None:
        bind(f"/proc/self/fd/{tmp_fd}", root("/tmp"), True, readonly=False)
        os.close(tmp_fd)
        # The inputs get a tmpfs of their own, outside the session's /tmp (which its programs own).
        os.makedirs(root(input_dir), 0o755)
        mount("tmpfs", root(input_dir), "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={cfg['tmpfs_bytes']},nr_inodes={cfg['tmpfs_inodes']},mode=700,uid={uid},gid={gid}")
    else:
        mount("tmpfs", root("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={cfg['tmpfs_bytes']},nr_inodes={cfg['tmpfs_inodes']},mode=755")
        os.makedirs(root(input_dir), 0o700)
    for file_name, data in inputs.items():
        write_file(root(f"{input_dir}/{file_name}"), data)
        os.chown(root(f"{input_dir}/{file_name}"), uid, gid)
    os.chown(root(input_dir), uid, gid)

    expose([entry for entry in exposed if under(entry[0], "/tmp")])
    for fd, target, readonly in binds:  # after /tmp: a workspace may sit below it
        bind(f"/proc/self/fd/{fd}", root(target), True, readonly=readonly)
        os.close(fd)

    for path in cfg.get("hide", ()):  # an exposed path the program must not read: an empty folder or file over it
        if os.path.islink(root(path)):
            continue
        if os.path.isdir(root(path)):
            mount("tmpfs", root(path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=4,mode=555")
        elif os.path.isfile(root(path)):
            empty = root("/.hidden")
            if not os.path.exists(empty):
                write_file(empty, b"", 0o444)
            bind(empty, root(path), False)

    os.mkdir(root("/proc"), 0o555)
    # This PID namespace only, and only the program's own processes: init (root) and its command line,
    # which names host paths, stay out of sight (hidepid=2).
    mount("proc", root("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    mount(None, NEW_ROOT, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    os.chroot(NEW_ROOT)
    os.chdir("/")
    try:
        _libc.sethostname(b"sandbox", 7)
    except Exception:
        pass


def run_init(cfg, status):
    """PID 1 of the new namespace: set up, run the program, report how it ended, exit."""
    try:
        # If the launcher dies, so does init, and with it the namespace. (getppid() is 0 here, the
        # parent being outside the namespace; the server also kills the launcher's process group,
        # init included, as a backstop.)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        build_root(cfg)
        worker = os.fork()
        if worker == 0:
            exec_program(cfg, status, cfg.get("workdir") or SANDBOX_DIR)
        while True:
            try:
                pid, wait_status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == worker:
                status.write(**describe(wait_status))
                break
    except BaseException as exc:  # noqa: BLE001
        status.write(error=f"sandbox setup failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)  # the kernel now kills whatever the program left running in the namespace


# --- basic / minimal modes -----------------------------------------------------------------
def uid_processes(uid):
    """PIDs of the live (not zombie) processes whose real uid is `uid` (a scan of /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                pids.append(int(entry))
        except (OSError, KeyError, ValueError):
            continue
    return pids


def reap():
    """Collect every exited child (the launcher is a subreaper: the program's orphans are its children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_uid(uid, deadline_s=5.0):
    """Kill every process of `uid`: a helper that becomes that uid sends SIGKILL to -1, until none is left."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        reap()
        if not uid_processes(uid):
            break
        helper = os.fork()
        if helper == 0:
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)  # every process this uid may signal, except this one
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        time.sleep(0.002)
    reap_all(end)


def reap_all(end):
    """Wait (until `end`) for every child to be collected: killed orphans are this subreaper's children."""
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.002)


def children():
    me = str(os.getpid())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            if fields[1] == me and fields[0] != "Z":  # state, ppid
                pids.append(int(entry))
        except (OSError, IndexError):
            continue
    return pids


def kill_descendants(deadline_s=5.0):
    """Kill the launcher's children until none is left: as a subreaper, every orphan of the program,
    including those that left its process group, becomes one of them."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        reap()
        pids = children()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)
    reap_all(end)


# --- the launcher --------------------------------------------------------------------------
def main():
    cfg = json.loads(sys.argv[1])
    status = Status(cfg["status_fd"])
    for procs in cfg.get("cgroups", ()):  # the session's groups: every process forked from here is inside
        try:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))
        except OSError as exc:
            status.write(error=f"cannot join {procs}: {exc}")
            return 2
    mode = cfg["mode"]
    state = {"child": None, "killed": None}

    def stop(reason):
        if state["killed"] is None:
            state["killed"] = reason
        child = state["child"]
        if child is None:
            return
        try:
            if mode == "namespaces":
                os.kill(child, signal.SIGKILL)  # init: its death takes the namespace with it
            else:
                os.killpg(child, signal.SIGKILL)  # the program's own process group
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, lambda *_: stop("terminated"))
    signal.signal(signal.SIGALRM, lambda *_: stop("timeout"))

    if mode == "namespaces":
        try:
            unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
        except SetupError as exc:
            status.write(error=str(exc))
            return 2
        child = os.fork()
        if child == 0:
            run_init(cfg, status)
    else:
        try:
            prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come to the launcher, to be killed and reaped
        except SetupError:
            pass
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            os.setpgid(0, 0)
            exec_program(cfg, status, cfg.get("workdir") or cfg["host_dir"])
        try:
            os.setpgid(child, child)  # both sides, so killpg(child) works whoever runs first
        except OSError:
            pass
    state["child"] = child
    if state["killed"] is not None:  # SIGTERM arrived before the fork
        stop(state["killed"])
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_s"])
    while True:
        try:
            _, wait_status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            wait_status = None
            break
        except InterruptedError:
            continue
    signal.setitimer(signal.ITIMER_REAL, 0)
    wall = time.monotonic() - started
    if mode != "namespaces":
        if wait_status is not None:
            status.write(**describe(wait_status))
        # Whatever the program left behind: all processes of its uid, or its process group.
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
        if cfg.get("uid") is not None:
            kill_uid(cfg["uid"])  # also those that left the process group (setsid)
        kill_descendants()
    elif wait_status is not None and os.WIFSIGNALED(wait_status) and state["killed"] is None:
        state["killed"] = f"init_signal_{os.WTERMSIG(wait_status)}"
    status.write(done=True, killed=state["killed"], wall_s=round(wall, 4))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001
        try:
            cfg_fd = json.loads(sys.argv[1])["status_fd"]
            os.write(cfg_fd, (json.dumps({"error": f"launcher failed: {type(exc).__name__}: {exc}"}) + "\n").encode())
        except Exception:
            pass
        sys.exit(3)
