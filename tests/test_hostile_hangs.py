"""Inputs that used to hang a command, or end it in a traceback: each now ends within a bounded
time, with one error line and exit 2 (or the exit a signal asks for).

End to end where the behaviour is the CLI's (a real process, a wall-clock bound); in-process
where a unit says it faster.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import run_nanolab, tiny_overrides, write_config

from nanolab.model.config import MAX_LAYERS, ConfigError, GPTConfig


def one_error_line(stderr: str, prog: str) -> str:
    """The single ``<prog>: error: ...`` line of ``stderr`` (and nothing that looks like a
    traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# -- 1. an absurd depth is refused by arithmetic, before any block is built -----------------
def test_depth_beyond_the_cap_is_refused_by_the_config() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"model.gpt.n_layer 1,000,000,000 .*at most 4096"):
        GPTConfig(n_layer=1_000_000_000)
    assert time.monotonic() - start < 0.5
    GPTConfig(n_layer=MAX_LAYERS, n_head=1, n_embd=8)  # the cap itself is a model


def test_host_memory_check_refuses_by_arithmetic_without_building(
    monkeypatch: pytest.MonkeyPatch, char_dataset: Path, tmp_path: Path
) -> None:
    from nanolab.estimator import shapes
    from nanolab.run import autobatch

    def never(*args: object) -> None:
        raise AssertionError("the meta model was built")

    monkeypatch.setattr(shapes, "meta_model", never)
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: 2**30)
    cfg = tiny_overrides(char_dataset, tmp_path, model__gpt__n_layer=4000)
    cfg["model"]["gpt"].update(n_embd=100_000, n_head=1, vocab_size=65)
    with pytest.raises(autobatch.HostMemoryError, match=r"needs at least .* GiB"):
        autobatch.check_fits_on_host(cfg)


@pytest.mark.parametrize("verb", ["fit", "estimate", "queue add"])
def test_a_billion_layers_is_one_line_within_seconds(
    verb: str, char_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", model__gpt__n_layer=1_000_000_000)
    config = write_config(tmp_path / "deep.yaml", cfg)
    args = {
        "fit": ["fit", "--config", str(config)],
        "estimate": ["estimate", "--config", str(config)],
        "queue add": ["queue", "add", "--db", str(tmp_path / "q.db"), str(config)],
    }[verb]
    start = time.monotonic()
    out = run_nanolab(*args, cwd=tmp_path, timeout=90)
    assert out.returncode == 2, out.stderr
    assert "model.gpt.n_layer 1,000,000,000" in one_error_line(out.stderr, f"nanolab {verb}")
    assert time.monotonic() - start < 60


# -- 2. a YAML alias bomb is refused before any reader expands it -----------------------------
def _alias_bomb(path: Path, levels: int = 9) -> Path:
    """The "billion laughs": each level nine aliases of the one before (9**9 strings)."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    path.write_text("\n".join([*lines, "trainer: {max_steps: 2}", ""]))
    return path


def test_alias_expansion_is_counted_without_expanding(tmp_path: Path) -> None:
    from nanolab.errors import RunConfigError
    from nanolab.training.resolve import check_alias_expansion, load_yaml

    text = _alias_bomb(tmp_path / "b.yaml").read_text()
    start = time.monotonic()
    with pytest.raises(RunConfigError, match=r"^bomb.yaml: its anchors and aliases expand"):
        load_yaml(text, "bomb.yaml")
    assert time.monotonic() - start < 1.0
    check_alias_expansion("base: &b {lr: 1}\nx: *b\ny: *b\n")  # ordinary aliases are fine
    with pytest.raises(RunConfigError, match="aliases expand"):
        check_alias_expansion("a: &a [1, *a]\n")  # a list that contains itself


@pytest.mark.parametrize("verb", ["fit", "estimate", "queue add"])
def test_billion_laughs_is_one_line_naming_the_file(
    verb: str, char_dataset: Path, tmp_path: Path
) -> None:
    bomb = _alias_bomb(tmp_path / "laughs.yaml")
    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    args = {
        "fit": ["fit", "--config", str(base), "--config", str(bomb)],
        "estimate": ["estimate", "--config", str(base), "--config", str(bomb)],
        "queue add": ["queue", "add", "--db", str(tmp_path / "q.db"), str(bomb)],
    }[verb]
    start = time.monotonic()
    out = run_nanolab(*args, cwd=tmp_path, timeout=90)
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr, f"nanolab {verb}")
    assert "laughs.yaml: its anchors and aliases expand" in line
    assert line.count("laughs.yaml") == 1
    assert time.monotonic() - start < 60
