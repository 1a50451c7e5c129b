"""``queue run --pack``: the scheduling decisions against simulated device sizes and job peaks
(pure planner, no processes), the schema upgrade that added the packing columns, and real
co-running ``nanolab fit`` processes on the CPU (two share it, the third waits for room; ``queue
ls`` shows who shares; a packed job that runs out of memory runs again alone and finishes).

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import SCHEMA_VERSION, QueueDB
from nanolab.queue.packing import Candidate, Device, GiB, Resident, Rules, plan_pack
from nanolab.runlog import read_records

TESTS = Path(__file__).resolve().parent
H200 = int(139.8 * GiB)  # what an H200 reports
RULES = Rules(margin=0.10, overhead=600 * 1024**2)  # CUDA context, as the estimator has it


_ids = iter(range(1000, 100_000))  # ids the tests do not pick themselves


def job(peak_gib: float | None, *, backfill=False, alone=False, devices=1, jid=None):
    """A waiting job as the planner sees it (a queue row plus its predicted peak)."""
    from nanolab.queue.db import Job

    i = jid if jid is not None else next(_ids)
    row = Job(
        id=i, name=f"j{i}", config="c.yaml", args=[], seed=None, cwd="/", run_dir=f"/r/{i}",
        config_key=None, devices=devices, max_steps=10, estimate_s=None, estimate_source=None,
        status="pending", detail=None, attempts=0, exit_code=None, created=0.0, started=None,
        last_started=None, ended=None, run_seconds=0.0, runner_id=None, job_pid=None, gpus=None,
        log=None, backfill=int(backfill), alone=int(alone),
    )  # fmt: skip
    peak = None if peak_gib is None else int(peak_gib * GiB)
    return Candidate(row, None, peak)


def started(plan) -> list[tuple[str, list[int]]]:
    return [(s.job.name, s.units) for s in plan.start]


def gpus(*sizes_gib: float) -> list[Device]:
    return [Device(i, f"GPU {i}", int(s * GiB)) for i, s in enumerate(sizes_gib)]


def test_three_124m_jobs_share_an_h200_with_the_sum_shown() -> None:
    """Three 17 GiB jobs on a 139.8 GiB device all start on it, each capped at peak + 10%; the
    sum of reservations (peak + margin + 600 MiB overhead each) is what fills the device: seven
    fit, the eighth waits.

    Mutations caught: the cap without the margin; the overhead left out of the reservation;
    reservations not accumulated over the jobs of one round (all eight start).
    """
    jobs = [job(17.0, jid=100 + i) for i in range(8)]
    plan = plan_pack(jobs, [Device(0, "GPU 0", H200)], RULES, None, 0.0)
    assert [s.units for s in plan.start] == [[0]] * 7
    first = plan.start[0]
    assert abs(first.cap - 17.0 * GiB * 1.1) < 2
    assert first.reserved == first.cap + 600 * 1024**2
    assert 7 * first.reserved <= H200 < 8 * first.reserved
    assert plan.drained == [(0, 107)]  # the eighth is next in line: the device is kept for it


def test_first_fit_by_size_and_a_big_job_is_not_starved() -> None:
    """One 40 GiB device; A (20 GiB) starts, B (25 GiB) no longer fits beside it, and C (10 GiB),
    which would, is held back: B is next in line and gets the room first. Once A has gone, B and
    C start together. With a second device, B goes there at once (first fit) and C beside A.

    Mutations caught: plain first fit without the head rule (C starts beside A, and a stream of
    small jobs would keep B waiting forever); the drained device offered to later jobs.
    """
    a, b, c = job(20, jid=1), job(25, jid=2), job(10, jid=3)
    plan = plan_pack([a, b, c], gpus(40), RULES, None, 0.0)
    assert started(plan) == [("j1", [0])] and plan.drained == [(0, 2)]
    # A runs; B and C wait; a stream of small jobs behind B does not get in either
    running = gpus(40)
    running[0].residents.append(Resident(1, plan.start[0].reserved))
    plan = plan_pack([b, c, job(1), job(1)], running, RULES, None, 0.0)
    assert plan.start == [] and plan.drained == [(0, 2)]
    # A finished: B, then C beside it (25 x 1.1 + 10 x 1.1 + 2 x 0.59 = 39.7 <= 40)
    plan = plan_pack([b, c], gpus(40), RULES, None, 0.0)
    assert started(plan) == [("j2", [0]), ("j3", [0])]
    # two devices: first fit puts B on the second one and C back on the first
    plan = plan_pack([a, b, c], gpus(40, 40), RULES, None, 0.0)
    assert started(plan) == [("j1", [0]), ("j2", [1]), ("j3", [0])]


def test_jobs_that_cannot_share_run_alone_and_wait_for_an_empty_device() -> None:
    """No prediction (micro-batch auto), a reservation larger than the device, two devices, or
    an out-of-memory error while packed: the job runs alone (no cap). At the head of the line
    it has a device set aside until that device is empty; meanwhile small jobs fill the other.

    Mutations caught: an unpredicted job packed with a cap of 0; a job marked alone after an
    OOM packed again; a 2-device job given one device.
    """
    big = job(None, jid=10)
    plan = plan_pack([big], gpus(80), RULES, None, 0.0)
    assert [(s.job.id, s.cap) for s in plan.start] == [(10, None)]
    assert "no memory prediction" in plan.alone[10]
    huge = job(79, jid=11)  # 79 x 1.1 > 80
    assert plan_pack([huge], gpus(80), RULES, None, 0.0).start[0].cap is None
    oomed = job(5, alone=True, jid=12)
    plan = plan_pack([oomed], gpus(80), RULES, None, 0.0)
    assert plan.start[0].cap is None and "out of memory" in plan.alone[12]
    # GPU 0 busy with a packed job, GPU 1 empty: the alone job takes GPU 1 at once
    busy = gpus(80, 80)
    busy[0].residents.append(Resident(1, 20 * GiB))
    plan = plan_pack([big, job(5, jid=13)], busy, RULES, None, 0.0)
    assert started(plan) == [("j10", [1]), ("j13", [0])]
    # both busy: GPU 1 (fewer jobs) is set aside for it; small jobs still go to GPU 0
    busy[1].residents.append(Resident(2, 10 * GiB))
    busy[0].residents.append(Resident(3, 10 * GiB))
    plan = plan_pack([big, job(5, jid=14)], busy, RULES, None, 0.0)
    assert plan.drained == [(1, 10)] and started(plan) == [("j14", [0])]
    # a 2-device job needs two empty devices; 3 devices on a 2-device runner is impossible
    wide = job(5, devices=2, jid=15)
    plan = plan_pack([wide], gpus(80, 80), RULES, None, 0.0)
    assert started(plan) == [("j15", [0, 1])] and plan.start[0].cap is None
    wider = job(5, devices=3, jid=16)
    assert plan_pack([wider], gpus(80, 80), RULES, None, 0.0).impossible == [(wider.job, 3)]


def test_backfill_fills_idle_room_and_gives_it_back() -> None:
    """A backfill job starts only where no other job wants room; when a normal job needs that
    room, the plan stops the backfill job (once: a job already stopping is not asked again) and
    the normal job starts only after it has gone. At the deadline nothing starts, backfill
    included; before it, a normal job that would end too late is deferred while backfill runs.

    Mutations caught: backfill started before normal jobs (it takes the room first); the normal
    job started beside a backfill job that does not leave it room (over-subscription); a
    second SIGTERM for a job already stopping (it would exit without a checkpoint).
    """
    bf = job(30, backfill=True, jid=20)
    normal = job(30, jid=21)
    plan = plan_pack([bf, normal], gpus(40), RULES, None, 0.0)
    assert started(plan) == [("j21", [0])]  # normal first, and no room left for the backfill
    plan = plan_pack([bf], gpus(40), RULES, None, 0.0)
    assert started(plan) == [("j20", [0])]
    running = gpus(40)
    running[0].residents.append(Resident(20, plan.start[0].reserved, backfill=True))
    plan = plan_pack([normal], running, RULES, None, 0.0)
    assert plan.start == [] and plan.preempt == [(20, 21)]
    plan = plan_pack([normal], running, RULES, None, 0.0, preempting={20})
    assert plan.start == [] and plan.preempt == []  # asked already; waits for it to exit
    # a small normal job fits beside the backfill job: nothing is stopped
    plan = plan_pack([job(2, jid=22)], running, RULES, None, 0.0)
    assert started(plan) == [("j22", [0])] and plan.preempt == []
    # --until: the long normal job is deferred, backfill fills the night; at the deadline, none
    long_ = Candidate(job(10, jid=23).job, 7200.0, 10 * GiB)
    plan = plan_pack([long_, bf], gpus(40), RULES, 3600.0, 0.0)
    assert [j.id for j, _ in plan.deferred] == [23] and started(plan) == [("j20", [0])]
    assert plan_pack([bf], gpus(40), RULES, 3600.0, 3600.0).start == []


def test_version_1_queue_is_upgraded_in_place(tmp_path: Path) -> None:
    """A queue written before packing existed (schema 1: no packing columns) opens, keeps its
    jobs and gains the columns with their defaults; a second open changes nothing.

    Mutations caught: the opening check requiring the new columns (a v1 queue refused as
    damaged); the upgrade forgetting the version (every open rewrites it)."""
    from nanolab.queue.db import SCHEMA, V2_COLUMNS

    v1 = "\n".join(
        line for line in SCHEMA.splitlines() if line.strip().split(" ")[0] not in V2_COLUMNS
    ).replace("log TEXT,", "log TEXT")
    path = tmp_path / "q.db"
    conn = sqlite3.connect(path)
    conn.executescript(v1)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    conn.execute(
        "INSERT INTO jobs(name, config, args, cwd, run_dir, created, status) "
        "VALUES ('old', 'c.yaml', '[]', '/', '/r/old', 0, 'done')"
    )
    conn.commit()
    assert "mem_peak" not in {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
    conn.close()
    (old,) = QueueDB(path).jobs()
    assert (old.name, old.status, old.backfill, old.alone, old.mem_peak) == (
        "old",
        "done",
        0,
        0,
        None,
    )
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        str(SCHEMA_VERSION),
    )
    assert set(V2_COLUMNS) <= {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
    conn.close()
    assert [j.name for j in QueueDB(path).jobs()] == ["old"]


# -- real processes on the CPU ----------------------------------------------------------------
PROBE_ENV = ["NANOLAB_QUEUE_PACKED", "NANOLAB_QUEUE_MEMORY_FRACTION", "TORCHINDUCTOR_CACHE_DIR"]


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    for name in PROBE_ENV:
        env.pop(name, None)  # what a job sees must come from the runner
    return env


def _span(run_dir: Path) -> tuple[float, float]:
    records = read_records(run_dir / "metrics.jsonl")
    return records[0]["time"], read_records(run_dir / "metrics.jsonl", "end")[-1]["time"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packed_cpu_jobs_share_and_an_out_of_memory_job_runs_again_alone(
    tmp_path: Path, char_dataset: Path, monkeypatch, capsys
) -> None:
    """``queue run --pack --device-mem`` with room for two: jobs A and B run at the same time
    (overlapping spans in their run logs), ``queue ls`` shows them sharing the CPU while they
    do, and C, which does not fit, waits. A raises PyTorch's out-of-memory error in its packed
    attempt (a probe: a CPU has no allocator cap to hit): the runner puts it back marked
    ``alone``; it is next in line, so C still waits; A starts again alone once B is done,
    resumes from its checkpoint, and finishes; then C runs. Each packed attempt got the cap
    variable and the shared compile cache through the launcher.

    Mutations caught: reservations not summed (C starts with A and B); the OOM marked failed
    (A never finishes); the re-queued job packed again (it OOMs forever); the head rule off (C
    starts beside B while A waits to run alone); ls without the sharing column.
    """
    monkeypatch.chdir(tmp_path)
    probe = {"class_path": "cli_probes.EnvProbe", "init_args": {"names": PROBE_ENV}}
    oom = {"class_path": "queue_probes.OutOfMemoryWhenPacked", "init_args": {"step": 4}}
    configs = {}
    # B outlives A's step 4 by far, whatever each process's start-up costs on a busy machine:
    # A's out-of-memory error must come while B still shares the device (12 steps of B left
    # it to chance: when B ended first, C rightly started beside A's first attempt).
    for name, callbacks, steps in (("a", [probe, oom], 12), ("b", [probe], 60), ("c", [probe], 12)):
        cfg = tiny_overrides(
            char_dataset, tmp_path / "runs", trainer__max_steps=steps, trainer__accelerator="cpu"
        )
        del cfg["run"]["name"]
        cfg["checkpoint"] = {"every_n_steps": 2}
        cfg["trainer"]["callbacks"] = callbacks
        configs[name] = write_config(tmp_path / f"{name}.yaml", cfg)
    db = tmp_path / "q.db"
    for name, path in configs.items():
        assert main(["add", str(path), "--db", str(db), "--name", name]) == 0
    peak = QueueDB(db).jobs()[0].mem_peak
    assert peak and 0 < peak < 64 * 1024**2  # the estimator's figure for a tiny model
    # room for two processes (512 MiB overhead each + peak + 10%), not three
    device = 2 * (512 * 1024**2 + int(peak * 1.1) + 1) + 64 * 1024**2
    out = tmp_path / "runner.out"
    runner = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db), "--pack",
         "--device-mem", str(device)],
        cwd=tmp_path, env=_env(tmp_path), stdout=out.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    shared = None
    deadline = time.monotonic() + 300
    while runner.poll() is None and time.monotonic() < deadline:
        capsys.readouterr()
        assert main(["ls", "--db", str(db), "--json"]) == 0
        rows = {j["name"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
        if shared is None and rows["a"]["status"] == rows["b"]["status"] == "running":
            shared = rows
            assert main(["ls", "--db", str(db)]) == 0
            table = capsys.readouterr().out
        time.sleep(0.2)
    assert runner.wait(timeout=300) == 0, out.read_text()[-3000:]
    text = out.read_text()
    assert shared is not None, text
    assert shared["a"]["shares_with"] == [shared["b"]["id"]]
    assert shared["a"]["packed_on"] == "cpu" and shared["c"]["status"] == "pending"
    assert f"cpu with {shared['b']['id']}" in table and f"cpu with {shared['a']['id']}" in table

    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert {n: (j.status, j.attempts) for n, j in jobs.items()} == {
        "a": ("done", 2), "b": ("done", 1), "c": ("done", 1)
    }, text  # fmt: skip
    assert jobs["a"].alone == 1 and "out of memory sharing cpu" in text
    assert "runs alone (ran out of memory while sharing a device)" in text
    runs = tmp_path / "runs"
    (a0, a1), (b0, b1), (c0, _) = (_span(runs / n) for n in "abc")
    assert a0 < b1 and b0 < a1  # A's first attempt and B overlapped
    assert c0 > b1  # C never started beside B: the re-queued A was next in line
    a_end = read_records(runs / "a" / "metrics.jsonl", "end")
    assert [e["reason"] for e in a_end][-1] == "completed"
    resumed = read_records(runs / "a" / "metrics.jsonl", "start")[-1]
    a_train = read_records(runs / "a" / "metrics.jsonl", "train")
    steps = [r["step"] for r in a_train if r["time"] >= resumed["time"]]
    assert steps[0] == 5 and steps[-1] == 12, steps  # resumed after the step-4 checkpoint
    assert c0 > read_records(runs / "a" / "metrics.jsonl", "end")[-1]["time"] - 1.0
    attempts = [json.loads(p.read_text()) for p in sorted((runs / "a").glob("env-*.json"))]
    packed = [s for s in attempts if s["NANOLAB_QUEUE_PACKED"] == "cpu"]
    alone = [s for s in attempts if s["NANOLAB_QUEUE_PACKED"] is None]
    assert len(packed) == 1 and len(alone) == 1, attempts
    assert float(packed[0]["NANOLAB_QUEUE_MEMORY_FRACTION"]) > 0
    assert alone[0]["NANOLAB_QUEUE_MEMORY_FRACTION"] is None
    assert packed[0]["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "nanolab_queue_cache" / "inductor"
    )
    assert "no GPU visible: no allocator cap" in Path(jobs["b"].log).read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_the_allocator_cap_is_real_on_a_gpu(tmp_path: Path) -> None:
    """On a GPU, the launcher's cap makes an allocation beyond it fail in that process with
    PyTorch's out-of-memory error, while one within it succeeds."""
    code = (
        "import torch\n"
        "from nanolab.queue.launch import apply_memory_cap\n"
        "print(apply_memory_cap(0.05))\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "x = torch.empty(int(total * 0.02), dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    y = torch.empty(int(total * 0.10), dtype=torch.uint8, device='cuda')\n"
        "    print('NO-OOM')\n"
        "except torch.OutOfMemoryError as err:\n"
        "    print('OOM', str(err).splitlines()[0][:80])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "allocator capped at 0.0500" in res.stdout and "\nOOM " in res.stdout, res.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pack", "--device-mem", "12XB"], "--device-mem '12XB': cannot read a memory size"),
        (["--device-mem", "80GiB"], "--device-mem is for --pack"),
        (["--pack", "--pack-margin", "2"], "--pack-margin must be between 0 and 1"),
        (["--pack", "--slots", "2"], "--pack decides how many jobs share"),
    ],
)
def test_pack_options_are_checked_before_anything_runs(tmp_path, capsys, args, message) -> None:
    """Bad ``queue run`` packing options: one line naming the option, exit 2, and the queue
    database is not even opened (not created here)."""
    db = tmp_path / "q.db"
    code = main(["run", "--db", str(db), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("nanolab queue run: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not db.exists()


#: A stand-in for the GPU memory program: the bytes it prints say which device it was shown
#: ((id + 1) GiB), and only when both vendors' masks name that one device.
ONE_GPU_SEEN = (
    "import os; c, h = os.environ['CUDA_VISIBLE_DEVICES'], os.environ['HIP_VISIBLE_DEVICES']; "
    "print((int(c) + 1) * 2**30 if c == h else 'both masks differ')"
)


def test_a_packed_gpu_runner_reads_each_gpu_s_memory_in_a_child_that_sees_only_it(
    tmp_path: Path,
) -> None:
    """The CPU twin of ``queue run --pack --gpus 0,3``: the runner's own GPU path (the backend
    pick, one child per GPU id under that id's masks, its sizes said after the runner's line)
    with only the child's program replaced, and the real program's failure on a CPU-only torch
    as the one-line refusal a GPU machine with a broken driver gives.

    Mutations caught: the masks not set per id (both GPUs read the same size); the sizes said
    before the runner's line; the child's error raised as it is."""
    import functools
    import io

    from nanolab.queue.db import QueueError
    from nanolab.queue.runner import Runner, gpu_total_memory

    out = io.StringIO()
    read = functools.partial(gpu_total_memory, program=ONE_GPU_SEEN)
    runner = Runner(QueueDB(tmp_path / "q.db"), gpus=["0", "3"], pack=True, read_gpu_memory=read,
                    out=out, poll_s=0.05)  # fmt: skip
    assert runner.run() == 0
    lines = out.getvalue().splitlines()
    assert "on GPUs 0,3, packed by memory" in lines[0], lines
    assert "GPU 0: 1.00 GiB (reported by the device)" in lines[1], lines
    assert "GPU 3: 4.00 GiB (reported by the device)" in lines[2], lines
    assert "per-process overhead (rocm)" in lines[1] or "per-process overhead (cuda)" in lines[1]
    assert runner._capacity == [GiB, 4 * GiB]
    if not torch.cuda.is_available():
        with pytest.raises(QueueError) as err:
            gpu_total_memory("0")  # the program a GPU machine runs
        assert str(err.value).startswith("--pack: GPU 0's memory could not be read (")
        assert "pass --device-mem SIZE" in str(err.value) and "\n" not in str(err.value)


#: A child that names the GPU it sees: id 5 an H200, any other a device no table knows.
NAMED_GPU = (
    "import os; c, h = os.environ['CUDA_VISIBLE_DEVICES'], os.environ['HIP_VISIBLE_DEVICES']; "
    "print(('NVIDIA H200' if c == '5' else 'Some Future Accelerator') if c == h else '')"
)


def test_until_times_a_job_queue_add_could_not_for_the_gpu_the_runner_gives_it(
    tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU twin of ``queue run --gpus 5 --until``: a GPU job added where no GPU was
    visible (``~?``) was held back every night, its line telling the user to "pass --gpu NAME",
    an option ``queue run`` does not have. The runner now times it for the GPU it would give
    it (its name read in a child that sees only that id); one it still cannot time is held
    back with a fix that exists.

    Mutations caught: the untimed job deferred without timing it again; the GPU's name not read
    for the runner's own id; the deferral naming ``(pass --gpu NAME)``."""
    import functools
    import io

    from nanolab.queue.runner import Runner, gpu_device_name

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("nanolab.estimator.runtime._gpu_name", lambda: None)  # no GPU at add
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__accelerator="gpu")
    db = tmp_path / "q.db"
    assert main(["add", str(write_config(tmp_path / "gpu.yaml", cfg)), "--db", str(db)]) == 0
    (added,) = QueueDB(db).jobs()
    assert added.estimate_s is None and "no GPU here" in (added.estimate_source or "")

    def night(gpu_id: str) -> str:
        out = io.StringIO()
        read = functools.partial(gpu_device_name, program=NAMED_GPU)
        until = time.time() + 1  # too short for any job: the line says what it was told
        runner = Runner(QueueDB(db), gpus=[gpu_id], until=until, read_gpu_name=read, out=out,
                        poll_s=0.05)  # fmt: skip
        assert runner.run() == 0
        (line,) = [x for x in out.getvalue().splitlines() if "deferred" in x]
        return line

    line = night("5")  # timed for the H200 it would run on: held back by its time, not as ~?
    assert "job 1 gpu: deferred, needs ~" in line and "unknown" not in line, line
    line = night("7")  # a device the estimator does not know: still untimed
    assert (
        "its time is unknown (no estimate: GPU 7 is a Some Future Accelerator, not in the table)"
        in line
        and "pass --gpu NAME" not in line
    ), line
    assert line.endswith("run it without --until, or add it again with "
                         "`nanolab queue add --gpu NAME ...`"), line  # fmt: skip
    assert QueueDB(db).get(1).status == "pending"
    if not torch.cuda.is_available():
        assert gpu_device_name("0") is None  # the program a GPU machine runs


def test_a_gpu_that_does_not_answer_refuses_the_run_in_one_line_and_leaves_no_runner_row(
    tmp_path: Path,
) -> None:
    """A memory read that hangs (a wedged driver) ends at its timeout as the one-line refusal,
    naming the timeout, before the runner registers: no runner row is left without a stop time
    (``queue status`` would list it as a runner).

    Mutations caught: ``subprocess.TimeoutExpired`` raised as it is (a traceback, exit 1); the
    sizes read after the runner's row is written (the row stays open)."""
    import functools

    from nanolab.errors import report
    from nanolab.queue.db import QueueError
    from nanolab.queue.runner import Runner, gpu_total_memory

    hang = functools.partial(gpu_total_memory, timeout=0.5, program="import time; time.sleep(60)")
    db = QueueDB(tmp_path / "q.db")
    runner = Runner(db, gpus=["0"], pack=True, read_gpu_memory=hang, poll_s=0.05)
    started = time.monotonic()
    with pytest.raises(QueueError) as err:
        runner.run()
    assert time.monotonic() - started < 30
    assert str(err.value) == (
        "--pack: GPU 0's memory could not be read (timed out after 0.5 s); pass --device-mem "
        "SIZE (e.g. 141GiB)"
    )
    assert report("nanolab queue run", err.value) == 2
    assert db.conn.execute("SELECT count(*) FROM runners WHERE stopped IS NULL").fetchone()[0] == 0


def test_until_holds_back_a_job_with_no_time_estimate_as_the_runner_does() -> None:
    """``--until``'s deadline is a promise: a job that cannot be timed (no estimate) was started
    and could run through it. Packed or not, it now waits, as a job too long for the time left
    does; without ``--until`` it starts. Mutation caught: the planners' rules drifting apart."""
    from dataclasses import replace

    from nanolab.queue.runner import plan_starts

    timed, untimed = replace(job(5.0, jid=301), remaining=600.0), job(5.0, jid=302)
    plan = plan_pack([untimed, timed], gpus(80), RULES, 3600.0, 0.0)
    assert started(plan) == [("j301", [0])]
    assert [(j.name, r) for j, r in plan.deferred] == [("j302", None)]
    assert started(plan_pack([untimed], gpus(80), RULES, None, 0.0)) == [("j302", [0])]
    rows = [(untimed.job, None), (timed.job, 600.0)]
    plain = plan_starts(rows, [0, 1], 2, 3600.0, 0.0, gpus=True)
    assert [j.name for j, _, _ in plain.start] == ["j301"] and [
        j.name for j, _ in plain.deferred
    ] == ["j302"]
