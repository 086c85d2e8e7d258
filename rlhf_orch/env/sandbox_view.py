"""What model-written code sees of the filesystem in the sandbox (`rlhf_orch.env.sandbox`): the
interpreter's own paths, read-only; the system directories; nothing private (checkouts, home
directories, the run's files). Planning over paths only: the child applies the plan
(`rlhf_orch.env.sandbox_child`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlhf_orch.env.sandbox_child import KEPT_DEVICES, MASKED_DIRS, SYSTEM_DIRS


def child_sys_path() -> list[str]:
    """The sys.path of `sys.executable -I`: what the code may import, and so must reach."""
    out = subprocess.run(
        [sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": os.defpath},
    )
    return [p for p in json.loads(out.stdout) if os.path.exists(p)]


def private_locations() -> list[str]:
    """Directories hidden wherever they are, a system directory included (a checkout under /usr/src,
    a workspace under /var/lib): this project's checkout (its datasets, run dirs, checkpoints), the
    working directory runs are started from (outputs/), the home directory (tokens, caches)."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return sorted({os.path.realpath(p) for p in (checkout, os.getcwd(), os.path.expanduser("~")) if p and p != "/"})


def interpreter_paths() -> list[str]:
    """What the code must reach to run Python and start it again: the isolated interpreter's
    sys.path, every hop of the executable's symlink chain, the base installation's lib directory
    (its shared libraries: libpython, a conda prefix's libssl/libffi) and the venv's pyvenv.cfg."""
    import sysconfig

    paths = child_sys_path() + link_chain(sys.executable)
    for extra in (
        sysconfig.get_config_var("LIBDIR"),
        os.path.join(sys.base_prefix, "lib"),
        os.path.join(sys.prefix, "pyvenv.cfg"),
    ):
        if extra and os.path.exists(extra):
            paths.append(extra)
    return paths


def read_only_tree(
    paths: list[str],
    private: list[str] = (),
    top_level: list[str] | None = None,
    is_dir=os.path.isdir,
    realpath=os.path.realpath,
    mounts: list[str] = (),
) -> list[tuple[str, list[str]]]:
    """What the code may see of the filesystem: the system directories (SYSTEM_DIRS) and `paths`
    (the interpreter and what it imports). Every other directory on the way to them -- a checkout
    holding the datasets and run dirs, a home directory holding tokens and caches, a masked temp
    dir -- keeps only the entries on that way, and so does every `private` location wherever it is
    (a checkout under /usr/src); every other top-level directory (/home, /root, /run, /mnt, /opt,
    ... and what a top-level symlink such as /home -> var/home points to) is emptied, and so is
    every directory mounted under /etc or /var (`mounts`: a Kubernetes token under
    /var/run/secrets, an application's secrets under /etc); /dev keeps KEPT_DEVICES alone. A path
    that holds a private location (a checkout root on sys.path) is not shown entire. Shallowest first, as `(directory, entries shown)`: the sandbox puts a read-only
    tmpfs over each, holding those."""
    private = [p.rstrip("/") for p in private]

    def inside(directory: str, roots) -> bool:
        return any(directory == r or directory.startswith(r + "/") for r in roots)

    masked = [m.rstrip("/") for m in MASKED_DIRS]
    variants = {v for p in paths for v in (os.path.abspath(p), realpath(p))}
    variants = {v for v in variants if not any(pr == v or pr.startswith(v.rstrip("/") + "/") for pr in private)}
    whole = {v.rstrip("/") for v in variants}
    shown: dict[str, set[str]] = {"/dev": set(KEPT_DEVICES), **{p: set() for p in private}}
    for variant in variants:
        parts = [p for p in variant.split("/") if p]
        for depth in range(1, len(parts)):
            directory = "/" + "/".join(parts[:depth])
            if inside(directory, whole):
                break  # inside a path shown entire (the standard library holding lib-dynload)
            hidden = parts[0] not in SYSTEM_DIRS or inside(directory, masked) or inside(directory, private)
            if hidden and not inside(directory, ["/dev"]):
                shown.setdefault(directory, set()).add(parts[depth])
    for name in os.listdir("/") if top_level is None else top_level:
        path = "/" + name
        if name in SYSTEM_DIRS or not is_dir(path):
            continue
        target = realpath(path)
        if target != path and inside(target, whole):
            continue  # a link to where the interpreter lives: its own entries are planned above
        shown.setdefault(target, set())
    for mount in mounts:
        if inside(mount, ["/etc", "/var"]) and not inside(mount, whole) and is_dir(mount):
            shown.setdefault(mount, set())
    return merged_plans(list(shown.items()))


def link_chain(path: str) -> list[str]:
    """`path` and every hop of the symbolic links it goes through (a venv's bin/python -> python3 ->
    the base interpreter): each must be reachable for the code to start the interpreter again."""
    chain = [os.path.abspath(path)]
    while os.path.islink(chain[-1]) and len(chain) < 40:
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), os.readlink(chain[-1]))))
    return chain


def merged_plans(*plans: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """One plan of hidden directories from several: each directory once, with every entry any of
    them shows, shallowest first (the order the sandbox mounts them in)."""
    shown: dict[str, set[str]] = {}
    for plan in plans:
        for directory, names in plan:
            shown.setdefault(directory, set()).update(names)
    return sorted(((d, sorted(names)) for d, names in shown.items()), key=lambda item: (item[0].count("/"), item[0]))


def hidden_dirs(paths: list[str]) -> list[tuple[str, list[str]]]:
    """Directories on the way to `paths` that others cannot search, each with the entries needed.

    Shallowest first: the sandbox replaces each by a tmpfs holding only those entries (bind mounts).
    """
    hidden: dict[str, set[str]] = {}
    for path in paths:
        for variant in {os.path.abspath(path), os.path.realpath(path)}:
            parts = [p for p in variant.split("/") if p]
            current = "/"
            for name in parts:
                try:
                    searchable = os.stat(current).st_mode & 0o001
                except OSError:
                    break
                if not searchable:
                    hidden.setdefault(current, set()).add(name)
                current = os.path.join(current, name)
    return sorted(((d, sorted(names)) for d, names in hidden.items()), key=lambda item: item[0].count("/"))
