"""lm-evaluation-harness on any nanolab checkpoint: ``nanolab lm-eval`` (docs/evaluate.md).

:class:`NanolabLM` is an lm-eval ``LM`` that loads a nanolab checkpoint directly (the model and
its tokenizer, with ``weights_only=True``), so every lm-eval task runs on every architecture
nanolab trains, including the ones ``nanolab export --format hf`` refuses (RoPE, RMSNorm, SwiGLU,
QK-norm). Requests are scored with nanolab's own batched scorer
(:mod:`nanolab.downstream.scoring`): tokenized the same way as ``nanolab eval``, so the two agree
on a task they share.

``nanolab lm-eval ARGS`` is lm-eval's own command line (``lm-eval ARGS``) with the model
registered as ``nanolab``::

    nanolab lm-eval run --model nanolab --model_args checkpoint=runs/quickstart \\
        --tasks my_task --include_path tasks/ --batch_size 16

Install with ``pip install 'nanolab[eval]'``. lm-eval fetches a task's dataset from the Hugging
Face hub unless the task's YAML points at local files (``dataset_path: json`` with
``dataset_kwargs: {data_files: ...}``); nanolab itself never downloads anything.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from nanolab.downstream.scoring import Request, encode_pair, score_requests
from nanolab.errors import NanolabError, one_line_errors

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # the extra is not installed: the adapter says how to get it when used
    LM = object  # type: ignore[assignment,misc]

    def register_model(*names: str) -> Any:  # type: ignore[misc]
        return lambda cls: cls


INSTALL = "pip install 'nanolab[eval]' (lm-evaluation-harness)"


class HarnessError(NanolabError):
    """lm-evaluation-harness is missing, or a ``--model_args`` value cannot work."""


def checkpoint_path(target: str) -> Path:
    """A ``.ckpt`` file, or a run directory's newest complete checkpoint (held open, so a live
    run's rotation cannot delete it before it is loaded)."""
    from nanolab.model.checkpoint import CheckpointError
    from nanolab.training.resume import find_resume_checkpoint

    if not target:  # Path("") is the current folder
        raise CheckpointError("checkpoint= is empty; give a run directory or a .ckpt")
    path = Path(target)
    if path.is_dir():
        chosen = find_resume_checkpoint(path, hold=True).chosen
        if chosen is None:
            raise CheckpointError(f"checkpoint={target}: no complete checkpoint in this folder")
        return chosen.path
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint={target} does not exist; give a run directory or a .ckpt"
        )
    return path


def batch_rows(batch_size: int | str | None) -> int:
    """Sequences per forward pass for lm-eval's ``batch_size`` (``auto`` and unset: 8); zero,
    a negative or a non-number is refused: 0 rows scored nothing and the tasks still passed."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return 8
    try:
        rows = int(str(batch_size).strip())  # 16 or "16"; not 16.5, "x" or True
    except ValueError:
        rows = 0
    if rows < 1:
        raise HarnessError(
            f"batch_size {batch_size!r} is not a positive whole number of sequences; give e.g. "
            "batch_size=16, or auto"
        )
    return rows


@register_model("nanolab")
class NanolabLM(LM):  # type: ignore[misc,valid-type]
    """A nanolab checkpoint as an lm-eval model.

    Args:
        checkpoint: A ``.ckpt`` file or a run directory (its newest complete checkpoint).
        device: ``cpu``, ``cuda``, ``cuda:1`` (default: cuda when there is one).
        batch_size: Sequences per forward pass (lm-eval's ``--batch_size``; ``auto`` = 8).
        max_gen_toks: Tokens ``generate_until`` produces at most when the task does not say.
    """

    def __init__(
        self,
        checkpoint: str,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_gen_toks: int = 256,
        **_: Any,  # lm-eval passes max_batch_size and others every model may ignore
    ) -> None:
        if LM is object:
            raise HarnessError(f"lm-evaluation-harness is not installed; {INSTALL}")
        super().__init__()
        from nanolab.model.checkpoint import (
            load_checkpoint,
            model_from_checkpoint,
            tokenizer_from_checkpoint,
        )
        from nanolab.model.device import check_device

        path = checkpoint_path(str(checkpoint))
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's --device defaults to cuda: on a machine without one, say so and go on.
            print(
                f"nanolab lm-eval: no CUDA device here; --device {device} -> cpu", file=sys.stderr
            )
            device = "cpu"
        # ``device`` is --model_args device=... or lm-eval's own --device: checked as generate
        # and eval check theirs, before the checkpoint is read.
        self._device = check_device(
            str(device or ("cuda" if torch.cuda.is_available() else "cpu")), "device"
        )
        self.rows = batch_rows(batch_size)
        ckpt = load_checkpoint(path)
        self.model = model_from_checkpoint(ckpt, path).to(self._device)
        self.tok = tokenizer_from_checkpoint(ckpt, path)
        self.block_size = int(self.model.config.block_size)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict | None = None
    ) -> NanolabLM:
        """``--model_args k=v,...`` first, then lm-eval's own ``--device``/``--batch_size``
        where ``--model_args`` does not set them (lm-eval's default passes both, twice)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> NanolabLM:
        """The same rule for lm-eval versions (0.4.13) that parse ``--model_args`` themselves
        and pass a dict: its keys win over lm-eval's own ``--device``/``--batch_size``."""
        extra = {
            k: v
            for k, v in (additional_config or {}).items()
            if v is not None and k not in arg_dict
        }
        return cls(**arg_dict, **extra)

    # -- lm-eval's three request types -----------------------------------------------------
    def loglikelihood(
        self, requests: Sequence[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding gives the continuation)."""
        reqs = []
        for i, request in enumerate(requests):
            context, continuation = request.args
            tokens, scored = encode_pair(self.tok, context, continuation, self.block_size)
            reqs.append(Request(i, 0, tokens, scored, max(1, len(continuation))))
        return score_requests(self.model, reqs, self.rows, self.vocab_size, self._device)

    def loglikelihood_rolling(
        self, requests: Sequence[Any], disable_tqdm: bool = False
    ) -> list[float]:
        """log P(text): every token scored once, in windows of the block size, the first one
        after the end-of-text id (lm-eval's rolling windows, made disjoint)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        prefix = self.tok.eot_id if self.tok.eot_id is not None else 0
        reqs, owner = [], []
        for i, request in enumerate(requests):
            (text,) = request.args[:1]
            windows = get_rolling_token_windows(
                list(self.tok.encode(text)), prefix, self.block_size, context_len=1
            )
            for context, predicted in map(make_disjoint_window, windows):
                reqs.append(Request(i, 0, tuple(context + predicted), len(predicted), 1))
                owner.append(i)
        totals = [0.0] * len(requests)
        scores = score_requests(self.model, reqs, self.rows, self.vocab_size, self._device)
        for i, (ll, _) in zip(owner, scores, strict=True):
            totals[i] += ll
        return totals

    @torch.no_grad()
    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context up to the first stop string (greedy unless the task
        asks for a temperature), at most ``max_gen_toks`` tokens, ending at end-of-text."""
        out = []
        self.model.eval()
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            steps = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(
                kwargs.get("temperature", 0.0) if kwargs.get("do_sample", False) else 0.0
            )
            head = [self.tok.eot_id] if self.tok.eot_id is not None else []
            ids = (head + list(self.tok.encode(context)))[-self.block_size :]
            idx = torch.tensor([ids], dtype=torch.long, device=self._device)
            new = self.model.generate(idx, steps, temperature=temperature)[0, len(ids) :].tolist()
            if self.tok.eot_id is not None and self.tok.eot_id in new:
                new = new[: new.index(self.tok.eot_id)]
            text = self.tok.decode(new)
            cut = min((text.find(s) for s in until if s and s in text), default=len(text))
            out.append(text[:cut])
        return out

    # -- what lm-eval asks of every model --------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"nanolab-{self.tok.name}"


#: Printed above lm-eval's own top-level help, which knows nothing of nanolab's model.
HELP_PREFACE = (
    "nanolab lm-eval: lm-evaluation-harness's own command line (its help follows), with one "
    "model added:\n"
    "  nanolab lm-eval run --model nanolab --model_args checkpoint=RUN_DIR_OR_CKPT "
    "--tasks TASKS [--include_path DIR]\n"
    "  --model_args also takes device=, batch_size= and max_gen_toks= (docs/evaluate.md)\n"
)


@one_line_errors("nanolab lm-eval")
def main(argv: Sequence[str] | None = None) -> int:
    """``nanolab lm-eval ARGS``: lm-eval's command line with ``--model nanolab`` available."""
    if LM is object:
        raise HarnessError(f"lm-evaluation-harness is not installed; {INSTALL}")
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"], []):  # lm-eval's own help follows: say what nanolab adds
        print(HELP_PREFACE, flush=True)
    with mock.patch.object(sys, "argv", ["lm-eval", *args]):
        try:
            cli_evaluate()
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
        except Exception as err:  # lm-eval's own refusals, at nanolab's boundary: one line
            one_line = task_error(err, args)
            if one_line is None:
                raise
            raise one_line from None
    return 0


#: Exceptions (by class name, anywhere in the chain) that mean "the hub could not be reached".
OFFLINE_ERRORS = frozenset(
    {"ConnectionError", "LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectTimeout"}
)


def task_error(err: BaseException, args: list[str]) -> HarnessError | None:
    """lm-eval's "Tasks not found" and a task whose dataset cannot be fetched (no network) as
    one line naming the task and the cause; None for anything else (it keeps its traceback)."""
    tasks = _option(args, "--tasks") or "?"
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, ValueError) and text.startswith("Tasks not found"):
        missing = text.split(":", 1)[1].strip() if ":" in text else tasks
        return HarnessError(
            f"--tasks {missing}: no such lm-eval task; `nanolab lm-eval ls tasks` lists them, "
            "and --include_path adds a folder of your own task YAMLs"
        )
    chain: BaseException | None = err
    while chain is not None:
        if type(chain).__name__ in OFFLINE_ERRORS:
            return HarnessError(
                f"--tasks {tasks}: the task's dataset could not be fetched ({text}); lm-eval "
                "downloads it from the Hugging Face hub: run where the hub is reachable, use a "
                "warm cache with HF_DATASETS_OFFLINE=1, or point the task's YAML at local files "
                "(docs/evaluate.md)"
            )
        chain = chain.__cause__ or chain.__context__
    return None


def _option(args: list[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``--tasks a,b`` or ``--tasks=a,b``)."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
