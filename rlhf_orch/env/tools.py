"""Run a tool by hand, as the policy would: `python -m rlhf_orch.env.tools python < code.py`.

Prints exactly what the model would get back (`run_python(code).observation()`) for the code on
stdin, under the default sandbox limits or the ones given. Exit code 0 when the tool ran, whatever
the code did; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_orch.env.sandbox import SandboxLimits, run_python

TOOLS = ("python",)


def _parser() -> argparse.ArgumentParser:
    defaults = SandboxLimits()
    parser = argparse.ArgumentParser(prog="python -m rlhf_orch.env.tools", description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=TOOLS, help="the tool to run; its input is read from stdin")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s, help="wall-clock limit")
    parser.add_argument("--memory-mb", type=int, default=defaults.memory_mb, help="address space limit")
    parser.add_argument(
        "--max-output-bytes",
        type=int,
        default=defaults.max_output_bytes,
        help="output the model sees; the rest is cut, with a marker",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits with 2 on bad flags
    try:
        limits = SandboxLimits(
            timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_output_bytes=args.max_output_bytes
        )
    except ValueError as e:
        parser.error(str(e))  # exits with 2
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    observation = run_python(code, limits).observation()
    # Bytes, so that what is printed does not depend on the terminal's encoding.
    sys.stdout.buffer.write(observation.encode("utf-8"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
