"""A branch (a new run from another run's checkpoint) trains with its own optimizer settings and
LR schedule, on the optimizer state it restored: the documented fix for a diverged run (a lower
learning rate from its newest checkpoint that a finite step followed) works, and the lines that
name it give a command that does."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
import torch

from nanolab.training.branch import BranchLR, branch_command, take_branch_settings
from nanolab.training.optim import WarmupCosine


def _adamw_pair(lr: float, weight_decay: float, betas: tuple[float, float], eps: float):
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3))
    opt = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    return param, opt


def test_a_branch_scheduler_takes_the_branchs_settings_after_the_parents_state_loads() -> None:
    """Lightning loads the parent's optimizer state (its ``lr``, ``initial_lr``, betas, weight
    decay, eps in every group) and then the scheduler's (``base_lrs``, the schedule function):
    the branch's own values were lost. The branch's scheduler puts them back after its load,
    and the next step is AdamW's on the restored moments with the branch's settings, computed
    here by hand.

    Mutation caught: a plain ``LambdaLR`` (the parent's rate 0.5, its betas and decay)."""
    parent_param, parent = _adamw_pair(0.5, 0.1, (0.9, 0.95), 1e-8)
    parent_schedule = torch.optim.lr_scheduler.LambdaLR(parent, WarmupCosine(0, 40, 0.1))
    for k in range(3):
        parent_param.grad = torch.full_like(parent_param, 0.1 * (k + 1))
        parent.step()
        parent_schedule.step()
    param, branch = _adamw_pair(1e-3, 0.01, (0.8, 0.9), 1e-6)
    param.data.copy_(parent_param.data)
    schedule = BranchLR(branch, WarmupCosine(2, 8, 0.1))
    branch.load_state_dict(parent.state_dict())
    schedule.load_state_dict(parent_schedule.state_dict())

    group = branch.param_groups[0]
    rate = 1e-3 * WarmupCosine(2, 8, 0.1)(3)
    assert group["lr"] == pytest.approx(rate) and group["initial_lr"] == 1e-3
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.01, (0.8, 0.9), 1e-6)
    assert schedule.base_lrs == [1e-3] and schedule.get_last_lr() == [pytest.approx(rate)]
    assert "branch_settings" not in schedule.state_dict()  # plain data: weights_only loads

    restored = {k: v.clone() for k, v in branch.state[param].items()}
    assert float(restored["step"]) == 3 and restored["exp_avg_sq"].abs().sum() > 0
    before = param.detach().clone()
    grad = torch.full_like(param, -0.2)
    param.grad = grad
    branch.step()
    b1, b2, step = 0.8, 0.9, 4
    m = b1 * restored["exp_avg"] + (1 - b1) * grad
    v = b2 * restored["exp_avg_sq"] + (1 - b2) * grad * grad
    expected = before * (1 - rate * 0.01) - rate / (1 - b1**step) * m / (
        (v / (1 - b2**step)).sqrt() + 1e-6
    )
    assert torch.allclose(param.detach(), expected, rtol=1e-5, atol=1e-7)
    schedule.step()
    assert branch.param_groups[0]["lr"] == pytest.approx(1e-3 * WarmupCosine(2, 8, 0.1)(4))


def test_a_restored_optimizer_with_other_groups_is_refused() -> None:
    _, opt = _adamw_pair(1e-3, 0.1, (0.9, 0.95), 1e-8)
    schedule = BranchLR(opt, WarmupCosine(0, 8, 0.1))
    settings = schedule.branch_settings
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="parameter groups"):
        take_branch_settings(opt, schedule, settings)


def test_the_branch_command_is_the_runs_config_another_name_the_checkpoint_and_the_change() -> None:
    command = branch_command(Path("runs/dv"), "dv", Path("runs/dv/c/step-3.ckpt"),
                             {"model.optimizer.lr": "0.0001"})  # fmt: skip
    assert shlex.split(command) == [
        "nanolab", "fit", "--config", "runs/dv/config.yaml", "--run.name", "dv-lr0.0001",
        "--run.resume", "runs/dv/c/step-3.ckpt", "--model.optimizer.lr", "0.0001",
    ]  # fmt: skip
    assert "--run.resume" not in branch_command("runs/dv", "dv", None, {"model.optimizer.lr": 1})


def test_the_branch_starts_from_the_newest_checkpoint_a_finite_step_followed(tmp_path) -> None:
    """Non-finite from step 5: the weights of step 4 are finite, but its very next forward is
    not, at any learning rate; step 3 is the newest a branch can train on from."""
    from nanolab.callbacks.divergence import branch_start

    for step in (1, 3, 4):
        (tmp_path / f"step-{step:08d}.ckpt").write_bytes(b"x")
    (tmp_path / "last.ckpt").write_bytes(b"x")
    assert branch_start(tmp_path, 5).name == "step-00000003.ckpt"
    assert branch_start(tmp_path, 3).name == "step-00000001.ckpt"
    assert branch_start(tmp_path, 2) is None
    assert branch_start(tmp_path, None).name == "step-00000004.ckpt"
    assert branch_start(tmp_path / "gone", None) is None


def _lrs(log: Path) -> dict[int, tuple[float, float]]:
    from nanolab.runlog import read_records

    return {r["step"]: (r["lr"], r["loss"]) for r in read_records(log, "train")}


def _optimizer_and_weights(path: Path) -> tuple[list[str], dict, dict]:
    """A checkpoint's parameter names in its optimizer's order, its optimizer state by index
    and its weights by name."""
    from nanolab.model import GPT, GPTConfig
    from nanolab.training.optim import parameter_groups

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    gpt = GPT(GPTConfig(**ckpt["nanolab"]["gpt"]))
    names = {id(p): n for n, p in gpt.named_parameters()}
    order = [names[id(p)] for g in parameter_groups(gpt, 0.1) for p in g["params"]]
    return order, ckpt["optimizer_states"][0], ckpt["state_dict"]


def test_the_divergence_fix_is_a_branch_that_trains_at_its_own_rate_on_restored_moments(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The exit-3 line named a fix that could not work: lower the learning rate and resume,
    but a resume, and a new run from the checkpoint too, trained with the checkpoint's rate.
    Now the line names a branch command from the newest checkpoint that a finite step
    followed; run with a lower rate, the branch trains at its own schedule's rates (finite
    losses, exit 0), on the parent's Adam moments: each weight of its first step is AdamW's
    update from the parent's checkpoint, computed here by hand.

    Mutations caught: the checkpoint's lr and schedule kept (lr 100 at the branch's steps, which
    diverges); the moments zeroed (step count 1, another update); the branch named from the
    newest checkpoint (its first forward is not finite)."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    parent = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(cfg), "--run.name", "dv",
        "--model.optimizer.lr", "100", "--model.schedule.warmup_steps", "0",
        "--trainer.max_steps", "30", "--checkpoint.every_n_steps", "1", cwd=tmp_path,
    )  # fmt: skip
    assert parent.returncode == 3, parent.stderr[-2000:]
    line = parent.stderr.strip().splitlines()[-1]
    assert "a resume keeps its model.optimizer.lr 100" in line, line
    command = shlex.split(line.split(": nanolab fit ", 1)[1])
    folder = tmp_path / "runs" / "dv" / "checkpoints"
    start = Path(command[command.index("--run.resume") + 1])
    assert start.parent == folder and start.exists()
    assert command[command.index("--config") + 1] == str(tmp_path / "runs" / "dv" / "config.yaml")
    assert command[command.index("--model.optimizer.lr") + 1] == "10"
    from nanolab.runlog import read_records

    end = read_records(tmp_path / "runs" / "dv" / "metrics.jsonl", "end")[-1]
    parent_step = int(start.stem.split("-")[1])
    assert end["reason"] == "diverged" and parent_step == end["diverged_step"] - 2

    command[command.index("--model.optimizer.lr") + 1] = "0.001"
    branch = nanolab_here("fit", *command, "--trainer.max_steps", str(parent_step + 4),
                          "--checkpoint.keep_last", "10", cwd=tmp_path)  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-2000:]
    said = [x for x in branch.stderr.splitlines() if "this branch trains with" in x]
    assert len(said) == 1 and (
        f"model.optimizer.lr 0.001 from step {parent_step + 1}, after its parent's step "
        f"{parent_step}; its parent's was 100" in said[0]
    )
    assert "resuming keeps" not in branch.stderr
    name = command[command.index("--run.name") + 1]
    run = tmp_path / "runs" / name
    lrs = _lrs(run / "metrics.jsonl")
    plan = WarmupCosine(0, parent_step + 4, 0.1)  # the branch's own cosine, to its own end
    assert sorted(lrs) == list(range(parent_step + 1, parent_step + 5))
    for step, (lr, loss) in lrs.items():
        assert lr == pytest.approx(1e-3 * plan(step - 1)) and math.isfinite(loss)

    order, before, weights = _optimizer_and_weights(start)
    _, after, new_weights = _optimizer_and_weights(
        run / "checkpoints" / f"step-{parent_step + 1:08d}.ckpt"
    )
    (b1, b2), eps, wd = (0.9, 0.99), 1e-8, 0.1  # quickstart's betas, eps and decay
    rate, step = lrs[parent_step + 1][0], parent_step + 1
    for index, param in enumerate(order):
        old, new = before["state"][index], after["state"][index]
        assert float(new["step"]) == step  # the parent's count, one step on
        grad = (new["exp_avg"] - b1 * old["exp_avg"]) / (1 - b1)  # the step's clipped gradient
        assert torch.allclose(new["exp_avg_sq"], b2 * old["exp_avg_sq"] + (1 - b2) * grad**2,
                              rtol=1e-4, atol=1e-6), param  # fmt: skip
        decay = wd if new_weights[f"model.{param}"].dim() >= 2 else 0.0
        expected = weights[f"model.{param}"] * (1 - rate * decay) - rate / (1 - b1**step) * (
            new["exp_avg"] / ((new["exp_avg_sq"] / (1 - b2**step)).sqrt() + eps)
        )
        assert torch.allclose(new_weights[f"model.{param}"], expected, rtol=1e-4, atol=1e-6), param


def test_a_resume_that_keeps_the_rate_names_a_branch_command_that_trains_with_the_new_one(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The resume's warning said "start a new run (another --run.name)", which kept the
    checkpoint's rate too. It names the branch command now, and that command trains with the
    new rate."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "4", cwd=tmp_path).returncode == 0
    resumed = nanolab_here(*base, "--trainer.max_steps", "5", "--model.optimizer.lr", "0.05",
                           cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warned = [x for x in resumed.stderr.splitlines() if "resuming keeps" in x]
    assert len(warned) == 1 and "model.optimizer.lr 0.003 (not 0.05)" in warned[0]
    command = shlex.split(warned[0].split("from this checkpoint: nanolab fit ", 1)[1])
    assert command[command.index("--model.optimizer.lr") + 1] == "0.05"
    assert Path(command[command.index("--run.resume") + 1]).exists()
    branch = nanolab_here("fit", *command, "--trainer.max_steps", "7", cwd=tmp_path)
    assert branch.returncode == 0, branch.stderr[-2000:]
    run = tmp_path / "runs" / command[command.index("--run.name") + 1]
    lrs = _lrs(run / "metrics.jsonl")
    warmup = 50  # quickstart's: the branch is still in its warm-up, at 0.05's
    assert {s: lr for s, (lr, _) in lrs.items()} == {
        s: pytest.approx(0.05 * (s) / (warmup + 1)) for s in (5, 6, 7)
    }
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["nanolab"]
    assert saved["optimizer"]["lr"] == 0.05


def test_a_branch_s_schedule_notes_are_its_own_not_a_resumes(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A branch trains with its own model.schedule, planned as a new run's: its notes said "a
    resume keeps the plan: ... train a new run (run.fresh: true, or another run.name)", false
    for a branch (a new run already, whose own decay_steps or missing end is the cause)."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "4", cwd=tmp_path).returncode == 0
    parent = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    branch = [*base, "--run.resume", str(parent), "--model.schedule.warmup_steps", "1"]
    past = nanolab_here(*branch, "--run.name", "b1", "--trainer.max_steps", "6",
                        "--model.schedule.decay_steps", "2", cwd=tmp_path)  # fmt: skip
    assert past.returncode == 0, past.stderr[-2000:]
    said = past.stdout + past.stderr
    assert "this branch trains with its own model.schedule: for a cosine past this step" in said
    assert "a resume keeps the plan" not in said
    endless = nanolab_here(*branch, "--run.name", "b2", "--trainer.max_steps", "-1",
                           "--budget.max_wall_hours", "0.0003", cwd=tmp_path)  # fmt: skip
    assert endless.returncode == 0, endless.stderr[-2000:]
    said = endless.stdout + endless.stderr
    assert "a resume keeps the plan" not in said and "the LR cosine has no end to plan" in said


def _sharded_folder(folder: Path, kind: str, state: dict) -> Path:
    """A sharded checkpoint folder as its strategy leaves it: FSDP2's distributed save (torch's
    own index and shards, one process) with Lightning's ``meta.pt``; DeepSpeed's
    ``checkpoint/mp_rank_00_model_states.pt``, into which Lightning saves its state."""
    if kind == "fsdp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"state_dict": {"model.w": torch.ones(4, 3)}}, checkpoint_id=folder, no_dist=True)
        torch.save(state, folder / "meta.pt")
    else:
        (folder / "checkpoint").mkdir(parents=True)
        modules = {"module": {"w": torch.ones(4, 3)}, **state}
        torch.save(modules, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    return folder


def test_a_branch_s_line_names_its_first_step_the_one_after_its_parent_s() -> None:
    """A branch from the step-7 checkpoint first trains with its own rate at step 8 (step 7 was
    the parent's, at the parent's rate): the line said "from step 7".

    Mutation caught: the checkpoint's step named as the branch's first."""
    from nanolab.run.compose import branch_settings_line

    line = branch_settings_line([("model.optimizer.lr", 0.001, 0.003)], 7)
    assert line == (
        "nanolab fit: this branch trains with model.optimizer.lr 0.001 from step 8, after its "
        "parent's step 7; its parent's was 0.003 (the optimizer's moments and step counts are "
        "its parent's)"
    )
    assert "after its parent's last step" in branch_settings_line([("x", 1, 2)], None)


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_a_branch_from_a_sharded_folder_says_it_trains_with_its_own_settings(
    tmp_path, capsys, kind
) -> None:
    """A branch from a one-file checkpoint says in one line which optimizer and schedule
    settings it trains with instead of its parent's; from a sharded folder (FSDP2, DeepSpeed)
    it said nothing, although it trains with them the same. A resume from the folder names
    the branch command, as from a file.

    Mutation caught: the folder passed over (no line)."""
    from jsonargparse import Namespace

    from nanolab.model.checkpoint import sharded_kind
    from nanolab.run.compose import keep_checkpoint_settings

    parent = {"name": "adamw", "lr": 0.5, "weight_decay": 0.1}
    state = {"global_step": 10, "nanolab": {"optimizer": parent, "schedule": {"decay_steps": 40}}}
    folder = _sharded_folder(tmp_path / "dv" / "checkpoints" / "step-00000010.ckpt", kind, state)
    assert sharded_kind(folder) == kind

    def config() -> Namespace:
        optimizer = Namespace(name="adamw", lr=0.001, weight_decay=0.1)
        model = Namespace(init_args=Namespace(optimizer=optimizer, schedule=None))
        return Namespace(model=model, data=None, seed_everything=None, run=Namespace(name="b"))

    keep_checkpoint_settings(config(), folder, seeds=False, run_dir=tmp_path / "b")
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "nanolab fit: this branch trains with model.optimizer.lr 0.001 from step 11, after its "
        "parent's step 10; its parent's was 0.5 (the optimizer's moments and step counts are its parent's)"
    ]
    resumed = config()
    keep_checkpoint_settings(resumed, folder, seeds=True, run_dir=tmp_path / "dv")
    said = capsys.readouterr().err
    assert "resuming keeps the checkpoint's model.optimizer.lr 0.5 (not 0.001)" in said
    assert f"--run.resume {folder} --model.optimizer.lr 0.001" in said
    assert resumed.model.init_args.optimizer.lr == 0.5  # config.yaml says what it trains with


def test_a_branch_whose_budget_ends_it_decays_its_cosine_to_where_the_budget_stops_it(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A branch with ``trainer.max_steps -1`` and ``budget.max_tokens`` planned its cosine
    before the parent's step was restored (from step 0: 10 steps of budget ended it at step
    10), so steps 13-22 all trained at the minimum LR while the start record said 22 and the
    banner advised a later decay_steps. Its cosine now ends where the budget stops it: each
    step ``k`` trains at ``lr * f(k - 1)`` of the branch's own warm-up and a cosine to step 22,
    as a branch with ``trainer.max_steps 22`` does."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    parent = nanolab_here(*base, "--trainer.max_steps", "12", "--model.schedule.warmup_steps",
                          "3", cwd=tmp_path)  # fmt: skip
    assert parent.returncode == 0, parent.stderr[-2000:]
    start = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    branch = nanolab_here(*base, "--run.name", "br", "--run.resume", str(start),
                          "--model.schedule.warmup_steps", "3", "--trainer.max_steps", "-1",
                          "--budget.max_tokens", "1280", "--model.optimizer.lr", "2e-3",
                          cwd=tmp_path)  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-2000:]
    said = branch.stdout + branch.stderr
    assert "the LR cosine ends at step 22 (budget.max_tokens)" in said, said
    assert "later model.schedule.decay_steps" not in said
    log = tmp_path / "runs" / "br" / "metrics.jsonl"
    assert read_records(log, "start")[-1]["planned_steps"] == 22
    plan = WarmupCosine(3, 22, 0.1)  # 128 tokens a step: 1280 tokens are 10 steps after 12
    lrs = {step: lr for step, (lr, _) in _lrs(log).items()}
    assert lrs == {k: pytest.approx(2e-3 * plan(k - 1)) for k in range(13, 23)}


def test_a_branch_s_epoch_goes_on_from_its_parent_s_place_in_the_data(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A branch's data order goes on from its parent's position (its step 13 trains the batch
    the parent's step 13 would), but its ``epoch`` restarted at 0, counted from its own tokens.
    It follows the data now: the same epoch at each step as the parent resumed there. Its
    records say which tokens are its own (``run_tokens``: what its GPU-hours paid for; report's
    forecast and scaling fit divided its hours by its parent's tokens too), and its start
    record that it is a branch."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "6", cwd=tmp_path).returncode == 0
    start = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    branch = nanolab_here(*base, "--run.name", "br", "--run.resume", str(start),
                          "--trainer.max_steps", "9", cwd=tmp_path)  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-2000:]
    import json

    split = json.loads((char_dataset / "meta.json").read_text())["train_tokens"]
    per_step = 4 / (((split - 1) // 32 - 1) // 4 * 4)  # 4 of an epoch's windows a step
    parent = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train")
    assert [r["epoch"] for r in parent] == [
        pytest.approx(r["step"] * per_step, abs=1e-4) for r in parent
    ]
    ours = read_records(tmp_path / "runs" / "br" / "metrics.jsonl", "train")
    assert [r["step"] for r in ours] == [7, 8, 9]
    assert [r["epoch"] for r in ours] == [pytest.approx(s * per_step, abs=1e-4) for s in (7, 8, 9)]
    inherited = parent[-1]["tokens"]
    assert [r["run_tokens"] for r in ours] == [r["tokens"] - inherited for r in ours]
    assert [r["run_tokens"] for r in parent] == [r["tokens"] for r in parent]
    end = read_records(tmp_path / "runs" / "br" / "metrics.jsonl", "end")[-1]
    assert end["run_tokens"] == end["tokens"] - inherited > 0
    assert read_records(tmp_path / "runs" / "br" / "metrics.jsonl", "start")[-1]["branched"]
    assert not read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "start")[-1]["branched"]


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_a_diverged_run_s_branch_starts_from_its_sharded_step_folder(tmp_path, kind) -> None:
    """A diverged run whose checkpoints are folders (DeepSpeed, FSDP2's distributed save) said
    "it saved no checkpoint: start a new run" although its step folders were there: only step
    files were looked at. The branch now starts from the newest step folder a finite step
    followed; a folder of a step's name that holds no checkpoint is still passed over.

    Mutation caught: folders left out (no start), or every folder taken (step 4's empty one)."""
    from types import SimpleNamespace

    from nanolab.callbacks.divergence import divergence_fix

    run = tmp_path / "runs" / "dv"
    state = {"global_step": 2}
    step2 = _sharded_folder(run / "checkpoints" / "step-00000002.ckpt", kind, state)
    (run / "checkpoints" / "step-00000004.ckpt").mkdir()  # a folder, but no checkpoint
    _sharded_folder(run / "checkpoints" / "step-00000008.ckpt", kind, {"global_step": 8})
    module = SimpleNamespace(optimizer_config=SimpleNamespace(lr=0.03))
    trainer = SimpleNamespace(default_root_dir=str(run), lightning_module=module)
    said = divergence_fix(trainer, 6)
    assert "it saved no checkpoint" not in said
    assert "from step 2, its newest checkpoint that a finite step followed: " in said
    assert said.endswith(f"--run.resume {step2} --model.optimizer.lr 0.003")
