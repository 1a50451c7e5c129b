"""``model.gpt.activation``: the MLP's GELU is an explicit choice that travels with the model.

The exact GELU (nanoGPT's) is the CPU quickstart's choice because it is faster there; GPT-2's tanh
approximation stays the default (and what a checkpoint without the field was trained with), and
Hugging Face import/export maps each to transformers' own name.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from nanolab.model import GPT, GPTConfig
from nanolab.model.config import ConfigError, with_defaults
from nanolab.model.hf import architecture_from_hf, hf_config_from_nanolab
from nanolab.training.resume import Candidate, ResumeError, check_same_model

REPO = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 11, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}


def _exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize(("activation", "formula"), [("gelu", _exact), ("gelu_tanh", _tanh)])
def test_mlp_computes_the_chosen_gelu(activation, formula):
    """The MLP's output equals c_proj(formula(c_fc(x))) for the chosen formula, written out here,
    and is measurably away from the other formula's (they differ by up to ~5e-4 near |x| ~ 2)."""
    torch.manual_seed(0)
    mlp = GPT(GPTConfig(**TINY, activation=activation)).blocks[0].mlp
    x = torch.randn(64, 16) * 25  # c_fc's inputs spread over the range where the GELUs differ
    with torch.no_grad():
        hidden = mlp.c_fc(x)
        got = mlp(x)
        want = mlp.c_proj(formula(hidden))
        other = mlp.c_proj((_tanh if formula is _exact else _exact)(hidden))
    assert hidden.abs().max() > 2
    assert (got - want).abs().max() < 1e-6
    assert (got - other).abs().max() > 1e-5


def test_default_is_gpt2s_tanh_gelu_and_a_bad_value_names_the_field():
    assert GPTConfig(**TINY).activation == "gelu_tanh"
    with pytest.raises(ConfigError, match=r"model\.gpt\.activation .*'relu'"):
        GPTConfig(**TINY, activation="relu")


def test_recipes_state_their_gelu():
    """The CPU quickstart uses the exact GELU and no vocabulary padding; the GPT-2 recipes keep
    GPT-2's GELU. Each says so in its YAML rather than relying on a default."""
    quick = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["model"]["gpt"]
    assert (quick["activation"], quick["vocab_multiple"]) == ("gelu", 1)
    base = yaml.safe_load((REPO / "configs" / "gpt2-124m.yaml").read_text())["model"]["gpt"]
    assert base["activation"] == "gelu_tanh"
    for name in ("gpt2-350m", "gpt2-774m"):  # size overlays composed after gpt2-124m.yaml
        gpt = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["model"]["gpt"]
        assert gpt.get("activation", base["activation"]) == "gelu_tanh", name


def test_resuming_a_checkpoint_older_than_the_field_under_another_gelu_is_refused(tmp_path):
    """A checkpoint written before ``activation`` existed was trained with the tanh GELU: resuming
    it with ``activation: gelu`` would change the model mid-run, so it is refused by name; with the
    default it resumes."""
    old = GPTConfig(**TINY).to_dict()
    del old["activation"]  # as written before the field existed
    cand = Candidate(path=tmp_path / "last.ckpt", step=10, nanolab={"gpt": old})
    with pytest.raises(ResumeError, match=r"activation 'gelu_tanh' in the checkpoint vs 'gelu'"):
        check_same_model(cand, GPTConfig(**TINY, activation="gelu").to_dict())
    check_same_model(cand, GPTConfig(**TINY).to_dict())  # no error
    assert with_defaults(old)["activation"] == "gelu_tanh"


@pytest.mark.parametrize(
    ("hf_name", "ours"),
    [("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu")],
)
def test_hf_import_and_export_keep_the_gelu(tmp_path, hf_name, ours):
    """transformers' activation names map to nanolab's and back: an exact-GELU model is never
    exported as a tanh one (its logits would shift)."""
    hf = {"n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 8, "vocab_size": 11}
    arch = architecture_from_hf({**hf, "activation_function": hf_name}, tmp_path)
    assert arch["activation"] == ours
    exported = hf_config_from_nanolab(GPTConfig(**TINY, activation=ours), None, torch.float32, {})
    assert exported["activation_function"] == ("gelu" if ours == "gelu" else "gelu_pytorch_tanh")
    # docs/hf.md says so (it said every export was gelu_pytorch_tanh)
    doc = (Path(__file__).parents[1] / "docs" / "hf.md").read_text()
    assert f"`{exported['activation_function']}` for `{ours}`" in doc


def test_hf_export_with_exact_gelu_matches_transformers(tmp_path):
    """End to end with transformers: an exact-GELU nanolab model exported as ``gelu`` gives the
    same logits in ``GPT2LMHeadModel``."""
    transformers = pytest.importorskip("transformers")
    from nanolab.model.hf import hf_state_from_nanolab

    torch.manual_seed(0)
    cfg = GPTConfig(**TINY, activation="gelu", bias=True)
    ours = GPT(cfg).eval()
    hf_cfg = hf_config_from_nanolab(cfg, None, torch.float32, {})
    hf_cfg.pop("nanolab")
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_cfg)).eval()
    theirs.load_state_dict(hf_state_from_nanolab(ours.state_dict(), cfg), strict=False)
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx)[0] - theirs(idx).logits).abs().max().item()
    assert diff < 1e-5
