"""scripts/uv_args.py: pip's own merged install options turned into uv's, so scripts/setup.sh's uv
installs from the indexes, wheel folders and constraints pip would. Run as setup.sh runs it, under
a pip configured by a file of this test's (and the environment), with this machine's own pip
configuration kept out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "uv_args.py"

PIP_CONF = """\
[global]
index-url = https://global.example/simple
extra-index-url =
    file:///srv/mirror/simple
    file:///srv/more/simple
find-links = /srv/file-wheels
cert = /srv/ca.pem

[install]
index-url = https://install.example/simple
constraint = /srv/constraints.txt
"""


def _run(tmp_path: Path, conf: str, *args: str, **env: str) -> list[str]:
    (tmp_path / "pip.conf").write_text(conf)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update(
        PIP_CONFIG_FILE=str(tmp_path / "pip.conf"),
        HOME=str(tmp_path),  # no user file
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_CONFIG_DIRS=str(tmp_path / "nowhere"),  # no site-wide file under /etc/xdg
        **env,
    )
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=clean, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_pip_s_merged_install_options_become_uv_options(tmp_path):
    assert _run(tmp_path, PIP_CONF, PIP_FIND_LINKS="/srv/env-wheels /srv/more-wheels") == [
        "--index-strategy",
        "unsafe-best-match",  # pip's rule: the best version across every index
        "--index-url",  # [install] over [global], as pip reads them for `pip install`
        "https://install.example/simple",
        "--extra-index-url",  # a multi-line value: one URL a line
        "file:///srv/mirror/simple",
        "--extra-index-url",
        "file:///srv/more/simple",
        "--find-links",  # the environment over the files
        "/srv/env-wheels",
        "--find-links",
        "/srv/more-wheels",
        "--constraint",
        "/srv/constraints.txt",
    ]
    assert _run(tmp_path, PIP_CONF, "--cert") == ["/srv/ca.pem"]


def test_no_index_is_passed_and_no_index_url_with_it(tmp_path):
    args = _run(tmp_path, "[install]\nno-index = true\nfind-links = /srv/wheels\n")
    assert args == ["--index-strategy", "unsafe-best-match", "--no-index", "--find-links", "/srv/wheels"]
