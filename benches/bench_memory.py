"""How good is ``nanolab estimate``? Predicted vs measured memory, as an error table.

On a GPU (default when CUDA/ROCm is available) it trains the shipped recipes
(``configs/gpt2-*.yaml``) for two steps on one device, eager mode, and compares the predicted
peak with ``torch.cuda.max_memory_allocated`` (target +-10%), and the predicted saved
activations with what autograd saved (``saved_tensors_hooks``)::

    python benches/bench_memory.py                      # every configs/gpt2-*.yaml
    python benches/bench_memory.py --configs configs/gpt2-124m.yaml --micro-batch 8

On CPU (``--cpu``, or no GPU) it runs a reduced mode so CI keeps it working: small models of the
recipes' shape, with the peak measured from the profiler's CPU allocation events, saved
activations with ``saved_tensors_hooks`` and model states by counting tensors. Exit code 1 when
an error exceeds the target.

The training loop mirrors Lightning's (autocast with its cache off, logits dropped before
backward, gradients set to None after the step, the optimizer built as nanolab builds it) with
gradient accumulation 2, so the gradients exist during the second forward as in a real run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nanolab.estimator.activations import saved_activations  # noqa: E402
from nanolab.estimator.memory import estimate_memory  # noqa: E402
from nanolab.estimator.numerics import numerics_for  # noqa: E402
from nanolab.estimator.setup import Setup, Strategy, load_config, setup_from_config  # noqa: E402
from nanolab.estimator.shapes import inventory  # noqa: E402
from nanolab.estimator.states import model_states  # noqa: E402

TARGET = 0.10
ACCUMULATE = 2
MiB = 2**20


@dataclass
class Row:
    config: str
    micro_batch: int
    what: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1 if self.measured else 0.0


def print_table(rows: list[Row], title: str) -> None:
    print(title)
    print(
        f"{'config':<34}{'B':>4}  {'quantity':<22}{'predicted MiB':>14}{'measured MiB':>14}"
        f"{'error':>9}"
    )
    for r in rows:
        print(
            f"{r.config:<34}{r.micro_batch:>4}  {r.what:<22}{r.predicted / MiB:>14,.2f}"
            f"{r.measured / MiB:>14,.2f}{r.error:>+9.2%}"
        )
    worst = max((abs(r.error) for r in rows), default=0.0)
    print(f"worst error {worst:.2%} (target +-{TARGET:.0%})")


def _single_device(setup: Setup, micro_batch: int) -> Setup:
    return replace(
        setup,
        devices=1,
        num_nodes=1,
        strategy=Strategy("single"),
        micro_batch_size=micro_batch,
        global_batch_tokens=micro_batch * setup.gpt.block_size * ACCUMULATE,
        compile=False,
    )


# -- GPU ----------------------------------------------------------------------------------------
def run_gpu(configs: Sequence[str], micro_batch: int | None) -> list[Row]:
    import torch

    from nanolab.estimator.measure import build_optimizer, measure_saved
    from nanolab.estimator.recommend import largest_micro_batch
    from nanolab.model.gpt import GPT

    props = torch.cuda.get_device_properties(0)
    backend = "rocm" if torch.version.hip else "cuda"
    rows: list[Row] = []
    for path in configs:
        base = setup_from_config(load_config([path]))
        fit_b = largest_micro_batch(_single_device(base, 1), props.total_memory, backend=backend)
        B = micro_batch or min(base.micro_batch_size or fit_b, fit_b)
        if B < 1:
            print(f"{path}: does not fit on {props.name} even at micro-batch 1; skipped")
            continue
        setup = _single_device(base, B)
        gpt = setup.gpt
        torch.manual_seed(0)
        model = GPT(gpt).cuda()
        if setup.precision.endswith("-true") and setup.precision != "32-true":
            model = model.to(torch.bfloat16 if setup.precision.startswith("bf16") else torch.half)
        opt = (
            build_optimizer(model, setup.optimizer)
            if setup.optimizer == "adamw8bit"
            else _fused_adamw(model)
        )
        amp = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(setup.precision)
        idx = torch.randint(0, gpt.vocab_size, (B, gpt.block_size), device="cuda")
        tgt = torch.randint(0, gpt.vocab_size, (B, gpt.block_size), device="cuda")

        def step(model=model, opt=opt, amp=amp, idx=idx, tgt=tgt) -> None:
            for _ in range(ACCUMULATE):
                with torch.autocast(
                    "cuda", dtype=amp or torch.float32, enabled=amp is not None, cache_enabled=False
                ):
                    loss = model(idx, tgt)[1]
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # optimizer states now exist
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        measured_peak = torch.cuda.max_memory_allocated()
        est = estimate_memory(setup, B, backend=backend)
        name = Path(path).stem
        rows.append(Row(name, B, "peak allocated", est.peak_allocated, measured_peak))
        saved = measure_saved(model, B, gpt.block_size, autocast_dtype=amp, device="cuda")
        rows.append(Row(name, B, "saved activations", est.saved.total, saved.bytes))
        del model, opt, idx, tgt, step
        torch.cuda.empty_cache()
    return rows


def _fused_adamw(model):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, fused=True)


# -- CPU (reduced) ------------------------------------------------------------------------------
def reduced(setup: Setup) -> Setup:
    """The recipe at a CPU size: depth / 6, heads / 2 at 16 wide, vocabulary / 50 (still
    padded), context / 16; bias, tying, attention and precision unchanged."""
    g = setup.gpt
    heads = max(1, g.n_head // 2)
    gpt = replace(
        g,
        n_layer=max(1, g.n_layer // 6),
        n_head=heads,
        n_embd=16 * heads,
        vocab_size=max(2, (g.vocab_size or 100) // 50),
        block_size=max(8, g.block_size // 16),
    )
    return replace(setup, gpt=gpt)


def cpu_cases(configs: Sequence[str], quick: bool) -> list[tuple[str, Setup, int]]:
    cases = []
    for path in configs:
        small = reduced(setup_from_config(load_config([path])))
        name = Path(path).stem
        cases.append((f"{name}-small", small, 4))
        if quick:
            continue
        cases.append((f"{name}-small fp32", replace(small, precision="32-true"), 4))
        ckpt = replace(small.gpt, gradient_checkpointing=True)
        cases.append((f"{name}-small ckpt", replace(small, gpt=ckpt), 4))
        cases.append((f"{name}-small 8bit", replace(small, optimizer="adamw8bit"), 1))
        cases.append(
            (f"{name}-small math", replace(small, gpt=replace(small.gpt, attention="math")), 2)
        )
    return cases


def run_cpu(configs: Sequence[str], quick: bool) -> list[Row]:
    import torch

    from nanolab.estimator.measure import measure_peak_cpu, measure_saved, measure_states
    from nanolab.model.gpt import GPT

    rows: list[Row] = []
    for name, small, B in cpu_cases(configs, quick):
        setup = replace(_single_device(small, B), fused=False)
        gpt = setup.gpt
        peak = measure_peak_cpu(
            gpt, B, precision=setup.precision, optimizer=setup.optimizer, accumulate=ACCUMULATE
        )
        est = estimate_memory(setup, B, backend="cpu")
        rows.append(Row(name, B, "peak allocated", est.peak_allocated, peak))
        torch.manual_seed(0)
        model = GPT(gpt)
        amp = torch.bfloat16 if setup.precision == "bf16-mixed" else None
        if setup.precision == "bf16-true":
            model = model.to(torch.bfloat16)
        saved = measure_saved(model, B, gpt.block_size, autocast_dtype=amp)
        num = numerics_for(setup, "cpu")
        rows.append(
            Row(
                name,
                B,
                "saved activations",
                saved_activations(gpt, B, gpt.block_size, num).total,
                saved.bytes,
            )
        )
        dtype = torch.bfloat16 if setup.precision == "bf16-true" else torch.float32
        real = measure_states(gpt, setup.optimizer, dtype=dtype)
        st = model_states(setup, inventory(gpt), num)
        rows.append(
            Row(
                name,
                B,
                "params+grads+optimizer",
                st.params + st.grads + st.optimizer,
                real.params + real.grads + real.optimizer,
            )
        )
    return rows


def default_configs() -> list[str]:
    found = sorted(str(p) for p in (ROOT / "configs").glob("gpt2-*.yaml"))
    return found or [str(ROOT / "tests" / "fixtures" / "estimator_gpt2_124m.yaml")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", help="recipes to measure (default configs/gpt2-*)")
    p.add_argument("--cpu", action="store_true", help="reduced CPU mode even if a GPU exists")
    p.add_argument("--quick", action="store_true", help="CPU mode: one case per recipe")
    p.add_argument(
        "--micro-batch",
        type=int,
        help="GPU mode: micro-batch (default: config's, capped at the largest predicted to fit)",
    )
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    configs = args.configs or default_configs()

    import torch

    threads = torch.get_num_threads()
    if not args.cpu and torch.cuda.is_available():
        rows = run_gpu(configs, args.micro_batch)
        title = f"GPU: {torch.cuda.get_device_name(0)}, eager mode, accumulation {ACCUMULATE}"
    else:
        torch.set_num_threads(1)  # tiny models: threads only add contention
        try:
            rows = run_cpu(configs, args.quick)
        finally:
            torch.set_num_threads(threads)
        title = "CPU reduced mode (small models of the recipes' shape)"
    print_table(rows, title)
    return 0 if all(abs(r.error) <= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
