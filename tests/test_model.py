"""The GPT itself: causality, initial loss, learning, checkpointing, sizes, generation, config errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nanolab.model import GPT, ConfigError, GPTConfig


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(attention, position_embedding):
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, position_embedding=position_embedding)).eval()
    idx = torch.randint(0, 256, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-4)


def test_math_and_sdpa_attention_agree():
    torch.manual_seed(0)
    sdpa = GPT(tiny(attention="sdpa")).eval()
    math_model = GPT(tiny(attention="math")).eval()
    math_model.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 256, (3, 32))
    assert torch.allclose(sdpa(idx)[0], math_model(idx)[0], atol=1e-5)


def test_initial_loss_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 256, (8, 32))
    _, loss = model(idx, torch.randint(0, 256, (8, 32)))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_gradient_checkpointing_gives_the_same_gradients():
    # Dropout on: checkpointing must replay the same masks in the recomputation.
    torch.manual_seed(0)
    plain = GPT(tiny(dropout=0.1))
    ckpt = GPT(tiny(dropout=0.1, gradient_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(123)
        _, loss = model(idx, targets)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def test_gpt2_124m_parameter_count():
    cfg = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    with torch.device("meta"):
        published = GPT(GPTConfig(**cfg, vocab_multiple=1))
        padded = GPT(GPTConfig(**cfg))
    assert published.num_params() == 124_439_808
    assert padded.config.padded_vocab_size == 50304
    assert padded.num_params() == 124_439_808 + (50304 - 50257) * 768


def test_flops_per_token_follows_6n_plus_attention():
    model = GPT(tiny())
    c = model.config
    # All but the position embedding, the biases and the norm gains (no matmul multiplies them).
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    n_matmul = model.num_params() - c.block_size * c.n_embd - vectors
    expected = 6 * n_matmul + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
    assert model.flops_per_token() == expected
    assert model.flops_per_token(seq_len=16) < expected


def test_weights_are_tied_and_counted_once():
    model = GPT(tiny())
    assert model.lm_head.weight is model.wte.weight
    untied = GPT(tiny(tie_weights=False))
    assert untied.num_params() == model.num_params() + 256 * 32


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    model = GPT(tiny(n_embd=256, n_head=4, n_layer=8))
    std = model.blocks[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(model.blocks[0].attn.c_attn.weight.std().item() - 0.02) < 0.001


def test_generate_greedy_top_k_and_padding():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=70)).eval()  # padded to 128 rows
    idx = torch.randint(0, 70, (2, 5))
    out = model.generate(idx, 40, temperature=1.5)
    assert out.shape == (2, 45)
    assert out.max().item() < 70  # padded ids are never sampled
    greedy = model.generate(idx, 10, temperature=0)
    top1 = model.generate(idx, 10, temperature=1.0, top_k=1)
    assert torch.equal(greedy, top1)
    long = model.generate(idx, 40, temperature=0)  # longer than block_size: context is cropped
    assert long.shape == (2, 45)


def test_top_p_keeps_the_likeliest_tokens_up_to_p_and_the_one_that_crosses_it():
    from nanolab.model.gpt import sampling_probs

    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    kept = sampling_probs(logits, top_p=0.8)  # 0.5 + 0.3 reach 0.8: those two, renormalised
    assert torch.allclose(kept, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    crossed = sampling_probs(logits, top_p=0.81)  # 0.15 crosses 0.81: kept too
    assert torch.allclose(crossed, torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    assert torch.allclose(sampling_probs(logits, top_p=1e-9), torch.tensor([[0.0, 1, 0, 0]]))
    both = sampling_probs(logits, top_k=3, top_p=0.6)  # top-k first (drops 0.05), then p of it
    assert torch.allclose(both, torch.tensor([[0.0, 0.5, 0.0, 0.3]]) / 0.8)
    assert torch.equal(sampling_probs(logits, top_p=1.0), sampling_probs(logits))


def test_generate_with_a_tiny_top_p_is_greedy_and_top_p_one_changes_nothing():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=70)).eval()
    idx = torch.randint(0, 70, (2, 5))
    greedy = model.generate(idx, 12, temperature=0)
    nucleus = model.generate(idx, 12, temperature=1.5, top_p=1e-6)
    assert torch.equal(greedy, nucleus)

    def draw(**kw: float) -> torch.Tensor:
        return model.generate(idx, 12, 1.5, None, torch.Generator().manual_seed(3), **kw)

    assert torch.equal(draw(top_p=1.0), draw())
    assert not torch.equal(draw(top_p=0.3), draw())


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-40, None), (1e-300, None), (1.0, 1e-300), (1.0, 5e-324)]
)
def test_an_extreme_temperature_or_top_p_samples_greedily_instead_of_failing(temperature, top_p):
    """A temperature so small that the scaled logits overflow, and a top_p that is 0 in
    float32, both passed the argument checks and ended in multinomial's "probability tensor
    contains either inf, nan" traceback. In the limit they are greedy decoding."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=70)).eval()
    idx = torch.randint(0, 70, (2, 5))
    greedy = model.generate(idx, 8, temperature=0)
    sampled = model.generate(
        idx, 8, temperature, None, torch.Generator().manual_seed(1), top_p=top_p
    )
    assert torch.equal(sampled, greedy)


#: Every shipped variant of each part, so the cache is checked against each of them.
VARIANTS = [
    {},
    {"attention": "math"},
    {"attention_variant": "qk_norm", "position_embedding": "rope"},
    {"position_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
    {"mlp": "relu2", "norm": "rmsnorm", "tie_weights": False},
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_generation_equals_recomputing_the_context(variant: dict) -> None:
    """Greedy and seeded sampling draw the same tokens with and without the key/value cache
    while prompt + sample fit in the block (2 prompts at once); past the block the cached
    sampler refills and keeps going."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=70, **variant)).eval()  # block_size 32
    assert model.supports_kv_cache
    idx = torch.randint(0, 70, (2, 5))
    cached = model.generate(idx, 11, temperature=0, use_cache=True)
    assert torch.equal(cached, model.generate(idx, 11, temperature=0, use_cache=False))
    draws = [torch.Generator().manual_seed(7) for _ in range(2)]
    sampled = [
        model.generate(idx, 11, 0.8, 20, g, use_cache=c)
        for g, c in zip(draws, (True, False), strict=True)
    ]
    assert torch.equal(*sampled)
    assert model.generate(idx, 60, temperature=0).shape == (2, 65)


def test_a_variant_that_does_not_declare_the_cache_recomputes() -> None:
    """An attention subclass must declare ``supports_kv_cache`` itself (its overrides may not
    take the cache's arguments): without it the model samples as before, whole context."""
    from nanolab.model.gpt import CausalSelfAttention

    class Mine(CausalSelfAttention):
        def attend(self, q, k, v):  # the contract before the cache: no mask
            return super().attend(q, k, v)

    model = GPT(tiny(vocab_size=70)).eval()
    for block in model.blocks:
        block.attn.__class__ = Mine
    assert not model.supports_kv_cache
    assert model.generate(torch.zeros(1, 3, dtype=torch.long), 20, temperature=0).shape == (1, 23)
    with pytest.raises(ValueError, match=r"use_cache=True, but .*\.Mine does not declare"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, use_cache=True)


@pytest.mark.parametrize(
    ("masks", "named"),
    [
        ({"attention_window": 4}, "model.gpt.attention_window runs"),
        ({"document_mask": True, "eot_id": 0}, "model.gpt.document_mask runs"),
    ],
)
def test_asking_for_the_cache_on_a_masked_model_is_refused(masks: dict, named: str) -> None:
    """A cached pass drops the window and the document mask (the cache has no mask for
    them): ``use_cache=True`` sampled from another model than the one trained, silently."""
    model = GPT(tiny(vocab_size=70, **masks)).eval()
    idx = torch.randint(1, 70, (1, 8))
    with pytest.raises(ValueError, match=f"use_cache=True, but {named} without a key/value"):
        model.generate(idx, 2, use_cache=True)
    with pytest.raises(ValueError, match="leave use_cache unset"):
        next(model.stream(idx, 2, use_cache=True))
    assert model.generate(idx, 2).shape == model.generate(idx, 2, use_cache=False).shape == (1, 10)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n_embd=30, n_head=4), "model.gpt.n_embd"),
        (dict(n_layer=0), "model.gpt.n_layer"),
        (dict(dropout=1.5), "model.gpt.dropout"),
        (dict(position_embedding="alibi"), "model.gpt.position_embedding"),
        (dict(position_embedding="rope", n_embd=18, n_head=2), "even head size"),
        (dict(attention="flash3"), "model.gpt.attention"),
        (dict(vocab_size=1), "model.gpt.vocab_size"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny(**kwargs)


def test_sequence_longer_than_block_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_a_checkpoint_whose_config_is_larger_than_its_weights_is_refused_unbuilt():
    # The shapes are compared on the meta device first: a config of a billion-token vocabulary
    # over small weights is one line, not a terabyte allocated (or a traceback when it fails).
    from nanolab.model.checkpoint import CheckpointError, model_from_checkpoint

    model = GPT(tiny())
    config = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(model.config)}
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    ckpt = {"state_dict": state, "nanolab": {"gpt": config}}
    rebuilt = model_from_checkpoint(ckpt)
    assert all(
        torch.equal(a, b)
        for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values(), strict=True)
    )
    for key, value in (("vocab_size", 10**9), ("n_embd", 2**17), ("block_size", 10**9)):
        inflated = {**ckpt, "nanolab": {"gpt": {**config, key: value}}}
        with pytest.raises(CheckpointError, match="the weights do not fit its model config"):
            model_from_checkpoint(inflated)


def test_a_fork_model_that_cannot_be_built_on_meta_still_loads(monkeypatch):
    # A fork's part that reads a value in __init__ (.item()) fails on the meta device: the
    # shapes are then compared on the model built for real, as before the meta check.
    import nanolab.model.checkpoint as checkpoint

    class ReadsAValue(GPT):
        def __init__(self, config: GPTConfig) -> None:
            super().__init__(config)
            self.scale = float(torch.ones(1).item())

    monkeypatch.setattr(checkpoint, "GPT", ReadsAValue)
    model = GPT(tiny())
    config = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(model.config)}
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "nanolab": {"gpt": config}}  # fmt: skip
    rebuilt = checkpoint.model_from_checkpoint(ckpt)
    assert isinstance(rebuilt, ReadsAValue) and rebuilt.scale == 1.0
    assert torch.equal(rebuilt.wte.weight, model.wte.weight)


def test_a_checkpoint_path_that_is_not_a_file_says_what_it_is(tmp_path):
    """``--ckpt /dev/null`` said "does not exist"."""
    from nanolab.model.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="/dev/null is not a regular file"):
        load_checkpoint("/dev/null")
    with pytest.raises(CheckpointError, match=r"gone\.ckpt does not exist"):
        load_checkpoint(tmp_path / "gone.ckpt")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused():
    """An edited or mixed-up checkpoint: generate indexed past the embedding (IndexError
    traceback), or printed nothing for ids its tokenizer could not decode."""
    from nanolab.model.checkpoint import CheckpointError, tokenizer_from_checkpoint

    fits = {"nanolab": {"gpt": {"vocab_size": 256}, "tokenizer": {"name": "bytes"}}}
    assert tokenizer_from_checkpoint(fits).vocab_size == 256
    small = {"nanolab": {"gpt": {"vocab_size": 64}, "tokenizer": {"name": "bytes"}}}
    with pytest.raises(CheckpointError, match="256 tokens, more than its model's vocabulary"):
        tokenizer_from_checkpoint(small)


def test_a_sharded_checkpoint_folder_says_how_to_make_it_one_file(tmp_path, capsys):
    """generate, eval and export on a DeepSpeed run: its last.ckpt is a folder; they said "a
    folder without checkpoints/last.ckpt" and suggested another folder. Now one line naming
    the conversion, for the run, its last.ckpt and a step folder alike."""
    from nanolab.callbacks.checkpoint_io import atomic_link
    from nanolab.cli import main

    run = tmp_path / "runs" / "ds"
    step = run / "checkpoints" / "step-00000008.ckpt"
    (step / "checkpoint").mkdir(parents=True)
    torch.save({"module": {}}, step / "checkpoint" / "mp_rank_00_model_states.pt")
    atomic_link(step, run / "checkpoints" / "last.ckpt")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    for args, how in [
        (["generate", "--ckpt", str(run)], "convert_zero_checkpoint_to_fp32_state_dict"),
        (["generate", "--ckpt", str(run / "checkpoints" / "last.ckpt")], "convert_zero"),
        (["eval", str(run / "checkpoints" / "last.ckpt")], "convert_zero"),
        (["eval", str(run)], "convert_zero"),
        (["export", "--ckpt", str(step), "-o", str(tmp_path / "out")], "convert_zero"),
        (["generate", "--ckpt", str(dcp)], "dcp_to_torch_save"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a sharded checkpoint folder" in err[0] and how in err[0], err


def test_a_model_cast_to_16_bits_computes_its_loss_in_fp32():
    """DeepSpeed and ``bf16-true`` cast the whole model to bf16: the loss is still computed in
    fp32 from its logits, as autocast does, so such runs log the loss DDP and FSDP2 runs log.
    Mutation caught: cross-entropy in bf16 (the loss rounded to 1/32 near 4.8, and biased)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=71, block_size=32, n_layer=1, n_head=2, n_embd=32))
    x, y = torch.randint(0, 71, (4, 32)), torch.randint(0, 71, (4, 32))
    with torch.no_grad():
        logits, loss = model.to(torch.bfloat16)(x, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    exact = F.cross_entropy(logits.float().flatten(0, 1), y.view(-1))
    assert loss.item() == pytest.approx(exact.item(), abs=1e-6)
    rounded = F.cross_entropy(logits.flatten(0, 1), y.view(-1))
    assert abs(rounded.float().item() - exact.item()) > 1e-4  # what a bf16 loss would log


def test_a_checkpoint_with_an_overwritten_record_header_is_refused_not_read_shifted(tmp_path):
    """A zip record's local header overwritten (a bad sector, a torn copy) left the archive's
    directory intact, and the memory-mapped load read the tensors after it from shifted bytes:
    an export of such a file held embeddings of 4e24, finite and silent. Every record's header
    is now checked where the directory says it is."""
    import io
    import zipfile

    from nanolab.model.checkpoint import CheckpointError, damaged_record, load_checkpoint

    path = tmp_path / "good.ckpt"
    torch.save({"state_dict": {f"model.w{i}": torch.randn(64) for i in range(3)}}, path)
    assert damaged_record(path) is None and load_checkpoint(path)["state_dict"]
    good = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(good)) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    damaged = bytearray(good)
    damaged[record.header_offset : record.header_offset + 30] = bytes(30)
    (tmp_path / "damaged.ckpt").write_bytes(bytes(damaged))
    assert damaged_record(tmp_path / "damaged.ckpt") == record.filename
    with pytest.raises(CheckpointError, match=r"damaged.ckpt is damaged \(its record .*data/0"):
        load_checkpoint(tmp_path / "damaged.ckpt")
