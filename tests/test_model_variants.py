"""The registries at the model's seams: built-in variants, config validation, a user's own.

A variant is one class with one decorator; the config accepts exactly the registered names and
says which they are; a module of the user's registers its variants when it is imported.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from nanolab.model import GPT, ConfigError, GPTConfig
from nanolab.model.registry import ATTENTIONS, MLPS, NORMS, POSITIONS, register_mlp, register_norm

TINY = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)

VARIANTS = {
    "rmsnorm": {"norm": "rmsnorm"},
    "swiglu": {"mlp": "swiglu"},
    "relu2": {"mlp": "relu2"},
    "qk_norm": {"attention_variant": "qk_norm"},
    "qk_norm-rope-math": {"attention_variant": "qk_norm", "position_embedding": "rope"},
    "all": {"norm": "rmsnorm", "mlp": "swiglu", "attention_variant": "qk_norm"},
}


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_a_variant_is_causal_and_learns(kwargs: dict) -> None:
    torch.manual_seed(0)
    model = GPT(replace(TINY, **kwargs))
    idx = torch.randint(0, 128, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    model.eval()
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.equal(a[:, 10:], b[:, 10:])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(idx, idx)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_variants_change_the_parameters_they_should() -> None:
    base = dict(GPT(TINY).named_parameters())
    rms = dict(GPT(replace(TINY, norm="rmsnorm")).named_parameters())
    assert set(base) - set(rms) == {"blocks.0.ln_1.bias", "blocks.0.ln_2.bias"} | {
        "blocks.1.ln_1.bias",
        "blocks.1.ln_2.bias",
        "ln_f.bias",
    }
    qk = dict(GPT(replace(TINY, attention_variant="qk_norm")).named_parameters())
    assert set(qk) - set(base) == {
        f"blocks.{i}.attn.{n}_norm.weight" for i in range(2) for n in ("q", "k")
    }
    swiglu = GPT(replace(TINY, mlp="swiglu")).blocks[0].mlp
    hidden = swiglu.c_proj.in_features
    assert swiglu.c_fc.out_features == 2 * hidden and hidden % 64 == 0
    # 2/3 of GELU's width, rounded up: the MLP stays about GPT-2's size.
    assert hidden >= 2 * 4 * TINY.n_embd / 3


def test_qk_norm_sdpa_and_math_kernels_agree() -> None:
    torch.manual_seed(0)
    sdpa = GPT(replace(TINY, attention_variant="qk_norm", position_embedding="rope")).eval()
    math = GPT(replace(sdpa.config, attention="math")).eval()
    math.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(idx)[0], math(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("field", "registry"),
    [
        ("norm", NORMS),
        ("mlp", MLPS),
        ("attention_variant", ATTENTIONS),
        ("position_embedding", POSITIONS),
    ],
)
def test_an_unknown_name_lists_the_registered_ones(field: str, registry) -> None:
    with pytest.raises(ConfigError) as err:
        replace(TINY, **{field: "nonesuch"})
    message = str(err.value)
    assert message.startswith(f"model.gpt.{field} must be one of")
    assert "'nonesuch'" in message and "\n" not in message
    assert all(repr(name) in message for name in registry.names())


def test_a_name_is_one_class() -> None:
    @register_norm("test_twice")
    class First(nn.Module):
        pass

    register_norm("test_twice")(First)  # the same class again: a module imported twice
    with pytest.raises(ValueError, match="already registered"):

        @register_norm("test_twice")
        class Second(nn.Module):
            pass


USER_MODULE = '''
import torch
from torch import nn

from nanolab.model.registry import register_norm


@register_norm("test_user_scalenorm")
class ScaleNorm(nn.Module):
    """One learned scale for the whole vector (Nguyen & Salazar 2019)."""

    def __init__(self, dim, config):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(dim**0.5))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp(min=1e-5)
'''


def test_a_variant_in_a_users_module_registers_on_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_norms.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="test_user_scalenorm"):
        replace(TINY, norm="test_user_scalenorm")
    importlib.import_module("user_norms")
    try:
        model = GPT(replace(TINY, norm="test_user_scalenorm"))
        assert "test_user_scalenorm" in NORMS.names()
        assert {n for n, _ in model.named_parameters() if n.startswith("blocks.0.ln")} == {
            "blocks.0.ln_1.g",
            "blocks.0.ln_2.g",
        }
        assert model(torch.randint(0, 128, (1, 16)), torch.zeros(1, 16, dtype=torch.long))[1] > 0
    finally:
        sys.modules.pop("user_norms", None)


# -- docs/forking.md, "Adding a model variant" ----------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs" / "forking.md"


def _section(title: str) -> str:
    text = DOCS.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _blocks(section: str, lang: str) -> list[str]:
    parts = section.split(f"```{lang}\n")[1:]
    return [p.split("```", 1)[0] for p in parts]


def test_the_documented_variant_registers_trains_and_is_estimated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanolab.estimator.activations import saved_activations
    from nanolab.estimator.measure import measure_saved
    from nanolab.estimator.numerics import numerics_for
    from nanolab.estimator.setup import Setup

    section = _section("Adding a model variant")
    (code,) = _blocks(section, "python")
    (error_line,) = _blocks(section, "text")
    path = code.splitlines()[0].removeprefix("# ")
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).parent.joinpath("__init__.py").write_text("")
    (tmp_path / path).write_text(code)
    package = path.split("/")[0]
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    if "softcap" not in ATTENTIONS:
        with pytest.raises(ConfigError) as err:
            replace(TINY, attention_variant="softcap")
        # The page lists the built-ins; a test session may have registered more.
        names = re.compile(r"variants \((.*?)\), got")
        documented = names.search(error_line).group(1)
        assert names.sub("", str(err.value)) == names.sub("", error_line.strip())
        assert set(documented.split(", ")) <= {repr(n) for n in ATTENTIONS.names()}
    importlib.import_module(path.removesuffix(".py").replace("/", "."))
    try:
        cfg = replace(TINY, attention_variant="softcap")
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, 128, (2, 16))
        loss = model(idx, idx)[1]
        loss.backward()
        assert torch.isfinite(loss)
        assert model.flops_per_token() == GPT(TINY).flops_per_token()  # same matmuls
        num = numerics_for(Setup(gpt=cfg, precision="32-true"), "cpu")
        estimated = saved_activations(cfg, 2, 16, num).total
        measured = measure_saved(GPT(cfg), 2, 16).bytes
        assert estimated == pytest.approx(measured, rel=0.005)
    finally:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            sys.modules.pop(name)


def test_the_documented_command_trains_and_estimates_the_variant(
    tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The section's ``nanolab fit`` as written (a tiny model on the prepared data given after
    the recipe), with the model module importing the variant as the page says; then
    ``nanolab estimate`` of the run's config.yaml counts the variant's parameters."""
    import json
    import shlex

    import yaml
    from conftest import tiny_overrides, write_config

    from nanolab.cli import main

    section = _section("Adding a model variant")
    (code,) = _blocks(section, "python")
    (command,) = [shlex.split(line) for b in _blocks(section, "bash") for line in b.splitlines()]
    model_class = command[command.index("--model") + 1]
    module, name = model_class.rsplit(".", 1)
    layers = code.splitlines()[0].removeprefix("# ").removesuffix(".py").replace("/", ".")
    root = tmp_path / "src"
    (root / "mylab").mkdir(parents=True)
    (root / "mylab" / "__init__.py").write_text("")
    (root / "mylab" / "layers.py").write_text(code)
    (root / (module.replace(".", "/") + ".py")).write_text(
        f"import {layers}  # noqa: F401  (registers the variants)\n"
        "from nanolab.training.module import GPTLightningModule\n\n\n"
        f"class {name}(GPTLightningModule):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(DOCS.parents[1] / "configs")
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    fit = command[1:]
    at = fit.index("configs/quickstart.yaml") + 1
    fit[at:at] = ["--config", str(tiny)]
    try:
        assert main(fit) == 0, capsys.readouterr().err[-2000:]
        run_dir = tmp_path / "runs" / "tiny"
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["model"]["init_args"]["gpt"]["attention_variant"] == "softcap"
        capsys.readouterr()
        config = str(run_dir / "config.yaml")
        assert main(["estimate", "--config", config, "--device", "cpu", "--json"]) == 0
        estimate = json.loads(capsys.readouterr().out)
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        state = ckpt["state_dict"]
        params = sum(v.numel() for k, v in state.items() if k != "model.lm_head.weight")
        assert estimate["model"]["params"] == params
        assert "softcap" in estimate["model"]["gpt"]["attention_variant"]
        # Spelled-out scores: the block is measured, not described by the GPT-2 rules.
        assert any("measured" in key for key in estimate["memory"]["per_block_saved"])
        assert ckpt["nanolab"]["part_modules"] == {"attention_variant": "mylab.layers"}
        _generate_eval_export_need_the_module(run_dir, capsys)
    finally:
        for mod in [m for m in sys.modules if m.split(".")[0] == "mylab"]:
            del sys.modules[mod]


def _generate_eval_export_need_the_module(run_dir: Path, capsys) -> None:
    """generate, eval and export build the model from the checkpoint alone: in a process that
    never imported the variant's module, each says which module to --import (it never imports
    what a checkpoint names), and runs with it; an installed project's nanolab.plugins entry
    point (a dist-info on the path, as pip install -e writes it) needs no flag."""
    from nanolab import installed_plugins
    from nanolab.cli import main
    from nanolab.model import registry

    def forget() -> None:  # a new process: the variant's module was never imported
        registry.ATTENTIONS._classes.pop("softcap", None)
        for mod in [m for m in sys.modules if m.split(".")[0] == "mylab"]:
            del sys.modules[mod]
        installed_plugins._plugins_loaded.clear()

    out = run_dir.parent / "exported"
    commands = {
        "generate": ["generate", "--ckpt", str(run_dir), "--max-new-tokens", "4"],
        "eval": ["eval", str(run_dir), "--limit", "4", "--no-log"],
        "export": ["export", "--ckpt", str(run_dir), "--format", "safetensors", "-o", str(out)],
    }
    for verb, args in commands.items():
        forget()
        capsys.readouterr()
        assert main(args) == 2, verb
        err = capsys.readouterr().err
        assert "registered when it was saved; pass --import mylab.layers" in err, (verb, err)
        assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1
        assert "Traceback" not in err
        assert main([*args, "--import", "mylab.layers"]) == 0, (verb, capsys.readouterr().err)
    assert (out / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(run_dir), "--import", "mylab.nothing"]) == 2
    assert "--import mylab.nothing: cannot import it" in capsys.readouterr().err

    forget()
    site = run_dir.parent / "site"
    dist = site / "mylab_project-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab-project\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[nanolab.plugins]\nmylab = mylab.layers\n")
    sys.path.insert(0, str(site))
    try:
        assert main(commands["generate"]) == 0, capsys.readouterr().err
    finally:
        sys.path.remove(str(site))
        installed_plugins._plugins_loaded.clear()

    # Another project registers the same name with other maths: refused, not built with it.
    forget()
    other = run_dir.parent / "otherlab"
    other.mkdir()
    (other / "__init__.py").write_text(
        "from nanolab.model.gpt import CausalSelfAttention\n"
        "from nanolab.model.registry import register_attention\n\n\n"
        "@register_attention('softcap')\n"
        "class Other(CausalSelfAttention):\n    pass\n"
    )
    sys.path.insert(0, str(other.parent))
    try:
        capsys.readouterr()
        assert main([*commands["generate"], "--import", "otherlab"]) == 2
        err = capsys.readouterr().err
        assert "was registered by mylab.layers when it was saved, and here by otherlab" in err
    finally:
        sys.path.remove(str(other.parent))
        registry.ATTENTIONS._classes.pop("softcap", None)
        sys.modules.pop("otherlab", None)


@pytest.mark.parametrize(
    ("field", "variant"), [("norm", "rmsnorm"), ("mlp", "swiglu"), ("attention_variant", "qk_norm")]
)
def test_a_checkpoint_older_than_the_variant_keys_resumes_only_as_gpt2(
    tmp_path: Path, field: str, variant: str
) -> None:
    """A checkpoint written before the registries existed was GPT-2's block: it resumes under
    the defaults and is refused, by name, under another variant."""
    from nanolab.training.resume import Candidate, ResumeError, check_same_model

    old = TINY.to_dict()
    for key in ("norm", "mlp", "attention_variant"):
        del old[key]  # as written before the keys existed
    cand = Candidate(path=tmp_path / "last.ckpt", step=10, nanolab={"gpt": old})
    default = getattr(TINY, field)
    with pytest.raises(ResumeError, match=rf"{field} '{default}' in the checkpoint vs '{variant}'"):
        check_same_model(cand, replace(TINY, **{field: variant}).to_dict())
    check_same_model(cand, TINY.to_dict())  # no error


def test_built_in_names_known_without_torch_are_what_the_model_registers() -> None:
    """The registries name the built-ins (and which check the config) before
    nanolab.model.gpt is imported; that list must be exactly what gpt registers."""
    import nanolab.model.gpt  # noqa: F401  (registers the built-ins)
    from nanolab.model import registry

    for reg in (registry.ATTENTIONS, registry.MLPS, registry.NORMS, registry.POSITIONS):
        registered = {n: c for n, c in reg._classes.items() if c.__module__ == registry.BUILTINS}
        assert set(registered) == set(reg.builtins), reg.kind
        for name, cls in registered.items():
            assert hasattr(cls, "validate_config") == reg.builtins[name], (reg.kind, name)


def test_a_config_of_built_in_parts_validates_without_torch() -> None:
    code = (
        "import sys; from nanolab.model.config import GPTConfig, ConfigError\n"
        "GPTConfig(vocab_size=50, norm='rmsnorm', mlp='swiglu', attention_variant='qk_norm')\n"
        "try:\n    GPTConfig(vocab_size=50, norm='nope')\nexcept ConfigError as e:\n"
        "    assert 'rmsnorm' in str(e)\nelse:\n    raise SystemExit('not refused')\n"
        "assert 'torch' not in sys.modules\n"
        # RoPE checks the head size: that one name loads the built-ins (and torch).
        "GPTConfig(vocab_size=50, position_embedding='rope')\nassert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_built_in_name_cannot_be_taken_by_another_class() -> None:
    from torch import nn

    with pytest.raises(ValueError, match="built-in"):

        @register_mlp("gelu")
        class NotTheBuiltIn(nn.Module):
            pass


class _PlainAttention(torch.nn.Module):
    """An attention written from scratch (not a CausalSelfAttention): forward(x) only."""

    def __init__(self, config) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(config.n_embd, 3 * config.n_embd)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.size(-1), dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _WideMLP(torch.nn.Module):
    def __init__(self, config, width: int = 4) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(config.n_embd, width * config.n_embd)

    def forward(self, x):
        return self.fc(x)


class _OneWideMLP(_WideMLP):
    def __init__(self, config) -> None:
        torch.nn.Module.__init__(self)
        self.fc = torch.nn.Linear(config.n_embd, 1)


class _DimOnlyNorm(torch.nn.Module):
    def __init__(self, dim) -> None:  # the block calls cls(dim, config)
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gain


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"attention_variant": "t_plain", "position_embedding": "rope"},
         r"attention_variant 't_plain' \(.*_PlainAttention\) does not subclass CausalSelfAttention, whose prepare_qk applies .*'rope'"),
        ({"attention_variant": "t_plain", "attention": "math"},
         r"kernel model\.gpt\.attention 'math' picks"),
        ({"attention_variant": "t_plain", "attention_window": 8},
         r"its forward takes no `visible` argument"),
        ({"mlp": "t_wide"}, r"model\.gpt\.mlp 't_wide' \(.*_WideMLP\) returned \(2, 4, 128\) for an input of \(2, 4, 32\)"),
        ({"mlp": "t_one"}, r"model\.gpt\.mlp 't_one' .* returned \(2, 4, 1\)"),
        ({"norm": "t_dim_only"}, r"model\.gpt\.norm 't_dim_only' .* cannot be built as cls\(dim, config\)"),
    ],
)  # fmt: skip
def test_a_part_of_ones_own_that_would_be_ignored_or_misshapen_is_one_line(parts, message):
    """What a from-scratch part would silently skip (RoPE, the kernel, the document mask or
    window) or get wrong (a shape other than (B, T, C), which the residual add would broadcast
    from (B, T, 1)), refused when the module is built: the setting, the class and the fix.
    Mutations caught: a plain attention with rope trained with no positions at all; a
    (B, T, 1) MLP output trained to the end."""
    from nanolab.model.config import ConfigError
    from nanolab.model.registry import register_attention
    from nanolab.training.module import GPTLightningModule

    registered = [(ATTENTIONS, "t_plain", _PlainAttention), (MLPS, "t_wide", _WideMLP),
                  (MLPS, "t_one", _OneWideMLP), (NORMS, "t_dim_only", _DimOnlyNorm)]  # fmt: skip
    register_attention("t_plain")(_PlainAttention)
    register_mlp("t_wide")(_WideMLP)
    register_mlp("t_one")(_OneWideMLP)
    register_norm("t_dim_only")(_DimOnlyNorm)
    try:
        gpt = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, **parts)
        with pytest.raises(ConfigError, match=message):
            GPTLightningModule(gpt=gpt)
        plain = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32,
                          attention_variant="t_plain")  # fmt: skip
        GPTLightningModule(gpt=plain)  # learned positions, sdpa, no mask: it trains as written
    finally:
        for reg, name, _ in registered:
            reg._classes.pop(name, None)


class _SizedMLP(torch.nn.Module):
    """Reads a tensor's value while it is built (a LLaMA-style hidden size): no meta build."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden = int(torch.tensor(8 * config.n_embd / 3).div(8).ceil().mul(8).item())
        self.up, self.down = (
            torch.nn.Linear(config.n_embd, hidden),
            torch.nn.Linear(hidden, config.n_embd),
        )

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _BuggyMLP(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(config.n_embd)  # a bug in the body, not in the signature


def test_the_build_check_leaves_what_it_cannot_judge_to_the_real_build():
    """A part that reads a tensor's value in its constructor (refused on the meta device) is
    built and trains as before the check existed; a TypeError inside a constructor's body is
    the user's traceback, not a line blaming the signature. Mutations caught: the meta build
    outside the guard (the run could not start); any TypeError mentioning "argument" taken
    for a wrong signature."""
    from nanolab.training.module import GPTLightningModule

    register_mlp("t_sized")(_SizedMLP)
    register_mlp("t_buggy")(_BuggyMLP)
    try:
        gpt = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, mlp="t_sized")
        module = GPTLightningModule(gpt=gpt)
        logits, loss = module.model(
            torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
        )
        assert logits.shape == (1, 4, 64) and loss is not None
        buggy = GPTConfig(
            vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, mlp="t_buggy"
        )
        with pytest.raises(TypeError, match="out_features"):
            GPTLightningModule(gpt=buggy)
    finally:
        MLPS._classes.pop("t_sized", None)
        MLPS._classes.pop("t_buggy", None)
