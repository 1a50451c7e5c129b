"""Validation loss in bits per byte (``val_bpb``): metrics.jsonl, the progress bar, the report.

bpb = loss (nats/token) x tokens/bytes / ln 2 of the validation split, so it is exactly
loss / ln 2 whenever a token is a byte (bytes tokenizer, or chars on ASCII text), and the given
ratio otherwise. (A logged value goes through float32, hence ``rel=1e-6`` on the log records;
the factor itself is checked exactly.)
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
from test_data_checks import TEXT, fit_config, fit_in_process, write_dataset

from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import prepare_dataset
from nanolab.report import main as report_main
from nanolab.runlog import read_records

LN2 = math.log(2)


def val_records(tmp_path):
    return read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "val")


def scale_of(folder) -> float | None:
    dm = TokenDataModule(dataset_dir=str(folder), micro_batch_size=4, block_size=32, val_windows=4)
    dm.setup("validate")
    dm.val_dataloader()
    return dm.eval_scales[0].overall_bpb


@pytest.mark.parametrize("tokenizer", ["bytes", "chars"])
def test_one_token_per_byte_gives_loss_over_ln2(tmp_path, capsys, tokenizer):
    data = tmp_path / "data"
    write_dataset(data, tokenizer=tokenizer)  # ASCII text: a char is a byte
    assert scale_of(data) == 1 / (1.0 * LN2)
    cfg = fit_config(
        tmp_path,
        {"dataset_dir": str(data)},
        trainer={"enable_progress_bar": True},
        progress={"refresh_rate": 1},
    )
    code, err = fit_in_process(capsys, cfg)
    assert code == 0, err[-20:]
    records = val_records(tmp_path)
    assert len(records) == 2
    for r in records:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / LN2, rel=1e-6)
    # The progress display shows it beside the validation loss (plain lines off a terminal).
    assert f"bpb {records[-1]['val_bpb']:.4f}" in fit_in_process.stdout


def test_multibyte_text_gives_the_token_to_byte_ratio(tmp_path, capsys):
    data = tmp_path / "data"
    val = "Müller ärgert sich über Größe " * 30  # 5 of 30 characters take 2 bytes
    write_dataset(data, train=TEXT * 30 + val * 4, val=val, tokenizer="chars")
    ratio = len(val) / len(val.encode("utf-8"))
    assert ratio == pytest.approx(30 / 35)
    assert scale_of(data) == pytest.approx(ratio / LN2, rel=1e-15)
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 0, err[-20:]
    for r in val_records(tmp_path):
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * ratio / LN2, rel=1e-6)


def test_prepared_bpe_data_logs_bpb_with_its_own_ratio(tmp_path, capsys):
    src = tmp_path / "text.txt"
    src.write_text((TEXT + "Ünïcödé ✓ 日本\n") * 300, encoding="utf-8")
    data = tmp_path / "data"
    meta = prepare_dataset([str(src)], data, "bpe", bpe_vocab_size=300, quiet=True)
    if "val_bytes" not in meta:
        pytest.skip("this nanolab prepare does not record val_bytes")
    ratio = meta["val_tokens"] / meta["val_bytes"]
    assert ratio < 0.9  # BPE merges bytes: fewer tokens than bytes
    assert scale_of(data) == pytest.approx(ratio / LN2, rel=1e-15)
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 0, err[-20:]
    for r in val_records(tmp_path):
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * ratio / LN2, rel=1e-6)


def test_data_without_byte_counts_trains_and_says_so_once(tmp_path, capsys):
    data = tmp_path / "old"
    write_dataset(data, byte_counts=False)  # a dataset prepared before val_bytes existed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 0, err[-20:]
    # A nanolab note, as the others are: no Python warning with its source path and line.
    assert not [w for w in caught if "no val_bytes" in str(w.message)]
    notes = [line for line in err if "no val_bytes" in line]
    assert notes == [
        f"nanolab: note: {data / 'meta.json'} has no val_bytes (prepared by an older nanolab): "
        "val_bpb is not logged; prepare the data again to log bits per byte"
    ], err[-20:]
    records = val_records(tmp_path)
    assert len(records) == 2
    assert all(r["val_bpb"] is None and "val/bpb" not in r for r in records)
    assert all(r["val_loss"] > 0 for r in records)


def test_report_shows_val_bpb(tmp_path, capsys):
    data = tmp_path / "data"
    write_dataset(data)
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 0, err[-20:]
    records = val_records(tmp_path)
    best = min(records, key=lambda r: r["val_loss"])
    assert report_main([str(tmp_path / "runs"), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["best_val_bpb"] == best["val_bpb"]
    assert run["final_val_bpb"] == records[-1]["val_bpb"]
    assert report_main([str(tmp_path / "runs")]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert "val bpb" in header and f"{best['val_bpb']:.4f}" in row
