"""Hugging Face GPT-2 import (``model.init_from``), fine-tuning, and ``nanolab export``.

No network: every GPT-2 here is a tiny random ``GPT2LMHeadModel`` built by ``transformers`` in the
test (weights perturbed so no bias or LayerNorm is left at its 0/1 initialisation, where a mixed-up
mapping would go unnoticed) and saved with ``save_pretrained``; its tokenizer is a byte-level BPE
trained here. The checks are transformers' own forward passes and loaders against nanolab's.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, REPO, tiny_overrides, write_config
from test_tokenizer_gpt2 import TEXT as GPT2_TEXT
from test_tokenizer_gpt2 import local_gpt2 as tiktoken_gpt2  # noqa: F401  (a shared fixture)

from nanolab.cli import main
from nanolab.data.prepare import prepare_dataset
from nanolab.data.tokenizers import HFTokenizer, load_tokenizer, tokenizer_from_spec
from nanolab.generate import load_checkpoint, model_from_checkpoint
from nanolab.model import GPT, GPTConfig
from nanolab.model.hf import (
    gpt_shapes,
    hf_state_from_nanolab,
    nanolab_state_from_hf,
    read_hf_weights,
)
from nanolab.model.hf_tokenizer import tokenizer_json, vocabulary
from nanolab.training.freeze import FreezeConfig, apply_freeze
from nanolab.training.module import GPTLightningModule
from nanolab.training.optim import parameter_groups

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

FINETUNE = REPO / "configs" / "finetune-gpt2.yaml"
VOCAB = 300  # the tiny BPE's ids, end-of-text included


def shakespeare(n_chars: int) -> str:
    with gzip.open(REPO / "nanolab" / "data" / "corpus" / "shakespeare.txt.gz", "rt") as f:
        return f.read(n_chars)


def save_tiny_gpt2(folder: Path, *, seed: int = 0, tokenizer: bool = True, **config) -> object:
    """A random 2-layer GPT-2 saved by transformers (plus a BPE ``tokenizer.json``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    settings = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": VOCAB}
    settings.update(bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **config)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    if tokenizer:
        tok = HFTokenizer.train([shakespeare(20_000)], VOCAB)
        assert tok.vocab_size == VOCAB and tok.eot_id == VOCAB - 1
        tok.save_files(folder)
    return model


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    return folder, save_tiny_gpt2(folder)


@contextlib.contextmanager
def lightning_logs_to_stderr() -> Iterator[None]:
    """Lightning's log handlers keep the stderr of the test that first imported it, which pytest
    may have closed since: point them at this test's for the block, then back (the next test's
    own redirection expects to find them as they were)."""
    handlers = [
        handler
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("lightning")
        for handler in logging.getLogger(name).handlers
        if type(handler) is logging.StreamHandler
    ]
    saved = [h.stream for h in handlers]
    for handler in handlers:
        handler.stream = sys.stderr
    try:
        yield
    finally:
        for handler, stream in zip(handlers, saved, strict=True):
            handler.stream = stream


def fit(capsys, *args: str, config: Path = QUICKSTART) -> tuple[int, list[str]]:
    """``nanolab fit`` in this process: (exit code, stderr lines)."""
    try:
        with lightning_logs_to_stderr():
            code = main(["fit", "--config", str(config), *args])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.splitlines()


def error_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "error" in line.lower()]


# -- import -----------------------------------------------------------------------------------
def _hub_layout_bin(src: Path, dst: Path) -> None:
    """The layout of OpenAI's GPT-2 on the Hub: no ``transformer.`` prefix, each block's causal
    mask stored as ``h.N.attn.bias``, weights in a ``pytorch_model.bin``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = read_hf_weights(src)
    hub = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    torch.save(hub, dst / "pytorch_model.bin")


@pytest.mark.parametrize("variant", ["safetensors", "hub-bin", "untied-wide-mlp"])
def test_import_computes_transformers_logits(tmp_path, gpt2_folder, variant):
    """nanolab's GPT built from a GPT-2 folder gives transformers' logits on the same ids, for
    save_pretrained's safetensors, the Hub's old .bin layout, and an untied head with a 2x MLP;
    a shorter ``block_size`` keeps the first positions.

    Mutations caught: a Conv1D weight not transposed; biases or LayerNorms mapped to the wrong
    block; the tied head left random; ``n_inner`` ignored.
    """
    folder, hf_model = gpt2_folder
    if variant == "hub-bin":
        _hub_layout_bin(folder, tmp_path / "hub")
        folder = tmp_path / "hub"
    elif variant == "untied-wide-mlp":
        folder = tmp_path / "untied"
        hf_model = save_tiny_gpt2(folder, seed=1, tie_word_embeddings=False, n_inner=128)
    module = GPTLightningModule(gpt=GPTConfig(block_size=64), init_from=str(folder))
    cfg = module.gpt_config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.padded_vocab_size) == (
        2, 4, 64, VOCAB, VOCAB,
    )  # fmt: skip
    assert cfg.tie_weights == (variant != "untied-wide-mlp")
    assert cfg.mlp_ratio == (2 if variant == "untied-wide-mlp" else 4)
    idx = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = module.model.eval()(idx)[0]
        theirs = hf_model(idx).logits
    diff = (ours - theirs).abs().max().item()
    print(f"import {variant}: max |logit difference| {diff:.2e}")
    assert diff < 1e-4 and theirs.abs().max() > 0.5
    short = GPTLightningModule(gpt=GPTConfig(block_size=16), init_from=str(folder)).model.eval()
    with torch.no_grad():
        assert torch.allclose(short(idx[:, :16])[0], theirs[:, :16], atol=1e-4)

    # And back: nanolab's tensors under GPT-2's names are the folder's, bit for bit.
    def plain(state: dict) -> dict:
        named = {k.removeprefix("transformer."): v for k, v in state.items()}
        return {k: v for k, v in named.items() if not re.fullmatch(r"h\.\d+\.attn\.bias", k)}

    original = plain(read_hf_weights(folder))
    exported = plain(hf_state_from_nanolab(module.model.state_dict(), cfg))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


# -- fit -> export -> transformers -> import ----------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, char_dataset) -> Path:
    """The quickstart recipe (chars, no biases, vocabulary padded to 128 rows), trained 4 steps."""
    tmp = tmp_path_factory.mktemp("fit")
    # GPT-2's tanh GELU and a padded vocabulary, which the export must carry (the quickstart's
    # own CPU choices are the exact GELU and no padding: docs/performance.md).
    overrides = tiny_overrides(
        char_dataset,
        tmp / "runs",
        model__gpt__activation="gelu_tanh",
        model__gpt__vocab_multiple=64,
    )
    cfg = write_config(tmp / "t.yaml", overrides)
    with lightning_logs_to_stderr():
        assert main(["fit", "--config", str(QUICKSTART), "--config", str(cfg)]) == 0
    return tmp / "runs" / "tiny"


def test_export_of_a_fit_checkpoint_loads_in_transformers(tmp_path, trained_run, capsys):
    """``nanolab export --format hf`` of a checkpoint trained by fit: transformers'
    ``AutoModelForCausalLM`` gives nanolab's logits over every (padded) id, ``AutoTokenizer``
    encodes and decodes as the data's chars tokenizer, and importing the export back gives a model
    whose every tensor is bit-identical to the checkpoint's (the biases it never had are zeros).

    Mutations caught: Conv1D weights exported untransposed; the padded rows dropped (logits
    shift); biases of a bias-free model left out (transformers would initialise them randomly);
    the tokenizer's end-of-text or alphabet out of order.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    start = time.perf_counter()
    assert main(["export", "--ckpt", str(trained_run), "--format", "hf", "-o", str(out)]) == 0
    seconds = time.perf_counter() - start
    print(f"export --format hf of the tiny fit checkpoint: {seconds:.2f}s")
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.ckpt")
    ours = model_from_checkpoint(ckpt)
    assert not ours.config.bias and ours.config.padded_vocab_size == 128 > ours.config.vocab_size
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(
        0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        a, b = ours(idx)[0], theirs(idx).logits
    diff = (a - b).abs().max().item()
    print(f"export: max |logit difference| nanolab vs transformers {diff:.2e}")
    assert a.shape == b.shape and diff < 1e-4

    tok = tokenizer_from_spec(ckpt["nanolab"]["tokenizer"])
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "HIPPOLYTA:\nFour days will quickly steep themselves in night;"
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    assert hf_tok.eos_token_id == tok.eot_id

    back = GPTLightningModule(
        gpt=GPTConfig(block_size=32), init_from=str(out)
    )  # the quickstart's bias: false would disagree with GPT-2's biases: left at the default
    assert back.gpt_config.vocab_size == ours.config.vocab_size  # the data's, not the 128 rows
    assert back.gpt_config.padded_vocab_size == 128
    imported = back.model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(imported[name], tensor), name
    extra = set(imported) - set(ours.state_dict())
    assert extra and all(name.endswith(".bias") and not imported[name].any() for name in extra)


def test_transformers_never_samples_the_padding_ids_of_an_export(tmp_path, trained_run):
    """The export keeps nanolab's padded rows (128 for 71 ids), whose logits transformers'
    ``generate`` sampled (about one token in eight, decoding to ''), where ``nanolab generate``
    samples the real vocabulary only. Its generation_config.json suppresses the padding ids:
    sampled and greedy, every id transformers generates is the tokenizer's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    assert main(["export", "--ckpt", str(trained_run), "--format", "hf", "-o", str(out)]) == 0
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.ckpt")
    vocab = model_from_checkpoint(ckpt).config.vocab_size
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.vocab_size == 128 > vocab  # the weights as trained, padding included
    prompt = torch.tensor([[1, 2, 3]])
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = theirs.generate(
            prompt, max_new_tokens=24, do_sample=True, top_k=0, num_return_sequences=32,
            pad_token_id=0,
        )[:, 3:]  # fmt: skip
        greedy = theirs.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert sampled.numel() > 500 and int(sampled.max()) < vocab
    assert int(greedy.max()) < vocab


def test_safetensors_export_keeps_nanolab_names(tmp_path, trained_run):
    """``--format safetensors``: the checkpoint's tensors under nanolab's names (a tied head once)
    and the architecture and tokenizer in nanolab.json."""
    from safetensors.torch import load_file

    out = tmp_path / "st"
    assert (
        main(["export", "--ckpt", str(trained_run), "--format", "safetensors", "-o", str(out)]) == 0
    )
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.ckpt")
    model = model_from_checkpoint(ckpt)
    tensors = load_file(out / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())
    info = json.loads((out / "nanolab.json").read_text())
    assert info["gpt"] == asdict(model.config) and info["tokenizer"]["name"] == "chars"


# -- the fine-tuning recipe ---------------------------------------------------------------------
#: What the docs' commands get on top, to run in seconds on a CPU with the tiny GPT-2.
CPU_SCALE = [
    "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.max_steps=3",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--model.gpt.block_size=64", "--run.global_batch_tokens=null", "--run.eval_every_steps=3",
    "--data.micro_batch_size=2", "--data.val_windows=8", "--model.optimizer.lr=1e-3",
]  # fmt: skip


def docs_block(heading: str, language: str) -> str:
    text = (REPO / "docs" / "hf.md").read_text()
    return text.split(heading, 1)[1].split(f"```{language}", 1)[1].split("```", 1)[0]


def test_docs_finetune_then_export_then_transformers(tmp_path, gpt2_folder, capsys, monkeypatch):
    """docs/hf.md as written, with the tiny GPT-2 as models/gpt2: ``validate`` and ``fit`` with
    configs/finetune-gpt2.yaml (data prepared from the bundled corpus with the folder's
    tokenizer.json), ``export``, then the docs' transformers snippet on the export. ``fit`` also
    gets ``model.freeze``: the embeddings and the first block end bit-identical to the folder's,
    the second block has moved, so training started from the folder's weights.
    """
    import shlex
    import shutil

    folder, _ = gpt2_folder
    shutil.copytree(folder, tmp_path / "models" / "gpt2")
    (tmp_path / "configs").mkdir()
    shutil.copy(FINETUNE, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    commands = [
        shlex.split(line.split("  #", 1)[0])
        for line in docs_block("## Fine-tune GPT-2", "bash").splitlines()
        if line.startswith("nanolab ")
    ]
    assert [c[1] for c in commands] == ["validate", "fit", "export"]
    freeze = ["--model.freeze.embeddings=true", "--model.freeze.blocks=1"]
    for command in commands:
        extra = CPU_SCALE + freeze if command[1] == "fit" else []
        extra = CPU_SCALE if command[1] == "validate" else extra
        with lightning_logs_to_stderr():
            code = main(command[1:] + extra)
        err = capsys.readouterr().err
        assert code in (0, None), (command, err[-2000:])

    assert load_tokenizer(tmp_path / "data" / "shakespeare_gpt2").name == "hf"
    run = tmp_path / "runs" / "finetune-gpt2"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["nanolab"]["gpt"]["n_embd"] == 64
    trained = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    config = GPTConfig(**ckpt["nanolab"]["gpt"])
    start = nanolab_state_from_hf(read_hf_weights(folder), config, folder)
    frozen = ["wte.weight", "wpe.weight"] + [k for k in start if k.startswith("blocks.0.")]
    assert all(torch.equal(trained[k], start[k]) for k in frozen)
    moved = [
        k for k in start if k.startswith("blocks.1.") and not torch.equal(trained[k], start[k])
    ]
    assert len(moved) == 12  # every tensor of the trained block

    out = tmp_path / "out" / "gpt2-shakespeare"
    exported, original = (json.loads((d / "tokenizer.json").read_text()) for d in (out, folder))
    assert exported == original
    snippet = docs_block("## Export to transformers", "python")
    exec(compile(snippet, "docs/hf.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and len(printed) > len("ROMEO:") + 10


def test_estimate_reads_the_architecture_from_init_from(tmp_path, gpt2_folder, capsys):
    """``nanolab estimate`` on the fine-tuning recipe sizes the checkpoint's model (2 x 64,
    300 ids, 64 positions here), not the config's defaults; a missing folder is one line."""
    import yaml

    from nanolab.estimator.setup import EstimateError, setup_from_config

    folder, _ = gpt2_folder
    cfg = yaml.safe_load(FINETUNE.read_text())
    cfg["model"]["init_from"] = str(folder)
    cfg["model"]["gpt"]["block_size"] = 64
    gpt = setup_from_config(cfg).gpt
    assert (gpt.n_layer, gpt.n_embd, gpt.vocab_size, gpt.vocab_multiple) == (2, 64, VOCAB, 1)
    cfg["model"]["init_from"] = str(tmp_path / "nowhere")
    with pytest.raises(EstimateError, match="no such folder, and nanolab never downloads"):
        setup_from_config(cfg)


@pytest.mark.parametrize(
    "options",
    [{}, {"bias": False}, {"tie_weights": False, "mlp_ratio": 3}, {"position_embedding": "rope"},
     {"norm": "rmsnorm"}, {"mlp": "swiglu", "bias": False}, {"mlp": "swiglu"}, {"mlp": "relu2"},
     {"attention_variant": "qk_norm", "position_embedding": "rope"}],
)  # fmt: skip
def test_shapes_from_the_config_are_the_models(options):
    """``gpt_shapes`` (what import and export check tensors against without building a model)
    lists exactly GPT's state dict, for every option that changes it."""
    config = GPTConfig(vocab_size=70, n_layer=2, n_head=2, n_embd=16, block_size=8, **options)
    model = GPT(config)
    assert gpt_shapes(config) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_freeze_leaves_parameters_out_of_the_optimizer():
    """A tied head is the token embedding: freezing embeddings freezes it too."""
    model = GPT(GPTConfig(vocab_size=50, n_layer=3, n_head=2, n_embd=16, block_size=8))
    names = apply_freeze(model, FreezeConfig(embeddings=True, blocks=2))
    assert "lm_head.weight" in names and "wpe.weight" in names
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {"0", "1"}
    trainable = {id(p) for group in parameter_groups(model, 0.1) for p in group["params"]}
    assert trainable == {id(p) for p in model.blocks[2].parameters()} | {
        id(model.ln_f.weight),
        id(model.ln_f.bias),
    }


# -- tokenizers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bytes", "chars", "bpe"])
def test_every_tokenizer_has_an_equivalent_tokenizer_json(name):
    """The tokenizer.json an export writes encodes, decodes and numbers tokens as nanolab does."""
    from tokenizers import Tokenizer

    from nanolab.data.tokenizers import train_tokenizer

    corpus = shakespeare(20_000) + " ünïcödé ✓ 日本"
    tok = train_tokenizer(name, corpus, bpe_vocab_size=400)
    hf = Tokenizer.from_str(tokenizer_json(tok))
    sample = corpus[-300:]
    assert hf.encode(sample, add_special_tokens=False).ids == tok.encode(sample)
    assert hf.decode(tok.encode(sample)) == sample
    assert hf.get_vocab(with_added_tokens=True) == vocabulary(tok)
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size


def test_gpt2_tiktoken_tokenizer_becomes_a_tokenizer_json(request):
    """tiktoken's GPT-2 (files made locally, as in test_tokenizer_gpt2) as a byte-level BPE
    tokenizer.json: its merges recovered from the ranks give tiktoken's ids."""
    from tokenizers import Tokenizer

    enc, _ = request.getfixturevalue("tiktoken_gpt2")
    tok = tokenizer_from_spec({"name": "gpt2"})
    hf = Tokenizer.from_str(tokenizer_json(tok))
    # As in transformers' own GPT-2 tokenizer, the literal "<|endoftext|>" in a text is read as
    # the special token (tiktoken's encode_ordinary, what prepare uses, reads it as text).
    text = GPT2_TEXT.replace("<|endoftext|>", "<|end|>")
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert hf.decode(tok.encode(GPT2_TEXT)) == GPT2_TEXT
    assert hf.token_to_id("<|endoftext|>") == enc.eot_token


# -- bad input: one line, exit 2, nothing written --------------------------------------------------
def _no_config(folder: Path, tmp: Path) -> Path:
    bad = tmp / "no-config"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return bad


def _edited_config(**changes):
    def make(folder: Path, tmp: Path) -> Path:
        bad = tmp / "edited"
        bad.mkdir()
        for f in folder.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (bad / "config.json").write_text(json.dumps(config))
        return bad

    return make


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {_Payload.marker}",))


def _pickle_payload(folder: Path, tmp: Path) -> Path:
    bad = tmp / "payload"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    _Payload.marker = tmp / "payload-ran"
    torch.save({"wte.weight": torch.zeros(2), "x": _Payload()}, bad / "pytorch_model.bin")
    return bad


def _nanolab_export(folder: Path, tmp: Path) -> Path:
    bad = tmp / "st-export"
    bad.mkdir()
    (bad / "nanolab.json").write_text("{}")
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return bad


IMPORT_ROWS = [
    # (id, make the folder, extra args, what the one line says)
    ("hub-name", lambda f, t: "gpt2", [], "nanolab never downloads"),
    ("no-config", _no_config, [], "has no config.json"),
    ("safetensors-export", _nanolab_export, [], "has no model architecture nanolab reads"),
    ("not-gpt2", _edited_config(model_type="mistral"), [], "model_type is 'mistral'"),
    ("shapes", _edited_config(n_embd=32), [], "tensor wte.weight has shape [300, 64]"),
    ("payload", _pickle_payload, [], "never runs code from a checkpoint"),
    ("arch-key", lambda f, t: f, ["--model.gpt.n_layer=3"], "model.gpt.n_layer is 3 but"),
    ("too-long", lambda f, t: f, ["--model.gpt.block_size=128"], "longer than the checkpoint's 64"),
    ("too-frozen", lambda f, t: f, ["--model.freeze.blocks=3"], "model.freeze.blocks 3"),
    (
        "other-tokenizer",
        lambda f, t: f,
        ["--data.dataset_dir=CHARS"],
        "not the checkpoint's tokenizer",
    ),
]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, gpt2_folder) -> Path:
    """Text prepared with the tiny GPT-2's own tokenizer.json."""
    folder, _ = gpt2_folder
    tmp = tmp_path_factory.mktemp("bpe-data")
    (tmp / "text.txt").write_text(shakespeare(40_000))
    prepare_dataset(
        [str(tmp / "text.txt")], tmp / "data", str(folder / "tokenizer.json"), quiet=True
    )
    return tmp / "data"


@pytest.mark.parametrize("row", IMPORT_ROWS, ids=[r[0] for r in IMPORT_ROWS])
def test_bad_init_from_is_one_error_line(
    tmp_path, gpt2_folder, bpe_data, char_dataset, capsys, monkeypatch, row
):
    """Each bad ``model.init_from``: exit 2, one error line naming the fix, no run directory,
    and a pickle's payload never runs."""
    _, make, extra, message = row
    folder, _ = gpt2_folder
    monkeypatch.chdir(tmp_path)  # "gpt2" names no folder here
    data = bpe_data
    source = make(folder, tmp_path)
    args = [a.replace("CHARS", str(char_dataset)) for a in extra]
    code, err = fit(
        capsys,
        f"--model.init_from={source}", f"--data.dataset_dir={data}", "--data.source=null",
        f"--run.root={tmp_path / 'runs'}", "--model.gpt.block_size=32",
        "--trainer.max_steps=2", "--data.micro_batch_size=2", "--run.global_batch_tokens=null",
        "--trainer.accelerator=cpu", "--trainer.precision=32-true", *args,
        config=FINETUNE,
    )  # fmt: skip
    assert code == 2, err[-10:]
    errors = error_lines(err)
    print(errors[0] if errors else err)
    assert len(errors) == 1 and message in errors[0], err
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "payload-ran").exists()


def test_export_refusals_write_nothing(tmp_path, trained_run, capsys):
    """An existing -o without --force, --force onto a folder that is not an export (a run
    directory), and a RoPE model as GPT-2: one error line each, exit 2, files untouched."""
    out = tmp_path / "out"
    assert main(["export", "--ckpt", str(trained_run), "-o", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def refused(*args: str) -> str:
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nanolab export: error:"), err
        return err[0]

    assert "already exists; pass --force" in refused("--ckpt", str(trained_run), "-o", str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    run_files = sorted(p.name for p in trained_run.iterdir())
    # Even with --force: no command writes into a run directory (one rule for every -o).
    line = refused("--ckpt", str(trained_run), "-o", str(trained_run), "--force")
    assert "is inside the run directory" in line and "write it elsewhere" in line
    assert sorted(p.name for p in trained_run.iterdir()) == run_files

    rope = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=16, block_size=8,
                     position_embedding="rope")  # fmt: skip
    model = GPT(rope)
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "nanolab": {"gpt": asdict(rope), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "rope.ckpt")
    line = refused("--ckpt", str(tmp_path / "rope.ckpt"), "-o", str(tmp_path / "rope-hf"))
    assert "position_embedding 'rope'" in line and "--format safetensors" in line
    assert not (tmp_path / "rope-hf").exists()

    # A sliding window is neither GPT-2's attention nor Llama's: named on both sides.
    windowed = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=16, block_size=8,
                         attention_window=4)  # fmt: skip
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in GPT(windowed).state_dict().items()},
        "nanolab": {"gpt": asdict(windowed), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "window.ckpt")
    line = refused("--ckpt", str(tmp_path / "window.ckpt"), "-o", str(tmp_path / "window-hf"))
    assert "attention_window 4 (GPT-2 attends to the whole context)" in line
    assert "attention_window 4 (Llama attends to the whole context)" in line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left

    assert main(["export", "--ckpt", str(trained_run), "-o", str(out), "--force"]) == 0
    assert {p.name for p in out.iterdir()} == set(before)


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_force_never_replaces_a_transformers_folder(tmp_path, trained_run, capsys, fmt):
    """``--force`` onto a folder ``save_pretrained`` wrote (config.json, model.safetensors, the
    user's own README.md: every name one an export writes too) is refused in one line and the
    folder is left as it was: only nanolab's own mark (config.json's ``nanolab`` entry,
    nanolab.json's model) makes a folder a previous export."""
    out = tmp_path / "user_ft"
    save_tiny_gpt2(out, tokenizer=False)
    (out / "README.md").write_text("# my fine-tune\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    args = ["export", "--ckpt", str(trained_run), "--format", fmt, "-o", str(out), "--force"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nanolab export: error: -o {out} "), err
    assert "not a previous nanolab export" in err[0] and "choose another -o" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_ft"]


@pytest.mark.parametrize("force", [False, True])
def test_an_out_made_during_the_export_is_checked_again(
    tmp_path, trained_run, capsys, monkeypatch, force
):
    """-o absent at the check but made while the export works (another export to it finished
    first; a transformers folder of the user's): the move into place checks again. Without
    --force the late export is the "already exists" line; with --force only a previous export
    may be replaced, never the user's folder. Either way what is at -o stays, nothing is left
    beside it."""
    import shutil

    import nanolab.export as export_module

    earlier = tmp_path / "earlier"
    assert main(["export", "--ckpt", str(trained_run), "--format", "safetensors",
                 "-o", str(earlier)]) == 0  # fmt: skip
    out = tmp_path / "race"
    real_card = export_module.model_card

    def card_while_out_appears(*args, **kwargs):
        if force:
            save_tiny_gpt2(out, tokenizer=False)  # the user's own folder
        else:
            shutil.copytree(earlier, out)  # another export to -o, finished meanwhile
        return real_card(*args, **kwargs)

    monkeypatch.setattr(export_module, "model_card", card_while_out_appears)
    capsys.readouterr()
    args = ["export", "--ckpt", str(trained_run), "--format", "hf", "-o", str(out)]
    assert main(args + (["--force"] if force else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nanolab export: error: -o {out} "), err
    wanted = "not a previous nanolab export" if force else "already exists; pass --force"
    assert wanted in err[0]
    assert (out / "nanolab.json").is_file() != force  # what was there is there, untouched
    assert (out / "config.json").is_file() == force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "race"]


@pytest.mark.parametrize("tied", [True, False])
def test_a_rope_rmsnorm_swiglu_model_exports_as_llama(tmp_path, tied, capsys):
    """RoPE + RMSNorm + SwiGLU without biases is the Llama architecture: ``export --format hf``
    writes ``LlamaForCausalLM``, whose logits in transformers equal nanolab's (q/k rows permuted
    from interleaved pairs to rotate_half's halves), and the tensors come back bit-exact."""
    from transformers import AutoModelForCausalLM

    from nanolab.model.llama import llama_state_from_nanolab, nanolab_state_from_llama

    cfg = GPTConfig(vocab_size=70, vocab_multiple=64, n_layer=2, n_head=4, n_embd=64, block_size=32,
                    position_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    tie_weights=tied, rope_base=500.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # gains away from 1, so a misplaced norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "nanolab": {"gpt": asdict(cfg), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "llama.ckpt")
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(tmp_path / "llama.ckpt"), "-o", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 500.0
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, 70, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(idx)[0], theirs(idx).logits
    diff = (a - b).abs().max().item()
    print(f"llama export (tied={tied}): max |logit difference| {diff:.2e}")
    assert a.shape == b.shape and diff < 1e-4
    state = model.state_dict()
    back = nanolab_state_from_llama(llama_state_from_nanolab(state, cfg), cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_what_neither_architecture_expresses_is_named() -> None:
    from nanolab.model.llama import llama_refusals

    qk = GPTConfig(vocab_size=65, position_embedding="rope", norm="rmsnorm", mlp="relu2",
                   attention_variant="qk_norm", bias=False)  # fmt: skip
    refusals = llama_refusals(qk)
    assert "model.gpt.mlp 'relu2' (Llama has 'swiglu')" in refusals
    assert "model.gpt.attention_variant 'qk_norm' (Llama has 'causal')" in refusals
    learned = GPTConfig(vocab_size=65, norm="rmsnorm", mlp="swiglu", bias=False)
    assert llama_refusals(learned) == ["model.gpt.position_embedding 'learned' (Llama has 'rope')"]


def _round_trip(tmp_path: Path, char_dataset: Path, fmt: str, block: int, **gpt: str):
    """A tiny run of ``model.gpt`` settings ``gpt`` trained by fit, exported as ``fmt`` and
    built back by ``model.init_from`` at context ``block``: (export folder, module built back),
    its every tensor checked bit-identical to the checkpoint's."""
    settings = {f"model__gpt__{key}": value for key, value in gpt.items()}
    cfg = write_config(
        tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs", **settings)
    )
    with lightning_logs_to_stderr():
        assert main(["fit", "--config", str(QUICKSTART), "--config", str(cfg)]) == 0
    run = tmp_path / "runs" / "tiny"
    out = tmp_path / "export"
    assert main(["export", "--ckpt", str(run), "--format", fmt, "-o", str(out)]) == 0
    ours = model_from_checkpoint(load_checkpoint(run / "checkpoints" / "last.ckpt"))
    back = GPTLightningModule(gpt=GPTConfig(block_size=block), init_from=str(out))
    assert {key: getattr(back.gpt_config, key) for key in gpt} == gpt
    back.configure_model()
    a, b = ours.state_dict(), back.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return out, back


def test_a_fit_llama_run_exports_and_comes_back_with_init_from(tmp_path, char_dataset):
    """A RoPE + RMSNorm + SwiGLU run trained by fit: ``export --format hf`` writes a Llama
    folder with its tokenizer, and ``model.init_from`` of that folder builds the same
    architecture with every tensor bit-identical to the checkpoint's."""
    out, _ = _round_trip(
        tmp_path, char_dataset, "hf", 32, position_embedding="rope", norm="rmsnorm", mlp="swiglu"
    )
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "tokenizer.json").is_file()


def test_a_model_no_hf_format_expresses_comes_back_from_its_safetensors_export(
    tmp_path, char_dataset, capsys
):
    """QK-norm attention with RoPE (neither GPT-2 nor Llama): ``export --format safetensors``,
    then ``model.init_from`` of that folder builds the same architecture, every tensor
    bit-identical, at a longer context (RoPE has no table); a new run fine-tunes from it on data
    of the same tokenizer, and an architecture key set otherwise is refused naming both."""
    out, _ = _round_trip(
        tmp_path, char_dataset, "safetensors", 64, position_embedding="rope",
        attention_variant="qk_norm",
    )  # fmt: skip
    capsys.readouterr()
    code, err = fit(
        capsys, f"--model.init_from={out}", f"--data.dataset_dir={char_dataset}",
        "--data.source=null", f"--run.root={tmp_path / 'runs'}", "--run.name=ft",
        "--model.gpt.block_size=32", "--trainer.max_steps=2", "--data.micro_batch_size=2",
        "--run.global_batch_tokens=null", "--trainer.accelerator=cpu",
        "--trainer.precision=32-true", config=FINETUNE,
    )  # fmt: skip
    assert code == 0, err[-10:]
    code, err = fit(
        capsys, f"--model.init_from={out}", f"--data.dataset_dir={char_dataset}",
        "--data.source=null", f"--run.root={tmp_path / 'runs'}", "--run.name=ft2",
        "--model.gpt.norm=rmsnorm", "--trainer.accelerator=cpu", config=FINETUNE,
    )  # fmt: skip
    errors = error_lines(err)
    assert code == 2 and len(errors) == 1, err[-10:]
    assert "model.gpt.norm is 'rmsnorm' but the checkpoint in" in errors[0], errors


@pytest.mark.parametrize(("flag", "shown"), [([], True), (["-q"], False), (["--verbose"], True)])
def test_one_verbosity_flag_governs_what_a_verb_says_besides_its_output(
    trained_run, capsys, flag, shown
):
    """``nanolab -q <verb>`` keeps the command's output (the sample on stdout) and drops its
    informational lines (``using .../last.ckpt`` on stderr), through the ``nanolab`` logger.
    Mutations caught: a note printed around the logger (shown under -q), the flag leaking into
    the next command of the same process (the environment is put back)."""
    from nanolab.messages import ENV

    before = os.environ.get(ENV)
    code = main([*flag, "generate", "--ckpt", str(trained_run), "--prompt", "To",
                 "--max-new-tokens", "3", "--seed", "1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and out.strip().startswith("To")
    assert ("nanolab generate: using" in err) is shown, err
    assert os.environ.get(ENV) == before


def test_warnings_still_show_when_quiet(capsys, monkeypatch):
    from nanolab import messages

    monkeypatch.setenv(messages.ENV, "quiet")
    messages.configure()
    messages.note("nanolab x", "hidden")
    messages.warn("nanolab x", "shown")
    messages.debug("nanolab x", "hidden too")
    err = capsys.readouterr().err
    assert err == "nanolab x: warning: shown\n"
    monkeypatch.setenv(messages.ENV, "verbose")
    messages.configure()
    messages.debug("nanolab x", "detail")
    assert capsys.readouterr().err == "nanolab x: detail\n"
    monkeypatch.delenv(messages.ENV)
    messages.configure()


def test_what_a_killed_export_left_is_cleared_or_put_back(tmp_path, trained_run):
    """A kill -9 mid-export left ``.st.export-PID`` (a full-size hidden copy no later export
    removed); a kill between moving the previous export aside and the new one in left the
    previous one as ``.st.replaced-PID`` only. The next export clears the first and puts the
    second back (then ``--force`` is needed to replace it, as for any export)."""
    out = tmp_path / "st"
    args = ["export", "--ckpt", str(trained_run), "--format", "safetensors", "-o", str(out)]
    assert main(args) == 0
    dead_pid = 2**22 + 12345  # above pid_max's default: no such process
    (tmp_path / f".st.export-{dead_pid}").mkdir()
    (tmp_path / f".st.export-{dead_pid}" / "model.safetensors").write_bytes(b"0" * 1000)
    out.rename(tmp_path / f".st.replaced-{dead_pid}")
    assert main(args) == 2  # the previous export is back: replacing it takes --force
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]
    assert main([*args, "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]
    # this process's own pid (every export is pid 1 in a container) is not a live export; a
    # leftover of another output whose name begins the same is not this one's
    out.rename(tmp_path / f".st.replaced-{os.getpid()}")
    other = tmp_path / f".st.export-x.replaced-{dead_pid}"
    other.mkdir()
    assert main(args) == 2 and (out / "model.safetensors").is_file() and other.is_dir()


def test_a_quiet_command_leaves_the_next_ones_lightning_lines_alone(monkeypatch):
    """``-q`` quiets Lightning's loggers; a command run after it in the same process (a
    script calling ``nanolab.cli.main`` twice) printed none of its resume notes, which
    Lightning's info logger carries."""
    import logging

    from nanolab import messages

    before = logging.getLogger("lightning.pytorch").level
    monkeypatch.setenv(messages.ENV, "quiet")
    messages.configure()
    assert logging.getLogger("lightning.pytorch").level == logging.WARNING
    monkeypatch.setenv(messages.ENV, "normal")
    messages.configure()
    assert logging.getLogger("lightning.pytorch").level == before
