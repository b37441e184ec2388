"""The child side of the `python` tool: checks, evaluates and renders one Python expression.

The parent (rlmega.agents.tools.run_python) runs this file as a script in a fresh interpreter,

    python -I -S rlmega/agents/python_sandbox.py   (stdin: "MEMORY_MB CPU_S LAYERS_OFF\\nEXPRESSION")

with an empty environment, in an empty temporary working directory it removes afterwards. The
script imports only the standard library: with -I -S neither rlmega nor site-packages is on the path.
Before it compiles the expression the script shuts itself in (confine), then writes "ok\\nTEXT" or
"error\\nEXCEPTION_TYPE\\nMESSAGE" (both bounded) to stdout. The parent enforces the wall-clock
limit by killing the process and reads at most a few KiB of what it writes.

What keeps the expression in its box. The first two layers are Python-level and one bypass away
from arbitrary code, so each layer below them holds on its own (tests/unit/test_tool_sandbox.py
turns the others off and attacks it):
- filter: check_source, run by the parent before a process is spawned: no "__" anywhere (no dunder
  attributes, no __import__), eval syntax only (no statements, so no import), attributes only
  from ALLOWED_ATTRIBUTES -- math's public names and the public methods of the built-in value
  types -- which leaves out the introspection attributes (gi_frame, f_back, f_globals, ...)
  that reach a frame with the real builtins;
- evaluation with SAFE_BUILTINS as the only builtins (no open, getattr, type, vars, ...);
- environment (parent): an empty environment, so no HF_TOKEN, RAY_AUTH_TOKEN or the like;
- workdir (parent): an empty temporary working directory, removed after the call;
- network: a network namespace of its own (unshare(CLONE_NEWNET); CLONE_NEWUSER too when not root),
  where no interface is up, not even loopback. Where the kernel refuses both, the child says so on
  stderr (the parent logs it once) and the files layer still refuses every socket;
- files: RLIMIT_NOFILE = 0, so no new file descriptor at all (no file, socket, pipe; only the
  stdin/stdout/stderr it has, even after closing one of them), and RLIMIT_FSIZE = 0 (no bytes written to a file);
- processes: RLIMIT_NPROC = 0, so fork fails. The kernel does not enforce it for root, hence:
- root: chroot into the call's empty work folder (the parent makes one when the workdir layer is off), as root
  or inside a user namespace of its own, then every capability dropped and the securebits locked: no other path
  exists for it (no /tmp, no /proc, none of the user's files), and it cannot chroot, mount or mknod its way out.
  Where the kernel allows neither (not root, no unprivileged user namespaces), the child says so on stderr;
- syscalls: a seccomp filter (x86_64; elsewhere the child says so on stderr): kill, tkill, tgkill,
  rt_(tg)sigqueueinfo, pidfd_send_signal / _open / _getfd, ptrace, process_vm_readv / _writev, execve and
  execveat fail with EPERM, so it signals, traces and execs nothing (a non-root parent's child is that user);
- user: when started as root, the child drops to the user nobody (no supplementary groups) and
  sets no_new_privs; it then can neither raise the limits above (hard limits are lowered first) nor
  read another user's files or /proc/PID/environ, nor gain privileges through a setuid program;
- always: the memory (RLIMIT_AS), CPU-time (RLIMIT_CPU) and core-dump limits of a short-lived process.
Each layer below the filter is attacked alone in tests/unit/test_tool_sandbox.py, every other layer off, after
the same attack is shown to work with all of them off; as root, and with the parent run as an unprivileged user
(the root layer then chroots inside a user namespace, and the child keeps the parent's user).

Values are rendered in the tiny model's alphabet where that is cheap (render): True/False/None
as true/false/none, lists, tuples, sets and dicts with parentheses instead of brackets and braces.
"""

from __future__ import annotations

import ast
import math
import sys

MAX_SOURCE_CHARS = 2000
MAX_OUTPUT_CHARS = 1000  # the loop's format_result cuts further; this bounds the pipe
MAX_RENDER_DEPTH = 8

SAFE_BUILTIN_NAMES = (
    "abs",
    "min",
    "max",
    "sum",
    "len",
    "range",
    "round",
    "int",
    "float",
    "str",
    "bool",
    "sorted",
    "reversed",
    "pow",
    "divmod",
    "list",
    "tuple",
    "dict",
    "set",
    "all",
    "any",
    "enumerate",
    "zip",
    "map",
    "filter",
    "chr",
    "ord",
    "hex",
    "bin",
)
_BUILTINS = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
SAFE_BUILTINS = {name: _BUILTINS[name] for name in SAFE_BUILTIN_NAMES}
# Exception classes the expression cannot name (no builtins for them) but may raise: fine.

_VALUE_TYPES = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range)
# str.format/format_map read attributes by name from inside a string ("{0.x}"), around this check.
_UNSAFE_METHODS = frozenset({"format", "format_map", "mro"})
MATH_NAMES = frozenset(n for n in dir(math) if not n.startswith("_"))
METHOD_NAMES = frozenset(
    n for t in _VALUE_TYPES for n in dir(t) if not n.startswith("_") and n not in _UNSAFE_METHODS
)
ALLOWED_ATTRIBUTES = MATH_NAMES | METHOD_NAMES


def check_source(source: str) -> tuple[str, str] | None:
    """Why `source` may not be evaluated, as (error type, message), or None when it may."""
    if len(source) > MAX_SOURCE_CHARS:
        return "forbidden", f"expression longer than {MAX_SOURCE_CHARS} characters"
    if "__" in source:
        return "forbidden", "double underscores are not allowed"
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as e:
        return "syntaxerror", e.msg
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurd nesting
        return type(e).__name__.lower(), str(e) or "expression too complex"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr not in ALLOWED_ATTRIBUTES:
            return "forbidden", f"attribute {node.attr} is not allowed"
    return None


def evaluate(source: str) -> object:
    """The value of the expression `source` with only SAFE_BUILTINS and `math` in scope.
    Not a sandbox on its own: call it after check_source, in a process with limits."""
    code = compile(source.strip(), "<expression>", "eval")
    return eval(code, {"__builtins__": dict(SAFE_BUILTINS), "math": math})


def _chunks(value: object, depth: int):
    """Pieces of value's rendering, lazily, so a huge list is cut without being rendered whole."""
    if value is True or value is False:
        yield "true" if value else "false"
    elif value is None:
        yield "none"
    elif isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth >= MAX_RENDER_DEPTH:  # also what stops a list that contains itself
            yield "..."
            return
        if isinstance(value, (set, frozenset)) and not value:
            yield "set()"
            return
        yield "("
        for i, item in enumerate(value.items() if isinstance(value, dict) else value):
            if i:
                yield ", "
            if isinstance(value, dict):
                yield from _chunks(item[0], depth + 1)
                yield ": "
                item = item[1]
            yield from _chunks(item, depth + 1)
        if isinstance(value, tuple) and len(value) == 1:
            yield ","
        yield ")"
    else:
        yield repr(value)


def render(value: object, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """repr-like text of `value` in the tiny vocabulary where cheap, cut after `max_chars` with " ..."."""
    parts, size = [], 0
    for chunk in _chunks(value, 0):
        parts.append(chunk)
        size += len(chunk)
        if size > max_chars:
            return "".join(parts)[:max_chars] + " ..."
    return "".join(parts)


# The layers a test may switch off (tests/unit/test_tool_sandbox.py); the parent applies the first three.
LAYERS = (
    "filter",
    "environment",
    "workdir",
    "network",
    "files",
    "processes",
    "root",
    "syscalls",
    "user",
)
CHILD_LAYERS = ("network", "files", "processes", "root", "syscalls", "user")
MAX_ERROR_CHARS = 200  # an exception's message is cut to this in the child: KeyError('a'*5*10**7)
_CLONE_NEWNET, _CLONE_NEWUSER, _PR_SET_NO_NEW_PRIVS = 0x40000000, 0x10000000, 38
_NOBODY = 65534  # uid and gid, when the user database cannot say
_PR_SET_SECUREBITS, _PR_CAPBSET_DROP, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 28, 24, 22, 2
# SECBIT_NOROOT | _LOCKED | SECBIT_NO_SETUID_FIXUP | _LOCKED | SECBIT_KEEP_CAPS_LOCKED: uid 0 regains nothing on exec
_SECUREBITS_LOCKED = 0x2F
# The syscalls layer's seccomp filter: these fail with EPERM (x86_64 numbers: the filter checks the architecture).
# Signals and process-control of others (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
# pidfd_send_signal, pidfd_open, pidfd_getfd), reading or writing other processes (ptrace, process_vm_readv,
# process_vm_writev), and starting programs (execve, execveat).
_AUDIT_ARCH_X86_64 = 0xC000003E
_DENIED_X86_64 = (62, 200, 234, 129, 297, 424, 434, 438, 101, 310, 311, 59, 322)


def _unshare_network(libc) -> str | None:
    """Enter a new network namespace (only a loopback, down); why not, when the kernel refuses."""
    import ctypes
    import os

    # unprivileged: via a user ns
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    if libc.unshare(flags) == 0:
        return None
    return f"no network namespace (unshare: {os.strerror(ctypes.get_errno())})"


def _nobody() -> tuple[int, int]:
    """nobody's uid and gid; looked up before the files layer closes /etc/passwd off."""
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return _NOBODY, _NOBODY


def _drop_to_nobody(libc, uid: int, gid: int) -> None:
    """As root: become nobody, so that the kernel enforces RLIMIT_NPROC and the lowered hard limits."""
    import os

    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # a setuid program gains nothing
        raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")
    if os.geteuid() != 0:
        return  # already unprivileged: the limits hold as they are
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # also the saved uid: no way back
    if 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
        raise OSError("could not drop root")


def _enter_jail(libc, jail: str, in_user_namespace: bool) -> str | None:
    """chroot into ``jail`` (the call's empty work folder): no other path exists for this process. Unprivileged,
    inside a user namespace of its own (where it may chroot). Why not, when the kernel refuses."""
    import ctypes
    import os

    if os.geteuid() != 0 and not in_user_namespace and libc.unshare(_CLONE_NEWUSER) != 0:
        return f"no root layer (unshare: {os.strerror(ctypes.get_errno())})"
    try:
        os.chroot(jail)
        os.chdir("/")
    except OSError as e:
        return f"no root layer (chroot: {e.strerror})"
    return None


def _drop_capabilities(libc) -> None:
    """No capability left, nor any to regain: what a process needs to leave a chroot (chroot, mount, mknod, ...).
    Securebits first (CAP_SETPCAP): uid 0 gets no capabilities back on exec."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    # refused without CAP_SETPCAP: then none to drop
    libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED, 0, 0, 0)
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    # _LINUX_CAPABILITY_VERSION_3
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError("capset: could not drop the capabilities")


def _deny_syscalls(libc) -> str | None:
    """A seccomp filter: the syscalls of _DENIED_X86_64 fail with EPERM, those of another ABI (x32) too, and a
    process of another architecture is killed at its first syscall. Why not, on a machine it is not written for."""
    import ctypes
    import os  # loaded already: nothing new can be opened by now (the files layer, the jail)

    machine = os.uname().machine
    if machine != "x86_64":
        return f"no syscalls layer (its seccomp filter is written for x86_64; this machine is {machine})"
    # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, kill, eperm = 0x7FFF0000, 0x80000000, 0x00050000 | 1
    n = len(_DENIED_X86_64)
    program = [
        (ld, 0, 0, 4),
        (jeq, 1, 0, _AUDIT_ARCH_X86_64),
        (ret, 0, 0, kill),
        (ld, 0, 0, 0),
        (jge, n + 1, 0, 0x40000000),
    ]  # seccomp_data: nr at 0, arch at 4
    program += [(jeq, n - i, 0, nr) for i, nr in enumerate(_DENIED_X86_64)]
    program += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]

    class Instruction(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*(Instruction(*i) for i in program))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
        _PR_SET_SECCOMP,
        _SECCOMP_MODE_FILTER,
        ctypes.byref(Program(len(program), instructions)),
        0,
        0,
    ):
        raise OSError(f"seccomp: the filter was refused ({ctypes.get_errno()})")
    return None


def confine(
    memory_mb: int, cpu_s: int, layers_off: frozenset[str] = frozenset(), jail: str | None = None
) -> list[str]:
    """Shut this process in before it evaluates anything (see the module docstring), in the order
    that works: namespaces and the chroot while still privileged, limits (hard ones included) while root can
    still lower them, the user, then the capabilities, the syscall filter last. ``jail``: the empty folder the
    root layer chroots into. Returns notes on layers the kernel refused (for the parent's log); raises when a
    layer that must hold cannot be set."""
    import ctypes
    import os
    import resource

    notes = []
    libc = ctypes.CDLL(None, use_errno=True)  # dlopen(NULL): no file to open
    nobody = _nobody()
    # unprivileged, the network layer's namespace comes with a user namespace
    in_user_namespace = False
    if "network" not in layers_off:
        note = _unshare_network(libc)
        if note is not None:
            notes.append(note)
        in_user_namespace = note is None and os.geteuid() != 0
    jailed = False
    if "root" not in layers_off and jail:
        note = _enter_jail(libc, jail, in_user_namespace)
        notes += [note] if note else []
        jailed = note is None
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core
    if "files" not in layers_off:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no bytes into any file
        # A limit of 0, not 3: no descriptor can be made even after closing stdin (0 would be free again)
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, 0))
    if "processes" not in layers_off:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # fork fails (for any user but root)
    if "user" not in layers_off:
        _drop_to_nobody(libc, *nobody)
    if jailed:
        # as root without the user layer, or in a user namespace: none to leave by
        _drop_capabilities(libc)
    if "syscalls" not in layers_off:
        note = _deny_syscalls(libc)
        notes += [note] if note else []
    return notes


def _error_message(e: BaseException) -> str:
    """str(e) cut to MAX_ERROR_CHARS, so a 50 MB KeyError is never written to the pipe."""
    try:
        message = str(e)
    except BaseException:  # noqa: BLE001 -- a __str__ that fails (or runs out of memory)
        return "(message could not be shown)"
    return message[:MAX_ERROR_CHARS] + " ..." if len(message) > MAX_ERROR_CHARS else message


def main() -> int:
    header, _, source = sys.stdin.buffer.read().decode("utf-8", errors="replace").partition("\n")
    memory_mb, cpu_s, layers_off, jail = header.split(" ", 3)  # the jail's path may hold spaces
    notes = confine(
        int(memory_mb), int(cpu_s), frozenset(layers_off.split(",")), None if jail == "-" else jail
    )
    if notes:
        sys.stderr.write("".join(f"sandbox: {note}\n" for note in notes))
        sys.stderr.flush()
    error = None
    try:
        text = render(evaluate(source))
    except BaseException as e:  # noqa: BLE001 -- every failure is the expression's answer
        # Only strings survive the except block, so the traceback (holding e.g. the half-built
        # list that ran out of memory) is freed before the answer is written.
        error = (type(e).__name__[:MAX_ERROR_CHARS], _error_message(e))
    if error is not None:
        text = None
        answer = f"error\n{error[0]}\n{error[1]}"
    else:
        answer = f"ok\n{text}"
    sys.stdout.buffer.write(answer.encode("utf-8", errors="replace"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
