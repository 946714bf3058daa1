"""Run logs survive a kill mid-write: a torn last metrics line is cut when the resumed run reopens the file
(appending to it made the whole file unreadable), readers skip an unterminated last line, and `plot` says
what is wrong in one line instead of a traceback."""

from __future__ import annotations

import json

from megatron_opd.trainer.logger import METRICS_FILE, RunLogger, read_metrics
from megatron_opd.trainer.plot import main as plot_main


def test_torn_last_line_is_cut_on_resume_and_skipped_by_readers(tmp_path):
    log = RunLogger(tmp_path, tensorboard=False)
    log.log(1, {"loss/total_loss": 1.0})
    log.close()
    path = tmp_path / METRICS_FILE
    with open(path, "a") as f:
        f.write('{"step": 2, "loss/tot')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # a reader while it is torn
    log = RunLogger(tmp_path, tensorboard=False)  # the resumed run
    log.log(2, {"loss/total_loss": 0.5})
    log.close()
    assert [(r["step"], r["loss/total_loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 0.5)]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert plot_main([str(tmp_path / "nope")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / METRICS_FILE}:2: invalid JSON" in err and "Traceback" not in err
