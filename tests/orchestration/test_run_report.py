"""`logger.report=true`: the run record writes the run page every `logger.plot_every_n_steps` steps
and at the end; a page that cannot be written is one printed line, never a failed run."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_orch.orchestration.run_record import RunRecord
from tests.view.run_dirs import write_run


def _record(run_dir, report: bool, every: int) -> RunRecord:
    record = RunRecord.__new__(RunRecord)  # (only what `log` and `write_report` touch)
    record.run_dir = run_dir
    record.typed = SimpleNamespace(logger=SimpleNamespace(report=report, plot_every_n_steps=every))
    record.metrics_file = SimpleNamespace(write=lambda metrics: None)
    record.logger = SimpleNamespace(log=lambda step, metrics: None)
    record.history = []
    return record


def test_the_page_is_written_every_plot_every_n_steps_when_asked(tmp_path):
    run = write_run(tmp_path / "run")
    page = run / "report.html"
    record = _record(run, report=True, every=2)
    record.log(1, {"step": 1})
    assert not page.exists()
    record.log(2, {"step": 2})
    assert page.is_file() and "page_test" in page.read_text()
    page.unlink()
    _record(run, report=False, every=2).log(4, {"step": 4})
    assert not page.exists()
    _record(run, report=True, every=0).log(4, {"step": 4})  # 0: only at the end
    assert not page.exists()


def test_a_page_that_cannot_be_written_is_one_line(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a dir")
    _record(blocked, report=True, every=1).write_report()  # (a run dir that is a file: every write fails)
    out = capsys.readouterr().out
    assert out.startswith("report: not written (") and out.count("\n") == 1
