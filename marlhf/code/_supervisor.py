"""The sandbox supervisor: runs one program against a list of test inputs, each in a fresh jail.

Started by :mod:`marlhf.code.sandbox` as ``python -I -S _supervisor.py`` in its own session, with a JSON
job on stdin; prints one JSON line of raw outcomes (exit status, captured output) on stdout.  It imports
only the standard library and never imports the project, so it runs the same under any interpreter.

Process tree per test (``isolation`` "root" or "userns"):

    supervisor (child subreaper)
      └─ C: unshare(mount, network, pid [, user]), build a fresh root    own process group
           └─ P: pid 1 of the new pid namespace, mounts a private /proc    same process group as C
                └─ Q: the program: setsid, rlimits, unprivileged uid, exec python harness

When P exits (the program finished or was killed) the kernel kills everything left in the pid
namespace, so a detached grandchild (double fork + setsid) cannot outlive its test.  On a timeout or an
output overflow the supervisor SIGKILLs C's process group (C and P), which tears the namespace down.
With isolation "none" there are no namespaces: the supervisor is a child subreaper, so every orphan
re-parents to it and the sweep after each test kills them.
"""

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
ST_RELATIME = 4096
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1

SETUP_FAILED = 125  # exit code of C/P/Q when the jail could not be built (the reason goes to the setup pipe)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} -> {target}")


def prctl(option, value):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), 0, 0, 0), "prctl")


# ------------------------------------------------------------------------------------------- inside the jail
# What the jailed interpreter may see of the host, read-only: the system directories (libc, /etc for
# locale and time zones) and four harmless devices.  Everything else (/root, /home, /work, other jails'
# directories, host processes) does not exist inside.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME  # statvfs bits equal these


def _bind(source, root, target, writable=False):
    """Bind ``source`` at ``root + target``; read-only unless ``writable``.  The flags the mount already
    has are kept on the read-only remount (a user namespace may not clear locked ones)."""
    path = root + target
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount(source, path, None, MS_BIND | MS_REC)
    if not writable:
        st = os.statvfs(path)
        flags = (st.f_flag & _KEEP_FLAGS) | (MS_RELATIME if st.f_flag & ST_RELATIME else 0)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags)


def build_root(job, test_dir, root):
    """Make ``root`` (an empty directory) the test's whole filesystem and enter it.

    A small tmpfs holds read-only binds of :data:`SYSTEM_DIRS`, :data:`DEVICES`, the interpreter's prefix
    (at its own path, so it needs no relocation) and the harness + program (``/code``), and the test's
    empty directory as the only writable place, ``/tmp`` (its cwd and HOME).  The tmpfs is then made
    read-only, moved over ``/`` and chrooted into; the program never holds CAP_SYS_CHROOT (an unprivileged
    uid, or a non-root uid inside the user namespace), so it cannot climb back out.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    bound = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(path, root, path)
            bound.append(path)
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(dev, root, dev)
    prefix = job["python_prefix"]
    if not any(prefix == d or prefix.startswith(d + "/") for d in bound):
        _bind(prefix, root, prefix)
    _bind(job["code_dir"], root, "/code")
    _bind(test_dir, root, "/tmp", writable=True)
    os.mkdir(root + "/proc")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")


def processes_of_uid(uid):
    """Live processes (threads not counted) whose real uid is ``uid``."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    count += any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f)
            except OSError:
                continue
    return count


def set_limits(limits, shared_uid):
    """rlimits of the program.  RLIMIT_NPROC counts every process of the uid: with a uid of its own (or a
    user namespace) that is the program's; with a ``shared_uid`` (isolation "none") the caller's
    processes count too, so the program gets ``max_processes`` more than there are now."""
    cpu = int(limits["cpu_s"])
    nproc = limits["max_processes"] + (processes_of_uid(os.getuid()) if shared_uid else 0)
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, value)


def exec_program(job, stdin_fd, out_fd, err_fd, setup_fd, in_jail):
    """Q: become the program.  Never returns.  ``setup_fd`` is close-on-exec: it closes on success."""
    os.setsid()
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, setup_fd)
    os.closerange(setup_fd + 1, 65536)
    work = "/tmp" if in_jail else job["test_dir"]
    code = "/code" if in_jail else job["code_dir"]
    python = job["python"]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work}
    os.chdir(work)
    set_limits(job["limits"], shared_uid=not in_jail)
    if job["uid"] is not None:  # last: setting limits above needs privileges the program must not keep
        os.setgroups([])
        os.setresgid(job["uid"], job["uid"], job["uid"])
        os.setresuid(job["uid"], job["uid"], job["uid"])
    argv = [python, "-I", code + "/harness.py", code + "/program.py", job["test"]["kind"],
            job["test"].get("fn_name") or "", "0" if in_jail else "1"]
    os.execve(python, argv, env)


def jail_init(job, stdin_fd, out_fd, err_fd, setup_fd, in_jail):
    """P: pid 1 of the test's pid namespace; runs the program and reports its status as an exit code."""
    if in_jail:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)  # the program sees only its own processes
    q = os.fork()
    if q == 0:
        try:
            exec_program(job, stdin_fd, out_fd, err_fd, setup_fd, in_jail)
        except BaseException as err:  # noqa: BLE001 - any failure before exec is the sandbox's, not the program's
            os.write(setup_fd, f"{err!r}\n".encode())
        os._exit(SETUP_FAILED)
    for fd in (stdin_fd, out_fd, err_fd, setup_fd):
        os.close(fd)
    while True:  # as pid 1 we also reap re-parented orphans until the program itself exits
        pid, status = os.waitpid(-1, 0)
        if pid == q:
            return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def jail(job, stdin_fd, out_fd, err_fd, setup_fd):
    """C: build the namespaces, start P, exit with P's code."""
    os.setpgid(0, 0)
    isolation = job["isolation"]
    in_jail = isolation != "none"
    if isolation == "root":
        unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
    elif isolation == "userns":
        # Identity map of our own (non-root) uid: we keep the namespace's capabilities to build the jail,
        # and the program, exec'd as a non-root uid, loses them all.
        uid, gid = os.getuid(), os.getgid()
        unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    if in_jail:
        build_root(job, job["test_dir"], job["root_dir"])
    p = os.fork()
    if p == 0:
        code = SETUP_FAILED
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # C killed on timeout -> P (and the namespace) dies
            code = jail_init(job, stdin_fd, out_fd, err_fd, setup_fd, in_jail)
        except BaseException as err:  # noqa: BLE001
            os.write(setup_fd, f"{err!r}\n".encode())
        os._exit(code)
    for fd in (stdin_fd, out_fd, err_fd, setup_fd):
        os.close(fd)
    _, status = os.waitpid(p, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


# ------------------------------------------------------------------------------------------- the supervisor
def children_of(pid):
    """Pids whose parent is ``pid`` (orphans re-parented to us as the subreaper included)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2:].split()
            if int(fields[1]) == pid:
                found.append(int(name))
    return found


def reap():
    """Collect every child that has exited, without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep():
    """Kill and reap every remaining descendant (each is our child: we are the subreaper).

    Each found process's whole process group is killed too: a fork bomb's copies share the program's
    group, and a group kill reaches all of them at once (the kernel fails forks racing with it).  Orphans
    handed to us while we work are caught by the next round; never block on a child we have not killed.
    """
    me, own_group = os.getpid(), os.getpgrp()
    while True:
        pids = children_of(me)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                group = os.getpgid(pid)
                if group != own_group:
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        reap()
        time.sleep(0.002)


def run_test(job, test, index):
    limits = job["limits"]
    test_dir = os.path.join(job["work_dir"], f"test{index}")
    os.mkdir(test_dir, 0o700)
    root_dir = os.path.join(job["work_dir"], f"root{index}")  # mount point of the jail's root (stays empty)
    os.mkdir(root_dir, 0o755)
    if job["uid"] is not None:
        os.chown(test_dir, job["uid"], job["uid"])
    stdin_fd = os.memfd_create("stdin")
    data = test["stdin"].encode()
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view):]
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_setup, w_setup = os.pipe()  # close-on-exec: stays empty unless building the jail failed
    start = time.monotonic()
    c = os.fork()
    if c == 0:
        try:
            os.close(r_out)
            os.close(r_err)
            os.close(r_setup)
            jail(dict(job, test=test, test_dir=test_dir, root_dir=root_dir), stdin_fd, w_out, w_err, w_setup)
        except BaseException as err:  # noqa: BLE001
            os.write(w_setup, f"{err!r}\n".encode())
        os._exit(SETUP_FAILED)
    for fd in (stdin_fd, w_out, w_err, w_setup):
        os.close(fd)
    pidfd = os.pidfd_open(c)
    out, err = bytearray(), bytearray()
    err_cap = 4096
    state, status = "running", None
    open_fds = {r_out, r_err}
    deadline = start + limits["time_s"]
    while state == "running":
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            state = "timeout"
            break
        ready, _, _ = select.select([*open_fds, pidfd], [], [], remaining)
        for fd in ready:
            if fd == pidfd:
                _, status = os.waitpid(c, 0)
                state = "exited"
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            elif fd == r_out:
                out += chunk
                if len(out) > limits["output_bytes"]:
                    state = "output_limit"
            else:
                err += chunk
                del err[:-err_cap]  # keep the tail: the traceback's last line says what went wrong
    if state != "exited":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c, signal.SIGKILL)  # C and P: the pid namespace dies with P
        _, status = os.waitpid(c, 0)
    wall = time.monotonic() - start
    sweep()
    # Every writer is dead now: drain what is left in the pipes (bounded by the caps).
    for fd in (r_out, r_err):
        while state in ("exited", "timeout") and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if fd == r_out:
                out += chunk
                if len(out) > limits["output_bytes"]:
                    state = "output_limit"
            else:
                err += chunk
                del err[:-err_cap]
        os.close(fd)
    os.close(pidfd)
    setup_error = b""
    while select.select([r_setup], [], [], 0)[0]:
        chunk = os.read(r_setup, 4096)
        if not chunk:
            break
        setup_error += chunk
    os.close(r_setup)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    return {
        "state": state,
        "exit_code": code,
        "stdout": bytes(out[: limits["output_bytes"]]).decode("utf-8", "replace"),
        "stderr_tail": bytes(err).decode("utf-8", "replace"),
        "wall_s": wall,
        "setup_error": setup_error.decode("utf-8", "replace"),
    }


def main():
    job = json.loads(sys.stdin.read())
    # A uid of its own per supervisor (pids are unique among live processes): RLIMIT_NPROC counts the
    # processes of one uid, so concurrent runs must not share one.
    job["uid"] = None if job["uid_base"] is None else job["uid_base"] + os.getpid()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    results = [run_test(job, test, job["first_index"] + i) for i, test in enumerate(job["tests"])]
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
