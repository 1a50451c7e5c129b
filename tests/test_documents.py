"""Document-aligned windows (``data.align: document``) and document-masked / sliding-window
attention (``model.gpt.document_mask``, ``attention_window``)."""

from __future__ import annotations

import bisect
import json
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import QUICKSTART
from test_data_checks import fit_config, fit_in_process

from nanolab.data import documents
from nanolab.data.datamodule import DocumentWindows, TokenDataModule
from nanolab.data.documents import pack_documents, unit_starts
from nanolab.data.windows import DataTooSmallError, MixturePlan, ResumableBatchSampler
from nanolab.estimator.memory import estimate_memory
from nanolab.estimator.setup import Setup
from nanolab.model import GPT, GPTConfig
from nanolab.model.config import ConfigError
from nanolab.model.gpt import AttentionMask, _vector_numel, attended_span, flex_attend

EOT = 256  # the bytes tokenizer's end-of-text id


def write_documents(folder: Path, train: list[str], val: list[str]) -> Path:
    """A dataset as ``nanolab prepare --tokenizer bytes`` lays it out: every document ends with
    the end-of-text id."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "nanolab-tokens-v1", "tokenizer": {"name": "bytes", "eot": True},
            "vocab_size": 257, "dtype": "uint16", "eot_id": EOT}  # fmt: skip
    for split, docs in (("train", train), ("val", val)):
        ids = [t for d in docs for t in [*d.encode(), EOT]]
        (folder / f"{split}.bin").write_bytes(np.asarray(ids, dtype=np.uint16).tobytes())
        meta[f"{split}_tokens"] = len(ids)
        meta[f"{split}_bytes"] = sum(len(d.encode()) for d in docs)
    meta["documents"] = {"train": len(train), "val": len(val)}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def random_documents(n: int, seed: int, longest: int = 90) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "slept", "well"]
    return [" ".join(rng.choice(words, size=int(rng.integers(2, longest // 4)))) for _ in range(n)]


# -- packing ----------------------------------------------------------------------------------
def test_units_begin_at_the_end_of_text_before_each_document(monkeypatch):
    tokens = np.array([5, 6, EOT, 7, EOT, 8, 9, 9, EOT], dtype=np.uint16)
    assert unit_starts(tokens, EOT).tolist() == [0, 2, 4]
    monkeypatch.setattr(documents, "SCAN_CHUNK", 2)  # a boundary on a chunk edge is found too
    assert unit_starts(tokens, EOT).tolist() == [0, 2, 4]


@pytest.mark.parametrize("row_len", [9, 33, 200])
def test_every_row_is_full_starts_at_a_document_and_holds_whole_or_cropped_documents(row_len):
    rng = np.random.default_rng(row_len)
    lengths = rng.integers(1, 60, size=400)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total = int(lengths.sum())
    p = pack_documents(starts, total, row_len)
    unit_length = dict(zip(starts.tolist(), lengths.tolist(), strict=True))
    assert p.rows > 0 and p.row_ptr[0] == 0
    seen = set()
    for r in range(p.rows):
        pieces = range(p.row_ptr[r], p.row_ptr[r + 1])
        assert sum(int(p.piece_len[i]) for i in pieces) == row_len  # no padding
        for i in pieces:
            start, length = int(p.piece_start[i]), int(p.piece_len[i])
            assert start in unit_length and start not in seen  # a document, used once
            seen.add(start)
            cropped = length < unit_length[start]
            # Only the last piece of a row may be cropped: a document that fits is kept whole.
            assert not cropped or i == p.row_ptr[r + 1] - 1
    assert p.dropped_tokens == total - p.rows * row_len
    assert p.dropped_tokens < 0.25 * total or row_len < 60


def reference_packing(tokens: np.ndarray, row_len: int) -> tuple[list[int], list[int], list[int]]:
    """The packing rule as a plain loop over (length, unit) pairs, as nanolab packed before its
    packing was made with compact arrays: (piece starts, piece lengths, row ends)."""
    starts = np.unique(np.concatenate(([0], np.flatnonzero(tokens == EOT))))
    starts = (starts[starts < len(tokens) - 1] if len(tokens) > 1 else starts[:1]).tolist()
    lengths = [b - a for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True)]
    pending: list[tuple[int, int]] = []
    nxt, piece_start, piece_len, row_ptr = 0, [], [], [0]
    while True:
        room, row_pieces = row_len, 0
        while room > 0:
            while len(pending) < documents.PACK_BUFFER and nxt < len(lengths):
                bisect.insort(pending, (lengths[nxt], nxt))
                nxt += 1
            if not pending:
                break
            i = bisect.bisect_right(pending, (room, len(lengths))) - 1
            length, unit = pending.pop(i) if i >= 0 else (room, pending.pop(0)[1])
            piece_start.append(starts[unit])
            piece_len.append(length)
            row_pieces += 1
            room -= length
        if room > 0:
            del (
                piece_start[len(piece_start) - row_pieces :],
                piece_len[len(piece_len) - row_pieces :],
            )
            return piece_start, piece_len, row_ptr
        row_ptr.append(len(piece_start))


@pytest.mark.parametrize("buffer", [1000, 7])
def test_packing_is_the_rule_s_bit_for_bit(monkeypatch, buffer):
    """Random splits, with documents longer than a row, empty ones (two end-of-texts in a row),
    an end-of-text first and last or not, and a partial last row, pack exactly as the rule's
    plain loop packs them."""
    monkeypatch.setattr(documents, "PACK_BUFFER", buffer)  # a small look-ahead: many crops
    monkeypatch.setattr(documents, "SCAN_CHUNK", 97)  # boundaries on chunk edges
    monkeypatch.setattr(documents, "KEY_CHUNK", 5, raising=False)
    rng = np.random.default_rng(buffer)
    for trial in range(60):
        row_len = int(rng.choice([2, 9, 33, 257]))
        count = int(rng.integers(1, 2500))
        lengths = np.maximum(0, rng.lognormal(np.log(row_len / 3 + 1), 1.3, count)).astype(int)
        lengths[rng.random(count) < 0.1] = 0  # empty documents
        lengths[rng.random(count) < 0.05] = row_len  # exactly a row, with its end-of-text over
        tokens = np.full(int((lengths + 1).sum()), 5, dtype=np.uint16)
        tokens[np.cumsum(lengths + 1) - 1] = EOT
        tokens = tokens[int(trial % 3 == 1) : len(tokens) - int(trial % 2)]
        if trial % 5 == 0:
            tokens[0] = EOT
        got = pack_documents(unit_starts(tokens, EOT), len(tokens), row_len)
        want_start, want_len, want_rows = reference_packing(tokens, row_len)
        assert got.piece_start.dtype == np.int64 and got.piece_len.dtype == np.int32
        assert got.piece_start.tolist() == want_start and got.piece_len.tolist() == want_len
        assert got.row_ptr.tolist() == want_rows, trial
    assert pack_documents(unit_starts(np.zeros(0, np.uint16), EOT), 0, 9).rows == 0


def test_units_of_billions_of_tokens_are_cropped_shortest_first():
    """Lengths too long for the packer's int64 sort keys still sort as lengths: of two units
    longer than any row, the shorter (the later one here) is cropped first."""
    first, second = (1 << 61) + 5, (1 << 61) + 2
    p = pack_documents(np.array([0, first], dtype=np.int64), first + second, 4)
    assert p.piece_start.tolist() == [first, 0] and p.piece_len.tolist() == [4, 4]
    assert p.row_ptr.tolist() == [0, 1, 2]


def test_packing_memory_follows_the_documents_not_python_objects(monkeypatch):
    """Packing 100,000 documents peaks at tens of bytes per document (compact arrays), not at
    the hundred and more that Python lists of ints took."""
    monkeypatch.setattr(documents, "KEY_CHUNK", 4096, raising=False)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, 100_000)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        packing = pack_documents(starts, int(lengths.sum()), 257)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert packing.rows > 0
    assert peak / len(lengths) < 64, f"{peak / len(lengths):.0f} bytes per document"


def test_packed_rows_read_the_pieces_end_to_end(tmp_path):
    folder = write_documents(tmp_path / "d", random_documents(60, 0), ["x y"])
    windows = DocumentWindows(folder / "train.bin", "uint16", 31, EOT)
    data = np.fromfile(folder / "train.bin", dtype=np.uint16)
    p = windows.packing
    rows = np.array([0, p.rows - 1, 3, 3])
    x, y = windows[rows]
    for j, r in enumerate(rows):
        want = np.concatenate(
            [data[p.piece_start[i] : p.piece_start[i] + p.piece_len[i]]
             for i in range(p.row_ptr[r], p.row_ptr[r + 1])]
        )  # fmt: skip
        assert torch.equal(x[j], torch.from_numpy(want[:-1].astype(np.int64)))
        assert torch.equal(y[j], torch.from_numpy(want[1:].astype(np.int64)))
        # Every row opens with the end-of-text before a document, or with the split's start.
        assert x[j, 0] == EOT or p.piece_start[p.row_ptr[r]] == 0


# -- the DataModule ---------------------------------------------------------------------------
def _opens_documents(windows: DocumentWindows, keys: np.ndarray, x: torch.Tensor) -> bool:
    """Whether each row opens with an end-of-text (a document starts after it), or with the
    split's first document, which has none before it."""
    p = windows.packing
    return all(
        row[0] == EOT or p.piece_start[p.row_ptr[k]] == 0 for k, row in zip(keys, x, strict=True)
    )


def _module(folder: Path, **kw) -> TokenDataModule:
    dm = TokenDataModule(dataset_dir=str(folder), source=None, block_size=31,
                         micro_batch_size=4, val_windows=6, align="document", **kw)  # fmt: skip
    dm.setup("fit")
    return dm


def test_training_windows_start_at_documents_and_an_epoch_visits_every_row(tmp_path):
    dm = _module(write_documents(tmp_path / "d", random_documents(200, 1), random_documents(20, 2)))
    plan = dm.window_plan(1)
    rows = len(dm.train_parts[0])
    seen = []
    for g in range(plan.batches_per_epoch):
        keys = plan.batch_starts(g, 0)
        x, _ = dm.train_parts[0][keys]
        assert _opens_documents(dm.train_parts[0], keys, x)
        seen += keys.tolist()
    assert len(seen) == len(set(seen)) == plan.batches_per_epoch * 4 <= rows


def test_the_order_resumes_exactly_and_two_ranks_take_one_step_of_two_micro_batches(tmp_path):
    dm = _module(write_documents(tmp_path / "d", random_documents(200, 3), random_documents(20, 4)))
    one = iter(ResumableBatchSampler(dm.window_plan(1), 0))
    stream = [next(one) for _ in range(40)]
    resumed = iter(ResumableBatchSampler(dm.window_plan(1), 0, start=17))
    assert all(np.array_equal(next(resumed), stream[g]) for g in range(17, 40))
    two = dm.window_plan(2)
    for step in range(5):  # step k of two ranks = micro-batches 2k and 2k+1 of one
        ranks = np.concatenate([two.batch_starts(step, r) for r in (0, 1)])
        assert sorted(ranks.tolist()) == sorted(
            np.concatenate(stream[2 * step : 2 * step + 2]).tolist()
        )


def test_validation_rows_are_fixed_and_aligned(tmp_path):
    folder = write_documents(tmp_path / "d", random_documents(50, 5), random_documents(40, 6))
    a, b = _module(folder), _module(folder)
    keys = [k for batch in a.val_dataloader().sampler for k in batch]
    assert keys == [k for batch in b.val_dataloader().sampler for k in batch] and len(keys) == 6
    x, _ = a.val_parts[0][np.asarray(keys)]
    assert _opens_documents(a.val_parts[0], np.asarray(keys), x)


def test_a_mixture_of_aligned_datasets_reads_rows_of_each(tmp_path):
    prose = write_documents(tmp_path / "prose", random_documents(120, 7), random_documents(20, 8))
    code = write_documents(tmp_path / "code", ["def f(x):\n    return x"] * 80, ["pass"] * 20)
    dm = TokenDataModule(datasets=[{"path": str(prose), "weight": 0.7},
                                   {"path": str(code), "weight": 0.3}],
                         block_size=31, micro_batch_size=4, val_windows=4, align="document")  # fmt: skip
    dm.setup("fit")
    plan = dm.window_plan(1)
    assert isinstance(plan, MixturePlan)
    rows = np.concatenate([plan.batch_starts(g, 0) for g in range(25)])
    sizes = [len(p) for p in dm.train_parts]
    for d in (0, 1):
        mine = rows[rows[:, 0] == d, 1]
        assert mine.min() >= 0 and mine.max() < sizes[d]
    assert 0.6 < np.mean(rows[:, 0] == 0) < 0.8
    x, y = dm.train_dataloader().dataset[plan.batch_starts(0, 0)]
    assert x.shape == y.shape == (4, 31)


def test_long_documents_are_named_when_aligning_drops_most_tokens(tmp_path, recwarn):
    """A ``nanolab: warning:`` line through nanolab's logger, not a Python warning (which
    prints its source line too)."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nanolab").addHandler(handler)
    try:
        long_docs = ["word " * 200] * 10  # 1000-byte documents, 32-token rows
        _module(write_documents(tmp_path / "d", long_docs, long_docs[:3]))
    finally:
        logging.getLogger("nanolab").removeHandler(handler)
    assert any(
        m.startswith("nanolab: warning: data.align document keeps only") and "train tokens" in m
        for m in said
    ), said
    assert not [w for w in recwarn if "keeps only" in str(w.message)]


def _record_packings(monkeypatch) -> list[str]:
    """The split files (``train.bin``, ``val.bin``) packed from here on, in order."""
    from nanolab.data import datamodule

    packed: list[str] = []
    real = datamodule.packing_of

    def recording(path, *args):
        packed.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(datamodule, "packing_of", recording)
    return packed


def test_validate_and_test_neither_pack_nor_require_the_training_split(tmp_path, monkeypatch):
    """The training split of a large corpus costs a scan and a packing (seconds, memory) that
    an evaluation would never read; one too small for a step is no reason to refuse it."""
    folder = write_documents(tmp_path / "d", ["a cat"] * 10, random_documents(40, 13))
    packed = _record_packings(monkeypatch)
    for stage in ("validate", "test"):
        dm = TokenDataModule(dataset_dir=str(folder), source=None, block_size=31,
                             micro_batch_size=4, val_windows=6, align="document")  # fmt: skip
        dm.check_validation_fits(1)
        dm.setup(stage)
        keys = [k for batch in dm.val_dataloader().sampler for k in batch]
        assert len(keys) == 6, stage
    assert packed == ["val.bin", "val.bin"]
    with pytest.raises(DataTooSmallError, match="training split"):
        dm.check_fits(1)  # a fit still refuses it, naming the split
    assert 0 < len(dm.train_parts[0]) < 4  # made on first use, for whoever reads it


# -- the mask -----------------------------------------------------------------------------------
BASE = dict(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 49, (3, 32), generator=g)
    idx[0, 5], idx[0, 20], idx[1, 0], idx[2, 31] = 49, 49, 49, 49
    return idx, torch.randint(0, 49, (3, 32), generator=g)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_a_masked_document_sees_nothing_of_the_one_before(position):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, position_embedding=position, document_mask=True, eot_id=49))
    model.eval()
    idx, _ = _batch()
    logits, _ = model(idx[:1])
    alone, _ = model(idx[:1, :20])  # the first two documents, without the third
    assert torch.allclose(logits[0, :20], alone[0], atol=1e-6)
    changed = idx[:1].clone()
    changed[0, :5] = (changed[0, :5] + 1) % 49  # rewrite the first document
    after, _ = model(changed)
    assert torch.allclose(after[0, 5:], logits[0, 5:], atol=1e-6)  # the later ones never see it
    assert not torch.allclose(after[0, :5], logits[0, :5])
    if position == "rope":  # relative positions: a document alone = the document packed
        solo, _ = model(idx[:1, 5:20])
        assert torch.allclose(logits[0, 5:20], solo[0], atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        dict(document_mask=True, eot_id=49),
        dict(attention_window=7),
        dict(document_mask=True, eot_id=49, attention_window=5),
    ],
    ids=["documents", "window", "both"],
)
def test_flex_sdpa_and_math_give_the_same_losses_and_gradients(extra):
    """FlexAttention has no backward on a CPU, so its loss is compared without gradients;
    SDPA with a boolean mask and the spelled-out kernel are compared with them."""
    idx, targets = _batch()
    results = {}
    for impl in ("sdpa", "math", "flex"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**BASE, position_embedding="rope", attention=impl, **extra))
        with torch.no_grad():
            results[impl] = [model(idx, targets)[1]]
        if impl != "flex":
            loss = model(idx, targets)[1]
            loss.backward()
            results[impl].append(model.blocks[0].attn.c_attn.weight.grad)
    assert float(results["flex"][0]) == pytest.approx(float(results["sdpa"][0]), abs=1e-5)
    assert float(results["math"][0]) == pytest.approx(float(results["sdpa"][0]), abs=1e-5)
    assert torch.allclose(results["sdpa"][1], results["math"][1], atol=1e-5)


@pytest.mark.slow  # compiling FlexAttention and its block mask: ~1-2 min on 2 loaded cores
def test_the_compiled_flex_path_a_gpu_takes_gives_sdpa_s_attention_on_cpu():
    """The path a GPU takes (the block mask built by the compiled ``create_block_mask``, the
    compiled FlexAttention kernel), forced on CPU forward-only, against SDPA: causal, and under
    the dense document mask with a window. 256 positions make 2 x 2 blocks of 128, so a block
    the mask skips is skipped. Mutations caught: the compiled kernel called without the block
    mask (it attends to the future and to other documents); the mask built per call; the mask compiled through torch's deprecated flag."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 49, (2, 256), generator=g)
    idx[0, 40], idx[0, 200], idx[1, 130] = 49, 49, 49
    q, k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(3))
    cases = {
        "causal": ({}, {"is_causal": True}),
        "documents": (dict(document_mask=True, eot_id=49, attention_window=150), None),
    }
    for name, (extra, sdpa) in cases.items():
        config = GPTConfig(**{**BASE, "block_size": 256, "attention": "flex", **extra})
        visible = AttentionMask(idx, config, compiled=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert visible.block_mask() is visible.block_mask()  # built once per batch
        assert not [w for w in caught if "_compile flag" in str(w.message)]  # torch's own way
        with torch.no_grad():
            out = flex_attend(q, k, v, visible.block_mask(), visible.compiled)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, **(sdpa or {"attn_mask": visible.dense()})
            )
        assert torch.allclose(out, want, atol=1e-5), name


def test_a_window_sees_exactly_its_last_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, position_embedding="rope", attention_window=4)).eval()
    idx, _ = _batch()
    logits, _ = model(idx[:1])
    changed = idx[:1].clone()
    changed[0, 10] = (changed[0, 10] + 1) % 49
    after, _ = model(changed)
    # Two layers of a 4-token window: position 10 reaches at most positions 10..16.
    differs = [(after[0, t] - logits[0, t]).abs().max() > 1e-6 for t in range(32)]
    assert differs[10:17] == [True] * 7 and not any(differs[:10]) and not any(differs[17:])


def test_masked_models_sample_without_a_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, document_mask=True, eot_id=49, attention_window=8)).eval()
    assert not model.supports_kv_cache
    out = model.generate(torch.tensor([[1, 2, 49, 3]]), 6, temperature=0)
    assert out.shape == (1, 10)


def test_settings_that_cannot_work_are_named():
    with pytest.raises(ConfigError, match="attention_window must be a positive"):
        GPTConfig(**BASE, attention_window=0)
    with pytest.raises(ConfigError, match="'flex' has no attention dropout"):
        GPTConfig(**BASE, attention="flex", dropout=0.1)
    model = GPT(GPTConfig(**BASE, document_mask=True))
    with pytest.raises(ConfigError, match="document_mask needs the end-of-text id"):
        model(torch.zeros(1, 4, dtype=torch.long))


# -- what the estimator counts ------------------------------------------------------------------
def test_a_window_is_charged_its_share_of_the_attention_flops():
    assert attended_span(1024, None) == 1024 and attended_span(1024, 4096) == 1024
    assert attended_span(1024, 1) == pytest.approx(1024 / 512.5)
    full = GPT(GPTConfig(**BASE))
    windowed = GPT(GPTConfig(**BASE, attention_window=8))
    matmul = 6 * (full.num_params(non_embedding=True) - _vector_numel(full))  # matrices only
    attention = full.flops_per_token() - matmul
    kept = sum(min(q + 1, 8) for q in range(32)) / (32 * 33 / 2)
    assert (
        windowed.flops_per_token() - matmul
        == round(attention * kept / BASE["n_layer"]) * BASE["n_layer"]
    )


def test_the_estimator_adds_the_mask_sdpa_keeps_on_a_cpu_and_not_flex_on_a_gpu():
    plain = GPTConfig(vocab_size=600, block_size=128, n_layer=3, n_head=4, n_embd=128)
    masked = GPTConfig(**{**plain.to_dict(), "document_mask": True, "eot_id": 5})
    cpu = [estimate_memory(Setup(gpt=g, precision="32-true"), 3, backend="cpu").peak_allocated
           for g in (plain, masked)]  # fmt: skip
    assert cpu[1] - cpu[0] == 3 * 3 * 128 * 128 * 4  # micro-batch x layers x T x T x fp32
    gpu = [estimate_memory(Setup(gpt=g, precision="bf16-mixed"), 3, backend="cuda").peak_allocated
           for g in (plain, masked)]  # fmt: skip
    assert gpu[1] == gpu[0]


# -- a run ----------------------------------------------------------------------------------------
def test_fit_trains_aligned_and_masked_records_the_eot_and_refuses_another_alignment(
    tmp_path, capsys, monkeypatch
):
    folder = write_documents(tmp_path / "d", random_documents(300, 9), random_documents(40, 10))
    cfg = fit_config(
        tmp_path, {"dataset_dir": str(folder), "align": "document"},
        model={"gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32,
                       "document_mask": True, "attention_window": 16}},
    )  # fmt: skip
    code, err = fit_in_process(capsys, cfg)
    assert code == 0, err[-20:]
    run = tmp_path / "runs" / "tiny"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["gpt"]["eot_id"] == EOT
    assert saved["data"]["align"] == "document"
    code, err = fit_in_process(capsys, cfg, "--trainer.max_steps", "6", "--data.align", "stream")
    assert code == 2
    assert any("data.align is stream, the checkpoint's run trained with document" in e for e in err)

    from nanolab.cli import main

    packed = _record_packings(monkeypatch)
    assert main(["validate", "--config", str(QUICKSTART), "--config", str(cfg)]) == 0
    assert packed and set(packed) == {"val.bin"}, packed  # the training split is not read
    ckpt = str(run / "checkpoints" / "last.ckpt")
    assert main(["generate", "--ckpt", ckpt, "--prompt", "the cat", "--max-new-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert (
        "note: model.gpt.document_mask and model.gpt.attention_window run without a key/value "
        "cache" in err
    )


# -- exact resume and DDP = accumulation, end to end (slow) --------------------------------------
def _aligned_config(tmp_path: Path, steps: int, name: str = "aligned.yaml") -> Path:
    folder = tmp_path / "docs"
    if not folder.exists():
        write_documents(folder, random_documents(400, 11), random_documents(40, 12))
    cfg = {
        "seed_everything": 1234,
        "run": {"root": str(tmp_path / "runs"), "global_batch_tokens": 4 * 32 * 2,
                "eval_every_steps": 4},
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true",
                    "max_steps": steps, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "checkpoint": {"every_n_steps": 1, "keep_last": 3},
        "model": {"gpt": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32,
                          "dropout": 0.0, "position_embedding": "rope",
                          "document_mask": True, "attention_window": 24},
                  "optimizer": {"lr": 3.0e-3}, "schedule": {"warmup_steps": 3}},
        "data": {"source": None, "dataset_dir": str(folder), "align": "document",
                 "micro_batch_size": 4, "val_windows": 4},
    }  # fmt: skip
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow  # 30-100 s on 2 cores
def test_kill_and_resume_an_aligned_masked_run_is_bit_identical(tmp_path):
    import signal
    import time

    from test_data_mixture import STEPS, _final, _launch

    from nanolab.runlog import read_records

    cfg = _aligned_config(tmp_path, STEPS)
    runs = tmp_path / "runs"
    reference = _launch(cfg, "reference")
    proc = _launch(cfg, "killed")
    deadline = time.monotonic() + 240
    while not list((runs / "killed" / "checkpoints").glob("step-0000000[3-9].ckpt")):
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    resumed = _launch(cfg, "killed")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()[-2000:]
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-2000:]
    a, b = _final(runs / "reference"), _final(runs / "killed")
    for key, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][key]), key
    log_a, log_b = (read_records(runs / n / "metrics.jsonl") for n in ("reference", "killed"))
    starts = [r for r in log_b if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from_step"] >= 3
    train_a = {r["step"]: r["loss"] for r in log_a if r["event"] == "train"}
    train_b = {r["step"]: r["loss"] for r in log_b if r["event"] == "train"}
    assert train_a == train_b and sorted(train_a) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_accumulation_when_aligned(tmp_path):
    from conftest import QUICKSTART, run_nanolab

    cfg = _aligned_config(tmp_path, 3)
    states = {}
    for name, extra in (
        ("single", []),
        ("ddp", ["--config", str(QUICKSTART.parent / "strategy" / "ddp.yaml"),
                 "--trainer.devices", "2"]),
    ):  # fmt: skip
        res = run_nanolab("fit", "--config", str(cfg), "--run.name", name, *extra,
                          "--run.eval_every_steps", "3", cwd=tmp_path, timeout=600)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        states[name] = torch.load(
            tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True
        )
    a, b = states["single"]["state_dict"], states["ddp"]["state_dict"]
    for key in a:
        assert torch.allclose(a[key], b[key], atol=2e-5, rtol=1e-4), key


def test_estimate_counts_a_window_and_says_a_document_mask_is_an_upper_bound(capsys):
    from conftest import QUICKSTART

    from nanolab.cli import main

    base = ["estimate", "--config", str(QUICKSTART), "--vocab-size", "65", "--device", "cpu"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert (
        main([*base, "--model.gpt.document_mask", "true", "--model.gpt.attention_window", "64"])
        == 0
    )
    masked = capsys.readouterr().out

    def flops(out: str) -> float:
        line = next(ln for ln in out.splitlines() if "FLOPs per token" in ln)
        return float(line.split()[-1])

    span = attended_span(128, 64) / 128  # the quickstart's context is 128
    attention = 12 * 4 * 32 * 128 * 4  # layers x heads x head size x T
    assert flops(plain) - flops(masked) == pytest.approx(attention * (1 - span), rel=1e-3)
    assert "attention within a window of 64 tokens" in masked
    assert "the document mask skips more (an upper bound)" in masked
