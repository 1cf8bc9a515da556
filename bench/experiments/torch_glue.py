"""Any moe-inspector command with the fused decode glue switched off: decode steps run engine.model's torch forward
(graphed as ever), the arms unchanged, so a bench row here against the same row of the plain command measures what
engine.decode_fused saves on one model (the glue the architecture would otherwise take).

    python3 bench/experiments/torch_glue.py bench --model bench/configs/gpt-oss-20b --weights random --tg 128 ...

It replaces engine.decode_fused.ineligible, the one test every caller asks (the model's forward, the runtime's
`decode_glue`, the records' `forward` field), with one that names this script, so the bench footer says which glue
ran. Not a flag: an experiment's switch, not a choice a user makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import decode_fused  # noqa: E402
from inspector.cli import main  # noqa: E402


def _off(config) -> str:
    return "glue switched off by bench/experiments/torch_glue.py"


if __name__ == "__main__":
    decode_fused.ineligible = _off
    sys.exit(main(sys.argv[1:]))
