"""The estimator's on-disk memory of model facts: same answers, no torch on a warm launch, and
never a stale or foreign answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanolab.estimator import facts_cache
from nanolab.model.config import GPTConfig

REPO = Path(__file__).resolve().parents[1]

# `nanolab estimate`, then whether torch was imported, on stderr's last line.
PROBE = (
    "import sys; from nanolab.cli import main; rc = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)"
)


def _estimate(cache: str, *args: str, config: str = "gpt2-124m.yaml") -> tuple[str, bool]:
    argv = ["estimate", "--config", str(REPO / "configs" / config), *args]
    # HOME beside the cache: a cold estimate reads the config with fit's parser (Lightning,
    # which leaves matplotlib's font cache in the home folder)
    env = {
        "NANOLAB_ESTIMATOR_CACHE": cache,
        "PATH": "/usr/bin:/bin",
        "HOME": str(Path(cache).parent),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr.strip().splitlines()[-1] == "torch imported: True"


def test_a_warm_estimate_gives_the_same_answer_without_importing_torch(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    cold, cold_torch = _estimate(cache, "--json")
    warm, warm_torch = _estimate(cache, "--json")
    assert cold_torch and not warm_torch
    assert json.loads(warm) == json.loads(cold)
    assert {p.name.split("-")[0] for p in Path(cache).iterdir()} == {
        "inventory", "flops", "flops_difference", "matches_rules",
        "fit",  # fit's keys and their types: the config is read as fit reads it
    }  # fmt: skip
    # A damaged file is recomputed (torch again), with the same answer, and repaired.
    for path in Path(cache).glob("inventory-*.json"):
        path.write_text("{not json")
    again, again_torch = _estimate(cache, "--json")
    assert again_torch and json.loads(again) == json.loads(cold)
    assert not _estimate(cache, "--json")[1]


def test_a_warm_cpu_estimate_divides_by_the_remembered_rates_without_importing_torch(
    tmp_path: Path,
) -> None:
    """A CPU run's estimate (the quickstart's trainer.accelerator: cpu): the first launch probes
    this machine's matmul rates (torch) and remembers them; the next one reads them, and the
    model's facts, from disk, so it imports no torch and divides by the same rate."""
    cache = str(tmp_path / "cache")
    args = ("--vocab-size", "65", "--json")
    cold, cold_torch = _estimate(cache, *args, config="quickstart.yaml")
    warm, warm_torch = _estimate(cache, *args, config="quickstart.yaml")
    assert cold_torch and not warm_torch
    assert json.loads(cold)["device"]["gpu"] == json.loads(warm)["device"]["gpu"] == "cpu"
    rates = [json.loads(out)["device"]["peak_tflops"] for out in (cold, warm)]
    assert rates[0] == rates[1] and rates[0]["fp32"] > 0


@pytest.fixture
def fresh_process_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As in a launch that loads the model code itself, with the cache in ``tmp_path``."""
    monkeypatch.setattr(facts_cache._State, "pristine", True)
    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    return tmp_path


def _counting(value: object) -> tuple[list[int], object]:
    calls: list[int] = []

    def answer() -> object:
        calls.append(1)
        return value

    return calls, answer


def test_answers_are_keyed_by_question_model_and_code(
    fresh_process_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=64, block_size=32)
    calls, answer = _counting(7)
    assert facts_cache.remembered("fact", gpt, 1, answer) == 7
    assert facts_cache.remembered("fact", gpt, 1, answer) == 7
    assert len(calls) == 1
    facts_cache.remembered("fact", gpt, 2, answer)  # another question
    facts_cache.remembered("fact", GPTConfig(**{**gpt.to_dict(), "n_layer": 3}), 1, answer)
    assert len(calls) == 3
    # Edited model or estimator code (or another torch) is another fingerprint: recomputed.
    monkeypatch.setattr(facts_cache, "code_fingerprint", lambda: "edited")
    facts_cache.remembered("fact", gpt, 1, answer)
    assert len(calls) == 4


def test_a_projects_own_variant_is_never_remembered(fresh_process_state: Path) -> None:
    from nanolab.model.registry import NORMS

    class OwnNorm:  # stands in for a project's registered class: only its name matters here
        __module__ = "myproject.layers"

    NORMS._classes["test_cache_own_norm"] = OwnNorm
    try:
        gpt = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=64, norm="test_cache_own_norm")
        calls, answer = _counting(1)
        facts_cache.remembered("fact", gpt, None, answer)
        facts_cache.remembered("fact", gpt, None, answer)
        assert len(calls) == 2 and not any(fresh_process_state.iterdir())
    finally:
        del NORMS._classes["test_cache_own_norm"]


def test_a_process_that_loaded_the_model_itself_reads_the_live_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A notebook or test may have patched a model class: no cached answer may hide that."""
    monkeypatch.setattr(facts_cache._State, "pristine", False)
    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    gpt = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=64)
    calls, answer = _counting(1)
    facts_cache.remembered("fact", gpt, None, answer)
    facts_cache.remembered("fact", gpt, None, answer)
    assert len(calls) == 2 and not any(tmp_path.iterdir())


def test_the_cache_can_be_turned_off(fresh_process_state: Path, monkeypatch) -> None:
    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", "0")
    gpt = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=64)
    calls, answer = _counting(1)
    facts_cache.remembered("fact", gpt, None, answer)
    facts_cache.remembered("fact", gpt, None, answer)
    assert len(calls) == 2 and not any(fresh_process_state.iterdir())
