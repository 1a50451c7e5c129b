"""Notifications: a command target filled in without a shell, an apprise URL delivered to a
local endpoint, results.log, and failures that never touch the run."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

from nanolab.notify import NotifyConfigError, check_targets, send

#: A command that writes its arguments, one per line, to the file named first.
RECORDER = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write('\\\\n'.join(sys.argv[2:]) + '\\\\n')\""


def test_fields_fill_arguments_and_never_reach_a_shell(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    hostile = "x; touch pwned $(touch pwned2)"
    assert (
        send(
            [f"{RECORDER} {out} {{run}} reason={{reason}}"],
            {"run": hostile, "reason": "completed"},
            "t",
            "b",
        )
        == []
    )
    assert out.read_text().splitlines() == [hostile, "reason=completed"]
    assert not (tmp_path / "pwned").exists() and not list(Path.cwd().glob("pwned*"))


def test_a_failing_target_is_a_warning(tmp_path: Path, capsys) -> None:
    warnings = send(["false", "no-such-command-here x", "nope://host"], {}, "t", "b")
    assert len(warnings) == 3
    err = capsys.readouterr().err
    assert "notify 'false' failed (exit 1)" in err and "no such command" in err


def test_unknown_fields_are_refused_before_anything_runs() -> None:
    check_targets(["echo {run} {reason}", "ntfy://topic"], ("run", "reason"), "notify.targets")
    with pytest.raises(NotifyConfigError, match=r"notify.targets\[0\] names \{runn\}"):
        check_targets(["echo {runn}"], ("run",), "notify.targets")
    with pytest.raises(NotifyConfigError, match="No closing quotation"):
        check_targets(['echo "open'], ("run",), "notify.targets")


def test_an_apprise_url_is_delivered(tmp_path: Path) -> None:
    """apprise's json:// target posts to a local HTTP endpoint (nothing leaves the machine)."""
    pytest.importorskip("apprise")
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"json://127.0.0.1:{server.server_port}/"
        assert send([url], {"run": "r"}, "nanolab: r completed", "the body") == []
    finally:
        server.shutdown()
    assert got and got[0]["title"] == "nanolab: r completed" and got[0]["message"] == "the body"


def test_a_run_end_writes_results_log_and_fires_the_targets(tmp_path: Path, char_dataset: Path):
    out = tmp_path / "told.txt"
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["notify"] = {
        "targets": [f"{RECORDER} {out} {{run}} {{reason}} {{step}} {{val_loss}}", "false"]
    }
    path = write_config(tmp_path / "t.yaml", cfg)
    proc = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run, reason, step, val = out.read_text().splitlines()
    assert (run, reason, step) == ("tiny", "completed", "6") and float(val) > 0
    assert "notify 'false' failed (exit 1)" in proc.stderr  # and the run still exited 0
    (line,) = (tmp_path / "runs" / "results.log").read_text().splitlines()
    result = json.loads(line)
    assert result["run"] == "tiny" and result["reason"] == "completed" and result["step"] == 6
    bad = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(path),
        "--notify.targets", '["echo {nope}"]', "--run.name", "other", cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2 and "notify.targets[0] names {nope}" in bad.stderr


def test_output_that_is_not_text_and_a_hung_command_with_children(tmp_path: Path, monkeypatch):
    """A target printing bytes that are not UTF-8 is a warning like any failure (it was a
    traceback); a target past its time is stopped with its children."""
    import time

    from nanolab import notify

    script = tmp_path / "bin.sh"
    script.write_text("#!/bin/sh\nprintf '\\377\\376'\nexit 3\n")
    script.chmod(0o755)
    (warning,) = send([str(script)], {}, "t", "b")
    assert "failed (exit 3" in warning
    monkeypatch.setattr(notify, "TIMEOUT_S", 1.0)
    pidfile = tmp_path / "child.pid"
    (warning,) = send([f"sh -c 'sleep 30 & echo $! > {pidfile}; wait'"], {}, "t", "b")
    assert "stopped with its children" in warning
    child = int(pidfile.read_text())
    time.sleep(0.2)
    stat = Path(f"/proc/{child}/stat")
    state = stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "gone"
    assert state in ("gone", "Z", "X"), state  # killed (a zombie until its new parent reaps it)


def test_a_format_spec_that_cannot_apply_is_refused_up_front() -> None:
    with pytest.raises(NotifyConfigError, match="Unknown conversion specifier"):
        check_targets(["echo {run!x}"], ("run",), "notify.targets")
    with pytest.raises(NotifyConfigError, match=r"notify\.targets\[0\]"):
        check_targets(["echo x{run:q}"], ("run",), "notify.targets")


def test_an_apprise_url_that_can_never_work_is_refused_before_the_run(
    tmp_path: Path, capsys, monkeypatch, char_dataset: Path
) -> None:
    """An unknown scheme (a typo of the service), or apprise missing, would only show as a
    warning in the morning: both are refused up front, in one line, and fit exits 2."""
    pytest.importorskip("apprise")
    with pytest.raises(NotifyConfigError, match=r"apprise does not understand slak://"):
        check_targets(["slak://token/channel"], ("run",), "notify.targets")
    from test_data_checks import fit_in_process

    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["notify"] = {"targets": ["slak://token/channel"]}
    code, err = fit_in_process(capsys, write_config(tmp_path / "n.yaml", cfg))
    assert code == 2 and not (tmp_path / "runs" / "tiny").exists()
    assert [e for e in err if "error" in e] == [
        "nanolab fit: error: notify.targets[0]: apprise does not understand slak://... (an "
        "unknown service or a malformed URL); see https://github.com/caronc/apprise/wiki for "
        "the URL of yours"
    ]
    monkeypatch.setitem(sys.modules, "apprise", None)  # import apprise -> ImportError
    with pytest.raises(NotifyConfigError, match=r"pip install 'nanolab\[notify\]'"):
        check_targets(["ntfy://topic"], ("run",), "--notify")


def test_the_end_notification_carries_trainings_last_val_loss(tmp_path: Path) -> None:
    """A ``nanolab validate`` appended after training's last validation (a resume that then
    ends without validating) is not the run's val loss in results.log and the targets."""
    from types import SimpleNamespace

    from nanolab.callbacks.notify import Notifier

    run = tmp_path / "runs" / "night"
    run.mkdir(parents=True)
    records = [
        {"event": "val", "time": 1.0, "step": 2000, "tokens": 256000, "val_loss": 2.3905},
        {"event": "val", "time": 2.0, "step": 2044, "evaluated_by": "nanolab validate",
         "val_loss": 2.3754},
        {"event": "end", "time": 3.0, "step": 2044, "reason": "budget"},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trainer = SimpleNamespace(
        is_global_zero=True, state=SimpleNamespace(fn="fit"), default_root_dir=str(run)
    )
    notifier = Notifier(results_log=True)
    notifier._ended(trainer)
    assert notifier.sent is not None and notifier.sent["val_loss"] == 2.3905
    (line,) = (tmp_path / "runs" / "results.log").read_text().splitlines()
    assert json.loads(line)["val_loss"] == 2.3905


def test_the_end_notification_leaves_out_a_validation_a_resume_abandoned(tmp_path: Path) -> None:
    """A run validated at 2,000 and 3,000, crashed, resumed from its step-2,000 checkpoint and
    stopped by its budget at 2,500 before validating again: step 3,000 is the abandoned
    timeline's; the run's val loss is step 2,000's."""
    from types import SimpleNamespace

    from nanolab.callbacks.notify import Notifier

    run = tmp_path / "runs" / "night"
    run.mkdir(parents=True)
    records = [
        {"event": "start", "time": 0.0, "step": 0, "resumed_from_step": None},
        {"event": "val", "time": 1.0, "step": 2000, "tokens": 256000, "val_loss": 2.3905},
        {"event": "val", "time": 2.0, "step": 3000, "tokens": 384000, "val_loss": 2.2001},
        {"event": "start", "time": 3.0, "step": 2000, "resumed_from_step": 2000},
        {"event": "end", "time": 4.0, "step": 2500, "reason": "budget"},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trainer = SimpleNamespace(
        is_global_zero=True, state=SimpleNamespace(fn="fit"), default_root_dir=str(run)
    )
    notifier = Notifier(results_log=False)
    notifier._ended(trainer)
    assert notifier.sent is not None and notifier.sent["val_loss"] == 2.3905
