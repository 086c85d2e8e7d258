"""What `python run.py --help` lists: every config group, each option with its one-line description,
the options in use marked.

One source for each description: the first comment line of the option's YAML
(conf/<group>/<option>.yaml; after `# @package _global_` for experiments and sweeps). The groups come
in the order of conf/config.yaml's defaults list (the table of contents), followed by any other
folder of conf/. conf/hydra/help/rlhf_orch.yaml is the template; `${rlhf_help_groups:...}` in it is
`groups_text`, given Hydra's `hydra.runtime.choices` (the defaults after your overrides).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
WIDTH = 100  # columns of the help text at most
NOT_GROUPS = frozenset({"hydra"})  # folders of conf/ that are not option groups
_DEFAULT = re.compile(r"^\s*-\s*(?:override\s+)?(?P<group>[\w/]+)\s*:\s*(?P<option>[\w.-]+)\s*(?:#\s*(?P<what>.*))?$")


def groups(conf_dir: Path = CONF_DIR) -> list[str]:
    """The option groups: conf/config.yaml's defaults order first, then any other folder of conf/."""
    order = [g for g, _ in defaults_list(conf_dir)]
    present = sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name not in NOT_GROUPS)
    return [g for g in order if g in present] + [g for g in present if g not in order]


def defaults_list(conf_dir: Path = CONF_DIR) -> list[tuple[str, str]]:
    """(group, what it decides) for each `- group: option  # what` line of conf/config.yaml."""
    out = []
    for line in (conf_dir / "config.yaml").read_text(encoding="utf-8").splitlines():
        m = _DEFAULT.match(line)
        if m and "/" not in m["group"]:
            out.append((m["group"], (m["what"] or "").strip()))
    return out


def options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def description(group: str, option: str, conf_dir: Path = CONF_DIR) -> Optional[str]:
    """The first comment line of conf/<group>/<option>.yaml (None when it has no header comment)."""
    for line in (conf_dir / group / f"{option}.yaml").read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text.startswith("#"):
            return None
        text = text.lstrip("#").strip()
        if text.startswith("@package") or not text:
            continue
        return text
    return None


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _merged(names: list[str]) -> str:
    """Options that share a description on one row: {gloo,nccl}_bucketed, or a, b."""
    heads, tails = zip(*(n.split("_", 1) if "_" in n else (n, "") for n in names))
    if len(names) > 1 and len(set(tails)) == 1 and tails[0]:
        return "{" + ",".join(heads) + "}_" + tails[0]
    return ", ".join(names)


def rows(choices: Optional[Mapping[str, Any]] = None, conf_dir: Path = CONF_DIR) -> list[tuple[str, bool, str, str]]:
    """(group, in use, option(s), description) rows; options of a group with the same description
    share a row (gloo_bucketed and nccl_bucketed), except the one in use."""
    choices = dict(choices or {})
    out = []
    for group in groups(conf_dir):
        by_text: dict[str, list[str]] = {}
        for option in options(group, conf_dir):
            text = description(group, option, conf_dir) or ""
            key = f"\0{option}" if choices.get(group) == option or not text else text
            by_text.setdefault(key, []).append(option)
        for key, names in by_text.items():
            text = "" if key.startswith("\0") else key
            out.append(
                (
                    group,
                    choices.get(group) in names,
                    _merged(names),
                    text or description(group, names[0], conf_dir) or "",
                )
            )
    return out


def groups_text(choices: Optional[Mapping[str, Any]] = None, conf_dir: Path = CONF_DIR, width: int = WIDTH) -> str:
    """One row per option: `group  * option  description` (`*`: in use with these choices)."""
    table = rows(choices, conf_dir)
    group_w = max(len(g) for g, *_ in table) + 2
    name_w = max(len(n) for _, _, n, _ in table) + 2
    lines, last = [], None
    for group, used, names, text in table:
        head = f"{group if group != last else '':<{group_w}}{'*' if used else ' '} {names:<{name_w}}"
        lines.append(head + _clip(text, width - len(head)))
        last = group
    return "\n".join(lines)


def help_resolver(choices: Any = None) -> str:
    """`${rlhf_help_groups:${hydra.runtime.choices}}` in the help template; `$` escaped for the
    string.Template Hydra applies afterwards."""
    return groups_text(choices).replace("$", "$$")
