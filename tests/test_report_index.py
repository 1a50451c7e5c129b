"""``nanolab report --index`` on a results.log whose last line a killed writer left without its
newline."""

from __future__ import annotations

import json
from pathlib import Path

from test_report import run_report, write_run

from nanolab.runs import append_result


def test_index_ends_a_torn_last_line_before_appending(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, "a", losses=[3.0, 2.5], vals={2: 2.6})
    log = tmp_path / "results.log"
    log.write_text('{"run": "old", "reason": "completed", "step": 5}\n{"run": "torn", "rea')
    code, _, err = run_report(capsys, str(tmp_path), "--index")
    assert code == 0, err
    lines = log.read_text().splitlines()
    assert lines[1] == '{"run": "torn", "rea'  # left as it was, on a line of its own
    assert json.loads(lines[2])["run"] == "a"
    append_result(log, {"run": "b"})  # a whole last line gets no blank line before the next
    assert log.read_text().splitlines()[3:] == ['{"run": "b"}']
