"""Every ``nanolab`` command in a ```bash block of docs/*.md has a plan, and the plan is carried out.

A page's command is either run here for real (in a temporary work directory: ``configs/`` linked,
the tiny prepared dataset, ``runs/`` and the queue database in the directory, and a tiny model
given last as ``--config tiny.yaml`` -- a size override, never a change of what the command
means), run by another test (named, so a reader finds it), or checked by parsing only, with the
reason (it needs a GPU, several nodes, SLURM or Docker). Parse-only means the real parser:
``fit``/``validate``/``test`` print their full config (``--print_config``), ``estimate`` and
``queue add`` run as written (both work on a CPU), ``queue run`` goes through the queue's own
argument parser and checks. A command added to a page later, or changed, has no plan and fails
:func:`test_every_documented_command_has_a_plan` until it gets one. The ``$ nanolab`` transcripts of
console/text blocks likewise: an error line shown on a page is what the command prints.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from conftest import QUICKSTART, REPO, tiny_overrides, write_config

from nanolab.cli import main

DOCS = REPO / "docs"

RUN = "run"  # run for real by this module's test for the page
#: The parser alone, for the reason given (a machine this test does not have).
GPU = "parse only: needs a GPU (configs/gpt2-*.yaml train on accelerator: gpu)"
MULTI_GPU = "parse only: needs several GPUs"
MULTI_NODE = "parse only: needs several nodes (torchrun/deepspeed launchers)"
SLURM = "parse only: needs SLURM (sbatch); the script's fit is run by test_docker.py"
DOCKER = "parse only: needs Docker and a GPU; the fit inside the container is parsed"
QUEUE_GPUS = "parse only: queue run on GPUs (and for hours); the queue's own parser checks it"
NO_PACKAGE = "parse only: the logger's package is not a test dependency"


def elsewhere(test: str) -> str:
    """A plan that names the test which runs the command as written."""
    return f"run by {test}"


#: page -> command (as on the page: continuation lines joined, the comment dropped) -> its plan.
PLANS: dict[str, dict[str, str]] = {
    "configs.md": {
        "nanolab fit --config configs/gpt2-124m.yaml --config configs/gpt2-350m.yaml "
        "--print_config": elsewhere("test_configs_doc.py::test_the_pages_commands_run_as_written"),
        "nanolab estimate --config configs/gpt2-124m.yaml --config configs/gpt2-350m.yaml "
        "--gpu h100": elsewhere("test_configs_doc.py::test_the_pages_commands_run_as_written"),
    },
    "data.md": {
        "nanolab prepare /data/fineweb-edu/sample/10BT/ --tokenizer bpe --bpe-vocab-size 50257 "
        "-o data/fw": elsewhere("test_prepare.py::test_the_docs_prepare_commands_run"),
        "nanolab prepare '/data/dump/*.jsonl.zst' --text-field meta.body --skip-bad "
        "-o data/dump": elsewhere("test_prepare.py::test_the_docs_prepare_commands_run"),
        "nanolab prepare /data/books/ --tokenizer /models/neox/tokenizer.json "
        "-o data/books": elsewhere("test_prepare.py::test_the_docs_prepare_commands_run"),
    },
    "docker.md": {
        'docker run --rm -it --gpus all --shm-size 16g -v "$PWD/runs:/workspace/runs" '
        '-v "$PWD/data:/workspace/data" nanolab:cuda fit --config configs/gpt2-124m.yaml '
        "--config configs/strategy/ddp.yaml": DOCKER,
        "docker run --rm -it --device /dev/kfd --device /dev/dri --group-add video "
        '--group-add "$(getent group render | cut -d: -f3)" --shm-size 16g '
        '-v "$PWD/runs:/workspace/runs" -v "$PWD/data:/workspace/data" nanolab:rocm fit '
        "--config configs/gpt2-124m.yaml --config configs/strategy/ddp.yaml": DOCKER,
        'docker run --rm -v "$PWD/runs:/workspace/runs" -v "$PWD/data:/workspace/data" '
        "nanolab:cpu fit --config configs/quickstart.yaml --trainer.max_steps 20": elsewhere(
            "test_docker.py::test_cpu_image_trains_the_quickstart_into_mounted_folders"
        ),
    },
    "estimate.md": {
        "nanolab estimate --config configs/gpt2-124m.yaml --gpu rtx4070": RUN,
        "nanolab estimate --config configs/gpt2-124m.yaml --config configs/gpt2-774m.yaml "
        "--config configs/strategy/fsdp.yaml --devices 8 --gpu h100": RUN,
        "nanolab estimate --config my.yaml --gpu-mem 12GiB --micro-batch 8 --json": RUN,
        "nanolab estimate --config my.yaml --device cpu --json": RUN,
        "nanolab estimate --config configs/gpt2-124m.yaml --model.gpt.n_layer 6 --gpu rtx4070": RUN,
        "nanolab estimate --list-gpus": RUN,
    },
    "evaluate.md": {
        "nanolab fit --config configs/quickstart.yaml": RUN,
        "nanolab validate --config configs/quickstart.yaml": RUN,
        "nanolab test --config configs/quickstart.yaml --ckpt_path best": RUN,
        "nanolab validate --config configs/quickstart.yaml --ckpt_path none": RUN,
        "nanolab eval runs/quickstart": RUN,
        "nanolab eval runs/quickstart --suite my-suite.yaml": RUN,
        "nanolab eval runs/quickstart --suite eval_bundle": RUN,
        "nanolab lm-eval run --model nanolab --model_args checkpoint=runs/quickstart --tasks "
        "shakespeare_cloze_local --include_path tasks --batch_size 32": RUN,
    },
    "forking.md": {
        "nanolab init my-lm": RUN,
        "nanolab prepare data/text -o data/tokens --tokenizer bpe --bpe-vocab-size 4096": (
            elsewhere("test_fork_story.py::test_the_fork_story")
        ),
        "nanolab fit --config configs/experiment.yaml": (
            elsewhere("test_fork_story.py::test_the_fork_story")
        ),
        "nanolab fit --config configs/quickstart.yaml --model mylab.models.SmoothedGPT "
        "--model.label_smoothing 0.1 --data mylab.data.SubsetData "
        "--data.max_train_tokens 200000 --run.name smoothed": elsewhere(
            "test_plugins.py::test_the_forking_pages_classes_work_with_fit_estimate_and_queue"
        ),
        "nanolab validate --config runs/smoothed/config.yaml": elsewhere(
            "test_plugins.py::test_the_forking_pages_classes_work_with_fit_estimate_and_queue"
        ),
        "nanolab estimate --config runs/smoothed/config.yaml --device cpu": elsewhere(
            "test_plugins.py::test_the_forking_pages_classes_work_with_fit_estimate_and_queue"
        ),
        "nanolab queue add runs/smoothed/config.yaml --name smoothed --seeds 2": elsewhere(
            "test_plugins.py::test_the_forking_pages_classes_work_with_fit_estimate_and_queue"
        ),
        "nanolab fit --config configs/quickstart.yaml --model mylab.models.SmoothedGPT "
        "--model.gpt.attention_variant softcap": elsewhere(
            "test_model_variants.py::test_the_documented_command_trains_and_estimates_the_variant"
        ),
    },
    "guarantees.md": {
        "until nanolab fit --config configs/gpt2-124m.yaml --run.name owt; [ $? -ne 75 ]; "
        "do :; done": GPU,
    },
    "hf.md": {
        "nanolab validate --config configs/finetune-gpt2.yaml": elsewhere(
            "test_hf.py::test_docs_finetune_then_export_then_transformers"
        ),
        "nanolab fit --config configs/finetune-gpt2.yaml": elsewhere(
            "test_hf.py::test_docs_finetune_then_export_then_transformers"
        ),
        "nanolab export --ckpt runs/finetune-gpt2 --format hf -o out/gpt2-shakespeare": elsewhere(
            "test_hf.py::test_docs_finetune_then_export_then_transformers"
        ),
    },
    "loggers.md": {
        "nanolab fit --config configs/quickstart.yaml --run.name qs-csv --logger csv": RUN,
        "nanolab fit --config configs/quickstart.yaml --run.name qs-tb --logger tensorboard": RUN,
        "nanolab fit --config configs/quickstart.yaml --run.name qs-wandb --logger wandb": NO_PACKAGE,
        "nanolab fit --config configs/quickstart.yaml --run.name qs-mlflow --logger mlflow": NO_PACKAGE,
    },
    "optimizers.md": {
        "nanolab fit --config configs/quickstart.yaml --model.optimizer.name muon "
        "--model.optimizer.muon_lr 0.02": elsewhere(
            "test_optim.py::test_docs_commands_and_snippet"
        ),
        "nanolab estimate --config configs/gpt2-124m.yaml --config muon.yaml --gpu H100": (
            elsewhere("test_optim.py::test_docs_commands_and_snippet")
        ),
    },
    "performance.md": {
        "nanolab bench --config configs/quickstart.yaml --steps 150 --warmup 20 --rounds 3": RUN,
    },
    "queue.md": {
        "nanolab queue add configs/quickstart.yaml --name qs60 --seeds 1,2,3 "
        "--set trainer.max_steps=60 --set run.eval_every_steps=20 "
        "--set budget.price_per_gpu_hour=0.05": RUN,
        "nanolab queue add configs/quickstart.yaml --name qs600 --set trainer.max_steps=600": RUN,
        "nanolab queue ls": RUN,
        "nanolab queue run --gpus 0,1,2,3 --until 08:00 --order longest-first": QUEUE_GPUS,
        "nanolab report runs/ --plot loss.png": RUN,
        "nanolab queue add configs/quickstart.yaml --name quickstart --seeds 1,2,3 "
        "--sweep model.optimizer.lr=1e-3,3e-3 --set trainer.max_steps=100 "
        "--set run.eval_every_steps=20 --set checkpoint.every_n_steps=100": elsewhere(
            "test_queue_sweep.py::test_the_sweep_commands_of_docs_queue_md_queue_what_they_say"
        ),
        "nanolab queue add configs/quickstart.yaml --sweep model.optimizer.lr=1e-3,3e-3,1e-2 "
        "--sweep model.gpt.n_layer=4,6 --seeds 1,2": elsewhere(
            "test_queue_sweep.py::test_the_sweep_commands_of_docs_queue_md_queue_what_they_say"
        ),
        "nanolab queue add configs/gpt2-124m.yaml --name s --seeds 1,2,3 "
        "--set trainer.max_steps=2000": RUN,
        "nanolab queue run --gpus 0 --pack": QUEUE_GPUS,
        "nanolab queue run --pack --device-mem 1.1GiB": RUN,
        "nanolab queue add configs/gpt2-124m.yaml configs/gpt2-350m.yaml --name next-size "
        "--backfill": RUN,
        "nanolab queue run --gpus 0,1 --until 08:00": QUEUE_GPUS,
        "nanolab queue add configs/quickstart.yaml --name qs-lr1e-3 --seeds 1,2,3 "
        "--set model.optimizer.lr=1e-3 --set trainer.max_steps=100 --set downstream.suite=null": (
            elsewhere("test_docs_commands.py::test_queue_md_morning")
        ),
        "nanolab queue add configs/quickstart.yaml --name qs-lr3e-3 --seeds 1,2,3 "
        "--set model.optimizer.lr=3e-3 --set trainer.max_steps=100 --set downstream.suite=null": (
            elsewhere("test_docs_commands.py::test_queue_md_morning")
        ),
        'nanolab queue run --notify "./tell.sh queue {reason}: {summary}"': elsewhere(
            "test_docs_commands.py::test_queue_md_morning"
        ),
    },
    "report.md": {
        "nanolab report runs/ --plot loss.png": RUN,
        "nanolab report runs/ --forecast": RUN,
        "nanolab report runs/ --target-loss 1.5 --plot loss.png": RUN,
    },
    "resume.md": {
        "until nanolab fit --config my.yaml --run.name my-run; [ $? -ne 75 ]; do sleep 5; done": (
            RUN
        ),
    },
    "scaling.md": {
        "nanolab fit --config configs/gpt2-124m.yaml --config configs/strategy/ddp.yaml": (
            MULTI_GPU
        ),
        "nanolab fit --config configs/gpt2-124m.yaml --config configs/strategy/ddp.yaml "
        "--trainer.devices 4": MULTI_GPU,
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
        "--rdzv-id gpt2-350m -m nanolab fit --config configs/gpt2-124m.yaml "
        "--config configs/gpt2-350m.yaml --config configs/strategy/fsdp.yaml "
        "--config configs/strategy/multinode.yaml": MULTI_NODE,
        "sbatch scripts/slurm/train.sbatch configs/gpt2-124m.yaml configs/gpt2-350m.yaml "
        "configs/strategy/fsdp.yaml": SLURM,
        "RUN_NAME=774m-zero2 sbatch --nodes 4 --time 12:00:00 scripts/slurm/train.sbatch "
        "configs/gpt2-124m.yaml configs/gpt2-774m.yaml configs/strategy/deepspeed_stage2.yaml": (
            SLURM
        ),
        "deepspeed --num_gpus 8 --no_local_rank --module nanolab fit "
        "--config configs/gpt2-124m.yaml --config configs/gpt2-774m.yaml "
        "--config configs/strategy/deepspeed_stage2.yaml --trainer.devices 8": MULTI_NODE,
        "nanolab report runs/ --scaling --gpu-hours 100": elsewhere(
            "test_scaling_fit.py::test_the_docs_scaling_command_prints_the_pages_fit"
        ),
    },
}

#: The pages this module has a test for (``test_<page>_md``) that runs their RUN commands.
PAGES_RUN_HERE = {
    "estimate.md", "evaluate.md", "forking.md", "loggers.md", "performance.md", "queue.md",
    "report.md", "resume.md",
}  # fmt: skip

#: Words after which ``nanolab`` is the command a line runs.
LAUNCHERS = {"until", "-m", "--module", "exec"}
SBATCH_SCRIPT = "scripts/slurm/train.sbatch"


def page_commands(page: Path) -> list[str]:
    """The page's nanolab command lines, each as one line: ``\\`` continuations joined, a trailing
    ``# comment`` and comment lines dropped, runs of spaces made one."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if line and runs_nanolab(shlex.split(line)):
                found.append(line)
    return found


def runs_nanolab(words: list[str]) -> bool:
    """Whether the shell line runs nanolab (directly, under a launcher, in its Docker image, or
    through the SLURM script) -- not merely names it (``pip install 'nanolab[wandb]'``)."""
    if words[0] == "nanolab" or SBATCH_SCRIPT in words:
        return True
    return any(
        (w == "nanolab" and words[i - 1] in LAUNCHERS)
        or (w.startswith("nanolab:") and words[i - 1] not in ("-t", "--tag"))  # an image run
        for i, w in enumerate(words)
        if i
    )


def nanolab_argv(line: str) -> list[str]:
    """The arguments nanolab itself gets from the line (what follows ``nanolab`` or the image,
    up to the end of the shell command); the SLURM script's configs become fit's ``--config``s."""
    words = shlex.split(line)
    if SBATCH_SCRIPT in words:
        configs = words[words.index(SBATCH_SCRIPT) + 1 :]
        return ["fit", *(a for c in configs for a in ("--config", c))]
    start = next(i for i, w in enumerate(words) if w == "nanolab" or w.startswith("nanolab:"))
    argv = []
    for word in words[start + 1 :]:
        argv.append(word.removesuffix(";"))
        if word.endswith(";"):
            break
    return argv


def test_every_documented_command_has_a_plan() -> None:
    """Each page's commands are exactly the planned ones: a new or changed command fails here,
    listed, until it is run by a test or marked parse-only with a reason."""
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    unplanned = [
        f"docs/{name}: {command}"
        for name in pages
        for command in page_commands(DOCS / name)
        if command not in PLANS.get(name, {})
    ]
    stale = [
        f"docs/{name}: {command}"
        for name, plans in PLANS.items()
        for command in plans
        if not (DOCS / name).exists() or command not in page_commands(DOCS / name)
    ]
    ran = {name for name, plans in PLANS.items() if RUN in plans.values()}
    assert ran <= PAGES_RUN_HERE, f"no test here runs the RUN commands of {ran - PAGES_RUN_HERE}"
    assert not unplanned, "documented commands no test runs or parses:\n" + "\n".join(unplanned)
    assert not stale, "planned commands no longer on their page:\n" + "\n".join(stale)


def test_the_tests_named_as_running_commands_exist() -> None:
    """A plan that names another test names one that exists and reads that page (its file
    mentions the page, or, for the fork story, the init README it shares the commands with)."""
    for name, plans in PLANS.items():
        for command, plan in plans.items():
            if not plan.startswith("run by "):
                continue
            module, test = plan.removeprefix("run by ").split("::")
            source = (REPO / "tests" / module).read_text()
            assert f"def {test}(" in source, f"docs/{name}: {command}: {plan} does not exist"
            if module == "test_fork_story.py":  # nanolab init's README holds the same commands
                readme = (REPO / "nanolab" / "templates" / "init" / "README.md").read_text()
                assert command in readme, (name, command)
            else:
                assert name in source, f"{module} does not read docs/{name}"


# -- running them ---------------------------------------------------------------------------------


def nanolab(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str, str]:
    """One verb in this process (a new process spends most of its time importing torch)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # --print_config exits once it has printed
        code = stop.code if isinstance(stop.code, int) else 1
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


@pytest.fixture
def work(tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project directory: the repository's configs, ``my.yaml`` (a config of one's own)
    and ``tiny.yaml`` (the size override: a 2-layer model on the prepared data, runs/ here), the
    queue database here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NANOLAB_QUEUE_DB", str(tmp_path / "nanolab_queue.db"))
    (tmp_path / "configs").symlink_to(REPO / "configs")
    tiny = tiny_overrides(char_dataset, tmp_path / "runs")
    del tiny["run"]["name"]  # the run keeps the name the page's command gives it
    write_config(tmp_path / "tiny.yaml", tiny)
    mine = yaml.safe_load(QUICKSTART.read_text())
    mine["data"] = {**mine["data"], "dataset_dir": str(char_dataset), "source": None}
    write_config(tmp_path / "my.yaml", mine)
    return tmp_path


def sized(argv: list[str]) -> list[str]:
    """The command with the tiny model given last (fit, validate and test only)."""
    return [*argv, "--config", "tiny.yaml"] if argv[0] in ("fit", "validate", "test") else argv


def parse(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """The command through nanolab's real parser, without training."""
    argv = nanolab_argv(command)
    if argv[0] in ("fit", "validate", "test"):
        code, out, err = nanolab(capsys, [*argv, "--print_config"])
        assert code == 0, f"{command}: {err[-2000:]}"
        assert "\ntrainer:\n" in out, out[-2000:]  # a launcher's warnings may print before it
    elif argv[:2] == ["queue", "run"]:
        import torch

        from nanolab.queue.cli import build_parser, parse_gpus, parse_size, parse_until

        args = build_parser().parse_args(argv[1:])
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # the page's 8-GPU machine
        if args.gpus:
            assert parse_gpus(args.gpus), command
        if args.device_mem:
            assert parse_size(args.device_mem, "--device-mem") > 2**30, command
        if args.until:
            parse_until(args.until)
    else:
        code, _, err = nanolab(capsys, argv)
        assert code == 0, f"{command}: {err[-2000:]}"


def commands(page: str, plan: str | None = None) -> list[str]:
    return [c for c, p in PLANS[page].items() if plan is None or p == plan]


PARSED = [
    page
    for page, plans in PLANS.items()
    if any(p != RUN and not p.startswith("run by ") for p in plans.values())
]


@pytest.mark.parametrize("page", PARSED)
def test_parse_only_commands_parse(work: Path, capsys, monkeypatch, page: str) -> None:
    """The commands this machine cannot run go through the real parser: the configs they name
    compose, every key exists and validates."""
    for command, plan in PLANS[page].items():
        if plan != RUN and not plan.startswith("run by "):
            parse(capsys, monkeypatch, command)


def test_estimate_md(work: Path, capsys) -> None:
    """docs/estimate.md's commands as written (an estimate runs on a CPU)."""
    for command in commands("estimate.md", RUN):
        code, out, err = nanolab(capsys, nanolab_argv(command))
        assert code == 0, f"{command}: {err[-2000:]}"
        if "--json" in command:
            report = json.loads(out)
            assert report["model"]["params"] > 0, command
        elif "--list-gpus" in command:
            assert "rtx4070" in out.lower() and "h100" in out.lower(), out[:500]
        else:
            assert "GiB" in out, out[:500]


def evaluate_md_files(work: Path) -> None:
    """What the page's eval commands name: a suite of one's own, a DCLM bundle folder (its
    layout, with tasks this vocabulary can spell) and the page's lm-eval task YAML."""
    rows = [
        {"context": "ROMEO:", "choices": ["Good night.", "Farewell."], "label": i % 2}
        for i in range(6)
    ]
    (work / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "my-suite.yaml").write_text("- file: mine.jsonl\n  kind: multiple_choice\n")
    bundle = work / "eval_bundle"
    (bundle / "eval_data").mkdir(parents=True)
    mc = [{"query": "Who is there?", "choices": ["Nay, answer me.", "I."], "gold": 0}] * 4
    (bundle / "eval_data" / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (bundle / "core.yaml").write_text(
        "icl_tasks:\n- label: mc\n  dataset_uri: mc.jsonl\n  num_fewshot: [1]\n"
        "  icl_task_type: multiple_choice\n"
    )
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,50\n")
    page = (DOCS / "evaluate.md").read_text()
    task = re.search(r"```yaml\n(# tasks/cloze.yaml.*?)```", page, flags=re.S).group(1)
    shipped = REPO / "nanolab" / "downstream" / "data" / "shakespeare-cloze.jsonl"
    (work / "tasks").mkdir()
    (work / "tasks" / "cloze.yaml").write_text(
        task.replace("nanolab/downstream/data/shakespeare-cloze.jsonl", str(shipped))
    )


def test_evaluate_md(
    work: Path, capsys, monkeypatch: pytest.MonkeyPatch, lm_eval_local_only: None
) -> None:
    """docs/evaluate.md: fit, validate the newest checkpoint, test the best, validate untrained;
    eval the tasks three ways (each logged at the checkpoint's step); lm-eval on a local task."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the page's export
    evaluate_md_files(work)
    records = work / "runs" / "quickstart" / "metrics.jsonl"
    printed = []
    for command in commands("evaluate.md", RUN):
        code, out, err = nanolab(capsys, sized(nanolab_argv(command)))
        assert code == 0, f"{command}: {err[-2000:]}"
        printed.append(out)
    evaluated = [json.loads(line) for line in records.read_text().splitlines()]
    by = [(r["event"], r["evaluated_by"], r["step"]) for r in evaluated if "evaluated_by" in r]
    # validate: the newest checkpoint (step 6); test best: the only validated step; none: the
    # untrained model, printed and not logged; eval: the newest checkpoint, three suites.
    assert by == [
        ("val", "nanolab validate", 6), ("test", "nanolab test", 6),
        *[("tasks", "nanolab eval", 6)] * 3,
    ], by  # fmt: skip
    assert "val_loss" in printed[3] or "val/loss" in printed[3], printed[3][-1000:]
    suites = [r["suite"] for r in evaluated if r.get("event") == "tasks"]
    assert suites == ["builtin:shakespeare", "my-suite.yaml", "eval_bundle"]
    assert evaluated[-1]["tasks/mc/n"] == 4 and "tasks/core" in evaluated[-1]
    assert "shakespeare_cloze_local" in printed[-1] and "acc_norm" in printed[-1]


def test_loggers_md(work: Path, capsys) -> None:
    """docs/loggers.md: the csv and tensorboard runs write where the comments say."""
    pytest.importorskip("tensorboard")
    for command in commands("loggers.md", RUN):
        code, _, err = nanolab(capsys, sized(nanolab_argv(command)))
        assert code == 0, f"{command}: {err[-2000:]}"
    runs = work / "runs"
    assert (runs / "qs-csv" / "csv" / "metrics.csv").stat().st_size > 0
    assert list((runs / "qs-tb" / "tensorboard").rglob("events.out.tfevents.*"))


def test_resume_md(work: Path, capsys) -> None:
    """docs/resume.md's retry loop: its fit, run; exit 0 ends the loop (75 would rerun it;
    resuming after exit 75 is test_resume.py's subject)."""
    (command,) = commands("resume.md", RUN)
    code, _, err = nanolab(capsys, sized(nanolab_argv(command)))
    assert code == 0, f"{command}: {err[-2000:]}"
    assert (work / "runs" / "my-run" / "checkpoints" / "last.ckpt").exists()


def test_forking_md(work: Path, capsys, monkeypatch) -> None:
    """docs/forking.md's ``nanolab init``: the project it writes has the README whose commands the
    page gives next (and test_fork_story.py follows)."""
    (command,) = commands("forking.md", RUN)
    code, _, err = nanolab(capsys, nanolab_argv(command))
    assert code == 0, f"{command}: {err[-2000:]}"
    readme = (work / "my-lm" / "README.md").read_text()
    for later in commands("forking.md"):
        if PLANS["forking.md"][later].startswith("run by test_fork_story.py"):
            assert later in readme, later
    assert (work / "my-lm" / "data" / "text").is_dir()  # where the page says the text goes
    # The fork story runs the project's fit (slow); here its config parses, the project's
    # package importable as `pip install -e .` makes it.
    (fit,) = [
        c for c in commands("forking.md") if c == "nanolab fit --config configs/experiment.yaml"
    ]
    monkeypatch.chdir(work / "my-lm")
    monkeypatch.syspath_prepend(str(work / "my-lm" / "src"))
    try:
        parse(capsys, monkeypatch, fit)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "my_lm"]:
            del sys.modules[name]


@pytest.mark.slow  # two fits and two plain loops in processes of their own: ~60 s on 2 cores
def test_performance_md(work: Path, capsys) -> None:
    """docs/performance.md's bench, shrunk (steps, warmup and rounds; the tiny model given last):
    both sides train and the comparison is printed."""
    (command,) = commands("performance.md", RUN)
    argv = nanolab_argv(command)
    for option, small in (("--steps", "8"), ("--warmup", "2"), ("--rounds", "1")):
        argv[argv.index(option) + 1] = small
    code, out, err = nanolab(capsys, [*argv, "--config", "tiny.yaml", "--json"])
    assert code == 0, f"{command}: {err[-3000:]}"
    report = json.loads(out)
    assert report["rounds"] == 1 and report["nanolab_tokens_per_s"]["median"] > 0


QUEUE_ADDS_AND_LS = [
    c for c in commands("queue.md", RUN) if c.startswith(("nanolab queue add", "nanolab queue ls"))
]


def test_queue_md(work: Path, char_dataset: Path, capsys, monkeypatch) -> None:
    """docs/queue.md's adds and ls as written: each add is parsed with fit's parser and queued
    (the GPT-2 recipes' data/owt is the tiny prepared dataset here)."""
    from nanolab.queue.db import QueueDB

    (work / "data").mkdir()
    (work / "data" / "owt").symlink_to(char_dataset)
    for command in QUEUE_ADDS_AND_LS:
        code, out, err = nanolab(capsys, nanolab_argv(command))
        assert code == 0, f"{command}: {err[-2000:]}"
    names = [job.name for job in QueueDB(work / "nanolab_queue.db").jobs()]
    assert names == [*(f"qs60-s{i}" for i in (1, 2, 3)), "qs600", *(f"s-s{i}" for i in (1, 2, 3)),
                     "next-size"], names  # fmt: skip
    code, out, _ = nanolab(capsys, nanolab_argv("nanolab queue ls"))  # the page's 08:00 ls
    assert code == 0 and "qs60: 3 seeds (1, 2, 3): 3 pending" in out, out
    # The CPU runner the slow night test runs: here its options parse (the queue's own checks).
    for command in [c for c in commands("queue.md", RUN) if c.startswith("nanolab queue run")]:
        parse(capsys, monkeypatch, command)


@pytest.mark.slow  # three tiny 60-step jobs in processes of their own: ~60 s on 2 cores
def test_queue_md_night(work: Path, capsys, monkeypatch) -> None:
    """docs/queue.md's night on a CPU: the page's qs60 add (the tiny model given last), the
    page's ``queue run --pack --device-mem 1.1GiB`` as written, then the report commands of
    docs/queue.md and docs/report.md."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (add,) = [c for c in commands("queue.md") if "qs60" in c.split()]
    argv = nanolab_argv(add)
    argv.insert(argv.index("configs/quickstart.yaml") + 1, "tiny.yaml")
    code, _, err = nanolab(capsys, argv)
    assert code == 0, err[-2000:]
    (run,) = [c for c in commands("queue.md", RUN) if c.startswith("nanolab queue run")]
    code, out, err = nanolab(capsys, nanolab_argv(run))
    assert code == 0, f"{run}: {err[-3000:]}{out[-3000:]}"
    for seed in (1, 2, 3):
        ckpt = work / "runs" / f"qs60-s{seed}" / "checkpoints" / "last.ckpt"
        assert ckpt.exists(), (out + err)[-3000:]
    reports = [*commands("queue.md", RUN), *commands("report.md", RUN)]
    for command in dict.fromkeys(c for c in reports if c.startswith("nanolab report")):
        code, out, err = nanolab(capsys, nanolab_argv(command))
        assert code == 0, f"{command}: {err[-2000:]}"
        assert "qs60" in out, out[-2000:]
    assert (work / "loss.png").stat().st_size > 0


@pytest.mark.slow  # six tiny 100-step jobs in processes of their own: ~1 min on 2 cores
def test_queue_md_morning(work: Path, capsys, monkeypatch) -> None:
    """docs/queue.md's night in small as written (the tiny model given last): two adds of 3
    seeds, the queue run with its --notify, then the morning's status and report."""
    import subprocess

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (work / "tell.sh").write_text('#!/bin/sh\necho "$(date +%H:%M:%S) $*" >> night.log\n')
    (work / "tell.sh").chmod(0o755)
    page = commands("queue.md")
    adds = [c for c in page if c.startswith("nanolab queue add") and "qs-lr" in c]
    (run,) = [c for c in page if c.startswith("nanolab queue run --notify")]
    assert len(adds) == 2
    for add in adds:
        argv = nanolab_argv(add)
        argv.insert(argv.index("configs/quickstart.yaml") + 1, "tiny.yaml")
        code, _, err = nanolab(capsys, argv)
        assert code == 0, err[-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "nanolab", *nanolab_argv(run)], cwd=work, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "night.log").read_text().split(" ", 1)[1] == "queue drained: 6 done\n"
    code, out, _ = nanolab(capsys, ["status"])
    assert code == 0 and "ended (6)" in out and "queued (0;" in out, out
    code, out, _ = nanolab(capsys, ["report", "runs/"])
    assert code == 0 and "differences (Welch's t-test over seeds" in out, out
    assert ("is lower than" in out) or ("not distinguishable from seed noise" in out)
    assert len((work / "runs" / "results.log").read_text().splitlines()) == 6


def test_callbacks_md_queries(work: Path, capsys) -> None:
    """docs/callbacks.md's metrics.jsonl queries (grep/jq, no nanolab command), on a real run of
    the quickstart (tiny model, 50 steps so the every-50-steps query has a row): each prints,
    and the final-loss one prints the last train record's loss."""
    import shutil
    import subprocess

    if shutil.which("jq") is None:
        pytest.skip("jq is not installed")
    argv = ["fit", "--config", "configs/quickstart.yaml", "--config", "tiny.yaml"]
    code, _, err = nanolab(capsys, [*argv, "--trainer.max_steps=50", "--run.eval_every_steps=25"])
    assert code == 0, err[-2000:]
    page = (DOCS / "callbacks.md").read_text()
    (block,) = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    setting, *queries = block.strip().splitlines()
    assert setting == "L=runs/quickstart/metrics.jsonl", setting
    printed = []
    for query in queries:
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {setting}; {query}"],
            capture_output=True, text=True, cwd=work, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip(), f"{query}: {done.stderr}"
        printed.append(done.stdout)
    records = (work / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(r) for r in records if '"event":"train"' in r][-1]
    assert float(printed[1]) == pytest.approx(last["loss"]), printed[1]
    assert json.loads(printed[0])["step"] == last["step"] == 50


# -- transcripts: ```console / ```text blocks that show a command and what it printed ------------

RECORDED = "recorded output of a real run (times, losses, pids vary): shown, not compared"

#: page -> transcript command (after ``$ ``, comment dropped) -> (plan, for a plan naming another
#: test: a piece of the page's line that test asserts).
TRANSCRIPTS: dict[str, dict[str, tuple[str, str | None]]] = {
    "evaluate.md": {
        "nanolab validate --config configs/quickstart.yaml --run.name never-trained": (RUN, None),
    },
    "guarantees.md": {
        "nanolab fit --config configs/quickstart.yaml": (
            elsewhere(
                "test_adversarial.py::"
                "test_second_launch_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over"
            ),
            "in use by pid",
        ),
    },
    "loggers.md": {
        "nanolab fit --config configs/quickstart.yaml --logger wandb": (
            elsewhere(
                "test_loggers.py::test_a_missing_logger_package_is_one_line_with_the_pip_command"
            ),
            "--logger wandb needs the wandb package, which is not installed: ",
        ),
        "nanolab fit --config configs/quickstart.yaml --trainer.logger csv": (RUN, None),
    },
    "queue.md": {
        "nanolab queue add configs/quickstart.yaml --set model.gpt.n_head=5": (RUN, None),
        "nanolab queue ls": (RECORDED, None),
        "nanolab status": (RECORDED, None),
    },
    "report.md": {
        "nanolab queue ls": (RECORDED, None),
        "nanolab report runs/ --plot docs/queue-report.png": (RECORDED, None),
        "nanolab report runs/ --compare qs-lr1e-3-s2 qs-lr3e-3-s3": (RECORDED, None),
    },
    "tool-errors.md": {
        "nanolab fit --config tiny.yaml --run.root /tmp/mnttest --run.name full "
        "--checkpoint.every_n_steps 2": (
            elsewhere("test_adversarial_tools.py::test_full_disk_during_a_checkpoint"),
            "no space left on device writing",
        ),
    },
}


def page_transcripts(page: Path) -> list[tuple[str, str]]:
    """``(command, the line printed after it)`` for each ``$ nanolab`` line of the page's console
    and text blocks."""
    found = []
    for block in re.findall(r"```(?:console|text)\n(.*?)```", page.read_text(), flags=re.S):
        lines = [*block.splitlines(), ""]
        for line, after in itertools.pairwise(lines):
            if line.startswith("$ nanolab "):
                command = " ".join(re.sub(r"(^|\s)#.*$", "", line[2:]).split())
                found.append((command, after))
    return found


def test_every_transcript_has_a_plan() -> None:
    """Every ``$ nanolab`` transcript is compared here, asserted by a named test, or marked as a
    recorded output; a new one fails, listed."""
    seen = {(p.name, command) for p in DOCS.glob("*.md") for command, _ in page_transcripts(p)}
    planned = {(page, command) for page, plans in TRANSCRIPTS.items() for command in plans}
    assert not seen - planned, "transcripts without a plan:\n" + "\n".join(map(str, seen - planned))
    assert not planned - seen, "planned transcripts no longer on their page:\n" + "\n".join(
        map(str, planned - seen)
    )
    for page, plans in TRANSCRIPTS.items():
        for command, (plan, fragment) in plans.items():
            if plan.startswith("run by "):
                module, test = plan.removeprefix("run by ").split("::")
                source = (REPO / "tests" / module).read_text()
                assert f"def {test}(" in source, f"docs/{page}: {plan} does not exist"
                expected = dict(page_transcripts(DOCS / page))[command]
                assert fragment in expected and fragment in source, (page, command, fragment)


def test_error_transcripts_print_the_pages_line(work: Path, capsys) -> None:
    """The error transcripts run here print, as their last stderr line, the page's line (``...``
    stands for the directory the page leaves out)."""
    for page, plans in TRANSCRIPTS.items():
        shown = dict(page_transcripts(DOCS / page))
        for command in [c for c, (plan, _) in plans.items() if plan == RUN]:
            code, _, err = nanolab(capsys, nanolab_argv(command))
            assert code == 2, f"{command}: {err[-2000:]}"
            pattern = ".*".join(map(re.escape, shown[command].split("...")))
            assert re.fullmatch(pattern, err.strip().splitlines()[-1]), (shown[command], err)


def test_scaling_md_strategy_table_is_what_estimate_says(capsys) -> None:
    """docs/scaling.md's table of model states and largest micro-batch per strategy and size
    (8 RTX 4090s) and its A100 sentence, cell by cell against ``nanolab estimate --json`` as
    the page says to run it: the table went stale once when the recipes turned compile on."""
    page = (DOCS / "scaling.md").read_text()
    sizes = [[], ["configs/gpt2-350m.yaml"], ["configs/gpt2-774m.yaml"]]

    def estimate(size: list[str], strategy: str, gpu: str) -> dict:
        argv = ["estimate", "--config", str(REPO / "configs" / "gpt2-124m.yaml")]
        for extra in [*size, f"configs/strategy/{strategy}.yaml"]:
            argv += ["--config", str(REPO / extra)]
        code, out, err = nanolab(capsys, [*argv, "--gpu", gpu, "--devices", "8", "--json"])
        assert code == 0, err[-2000:]
        return json.loads(out)

    checked = 0
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.match(r"(DDP|ZeRO-\d|FSDP2|ZeRO-3 \+ offload) \(`([\w.]+)\.yaml`\)", cells[0])
        if not name or len(cells) != 4:
            continue
        strategy = name.group(2)
        for cell, size in zip(cells[1:], sizes, strict=True):
            states, micro = re.match(r"([\d.]+) GiB.*· (\d+)$", cell).groups()
            report = estimate(size, strategy, "rtx4090")
            lines = {x["key"]: x["bytes"] for x in report["memory"]["lines"]}
            found = sum(lines.get(k, 0) for k in ("params", "optimizer", "master", "grads"))
            assert f"{found / 2**30:.2f}" == states, (strategy, size, cell)
            assert report["largest_micro_batch"] == int(micro), (strategy, size, cell)
            checked += 1
    assert checked == 18  # six strategies x three sizes
    a100 = re.search(r"On 80 GB\s+A100s, DDP fits micro-batches\s+of (\d+), (\d+) and (\d+)", page)
    assert a100, "the A100 sentence moved"
    assert [estimate(s, "ddp", "a100-80gb")["largest_micro_batch"] for s in sizes] == [
        int(x) for x in a100.groups()
    ]
