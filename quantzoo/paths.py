"""Output locations checked before the work that fills them: a benchmark, a report or a
quantized model takes minutes, and its writer's bare OSError ('[Errno 2] No such file or
directory') named neither the argument nor what was wrong with it.

Each check raises ValueError("<what>: <the problem>"), `what` naming the argument as the user
gave it (e.g. "--json out/x.json", "DST=model.gguf").
"""
from __future__ import annotations

import errno
import os


def check_no_symlink_loop(path, what: str) -> None:
    """`path` (an input or an output) is not, and does not pass through, a symlink loop
    (`ln -s a a`). os.path.exists calls one missing, which misnames the cause ("no such file"),
    Path.resolve raises a RuntimeError, and a writer that renames its file over `path` would
    silently replace the link."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{what}: symlink loop (too many levels of symbolic links)") from None


def _writable_dir(d: str, what: str) -> None:
    if not os.path.isdir(d):
        raise ValueError(f"{what}: {d} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: directory {d} is not writable")


def _nearest(path: str) -> str:
    """The nearest ancestor of a missing `path` that exists (lexists: a dangling link counts, as
    os.makedirs stops on it too)."""
    top = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    while not os.path.lexists(top):
        top = os.path.dirname(top)
    return top


def check_out_dir(path, what: str, files=()) -> None:
    """`path` is a writable directory, or one that os.makedirs can create (its nearest existing
    ancestor is a writable directory); `files`, written inside it, are not directories."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{what.rstrip()}: an empty path")
    check_no_symlink_loop(path, what)
    if not os.path.exists(path):
        _writable_dir(_nearest(path), what)
        return
    _writable_dir(path, what)
    for f in files:
        if os.path.isdir(os.path.join(path, f)):
            raise ValueError(f"{what}: {os.path.join(path, f)} is a directory, where the {f} file goes")


def check_out_file(path, what: str, make_parent: bool = False, replaced: bool = False) -> None:
    """`path` can be opened for writing: not a directory, an existing file writable, and its
    directory a writable one -- or, with make_parent (the writer creates it as os.makedirs
    does), one that check_out_dir accepts. replaced: the writer renames a file of its own over
    `path`, so an existing file's permissions do not matter."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{what.rstrip()}: an empty path")
    check_no_symlink_loop(path, what)
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{what}: is a directory; give the file to write")
    parent = os.path.dirname(path) or "."
    if make_parent:
        check_out_dir(parent, what)
    elif os.path.exists(parent):
        _writable_dir(parent, what)
    elif os.path.isdir(_nearest(parent)):
        raise ValueError(f"{what}: directory {parent} does not exist")
    else:   # a file where a directory of the path should be
        raise ValueError(f"{what}: {_nearest(parent)} is not a directory")
    if not replaced and os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{what}: the file exists and is not writable")
