"""The directories the processes of one ``dramatiq -p N`` group share, private to the user who runs it.

Each worker process writes its health report and its metrics snapshot to a file
there, and whichever process serves the group's endpoint reads them all. They live
in :func:`root`, ``<tmp>/dramatiq-gp-<uid>`` (``TMPDIR`` moves it), made ``0700`` by
the first process that needs it. A directory there that another user made, that
other users may enter, or that is a symbolic link is refused
(:class:`~dramatiq_gp.errors.UnsafeDirectory`): under a name anyone can predict in a
shared ``/tmp``, another user could otherwise plant or delete reports, or have a
worker write through a link of theirs. Files are written and read without
following symbolic links.

Each group's directory carries the pid of the group's ``dramatiq`` command
(:func:`group`), so two groups on one machine never read each other's files, even
with the same namespace; that of a group whose command has ended is removed by the
next process to start (:func:`forget_dead_groups`).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import tempfile
from pathlib import Path
from urllib.parse import quote

from .errors import UnsafeDirectory

#: What the group's directories may let others do: nothing (``0700``).
PRIVATE = 0o077


def root() -> Path:
    """This user's directory of group directories, on this machine (this container)."""
    return Path(tempfile.gettempdir()) / f"dramatiq-gp-{os.geteuid()}"


def group() -> int:
    """The pid naming this process's group: the ``dramatiq`` command that started it, or this process alone.

    Dramatiq internal relied on: the command starts each worker process with
    ``multiprocessing.Process`` from its main process, whatever the start method
    (``fork``, ``spawn``, ``forkserver``), so ``parent_process()`` is that process
    in all of them (``os.getppid()`` is the fork server's under ``forkserver``).
    """
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getpid()


def name(kind: str, namespace: str, *parts: object) -> str:
    """A group directory's name: ``kind``, the namespace (quoted to one path component), ``parts``, by ``-``."""
    return "-".join([kind, quote(namespace, safe=""), *map(str, parts)])


def private(path: Path, *, others_may_read: bool = False) -> Path:
    """``path``, a directory of this user's alone, made ``0700`` if it is missing (its parents too).

    Raises:
        UnsafeDirectory: it is a symbolic link or not a directory, another user owns it, or its mode lets
            other users in (write only, with ``others_may_read``: a directory the user chose).
    """
    try:
        path.mkdir(mode=0o700)
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return private(path, others_may_read=others_may_read)
    except FileExistsError:
        pass
    found = os.lstat(path)
    mode = stat.S_IMODE(found.st_mode)
    if stat.S_ISLNK(found.st_mode):
        why = "it is a symbolic link"
    elif not stat.S_ISDIR(found.st_mode):
        why = "it is not a directory"
    elif found.st_uid != os.geteuid():
        why = f"it belongs to uid {found.st_uid}, not to uid {os.geteuid()} running this"
    elif found.st_mode & (0o022 if others_may_read else PRIVATE):
        why = f"its mode {mode:04o} lets other users {'write in it' if others_may_read else 'in'}"
    else:
        return path
    raise UnsafeDirectory(f"refusing {path}: {why}")


def group_dir(kind: str, namespace: str, *parts: object) -> Path:
    """This group's directory for ``kind`` and ``namespace`` (and ``parts``), made or checked with :func:`private`."""
    return private(_root() / name(kind, namespace, *parts, group()))


def _root() -> Path:
    """:func:`root`, made or checked with :func:`private`."""
    try:
        return private(root())
    except UnsafeDirectory as exc:
        raise UnsafeDirectory(f"{exc}; remove it, or set TMPDIR to a directory of this user's") from None


def groups(kind: str, namespace: str, *parts: object) -> dict[int, Path]:
    """The group directories for ``kind`` and ``namespace`` (and ``parts``) of groups still running, by group pid.

    Raises:
        UnsafeDirectory: :func:`root` is not this user's alone.
    """
    if not os.path.lexists(root()):
        return {}
    base = _root()
    prefix = name(kind, namespace, *parts) + "-"
    found = {}
    for path in base.iterdir():
        pid = path.name.removeprefix(prefix)
        if path.name.startswith(prefix) and pid.isdigit() and alive(int(pid)):
            found[int(pid)] = path
    return found


def forget_dead_groups(kind: str) -> None:
    """Remove the ``kind`` directories of groups whose ``dramatiq`` command has ended (killed, it left them).

    Raises:
        UnsafeDirectory: :func:`root` is not this user's alone (nothing is removed through another's).
    """
    for path in _root().iterdir():
        pid = path.name.rpartition("-")[2]
        if path.name.startswith(f"{kind}-") and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def forget_the_dead(directory: Path) -> None:
    """Remove the files ``<pid>.json`` of processes that are gone: a group's earlier run left them."""
    for path in directory.glob("*.json"):
        if path.stem.isdigit() and not alive(int(path.stem)):
            path.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write(path: Path, data: bytes) -> None:
    """Replace the file ``path`` with ``data`` at once (through ``<path>.tmp``), following no symbolic link."""
    temporary = path.with_suffix(".tmp")
    temporary.unlink(missing_ok=True)  # left by a process killed while writing
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(temporary, flags, 0o600), "wb") as file:
        file.write(data)
    os.replace(temporary, path)


def read(path: Path) -> bytes:
    """The content of the regular file ``path``, following no symbolic link.

    Raises:
        OSError: it is missing, a symbolic link, or not a regular file (a FIFO would block the reader).
    """
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return file.read()
