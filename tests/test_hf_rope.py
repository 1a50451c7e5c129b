"""A Llama folder's RoPE as either transformers spelling writes it (``model.init_from``).

transformers 4 writes a top-level ``rope_theta`` (and ``rope_scaling`` for a scaled RoPE);
transformers 5 writes ``rope_parameters: {"rope_theta": ..., "rope_type": ...}`` and neither
top-level key. The folders here are written by hand (config.json and a ``pytorch_model.bin``),
so these run without transformers; one more check saves through transformers 5 when it is here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nanolab.model import GPT, GPTConfig
from nanolab.model.config import ConfigError
from nanolab.model.llama import llama_config_from_nanolab, llama_state_from_nanolab
from nanolab.training.module import GPTLightningModule

LLAMA_GPT = GPTConfig(vocab_size=70, vocab_multiple=1, n_layer=1, n_head=2, n_embd=32,
                      block_size=16, position_embedding="rope", norm="rmsnorm", mlp="swiglu",
                      bias=False, rope_base=500.0)  # fmt: skip


def llama_folder(folder: Path, rope: dict[str, Any]) -> GPT:
    """A Llama folder of a random nanolab model whose ``config.json`` spells its RoPE as
    ``rope`` says (keys set to None are left out); returns the model."""
    torch.manual_seed(0)
    model = GPT(LLAMA_GPT).eval()
    config = llama_config_from_nanolab(LLAMA_GPT, None, torch.float32, {})
    del config["nanolab"]  # as a folder from elsewhere
    config.update(rope)
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    torch.save(
        llama_state_from_nanolab(model.state_dict(), LLAMA_GPT), folder / "pytorch_model.bin"
    )
    return model


def imported(folder: Path) -> GPTLightningModule:
    module = GPTLightningModule(gpt=GPTConfig(block_size=16), init_from=str(folder))
    module.configure_model()
    return module


def test_transformers_5s_rope_parameters_give_the_trained_base(tmp_path: Path) -> None:
    """``rope_parameters.rope_theta`` is the base: read only at the top level, the import took
    10000 and computed other logits, silently."""
    ours = llama_folder(
        tmp_path / "v5",
        {"rope_theta": None, "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}},
    )
    module = imported(tmp_path / "v5")
    assert module.gpt_config.rope_base == 500.0
    idx = torch.randint(0, 70, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(module.model.eval()(idx)[0], ours(idx)[0])


@pytest.mark.parametrize(
    ("rope", "named"),
    [
        ({"rope_theta": None, "rope_parameters": {"rope_theta": 500.0, "rope_type": "linear",
                                                  "factor": 4.0}},
         "rope_parameters rope_type 'linear'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         "rope_scaling rope_type 'llama3'"),
    ],
)  # fmt: skip
def test_a_scaled_rope_is_refused_in_either_spelling(
    tmp_path: Path, rope: dict[str, Any], named: str
) -> None:
    llama_folder(tmp_path / "scaled", rope)
    with pytest.raises(ConfigError) as err:
        imported(tmp_path / "scaled")
    line = str(err.value)
    assert "\n" not in line and f"{named} (nanolab: plain RoPE)" in line, line


def test_a_plain_rope_scaling_entry_is_plain_rope(tmp_path: Path) -> None:
    llama_folder(tmp_path / "plain", {"rope_scaling": {"rope_type": "default"}})
    assert imported(tmp_path / "plain").gpt_config.rope_base == 500.0


def test_a_folder_transformers_5_saved_imports_with_its_base(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 writes the top-level rope_theta")
    from transformers import LlamaForCausalLM

    llama_folder(tmp_path / "by-hand", {})
    LlamaForCausalLM.from_pretrained(tmp_path / "by-hand").save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 500.0
    assert imported(tmp_path / "saved").gpt_config.rope_base == 500.0
