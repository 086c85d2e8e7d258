"""scripts/uv_args.py: pip's configuration turned into uv's options, so scripts/setup.sh's uv installs
from the indexes, wheel folders and constraints pip would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from uv_args import uv_args  # noqa: E402

# `pip config list` as a machine with a local mirror prints it (values as pip quotes them)
PIP_CONFIG = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///srv/mirror/simple file:///srv/more/simple'
global.find-links='/srv/global-wheels'
global.index-url='https://pypi.example/simple'
:env:.default-timeout='180'
:env:.find-links='/srv/wheels /srv/more-wheels'
user.index-url='https://user.example/simple'
"""


def test_pip_s_indexes_wheel_folders_and_constraints_become_uv_options():
    assert uv_args(PIP_CONFIG) == [
        "--index-strategy",
        "unsafe-best-match",  # pip's rule: the best version across every index
        "--constraint",
        "/etc/pip/constraints.txt",
        "--extra-index-url",
        "file:///srv/mirror/simple",
        "--extra-index-url",
        "file:///srv/more/simple",
        "--find-links",  # the environment's value replaces the global file's, as in pip
        "/srv/wheels",
        "--find-links",
        "/srv/more-wheels",
        "--index-url",  # the user's file over the global one
        "https://user.example/simple",
    ]


def test_without_pip_configuration_only_pip_s_index_rule_is_passed():
    assert uv_args("") == ["--index-strategy", "unsafe-best-match"]
    assert uv_args("global.timeout='60'\nnot a setting\n") == ["--index-strategy", "unsafe-best-match"]


def test_the_script_reads_pip_config_list_from_stdin():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "uv_args.py")],
        input="site.find-links='/srv/w'\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["--index-strategy", "unsafe-best-match", "--find-links", "/srv/w"]
