"""nanolab vs a plain PyTorch loop (same model, data, batch, optimizer, precision, schedule).

    python benches/speed.py --config configs/quickstart.yaml --steps 150 --rounds 3

Same as ``nanolab bench``; the plain loop is ``nanolab/bench/plain_loop.py``.
"""

import sys

from nanolab.bench import main

if __name__ == "__main__":
    sys.exit(main())
