"""Directories no other user can change, opened once and then used through their descriptor.

A library loaded from a directory runs with the loader's rights, so the kernel cache
(:mod:`~fedlap_privacy.compute.kernels.build`) is used only where nobody else can put a file into
it or rename it, nor any directory above it: checking the last directory alone is not
enough, since whoever can write to its parent can rename it away and put their own in its
place between the check and the use. :func:`open_private_dir` walks the path from ``/`` one
component at a time with ``openat(O_NOFOLLOW | O_DIRECTORY)`` relative to the directory
checked before, and checks each one it opens (``fstat`` of the open descriptor, not the
name):

* owned by the caller (effective uid) or root;
* not writable by group or others, except an ancestor with the sticky bit set (``/tmp``),
  in which only an entry's owner may rename or remove it; the directory itself must be
  private to these owners;
* no symbolic link, except one that root owns (the system's own layout: macOS's ``/tmp``,
  a cluster's ``/home``), whose target is then walked and checked the same way.

The descriptor returned names the directory that was checked, whatever happens to the path
afterwards; :mod:`~fedlap_privacy.compute.kernels.build` creates, renames and reads files relative
to it. This is the check of OpenSSH's ``safe_path`` and systemd's ``CHASE_SAFE`` made with
descriptors. Linux and macOS (POSIX ``*at`` calls); elsewhere every path is unsafe.
"""

from __future__ import annotations

import os
import secrets
import stat

__all__ = ["UnsafePath", "make_private_subdir", "open_private_dir", "remove_private_subdir"]

_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_PATH", 0))
_LIST_FLAGS = _DIR_FLAGS & ~getattr(os, "O_PATH", 0)  # a descriptor that can be listed
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


class UnsafePath(OSError):
    """A path another user could change (the message names the component and why)."""


def _trusted_owners() -> tuple[int, int]:
    if not hasattr(os, "geteuid") or os.open not in os.supports_dir_fd:
        raise UnsafePath("directory ownership cannot be checked on this platform")
    return (os.geteuid(), 0)


def _check(st: os.stat_result, shown: str, *, ancestor: bool) -> None:
    """The rules of the module docstring for one open directory."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{shown} is not a directory")
    if st.st_uid not in _trusted_owners():
        raise UnsafePath(f"{shown} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022 and not (ancestor and st.st_mode & stat.S_ISVTX):
        raise UnsafePath(f"{shown} is writable by other users "
                         f"(mode {stat.S_IMODE(st.st_mode):o})")


def _open_component(parent: int, name: str, shown: str) -> int:
    """``openat(parent, name)`` of a directory, never through a link; the descriptor is
    checked to be the entry that was looked at."""
    before = os.stat(name, dir_fd=parent, follow_symlinks=False)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise UnsafePath(f"{shown} changed while it was checked")
    return fd


def open_private_dir(path: str, *, create: bool, parent_only: bool = False
                     ) -> tuple[int, str]:
    """A descriptor of the directory ``path`` (made absolute; ``..`` taken lexically), every
    component checked, and the path it was reached by with root's links replaced by their
    targets; missing components are created with mode 0700 where ``create``. With
    ``parent_only`` the directory itself is checked as an ancestor (it may be a sticky one
    such as /tmp): the caller uses it only to make a private one in it
    (:func:`make_private_subdir`).

    Raises :class:`UnsafePath` naming the first component that fails, or the
    ``OSError`` of a lookup (a missing directory without ``create``, a denied one).
    """
    _trusted_owners()
    pending = [part for part in os.path.abspath(path).split("/") if part]
    pending.reverse()  # a stack: the next component last
    root = os.open("/", _DIR_FLAGS)
    stack: list[tuple[int, str]] = [(root, "/")]
    links = 0
    try:
        _check(os.fstat(root), "/", ancestor=True)
        while pending:
            name = pending.pop()
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            parent, parent_shown = stack[-1]
            shown = os.path.join(parent_shown, name)
            try:
                entry = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    pass
                entry = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISLNK(entry.st_mode):
                if entry.st_uid != 0:
                    raise UnsafePath(f"{shown} is a symbolic link (give the directory "
                                     f"it points to instead)")
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafePath(f"{shown}: too many symbolic links")
                target = os.readlink(name, dir_fd=parent)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                pending.extend(reversed([part for part in target.split("/") if part]))
                continue
            fd = _open_component(parent, name, shown)
            stack.append((fd, shown))
            _check(os.fstat(fd), shown, ancestor=True)  # the last one again below
        _check(os.fstat(stack[-1][0]), stack[-1][1], ancestor=parent_only)
        return stack.pop()
    finally:
        for fd, _ in stack:
            os.close(fd)


def make_private_subdir(parent: int, prefix: str) -> tuple[int, str]:
    """A new directory with a random name under the descriptor ``parent``, mode 0700, as
    :func:`tempfile.mkdtemp` makes one: its descriptor and name."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            continue
        fd = _open_component(parent, name, name)
        try:
            _check(os.fstat(fd), name, ancestor=False)
        except UnsafePath:
            os.close(fd)
            raise
        return fd, name
    raise FileExistsError(f"no free name for a {prefix}* directory")


def remove_private_subdir(parent: int, name: str) -> None:
    """Remove the directory ``name`` under ``parent`` (one of :func:`make_private_subdir`'s)
    and the files in it, never through a link; errors are ignored (what remains is private
    to the caller)."""
    try:
        fd = os.open(name, _LIST_FLAGS, dir_fd=parent)
    except OSError:
        return
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)
            except OSError:
                pass
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError:
        pass
