"""``queue add a.yaml b.yaml --sweep KEY=V1,V2 ... --seeds``: the grid, composed configs, names
after the swept values, and ``queue ls`` grouping the seeds of each point."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import QueueDB
from nanolab.queue.sweep import grid, parse_sweeps, point_name


def queue(capsys, db: Path, *argv: str) -> tuple[int, str, str]:
    code = main([argv[0], "--db", str(db), *argv[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_grid_and_names() -> None:
    sweeps = parse_sweeps(["model.optimizer.lr=1e-3,3e-3", "model.gpt.n_layer=4,6"], [])
    points = grid(sweeps)
    assert len(points) == 4 and grid([]) == [()]
    assert points[1] == (("model.optimizer.lr", "1e-3"), ("model.gpt.n_layer", "6"))
    assert point_name("quickstart", points[1]) == "quickstart-lr1e-3-n_layer6"
    # a swept path names its folder (it was refused as "--name 'q-dataset_dirdata/web'")
    (web,) = grid(parse_sweeps(["data.dataset_dir=data/web"], []))
    assert point_name("q", web) == "q-dataset_dirdata_web"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--sweep", "model.optimizer.lr"], "expected KEY=V1,V2"),
     (["--sweep", "model.optimizer.lr=1e-3,"], "expected KEY=V1,V2"),
     (["--sweep", "model.optimizer.lr=1e-3", "--set", "model.optimizer.lr=2e-3"], "also given with --set"),
     (["--sweep", "seed_everything=1,2"], "use --seeds"),
     (["--sweep", "model.optimizer.lr=1,2", "--sweep", "model.optimizer.lr=3"], "swept twice"),
     (["--sweep", "model.optimizer.lr=1e-3,1.0e-3"], "'1.0e-3' is a value listed before"),
     (["--sweep", "model.gpt.n_layer=1,01"], "'01' is a value listed before"),
     (["--sweep", "model.optimizer.betas=[0.9,0.95],[0.9,0.99]"], "a list or mapping value cannot be swept")],
)  # fmt: skip
def test_bad_sweeps_are_one_line_and_add_nothing(tmp_path, capsys, argv, message) -> None:
    config = write_config(tmp_path / "a.yaml", {"trainer": {"max_steps": 5}})
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(config), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert QueueDB(db).jobs() == []


def test_several_configs_and_a_sweep_times_seeds(tmp_path, char_dataset, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    del cfg["run"]["name"]
    base = write_config(tmp_path / "base.yaml", cfg)
    wide = write_config(tmp_path / "wide.yaml", {"model": {"gpt": {"n_embd": 48}}})
    db = tmp_path / "q.db"
    code, out, err = queue(capsys, db, "add", str(base), str(wide), "--seeds", "1,2",
                           "--sweep", "model.optimizer.lr=1e-3,3e-3")  # fmt: skip
    assert code == 0, err
    jobs = QueueDB(db).jobs()
    assert [j.name for j in jobs] == ["base+wide-lr1e-3-s1", "base+wide-lr1e-3-s2",
                                      "base+wide-lr3e-3-s1", "base+wide-lr3e-3-s2"]  # fmt: skip
    assert jobs[0].config == str(base.resolve())
    assert jobs[0].args == ["--config", str(wide.resolve()), "--model.optimizer.lr=1e-3",
                            "--seed_everything=1"]  # fmt: skip
    # seeds of one point share a config key; the two points do not
    assert jobs[0].config_key == jobs[1].config_key != jobs[2].config_key == jobs[3].config_key
    code, out, _ = queue(capsys, db, "ls")
    lines = out.splitlines()
    header = lines.index("base+wide-lr1e-3: 2 seeds (1, 2): 2 pending")
    assert lines[header + 1].split()[1] == "base+wide-lr1e-3-s1"
    assert "base+wide-lr3e-3: 2 seeds (1, 2): 2 pending" in lines


@pytest.mark.slow  # 18 configs parsed: ~30 s
def test_the_sweep_commands_of_docs_queue_md_queue_what_they_say(tmp_path, capsys, monkeypatch):
    import re
    import shlex

    from conftest import REPO

    page = (REPO / "docs" / "queue.md").read_text()
    section = page[page.index("**Several configs, sweeps.**") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    commands = [line for line in block.splitlines() if line.startswith("nanolab queue add")]
    assert len(commands) == 2
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    counts = []
    for command in commands:
        words = shlex.split(command.split("#")[0])
        db = tmp_path / f"q{len(counts)}.db"
        code, _, err = queue(capsys, db, *words[2:])
        assert code == 0, err
        counts.append([j.name for j in QueueDB(db).jobs()])
    assert counts[0] == [f"quickstart-lr{lr}-s{s}" for lr in ("1e-3", "3e-3") for s in (1, 2, 3)]
    assert len(counts[1]) == 12 and counts[1][0] == "quickstart-lr1e-3-n_layer4-s1"


def test_a_sweep_times_seeds_parses_and_estimates_each_point_once(
    tmp_path, char_dataset, capsys, monkeypatch
):
    """A config is read and estimated once per sweep point, not once per job: the seeds of a
    point differ only in ``seed_everything`` and the run name (counted, not timed). With the
    parser's schema remembered, no point needs the parser itself."""
    import nanolab.queue.predict as predict
    import nanolab.run.parse as parse
    import nanolab.run.read as read

    parse.verb_keys("fit")  # the keys and the schema remembered, as after any earlier fit
    calls: dict[str, int] = {"read": 0, "parse": 0, "estimate": 0, "memory": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(read, "fit_config", counted("read", read.fit_config))
    monkeypatch.setattr(parse, "parse_fit_config", counted("parse", parse.parse_fit_config))
    monkeypatch.setattr(predict, "job_estimate", counted("estimate", predict.job_estimate))
    monkeypatch.setattr(predict, "memory_need", counted("memory", predict.memory_need))
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    del cfg["run"]["name"]
    base = write_config(tmp_path / "base.yaml", cfg)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(base), "--seeds", "1,2,3",
                         "--sweep", "model.optimizer.lr=1e-3,3e-3",
                         "--sweep", "model.gpt.n_layer=1,2")  # fmt: skip
    assert code == 0, err
    assert len(QueueDB(db).jobs()) == 12
    assert calls == {"read": 4, "parse": 0, "estimate": 4, "memory": 4}


def test_the_seeds_of_a_point_are_the_jobs_one_parse_per_seed_gives(tmp_path, char_dataset):
    """A seed's job built from its sibling's parse equals the job built from its own parse:
    the same config (seed and run name included), key, estimate, memory and run directory."""
    from nanolab.queue.jobs import build_jobs, parse_config
    from nanolab.queue.predict import flops_estimate, memory_need

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    del cfg["run"]["name"]
    base = write_config(tmp_path / "base.yaml", cfg).resolve()
    sets = ["model.optimizer.lr=3e-3", "--run.eval_every_steps=4"]

    def build(seeds: str):
        return build_jobs(base, sets, seeds, None, tmp_path, estimate=flops_estimate,
                          memory=memory_need)  # fmt: skip

    together = build("7,2,11")
    alone = [job for seed in ("7", "2", "11") for job in build(seed)]
    assert together == alone
    args = ["--model.optimizer.lr=3e-3", "--run.eval_every_steps=4"]
    first = parse_config(base, [*args, "--seed_everything=7"], "base-lr-s7", tmp_path)
    own = parse_config(base, [*args, "--seed_everything=2"], "base-lr-s2", tmp_path)
    shared = parse_config(base, [*args, "--seed_everything=2"], "base-lr-s2", tmp_path,
                          seed_of=first, seed=2)  # fmt: skip
    assert shared == own and shared.config["seed_everything"] == 2
