"""Step loggers: console line, metrics.jsonl, and W&B in offline mode (no network, no key)."""

from __future__ import annotations

import math
import time

from rlhf_orch.logging.base import MetricsFile, read_metrics
from rlhf_orch.logging.console import format_step_line
from rlhf_orch.logging.wandb_logger import WandbLogger

METRICS = {"reward/mean": 0.5, "kl": 0.01, "loss/policy": -0.1, "time/step": 0.4, "time/sync": 0.02}


def test_console_line_shows_the_key_metrics():
    line = format_step_line(3, 10, METRICS)
    assert line.startswith("step    3/10")
    assert "reward 0.500" in line and "sync 0.02s" in line


def test_metrics_file_appends_one_json_object_per_step(tmp_path):
    f = MetricsFile(tmp_path)
    f.write({"step": 1, **METRICS})
    f.write({"step": 2, "reward/mean": math.nan})  # non-finite values become null, not invalid JSON
    f.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["reward/mean"] is None


def test_wandb_logger_runs_offline_into_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="rlhf_orch_test")
    logger.start(str(tmp_path), {"algo": {"num_steps": 2}}, "unit")
    logger.log(1, METRICS)
    logger.log(2, METRICS)
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the offline run's data file was written


def test_wandb_resume_continues_the_same_run_and_a_stop_is_not_a_success(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = WandbLogger(project="rlhf_orch_test")
    first.start(str(tmp_path), {"algo": {"num_steps": 4}}, "unit")
    run_id = first.run_id
    first.log(1, METRICS)
    first.close(exit_code=1, preempted=True)  # SIGTERM: marked preempting, finished with a failure code
    again = WandbLogger(project="rlhf_orch_test")
    again.start(str(tmp_path), {"algo": {"num_steps": 4}}, "unit", resume_id=run_id)  # what resume= passes
    assert again.run_id == run_id
    again.log(2, METRICS)
    again.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))  # one per invocation (same second: one dir)
    assert runs and all(run_id in r.name for r in runs)


def _offline_history_steps(run_dir) -> list[int]:
    """Every `_step` of every history record in the run's offline W&B files (their LevelDB-log
    format: a 7-byte header, then 32 KiB blocks of records with a 7-byte header each)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    steps = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):
        data, pos, pieces = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pieces += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                record = pb.Record()
                record.ParseFromString(pieces)
                pieces = b""
                if record.WhichOneof("record_type") == "history":
                    steps += [
                        int(i.value_json) for i in record.history.item if (i.key or "/".join(i.nested_key)) == "_step"
                    ]
    return steps


def test_a_resumed_wandb_run_does_not_log_again_the_steps_it_has(tmp_path, monkeypatch):
    """The first process logged steps 1-5 and was killed; its checkpoint was of step 3. The resumed
    process runs steps 4-7 again: W&B gets 6 and 7 only (4 and 5 it has; exact resume makes them equal)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = WandbLogger(project="rlhf_orch_test")
    first.start(str(tmp_path), {}, "unit")
    for step in range(1, 6):
        first.log(step, METRICS)
    first.close(exit_code=1, preempted=True)
    again = WandbLogger(project="rlhf_orch_test")
    again.start(str(tmp_path), {}, "unit", resume_id=first.run_id)
    for step in range(4, 8):
        again.log(step, METRICS)
    again.close()
    # W&B's service process writes the offline file; under load its last records land after
    # close() returns (seen once in CI: 6 and 7 missing), so wait for them a while.
    deadline = time.monotonic() + 60
    while _offline_history_steps(tmp_path) != [1, 2, 3, 4, 5, 6, 7] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _offline_history_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7]
