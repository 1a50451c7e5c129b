"""Model-only microbenchmark: nanolab's ``GPT`` vs nanoGPT's own ``model.py``, same weights.

    python benches/vs_nanogpt_model.py --nanogpt ~/src/nanoGPT --shape quickstart --threads 1
    python benches/vs_nanogpt_model.py --nanogpt ~/src/nanoGPT --profile      # op table per side

``benches/vs_nanogpt.py`` times the two training programs end to end; this one isolates the
model and the optimizer step, so a gap there can be told apart from a gap in the loop around
it. nanoGPT's ``model.py`` is imported from the user's checkout (never copied). Both models are
built with the shape's settings, nanoGPT's weights are loaded into nanolab's model (the key map
below), and with nanoGPT's own choices (exact GELU, no vocabulary padding) the two must give the
same loss on the same batch before anything is timed: the comparison is between two
implementations of one function. ``--activation gelu_tanh`` / ``--vocab-multiple 128`` time
what those options cost (the function then differs, so the check is skipped).

Each step is forward + backward + global-norm clip + AdamW step + ``zero_grad(set_to_none)``,
on the same random batch for both sides; the sides alternate step by step so a busy machine
disturbs both alike. Reported per side: median wall ms and median process CPU ms per step
(CPU time counts every intra-op thread, so it is the steadier number on a shared machine
with ``--threads 1``), and the ratio nanoGPT / nanolab (above 1: nanolab is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_nanogpt import SHAPES, BenchError, Shape, check_checkout, machine

VOCAB = 65  # nanoGPT's shakespeare_char vocabulary; the bundled text gives a similar 70


def load_upstream_model(nanogpt: Path) -> ModuleType:
    """nanoGPT's ``model.py`` as a module, imported from the checkout in place."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt / "model.py")
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot import {nanogpt / 'model.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upstream_to_nanolab_key(key: str) -> str:
    """nanoGPT's state-dict key -> nanolab's (``transformer.h.3.mlp`` -> ``blocks.3.mlp``)."""
    key = key.removeprefix("transformer.")
    if key.startswith("h."):
        return "blocks." + key[2:]
    return key


def build_pair(nanogpt: Path, shape: Shape, options: dict[str, Any]) -> tuple[Any, Any]:
    """(nanoGPT model, nanolab model) with identical weights, in training mode."""
    import torch

    from nanolab.model import GPT, GPTConfig

    upstream = load_upstream_model(nanogpt)
    arch = dict(
        n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
        block_size=shape.block_size, dropout=shape.dropout, bias=False, vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = upstream.GPT(upstream.GPTConfig(**arch))
    ours = GPT(GPTConfig(**arch, **options))
    state = {upstream_to_nanolab_key(k): v for k, v in theirs.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith(".attn.bias")}  # causal mask buffer
    if ours.config.padded_vocab_size != VOCAB:  # extra head rows: zero, never a target
        for key in ("wte.weight", "lm_head.weight"):
            pad = torch.zeros(ours.config.padded_vocab_size - VOCAB, shape.n_embd)
            state[key] = torch.cat([state[key], pad])
    ours.load_state_dict(state, strict=True)
    if options.get("activation") == "gelu" and ours.config.padded_vocab_size == VOCAB:
        check_same_function(theirs, ours, shape)  # other options change the function itself
    theirs.train()
    ours.train()
    return theirs, ours


def check_same_function(theirs: Any, ours: Any, shape: Shape) -> None:
    """Both models give the same loss on one batch (dropout off), or the bench refuses."""
    import torch

    theirs.eval()
    ours.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, shape.block_size), generator=g)
    y = torch.randint(0, VOCAB, (2, shape.block_size), generator=g)
    with torch.no_grad():
        a = float(theirs(x, y)[1])
        b = float(ours(x, y)[1])
    if abs(a - b) > 1e-4 * max(1.0, abs(a)):
        raise BenchError(f"the models differ: loss {a:.6f} (nanoGPT) vs {b:.6f} (nanolab)")


def optimizers(theirs: Any, ours: Any, shape: Shape) -> tuple[Any, Any]:
    """Each side's own AdamW set-up (decay groups, fused/foreach choice) with the shape's values."""
    import torch

    from nanolab.training.optim import OptimizerConfig, build_optimizer

    betas = (0.9, shape.beta2)
    a = theirs.configure_optimizers(shape.weight_decay, shape.learning_rate, betas, "cpu")
    cfg = OptimizerConfig(lr=shape.learning_rate, weight_decay=shape.weight_decay, betas=betas)
    b = build_optimizer(ours, cfg, torch.device("cpu"))
    return a, b


def time_steps(
    pair: tuple[Any, Any], opts: tuple[Any, Any], shape: Shape, steps: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """Alternating training steps; per side the wall and process-CPU seconds of each step."""
    import torch

    out = {side: {"wall": [], "cpu": []} for side in ("nanogpt", "nanolab")}
    g = torch.Generator().manual_seed(2)
    for i in range(warmup + steps):
        x = torch.randint(0, VOCAB, (shape.batch_size, shape.block_size), generator=g)
        y = torch.randint(0, VOCAB, (shape.batch_size, shape.block_size), generator=g)
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            model, opt = pair[j], opts[j]
            w0, c0 = time.perf_counter(), time.process_time()
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), shape.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                side = out["nanogpt" if j == 0 else "nanolab"]
                side["wall"].append(w1 - w0)
                side["cpu"].append(c1 - c0)
    return out


def profile(pair: tuple[Any, Any], opts: tuple[Any, Any], shape: Shape, steps: int) -> str:
    """torch.profiler's op table (self CPU time) for a few steps of each side."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = []
    g = torch.Generator().manual_seed(3)
    for name, model, opt in zip(("nanoGPT", "nanolab"), pair, opts, strict=True):
        x = torch.randint(0, VOCAB, (shape.batch_size, shape.block_size), generator=g)
        y = torch.randint(0, VOCAB, (shape.batch_size, shape.block_size), generator=g)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), shape.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        tables.append(f"== {name}, {steps} steps ==\n{table}")
    return "\n".join(tables)


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    med = {s: {k: statistics.median(v) * 1000 for k, v in d.items()} for s, d in times.items()}
    return {
        "ms": med,
        "wall_ratio": med["nanogpt"]["wall"] / med["nanolab"]["wall"],
        "cpu_ratio": med["nanogpt"]["cpu"] / med["nanolab"]["cpu"],
        "steps": len(times["nanolab"]["wall"]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benches/vs_nanogpt_model.py", description=__doc__)
    parser.add_argument("--nanogpt", required=True, help="a nanoGPT checkout (git clone)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--activation", default="gelu", choices=("gelu", "gelu_tanh"))
    parser.add_argument("--vocab-multiple", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N steps")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        print("vs_nanogpt_model: error: --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    options = {"activation": args.activation, "vocab_multiple": args.vocab_multiple}
    try:
        nanogpt = Path(args.nanogpt).resolve()
        check_checkout(nanogpt)
        pair = build_pair(nanogpt, shape, options)
    except BenchError as err:
        print(f"vs_nanogpt_model: error: {err}", file=sys.stderr)
        return 2
    opts = optimizers(*pair, shape)
    if args.profile:
        print(profile(pair, opts, shape, args.profile))
        return 0
    load = os.getloadavg()[0]
    res = summary(time_steps(pair, opts, shape, args.steps, args.warmup))
    res.update(
        shape=shape.name, nanolab=options, threads=torch.get_num_threads(), machine=machine(),
        date=time.strftime("%Y-%m-%d %H:%M"), load=[round(load, 1), round(os.getloadavg()[0], 1)],
    )  # fmt: skip
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        ms = res["ms"]
        print(
            f"{shape.name} ({res['steps']} steps/side, threads {res['threads']}, load "
            f"{res['load'][0]} -> {res['load'][1]}, nanolab {options}): "
            f"nanoGPT {ms['nanogpt']['wall']:.1f} ms wall / {ms['nanogpt']['cpu']:.1f} ms CPU, "
            f"nanolab {ms['nanolab']['wall']:.1f} / {ms['nanolab']['cpu']:.1f}; ratio wall "
            f"{res['wall_ratio']:.3f}, CPU {res['cpu_ratio']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
